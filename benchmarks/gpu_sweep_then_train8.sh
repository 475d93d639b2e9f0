# sweep_then_train.py, eighth call (issue 15): where the recipe's cost over HDET at the tuned LR comes from. The
# configurations and seeds of calls 2 (GPT) and 4 (Fashion-MNIST), with (a) the main run from the initial weights for
# all 1500 steps at the same pick (--from init: 20% more compute; the pick's worth alone, without the sweep's steps
# on 1/N of the data), and (b) a sweep of 10% of the steps instead of 20% (cheaper, noisier).
# Usage: bash benchmarks/gpu_sweep_then_train8.sh
set -x
export PYTHONPATH=$PWD/src
python -c "import sys,torch;print(sys.version, torch.__version__, torch.cuda.get_device_name())" > $OUT/env.txt
b="--task bytes --best 0.004 --factor sqrt --centre scaled --judge train --seeds 0,1,2 --starts 0.1,1,10 --jobs 9"
f="--task fashion --data data/fashion --best 0.016 --factor sqrt --centre scaled --judge heldout --seeds 0,1,2 --starts 0.1,1,10 --jobs 9"
python benchmarks/sweep_then_train.py $b --sweep-frac 0.2 --from init --runs /tmp/stt_bi --out $OUT/call8_init_bytes.json > $OUT/bytes_init.log 2>&1 &
python benchmarks/sweep_then_train.py $f --sweep-frac 0.2 --from init --runs /tmp/stt_fi --out $OUT/call8_init_fashion.json > $OUT/fashion_init.log 2>&1 &
python benchmarks/sweep_then_train.py $b --sweep-frac 0.1 --runs /tmp/stt_b1 --out $OUT/call8_frac01_bytes.json > $OUT/bytes_frac01.log 2>&1 &
python benchmarks/sweep_then_train.py $f --sweep-frac 0.1 --runs /tmp/stt_f1 --out $OUT/call8_frac01_fashion.json > $OUT/fashion_frac01.log 2>&1 &
wait
tail -n 3 $OUT/*.log
