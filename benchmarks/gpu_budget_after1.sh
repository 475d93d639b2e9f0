# Issue 15 follow-up (session 51, 2026-12-04): the recipe at ONE run's compute (`--steps 1250`: the 250-step sweep
# inside the plain run's steps, then the run at alpha 0 with the stability guard, `--lr-cut-after 1` by default) with
# today's code, from 0.1x, 1x and 10x the grid's best. Pre-registered in
# benchmarks/results/evidence/budget_after1/README.md before any call. One GPU; data/fashion carried.
# Usage: call 1 `BYTES_SEEDS=12,13,14,15,16 FASHION_SEEDS=12,13,14,15,16,17 bash benchmarks/gpu_budget_after1.sh`,
#        call 2 `BYTES_SEEDS=17,18,19,20,21 FASHION_SEEDS= bash ...`, call 3 `BYTES_SEEDS=22,23,24,25,26 ...`.
set -x
export PYTHONPATH=$PWD/src
BS=${BYTES_SEEDS-12,13,14,15,16}
FS=${FASHION_SEEDS-}
python -c "import sys,torch;print(sys.version, torch.__version__, torch.cuda.get_device_name())" > $OUT/env.txt
git log -1 --format=%H > $OUT/commit.txt
if [ -n "$BS" ]; then
  python benchmarks/lr_sweep_cli.py --tasks bytes --starts 0.1,1,10 --seeds $BS --steps 1250 --sweep 0.2 \
    --then restart --deadline ${DEADLINE:-480} --runs /tmp/ba_b --extra "--alpha 0" \
    --out $OUT/budget_after1_bytes_s${BS//,/-}.json > $OUT/budget_bytes.log 2>&1 &
fi
if [ -n "$FS" ]; then
  python benchmarks/lr_sweep_cli.py --tasks fashion --starts 0.1,1,10 --seeds $FS --steps 1250 --sweep 0.2 \
    --then restart --deadline ${DEADLINE:-480} --runs /tmp/ba_f --extra "--alpha 0" \
    --out $OUT/budget_after1_fashion_s${FS//,/-}.json > $OUT/budget_fashion.log 2>&1 &
fi
wait
tail -n 12 $OUT/budget_*.log
