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
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
# Only 8 files of $OUT come back from a device call (16 MiB each), the first by name: everything
# the call wrote goes back as 00_all.tgz too, whatever else is left out.
# (Written outside $OUT first: tar reports a directory that changes while it reads it.)
trap 'tar czf "/tmp/00_all.$$.tgz" -C "$OUT" --exclude 00_all.tgz . \
  && mv "/tmp/00_all.$$.tgz" "$OUT/00_all.tgz"' EXIT
