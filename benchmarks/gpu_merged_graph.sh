#!/bin/bash
# The engine's merged step in a CUDA graph (mode="merged", cuda_graph=True) against merged, vmap and one model at
# N x the batch, on one GPU (issue 19); the GPU tests first.
# Usage: bash benchmarks/gpu_merged_graph.sh OUT
set -e
OUT=${1:?out dir}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src
python -c "import platform, torch; print(platform.python_version(), torch.__version__, torch.cuda.get_device_name())"
python -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tail -3 | tee "$OUT/gpu_tests.log"
python -W ignore benchmarks/engine_throughput.py --sizes tiny,small,medium --modes vmap,merged,merged+graph \
    --optimizers fused --out "$OUT/engine_throughput_graph.json"
