# Call 21 (issue 15): the recovery's LR cut. The six GPT runs of calls 17-18 in which the stability guard acted,
# again at their swept peak LR, with --lr-cut 0.5 (the default: call 20's runs again), 0.7 and 0.85; and the
# 10x start without a sweep (GPT max_lr 0.04, Fashion-MNIST 0.16, seeds 0-2), where the guard cuts two to four
# times, with the same three cuts (benchmarks/guard_events.py). Usage: bash benchmarks/gpu_guard_cut.sh
set -x
export PYTHONPATH=$PWD/src
D=benchmarks/results/evidence/sweep_then_train
G=recover,recover:0.7,recover:0.85
python -c "import sys,torch;print(sys.version, torch.__version__, torch.cuda.get_device_name())" > $OUT/env.txt
python benchmarks/guard_events.py --task fashion --fixed-lr 0.16 --seeds 0,1,2 --guards $G --runs /tmp/gf \
  --deadline 520 --out $OUT/guard_cut_fashion.json > $OUT/fashion.log 2>&1 &
python benchmarks/guard_events.py --task bytes --from $D/call17/lr_sweep_cli_lattice_bytes_x10_s12-27.json \
  $D/call18/lr_sweep_cli_lattice_bytes_x0.1_s12-27.json $D/call18/lr_sweep_cli_lattice_bytes_x1_s12-17.json \
  --fixed-lr 0.04 --seeds 0,1,2 --guards $G --runs /tmp/gb --deadline 520 --out $OUT/guard_cut_bytes.json > $OUT/bytes.log 2>&1
wait
tail -5 $OUT/*.log
