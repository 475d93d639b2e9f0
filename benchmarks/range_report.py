"""Tables of the in-run LR range test (issue 15, item 3): every version measured, from 0.1x, 1x and 10x each
task's best max_lr, seeds 0-2, against plain DP's 3-seed grid best and the earlier rows of the suite. Writes
results/evidence/range/report.md.

    python benchmarks/range_report.py
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent / "results" / "evidence" / "range"
TASKS = {"bytes": dict(metric="val_loss_full", best=1.2127, fmt="{:.4f}", rel=lambda m, b: f"{100 * (m / b - 1):+.1f}%"),
         "fashion": dict(metric="test_accuracy", best=92.09, fmt="{:.2f}", rel=lambda m, b: f"{m - b:+.2f} pt")}
# (file, version): what the code was when each file was measured (git log has the commits)
FILES = [("bytes.json", "v1: ramp from 1x the schedule, ends at a rise or 3 windows without a new best, back to the best sync"),
         ("bytes_v2.json", "v2: + ends at a collapse of the per-window improvement; back to the ramp's last sync at or below the new peak"),
         ("bytes_v3.json", "v3: + the ramp starts at 1/25 of the schedule (the code now)"),
         ("bytes_v3b.json", "v3"),
         ("bytes_v4.json", "v4: + a collapse must also be under 2 standard errors (reverted)"),
         ("bytes_v5.json", "v5: v3 + a collapse needs two low windows in a row (reverted)"),
         ("bytes_v3_fit.json", "v3 + the fit controller after the warm-up (H100: the grid best is the H200's)"),
         ("fashion_v3.json", "v3 (the code now)"),
         ("fashion_v3_fit.json", "v3 + the fit controller after the warm-up (H100: the grid best is the H200's)"),
         ("fashion_v4.json", "v4 (reverted)"),
         ("fashion_v5.json", "v5 (reverted)")]


def main() -> None:
    out = ["# The in-run LR range test: every version measured", ""]
    for name, version in FILES:
        d = json.loads((HERE / name).read_text())
        t = TASKS[d["task"]]
        rows: dict[tuple[str, str], list[float]] = {}
        ends: dict[tuple[str, str], list[str]] = {}
        for r in d["runs"]:
            group, start, _ = r["name"].rsplit("-", 2)
            m = (r.get("final_metrics") or {}).get(t["metric"])
            if m is not None:
                rows.setdefault((group, start), []).append(m)
                e = r.get("range_end")
                ends.setdefault((group, start), []).append(f"{e[1]} at {e[0]}, peak {e[2]:.2g}" if e else "-")
        out += [f"## {d['task']}, `{name}`: {version}", "",
                f"{d['device']}, Python {d['python']}, torch {d['torch']}; N = 8, {d['steps']} steps, T = 25, alpha "
                f"{d['alpha']}; grid best {t['best']}. Command: `{d['command']}`", "",
                "| backoff | start | seeds | mean | vs grid best | how the test ended (per seed) |", "|---|---|---|---|---|---|"]
        for (group, start), vals in sorted(rows.items(), key=lambda kv: (kv[0][0], float(kv[0][1][:-1]))):
            mean = statistics.mean(vals)
            out.append(f"| {group.removeprefix('range-b')} | {start} | {', '.join(t['fmt'].format(v) for v in vals)} | "
                       f"{t['fmt'].format(mean)} | {t['rel'](mean, t['best'])} | {'; '.join(ends[(group, start)])} |")
        out.append("")
    (HERE / "report.md").write_text("\n".join(out) + "\n")
    print(f"wrote {HERE / 'report.md'}")


if __name__ == "__main__":
    main()
