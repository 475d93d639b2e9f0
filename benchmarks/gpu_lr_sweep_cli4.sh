# The same compute as hdet train --lr-sweep 0.2's restart (1500 + 300 steps): plain DP and hdet train's defaults at the
# grid's best max_lr for 1800 steps, seeds 0-2, both evidence tasks (issue 15: the equal-compute reference).
# Usage: bash benchmarks/gpu_lr_sweep_cli4.sh
set -x
export PYTHONPATH=$PWD/src
python -c "import sys,torch;print(sys.version, torch.__version__, torch.cuda.get_device_name())" > $OUT/env.txt
python benchmarks/lr_sweep_cli.py --starts 1 --seeds 0,1,2 --tuned bytes,fashion --sweep 0 --steps 1800 --deadline 225 --runs /tmp/lsc_t --out $OUT/tuned_1800_s0-2.json > $OUT/tuned.log 2>&1
tail -n 40 $OUT/tuned.log
