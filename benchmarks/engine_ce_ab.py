"""The engine with and without ``hdet.cross_entropy``'s routing, side by side in one process (2 CPU cores, or a GPU).

Two engines of the same MLP (N = 8, AdamW, OneCycleAutoLR at alpha 0.2, T 25), one stepping with the routing of
``F.cross_entropy`` and one with the function torch's vmap runs (the routing replaced by a no-op), timed in
``--rounds`` interleaved rounds; medians reported. ``--size tiny`` (a 16-wide MLP, 4 rows a replica: bound by the
host's per-operation work, as the engine's tiny and small models are on a GPU) or ``mlp`` (784-256-256-10, 32 rows).
Writes JSON with the command, machine and versions.

    python benchmarks/engine_ce_ab.py --out benchmarks/results/cpu/ce_routing.json
"""

from __future__ import annotations

import argparse
import contextlib
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
import hdet.cross_entropy as ce
from hdet.engine import ReplicaEngine

SIZES = {"tiny": (4, 16, 16), "mlp": (32, 784, 256)}  # rows a replica, input width, hidden width


def bench(size: str, mode: str, rounds: int, device: torch.device) -> dict:
    n, (rows, d, h) = 8, SIZES[size]

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 10)).to(device)

    def engine() -> ReplicaEngine:
        return ReplicaEngine(model(), n, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
                             lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=1e-3, total_steps=100_000,
                                                                   ensemble_lr_spread_ratio=0.2, model_sync_interval=25,
                                                                   replicas=rep, model=m), mode=mode)
    x, y = torch.randn(n, rows, d, device=device), torch.randint(0, 10, (n, rows), device=device)
    engines = {"routed": engine(), "torch": engine()}
    real = ce.routed

    def step(name: str) -> None:
        ce.routed = real if name == "routed" else contextlib.nullcontext
        try:
            engines[name].step((x, y), lambda m, b: F.cross_entropy(m(b[0]), b[1]), stacked=True)
        finally:
            ce.routed = real

    def timed(name: str, steps: int) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            step(name)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / steps
    steps = 200 if size == "tiny" else 40
    for name in engines:
        timed(name, 20)
    times: dict[str, list[float]] = {k: [] for k in engines}
    for _ in range(rounds):
        for name in engines:
            times[name].append(timed(name, steps))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"size": size, "mode": engines["routed"].mode, "seconds_per_step_median": med, "seconds_per_step_all": times,
            "routed_speedup": med["torch"] / med["routed"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="tiny,mlp")
    p.add_argument("--modes", default="merged,vmap")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    dev = torch.device(a.device)
    runs = [bench(s, m, a.rounds, dev) for s in a.sizes.split(",") for m in a.modes.split(",")]
    for r in runs:
        print(f"{r['size']} {r['mode']}: routed {r['seconds_per_step_median']['routed'] * 1e6:.0f} us, torch's "
              f"{r['seconds_per_step_median']['torch'] * 1e6:.0f} us, {r['routed_speedup']:.3f}x")
    rec = {"command": "python " + " ".join(sys.argv), "python": platform.python_version(), "torch": torch.__version__,
           "hdet": hdet.__version__, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else
           f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} threads)", "runs": runs}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
