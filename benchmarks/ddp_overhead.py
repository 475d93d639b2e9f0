"""HDET's cost against plain DDP + OneCycleLR, and a converge step against the bandwidth floor.

Run with torchrun on 2+ GPUs (NCCL; gloo on CPU for a smoke test with --tiny):

    torchrun --nproc-per-node 2 benchmarks/ddp_overhead.py            # GPT ~124M, bf16 autocast
    torchrun --nproc-per-node 2 benchmarks/ddp_overhead.py --tiny     # CPU smoke test

1. Step time, interleaved in one run: three models train side by side in blocks of --block steps, round
   robin: plain DDP + OneCycleLR, HDET at T = 100 and HDET at T = 1000 (alpha 0.2). Ratios HDET / plain
   over the same number of steps (syncs included).
   Also both without the gradient guard (``guard_gradients=False``), to show its share, and local mode
   (``ddp.no_sync()`` every step: no gradient all-reduce between converge steps).
2. One converge step's averaging (``ProcessGroupReplicas.average_`` over the weights) against one
   all_reduce of a ready flat buffer of the same bytes (the floor), and against the reference's loop of
   one all_reduce per parameter; medians of --reps.
Rank 0 prints one JSON line.
"""

import argparse
import contextlib
import json
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import hdet
from hdet.tasks import ByteGPT


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--block", type=int, default=50)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--only", default=None, help="comma list of HDET configs to run next to plain")
    p.add_argument("--converge-only", action="store_true", help="skip the step-time part (one HDET model)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="HDET's averaging bucket size")
    a = p.parse_args()
    cuda = torch.cuda.is_available() and not a.tiny
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        torch.backends.cuda.matmul.allow_tf32 = True
    dev = torch.device("cuda" if cuda else "cpu")
    vocab, ctx, d, layers, heads = (256, 32, 64, 2, 2) if a.tiny else (50304, 1024, 768, 12, 12)
    steps = min(a.steps, 60) if a.tiny else a.steps
    block = min(a.block, 10) if a.tiny else a.block

    def sync_dev() -> None:
        if cuda:
            torch.cuda.synchronize()

    runs = {}
    configs = [("plain", None, True), ("hdet_T100", 100, True), ("hdet_T1000", 1000, True),
               ("hdet_T100_noguard", 100, False), ("hdet_T1000_noguard", 1000, False),
               ("hdet_T100_stock_python_hook", 100, "stock"), ("hdet_T100_local", 100, "local")]
    configs = [c for c in configs if c[0] == "plain" or a.only is None or c[0] in a.only.split(",")]
    if a.converge_only:
        configs = [("hdet_T100", 100, True)]
    for name, T, guard in configs:
        T = T if T is None or not a.tiny else T // 10
        torch.manual_seed(0)
        model = ByteGPT(ctx, d, layers, heads, vocab=vocab).to(dev)  # GPT-2 small's shape at vocab 50304
        ddp = DDP(model, device_ids=[dev.index] if cuda else None)
        opt = torch.optim.AdamW(ddp.parameters(), lr=6e-4, weight_decay=0.1, fused=cuda)
        if T is None:
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=6e-4, total_steps=steps)
        else:
            sched = hdet.OneCycleAutoLR(opt, max_lr=6e-4, total_steps=steps, ensemble_lr_spread_ratio=0.2,
                                        model_sync_interval=T, model=ddp, guard_gradients=guard is True,
                                        bucket_cap_mb=a.bucket_mb)
            if guard == "stock":  # torch's own Python allreduce hook: the cost of any Python comm hook
                from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
                ddp.register_comm_hook(None, allreduce_hook)
        runs[name] = {"model": model, "ddp": ddp, "opt": opt, "sched": sched, "T": T, "seconds": 0.0, "done": 0,
                      "local": guard == "local",
                      "params": sum(q.numel() for q in model.parameters())}
    g = torch.Generator(device=dev).manual_seed(rank)
    data = torch.randint(0, vocab, (4, a.batch, ctx + 1), device=dev, generator=g)

    def train_block(run: dict, n: int) -> None:
        sync_dev()
        t0 = time.perf_counter()
        for _ in range(n):
            b = data[run["done"] % 4]
            # local mode: no gradient all-reduce at all between converge steps (DDP's no_sync)
            with run["ddp"].no_sync() if run["local"] else contextlib.nullcontext():
                with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
                    logits = run["ddp"](b[:, :-1])
                loss = F.cross_entropy(logits.float().reshape(-1, vocab), b[:, 1:].reshape(-1))
                run["opt"].zero_grad(set_to_none=True)
                loss.backward()
            run["opt"].step()
            run["sched"].step(loss) if run["T"] else run["sched"].step()
            run["done"] += 1
        sync_dev()
        run["seconds"] += time.perf_counter() - t0

    warm = 10
    out = {"command": "torchrun --nproc-per-node {} benchmarks/ddp_overhead.py{}{}".format(
               world, " --tiny" * a.tiny, " --converge-only" * a.converge_only) + (f" --bucket-mb {a.bucket_mb:g}" if a.bucket_mb != 25 else ""),
           "world": world, "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
           "torch": torch.__version__, "python": platform.python_version(),
           "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
           "params": next(iter(runs.values()))["params"]}
    if not a.converge_only:
        out.update(step_times(runs, train_block, steps, warm, block, a, ctx))
    ens = next(r["sched"].ensemble for r in runs.values() if r["T"])
    if a.converge_only:
        train_block(next(r for r in runs.values() if r["T"]), 2)  # optimizer state exists, weights are real
    converge(out, ens, dev, a.reps, sync_dev)
    if rank == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def step_times(runs, train_block, steps, warm, block, a, ctx) -> dict:
    for run in runs.values():  # warm-up steps are not timed... but count against total_steps
        train_block(run, warm)
        run["seconds"] = 0.0
    while runs["plain"]["done"] < steps:
        n = min(block, steps - runs["plain"]["done"])
        for run in runs.values():  # round robin: the same GPU state for all
            train_block(run, n)
    timed = steps - warm
    return {"tokens_per_step_per_gpu": a.batch * ctx, "timed_steps": timed,
            "seconds": {k: r["seconds"] for k, r in runs.items()},
            "ms_per_step": {k: 1000 * r["seconds"] / timed for k, r in runs.items()},
            "ratio_to_plain": {k: r["seconds"] / runs["plain"]["seconds"] for k, r in runs.items() if r["T"]},
            "syncs": {k: sum(r["sched"].ensemble.is_sync_step(t) for t in range(warm + 1, steps + 1))
                      for k, r in runs.items() if r["T"]}}


def converge(out: dict, ens, dev, reps: int, sync_dev) -> None:
    """One converge step's averaging against the floor (one all_reduce of a ready flat buffer of the same
    bytes) and against the reference's loop of one all_reduce per parameter."""
    tensors = ens.tensors()
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    flat = torch.zeros(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device=dev)

    def timed_op(fn) -> float:
        times = []
        for _ in range(reps):
            dist.barrier()
            sync_dev()
            t0 = time.perf_counter()
            fn()
            sync_dev()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    t_avg = timed_op(lambda: ens.replicas.average_(tensors))
    t_flat = timed_op(lambda: dist.all_reduce(flat))
    t_loop = timed_op(lambda: [dist.all_reduce(t) for t in tensors])  # the reference's way (no division)
    out.update({"averaged_tensors": len(tensors), "averaged_mb": nbytes / 2**20,
                "ms_converge_average": 1000 * t_avg, "ms_flat_all_reduce": 1000 * t_flat,
                "ms_per_tensor_loop": 1000 * t_loop, "ratio_converge_to_flat": t_avg / t_flat,
                "ratio_loop_to_flat": t_loop / t_flat, "bucket_cap_mb": ens.replicas.cap_bytes / 2**20})


if __name__ == "__main__":
    main()
