#!/usr/bin/env bash
# Issue 15: benchmarks/eos_growth.py (D-Adaptation's estimate as a floor, Adam's edge of stability as a ceiling) on
# both evidence tasks, seeds 0-2, with and without the rule (HDET over D-Adaptation, alpha 0.2, T 25, recover), on
# one GPU, both tasks at once. Carry data/fashion and .whl.
# usage: bash benchmarks/gpu_eos_growth.sh OUTDIR   (run from the repo root)
set -u
export PYTHONPATH=$PWD/src
python -m pip install -q --no-index --no-deps .whl/dadaptation-3.2-py3-none-any.whl || exit 1
O=$1; mkdir -p "$O"; nvidia-smi -L > "$O/gpus.txt"; python --version >> "$O/gpus.txt"
python benchmarks/eos_growth.py --task bytes --seeds 0,1,2 --without --jobs 6 --out "$O/bytes_eos.json" > "$O/bytes.log" 2>&1 &
python benchmarks/eos_growth.py --task fashion --data data/fashion --seeds 0,1,2 --without --jobs 6 \
  --out "$O/fashion_eos.json" > "$O/fashion.log" 2>&1 &
wait
grep -h '"R"' "$O"/*.log | tail -n 30
