#!/bin/bash
# the data plane's throughput on the H200 host's 16 idle cores, where the
# 2-core development VM (loaded by other work) could not show the 1 -> 2 worker scaling:
# bench/data_bench.py with 1, 2, 4 and 8 workers on 48 MB of real text (/usr/share/doc and Python sources there),
# peak RSS on a 1 GB input of real text (the base corpus repeated), and the shard reader's rate.
export R=/tmp/r
source bench/device/setup.sh
nproc; uptime
python3 bench/data_bench.py --base-mb 48 --large-mb 1024 --workers 1,2,4,8 --large-workers 8 \
  --workdir /tmp/databench 2>&1 | tee "$R/data_bench_h200.txt"
cp "$R/data_bench_h200.txt" "$OUT/"
snap
