"""Host time of the engine's per-step scheduler bookkeeping against N (issue 19: "must not grow with N").

For N = 1, 8 and 32 replicas of a tiny model in ``ReplicaEngine(mode="vmap")`` (OneCycleAutoLR, alpha 0.2,
no sync in the timed steps): what ``engine.step`` does after the optimizer step, alone: every replica's
loss kept, ``begin_step`` and ``end_step`` (the base schedule, once for the N replicas where they follow
replica 0's; the LR per group, the explored values).
Writes JSON with the command, machine and versions.

    python benchmarks/engine_sched_cost.py --out benchmarks/results/cpu/engine_sched_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

import hdet
from hdet.engine import ReplicaEngine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", default="1,8,32")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--repeats", type=int, default=5, help="timed rounds of --steps steps (the median is reported)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    out: dict[str, float] = {}
    total = (a.repeats + 2) * a.steps
    for N in map(int, a.replicas.split(",")):
        torch.manual_seed(0)
        eng = ReplicaEngine(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2)), N,
                            lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
                            lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=1e-3, total_steps=total + 10,
                                                                  ensemble_lr_spread_ratio=0.2,
                                                                  model_sync_interval=total, replicas=rep, model=m),
                            mode="vmap")
        eng.step(torch.randn(N, 4, 8), lambda m, b: m(b).pow(2).mean(), stacked=True)
        losses, scheds = torch.zeros(N), eng.schedulers
        rounds = []
        for _ in range(a.repeats):
            rounds.append(_timed(eng, scheds, losses, a.steps))
        out[str(N)] = statistics.median(rounds)
    rec = {"command": "python " + " ".join(sys.argv), "python": platform.python_version(), "torch": torch.__version__,
           "hdet": hdet.__version__, "device": f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} threads)",
           "seconds_per_step": out, "seconds_per_step_per_replica": {k: v / int(k) for k, v in out.items()}}
    print(json.dumps(rec["seconds_per_step_per_replica"]))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rec, indent=1))


def _timed(eng: ReplicaEngine, scheds: list, losses: torch.Tensor, steps: int) -> float:
    """Seconds a step of the engine's scheduler bookkeeping, over ``steps`` steps."""
    t0 = time.perf_counter()
    for _ in range(steps):
        for s in scheds:  # what optimizer.step() would count (the timed part is the bookkeeping alone)
            if hasattr(s, "_watch"):
                s._watch.opt_steps += 1
            else:  # (hdet before hdet.step_watch: to time an older src/ on PYTHONPATH side by side)
                s._opt_steps += 1
        for s, loss in zip(scheds, losses):
            s.ensemble.window.keep(loss)
        eng._begin_steps()  # (replica 0's base schedule, the others following it)
        eng._end_steps()
    return (time.perf_counter() - t0) / steps


if __name__ == "__main__":
    main()
