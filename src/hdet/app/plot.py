"""PNG plots of run folders written by :func:`hdet.run.train` (matplotlib, no display needed).

* ``loss.png``: training and held-out loss against steps for one run or every run of a comparison
  (the layout of the paper's Figure 2; the held-out loss is the task's validation split, Fashion-MNIST's test set).
* ``lr.png``: the per-group learning rates of replica 0 (dashed) and the mean over replicas (solid,
  the base schedule) against steps (the paper's Figure 3).
* ``hparams.png`` (runs that explore more than the LR): for every explored hyperparameter, every
  replica's value and the base at each sync, and the controller's zero-order hypergradient Delta.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

__all__ = ["load_run", "plot_losses", "plot_lrs", "plot_hparams", "plot_dir", "plot_runs"]


def _jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a ``.jsonl`` file; a last line cut by a kill mid-write (or a run still writing) left out, as
    ``--resume`` leaves it; a bad line before it is an error naming the file."""
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    out = []
    for i, line in enumerate(lines):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                break
            raise ValueError(f"Expected one JSON record a line in {path}, but line {i + 1} is not ({e})") from None
    return out


def load_run(run_dir: str | Path) -> dict[str, Any]:
    """config, metrics, syncs and summary of one run folder."""
    d = Path(run_dir)
    if not (d / "metrics.jsonl").is_file():
        raise FileNotFoundError(f"Expected a run folder with metrics.jsonl (from `hdet train`), but {d} has none")
    cfg = json.loads((d / "config.json").read_text()) if (d / "config.json").exists() else {}
    summary = json.loads((d / "summary.json").read_text()) if (d / "summary.json").exists() else {}
    return {"dir": d, "config": cfg, "metrics": _jsonl(d / "metrics.jsonl"), "syncs": _jsonl(d / "syncs.jsonl"),
            "summary": summary, "label": cfg.get("config", {}).get("label") or d.name}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: str | Path, dpi: int) -> Path:
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=dpi)
    _pyplot().close(fig)
    return out


def _held_out(runs: list[dict[str, Any]]) -> str:
    """What the runs' ``val_loss`` is the loss of: the GPT's validation files, Fashion-MNIST's test set (it has no
    validation split), as ``hdet train`` prints it."""
    tasks = {r.get("config", {}).get("config", {}).get("task") for r in runs}
    return "test" if tasks == {"fashion"} else "validation" if tasks <= {"bytes"} else "held-out"


def plot_losses(runs: list[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    plt = _pyplot()
    fig, (ax_t, ax_v) = plt.subplots(1, 2, figsize=(12, 4.5))
    firsts: tuple[list[float], list[float]] = ([], [])  # per panel: every run's first finite values
    lows: tuple[list[float], list[float]] = ([], [])  # per panel: every run's lowest finite value
    for run in runs:
        steps = [m["step"] for m in run["metrics"]]
        loss = [m["train_loss"] if m["train_loss"] is not None and math.isfinite(m["train_loss"]) else float("nan")
                for m in run["metrics"]]  # (null: no finite loss; records written before: NaN)
        crashed = run["summary"].get("crashed")
        label = run["label"] + (" (crashed)" if crashed else "")
        (line,) = ax_t.plot(steps, loss, label=label, lw=1.2)
        val = [(m["step"], math.nan if m["val_loss"] is None else m["val_loss"]) for m in run["metrics"]
               if "val_loss" in m]  # (null: a non-finite evaluation)
        if val:
            ax_v.plot(*zip(*val), "o-", ms=3, color=line.get_color(), label=label)
        firsts[0].extend(v for v in loss[:3] if math.isfinite(v))
        firsts[1].extend(v for _, v in val[:1] if math.isfinite(v))
        for low, values in zip(lows, (loss, [v for _, v in val])):
            low.append(min((v for v in values if math.isfinite(v)), default=math.inf))
    for ax, first, low in zip((ax_t, ax_v), firsts, lows):
        if len(runs) > 1 and first:  # overlaid runs: keep a diverged one from squashing the others, and say so
            top = max(first) * 1.05
            if ax.dataLim.y1 > top:
                bottom = min(min(low), top)  # (the lowest value shown: not the autoscale of the diverged range)
                pad = 0.05 * (top - bottom)
                ax.set_ylim(bottom - pad, top)
                ax.text(0.99, 0.98, f"clipped at {top:.3g}", transform=ax.transAxes, ha="right", va="top", fontsize=7)
    ax_t.set(xlabel="step", ylabel="training loss (mean over replicas)", title="training loss")
    held_out = _held_out(runs)
    ax_v.set(xlabel="step", ylabel=f"{held_out} loss (averaged model)", title=f"{held_out} loss")
    for ax in (ax_t, ax_v):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return _save(fig, path, 120)


def _check_lrs(run: dict[str, Any]) -> None:
    """Before any file is written: a run with no logged step has no learning rates to plot."""
    if not (run["metrics"] and run["metrics"][0].get("lr")):
        raise ValueError(f"Expected learning rates in {run['dir']}/metrics.jsonl, but found none (a run that "
                         "logged no step)")


def plot_lrs(run: dict[str, Any], path: str | Path) -> Path:
    plt = _pyplot()
    _check_lrs(run)
    groups = list(run["metrics"][0]["lr"])
    cols = min(len(groups), 2)
    rows = math.ceil(len(groups) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.2 * rows), squeeze=False)
    steps = [m["step"] for m in run["metrics"]]
    n = run["config"].get("replicas", "N")
    for ax, g in zip(axes.flat, groups):
        ax.plot(steps, [m["lr_mean"][g] for m in run["metrics"]], "-", label=f"mean of {n} replicas (base)")
        ax.plot(steps, [m["lr"][g] for m in run["metrics"]], "--", label="replica 0")
        j = groups.index(g)
        if run["syncs"]:  # every replica's multiplier at each sync, times the base there (SyncRecord.values)
            xs = [s["step"] for s in run["syncs"] for _ in s["values"][j]]
            ys = [v for s in run["syncs"] for v in s["values"][j]]
            ax.plot(xs, ys, ".", ms=3, color="gray", label="all replicas: new multipliers x base, at syncs")
        ax.set(title=f"group {g}", xlabel="step", ylabel="learning rate")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(groups):]:
        ax.axis("off")
    fig.suptitle(f"per-group learning rates: {run['label']}")
    return _save(fig, path, 120)


