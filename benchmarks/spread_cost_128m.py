"""HDET's spread at 128M against plain DDP, pooled over every machine's committed runs (issue 15).

Reads every run of ``benchmarks/gpt_multi_gpu.py`` (and of ``benchmarks/spread_eos.py``, its one-GPU emulation) under
``benchmarks/results/`` at the tuned LR (max_lr 7.5e-4, 1000 steps, the 768-wide model, no sweep, no range test),
groups them by machine (the results folder) and arm (plain: alpha 0; HDET: alpha 0.2 at any T, without a stability-guard
event, since those runs measure the guard's false alarms of before ``judge_steps``), and writes per machine the arms'
means and their difference, and over the machines the difference's inverse-variance mean with its standard error,
from the within-arm standard deviation pooled over every cell (a cell of 2-4 runs says little about its own spread);
then the same with other choices of runs (without the one-GPU emulation, which has no stability guard; with the runs
that had guard events; with the LR grid's plain run on one GPU; T 5 and T 25 apart), and alpha 0.1.
Same-seed runs are not paired: on one GPU the same seed reran 1.9% apart (``gpu_h200/spread_eos/``).

    python benchmarks/spread_cost_128m.py --out benchmarks/results/spread_cost_128m.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def runs() -> list[dict]:
    out = []
    for f in sorted(RESULTS.rglob("*.json")):
        try:
            d = json.loads(f.read_text())
        except (ValueError, UnicodeDecodeError):
            continue
        a = d.get("args") if isinstance(d, dict) else None
        if not isinstance(a, dict) or "final_val_loss" not in d or a.get("steps") != 1000 or a.get("max_lr") != 7.5e-4:
            continue
        if a.get("lr_sweep") or a.get("range_test") or a.get("tiny") or a.get("width", 768) != 768 \
                or a.get("global_batch", 32) != 32:
            continue
        if "multipliers" in a:  # spread_eos.py: the multipliers
            rho = [float(x) for x in a["multipliers"].split(",")]
            alpha = round((max(rho) - min(rho)) / 2, 6)
        else:
            alpha = float(a["alpha"])
        events = [s["step"] for s in d.get("syncs", []) if s.get("runaway") or s.get("recovered")
                  or s.get("went_back_to") is not None]
        out.append({"file": str(f.relative_to(RESULTS)), "machine": str(f.relative_to(RESULTS)).split("/")[0],
                    "world": d.get("world", len(a.get("multipliers", "").split(","))), "alpha": alpha,
                    "T": a.get("T"), "seed": a.get("seed"), "loss": d["final_val_loss"], "guard_events": events})
    return out


def estimate(rs: list[dict], alpha: float, with_events: bool = False) -> dict:
    """Per machine the arms' means and difference, and over the machines the difference's inverse-variance mean with
    its standard error (the within-arm standard deviation pooled over every cell)."""
    cells: dict[str, dict[str, list[float]]] = {}
    for r in rs:
        arm = "plain" if r["alpha"] == 0 else "hdet" if r["alpha"] == alpha and (with_events or not r["guard_events"]) \
            else None
        if arm:
            cells.setdefault(r["machine"], {"plain": [], "hdet": []})[arm].append(r["loss"])
    cells = {m: c for m, c in cells.items() if c["plain"] and c["hdet"]}
    resid = [x - statistics.mean(v) for c in cells.values() for v in c.values() for x in v]
    dof = len(resid) - sum(len(c) for c in cells.values())
    sd = math.sqrt(sum(e * e for e in resid) / dof)
    per, num, den = {}, 0.0, 0.0
    for m, c in sorted(cells.items()):
        mp, mh = statistics.mean(c["plain"]), statistics.mean(c["hdet"])
        se = sd * math.sqrt(1 / len(c["plain"]) + 1 / len(c["hdet"]))
        per[m] = {"plain": c["plain"], "hdet": c["hdet"], "plain_mean": mp, "hdet_mean": mh,
                  "difference_pct": 100 * (mh - mp) / mp, "se_pct": 100 * se / mp}
        num, den = num + (mh - mp) / mp / (se / mp) ** 2, den + 1 / (se / mp) ** 2
    return {"difference_pct": 100 * num / den, "se_pct": 100 / math.sqrt(den), "pooled_within_arm_sd": sd,
            "dof": dof, "runs": {"plain": sum(len(c["plain"]) for c in cells.values()),
                                 "hdet": sum(len(c["hdet"]) for c in cells.values())}, "machines": per}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    a = p.parse_args()
    every = runs()
    rs = [r for r in every if r["world"] and r["world"] > 1]  # (world 1: the LR grid's one-GPU runs)
    real = [r for r in rs if r["machine"] != "gpu_h200"]  # (gpu_h200: spread_eos.py's emulation, no stability guard)
    grid = [r for r in every if r["world"] == 1 and r["alpha"] == 0]  # (plain at the whole batch on one GPU)
    by_T = {T: estimate([r for r in rs if r["alpha"] == 0 or r["T"] == T], 0.2) for T in (5, 25)}
    rec = {"command": "python " + " ".join(sys.argv), "python": sys.version.split()[0],
           "alpha_0.2": estimate(rs, 0.2),
           "variants": {"without the one-GPU emulation": estimate(real, 0.2),
                        "with the runs that had guard events": estimate(rs, 0.2, with_events=True),
                        "with the LR grid's one-GPU plain run": estimate(
                            rs + [dict(r, machine="gpu_4x_h100") for r in grid], 0.2),
                        "T 5 alone": by_T[5], "T 25 alone": by_T[25]},
           "alpha_0.1": estimate(rs, 0.1),
           "alpha_0.1_T25": estimate([r for r in rs if r["alpha"] == 0 or r["T"] == 25], 0.1),
           "runs": every,
           "excluded_hdet_runs_with_guard_events": [r["file"] for r in rs if r["alpha"] > 0 and r["guard_events"]]}
    for name, e in [("alpha 0.2", rec["alpha_0.2"]), *rec["variants"].items(), ("alpha 0.1", rec["alpha_0.1"]),
                    ("alpha 0.1, T 25", rec["alpha_0.1_T25"])]:
        print(f"{name}: {e['difference_pct']:+.2f}% (se {e['se_pct']:.2f}%; {e['runs']['hdet']} HDET, "
              f"{e['runs']['plain']} plain runs; sd {e['pooled_within_arm_sd']:.4f})")
    for m, v in rec["alpha_0.2"]["machines"].items():
        print(f"  {m}: plain {len(v['plain'])} runs {v['plain_mean']:.4f}, hdet {len(v['hdet'])} runs "
              f"{v['hdet_mean']:.4f}: {v['difference_pct']:+.2f}% (se {v['se_pct']:.2f}%)")
    Path(a.out).write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
