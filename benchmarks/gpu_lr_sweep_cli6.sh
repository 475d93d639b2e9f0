# Where HDET's own best max_lr lies against plain DP's (issue 15): the restart recipe's 1x starts (picks 1.12-1.28x the
# grid's best) ended the GPT 0.5% better than hdet train's defaults at exactly 1x on the same seeds, and its 10x starts
# (picks 0.96-1.04x) worse than the 1x starts in 10 of 11 seeds. Without a sweep: the GPT at 1.25x and 1.6x the grid's
# best, hdet train's defaults at seeds 12-17 and plain DP at seeds 12-16; Fashion-MNIST's defaults at 2x (the plain
# grid's best 3-seed mean, 3.2e-2) at seeds 0-2. Usage: bash benchmarks/gpu_lr_sweep_cli6.sh (carry data/fashion)
set -x
export PYTHONPATH=$PWD/src
python -c "import sys,torch;print(sys.version, torch.__version__, torch.cuda.get_device_name())" > $OUT/env.txt
python benchmarks/lr_sweep_cli.py --tasks bytes --sweep 0 --tuned bytes --tuned-at 1.25,1.6 --tuned-kinds hdet --seeds 12,13,14,15,16,17 --deadline 530 --runs /tmp/lsc_h --out $OUT/hdet_bytes_1.25_1.6_s12-17.json > $OUT/hdet.log 2>&1 &
python benchmarks/lr_sweep_cli.py --tasks bytes --sweep 0 --tuned bytes --tuned-at 1.25,1.6 --tuned-kinds plain --seeds 12,13,14,15,16 --deadline 530 --runs /tmp/lsc_p --out $OUT/plain_bytes_1.25_1.6_s12-16.json > $OUT/plain.log 2>&1 &
python benchmarks/lr_sweep_cli.py --tasks fashion --sweep 0 --tuned fashion --tuned-at 2 --tuned-kinds hdet --seeds 0,1,2 --deadline 530 --runs /tmp/lsc_f --out $OUT/hdet_fashion_2_s0-2.json > $OUT/fashion.log 2>&1 &
wait
tail -n 20 $OUT/*.log
