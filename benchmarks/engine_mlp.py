"""The one-process engine on a small MLP through the public API, against one model at N x the batch.

N = 8 replicas of a 784-W-W-10 MLP (Fashion-MNIST's shape; random data), B examples each, AdamW +
``hdet.OneCycleAutoLR`` (alpha 0.2, T 25) in ``ReplicaEngine(mode="vmap")``, with the stacked optimizer
step (row-major parameters, the default, and ``gradient_layout=True``) and with each replica's own
``optimizer.step()``; the baseline is one model (AdamW + OneCycleLR) on
N * B examples: the same FLOPs. Ratios are measured side by side, interleaved over ``--repeats`` rounds
(the median is reported). Writes JSON with the command, machine and versions.

    python benchmarks/engine_mlp.py --out benchmarks/results/cpu/engine_mlp.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import hdet
from hdet.engine import ReplicaEngine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_throughput import state_bytes, time_steps  # noqa: E402  (same folder)


def baseline(mlp, x: torch.Tensor, y: torch.Tensor, total: int, compiled: bool = False):  # noqa: ANN001, ANN201
    """One model (AdamW + OneCycleLR over ``total`` steps; its forward through torch.compile if ``compiled``) on the
    N replicas' batches ``x [N, B, 784]`` at once: its step, and its optimizer."""
    base = mlp()
    opt = torch.optim.AdamW(base.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=total)
    xb, yb = x.reshape(-1, x.shape[-1]), y.reshape(-1)
    forward = torch.compile(base) if compiled else base

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(forward(xb), yb).backward()
        opt.step()
        sched.step()
    return step, opt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=32, help="examples per replica")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--compile", action="store_true",
                   help="also the engine with compile=True and the baseline through torch.compile")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    dev, N, B, W = torch.device(a.device), a.replicas, a.batch, a.width
    total = (a.steps + 10) * a.repeats * 3 + 10

    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(784, W), nn.ReLU(), nn.Linear(W, W), nn.ReLU(), nn.Linear(W, 10)).to(dev)

    x, y = torch.randn(N, B, 784, device=dev), torch.randint(0, 10, (N, B), device=dev)
    base_step, opt = baseline(mlp, x, y, total)

    if a.compile:
        base_compiled_step, _ = baseline(mlp, x, y, total, compiled=True)

    def engine(stacked: bool, layout: bool = False, comp: bool = False) -> ReplicaEngine:
        return ReplicaEngine(mlp(), N, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
                             lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=1e-3, total_steps=total,
                                                                   ensemble_lr_spread_ratio=0.2, model_sync_interval=25,
                                                                   replicas=rep, model=m),
                             mode="vmap", stacked_optimizer=stacked, gradient_layout=layout, compile=comp)

    engines = {"stacked": engine(True), "stacked, gradient_layout": engine(True, True), "per-replica": engine(False)}
    if a.compile:
        engines["stacked, compile"] = engine(True, comp=True)
    steps = {k: (lambda e=e: e.step((x, y), lambda m, b: F.cross_entropy(m(b[0]), b[1]), stacked=True))
             for k, e in engines.items()}
    times: dict[str, list[float]] = {"baseline": [], **({"baseline, compiled": []} if a.compile else {}),
                                     **{k: [] for k in engines}}
    for _ in range(a.repeats):
        times["baseline"].append(time_steps(base_step, 10, a.steps, dev))
        if a.compile:
            times["baseline, compiled"].append(time_steps(base_compiled_step, 10, a.steps, dev))
        for k, f in steps.items():
            times[k].append(time_steps(f, 10, a.steps, dev))
    med = {k: statistics.median(v) for k, v in times.items()}
    rec = {"command": "python " + " ".join(sys.argv), "python": platform.python_version(), "torch": torch.__version__,
           "hdet": hdet.__version__, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else
           f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} threads)",
           "N": N, "width": W, "batch_per_replica": B, "params": sum(q.numel() for g in opt.param_groups for q in g["params"]),
           "seconds_per_step_median": med, "seconds_per_step_all": times,
           "ratio_to_baseline": {k: med["baseline"] / med[k] for k in engines},
           **({"ratio_to_baseline_compiled": {k: med["baseline, compiled"] / med[k] for k in engines}}
              if a.compile else {}),
           "optimizer_path": {k: e.optimizer_path for k, e in engines.items()},
           "optimizer_state_bytes": {"baseline": state_bytes([opt]),
                                     **{k: state_bytes(e.optimizers) for k, e in engines.items()}}}
    print(json.dumps({k: rec[k] for k in ("device", "ratio_to_baseline", "optimizer_state_bytes")
                      + (("ratio_to_baseline_compiled",) if a.compile else ())}))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
