#!/usr/bin/env bash
# The hybrid Muon optimizer against AdamW on one H200 (issue 45): configs/ablation_1b.py at
# 8 x 4,096 tokens a step (CSA2 and everything else on, no remat), the default corpus (16K BPE),
# the same data order and tokens for both optimizers; held-out loss every EVAL steps. Writes logs
# and metrics to $OUT. Each mode fits one device call (10 minutes):
#   bash benchmarks/gpu_optimizer.sh sweep                   # muon_hybrid at each of LRS
#                                                            # (6e-4 1.2e-3 2.4e-3) for
#                                                            # SWEEP_STEPS (150) steps
#                                                            # (SWEEP_OPT=adamw: AdamW's)
#   bash benchmarks/gpu_optimizer.sh run muon_hybrid         # STEPS (600) steps at LR, by
#   bash benchmarks/gpu_optimizer.sh run adamw               # default each optimizer's best
#                                                            # swept rate (2.4e-3, 3e-4:
#                                                            # docs/performance.md section 42)
#       (flags after the optimizer go to the trainer: --config.train.muon_ns_dtype=float32)
#   bash benchmarks/gpu_optimizer.sh profile                 # steps 18-20 of each optimizer
#       profiled: the `optimizer` scope's share of the step (trace_summary.py); `run` traces
#       steps PROFILE..+2 (21-23) of its own run too
# SOURCES=.corpus/code16k (benchmarks/prepare_code_corpus.sh, carried with the wheels) trains on
# 22M tokens that do not repeat within 600 steps; without it, the default corpus, which does.
# The sweep keeps the schedule of a 600-step run (its lr at step 150 as the full run's) by
# stopping at SWEEP_STEPS (--stop_at_step), so its held-out loss ranks the rates the run uses.
set -uo pipefail
mode=${1:-sweep}
source benchmarks/device_env.sh
if [ -n "${SOURCES:-}" ]; then  # a prepared text set (benchmarks/prepare_code_corpus.sh)
  SOURCES_FLAG="--config.data.sources=$SOURCES"; echo "$SOURCES" > "$OUT/corpus.txt"
else  # the default corpus: 2.65M training tokens, one pass every 81 steps here (section 39)
  SOURCES_FLAG=""
  python3 -c "from deepseek41.data.default_corpus import default_corpus_dir as d; \
print(d('/tmp/ds41-cache', 16384, progress=False))" > "$OUT/corpus.txt" 2>&1
fi
STEPS=${STEPS:-600}
[ "$mode" = sweep ] && EVAL=${EVAL:-50}  # held-out loss at 50, 100, 150
COMMON="--config=configs/ablation_1b.py --config.log.progress_bar=False \
  --config.data.cache_dir=/tmp/ds41-cache --config.data.seq_len=4096 \
  --config.train.batch_size=8 --config.train.remat=none --config.train.steps=$STEPS \
  --config.train.warmup_steps=50 --config.train.eval_every_steps=${EVAL:-100} \
  --config.train.eval_batches=8 --config.log.every_steps=10 --config.checkpoint.every_steps=0 \
  $SOURCES_FLAG"
