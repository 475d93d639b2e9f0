"""`hdet train --lr-sweep` on the evidence suite's tasks and sizes, from 0.1x, 1x and 10x the grid's best LR
(issue 15): the CLI's own form of `benchmarks/sweep_then_train.py` (the sweep judged by the training loss's tail,
`hdet train`'s defaults after it: T 25, `--on-runaway recover`, and alpha 0 since 2026-12-01; the runs committed
before ran at alpha 0.2, then the default: `--extra "--alpha 0.2"` repeats them). Every run is one `hdet train`
process (TF32 on, as the suite), all at once; writes JSON with each run's sweep, peak LR, spread and final metric.

    python benchmarks/lr_sweep_cli.py --seeds 9,10,11 --out lr_sweep_cli.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

SIZES = {  # benchmarks/evidence.py's, and the grid's best max_lr the starts multiply
    "bytes": dict(args=["--width", "256", "--layers", "4", "--ctx", "128", "--batch", "16"], best=4e-3),
    "fashion": dict(args=["--batch", "32", "--width", "128"], best=1.6e-2),
}
LAUNCH = ("import sys, torch; torch.backends.cuda.matmul.allow_tf32 = True; torch.backends.cudnn.allow_tf32 = True; "
          "from hdet.app.cli import main; sys.exit(main(sys.argv[1:]))")


def train_command(task: str, seed: object, steps: str, device: str, data: str, extra: list[str], out: Path,
                  replicas: int = 8) -> list[str]:
    """One `hdet train` process of the evidence suite's task and size (N = 8, TF32 on): its command line. With
    another N, the examples per replica are scaled so that the ensemble's batch is the suite's (N = 8's), and so the
    grid's best max_lr still applies."""
    args = list(SIZES[task]["args"])
    i = args.index("--batch") + 1
    if (int(args[i]) * 8) % replicas:
        raise SystemExit(f"--replicas {replicas}: the suite's ensemble batch ({int(args[i]) * 8}) is not a multiple")
    args[i] = str(int(args[i]) * 8 // replicas)
    cmd = [sys.executable, "-c", LAUNCH, "train", "--task", task, *args, "--replicas", str(replicas),
           "--steps", steps, "--weight-decay", "0.01", "--seed", str(seed), "--device", device, *extra,
           "--checkpoint-every", "0", "--eval-every", "150", "--no-progress", "--out", str(out)]
    return cmd + (["--data", data] if task == "fashion" else [])


def final_metric(task: str, summary: dict) -> float | None:
    """A run's final metric from its summary.json: Fashion-MNIST's test accuracy, the GPT's full validation loss."""
    m = summary.get("final_metrics") or {}
    return m.get("test_accuracy") if task == "fashion" else m.get("val_loss_full")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default="bytes,fashion")
    p.add_argument("--starts", default="0.1,1,10")
    p.add_argument("--seeds", default="9,10,11")
    p.add_argument("--sweep", type=float, default=0.2, help="--lr-sweep (0: only the --tuned runs)")
    p.add_argument("--then", choices=("restart", "continue"), default="restart",
                   help="--lr-sweep-then (call 6, seeds 9-11, ran before it existed: continue)")
    p.add_argument("--tuned", default="", help="comma-separated tasks that also run, at each seed, without a sweep at "
                                               "the grid's best max_lr: plain (--alpha 0 --on-runaway ignore) and "
                                               "hdet train's defaults (the seeds' own references)")
    p.add_argument("--tuned-at", default="1", help="the --tuned runs' max_lr, comma-separated multiples of the grid's "
                                                   "best")
    p.add_argument("--tuned-kinds", default="plain,hdet", help="which --tuned runs: plain and/or hdet")
    p.add_argument("--replicas", type=int, default=8, help="N; the examples per replica scaled so the ensemble's batch "
                                                          "stays N = 8's")
    p.add_argument("--sweep-factors", default="", help="comma-separated --lr-sweep-factor values, each a run a seed "
                                                      "(default: none given, the CLI's)")
    p.add_argument("--sweep-points", default="", help="--lr-sweep-points (default: none given, the CLI's N)")
    p.add_argument("--extra", default="", help="more `hdet train` flags for the sweep rows, one string (e.g. "
                                               "'--alpha 0': the run after the sweep without the spread)")
    p.add_argument("--data", default="data/fashion")
    p.add_argument("--device", default="cuda")
    p.add_argument("--runs", default="runs/lr_sweep_cli")
    p.add_argument("--steps", default="1500")
    p.add_argument("--deadline", type=float, default=540.0, help="seconds: runs still going then are stopped")
    p.add_argument("--collect", action="store_true", help="launch nothing: gather the runs the same options left in "
                                                           "--runs (whose launcher was stopped before they ended)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    procs = {}
    factors = [f for f in a.sweep_factors.split(",") if f] or [None]
    rows = [(task, st, sd, "sweep" if f is None else f"sweep-f{f}",
             ["--max-lr", repr(SIZES[task]["best"] * float(st)), "--lr-sweep", str(a.sweep), "--lr-sweep-then", a.then]
             + ([] if f is None else ["--lr-sweep-factor", f])
             + (["--lr-sweep-points", a.sweep_points] if a.sweep_points else []) + a.extra.split())
            for task in a.tasks.split(",") for st in a.starts.split(",") for sd in a.seeds.split(",") for f in factors
            if a.sweep > 0]
    for task in filter(None, a.tuned.split(",")):
        kinds = {"plain": ["--alpha", "0", "--on-runaway", "ignore"], "hdet": []}
        rows += [(task, at, sd, kind, ["--max-lr", repr(SIZES[task]["best"] * float(at))] + kinds[kind])
                 for at in a.tuned_at.split(",") for sd in a.seeds.split(",") for kind in a.tuned_kinds.split(",")]
    for task, st, sd, kind, extra in rows:
        name = f"{task}-x{st}-s{sd}" + ("" if kind == "sweep" else f"-{kind}")
        out = Path(a.runs) / name
        cmd = train_command(task, sd, a.steps, a.device, a.data, extra, out, a.replicas)
        if a.collect:
            procs[name] = (task, float(st), int(sd), kind, out, None)
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        log = (out.parent / f"{name}.log").open("w")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}  # (every run at once: 9 processes of 2 threads on 2 cores ran
        # the sweeps about 10x slower than one thread each)
        procs[name] = (task, float(st), int(sd), kind, out, subprocess.Popen(cmd, stdout=log, env=env,
                                                                             stderr=subprocess.STDOUT, text=True))
    t0 = time.time()
    while any(pr is not None and pr.poll() is None for *_, pr in procs.values()) and time.time() - t0 < a.deadline:
        time.sleep(2)
    runs = []
    for name, (task, st, sd, kind, out, proc) in procs.items():
        if proc is not None and proc.poll() is None:
            proc.kill()
        if proc is not None:
            proc.wait()
        log_file = out.parent / f"{name}.log"
        log = log_file.read_text() if log_file.is_file() else ""
        row = {"name": name, "task": task, "kind": kind, "start": st, "seed": sd,
               "rc": proc.returncode if proc is not None else None, "finished": (out / "summary.json").is_file(),
               "log_tail": log[-1500:]}
        if (out / "summary.json").is_file():
            s = json.loads((out / "summary.json").read_text())
            then = (s.get("lr_sweep") or {}).get("then", "continue")  # (before --lr-sweep-then: continue)
            swept = kind.startswith("sweep")
            if a.collect and swept != bool(s.get("lr_sweep")) or swept and then != a.then:
                raise SystemExit(f"{out} holds another run than these options describe (--then {a.then})")
            row.update(metric=final_metric(task, s),
                       crashed=s.get("crashed"), lr_sweep=s.get("lr_sweep"), alpha=s["config"].get("alpha"),
                       max_lr_x_best=(s["lr_sweep"]["max_lr"] if swept else s["config"]["max_lr"])
                       / SIZES[task]["best"])
        runs.append(row)
    summary = {}
    for task in dict.fromkeys(r["task"] for r in runs):  # (--tasks' and --tuned's, in order)
        for kind, st in sorted({(r["kind"], r["start"]) for r in runs if r["task"] == task}):
            mine = [r for r in runs if r["task"] == task and r["kind"] == kind and r["start"] == st]
            ms = [r["metric"] for r in mine if r.get("metric") is not None]
            summary[f"{task} x{st}" + ("" if kind == "sweep" else f" {kind}")] = {
                "mean": statistics.mean(ms) if ms else None, "sd": statistics.stdev(ms) if len(ms) > 1 else None,
                "n": len(ms), "max_lr_x_best": sorted(round(r["max_lr_x_best"], 3) for r in mine if "max_lr_x_best" in r),
                # the runs the mean leaves out, said (a crashed run has no metric; one the deadline stopped, no summary)
                "crashed": sum(1 for r in mine if r.get("crashed")),
                "unfinished": sum(1 for r in mine if not r["finished"])}
    import torch

    rec = {"command": "python " + " ".join(sys.argv), "python": platform.python_version(), "torch": torch.__version__,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "seconds": None if a.collect else time.time() - t0, "collected": a.collect, "summary": summary,
           "runs": runs}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rec, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
