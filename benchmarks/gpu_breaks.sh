#!/usr/bin/env bash
# Issue 15: how often the GPT breaks at the grid's best LR, with and without HDET: 16 seeds x (plain DP, HDET
# alpha 0.2 T 25, HDET with on_runaway='recover'), 12 runs a GPU on 4 GPUs at once.
# usage: bash benchmarks/gpu_breaks.sh OUTDIR   (run from the repo root, on nvidia-h100-x4)
set -u
export PYTHONPATH=$PWD/src
O=$1; mkdir -p "$O"; nvidia-smi -L > "$O/gpus.txt"; python --version >> "$O/gpus.txt"
python benchmarks/evidence.py --task bytes --device cuda:0,cuda:1,cuda:2,cuda:3 --jobs 48 --deadline 520 \
  --runs runs/breaks --breaks 0.004 --alpha 0.2 --seeds 0-15 --out "$O/bytes_breaks.json" > "$O/bytes_breaks.log" 2>&1
tail -n 4 "$O/bytes_breaks.log"
