#!/bin/bash
# The fused layer norm's host cost (issue 19): its GPU tests again, the norms alone (benchmarks/merged_kernels.py
# --norms-only: device and wall time a call), and the small GPT merged with and without it in eager steps
# (EAGER_LAYER_NORM: the variant merged+eagernorm; the committed call ran merged,merged+torchnorm at a version where the
# fused norm ran eagerly by default), 40 steps, in both orders.
# Usage: OUT=dir bash benchmarks/gpu_fused_norm_host.sh
set -e
export PYTHONPATH=$PWD/src
python -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_cuda.py -W ignore 2>&1 | tail -3
python -W ignore benchmarks/merged_kernels.py --norms-only --out $OUT/merged_norms.json > /dev/null
python - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/merged_norms.json"))
for r in d["results"]:
    print(r["size"], r["dtype"][6:], r["variant"], round(r["device_us"], 1), round(r["wall_us"], 1), r["max_abs_diff_to_first"])
PY
cd benchmarks
for v in merged+eagernorm,merged merged,merged+eagernorm; do
  python -W ignore profile_engine.py --sizes small --steps 40 --rows 1 --variants $v --out $OUT/profile_small_${v//,/_}.json 2>&1 | grep "=="
done
