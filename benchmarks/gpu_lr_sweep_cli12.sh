# Call 25 (issue 15): hdet train --lr-sweep 0.2 (restart) from 1x the GPT's grid best, at fresh seeds 28-43, with the
# guard's rule of calls 21-23 (the k-th cut 0.7 ** k): out of the sample that chose it, paired with call 24 seed for seed.
# Usage: bash benchmarks/gpu_lr_sweep_cli12.sh
set -x
export PYTHONPATH=$PWD/src
S=28,29,30,31,32,33,34,35,36,37,38,39,40,41,42,43
python -c "import sys,torch;print(sys.version, torch.__version__, torch.cuda.get_device_name())" > $OUT/env.txt
python benchmarks/lr_sweep_cli.py --tasks bytes --starts 1 --seeds $S --then restart --deadline 330 --runs /tmp/lsc --out $OUT/lr_sweep_cli_cut07_bytes_x1_s28-43.json > $OUT/sweep.log 2>&1
tail -n 20 $OUT/sweep.log
