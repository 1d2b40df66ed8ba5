#!/usr/bin/env bash
# Issue 16's H200 measurement (docs/performance.md section 15), one device call: the 1B backbone
# and its DSpark drafter trained together from initialization (configs/ablation_1b_dspark.py with
# dspark.stage=post_training, full structure, 4K x 8) for STEPS (default 150) steps, then
# benchmarks/bench_generate.py on its checkpoint: plain greedy decoding at 1 and 32 tokens per
# dispatch (its --tokens_per_dispatch) and speculative greedy decoding, the host loop (1) and
# rounds on the device (32 tokens a row per dispatch; its --speculative_per_dispatch), at batch
# 1 and 32, the cache's bytes per token, the bounded-replay KL, decode FLOPs by context.
# Everything still going DEADLINE_S (default 570) seconds after the start is skipped or killed.
# SMOKE=1 runs the same on this CPU with configs/tiny_dspark.py. PROFILE=1 also traces one more
# run of each mode at the first batch size and leaves trace_summary.py's tables as
# $OUT/trace_b<B>_<mode>.txt. REUSE=1 on a warm machine reuses /tmp/gen's trained checkpoint.
# BENCH_EXTRA: more bench_generate.py flags (e.g. `--speculative_per_dispatch= --replay_sequences=0
# --flop_contexts=` for plain decoding only).
set -uo pipefail
source benchmarks/device_env.sh
export TF_CPP_MIN_LOG_LEVEL=2
STEPS=${STEPS:-150}
if [[ -n ${SMOKE:-} ]]; then
  CONFIG=configs/tiny_dspark.py
  SHAPE="--config.data.seq_len=128 --config.train.batch_size=4"; ANCHORS=8; STEPS=${STEPS_SMOKE:-6}
  BENCH="--batch_sizes=1,4 --prompt_tokens=48 --new_tokens=16 --replay_context=256 \
    --replay_n_win=8,32 --replay_sequences=8 --flop_contexts=256,1024"
  export JAX_PLATFORMS=cpu
else
  CONFIG=configs/ablation_1b_dspark.py
  SHAPE="--config.data.seq_len=4096 --config.train.batch_size=8 $(no_remat_if_it_fits)"
  ANCHORS=128
  BENCH="--batch_sizes=1,32 --prompt_tokens=512 --new_tokens=128 --replay_context=2048 \
    --replay_n_win=128,512 --replay_sequences=32 --flop_contexts=4096,65536"
fi
START=$(date +%s)
left() { echo $((${DEADLINE_S:-570} - ($(date +%s) - START))); }
if [[ -z ${REUSE:-} || ! -d /tmp/gen/checkpoints ]]; then  # REUSE=1: a warm machine's run
rm -rf /tmp/gen
timeout -s KILL "$(left)" python3 -m deepseek41.train --config=$CONFIG $SHAPE \
  --workdir=/tmp/gen --config.dspark.stage=post_training --config.dspark.backbone_checkpoint= \
  --config.dspark.anchors_per_sequence=$ANCHORS --config.train.steps=$STEPS \
  --config.train.warmup_steps=40 --config.train.eval_every_steps=0 \
  --config.checkpoint.every_steps=$STEPS --config.log.every_steps=10 \
  --config.log.progress_bar=False --config.log.tensorboard=False \
  --config.data.cache_dir=/tmp/ds41-cache > "$OUT/train.log" 2>&1
echo "train exit $? wall $(($(date +%s) - START)) s" | tee -a "$OUT/summary.txt"
cp /tmp/gen/metrics.jsonl "$OUT/train.jsonl" 2>/dev/null
grep -E "initiali|first step|finished|rror" "$OUT/train.log" | cut -c1-300 | tail -5
fi
timeout -s KILL "$(left)" python3 benchmarks/bench_generate.py --workdir=/tmp/gen $BENCH ${BENCH_EXTRA:-} \
  ${PROFILE:+--profile_dir=$OUT/trace} \
  --deadline_s=$(($(left) - 60)) --out="$OUT/generate.json" > "$OUT/generate.log" 2>&1
echo "bench exit $? wall $(($(date +%s) - START)) s" | tee -a "$OUT/summary.txt"
grep -vE "^[IW][0-9]{4}" "$OUT/generate.log" | grep -E "^(plain|speculative|replay|flops)|rror" | cut -c1-400
if [[ -n ${PROFILE:-} ]]; then  # where a batch-1 token's time goes, per mode traced
  for t in "$OUT"/trace/*/; do
    python3 benchmarks/trace_summary.py "$t" --top 25 --depth 2 --merge-layers \
      > "$OUT/trace_$(basename "$t").txt" 2>&1
  done
  rm -rf "$OUT/trace"  # summarised: the raw traces do not all come back
fi
