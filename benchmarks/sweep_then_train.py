"""A short sweep on the replicas' own batches, then HDET at what it picked (issue 15, a study).

``local_sweep_signal.py`` found that N independent short runs, one per replica on its own batch (1/N of the
ensemble's), annealed and judged on data held out of training, pick an LR near half the full run's best on the GPT
(every seed) and within Fashion-MNIST's flat region (0.25x-2x) there. This study runs the whole recipe from a first
guess (0.1x, 1x, 10x the suite's grid best), with the evidence suite's tasks and budget (N = 8, 1500 steps):

1. the sweep: replica r trains its own copy of the model (the same initial weights) for ``--sweep-frac`` of the steps
   on its own batches at ``guess * 32 ** ((2 r - (N - 1)) / (N - 1))`` (1/32x to 32x, 2.7x apart), OneCycle over
   the sweep; no gradient is shared, so a replica that blows up harms no other;
2. the pick: the held-out loss (the last 10,000 training examples, the GPT's last tenth of training bytes, which
   the sweep never trains on) of each; a parabola in log LR through the best and its two neighbours (the best
   itself at an edge); the main run's max_lr is its vertex times sqrt(N) (Adam's LR grows about as the square root
   of the batch: the main run's batch is N times the sweep's; not fitted to these tasks);
3. the main run: ``hdet train``'s recipe (alpha 0.2, T 25, ``on_runaway="recover"``) at that max_lr for the rest
   of the steps, from the sweep's best replica (``--from winner``, the same total compute as one run) or from the
   initial weights for the full steps (``--from init``: 10% more compute; says what the pick alone is worth).

Writes JSON (per run: the sweep's losses, the pick, the main run's final metric) with the command and versions.

    python benchmarks/sweep_then_train.py --task bytes --best 0.004 --out sweep_bytes.json
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def pick(lrs: list[float], losses: list[float]) -> float:
    """The vertex (in log LR) of the parabola through the lowest finite loss and its two neighbours, clipped to them;
    the lowest's own LR at an edge of the sweep."""
    ok = [(i, v) for i, v in enumerate(losses) if math.isfinite(v)]
    if not ok:
        raise RuntimeError("every sweep run diverged")
    i = min(ok, key=lambda t: t[1])[0]
    if i in (0, len(lrs) - 1) or not (math.isfinite(losses[i - 1]) and math.isfinite(losses[i + 1])):
        return lrs[i]
    x = [math.log(lrs[j]) for j in (i - 1, i, i + 1)]
    y = [losses[j] for j in (i - 1, i, i + 1)]
    h = x[1] - x[0]  # equal spacing in log LR
    curv = y[0] - 2 * y[1] + y[2]
    v = x[1] + (h * (y[0] - y[2]) / (2 * curv) if curv > 0 else 0.0)
    return math.exp(min(max(v, x[0]), x[2]))


