"""HDET's spread at 128M against plain DDP, pooled over every machine's committed runs (issue 15).

Reads every run of ``benchmarks/gpt_multi_gpu.py`` (and of ``benchmarks/spread_eos.py``, its one-GPU emulation) under
``benchmarks/results/`` at the tuned LR (max_lr 7.5e-4, 1000 steps, the 768-wide model, no sweep, no range test),
groups them by machine (the results folder) and arm (plain: alpha 0; HDET: alpha 0.2 at any T, without a stability-guard
event, since those runs measure the guard's false alarms of before ``judge_steps``), and writes per machine the arms'
means and their difference, and over the machines the difference's inverse-variance mean with its standard error,
from the within-arm standard deviation pooled over every cell (a cell of 2-4 runs says little about its own spread).
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
        if a.get("lr_sweep") or a.get("range_test") or a.get("width", 768) != 768 or a.get("global_batch", 32) != 32:
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--alpha", type=float, default=0.2)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    rs = [r for r in runs() if r["world"] and r["world"] > 1]  # (world 1: the LR grid's one-GPU runs)
    cells: dict[str, dict[str, list[float]]] = {}
    for r in rs:
        arm = "plain" if r["alpha"] == 0 else "hdet" if r["alpha"] == a.alpha and not r["guard_events"] else None
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
    rec = {"command": "python " + " ".join(sys.argv), "python": sys.version.split()[0], "alpha": a.alpha,
           "pooled_within_arm_sd": sd, "machines": per, "difference_pct": 100 * num / den,
           "se_pct": 100 / math.sqrt(den), "runs": rs,
           "excluded_hdet_runs_with_guard_events": [r["file"] for r in rs if r["alpha"] == a.alpha and r["guard_events"]]}
    print(json.dumps({k: rec[k] for k in ("difference_pct", "se_pct", "pooled_within_arm_sd")}))
    for m, v in per.items():
        print(f"{m}: plain {len(v['plain'])} runs {v['plain_mean']:.4f}, hdet {len(v['hdet'])} runs {v['hdet_mean']:.4f}: "
              f"{v['difference_pct']:+.2f}% (se {v['se_pct']:.2f}%)")
    Path(a.out).write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