def plot_hparams(run: dict[str, Any], path: str | Path) -> Path | None:
    """Values, base and Delta of every explored hyperparameter other than the LR; None if there is none."""
    syncs = [x for x in run["syncs"] if x.get("names")]
    if not syncs:
        return None
    slots = [j for j, n in enumerate(syncs[0]["names"]) if not n.startswith("lr/")]
    if not slots:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(2, len(slots), figsize=(max(7.0, 4.2 * len(slots)), 6), squeeze=False, sharex=True)
    steps = [x["step"] for x in syncs]
    for col, j in enumerate(slots):
        ax, ax_d = axes[0][col], axes[1][col]
        n = len(syncs[0]["values"][j])
        for r in range(n):
            ax.plot(steps, [x["values"][j][r] for x in syncs], ".", ms=4, alpha=0.7, label=f"replica {r}")
        ax.plot(steps, [x["bases"][j] for x in syncs], "k-", lw=1.2, label="base")
        ax.set(title=syncs[0]["names"][j], ylabel="value")
        recs = [(x["step"], x["controller"][j]) for x in syncs if x.get("controller")]
        fit = bool(recs) and recs[0][1].get("kind") == "fit"
        ctrl = [(t, c["x_star"] if fit else c["delta"]) for t, c in recs]
        if ctrl:
            ax_d.axhline(0, color="gray", lw=0.8)
            ax_d.plot(*zip(*ctrl), "o-", ms=3)
        else:
            ax_d.text(0.5, 0.5, "no controller ran\n(enable auto-LR to steer it)", ha="center", va="center",
                      transform=ax_d.transAxes, color="gray")
        ax_d.set(xlabel="step", ylabel="fitted optimum x* (offset)" if fit else "Delta = h~ - h_bar")
        for a in (ax, ax_d):
            a.grid(alpha=0.3)
        if col == 0:
            ax.legend(fontsize=7)
    fig.suptitle(f"explored hyperparameters: {run['label']}\n(Delta of log-spread values in log units)", fontsize=10)
    return _save(fig, path, 110)


def _run_folder(run_dir: str | Path) -> Path:
    d = Path(run_dir)
    if not d.exists():
        raise FileNotFoundError(f"Expected a run folder, but {d} does not exist")
    if not d.is_dir():
        raise FileNotFoundError(f"Expected a run folder, but {d} is a file")
    return d


def _out_folder(out: str | Path) -> Path:
    d = Path(out)
    if d.exists() and not d.is_dir():
        raise FileExistsError(f"Expected --out to be a folder, but {d} is a file")
    d.mkdir(parents=True, exist_ok=True)
    return d


def plot_runs(run_dirs: list[str | Path], out: str | Path) -> list[Path]:
    """Several runs into one folder: their losses overlaid in ``loss.png``, and each run's own ``lr-<name>.png``
    (and ``hparams-<name>.png``), so no run's plots overwrite another's."""
    runs = [load_run(_run_folder(d)) for d in run_dirs]
    names = [r["dir"].name for r in runs]
    if len(set(names)) < len(names):  # folders of the same name from different places
        names = [f"{k}-{n}" for k, n in enumerate(names)]
    for run in runs:
        _check_lrs(run)
    out_dir = _out_folder(out)
    paths = [plot_losses(runs, out_dir / "loss.png")]
    for run, name in zip(runs, names):
        paths.append(plot_lrs(run, out_dir / f"lr-{name}.png"))
        hp = plot_hparams(run, out_dir / f"hparams-{name}.png")
        paths += [hp] if hp else []
    return paths


def plot_dir(run_dir: str | Path, out: str | Path | None = None) -> list[Path]:
    """Plots for a run folder, or for a comparison folder (one with ``compare.json``)."""
    d = _run_folder(run_dir)
    out_dir = _out_folder(out) if out is not None else d
    if (d / "compare.json").exists():
        comp = json.loads((d / "compare.json").read_text())
        runs = [load_run(d / r["folder"]) for r in comp["runs"]]
        for run, r in zip(runs, comp["runs"]):
            run["label"] = r["config"]
        logged = [r for r in runs if r["metrics"]]  # (a row that crashed before its first log has none)
        lr_run = next((r for r in logged if r["label"] == "HDET (full)"), logged[-1] if logged else runs[-1])
        _check_lrs(lr_run)
        return [plot_losses(runs, out_dir / "loss.png", comp.get("title", "")),
                plot_lrs(lr_run, out_dir / "lr.png")]
    run = load_run(d)
    _check_lrs(run)
    hp = plot_hparams(run, out_dir / "hparams.png")
    return [plot_losses([run], out_dir / "loss.png"), plot_lrs(run, out_dir / "lr.png"), *([hp] if hp else [])]
