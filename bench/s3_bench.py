"""S3 checkpoint bench: DCP save/load MB/s and the async save stall, an S3-compatible server vs local disk, one run.

    python bench/s3_bench.py [--out FILE.txt] [--states debug,1b] [--reps 2]

Two states: the debug model's training state (torchtitan's Llama 3 `debugmodel`: parameters plus AdamW's two
moments, fp32) and a ~1B-parameter state (15 x 8192 x 8192 bf16 tensors = 1.007 B parameters, 2.0 GB: a 1B model's
bf16 weights; its full fp32 training state would be 12 GB, more than this shared machine can hold twice). Each is
saved with torch.distributed.checkpoint through the trainer's own storage layer (kubetitan_trainer.storage: the
S3 writer/reader on s3torchconnector's CRT client, 4 writer threads) to moto's S3 server (its own venv, started
here on 127.0.0.1), and with DCP's FileSystemWriter (4 threads) to a local directory.

- save/load MB/s: state bytes / wall seconds of a synchronous ``dcp.save`` / ``dcp.load`` (best of ``--reps``).
- async save stall: a loop of fixed CPU "steps" (a matmul) with ``dcp.async_save`` every interval (by default as
  many steps as 1.5 x that target's synchronous save takes, so the write can fit); the stall is the time the loop
  spent blocked in ``async_save`` (staging the copy) plus waiting for the previous write before the next, as a %
  of the interval's wall time (the rest of the write overlaps the steps, competing with them for the CPU).
- requests per save: the S3 server's own request log, counted by kind, for the request-cost figures in
  docs/storage.md.

Caveats printed with the numbers: moto is a Python server on the same 2-core machine (not S3: S3 scales out per
prefix and per connection; moto serialises), the local disk is this VM's disk with a page cache, and the machine
is shared (its load average is printed).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "trainer"), str(REPO / "operator" / "core"), str(REPO / "operator"), str(REPO / "tests")]

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from kubetitan_trainer import storage  # noqa: E402

THREADS = 4


def debug_state() -> dict[str, torch.Tensor]:
    from torchtitan.models.llama3 import llama3_args
    from torchtitan.models.llama3.model.model import Transformer

    args = llama3_args["debugmodel"]
    with torch.device("cpu"), torch.no_grad():
        model = Transformer(args)
        model.init_weights()
    sd = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for k, v in list(sd.items()):
        sd[k.replace("model.", "optim.exp_avg.", 1)] = torch.randn_like(v)
        sd[k.replace("model.", "optim.exp_avg_sq.", 1)] = torch.rand_like(v)
    return sd


def one_b_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(8192, 8192, generator=g, dtype=torch.float32).to(torch.bfloat16)
            for i in range(15)}


def nbytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def params(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() for k, t in sd.items() if not k.startswith("optim."))


class Target:
    def __init__(self, name: str, root: str, store: storage.CheckpointStore | None) -> None:
        self.name, self.root, self.store = name, root, store

    def cid(self, tag: str) -> str:
        return f"{self.root.rstrip('/')}/{tag}"

    def writer(self, cid: str):
        return self.store.writer(cid) if self.store else dcp.FileSystemWriter(cid, thread_count=THREADS)

    def reader(self, cid: str):
        return self.store.reader(cid) if self.store else dcp.FileSystemReader(cid)


def timed_save(t: Target, sd, tag: str) -> float:
    cid = t.cid(tag)
    begin = time.perf_counter()
    dcp.save(sd, storage_writer=t.writer(cid), checkpoint_id=cid, no_dist=True)
    return time.perf_counter() - begin


def timed_load(t: Target, sd, tag: str) -> float:
    cid = t.cid(tag)
    into = {k: torch.empty_like(v) for k, v in sd.items()}
    begin = time.perf_counter()
    dcp.load(into, storage_reader=t.reader(cid), checkpoint_id=cid, no_dist=True)
    elapsed = time.perf_counter() - begin
    k = next(iter(sd))
    assert torch.equal(into[k], sd[k]), f"{t.name}: the loaded state differs"
    return elapsed


def step_seconds(step_size: int, n: int = 10) -> float:
    a = torch.randn(step_size, step_size)
    for _ in range(3):
        (a @ a).sum().item()
    begin = time.perf_counter()
    for _ in range(n):
        (a @ a).sum().item()
    return (time.perf_counter() - begin) / n


def stall(t: Target, sd, tag: str, interval: int, intervals: int, step_size: int) -> tuple[float, float, float, float]:
    """(blocked seconds per interval, of which in the async_save call (staging), interval wall seconds, step
    seconds) of a loop of CPU steps with an async save every ``interval`` steps."""
    a = torch.randn(step_size, step_size)

    def step() -> None:
        (a @ a).sum().item()

    step_s = step_seconds(step_size)
    blocked, staging, pending = 0.0, 0.0, None
    begin = time.perf_counter()
    for i in range(intervals):
        b = time.perf_counter()
        if pending is not None:
            pending.result()  # torchtitan waits for the previous save before the next (CheckpointManager._async_wait)
        cid = t.cid(f"{tag}-async-{i}")
        s = time.perf_counter()
        pending = dcp.async_save(sd, storage_writer=t.writer(cid), checkpoint_id=cid, no_dist=True)
        staging += time.perf_counter() - s
        blocked += time.perf_counter() - b
        for _ in range(interval):
            step()
    b = time.perf_counter()
    pending.result()
    blocked += time.perf_counter() - b
    wall = time.perf_counter() - begin
    return blocked / intervals, staging / intervals, wall / intervals, step_s


REQ = re.compile(r'"(GET|PUT|POST|HEAD|DELETE) (\S+) HTTP')
STATUS = re.compile(r'"(GET|PUT|POST|HEAD|DELETE) (\S+) HTTP/[\d.]+"? (\d{3})')


def attempt(what: str, fn, say):
    """``fn()``, or None after one line saying why it failed: a failure is a result too, the bench goes on. DCP's
    ``CheckpointException`` is a ``BaseException`` (an ``except Exception`` let it end the bench with a traceback
    of every rank's error); its storage error is said in one line (``storage.storage_failure``)."""
    try:
        return fn()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - see the docstring
        said = storage.storage_failure(e) or f"{type(e).__name__}: {' '.join(str(e).split())[-300:]}"
        say(f"{what} FAILED: {said}")
        return None


def server_errors(log_path: Path, mark: int) -> str:
    """The S3 server's answers that were not 2xx since line ``mark`` of its log, counted by method and status."""
    bad: collections.Counter = collections.Counter()
    for line in log_path.read_text(errors="replace").splitlines()[mark:]:
        m = STATUS.search(re.sub(r"\x1b\[[0-9;]*m", "", line))
        if m and not m.group(3).startswith("2"):
            bad[f"{m.group(1)} {m.group(3)}"] += 1
    return "           server answers that were not 2xx: " + (", ".join(f"{k} x{v}" for k, v in bad.items()) or "none")


def request_kinds(lines: list[str]) -> collections.Counter:
    c: collections.Counter = collections.Counter()
    for line in lines:
        m = REQ.search(line)
        if not m:
            continue
        method, path = m.groups()
        if method == "PUT" and "partNumber=" in path:
            kind = "UploadPart"
        elif method == "POST" and "uploads" in path and "uploadId" not in path:
            kind = "CreateMultipartUpload"
        elif method == "POST" and "uploadId=" in path:
            kind = "CompleteMultipartUpload"
        elif method == "PUT":
            kind = "PutObject/CopyObject"
        elif method == "GET" and "list-type" in path or method == "GET" and path.count("/") <= 2 and "?" in path:
            kind = "List"
        else:
            kind = {"GET": "GetObject", "HEAD": "HeadObject", "DELETE": "DeleteObject"}.get(method, method)
        c[kind] += 1
    return c


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--states", default="debug,1b")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--interval", type=int, default=0,
                   help="steps per checkpoint interval in the stall loop (0: 1.5 x the target's synchronous save)")
    p.add_argument("--intervals", type=int, default=3)
    p.add_argument("--step-size", type=int, default=768, help="matmul size of one CPU 'step' in the stall loop")
    p.add_argument("--out", help="also write the report here")
    a = p.parse_args()

    from kmockx.harness import free_port

    lines_out: list[str] = []

    def say(s: str = "") -> None:
        print(s, flush=True)
        lines_out.append(s)

    moto = shutil.which("moto_server") or str(REPO / ".tools" / "bin" / "moto_server")
    port = free_port()
    work = Path(tempfile.mkdtemp(prefix="s3bench-"))
    log_path = work / "moto.log"
    log = open(log_path, "wb")
    server = subprocess.Popen([moto, "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("moto_server did not start (run `make setup`)")
                time.sleep(0.05)
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        urllib.request.urlopen(urllib.request.Request(f"{endpoint}/{bucket}", method="PUT"), timeout=30)
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
        s3 = storage.S3Store(storage.S3Settings(uri=f"s3://{bucket}/bench", endpoint=endpoint, force_path_style=True,
                                                thread_count=THREADS))
        targets = [Target("local-disk", str(work / "local"), None), Target("s3-moto", s3.root, s3)]

        say(f"# s3_bench {time.strftime('%Y-%m-%d %H:%M:%S %Z')}: torch {torch.__version__}, "
            f"{os.cpu_count()} CPUs, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at start")
        say(f"# S3 server: moto 5.2.5 server mode on 127.0.0.1 (this machine); writer threads {THREADS}, part size "
            f"{s3.settings.part_size_bytes >> 20} MiB; local disk: {work}")
        say("# caveat: a local moto server is not S3 (single Python process on the same cores; S3 scales per prefix "
            "and connection), and the local disk has a page cache: compare orders of magnitude, not absolutes")
        builders = {"debug": debug_state, "1b": one_b_state}
        for name in a.states.split(","):
            sd = builders[name]()
            size = nbytes(sd)
            say(f"\n## state {name}: {params(sd) / 1e6:.1f} M parameters, {len(sd)} tensors, {size / 2**20:.1f} MiB")
            for t in targets:
                saves, loads = [], []
                for r in range(a.reps):
                    mark = len(log_path.read_text().splitlines()) if t.store else 0
                    took = attempt(f"{t.name:10s} save", lambda: timed_save(t, sd, f"{name}-{r}"), say)
                    if took is None:
                        if t.store:
                            say(server_errors(log_path, mark))
                        continue
                    saves.append(took)
                    if t.store and r == 0:
                        kinds = request_kinds(log_path.read_text().splitlines()[mark:])
                        objs = len(s3.list_keys(f"{name}-0"))
                        say(f"{t.name:10s} requests of one save: {sum(kinds.values())} "
                            f"({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))}); objects {objs}")
                    took = attempt(f"{t.name:10s} load", lambda: timed_load(t, sd, f"{name}-{r}"), say)
                    if took is not None:
                        loads.append(took)

                def rate(xs: list[float]) -> str:
                    if not xs:
                        return "     n/a"
                    return (f"{size / 2**20 / min(xs):8.1f} MiB/s ({min(xs):.2f} s, runs "
                            f"{' '.join(f'{x:.2f}' for x in xs)})")

                say(f"{t.name:10s} save {rate(saves)}   load {rate(loads)}")
                # an interval the write fits in: 1.5 x this target's synchronous save, in CPU steps
                sync = min(saves) if saves else 10.0
                steps = a.interval or max(5, int(1.5 * sync / step_seconds(a.step_size)) + 1)
                got = attempt(f"{t.name:10s} async save stall",
                              lambda: stall(t, sd, name, steps, a.intervals, a.step_size), say)
                if got is not None:
                    blocked, staging, wall, step_s = got
                    say(f"{t.name:10s} async save stall {blocked:.2f} s per checkpoint interval of {steps} steps "
                        f"({wall:.2f} s wall, {step_s * 1000:.0f} ms/step alone): {100 * blocked / wall:.1f}% of the "
                        f"interval (staging in async_save {staging:.2f} s, the rest waiting for the previous write)")
            for key, _size in s3.list_keys():  # the server spools objects to its disk: free it per state
                s3._client.delete_object(bucket, s3._key(key))
            shutil.rmtree(work / "local", ignore_errors=True)
            del sd
        say(f"\n# load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        server.kill()
        server.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text("\n".join(lines_out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
