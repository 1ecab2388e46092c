"""What verifying shards costs the loader: CRC-32 checks of what a rank reads, per GB, against reading unchecked.

    nice -n 10 python bench/shard_verify_bench.py [--gib 1] [--seq-len 8192] [--dir /tmp/kt-verify-bench]

Writes ``--gib`` GiB of uint16 shards (random ids, 100 M-token shards as prepare-data's default, 64 KiB chunk
checksums) with the trainer's own ShardWriter, reads them once so they are in the page cache (the numbers are the
CPU cost, not the disk's), then times, each over every window of ``seq-len + 1`` tokens:

- ``sequential``: the windows in corpus order through ``ShardSet.read`` with ``verify="size"`` (no checksum: what
  the trainer did before) and ``verify="lazy"`` (every chunk verified on the first read that touches it: what it does
  now), on fresh ShardSets, and the lazy one a second time (every chunk verified: the bookkeeping alone);
- ``shuffled``: the same in a random order (first touches of chunks scattered over the shards);
- ``whole_file_crc``: ``crc32_file`` over every shard (what a lazy reader does on the first read of a shard that has
  no chunk index, and ``prepare-data --verify``).

Prints one JSON line per case with seconds, seconds per GB (10^9 bytes) and the verification's extra seconds per GB;
the load average with it (a shared machine: the numbers are upper bounds of the cost).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np

from kubetitan_trainer.data.shards import CHUNK_BYTES, INDEX_FILE, ShardSet, ShardWriter, crc32_file, make_index

SHARD_TOKENS = 100_000_000


def write(out: Path, gib: float) -> int:
    """uint16 shards of random ids totalling ``gib`` GiB; returns the bytes written."""
    if (out / INDEX_FILE).is_file():
        return sum(f["tokens"] * 2 for f in json.loads((out / INDEX_FILE).read_text())["files"])
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    total, files, k = int(gib * 2**30) // 2, [], 0
    while total > 0:
        n = min(total, SHARD_TOKENS)
        w = ShardWriter(out, f"shard-{k:06d}.bin", "uint16")
        for start in range(0, n, 1 << 22):
            m = min(1 << 22, n - start)
            w.add(rng.integers(0, 50_000, size=m, dtype=np.int64), np.asarray([m], dtype=np.int64))
        files.append(w.close())
        total -= n
        k += 1
    (out / INDEX_FILE).write_text(json.dumps(make_index(files, dtype="uint16", vocab_size=50_000, bos_id=None,
                                                        eos_id=None, tokenizer={"name": "bench"})))
    return sum(f["tokens"] * 2 for f in files)


def read_all(path: Path, verify: str, order: np.ndarray, size: int) -> tuple[float, float]:
    """Seconds to read every window in ``order`` on a fresh ShardSet, and again on the same one (every chunk
    verified by then)."""
    ss = ShardSet.open(path, verify=verify)  # type: ignore[arg-type]
    out = []
    for _ in range(2):
        begin = time.perf_counter()
        for k in order:
            ss.read(int(k) * size, size)
        out.append(time.perf_counter() - begin)
    return out[0], out[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--dir", default="/tmp/kt-verify-bench")
    p.add_argument("--keep", action="store_true", help="leave the shards in --dir")
    a = p.parse_args()
    out = Path(a.dir)
    nbytes = write(out, a.gib)
    gb = nbytes / 1e9
    for f in sorted(out.glob("shard-*")):  # into the page cache
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass
    size = a.seq_len + 1
    windows = nbytes // 2 // size
    orders = {"sequential": np.arange(windows), "shuffled": np.random.default_rng(1).permutation(windows)}
    common = {"gb": round(gb, 3), "seq_len": a.seq_len, "windows": int(windows), "chunk_bytes": CHUNK_BYTES}
    for name, order in orders.items():
        plain, _ = read_all(out, "size", order, size)
        lazy, again = read_all(out, "lazy", order, size)
        print(json.dumps({"case": name, **common, "unchecked_s": round(plain, 3), "verified_s": round(lazy, 3),
                          "unchecked_s_per_gb": round(plain / gb, 3), "verified_s_per_gb": round(lazy / gb, 3),
                          "extra_s_per_gb": round((lazy - plain) / gb, 3),
                          "extra_us_per_window": round((lazy - plain) / windows * 1e6, 2),
                          "verified_again_s_per_gb": round(again / gb, 3),
                          "load_average_1m": os.getloadavg()[0]}), flush=True)
    begin = time.perf_counter()
    for f in sorted(out.glob("shard-*.bin")):
        crc32_file(f)
    whole = time.perf_counter() - begin
    print(json.dumps({"case": "whole_file_crc", **common, "seconds": round(whole, 3), "s_per_gb": round(whole / gb, 3),
                      "load_average_1m": os.getloadavg()[0]}), flush=True)
    if not a.keep:
        shutil.rmtree(out)


if __name__ == "__main__":
    main()
