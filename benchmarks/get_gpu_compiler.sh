#!/usr/bin/env bash
# The CUDA compiler for benchmarks/compile_for_gpu.py, on a machine without a GPU: jax's CUDA
# plugin (the version of the installed jax) and the NVIDIA libraries it loads (ptxas, cuBLAS,
# cuDNN, ...), installed into DIR, outside the project's venv (about 4 GB):
#   bash benchmarks/get_gpu_compiler.sh /tmp/gpu-compiler
#   PYTHONPATH=/tmp/gpu-compiler .venv/bin/python benchmarks/compile_for_gpu.py --config=...
set -euo pipefail
dir=${1:?usage: bash benchmarks/get_gpu_compiler.sh DIR}
python=${PYTHON:-.venv/bin/python}
version=$($python -c 'import jax; print(jax.__version__)')
# --no-deps: the plugin's own requirements would pin a second jax into DIR.
$python -m pip install -q --target "$dir" --no-deps "jax-cuda13-plugin==$version" \
  "jax-cuda13-pjrt==$version" nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvcc \
  nvidia-cuda-runtime "nvidia-cudnn-cu13<10" nvidia-cufft nvidia-cusolver nvidia-cusparse \
  nvidia-nccl-cu13 nvidia-nvjitlink nvidia-cuda-nvrtc nvidia-nvshmem-cu13 nvidia-nvvm
echo "installed jax's CUDA $version compiler into $dir: PYTHONPATH=$dir"
