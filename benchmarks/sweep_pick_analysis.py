"""Offline analyses of the recorded LR sweeps and runs under benchmarks/results/evidence/sweep_then_train/ (issue 15),
the numbers its README quotes:

1. the pick rule: each seed's three sweeps (from 0.1x, 1x and 10x the grid's best; their grids 2.7x apart and offset
   from one another by a third of that) give 24 points of one sweep curve; a parabola in log LR through the points
   within 3x of their lowest is the reference, and each grid's pick by ``hdet.sweep.pick_lr`` with 1, 2 or 3
   neighbours a side (3 points, 5, 7: the default) is compared with it (GPT: the 20 seeds of calls 4, 6, 8, 9, 10 and
   13; Fashion-MNIST: the 12 of calls 5, 8, 9 and the CPU call 12);
2. the GPT's final loss against ln(max_lr), one offset a seed: over the CLI's sweep runs (calls 9, 10, 13, 16) and
   with the runs without a sweep (calls 10, 13, 14, 16);
3. ``shifted_grid``: the 1x start's GPT sweeps as a grid two points higher would see them without runs beyond it.

    python benchmarks/sweep_pick_analysis.py --out benchmarks/results/evidence/sweep_then_train/pick_analysis.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
from hdet.sweep import pick_lr  # noqa: E402

D = ROOT / "benchmarks/results/evidence/sweep_then_train"
CPU = ROOT / "benchmarks/results/cpu"
SQ = math.sqrt(8)  # the main run's factor over a sweep run's LR (N = 8)
BEST = {"bytes": 4e-3, "fashion": 1.6e-2}
CLI = ["call9_cli_restart_s12-14.json", "call10_cli_restart_bytes_s15-17.json", "call13_cli_restart_bytes_s18-22.json",
       "call16_cli_restart_bytes_s23-27.json"]


def _inf(xs: list) -> list[float]:
    return [math.inf if x is None else float(x) for x in xs]


def sweeps(task: str) -> dict[int, dict[float, tuple[list[float], list[float], float | None]]]:
    """seed -> start -> (LRs, judged losses (training loss's tail), start loss)."""
    out: dict = {}
    study = {"bytes": ["call8_init_bytes.json", "call4_sqrt_bytes_s345.json"],
             "fashion": ["call8_init_fashion.json", "call5_fit7_fashion_s345.json"]}[task]
    for f in study:
        for r in json.loads((D / f).read_text())["runs"]:
            out.setdefault(int(r["seed"]), {})[float(r["start"])] = (r["sweep_lrs"], _inf(r["sweep_train_tail"]), None)
    cli = {"bytes": [D / f for f in ["call6_cli_seeds9-11.json", *CLI[:3]]],
           "fashion": [D / "call9_cli_restart_s12-14.json", CPU / "lr_sweep_cli_fashion_cpu_restart.json"]}[task]
    for f in cli:
        for r in json.loads(f.read_text())["runs"]:
            if r.get("task") == task:
                s = r["lr_sweep"]
                out.setdefault(int(r["seed"]), {})[float(r["start"])] = (s["lrs"], _inf(s["losses"]), s["start_loss"])
    return out


def reference(points: list[tuple[float, float]], width: float = 3.0) -> float:
    pts = [(math.log(lr), v) for lr, v in points if math.isfinite(v)]
    x0 = min(pts, key=lambda p: p[1])[0]
    sel = [p for p in pts if abs(p[0] - x0) <= math.log(width)]
    a, b, _ = np.polyfit([p[0] for p in sel], [p[1] for p in sel], 2)
    if a <= 0:
        return math.exp(x0)
    return math.exp(min(max(-b / (2 * a), min(p[0] for p in sel)), max(p[0] for p in sel)))


def pick_rules(task: str) -> dict:
    data = sweeps(task)
    refs = {s: reference(sorted(p for st in d.values() for p in zip(st[0], st[1]))) for s, d in data.items()}
    out = {"seeds": sorted(data), "reference_mean_x_best": statistics.mean(refs.values()) * SQ / BEST[task]}
    for k in (1, 2, 3):
        row, errs = {}, []
        for start in (0.1, 1.0, 10.0):
            ss = [s for s in data if start in data[s]]
            picks = [pick_lr(*data[s][start][:2], data[s][start][2], neighbours=k) for s in ss]
            e = [math.log2(p / refs[s]) for p, s in zip(picks, ss)]
            errs += e
            row[str(start)] = {"mean_pick_x_best": statistics.mean(picks) * SQ / BEST[task],
                               "mean_log2_error": statistics.mean(e), "sd_log2_error": statistics.stdev(e)}
        out[f"{2 * k + 1}_points"] = {**row, "rms_log2_error": math.sqrt(sum(x * x for x in errs) / len(errs))}
    return out


def shifted_grid(task: str, shift: int = 2) -> dict:
    """The 1x start's sweep as the grid ``shift`` points higher would see it (the lattice puts the 10x start's GPT
    grid two points up): its lowest ``shift`` runs left out, the top ones beyond it blown up (inf); the 7-point pick
    without runs beyond the grid, against the 1x grid's own."""
    data = sweeps(task)
    ss = [s for s in data if 1.0 in data[s]]
    own, shifted = [], []
    for s in ss:
        lrs, losses, start = data[s][1.0]
        ratio = lrs[1] / lrs[0]
        own.append(pick_lr(lrs, losses, start))
        shifted.append(pick_lr([lr * ratio ** shift for lr in lrs], losses[shift:] + [math.inf] * shift, start))
    return {"seeds": ss, "shift": shift, "mean_pick_x_best_own": statistics.mean(own) * SQ / BEST[task],
            "mean_pick_x_best_shifted": statistics.mean(shifted) * SQ / BEST[task]}


def lr_fit() -> dict:
    sweep = [(r["max_lr_x_best"], r["metric"], r["seed"]) for f in CLI
             for r in json.loads((D / f).read_text())["runs"] if r["task"] == "bytes"]
    fixed = [(r.get("max_lr_x_best", 1.0), r["metric"], r["seed"])
             for f in ["call10_tuned_bytes_s12-17.json", "call13_tuned_bytes_s18-20.json", "call16_tuned_bytes_s21-23.json",
                       "call14_hdet_bytes_1.25_1.6_s12-17.json"]
             for r in json.loads((D / f).read_text())["runs"] if r["name"].endswith("hdet")]

    def fit(pts: list) -> dict:
        seeds = sorted({p[2] for p in pts})
        X = np.array([[math.log(x)] + [float(s == t) for t in seeds] for x, _, s in pts])
        y = np.array([m for _, m, _ in pts])
        b = np.linalg.lstsq(X, y, rcond=None)[0]
        r = y - X @ b
        cov = (r @ r) / (len(y) - X.shape[1]) * np.linalg.pinv(X.T @ X)
        return {"runs": len(pts), "slope_per_ln_lr": float(b[0]), "se": float(math.sqrt(cov[0, 0])),
                "loss_change_1.2x_vs_1x": float(b[0] * math.log(1.2))}
    return {"cli_sweep_runs": fit(sweep), "with_runs_without_a_sweep": fit(sweep + fixed)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    rec = {"command": "python " + " ".join(sys.argv), "pick_rules": {t: pick_rules(t) for t in ("bytes", "fashion")},
           "gpt_loss_against_ln_max_lr": lr_fit(), "shifted_grid": shifted_grid("bytes")}
    Path(a.out).write_text(json.dumps(rec, indent=1))
    print(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
