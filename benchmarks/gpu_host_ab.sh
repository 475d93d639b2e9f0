# Host time of HDET's per-step bookkeeping, this tree's src/ against an older one side by side, on the GPU machine's
# host CPU (quieter than the 2-core VM): benchmarks/engine_sched_cost.py (the engine's N schedulers, N = 1, 8, 32) and
# benchmarks/step_cost.py (one scheduler's step against OneCycleLR), interleaved, three rounds each.
# Usage: bash benchmarks/gpu_host_ab.sh OLD_SRC (a copy of an older commit's src/, e.g. `git archive C src | tar -x -C
# data/old_src`, carried), writes to $OUT
OLD=$1
python -c "import sys,torch,platform;print(sys.version, torch.__version__, platform.processor(), torch.get_num_threads())" > $OUT/host_env.txt
for r in 1 2 3; do
  for which in new old; do
    if [ $which = new ]; then SRC=$PWD/src; else SRC=$OLD; fi
    PYTHONPATH=$SRC python benchmarks/engine_sched_cost.py --out $OUT/engine_sched_cost_${which}_$r.json > /dev/null
    PYTHONPATH=$SRC python benchmarks/step_cost.py --out $OUT/step_cost_${which}_$r.json > /dev/null
  done
done
python - <<'PY'
import json, os, glob
out = os.environ["OUT"]
for kind in ("engine_sched_cost", "step_cost"):
    for which in ("new", "old"):
        rows = [json.load(open(f)) for f in sorted(glob.glob(f"{out}/{kind}_{which}_*.json"))]
        key = "seconds_per_step" if kind == "engine_sched_cost" else "us_per_call"
        print(kind, which, [r[key] for r in rows])
PY
