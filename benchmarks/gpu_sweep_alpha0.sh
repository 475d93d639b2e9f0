# Issue 15 (session 33): the recipe `hdet train --lr-sweep 0.2` (1500 steps after a 300-step sweep) with the run after
# the sweep WITHOUT HDET's spread (`--alpha 0`; the stability guard `on_runaway="recover"` kept), at the seeds whose
# alpha-0.2 runs are committed (GPT 12-27 in ../sweep_then_train/call17-23, Fashion-MNIST 12-14 in call17/19/23), from
# 0.1x, 1x and 10x the grid's best. One GPU; data/fashion carried.
# Usage: call 1 `bash benchmarks/gpu_sweep_alpha0.sh` (GPT 12-16 and Fashion-MNIST 12-14 side by side);
#        calls 2-3 `BYTES_SEEDS=17,18,19,20,21,22 FASHION_SEEDS= bash benchmarks/gpu_sweep_alpha0.sh`, then 23-27.
#        Session 48, fresh GPT seeds (out of the sample the default was chosen on): call 7
#        `STARTS=1 BYTES_SEEDS=28,...,43 FASHION_SEEDS= DEADLINE=420 bash benchmarks/gpu_sweep_alpha0.sh`, call 8 the same
#        with `STARTS=0.1,10` and seeds 28-35 (its JSON, named with a comma, did not come back: `--collect`ed into
#        `..._x0.1-10_s28-35.json` on the warm machine), call 9 seeds 36-43. Call 10: the factor 2.5 instead of sqrt(8),
#        from 1x at seeds 28-43, paired with call 7: `EXTRA="--lr-sweep-factor 2.5" TAG=_f2.5 STARTS=1 ...`.
#        Session 50, the confirmation of --lr-cut-after 1 at fresh seeds (../confirm_after1/): call 1 `STARTS=1
#        FASHION_STARTS=0.1,1,10 BYTES_SEEDS=44,...,59 FASHION_SEEDS=18,19,20 DEADLINE=480`, calls 2-3 `STARTS=0.1,10
#        BYTES_SEEDS=44,...,51 FASHION_SEEDS=` and 52-59 (FASHION_STARTS: Fashion-MNIST's starts, STARTS' otherwise).
set -x
export PYTHONPATH=$PWD/src
BS=${BYTES_SEEDS-12,13,14,15,16}
FS=${FASHION_SEEDS-12,13,14}
python -c "import sys,torch;print(sys.version, torch.__version__, torch.cuda.get_device_name())" > $OUT/env.txt
if [ -n "$BS" ]; then
  python benchmarks/lr_sweep_cli.py --tasks bytes --starts ${STARTS:-0.1,1,10} --seeds $BS --then restart \
    --deadline ${DEADLINE:-540} --runs /tmp/lsc_b --extra "--alpha 0 $EXTRA" \
    --out $OUT/lr_sweep_cli_alpha0${TAG}_bytes_x${STARTS//,/-}_s${BS//,/-}.json > $OUT/sweep_bytes.log 2>&1 &
fi
if [ -n "$FS" ]; then
  FST=${FASHION_STARTS:-${STARTS:-0.1,1,10}}
  python benchmarks/lr_sweep_cli.py --tasks fashion --starts $FST --seeds $FS --then restart \
    --deadline ${DEADLINE:-540} --runs /tmp/lsc_f --extra "--alpha 0" \
    --out $OUT/lr_sweep_cli_alpha0${TAG}_fashion_x${FST//,/-}_s${FS//,/-}.json > $OUT/sweep_fashion.log 2>&1 &
fi
wait
tail -n 12 $OUT/sweep_*.log
