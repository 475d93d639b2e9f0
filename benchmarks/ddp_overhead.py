"""HDET's cost against plain DDP + OneCycleLR, and a converge step against the bandwidth floor.

Run with torchrun on 2+ GPUs (NCCL; gloo on CPU for a smoke test with --tiny):

    torchrun --nproc-per-node 2 benchmarks/ddp_overhead.py            # GPT ~124M, bf16 autocast
    torchrun --nproc-per-node 2 benchmarks/ddp_overhead.py --tiny     # CPU smoke test

1. Step time, interleaved in one run: the models train side by side in blocks of --block steps, round
   robin (the order reversed every other round): plain DDP + OneCycleLR, a second plain model (the
   noise floor of the ratios), and HDET (alpha 0.2) at T = 100 and T = 1000 with the default gradient
   guard ("auto": "skip-all" for this fused AdamW, every gradient read), with "skip" (the sentinel gradients
   only: "auto" under on_runaway="recover"), with the comm-hook guard ("hook"), without a guard, with
   contiguous parameters (``hdet.contiguous_parameters_``) and in local mode (``ddp.no_sync()`` every
   step: no gradient all-reduce between converge steps). Ratios HDET / plain over the same steps (syncs
   included).
1b. The step's tail on the device (CUDA events on the compute stream, every timed step): from the end of the
   backward (DDP's all-reduce included) and the clip to the end of ``optimizer.step()`` and
   ``scheduler.step()``, median per model; HDET's minus plain's is what HDET adds after the backward,
   where nothing hides it (the optimizer step's own time is the same in every model). The clip is before the
   tail: a model clipping through ``scheduler.clip_grad_norm_`` (torch's clip, the norm handed to the guard)
   and plain's torch clip are outside it alike.
2. No host sync on non-sync steps: 2T more steps of the default HDET model with
   ``torch.cuda.set_sync_debug_mode("error")`` on every non-sync step (any host sync raises).
2b. A device timeline (``torch.profiler``, --profile-steps non-sync steps of every model): the device time
   of every kernel, summed per step, and the kernels HDET adds to plain's (by name); the added time over
   plain's step time is HDET's cost where step-time ratios cannot resolve it. The "skip" guard's check
   alone (CUDA events, on the model's real gradients): the shipped read-only check, the earlier
   read-and-write check (GradScaler's), a handed-over norm; and the check's verdict on planted NaN/Inf.
3. One converge step's averaging (``ProcessGroupReplicas.average_`` over the weights) against one
   all_reduce of a ready flat buffer of the same bytes (the floor): the model's own separate parameters
   (bucketed copies, 25 and 100 MB buckets), the same tensors laid out contiguously (in place, no copy),
   the reference's loop of one all_reduce per parameter, and that loop coalesced into one NCCL group
   (``_coalescing_manager``); medians of --reps.
Rank 0 prints one JSON line (and writes it to --out when given).
"""

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import hdet
from hdet.app.tasks import ByteGPT


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--block", type=int, default=50)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--only", default=None, help="comma list of HDET configs to run next to plain")
    p.add_argument("--converge-only", action="store_true", help="skip the step-time part (one HDET model)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the model's parameters (with --converge-only): fp16/bf16 are averaged in float32")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="HDET's averaging bucket size")
    p.add_argument("--out", default=None, help="also write the JSON line here (rank 0)")
    p.add_argument("--clip", type=float, default=None, help="every model clips its gradients to this norm")
    p.add_argument("--profile-steps", type=int, default=20, help="steps per model in the device timeline (0: none)")
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
    # name: (T, guard_gradients, local mode, contiguous parameters)
    configs = {"plain": (None, False, False, False), "plain_again": (None, False, False, False),
               "hdet_T100": (100, "auto", False, False),
               "hdet_T1000": (1000, "auto", False, False), "hdet_T100_hook": (100, "hook", False, False),
               "hdet_T100_noguard": (100, False, False, False), "hdet_T1000_noguard": (1000, False, False, False),
               "hdet_T100_contiguous": (100, "auto", False, True), "hdet_T100_local": (100, "auto", True, False),
               "hdet_T100_schedclip": (100, "auto", False, False), "hdet_T1000_schedclip": (1000, "auto", False, False),
               "hdet_T100_skipall": (100, "skip-all", False, False), "hdet_T100_sentinels": (100, "skip", False, False),
               "hdet_T1000_sentinels": (1000, "skip", False, False)}
    configs = {k: v for k, v in configs.items() if k == "plain" or a.only is None or k in a.only.split(",")}
    if a.converge_only:
        configs = {"hdet_T100": configs.get("hdet_T100", (100, "auto", False, False))}
    elif a.dtype != "float32":
        p.error("--dtype is for --converge-only (the step-time part trains float32 weights under bf16 autocast)")
    for name, (T, guard, local, contiguous) in configs.items():
        T = T if T is None or not a.tiny else T // 10
        torch.manual_seed(0)
        model = ByteGPT(ctx, d, layers, heads, vocab=vocab).to(dev, getattr(torch, a.dtype))  # GPT-2 small's shape
        if contiguous:
            hdet.contiguous_parameters_(model)
        ddp = DDP(model, device_ids=[dev.index] if cuda else None)
        opt = torch.optim.AdamW(ddp.parameters(), lr=6e-4, weight_decay=0.1, fused=True)
        if T is None:
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=6e-4, total_steps=steps + 300)
        else:  # (+300: room for the host-sync check's steps after the timed ones)
            sched = hdet.OneCycleAutoLR(opt, max_lr=6e-4, total_steps=steps + 300, ensemble_lr_spread_ratio=0.2,
                                        model_sync_interval=T, model=ddp, guard_gradients=guard,
                                        bucket_cap_mb=a.bucket_mb)
        runs[name] = {"model": model, "ddp": ddp, "opt": opt, "sched": sched, "T": T, "seconds": 0.0, "done": 0,
                      "local": local, "schedclip": name.endswith("_schedclip"), "guard": getattr(sched, "gradient_guard", None),
                      "params": sum(q.numel() for q in model.parameters())}
    g = torch.Generator(device=dev).manual_seed(rank)
    data = torch.randint(0, vocab, (4, a.batch, ctx + 1), device=dev, generator=g)

    def train_block(run: dict, n: int, check_sync: bool = False) -> int:
        start = run["seconds"]
        sync_dev()
        t0 = time.perf_counter()
        checked = 0
        for _ in range(n):
            b = data[run["done"] % 4]
            quiet = check_sync and not run["sched"].ensemble.is_sync_step(run["done"] + 1)
            if quiet:  # a non-sync step: any host-device sync raises
                torch.cuda.set_sync_debug_mode("error")
                checked += 1
            # local mode: no gradient all-reduce at all between converge steps (DDP's no_sync)
            with run["ddp"].no_sync() if run["local"] else contextlib.nullcontext():
                with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
                    logits = run["ddp"](b[:, :-1])
                loss = F.cross_entropy(logits.float().reshape(-1, vocab), b[:, 1:].reshape(-1))
                run["opt"].zero_grad(set_to_none=True)
                loss.backward()
            if a.clip is not None and run["schedclip"]:  # the clip's norm is the guard's verdict
                run["sched"].clip_grad_norm_(a.clip)
            elif a.clip is not None:
                torch.nn.utils.clip_grad_norm_(run["model"].parameters(), a.clip)
            tail = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else None
            if tail:  # the step's tail on the device: from the end of backward (and clip) to the next step
                tail[0].record()
            run["opt"].step()
            run["sched"].step(loss) if run["T"] else run["sched"].step()
            if tail:
                tail[1].record()
                run.setdefault("tails", []).append(tail)
            if quiet:
                torch.cuda.set_sync_debug_mode(0)
            run["done"] += 1
        sync_dev()
        run["seconds"] += time.perf_counter() - t0
        run.setdefault("blocks", []).append(run["seconds"] - start)
        return checked

    warm = 10
    out = {"command": f"torchrun --nproc-per-node {world} benchmarks/ddp_overhead.py " + " ".join(sys.argv[1:]),
           "world": world, "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
           "torch": torch.__version__, "python": platform.python_version(),
           "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
           "params": next(iter(runs.values()))["params"], "dtype": a.dtype,
           "guards": {k: r["guard"] for k, r in runs.items() if r["T"]}}
    if not a.converge_only:
        out.update(step_times(runs, train_block, steps, warm, block, a, ctx))
    main_run = next(r for r in runs.values() if r["T"])
    if a.converge_only:
        train_block(main_run, 2)  # optimizer state exists, weights are real
    if cuda:  # 2. no host sync on non-sync steps (the default guard included)
        out["sync_debug_mode_error"] = {"config": next(k for k, r in runs.items() if r is main_run),
                                        "guard": main_run["guard"],
                                        "non_sync_steps_checked": train_block(main_run, 2 * main_run["T"], True)}
    out["skip_guard_check"] = guard_cost(main_run, sync_dev)
    if a.profile_steps and not a.converge_only:
        out["timeline"] = timeline(runs, train_block, a.profile_steps, out["ms_per_step"]["plain"], cuda)
    converge(out, main_run["sched"].ensemble, dev, a.reps, sync_dev)
    if rank == 0:
        print(json.dumps(out), flush=True)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(out, f, indent=1)
    dist.destroy_process_group()


