#!/usr/bin/env bash
# The 1B backbone (configs/ablation_1b.py, full structure, 4K x 8) trained from scratch, then the
# DSpark stage (configs/ablation_1b_dspark.py) on its last checkpoint, with held-out acceptance
# at the stage's start, middle and end (issue 15, docs/performance.md section 13); BENCH=1 then
# measures decoding with that drafter (benchmarks/bench_generate.py: plain and speculative, host
# and device loops, batch 1 and 32; issue 48 item 4).
# BACKBONE_STEPS and DSPARK_STEPS (default 150 each) set the run lengths; everything still going
# DEADLINE_S (default 570) seconds after the start is stopped by SIGTERM (the trainer saves a
# checkpoint at the next step) and killed STOP_GRACE_S (60) later.
# Longer than one call (a drafter is worth measuring only on a backbone that has trained for a
# while): RESUME=1 keeps /tmp/bb and /tmp/dspark, so the same command again on the warm machine
# (the device releases it after ~30 s idle, so call again at once) continues the stage that
# stopped, skips the ones that finished and starts the next. E.g., three calls on one machine:
#   RESUME=1 BACKBONE_STEPS=1200 DSPARK_STEPS=300 BENCH=1 SOURCES=.corpus/code16k \
#     bash benchmarks/gpu_dspark.sh      # (carrying .whl and .corpus) x 3
# SOURCES: data.sources of both stages (default: the config's, the embedded corpus).
# SMOKE=1 runs the same commands on this CPU with configs/tiny.py / tiny_dspark.py.
set -uo pipefail
source benchmarks/device_env.sh
export TF_CPP_MIN_LOG_LEVEL=2
BB_STEPS=${BACKBONE_STEPS:-150}; DS_STEPS=${DSPARK_STEPS:-150}
if [[ -n ${SMOKE:-} ]]; then
  BB_CONFIG=configs/tiny.py; DS_CONFIG=configs/tiny_dspark.py
  SHAPE="--config.data.seq_len=128 --config.train.batch_size=4"; ANCHORS=8
  BB_STEPS=${STEPS_SMOKE:-6}; DS_STEPS=${STEPS_SMOKE:-6}
  BENCH_FLAGS="--batch_sizes=1,4 --prompt_tokens=48 --new_tokens=16 --replay_context=256 \
    --replay_n_win=8,32 --replay_sequences=8 --flop_contexts=256,1024"
  export JAX_PLATFORMS=cpu
else
  BB_CONFIG=configs/ablation_1b.py; DS_CONFIG=configs/ablation_1b_dspark.py
  SHAPE="--config.data.seq_len=4096 --config.train.batch_size=8 $(no_remat_if_it_fits)"
  ANCHORS=128  # per 4K row: 1,024 anchors x 5 slots a step
  BENCH_FLAGS="--batch_sizes=1,32 --prompt_tokens=512 --new_tokens=128 --replay_context=2048 \
    --replay_n_win=128,512 --replay_sequences=32 --flop_contexts=4096,65536"
fi
COMMON="$SHAPE --config.log.progress_bar=False --config.log.tensorboard=False \
  --config.data.cache_dir=/tmp/ds41-cache --config.train.eval_batches=4 --config.log.every_steps=10 \
  ${SOURCES:+--config.data.sources=$SOURCES}"
START=$(date +%s)
left() { echo $((${DEADLINE_S:-570} - ($(date +%s) - START))); }
finished() { [ -d "/tmp/$1/checkpoints/$2" ]; }  # name, steps
run() {  # name, config, flags...
  local name=$1 t0; shift; t0=$(date +%s)
  (($(left) > 30)) || { echo "$name skipped: $(left) s left" | tee -a "$OUT/summary.txt"; return 1; }
  timeout -s TERM -k "${STOP_GRACE_S:-60}" "$(left)" python3 -m deepseek41.train --config=$1 $COMMON \
    --workdir=/tmp/$name "${@:2}" >> "$OUT/$name.log" 2>&1
  local rc=$?
  local reached
  reached=$(latest_checkpoint /tmp/$name)
  echo "$name exit $rc wall $(($(date +%s) - t0)) s, last checkpoint ${reached:-none}" \
    | tee -a "$OUT/summary.txt"
  cp /tmp/$name/metrics.jsonl "$OUT/$name.jsonl" 2>/dev/null
  grep -E "first step|initiali|restored|resum|backbone|finished|stopped|rror" "$OUT/$name.log" \
    | cut -c1-300 | tail -8
  return $rc
}
[[ -n ${RESUME:-} ]] || rm -rf /tmp/bb /tmp/dspark
# Checkpoints every 250 steps besides the stop signal's, so that a kill loses little.
finished bb $BB_STEPS || run bb $BB_CONFIG --config.train.steps=$BB_STEPS \
  --config.train.warmup_steps=40 --config.train.eval_every_steps=0 \
  --config.checkpoint.every_steps=$((BB_STEPS < 250 ? BB_STEPS : 250))
if finished bb $BB_STEPS && ! finished dspark $DS_STEPS; then
  run dspark $DS_CONFIG --config.dspark.backbone_checkpoint=/tmp/bb/checkpoints/$BB_STEPS \
    --config.dspark.anchors_per_sequence=$ANCHORS --config.train.steps=$DS_STEPS \
    --config.train.warmup_steps=20 --config.train.eval_every_steps=$((DS_STEPS / 2)) \
    --config.checkpoint.every_steps=$((DS_STEPS < 250 ? DS_STEPS : 250))
fi
grep -h eval_dspark "$OUT/dspark.jsonl" 2>/dev/null | cut -c1-400
if [[ -n ${BENCH:-} ]] && finished dspark $DS_STEPS; then
  (($(left) > 90)) || { echo "bench skipped: $(left) s left (RESUME=1: call again)" \
    | tee -a "$OUT/summary.txt"; exit 0; }
  timeout -s KILL "$(left)" python3 benchmarks/bench_generate.py --workdir=/tmp/dspark \
    $BENCH_FLAGS --deadline_s=$(($(left) - 60)) --out="$OUT/generate.json" > "$OUT/generate.log" 2>&1
  echo "bench exit $? wall $(($(date +%s) - START)) s" | tee -a "$OUT/summary.txt"
  grep -vE "^[IW][0-9]{4}" "$OUT/generate.log" | grep -E "^(plain|speculative|replay|flops)|rror" \
    | cut -c1-400
fi
