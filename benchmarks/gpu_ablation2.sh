#!/usr/bin/env bash
# Second device call: steady-state checkpoint blocking and expert drops over 120 steps on the
# default corpus (released bias rate vs 0.01), and the cost of block remat. Writes to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/ds41-bench}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
COMMON="--config=configs/ablation_1b.py --config.log.progress_bar=False --config.log.every_steps=10"
run() {
  local name=$1; shift
  python3 -m deepseek41.train $COMMON --workdir=/tmp/$name "$@" > "$OUT/$name.log" 2>&1
  echo "$name exit $?" | tee -a "$OUT/summary.txt"
  cp /tmp/$name/metrics.jsonl "$OUT/$name.jsonl" 2>/dev/null
  grep -E "took|step (10|60|120):|rror" "$OUT/$name.log" | tail -5
}
REAL="--config.train.steps=120 --config.checkpoint.every_steps=40 --config.train.eval_every_steps=60 --config.data.cache_dir=/tmp/ds41-cache"
run real_rate001 $REAL
run real_rate01 $REAL --config.model.router_bias_rate=0.01
run syn_remat --config.data.synthetic=True --config.checkpoint.every_steps=0 \
  --config.train.eval_every_steps=0 --config.train.steps=30 --config.train.remat=block
