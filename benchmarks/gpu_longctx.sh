#!/usr/bin/env bash
# The long-context ablation on one GPU: CSA2 vs dense attention vs window-only at the same
# tokens, trained on MQAR, passkey and needle documents, then scored at 4K-64K by
# `python -m deepseek41.eval` (README, "Long-context evaluation"). One device call per variant:
#   bash benchmarks/gpu_longctx.sh csa2      # configs/ablation_longctx.py as shipped
#   bash benchmarks/gpu_longctx.sh dense     # every ratio > 0 layer attends to all its tokens
#   bash benchmarks/gpu_longctx.sh window    # sliding window only
#   python3 benchmarks/summarize_longctx.py $OUT/longctx_*.json   # the three side by side
# Two stages, as long-context models are trained (short first, then extended): SHORT_STEPS
# (300) steps of SHORT_BATCH x SHORT_LEN (16 x 4,096) tokens, the task documents
# SHORT_TASK_LEN (1,024) tokens long, four to a row, where the formats and the copying are
# learned cheaply (dense attention costs 0.56 GFLOP a token at 4K against 1.47 at 16K, and a
# step carries up to 16 times the task documents of a 4 x 16,384 one), then, from its weights
# (checkpoint.init_from: a fresh optimizer, warm-up WARMUP2), STEPS (70) steps of 4 x 16,384.
# Each stage stops at its step count or its time budget (SHORT_S, TRAIN_S: SIGTERM saves and
# stops), whichever comes first; the steps each reached are in summary.txt (the same tokens
# only if all reach their counts). Then every task is evaluated at 4K-64K (YaRN covers
# 4 x 16,384 = 65,536 positions) at five depths, and the checkpoints are deleted.
# Why this shape (docs/performance.md sections 38, 40, 42, 43): retrieval forms late, so
# configs/ablation_longctx.py (0.16B) rather than the 1B model, trained with muon_hybrid (on
# the CPU it formed MQAR retrieval about ten times sooner than AdamW), on task documents only
# (beside text rows the answers were a few hundred of a step's 65,536 supervised tokens, and
# dense attention had not learned even the answers' digits after 175 steps), without the
# trainer's evaluations (each costs its compilation, 31-34 s on the H100; SHORT_EVERY=N
# evaluates the short stage every N steps). The budget on an H100 (section 42): a stage's
# first step 52-56 s with AdamW (muon_hybrid compiled about 40 s longer on the 1B model), then
# 0.36 s a step at 16 x 4,096 and 1.15 s at 4 x 16,384 (dense; CSA2 and window are faster), so
# 215 + 185 s of training and about 160 s of evaluation fit a 10-minute call.
# Knobs (environment): CONFIG, SHORT_LEN (0: no short stage), SHORT_BATCH, SHORT_STEPS,
# SHORT_TASK_LEN, SHORT_S (215 s), SHORT_EVERY (0), STEPS, TRAIN_S (185 s), EVAL_S, WARMUP2, SOURCES,
# EXAMPLES (documents per task, length and depth; default 6), EVAL_TASKS, VARIANT_KEY (the
# config key that picks the attention: csa2 | dense | window), GENERATE=1 (also decode each
# answer greedily: slower), LEN (the long stage's tokens a row; default 16384), BATCH (4) and
# TASK_FLAGS (the tasks' sizes), SHORT_EXTRA (trainer flags of the short stage alone, e.g. a
# wider selection while the tasks are learned: --config.model.index_topk=1024, a quarter of
# the entries at 4K, as many as the candidate pool holds; the weights carry over, the
# selection's size is not a parameter).
# On the CPU, in two minutes:
#   PATH=.venv/bin:$PATH OUT=/tmp/lc CONFIG=configs/tiny.py SHORT_LEN=256 SHORT_BATCH=4 \
#     SHORT_TASK_LEN=128 SHORT_STEPS=6 SHORT_EVERY=6 STEPS=4 LEN=256 BATCH=2 TASK_FLAGS=" " \
#     EXAMPLES=2 EVAL_TASKS=mqar@256,passkey@256 bash benchmarks/gpu_longctx.sh csa2
# A call that ends during the evaluation (its report is written cell by cell) leaves the
# checkpoint on the machine: while the machine is warm, `EVAL_ONLY=1 PARTIAL=<the returned
# longctx_VARIANT.json, carried> bash benchmarks/gpu_longctx.sh VARIANT` evaluates the missing
# cells only (section 49 did this by hand).
# Side by side: `bash benchmarks/gpu_longctx.sh dense csa2` trains the variants at once on the
# one GPU, each a process with 1/N of its memory (XLA_PYTHON_CLIENT_MEM_FRACTION), so their
# compilations (CPU-bound, about a third of a stage) overlap and one call holds the comparison.
# Give step counts, not only budgets, so both see the same tokens: e.g. SHORT_STEPS=200
# STEPS=50 SHORT_S=300 TRAIN_S=210. On a GPU under 100 GB (an H100) each batch is halved and
# each step count doubled: the same tokens in each process's share of the memory.
set -uo pipefail
variant=${1:-csa2}
source benchmarks/device_env.sh
if [ $# -gt 1 ]; then
  gb=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
  if [ -n "$gb" ] && [ "$gb" -lt 100000 ]; then
    export SHORT_BATCH=$(( ${SHORT_BATCH:-16} / 2 )) BATCH=$(( ${BATCH:-4} / 2 ))
    export SHORT_STEPS=$(( ${SHORT_STEPS:-300} * 2 )) STEPS=$(( ${STEPS:-70} * 2 ))
  fi
  export XLA_PYTHON_CLIENT_MEM_FRACTION=$(python3 -c "print(round(0.92 / $#, 2))")
  echo "side by side: $* (memory fraction $XLA_PYTHON_CLIENT_MEM_FRACTION each, GPU ${gb:-?} MiB)" \
    | tee -a "$OUT/summary.txt"
  for v in "$@"; do bash "$0" "$v" > "$OUT/side_$v.txt" 2>&1 & done
  wait
  for v in "$@"; do tail -n 30 "$OUT/side_$v.txt"; done
  exit 0
fi
CONFIG=${CONFIG:-configs/ablation_longctx.py}
VARIANT_KEY=${VARIANT_KEY:-model.attention_variant}
SHORT_LEN=${SHORT_LEN:-4096}
STEPS=${STEPS:-70}
LEN=${LEN:-16384}
EXAMPLES=${EXAMPLES:-6}
# Task documents only (section 43): beside text rows, whose every token is supervised, the
# answers were a few hundred of a step's 65,536 supervised tokens, and the model had not
# learned even the answers' digits by step 175 (section 42).
SOURCES=${SOURCES:-mqar:0.4,passkey:0.3,needle:0.3}
EVAL_TASKS=${EVAL_TASKS:-mqar@4k,mqar@16k,mqar@64k,passkey@4k,passkey@16k,passkey@32k,passkey@64k,needle@16k,needle@64k}
case "$variant" in
  csa2|dense|window) ;;
  *) echo "unknown variant $variant (csa2 | dense | window)" >&2; exit 2 ;;
