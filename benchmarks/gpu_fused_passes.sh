#!/bin/bash
# hdet.kernels' fused passes (the stacked step's update, the gradients' mean) on one GPU (issue 19): the GPU tests,
# the kernels against torch's ops alone, then the engine's throughput with and without them, side by side, in both
# orders (the mode measured second ran faster in either order on the host-bound tiny and small models).
# Usage: bash benchmarks/gpu_fused_passes.sh OUT   (on 2 GPUs the tests that need them run too)
set -e
OUT=${1:?out dir}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src
python -c "import platform, torch, triton; print(platform.python_version(), torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee "$OUT/versions.txt"
python -m pytest -q -p no:cacheprovider tests/gpu tests/test_guard.py -rs 2>&1 | tail -8 | tee "$OUT/gpu_tests.log"
python -W ignore benchmarks/merged_kernels.py --passes-only --out "$OUT/merged_passes.json" > /dev/null
python -W ignore benchmarks/engine_throughput.py --sizes medium,small,tiny --modes merged,merged/torch-passes,vmap,vmap/torch-passes \
    --optimizers fused --out "$OUT/engine_throughput_fused_first.json" | tail -3
python -W ignore benchmarks/engine_throughput.py --sizes medium,small,tiny --modes merged/torch-passes,merged,vmap/torch-passes,vmap \
    --optimizers fused --out "$OUT/engine_throughput_torch_first.json" | tail -3
