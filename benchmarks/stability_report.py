"""Tables of the stability study (issue 15, item 2): plain DP, HDET, and both with on_runaway='recover', at 1x,
3x and 10x each task's best max_lr, seeds 0-2. Writes results/evidence/stability/{bytes,fashion}.md.

    python benchmarks/stability_report.py
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent / "results" / "evidence" / "stability"
# plain DP's 3-seed mean at the grid's best max_lr (results/evidence/final), and a result that means "did not
# train": a validation loss the 1x runs pass before step 300, an accuracy 2 points under the grid best
TASKS = {"bytes": dict(metric="val_loss_full", best=1.2127, broken=lambda v: v > 2.0, unit="validation loss",
                       rel=lambda m, b: f"{100 * (m / b - 1):+.1f}%", what="final validation loss above 2.0"),
         "fashion": dict(metric="test_accuracy", best=92.09, broken=lambda v: v < 90.09, unit="test accuracy (%)",
                         rel=lambda m, b: f"{m - b:+.2f} pt", what="final accuracy 2 points or more under the grid best")}


def main() -> None:
    for task in TASKS:
        report(task)


def report(task: str) -> None:
    t = TASKS[task]
    d = json.loads((HERE / f"{task}.json").read_text())
    rows = {}
    for r in d["runs"]:
        name, start, _ = r["name"].rsplit("-", 2)
        m = (r.get("final_metrics") or {}).get(t["metric"])
        rows.setdefault((name, start), []).append((r["name"], m, r.get("final_lr_scale"), r.get("runaway_events")))
    labels = {"plain": "plain DP (alpha 0)", "hdet": "HDET alpha 0.2, as the paper has it",
              "guard": "HDET alpha 0.2, on_runaway='recover'", "plainguard": "plain DP, on_runaway='recover'"}
    out = [f"# Stability study, {task}: {d['device']}, Python {d['python']}, torch {d['torch']}", "",
           f"The evidence suite's {task} task, N = 8, {d['steps']} steps, T = 25; grid best max_lr {d['best_max_lr']}; "
           f"plain DP's 3-seed grid best {t['best']}. Final {t['unit']} per seed, mean, and runs that did not train "
           f"({t['what']}). Command: `{d['command']}` (plain and HDET rows from the earlier calls' JSON, "
           "`--previous`).", "",
           "| configuration | start | seeds | mean | vs grid best | not trained | LR scale at the end |",
           "|---|---|---|---|---|---|---|"]
    for start in ("1x", "3x", "10x"):
        for name in ("plain", "hdet", "guard", "plainguard"):
            runs = sorted(rows.get((name, start), []))
            if not runs:
                continue
            vals = [m for _, m, _, _ in runs if m is not None]
            mean = statistics.mean(vals)
            out.append(f"| {labels[name]} | {start} | {', '.join(f'{v:.4f}' for v in vals)} | {mean:.4f} | "
                       f"{t['rel'](mean, t['best'])} | {sum(t['broken'](v) for v in vals)} of {len(vals)} | "
                       f"{', '.join(f'{s:g}' for _, _, s, _ in runs)} |")
    (HERE / f"{task}.md").write_text("\n".join(out) + "\n")
    print("\n".join(out))


if __name__ == "__main__":
    main()
