#!/usr/bin/env bash
# Residual ablation on one H200 (issue 4): single-pass mHC, multi-pass mHC and the plain residual
# trained on the same data order and token budget. The 1B model at 4K tokens, window attention
# only, on the default corpus (16K BPE); held-out loss every EVAL steps. Writes logs to $OUT.
#   STEPS=200 EVAL=100 bash benchmarks/gpu_residual.sh [residual ...]
set -uo pipefail
source benchmarks/device_env.sh
residuals=${*:-mhc_single_pass mhc_multi_pass plain}
python3 -c "from deepseek41.data.default_corpus import default_corpus_dir as d; \
print(d('/tmp/ds41-cache', 16384, progress=False))" > "$OUT/corpus.txt" 2>&1
for residual in $residuals; do
  start=$(date +%s)
  python3 -m deepseek41.train --config=configs/ablation_1b.py --config.log.progress_bar=False \
    --workdir=/tmp/res_$residual --config.data.cache_dir=/tmp/ds41-cache \
    --config.checkpoint.every_steps=0 --config.train.steps=${STEPS:-200} \
    --config.train.eval_every_steps=${EVAL:-100} --config.train.eval_batches=8 \
    --config.log.every_steps=10 --config.data.seq_len=4096 --config.train.batch_size=8 \
    --config.train.remat=none --config.train.warmup_steps=20 \
    --config.model.attention_variant=window --config.model.swa_quant=none \
    --config.model.residual=$residual > "$OUT/residual_$residual.log" 2>&1
  echo "$residual exit $? wall $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
  cp /tmp/res_$residual/metrics.jsonl "$OUT/residual_$residual.jsonl"
  grep -E "took|rror" "$OUT/residual_$residual.log" | tail -3 | cut -c1-200
done
