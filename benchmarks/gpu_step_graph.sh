#!/bin/bash
# cuda_graph=True on the vmapped and the merged engine against one model at N x the batch, on one GPU (issue 19):
# the GPU tests, the throughput benchmark, and `hdet train` on the GPU with and without --cuda-graph.
# Usage: bash benchmarks/gpu_step_graph.sh OUT
set -e
OUT=${1:?out dir}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src
python -c "import platform, torch; print(platform.python_version(), torch.__version__, torch.cuda.get_device_name())"
python -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tail -3 | tee "$OUT/gpu_tests.log"
python -W ignore benchmarks/engine_throughput.py --sizes tiny,small,medium --modes vmap,vmap+graph,merged+graph \
    --optimizers fused --out "$OUT/engine_throughput_step_graph.json" | cut -c1-300
for args in "" "--cuda-graph" "--mode merged --cuda-graph"; do
    python -W ignore -m hdet train --no-progress --device cuda $args --out "$OUT/train_run" 2>/dev/null | grep steps \
        | sed "s|^|hdet train $args: |" | tee -a "$OUT/hdet_train_cuda.log"
done
rm -rf "$OUT/train_run"
