#!/usr/bin/env bash
# CSA2 on one GPU, in one device call per mode. Writes logs and JSON lines to $OUT.
#   bash benchmarks/gpu_csa2.sh layers     # fake-quant check; Full/Reuse layers vs cuDNN, 16K+64K
#   bash benchmarks/gpu_csa2.sh long       # the same at 128K, plus the ratio-1 candidate source
#   bash benchmarks/gpu_csa2.sh long128    # only the 128K part of `long`
#   bash benchmarks/gpu_csa2.sh train      # configs/ablation_1b.py at 65,536 tokens per sequence
set -uo pipefail
mode=${1:-layers}
source benchmarks/device_env.sh
case "$mode" in
  layers)
    python3 benchmarks/check_fake_quant.py > "$OUT/fake_quant.txt" 2>&1; echo "fake quant exit $?"
    tail -15 "$OUT/fake_quant.txt"
    python3 benchmarks/bench_index_scores.py --out "$OUT/index_scores.jsonl" 2>&1 | tail -4 | cut -c1-250
    python3 benchmarks/bench_csa2.py --seq_lens 16384,65536 --layers full2,reuse2 --reps 5 \
      --out "$OUT/csa2_layers.jsonl" > "$OUT/csa2_layers.log" 2>&1; echo "bench exit $?"
    python3 benchmarks/summarize_csa2.py "$OUT/csa2_layers.jsonl" ;;
  long128)
    python3 benchmarks/bench_csa2.py --seq_lens 131072 --layers full2,reuse2 --reps 3 \
      --out "$OUT/csa2_long.jsonl" > "$OUT/csa2_long.log" 2>&1; echo "bench exit $?"
    python3 benchmarks/summarize_csa2.py "$OUT/csa2_long.jsonl" ;;
  long)
    python3 benchmarks/bench_csa2.py --seq_lens 131072 --layers full2,reuse2 --reps 3 \
      --out "$OUT/csa2_long.jsonl" > "$OUT/csa2_long.log" 2>&1; echo "bench exit $?"
    python3 benchmarks/bench_csa2.py --seq_lens 65536 --layers full1_candidates,reindex \
      --no-dense --reps 3 --out "$OUT/csa2_long.jsonl" >> "$OUT/csa2_long.log" 2>&1
    echo "bench exit $?"; python3 benchmarks/summarize_csa2.py "$OUT/csa2_long.jsonl" ;;
  train)
    SYN="--config.data.synthetic=True --config.checkpoint.every_steps=0 --config.train.eval_every_steps=0"
    python3 -m deepseek41.train --config=configs/ablation_1b.py --config.log.progress_bar=False \
      --workdir=/tmp/csa2_64k $SYN --config.log.every_steps=5 --config.train.steps=${STEPS:-30} \
      ${EXTRA:-} > "$OUT/train_64k.log" 2>&1
    echo "train exit $?"; cp /tmp/csa2_64k/metrics.jsonl "$OUT/train_64k.jsonl" 2>/dev/null
    if grep -q RESOURCE_EXHAUSTED "$OUT/train_64k.log"; then  # then the same with block remat
      rm -rf /tmp/csa2_64k; mv "$OUT/train_64k.log" "$OUT/train_64k_oom.log"
      python3 -m deepseek41.train --config=configs/ablation_1b.py --config.log.progress_bar=False \
        --workdir=/tmp/csa2_64k $SYN --config.log.every_steps=5 --config.train.steps=${STEPS:-30} \
        --config.train.remat=block ${EXTRA:-} > "$OUT/train_64k.log" 2>&1
      echo "train (remat=block) exit $?"; cp /tmp/csa2_64k/metrics.jsonl "$OUT/train_64k.jsonl"
    fi
    grep -E "took|step [0-9]+:|rror|params" "$OUT/train_64k.log" | tail -12 ;;
  *) echo "unknown mode $mode (layers | long | long128 | train)" >&2; exit 2 ;;
esac
