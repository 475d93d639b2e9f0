"""The table of ``benchmarks/results/evidence/peers_hdet/`` (issue 15, item 4): HDET over D-Adaptation Adam
(the multiplier on its step, :mod:`hdet.step_scale`) beside D-Adaptation alone and the suite's reference rows.

    python benchmarks/peers_hdet_report.py            # prints the markdown table (README.md of that folder)
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent / "results" / "evidence"
GRID_BEST = {"bytes": 1.2127, "fashion": 92.2167}  # plain DP's 3-seed grid best (../final/*.md)
FILES = {"bytes": ["bytes.json"], "fashion": ["fashion.json", "fashion_ignore.json", "fashion_a0.1.json"]}


def metric(task: str, run: dict) -> float | None:
    m = run.get("final_metrics")
    if not m:
        return None
    return m["val_loss_full"] if task == "bytes" else m["test_accuracy"]


def rows(task: str) -> dict[str, tuple[list[float], dict]]:
    """group -> (metric per seed in seed order, the first run's config)."""
    out: dict[str, tuple[list[float], dict]] = {}
    for name in FILES[task]:
        for r in sorted(json.loads((HERE / "peers_hdet" / name).read_text())["runs"], key=lambda r: r["name"]):
            v = metric(task, r)
            if v is not None and r["group"] not in ("plain", "sf", "sf-grid", "prodigy"):
                out.setdefault(r["group"], ([], r["cfg"]))[0].append(v)
    return out


def main() -> None:
    for task, unit in (("bytes", "GPT validation loss"), ("fashion", "Fashion-MNIST test accuracy (%)")):
        best = GRID_BEST[task]
        print(f"\n{unit}; plain DP's grid best {best:g}\n")
        print("| row | alpha | on_runaway | seeds 0 / 1 / 2 | mean +- sd | vs grid best |")
        print("|---|---|---|---|---|---|")
        for group, (xs, cfg) in rows(task).items():
            mean = statistics.mean(xs)
            sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
            rel = f"{100 * (mean / best - 1):+.2f}%" if task == "bytes" else f"{mean - best:+.2f} pt"
            seeds = " / ".join(f"{x:.4f}" if task == "bytes" else f"{x:.2f}" for x in xs)
            print(f"| {group} | {cfg['alpha']:g} | {cfg['on_runaway']} | {seeds} | {mean:.4f} +- {sd:.4f} | {rel} |")


if __name__ == "__main__":
    main()
