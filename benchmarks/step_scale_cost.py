"""What HDET over D-Adaptation (or Prodigy) costs in the engine (issue 15 item 4, issue 19): N = 8 replicas of an
MLP in ``ReplicaEngine(mode="vmap")`` with D-Adaptation Adam (``--optimizer prodigy``: Prodigy, whose estimate
is also shared at every step): each replica's own optimizer step at alpha 0 (no
scaling: the step-scale hooks copy nothing) and at alpha 0.2 (``hdet.step_scale``: the update scaled by each
replica's multiplier), and the engine's stacked D-Adaptation step at alpha 0.2 (``hdet.stacked_optim``: one
copy of the state, one host read a step), measured side by side in one process, interleaved, median of
``--repeats``. No converge step falls in the timed steps. Writes JSON with the command, machine and versions.

    python benchmarks/step_scale_cost.py --out benchmarks/results/cpu/step_scale_cost.json
    python benchmarks/step_scale_cost.py --optimizer prodigy --out benchmarks/results/cpu/step_scale_cost_prodigy.json
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
import torch.nn.functional as F
from torch import nn

import hdet
from hdet.engine import ReplicaEngine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--optimizer", choices=["dadapt", "prodigy"], default="dadapt")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    import dadaptation  # pip install 'hdet[bench]'
    import prodigyopt

    make = (lambda m: dadaptation.DAdaptAdam(m.parameters(), lr=1.0, decouple=True)) if a.optimizer == "dadapt" \
        else (lambda m: prodigyopt.Prodigy(m.parameters(), lr=1.0, decouple=True))

    dev, N, W = torch.device(a.device), a.replicas, a.width
    total = 10_000

    def engine(alpha: float, stacked: bool) -> ReplicaEngine:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(784, W), nn.ReLU(), nn.Linear(W, W), nn.ReLU(), nn.Linear(W, 10)).to(dev)
        return ReplicaEngine(model, N, make,
                             lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=1.0, total_steps=total,
                                                                   ensemble_lr_spread_ratio=alpha,
                                                                   model_sync_interval=total, replicas=rep, model=m),
                             mode="vmap", stacked_optimizer=stacked)

    x, y = torch.randn(N, a.batch, 784, device=dev), torch.randint(0, 10, (N, a.batch), device=dev)
    engines = {"alpha 0 (no scaling)": engine(0.0, False), "alpha 0.2 (scaled step)": engine(0.2, False),
               "alpha 0.2, stacked step": engine(0.2, True)}
    times: dict[str, list[float]] = {k: [] for k in engines}

    def timed(e: ReplicaEngine, n: int) -> float:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for _ in range(n):
            e.step((x, y), lambda m, b: F.cross_entropy(m(b[0]), b[1]), stacked=True)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return (time.perf_counter() - t0) / n

    for e in engines.values():
        timed(e, 5)  # warm-up
    for _ in range(a.repeats):
        for k, e in engines.items():
            times[k].append(timed(e, a.steps))
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med["alpha 0 (no scaling)"]
    rec = {"command": "python " + " ".join(sys.argv), "python": platform.python_version(), "torch": torch.__version__,
           "optimizer": a.optimizer, "dadaptation": getattr(dadaptation, "__version__", "3.2"),
           "prodigyopt": getattr(prodigyopt, "__version__", "1.1.2"), "hdet": hdet.__version__,
           "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else
           f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} threads)",
           "N": N, "width": W, "batch_per_replica": a.batch,
           "params": sum(q.numel() for q in engines["alpha 0 (no scaling)"].models[0].parameters()),
           "optimizer_path": {k: e.optimizer_path for k, e in engines.items()},
           "seconds_per_step_median": med, "seconds_per_step_all": times,
           "scaled_over_unscaled": med["alpha 0.2 (scaled step)"] / base,
           "stacked_over_per_replica": med["alpha 0.2, stacked step"] / med["alpha 0.2 (scaled step)"]}
    print(json.dumps({k: rec[k] for k in ("device", "seconds_per_step_median", "scaled_over_unscaled",
                                          "stacked_over_per_replica")}))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
