#!/usr/bin/env bash
# Two trainer flag sets side by side on one GPU, interleaved A B A B (the machines are noisy):
# the same config, synthetic data, STEPS steps each (default 16), log window 4. Prints a table
# per run (benchmarks/summarize_ab.py: the whole run's tokens/s and MFU since the compile
# step, the windows' median, peak memory, the first step's time, the last loss).
#   A="--config.model.head_chunk=0" B="" bash benchmarks/gpu_ab.sh
#   CONFIG=configs/ablation_3b.py A="" B="--config.model.fp8=rowwise" bash benchmarks/gpu_ab.sh
# CONFIG (default configs/ablation_1b.py), STEPS, ROUNDS (default 2) and EXTRA (flags for both)
# override the defaults. PROFILE=1 also traces steps 5-6 of each run (XLA's command buffers off,
# so kernels keep their scopes; ~1% on the step, section 15) and leaves trace_summary.py's
# tables as $OUT/trace_<side>_<round>.txt; e.g. why FP8 loses on the 3B config (part K row 6):
#   PROFILE=1 STEPS=8 ROUNDS=1 CONFIG=configs/ablation_3b.py A="" B="--config.model.fp8=rowwise" \
#     bash benchmarks/gpu_ab.sh
set -uo pipefail
source benchmarks/device_env.sh
# No final save either: nobody resumes these states (a 3B one is ~40 GB).
SYN="--config.data.synthetic=True --config.checkpoint.every_steps=0 \
  --config.checkpoint.save_at_end=False \
  --config.train.eval_every_steps=0 --config.log.every_steps=4 --config.log.progress_bar=False"
if [[ -n ${PROFILE:-} ]]; then
  SYN="$SYN --config.log.profile_start_step=5 --config.log.profile_steps=2"
  export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer="
fi
for round in $(seq 1 "${ROUNDS:-2}"); do
  for side in A B; do
    flags=${!side-}
    wd=/tmp/ab_${side}_${round}; rm -rf "$wd"
    start=$(date +%s)
    python3 -m deepseek41.train --config="${CONFIG:-configs/ablation_1b.py}" --workdir="$wd" \
      $SYN --config.train.steps="${STEPS:-16}" ${EXTRA:-} $flags > "$OUT/ab_${side}_${round}.log" 2>&1
    echo "$side round $round ($flags): exit $? in $(( $(date +%s) - start )) s"
    cp "$wd/metrics.jsonl" "$OUT/ab_${side}_${round}.jsonl" 2>/dev/null
    if [[ -n ${PROFILE:-} ]]; then
      python3 benchmarks/trace_summary.py "$wd/profile" --top 40 --merge-layers \
        > "$OUT/trace_${side}_${round}.txt" 2>&1
    fi
    # Nothing is saved (save_at_end off); the traces are not needed once summarised.
    rm -rf "$wd"
  done
done
python3 benchmarks/summarize_ab.py "$OUT"/ab_*.jsonl --logs "$OUT" | tee "$OUT/ab_table.txt"
