#!/bin/bash
# Issue 19 item 3: HDET's DDP path against plain DDP + OneCycleLR on one multi-GPU host, with the step's tail
# after the backward on CUDA events (benchmarks/ddp_overhead.py, section 1b). ONLY and STEPS choose the configs.
# Usage (device machine, repo root): bash benchmarks/gpu_ddp_tail.sh WORLD OUT_DIR
set -u
WORLD=$1
OUT_DIR=$2
mkdir -p "$OUT_DIR"
export PYTHONPATH=$PWD/src
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT_DIR/gpus.txt"
python -c "import sys, torch; print(sys.version); print(torch.__version__, torch.cuda.nccl.version())" >> "$OUT_DIR/gpus.txt"
ONLY=${ONLY:-plain_again,hdet_T100,hdet_T1000,hdet_T100_schedclip,hdet_T1000_schedclip}
DEVICES=$(seq -s, 0 $((WORLD - 1)))
CUDA_VISIBLE_DEVICES=$DEVICES torchrun --standalone --nproc-per-node "$WORLD" benchmarks/ddp_overhead.py \
    --steps ${STEPS:-300} --clip 1.0 --profile-steps 10 --reps 10 --only "$ONLY" --out "$OUT_DIR/world$WORLD.json" \
    > "$OUT_DIR/world$WORLD.log" 2>&1
echo "rc=$?"
python - "$OUT_DIR/world$WORLD.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(json.dumps({"ms_per_step": d["ms_per_step"], "tail": d["tail_after_backward"],
                  "sync_debug": d.get("sync_debug_mode_error")}, indent=1))
for k, v in d["timeline"].items():
    if isinstance(v, dict):
        print(k, round(v.get("added_ms_per_step", 0) * 1000, 1), "us added;",
              list(v.get("added_kernels", {}).items())[:6])
PY
