"""The pre-registered rerun of the recipe at one run's compute with today's code (issue 15 follow-up, session 51).

``results/evidence/budget_after1/README.md`` wrote the test down before the runs: ``lr_sweep_cli.py --steps 1250
--sweep 0.2 --then restart --extra "--alpha 0"`` (``hdet train``'s defaults otherwise, ``--lr-cut-after 1``) from
0.1x, 1x and 10x the grid's best, GPT seeds 12-21 (and 22-26 where call 3 ran), Fashion-MNIST seeds 12-17. Each
start's GPT cell within +0.5% of the grid's best, each Fashion-MNIST cell within 0.2 point of it. Beside each cell,
the committed cell it replaces (the rule before, older code) at the same seeds, paired.

    python benchmarks/budget_after1_report.py --out benchmarks/results/evidence/budget_after1/report.json
"""

from __future__ import annotations

import argparse
import json
import statistics as st
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from confirm_after1_report import cell, runs  # noqa: E402  (same folder)
from sweep_alpha0_report import BEST, R  # noqa: E402

HERE = R / "budget_after1"
BEFORE = {"bytes": ["sweep_budget/call7/sweep_budget_bytes_sweep0.2_x0.1-1-10_s12-13-14-15-16.json",
                    "sweep_alpha0/call4/sweep_budget_alpha0_bytes_s17-21.json"],
          "fashion": ["sweep_alpha0/call6/sweep_budget_alpha0_fashion_s12-17.json"]}  # the cells these replace
REGISTERED = {"bytes": (range(12, 22), range(22, 27)), "fashion": (range(12, 18), range(0))}  # (calls 1-2, call 3)


def now(task: str) -> dict[tuple[float, int], tuple[float, bool]]:
    out = runs(sorted(HERE.glob(f"call[123]/budget_after1_{task}_*.json")))
    first, third = REGISTERED[task]
    want = {(s0, sd) for s0 in (0.1, 1.0, 10.0) for sd in first}
    extra = {(s0, sd) for s0 in (0.1, 1.0, 10.0) for sd in third}
    if set(out) not in (want, want | extra):  # (call 3's seeds all or none)
        raise SystemExit(f"Expected the registered {task} runs: missing {sorted(want - set(out))}, not registered "
                         f"{sorted(set(out) - want - extra)}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    rec: dict = {"command": "python " + " ".join(sys.argv), "grid_best": BEST, "cells": [], "met": True}
    for task in ("bytes", "fashion"):
        best, relative = BEST[task], task == "bytes"
        new, old = now(task), runs([R / f for f in BEFORE[task]])
        unit = (lambda x: f"{x['vs_best_pct']:+.2f}%, se {x['se_pct']:.2f}%") if relative else \
            (lambda x: f"{x['vs_best_pt']:+.2f} pt, se {x['se_pt']:.2f}")
        for start in (0.1, 1.0, 10.0):
            keys = sorted(k for k in new if k[0] == start)
            c = {"task": task, "start": start, "seeds": [k[1] for k in keys],
                 "now": cell([new[k][0] for k in keys], best, relative),
                 "guard_acted": [k[1] for k in keys if new[k][1]]}
            paired = [k for k in keys if k in old]
            d = [new[k][0] - old[k][0] for k in paired]
            c["before_same_seeds"] = cell([old[k][0] for k in paired], best, relative)
            c["paired_now_minus_before"] = {"n": len(d), "mean": st.mean(d), "se": st.stdev(d) / len(d) ** 0.5}
            c["met"] = (c["now"]["vs_best_pct"] <= 0.5) if relative else (c["now"]["vs_best_pt"] >= -0.2)
            rec["met"] &= c["met"]
            rec["cells"].append(c)
            n, b = c["now"], c["before_same_seeds"]
            print(f"{task} {start:g}x: {n['n']} seeds {n['mean']:.4f} ({unit(n)}); before, {b['n']} of the same seeds "
                  f"{b['mean']:.4f} ({unit(b)}); paired {c['paired_now_minus_before']['mean']:+.4f} (se "
                  f"{c['paired_now_minus_before']['se']:.4f}); guard acted at seeds {c['guard_acted']}: "
                  f"{'met' if c['met'] else 'NOT met'}")
    print(f"the targets at one run's compute: {'met' if rec['met'] else 'NOT met'}")
    Path(a.out).write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