def step_times(runs, train_block, steps, warm, block, a, ctx) -> dict:
    """Round robin over the models in blocks of ``block`` steps, the order reversed every other round (no
    model always follows the same one). ``plain_again``, a second plain DDP model, measures the noise
    floor of the ratios in the same run. Ratios: total time, and the median over rounds of the per-round
    ratio to plain."""
    for run in runs.values():  # warm-up steps are not timed... but count against total_steps
        train_block(run, warm)
        run["seconds"], run["blocks"], run["tails"] = 0.0, [], []
    order, rnd = list(runs.values()), 0
    while runs["plain"]["done"] < steps:
        n = min(block, steps - runs["plain"]["done"])
        for run in (order if rnd % 2 == 0 else order[::-1]):  # the same GPU state for all
            train_block(run, n)
        rnd += 1
    timed = steps - warm
    plain = runs["plain"]
    tails = {}  # us: the optimizer step + the scheduler step, after the backward (and the clip) on the device
    for k, r in runs.items():
        if r.get("tails"):
            us = [1000 * e0.elapsed_time(e1) for e0, e1 in r["tails"]]
            tails[k] = {"median_us": statistics.median(us), "mean_us": statistics.fmean(us)}
    if tails:
        for k, v in tails.items():
            v["added_us_median"] = v["median_us"] - tails["plain"]["median_us"]
            v["added_fraction_of_plain_step"] = v["added_us_median"] / (1e6 * plain["seconds"] / timed)
    return {"tail_after_backward": tails, "tokens_per_step_per_gpu": a.batch * ctx, "timed_steps": timed, "rounds": rnd,
            "seconds": {k: r["seconds"] for k, r in runs.items()},
            "ms_per_step": {k: 1000 * r["seconds"] / timed for k, r in runs.items()},
            "ratio_to_plain": {k: r["seconds"] / plain["seconds"] for k, r in runs.items() if k != "plain"},
            "ratio_to_plain_median_of_rounds": {
                k: statistics.median(b / p for b, p in zip(r["blocks"], plain["blocks"]))
                for k, r in runs.items() if k != "plain"},
            "syncs": {k: sum(r["sched"].ensemble.is_sync_step(t) for t in range(warm + 1, steps + 1))
                      for k, r in runs.items() if r["T"]}}


