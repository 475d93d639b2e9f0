#!/usr/bin/env bash
# Issue 15: AdamW at the step size that D-Adaptation / Prodigy settle on, seeds 0-2, one GPU, every
# (task, estimator, seed) in its own process at once; merged into one JSON per task.
# usage: bash benchmarks/gpu_lr_free_estimate.sh OUTDIR [TASKS]   (run from the repo root; carry .whl data/fashion)
# TASKS: "bytes fashion" (the default; both at once ran out of a call's 600 s on one H100) or one of them
set -u
export PYTHONPATH=$PWD/src
python -m pip install -q --no-index --no-deps .whl/dadaptation-3.2-py3-none-any.whl .whl/prodigyopt-1.1.2-py3-none-any.whl
O=$1; TASKS=${2:-bytes fashion}; W=runs/lfe; mkdir -p "$O" "$W"; nvidia-smi -L > "$O/gpus.txt"; python --version >> "$O/gpus.txt"
for seed in 0 1 2; do
  for est in dadapt prodigy; do
    nb=$([ "$seed" = 0 ] && echo "" || echo "--no-best")  # AdamW at the grid's best: seed 0 only, an anchor
    case " $TASKS " in *" bytes "*)
      python benchmarks/lr_free_estimate.py --task bytes --best 0.004 --estimator $est --seed $seed $nb --device cuda \
        --runs $W/bytes-$est-$seed --out $W/bytes-$est-$seed.json > $W/bytes-$est-$seed.log 2>&1 & ;; esac
    case " $TASKS " in *" fashion "*)
      python benchmarks/lr_free_estimate.py --task fashion --data data/fashion --best 0.016 --estimator $est \
        --seed $seed $nb --device cuda --runs $W/fashion-$est-$seed --out $W/fashion-$est-$seed.json \
        > $W/fashion-$est-$seed.log 2>&1 & ;; esac
  done
done
wait
python - "$W" "$O" <<'PY'
import json, sys, pathlib
w, o = map(pathlib.Path, sys.argv[1:])
for task in ("bytes", "fashion"):
    recs = [json.loads(p.read_text()) for p in sorted(w.glob(f"{task}-*.json"))]
    if not recs:
        continue
    (o / f"lr_free_estimate_{task}.json").write_text(json.dumps(
        {"command": "bash benchmarks/gpu_lr_free_estimate.sh $OUT", "processes": recs}, indent=1))
PY
for f in $W/*.log; do echo "== $f"; tail -n 5 "$f"; done > "$O/logs.txt"
tail -n 40 "$O/logs.txt"
