"""How often a GPT run of the evidence suite breaks, with and without HDET (issue 15).

A run "breaks" when its final validation loss ends above ``--above`` (1.3: the task's unbroken runs at or below
the best LR end between 1.20 and 1.27, broken ones at 1.35-1.45: a loss spike it never recovers from). Counted
over every committed GPT run of ``benchmarks/results/evidence/`` at an LR that trains (AdamW at 0.45x-1.1x the
grid's best max_lr, 4e-3; D-Adaptation and Prodigy at lr 1), without the range test, local mode, Schedule-Free or
the paper's controller (it drives the LR to its floor: those runs end at 1.31-1.32 undertrained, not broken),
plus the runs read back in ``lr_free_estimate/salvage_d.txt``; a run that a later JSON repeats counts once.

    python benchmarks/breaks_report.py            # prints the table
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent / "results" / "evidence"
BEST = 4e-3


def committed() -> list[tuple[str, str, float]]:
    """(kind, where, final validation loss) of every counted run; kind: 'plain' (no spread) or 'hdet'."""
    seen, out = set(), []
    for path in sorted(HERE.rglob("*.json")):
        try:
            runs = json.loads(path.read_text()).get("runs", [])
        except (ValueError, AttributeError):
            continue
        for r in runs:
            c, v = r.get("cfg") or {}, (r.get("final_metrics") or {}).get("val_loss_full")
            if (c.get("task") != "bytes" or v is None or c.get("range_test") or c.get("local")
                    or (c.get("auto_lr") and c.get("controller") == "paper")):
                continue
            opt = c.get("optimizer", "adamw")
            if opt == "schedulefree-adamw" or (opt == "adamw" and not 0.45 * BEST <= c["max_lr"] <= 1.1 * BEST):
                continue
            key = (json.dumps({k: x for k, x in c.items() if k not in ("out", "device", "label")}, sort_keys=True), v)
            if key in seen:
                continue
            seen.add(key)
            kind = "hdet" if c.get("alpha") else "guard" if c.get("on_runaway") == "recover" else "plain"
            out.append((kind, f"{path.relative_to(HERE)}:{r['name']}", v))
    for line in (HERE / "lr_free_estimate" / "salvage_d.txt").read_text().splitlines():
        m = re.search(r"^(\S+).*'val_loss_full': ([0-9.]+)", line)
        if m and not line.startswith("#"):
            out.append(("plain", f"lr_free_estimate/salvage_d.txt:{m.group(1)}", float(m.group(2))))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--above", type=float, default=1.3)
    a = p.parse_args()
    runs = committed()
    print("| runs | counted | broke (final val. loss > %g) | the broken ones |" % a.above)
    print("|---|---|---|---|")
    for kind, label in (("plain", "without HDET (alpha 0: AdamW, D-Adaptation, Prodigy)"), ("hdet", "with HDET"),
                        ("guard", "without HDET's spread, with its stability guard (alpha 0, on_runaway='recover')")):
        xs = [(w, v) for k, w, v in runs if k == kind]
        bad = [f"{w} ({v:.4f})" for w, v in xs if v > a.above]
        print(f"| {label} | {len(xs)} | {len(bad)} | {'; '.join(bad) or '-'} |")


if __name__ == "__main__":
    main()
