#!/usr/bin/env bash
# Issue 15: Mechanic (mechanic-pytorch, a learning-rate tuner over AdamW, lr 1 under the OneCycle shape) alone,
# seeds 0-2, on one GPU.
# usage: bash benchmarks/gpu_mechanic.sh PART OUTDIR   (run from the repo root)
#   PART 1: Fashion-MNIST, N = 8 replicas in the engine at alpha 0 (plain DP; Mechanic steps one replica at a time)
#   PART 2: the GPT as one model at the 8 replicas' batch (--one-model: plain DP's computation without BatchNorm; the
#           engine's per-replica steps did not finish 3 seeds in 10 minutes), and D-Adaptation the same way (an anchor)
set -u
export PYTHONPATH=$PWD/src
python -m pip install -q --no-index --no-deps .whl/mechanic_pytorch-0.0.1-py3-none-any.whl .whl/dadaptation-3.2-py3-none-any.whl
python -c "import mechanic_pytorch, dadaptation" || exit 1
O=$2; mkdir -p "$O"; nvidia-smi -L > "$O/gpus$1.txt"; python --version >> "$O/gpus$1.txt"
E=(python benchmarks/evidence.py --device cuda:0 --deadline 500 --runs runs/mech --alone-only)
if [ "$1" = 1 ]; then
  "${E[@]}" --task fashion --data data/fashion --peers-hdet 0.016 --peer-names mechanic --jobs 3 \
    --out "$O/fashion_mechanic.json" > "$O/fashion.log" 2>&1
fi
if [ "$1" = 2 ]; then
  "${E[@]}" --task bytes --peers-hdet 0.004 --peer-names mechanic,dadapt --one-model --jobs 6 \
    --out "$O/bytes_one_model.json" > "$O/bytes.log" 2>&1
fi
for f in "$O"/*.log; do echo "== $f"; cat "$f"; done > "$O/logs$1.txt"; rm "$O"/*.log
