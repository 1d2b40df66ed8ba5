#!/usr/bin/env bash
# Issue 14's 2-GPU measurement (docs/performance.md section 12), one device call per mode, on
# nvidia-h200-x2. Every run trains ablation_1b.py on the default corpus at the same global batch;
# benchmarks/summarize_scaleout.py compares the loss curves and tokens/s per GPU to the 1-GPU run
# of the same call.
#   bash benchmarks/gpu_scaleout.sh window   # window-only, plain residual, 4K x 16: 1 GPU against
#                                            # data=2, expert=2 and fsdp=2 in one process
#   bash benchmarks/gpu_scaleout.sh restore  # the same 1 GPU and fsdp=2, then 2 processes
#                                            # (launch/local.sh, data=2) whose checkpoint one
#                                            # process on one GPU restores and trains on
#   bash benchmarks/gpu_scaleout.sh full     # the full structure (CSA2, FP4/FP8 QAT, mHC) 4K x 8 on
#                                            # 1 GPU and data=2; a profile of expert=2
#   bash benchmarks/gpu_scaleout.sh expert   # window-only 4K x 16: 1 GPU against expert=2 with the
#                                            # allgather exchange (the default), with its partials
#                                            # in bf16, bounded at 1.25 N K, and padded (last: the
#                                            # deadline may cut it)
#   bash benchmarks/gpu_scaleout.sh tensor   # window-only 4K x 16: 1 GPU against tensor=2 with
#                                            # sequence parallelism on (the default) and off
# WARMUP (default 40) sets train.warmup_steps; STEPS (default 40) the run length; a run still going
# DEADLINE_S (default 570) seconds after the start is killed, and later runs are skipped (a device
# call gets 600 s and the rest must still come back). SMOKE=1 runs the
# same commands on this CPU with configs/tiny.py and fake devices (checks the script, not numbers).
set -uo pipefail
mode=${1:-window}
source benchmarks/device_env.sh
export TF_CPP_MIN_LOG_LEVEL=2
STEPS=${STEPS:-40}
if [[ -n ${SMOKE:-} ]]; then
  CONFIG=configs/tiny.py
  SHAPE="--config.data.seq_len=128"
  WINDOW_BATCH=8; FULL_BATCH=4; STEPS=${STEPS_SMOKE:-6}; LOG_EVERY=2
  export JAX_PLATFORMS=cpu
else
  CONFIG=configs/ablation_1b.py
  SHAPE="--config.data.seq_len=4096"
  WINDOW_BATCH=16; FULL_BATCH=8; LOG_EVERY=5
fi
# A short warmup so the curves move in STEPS steps (10 made the 1B model spike at step 20, and
# the curves of different meshes part there; 40 did not).
# streams 2: every run reads the same documents into the same rows, whatever its process count.
COMMON="--config=$CONFIG --config.data.streams=2 $SHAPE --config.log.progress_bar=False --config.log.tensorboard=False \
  --config.train.steps=$STEPS --config.train.warmup_steps=${WARMUP:-40} --config.train.remat=none \
  --config.train.eval_every_steps=0 --config.checkpoint.every_steps=0 \
  --config.log.every_steps=$LOG_EVERY --config.data.cache_dir=/tmp/ds41-cache"
WINDOW="--config.train.batch_size=$WINDOW_BATCH --config.model.attention_variant=window \
  --config.model.residual=plain --config.model.kv_quant=none --config.model.index_quant=none \
  --config.model.swa_quant=none"
FULL="--config.train.batch_size=$FULL_BATCH"

START=$(date +%s)
left() { echo $((${DEADLINE_S:-570} - ($(date +%s) - START))); }
devices() {  # N: the environment of a process that sees N devices
  if [[ -n ${SMOKE:-} ]]; then
    echo "XLA_FLAGS=--xla_force_host_platform_device_count=$1"
  else
    echo "CUDA_VISIBLE_DEVICES=$(seq -s, 0 $(($1 - 1)))"
  fi
}
finish() {  # name, exit status, start time
  echo "$1 exit $2 wall $(($(date +%s) - $3)) s" | tee -a "$OUT/summary.txt"
  cp /tmp/$1/metrics.jsonl "$OUT/$1.jsonl" 2>/dev/null
  grep -E "mesh|first step|initiali|restored|rror" "$OUT/$1.log" | cut -c1-300 | tail -8
}
run() {  # name, devices, flags...: one process
  local name=$1 n=$2 t0; shift 2; t0=$(date +%s)
  (($(left) > 30)) || { echo "$name skipped: $(left) s left" | tee -a "$OUT/summary.txt"; return; }
  env $(devices "$n") timeout -s KILL "$(left)" python3 -m deepseek41.train $COMMON --workdir=/tmp/$name "$@" \
    > "$OUT/$name.log" 2>&1
  finish "$name" $? "$t0"
}
run_processes() {  # name, processes, flags...: launch/local.sh, one GPU per process
  local name=$1 n=$2 t0 rc; shift 2; t0=$(date +%s)
  (($(left) > 30)) || { echo "$name skipped: $(left) s left" | tee -a "$OUT/summary.txt"; return; }
  PYTHON=python3 timeout -s KILL "$(left)" bash launch/local.sh "$n" $COMMON --workdir=/tmp/$name "$@" \
    > "$OUT/$name.log" 2>&1
  rc=$?
  for f in /tmp/$name/logs/process_*.log; do cp "$f" "$OUT/$name.$(basename "$f")"; done
  finish "$name" $rc "$t0"
}
drop_checkpoints() { rm -rf /tmp/$1/checkpoints; }  # 13 GB each at the 1B config
rm -rf /tmp/w_* /tmp/f_*