esac
WORKDIR=/tmp/longctx_$variant
SHORT_WORKDIR=/tmp/longctx_short_$variant
if [ -n "${EVAL_ONLY:-}" ]; then  # the header's resume: no training, PARTIAL's cells kept
  [ -n "$(latest_checkpoint $WORKDIR)" ] || {
    echo "EVAL_ONLY: no checkpoint in $WORKDIR/checkpoints (a fresh machine: train again)" \
      | tee -a "$OUT/summary.txt"; exit 1; }
  if [ -n "${PARTIAL:-}" ]; then
    [ -f "$PARTIAL" ] || { echo "PARTIAL=$PARTIAL: no such file" >&2; exit 2; }
    cp "$PARTIAL" "$OUT/longctx_$variant.json"
  fi
else
  rm -rf $WORKDIR $SHORT_WORKDIR
fi
# 64 key:value pairs, all asked; four needles, one asked, three distractors; every task document
# fills its row; only answers supervised.
TASK_FLAGS=${TASK_FLAGS:---config.tasks.mqar_pairs=64 --config.tasks.mqar_queries=64 \
  --config.tasks.needle_count=4 --config.tasks.needle_queries=1}
COMMON="--config=$CONFIG --config.$VARIANT_KEY=$variant --config.log.progress_bar=False \
  --config.log.every_steps=25 --config.data.cache_dir=/tmp/ds41-cache \
  --config.data.sources=$SOURCES $TASK_FLAGS \
  --config.train.eval_batches=2 --config.tasks.eval_examples=$EXAMPLES \
  --config.checkpoint.every_steps=0 --config.checkpoint.max_to_keep=1"
