"""Run under torchrun (tests/test_resume.py): DDP + Adam + HDET with auto-LR, a checkpoint every few
steps, and an injected crash of one rank on the first attempt. On restart every rank resumes from the
last complete checkpoint. Rank 0 writes the final weights and LR history."""

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(__file__))
import hdet  # noqa: E402
from dist_workers import batch, make_model  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--kill-at", type=int, default=0, help="optimizer step at which rank 1 dies (0: never)")
    p.add_argument("--kill-when", default="before_step", choices=["before_step", "before_sync"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--ckpt-every", type=int, default=4)
    a = p.parse_args()
    torch.set_num_threads(1)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # One key namespace per attempt in the agent's store: gloo would otherwise read a dead rank's stale
    # address left by the first attempt (seen with torch 2.13: "connectFullMesh ... Connection refused").
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt{attempt}/", store), rank=rank, world_size=world)
    model = make_model(0)
    ddp = DDP(model, broadcast_buffers=False)
    o = torch.optim.Adam(ddp.parameters(), lr=0.01)
    s = hdet.OneCycleAutoLR(o, max_lr=0.02, total_steps=a.steps, ensemble_lr_spread_ratio=0.2, model_sync_interval=5,
                            controller="paper", enable_auto_lr=True, auto_lr_warmup_steps=5, loss_scale=0.05, model=ddp, seed=3)
    latest = os.path.join(a.out, "latest")
    start = 0
    if os.path.exists(latest):
        start = int(open(latest).read())
        ck = torch.load(os.path.join(a.out, f"ckpt{start}_rank{rank}.pt"), weights_only=True)
        model.load_state_dict(ck["model"])
        o.load_state_dict(ck["opt"])
        s.load_state_dict(ck["sched"])
    lrs = []
    for t in range(start + 1, a.steps + 1):
        if attempt == 0 and rank == 1 and t == a.kill_at and a.kill_when == "before_step":
            os._exit(1)  # the crash
        x, y = batch(rank, t)
        loss = nn.functional.mse_loss(ddp(x), y)
        o.zero_grad()
        loss.backward()
        o.step()
        if attempt == 0 and rank == 1 and t == a.kill_at and a.kill_when == "before_sync":
            os._exit(1)  # dies with the others waiting in the converge step's collective
        s.step(loss)
        lrs.append(s.get_last_lr()[0])
        if t % a.ckpt_every == 0:
            torch.save({"model": model.state_dict(), "opt": o.state_dict(), "sched": s.state_dict()},
                       os.path.join(a.out, f"ckpt{t}_rank{rank}.pt"))
            dist.barrier()  # every rank's checkpoint of step t is on disk before it counts as complete
            if rank == 0:
                with open(latest + ".tmp", "w") as f:
                    f.write(str(t))
                os.replace(latest + ".tmp", latest)
    if rank == 0:
        torch.save({"params": [p.detach().clone() for p in model.parameters()],
                    "buffers": [b.clone() for b in model.buffers()], "lrs": lrs, "attempt": attempt, "start": start},
                   os.path.join(a.out, "final.pt"))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()  # gloo may abort at interpreter exit, after the run (pytorch/pytorch#179291; seen in the
    sys.stderr.flush()  # clean-clone CI after the restarted run): leave without C++ destructors, as the examples do
    os._exit(0)


if __name__ == "__main__":
    main()
