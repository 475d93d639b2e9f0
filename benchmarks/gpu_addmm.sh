#!/bin/bash
# hdet.linear's one addmm per replica for large layers with a bias (issue 19), on one GPU: the GPU tests, then the
# engine's throughput with it and with every layer one baddbmm (/baddbmm), side by side in both orders, in float32
# (TF32) and under bf16 autocast.
# Usage: bash benchmarks/gpu_addmm.sh OUT
set -e
OUT=${1:?out dir}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src
python -c "import platform, torch, triton; print(platform.python_version(), torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee "$OUT/versions.txt"
python -m pytest -q -p no:cacheprovider tests/gpu tests/test_linear.py -rs -W ignore 2>&1 | tail -8 | tee "$OUT/gpu_tests.log"
for amp in none bf16; do
  python -W ignore benchmarks/engine_throughput.py --sizes medium,small --modes merged,merged/baddbmm,vmap,vmap/baddbmm \
      --optimizers fused --autocast $amp --out "$OUT/engine_addmm_first_$amp.json" | tail -2
  python -W ignore benchmarks/engine_throughput.py --sizes medium,small --modes merged/baddbmm,merged,vmap/baddbmm,vmap \
      --optimizers fused --autocast $amp --out "$OUT/engine_baddbmm_first_$amp.json" | tail -2
done
