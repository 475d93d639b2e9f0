"""A short sweep on the replicas' own batches, then HDET at what it picked (issue 15, a study).

``local_sweep_signal.py`` found that N independent short runs, one per replica on its own batch (1/N of the
ensemble's), annealed and judged on data held out of training, pick an LR near half the full run's best on the GPT
(every seed) and within Fashion-MNIST's flat region (0.25x-2x) there. This study runs the whole recipe from a first
guess (0.1x, 1x, 10x the suite's grid best), with the evidence suite's tasks and budget (N = 8, 1500 steps):

1. the sweep: replica r trains its own copy of the model (the same initial weights) for ``--sweep-frac`` of the steps
   on its own batches at ``centre * 32 ** ((2 r - (N - 1)) / (N - 1))`` (1/32x to 32x, 2.7x apart; the centre is
   the guess, or with ``--centre scaled`` the guess over the factor below, where the sweep's smaller batch puts its
   best LR), OneCycle over the sweep; no gradient is shared, so a replica that blows up harms no other;
2. the pick: by the held-out loss of each sweep run (the last 10,000 training examples, the GPT's last tenth of
   training bytes, which the sweep never trains on), or (``--judge train``) by its training loss over its last
   tenth, on its own batches (what a library can read without a held-out set); a parabola in log LR through the best and its two neighbours (the best
   itself at an edge; ``--pick fit5/fit7``: a least-squares parabola through up to 5 or 7 points around it;
   ``--pick argmin``: the best itself); the main run's max_lr is that times ``--factor``:
   sqrt(N) by default (Adam's LR grows about as the square root of the batch: the main run's batch is N times
   the sweep's; not fitted to these tasks), or a number (2: the ratio ``local_sweep_signal.py`` measured on the
   GPT at 300 steps, which also lands Fashion-MNIST's 300-step picks inside its flat region: fitted to these
   two tasks, so a result with it is in-sample), or ``noise``: from the gradient noise scale measured at the
   winner's weights (:func:`noise_scale`, recorded with every factor) by the surge rule (:func:`surge_factor`);
3. the main run: ``hdet train``'s recipe (alpha 0.2, T 25, ``on_runaway="recover"``) at that max_lr for the rest
   of the steps, from the sweep's best replica (``--from winner``, the same total compute as one run) or from the
   initial weights for the full steps (``--from init``: ``--sweep-frac`` more compute; says what the pick alone is
   worth).

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


def pick_fit(lrs: list[float], losses: list[float], k: int) -> float:
    """The vertex (in log LR) of the least-squares parabola through the lowest finite loss and up to ``k`` finite
    neighbours on each side, clipped to their range; the lowest's own LR where the fit is not convex. Wider than
    :func:`pick` (three points): a flat region's noise moves it less."""
    import torch

    ok = [i for i, v in enumerate(losses) if math.isfinite(v)]
    if not ok:
        raise RuntimeError("every sweep run diverged")
    best = min(ok, key=lambda i: losses[i])
    idx = [i for i in ok if abs(i - best) <= k]
    if len(idx) < 3:
        return lrs[best]
    x = torch.tensor([math.log(lrs[i]) for i in idx], dtype=torch.float64)
    y = torch.tensor([losses[i] for i in idx], dtype=torch.float64)
    a, b, _ = torch.linalg.lstsq(torch.stack([x * x, x, torch.ones_like(x)], 1), y[:, None]).solution[:, 0].tolist()
    if a <= 0:
        return lrs[best]
    return math.exp(min(max(-b / (2 * a), float(x.min())), float(x.max())))


def surge_factor(b_noise: float, b: int, big: int) -> float:
    """How much higher Adam's best LR is at batch ``big`` than at ``b``, for a gradient noise scale ``b_noise``:
    ``eps_opt(B) ~ 1 / (sqrt(b_noise / B) + sqrt(B / b_noise))`` (Li et al. 2024, "Surge phenomenon in optimal
    learning rate and batch size scaling"): the square root of the batch ratio where both batches are far below
    the noise scale, less as the larger one nears it. An infinite or unmeasurable noise scale: sqrt(big / b)."""
    if not (math.isfinite(b_noise) and b_noise > 0):
        return math.sqrt(big / b)
    at = lambda B: 1.0 / (math.sqrt(b_noise / B) + math.sqrt(B / b_noise))  # noqa: E731
    return at(big) / at(b)


