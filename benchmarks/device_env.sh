# Sourced by the benchmarks/gpu_*.sh scripts: $OUT, the carried wheels, and the GPU's name.
OUT=${OUT:-/tmp/ds41-bench}; mkdir -p "$OUT"
if [ -d .whl ]; then  # grain, array-record, ml_collections, portpicker, tensorboardX
  # Once a machine: a script started by another (side by side) finds them installed.
  [ -d /tmp/site/grain ] || python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
latest_checkpoint() {  # workdir: its newest complete checkpoint's step, or nothing
  ls "$1/checkpoints" 2>/dev/null | grep -E '^[0-9]+$' | sort -n | tail -1
}
# `--config.train.remat=none` where the 1B step at 8 x 4,096 fits without remat (an H200's 141
# GB: 71 GB); on an 80 GB H100 the config's own remat (the DSpark post-training step asked for
# 45.9 GB more than was left).
no_remat_if_it_fits() {
  local mib; mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null \
    | head -1)
  [[ ${mib:-0} -gt 100000 ]] && echo "--config.train.remat=none"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
# Only 8 files of $OUT come back from a device call (16 MiB each), the first by name: everything
# the call wrote goes back as 00_all.tgz too, whatever else is left out.
# (Written outside $OUT first: tar reports a directory that changes while it reads it.)
trap 'tar czf "/tmp/00_all.$$.tgz" -C "$OUT" --exclude 00_all.tgz . \
  && mv "/tmp/00_all.$$.tgz" "$OUT/00_all.tgz"' EXIT
