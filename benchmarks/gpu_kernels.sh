#!/usr/bin/env bash
# Issue 12's measurements on one GPU: the fused CSA2 kernels, alone and in training.
#   bash benchmarks/gpu_kernels.sh micro        # sparse kernel vs gathered path, 1B + V4.1 shapes
#   bash benchmarks/gpu_kernels.sh train4k A B  # 8 x 4,096 full structure, runs A B ... (below)
#   bash benchmarks/gpu_kernels.sh train64k A   # configs/ablation_1b.py as shipped (1 x 65,536)
#   bash benchmarks/gpu_kernels.sh layers       # one CSA2 layer vs cuDNN dense (bench_csa2.py)
# Runs (model overrides): xla = the jnp paths (gathered, chunked, top_k); sparse = fused sparse
# kernel only; fused = every kernel (sparse, window, threshold select); prof = fused + profile;
# grouped = the defaults with the dropless grouped-GEMM experts; mhc = the fused mHC kernels;
# selref = the defaults with the indexer's selected-entry scores on the jnp path (the kernel's A/B);
# nosave = the defaults with block remat saving nothing; fullbwd = the sparse backward's key/value
# gradient over the whole head width at once (both through benchmarks/train_variant.py);
# keep = block remat keeping the attention kernels' outputs (train.remat=block_keep_attention);
# headfp32 = the LM head's backward as fp32 GEMMs (benchmarks/train_variant.py head_fp32_backward);
# rlN = remat for the first N layers only (train.remat_layers=N), e.g. rl6;
# chN = the indexer scores and selects N queries per chunk (model.sparse_chunk=N), e.g. ch4096;
# mhcnopf = the fused mHC walks without look-ahead loads, at their earlier tiles (train_variant.py);
# nogroup = each sparse layer adds its own key/value gradient (model.sparse_group_dkv=False);
# sparsetiles1 = the sparse kernels' earlier, unpipelined tiles (train_variant.py sparse_unpipelined);
# tiles1202 = the expert GEMMs' and window forward's earlier tiles (train_variant.py tiles_before_dec2);
# select1202 = the indexer in one run over every entry, recall by top_k (train_variant.py select_before_dec2);
# cgN = the indexer's chunks in up to N causal runs (model.index_causal_groups=N), e.g. cg8;
# bmslices = the indexer's block maxima as a max of strided slices (train_variant.py blockmax_slices);
# nomerge = the fused kernels' backward through autodiff of the softmax merge (model.merged_backward=False);
# ropeafter = the output's inverse RoPE as its own pass after the merge (train_variant.py rope_after_merge).
set -uo pipefail
mode=${1:-micro}; shift || true
source benchmarks/device_env.sh
SYN="--config.data.synthetic=True --config.checkpoint.every_steps=0 --config.train.eval_every_steps=0 --config.log.progress_bar=False"
XLA="--config.model.sparse_impl=gathered --config.model.attention_impl=chunked --config.model.select_impl=top_k"
SPARSE="--config.model.sparse_impl=fused --config.model.attention_impl=chunked --config.model.select_impl=top_k"
FUSED="--config.model.sparse_impl=fused --config.model.attention_impl=${ATT:-fused} --config.model.select_impl=${SEL:-threshold}"
flags() { case "$1" in auto) echo "";; xla) echo $XLA;; sparse) echo $SPARSE;; fused|prof) echo $FUSED;;
  grouped) echo "--config.model.moe_backend=grouped";; mhc) echo "--config.model.mhc_impl=fused";;
  selref) echo "--config.model.selected_scores_impl=reference";;
  nosave|fullbwd|headfp32|mhcnopf|sparsetiles1|tiles1202|select1202|bmslices|ropeafter) echo "";;
  keep) echo "--config.train.remat=block_keep_attention";;
  nogroup) echo "--config.model.sparse_group_dkv=False";;
  nomerge) echo "--config.model.merged_backward=False";;
  rl[0-9]*) echo "--config.train.remat_layers=${1#rl}";;
  ch[0-9]*) echo "--config.model.sparse_chunk=${1#ch}";;
  cg[0-9]*) echo "--config.model.index_causal_groups=${1#cg}";;
  *) echo "unknown run $1" >&2; exit 2;; esac; }
