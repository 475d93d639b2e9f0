"""FSDP2 + HDET on GPUs (torchrun, NCCL): meshes (2, 1) (two replicas, unsharded) and (1, 2) (one
replica sharded over both GPUs), with the paper controller and the fit controller. Checks the same invariants as
tests/test_distributed.py's gloo tests; with the fit controller, each probe loss against the probe at the mean of the
replica's weights over the window, computed by hand.

    torchrun --nproc-per-node 2 benchmarks/fsdp_check.py
Rank 0 prints one JSON line.
"""

import json
import os
import platform

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import hdet


def run(shape, rank, world, steps=10, T=5, controller="paper"):
    mesh = init_device_mesh("cuda", shape, mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1)).cuda()
    fully_shard(model, mesh=mesh)
    o = torch.optim.Adam(model.parameters(), lr=1e-3)
    xp = torch.randn(64, 64, device="cuda", generator=torch.Generator(device="cuda").manual_seed(99))
    s = hdet.OneCycleAutoLR(o, max_lr=1e-3, total_steps=steps, ensemble_lr_spread_ratio=0.3, model_sync_interval=T,
                            controller=controller, enable_auto_lr=True, auto_lr_warmup_steps=T, model=model,
                            probe=lambda m: nn.functional.mse_loss(m(xp), xp[:, :1]), device_mesh=mesh)
    g = torch.Generator(device="cuda").manual_seed(rank)
    equal_after, lrs, probe_rel_err, window = [], [], [], []
    for t in range(1, steps + 1):
        x = torch.randn(32, 64, device="cuda", generator=g)
        loss = nn.functional.mse_loss(model(x), x[:, :1])
        o.zero_grad()
        loss.backward()
        o.step()
        full = [p.full_tensor().detach().clone() for p in model.parameters()]
        window = [w + f for w, f in zip(window, full)] if window else full
        s.step(loss)
        lrs.append(s.get_last_lr()[0])
        rec = s.last_sync if s.is_sync_step(t) else None
        if rec is not None and rec.controller and controller == "fit":  # the probe by hand at the window's mean
            plain = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1)).cuda()
            with torch.no_grad():
                for p, w in zip(plain.parameters(), window):
                    p.copy_(w / T)
                want = float(nn.functional.mse_loss(plain(xp), xp[:, :1]))
            probe_rel_err.append(abs(float(rec.controller[0].losses[s.rank]) - want) / want)
        if s.is_sync_step(t):
            window = []
            full = torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()])
            out = [torch.empty_like(full) for _ in range(world)]
            dist.all_gather(out, full)
            equal_after.append(all(torch.equal(out[0], o_) for o_ in out[1:]))
    lr_t = torch.tensor(lrs, device="cuda", dtype=torch.float64)
    all_lrs = [torch.empty_like(lr_t) for _ in range(world)]
    dist.all_gather(all_lrs, lr_t)
    same_lr_across_ranks = torch.equal(all_lrs[0], all_lrs[1])
    return {"mesh": list(shape), "replicas": s.world_size, "equal_after_sync": equal_after,
            "lrs_identical_on_both_ranks": bool(same_lr_across_ranks), "controller": controller,
            "controller_updates": s.ensemble.controllers[0].updates, "probe_rel_err_vs_by_hand": probe_rel_err}


def main() -> None:
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    res = [run(shape, rank, world, controller=c) for c in ("paper", "fit") for shape in ((2, 1), (1, 2))]
    if rank == 0:
        print(json.dumps({"command": "torchrun --nproc-per-node 2 benchmarks/fsdp_check.py",
                          "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                          "python": platform.python_version(), "results": res}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
