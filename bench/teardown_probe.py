"""Where a killed worker's seconds go before the next one can start, measured apart.

The H200 recovery bench (bench/device/recovery.sh) measured 6.4 s from SIGKILL to the launcher seeing a worker dead when that worker had saved (its ~40 GiB
of pinned DCP staging memory and its CUDA context), 0.4 s when it had not. This probe separates the parts, one child
process per variant (spawned, never forked from a CUDA parent):

  ctx          a CUDA context only
  gpu          + GPU memory (--gpu-gib, like the training state and activations)
  pinned       + --host-gib of pinned host memory from the CUDA caching host allocator (cudaHostAlloc)
  dcp_today    + --host-gib as DCP's pinned, shared staging allocates it (torch 2.11 StateDictStager: a shared-memory
               storage per tensor, each cudaHostRegister-ed; here 1 GiB storages)
  shm_reg      + --host-gib of a /dev/shm file mapped and cudaHostRegister-ed in place (memory a worker's death does
               not free: the file outlives the process; only the registration ends with it)
  shm_map      + the same file mapped with every page mapped for writing, not registered (a staging arena written
               through small pinned bounce buffers: what its death costs without the registration)

For each: SIGKILL -> a robust mutex held by the child is handed to the parent as EOWNERDEAD (the kernel releases
robust futexes at the start of the exit, before the address space and file descriptors are torn down) ->
waitpid returns (what torchrun's agent polls) -> the GPU's free memory is back (the next worker can allocate).
Then the load side: --host-gib from the registered mapping to the GPU on 1 and 4 streams, registration itself, and
a pipelined register-then-copy of 1 GiB chunks, against a copy from the same mapping unregistered (today's tier).
First, the reads a new worker could make of a tier it has never mapped: ``pread`` on 1-16 threads into pinned bounce
buffers (no page tables at all) and a fresh mapping copied through pinned buffers (today's tier load).

    python bench/teardown_probe.py --host-gib 40 --gpu-gib 100 --out /tmp/probe     # on the H200
    python bench/teardown_probe.py --cpu --host-gib 1 --out /tmp/probe              # the mechanism only, no CUDA
    python bench/teardown_probe.py --host-gib 40 --fallocate --load-variants pread_1,pread_4,pread_8,pread_16,fresh

Prints one JSON line per measurement and a table at the end; writes results.jsonl into --out.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import mmap
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

GIB = 1 << 30
EOWNERDEAD = 130
MADV_POPULATE_WRITE = 23  # linux/mman.h (5.14+); Python's mmap module may not name it
MUTEX_BYTES = 64  # sizeof(pthread_mutex_t) is 40 on x86_64 glibc; padded
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def _robust_mutex(path: Path, init: bool) -> tuple[mmap.mmap, ctypes.c_void_p]:
    """A process-shared robust pthread mutex in a small shared file."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, MUTEX_BYTES)
    m = mmap.mmap(fd, MUTEX_BYTES)
    os.close(fd)
    addr = ctypes.c_void_p(ctypes.addressof(ctypes.c_char.from_buffer(m)))
    if init:
        attr = ctypes.create_string_buffer(16)
        assert _libc.pthread_mutexattr_init(attr) == 0
        assert _libc.pthread_mutexattr_setpshared(attr, 1) == 0   # PTHREAD_PROCESS_SHARED
        assert _libc.pthread_mutexattr_setrobust(attr, 1) == 0    # PTHREAD_MUTEX_ROBUST
        assert _libc.pthread_mutex_init(addr, attr) == 0
    return m, addr


