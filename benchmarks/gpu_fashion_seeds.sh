#!/usr/bin/env bash
# Issue 15: Fashion-MNIST's seed noise, against which the 0.2-point target is read: 8 seeds (0-7) on one GPU of
# plain DP, HDET (alpha 0.2, T 25) and HDET + on_runaway='recover' at the grid's picked max_lr 0.016, and of
# D-Adaptation alone and HDET over it (alpha 0.2, recover), no LR chosen; both studies at once. Carry data/fashion
# and .whl. Then the GPU checks (tests/gpu) after this session's engine changes.
# usage: bash benchmarks/gpu_fashion_seeds.sh OUTDIR   (run from the repo root)
set -u
export PYTHONPATH=$PWD/src
python -m pip install -q --no-index --no-deps .whl/dadaptation-3.2-py3-none-any.whl || exit 1
O=$1; mkdir -p "$O"; nvidia-smi -L > "$O/gpus.txt"; python --version >> "$O/gpus.txt"
E=(python benchmarks/evidence.py --task fashion --data data/fashion --device cuda:0 --deadline 420 --seeds 0-7)
"${E[@]}" --jobs 12 --runs runs/fseeds1 --breaks 0.016 --alpha 0.2 --out "$O/fashion_seeds.json" > "$O/fashion_seeds.log" 2>&1 &
"${E[@]}" --jobs 9 --runs runs/fseeds2 --peers-hdet 0.016 --peer-names dadapt --alpha 0.2 \
  --out "$O/fashion_dadapt_seeds.json" > "$O/fashion_dadapt_seeds.log" 2>&1 &
wait
python -m pytest -q -p no:cacheprovider tests/gpu -rs > "$O/gpu_tests.log" 2>&1
tail -n 3 "$O"/*.log
