"""Tables of the stability study (issue 15, item 2): plain DP, HDET, and both with on_runaway='recover', at 1x,
3x and 10x the GPT's best max_lr, seeds 0-2. Writes results/evidence/stability/bytes.md.

    python benchmarks/stability_report.py
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent / "results" / "evidence" / "stability"
GRID_BEST = 1.2127  # plain DP's 3-seed mean at the grid's best max_lr (results/evidence/final)
BROKEN = 2.0  # a final validation loss the 1x runs pass before step 300: "did not train"


def main() -> None:
    d = json.loads((HERE / "bytes.json").read_text())
    rows = {}
    for r in d["runs"]:
        name, start, _ = r["name"].rsplit("-", 2)
        m = (r.get("final_metrics") or {}).get("val_loss_full")
        rows.setdefault((name, start), []).append((r["name"], m, r.get("final_lr_scale"), r.get("runaway_events")))
    labels = {"plain": "plain DP (alpha 0)", "hdet": "HDET alpha 0.2, as the paper has it",
              "guard": "HDET alpha 0.2, on_runaway='recover'", "plainguard": "plain DP, on_runaway='recover'"}
    out = [f"# Stability study: {d['device']}, Python {d['python']}, torch {d['torch']}", "",
           f"Byte GPT of the evidence suite, N = 8, {d['steps']} steps, T = 25; grid best max_lr {d['best_max_lr']}; "
           f"plain DP's 3-seed grid best {GRID_BEST}. Final validation loss per seed (`val_loss_full`), mean, and runs "
           f"that did not train (final loss above {BROKEN}). Command: `{d['command']}` (and `bytes_call1.json`).", "",
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
                       f"{100 * (mean / GRID_BEST - 1):+.1f}% | {sum(v > BROKEN for v in vals)} of {len(vals)} | "
                       f"{', '.join(f'{s:g}' for _, _, s, _ in runs)} |")
    (HERE / "bytes.md").write_text("\n".join(out) + "\n")
    print("\n".join(out))


if __name__ == "__main__":
    main()
