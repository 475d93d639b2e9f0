#!/bin/bash
# The fused layer norm in the merged engine's CUDA graphs (issue 19), one GPU: its GPU tests and the graph tests, then
# merged+graph against merged+graph/torchnorm (benchmarks/engine_throughput.py), medium and small GPTs, float32 (TF32),
# in both orders.   Usage: bash benchmarks/gpu_fused_norm_graph.sh OUT
set -e
OUT=${1:?out dir}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src
python -c "import platform, torch, triton; print(platform.python_version(), torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee "$OUT/versions.txt"
python -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_cuda.py tests/gpu/test_merged_graph_cuda.py -W ignore 2>&1 | tail -3 | tee "$OUT/gpu_tests.log"
python -W ignore benchmarks/engine_throughput.py --sizes medium,small --modes merged+graph,merged+graph/torchnorm \
    --optimizers fused --out "$OUT/graph_fused_first.json" | tail -2
python -W ignore benchmarks/engine_throughput.py --sizes medium,small --modes merged+graph/torchnorm,merged+graph \
    --optimizers fused --out "$OUT/graph_torch_first.json" | tail -2
