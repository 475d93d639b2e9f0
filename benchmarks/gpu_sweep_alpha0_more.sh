# Issue 15 (session 33), call 4 of ../results/evidence/sweep_alpha0/: (1) the recipe at ONE run's compute
# (`--steps 1250`, the 250-step sweep inside the plain run's 1500 steps) at alpha 0 (the default after a sweep since
# 2026-12-01) at GPT seeds 17-21, whose alpha-0.2 runs are in ../sweep_budget/call3/; (2) Fashion-MNIST at 1500 steps,
# both arms (alpha 0 and 0.2) at fresh seeds 15-17. One GPU; data/fashion carried.
# Usage: `DEADLINE=320 bash benchmarks/gpu_sweep_alpha0_more.sh`
set -x
export PYTHONPATH=$PWD/src
python -c "import sys,torch;print(sys.version, torch.__version__, torch.cuda.get_device_name())" > $OUT/env.txt
python benchmarks/lr_sweep_cli.py --tasks bytes --starts 0.1,1,10 --seeds 17,18,19,20,21 --steps 1250 --sweep 0.2 \
  --then restart --deadline ${DEADLINE:-300} --runs /tmp/lsc_b --extra "--alpha 0" \
  --out $OUT/sweep_budget_alpha0_bytes_s17-21.json > $OUT/sweep_bytes.log 2>&1 &
for A in 0 0.2; do
  python benchmarks/lr_sweep_cli.py --tasks fashion --starts 0.1,1,10 --seeds 15,16,17 --then restart \
    --deadline ${DEADLINE:-300} --runs /tmp/lsc_f$A --extra "--alpha $A" \
    --out $OUT/lr_sweep_cli_alpha${A}_fashion_s15-17.json > $OUT/sweep_fashion_$A.log 2>&1 &
done
wait
tail -n 5 $OUT/*.log
