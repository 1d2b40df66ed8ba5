#!/usr/bin/env bash
# Issue 48's decode-step paths side by side (docs/performance.md section 54, part K row 5), one
# device call, no training: one layer's mHC at one token by D chunk width
# (benchmarks/bench_mhc.py), then benchmarks/bench_decode_init.py on the 1B config as
# initialised: each SETS entry ('|'-separated execution sets; the default: every weight as
# trained (`uncast`, before generate/weight_reads.py), the defaults, the gathered experts, then
# both paths with CHUNK-wide mHC chunks), at BATCHES
# (default 1; `BATCHES=32` in a second call: each set and size compiles for about 75 s).
#   bash benchmarks/gpu_decode_paths.sh
#   CHUNK=128 BATCHES=1 bash benchmarks/gpu_decode_paths.sh
# SMOKE=1 runs the same on this CPU with configs/tiny.py.
set -uo pipefail
source benchmarks/device_env.sh
export TF_CPP_MIN_LOG_LEVEL=2
START=$(date +%s)
left() { echo $((${DEADLINE_S:-570} - ($(date +%s) - START))); }
CHUNK=${CHUNK:-256}
SETS=${SETS:-"uncast||model.moe_gather_small_calls=true|model.mhc_decode_block_d=$CHUNK,model.moe_gather_small_calls=true"}
if [[ -n ${SMOKE:-} ]]; then
  export JAX_PLATFORMS=cpu
  CONFIG=configs/tiny.py; D=64; MHC_CONFIGS=16x32x8,16x64x8
  SIZES="--prompt_tokens=48 --new_tokens=16"; BATCHES=${BATCHES:-1,4}
else
  CONFIG=configs/ablation_1b.py; D=1024; MHC_CONFIGS=16x32x8,16x64x8,16x128x8,16x256x8,16x128x4
  SIZES=""; BATCHES=${BATCHES:-1}  # each set and batch size compiles for ~75 s: 32 in a second call
fi
timeout -s KILL 120 python3 benchmarks/bench_mhc.py --d $D --batch 1 --seq 1 --modes fwd \
  --cases layer --configs $MHC_CONFIGS --check --out "$OUT/mhc_decode.jsonl" \
  > "$OUT/mhc_decode.log" 2>&1
echo "bench_mhc exit $? wall $(($(date +%s) - START)) s" | tee -a "$OUT/summary.txt"
timeout -s KILL "$(left)" python3 benchmarks/bench_decode_init.py --config=$CONFIG $SIZES \
  --batch_sizes=$BATCHES --execution_sets="$SETS" --out="$OUT/decode_paths.json" \
  > "$OUT/decode_paths.log" 2>&1
echo "bench_decode_init exit $? wall $(($(date +%s) - START)) s" | tee -a "$OUT/summary.txt"
grep -E '"impl": "fused"' "$OUT/mhc_decode.jsonl" | cut -c1-200
grep -vE "^[IWE][0-9]{4}" "$OUT/decode_paths.log" | grep -E "^(defaults|model\.|uncast)|rror" | cut -c1-300
