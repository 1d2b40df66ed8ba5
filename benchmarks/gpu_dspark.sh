#!/usr/bin/env bash
# Issue 15's H200 measurement (docs/performance.md section 13), one device call: the 1B backbone
# (configs/ablation_1b.py, full structure, 4K x 8) trained briefly from scratch, then the DSpark
# stage (configs/ablation_1b_dspark.py) on its last checkpoint, with held-out acceptance at the
# stage's start, middle and end. BACKBONE_STEPS and DSPARK_STEPS (default 150 each) set the run
# lengths; a run still going DEADLINE_S (default 570) seconds after the start is killed.
# SMOKE=1 runs the same commands on this CPU with configs/tiny.py / tiny_dspark.py.
set -uo pipefail
source benchmarks/device_env.sh
export TF_CPP_MIN_LOG_LEVEL=2
BB_STEPS=${BACKBONE_STEPS:-150}; DS_STEPS=${DSPARK_STEPS:-150}
if [[ -n ${SMOKE:-} ]]; then
  BB_CONFIG=configs/tiny.py; DS_CONFIG=configs/tiny_dspark.py
  SHAPE="--config.data.seq_len=128 --config.train.batch_size=4"; ANCHORS=8
  BB_STEPS=${STEPS_SMOKE:-6}; DS_STEPS=${STEPS_SMOKE:-6}
  export JAX_PLATFORMS=cpu
else
  BB_CONFIG=configs/ablation_1b.py; DS_CONFIG=configs/ablation_1b_dspark.py
  SHAPE="--config.data.seq_len=4096 --config.train.batch_size=8 --config.train.remat=none"
  ANCHORS=128  # per 4K row: 1,024 anchors x 5 slots a step
fi
COMMON="$SHAPE --config.log.progress_bar=False --config.log.tensorboard=False \
  --config.data.cache_dir=/tmp/ds41-cache --config.train.eval_batches=4 --config.log.every_steps=10"
START=$(date +%s)
left() { echo $((${DEADLINE_S:-570} - ($(date +%s) - START))); }
run() {  # name, config, flags...
  local name=$1 t0; shift; t0=$(date +%s)
  (($(left) > 30)) || { echo "$name skipped: $(left) s left" | tee -a "$OUT/summary.txt"; return 1; }
  timeout -s KILL "$(left)" python3 -m deepseek41.train --config=$1 $COMMON --workdir=/tmp/$name "${@:2}" \
    > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name exit $rc wall $(($(date +%s) - t0)) s" | tee -a "$OUT/summary.txt"
  cp /tmp/$name/metrics.jsonl "$OUT/$name.jsonl" 2>/dev/null
  grep -E "first step|initiali|restored|backbone|finished|rror" "$OUT/$name.log" | cut -c1-300 | tail -8
  return $rc
}
rm -rf /tmp/bb /tmp/dspark
run bb $BB_CONFIG --config.train.steps=$BB_STEPS --config.train.warmup_steps=40 \
  --config.train.eval_every_steps=0 --config.checkpoint.every_steps=$BB_STEPS \
  && run dspark $DS_CONFIG --config.dspark.backbone_checkpoint=/tmp/bb/checkpoints/$BB_STEPS \
    --config.dspark.anchors_per_sequence=$ANCHORS --config.train.steps=$DS_STEPS \
    --config.train.warmup_steps=20 --config.train.eval_every_steps=$((DS_STEPS / 2)) \
    --config.checkpoint.every_steps=0
grep -h eval_dspark "$OUT/dspark.jsonl" 2>/dev/null | cut -c1-400
