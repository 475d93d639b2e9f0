#!/bin/bash
# Issue 15 item 6: a 128M byte-level GPT on all GPUs of one host, plain DDP against HDET's recommended
# configuration (what `hdet train` uses: alpha 0.2, T 25, on_runaway="recover"), at the tuned LR and from
# a 10x start; then, as time allows, the LR range test from 10x and 1x. Usage, from the repo root:
#   bash benchmarks/gpt_multi_gpu.sh OUT [STEPS] [GRID]
# 1. the corpus (this machine's stdlib and installed packages' .py files);
# 2. the LR grid: one plain run per GPU, each with the whole global batch on its GPU (the same update as
#    DDP over the same batch), one max_lr each (GRID, as many values as GPUs);
# 3. under torchrun on every GPU: plain DDP and HDET at the grid's best max_lr and at 10x it.
# Each run writes OUT/<name>.json (command, config, curves, final held-out loss); DEADLINE (seconds, default
# 540) skips the runs that would not finish in time; TAR (a path) packs OUT into one archive after each run. EXTRA: more arguments for every run (a CPU check:
# EXTRA="--tiny --corpus-limit 3000000 --steps 60" with a stub nvidia-smi on PATH).
set -u
out=$1; steps=${2:-1000}; grid=${3:-"7.5e-4 1.5e-3 3e-3 6e-3"}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
S=benchmarks/gpt_multi_gpu.py
G=$(nvidia-smi -L | wc -l)
export OMP_NUM_THREADS=$(( $(nproc) / G ))
nvidia-smi -L > "$out/gpus.txt"
python -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'nccl', torch.cuda.nccl.version())" >> "$out/gpus.txt"
python $S --prepare --cache /tmp/hdet_corpus ${EXTRA:-} > "$out/corpus.json" || exit 1
i=0
for lr in $grid; do
  CUDA_VISIBLE_DEVICES=$i python $S --steps "$steps" --max-lr "$lr" ${EXTRA:-} --out "$out/grid_$lr.json" > "$out/grid_$lr.log" 2>&1 &
  i=$(( (i + 1) % G ))
done
wait
echo "grid done at ${SECONDS}s" | tee -a "$out/timeline.txt"
best=$(python $S --best "$out"/grid_*.json) || exit 1
echo "best max_lr $best" | tee -a "$out/timeline.txt"
last=0
pack() {  # TAR: one archive of OUT after every run (a device that returns few files gets them all)
  if [ -n "${TAR:-}" ]; then tar czf "$TAR" -C "$out" .; fi
}
pack
run() {  # name, multiplier of the best max_lr, extra arguments
  local name=$1 mult=$2; shift 2
  if [ $(( SECONDS + last )) -gt "${DEADLINE:-540}" ]; then
    echo "skipped $name: ${SECONDS}s + ${last}s > ${DEADLINE:-540}s" | tee -a "$out/timeline.txt"; return
  fi
  local t=$SECONDS lr
  lr=$(python -c "print($best * $mult)")
  torchrun --standalone --nproc-per-node "$G" $S --steps "$steps" --max-lr "$lr" "$@" ${EXTRA:-} --out "$out/$name.json" > "$out/$name.log" 2>&1
  last=$(( SECONDS - t ))
  echo "$name: ${last}s, $(grep '^{"final_val_loss' "$out/$name.log")" | tee -a "$out/timeline.txt"
  pack
}
run plain_1x 1 --alpha 0
run hdet_1x 1 --alpha 0.2 --T 25 --on-runaway recover
run plain_10x 10 --alpha 0
run hdet_10x 10 --alpha 0.2 --T 25 --on-runaway recover
run hdet_range_10x 10 --alpha 0.2 --T 25 --on-runaway recover --range-test
run hdet_range_1x 1 --alpha 0.2 --T 25 --on-runaway recover --range-test
