"""What one converge step of the one-process engine costs: N replicas of a small GPT trained with T = 1 (a
sync every step) and with T beyond the run (no sync), side by side; the difference per step is one sync
(gathering the N sync vectors, the checks, the average of every weight, the controller's bookkeeping).
Also checks, on the device, that the fused finiteness check sees a NaN and an Inf (``hdet.sync.health``).
Writes JSON with the command, machine and versions.

    python benchmarks/engine_sync_cost.py --out benchmarks/results/cpu/engine_sync_cost.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

import hdet
from hdet.app.tasks import ByteGPT
from hdet.engine import ReplicaEngine
from hdet.sync import health

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_throughput import lm_loss, time_steps  # noqa: E402  (same folder)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--ctx", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    dev, N = torch.device(a.device), a.replicas
    data = torch.randint(0, 256, (N, a.batch, a.ctx + 1), device=dev)
    total = 10 * a.steps * a.repeats + 100

    def engine(T: int) -> ReplicaEngine:
        torch.manual_seed(0)
        return ReplicaEngine(ByteGPT(a.ctx, a.d, a.layers, 4).to(dev), N,
                             lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
                             lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=1e-3, total_steps=total,
                                                                   ensemble_lr_spread_ratio=0.2, model_sync_interval=T,
                                                                   replicas=rep, model=m), mode="vmap")

    engines = {"sync_every_step": engine(1), "no_sync": engine(total)}
    times: dict[str, list[float]] = {k: [] for k in engines}
    for _ in range(a.repeats):
        for k, e in engines.items():
            times[k].append(time_steps(lambda e=e: e.step(data, lm_loss, stacked=True), 5, a.steps, dev))
    med = {k: statistics.median(v) for k, v in times.items()}
    x = torch.ones(1000, device=dev)
    checks = {}
    for name, bad in (("nan", float("nan")), ("inf", float("inf")), ("finite", 1.0)):
        y = x.clone()
        y[7] = bad
        ok, _ = health([x, y], [True, True], dev)
        checks[name] = bool(ok)
    rec = {"command": "python " + " ".join(sys.argv), "python": platform.python_version(), "torch": torch.__version__,
           "hdet": hdet.__version__, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "N": N, "model": {"d": a.d, "layers": a.layers, "ctx": a.ctx, "batch_per_replica": a.batch},
           "seconds_per_step_median": med, "seconds_per_step_all": times,
           "ms_per_sync": 1e3 * (med["sync_every_step"] - med["no_sync"]),
           "health_says_finite": checks}
    print(json.dumps({k: rec[k] for k in ("device", "ms_per_sync", "seconds_per_step_median", "health_says_finite")}))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
