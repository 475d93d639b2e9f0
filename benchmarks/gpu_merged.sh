#!/bin/bash
# The engine's mode="merged" against vmap (eager and compiled) and one model at N x the batch, on one GPU (issue 19),
# then where the step's time goes (profiler) for the small and medium GPTs.
# Usage: bash benchmarks/gpu_merged.sh OUT
set -e
OUT=${1:?out dir}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src
python -c "import platform, torch; print(platform.python_version(), torch.__version__, torch.cuda.get_device_name())"
python -W ignore benchmarks/engine_throughput.py --sizes tiny,small,medium --modes vmap,merged,vmap+compile \
    --optimizers fused --out "$OUT/engine_throughput_merged.json"
cd benchmarks && python -W ignore profile_engine.py --sizes small,medium --steps 10 --rows 16 --variants default,merged \
    --out "$OUT/profile_merged.json" | grep "=="
