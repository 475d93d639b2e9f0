# Call 22 (issue 15): each cut harder than the one before (the k-th lr_cut ** k) at --lr-cut 0.7, against the rule
# before it (every cut 0.5; old: runs the hdet of scratch_wt/src, commit in scratch_wt/COMMIT, made with
# `git archive cb5dacd src | tar -x -C scratch_wt && git rev-parse cb5dacd > scratch_wt/COMMIT`). The six GPT event runs of calls 17-18 and the 10x starts
# of call 21 with the new rule; the GPT at 1.5x the grid best (max_lr 0.006) on fresh seeds 28-39 with both.
# Usage: bash benchmarks/gpu_guard_cut2.sh (carry data/fashion and scratch_wt)
set -x
export PYTHONPATH=$PWD/src
D=benchmarks/results/evidence/sweep_then_train
python -c "import sys,torch;print(sys.version, torch.__version__, torch.cuda.get_device_name())" > $OUT/env.txt
python benchmarks/guard_events.py --task fashion --fixed-lr 0.16 --seeds 0,1,2 --guards recover:0.7 --runs /tmp/gf \
  --deadline 530 --out $OUT/guard_cut2_fashion.json > $OUT/fashion.log 2>&1 &
python benchmarks/guard_events.py --task bytes --fixed-lr 0.006 --seeds 28,29,30,31,32,33,34,35,36,37,38,39 \
  --guards old:recover,recover:0.7 --old-src $PWD/scratch_wt/src --runs /tmp/gn --deadline 530 \
  --out $OUT/guard_cut2_bytes_1.5x.json > $OUT/bytes_1.5x.log 2>&1 &
python benchmarks/guard_events.py --task bytes --from $D/call17/lr_sweep_cli_lattice_bytes_x10_s12-27.json \
  $D/call18/lr_sweep_cli_lattice_bytes_x0.1_s12-27.json $D/call18/lr_sweep_cli_lattice_bytes_x1_s12-17.json \
  --fixed-lr 0.04 --seeds 0,1,2 --guards recover:0.7 --runs /tmp/gb --deadline 530 --out $OUT/guard_cut2_bytes.json > $OUT/bytes.log 2>&1
wait
tail -n 5 $OUT/*.log
