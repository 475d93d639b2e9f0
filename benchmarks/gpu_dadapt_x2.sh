#!/usr/bin/env bash
# Issue 15: D-Adaptation at twice its own estimate of the step size (lr 2, OneCycle shape), alone and under HDET
# (alpha 0.2, T 25, recover), both evidence tasks, seeds 0-2, on one GPU, all at once. Carry data/fashion and .whl.
# Its estimate lands at 0.85-1.08x the grid's best LR on the GPT and 0.18x on Fashion-MNIST (docs/auto-lr.md):
# does HDET's robustness (no broken GPT seed in 16) make a fixed 2x safe on the GPT while it helps Fashion-MNIST?
# usage: bash benchmarks/gpu_dadapt_x2.sh OUTDIR   (run from the repo root)
set -u
export PYTHONPATH=$PWD/src
python -m pip install -q --no-index --no-deps .whl/dadaptation-3.2-py3-none-any.whl || exit 1
O=$1; mkdir -p "$O"; nvidia-smi -L > "$O/gpus.txt"; python --version >> "$O/gpus.txt"
E=(python benchmarks/evidence.py --device cuda:0 --deadline 400 --peer-names dadapt --alpha 0.2 --peer-max-lr 2)
"${E[@]}" --task bytes --peers-hdet 0.004 --jobs 7 --runs runs/dx2b --out "$O/bytes_dadapt_x2.json" > "$O/bytes.log" 2>&1 &
"${E[@]}" --task fashion --data data/fashion --peers-hdet 0.016 --jobs 7 --runs runs/dx2f \
  --out "$O/fashion_dadapt_x2.json" > "$O/fashion.log" 2>&1 &
wait
tail -n 4 "$O"/*.log
