"""Where an engine step's time goes, op by op, without the profiler (issue 19: the engine on CPU).

N = 8 replicas of a 784-256-256-10 MLP in ``ReplicaEngine(mode="vmap", gradient_layout=True)`` (AdamW,
the stacked step, OneCycleAutoLR alpha 0.2), the same as ``benchmarks/engine_mlp.py``. Every ATen op of
``--steps`` steps is timed in a ``TorchDispatchMode`` (wall time around the call; the mode's own Python
overhead is outside the op times but inside ``step_under_mode``), and the plain step is timed alike
without the mode. Each matmul's shapes and strides are listed once. Writes JSON with the command.

    python benchmarks/engine_op_times.py --out benchmarks/results/cpu/engine_op_times.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import hdet
from hdet.engine import ReplicaEngine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--steps", type=int, default=20, help="timed steps (steps 6.. of the run; a sync falls at 25)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    N, B, W = a.replicas, 32, 256

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, W), nn.ReLU(), nn.Linear(W, W), nn.ReLU(), nn.Linear(W, 10))
    x, y = torch.randn(N, B, 784), torch.randint(0, 10, (N, B))
    eng = ReplicaEngine(model, N, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
                        lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=1e-3, total_steps=10_000,
                                                              ensemble_lr_spread_ratio=0.2, model_sync_interval=10_000,
                                                              replicas=rep, model=m),
                        mode="vmap", gradient_layout=True)

    def step() -> None:
        eng.step((x, y), lambda m, b: F.cross_entropy(m(b[0]), b[1]), stacked=True)

    op_seconds: dict[str, float] = collections.defaultdict(float)
    matmuls: dict[str, list[float]] = collections.defaultdict(list)

    class Timed(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            t0 = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            dt = time.perf_counter() - t0
            op_seconds[str(func)] += dt
            if "mm" in str(func):
                key = str(func) + " " + str([(tuple(t.shape), t.stride()) for t in args if isinstance(t, torch.Tensor)])
                matmuls[key].append(dt)
            return out

    for _ in range(5):
        step()
    t0 = time.perf_counter()
    with Timed():
        for _ in range(a.steps):
            step()
    under_mode = (time.perf_counter() - t0) / a.steps
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step()
    plain = (time.perf_counter() - t0) / a.steps
    per_step = {k: v / a.steps for k, v in sorted(op_seconds.items(), key=lambda kv: -kv[1])}
    rec = {"command": "python " + " ".join(sys.argv), "python": platform.python_version(), "torch": torch.__version__,
           "hdet": hdet.__version__, "device": f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} threads)",
           "N": N, "plain_step_seconds": plain, "step_under_mode_seconds": under_mode,
           "op_seconds_per_step": per_step,
           "matmul_seconds_per_call_median": {k: sorted(v)[len(v) // 2] for k, v in matmuls.items()}}
    print(json.dumps({"plain_step_ms": plain * 1e3, "top_ops_ms": {k: v * 1e3 for k, v in list(per_step.items())[:8]}},
                     indent=1))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
