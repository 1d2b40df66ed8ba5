#!/usr/bin/env bash
# CSA2 vs dense vs window-only (model.attention_variant; docs/architecture.md 3.8.1) on one
# H200, one device call per mode. Writes logs, JSON lines and markdown tables to $OUT.
#   bash benchmarks/gpu_variants.sh layers  # one layer's attention core per variant + cuDNN,
#                                           # 4K-64K (benchmarks/bench_variants.py)
#   bash benchmarks/gpu_variants.sh train   # configs/ablation_1b.py per variant and sequence
#                                           # length, 65,536 tokens per step at every length
# SEQ_LENS, VARIANTS, STEPS (default 12) and EXTRA (more trainer flags) override the defaults.
set -uo pipefail
mode=${1:-layers}
source benchmarks/device_env.sh
case "$mode" in
  layers)
    python3 benchmarks/bench_variants.py --seq_lens "${SEQ_LENS:-4096,16384,32768,65536}" \
      --reps 5 --out "$OUT/variants_layers.jsonl" > "$OUT/variants_layers.log" 2>&1
    echo "bench exit $?"; cat "$OUT/variants_layers_table.txt" ;;
  train)
    SYN="--config.data.synthetic=True --config.checkpoint.every_steps=0 \
      --config.train.eval_every_steps=0 --config.log.every_steps=1 --config.log.progress_bar=False"
    for t in ${SEQ_LENS:-4096 16384 65536}; do
      for v in ${VARIANTS:-csa2 dense window}; do
        name=${v}_${t}; wd=/tmp/variants_$name
        run() {  # extra flags...
          rm -rf "$wd"
          python3 -m deepseek41.train --config=configs/ablation_1b.py --workdir="$wd" $SYN \
            --config.model.attention_variant="$v" --config.data.seq_len="$t" \
            --config.train.batch_size=$((65536 / t)) --config.train.steps="${STEPS:-12}" \
            "$@" ${EXTRA:-} > "$OUT/train_$name.log" 2>&1
        }
        run; echo "$name exit $?"
        if grep -q RESOURCE_EXHAUSTED "$OUT/train_$name.log"; then  # then with remat everywhere
          mv "$OUT/train_$name.log" "$OUT/train_${name}_oom.log"
          run --config.train.remat=block --config.train.remat_layers=0
          echo "$name (remat=block) exit $?"
        fi
        cp "$wd/metrics.jsonl" "$OUT/train_$name.jsonl" 2>/dev/null
      done
    done
    python3 benchmarks/summarize_variants.py "$OUT"/train_*.jsonl | tee "$OUT/variants_train_table.txt" ;;
  *) echo "unknown mode $mode (layers | train)" >&2; exit 2 ;;
esac
