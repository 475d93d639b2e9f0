# hdet.lr_sweep under torchrun on NCCL (2 GPUs, one run a rank; the rounds beyond the grid with an idle rank), and
# tests/gpu with its NCCL tests. Usage: bash benchmarks/gpu_nccl_sweep.sh (on a 2-GPU machine; writes to $OUT)
set -x
export PYTHONPATH=$PWD/src OMP_NUM_THREADS=1
nvidia-smi -L > $OUT/gpus.txt
python -c "import sys,torch;print(sys.version, torch.__version__, torch.cuda.get_device_name(), torch.cuda.nccl.version())" > $OUT/env.txt
timeout 200 python -m pytest tests/gpu -q -p no:cacheprovider > $OUT/gpu_tests.log 2>&1
for g in 0.003 3.0; do  # about the default job's LR, and 1000x it
  timeout 120 torchrun --standalone --nproc-per-node 2 -m hdet train --device cuda --lr-sweep 0.2 --max-lr $g \
    --checkpoint-every 0 --no-progress --out $OUT/cli_sweep_g$g > $OUT/cli_sweep_g$g.log 2>&1
done
timeout 120 torchrun --standalone --nproc-per-node 2 examples/ddp_train.py --lr-sweep 0.2 --max-lr 1.0 \
  --data-bytes 1000000 --out $OUT/ddp_example_sweep.json > $OUT/ddp_example_sweep.log 2>&1
tail -n 3 $OUT/gpu_tests.log; grep -h "lr sweep" $OUT/*.log; python - <<'PY'
import json, os, glob
out = os.environ["OUT"]
for f in sorted(glob.glob(f"{out}/cli_sweep_g*/summary.json")):
    s = json.load(open(f)); sw = s["lr_sweep"]
    print(f, sw["lrs"], sw["losses"], sw["max_lr"], s["final_metrics"])
PY
rm -rf $OUT/cli_sweep_g*/checkpoint*
