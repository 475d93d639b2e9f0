# One H200 call (session 52, 2026-12-04): torch step-function schedulers as HDETLR's base over device tensor LRs,
# their closed form on the host (no host sync a step) against the LRs read back (before), and tests/gpu/test_cuda.py.
# Usage: `bash benchmarks/gpu_tensor_lr_base.sh` (writes to $OUT)
export PYTHONPATH=$PWD/src
python -c "import sys,torch;print(sys.version, torch.__version__, torch.cuda.get_device_name())" > $OUT/env.txt
git log -1 --format=%H > $OUT/commit.txt 2>/dev/null
timeout 200 python -m pytest tests/gpu/test_cuda.py -q -p no:cacheprovider -rs > $OUT/test_cuda.log 2>&1
tail -n 3 $OUT/test_cuda.log
for size in tiny small; do for base in cosine multistep; do
  timeout 150 python benchmarks/tensor_lr_base.py --size $size --base $base --out $OUT/${size}_${base}.json
done; done
