#!/usr/bin/env bash
# Issue 15: how often the GPT breaks, with and without HDET, over 16 seeds, 12 runs a GPU on 4 GPUs at once.
# PART 1: at the grid's best LR: plain DP, HDET (alpha 0.2, T 25), HDET with on_runaway='recover'.
# PART 2: no LR to choose: D-Adaptation alone, HDET over it at alpha 0.5 and 0.2 (T 25, recover); carry .whl.
# usage: bash benchmarks/gpu_breaks.sh PART OUTDIR   (run from the repo root, on nvidia-h100-x4)
set -u
export PYTHONPATH=$PWD/src
O=$2; mkdir -p "$O"; nvidia-smi -L > "$O/gpus$1.txt"; python --version >> "$O/gpus$1.txt"
E=(python benchmarks/evidence.py --task bytes --device cuda:0,cuda:1,cuda:2,cuda:3 --deadline 520 --seeds 0-15)
if [ "$1" = 1 ]; then
  "${E[@]}" --jobs 48 --runs runs/breaks --breaks 0.004 --alpha 0.2 --out "$O/bytes_breaks.json" > "$O/bytes_breaks.log" 2>&1
else
  python -m pip install -q --no-index --no-deps .whl/dadaptation-3.2-py3-none-any.whl || exit 1
  "${E[@]}" --jobs 33 --runs runs/breaks2 --peers-hdet 0.004 --peer-names dadapt --alpha 0.5 \
    --out "$O/bytes_dadapt.json" > "$O/bytes_dadapt.log" 2>&1 &
  "${E[@]}" --jobs 16 --runs runs/breaks3 --peers-hdet 0.004 --peer-names dadapt --alpha 0.2 --hdet-only \
    --out "$O/bytes_dadapt_a0.2.json" > "$O/bytes_dadapt_a0.2.log" 2>&1 &
  wait
fi
tail -n 3 "$O"/*.log
