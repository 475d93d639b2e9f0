# Session 34 (2026-12-01), one H200: the recipe's runs in which the stability guard acted (sweep_alpha0, alpha 0: the
# GPT at 0.1x seeds 13, 18; 1x seeds 14, 20, 24, 26; 10x seeds 17, 26; each went back once or twice and ended 1.217-1.253
# against 1.215 for the others), again with the default cut (0.7 ** k: how far a rerun moves) and with `--lr-cut 1`
# (going back without a cut): does the cut, rather than the spike, cost those runs? 16 runs side by side.
# Usage: `bash benchmarks/gpu_guard_cut.sh` (writes to $OUT)
set -x
export PYTHONPATH=$PWD/src
python -c "import sys,torch;print(sys.version, torch.__version__, torch.cuda.get_device_name())" > $OUT/env.txt
for CUT in 0.7 1; do
  for SS in 0.1:13,18 1:14,20,24,26 10:17,26; do
    S=${SS%%:*}; SEEDS=${SS#*:}
    python benchmarks/lr_sweep_cli.py --tasks bytes --starts $S --seeds $SEEDS --then restart \
      --deadline ${DEADLINE:-500} --runs /tmp/gc$CUT --extra "--alpha 0 --lr-cut $CUT" \
      --out $OUT/cut${CUT}_x${S}.json > /tmp/gc_${CUT}_$S.log 2>&1 &
  done
done
wait
tail -n 4 /tmp/gc_*.log > $OUT/run.log
