#!/bin/bash
# loss parity on REAL TEXT: one H200, or one H100 with SERIAL=1 (run on H100s: docs/benchmarks.md, "Loss parity").
# 1. corpus: the text files of the machine (no network): bench/text_corpus.py (the Python standard library's .py,
#    /usr/share/doc and common-licenses, man pages, the installed packages' .py/.md/.rst/.txt; one JSONL document a
#    file); a 32,768-token byte-level BPE learnt from it (TOKENIZER=bpe, the default: kubetitan's builtin tokenizer,
#    trainer/kubetitan_trainer/assets/tokenizer, is 644 tokens learnt from the shipped toy corpus, ~1.3 bytes a
#    token on real text; no Llama 3 tokenizer can be fetched there; TOKENIZER=builtin uses it anyway); then
#    `kubetitan prepare-data` (kubetitan's own CLI) into shards, every core a worker; byte counts, the files'
#    summary, tokens and MB/s -> corpus.txt. The shuffle is the loader's (data.order: shuffled, a permutation of
#    the seqLen+1-token windows seeded by the run's seed).
# 2. three runs of the 3B model at seq 2048, batch 2, 300 steps (learning-rate warm-up 20), on those shards:
#    a) the recipe's numerics through `kubetitan run` (examples/llama3-3b-h200.yaml: FP8 tensorwise with the output
#       projection in FP8, compiled by kubetitan's TrainSpec; expandable segments), seed A;
#    b) plain torchtitan 0.2.2 (its own TrainSpec, FP8 tensorwise blocks, bf16 output projection: torchtitan's
#       default filter), seed A: the same initial weights and the same data order as a) (torchtitan seeds the
#       initialisation with debug.seed, kubetitan's loader the window order with the same seed);
#    c) plain torchtitan, seed B: another initialisation AND another data order (both follow the seed): the
#       run-to-run noise.
#    a) and b) run at once on the one GPU (~62 GiB each; their step times are not measurements), then c) alone;
#    a run of the pair that stopped short of STEPS (say, out of memory beside the other) runs again alone if time
#    is left.
#    Every run: alloc=exp (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; the allocator's, not numerics).
# 3. bench/plot_parity.py: raw + EMA-smoothed curves and their differences -> loss_parity_text.png; the numbers
#    (mean |recipe - plain_A| and |plain_A - plain_B| over the last 100 steps, raw and smoothed, the gap of the
#    tail means, the step-to-step std) -> parity.txt.
# $OUT gets (6 files): progress.txt, corpus.txt, parity.txt, loss_parity_text.png, results.jsonl, logs.tgz (every
# log, the corpus summary and file list, the learnt tokenizer, the shards' index.json, env.txt), each as soon as it
# exists.
# Expected: ~1.5 min set-up (wheels, corpus, prepare-data), a)+b) ~2.5-3 min, c) ~1.5-2 min: ~6-7 min in all.
#
# On a card of less than ~127 GiB (an H100) the three runs go one after another (SERIAL=1, ~60 GiB each).
# Usage (device tool, carry [".whl"], timeout_s 600): bash bench/device/loss_parity_real_text.sh
# Knobs (env): STEPS (300), BATCH (2), SEQ (2048), SEED_A (42), SEED_B (1234), CORPUS_MB (64), TOKENIZER (bpe or
# builtin), FP8OUT_A (1: run a's output projection in FP8, as the recipes; 0: in bf16, as plain torchtitan), VOCAB (32768), END_S (540: no run goes past this many seconds of the script), PAIR_S (the limit of the
# a)+b) pair; default END_S - 130 - the set-up's seconds), CASE_EXTRA (more case fields for every run, e.g.
# ac=selective:sac=7, the H100 recipe's every-7th-block checkpointing), RUNS (SERIAL=1 only: which of a b c run in
# this call, default "a b c"; RUN_S: each run's limit but the last's, which gets what is left; the corpus and shards are made again the same way, so runs split over several calls
# train on the same tokens; the plot then needs all three results.jsonl: bench/plot_parity.py, run anywhere).
# The H100 recipe's shape (examples/llama3-3b-h100.yaml: seq 8192, batch 2, every 7th block), in two calls:
#   SEQ=8192 CASE_EXTRA=ac=selective:sac=7 RUNS="b c" RUN_S=290 END_S=585 \
#     bash bench/device/loss_parity_real_text.sh                                                  (timeout_s 600)
#   SEQ=8192 CASE_EXTRA=ac=selective:sac=7 RUNS="a" END_S=380 bash bench/device/loss_parity_real_text.sh  (timeout_s 400)
# CPU dry run on the development machine (the same path: debug model, eager, seq 128, 10 steps, learning-rate warm-up
# 2, an 8 MB corpus):
#   DRY=1 OUT=bench/results/parity/cpu_dryrun bash bench/device/loss_parity_real_text.sh
export R=${R:-/tmp/parity-text}
DRY=${DRY:-0}
rm -rf "$R"
mkdir -p "$OUT"
source bench/device/setup.sh
if [ "$DRY" = 1 ]; then
  FLAV=debugmodel MODE=eager STEPS=${STEPS:-10} SEQ=${SEQ:-128} CORPUS_MB=${CORPUS_MB:-8} D=${D:-/tmp/parity-text-data-dry} LRWARM=2
  VOCAB=${VOCAB:-2048}  # the debug model's vocabulary
