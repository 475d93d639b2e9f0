# sweep_then_train.py, seventh call (issue 15): the main run's warm-up aligned with the whole run's (--main-pct align:
# its OneCycle peak at step 0.3 x 1500 = 450, as in a run without a sweep, instead of a fresh 0.3 of its own 1200
# steps, peak at 660), on the configurations and seeds of calls 2 (GPT) and 4 (Fashion-MNIST), so that the
# sweeps and picks repeat and only the schedule after them differs; and the 1x runs with the fresh warm-up again
# (control: do calls 2 and 4 reproduce with today's code?). Usage: bash benchmarks/gpu_sweep_then_train7.sh
set -x
export PYTHONPATH=$PWD/src
python -c "import sys,torch;print(sys.version, torch.__version__, torch.cuda.get_device_name())" > $OUT/env.txt
b="--task bytes --best 0.004 --sweep-frac 0.2 --factor sqrt --centre scaled --judge train --seeds 0,1,2"
f="--task fashion --data data/fashion --best 0.016 --sweep-frac 0.2 --factor sqrt --centre scaled --judge heldout --seeds 0,1,2"
python benchmarks/sweep_then_train.py $b --starts 0.1,1,10 --main-pct align --jobs 9 --runs /tmp/stt_ba --out $OUT/call7_align_bytes.json > $OUT/bytes_align.log 2>&1 &
python benchmarks/sweep_then_train.py $f --starts 0.1,1,10 --main-pct align --jobs 9 --runs /tmp/stt_fa --out $OUT/call7_align_fashion.json > $OUT/fashion_align.log 2>&1 &
python benchmarks/sweep_then_train.py $b --starts 1 --main-pct fresh --jobs 3 --runs /tmp/stt_bf --out $OUT/call7_fresh_bytes_1x.json > $OUT/bytes_fresh.log 2>&1 &
python benchmarks/sweep_then_train.py $f --starts 1 --main-pct fresh --jobs 3 --runs /tmp/stt_ff --out $OUT/call7_fresh_fashion_1x.json > $OUT/fashion_fresh.log 2>&1 &
wait
tail -n 3 $OUT/*.log
