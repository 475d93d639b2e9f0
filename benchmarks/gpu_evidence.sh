#!/bin/bash
# The evidence suite on a 2-GPU machine (one task per GPU), plus a check that 2-GPU NCCL DDP and the
# one-process engine agree with the fit controller on. Usage (from the repo root, data/fashion holding
# the four Fashion-MNIST gz files):
#   bash benchmarks/gpu_evidence.sh grid OUT          # the grids (seed 0) + the DDP/engine check
#   bash benchmarks/gpu_evidence.sh main OUT PREV     # everything else, skipping what PREV/*.json finished
#   bash benchmarks/gpu_evidence.sh local OUT         # local mode (issue 6), next to the committed results
set -u
phase=$1; out=$2; prev=${3:-}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
nvidia-smi -L > "$out/gpus.txt"; python -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__)" >> "$out/gpus.txt"
mkdir -p runs
if [ "$phase" = local ]; then  # no gradient averaging between converge steps, T = 100 and 25, from the grid's best
  R=benchmarks/results/evidence
  L="--sync-interval 100 --local --follow-starts 1 --follow-controllers plain,none,fit --deadline ${DEADLINE:-500}"
  python benchmarks/evidence.py --task bytes --device cuda:0 --jobs 9 $L --previous $R/followup_T/bytes_T100.json --runs runs/l100 --out "$out/bytes_T100_local.json" > "$out/bytes_T100_local.log" 2>&1 &
  python benchmarks/evidence.py --task fashion --device cuda:0 --data data/fashion --jobs 5 $L --previous $R/followup_T/fashion_T100.json --runs runs/l100 --out "$out/fashion_T100_local.json" > "$out/fashion_T100_local.log" 2>&1 &
  L=${L/--sync-interval 100/--sync-interval 25}
  python benchmarks/evidence.py --task bytes --device cuda:1 --jobs 9 $L --previous $R/final/bytes.json --runs runs/l25 --out "$out/bytes_T25_local.json" > "$out/bytes_T25_local.log" 2>&1 &
  python benchmarks/evidence.py --task fashion --device cuda:1 --data data/fashion --jobs 5 $L --previous $R/final/fashion.json --runs runs/l25 --out "$out/fashion_T25_local.json" > "$out/fashion_T25_local.log" 2>&1 &
  wait
  tail -n 3 "$out"/*.log
  exit 0
fi
A="--steps 300 --T 25 --width 128 --layers 2 --alpha 0.5 --max-lr 3e-3 --auto-lr --controller fit --tie-lr-groups --warmup 90 --no-progress"
( torchrun --standalone --nproc_per_node 2 -m hdet train $A --out runs/check-ddp > runs/check.log 2>&1
    python -m hdet train $A --replicas 2 --device cuda:0 --mode vmap --out runs/check-engine >> runs/check.log 2>&1
    python -c "
import json
d = {k: json.load(open(f'runs/check-{k}/summary.json')) for k in ('ddp', 'engine')}
print(json.dumps({k: {'mode': v['mode'], 'final_val_loss': v['final_val_loss'], 'final_train_loss': v['final_train_loss'],
                      'final_metrics': v['final_metrics'], 'command': v.get('command')} for k, v in d.items()}, indent=1))
for k in ('ddp', 'engine'):
    print(k, [json.loads(l)['bases'][0] for l in open(f'runs/check-{k}/syncs.jsonl')])
" ) > "$out/ddp_vs_engine.txt" 2>&1 &
if [ "$phase" = grid ]; then
  python benchmarks/evidence.py --task bytes --device cuda:0 --jobs 12 --only-grid --deadline 420 --out "$out/bytes.json" > "$out/bytes.log" 2>&1 &
  python benchmarks/evidence.py --task fashion --device cuda:1 --data data/fashion --jobs 12 --only-grid --deadline 420 --out "$out/fashion.json" > "$out/fashion.log" 2>&1 &
else  # the GPT needs both GPUs; Fashion-MNIST is light
  P=${prev:+--previous $prev/bytes.json}; F=${prev:+--previous $prev/fashion.json}
  python benchmarks/evidence.py --task bytes --device cuda:0,cuda:1 --jobs 20 --deadline ${DEADLINE:-530} $P --out "$out/bytes.json" > "$out/bytes.log" 2>&1 &
  python benchmarks/evidence.py --task fashion --device cuda:1 --data data/fashion --jobs 8 --deadline ${DEADLINE:-530} $F --out "$out/fashion.json" > "$out/fashion.log" 2>&1 &
fi
wait
tail -n 4 "$out"/*.log; cat "$out/ddp_vs_engine.txt" 2>/dev/null | head -30
