"""Is a learning-rate-free optimizer's gap its choice of step size? (issue 15)

One seed of the evidence suite's task (``benchmarks/evidence.py``'s sizes: N = 8 replicas in the engine, alpha 0,
1500 steps): D-Adaptation Adam (or ``--estimator prodigy``) at lr 1 under the OneCycle shape, then AdamW with
``max_lr`` = the d that it settled on, then AdamW at ``--best`` (the plain grid's best max_lr). If AdamW at d ends
where the estimator does, its gap to the grid is its estimate of the step size; if AdamW at d ends near the grid's
best, the gap is elsewhere. Writes JSON with the command, machine and versions.

    python benchmarks/lr_free_estimate.py --task fashion --data data/fashion --best 0.016 \\
        --out benchmarks/results/cpu/lr_free_estimate_fashion.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evidence import SIZES  # noqa: E402

from hdet.app.run import RunConfig, train  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=sorted(SIZES), default="fashion")
    p.add_argument("--data", default=None)
    p.add_argument("--best", type=float, required=True, help="the plain grid's best max_lr")
    p.add_argument("--estimator", choices=["dadapt", "prodigy"], default="dadapt",
                   help="D-Adaptation Adam or Prodigy (prodigyopt's defaults), at lr 1 under the OneCycle shape")
    p.add_argument("--no-best", action="store_true", help="skip AdamW at --best (known from the grid)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--runs", default="runs/lr_free_estimate")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    size = {k: v for k, v in SIZES[a.task].items() if k != "centre"}
    base = dict(task=a.task, data=a.data, replicas=8, device=a.device, mode="vmap", progress=False, checkpoint_every=0,
                eval_every=size["steps"] // 10, eval_batches=8, alpha=0.0, on_runaway="ignore", seed=a.seed, **size)
    runs: list[dict] = []

    def run(name: str, **over: object) -> dict:
        t0 = time.time()
        out = Path(a.runs) / name
        s = train(RunConfig(**base, **over, label=name, out=str(out)), argv=["lr_free_estimate", name])
        d = [r["d"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "d" in r]
        rec = {"name": name, **over, "final_metrics": s["final_metrics"], "final_d": d[-1] if d else None,
               "seconds": time.time() - t0}
        runs.append(rec)
        print(json.dumps(rec), flush=True)
        return rec

    d = run(a.estimator, optimizer={"dadapt": "dadapt-adam"}.get(a.estimator, a.estimator), max_lr=1.0)["final_d"]
    run("adamw-at-d", optimizer="adamw", max_lr=d)
    if not a.no_best:
        run("adamw-at-best", optimizer="adamw", max_lr=a.best)
    rec = {"command": "python " + " ".join(sys.argv), "python": platform.python_version(), "torch": torch.__version__,
           "device": torch.cuda.get_device_name(0) if a.device.startswith("cuda") else platform.machine(),
           "task": a.task, "size": size, "seed": a.seed, "estimator": a.estimator, "best_max_lr": a.best, "runs": runs}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
