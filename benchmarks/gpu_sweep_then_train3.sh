# sweep_then_train.py, third call (issue 15): the main run at the pick x the surge factor of the measured gradient noise scale, the sweep's grid centred on
# guess / sqrt(N), picked by the sweep runs' own training loss. Usage: bash benchmarks/gpu_sweep_then_train3.sh
set -x
export PYTHONPATH=$PWD/src
python -c "import sys,torch;print(sys.version, torch.__version__, torch.cuda.get_device_name())" > $OUT/env.txt
common="--starts 0.1,1,10 --seeds 0,1,2 --sweep-frac 0.2 --factor noise --centre scaled --judge train --jobs 9"
python benchmarks/sweep_then_train.py --task bytes --best 0.004 $common --runs /tmp/stt_b --out $OUT/sweep_then_train_bytes_noise.json > $OUT/bytes.log 2>&1 &
python benchmarks/sweep_then_train.py --task fashion --data data/fashion --best 0.016 $common --runs /tmp/stt_f --out $OUT/sweep_then_train_fashion_noise.json > $OUT/fashion.log 2>&1 &
wait
tail -n 5 $OUT/*.log
