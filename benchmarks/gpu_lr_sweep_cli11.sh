# Calls 24 and 25 (issue 15): hdet train --lr-sweep 0.2 (restart) at fresh GPT seeds 28-43, with the guard's rule of
# calls 21-23 (the k-th cut 0.7 ** k): out of the sample that chose it. Usage: call 24, from 10x the grid best,
# `bash benchmarks/gpu_lr_sweep_cli11.sh`; call 25, from 1x, `STARTS=1 DEADLINE=330 bash benchmarks/gpu_lr_sweep_cli11.sh`
set -x
export PYTHONPATH=$PWD/src
S=28,29,30,31,32,33,34,35,36,37,38,39,40,41,42,43
python -c "import sys,torch;print(sys.version, torch.__version__, torch.cuda.get_device_name())" > $OUT/env.txt
python benchmarks/lr_sweep_cli.py --tasks bytes --starts ${STARTS:-10} --seeds $S --then restart --deadline ${DEADLINE:-540} --runs /tmp/lsc --out $OUT/lr_sweep_cli_cut07_bytes_x${STARTS:-10}_s28-43.json > $OUT/sweep.log 2>&1
tail -n 20 $OUT/sweep.log
