"""Would a short sweep on the replicas' own batches pick the full run's LR? (issue 15, item 3)

Every in-run judge tried so far compares replicas that share every gradient (one line, a greedy line search)
and prefers lower LRs than the whole run does, with a training or a held-out probe (``cooldown_signal.py``).
Replicas that each step on their own batch (local mode) follow independent trajectories, and a short run that is
annealed ranks LRs near where the full grid does (``results/cpu/short_grid_fashion_300.json``, at the ensemble's
batch). This study asks whether N independent short runs, each on one replica's batch (1/N of the ensemble's),
at LRs spaced 2x apart, annealed (OneCycle over the short run), rank the LRs as the full plain-DP grid does
(the suite's grid best: GPT 4e-3, Fashion-MNIST 1.6e-2 to 3.2e-2, flat from 4e-3). Each run is one model, AdamW,
the suite's param groups and weight decay; judged by the loss (and accuracy) on ``--probe-batches`` batches of
256 held out of the training set (its last 10,000 examples; the GPT: the last tenth of its bytes), which
training never samples. Writes JSON with the command, machine and versions.

    python benchmarks/local_sweep_signal.py --task fashion --data /usr/share/datasets/fashion-mnist \\
        --best 0.016 --steps 150,300 --seeds 0,1 --out benchmarks/results/cpu/local_sweep_fashion.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cooldown_signal import carve_heldout, probe_loss_accuracy  # noqa: E402
from evidence import SIZES  # noqa: E402

import hdet  # noqa: E402
from hdet.app.runs import to_device  # noqa: E402
from hdet.app.tasks import make_task, param_groups  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=sorted(SIZES), default="fashion")
    p.add_argument("--data", default=None)
    p.add_argument("--best", type=float, required=True, help="the plain grid's best max_lr (the sweep's centre)")
    p.add_argument("--powers", default="-5,-4,-3,-2,-1,0,1,2,3,4", help="the LRs: best x 2^k")
    p.add_argument("--steps", default="150,300", help="the short runs' lengths")
    p.add_argument("--batch-factor", type=int, default=1,
                   help="the short runs' batch, in replica batches (1: one replica's, 8: the ensemble's)")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--probe-batches", type=int, default=16)
    p.add_argument("--heldout", type=int, default=10_000)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    dev = torch.device(a.device)
    size = {k: v for k, v in SIZES[a.task].items() if k != "centre"}
    task = make_task(a.task, data=a.data, ctx=size["ctx"], width=size["width"], layers=size["layers"])
    carve_heldout(task, a.heldout)
    B = size["batch"] * a.batch_factor

    def judge(model: torch.nn.Module) -> tuple[float, float | None]:  # the same held-out batches for every run
        return probe_loss_accuracy(task, model, "heldout", a.probe_batches, 777_000, dev)

    runs = []
    t0 = time.time()
    for steps in map(int, a.steps.split(",")):
        for seed in map(int, a.seeds.split(",")):
            for k in map(int, a.powers.split(",")):
                lr = a.best * 2.0 ** k
                torch.manual_seed(seed)
                model = task.make_model().to(dev)
                opt = torch.optim.AdamW(param_groups(model, task.group_of, size["weight_decay"]), lr=lr)
                sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.3)
                g = torch.Generator().manual_seed(seed * 1000 + 17)
                for _ in range(steps):
                    opt.zero_grad(set_to_none=True)
                    loss = task.loss_fn(model, to_device(task.sample("train", B, g), dev))
                    loss.backward()
                    opt.step()
                    sched.step()
                hl, acc = judge(model) if math.isfinite(loss.item()) else (float("inf"), None)  # host sync
                runs.append({"steps": steps, "seed": seed, "power": k, "lr": lr, "heldout_loss": hl, "accuracy": acc})
                print(json.dumps(runs[-1]), flush=True)
    picks = {}
    for steps in map(int, a.steps.split(",")):
        for seed in map(int, a.seeds.split(",")):
            rs = [r for r in runs if r["steps"] == steps and r["seed"] == seed]
            picks[f"{steps}/{seed}"] = {"by_loss": min(rs, key=lambda r: r["heldout_loss"])["lr"],
                                        "by_accuracy": (max(rs, key=lambda r: r["accuracy"] or 0)["lr"]
                                                        if rs[0]["accuracy"] is not None else None)}
    rec = {"command": "python " + " ".join(sys.argv), "python": platform.python_version(), "torch": torch.__version__,
           "hdet": hdet.__version__,
           "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.machine(),
           "task": a.task, "size": size, "batch": B, "best_max_lr": a.best, "seconds": time.time() - t0,
           "picks": picks, "runs": runs}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rec, indent=1))
    print(json.dumps(picks, indent=1))


if __name__ == "__main__":
    main()
