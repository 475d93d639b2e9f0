# Session 34 (2026-12-01), one H200, the last call: `python -m pytest tests/gpu` on the session's final code (the
# bf16 merged bound of tests/gpu/test_kernels_cuda.py among them), and `hdet train --device cuda` (the README's job).
# Usage: `bash benchmarks/gpu_tests_final.sh` (writes to $OUT)
export PYTHONPATH=$PWD/src
python -c "import sys,torch;print(sys.version, torch.__version__, torch.cuda.get_device_name())" > $OUT/env.txt
timeout 300 python -m pytest tests/gpu -q -p no:cacheprovider -rs > $OUT/gpu_tests.log 2>&1
tail -n 12 $OUT/gpu_tests.log
cd /tmp && timeout 120 python -m hdet train --device cuda --no-progress --out /tmp/hdet_cuda > $OUT/hdet_train_cuda.log 2>&1
tail -n 3 $OUT/hdet_train_cuda.log
