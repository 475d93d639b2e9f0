#!/bin/bash
# hdet.kernels' fused layer norm for the merged replicas in eager steps (issue 19; the committed results in
# benchmarks/results/gpu_h200/fused_norm/eager/ are from a version that ran it eagerly by default, variants
# merged,merged+torchnorm; since, eager steps take it only with EAGER_LAYER_NORM, the variant merged+eagernorm), on one
# GPU: the GPU tests; device time a step with it and with torch's norm + addcmul (benchmarks/profile_engine.py); wall
# time interleaved in one process against the code before it (benchmarks/engine_ab.py --mode merged: at that version,
# the fused norm in eager steps; now the same code as before), medium and small GPTs, float32 (TF32) and bf16.
# OLD_SRC: the previous hdet package (`git archive <rev> src | tar -x -C data/old`, carried).
# Usage: bash benchmarks/gpu_fused_norm.sh OLD_SRC OUT
set -e
OLD=${1:?old src}; OUT=${2:?out dir}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src
python -c "import platform, torch, triton; print(platform.python_version(), torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee "$OUT/versions.txt"
python -m pytest -q -p no:cacheprovider tests/gpu tests/test_merged.py tests/test_linear.py -rs -W ignore 2>&1 | tail -8 | tee "$OUT/gpu_tests.log"
for amp in none bf16; do
  (cd benchmarks && python -W ignore profile_engine.py --sizes medium,small --steps 10 --rows 12 --ops 30 \
      --variants merged+eagernorm,merged --autocast $amp --out "$OUT/profile_norm_$amp.json" > "$OUT/profile_norm_$amp.log" 2>&1)
  grep "==" "$OUT/profile_norm_$amp.log"
  for T in medium small; do
    python -W ignore benchmarks/engine_ab.py --old "$OLD" --task $T --mode merged --autocast $amp --rounds 9 \
        --out "$OUT/ab_${T}_$amp.json" | tail -1
  done
done