def child(args: argparse.Namespace) -> None:
    """The worker stand-in: take the mutex, allocate, say ready, wait to be killed."""
    m, mutex = _robust_mutex(Path(args.mutex), init=False)
    assert _libc.pthread_mutex_lock(mutex) == 0
    info: dict = {}
    held = []
    if not args.cpu:
        import torch
        t0 = time.perf_counter()
        torch.cuda.init()
        torch.empty(1, device="cuda")
        info["ctx_s"] = time.perf_counter() - t0
        if args.variant != "ctx":
            t0 = time.perf_counter()
            held.append(torch.empty(int(args.gpu_gib * GIB), dtype=torch.uint8, device="cuda"))
            torch.cuda.synchronize()
            info["gpu_alloc_s"] = time.perf_counter() - t0
    if args.variant == "pinned":
        t0 = time.perf_counter()
        if args.cpu:
            buf = mmap.mmap(-1, int(args.host_gib * GIB))
            buf.write(b"\1" * len(buf)) if args.host_gib <= 1 else None
            held.append(buf)
        else:
            import torch
            held.append(torch.empty(int(args.host_gib * GIB), dtype=torch.uint8, pin_memory=True))
        info["pin_s"] = time.perf_counter() - t0
    elif args.variant == "dcp_today":  # DCP's staging as torch 2.11 does it: shared storages, each registered
        t0 = time.perf_counter()
        if args.cpu:
            held += [mmap.mmap(-1, GIB // 4) for _ in range(max(1, int(args.host_gib * 4)))]
        else:
            import torch
            import torch.cuda._pin_memory_utils as pin_memory_utils
            for _ in range(max(1, int(args.host_gib))):  # 1 GiB storages (DCP: one per state tensor)
                st = torch.UntypedStorage._new_shared(GIB, device="cpu")
                st.fill_(1)
                pin_memory_utils.pin_memory(st.data_ptr(), st.nbytes())
                held.append(st)
        info["pin_s"] = time.perf_counter() - t0
    elif args.variant in ("shm_reg", "shm_map"):
        t0 = time.perf_counter()
        fd = os.open(args.shm, os.O_RDWR)
        size = os.fstat(fd).st_size
        mapping = mmap.mmap(fd, size)
        os.close(fd)
        held.append(mapping)
        if args.variant == "shm_map":  # every page mapped for writing, as staging through bounce buffers would
            mapping.madvise(MADV_POPULATE_WRITE)
        info["map_s"] = time.perf_counter() - t0
        if not args.cpu and args.variant == "shm_reg":
            import torch
            ptr = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
            t0 = time.perf_counter()
            rc = torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
            info["register_s"], info["register_rc"] = time.perf_counter() - t0, int(rc)
    print(json.dumps({"ready": True, **info}), flush=True)
    signal.pause()


def _gpu_free() -> int:
    import torch
    return int(torch.cuda.mem_get_info()[0])


def kill_once(args: argparse.Namespace, variant: str, work: Path) -> dict:
    """Start one child, kill it when ready, time the three events."""
    mpath = work / f"mutex-{variant}"
    mpath.unlink(missing_ok=True)
    _m, mutex = _robust_mutex(mpath, init=True)
    cmd = [sys.executable, __file__, "--child", "--variant", variant, "--mutex", str(mpath), "--shm", str(args.shm),
           "--host-gib", str(args.host_gib), "--gpu-gib", str(args.gpu_gib)] + (["--cpu"] if args.cpu else [])
    base_free = None if args.cpu else _gpu_free()
    t_start = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    ready = json.loads(p.stdout.readline())
    setup_s = time.perf_counter() - t_start
    got: dict[str, float] = {}

    def wait_mutex() -> None:
        rc = _libc.pthread_mutex_lock(mutex)  # blocks (the GIL released) until the child dies
        got["futex"] = time.perf_counter()
        got["futex_rc"] = rc
        if rc == EOWNERDEAD:
            _libc.pthread_mutex_consistent(mutex)
        _libc.pthread_mutex_unlock(mutex)

    th = threading.Thread(target=wait_mutex, daemon=True)
    th.start()
    time.sleep(0.5)  # the waiter is blocked in the lock before the kill (a probe, not a test)
    t_kill = time.perf_counter()
    os.kill(p.pid, signal.SIGKILL)
    gpu_back = None
    if not args.cpu:
        while True:  # free memory back within 2 GiB of before the child started
            if _gpu_free() >= base_free - 2 * GIB:
                gpu_back = time.perf_counter() - t_kill
                break
            time.sleep(0.005)
            if time.perf_counter() - t_kill > 60:
                break
    p.wait()
    t_reap = time.perf_counter()
    th.join(60)
    r = {"what": "kill", "variant": variant, "setup_s": round(setup_s, 3), **{k: round(v, 3) if isinstance(v, float)
         else v for k, v in ready.items() if k != "ready"},
         "kill_to_futex_s": round(got["futex"] - t_kill, 4) if "futex" in got else None,
         "futex_rc": got.get("futex_rc"), "kill_to_reap_s": round(t_reap - t_kill, 4),
         "kill_to_gpu_free_s": None if gpu_back is None else round(gpu_back, 4)}
    mpath.unlink(missing_ok=True)
    return r


def load_side(args: argparse.Namespace) -> list[dict]:
    """Copies of the /dev/shm mapping to the GPU: unregistered, registered (1 and 4 streams), pipelined."""
    import torch
    out = []
    fd = os.open(args.shm, os.O_RDWR)
    size = os.fstat(fd).st_size
    mapping = mmap.mmap(fd, size)
    os.close(fd)
    host = torch.frombuffer(mapping, dtype=torch.uint8)
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()

    def timed(what: str, fn) -> None:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        s = time.perf_counter() - t0
        out.append({"what": what, "gib": round(size / GIB, 2), "s": round(s, 3), "gb_per_s": round(size / s / 1e9, 1)})
        print(json.dumps(out[-1]), flush=True)

    def bounced(threads: int, fill, chunk: int = 64 << 20) -> None:
        # each thread fills its chunks into its own two pinned buffers (``fill(buf, offset, n)``) and copies them
        # on its own stream
        def part(k: int) -> None:
            bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            evs = [None, None]
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                for j, off in enumerate(range(k * chunk, size, threads * chunk)):
                    n = min(chunk, size - off)
                    b = j & 1
                    if evs[b] is not None:
                        evs[b].synchronize()
                    fill(bufs[b], off, n)
                    dev[off:off + n].copy_(bufs[b][:n], non_blocking=True)
                    evs[b] = torch.cuda.Event()
                    evs[b].record(stream)
            stream.synchronize()

        ts = [threading.Thread(target=part, args=(k,)) for k in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    def pread_bounced(threads: int) -> None:
        # no mapping at all: the kernel's copy from the page cache (os.preadv releases the GIL)
        rfd = os.open(args.shm, os.O_RDONLY)

        def fill(buf, off: int, n: int) -> None:
            view, got = memoryview(buf.numpy()), 0
            while got < n:
                got += os.preadv(rfd, [view[got:n]], off + got)

        try:
            bounced(threads, fill)
        finally:
            os.close(rfd)

    def fresh_mapping_bounced() -> None:
        # today's tier load in a new worker: a mapping this process has never touched (every page faults), one
        # thread through two pinned buffers (torch's CPU copy runs on its intra-op threads)
        with open(args.shm, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            src = torch.frombuffer(mm, dtype=torch.uint8)
            bufs = [torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            evs = [None, None]
            for j, off in enumerate(range(0, size, 64 << 20)):
                n = min(64 << 20, size - off)
                b = j & 1
                if evs[b] is not None:
                    evs[b].synchronize()
                bufs[b][:n].copy_(src[off:off + n])
                dev[off:off + n].copy_(bufs[b][:n], non_blocking=True)
                evs[b] = torch.cuda.Event()
                evs[b].record()
            torch.cuda.synchronize()
            del src

    wanted = args.load_variants.split(",") if args.load_variants else None
    for n in (1, 4, 8, 16):
        if wanted is None or f"pread_{n}" in wanted:
            timed(f"pread_bounced_{n}_threads", lambda n=n: pread_bounced(n))
    if wanted is None or "fresh" in wanted:
        timed("fresh_mapping_bounced_1_thread", fresh_mapping_bounced)
    if wanted is not None:
        del host, dev
        torch.cuda.empty_cache()
        mapping.close()
        return out
    timed("copy_pageable", lambda: dev.copy_(host))

    def from_mapping(buf, off: int, n: int) -> None:
        # today's tier load: a memcpy from the mapping (torch's CPU copy_ releases the GIL)
        buf[:n].copy_(host[off:off + n])

    for n in (1, 4, 8):
        timed(f"copy_bounced_{n}_threads", lambda n=n: bounced(n, from_mapping))
    ptr = host.data_ptr()
    cudart = torch.cuda.cudart()
    timed("register", lambda: cudart.cudaHostRegister(ptr, size, 0))
    out[-1]["pinned_after"] = bool(host.is_pinned())
    timed("copy_registered_1_stream", lambda: dev.copy_(host, non_blocking=True))

    def four() -> None:
        streams = [torch.cuda.Stream() for _ in range(4)]
        step = (size + 3) // 4
        for i, s in enumerate(streams):
            with torch.cuda.stream(s):
                dev[i * step:(i + 1) * step].copy_(host[i * step:(i + 1) * step], non_blocking=True)
        for s in streams:
            s.synchronize()

    timed("copy_registered_4_streams", four)
    timed("unregister", lambda: cudart.cudaHostUnregister(ptr))

    def pipelined() -> None:  # register 1 GiB, start its copy, register the next while it runs
        chunk = GIB
        for off in range(0, size, chunk):
            n = min(chunk, size - off)
            cudart.cudaHostRegister(ptr + off, n, 0)
            dev[off:off + n].copy_(host[off:off + n], non_blocking=True)
        torch.cuda.synchronize()
        for off in range(0, size, chunk):
            cudart.cudaHostUnregister(ptr + off)

    timed("register_and_copy_pipelined_1gib", pipelined)
    del host, dev
    torch.cuda.empty_cache()  # the kill variants below need the GPU's memory back
    mapping.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("/tmp/teardown-probe"))
    ap.add_argument("--host-gib", type=float, default=40.0)
    ap.add_argument("--gpu-gib", type=float, default=100.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--variants", default="ctx,gpu,dcp_today,shm_reg,shm_map,pinned")
    ap.add_argument("--shm", type=Path, default=Path("/dev/shm/kt-teardown-probe"))
    ap.add_argument("--cpu", action="store_true", help="no CUDA: the mutex and reap timings only")
    ap.add_argument("--skip-load", action="store_true", help="the kill variants only")
    ap.add_argument("--load-variants", default="",
                    help="only these reads, then no kill variant (comma-separated: pread_1, pread_4, pread_8, "
                         "pread_16, fresh); default: every read")
    ap.add_argument("--fallocate", action="store_true",
                    help="make the file with posix_fallocate (zeroed pages, seconds) instead of random bytes")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--mutex", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(args.shm, "wb") as f:  # the tier-like file, written once (its pages exist before any child maps it)
        if args.fallocate:
            os.posix_fallocate(f.fileno(), 0, int(args.host_gib * GIB) // (64 << 20) * (64 << 20))
        else:
            block = os.urandom(1 << 20) * 64
            for _ in range(int(args.host_gib * GIB) // len(block)):
                f.write(block)
    print(json.dumps({"what": "shm_file_written", "gib": args.host_gib, "s": round(time.perf_counter() - t0, 2)}),
          flush=True)
    rows = []
    try:
        if not args.cpu and not args.skip_load:  # first: it needs the GPU to itself
            rows += load_side(args)
        for _ in range(0 if args.load_variants else args.repeats):
            for v in args.variants.split(","):
                r = kill_once(args, v, args.out)
                print(json.dumps(r), flush=True)
                rows.append(r)
    finally:
        args.shm.unlink(missing_ok=True)
        with open(args.out / "results.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print("\n| variant | set-up s | kill -> robust mutex s | kill -> reaped s | kill -> GPU memory free s |")
    print("|---|---|---|---|---|")
    for r in rows:
        if r["what"] == "kill":
            print(f"| {r['variant']} | {r['setup_s']} | {r['kill_to_futex_s']} | {r['kill_to_reap_s']} | "
                  f"{r['kill_to_gpu_free_s']} |")


if __name__ == "__main__":
    main()
