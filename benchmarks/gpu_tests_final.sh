# The last call of a session on one H200: `python -m pytest tests/gpu` on the session's final code, and
# `hdet train --device cuda` (the README's job). Sessions 34 and 36 (2026-12-01; 36: the half-precision fused AdamW
# decay test of tests/gpu/test_kernels_cuda.py among them).
# Usage: `bash benchmarks/gpu_tests_final.sh` (writes to $OUT)
export PYTHONPATH=$PWD/src
python -c "import sys,torch;print(sys.version, torch.__version__, torch.cuda.get_device_name())" > $OUT/env.txt
timeout 300 python -m pytest tests/gpu -q -p no:cacheprovider -rs > $OUT/gpu_tests.log 2>&1
tail -n 12 $OUT/gpu_tests.log
cd /tmp && timeout 120 python -m hdet train --device cuda --no-progress --out /tmp/hdet_cuda > $OUT/hdet_train_cuda.log 2>&1
tail -n 3 $OUT/hdet_train_cuda.log
