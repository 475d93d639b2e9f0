set -x
export PYTHONPATH=$PWD/src
python -c "import sys,torch;print(sys.version, torch.__version__, torch.cuda.get_device_name())" > $OUT/env.txt
nvidia-smi -L >> $OUT/env.txt
python benchmarks/local_sweep_signal.py --task bytes --best 0.004 --powers=-4,-3,-2,-1,0,1,2,3 --steps 150,300 --seeds 0,1,2 --out $OUT/local_sweep_bytes.json > $OUT/bytes.log 2>&1 &
python benchmarks/local_sweep_signal.py --task bytes --best 0.004 --powers=-4,-3,-2,-1,0,1,2,3 --steps 150,300 --seeds 0,1,2 --batch-factor 8 --out $OUT/local_sweep_bytes_b8.json > $OUT/bytes_b8.log 2>&1 &
python benchmarks/local_sweep_signal.py --task fashion --data data/fashion --best 0.016 --steps 150,300 --seeds 0,1,2 --out $OUT/local_sweep_fashion.json > $OUT/fashion.log 2>&1 &
python benchmarks/local_sweep_signal.py --task fashion --data data/fashion --best 0.016 --steps 150,300 --seeds 0,1,2 --batch-factor 8 --out $OUT/local_sweep_fashion_b8.json > $OUT/fashion_b8.log 2>&1 &
wait
tail -n 3 $OUT/*.log
