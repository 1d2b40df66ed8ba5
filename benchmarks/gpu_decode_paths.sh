#!/usr/bin/env bash
# Issue 48's decode-step paths side by side (docs/performance.md sections 54, 58 and 62, part K
# row 5), one device call, no training: benchmarks/bench_decode_init.py on the 1B config as
# initialised: each SETS entry ('|'-separated execution sets; the default: the defaults, and
# one-row products as reductions, model.decode_vector_dots=reduce, the default until section
# 64), at BATCHES (default 1;
# each set and size compiles for about 25-75 s). Then, in the time left, THEN_SETS at
# THEN_BATCHES (default: none).
# MHC=1 first sweeps one layer's mHC at one token by D chunk width and by D split
# (benchmarks/bench_mhc.py, checked against the jnp sites; section 59 chose 16 splits).
#   bash benchmarks/gpu_decode_paths.sh
#   SETS='|model.moe_gather_small_calls=false' THEN_SETS='|model.mhc_decode_splits=0' \
#     bash benchmarks/gpu_decode_paths.sh
# PROFILE=1 also traces the first set at each batch size (XLA's command buffers off) and leaves
# trace_summary.py's tables as $OUT/trace_b<B>.txt: where a decode step's time goes.
#   PROFILE=1 BATCHES=1,32 bash benchmarks/gpu_decode_paths.sh
# SMOKE=1 runs the same on this CPU with configs/tiny.py.
set -uo pipefail
source benchmarks/device_env.sh
export TF_CPP_MIN_LOG_LEVEL=2
[[ -n ${PROFILE:-} ]] && export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer="
START=$(date +%s)
left() { echo $((${DEADLINE_S:-570} - ($(date +%s) - START))); }
# (Section 56 on an H100: the gathered experts became the default; 256-wide chunks,
# model.mhc_decode_block_d=256, were slower.)
SETS=${SETS:-"|model.decode_vector_dots=reduce"}
THEN_SETS=${THEN_SETS-}
if [[ -n ${SMOKE:-} ]]; then
  export JAX_PLATFORMS=cpu
  CONFIG=configs/tiny.py; D=64; MHC_CONFIGS=16x32x8; MHC_SPLITS=0,2
  SIZES="--prompt_tokens=48 --new_tokens=16"; BATCHES=${BATCHES:-1,4}
else
  CONFIG=configs/ablation_1b.py; D=1024; MHC_CONFIGS=16x32x8,16x32x4,16x64x8; MHC_SPLITS=0,8,16,32
  SIZES=""; BATCHES=${BATCHES:-1}
fi
THEN_BATCHES=${THEN_BATCHES:-32}
if [[ -n ${MHC:-} ]]; then
  timeout -s KILL 150 python3 benchmarks/bench_mhc.py --d $D --batch 1 --seq 1 --modes fwd \
    --cases layer --configs $MHC_CONFIGS --decode_splits $MHC_SPLITS --check \
    --out "$OUT/mhc_decode.jsonl" \
    > "$OUT/mhc_decode.log" 2>&1
  echo "bench_mhc exit $? wall $(($(date +%s) - START)) s" | tee -a "$OUT/summary.txt"
  grep -E '"impl": "fused"' "$OUT/mhc_decode.jsonl" | cut -c1-200
fi
timeout -s KILL "$(left)" python3 benchmarks/bench_decode_init.py --config=$CONFIG $SIZES \
  --batch_sizes=$BATCHES --execution_sets="$SETS" --out="$OUT/decode_paths.json" \
  ${PROFILE:+--profile_dir=/tmp/decode_trace} > "$OUT/decode_paths.log" 2>&1
echo "bench_decode_init exit $? wall $(($(date +%s) - START)) s" | tee -a "$OUT/summary.txt"
if [[ -n ${PROFILE:-} ]]; then
  for t in /tmp/decode_trace/*/; do
    python3 benchmarks/trace_summary.py "$t" --top 30 --depth 2 --merge-layers \
      > "$OUT/trace_$(basename "$t").txt" 2>&1
  done
  rm -rf /tmp/decode_trace
fi
if [[ -n $THEN_SETS && $(left) -gt 60 ]]; then
  timeout -s KILL "$(left)" python3 benchmarks/bench_decode_init.py --config=$CONFIG $SIZES \
    --batch_sizes=$THEN_BATCHES --execution_sets="$THEN_SETS" --out="$OUT/decode_then.json" \
    > "$OUT/decode_then.log" 2>&1
  echo "then: bench_decode_init exit $? wall $(($(date +%s) - START)) s" | tee -a "$OUT/summary.txt"
fi
cat "$OUT/decode_paths.log" "$OUT/decode_then.log" 2>/dev/null | grep -vE "^[IWE][0-9]{4}" | grep -E "^(defaults|model\.|uncast)|rror" | cut -c1-300
