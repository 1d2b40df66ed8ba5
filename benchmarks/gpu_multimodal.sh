#!/usr/bin/env bash
# Multimodal configs/ablation_1b.py on one GPU (issue 5): the 1B LM at 4K tokens x 4 rows with
# a 6-layer DeepSeek-ViT (dim 512, patch 14) trained from scratch on the embedded shapes task
# at 448x448 px (32x32 patches -> 11x11 = 121 LM tokens per image) mixed with the default
# corpus (batch 4: 8 rows with images do not fit without remat). Reports images/s and tokens/s (metrics.jsonl). Writes logs to $OUT.
#   STEPS=60 bash benchmarks/gpu_multimodal.sh [--config.key=value ...]
#   NAME=nocsa2 STEPS=30 bash benchmarks/gpu_multimodal.sh --config.model.attention_variant=window
set -uo pipefail
source benchmarks/device_env.sh
python3 -m deepseek41.train --config=configs/ablation_1b.py --config.log.progress_bar=False \
  --workdir=/tmp/mm1b-${NAME:-multimodal} --config.data.cache_dir=/tmp/ds41-cache \
  --config.checkpoint.every_steps=0 --config.train.steps=${STEPS:-60} \
  --config.train.eval_every_steps=${EVAL:-60} --config.train.eval_batches=4 \
  --config.log.every_steps=10 --config.data.seq_len=4096 --config.train.batch_size=${BATCH:-4} \
  --config.train.remat=none --config.train.warmup_steps=10 --config.data.num_workers=8 \
  --config.model.vision=True --config.model.vision_layers=6 --config.model.vision_dim=512 \
  --config.model.vision_heads=8 --config.model.vision_mlp=1408 --config.model.vision_patch=14 \
  --config.model.vision_max_image_tokens=121 --config.data.max_images_per_row=16 \
  --config.data.shapes_image_size=448 --config.data.sources=default:0.1 \
  --config.data.image_sources=shapes:0.9 "$@" > "$OUT/${NAME:-multimodal}.log" 2>&1
echo "exit $?"
cp /tmp/mm1b-${NAME:-multimodal}/metrics.jsonl "$OUT/${NAME:-multimodal}.jsonl"
grep -E "took|parameters|rror" "$OUT/${NAME:-multimodal}.log" | tail -5 | cut -c1-300
