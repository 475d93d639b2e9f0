"""A GPT-2-small-sized confirmation on several GPUs (issue 15, item 6): plain DDP against HDET's
recommended configuration, at the tuned LR and from a 10x start.

The model: a byte-level GPT with GPT-2 small's width (768), heads (12) and context (1024); 18 layers, so
that its parameter count (128M) matches GPT-2 small's 124M without a BPE embedding. The corpus: every
``.py`` file of this Python's standard library and installed packages (the largest real text on a machine
with no download; it depends on what is installed, so ``--prepare`` records its size and hash); files
whose path hashes to 0 mod 50 are held out. bf16 autocast, fused AdamW (weight decay 0.1, none on norms),
OneCycleLR, gradient norm clipped to 1.0 in every run.

    python benchmarks/gpt_multi_gpu.py --prepare --cache /tmp/corpus                  # the corpus, once
    CUDA_VISIBLE_DEVICES=0 python benchmarks/gpt_multi_gpu.py --max-lr 3e-3 --out a.json   # one GPU, the
        # whole global batch (the LR grid: the same update as DDP over --global-batch)
    torchrun --nproc-per-node 4 benchmarks/gpt_multi_gpu.py --max-lr 3e-3 --alpha 0.2 --out b.json
    python benchmarks/gpt_multi_gpu.py --best a.json b.json ...                       # the grid's best max_lr
    torchrun --nproc-per-node 2 benchmarks/gpt_multi_gpu.py --max-lr 3e-3 --alpha 0.2 --lr-sweep 0.2 --out c.json
        # hdet.lr_sweep first (8 LRs around 3e-3, one a rank a round, 200 steps each), then all steps at its peak

``benchmarks/gpt_multi_gpu.sh`` runs the whole comparison. ``--tiny`` shrinks everything for a CPU check.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
import time
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import hdet
from hdet.app.tasks import ByteGPT, param_groups
from hdet.telemetry import SyncLogger

VOCAB = 256


def prepare(cache: Path, limit: int) -> dict:
    """Write train.bin / val.bin (raw bytes) and meta.json: every .py file under the stdlib and the
    installed packages, in sorted path order, up to ``limit`` bytes."""
    roots = sorted({Path(sysconfig.get_paths()[k]).resolve() for k in ("stdlib", "purelib", "platlib")})
    files = sorted({f.resolve() for r in roots for f in r.rglob("*.py") if f.is_file()})
    train, val, n, size, digest = [], [], [0, 0], 0, hashlib.sha256()
    for f in files:
        data = f.read_bytes()
        held_out = zlib.crc32(str(f).encode()) % 50 == 0
        (val if held_out else train).append(data)
        n[held_out] += 1
        size += len(data)
        digest.update(data)
        if size >= limit:
            break
    cache.mkdir(parents=True, exist_ok=True)
    (cache / "train.bin").write_bytes(b"".join(train))
    (cache / "val.bin").write_bytes(b"".join(val))
    meta = {"roots": [str(r) for r in roots], "train_files": n[0], "val_files": n[1],
            "train_bytes": sum(map(len, train)), "val_bytes": sum(map(len, val)), "sha256": digest.hexdigest(),
            "python": platform.python_version()}
    (cache / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


def load(cache: Path, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    def read(name: str) -> torch.Tensor:
        return torch.frombuffer(bytearray((cache / name).read_bytes()), dtype=torch.uint8).to(device)
    return read("train.bin"), read("val.bin")


@torch.no_grad()
def evaluate(model: torch.nn.Module, val: torch.Tensor, ctx: int, windows: int, batch: int, rank: int,
             world: int) -> float:
    """Mean loss over ``windows`` evenly spaced held-out windows, split over the ranks (one all_reduce)."""
    starts = torch.linspace(0, val.numel() - ctx - 2, windows, device=val.device).long()[rank::world]
    total = torch.zeros(2, dtype=torch.float64, device=val.device)
    was = model.training
    model.eval()
    for i in range(0, starts.numel(), batch):
        x = val[starts[i:i + batch, None] + torch.arange(ctx + 1, device=val.device)].long()
        with torch.autocast(val.device.type, dtype=torch.bfloat16, enabled=val.is_cuda):
            logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), x[:, 1:].reshape(-1), reduction="none")
        total += torch.stack([loss.view(x.shape[0], -1).mean(1).sum().double(),
                              torch.tensor(float(x.shape[0]), dtype=torch.float64, device=val.device)])
    if world > 1:
        dist.all_reduce(total)  # collective: the held-out sums of every rank
    model.train(was)
    return (total[0] / total[1]).item()  # host sync


def sweep(a: argparse.Namespace, model: torch.nn.Module, net: torch.nn.Module, make_optimizer, data: torch.Tensor,
          batch: int, dev: torch.device, cuda: bool) -> dict:
    """``--lr-sweep F``: :func:`hdet.lr_sweep` over ``F * steps`` steps, ``--sweep-points`` LRs around ``--max-lr``
    (each rank one run a round, on its own batches of the per-rank size; the same clipping as the main run, through a
    step pre-hook), judged by each run's training loss over its last tenth; the model back at its start weights. What
    it found (the main run's peak is its ``max_lr``: the pick times hdet.lr_sweep's default factor, sqrt(max(world, 8)))."""
    offsets = torch.arange(a.ctx + 1, device=dev)

    def clipped(params, lr: float) -> torch.optim.Optimizer:
        opt = make_optimizer(params, lr)
        def clip(*_) -> None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), a.clip)
        opt.register_step_pre_hook(clip)
        return opt

    def loss_fn(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            logits = m(x[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), x[:, 1:].reshape(-1))

    def batches(r: int):
        g = torch.Generator(device=dev).manual_seed((1 << 40) + 1000 * a.seed + r)  # apart from the main run's
        for _ in range(steps):
            i = torch.randint(0, data.numel() - a.ctx - 1, (batch, 1), device=dev, generator=g)
            yield data[i + offsets].long()
    steps = int(a.lr_sweep * a.steps)
    t0 = time.perf_counter()
    ranks = dist.is_initialized()  # (in one process, as a check: 2 runs at a time, the pick taken as it is)
    res = hdet.lr_sweep(model, clipped, loss_fn, batches, guess=a.max_lr, steps=steps, points=a.sweep_points,
                        num_replicas=None if ranks else 2,
                        lr_factor=a.sweep_factor if a.sweep_factor else None if ranks else 1.0)
    if cuda:
        torch.cuda.synchronize()
    return {"steps": steps, "points": a.sweep_points, "guess": a.max_lr, "max_lr": res.max_lr, "pick": res.pick,
            "lr_factor": res.lr_factor, "lrs": res.lrs, "losses": [v if math.isfinite(v) else None for v in res.losses],
            "start_loss": res.start_loss, "winner": res.winner, "at_edge": res.at_edge,
            "seconds": time.perf_counter() - t0}


def train(a: argparse.Namespace) -> dict:
    distributed = "RANK" in os.environ
    cuda = torch.cuda.is_available() and not a.tiny
    if distributed:
        dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        torch.backends.cuda.matmul.allow_tf32 = True
    dev = torch.device("cuda" if cuda else "cpu")
    if a.global_batch % world:
        raise SystemExit(f"Expected --global-batch ({a.global_batch}) to be a multiple of the world size ({world})")
    batch = a.global_batch // world
    train_data, val_data = load(Path(a.cache), dev)
    torch.manual_seed(a.seed)  # the same initial model on every rank and in every run
    net = ByteGPT(a.ctx, a.width, a.layers, a.heads).to(dev)
    model = DDP(net, device_ids=[dev.index] if cuda else None) if distributed else net
    def make_optimizer(params, lr: float) -> torch.optim.Optimizer:
        opt = torch.optim.AdamW(param_groups(net, lambda n: "norm" if "ln" in n or "norm" in n else "weights", 0.1),
                                lr=lr, betas=(0.9, 0.95), fused=cuda)
        return opt

    opt = make_optimizer(net.parameters(), a.max_lr)
    max_lr, swept = a.max_lr, None
    if a.lr_sweep:  # COLLECTIVES under torchrun (hdet.lr_sweep: each rank one of its runs a round)
        swept = sweep(a, model, net, make_optimizer, train_data, batch, dev, cuda)
        max_lr = swept["max_lr"]
    hdet_run = a.alpha > 0 or a.range_test
    syncs: list[dict] = []
    if hdet_run:
        sched = hdet.OneCycleAutoLR(opt, max_lr=max_lr, total_steps=a.steps, ensemble_lr_spread_ratio=a.alpha,
                                    model_sync_interval=a.T, model=model, on_runaway=a.on_runaway,
                                    lr_range_test=a.range_test, seed=a.seed)
        keep = ("step", "losses", "bases", "multipliers", "recovered", "runaway", "lr_scale", "went_back_to",
                "range_scale", "range_ended")
        SyncLogger(sched, callback=lambda d: syncs.append({k: d[k] for k in keep}))
    else:
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=max_lr, total_steps=a.steps)
    g = torch.Generator(device=dev).manual_seed(1000 * a.seed + rank)  # each rank its own batches
    offsets = torch.arange(a.ctx + 1, device=dev)
    curve, val_curve, error = [], [], None
    norms, norm_sum = [], torch.zeros((), device=dev)  # the pre-clip gradient norm, summed on the device
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    try:
        for step in range(1, a.steps + 1):
            i = torch.randint(0, train_data.numel() - a.ctx - 1, (batch, 1), device=dev, generator=g)
            x = train_data[i + offsets].long()
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
                logits = model(x[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), x[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            norm_sum += torch.nn.utils.clip_grad_norm_(net.parameters(), a.clip)
            opt.step()
            sched.step(loss) if hdet_run else sched.step()
            if step % a.log_every == 0 or step == a.steps:
                curve.append((step, loss.item(), opt.param_groups[0]["lr"]))  # host sync every log_every steps
                norms.append((step, norm_sum.item() / (step - (norms[-1][0] if norms else 0))))  # (window mean)
                norm_sum.zero_()
            if step % a.eval_every == 0 or step == a.steps:
                # mid-run, HDET's replicas differ: the mean over replicas; after the last step they are averaged
                val_curve.append((step, evaluate(model, val_data, a.ctx, a.eval_windows, 32, rank, world)))
    except Exception as e:  # a run that fails is a result too (all other runs go on)
        error = f"{type(e).__name__}: {e}"
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    final = val_curve[-1][1] if val_curve and val_curve[-1][0] == a.steps and error is None else float("nan")
    out = {"command": ("torchrun --nproc-per-node %d " % world if distributed else "python ")
           + "benchmarks/gpt_multi_gpu.py " + " ".join(sys.argv[1:]),
           "args": vars(a), "world": world, "device": torch.cuda.get_device_name() if cuda else "cpu",
           "python": platform.python_version(), "torch": torch.__version__, "hdet": hdet.__version__,
           "params": sum(p.numel() for p in net.parameters()), "tokens_per_step": a.global_batch * a.ctx,
           "corpus": json.loads((Path(a.cache) / "meta.json").read_text()),
           "max_lr": max_lr, "lr_sweep": swept,
           "final_val_loss": final, "diverged": not math.isfinite(final) or final > a.diverged_above,
           "error": error, "seconds": seconds, "steps_per_second": a.steps / seconds,
           "train_curve": curve, "val_curve": val_curve, "syncs": syncs,
           "grad_norm_curve": norms}
    if rank == 0 and a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))
    if rank == 0:
        print(json.dumps({k: out[k] for k in ("final_val_loss", "diverged", "error", "seconds", "params")}))
    if distributed:
        dist.barrier()  # collective: every rank done before the group goes
        dist.destroy_process_group()
    return out


def best(paths: list[str]) -> float:
    """The max_lr of the finished run with the lowest final held-out loss."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    ok = [r for r in runs if math.isfinite(r["final_val_loss"])]
    if not ok:
        raise SystemExit(f"Expected a finished run among {paths}, but every one failed")
    return min(ok, key=lambda r: r["final_val_loss"])["args"]["max_lr"]