def job(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    torch.backends.cuda.matmul.allow_tf32 = True  # as the evidence suite
    torch.backends.cudnn.allow_tf32 = True
    from cooldown_signal import carve_heldout
    from evidence import SIZES

    from hdet.app.run import RunConfig, train
    from hdet.app.runs import to_device
    from hdet.app.tasks import make_task, param_groups

    t0 = time.time()
    a = spec["args"]
    dev = torch.device(spec["device"])
    size = {k: v for k, v in SIZES[a["task"]].items() if k != "centre"}
    N, steps, B = 8, size["steps"], size["batch"]
    s0 = int(a["sweep_frac"] * steps)
    guess = a["best"] * spec["start"]
    seed = spec["seed"]
    task = make_task(a["task"], data=a["data"], ctx=size["ctx"], width=size["width"], layers=size["layers"])
    carve_heldout(task, 10_000)
    lrs = [guess * 32.0 ** ((2 * r - (N - 1)) / (N - 1)) for r in range(N)]
    losses, models = [], []
    for r, lr in enumerate(lrs):
        torch.manual_seed(seed)
        model = task.make_model().to(dev)
        opt = torch.optim.AdamW(param_groups(model, task.group_of, size["weight_decay"]), lr=lr)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=s0, pct_start=0.3)
        g = torch.Generator().manual_seed(seed * 1000 + r)
        for _ in range(s0):
            opt.zero_grad(set_to_none=True)
            task.loss_fn(model, to_device(task.sample("train", B, g), dev)).backward()
            opt.step()
            sched.step()
        hg = torch.Generator().manual_seed(777_000)
        model.eval()
        with torch.no_grad():
            held = sum(task.loss_fn(model, to_device(task.sample("heldout", 256, hg), dev)).item()  # host sync
                       for _ in range(16)) / 16
        losses.append(held if math.isfinite(held) else float("inf"))
        models.append({k: v.detach().cpu().clone() for k, v in model.state_dict().items()})
    chosen = pick(lrs, losses)
    max_lr = chosen * math.sqrt(N)
    winner = min(range(N), key=lambda i: losses[i])
    out = Path(a["runs"]) / spec["name"]
    out.mkdir(parents=True, exist_ok=True)
    init = None
    if a["start_from"] == "winner":
        init = str(out / "winner.pt")
        torch.save(models[winner], init)
    cfg = RunConfig(task=a["task"], data=a["data"], replicas=N, device=spec["device"], mode="vmap", progress=False,
                    checkpoint_every=0, eval_every=steps // 10, eval_batches=8, auto_lr=False, seed=seed,
                    alpha=0.2, on_runaway="recover", max_lr=max_lr, init_from=init,
                    **{**size, "steps": steps - s0 if a["start_from"] == "winner" else steps}, out=str(out / "main"))
    s = train(cfg, argv=["(sweep_then_train)", spec["name"]])
    m = s.get("final_metrics") or {}
    metric = m.get("test_accuracy") if a["task"] == "fashion" else m.get("val_loss_full")
    return {**{k: spec[k] for k in ("name", "start", "seed")}, "sweep_lrs": lrs, "sweep_heldout": losses,
            "picked": chosen, "max_lr": max_lr, "max_lr_x_best": max_lr / a["best"], "winner": winner,
            "metric": metric, "crashed": s.get("crashed"), "seconds": time.time() - t0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=("bytes", "fashion"), required=True)
    p.add_argument("--data", default=None)
    p.add_argument("--best", type=float, required=True, help="the plain grid's best max_lr (the starts are x this)")
    p.add_argument("--starts", default="0.1,1,10")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--sweep-frac", type=float, default=0.1)
    p.add_argument("--from", dest="start_from", choices=("winner", "init"), default="winner")
    p.add_argument("--device", default="cuda")
    p.add_argument("--jobs", type=int, default=9)
    p.add_argument("--runs", default="runs/sweep_then_train")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    import torch

    import hdet

    specs = [{"args": vars(a), "device": a.device, "start": float(st), "seed": int(sd),
              "name": f"{a.task}-{a.start_from}-x{st}-s{sd}"}
             for st in a.starts.split(",") for sd in a.seeds.split(",")]
    t0 = time.time()
    with mp.get_context("spawn").Pool(a.jobs) as pool:
        results = pool.map(job, specs, chunksize=1)
    rows = {}
    for st in sorted({r["start"] for r in results}):
        ms = [r["metric"] for r in results if r["start"] == st and r["metric"] is not None]
        rows[str(st)] = {"mean": sum(ms) / len(ms) if ms else None, "n": len(ms),
                         "max_lr_x_best": [round(r["max_lr_x_best"], 3) for r in results if r["start"] == st]}
    rec = {"command": "python " + " ".join(sys.argv), "python": platform.python_version(), "torch": torch.__version__,
           "hdet": hdet.__version__, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "seconds": time.time() - t0, "summary": rows, "runs": results}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rec, indent=1))
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
