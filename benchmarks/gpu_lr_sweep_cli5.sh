# More seeds for the restart recipe on the GPT (issue 15; fixed before each call, whatever it shows: one run's noise,
# about 1.2%, is larger than the 0.5% target): hdet train --lr-sweep 0.2 (restart) from 0.1x / 1x / 10x at SEEDS, and
# the seeds' references without a sweep at the grid's best max_lr (plain DP and hdet train's defaults) at REF_SEEDS.
# Usage: bash benchmarks/gpu_lr_sweep_cli5.sh (call 13: seeds 18-22, references 18-20); call 16 is
# benchmarks/gpu_lr_sweep_cli8.sh (SEEDS=23,24,25,26,27 REF_SEEDS=21,22,23).
set -x
export PYTHONPATH=$PWD/src
S=${SEEDS:-18,19,20,21,22}
R=${REF_SEEDS:-18,19,20}
python -c "import sys,torch;print(sys.version, torch.__version__, torch.cuda.get_device_name())" > $OUT/env.txt
python benchmarks/lr_sweep_cli.py --tasks bytes --seeds $S --then restart --deadline 500 --runs /tmp/lsc --out $OUT/lr_sweep_cli_restart_bytes_s${S%%,*}-${S##*,}.json > $OUT/sweep.log 2>&1 &
python benchmarks/lr_sweep_cli.py --tasks bytes --starts 1 --seeds $R --tuned bytes --sweep 0 --deadline 500 --runs /tmp/lsc_t --out $OUT/tuned_bytes_s${R%%,*}-${R##*,}.json > $OUT/tuned.log 2>&1 &
wait
tail -n 30 $OUT/*.log
