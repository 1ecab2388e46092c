"""Where the operator's memory goes: a measurement hook loaded into the operator process (not product code).

Put this directory first on the operator's ``PYTHONPATH`` (Python imports ``sitecustomize`` at start-up) and set
``KUBETITAN_MEMHOOK_DIR``; nothing happens without it. Then, in the operator process:

- ``SIGUSR2`` starts ``tracemalloc`` with ``KUBETITAN_MEMHOOK_FRAMES`` frames (default 6; started late, so the
  imports are not traced and start-up stays fast);
- ``SIGUSR1`` writes ``DIR/dump<n>_<pid>.txt``: the threads, ``gc.get_objects()`` counts by type, the traced
  memory by file, by line and by traceback (when tracing), ``/proc/self/status``'s Vm lines and pymalloc's arena
  statistics (``sys._debugmallocstats``: live blocks vs free ones, i.e. live objects vs fragmentation; Python prints
  them only while tracemalloc is off, so take that dump without ``SIGUSR2``).

With the operator bench (its ``--operator-src`` is the operator's ``PYTHONPATH``)::

    KUBETITAN_MEMHOOK_DIR=/tmp/mem python bench/operator_bench.py --only many --runs 500 \
        --operator-src bench/memhook:operator:operator/core
    kill -USR2 <operator pid>   # before applying; then, once the runs are Starting:
    kill -USR1 <operator pid>

docs/benchmarks.md ("Issue 24 item 5, session 16") says what it showed.
"""

import os

_DIR = os.environ.get("KUBETITAN_MEMHOOK_DIR")

if _DIR:
    import collections
    import gc
    import signal
    import sys
    import threading
    import tracemalloc

    _FRAMES = int(os.environ.get("KUBETITAN_MEMHOOK_FRAMES", "6"))
    _count = [0]

    def _traced(f) -> None:
        snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
        f.write(f"tracemalloc: {tracemalloc.get_traced_memory()[0] / 2**20:.1f} MiB traced, "
                f"peak {tracemalloc.get_traced_memory()[1] / 2**20:.1f} MiB\n")
        for key, top in (("filename", 40), ("lineno", 60), ("traceback", 40)):
            f.write(f"by {key}:\n")
            for s in snap.statistics(key)[:top]:
                where = "" if key == "traceback" else f" {s.traceback[0].filename}:{s.traceback[0].lineno}"
                f.write(f"  {s.size / 2**20:8.2f} MiB {s.count:8d}{where}\n")
                if key == "traceback":
                    f.writelines(f"      {line}\n" for line in s.traceback.format(limit=_FRAMES))

    def _dump(*_: object) -> None:
        _count[0] += 1
        path = os.path.join(_DIR, f"dump{_count[0]}_{os.getpid()}.txt")
        with open(path + ".tmp", "w") as f:
            f.write(f"threads {threading.active_count()}: {[t.name for t in threading.enumerate()]}\n")
            counts = collections.Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.get_objects())
            f.write(f"gc objects {sum(counts.values())}\n")
            f.writelines(f"  {v:8d} {k}\n" for k, v in counts.most_common(60))
            if tracemalloc.is_tracing():
                _traced(f)
            with open("/proc/self/status") as st:
                f.write("".join(line for line in st if line.startswith(("Vm", "Threads"))))
            f.flush()
            saved = os.dup(2)  # _debugmallocstats writes to the C stderr
            os.dup2(f.fileno(), 2)
            try:
                sys._debugmallocstats()
            finally:
                os.dup2(saved, 2)
                os.close(saved)
        os.replace(path + ".tmp", path)  # complete files only

    signal.signal(signal.SIGUSR1, _dump)
    signal.signal(signal.SIGUSR2, lambda *_: tracemalloc.start(_FRAMES))
