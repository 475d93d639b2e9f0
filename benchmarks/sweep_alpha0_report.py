"""The recipe's run after an LR sweep with and without HDET's spread, seed for seed (issue 15, session 33).

`hdet train --lr-sweep 0.2` (1500 steps after a 300-step sweep) from 0.1x, 1x and 10x the grid's best, run after the
sweep at ``--alpha 0`` (``results/evidence/sweep_alpha0/``, ``benchmarks/gpu_sweep_alpha0.sh``) against the committed
alpha-0.2 runs of the same seeds (``results/evidence/sweep_then_train/``: calls 17-19, the runs the stability guard
acted in replaced by calls 22-23's, as that folder's headline does). Per task and start: each arm's mean, its distance
from the grid's best (GPT 1.2127 validation loss, Fashion-MNIST 92.22%), the paired difference and its standard
error, and the runs in which the stability guard acted; then the same for the GPT at one run's compute
(``--steps 1250``, ``results/evidence/sweep_budget/``) and for Fashion-MNIST there (this folder's calls 5 and 6, session
34). Fashion-MNIST's alpha-0.2 runs at seeds 15-17 (1500 steps) are this folder's call 5, beside their alpha-0 runs.

    python benchmarks/sweep_alpha0_report.py --out benchmarks/results/evidence/sweep_alpha0/report.json
"""

from __future__ import annotations

import argparse
import json
import statistics as st
import sys
from collections.abc import Callable
from pathlib import Path

R = Path(__file__).resolve().parent / "results" / "evidence"
BEST = {"bytes": 1.2127, "fashion": 92.22}
ALPHA02 = {"bytes": ["call17/lr_sweep_cli_lattice_bytes_x10_s12-27.json", "call18/lr_sweep_cli_lattice_bytes_x0.1_s12-27.json",
                     "call18/lr_sweep_cli_lattice_bytes_x1_s12-17.json", "call19/lr_sweep_cli_lattice_bytes_x1_s18-27.json"],
           "fashion": ["call17/lr_sweep_cli_lattice_fashion_s12-14.json", "call19/lr_sweep_cli_lattice_fashion_x1_s12-14.json"]}
REPLACED = {"bytes": ("call22/guard_cut2_bytes.json", "recover:0.7"), "fashion": ("call23/guard_cut3_fashion.json", "recover")}


def acted(log_tail: str) -> bool:
    return "went back" in log_tail or "reset" in log_tail


def alpha02(task: str) -> dict[tuple[float, int], tuple[float, bool]]:
    out = {}
    for f in ALPHA02[task]:
        for r in json.loads((R / "sweep_then_train" / f).read_text())["runs"]:
            if r.get("kind") == "sweep" and r.get("metric") is not None:
                out[(r["start"], r["seed"])] = (r["metric"], acted(r["log_tail"]))
    f, guard = REPLACED[task]
    for r in json.loads((R / "sweep_then_train" / f).read_text())["runs"]:
        if r["guard"] == guard and (r["start"], r["seed"]) in out:
            out[(r["start"], r["seed"])] = (r["metric"], True)
    for f in sorted((R / "sweep_alpha0").glob(f"call*/lr_sweep_cli_alpha0.2_{task}_*.json")):  # both arms in one call
        for r in json.loads(f.read_text())["runs"]:  # (Fashion-MNIST seeds 15-17, call 5)
            if r.get("metric") is not None:
                out[(r["start"], r["seed"])] = (r["metric"], acted(r["log_tail"]))
    return out


