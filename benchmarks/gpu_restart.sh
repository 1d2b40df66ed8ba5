#!/usr/bin/env bash
# Start-up on one GPU (issue 47 item 5): a cold start with an empty compilation cache, a restart
# of the same run from its checkpoint, and a fresh run of the same config with the cache warm.
# For each: seconds from the process's launch to its first step's line, and the trainer's own
# start-up lines (initialisation, first step, what the persistent cache and the executable store
# loaded). RUNS picks and orders them (default: cold restart restart_nostore fresh_warm;
# restart_nostore is the same restart with the executable store off; restore, not in the
# default, times a checkpoint's verification and restore alone: benchmarks/bench_restore.py,
# RESTORE_GB gigabytes, default 8; cold_autotune0, not in the default, a cold start with XLA's
# autotuning off, last: it empties the cache).
#   bash benchmarks/gpu_restart.sh                    # configs/ablation_1b.py at 8 x 4,096
#   CONFIG=configs/ablation_1b.py EXTRA="" bash benchmarks/gpu_restart.sh   # as shipped (64K)
set -uo pipefail
source benchmarks/device_env.sh
CONFIG=${CONFIG:-configs/ablation_1b.py}
EXTRA=${EXTRA---config.data.seq_len=4096 --config.train.batch_size=8 --config.train.remat=none}
CACHE=/tmp/restart_cache; rm -rf "$CACHE" /tmp/restart_a /tmp/restart_b /tmp/restart_c /tmp/restart_d
COMMON="--config.data.synthetic=True --config.log.every_steps=1 --config.log.progress_bar=False \
  --config.train.eval_every_steps=0 --config.checkpoint.every_steps=2 \
  --config.train.compilation_cache_dir=$CACHE $EXTRA"

# Every run has the same train.steps (4) and stops where it should with --stop_at_step. (Since
# section 63 the schedule's numbers are the step's argument, so another step count would load
# the same program; section 51's first version of this script compiled its step again.)
run() {  # name workdir [--stop_at_step=N]
  local t0; t0=$(date +%s.%N)
  python3 -m deepseek41.train --config="$CONFIG" --workdir="$2" $COMMON \
    --config.train.steps=4 ${3:-} > "$OUT/restart_$1.log" 2>&1
  local rc=$? t1; t1=$(date +%s.%N)
  # the log's clock has whole seconds: the first step's line against the launch
  local first; first=$(grep -m1 -E "INFO step [0-9]+:" "$OUT/restart_$1.log" | cut -c1-8)
  local launch; launch=$(date -d "@${t0%.*}" +%H:%M:%S)
  echo "$1: exit $rc, process $(python3 -c "print(round($t1 - $t0, 1))") s, launch $launch," \
    "first step line $first" | tee -a "$OUT/restart_summary.txt"
  grep -E "initialised|resumed|first step|compil|executable" "$OUT/restart_$1.log" | cut -c1-400 \
    | tee -a "$OUT/restart_summary.txt"
}
RUNS=${RUNS:-cold restart restart_nostore fresh_warm}
for r in $RUNS; do
  case $r in
    # empty cache: compiles and writes every program; a copy of its step-2 work directory
    cold) run cold /tmp/restart_a --stop_at_step=2; rm -rf /tmp/restart_c
          cp -r /tmp/restart_a /tmp/restart_c;;
    restart) run restart /tmp/restart_a;;  # the same run from its step-2 checkpoint
    # the same restart (of the copy) with the persistent cache alone: the step traced and
    # lowered to find it there
    restart_nostore) run restart_nostore /tmp/restart_c --config.train.store_executables=False;;
    fresh_warm) run fresh_warm /tmp/restart_b --stop_at_step=2;;  # a new run, the cache warm
    # a cold start without XLA's GEMM and fusion autotuning (the compile's share of it; its step
    # times beside cold's say what the autotuning buys)
    cold_autotune0) rm -rf "$CACHE"; XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" \
                      run cold_autotune0 /tmp/restart_d --stop_at_step=4;;
    # the restore's parts on this host: a synthetic fp32 state, zstd and uncompressed
    # (docs/performance.md section 62)
    restore) timeout -s KILL 300 python3 benchmarks/bench_restore.py --gb="${RESTORE_GB:-8}" \
               --repeats=1 --dir=/tmp/bench_restore 2>&1 | grep -E '^\{|rror' \
               | tee -a "$OUT/restart_summary.txt";;
  esac
done
