#!/usr/bin/env bash
# Two trainer flag sets side by side on one GPU, interleaved A B A B (the machines are noisy):
# the same config, synthetic data, STEPS steps each (default 16), log window 4. Prints a table
# per run (benchmarks/summarize_ab.py: the whole run's tokens/s and MFU since the compile
# step, the windows' median, peak memory, the first step's time, the last loss).
#   A="--config.model.head_chunk=0" B="" bash benchmarks/gpu_ab.sh
#   CONFIG=configs/ablation_3b.py A="" B="--config.model.fp8=rowwise" bash benchmarks/gpu_ab.sh
# CONFIG (default configs/ablation_1b.py), STEPS, ROUNDS (default 2) and EXTRA (flags for both)
# override the defaults.
set -uo pipefail
source benchmarks/device_env.sh
SYN="--config.data.synthetic=True --config.checkpoint.every_steps=0 \
  --config.train.eval_every_steps=0 --config.log.every_steps=4 --config.log.progress_bar=False"
for round in $(seq 1 "${ROUNDS:-2}"); do
  for side in A B; do
    flags=${!side-}
    wd=/tmp/ab_${side}_${round}; rm -rf "$wd"
    start=$(date +%s)
    python3 -m deepseek41.train --config="${CONFIG:-configs/ablation_1b.py}" --workdir="$wd" \
      $SYN --config.train.steps="${STEPS:-16}" ${EXTRA:-} $flags > "$OUT/ab_${side}_${round}.log" 2>&1
    echo "$side round $round ($flags): exit $? in $(( $(date +%s) - start )) s"
    cp "$wd/metrics.jsonl" "$OUT/ab_${side}_${round}.jsonl" 2>/dev/null
    # The final save of a 3B state is ~40 GB: four runs fill the 64 GB disk (section 65).
    rm -rf "$wd"
  done
done
python3 benchmarks/summarize_ab.py "$OUT"/ab_*.jsonl --logs "$OUT" | tee "$OUT/ab_table.txt"
