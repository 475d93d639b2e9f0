"""HDET with Hugging Face Accelerate (docs/accelerate.md), run by tests/test_integrations.py:

    torchrun --standalone --nproc-per-node 2 examples/accelerate_ddp.py --out /tmp/acc

HDET with Hugging Face Accelerate on 2 gloo
processes, gradient accumulation 2. The HDET scheduler is NOT passed to accelerator.prepare (a prepared
scheduler is stepped num_processes times per optimizer step); it is stepped once per real optimizer step,
and each micro-batch's loss is observed."""

import argparse
import os
import sys
import warnings

import torch
from accelerate import Accelerator
from torch import nn

import hdet


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of a step: a noisy linear target."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 6, generator=g)
    return x, x[:, :1] * 2 - x[:, 1:2] + 0.1 * torch.randn(8, 1, generator=g)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--save-at", type=int, default=None, help="accelerator.save_state after this optimizer step, stop")
    p.add_argument("--resume", default=None, help="accelerator.load_state from this folder, then go on")
    p.add_argument("--prepared", action="store_true", help="pass the HDET scheduler to accelerator.prepare, as a "
                   "user might: hdet must say that it is stepped twice per optimizer step")
    p.add_argument("--eval-at", type=int, default=None, help="after this optimizer step (between converge steps), "
                   "evaluate the replicas' average (with sched.averaged()) and save_state it into OUT/avg_state")
    p.add_argument("--clip", type=float, default=None, help="explore a gradient-clipping norm (hdet.GradClip) from "
                   "this base, applied with accelerator.clip_grad_norm_ once per optimizer step")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    torch.set_num_threads(1)
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model, opt = acc.prepare(model, opt)
    steps = 12
    clip = hdet.GradClip(a.clip, alpha=0.5) if a.clip else None
    sched = hdet.OneCycleAutoLR(opt.optimizer, max_lr=0.02, total_steps=steps, ensemble_lr_spread_ratio=0.3,
                                model_sync_interval=4, controller="paper", enable_auto_lr=True, auto_lr_warmup_steps=4,
                                loss_scale=0.05, model=model, seed=3, explore=[clip] if clip else None)
    rank, lrs, done = acc.process_index, [], 0
    record = {"clips": [], "eval": None}
    acc.register_for_checkpointing(sched)  # the docs' recipe: save_state/load_state include the HDET scheduler
    start = 1
    if a.resume:
        acc.load_state(a.resume)  # rank 0's scheduler state on every rank: each rank gets its own LR back
        done = sched.last_epoch
        start = 2 * done + 1
        lrs.append(sched.get_last_lr()[0])
    prepared = acc.prepare(sched) if a.prepared else None  # Accelerate's usual recipe: do not (hdet warns)
    last = 2 * steps if prepared is None else 6  # prepared: 3 optimizer steps, 6 scheduler steps
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for micro in range(start, last + 1):
            x, y = batch(rank, micro)
            with acc.accumulate(model):
                loss = nn.functional.mse_loss(model(x), y)
                acc.backward(loss)
                if clip is not None and acc.sync_gradients:  # once per optimizer step, on the averaged gradient
                    before = acc.clip_grad_norm_(model.parameters(), clip.max_norm)
                    after = torch.linalg.vector_norm(torch.stack([q.grad.norm() for q in model.parameters()]))
                    record["clips"].append((float(before), float(after), clip.max_norm))
                opt.step()
                if prepared is not None:
                    prepared.step()  # steps hdet num_processes (2) times per optimizer step
                opt.zero_grad()
            sched.observe(loss.detach())  # every micro-batch counts toward the window mean
            if prepared is None and acc.sync_gradients:
                sched.step()  # once per optimizer step (collectives at sync steps run on every rank alike)
                lrs.append(sched.get_last_lr()[0])
                done += 1
                if done == a.save_at:
                    acc.save_state(os.path.join(a.out, "state"))
                    break
                if done == a.eval_at:  # the docs' recipe between converge steps: evaluate (and save) the average
                    own = [q.detach().clone() for q in model.parameters()]
                    xv, yv = batch(99, 0)
                    with sched.averaged():
                        with torch.no_grad():
                            val = nn.functional.mse_loss(model(xv), yv).item()
                        mean = [q.detach().clone() for q in model.parameters()]
                        acc.save_state(os.path.join(a.out, "avg_state"))
                    record["eval"] = {"own": own, "mean": mean, "val": val,
                                      "own_after": [q.detach().clone() for q in model.parameters()]}
    torch.save({"params": [q.detach().clone() for q in model.parameters()], "lrs": lrs, "done": done,
                "updates": sched.ensemble.controllers[0].updates, "guard": sched.gradient_guard,
                "warnings": [str(w.message) for w in caught if "hdet" in str(w.message)], "last_epoch": sched.last_epoch,
                **record},
               os.path.join(a.out, f"result_rank{rank}.pt"))
    acc.wait_for_everyone()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
