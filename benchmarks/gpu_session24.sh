# Session 24's changes on the GPU: the GPU tests (NCCL ones need 2 GPUs) and the engine before and after, side by side
# (benchmarks/engine_ab.py against the session's start, d80472f, in data/old: `git archive d80472f src | tar -x -C
# data/old`, carried). Usage: `bash benchmarks/gpu_session24.sh` on nvidia-h200-x2.
set -x
export PYTHONPATH=$PWD/src
python -c "import sys,torch;print(sys.version, torch.__version__, torch.cuda.get_device_name(), torch.cuda.device_count())" > $OUT/env.txt
timeout 240 python -m pytest -q -p no:cacheprovider tests/gpu -rs > $OUT/gpu_tests.log 2>&1
tail -n 3 $OUT/gpu_tests.log
for task in tiny small; do
  timeout 150 python benchmarks/engine_ab.py --old data/old/src --task $task --out $OUT/engine_ab_$task.json > $OUT/engine_ab_$task.log 2>&1
  tail -n 1 $OUT/engine_ab_$task.log
done