def alpha0(task: str) -> dict[tuple[float, int], tuple[float, bool]]:
    out = {}
    for f in sorted((R / "sweep_alpha0").glob(f"call*/lr_sweep_cli_alpha0_{task}_*.json")):
        for r in json.loads(f.read_text())["runs"]:
            if r.get("metric") is not None:
                out[(r["start"], r["seed"])] = (r["metric"], acted(r["log_tail"]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    rec: dict = {"command": "python " + " ".join(sys.argv), "grid_best": BEST, "cells": [], "all": {}}
    for task in ("bytes", "fashion"):
        new, old = alpha0(task), alpha02(task)
        diffs = []
        for start in (0.1, 1.0, 10.0):
            seeds = sorted(s for (st_, s) in new if st_ == start and (st_, s) in old)  # (paired: both arms' seeds)
            x = [new[(start, s)][0] for s in seeds]
            y = [old[(start, s)][0] for s in seeds]
            d = [u - v for u, v in zip(x, y)]
            diffs += d
            rel = (lambda m: 100 * (m / BEST[task] - 1)) if task == "bytes" else (lambda m: m - BEST[task])
            cell = {"task": task, "start": start, "seeds": seeds, "alpha0_mean": st.mean(x), "alpha0.2_mean": st.mean(y),
                    "alpha0_vs_best": rel(st.mean(x)), "alpha0.2_vs_best": rel(st.mean(y)),
                    "paired_difference": st.mean(d), "paired_se": st.stdev(d) / len(d) ** 0.5,
                    "guard_acted": {"alpha0": sum(new[(start, s)][1] for s in seeds),
                                    "alpha0.2": sum(old[(start, s)][1] for s in seeds)}}
            rec["cells"].append(cell)
            unit = "%" if task == "bytes" else " pt"
            print(f"{task} {start:g}x ({len(seeds)} seeds): alpha 0 {cell['alpha0_mean']:.4f} ({cell['alpha0_vs_best']:+.2f}{unit}), "
                  f"alpha 0.2 {cell['alpha0.2_mean']:.4f} ({cell['alpha0.2_vs_best']:+.2f}{unit}); paired "
                  f"{cell['paired_difference']:+.4f} (se {cell['paired_se']:.4f}); guard acted {cell['guard_acted']}")
        for start in (0.1, 1.0, 10.0):  # alpha 0 at every seed run, paired or not (GPT 28-43: calls 7-9, session 48)
            seeds = sorted(s for (st_, s) in new if st_ == start)
            x = [new[(start, s)][0] for s in seeds]
            cell = {"task": task, "start": start, "seeds": seeds, "mean": st.mean(x),
                    "vs_best": rel(st.mean(x)), "se": (st.stdev(x) / len(x) ** 0.5) * (100 / BEST[task]
                                                                                      if task == "bytes" else 1),
                    "guard_acted": sum(new[(start, s)][1] for s in seeds)}
            rec.setdefault("alpha0_every_seed", []).append(cell)
            print(f"{task} {start:g}x, alpha 0 at all {len(seeds)} seeds: {cell['mean']:.4f} ({cell['vs_best']:+.2f}"
                  f"{unit}, se {cell['se']:.2f}); guard acted {cell['guard_acted']}")
        rec["all"][task] = {"runs": len(diffs), "paired_difference": st.mean(diffs),
                            "paired_se": st.stdev(diffs) / len(diffs) ** 0.5}
        print(f"{task}, all {len(diffs)}: alpha 0 minus alpha 0.2 {st.mean(diffs):+.4f} (se {rec['all'][task]['paired_se']:.4f})")
    rec["one_run_compute"] = one_run_compute()
    rec["one_run_compute_fashion"] = one_run_compute_fashion()
    Path(a.out).write_text(json.dumps(rec, indent=1))


def one_run_compute() -> dict:
    """The GPT at one run's compute (``--steps 1250``, ``../sweep_budget/``): alpha 0.2 in its calls 1 and 3, alpha 0
    in its call 7 (seeds 12-16) and this folder's call 4 (seeds 17-21)."""
    def read(files: list[Path]) -> dict[tuple[float, int], float]:
        return {(r["start"], r["seed"]): r["metric"] for f in files for r in json.loads(f.read_text())["runs"]
                if r.get("metric") is not None}
    b = R / "sweep_budget"
    old = read([*b.glob("call1/*.json"), *b.glob("call3/*.json")])
    new = read([*b.glob("call7/*.json"), *(R / "sweep_alpha0").glob("call4/sweep_budget_alpha0_bytes_*.json")])
    out: dict = {}
    every = [new[k] - old[k] for k in new if k in old]
    out["all"] = {"runs": len(every), "paired_difference": st.mean(every),
                  "paired_se": st.stdev(every) / len(every) ** 0.5}
    print(f"one run's compute, bytes, all {len(every)}: alpha 0 minus alpha 0.2 {st.mean(every):+.4f} "
          f"(se {out['all']['paired_se']:.4f})")
    for start in (0.1, 1.0, 10.0):
        c = out[str(start)] = _paired(new, old, start, lambda m: 100 * (m / BEST["bytes"] - 1))
        seeds = c["seeds"]
        print(f"one run's compute, bytes {start:g}x ({len(seeds)} seeds): alpha 0 {c['alpha0_mean']:.4f} "
              f"({c['alpha0_vs_best']:+.2f}%), alpha 0.2 {c['alpha0.2_mean']:.4f} ({c['alpha0.2_vs_best']:+.2f}%); "
              f"paired {c['paired_difference']:+.4f} (se {c['paired_se']:.4f})")
    return out


def _paired(new: dict[tuple[float, int], float], old: dict[tuple[float, int], float], start: float,
            rel: Callable[[float], float]) -> dict:
    """One start's cell at one run's compute: the seeds both arms ran, each arm's mean and its distance from the grid's
    best (``rel``), and the paired difference with its standard error."""
    seeds = sorted(s for (st_, s) in new if st_ == start and (st_, s) in old)
    x, y = [new[(start, s)] for s in seeds], [old[(start, s)] for s in seeds]
    d = [u - v for u, v in zip(x, y)]
    return {"seeds": seeds, "alpha0_mean": st.mean(x), "alpha0.2_mean": st.mean(y),
            "alpha0_vs_best": rel(st.mean(x)), "alpha0.2_vs_best": rel(st.mean(y)),
            "paired_difference": st.mean(d), "paired_se": st.stdev(d) / len(d) ** 0.5}


def one_run_compute_fashion() -> dict:
    """Fashion-MNIST at one run's compute (``--steps 1250``), both arms side by side at seeds 12-17 in call 6 (call 5's
    alpha-0 arm at the same seeds is reported from its log's summary: its JSON did not come back)."""
    def read(arm: str) -> dict[tuple[float, int], float]:
        f = R / "sweep_alpha0" / "call6" / f"sweep_budget_alpha{arm}_fashion_s12-17.json"
        return {(r["start"], r["seed"]): r["metric"] for r in json.loads(f.read_text())["runs"]
                if r.get("metric") is not None}
    new, old = read("0"), read("0.2")
    every = [new[k] - old[k] for k in new if k in old]
    out: dict = {"all": {"runs": len(every), "paired_difference": st.mean(every),
                         "paired_se": st.stdev(every) / len(every) ** 0.5}}
    call5 = json.loads((R / "sweep_alpha0" / "call5" / "budget_alpha0.log").read_text())
    print(f"one run's compute, fashion, all {len(every)}: alpha 0 minus alpha 0.2 {st.mean(every):+.3f} "
          f"(se {out['all']['paired_se']:.3f})")
    for start in (0.1, 1.0, 10.0):
        again = call5[f"fashion x{start}"]["mean"]
        c = out[str(start)] = {**_paired(new, old, start, lambda m: m - BEST["fashion"]),
                               "alpha0_mean_call5": again, "alpha0_vs_best_call5": again - BEST["fashion"]}
        seeds = c["seeds"]
        print(f"one run's compute, fashion {start:g}x ({len(seeds)} seeds): alpha 0 {c['alpha0_mean']:.2f} "
              f"({c['alpha0_vs_best']:+.2f} pt; call 5, the same seeds: {again:.2f}), alpha 0.2 {c['alpha0.2_mean']:.2f} "
              f"({c['alpha0.2_vs_best']:+.2f} pt); paired {c['paired_difference']:+.3f} (se {c['paired_se']:.3f})")
    return out


if __name__ == "__main__":
    main()
