"""Run under torchrun on 2 GPUs (tests/gpu/test_skip_guard_cuda.py): DDP + fused AdamW on CUDA, the "skip" guard,
T = 100. Rank 1's weight turns NaN at step 7 and every replica skips until the early recovery after step 30. Run
once through 60 steps, and once checkpointed after step ``stop`` (in the stall: the guard's counts are read from the
device into the scheduler's state, the lagged copy and its CUDA event included) and resumed in new objects. Writes
one JSON per rank to the folder given as argv[1]: the steps where rank 1 was reset, the largest weight difference."""

import io
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hdet


def main(out: str, stop: int = 20) -> None:
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(dev)

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1)).to(dev)
        ddp = DDP(model, device_ids=[dev.index])
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, fused=True)
        sched = hdet.OneCycleAutoLR(opt, max_lr=1e-3, total_steps=60, ensemble_lr_spread_ratio=0.2,
                                    model_sync_interval=100, model=ddp)
        return model, ddp, opt, sched

    def run(parts, steps, reset):
        model, ddp, opt, sched = parts
        for t in steps:
            if t == 7 and rank == 1:
                with torch.no_grad():
                    model[0].weight[0, 0] = float("nan")
            g = torch.Generator(device=dev).manual_seed(1000 * t + rank)
            x = torch.randn(32, 64, device=dev, generator=g)
            loss = ddp(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step(loss)
            if rank == 1 and t > 7 and not reset and all(bool(torch.isfinite(p).all()) for p in model.parameters()):
                reset.append(t)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        whole, reset_whole = build(), []
        run(whole, range(1, 61), reset_whole)
        first, reset_resumed = build(), []
        run(first, range(1, stop + 1), reset_resumed)
        buf = io.BytesIO()
        torch.save({"model": first[0].state_dict(), "opt": first[2].state_dict(), "sched": first[3].state_dict()}, buf)
        buf.seek(0)
        saved = torch.load(buf, weights_only=True)
        again = build()
        again[0].load_state_dict(saved["model"])
        again[2].load_state_dict(saved["opt"])
        again[3].load_state_dict(saved["sched"])
        run(again, range(stop + 1, 61), reset_resumed)
    diff = max(float((a - b).abs().max()) for a, b in zip(whole[0].state_dict().values(), again[0].state_dict().values()))
    res = {"reset": [reset_whole, reset_resumed], "diff": diff, "guard": whole[3].gradient_guard,
           "saved_guard": saved["sched"]["guard"]}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
