#!/usr/bin/env bash
# Issue 15: Prodigy with safeguard_warmup (prodigyopt's advice under a warm-up such as OneCycle's), alone and under
# HDET (alpha 0.5 and 0.2, T 25), both tasks, seeds 0-2, on one GPU; every study in the background.
# usage: bash benchmarks/gpu_peers_hdet3.sh PART OUTDIR   (run from the repo root)
set -u
export PYTHONPATH=$PWD/src
python -m pip install -q --no-index --no-deps .whl/dadaptation-3.2-py3-none-any.whl .whl/prodigyopt-1.1.2-py3-none-any.whl
python -c "import dadaptation, prodigyopt" || exit 1
O=$2; mkdir -p "$O"; nvidia-smi -L > "$O/gpus$1.txt"; python --version >> "$O/gpus$1.txt"
P=benchmarks/results/evidence/peers_hdet3
E=(python benchmarks/evidence.py --device cuda:0 --deadline 540 --runs runs/p3)
F=(--task fashion --data data/fashion --peers-hdet 0.016)
B=(--task bytes --peers-hdet 0.004)
study() {  # name, then evidence.py arguments
  local n=$1; shift
  "${E[@]}" "$@" --previous "$P/$n.json" --out "$O/$n.json" > "$O/$n.log" 2>&1 &
}
if [ "$1" = 1 ]; then
  study fashion_prodigy_sw "${F[@]}" --jobs 7 --peer-names prodigy-sw
  study bytes_prodigy_sw "${B[@]}" --jobs 7 --peer-names prodigy-sw
  study fashion_prodigy_sw_a0.2 "${F[@]}" --jobs 3 --hdet-only --peer-names prodigy-sw --alpha 0.2
  study bytes_prodigy_sw_a0.2 "${B[@]}" --jobs 3 --hdet-only --peer-names prodigy-sw --alpha 0.2
fi
wait
tail -n 3 "$O"/*.log
for f in "$O"/*.log; do echo "== $f"; cat "$f"; done > "$O/logs$1.txt"; rm "$O"/*.log  # 8 files come back a call