def noise_scale(task: Any, weights: dict[str, Any], dev: Any, b: int, n: int, seed: int, rounds: int = 8) -> dict[str, float]:
    """The gradient noise scale ``B_simple = tr(Sigma) / |G|^2`` (McCandlish et al. 2018, appendix A) at
    ``weights``, from ``rounds`` x ``n`` gradients on batches of ``b`` and their means (batches of ``n * b``)."""
    import torch

    from hdet.app.runs import to_device

    model = task.make_model().to(dev)
    model.load_state_dict(weights)
    model.train()
    g = torch.Generator().manual_seed(seed * 1000 + 999)
    small = big = 0.0
    for _ in range(rounds):
        grads = []
        for _ in range(n):
            model.zero_grad(set_to_none=True)
            task.loss_fn(model, to_device(task.sample("train", b, g), dev)).backward()
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).double())
        G = torch.stack(grads)
        small += float((G * G).sum(1).mean()) / rounds  # host sync: E|G_b|^2
        big += float(G.mean(0).square().sum()) / rounds  # E|G_B|^2, B = n * b
    B = n * b
    g2 = (B * big - b * small) / (B - b)
    tr = (small - big) / (1 / b - 1 / B)
    return {"G2_b": small, "G2_B": big, "G2": g2, "trSigma": tr, "B_simple": tr / g2 if g2 > 0 else math.inf}


