"""Correctness of HDET on NCCL (run with torchrun on GPUs); writes a JSON of what it checked.

    torchrun --nproc-per-node 2 benchmarks/nccl_check.py --out benchmarks/results/nccl_check.json

Checks per sync step: weights (and BatchNorm statistics) differ across replicas just before and are
equal just after; replica r's LR is OneCycle(t) * rho_r before auto-LR starts; after each controller
update the multipliers across ranks are a permutation of rho; no host sync off sync steps
(torch.cuda.set_sync_debug_mode('error'))."""

import argparse
import json
import os
import platform

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import OneCycleLR

import hdet


def gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--T", type=int, default=20)
    a = p.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 512), nn.BatchNorm1d(512), nn.ReLU(), nn.Linear(512, 1)).to(dev)
    ddp = DDP(model, broadcast_buffers=False)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    warm = a.steps // 2
    sched = hdet.OneCycleAutoLR(opt, max_lr=1e-3, total_steps=a.steps, ensemble_lr_spread_ratio=0.2,
                                model_sync_interval=a.T, controller="paper", enable_auto_lr=True, auto_lr_warmup_steps=warm, model=ddp)
    ref_opt = torch.optim.Adam([torch.zeros(1, requires_grad=True)], lr=1e-3)
    ref = OneCycleLR(ref_opt, max_lr=1e-3, total_steps=a.steps)
    rho = hdet.linear_multipliers(world, 0.2)
    g = torch.Generator(device=dev).manual_seed(rank)
    checks = {"syncs": 0, "differ_before": 0, "equal_after": 0, "lr_matches_onecycle_times_rho": True,
              "permutation_after_control": 0, "controller_updates": 0, "nonsync_steps_without_host_sync": 0}
    for t in range(1, a.steps + 1):
        x = torch.randn(64, 32, device=dev, generator=g)
        y = x[:, :1] * 2 - x[:, 1:2]
        sync = sched.ensemble.is_sync_step(t)
        if sync:
            before = gather(torch.cat([q.detach().flatten() for q in list(model.parameters()) + [model[1].running_mean]]))
            checks["differ_before"] += any(not torch.equal(before[0], b) for b in before[1:])
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        torch.cuda.set_sync_debug_mode(0 if sync else "error")  # HDET's own step: no host sync off syncs
        sched.step(loss)
        torch.cuda.set_sync_debug_mode(0)
        ref_opt.step()
        ref.step()
        if not sync:
            checks["nonsync_steps_without_host_sync"] += 1
        if t < warm and abs(sched.get_last_lr()[0] - ref.get_last_lr()[0] * rho[rank]) > 1e-15:
            checks["lr_matches_onecycle_times_rho"] = False
        if sync:
            checks["syncs"] += 1
            after = gather(torch.cat([q.detach().flatten() for q in list(model.parameters()) + [model[1].running_mean]]))
            checks["equal_after"] += all(torch.equal(after[0], b) for b in after[1:])
            if sched.last_sync.controller is not None:
                checks["controller_updates"] += 1
                m = gather(torch.tensor([sched.multipliers[0]], device=dev, dtype=torch.float64))
                checks["permutation_after_control"] += sorted(float(v) for v in m) == sorted(rho)
    checks["ok"] = (checks["differ_before"] == checks["equal_after"] == checks["syncs"]
                    and checks["permutation_after_control"] == checks["controller_updates"] > 0
                    and checks["lr_matches_onecycle_times_rho"])
    if rank == 0:
        result = {"command": "torchrun --nproc-per-node %d benchmarks/nccl_check.py" % world,
                  "world_size": world, "backend": dist.get_backend(), "gpu": torch.cuda.get_device_name(),
                  "python": platform.python_version(), "torch": torch.__version__, "nccl": list(torch.cuda.nccl.version()),
                  "checks": checks}
        print(json.dumps(result, indent=1))
        if a.out:
            with open(a.out, "w") as f:
                json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
