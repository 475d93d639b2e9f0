#!/usr/bin/env bash
# Issue 19: the engine before and after a change, interleaved in one process per task (benchmarks/engine_ab.py),
# on one GPU. OLD_SRC: a folder holding the previous hdet package (`git archive <rev> src | tar -x -C data/old`,
# carried). usage: bash benchmarks/gpu_engine_ab.sh OLD_SRC OUTDIR   (from the repo root, one H100)
set -u
export PYTHONPATH=$PWD/src
O=$2; mkdir -p "$O"; { nvidia-smi -L; python --version; } > "$O/log.txt" 2>&1
A=(python benchmarks/engine_ab.py --old "$1")
for T in mlp tiny small medium; do "${A[@]}" --task $T --out "$O/ab_$T.json" >> "$O/log.txt" 2>&1; done
for T in tiny small; do "${A[@]}" --task $T --compile --out "$O/ab_${T}_compile.json" >> "$O/log.txt" 2>&1; done
grep -h '^{' "$O/log.txt"
