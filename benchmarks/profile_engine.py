"""Profile one engine step (vmap) and one baseline step on the GPU: where does the time go?

    python benchmarks/profile_engine.py --size small
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import hdet
from hdet.engine import ReplicaEngine
from hdet.app.tasks import ByteGPT

import engine_throughput as et  # same folder


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="small")
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--rows", type=int, default=25)
    a = p.parse_args()
    sizes = {"tiny": dict(d=128, layers=2, heads=4, ctx=64, B=16), "small": dict(d=384, layers=6, heads=6, ctx=256, B=8)}
    s = sizes[a.size]
    N, B, ctx = a.replicas, s["B"], s["ctx"]
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    data = torch.randint(0, 256, (N * B, ctx + 1), device=dev)
    torch.manual_seed(0)
    eng = ReplicaEngine(ByteGPT(ctx, s["d"], s["layers"], s["heads"]).to(dev), N,
                        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
                        lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=1e-3, total_steps=100, ensemble_lr_spread_ratio=0.2,
                                                              model_sync_interval=1000, replicas=rep, model=m), mode="vmap")
    step = lambda: eng.step(data.view(N, B, ctx + 1), et.lm_loss, stacked=True)  # noqa: E731
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    print("== engine vmap, by self CUDA time")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=a.rows, max_name_column_width=60))
    print("== engine vmap, by self CPU time")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
