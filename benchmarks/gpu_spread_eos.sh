#!/bin/bash
# benchmarks/spread_eos.py on one GPU, runs in turn. Usage, from the repo root:
#   DEADLINE=480 bash benchmarks/gpu_spread_eos.sh OUT RUN...
# RUN: name:multipliers:seed:T (multipliers comma-separated, e.g. plain_s0:1,1:0:25 spread_s0:0.8,1.2:0:25);
# a run that would end past DEADLINE seconds (the last run's length as the guess) is skipped.
set -u
out=$1; shift
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
mkdir -p "$out"
nvidia-smi -L > "$out/gpus.txt"
python -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__)" >> "$out/gpus.txt"
[ -f /tmp/hdet_corpus/train.bin ] || python benchmarks/gpt_multi_gpu.py --prepare --cache /tmp/hdet_corpus > /dev/null
cp /tmp/hdet_corpus/meta.json "$out/corpus.json"
echo "prepared ${SECONDS}s" | tee -a "$out/timeline.txt"
last=0
for spec in "$@"; do
  IFS=: read -r name mult seed T <<< "$spec"
  if [ $(( SECONDS + last )) -gt "${DEADLINE:-480}" ]; then
    echo "skipped $name" | tee -a "$out/timeline.txt"; continue
  fi
  t=$SECONDS
  python benchmarks/spread_eos.py --cache /tmp/hdet_corpus --multipliers "$mult" --seed "$seed" --T "$T" \
    --out "$out/$name.json" > "$out/$name.log" 2>&1
  last=$(( SECONDS - t ))
  echo "$name ${last}s $(tail -1 "$out/$name.log")" | tee -a "$out/timeline.txt"
done
