#!/usr/bin/env bash
# Decoding at 4K-1M tokens of context on one GPU (issue 48 item 3), one device call: the 1B
# config with YaRN stretched to 2,097,152 positions (yarn_factor 512 over its 4,096: a
# 1,048,576-token prompt and its new tokens), its parameters as initialised (one training step
# on the default corpus writes the checkpoint and its tokenizer: speed and memory do not depend
# on what the weights learned), then benchmarks/bench_generate.py's long-context phase: at each
# context one prompt prefilled through CED and through every layer, PREFILL_CHUNK positions a
# dispatch, then NEW greedy tokens 32 a dispatch; prefill and decode tokens/s and the memory in
# use after each (JSON keys ctx<L>_<ced|full>).
#   bash benchmarks/gpu_longctx_decode.sh
#   CONTEXTS=262144,1048576 bash benchmarks/gpu_longctx_decode.sh
#   PREFILLS=ced CONTEXTS=1048576 bash benchmarks/gpu_longctx_decode.sh   # CED prefill only
# PROFILE=1 also traces, at each context, a second run's decode dispatches after its first
# (NEW >= 64: two dispatches of 32) and summarises them (benchmarks/trace_summary.py).
# SMOKE=1 runs the same on this CPU with configs/tiny.py at 256 and 1,024 tokens.
set -uo pipefail
source benchmarks/device_env.sh
export TF_CPP_MIN_LOG_LEVEL=2
START=$(date +%s)
left() { echo $((${DEADLINE_S:-570} - ($(date +%s) - START))); }
if [[ -n ${SMOKE:-} ]]; then
  export JAX_PLATFORMS=cpu
  CONFIG=configs/tiny.py; SHAPE="--config.data.seq_len=128 --config.train.batch_size=1"
  YARN="--config.model.yarn_factor=16"; CONTEXTS=${CONTEXTS:-256,1024}; CHUNK=${PREFILL_CHUNK:-512}
  NEW=${NEW:-16}
else
  CONFIG=configs/ablation_1b.py
  SHAPE="--config.data.seq_len=4096 --config.train.batch_size=1 --config.train.remat=none"
  YARN="--config.model.yarn_factor=512"; CONTEXTS=${CONTEXTS:-4096,65536,262144,1048576}
  CHUNK=${PREFILL_CHUNK:-65536}; NEW=${NEW:-128}
fi
WD=/tmp/longdecode; rm -rf $WD
timeout -s KILL "$(left)" python3 -m deepseek41.train --config=$CONFIG $SHAPE $YARN --workdir=$WD \
  --config.data.cache_dir=/tmp/ds41-cache --config.train.steps=1 --config.train.eval_every_steps=0 \
  --config.checkpoint.every_steps=1 --config.log.progress_bar=False > "$OUT/longdecode_train.log" 2>&1
echo "train exit $? wall $(($(date +%s) - START)) s" | tee -a "$OUT/summary.txt"
timeout -s KILL "$(left)" python3 benchmarks/bench_generate.py --workdir=$WD --contexts=$CONTEXTS \
  --context_prefill_chunk=$CHUNK --context_prefills=${PREFILLS:-ced,full} --new_tokens=$NEW \
  --tokens_per_dispatch=32 ${PROFILE:+--profile_dir=$OUT/trace} \
  --deadline_s=$(($(left) - 30)) --out="$OUT/longdecode.json" > "$OUT/longdecode.log" 2>&1
echo "bench exit $? wall $(($(date +%s) - START)) s" | tee -a "$OUT/summary.txt"
grep -E "^ctx|rror" "$OUT/longdecode.log" | cut -c1-400
if [[ -n ${PROFILE:-} ]]; then  # a decode dispatch's kernels at each context (not its prefill)
  for t in "$OUT"/trace/*/; do
    python3 benchmarks/trace_summary.py "$t" --top 30 --depth 2 --merge-layers \
      > "$OUT/trace_$(basename "$t").txt" 2>&1
  done
  rm -rf "$OUT/trace"
fi
rm -rf $WD  # the 1B checkpoint (~15 GB): a warm machine's next call needs the disk
