# Host time of the engine's per-step scheduler bookkeeping (benchmarks/engine_sched_cost.py, N = 8 and 32), this
# tree's src/ against an older one, on the GPU machine's host CPU, in the order A B B A A B B A (each run in its own
# process; the machine's speed drifts over a call, so the order is balanced); one JSON with every run.
# Usage: bash benchmarks/gpu_host_ab.sh OLD_SRC (a copy of an older commit's src/, e.g. `git archive C src | tar -x -C
# data/old_src`, carried), writes $OUT/host_ab.json
OLD=$1
python - "$OLD" <<'PY'
import json, os, platform, subprocess, sys
old, out = sys.argv[1], os.environ["OUT"]
runs = []
for which in ("old", "new", "new", "old", "old", "new", "new", "old"):
    env = dict(os.environ, PYTHONPATH=os.path.join(os.getcwd(), "src") if which == "new" else old)
    subprocess.run([sys.executable, "benchmarks/engine_sched_cost.py", "--replicas", "8,32", "--steps", "500",
                    "--out", "/tmp/run.json"], env=env, check=True, capture_output=True)
    runs.append({"src": which, **json.load(open("/tmp/run.json"))})
import statistics
med = {w: {n: statistics.median(r["seconds_per_step"][n] for r in runs if r["src"] == w) for n in ("8", "32")}
       for w in ("old", "new")}
rec = {"command": "bash benchmarks/gpu_host_ab.sh " + old, "python": platform.python_version(),
       "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
       "median_seconds_per_step": med, "runs": runs}
json.dump(rec, open(os.path.join(out, "host_ab.json"), "w"), indent=1)
print(json.dumps(med))
PY
