"""The runs of `benchmarks/lr_sweep_cli.py` JSONs in which hdet train's stability guard acted (a rising ensemble sent
every replica back with the LR cut, or a runaway replica was reset with the LR cut), run again without the sweep at
the peak LR their sweep found (the same run: `--lr-sweep-then restart` trains as the run without a sweep at that
--max-lr), with the guard (`--on-runaway recover`, the default: does it repeat?) and without it (`ignore`: would the
run have come back by itself, or broken?). Issue 15: what the guard's events cost the sweep's recipe.

    python benchmarks/guard_events.py --task bytes --from A.json B.json --out guard_events.json

--guards takes variants of the guard, comma-separated: ignore, recover, recover:F (--lr-cut F) or recover:F:K (and
--lr-cut-after K; since `hdet train`'s default is --lr-cut-after 1, plain recover and recover:F mean K = 1 too: the
rule before is recover:0.7:0); old:V runs variant V with the hdet of --old-src instead (an earlier commit's src/, to
compare rules side by side). --names picks the sources' runs by name instead (comma-separated, e.g. bytes-x1-s31: runs
whose logs were not kept). Each row keeps the run's trajectory: every sync's median window loss, LR scale and go-back,
and the logged training losses. With --fixed-lr X --seeds S the runs are instead every seed of S at --max-lr X (the
same task and size, no sweep): a stress test of the guard at one LR. --alpha: the spread of the --fixed-lr runs and of
source runs that do not say theirs (hdet train's default otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lr_sweep_cli import final_metric, train_command  # noqa: E402  (same folder)

EVENTS = ("rose more than", "ran away")  # hdet.stability's warnings


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="bytes")
    p.add_argument("--from", dest="sources", nargs="+", default=[])
    p.add_argument("--fixed-lr", type=float, default=None)
    p.add_argument("--seeds", default="")
    p.add_argument("--old-src", default=None, help="the src/ folder of the hdet that old:V variants run")
    p.add_argument("--guards", default="recover,ignore")
    p.add_argument("--alpha", type=float, default=None, help="--alpha of the --fixed-lr runs and of source runs that "
                                                             "do not say theirs (default: hdet train's)")
    p.add_argument("--names", default="", help="comma-separated run names of the sources (instead of their events)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--data", default="data/fashion")
    p.add_argument("--steps", default="1500", help="the runs' --steps (the run after the sweep: 1250 for the recipe at "
                                                  "one run's compute, `lr_sweep_cli.py --steps 1250`)")
    p.add_argument("--runs", default="runs/guard_events")
    p.add_argument("--deadline", type=float, default=480.0)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    picked = [(src, r) for src in a.sources for r in json.loads(Path(src).read_text())["runs"]
              if r["task"] == a.task and r.get("lr_sweep")
              and (r["name"] in a.names.split(",") if a.names else any(e in r["log_tail"] for e in EVENTS))]
    if a.fixed_lr is not None:  # the stress test: no source, every seed at one LR
        picked += [(None, {"name": f"{a.task}-lr{a.fixed_lr:g}-s{seed}", "seed": int(seed), "start": None,
                           "metric": None, "lr_sweep": {"max_lr": a.fixed_lr}}) for seed in a.seeds.split(",") if seed]
    def alpha_of(r: dict) -> float | None:
        return r["alpha"] if r.get("alpha") is not None else a.alpha

    procs = {}
    for src, r in picked:
        for guard in a.guards.split(","):
            name = f"{r['name']}-{guard.replace('old:', 'old-').replace(':', '', 1).replace(':', '-after')}"
            out = Path(a.runs) / name
            out.parent.mkdir(parents=True, exist_ok=True)
            old = guard.startswith("old:")
            on, cut, after = (guard.removeprefix("old:").split(":") + ["", ""])[:3]
            alpha = alpha_of(r)
            if alpha is None and src is not None:
                print(f"{r['name']}: its source does not say its --alpha, and no --alpha was given: rerun at hdet "
                      "train's default without a sweep (0.2), which is not its run if it ran at alpha 0 after its "
                      "sweep (hdet train's default there since 2026-12-01)", file=sys.stderr)
            cmd = train_command(a.task, r["seed"], a.steps, a.device, a.data,
                                ["--max-lr", repr(r["lr_sweep"]["max_lr"]), "--on-runaway", on]
                                + (["--alpha", repr(alpha)] if alpha is not None else [])  # (the source run's
                                # spread, alpha 0 after a sweep: a run without a sweep defaults to 0.2)
                                + (["--lr-cut", cut] if cut else [])
                                + (["--lr-cut-after", after] if after else []), out)
            log = (out.parent / f"{name}.log").open("w")
            procs[name] = (src, r, guard, out, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True,
                                                                env={**os.environ, "OMP_NUM_THREADS": "1",
                                                                     **({"PYTHONPATH": a.old_src} if old else {})}))
    t0 = time.time()
    while any(pr.poll() is None for *_, pr in procs.values()) and time.time() - t0 < a.deadline:
        time.sleep(2)
    rows = []
    for name, (src, r, guard, out, proc) in procs.items():
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        log = (out.parent / f"{name}.log").read_text()
        s = json.loads((out / "summary.json").read_text()) if (out / "summary.json").is_file() else {}
        rows.append({"name": name, "source": src, "seed": r["seed"], "start": r["start"], "guard": guard,
                     "alpha": alpha_of(r),
                     "max_lr": r["lr_sweep"]["max_lr"], "swept_metric": r["metric"],
                     "metric": final_metric(a.task, s),
                     "events": sum(log.count(e) for e in EVENTS),
                     "lr_scales": re.findall(r"(?:cut to|it stays at) ([0-9.e-]+) of its value", log),  # after
                     # each event (one of the first --lr-cut-after: "it stays at")
                     "rc": proc.returncode, "log_tail": log[-1200:], **_trajectory(out)})
    import torch

    rec = {"command": "python " + " ".join(sys.argv), "python": platform.python_version(), "torch": torch.__version__,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "seconds": time.time() - t0, "runs": rows,
           "old_src_commit": _commit(a.old_src)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rec, indent=1))
    for row in rows:
        print(row["name"], row["swept_metric"], row["metric"], row["events"])


def _trajectory(out: Path) -> dict:
    """The run's syncs ([step, median window loss, lr_scale, went_back_to]) and logged training losses ([step,
    loss]), from its syncs.jsonl and metrics.jsonl (what there is of them)."""
    import statistics

    def records(name: str) -> list[dict]:
        f = out / name
        return [json.loads(x) for x in f.read_text().splitlines() if x.strip()] if f.is_file() else []

    def median(xs: list) -> float | None:  # (a non-finite window loss is null in syncs.jsonl)
        finite = [x for x in xs if x is not None]
        return statistics.median(finite) if finite else None
    syncs = [[d["step"], median(d["losses"]), d["lr_scale"], d["went_back_to"]] for d in records("syncs.jsonl")]
    return {"syncs": syncs, "train_loss": [[d["step"], d["train_loss"]] for d in records("metrics.jsonl")
                                           if "train_loss" in d]}


def _commit(src: str | None) -> str | None:
    """The commit that --old-src was made from: the COMMIT file beside it (``git rev-parse C > scratch_wt/COMMIT``),
    where there is one."""
    f = Path(src).parent / "COMMIT" if src else None
    return f.read_text().strip() if f is not None and f.is_file() else None


if __name__ == "__main__":
    main()