def report(folder: Path) -> str:
    """A markdown table of every run under ``folder`` (and ``curves.png``, if matplotlib is there)."""
    runs = {str(f.relative_to(folder).with_suffix("")): json.loads(f.read_text()) for f in sorted(folder.rglob("*.json"))}
    runs = {k: r for k, r in runs.items() if "final_val_loss" in r}
    grid = list(map(str, folder.glob("grid_*.json")))
    plain_ddp = [r for r in runs.values() if r["world"] > 1 and r["args"]["alpha"] == 0
                 and not r["args"]["range_test"] and not r["args"].get("lr_sweep")]
    best_lr = best(grid) if grid else min(r["args"]["max_lr"] for r in plain_ddp)  # (no grid: one plain LR run)
    plain = [r["final_val_loss"] for r in plain_ddp if r["args"]["max_lr"] == best_lr]
    ref = sum(plain) / len(plain)
    lines = [f"Reference: plain DDP at {'the grid' + chr(39) + 's best ' if grid else ''}max_lr {best_lr:g}, "
             f"mean of {len(plain)} seed(s): {ref:.4f}", "",
             "| run | GPUs | max_lr | sweep: steps, pick -> peak | alpha | range test | seed | held-out loss | "
             "vs reference | events |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for k, r in runs.items():
        a, sw = r["args"], r.get("lr_sweep")
        swept = f"{sw['steps']}, {sw['pick']:.3g} -> {sw['max_lr']:.3g}" if sw else "-"
        ev = [f"step {s['step']}: " + ", ".join(
            x for x in (f"reset {s['recovered'] + s['runaway']}" if s["recovered"] or s["runaway"] else "",
                        f"back to {s['went_back_to']}" if s["went_back_to"] is not None else "",
                        f"range ended ({s['range_ended']}) at x{s['range_scale']:.3g}" if s["range_ended"] else "",
                        f"LR x{s['lr_scale']:.3g}" if s["went_back_to"] is not None or s["runaway"] else "") if x)
              for s in r["syncs"] if s["recovered"] or s["runaway"] or s["went_back_to"] is not None or s["range_ended"]]
        lines.append(f"| {k} | {r['world']} | {a['max_lr']:.4g} | {swept} | {a['alpha']} | "
                     f"{'yes' if a['range_test'] else 'no'} | "
                     f"{a['seed']} | {r['final_val_loss']:.4f} | {100 * (r['final_val_loss'] / ref - 1):+.1f}% | "
                     f"{'; '.join(ev[:3]) + (f' (+{len(ev) - 3} more)' if len(ev) > 3 else '') or '-'} |")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "\n".join(lines)
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    for k, r in runs.items():
        if r["world"] > 1:
            ax[0].plot(*zip(*[(s, v) for s, v, _ in r["train_curve"]]), label=k, lw=1)
            ax[1].plot(*zip(*[(s, lr) for s, _, lr in r["train_curve"]]), label=k, lw=1)
    ax[0].set(xlabel="step", ylabel="training loss (rank 0)", ylim=(0.8, 3.3))
    ax[1].set(xlabel="step", ylabel="rank 0's LR (group 0)", yscale="log")
    ax[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(folder / "curves.png", dpi=110)
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prepare", action="store_true", help="build the corpus cache and exit")
    p.add_argument("--best", nargs="+", default=None, help="print the best max_lr of these result files")
    p.add_argument("--report", default=None, help="print a markdown table of the runs in this folder")
    p.add_argument("--cache", default="/tmp/hdet_corpus")
    p.add_argument("--corpus-limit", type=int, default=400_000_000, help="--prepare: at most this many bytes")
    p.add_argument("--tiny", action="store_true", help="a small model on CPU (a check of the script)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--global-batch", type=int, default=32, help="sequences per optimizer step, all ranks")
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--layers", type=int, default=18)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--max-lr", type=float, default=3e-3)
    p.add_argument("--alpha", type=float, default=0.0, help="0: plain DDP + OneCycleLR")
    p.add_argument("--T", type=int, default=25)
    p.add_argument("--on-runaway", default="recover")
    p.add_argument("--range-test", action="store_true")
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--lr-sweep", type=float, default=0.0,
                   help="sweep the LR first over this fraction of --steps (hdet.lr_sweep), then train all steps")
    p.add_argument("--sweep-points", type=int, default=8, help="the sweep's grid (runs one a rank, in rounds)")
    p.add_argument("--sweep-factor", type=float, default=None,
                   help="the main run's peak over the sweep's pick (default hdet.lr_sweep's, sqrt(max(world, 8)); calls 1-4 of gpt128m_sweep ran sqrt(world))")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-windows", type=int, default=256)
    p.add_argument("--diverged-above", type=float, default=4.0, help="a final loss above this is 'diverged'")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.best:
        print(best(a.best))
    elif a.report:
        print(report(Path(a.report)))
    elif a.prepare:
        print(json.dumps(prepare(Path(a.cache), a.corpus_limit)))
    else:
        if a.tiny:
            a.ctx, a.width, a.layers, a.heads = min(a.ctx, 32), min(a.width, 32), min(a.layers, 2), 2
            a.eval_windows = min(a.eval_windows, 16)
        train(a)


if __name__ == "__main__":
    main()
