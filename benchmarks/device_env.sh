# Sourced by the benchmarks/gpu_*.sh scripts: $OUT, the carried wheels, and the GPU's name.
OUT=${OUT:-/tmp/ds41-bench}; mkdir -p "$OUT"
if [ -d .whl ]; then  # grain, array-record, ml_collections, portpicker, tensorboardX
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
