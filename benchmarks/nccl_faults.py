"""NCCL check of the fault path (torchrun, one GPU per rank): the gradient guard (DDP comm hook) and the
converge step's recovery, with torch.cuda.set_sync_debug_mode("error") on every non-sync step.

    torchrun --nproc-per-node 2 benchmarks/nccl_faults.py
Rank 0 prints one JSON line.
"""

import json
import os
import platform

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hdet


def main() -> None:
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 1)).to(dev)
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, fused=True)
    s = hdet.OneCycleAutoLR(opt, max_lr=1e-3, total_steps=60, ensemble_lr_spread_ratio=0.2, model_sync_interval=10,
                            controller="paper", enable_auto_lr=True, auto_lr_warmup_steps=10, model=ddp)
    g = torch.Generator(device=dev).manual_seed(rank)
    finite_others, recovered, equal_after, checked = True, [], [], 0
    for t in range(1, 61):
        x = torch.randn(32, 64, device=dev, generator=g)
        y = x[:, :1] * 2
        sync = s.is_sync_step(t)
        loss = nn.functional.mse_loss(ddp(x), y)  # DDP's own forward may sync (buffers, bucket rebuild)
        if rank == 1 and t in (7, 33):
            loss = loss * float("nan")  # a NaN loss (and so NaN gradients) on replica 1
        opt.zero_grad(set_to_none=True)
        # hdet's part: backward (the gradient guard hook), the optimizer, the scheduler
        check = not sync and t > 1  # step 1: DDP rebuilds its buckets
        torch.cuda.set_sync_debug_mode("error" if check else 0)
        try:
            loss.backward()
            opt.step()
            s.step(loss)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        checked += check
        ok = all(torch.isfinite(p).all().item() for p in model.parameters())
        finite_others &= ok or rank == 1
        if sync:
            recovered.append(list(s.last_sync.recovered))
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            out = [torch.empty_like(flat) for _ in range(world)]
            dist.all_gather(out, flat)
            equal_after.append(all(torch.equal(out[0], o) for o in out[1:]) and bool(torch.isfinite(out[0]).all()))
    if rank == 0:
        print(json.dumps({"command": "torchrun --nproc-per-node 2 benchmarks/nccl_faults.py", "world": world,
                          "device": torch.cuda.get_device_name(), "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                          "torch": torch.__version__, "python": platform.python_version(),
                          "gradient_guard": s.gradient_guard, "non_sync_steps_without_host_sync": checked,
                          "healthy_replicas_always_finite": bool(finite_others), "recovered_per_sync": recovered,
                          "equal_and_finite_after_every_sync": equal_after}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
