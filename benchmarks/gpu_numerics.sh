#!/usr/bin/env bash
# The same training steps from two trees, side by side in one device call: the loss of every
# step of configs/ablation_1b.py at 8 x 4,096 tokens (synthetic data, every V4.1 part on, no
# remat) from this checkout and from OLD (a checkout of another commit, e.g. the one before a
# restructuring: `git archive REV deepseek41 configs | tar -x -C .old`, carried to the device).
#   OLD=.old STEPS=6 bash benchmarks/gpu_numerics.sh
set -uo pipefail
source benchmarks/device_env.sh
OLD=${OLD:?OLD: a directory holding another commit\'s deepseek41/ and configs/}
STEPS=${STEPS:-6}
FLAGS="--config=configs/ablation_1b.py --config.data.synthetic=True --config.data.seq_len=4096 \
  --config.train.batch_size=8 --config.train.remat=none --config.train.steps=$STEPS \
  --config.train.eval_every_steps=0 --config.checkpoint.every_steps=0 \
  --config.log.every_steps=1 --config.log.progress_bar=False"
site=${PYTHONPATH%%:*}  # the carried wheels, if any
for tree in new old; do
  dir=$PWD; [ $tree = old ] && dir=$(cd "$OLD" && pwd)
  (cd "$dir" && PYTHONPATH=$site:$dir python3 -m deepseek41.train $FLAGS \
    --workdir=/tmp/numerics_$tree > "$OUT/$tree.log" 2>&1)
  echo "$tree exit $?" | tee -a "$OUT/summary.txt"
  cp /tmp/numerics_$tree/metrics.jsonl "$OUT/$tree.jsonl" 2>/dev/null
  grep -E "took|rror" "$OUT/$tree.log" | tail -3 | cut -c1-200
  rm -rf /tmp/numerics_$tree
done
python3 - "$OUT" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
rows = {t: {r['step']: r for r in map(json.loads, open(f'{sys.argv[1]}/{t}.jsonl')) if 'loss' in r}
        for t in ('new', 'old')}
for step in sorted(rows['new']):
  n, o = rows['new'][step], rows['old'].get(step, {})
  print(f"step {step:3d}  loss new {n['loss']:.6f}  old {o.get('loss', float('nan')):.6f}  "
        f"diff {n['loss'] - o.get('loss', float('nan')):+.2e}  grad_norm new "
        f"{n.get('grad_norm', 0):.5f} old {o.get('grad_norm', float('nan')):.5f}")
PY