run() {  # name, extra flags...
  local name=$1; shift
  # SIGTERM at BUDGET_S (a device call ends at 600 s): the run saves, stops (75) and its
  # metrics still come back; a later call resumes it from the checkpoint (RESUME=1 keeps it).
  timeout --signal=TERM ${BUDGET_S:-540} python3 -m deepseek41.train $COMMON \
    --workdir=/tmp/opt_$name "$@" > "$OUT/$name.log" 2>&1
  echo "$name exit $?" | tee -a "$OUT/summary.txt"
  cp /tmp/opt_$name/metrics.jsonl "$OUT/$name.jsonl" 2>/dev/null
  # with its metrics, the run's resolved config: tools.compare draws against tokens from it
  mkdir -p "$OUT/runs/$name" && cp /tmp/opt_$name/metrics.jsonl /tmp/opt_$name/config.json \
    "$OUT/runs/$name/" 2>/dev/null
  grep -E "took|eval_loss|step ($STEPS|150):|rror" "$OUT/$name.log" | tail -6 | cut -c1-250
  if [ -d /tmp/opt_$name/profile ]; then  # the `optimizer` scope's share of the traced steps
    python3 benchmarks/trace_summary.py /tmp/opt_$name/profile --merge-layers --depth 1 \
      > "$OUT/${name}_trace.txt" 2>&1
    grep -E "optimizer|busy|step" "$OUT/${name}_trace.txt" | head -12
  fi
  [ -n "${RESUME:-}" ] || rm -rf /tmp/opt_$name/checkpoints  # 13 GB each: the disk holds few
}
case "$mode" in
  sweep)
    opt=${SWEEP_OPT:-muon_hybrid}  # SWEEP_OPT=adamw sweeps AdamW's rate the same way
    # EXTRA: trainer flags for every point, TAG: their name in the runs' (e.g. TAG=_nsfp32
    # EXTRA=--config.train.muon_ns_dtype=float32)
    for lr in ${LRS:-6e-4 1.2e-3 2.4e-3}; do
      run sweep_${opt}_$lr${TAG:-} --config.train.optimizer=$opt --config.train.lr=$lr \
        --stop_at_step=${SWEEP_STEPS:-150} ${EXTRA:-}
    done ;;
  run)
    opt=${2:?run needs an optimizer: adamw or muon_hybrid}
    case "$opt" in adamw) best=3e-4 ;; *) best=2.4e-3 ;; esac  # the sweeps' (section 42)
    LR=${LR:-$best}
    # Steps PROFILE..PROFILE+2 traced on the way (command buffers on, as trained: most kernels
    # carry no scope there; `profile` turns them off for the optimizer's share).
    run ${opt}_$LR --config.train.optimizer=$opt --config.train.lr=$LR \
      --config.log.profile_start_step=${PROFILE:-21} --config.log.profile_steps=3 "${@:3}" ;;
  profile)  # with the step's HLO the glue fusions land in their scopes (trace_summary.py --hlo);
            # OPTS=muon_hybrid profiles one; EXTRA: trainer flags (e.g. a Newton-Schulz schedule).
            # Its step times are without command buffers: the runs' own (`run`, command buffers
            # on) are the ones to compare.
    for opt in ${OPTS:-adamw muon_hybrid}; do
      wd=/tmp/opt_prof_$opt
      # Command buffers off: a kernel launched inside one (a CUDA graph) carries no name stack in
      # the trace, and since the iterations are unrolled the optimizer's kernels are captured too.
      XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer= --xla_dump_to=$wd/hlo \
        --xla_dump_hlo_as_text \
        --xla_dump_hlo_module_re=.*train_step.*" \
        python3 -m deepseek41.train $COMMON --workdir=$wd --config.train.optimizer=$opt \
        --config.data.synthetic=True --config.train.eval_every_steps=0 \
        --config.train.compilation_cache_dir= \
        --config.log.profile_start_step=18 --config.log.profile_steps=3 \
        --stop_at_step=22 ${EXTRA:-} > "$OUT/prof_$opt.log" 2>&1
      echo "prof_$opt exit $?" | tee -a "$OUT/summary.txt"
      # every train_step module of the dump (the cache is off above: a loaded program dumps
      # none); trace_summary.py reads the one whose instructions name the most kernels
      hlo=$(ls $wd/hlo/module_*jit_train_step*after_optimizations.txt 2>/dev/null | tr "\n" " ")
      # three scope levels: optimizer/<group>/<part> (train/optimizer.py names them), and the
      # top 60 kernels so the optimizer's element-wise passes are listed too
      python3 benchmarks/trace_summary.py $wd/profile --merge-layers --depth 3 --top 60 \
        ${hlo:+--hlo $hlo} > "$OUT/prof_${opt}_trace.txt" 2>&1
      grep -E "^hlo:|busy per step" "$OUT/prof_${opt}_trace.txt"
      sed -n '/^(b)/,/^(c)/p' "$OUT/prof_${opt}_trace.txt" | grep -E "^\(b\)|fwd [0-9]|optimizer"
      rm -rf $wd
    done ;;
  *) echo "unknown mode $mode (sweep | run OPTIMIZER | profile)" >&2; exit 2 ;;
esac
