#!/bin/bash
# Issue 15 item 6 on the GPUs of one host (2 when 4 are not lent): the 128M byte-level GPT of
# benchmarks/gpt_multi_gpu.py under torchrun, plain DDP at the 4 x H100 grid's best max_lr (7.5e-4,
# benchmarks/results/gpu_4x_h100/gpt128m/) against `hdet train --lr-sweep 0.2`'s recipe (hdet.lr_sweep over a
# fifth of the steps, 8 LRs one a rank a round, then HDET at alpha 0.2, T 25, on_runaway="recover" for all the
# steps at the sweep's peak) from 0.1x, 1x and 10x that LR. Usage, from the repo root:
#   TAR=$OUT/r.tgz DEADLINE=540 bash benchmarks/gpu_gpt_sweep.sh OUT RUN...
# RUN: name:multiplier:seed[:alpha[:sweep[:factor[:T]]]] (alpha 0.2, sweep 0.2 and T 25 by default; alpha 0: plain DDP, sweep
# 0: none; factor: the main run's peak over the sweep's pick, default hdet.lr_sweep's (sqrt(world) in calls 1-4, sqrt(max(world, 8)) since);
# "plain" for alpha: plain DDP without a sweep), e.g. sweep_10x:10:0 plain_1x:1:0:plain sweep_plain_10x:10:0:0.
# Each run writes OUT/<name>.json (command, config, the sweep's LRs and losses, curves, final held-out loss);
# DEADLINE (seconds) skips a run that would not finish in time (the last run's length as the guess).
set -u
out=$1; shift
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
S=benchmarks/gpt_multi_gpu.py
G=$(nvidia-smi -L | wc -l)
export OMP_NUM_THREADS=$(( $(nproc) / G ))
best=7.5e-4
mkdir -p "$out"
nvidia-smi -L > "$out/gpus.txt"
python -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'nccl', torch.cuda.nccl.version())" >> "$out/gpus.txt"
python $S --prepare --cache /tmp/hdet_corpus > "$out/corpus.json" || exit 1
echo "prepared ${SECONDS}s" | tee -a "$out/timeline.txt"
last=0
for spec in "$@"; do
  IFS=: read -r name mult seed alpha frac factor T <<< "$spec"
  if [ $(( SECONDS + last )) -gt "${DEADLINE:-540}" ]; then
    echo "skipped $name: ${SECONDS}s + ${last}s > ${DEADLINE:-540}s" | tee -a "$out/timeline.txt"; continue
  fi
  t=$SECONDS
  lr=$(python -c "print($best * $mult)")
  alpha=${alpha:-0.2}; frac=${frac:-0.2}
  if [ "$alpha" = plain ]; then alpha=0; frac=0; fi
  extra="--alpha $alpha --lr-sweep $frac"
  if [ "$alpha" != 0 ]; then extra="$extra --T ${T:-25} --on-runaway recover"; fi
  if [ -n "${factor:-}" ]; then extra="$extra --sweep-factor $factor"; fi
  torchrun --standalone --nproc-per-node "$G" $S --steps 1000 --max-lr "$lr" --seed "$seed" $extra \
    --out "$out/$name.json" > "$out/$name.log" 2>&1
  last=$(( SECONDS - t ))
  echo "$name rc=$? ${last}s $(grep '^{"final_val_loss' "$out/$name.log")" | tee -a "$out/timeline.txt"
  if [ -n "${TAR:-}" ]; then tar czf "$TAR" -C "$out" .; fi
done