def guard_cost(run: dict, sync_dev, n: int = 50) -> dict:
    """The "skip" guard's check alone on the model's real gradients, per call: host time to enqueue it, and
    the time until the device has run it; on CUDA also its device time (CUDA events) next to the earlier
    read-and-write check (GradScaler's ``_amp_foreach_non_finite_check_and_unscale_``) and a handed-over
    norm, and the shipped check's verdict with a NaN or Inf planted at several places."""
    guard, opt = run["sched"].skip_guard, run["opt"]
    if guard is None:
        return {}
    grads = [p.grad for p in run["model"].parameters() if p.grad is not None]
    sync_dev()
    t0 = time.perf_counter()
    for _ in range(n):
        guard._pre(opt, (), {})
        guard._post(opt, (), {})
    t_host = time.perf_counter() - t0
    sync_dev()
    t_done = time.perf_counter() - t0
    out = {"reads": guard.reads, "ms_host": 1000 * t_host / n, "ms_until_done": 1000 * t_done / n,
           "gradient_mb": sum(g.numel() * g.element_size() for g in grads) / 2**20}
    if grads[0].device.type != "cuda":
        return out
    from guard_check_cost import verdicts  # benchmarks/, the script's own folder

    from hdet.guard import _nonfinite

    found, one = torch.zeros((), device=grads[0].device), torch.ones((), device=grads[0].device)
    norm = torch.nn.utils.clip_grad_norm_(grads, 1e9)

    def device_ms(fn) -> float:
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / n

    out["device_ms"] = {
        "shipped_readonly_inf_norm": device_ms(lambda: _nonfinite(grads, found)),
        "guard_pre_hook_readonly": device_ms(lambda: (guard._pre(opt, (), {}), guard._post(opt, (), {}))),
        **{f"guard_pre_hook_reads_{reads}": device_ms(lambda: (setattr(guard, "reads", reads), guard._pre(opt, (), {}),
                                                              guard._post(opt, (), {})))
           for reads in ("sentinels", "all")},
        **({"earlier_amp_read_write": device_ms(lambda: torch._amp_foreach_non_finite_check_and_unscale_(
            grads, found, one))} if grads[0].dtype == torch.float32 else {}),  # (CUDA's has no bf16 kernel)
        "handed_over_norm": device_ms(lambda: (guard.use_norm(norm, grads), guard._pre(opt, (), {}),
                                               guard._post(opt, (), {})))}
    guard.reads = out["reads"]  # (the loop above switched it)
    out["verdicts_true_means_nonfinite"] = verdicts(grads, found)  # planted NaN/Inf, restored after
    return out


