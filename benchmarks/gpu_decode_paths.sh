#!/usr/bin/env bash
# Issue 48's decode-step paths side by side (docs/performance.md section 54, part K row 5), one
# device call, no training: one layer's mHC at one token by D chunk width
# (benchmarks/bench_mhc.py), then benchmarks/bench_decode_init.py on the 1B config as
# initialised: each SETS entry ('|'-separated execution sets; the default: every weight as
# trained (`uncast`, before generate/weight_reads.py), the defaults, the grouped experts at
# every size, then both paths with CHUNK-wide mHC chunks), at BATCHES (default 1;
# `BATCHES=32` in a second call: each set and size compiles for about 75 s).
# Then, in the time left, THEN_SETS at THEN_BATCHES (default: both paths at batch 2; a step of
# two rows runs its products as GEMMs where one row's become a multiply and a reduction that
# write and read every [K, N] product: docs/performance.md section 55).
#   bash benchmarks/gpu_decode_paths.sh
#   CHUNK=128 BATCHES=1 bash benchmarks/gpu_decode_paths.sh
# SMOKE=1 runs the same on this CPU with configs/tiny.py.
set -uo pipefail
source benchmarks/device_env.sh
export TF_CPP_MIN_LOG_LEVEL=2
START=$(date +%s)
left() { echo $((${DEADLINE_S:-570} - ($(date +%s) - START))); }
CHUNK=${CHUNK:-256}
# (Section 56 on an H100: the gathered experts became the default; CHUNK=256 was slower.)
BOTH="model.mhc_decode_block_d=$CHUNK,model.moe_gather_small_calls=true"
SETS=${SETS:-"uncast||model.moe_gather_small_calls=false|$BOTH"}
THEN_SETS=${THEN_SETS-$BOTH}
if [[ -n ${SMOKE:-} ]]; then
  export JAX_PLATFORMS=cpu
  CONFIG=configs/tiny.py; D=64; MHC_CONFIGS=16x32x8,16x64x8
  SIZES="--prompt_tokens=48 --new_tokens=16"; BATCHES=${BATCHES:-1,4}
else
  CONFIG=configs/ablation_1b.py; D=1024; MHC_CONFIGS=16x32x8,16x64x8,16x128x8,16x256x8,16x128x4
  SIZES=""; BATCHES=${BATCHES:-1}  # each set and batch size compiles for ~75 s: 32 in a second call
fi
THEN_BATCHES=${THEN_BATCHES:-2}
timeout -s KILL 120 python3 benchmarks/bench_mhc.py --d $D --batch 1 --seq 1 --modes fwd \
  --cases layer --configs $MHC_CONFIGS --check --out "$OUT/mhc_decode.jsonl" \
  > "$OUT/mhc_decode.log" 2>&1
echo "bench_mhc exit $? wall $(($(date +%s) - START)) s" | tee -a "$OUT/summary.txt"
timeout -s KILL "$(left)" python3 benchmarks/bench_decode_init.py --config=$CONFIG $SIZES \
  --batch_sizes=$BATCHES --execution_sets="$SETS" --out="$OUT/decode_paths.json" \
  > "$OUT/decode_paths.log" 2>&1
echo "bench_decode_init exit $? wall $(($(date +%s) - START)) s" | tee -a "$OUT/summary.txt"
if [[ -n $THEN_SETS && $(left) -gt 60 ]]; then
  timeout -s KILL "$(left)" python3 benchmarks/bench_decode_init.py --config=$CONFIG $SIZES \
    --batch_sizes=$THEN_BATCHES --execution_sets="$THEN_SETS" --out="$OUT/decode_then.json" \
    > "$OUT/decode_then.log" 2>&1
  echo "then: bench_decode_init exit $? wall $(($(date +%s) - START)) s" | tee -a "$OUT/summary.txt"
fi
grep -E '"impl": "fused"' "$OUT/mhc_decode.jsonl" | cut -c1-200
cat "$OUT/decode_paths.log" "$OUT/decode_then.log" 2>/dev/null | grep -vE "^[IWE][0-9]{4}" | grep -E "^(defaults|model\.|uncast)|rror" | cut -c1-300