def choose(how: str, lrs: list[float], losses: list[float]) -> float:
    if how == "parabola":
        return pick(lrs, losses)
    if how.startswith("fit"):  # fit5, fit7: the least-squares parabola through 5 or 7 points
        return pick_fit(lrs, losses, (int(how[3:]) - 1) // 2)
    return lrs[min(range(len(lrs)), key=lambda i: losses[i])]


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
    if a["steps"]:
        size["steps"] = a["steps"]
    N, steps, B = 8, size["steps"], size["batch"]
    s0 = int(a["sweep_frac"] * steps)
    guess = a["best"] * spec["start"]
    seed = spec["seed"]
    task = make_task(a["task"], data=a["data"], ctx=size["ctx"], width=size["width"], layers=size["layers"])
    carve_heldout(task, 10_000)
    factor = {"sqrt": math.sqrt(N), "noise": math.sqrt(N)}.get(a["factor"]) or float(a["factor"])  # (noise: below)
    centre = guess / factor if a["centre"] == "scaled" else guess
    lrs = [centre * 32.0 ** ((2 * r - (N - 1)) / (N - 1)) for r in range(N)]
    losses, tails, models = [], [], []
    for r, lr in enumerate(lrs):
        torch.manual_seed(seed)
        model = task.make_model().to(dev)
        opt = torch.optim.AdamW(param_groups(model, task.group_of, size["weight_decay"]), lr=lr)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=s0, pct_start=0.3)
        g = torch.Generator().manual_seed(seed * 1000 + r)
        tail = []
        for i in range(s0):
            opt.zero_grad(set_to_none=True)
            loss = task.loss_fn(model, to_device(task.sample("train", B, g), dev))
            loss.backward()
            opt.step()
            sched.step()
            if i >= s0 - max(1, s0 // 10):  # the sweep's last tenth: its training loss, on its own batches
                tail.append(loss.detach())
        t = float(torch.stack(tail).mean())  # host sync
        tails.append(t if math.isfinite(t) else float("inf"))
        hg = torch.Generator().manual_seed(777_000)
        model.eval()
        with torch.no_grad():
            held = sum(task.loss_fn(model, to_device(task.sample("heldout", 256, hg), dev)).item()  # host sync
                       for _ in range(16)) / 16
        losses.append(held if math.isfinite(held) else float("inf"))
        models.append({k: v.detach().cpu().clone() for k, v in model.state_dict().items()})
    judged = losses if a["judge"] == "heldout" else tails
    chosen = choose(a["pick"], lrs, judged)
    winner = min(range(N), key=lambda i: judged[i])
    noise = noise_scale(task, models[winner], dev, B, N, seed)
    if a["factor"] == "noise":
        factor = surge_factor(noise["B_simple"], B, N * B)
    max_lr = chosen * factor
    other = tails if a["judge"] == "heldout" else losses  # what the other judge would have picked (recorded)
    other_pick = choose(a["pick"], lrs, other)
    out = Path(a["runs"]) / spec["name"]
    out.mkdir(parents=True, exist_ok=True)
    init = None
    if a["start_from"] == "winner":
        init = str(out / "winner.pt")
        torch.save(models[winner], init)
    rest = steps - s0 if a["start_from"] == "winner" else steps
    pct = 0.3 if a.get("main_pct", "fresh") == "fresh" or rest == steps else max(0.3 * steps - s0, 0.05 * rest) / rest
    cfg = RunConfig(task=a["task"], data=a["data"], replicas=N, device=spec["device"], mode="vmap", progress=False,
                    checkpoint_every=0, eval_every=steps // 10, eval_batches=8, auto_lr=False, seed=seed,
                    alpha=0.2, on_runaway="recover", max_lr=max_lr, init_from=init, pct_start=pct,
                    **{**size, "steps": rest}, out=str(out / "main"))
    s = train(cfg, argv=["(sweep_then_train)", spec["name"]])
    m = s.get("final_metrics") or {}
    metric = m.get("test_accuracy") if a["task"] == "fashion" else m.get("val_loss_full")
    return {**{k: spec[k] for k in ("name", "start", "seed")}, "sweep_lrs": lrs, "sweep_heldout": losses, "sweep_train_tail": tails,
            "judge": a["judge"], "other_judge_pick": other_pick,
            "noise": noise, "factor": factor,
            "picked": chosen, "max_lr": max_lr, "main_pct_start": pct, "max_lr_x_best": max_lr / a["best"], "winner": winner,
            "metric": metric, "crashed": s.get("crashed"), "seconds": time.time() - t0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=("bytes", "fashion"), required=True)
    p.add_argument("--data", default=None)
    p.add_argument("--best", type=float, required=True, help="the plain grid's best max_lr (the starts are x this)")
    p.add_argument("--starts", default="0.1,1,10")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--sweep-frac", type=float, default=0.1)
    p.add_argument("--factor", default="sqrt",
                   help="main max_lr = the pick x this: 'sqrt' (sqrt(N)), 'noise' (from the gradient noise scale at the "
                        "winner's weights: surge_factor) or a number")
    p.add_argument("--steps", type=int, default=None, help="the run's steps (the suite's: 1500)")
    p.add_argument("--centre", choices=("guess", "scaled"), default="guess",
                   help="the sweep's grid around the guess, or around guess / factor (the sweep's batch is N times "
                        "smaller: its best LR is the main run's over the factor)")
    p.add_argument("--judge", choices=("heldout", "train"), default="heldout",
                   help="pick by the held-out loss, or by each sweep run's training loss over its last tenth")
    p.add_argument("--pick", choices=("parabola", "fit5", "fit7", "argmin"), default="parabola")
    p.add_argument("--main-pct", choices=("fresh", "align"), default="fresh",
                   help="the main run's OneCycle warm-up from the winner: fresh (pct_start 0.3 of its own steps, as in "
                        "calls 1-6, and hdet train --lr-sweep's) or align (its peak at the whole run's, step 0.3 x --steps, "
                        "after at least 5%% of its own steps; call 7: worse on the GPT)")
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
    results: list[dict[str, Any]] = []
    with mp.get_context("spawn").Pool(a.jobs) as pool:
        for r in pool.imap_unordered(job, specs, chunksize=1):  # written after every run (a call can run out of time)
            results.append(r)
            rows = {}
            for st in sorted({r["start"] for r in results}):
                ms = [r["metric"] for r in results if r["start"] == st and r["metric"] is not None]
                mean = sum(ms) / len(ms) if ms else None
                sd = (sum((m - mean) ** 2 for m in ms) / (len(ms) - 1)) ** 0.5 if len(ms) > 1 else None
                rows[str(st)] = {"mean": mean, "sd": sd, "n": len(ms),
                                 "by_seed": {r["seed"]: r["metric"] for r in results if r["start"] == st},
                                 "max_lr_x_best": [round(r["max_lr_x_best"], 3) for r in results if r["start"] == st]}
            rec = {"command": "python " + " ".join(sys.argv), "python": platform.python_version(),
                   "torch": torch.__version__, "hdet": hdet.__version__,
                   "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                   "seconds": time.time() - t0, "done": f"{len(results)} of {len(specs)}", "summary": rows,
                   "runs": results}
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(json.dumps(rec, indent=1))
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
