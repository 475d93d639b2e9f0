# Issue 15: the recipe at ONE run's compute. `hdet train --lr-sweep 0.2` with --steps 1250: the sweep's runs take
# 0.2 x 1250 = 250 steps each (one round of N = 8, unless it extends beyond the grid), then the whole run of 1250 steps
# from the initial weights: 1500 steps a replica, the plain run's budget (the grid best, 1500 steps: GPT 1.2127,
# Fashion-MNIST 92.22%). STEPS and SWEEP (default 1250 and 0.2) change the split: STEPS=1364 SWEEP=0.1 is a
# 136-step sweep and a 1364-step run, 1500 again. Usage: `TASK=bytes STARTS=0.1,1,10 SEEDS=12,13,14,15,16 bash benchmarks/gpu_sweep_budget.sh`,
# `TASK=fashion STARTS=0.1,1,10 SEEDS=12,13,14 bash benchmarks/gpu_sweep_budget.sh` (data/fashion carried).
# EXTRA: more `hdet train` flags for every run (EXTRA="--alpha 0": the run after the sweep without HDET's spread, the
# default since 2026-12-01; the calls committed before ran at alpha 0.2, then the default: EXTRA="--alpha 0.2" repeats them).
set -x
export PYTHONPATH=$PWD/src
python -c "import sys,torch;print(sys.version, torch.__version__, torch.cuda.get_device_name())" > $OUT/env.txt
python benchmarks/lr_sweep_cli.py --tasks $TASK --starts ${STARTS:-0.1,1,10} --seeds $SEEDS --steps ${STEPS:-1250} --sweep ${SWEEP:-0.2} \
  --then restart --deadline ${DEADLINE:-540} --runs /tmp/lsc --extra "${EXTRA:-}" \
  --out $OUT/sweep_budget_${TASK}_sweep${SWEEP:-0.2}_x${STARTS//,/-}_s${SEEDS//,/-}.json > $OUT/sweep.log 2>&1
tail -n 40 $OUT/sweep.log
