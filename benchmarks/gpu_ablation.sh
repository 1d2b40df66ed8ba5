#!/usr/bin/env bash
# The 1B ablation on one GPU, in one device call. Writes logs and metrics to $OUT.
#   bash benchmarks/gpu_ablation.sh throughput   # synthetic data: capacity_einsum vs ragged_dot
#                                                # experts, then 60 steps on the default corpus
#   bash benchmarks/gpu_ablation.sh long         # 120 corpus steps (bias rate 0.001 vs 0.01,
#                                                # checkpoints every 40) and the cost of remat
set -uo pipefail
mode=${1:-throughput}
source benchmarks/device_env.sh
# Section 1 of docs/performance.md: the 1B model at 4K tokens, window attention only.
COMMON="--config=configs/ablation_1b.py --config.log.progress_bar=False \
  --config.data.seq_len=4096 --config.train.batch_size=8 --config.train.remat=none \
  --config.model.attention_variant=window --config.model.kv_quant=none \
  --config.model.index_quant=none \
  --config.model.swa_quant=none"
run() {  # name, extra flags...
  local name=$1; shift
  python3 -m deepseek41.train $COMMON --workdir=/tmp/$name "$@" > "$OUT/$name.log" 2>&1
  echo "$name exit $?" | tee -a "$OUT/summary.txt"
  cp /tmp/$name/metrics.jsonl "$OUT/$name.jsonl" 2>/dev/null
  rm -rf /tmp/$name/checkpoints  # 13 GB each: the machine's disk holds few
  grep -E "took|step (10|40|60|120):|rror" "$OUT/$name.log" | tail -5
}
SYN="--config.data.synthetic=True --config.checkpoint.every_steps=0 --config.train.eval_every_steps=0"
CORPUS="--config.data.cache_dir=/tmp/ds41-cache"
case "$mode" in
  throughput)
    run syn_capacity $SYN --config.log.every_steps=5 --config.train.steps=40 --config.model.moe_backend=capacity_einsum
    run syn_ragged $SYN --config.log.every_steps=5 --config.train.steps=15 --config.model.moe_backend=ragged_dot
    run real_corpus $CORPUS --config.log.every_steps=5 --config.train.steps=60 \
      --config.checkpoint.every_steps=30 --config.train.eval_every_steps=30 ;;
  long)
    LONG="$CORPUS --config.log.every_steps=10 --config.train.steps=120 --config.checkpoint.every_steps=40 --config.train.eval_every_steps=60"
    run real_rate001 $LONG
    run real_rate01 $LONG --config.model.router_bias_rate=0.01
    run syn_remat $SYN --config.log.every_steps=10 --config.train.steps=30 --config.train.remat=block ;;
  *) echo "unknown mode $mode (throughput | long)" >&2; exit 2 ;;
esac
