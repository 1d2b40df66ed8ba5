#!/usr/bin/env bash
# One device call: the 1B ablation on synthetic data (capacity_einsum vs ragged_dot experts) and
# on the default corpus (real data pipeline, evaluation, async checkpoints). Writes to $OUT.
#   usage (on the GPU machine, repo root): bash benchmarks/gpu_ablation.sh
set -uo pipefail
OUT=${OUT:-/tmp/ds41-bench}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import jax; print(jax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"
COMMON="--config=configs/ablation_1b.py --config.log.progress_bar=False --config.log.every_steps=5"
run() {  # name, extra flags...
  local name=$1; shift
  python3 -m deepseek41.train $COMMON --workdir=/tmp/$name "$@" > "$OUT/$name.log" 2>&1
  echo "$name exit $?" | tee -a "$OUT/summary.txt"
  cp /tmp/$name/metrics.jsonl "$OUT/$name.jsonl" 2>/dev/null
  grep -E "took|tokens_per_s|eval_loss|rror|checkpoint_block" "$OUT/$name.log" | tail -6
}
SYN="--config.data.synthetic=True --config.checkpoint.every_steps=0 --config.train.eval_every_steps=0"
run syn_capacity $SYN --config.train.steps=40 --config.model.moe_backend=capacity_einsum
run syn_ragged $SYN --config.train.steps=15 --config.model.moe_backend=ragged_dot
run real_corpus --config.train.steps=60 --config.checkpoint.every_steps=30 \
  --config.train.eval_every_steps=30 --config.data.cache_dir=/tmp/ds41-cache
