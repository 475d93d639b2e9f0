"""Tables and a plot: HDET against plain data parallel and the learning-rate-free peers (issue 15, item 1).

Reads ``benchmarks/results/evidence/peers/<task>.json`` (``evidence.py --peers``: D-Adaptation Adam, Prodigy,
Schedule-Free AdamW, and plain DP at the grid's best max_lr on the same machine) and the committed HDET rows
(``final/<task>.json``: spread and fit controller at T = 25; ``followup_T/<task>_T100.json``: at T = 100).
Writes ``peers/<task>.md`` and ``peers/<task>_peers.png``.

    python benchmarks/peers_report.py
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

R = Path(__file__).resolve().parent / "results" / "evidence"


def _metric(task: str, run: dict) -> float | None:
    m = run.get("final_metrics") or {}
    if run.get("crashed") or not m:
        return None
    return m["test_accuracy"] if task == "fashion" else m["val_loss_full"]


def _runs(path: Path) -> dict[str, dict]:
    return {r["name"]: r for r in json.loads(path.read_text())["runs"]} if path.is_file() else {}


def rows(task: str) -> list[tuple[str, str, list[float | None], int]]:
    """(label, source, per-seed metrics (None: diverged), seeds not run)."""
    peers, final, t100 = _runs(R / "peers" / f"{task}.json"), _runs(R / "final" / f"{task}.json"), \
        _runs(R / "followup_T" / f"{task}_T100.json")

    def seeds(runs: dict, prefix: str) -> tuple[list[float | None], int]:
        got = [runs[f"{prefix}-s{s}"] for s in range(3) if f"{prefix}-s{s}" in runs]
        done = [r for r in got if "final_metrics" in r or r.get("crashed")]
        return [_metric(task, r) for r in done], 3 - len(done)

    out = []
    best = json.loads((R / "final" / f"{task}.json").read_text())["best_max_lr"]
    grid_best = min(((k, v) for k, v in final.items() if k.startswith("grid-") and k.endswith("-s0")
                     and v["cfg"]["max_lr"] == best), default=(None, None))[0]
    if grid_best:
        out.append(("plain DP, grid best (committed)", "final", *seeds(final, grid_best[:-3])))
    out.append(("plain DP at the grid best (this machine)", "peers", *seeds(peers, "plain-1x")))
    out.append(("D-Adaptation Adam, lr 1 (OneCycle shape)", "peers", *seeds(peers, "dadapt")))
    out.append(("Prodigy, lr 1 (OneCycle shape)", "peers", *seeds(peers, "prodigy")))
    for start in ("0.1", "1", "10"):
        out.append((f"Schedule-Free AdamW, {start}x its best lr", "peers", *seeds(peers, f"sf-{start}x")))
    for start in ("0.1", "1", "10"):
        out.append((f"HDET spread (alpha 0.5, T 25), from {start}x", "final", *seeds(final, f"none-{start}x")))
        out.append((f"HDET + fit (T 25), from {start}x", "final", *seeds(final, f"fit-{start}x")))
        out.append((f"HDET + fit (T 100), from {start}x", "followup_T", *seeds(t100, f"fit-{start}x-T100")))
    return out


def _fmt(xs: list[float | None], task: str) -> tuple[str, float | None]:
    ok = [x for x in xs if x is not None]
    if not xs:
        return "not run", None
    if not ok:
        return f"diverged ({len(xs)}/{len(xs)})", None
    m = statistics.mean(ok)
    sd = statistics.stdev(ok) if len(ok) > 1 else float("nan")
    d = f"{m:.2f}" if task == "fashion" else f"{m:.4f}"
    s = f"{sd:.2f}" if task == "fashion" else f"{sd:.4f}"
    bad = len(xs) - len(ok)
    return f"{d} ± {s}" + (f" ({bad} diverged)" if bad else ""), m


def report(task: str) -> str:
    rs = rows(task)
    anchor = _fmt(rs[1][2], task)[1]
    ref = _fmt(rs[0][2], task)[1]
    what = "test accuracy (%), higher is better" if task == "fashion" else "validation loss, lower is better"
    lines = [f"# {task}: HDET against plain DP and the learning-rate-free peers", "",
             f"Metric: {what}; mean ± sd over the seeds run (n). Δ: against plain DP at the grid's best max_lr "
             "on the same machine as the peers (the anchor), and against the committed grid best.", "",
             "| configuration | source | mean ± sd | n | Δ anchor | Δ grid best |", "|---|---|---|---|---|---|"]
    for label, src, xs, missing in rs:
        text, m = _fmt(xs, task)

        def delta(base: float | None) -> str:
            if m is None or base is None:
                return "-"
            return f"{m - base:+.2f} pt" if task == "fashion" else f"{100 * (m / base - 1):+.1f}%"

        n = f"{len(xs)}" + (f" (+{missing} not finished)" if missing and xs else "")
        lines.append(f"| {label} | {src} | {text} | {n} | {delta(anchor)} | {delta(ref)} |")
    return "\n".join(lines) + "\n"


def plot(task: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = [r for r in rows(task) if r[2]]
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(rs) + 1.2))
    for i, (label, _, xs, _) in enumerate(rs):
        ok = [x for x in xs if x is not None]
        ax.scatter(ok, [i] * len(ok), s=18, color="C0" if "HDET" not in label else "C3")
    ax.set_yticks(range(len(rs)), [r[0] for r in rs], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("test accuracy (%)" if task == "fashion" else "validation loss")
    if task == "bytes":
        ax.set_xlim(right=min(ax.get_xlim()[1], 1.8))
    else:
        ax.set_xlim(left=max(ax.get_xlim()[0], 88.0))
    lo, hi = ax.get_xlim()
    for i, (_, _, xs, _) in enumerate(rs):
        off = [x for x in xs if x is not None and not lo <= x <= hi]
        if off:
            ax.text(hi if task == "bytes" else lo, i, f" off axis: {statistics.mean(off):.2f} (n {len(off)}) ",
                    fontsize=7, va="center", ha="right" if task == "bytes" else "left", color="grey")
    ax.set_title(f"{task}: one dot per seed", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    for task in ("bytes", "fashion"):
        (R / "peers" / f"{task}.md").write_text(report(task))
        plot(task, R / "peers" / f"{task}_peers.png")
        print(report(task))
