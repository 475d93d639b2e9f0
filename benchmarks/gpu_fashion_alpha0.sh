# Session 34 (2026-12-01), one H200: (1) `python -m pytest tests/gpu` on this code (the fingerprint's CUDA test among
# them, written in session 33 and not run there); (2) the Fashion-MNIST rows session 33's call 4 left unfinished
# (../results/evidence/sweep_alpha0/): the recipe at ONE run's compute (`--steps 1250`) at alpha 0, seeds 12-17, and
# at alpha 0.2 at seeds 15-17 (seeds 12-14 at 0.2 are ../results/evidence/sweep_budget/call2/); then the recipe at
# 1500 steps, both arms, seeds 15-17. Fashion-MNIST runs only, one batch at a time (call 4 had 33 runs at once).
# data/fashion carried. Usage: `bash benchmarks/gpu_fashion_alpha0.sh` (writes to $OUT)
set -x
export PYTHONPATH=$PWD/src
python -c "import sys,torch;print(sys.version, torch.__version__, torch.cuda.get_device_name())" > $OUT/env.txt
timeout 200 python -m pytest tests/gpu -q -p no:cacheprovider > $OUT/gpu_tests.log 2>&1
tail -n 3 $OUT/gpu_tests.log
F="--tasks fashion --starts 0.1,1,10 --then restart --deadline ${DEADLINE:-150}"
python benchmarks/lr_sweep_cli.py $F --seeds 12,13,14,15,16,17 --steps 1250 --runs /tmp/f0b --extra "--alpha 0" \
  --out $OUT/sweep_budget_alpha0_fashion_s12-17.json > $OUT/budget_alpha0.log 2>&1
python benchmarks/lr_sweep_cli.py $F --seeds 15,16,17 --steps 1250 --runs /tmp/f2b --extra "--alpha 0.2" \
  --out $OUT/sweep_budget_alpha0.2_fashion_s15-17.json > $OUT/budget_alpha0.2.log 2>&1
for A in 0 0.2; do
  python benchmarks/lr_sweep_cli.py $F --seeds 15,16,17 --runs /tmp/f$A --extra "--alpha $A" \
    --out $OUT/lr_sweep_cli_alpha${A}_fashion_s15-17.json > $OUT/sweep_alpha$A.log 2>&1
done
tail -n 3 $OUT/*.log
