#!/usr/bin/env bash
# Throughput of the three residuals (single-pass mHC, multi-pass mHC, plain) on the 1B model at
# 4K tokens, window attention only, synthetic data, in one device call. Writes logs to $OUT.
#   STEPS=20 bash benchmarks/gpu_residual.sh
set -uo pipefail
source benchmarks/device_env.sh
for residual in mhc_single_pass mhc_multi_pass plain; do
  python3 -m deepseek41.train --config=configs/ablation_1b.py --config.log.progress_bar=False \
    --workdir=/tmp/res_$residual --config.data.synthetic=True --config.checkpoint.every_steps=0 \
    --config.train.eval_every_steps=0 --config.log.every_steps=5 --config.train.steps=${STEPS:-20} \
    --config.data.seq_len=4096 --config.train.batch_size=8 --config.train.remat=none \
    --config.model.csa2=False --config.model.swa_quant=none \
    --config.model.residual=$residual > "$OUT/residual_$residual.log" 2>&1
  echo "$residual exit $?"; cp /tmp/res_$residual/metrics.jsonl "$OUT/residual_$residual.jsonl"
  grep -E "took|step [0-9]+:" "$OUT/residual_$residual.log" | tail -3 | cut -c1-200
done
