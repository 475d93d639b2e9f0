"""Host time of each phase of an engine step (no device sync inside the step: where the host is the bottleneck, this is
where the step's time goes), for the tiny/small GPT of ``engine_throughput.py``, N = 8, against one model's step.

    python benchmarks/engine_host_split.py --sizes tiny,small --modes vmap,merged --out split.json
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import platform
import sys
import time

import torch

import hdet
from hdet import engine as E, merged as M, stacking as S, stacked_optim as SO
from hdet.app.tasks import ByteGPT

import engine_throughput as et  # same folder

PHASES = [(E.ReplicaEngine, "step"), (E.ReplicaEngine, "_check_flags"), (E.ReplicaEngine, "_vmapped_forward"),
          (M.MergedReplicas, "losses"), (S.StackedReplicas, "before_backward"), (S.StackedReplicas, "backward"),
          (S.StackedReplicas, "average_gradients"), (SO.StackedStep, "step"), (E.ReplicaEngine, "_begin_steps"),
          (E.ReplicaEngine, "_end_steps"), (E.ReplicaEngine, "_sync")]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="tiny,small")
    p.add_argument("--modes", default="vmap,merged")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    acc: collections.Counter = collections.Counter()
    for cls, name in PHASES:
        f = getattr(cls, name)

        def timed(*args, _f=f, _k=f"{cls.__name__}.{name}", **kw):
            t = time.perf_counter()
            try:
                return _f(*args, **kw)
            finally:
                acc[_k] += time.perf_counter() - t
        setattr(cls, name, functools.wraps(f)(timed))
    res = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name() if dev.type == "cuda"
           else platform.processor() or "cpu", "torch": torch.__version__, "python": platform.python_version(),
           "results": []}
    for size in a.sizes.split(","):
        s = et.SIZES[size]
        N, B, ctx = 8, s["B"], s["ctx"]
        data = torch.randint(0, 256, (N * B, ctx + 1), device=dev)

        def fresh():
            torch.manual_seed(0)
            return ByteGPT(ctx, s["d"], s["layers"], s["heads"]).to(dev)
        one = fresh()
        opt = torch.optim.AdamW(one.parameters(), lr=1e-3, fused=dev.type == "cuda")
        sch = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=10_000)

        def base():
            loss = et.lm_loss(one, data)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sch.step()
        row = {"size": size, "baseline_ms": et.time_steps(base, 5, a.steps, dev) * 1e3}
        for mode in a.modes.split(","):
            eng = E.ReplicaEngine(fresh(), N, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3,
                                                                          fused=dev.type == "cuda"),
                                  lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=1e-3, total_steps=10_000,
                                                                        ensemble_lr_spread_ratio=0.2,
                                                                        model_sync_interval=25, replicas=rep, model=m),
                                  mode=mode)

            def step():
                eng.step(data.view(N, B, ctx + 1), et.lm_loss, stacked=True)
            et.time_steps(step, 5, 5, dev)
            acc.clear()
            wall = et.time_steps(step, 0, a.steps, dev)
            row[mode] = {"wall_ms": wall * 1e3, "engine_mode": eng.mode,
                         "host_ms": {k: v / a.steps * 1e3 for k, v in acc.most_common()}}
            print(size, mode, json.dumps({k: round(v, 3) for k, v in row[mode]["host_ms"].items()}),
                  "wall", round(wall * 1e3, 3), "baseline", round(row["baseline_ms"], 3), flush=True)
            eng = None
        res["results"].append(row)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
