#!/bin/bash
# The engine's backward on the calling thread (issue 19; tried in session 30 as hdet.engine._backward_here, not kept:
# benchmarks/results/gpu_h200/onethread/README.md): the previous code (its backward on
# autograd's CUDA thread, data/old/src = `git archive 665c317 src`) against this one, interleaved in one process
# (benchmarks/engine_ab.py), with the one-model baseline timed both ways (--baseline-one-thread), N = 8, on the tiny,
# small and medium GPTs, merged and vmapped, float32 and bf16 autocast.
# Usage: OUT=dir bash benchmarks/gpu_onethread.sh
set -e
export PYTHONPATH=$PWD/src
python -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_cuda.py tests/gpu/test_merged_graph_cuda.py -W ignore 2>&1 | tail -1
for ac in none bf16; do
  for task in tiny small medium; do
    python -W ignore benchmarks/engine_ab.py --old data/old/src --task $task --mode merged --autocast $ac \
      --rounds 5 --steps 15 --baseline-one-thread --out $OUT/ab_merged_${task}_${ac}.json
  done
  python -W ignore benchmarks/engine_ab.py --old data/old/src --task small --mode vmap --autocast $ac \
    --rounds 5 --steps 15 --baseline-one-thread --out $OUT/ab_vmap_small_${ac}.json
done
