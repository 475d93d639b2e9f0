# sweep_then_train.py on both evidence tasks at once, one GPU: a 20% sweep on the replicas' own batches, the main
# run at 2x the pick (issue 15). Usage: bash benchmarks/gpu_sweep_then_train.sh (writes under $OUT)
set -x
export PYTHONPATH=$PWD/src
python -c "import sys,torch;print(sys.version, torch.__version__, torch.cuda.get_device_name())" > $OUT/env.txt
nvidia-smi -L >> $OUT/env.txt
common="--starts 0.1,1,10 --seeds 0,1,2 --sweep-frac 0.2 --factor 2 --jobs 9"
python benchmarks/sweep_then_train.py --task bytes --best 0.004 $common --runs /tmp/stt_b --out $OUT/sweep_then_train_bytes.json > $OUT/bytes.log 2>&1 &
python benchmarks/sweep_then_train.py --task fashion --data data/fashion --best 0.016 $common --runs /tmp/stt_f --out $OUT/sweep_then_train_fashion.json > $OUT/fashion.log 2>&1 &
wait
tail -n 5 $OUT/*.log
