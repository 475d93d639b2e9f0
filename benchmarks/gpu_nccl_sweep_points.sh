# hdet train --lr-sweep --lr-sweep-points 8 under torchrun on NCCL (2 GPUs: a grid of 8 LRs in rounds of 2), with
# restart and continue. Usage: bash benchmarks/gpu_nccl_sweep_points.sh (on a 2-GPU machine; writes to $OUT)
set -x
export PYTHONPATH=$PWD/src OMP_NUM_THREADS=1
nvidia-smi -L > $OUT/gpus.txt
python -c "import sys,torch;print(sys.version, torch.__version__, torch.cuda.get_device_name(), torch.cuda.nccl.version())" > $OUT/env.txt
for then in restart continue; do
  timeout 150 torchrun --standalone --nproc-per-node 2 -m hdet train --device cuda --lr-sweep 0.2 --lr-sweep-points 8 \
    --lr-sweep-then $then --checkpoint-every 0 --no-progress --out $OUT/points8_$then > $OUT/points8_$then.log 2>&1
done
python - <<'PY'
import json, os
out = os.environ["OUT"]
for then in ("restart", "continue"):
    s = json.load(open(f"{out}/points8_{then}/summary.json")); sw = s["lr_sweep"]
    print(then, len(sw["lrs"]), [f"{x:.3g}" for x in sw["lrs"]], sw["losses"], sw["pick"], sw["max_lr"], s["final_metrics"])
PY
grep -h "lr sweep\|warning\|validation" $OUT/*.log
find $OUT -name "*.pt" -delete; find $OUT -name "*.png" -delete
