#!/bin/bash
# What document masking (spec.data.attentionMask: document) costs on the GPU: the card's recipe through
# `kubetitan run` (examples/llama3-3b-h100.yaml's layout: 3B, FP8 tensorwise with the FP8 output projection,
# expandable segments, batch 2, seq 8192, every 7th block checkpointed) on real text shards, causal and document
# alternating, ROUNDS rounds (bench/gpu_bench.py; STEPS steps a run, the median tok/s over the steps after the
# warm-up).
# 1. corpus: bench/text_corpus.py (the machine's own text files, one document a file: Python modules, docs, man
#    pages, package sources; CORPUS_MB), `kubetitan prepare-data` with the builtin tokenizer (the spec's), every
#    core a worker; the documents' token lengths (count, median, mean, share of windows holding a boundary) -> corpus.txt.
# 2. the runs: causal, document, causal, document, ... ; table.txt: gpu_bench's comparison (tok/s per round, MFU,
#    memory), and the masking's cost (document / causal - 1, of the medians).
# $OUT: progress.txt, corpus.txt, table.txt, results.jsonl, logs.tgz, env.txt.
# Usage (device tool, kind nvidia-h100-x1, carry [".whl"], timeout_s 600): bash bench/device/doc_mask_gpu.sh
# Knobs (env): GPU_PRODUCT (H100; H200 on an H200), ROUNDS (2), STEPS (16), WARMUP (5), CORPUS_MB (48),
# END_S (540: no run starts after this many seconds of the script).
# CPU dry run (the debug model, eager, 6 steps, an 8 MB corpus): DRY=1 OUT=/tmp/dm bash bench/device/doc_mask_gpu.sh
export R=${R:-/tmp/r_doc_mask}
DRY=${DRY:-0}
rm -rf "$R"
mkdir -p "$OUT"
source bench/device/setup.sh
GPU_PRODUCT=${GPU_PRODUCT:-H100} ROUNDS=${ROUNDS:-2} END_S=${END_S:-540}
if [ "$DRY" = 1 ]; then
  STEPS=${STEPS:-6} WARMUP=${WARMUP:-2} CORPUS_MB=${CORPUS_MB:-8} CASE="debugmodel:eager:2"
  export GPUBENCH_SEQ_LEN=256
else
  STEPS=${STEPS:-16} WARMUP=${WARMUP:-5} CORPUS_MB=${CORPUS_MB:-48}
  CASE="3B:fp8tw:2:ac=selective:sac=7:fp8out=1:alloc=exp:gpu=$GPU_PRODUCT"
fi
D=/tmp/doc_mask_data
rm -rf "$D"
mkdir -p "$D"
say() { echo "$(date -u +%T) +${SECONDS}s $*" | tee -a "$OUT/progress.txt"; }
cp "$R/env.txt" "$OUT/" 2>/dev/null
say "corpus: bench/text_corpus.py --max-mb $CORPUS_MB"
python3 bench/text_corpus.py --out "$D/corpus.jsonl" --max-mb "$CORPUS_MB" > "$D/corpus_summary.txt" 2>&1 || {
  say "corpus failed"; cat "$D/corpus_summary.txt"; exit 1; }
say "prepare-data, builtin tokenizer, $(nproc) workers"
python3 -m kubetitan.cli prepare-data "$D/corpus.jsonl" -o "$D/shards" --workers "$(nproc)" --no-progress \
  > "$D/prepare.txt" 2>&1 || { say "prepare-data failed"; tail -20 "$D/prepare.txt"; exit 1; }
python3 - "$D/shards" "${GPUBENCH_SEQ_LEN:-8192}" <<'EOF' | tee "$OUT/corpus.txt"
import json, statistics, sys
from pathlib import Path
import numpy as np
d, seq = Path(sys.argv[1]), int(sys.argv[2])
index = json.loads((d / "index.json").read_text())
lengths, boundaries = [], 0
for idx in sorted(d.glob("**/*.idx")):
    offsets = np.fromfile(idx, dtype="<u8")  # documents + 1 offsets into the .bin (kubetitan_trainer.data.shards)
    lengths.extend(np.diff(offsets).tolist())
total = sum(lengths)
print(f"shards {d}: {len(lengths):,} documents, {total:,} tokens; tokens a document: median "
      f"{statistics.median(lengths):,.0f}, mean {statistics.mean(lengths):,.0f}; at seq {seq}, "
      f"{len(lengths) / max(total / seq, 1):.2f} document ends per window on average")
print("index:", {k: index[k] for k in index if k in ("tokens", "documents", "tokenizer", "dtype")})
EOF
S="steps=$STEPS:warmup=$WARMUP:data=shards:shards=$D/shards:path=kubetitan"
cases=""
for i in $(seq 1 "$ROUNDS"); do
  cases="$cases,$CASE:$S:mask=causal:round=$i,$CASE:$S:mask=document:round=$i"
done
say "runs: ${cases#,}"
python3 bench/gpu_bench.py run --out "$R" --deadline $((END_S - SECONDS)) --case-timeout "${CT:-200}" \
  --cases "${cases#,}" 2>&1 | tee -a "$OUT/progress.txt"
python3 bench/gpu_bench.py compare "$R" | tee "$OUT/table.txt"
python3 - "$R/results.jsonl" <<'EOF' | tee -a "$OUT/table.txt"
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
by = {}
for r in rows:
    if r.get("rc") == 0 and r.get("tps_median"):
        by.setdefault("document" if "mask=document" in r["case"] else "causal", []).append(r["tps_median"])
if len(by) == 2:
    c, d = statistics.median(by["causal"]), statistics.median(by["document"])
    print(f"document masking: {d:,.0f} tok/s against causal {c:,.0f} (median of {len(by['document'])} and "
          f"{len(by['causal'])} runs): {d / c - 1:+.1%}")
else:
    print("document masking: not every side ran to the end:", {k: v for k, v in by.items()})
EOF
cp "$D/corpus_summary.txt" "$D/prepare.txt" "$R/" 2>/dev/null
snap
