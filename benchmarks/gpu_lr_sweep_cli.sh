# hdet train --lr-sweep 0.2 --lr-sweep-then continue (what --lr-sweep did then) on both evidence tasks from 0.1x / 1x / 10x, seeds 9-11, one GPU (issue 15).
# Usage: bash benchmarks/gpu_lr_sweep_cli.sh (writes under $OUT)
set -x
export PYTHONPATH=$PWD/src
python -c "import sys,torch;print(sys.version, torch.__version__, torch.cuda.get_device_name())" > $OUT/env.txt
python benchmarks/lr_sweep_cli.py --seeds 9,10,11 --then continue --deadline 370 --runs /tmp/lsc --out $OUT/lr_sweep_cli.json > $OUT/lr_sweep_cli.log 2>&1
tail -n 40 $OUT/lr_sweep_cli.log
