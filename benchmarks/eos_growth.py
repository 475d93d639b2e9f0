"""D-Adaptation's estimate as a floor, Adam's edge of stability as a ceiling (issue 15): one rule for both tasks?

Measured before: D-Adaptation's step size lands at 0.85-1.08x the grid's best LR on the GPT and 0.18x on
Fashion-MNIST, and twice it serves Fashion-MNIST (92.07-92.09%) but not the GPT (+6.7 to +8.1%)
(``results/evidence/dadapt_x2/``); Adam's preconditioned sharpness ratio ``R`` (1 at the edge of stability) sits at
0.99-1.34 on the GPT from step 300 at every LR up to the best, and at 0.28-0.83 on the BatchNorm CNN at every LR up to
10x (``results/evidence/sharpness/``). So: HDET over D-Adaptation (alpha 0.2, T 25, ``on_runaway="recover"``), and
at each of ``--checks`` (inside OneCycle's warm-up) ``R`` of replica 0 at its current step size ``d x lr``; while
``R < --below`` the LR schedule of every replica is multiplied by ``--growth``, up to ``--cap`` in all. A run that
sits at the edge (the GPT) keeps D-Adaptation's estimate; one far below it (the CNN) grows. The three constants
were chosen from those two studies, on these two tasks: a third task would have to confirm them.

``R = d lr * lambda_max(P^-1 H) (1 - beta1) / (2 + 2 beta1)``, ``P = sqrt(v) + eps`` (D-Adaptation Adam's own
denominator, no bias correction), by ``--iters`` power iterations of Hessian-vector products on one fixed batch of
N x B training examples, on a copy of replica 0 (explicit attention). Writes JSON with the command, machine and
versions after every run.

    python benchmarks/eos_growth.py --task fashion --data data/fashion --seeds 0,1,2 --out fashion_eos.json
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing as mp
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from evidence import SIZES  # noqa: E402
from sharpness_signal import preconditioned_copy, top_eigenvalue  # noqa: E402


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    from hdet.app.options import RunConfig
    from hdet.app.run import final_metrics
    from hdet.app.runs import EngineRun, make_optimizer, to_device
    from hdet.app.tasks import make_task

    a = job["args"]
    dev = torch.device(job["device"])
    size = {k: v for k, v in SIZES[a["task"]].items() if k != "centre"}
    task = make_task(a["task"], data=a["data"], ctx=size["ctx"], width=size["width"], layers=size["layers"])
    N, B, steps = 8, size["batch"], a["steps"] or size["steps"]
    cfg = RunConfig(task=a["task"], data=a["data"], replicas=N, steps=steps, batch=B, alpha=0.2, T=size["T"],
                    max_lr=1.0, optimizer="dadapt-adam", weight_decay=size["weight_decay"], width=size["width"],
                    layers=size["layers"], ctx=size["ctx"], device=job["device"], mode="vmap", seed=job["seed"],
                    on_runaway="recover", progress=False, checkpoint_every=0)
    torch.manual_seed(job["seed"])
    run = EngineRun(task, task.make_model().to(dev), N, cfg, int(0.3 * steps), dev)
    eng = run.engine
    gens = [torch.Generator().manual_seed(job["seed"] * 1000 + r) for r in range(N)]  # as hdet train's
    probe = to_device(task.sample("train", N * B, torch.Generator().manual_seed(4242)), dev)
    checks = set(a["checks"]) if job["rule"] else set()
    rows, t0, grown = [], time.time(), 1.0
    for t in range(1, steps + 1):
        run.step([to_device(task.sample("train", B, gens[r]), dev) for r in range(N)])
        if t not in checks:
            continue
        m, params, scale = preconditioned_copy(eng, make_optimizer(task, cfg), bias_correction=False)
        g0 = eng.optimizers[0].param_groups[0]
        dlr = float(g0["d"]) * float(g0["lr"])  # the step size of this step (D-Adaptation: no bias correction)
        beta1 = float(g0["betas"][0])
        lam = top_eigenvalue(lambda: task.loss_fn(m, probe), params, scale, a["iters"], seed=t)
        R = dlr * lam * (1 - beta1) / (2 + 2 * beta1)
        factor = min(a["growth"], a["cap"] / grown) if R < a["below"] else 1.0
        if factor > 1.0:
            for s in eng.schedulers:  # every replica's LR schedule, from the next step on
                s.ensemble.slots.cut_lr(factor)
                s.reapply()
            grown *= factor
        rows.append({"step": t, "d": float(g0["d"]), "lr": float(g0["lr"]), "R": R, "factor": factor, "grown": grown})
        print(json.dumps({"seed": job["seed"], "rule": job["rule"], **rows[-1]}), flush=True)
    final = final_metrics(task, run.eval_model(), dev)
    d_end = float(eng.optimizers[0].param_groups[0]["d"])
    return {"seed": job["seed"], "rule": job["rule"], "final_metrics": final, "rows": rows, "grown": grown,
            "final_d": d_end, "seconds": time.time() - t0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=sorted(SIZES), default="fashion")
    p.add_argument("--data", default=None)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--checks", default="250,300,350,400", help="steps at which R is measured (inside the warm-up)")
    p.add_argument("--below", type=float, default=0.9, help="grow while R is below this")
    p.add_argument("--growth", type=float, default=1.5, help="the LR schedule's factor per check")
    p.add_argument("--cap", type=float, default=4.0, help="at most this factor over D-Adaptation's own step")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--steps", type=int, default=0, help="0: the suite's (a smaller number: a smoke test)")
    p.add_argument("--without", action="store_true", help="also each seed without the rule (HDET over D-Adaptation)")
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    args = {"task": a.task, "data": a.data, "iters": a.iters, "steps": a.steps, "below": a.below, "growth": a.growth, "cap": a.cap,
            "checks": [int(x) for x in a.checks.split(",")]}
    jobs = [{"args": args, "device": a.device, "seed": int(s), "rule": rule} for s in a.seeds.split(",")
            for rule in ((True, False) if a.without else (True,))]
    t0 = time.time()
    dev = torch.device(a.device)
    runs: list[dict[str, Any]] = []
    with cf.ProcessPoolExecutor(a.jobs, mp_context=mp.get_context("spawn")) as pool:
        for fut in cf.as_completed([pool.submit(run_job, j) for j in jobs]):
            runs.append(fut.result())
            runs.sort(key=lambda r: (not r["rule"], r["seed"]))
            rec = {"command": "python " + " ".join(sys.argv), "python": platform.python_version(),
                   "torch": torch.__version__,
                   "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"{platform.machine()} cpu",
                   "task": a.task, "size": SIZES[a.task], **args, "wall_seconds": time.time() - t0,
                   "complete": len(runs) == len(jobs), "runs": runs}
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(json.dumps(rec, indent=1))  # after every job: a killed study keeps what it did


if __name__ == "__main__":
    main()