train() {  # shape name run
  local shape=$1 run=$2 wd=/tmp/k_$1_$2_$$ extra="" dump=""
  if [ "$run" = prof ]; then  # profile steps 18-20; dump the step's optimized HLO for --hlo
    extra="--config.log.profile_start_step=18 --config.log.profile_steps=3"
    dump="--xla_dump_to=$wd/hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*train_step.*"
  fi
  if [ "$shape" = 4k ]; then
    shape_flags="--config.data.seq_len=4096 --config.train.batch_size=8 --config.train.remat=none --config.train.steps=${STEPS:-24} --config.log.every_steps=4"
  else
    shape_flags="--config.train.steps=${STEPS:-16} --config.log.every_steps=4"
  fi
  local main="-m deepseek41.train"
  [ "$run" = nosave ] && main="benchmarks/train_variant.py remat_nothing_saved"
  [ "$run" = fullbwd ] && main="benchmarks/train_variant.py sparse_bwd_full_width"
  [ "$run" = headfp32 ] && main="benchmarks/train_variant.py head_fp32_backward"
  [ "$run" = mhcnopf ] && main="benchmarks/train_variant.py mhc_no_prefetch"
  [ "$run" = sparsetiles1 ] && main="benchmarks/train_variant.py sparse_unpipelined"
  [ "$run" = tiles1202 ] && main="benchmarks/train_variant.py tiles_before_dec2"
  [ "$run" = select1202 ] && main="benchmarks/train_variant.py select_before_dec2"
  [ "$run" = bmslices ] && main="benchmarks/train_variant.py blockmax_slices"
  [ "$run" = ropeafter ] && main="benchmarks/train_variant.py rope_after_merge"
  XLA_FLAGS=$(echo ${XLA_FLAGS:-} $dump) python3 $main --config=configs/ablation_1b.py --workdir=$wd \
    $SYN $shape_flags $(flags $run) $extra > "$OUT/train${shape}_$run.log" 2>&1
  echo "train${shape} $run exit $?"
  cp $wd/metrics.jsonl "$OUT/train${shape}_$run.jsonl" 2>/dev/null
  if [ "$run" = prof ]; then  # with the HLO, the glue fusions land in their scopes
    local hlo sum
    hlo=$(ls $wd/hlo/module_*jit_train_step*after_optimizations.txt 2>/dev/null | tr "\n" " ")
    sum="python3 benchmarks/trace_summary.py $wd/profile --merge-layers ${hlo:+--hlo $hlo}"
    $sum --depth 3 > "$OUT/train${shape}_prof_trace.txt" 2>&1 && head -40 "$OUT/train${shape}_prof_trace.txt"
    $sum --depth 6 --top 60 2>&1 | grep -E "attention|ms  *%|top" > "$OUT/train${shape}_prof_deep.txt"
    [ -n "$hlo" ] && $sum --top 1 --bodies 30 2>&1 | sed -n '/^(d) /,$p' > "$OUT/train${shape}_prof_bodies.txt"
  fi
  grep -E "took|step [0-9]+:|rror|peak" "$OUT/train${shape}_$run.log" | tail -6 | cut -c1-250
  rm -rf "$wd"  # its final checkpoint: a few runs' of them fill the machine's disk
}
case "$mode" in
  check)  # window + select kernels compiled on the GPU, v41-shape sparse backward; then runs
    python3 benchmarks/bench_kernels_gpu.py --out "$OUT/kernels.jsonl" 2>&1 | grep '^{' | cut -c1-300
    python3 benchmarks/bench_sparse_kernel.py --cases v41 --block_k 32 --num_warps 8 --no-check \
      --no-gathered --modes fwd_bwd --out "$OUT/sparse.jsonl" 2>&1 | grep '^{' | cut -c1-230
    grep -q '"check": "window".*"ok": true' "$OUT/kernels.jsonl" || export ATT=chunked
    grep -q '"same_sets": false\|"check": "select".*error' "$OUT/kernels.jsonl" && export SEL=top_k
    echo "runs use attention_impl=${ATT:-fused} select_impl=${SEL:-threshold}"
    for r in "$@"; do
      case $r in 4kprof) XLA_FLAGS=--xla_gpu_enable_command_buffer= train 4k prof;;
        64k) train 64k fused;; 64kauto) train 64k auto;; *) train 4k $r;; esac
    done ;;
  selected)  # the selected-entry indexer scores alone (tile sweep), then the 4K runs given
    python3 benchmarks/bench_selected_scores.py --block_k 32,64,128 --num_warps 4,8 \
      --out "$OUT/selected.jsonl" 2>&1 | grep '^{' | cut -c1-300
    for r in "$@"; do train 4k $r; done ;;
  micro)
    python3 benchmarks/bench_sparse_kernel.py --out "$OUT/sparse.jsonl" --block_k 64 --num_warps 4,8 \
      2>&1 | grep '^{' | cut -c1-230 ;;
  train4k) for r in "$@"; do
      if [ "$r" = prof ]; then XLA_FLAGS=--xla_gpu_enable_command_buffer= train 4k prof; else train 4k $r; fi
    done ;;
  train64k) for r in "$@"; do train 64k $r; done ;;
  layers)
    python3 benchmarks/bench_csa2.py --seq_lens 65536,131072 --layers full2,reuse2 --reps 3 \
      --out "$OUT/csa2_layers.jsonl" > "$OUT/csa2_layers.log" 2>&1; echo "bench exit $?"
    python3 benchmarks/summarize_csa2.py "$OUT/csa2_layers.jsonl" ;;
  *) echo "unknown mode $mode" >&2; exit 2 ;;
esac