else
  FLAV=3B MODE=fp8tw STEPS=${STEPS:-300} SEQ=${SEQ:-2048} CORPUS_MB=${CORPUS_MB:-64} D=${D:-/tmp/parity-text-data} LRWARM=20
  VOCAB=${VOCAB:-32768}
fi
# the dry run's debug model takes the builtin tokenizer only (the spec refuses another for it)
TOKENIZER=${TOKENIZER:-$([ "$DRY" = 1 ] && echo builtin || echo bpe)}
BATCH=${BATCH:-2} SEED_A=${SEED_A:-42} SEED_B=${SEED_B:-1234} END_S=${END_S:-540}
W=${GPUBENCH_WORK_ROOT:-/tmp/gpubench18}
rm -rf "$D" "$W"
mkdir -p "$D" "$R/a" "$R/b" "$R/c"
say() { echo "$(date -u +%T) +${SECONDS}s $*" | tee -a "$OUT/progress.txt"; }
gpu_mem() { nvidia-smi --query-gpu=memory.used --format=csv,noheader 2>/dev/null | tr -d '\n'; }
last_step() {  # the newest "step: N loss: X" of the given logs (kubetitan's keeps torchtitan's colours)
  cat "$@" 2>/dev/null | sed 's/\x1b\[[0-9;]*m//g' | grep -ao 'step: *[0-9]* *loss: *[0-9.]*' | tail -1 | tr -s ' '
}
alive() { for p in "$@"; do kill -0 "$p" 2>/dev/null && return 0; done; return 1; }
watch_runs() {  # every 20 s while a run lives: each run's newest step and the GPU's memory in use
  local pids=$1 last=$SECONDS
  shift
  while alive $pids; do
    sleep 2
    if ((SECONDS - last >= 20)); then
      last=$SECONDS
      say "$(for x in "$@"; do echo -n "$x: $(last_step $R/$x/*.log $W/$x/*/out/train.log) | "; done)gpu $(gpu_mem)"
    fi
  done
}
say "loss parity on real text, DRY=$DRY: $FLAV $MODE batch $BATCH seq $SEQ steps $STEPS seeds $SEED_A/$SEED_B, corpus <= $CORPUS_MB MB," \
  "tokenizer $TOKENIZER"

# 1. corpus, tokenizer, shards
case $TOKENIZER in
  bpe) TOK=$D/tokenizer TOKARGS=(--tokenizer-out "$D/tokenizer" --vocab-size "$VOCAB") ;;
  builtin) TOK=builtin TOKARGS=() ;;
  *) say "TOKENIZER=$TOKENIZER: use bpe or builtin"; exit 2 ;;
esac
python3 bench/text_corpus.py --out "$D/corpus.jsonl" --max-mb "$CORPUS_MB" --summary "$R/corpus_summary.json" \
  --list "$R/corpus_files.tsv" "${TOKARGS[@]}" 2>&1 | tee "$R/corpus.txt"
say "corpus written; prepare-data with $(nproc) workers, tokenizer $TOK"
python3 -m kubetitan.cli prepare-data "$D/corpus.jsonl" -o "$D/shards" --tokenizer "$TOK" --workers "$(nproc)" \
  --no-progress 2>&1 | tee -a "$R/corpus.txt"
python3 - "$D/shards/index.json" <<'PY' 2>&1 | tee -a "$R/corpus.txt"
import json, sys
ix = json.load(open(sys.argv[1]))
print(f"shards: {ix['total_tokens']:,} tokens ({ix['dtype']}), {ix['documents']:,} documents, {len(ix['files'])} "
      f"shard files, tokenizer {ix['tokenizer']['name']} ({ix['tokenizer']['vocab_size']} tokens), "
      f"{ix['input_bytes'] / ix['total_tokens']:.2f} input bytes per token")
PY
cp "$R/corpus.txt" "$OUT/"
[ -f "$D/shards/index.json" ] || { say "prepare-data failed: no index.json"; snap; exit 1; }
cp "$D/shards/index.json" "$R/shards_index.json"  # provenance: the shards' files, checksums, tokenizer sha256
[ "$TOKENIZER" = bpe ] && cp -r "$D/tokenizer" "$R/"
say "shards ready"
snap

