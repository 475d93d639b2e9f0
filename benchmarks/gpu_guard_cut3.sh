# Call 23 (issue 15): the three Fashion-MNIST runs of call 17 in which the stability guard acted, again at their swept
# peak LR, with the rule before (every cut 0.5; old: the hdet of scratch_wt/src, commit cb5dacd, as in
# gpu_guard_cut2.sh) and hdet train's default now (--lr-cut 0.7, the k-th cut 0.7 ** k).
# Usage: bash benchmarks/gpu_guard_cut3.sh (carry data/fashion and scratch_wt)
set -x
export PYTHONPATH=$PWD/src
D=benchmarks/results/evidence/sweep_then_train
python -c "import sys,torch;print(sys.version, torch.__version__, torch.cuda.get_device_name())" > $OUT/env.txt
python benchmarks/guard_events.py --task fashion --from $D/call17/lr_sweep_cli_lattice_fashion_s12-14.json \
  --guards old:recover,recover --old-src $PWD/scratch_wt/src --runs /tmp/gf --deadline 500 \
  --out $OUT/guard_cut3_fashion.json > $OUT/fashion.log 2>&1
tail -n 8 $OUT/*.log
