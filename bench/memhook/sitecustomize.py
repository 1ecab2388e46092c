"""Where the operator's memory goes: a measurement hook loaded into the operator process (not product code).

Put this directory first on the operator's ``PYTHONPATH`` (Python imports ``sitecustomize`` at start-up) and set
``KUBETITAN_MEMHOOK_DIR``; nothing happens without it. Then, in the operator process:

- ``SIGUSR2`` starts ``tracemalloc`` with ``KUBETITAN_MEMHOOK_FRAMES`` frames (default 6; started late, so the
  imports are not traced and start-up stays fast);
- ``SIGUSR1`` writes ``DIR/dump<n>_<pid>.txt``: the threads, ``gc.get_objects()`` counts by type, the live
  Kubernetes object bodies by kind (count, deep size, of which ``metadata.managedFields``, and what refers to a few
  of them), the traced memory by file, by line and by traceback (when tracing), ``/proc/self/status``'s Vm lines,
  glibc's heap (``mallinfo2``; ``KUBETITAN_MEMHOOK_TRIM`` set: ``malloc_trim(0)`` and the RSS it gives back) and
  pymalloc's arena statistics (``sys._debugmallocstats``: live blocks vs free ones, i.e. live objects vs fragmentation; Python prints
  them only while tracemalloc is off, so take that dump without ``SIGUSR2``).

``bench/memhook/where.py`` runs the bench's ``many`` scenario and sends the signals at its steps; by hand, with
the operator bench (its ``--operator-src`` is the operator's ``PYTHONPATH``)::

    KUBETITAN_MEMHOOK_DIR=/tmp/mem python bench/operator_bench.py --only many --runs 500 \
        --operator-src bench/memhook:operator:operator/core
    kill -USR2 <operator pid>   # before applying; then, once the runs are Starting:
    kill -USR1 <operator pid>

bench/results/RECORDS.md ("2,000 runs under 300 MiB — where the operator's memory goes") says what it showed.
"""

import os

_DIR = os.environ.get("KUBETITAN_MEMHOOK_DIR")

if _DIR:
    import collections
    import ctypes
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

    def _deep(o: object, seen: set[int]) -> int:
        """Bytes of ``o`` and everything under it (JSON-shaped: dicts, lists, scalars), each object counted once."""
        if id(o) in seen:
            return 0
        seen.add(id(o))
        n = sys.getsizeof(o)
        if isinstance(o, dict):
            n += sum(_deep(k, seen) + _deep(v, seen) for k, v in o.items())
        elif isinstance(o, (list, tuple)):
            n += sum(_deep(v, seen) for v in o)
        return n

    def _holders(o: object, ignore: set[int]) -> str:
        """What refers to ``o`` (two levels up; the dump's own frames left out). Plain loops: a generator or a
        closure here would itself refer to ``o``."""
        out = []
        for r in gc.get_referrers(o):
            if id(r) in ignore or type(r).__name__ == "frame":
                continue
            up = set()
            for rr in gc.get_referrers(r):
                if id(rr) not in ignore and type(rr).__name__ != "frame":
                    up.add(type(rr).__qualname__)
            key = ""
            if isinstance(r, dict):
                for k, v in r.items():
                    if v is o:
                        key = f"[{k!r}]"
            out.append(f"{type(r).__qualname__}{key} <- {', '.join(sorted(up))[:200]}")
        return "; ".join(out)

    def _bodies(f, objs: list[object]) -> None:
        """Live Kubernetes objects (dicts with apiVersion, kind and metadata) by kind: count, deep size, and how
        much of it is ``metadata.managedFields``; one set of ``seen`` ids, so a sub-object shared by bodies counts once."""
        kinds: dict[str, list] = {}
        seen: set[int] = set()
        for o in objs:
            if type(o) is dict and "metadata" in o and "kind" in o and "apiVersion" in o \
                    and isinstance(o["metadata"], dict):
                row = kinds.setdefault(str(o["kind"]), [0, 0, 0, []])
                mf = o["metadata"].get("managedFields")
                row[1] += _deep(o, seen)
                row[2] += _deep(mf, set()) if mf is not None else 0  # part of the body's size
                row[0] += 1
                if len(row[3]) < 3:
                    row[3].append(o)
        total = sum(r[1] for r in kinds.values())
        f.write(f"live object bodies: {total / 2**20:.1f} MiB (deep size), of which metadata.managedFields "
                f"{sum(r[2] for r in kinds.values()) / 2**20:.1f} MiB\n")
        ignore = {id(objs), id(kinds), *(id(r[3]) for r in kinds.values())}
        for kind, (count, size, mf, samples) in sorted(kinds.items(), key=lambda kv: -kv[1][1]):
            f.write(f"  {kind:24s} {count:7d} bodies {size / 2**20:8.2f} MiB ({size / max(count, 1) / 1024:.1f} KiB "
                    f"each), managedFields {mf / 2**20:8.2f} MiB ({mf / max(count, 1) / 1024:.1f} KiB each)\n")
            for s in samples:
                f.write(f"      held by: {_holders(s, ignore)}\n")

    class _Mallinfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]

    def _malloc(f) -> None:
        """glibc's heap (``mallinfo2``): what C-level ``malloc`` holds besides pymalloc's arenas (Python objects
        over 512 bytes, C libraries: OpenSSL, pydantic-core), in use vs free inside the heap; with
        ``KUBETITAN_MEMHOOK_TRIM`` set, ``malloc_trim(0)`` then, and VmRSS before and after it."""
        libc = ctypes.CDLL(None)
        if not hasattr(libc, "mallinfo2"):
            return
        libc.mallinfo2.restype = _Mallinfo2
        m = libc.mallinfo2()
        f.write(f"glibc malloc: heap {m.arena / 2**20:.1f} MiB, in use {m.uordblks / 2**20:.1f} MiB, free in the heap "
                f"{m.fordblks / 2**20:.1f} MiB, mmapped {m.hblkhd / 2**20:.1f} MiB in {m.hblks} chunks\n")
        if os.environ.get("KUBETITAN_MEMHOOK_TRIM"):
            before = _rss()
            libc.malloc_trim(0)
            f.write(f"malloc_trim(0): VmRSS {before:.1f} -> {_rss():.1f} MiB\n")

    def _rss() -> float:
        with open("/proc/self/status") as st:
            return next(int(line.split()[1]) for line in st if line.startswith("VmRSS")) / 1024

    def _dump(*_: object) -> None:
        _count[0] += 1
        path = os.path.join(_DIR, f"dump{_count[0]}_{os.getpid()}.txt")
        with open(path + ".tmp", "w") as f:
            f.write(f"threads {threading.active_count()}: {[t.name for t in threading.enumerate()]}\n")
            objs = gc.get_objects()
            counts = collections.Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in objs)
            f.write(f"gc objects {sum(counts.values())}\n")
            f.writelines(f"  {v:8d} {k}\n" for k, v in counts.most_common(60))
            _bodies(f, objs)
            del objs
            if tracemalloc.is_tracing():
                _traced(f)
            with open("/proc/self/status") as st:
                f.write("".join(line for line in st if line.startswith(("Vm", "Threads"))))
            _malloc(f)
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