case "$mode" in
  window)
    run w_gpu1 1 $WINDOW; drop_checkpoints w_gpu1
    run w_data2 2 $WINDOW --config.mesh.data=2; drop_checkpoints w_data2
    run w_expert2 2 $WINDOW --config.mesh.data=1 --config.mesh.expert=2; drop_checkpoints w_expert2
    run w_fsdp2 2 $WINDOW --config.mesh.data=1 --config.mesh.fsdp=2; drop_checkpoints w_fsdp2 ;;
  restore)
    run w_gpu1 1 $WINDOW; drop_checkpoints w_gpu1
    # Two processes save at STEPS/2; one process on one GPU restores that step and goes on.
    run_processes w_proc2 2 $WINDOW --stop_at_step=$((STEPS / 2))
    mv /tmp/w_proc2 /tmp/w_proc2_to_gpu1
    run w_proc2_to_gpu1 1 $WINDOW; drop_checkpoints w_proc2_to_gpu1
    run w_fsdp2 2 $WINDOW --config.mesh.data=1 --config.mesh.fsdp=2; drop_checkpoints w_fsdp2 ;;
  full)
    run f_gpu1 1 $FULL; drop_checkpoints f_gpu1
    run f_data2 2 $FULL --config.mesh.data=2; drop_checkpoints f_data2
    # Where expert=2's step goes (command buffers off: their kernels lose the scope names).
    XLA_FLAGS=--xla_gpu_enable_command_buffer= run p_expert2 2 $WINDOW --config.mesh.data=1 \
      --config.mesh.expert=2 --config.train.steps=24 --config.log.profile_start_step=20 \
      --config.log.profile_steps=3
    python3 benchmarks/trace_summary.py /tmp/p_expert2/profile --merge-layers --depth 3 \
      > "$OUT/p_expert2_trace.txt" 2>&1; head -60 "$OUT/p_expert2_trace.txt" ;;
  expert)
    run w_gpu1 1 $WINDOW; drop_checkpoints w_gpu1
    run w_expert2 2 $WINDOW --config.mesh.data=1 --config.mesh.expert=2; drop_checkpoints w_expert2
    run w_expert2_bf16 2 $WINDOW --config.mesh.data=1 --config.mesh.expert=2 \
      --config.model.expert_partials=compute; drop_checkpoints w_expert2_bf16
    run w_expert2_bound 2 $WINDOW --config.mesh.data=1 --config.mesh.expert=2 \
      --config.model.expert_buffer_factor=1.25; drop_checkpoints w_expert2_bound
    run w_expert2_padded 2 $WINDOW --config.mesh.data=1 --config.mesh.expert=2 \
      --config.model.expert_exchange=padded; drop_checkpoints w_expert2_padded ;;
  tensor)
    run w_gpu1 1 $WINDOW; drop_checkpoints w_gpu1
    run w_tensor2 2 $WINDOW --config.mesh.data=1 --config.mesh.tensor=2; drop_checkpoints w_tensor2
    run w_tensor2_nosp 2 $WINDOW --config.mesh.data=1 --config.mesh.tensor=2 \
      --config.mesh.sequence_parallel=False; drop_checkpoints w_tensor2_nosp ;;
  *) echo "unknown mode $mode (window | restore | full | expert | tensor)" >&2; exit 2 ;;
esac
python3 benchmarks/summarize_scaleout.py "$OUT" | tee "$OUT/table.txt"
# The device tool returns few files: the logs travel as one archive.
tar czf "$OUT/logs.tgz" -C "$OUT" $(cd "$OUT" && ls *.log) && rm "$OUT"/*.log
