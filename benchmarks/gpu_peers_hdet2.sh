#!/usr/bin/env bash
# Issue 15: HDET over D-Adaptation with the fit controller (T 100) and its T-100 control, HDET over Prodigy
# (shared estimate every step), on one GPU; every study in the background, 3 jobs each.
# usage: bash benchmarks/gpu_peers_hdet2.sh PART OUTDIR   (PART 1 to 6; run from the repo root)
set -u
export PYTHONPATH=$PWD/src
python -m pip install -q --no-index --no-deps .whl/dadaptation-3.2-py3-none-any.whl .whl/prodigyopt-1.1.2-py3-none-any.whl
python -c "import dadaptation, prodigyopt" || exit 1
O=$2; mkdir -p "$O"; nvidia-smi -L > "$O/gpus$1.txt"; python --version >> "$O/gpus$1.txt"
P=benchmarks/results/evidence/peers_hdet2
E=(python benchmarks/evidence.py --device cuda:0 --jobs 3 --deadline 540 --runs runs/p2)
F=(--task fashion --data data/fashion --peers-hdet 0.016)
B=(--task bytes --peers-hdet 0.004)
study() {  # name, then evidence.py arguments (the HDET rows; --alone-only: each optimizer alone)
  local n=$1; shift
  "${E[@]}" --hdet-only "$@" --previous "$P/$n.json" --out "$O/$n.json" > "$O/$n.log" 2>&1 &
}
if [ "$1" = 1 ]; then
  study fashion_fit "${F[@]}" --peer-names dadapt --peer-controller fit --peer-T 100
  study bytes_fit "${B[@]}" --peer-names dadapt --peer-controller fit --peer-T 100
  study fashion_prodigy "${F[@]}" --peer-names prodigy
elif [ "$1" = 3 ]; then  # Prodigy stepped per replica (two host reads per parameter): ran out of the call's 600 s
  study bytes_prodigy "${B[@]}" --peer-names prodigy
elif [ "$1" = 4 ]; then
  "${E[@]}" "${B[@]}" --peer-names prodigy --alone-only --seeds 1,2 --previous "$P/bytes_prodigy_alone.json" \
    --out "$O/bytes_prodigy_alone.json" > "$O/bytes_prodigy_alone.log" 2>&1 &
elif [ "$1" = 5 ]; then  # after the stacked Prodigy step: the GPT's Prodigy rows; T 10 and alpha 0.2 over D-Adaptation
  study bytes_prodigy "${B[@]}" --peer-names prodigy
  "${E[@]}" "${B[@]}" --peer-names prodigy --alone-only --seeds 1,2 --previous "$P/bytes_prodigy_alone.json" \
    --out "$O/bytes_prodigy_alone.json" > "$O/bytes_prodigy_alone.log" 2>&1 &
  study bytes_T10 "${B[@]}" --peer-names dadapt --peer-T 10
  study fashion_T10 "${F[@]}" --peer-names dadapt --peer-T 10
  study bytes_a0.2 "${B[@]}" --peer-names dadapt --alpha 0.2
elif [ "$1" = 6 ]; then  # the recovery rule's LR cut over D-Adaptation: the same seeds without it
  study bytes_ignore_a0.2 "${B[@]}" --peer-names dadapt --alpha 0.2 --peer-runaway ignore
  study bytes_ignore_T10 "${B[@]}" --peer-names dadapt --peer-T 10 --peer-runaway ignore
else
  study fashion_T100 "${F[@]}" --peer-names dadapt --peer-T 100
  study bytes_T100 "${B[@]}" --peer-names dadapt --peer-T 100
  study bytes_prodigy "${B[@]}" --peer-names prodigy
fi
wait
tail -n 3 "$O"/*.log
