"""Run under torchrun on 2+ GPUs (tests/gpu/test_skip_guard_cuda.py): DDP + fused AdamW on CUDA, the 'skip'
guard with its lagged skip-counter read (hdet.guard.SkipWatch, pinned copies and CUDA events), T = 100.
Rank 1 gets a NaN weight at step 7; every replica skips until the early recovery after step 30. Every step
that is not a sync step (nor one of DDP's first two, where DDP itself syncs to rebuild its buckets) runs under
torch.cuda.set_sync_debug_mode('error'): no host sync, the polls included.
With argv[2] == "fp16": fp16 autocast under a torch.amp.GradScaler (the guard takes the scaler's verdict), and the
scale after the recovery must be step 6's (the last step taken), kept at every step on the device.
Writes one JSON per rank to the folder given as argv[1]."""

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hdet


def main(out: str, fp16: bool = False) -> None:
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(dev)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1)).to(dev)
    ddp = DDP(model, device_ids=[dev.index])
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, fused=True)
    sched = hdet.OneCycleAutoLR(opt, max_lr=1e-3, total_steps=120, ensemble_lr_spread_ratio=0.2,
                                model_sync_interval=100, model=ddp)
    g = torch.Generator(device=dev).manual_seed(rank)
    frozen, debug_checked, caught, scales = [], 0, [], []
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 10) if fp16 else None
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for t in range(1, 121):
            if t == 7 and rank == 1:
                with torch.no_grad():
                    model[0].weight[0, 0] = float("nan")
            sync_step = sched.ensemble.is_sync_step(t)
            early = t == 30  # the recovery step: collectives and a host read, like a sync
            ddp_warmup = t < 3  # DDP itself syncs while it rebuilds its buckets (plain DDP does too)
            checked = not (sync_step or early or ddp_warmup)
            before = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
            torch.cuda.set_sync_debug_mode("error" if checked else 0)
            try:
                x = torch.randn(32, 64, device=dev, generator=g)
                with torch.autocast("cuda", dtype=torch.float16, enabled=fp16):
                    loss = nn.functional.mse_loss(ddp(x).float(), x[:, :1])
                opt.zero_grad(set_to_none=True)
                if fp16:
                    scaler.scale(loss).backward()
                    scaler.step(opt)
                    scaler.update()
                else:
                    loss.backward()
                    opt.step()
                sched.step(loss)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            debug_checked += checked
            if fp16:
                scales.append(scaler.get_scale())  # (a host read, after the checked step)
            after = torch.cat([p.detach().flatten() for p in model.parameters()])
            frozen.append(bool(torch.equal(before, after)))
        caught = [str(x.message) for x in w if "early recovery" in str(x.message)]
    finite = bool(all(torch.isfinite(p).all() for p in model.parameters()))
    res = {"rank": rank, "device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
           "frozen_steps": [t for t, f in enumerate(frozen, 1) if f], "skipped": float(sched.skip_guard.skipped),
           "finite": finite, "warnings": caught, "steps_under_sync_debug_error": debug_checked,
           "guard": sched.gradient_guard, "scales": scales}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], len(sys.argv) > 2 and sys.argv[2] == "fp16")
