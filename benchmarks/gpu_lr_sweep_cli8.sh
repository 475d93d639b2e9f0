# Still more seeds for the restart recipe on the GPT (issue 15; fixed before the call, whatever it shows: the cells of
# calls 9, 10 and 13 had 11 seeds each, and one run's noise, about 1.2%, is larger than the 0.5% target): hdet train
# --lr-sweep 0.2 (restart) from 0.1x / 1x / 10x at seeds 23-27, and the seeds' references without a sweep at the
# grid's best max_lr (plain DP and hdet train's defaults) at seeds 21-23. Usage: bash benchmarks/gpu_lr_sweep_cli8.sh
set -x
export PYTHONPATH=$PWD/src
python -c "import sys,torch;print(sys.version, torch.__version__, torch.cuda.get_device_name())" > $OUT/env.txt
python benchmarks/lr_sweep_cli.py --tasks bytes --seeds 23,24,25,26,27 --then restart --deadline 500 --runs /tmp/lsc --out $OUT/lr_sweep_cli_restart_bytes_s23-27.json > $OUT/sweep.log 2>&1 &
python benchmarks/lr_sweep_cli.py --tasks bytes --starts 1 --seeds 21,22,23 --tuned bytes --sweep 0 --deadline 500 --runs /tmp/lsc_t --out $OUT/tuned_bytes_s21-23.json > $OUT/tuned.log 2>&1 &
wait
tail -n 30 $OUT/*.log
