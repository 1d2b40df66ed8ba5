#!/usr/bin/env bash
# The short kernel probes of docs/performance.md part K (rows 9-11) in one device call, each
# under its own time limit so that one that hangs or runs long leaves the others their time:
#   bash benchmarks/gpu_kernel_probes.sh                       # fwd_groups, then mgpu
#   PROBES="merged_dkv fwd_groups mgpu" bash benchmarks/gpu_kernel_probes.sh
# merged_dkv (46.1; measured in section 49, so not run by default): the tile-merged key/value
#   gradient against the per-query atomics, the kernel alone on three selections with their
#   overlap (about 3 minutes; V4.1 at 64K did not fit DKV_S=190 there);
# fwd_groups (46.3): V4.1's 64-head forward as one program with the slot mass's second walk
#   against two programs of 32 heads with it on chip, checked against the reference first;
# mgpu (46.2): the Mosaic GPU window and sparse forwards' interpreter tests on the GPU, then each
#   against its Triton forward at the 1B and V4.1 shapes.
# Results: $OUT/<probe>.log and .jsonl, summary.txt (each probe's exit status; 124: its limit).
set -uo pipefail
source benchmarks/device_env.sh
probe() {  # name, seconds, command...
  local name=$1 seconds=$2; shift 2
  timeout -k 5 "$seconds" "$@" > "$OUT/$name.log" 2>&1
  echo "$name exit $?" | tee -a "$OUT/summary.txt"
  tail -n 12 "$OUT/$name.log" | cut -c1-300
}
for p in ${PROBES:-fwd_groups mgpu}; do
  case "$p" in
    merged_dkv)
      probe merged_dkv "${DKV_S:-200}" python3 benchmarks/bench_merged_dkv.py \
        --out "$OUT/merged_dkv.jsonl" ;;
    fwd_groups)
      probe fwd_groups "${FWD_S:-150}" python3 benchmarks/bench_sparse_kernel.py --cases v41 \
        --modes fwd,fwd_mass --fwd_tiles 64:8:2:0,64:8:2:32 --no-gathered \
        --out "$OUT/fwd_groups.jsonl" ;;
    mgpu)
      JAX_PLATFORMS=cuda,cpu probe mgpu_tests "${MGPU_TEST_S:-90}" python3 -m pytest --noconftest -q \
        tests/kernels/test_window_mgpu.py tests/kernels/test_sparse_mgpu.py
      probe window_mgpu "${MGPU_S:-90}" python3 benchmarks/bench_window_mgpu.py \
        --out "$OUT/window_mgpu.jsonl"
      probe sparse_mgpu "${MGPU_S:-90}" python3 benchmarks/bench_sparse_mgpu.py \
        --out "$OUT/sparse_mgpu.jsonl" ;;
    *) echo "unknown probe $p (merged_dkv | fwd_groups | mgpu)" >&2; exit 2 ;;
  esac
done
