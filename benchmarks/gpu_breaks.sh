#!/usr/bin/env bash
# Issue 15: how often the GPT breaks, with and without HDET, over 16 seeds, 12 runs a GPU on 4 GPUs at once.
# PART 1: at the grid's best LR: plain DP, HDET (alpha 0.2, T 25), HDET with on_runaway='recover'.
# PART 2: no LR to choose: D-Adaptation alone, HDET over it at alpha 0.5 and 0.2 (T 25, recover); carry .whl.
# PART 3 (one GPU): the stability guard without the spread (plain DP with on_runaway='recover') over the 16 seeds, and
# plain DP again at the seeds where it broke or nearly did (1, 10, 11) and three that did not (0, 2, 3) as the anchor.
# usage: bash benchmarks/gpu_breaks.sh PART OUTDIR   (run from the repo root, on nvidia-h100-x4; PART 3 on one GPU)
set -u
export PYTHONPATH=$PWD/src
O=$2; mkdir -p "$O"; nvidia-smi -L > "$O/gpus$1.txt"; python --version >> "$O/gpus$1.txt"
E=(python benchmarks/evidence.py --task bytes --device cuda:0,cuda:1,cuda:2,cuda:3 --deadline 520 --seeds 0-15)
if [ "$1" = 3 ]; then
  G=(python benchmarks/evidence.py --task bytes --device cuda:0 --deadline ${DEADLINE:-540} --breaks 0.004)
  "${G[@]}" --jobs 16 --seeds 0-15 --breaks-arms plainguard --runs runs/breaks4 --out "$O/bytes_plainguard.json" \
    > "$O/bytes_plainguard.log" 2>&1 &
  "${G[@]}" --jobs 6 --seeds 1,10,11,0,2,3 --breaks-arms plain --runs runs/breaks5 --out "$O/bytes_plain_anchor.json" \
    > "$O/bytes_plain_anchor.log" 2>&1 &
  wait
elif [ "$1" = 1 ]; then
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
