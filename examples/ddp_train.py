"""HDET on a byte-level transformer trained on the CPython standard library's own .py files.

No download: the corpus is the stdlib of the Python running this script (held-out files for
validation). Launch with torchrun; gloo on CPU, NCCL on GPUs:

    torchrun --nproc-per-node 2 examples/ddp_train.py                 # HDET, alpha = 0.2
    torchrun --nproc-per-node 2 examples/ddp_train.py --alpha 0       # plain DDP + OneCycleLR
    torchrun --nproc-per-node 4 examples/ddp_train.py --lr-sweep 0.2  # not sure of --max-lr: hdet.lr_sweep first,
                                        # then the run at alpha 0 with the stability guard, unless --alpha is given
    python examples/ddp_train.py                                      # one process, one replica
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import sysconfig
import time
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hdet


def load_stdlib(max_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bytes of the stdlib's .py files; files whose name hashes to 0 mod 10 are held out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, val, size = [], [], 0
    for f in sorted(root.rglob("*.py")):
        if "site-packages" in f.parts or "test" in f.parts:
            continue
        data = f.read_bytes()
        (val if zlib.crc32(f.name.encode()) % 10 == 0 else train).append(data)
        size += len(data)
        if size >= max_bytes:
            break
    as_tensor = lambda chunks: torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)  # noqa: E731
    return as_tensor(train), as_tensor(val)


class ByteGPT(nn.Module):
    def __init__(self, ctx: int, d: int = 128, layers: int = 2, heads: int = 4):
        super().__init__()
        self.tok = nn.Embedding(256, d)
        self.pos = nn.Parameter(torch.zeros(ctx, d))
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)  # (norm_first: no fast path)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 256)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(ctx), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos[: x.shape[1]]
        h = self.blocks(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True)
        return self.head(self.norm(h))


def batch(data: torch.Tensor, n: int, ctx: int, g: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    i = torch.randint(0, data.numel() - ctx - 1, (n,), generator=g)
    x = torch.stack([data[j: j + ctx + 1] for j in i.tolist()]).long().to(device)
    return x[:, :-1], x[:, 1:]


def lm_loss(m: nn.Module, xy: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The next-byte cross-entropy of model ``m`` on one batch ``(x, y)``."""
    return nn.functional.cross_entropy(m(xy[0]).flatten(0, 1), xy[1].flatten())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16, help="sequences per replica per step")
    p.add_argument("--ctx", type=int, default=64)
    p.add_argument("--max-lr", type=float, default=3e-3)
    p.add_argument("--alpha", type=float, default=None, help="spread ratio; 0 = plain DDP + OneCycleLR (default 0.2, "
                   "and 0 with --lr-sweep: after a sweep the spread gained nothing on the evidence suite's tasks and "
                   "cost about 2%% at 128M, docs/auto-lr.md)")
    p.add_argument("--T", type=int, default=25, help="sync interval (steps)")
    p.add_argument("--on-runaway", choices=["ignore", "recover"], default=None, help="the stability guard (default: "
                   "recover with --lr-sweep, where it takes the spread's place; ignore, the paper's HDET, without)")
    p.add_argument("--lr-cut-after", type=int, default=None, help="with --on-runaway recover: the first this many of "
                   "the guard's events go back without cutting the LR (default 1, hdet train's: measured with the "
                   "sweep recipe, docs/reliability.md; the library's HDETConfig default is 0)")
    p.add_argument("--auto-lr", action="store_true", help="auto-LR with the paper's controller (the library's default, "
                   "the fit controller, needs probe=: docs/auto-lr.md)")
    p.add_argument("--warmup", type=int, default=None, help="auto-LR warmup steps (default: 100, or a third of "
                   "--steps when shorter)")
    p.add_argument("--warm-init", action="store_true", help="warm noisy init (Eq. 10) of the start weights")
    p.add_argument("--lr-sweep", type=float, default=0.0, metavar="FRAC",
                   help="first an LR sweep of FRAC x --steps (hdet.lr_sweep: each rank one LR around --max-lr, judged "
                        "on held-out batches), then the run from the initial weights at its peak")
    p.add_argument("--lr-sweep-points", type=int, default=None, help="the sweep's LRs, in rounds of one a rank "
                   "(default: one a rank from 4 ranks, 8 at 2 or 3 (a grid of 2 points 1024x apart trained at 48x "
                   "the default LR), 4 in one process)")
    p.add_argument("--data-bytes", type=int, default=4_000_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=str, default=None, help="write a JSON summary here (rank 0)")
    a = p.parse_args()
    if a.warmup is None:
        a.warmup = min(100, a.steps // 3)
    if a.alpha is None:
        a.alpha = 0.0 if a.lr_sweep else 0.2
    if a.on_runaway is None:
        a.on_runaway = "recover" if a.lr_sweep else "ignore"
    if a.lr_cut_after is not None and a.lr_cut_after < 0:
        p.error(f"expected --lr-cut-after to be a whole number >= 0, but got {a.lr_cut_after}")
    if a.lr_cut_after is not None and a.on_runaway != "recover":
        p.error(f"--lr-cut-after acts only with --on-runaway recover, but got --on-runaway {a.on_runaway}")
    a.lr_cut_after = 1 if a.lr_cut_after is None else a.lr_cut_after
    if not 0 <= a.lr_sweep < 1:
        p.error(f"expected --lr-sweep in [0, 1) (a fraction of --steps), but got {a.lr_sweep}")
    if a.lr_sweep and round(a.lr_sweep * a.steps) < hdet.sweep.MIN_STEPS:
        p.error(f"expected --lr-sweep x --steps to give the sweep at least {hdet.sweep.MIN_STEPS} steps, but "
                f"--lr-sweep {a.lr_sweep} of --steps {a.steps} is {round(a.lr_sweep * a.steps)}")
    if a.out:  # (before training: a run whose summary cannot be written is lost at its end)
        where = next((q for q in Path(a.out).absolute().parents if q.exists()), None)
        why = ("a folder" if Path(a.out).is_dir() else f"{where} is a file" if where is not None and not where.is_dir()
               else f"{where} is not writable" if where is not None and not os.access(where, os.W_OK) else None)
        if why:
            p.error(f"expected --out to be a file path whose folder is or can be made, but got {a.out} ({why})")

    distributed = "RANK" in os.environ
    if distributed:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda")
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

    train_data, val_data = load_stdlib(a.data_bytes)
    torch.manual_seed(a.seed)
    model = ByteGPT(a.ctx).to(device)
    ddp = DDP(model) if distributed else model
    swept, max_lr = None, a.max_lr
    if a.lr_sweep:  # COLLECTIVES: an all-gather of the judged losses and broadcasts of the start weights a round
        def heldout(m: nn.Module) -> torch.Tensor:  # the same batches on every rank (of the validation split;
            # the final validation loss below reads other batches of it)
            hg = torch.Generator().manual_seed(999)
            return torch.stack([lm_loss(m, batch(val_data, 32, a.ctx, hg, device)) for _ in range(4)]).mean()

        steps = round(a.lr_sweep * a.steps)
        sg = torch.Generator().manual_seed(a.seed * 1000 + rank + 500)  # the sweep's own batches
        res = hdet.lr_sweep(ddp, lambda params, lr: torch.optim.AdamW(params, lr=lr, weight_decay=0.01), lm_loss,
                            lambda r: (batch(train_data, a.batch, a.ctx, sg, device) for _ in range(steps)),
                            guess=a.max_lr, steps=steps, judge=heldout,  # (in one process: 4 runs, one after
                            num_replicas=None if world > 1 else 4,  # the other, at the run's own batch)
                            points=a.lr_sweep_points or (8 if 1 < world < 4 else None),
                            lr_factor=None if world > 1 else 1.0)
        finite = [v if v != float("inf") else None for v in res.losses]  # (strict JSON: a run that blew up)
        max_lr, swept = res.max_lr, {"steps": steps, "guess": a.max_lr, "lrs": res.lrs, "losses": finite,
                                     "pick": res.pick, "max_lr": res.max_lr}  # the model is back at its start
        if rank == 0:
            print(f"lr sweep: the best of {res.lrs[0]:.2g}-{res.lrs[-1]:.2g} at {res.lrs[res.winner]:.2g}, the pick "
                  f"{res.pick:.3g} (the fit's vertex); the run at --max-lr {res.max_lr:.3g} ({res.lr_factor:.3g} x the "
                  f"pick), --alpha {a.alpha:g}, --on-runaway {a.on_runaway} (--lr-cut-after {a.lr_cut_after})",
                  flush=True)
    opt = torch.optim.AdamW(ddp.parameters(), lr=max_lr, weight_decay=0.01)
    sched = hdet.OneCycleAutoLR(
        opt, max_lr=max_lr, total_steps=a.steps, ensemble_lr_spread_ratio=a.alpha, model_sync_interval=a.T,
        controller="paper", enable_auto_lr=a.auto_lr, auto_lr_warmup_steps=a.warmup, model=ddp, seed=a.seed,
        on_runaway=a.on_runaway, lr_cut_after=a.lr_cut_after,
    )
    if a.warm_init:
        hdet.warm_init_(model, nu=0.01, seed=a.seed)
    g = torch.Generator().manual_seed(a.seed * 1000 + rank)  # each replica its own micro-batches
    t0 = time.perf_counter()
    syncs = []
    used = list(sched.ensemble.rho)  # the multipliers of the window now running (replica r: rho_r at the start)
    for t in range(1, a.steps + 1):
        x, y = batch(train_data, a.batch, a.ctx, g, device)
        loss = lm_loss(ddp, (x, y))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        lr = opt.param_groups[0]["lr"]  # this step's LR on this rank: the base LR times its multiplier
        sched.step(loss)  # off sync steps: no host sync, no collective
        if sched.is_sync_step(t):
            rec = sched.last_sync  # the window that just ended: its losses, its multipliers; rec.bases: the base LR
            base = lr / used[rank]  # after the sync (moved where the controller or the guard's cut moved it)
            syncs.append({"step": t, "losses": rec.losses, "base_lr": base, "base_lr_after_sync": rec.bases[0],
                          "multipliers": used, "next_multipliers": rec.multipliers[0],
                          "went_back_to": rec.went_back_to, "lr_scale": rec.lr_scale})  # (the stability guard's)
            if rank == 0:
                losses = ", ".join(f"{v:.3f}" for v in rec.losses or [])
                print(f"step {t:5d}  replica losses [{losses}]  base lr {base:.2e}  "
                      f"multipliers {[round(m, 3) for m in used]}", flush=True)
            used = list(rec.multipliers[0])  # dealt for the next window (Eq. 9)
    elapsed = time.perf_counter() - t0

    model.eval()
    vg = torch.Generator().manual_seed(12345)
    with torch.no_grad():
        val = sum(lm_loss(model, batch(val_data, 32, a.ctx, vg, device)).item() for _ in range(20)) / 20
    if rank == 0:
        print(f"done: {a.steps} steps on {world} replica(s) ({device.type}) in {elapsed:.1f}s; "
              f"validation loss {val:.4f} (bits/byte {val / 0.6931:.3f})")
        if a.out:
            summary = {
                "command": ("torchrun --nproc-per-node {} ".format(world) if distributed else "python ")
                + "examples/ddp_train.py " + " ".join(sys.argv[1:]),
                "args": vars(a), "world_size": world, "device": torch.cuda.get_device_name() if device.type == "cuda"
                else platform.processor() or "cpu", "backend": dist.get_backend() if distributed else None,
                "python": platform.python_version(), "torch": torch.__version__, "hdet": hdet.__version__,
                "train_seconds": elapsed, "val_loss": val, "syncs": syncs, "lr_sweep": swept,
            }
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(json.dumps(summary, indent=1))
    if distributed:
        dist.destroy_process_group()
        if device.type == "cpu":  # gloo may abort at interpreter exit, after the
            sys.stdout.flush()  # run (torch's bug, pytorch/pytorch#179291): leave without C++ destructors
            sys.stderr.flush()
            os._exit(0)


if __name__ == "__main__":
    main()
