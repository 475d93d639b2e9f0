# sweep_then_train.py, fourth call (issue 15): the sqrt(N) recipe of the second call on three more GPT seeds, and on
# Fashion-MNIST picked by the held-out loss instead. Usage: bash benchmarks/gpu_sweep_then_train4.sh
set -x
export PYTHONPATH=$PWD/src
python -c "import sys,torch;print(sys.version, torch.__version__, torch.cuda.get_device_name())" > $OUT/env.txt
common="--starts 0.1,1,10 --sweep-frac 0.2 --factor sqrt --centre scaled --jobs 9"
python benchmarks/sweep_then_train.py --task bytes --best 0.004 $common --seeds 3,4,5 --judge train --runs /tmp/stt_b --out $OUT/sweep_then_train_bytes_sqrt_s345.json > $OUT/bytes.log 2>&1 &
python benchmarks/sweep_then_train.py --task fashion --data data/fashion --best 0.016 $common --seeds 0,1,2 --judge heldout --runs /tmp/stt_f --out $OUT/sweep_then_train_fashion_sqrt_heldout.json > $OUT/fashion.log 2>&1 &
wait
tail -n 5 $OUT/*.log
