#!/usr/bin/env bash
# The long-context ablation on one GPU: CSA2 vs dense attention vs window-only at the same
# tokens, trained on text mixed with MQAR, passkey and needle documents, then scored at 4K-64K by
# `python -m deepseek41.eval` (README, "Long-context evaluation"). One device call per variant:
# train for TRAIN_S seconds at most (SIGTERM: the run saves and stops), evaluate, then delete
# the checkpoint.
#   bash benchmarks/gpu_longctx.sh csa2      # configs/ablation_longctx.py as shipped
#   bash benchmarks/gpu_longctx.sh dense     # every ratio > 0 layer attends to all its tokens
#   bash benchmarks/gpu_longctx.sh window    # sliding window only
#   python3 benchmarks/summarize_longctx.py $OUT/longctx_*.json   # the three side by side
# Each variant trains STEPS (default 1000) steps of 4 x 16,384 tokens (the same batches: one
# seed) or until TRAIN_S (default 420) seconds, whichever comes first, the trainer scoring
# mqar@16k and passkey@16k at its evaluations, then evaluates every task at 4K-64K (YaRN covers
# 4 x 16,384 = 65,536 positions) at five depths. configs/ablation_longctx.py (0.16B) rather than
# the 1B model: retrieval is learned late (docs/performance.md section 38), and the 1B model
# takes about 500 steps at this shape in a call. Every MQAR pair is asked (64 of 64): the
# supervision a step carries is what the CPU probes say is scarce.
# Knobs (environment): CONFIG, STEPS, TRAIN_S, EXAMPLES (documents per task, length and depth;
# default 8), EVAL_TASKS, VARIANT_KEY (the config key that picks the attention: csa2 | dense |
# window), GENERATE=1 (also decode each answer greedily: slower).
set -uo pipefail
variant=${1:-csa2}
source benchmarks/device_env.sh
CONFIG=${CONFIG:-configs/ablation_longctx.py}
VARIANT_KEY=${VARIANT_KEY:-model.attention_variant}
STEPS=${STEPS:-1000}
EXAMPLES=${EXAMPLES:-8}
EVAL_TASKS=${EVAL_TASKS:-mqar@4k,mqar@16k,mqar@64k,passkey@4k,passkey@16k,passkey@32k,passkey@64k,needle@16k,needle@64k}
case "$variant" in
  csa2|dense|window) ;;
  *) echo "unknown variant $variant (csa2 | dense | window)" >&2; exit 2 ;;
esac
WORKDIR=/tmp/longctx_$variant
# 64 key:value pairs, all asked; four needles, one asked, three distractors; every task document
# fills its 16K row; only answers supervised.
timeout --signal=TERM ${TRAIN_S:-420} python3 -m deepseek41.train --config=$CONFIG \
  --workdir=$WORKDIR --config.$VARIANT_KEY=$variant --config.log.progress_bar=False \
  --config.log.every_steps=25 --config.data.seq_len=16384 --config.train.batch_size=4 \
  --config.train.steps=$STEPS --config.data.cache_dir=/tmp/ds41-cache \
  --config.data.sources=default:0.4,mqar:0.2,passkey:0.2,needle:0.2 \
  --config.tasks.mqar_pairs=64 --config.tasks.mqar_queries=64 \
  --config.tasks.needle_count=4 --config.tasks.needle_queries=1 \
  --config.train.eval_every_steps=$(( (STEPS + 1) / 2 )) --config.train.eval_batches=2 \
  --config.train.eval_tasks=mqar@16k,passkey@16k --config.tasks.eval_examples=$EXAMPLES \
  --config.checkpoint.every_steps=0 --config.checkpoint.max_to_keep=1 \
  > "$OUT/train_$variant.log" 2>&1
echo "train $variant exit $?" | tee -a "$OUT/summary.txt"
cp $WORKDIR/metrics.jsonl "$OUT/train_$variant.jsonl" 2>/dev/null
grep -E "took|eval_acc|rror" "$OUT/train_$variant.log" | tail -5 | cut -c1-300
python3 -m deepseek41.eval --workdir=$WORKDIR --tasks=$EVAL_TASKS --examples=$EXAMPLES \
  --depths=0,0.25,0.5,0.75,1 --heldout_batches=2 ${GENERATE:+--generate} \
  --out="$OUT/longctx_$variant" > "$OUT/eval_$variant.log" 2>&1
echo "eval $variant exit $?" | tee -a "$OUT/summary.txt"
tail -25 "$OUT/eval_$variant.log"
rm -rf $WORKDIR/checkpoints