# 2. the runs
TOKCASE=; [ "$TOK" != builtin ] && TOKCASE=:tok=$TOK  # the runs' tokenizer: the one the shards were prepared with
C=$BATCH:steps=$STEPS:warmup=4:lrwarm=$LRWARM:alloc=exp:data=shards:shards=$D/shards$TOKCASE${CASE_EXTRA:+:$CASE_EXTRA}
export GPUBENCH_SEQ_LEN=$SEQ
run() {  # run NAME TIMEOUT CASE: one bench case into $R/NAME (log, results.jsonl)
  GPUBENCH_WORK=$W/$1 python3 bench/gpu_bench.py run --out "$R/$1" --case-timeout "$2" --cases "$3" \
    > "$R/$1/bench.txt" 2>&1
}
CASE_a=$FLAV:$MODE:$C:fp8out=${FP8OUT_A:-1}:path=kubetitan:seed=$SEED_A  # the recipe's numerics (FP8OUT_A=0: bf16 head)
CASE_b=$FLAV:$MODE:$C:path=plain:seed=$SEED_A                # plain torchtitan, the same seed
CASE_c=$FLAV:$MODE:$C:path=plain:seed=$SEED_B                # plain torchtitan, another seed
GPU_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
GPU_MIB=${GPU_MIB:-0}
# SERIAL=1 (the default on a card of less than ~127 GiB, e.g. an H100's 80 GB): a), b) and c) one after another,
# each limited to an equal share of the time left; the numerics do not depend on the order or on the card's size.
SERIAL=${SERIAL:-$(( GPU_MIB > 0 && GPU_MIB < 130000 ? 1 : 0 ))}
if [ "$SERIAL" = 1 ]; then
  RUNS=${RUNS:-a b c}
  for x in $RUNS; do
    left=$(( $(printf '%s\n' $RUNS | sed -n "/^$x\$/,\$p" | wc -l) ))
    T=$(( (END_S - SECONDS) / left )); ((T < 60)) && T=60
    if [ -n "${RUN_S:-}" ] && ((left > 1)); then T=$RUN_S; fi  # a fixed limit, the last run takes what is left
    if [ -n "${RUN_S:-}" ] && ((left == 1)); then T=$((END_S - SECONDS)); fi
    v=CASE_$x
    say "$x) alone (SERIAL=1: the card has $GPU_MIB MiB) ${!v}; limit ${T}s"
    run $x $T "${!v}" &
    watch_runs "$!" $x
    wait
    say "$x) $(tail -1 $R/$x/bench.txt)"
    snap
  done
else
T=${PAIR_S:-$((END_S - SECONDS - 130))}; ((T < 30)) && T=30  # a)+b) leave c) at least ~130 s
say "a) recipe (kubetitan, FP8 head) seed $SEED_A + b) plain (bf16 head) seed $SEED_A, at once; limit ${T}s"
run a $T "$CASE_a" &
P1=$!
run b $T "$CASE_b" &
P2=$!
watch_runs "$P1 $P2" a b
wait $P1 $P2
say "a) $(tail -1 $R/a/bench.txt)"
say "b) $(tail -1 $R/b/bench.txt)"
snap
T=$((END_S - SECONDS)); ((T < 60)) && T=60
say "c) plain seed $SEED_B alone; limit ${T}s"
run c $T "$CASE_c" &
watch_runs "$!" c
wait
say "c) $(tail -1 $R/c/bench.txt)"
fi
steps_of() { python3 -c 'import json,sys; print(max([json.loads(l).get("steps_logged", 0) for l in open(sys.argv[1])
  if l.strip()] or [0]))' "$R/$1/results.jsonl" 2>/dev/null || echo 0; }
for x in $(printf '%s\n' ${RUNS:-a b} | grep -x '[ab]'); do  # a run of the pair that stopped short (e.g. out of memory beside the other): again, alone
  T=$((END_S - SECONDS))
  if (($(steps_of $x) < STEPS && T >= 120)); then
    say "$x) logged $(steps_of $x) of $STEPS steps: again alone; limit ${T}s"
    mv "$R/$x" "$R/$x-first" && mkdir -p "$R/$x"
    v=CASE_$x
    run $x $T "${!v}" &
    watch_runs "$!" $x
    wait
    say "$x) $(tail -1 $R/$x/bench.txt)"
  fi
done
cat "$R"/{a,b,c}/results.jsonl > "$R/results.jsonl" 2>/dev/null

# 3. the curves and the numbers
PYTHONPATH=$PYTHONPATH${PLOT_PATH:+:$PLOT_PATH} python3 bench/plot_parity.py "$R/a/results.jsonl" \
  "$R/b/results.jsonl" "$R/c/results.jsonl" "$OUT/loss_parity_text.png" --txt "$R/parity.txt" 2>&1 \
  | tee -a "$OUT/progress.txt"
cp "$R/parity.txt" "$OUT/" 2>/dev/null
finish
say "done"
