# sweep_then_train.py, fifth call (issue 15): a confirmation on fresh seeds of the rule chosen from calls 2 and 4
# (sqrt(N) x the vertex of a least-squares parabola through the 7 held-out losses around the best; picked on those
# calls' sweeps after the fact). Usage: bash benchmarks/gpu_sweep_then_train5.sh
set -x
export PYTHONPATH=$PWD/src
python -c "import sys,torch;print(sys.version, torch.__version__, torch.cuda.get_device_name())" > $OUT/env.txt
common="--starts 0.1,1,10 --sweep-frac 0.2 --factor sqrt --centre scaled --judge heldout --pick fit7 --jobs 9"
python benchmarks/sweep_then_train.py --task bytes --best 0.004 $common --seeds 6,7,8 --runs /tmp/stt_b --out $OUT/sweep_then_train_bytes_fit7.json > $OUT/bytes.log 2>&1 &
python benchmarks/sweep_then_train.py --task fashion --data data/fashion --best 0.016 $common --seeds 3,4,5 --runs /tmp/stt_f --out $OUT/sweep_then_train_fashion_fit7.json > $OUT/fashion.log 2>&1 &
wait
tail -n 5 $OUT/*.log
