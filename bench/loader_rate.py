"""The loader's own throughput on one core: tokens/s one rank gets from ``GlobalDataLoader`` (global schedule,
per-epoch permutation, ShardSet reads, tensors), against the 3B H200 recipe's consumption (29,146 tokens/s per GPU,
docs/benchmarks.md).

    nice -n 10 python bench/loader_rate.py SHARDS_DIR [--seq-len 8192] [--seconds 5]

Cases: one source; a 3-source mixture (the same directory three times); and rank 0 of 64 (each micro-batch
computes the schedule of all 64 ranks' samples). Prints one JSON line per case; the load average with it (the CI
machine is shared: numbers are lower bounds).
"""

from __future__ import annotations

import argparse
import json
import os
import time

from kubetitan_trainer.data.loaders import GlobalDataLoader, open_shards
from kubetitan_trainer.data.stream import GlobalStream, WindowSource

RECIPE_TOKENS_PER_S = 29_146


def rate(path: str, seq_len: int, sources: int, world: int, local_batch: int, seconds: float) -> dict:
    srcs = [WindowSource(f"s{i}", open_shards(path, "bench"), seq_len) for i in range(sources)]
    stream = GlobalStream(srcs, [1.0 + i for i in range(sources)], seed=1, shuffled=True)
    it = iter(GlobalDataLoader(stream, dp_rank=0, dp_world_size=world, local_batch=local_batch))
    next(it)  # the first epoch's permutation is built here (reported apart)
    n, begin = 0, time.perf_counter()
    while time.perf_counter() - begin < seconds:
        inputs, labels = next(it)
        n += labels.numel() + labels.shape[0]
    tps = n / (time.perf_counter() - begin)
    return {"sources": sources, "dp_world_size": world, "local_batch": local_batch, "seq_len": seq_len,
            "windows_per_source": srcs[0].windows, "tokens_per_s": round(tps), "x_recipe": round(tps / RECIPE_TOKENS_PER_S, 1),
            "load_average_1m": os.getloadavg()[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("shards")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--seconds", type=float, default=5.0)
    a = p.parse_args()
    for sources, world in ((1, 1), (3, 1), (1, 64)):
        print(json.dumps(rate(a.shards, a.seq_len, sources, world, 1, a.seconds)))


if __name__ == "__main__":
    main()
