#!/bin/bash
# hdet.linear's one addmm per replica (issue 19) against the code before it (every layer one baddbmm), interleaved in
# one process (benchmarks/engine_ab.py, merged mode), medium and small GPTs, float32 (TF32) and bf16 autocast.
# OLD_SRC: the previous hdet package (`git archive <rev> src | tar -x -C data/old`, carried).
# Usage: bash benchmarks/gpu_addmm_ab.sh OLD_SRC OUT
set -e
OLD=${1:?old src}; OUT=${2:?out dir}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src
python -c "import platform, torch; print(platform.python_version(), torch.__version__, torch.cuda.get_device_name())" | tee "$OUT/versions.txt"
python -m pytest -q -p no:cacheprovider tests/gpu/test_linear_cuda.py -W ignore 2>&1 | tail -3 | tee "$OUT/gpu_tests.log"
for amp in none bf16; do
  for T in medium small; do
    python -W ignore benchmarks/engine_ab.py --old "$OLD" --task $T --mode merged --autocast $amp \
        --out "$OUT/ab_${T}_$amp.json" | tail -1
  done
done