def _annotate(run: dict) -> None:
    """Run HDET's own calls of ``run`` inside profiler ranges: its scheduler's ``step`` and the hooks it registered
    on the optimizer (the gradient guard's)."""
    from torch.profiler import record_function

    def ranged(name, fn):
        def call(*args, **kwargs):
            with record_function(name):
                return fn(*args, **kwargs)
        return call

    run["sched"].step = ranged("hdet::scheduler.step", run["sched"].step)
    for hooks, name in ((run["opt"]._optimizer_step_pre_hooks, "hdet::optimizer_pre_hooks"),
                        (run["opt"]._optimizer_step_post_hooks, "hdet::optimizer_post_hooks")):
        for key, fn in list(hooks.items()):
            hooks[key] = ranged(name, fn)


def timeline(runs: dict, train_block, k: int, plain_ms: float, cuda: bool = True) -> dict:
    """``k`` non-sync steps of every model under ``torch.profiler``: per kernel name, launches and device
    time per step. What HDET adds to plain is counted by launches, not by summed time (the same GEMMs run
    a few percent slower or faster from one model to the next as NCCL's kernels contend with them): every
    kernel launched more often per step than in plain adds its extra launches at its own mean duration.
    ``added_fraction_of_plain_step``: that time over plain's measured step time (an upper bound: added
    kernels may overlap communication; and a small kernel that shares its name with big ones, a scalar add
    beside the residual adds, is counted at their mean). ``hdet_ranges_us_per_step``: HDET's own calls (the
    scheduler's step, the guard's optimizer hooks) run inside ``record_function`` ranges, and the device time
    of the kernels each range launched, per step: what HDET's own code costs on the device, exactly, but not
    what it costs other kernels (none run in parallel with these on the compute stream). On CPU (a smoke
    test) the same with operators' CPU time."""
    from torch.profiler import ProfilerActivity, profile

    per, ranges = {}, {}
    for name, run in runs.items():
        sched = run["sched"]
        if run["T"]:
            _annotate(run)
        while run["T"] and any(sched.ensemble.is_sync_step(run["done"] + i) for i in range(1, k + 1)):
            train_block(run, 1)  # move past the next converge step: the timeline is of ordinary steps
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:  # (CPU: the ranges)
            train_block(run, k)
        kernels: dict[str, list[float]] = {}  # name: [launches per step, us per step]
        # (the host-side range: the device time of the kernels launched inside it; the profiler also records each
        # range's span on the GPU under the same name, which is no kernel and is left out here and below)
        ranges[name] = {e.key: (getattr(e, "device_time_total", 0.0) if cuda else e.cpu_time_total) / k
                        for e in prof.key_averages() if e.key.startswith("hdet::") and e.device_type.name == "CPU"}
        for e in prof.key_averages():
            us = getattr(e, "self_device_time_total", 0.0) if cuda else e.self_cpu_time_total
            annotation = getattr(e, "is_user_annotation", False) or e.key.startswith(("hdet::", "Optimizer."))
            if us and (not cuda or e.device_type.name == "CUDA") and not annotation:
                c = kernels.setdefault(e.key, [0.0, 0.0])
                c[0] += e.count / k
                c[1] += us / k
        per[name] = kernels
    out = {}
    plain = per["plain"]

    def total(ks: dict, nccl: bool) -> float:
        return sum(v[1] for n, v in ks.items() if ("nccl" in n.lower()) == nccl) / 1000

    for name, ks in per.items():
        row = {"device_ms_per_step": total(ks, False), "nccl_ms_per_step": total(ks, True),
               "launches_per_step": sum(v[0] for n, v in ks.items() if "nccl" not in n.lower())}
        if name != "plain":
            added = {}
            for n, (c, us) in ks.items():
                extra = c - plain.get(n, [0.0, 0.0])[0]
                if extra > 1e-9 and "nccl" not in n.lower():
                    added[n[:200]] = {"extra_launches_per_step": extra, "us_per_step": extra * us / c}
            row["added_ms_per_step"] = sum(v["us_per_step"] for v in added.values()) / 1000
            row["added_fraction_of_plain_step"] = row["added_ms_per_step"] / plain_ms
            row["added_kernels"] = dict(sorted(added.items(), key=lambda x: -x[1]["us_per_step"]))
        if ranges.get(name):
            row["hdet_ranges_us_per_step"] = ranges[name]
            row["hdet_ranges_us_total"] = sum(ranges[name].values())
            row["hdet_ranges_fraction_of_plain_step"] = sum(ranges[name].values()) / 1000 / plain_ms
        out[name] = row
    out["steps_profiled"] = k
    return out


