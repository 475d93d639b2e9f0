# hdet train --lr-sweep 0.2 (--lr-sweep-then restart, the default since 2026-11-29: after the sweep the run trains
# all 1500 steps from the initial weights at the found peak) on both evidence tasks from 0.1x / 1x / 10x, fresh seeds
# 12-14, one GPU (issue 15; a confirmation of sweep_then_train's call 8). Usage: bash benchmarks/gpu_lr_sweep_cli2.sh
set -x
export PYTHONPATH=$PWD/src
python -c "import sys,torch;print(sys.version, torch.__version__, torch.cuda.get_device_name())" > $OUT/env.txt
python benchmarks/lr_sweep_cli.py --seeds 12,13,14 --then restart --deadline 520 --runs /tmp/lsc --out $OUT/lr_sweep_cli_restart.json > $OUT/lr_sweep_cli_restart.log 2>&1
tail -n 40 $OUT/lr_sweep_cli_restart.log
