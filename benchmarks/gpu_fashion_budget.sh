# Session 34 (2026-12-01), one H200, the second call: (1) tests/gpu/test_kernels_cuda.py (bf16 weights stay merged);
# (2) Fashion-MNIST, the recipe at ONE run's compute (`--steps 1250`, the 250-step sweep inside the plain run's 1500
# steps), alpha 0 and alpha 0.2 at seeds 12-17, side by side in one call (the first call's two such JSONs did not come
# back: at most 8 files a call). data/fashion carried. Usage: `bash benchmarks/gpu_fashion_budget.sh` (writes to $OUT)
set -x
export PYTHONPATH=$PWD/src
python -c "import sys,torch;print(sys.version, torch.__version__, torch.cuda.get_device_name())" > $OUT/env.txt
timeout 120 python -m pytest tests/gpu/test_kernels_cuda.py -q -p no:cacheprovider \
  -k "adamw_bf16" > $OUT/gpu_kernels.log 2>&1
tail -n 3 $OUT/gpu_kernels.log
for A in 0 0.2; do
  python benchmarks/lr_sweep_cli.py --tasks fashion --starts 0.1,1,10 --then restart --deadline ${DEADLINE:-200} \
    --seeds 12,13,14,15,16,17 --steps 1250 --runs /tmp/fb$A --extra "--alpha $A" \
    --out $OUT/sweep_budget_alpha${A}_fashion_s12-17.json > $OUT/budget_alpha$A.log 2>&1
done
tail -n 3 $OUT/*.log