def converge(out: dict, ens, dev, reps: int, sync_dev) -> None:
    """One converge step's averaging against the floor (one all_reduce of a ready flat buffer of the same
    bytes): separate parameters (bucketed copies), contiguous ones (in place), the reference's loop of one
    all_reduce per parameter, and that loop in one NCCL group."""
    tensors = ens.tensors()
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    flat = torch.zeros(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device=dev)
    flat32 = flat.float()  # fp16/bf16 weights are averaged in float32: this is their floor
    cont = torch.cat([t.detach().reshape(-1) for t in tensors])  # the same tensors laid out back to back
    views, o = [], 0  # (what hdet.contiguous_parameters_ does)
    for t in tensors:
        views.append(cont[o:o + t.numel()].view_as(t))
        o += t.numel()
    big = hdet.ProcessGroupReplicas(bucket_cap_mb=100)

    def timed_op(fn) -> float:
        fn()  # one untimed call (first-use set-up of the communicator for this buffer)
        times = []
        for _ in range(reps):
            dist.barrier()
            sync_dev()
            t0 = time.perf_counter()
            fn()
            sync_dev()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def coalesced() -> None:
        with dist._coalescing_manager(device=dev, async_ops=True) as cm:
            for t in tensors:
                dist.all_reduce(t)
        cm.wait()

    ms = {"converge_separate": timed_op(lambda: ens.replicas.average_(tensors)),
          "converge_separate_100mb": timed_op(lambda: big.average_(tensors)),
          "converge_contiguous": timed_op(lambda: ens.replicas.average_(views)),
          "flat_all_reduce": timed_op(lambda: dist.all_reduce(flat)),
          "flat_all_reduce_float32": timed_op(lambda: dist.all_reduce(flat32)),  # (= flat for float32 weights)
          "per_tensor_loop": timed_op(lambda: [dist.all_reduce(t) for t in tensors])}  # the reference's way
    try:
        ms["per_tensor_coalesced"] = timed_op(coalesced)
    except Exception as e:  # noqa: BLE001 - a private torch API: record why it did not run
        out["per_tensor_coalesced_error"] = f"{type(e).__name__}: {e}"
    out.update({"averaged_tensors": len(tensors), "averaged_mb": nbytes / 2**20,
                "bucket_cap_mb": ens.replicas.cap_bytes / 2**20,
                "ms": {k: 1000 * v for k, v in ms.items()},
                "ratio_to_flat": {k: v / ms["flat_all_reduce"] for k, v in ms.items() if k != "flat_all_reduce"}})


if __name__ == "__main__":
    main()
