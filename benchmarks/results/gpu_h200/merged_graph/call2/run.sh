set -e
export PYTHONPATH=$PWD/src
python -c "import platform, torch; print(platform.python_version(), torch.__version__, torch.cuda.get_device_name())"
python -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tail -4 | tee $OUT/gpu_tests.log
mkdir -p /tmp/h && cd /tmp/h
for m in "--mode vmap" "--mode merged" "--mode merged --cuda-graph"; do
  python -m hdet train --no-progress --device cuda $m --out runs/x 2>&1 | grep -v Warn | tail -3 | head -1 | tee -a $OUT/hdet_train_cuda.log
done
cd -
python -W ignore benchmarks/engine_throughput.py --sizes tiny,small,medium --modes merged,merged+graph --optimizers fused --out $OUT/engine_throughput_graph2.json | cut -c1-400
