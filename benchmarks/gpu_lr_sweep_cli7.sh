# A cheaper sweep (issue 15): hdet train --lr-sweep 0.1 (restart: 10% more steps than one run instead of 20%) from
# 0.1x / 1x / 10x the grid's best, the GPT at seeds 12-17 and Fashion-MNIST at seeds 12-14, the seeds of calls 9-10's
# --lr-sweep 0.2 (call 8's 10% sweeps, which went on from the best run, picked 1.3-3.2x on the GPT; call 14 found
# HDET flat over 1-1.6x). Usage: bash benchmarks/gpu_lr_sweep_cli7.sh (carry data/fashion)
set -x
export PYTHONPATH=$PWD/src
python -c "import sys,torch;print(sys.version, torch.__version__, torch.cuda.get_device_name())" > $OUT/env.txt
python benchmarks/lr_sweep_cli.py --tasks bytes --sweep 0.1 --seeds 12,13,14,15,16,17 --deadline 530 --runs /tmp/lsc_b --out $OUT/sweep01_bytes_s12-17.json > $OUT/bytes.log 2>&1 &
python benchmarks/lr_sweep_cli.py --tasks fashion --sweep 0.1 --seeds 12,13,14 --deadline 530 --runs /tmp/lsc_f --out $OUT/sweep01_fashion_s12-14.json > $OUT/fashion.log 2>&1 &
wait
tail -n 40 $OUT/*.log
