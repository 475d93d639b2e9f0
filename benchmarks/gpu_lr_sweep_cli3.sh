# hdet train --lr-sweep 0.2 (restart) on the GPT from 0.1x / 1x / 10x at seeds 15-17, and without a sweep at the
# grid's best max_lr (plain: --alpha 0 --on-runaway ignore; hdet train's defaults) at seeds 12-17: the references of
# these seeds and of gpu_lr_sweep_cli2.sh's (issue 15). Usage: bash benchmarks/gpu_lr_sweep_cli3.sh
set -x
export PYTHONPATH=$PWD/src
python -c "import sys,torch;print(sys.version, torch.__version__, torch.cuda.get_device_name())" > $OUT/env.txt
python benchmarks/lr_sweep_cli.py --tasks bytes --seeds 15,16,17 --then restart --deadline 480 --runs /tmp/lsc --out $OUT/lr_sweep_cli_restart_bytes_s15-17.json > $OUT/sweep.log 2>&1 &
python benchmarks/lr_sweep_cli.py --tasks bytes --starts 1 --seeds 12,13,14,15,16,17 --tuned bytes --sweep 0 --deadline 480 --runs /tmp/lsc_t --out $OUT/tuned_bytes_s12-17.json > $OUT/tuned.log 2>&1 &
wait
tail -n 30 $OUT/*.log
