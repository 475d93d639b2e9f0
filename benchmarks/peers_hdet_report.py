"""The tables of ``benchmarks/results/evidence/peers_hdet/`` and ``peers_hdet2/`` (issue 15, item 4): HDET over
D-Adaptation Adam and Prodigy (the multiplier on their step, :mod:`hdet.step_scale`) beside each optimizer
alone and the suite's reference rows.

    python benchmarks/peers_hdet_report.py [peers_hdet2]   # prints the markdown tables (that folder's README.md)
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent / "results" / "evidence"
GRID_BEST = {"bytes": 1.2127, "fashion": 92.2167}  # plain DP's 3-seed grid best (../final/*.md)


def metric(task: str, run: dict) -> float | None:
    m = run.get("final_metrics")
    if not m:
        return None
    return m["val_loss_full"] if task == "bytes" else m["test_accuracy"]


def rows(folder: str, task: str) -> dict[str, tuple[list[float], dict]]:
    """group -> (metric per seed in seed order, the first run's config), from every ``<task>*.json`` of the
    folder (not the ``*_call<n>.json`` that a later JSON continues)."""
    out: dict[str, tuple[list[float], dict]] = {}
    for path in sorted((HERE / folder).glob(f"{task}*.json")):
        if "_call" in path.stem:
            continue
        for r in sorted(json.loads(path.read_text())["runs"], key=lambda r: (r["group"], r["cfg"]["seed"])):
            v = metric(task, r)
            if v is not None and r["group"] not in ("plain", "sf", "sf-grid"):
                out.setdefault(r["group"], ([], r["cfg"]))[0].append(v)
    return out


def main() -> None:
    folder = sys.argv[1] if len(sys.argv) > 1 else "peers_hdet"
    for task, unit in (("bytes", "GPT validation loss"), ("fashion", "Fashion-MNIST test accuracy (%)")):
        best = GRID_BEST[task]
        print(f"\n{unit}; plain DP's grid best {best:g}\n")
        print("| row | alpha | T | on_runaway | controller | seeds | mean +- sd | vs grid best |")
        print("|---|---|---|---|---|---|---|---|")
        for group, (xs, cfg) in rows(folder, task).items():
            mean = statistics.mean(xs)
            sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
            rel = f"{100 * (mean / best - 1):+.2f}%" if task == "bytes" else f"{mean - best:+.2f} pt"
            seeds = " / ".join(f"{x:.4f}" if task == "bytes" else f"{x:.2f}" for x in xs)
            ctrl = cfg.get("controller", "fit") if cfg.get("auto_lr") else "none"
            print(f"| {group} | {cfg['alpha']:g} | {cfg['T']} | {cfg['on_runaway']} | {ctrl} | {seeds} | "
                  f"{mean:.4f} +- {sd:.4f} | {rel} |")


if __name__ == "__main__":
    main()
