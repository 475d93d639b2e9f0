# Issue 15 (session 49): the 13 runs of the recipe (`hdet train --lr-sweep 0.2 --alpha 0`, GPT seeds 28-43 from 0.1x,
# 1x and 10x: ../sweep_alpha0/ calls 7-9) in which the stability guard acted, run again at the peak LR their sweep
# found (the same run: --lr-sweep-then restart trains as the run without a sweep at that --max-lr), with the guard as
# it is (recover: go back and cut 0.7 ** k) and with its first event going back without a cut (--lr-cut-after 1).
# Usage: bash benchmarks/gpu_guard_after.sh   (one GPU; GUARDS=... for other variants, TAG for the file name)
# Call 1 (session 49) ran the reruns at hdet train's default alpha 0.2, not the sources' 0: guard_events.py did not pass
# the source run's --alpha then (it does now); call 2 is the same command at alpha 0: TAG=_after1_a0. Call 3: the
# event runs of seeds 12-27 (calls 1-3, whose rows do not say their alpha: --alpha 0 given):
# SOURCES="$D/call1/*bytes*.json $D/call2/*.json $D/call3/*.json" TAG=_after1_s12-27 bash benchmarks/gpu_guard_after.sh
# Session 50 (../confirm_after1/ call 4): the fresh seeds' event runs with the rule before and the default:
# SOURCES="<confirm_after1 calls 1-3's GPT JSONs>" GUARDS=recover,recover:0.7:0 TAG=_confirm DEADLINE=400
set -x
export PYTHONPATH=$PWD/src
python -c "import sys,torch;print(sys.version, torch.__version__, torch.cuda.get_device_name())" > $OUT/env.txt
D=benchmarks/results/evidence/sweep_alpha0
if [ -n "$FIXED" ]; then
  for t in bytes:0.04 fashion:0.16; do
    python benchmarks/guard_events.py --task ${t%%:*} --fixed-lr ${t##*:} --seeds 0,1,2 --guards recover,recover:0.7:1 \
      --runs /tmp/ge_fixed --deadline 500 --out $OUT/guard_events_10x_${t%%:*}.json > $OUT/guard_events_${t%%:*}.log 2>&1 &
  done
  wait; tail -n 8 $OUT/guard_events_*.log; exit
fi
python benchmarks/guard_events.py --task ${TASK:-bytes} --from ${SOURCES:-$D/call7/*.json $D/call8/*.json $D/call9/*.json} \
  --alpha 0 --guards ${GUARDS:-recover,recover:0.7:1} --runs /tmp/ge${TAG:-_after1} --deadline ${DEADLINE:-520} \
  --out $OUT/guard_events${TAG:-_after1}.json > $OUT/guard_events.log 2>&1
tail -n 30 $OUT/guard_events.log
# Call 4 (FIXED=1): started 10x too high without a sweep (hdet train's default alpha 0.2), where the guard has to bring
# the LR down: GPT max_lr 0.04 and Fashion-MNIST 0.16, seeds 0-2 (sweep_then_train calls 21-22's runs), both rules.
# FIXED=1 bash benchmarks/gpu_guard_after.sh   (data/fashion carried)
# Call 5: Fashion-MNIST's event runs of the recipe (sweep_alpha0 calls 1 and 5: seeds 12-17), both rules (data/fashion
# carried): TASK=fashion SOURCES="$D/call1/*alpha0_fashion*.json $D/call5/*alpha0_fashion*.json" TAG=_after1_fashion
