"""The evidence suite (issue 5): does HDET's auto-LR find a good schedule on real tasks?

One task per invocation, N = 8 replicas in the one-process engine (exact DDP semantics: the engine is
tested equal to gloo processes), many runs in parallel on one GPU (small models leave it mostly idle).

1. LR grid of plain data parallel (alpha = 0: every replica the same LR, gradients averaged every step,
   i.e. DDP + OneCycleLR): 7 max_lr values a factor 2 apart, seed 0; the best by the task's metric
   (validation loss for the GPT, test accuracy for Fashion-MNIST) and its two neighbours get seeds 1, 2.
2. Controllers, each started at 0.1x, 1x and 10x the grid's best max_lr, seeds 0-2:
   ``none`` (HDET spread, no controller), ``paper`` (Eqs. 4-8, per-group multipliers as in the paper) and
   ``fit`` (hdet's, tied LR groups). The controller starts at the end of OneCycle's warm-up (30%).
3. The paper's Table 1 layout (six configurations; warm rows start from a short pre-training run), plus the
   two auto-LR rows with the fit controller.

Jobs run in priority order; none starts once ``--deadline`` seconds would be exceeded by its expected
duration (skipped jobs are listed). ``--previous`` takes an earlier JSON and skips what it finished.
Writes ``--out`` (JSON: every run's config, final metrics, LR and validation curves, the command).

    python benchmarks/evidence.py --task bytes --device cuda:0 --jobs 12 --deadline 540 --out bytes.json
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing as mp
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

SIZES = {  # per task: the model, the run, and the centre of the LR grid
    "bytes": dict(width=256, layers=4, ctx=128, batch=16, steps=1500, T=25, weight_decay=0.01, centre=2e-3),
    "fashion": dict(width=128, layers=1, ctx=64, batch=32, steps=1500, T=25, weight_decay=0.01, centre=8e-3),
}
GRID = [2.0 ** k for k in range(-3, 4)]  # x centre
STARTS = [0.1, 1.0, 10.0]
ALPHA = 0.5
# the learning-rate-free peers' run options; prodigy: prodigyopt's defaults (the committed rows), prodigy-sw: with
# safeguard_warmup, its advice under a warm-up
PEERS = {"dadapt": dict(optimizer="dadapt-adam"), "prodigy": dict(optimizer="prodigy", prodigy_safeguard=False),
         "prodigy-sw": dict(optimizer="prodigy", prodigy_safeguard=True), "mechanic": dict(optimizer="mechanic-adamw")}


def _on_sync(step: int, T: int) -> int:
    """``step`` rounded up to a sync step of interval ``T`` (where the controller can start)."""
    return -(-step // T) * T


def _metric(task: str, s: dict[str, Any]) -> float | None:
    """Higher is better: test accuracy, or minus the validation loss. None for a crashed run."""
    m = s.get("final_metrics") or {}
    if s.get("crashed") or not m:
        return None
    return m["test_accuracy"] if task == "fashion" else -m["val_loss_full"]


def run_job(job: dict[str, Any], deadline: float, expected: float) -> dict[str, Any]:
    """One training run (in a worker process)."""
    if time.time() + expected > deadline:
        return {**job, "skipped": "deadline"}
    import torch

    torch.set_num_threads(1)
    torch.backends.cuda.matmul.allow_tf32 = True  # TF32 matmuls and convolutions on the GPU (recorded)
    torch.backends.cudnn.allow_tf32 = True
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from hdet.app.run import RunConfig, train

    cfg = RunConfig(**job["cfg"])
    t0 = time.time()
    try:
        s = train(cfg, argv=["(evidence)", job["name"]])
    except Exception as e:  # noqa: BLE001 - a failed run is a result, not the end of the suite
        return {**job, "error": f"{type(e).__name__}: {e}", "seconds": time.time() - t0}
    lr = []  # [step, the mean base LR of the first group(, D-Adaptation's/Prodigy's d)]
    with open(Path(cfg.out) / "metrics.jsonl") as f:
        for line in f:
            rec = json.loads(line)
            if rec["step"] % 50 == 0 or rec["step"] == cfg.steps:
                lr.append((rec["step"], next(iter(rec["lr_mean"].values()))) + ((rec["d"],) if "d" in rec else ()))
    events = []  # syncs that found a runaway replica or cut the LR (on_runaway="recover")
    window = []  # per sync: step, the replicas' median window loss, slot 0's base LR for the next window
    syncs = Path(cfg.out) / "syncs.jsonl"
    scale = 1.0
    range_end = None  # lr_range_test: [step, why, slot 0's base LR for the next window]
    for line in (syncs.read_text().splitlines() if syncs.is_file() else []):
        rec = json.loads(line)
        if rec.get("range_ended"):
            range_end = [rec["step"], rec["range_ended"], rec["bases"][0], rec.get("went_back_to")]
        ok = sorted(x for x in rec.get("losses") or [] if x is not None and x == x)  # (null: NaN, strict JSON)
        if ok:
            window.append([rec["step"], ok[len(ok) // 2] if len(ok) % 2 else (ok[len(ok) // 2 - 1] + ok[len(ok) // 2]) / 2,
                           rec["bases"][0]])
        if rec.get("runaway") or rec.get("lr_scale", 1.0) != scale:
            events.append([rec["step"], rec.get("runaway"), rec.get("lr_scale")])
            scale = rec.get("lr_scale", 1.0)
    return {**job, "seconds": time.time() - t0, "crashed": s["crashed"], "final_metrics": s["final_metrics"],
            "runaway_events": events, "final_lr_scale": scale, "window_curve": window, "range_end": range_end,
            "final_val_loss": s["final_val_loss"], "final_train_loss": s["final_train_loss"],
            "val_curve": s["val_curve"], "lr_curve": lr, "mode": s["mode"], "device": s.get("device"),
            "steps_per_second": s["steps_per_second"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", choices=sorted(SIZES), required=True)
    ap.add_argument("--device", default="cuda:0", help="one device, or several comma-separated (jobs alternate)")
    ap.add_argument("--data", default=None)
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--deadline", type=float, default=540.0, help="seconds from start")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--runs", default="runs/evidence")
    ap.add_argument("--previous", default=None)
    ap.add_argument("--out", required=True)
    ap.add_argument("--set", action="append", default=[], help="override a size entry, e.g. --set width=32")
    ap.add_argument("--only-grid", action="store_true", help="stop after the grid's first seed and the pre-training run")
    ap.add_argument("--sync-interval", type=int, default=None, metavar="T",
                    help="a follow-up: only HDET none/fit at --follow-starts with this T (names get a -T<n> suffix)")
    ap.add_argument("--follow-starts", default="1,0.1", help="the follow-up's starts, x the grid's best max_lr")
    ap.add_argument("--follow-controllers", default="fit,none",
                    help="the follow-up's runs: fit, none (HDET spread), plain (alpha 0: data parallel at that max_lr)")
    ap.add_argument("--alpha", type=float, default=ALPHA, help="the follow-up's spread (names get an -a<alpha> suffix "
                    "when it is not the suite's 0.5)")
    ap.add_argument("--local", action="store_true", help="the follow-up in local mode (no gradient averaging between "
                    "converge steps; names get a -local suffix)")
    ap.add_argument("--peers", type=float, default=None, metavar="BEST_MAX_LR",
                    help="the learning-rate-free peers instead of the main suite (issue 15), beside plain DP at "
                    "BEST_MAX_LR (the plain grid's best, seeds 0-2, a same-machine anchor): D-Adaptation Adam and "
                    "Prodigy at lr 1 with the OneCycle shape (seeds 0-2); Schedule-Free AdamW: its own 7-LR grid "
                    "(seed 0, centred at 2x the task's centre), then 0.1x, 1x and 10x its best (seeds 0-2)")
    ap.add_argument("--peers-hdet", type=float, default=None, metavar="BEST_MAX_LR",
                    help="HDET (--alpha, on_runaway=recover) over D-Adaptation Adam and Prodigy at lr 1, the "
                         "multiplier on their step, beside each optimizer alone (issue 15, item 4), seeds 0-2 "
                         "(--peer-names: which), and plain DP at BEST_MAX_LR seed 0 again (repro-plain-1x-s0)")
    ap.add_argument("--peer-names", default="dadapt,prodigy", help="with --peers-hdet: dadapt, prodigy (prodigyopt's "
                    "defaults), prodigy-sw (with safeguard_warmup, its advice under a warm-up) and/or mechanic "
                    "(Mechanic over AdamW; alone only)")
    ap.add_argument("--peer-runaway", default="recover", choices=["recover", "ignore"],
                    help="with --peers-hdet: HDET's on_runaway (names: hdet-ignore-... for ignore)")
    ap.add_argument("--peer-controller", default="none", choices=["none", "fit"],
                    help="with --peers-hdet: the fit controller from the end of the warm-up over the HDET rows "
                    "(names: hdet-fit-...)")
    ap.add_argument("--peer-max-lr", type=float, default=1.0, help="with --peers-hdet: the peers' lr, a multiplier on "
                    "their own estimate of the step size (1: their documented use; names: ...-lr<x>)")
    ap.add_argument("--peer-T", type=int, default=None, help="with --peers-hdet: the HDET rows' sync interval "
                    "(default: the task's; names: hdet-...-T<n>-...)")
    ap.add_argument("--alone-only", action="store_true", help="with --peers-hdet: only the rows of each optimizer alone")
    ap.add_argument("--one-model", action="store_true", help="with --peers-hdet --alone-only: each optimizer as one "
                    "model at the N replicas' batch (what plain DP computes, up to BatchNorm's per-replica "
                    "statistics; for optimizers the engine steps one replica at a time, e.g. Mechanic)")
    ap.add_argument("--seeds", default="0,1,2", help="with --peers-hdet or --breaks: the seeds (comma-separated, or "
                    "FIRST-LAST)")
    ap.add_argument("--hdet-only", action="store_true", help="with --peers-hdet: only the HDET rows (names: "
                    f"hdet[-ignore][-a<alpha> unless {ALPHA}]-<peer>-s<seed>)")
    ap.add_argument("--stability", type=float, default=None, metavar="BEST_MAX_LR",
                    help="runaway replicas (issue 15, item 2) instead of the main suite: at 3x and 10x BEST_MAX_LR, "
                    "seeds 0-2, plain DP, HDET (--alpha, T from the size) as the paper has it, HDET with "
                    "on_runaway='recover', and plain DP with on_runaway='recover' (its rising-loss rule alone); at 1x "
                    "HDET with on_runaway='recover' (no harm?)")
    ap.add_argument("--signals", type=float, default=None, metavar="BEST_MAX_LR",
                    help="the warm-up signal study (issue 15, item 3): plain DP and HDET (--alpha) from 0.1x, 0.3x, 1x, "
                    "3x and 10x BEST_MAX_LR, seed 0, with every sync's median window loss and base LR recorded")
    ap.add_argument("--breaks", type=float, default=None, metavar="MAX_LR",
                    help="how often a run breaks (issue 15): at MAX_LR, for every --seeds, plain DP, HDET as the paper "
                    "has it (--alpha, T from the size) and HDET with on_runaway='recover' (names: breaks-<arm>-s<seed>)")
    ap.add_argument("--breaks-arms", default="plain,hdet,recover",
                    help="with --breaks: the arms, comma-separated, of plain, hdet, recover and plainguard (plain DP "
                    "with on_runaway='recover': the stability guard without HDET's spread)")
    ap.add_argument("--range", type=float, default=None, dest="range_best", metavar="BEST_MAX_LR",
                    help="the in-run LR range test (issue 15, item 3) instead of the main suite: HDET (--alpha) with "
                    "lr_range_test=True from 0.1x, 1x and 10x BEST_MAX_LR, seeds 0-2, once per --range-backoffs value")
    ap.add_argument("--range-backoffs", default="2", help="the range test's backoffs to run (names: range-b<value>)")
    ap.add_argument("--range-controller", default="none", choices=["none", "fit"],
                    help="the range test's decay phase: the schedule's own shape (none) or the fit controller from "
                    "the end of the warm-up (fit; names: range-b<value>-fit)")
    a = ap.parse_args()
    first, _, last = a.seeds.partition("-")
    seeds = list(range(int(first), int(last) + 1)) if last else [int(x) for x in a.seeds.split(",")]
    t_start = time.time()
    deadline = t_start + a.deadline
    size = dict(SIZES[a.task])
    centre = size.pop("centre")
    if a.steps:
        size["steps"] = a.steps
    for kv in a.set:
        k, v = kv.split("=")
        size[k] = type(size[k])(v)
    steps = size["steps"]
    warm = int(0.3 * steps) // size["T"] * size["T"]  # end of OneCycle's warm-up, on a sync step
    base = dict(task=a.task, data=a.data, replicas=8, device=a.device, mode="vmap", progress=False, checkpoint_every=0,
                eval_every=steps // 10, eval_batches=8, alpha=0.0, auto_lr=False, on_runaway="ignore", **size)
    runs = Path(a.runs) / a.task
    done: dict[str, dict[str, Any]] = {}
    if a.previous and Path(a.previous).is_file():
        done = {r["name"]: r for r in json.loads(Path(a.previous).read_text())["runs"]
                if "final_metrics" in r or r.get("crashed")}
        if not (runs / "pretrain" / "model.pt").is_file():
            done.pop("pretrain", None)  # the warm rows need its checkpoint on this machine

    devices = a.device.split(",")
    counter = [0]

    def job(name: str, group: str, **over: Any) -> dict[str, Any]:
        counter[0] += 1
        cfg = {**base, "label": name, **over, "out": str(runs / name), "device": devices[counter[0] % len(devices)]}
        return {"name": name, "group": group, "cfg": cfg}

    results: list[dict[str, Any]] = [r for r in done.values()]
    ctx = mp.get_context("spawn")
    durations: list[float] = [r["seconds"] for r in results if "seconds" in r]

    def expected(factor: float = 1.0) -> float:
        return factor * (sum(durations) / len(durations) if durations else 0.0)

    def save(final: bool = False) -> None:
        """Write --out (after every finished run, so a killed suite keeps what it finished)."""
        import torch

        out = {"command": "python " + " ".join(sys.argv), "task": a.task, "precision": "float32 weights, TF32 matmuls",
               "size": {**size, "centre": centre}, "steps": steps, "alpha": a.alpha, "controller_start_step": warm,
               "grid_centre": centre, "grid": GRID, "starts": STARTS, "best_max_lr": best[0], "python": platform.python_version(),
               "torch": torch.__version__,
               "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.machine(),
               "wall_seconds": time.time() - t_start, "complete": final,
               "runs": sorted(results, key=lambda r: r["name"])}
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1))
        if final:
            print(f"wrote {a.out}: {sum('final_metrics' in r for r in results)} runs finished, "
                  f"{sum('skipped' in r for r in results)} skipped, {sum('error' in r for r in results)} failed", flush=True)

    best: list[float | None] = [None]

    def run_all(jobs: list[dict[str, Any]], pool: cf.ProcessPoolExecutor) -> None:
        """At most --jobs runs in flight; each is submitted when a worker is free, with the expected duration
        known then (a job queued behind a full pool used to carry the estimate of the start, often 0)."""
        todo = [j for j in jobs if j["name"] not in done]
        in_flight: set[cf.Future] = set()
        while todo or in_flight:
            while todo and len(in_flight) < a.jobs:
                j = todo.pop(0)
                in_flight.add(pool.submit(run_job, j, deadline, expected(1.1 if j["cfg"].get("auto_lr") else 1.0)))
            finished, in_flight = cf.wait(in_flight, return_when=cf.FIRST_COMPLETED)
            for f in finished:
                r = f.result()
                results.append(r)
                if "seconds" in r:
                    durations.append(r["seconds"])
                done[r["name"]] = r
                status = r.get("skipped") or r.get("error") or r.get("crashed") or r.get("final_metrics")
                print(f"[{time.time() - t_start:6.0f}s] {r['name']}: {status}", flush=True)
                save()

    def run_study(best_lr: float, jobs: list[dict[str, Any]]) -> None:
        """A study's fixed list of runs (no grid first): all of them, then the final JSON."""
        best[0] = best_lr
        with cf.ProcessPoolExecutor(max_workers=a.jobs, mp_context=ctx) as pool:
            run_all(jobs, pool)
        save(final=True)

    if a.signals is not None:
        jobs = [job(f"{name}-{start:g}x-s0", name, max_lr=a.signals * start, seed=0, alpha=alpha)
                for start in (0.1, 0.3, 1.0, 3.0, 10.0) for name, alpha in (("plain", 0.0), ("hdet", a.alpha))]
        return run_study(a.signals, jobs)

    if a.breaks is not None:
        arms = {"plain": dict(alpha=0.0), "hdet": dict(alpha=a.alpha), "recover": dict(alpha=a.alpha, on_runaway="recover"),
                "plainguard": dict(alpha=0.0, on_runaway="recover")}
        wanted = a.breaks_arms.split(",")
        if unknown := [w for w in wanted if w not in arms]:
            raise SystemExit(f"Expected --breaks-arms from {sorted(arms)}, but got {unknown}")
        jobs = [job(f"breaks-{arm}-s{seed}", f"breaks-{arm}", max_lr=a.breaks, seed=seed, **arms[arm])
                for seed in seeds for arm in wanted]
        return run_study(a.breaks, jobs)

    if a.range_best is not None:
        backoffs = [float(x) for x in a.range_backoffs.split(",")]
        fit = a.range_controller == "fit"
        ctrl = dict(auto_lr=True, controller="fit", tie_lr_groups=True) if fit else {}
        tag = "-fit" if fit else ""
        jobs = [job(f"range-b{b:g}{tag}-{start:g}x-s{seed}", f"range-b{b:g}{tag}", max_lr=a.range_best * start,
                    seed=seed, alpha=a.alpha, range_test=True, range_backoff=b, on_runaway="recover", warmup=warm, **ctrl)
                for seed in (0, 1, 2) for b in backoffs for start in STARTS]
        return run_study(a.range_best, jobs)

    if a.stability is not None:
        configs = {"plain": dict(alpha=0.0), "hdet": dict(alpha=a.alpha), "guard": dict(alpha=a.alpha, on_runaway="recover"),
                   "plainguard": dict(alpha=0.0, on_runaway="recover")}
        jobs = [job(f"{name}-{start:g}x-s{seed}", name, max_lr=a.stability * start, seed=seed, **over)
                for seed in (0, 1, 2) for start in (3.0, 10.0) for name, over in configs.items()]
        jobs += [job(f"guard-1x-s{seed}", "guard", max_lr=a.stability, seed=seed, **configs["guard"]) for seed in (0, 1, 2)]
        return run_study(a.stability, jobs)

    if a.peers_hdet is not None:
        names = a.peer_names.split(",")
        fit = a.peer_controller == "fit"
        tag = ("hdet-" + ("ignore-" if a.peer_runaway == "ignore" else "") + ("fit-" if fit else "")
               + (f"a{a.alpha:g}-" if a.alpha != ALPHA else "") + (f"T{a.peer_T}-" if a.peer_T else ""))
        Tp = a.peer_T or size["T"]
        hdet = dict(alpha=a.alpha, on_runaway=a.peer_runaway, T=Tp,
                    **(dict(auto_lr=True, controller="fit", tie_lr_groups=True, warmup=_on_sync(warm, Tp)) if fit else {}))
        if a.one_model and not a.alone_only:
            raise SystemExit("--one-model needs --alone-only")
        if "mechanic" in names and not a.alone_only:
            raise SystemExit("--peer-names mechanic needs --alone-only (hdet refuses a spread over Mechanic)")
        one = dict(replicas=1, batch=8 * size["batch"]) if a.one_model else {}
        lr_tag = (f"-lr{a.peer_max_lr:g}" if a.peer_max_lr != 1.0 else "") + ("-1m" if a.one_model else "")
        jobs = [job(f"{pre}{name}{lr_tag}-s{seed}", pre + name + lr_tag, **PEERS[name], max_lr=a.peer_max_lr, seed=seed,
                    **(hdet if pre else one))
                for name in names for seed in seeds
                for pre in ((tag,) if a.hdet_only else ("",) if a.alone_only else (tag, ""))]
        repro = [] if a.hdet_only or a.alone_only else [job("repro-plain-1x-s0", "repro-plain", max_lr=a.peers_hdet, seed=0)]
        return run_study(a.peers_hdet, jobs + repro)

    if a.peers is not None:
        with cf.ProcessPoolExecutor(max_workers=a.jobs, mp_context=ctx) as pool:
            best[0] = a.peers
            sf_grid = [job(f"sf-grid-{m:g}x-s0", "sf-grid", optimizer="schedulefree-adamw", max_lr=2 * centre * m, seed=0)
                       for m in GRID]
            first = [job(f"{name}-s0", name, **PEERS[name], max_lr=1.0, seed=0) for name in ("dadapt", "prodigy")]
            run_all(sf_grid + first + [job("plain-1x-s0", "plain", max_lr=a.peers, seed=0)], pool)
            scored = [(r["cfg"]["max_lr"], _metric(a.task, r)) for r in results if r["group"] == "sf-grid"
                      and _metric(a.task, r) is not None]
            sf_best = max(scored, key=lambda x: x[1])[0] if scored else 2 * centre
            print(f"Schedule-Free grid best lr {sf_best:g}", flush=True)
            later = [job(f"sf-{start:g}x-s{seed}", "sf", optimizer="schedulefree-adamw", max_lr=sf_best * start, seed=seed)
                     for seed in (0, 1, 2) for start in STARTS]
            later += [job(f"{name}-s{seed}", name, **PEERS[name], max_lr=1.0, seed=seed)
                      for seed in (1, 2) for name in ("dadapt", "prodigy")]
            later += [job(f"plain-1x-s{seed}", "plain", max_lr=a.peers, seed=seed) for seed in (1, 2)]
            run_all(later, pool)
        save(final=True)
        return

    with cf.ProcessPoolExecutor(max_workers=a.jobs, mp_context=ctx) as pool:
        # 1. the grid (seed 0) and the pre-training run of the warm rows, together
        grid = [job(f"grid-{m:g}x-s0", "grid", max_lr=centre * m, seed=0) for m in GRID]
        pre = job("pretrain", "table1", replicas=1, max_lr=centre / 4, steps=steps // 10, seed=1)
        run_all(grid + ([] if a.sync_interval else [pre]), pool)
        scored = [(r["cfg"]["max_lr"], _metric(a.task, r)) for r in results if r["group"] == "grid"
                  and r["name"].endswith("-s0") and _metric(a.task, r) is not None]
        if not scored:
            raise SystemExit("every grid run crashed")
        best_lr = max(scored, key=lambda x: x[1])[0]
        best[0] = best_lr
        i = min(range(len(GRID)), key=lambda k: abs(centre * GRID[k] - best_lr))
        neighbours = [GRID[k] for k in (i - 1, i, i + 1) if 0 <= k < len(GRID)]
        print(f"grid best max_lr {best_lr:g}", flush=True)

        later: list[dict[str, Any]] = []
        for seed in (0, 1, 2) if not a.only_grid else ():  # in priority order: seed 0 of everything first
            if seed:
                later += [job(f"grid-{m:g}x-s{seed}", "grid", max_lr=centre * m, seed=seed) for m in neighbours]
            for start in STARTS:
                for ctrl in ("fit", "paper", "none"):
                    over = dict(alpha=ALPHA, max_lr=best_lr * start, seed=seed, warmup=warm)
                    if ctrl == "fit":
                        over.update(auto_lr=True, controller="fit", tie_lr_groups=True)
                    elif ctrl == "paper":
                        over.update(auto_lr=True, controller="paper")
                    later.append(job(f"{ctrl}-{start:g}x-s{seed}", ctrl, **over))
            if seed == 0:  # 3. Table 1 (seed 0), after the controllers' first seed
                ckpt = str(runs / "pretrain" / "model.pt")
                low, high = best_lr / 4, best_lr
                rows = [("Baseline-Low", dict(max_lr=low)), ("Baseline-High", dict(max_lr=high)),
                        ("Warm-Init", dict(max_lr=high, warm_init=True, init_from=ckpt, T=steps)),
                        ("HDET w/o auto-LR", dict(max_lr=high, alpha=ALPHA, warm_init=True, init_from=ckpt)),
                        ("HDET w/o warm init", dict(max_lr=high, alpha=ALPHA, auto_lr=True, warmup=warm)),
                        ("HDET (full)", dict(max_lr=high, alpha=ALPHA, auto_lr=True, warmup=warm, warm_init=True,
                                             init_from=ckpt)),
                        ("HDET w/o warm init [fit]", dict(max_lr=high, alpha=ALPHA, auto_lr=True, warmup=warm,
                                                          controller="fit", tie_lr_groups=True)),
                        ("HDET (full) [fit]", dict(max_lr=high, alpha=ALPHA, auto_lr=True, warmup=warm, warm_init=True,
                                                   init_from=ckpt, controller="fit", tie_lr_groups=True))]
                later += [job("t1-" + n.lower().replace(" ", "-").replace("/", "").replace("(", "").replace(")", "")
                              .replace("[", "").replace("]", ""), "table1", label=n, **o) for n, o in rows]
        if a.sync_interval:  # the follow-up replaces the main suite
            Tn, sfx = a.sync_interval, "-local" * a.local + (f"-a{a.alpha:g}" if a.alpha != ALPHA else "")
            later = [job(f"{ctrl}-{start:g}x-T{Tn}{sfx}-s{seed}", f"{ctrl}-T{Tn}{sfx}", alpha=0.0 if ctrl == "plain" else a.alpha,
                         max_lr=best_lr * start, seed=seed, T=Tn, warmup=_on_sync(warm, Tn), local=a.local,
                         **(dict(auto_lr=True, controller="fit", tie_lr_groups=True) if ctrl == "fit" else {}))
                     for seed in (0, 1, 2) for start in [float(x) for x in a.follow_starts.split(",")]
                     for ctrl in a.follow_controllers.split(",")]
        run_all(later, pool)
    save(final=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