stage() {  # name, workdir, seconds, steps, eval every, length, flags...
  # No step-0 evaluation: its compilation took 31-34 s of each stage's budget (section 42).
  local name=$1 wd=$2 seconds=$3 steps=$4 every=$5 len=$6; shift 6
  timeout --signal=TERM "$seconds" python3 -m deepseek41.train $COMMON --workdir=$wd \
    --config.data.seq_len=$len --config.train.steps=$steps \
    --config.train.eval_every_steps=$every --config.train.eval_at_start=False \
    --config.train.eval_tasks=mqar@$len,passkey@$len "$@" > "$OUT/${name}_$variant.log" 2>&1
  local rc=$?
  local reached
  reached=$(python3 -c "import json,sys; print(max((json.loads(l).get('step', 0) for l in open(sys.argv[1])), default=0))" \
    $wd/metrics.jsonl 2>/dev/null)
  echo "$name $variant exit $rc at step ${reached:-?} of $steps" | tee -a "$OUT/summary.txt"
  cp $wd/metrics.jsonl "$OUT/${name}_$variant.jsonl" 2>/dev/null
  grep -E "took|eval_acc|rror" "$OUT/${name}_$variant.log" | tail -4 | cut -c1-300
}
if [ -z "${EVAL_ONLY:-}" ]; then
  INIT=""
  if [ "$SHORT_LEN" != 0 ]; then
    stage short $SHORT_WORKDIR ${SHORT_S:-215} ${SHORT_STEPS:-300} ${SHORT_EVERY:-0} $SHORT_LEN \
      --config.train.batch_size=${SHORT_BATCH:-16} --config.tasks.length=${SHORT_TASK_LEN:-1024} \
      ${SHORT_EXTRA:-}
    last=$(latest_checkpoint $SHORT_WORKDIR)
    [ -n "$last" ] || {
      echo "short $variant saved no checkpoint" | tee -a "$OUT/summary.txt"; exit 1; }
    INIT="--config.checkpoint.init_from=$SHORT_WORKDIR/checkpoints/$last \
      --config.train.warmup_steps=${WARMUP2:-10}"
  fi
  stage train $WORKDIR ${TRAIN_S:-185} $STEPS 0 $LEN --config.train.batch_size=${BATCH:-4} $INIT
fi
# EVAL_S: the evaluation's own limit (SIGTERM), so that a call's end keeps the cells it finished
# (the report is written after each one, "complete": false until the end).
timeout --signal=TERM -k 15 "${EVAL_S:-900}" python3 -m deepseek41.eval --workdir=$WORKDIR \
  --tasks=$EVAL_TASKS --examples=$EXAMPLES \
  --depths=0,0.25,0.5,0.75,1 --heldout_batches=2 ${GENERATE:+--generate} \
  --out="$OUT/longctx_$variant" > "$OUT/eval_$variant${EVAL_ONLY:+_resumed}.log" 2>&1
rc=$?
echo "eval $variant exit $rc" | tee -a "$OUT/summary.txt"
tail -25 "$OUT/eval_$variant${EVAL_ONLY:+_resumed}.log"
# An unfinished evaluation keeps the checkpoint for EVAL_ONLY=1 on the same (warm) machine.
[ $rc != 0 ] || rm -rf $WORKDIR/checkpoints $SHORT_WORKDIR/checkpoints
