"""Where does an engine step's time go on the GPU, against one model at N x the batch?

For each size: wall time a step (no profiler), then ``torch.profiler`` over a few steps of each: device time a
step (summed kernel time), host time a step, and the kernels by device time. Writes JSON (with the command,
device, versions) to --out and prints the tables.

    python benchmarks/profile_engine.py --sizes tiny,small,medium --out profile.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import hdet
import hdet.kernels
import hdet.linear
import hdet.stacking
from hdet.engine import ReplicaEngine
from hdet.app.tasks import ByteGPT

import engine_throughput as et  # same folder


def kernels(prof, steps: int, rows: int) -> tuple[float, list[dict]]:
    """Summed device time a step (us) and the top kernels by it."""
    out, total = [], 0.0
    for e in prof.key_averages():
        if e.device_type != torch.autograd.DeviceType.CUDA:  # kernels only (an op's time is its kernels')
            continue
        dt = getattr(e, "self_device_time_total", None)
        dt = e.self_cuda_time_total if dt is None else dt
        total += dt
        out.append({"name": e.key[:120], "us_per_step": dt / steps, "calls_per_step": e.count / steps})
    out.sort(key=lambda r: -r["us_per_step"])
    return total / steps, out[:rows]


def ops(step, steps: int, rows: int) -> list[dict]:
    """The aten ops by the device time of the kernels they launch (self)."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    out = []
    for e in prof.key_averages():
        dt = getattr(e, "self_device_time_total", None)
        dt = e.self_cuda_time_total if dt is None else dt
        if e.device_type == torch.autograd.DeviceType.CUDA or not dt:
            continue
        out.append({"op": e.key, "us_per_step": dt / steps, "calls_per_step": e.count / steps})
    out.sort(key=lambda r: -r["us_per_step"])
    return out[:rows]


def measure(step, steps: int, rows: int) -> dict:
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    dev, top = kernels(prof, steps, rows)
    launches = sum(e.count for e in prof.key_averages() if e.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                                     "cudaLaunchKernelExC")) / steps
    return {"wall_ms": wall * 1e3, "device_ms": dev / 1e3, "launches_per_step": launches, "top_kernels": top}


reduce_default = hdet.stacking._reduce_in_backward
copy_default = hdet.stacking._copy_into_bound
per_replica_default = hdet.linear.PER_REPLICA_MIN
norm_default = hdet.kernels.layer_norm_usable


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="small")
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--variants", default="default",
                   help="comma list of engine variants: default, reduce (the backward's gradients summed where "
                        "they lie, hdet.stacking._reduce_in_backward forced on), accumulate (the bound gradients "
                        "accumulated into, hdet.stacking._copy_into_bound off), layout (gradient_layout=True), merged "
                        "(mode='merged'), baddbmm (every linear layer one baddbmm: hdet.linear.PER_REPLICA_MIN), "
                        "torchnorm (the merged layer norms in torch's ops, not hdet.kernels', in graphs too), "
                        "eagernorm (hdet.kernels' in eager steps too: EAGER_LAYER_NORM), onethread (the engine's step under "
                        "torch.autograd.set_multithreading_enabled(False): its backward on the calling thread, not "
                        "autograd's device thread), joined with +")
    p.add_argument("--ops", type=int, default=0, help="also list this many aten ops by their kernels' device time "
                   "(a second profile)")
    p.add_argument("--autocast", default="none", choices=["none", "bf16"], help="bf16: every step under autocast")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if a.autocast == "bf16" else contextlib.nullcontext
    res = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "python": platform.python_version(), "sizes": {}}
    for name in a.sizes.split(","):
        s = et.SIZES[name]
        N, B, ctx = a.replicas, s["B"], s["ctx"]
        data = torch.randint(0, 256, (N * B, ctx + 1), device=dev)

        def fresh():
            torch.manual_seed(0)
            return ByteGPT(ctx, s["d"], s["layers"], s["heads"]).to(dev)
        one = fresh()
        opt = torch.optim.AdamW(one.parameters(), lr=1e-3, fused=True)
        sch = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=10_000)

        def base():
            with amp():  # (the whole step, as the engine's)
                loss = et.lm_loss(one, data)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sch.step()
        r = {"baseline": measure(base, a.steps, a.rows)}
        if a.ops:
            r["baseline"]["top_ops"] = ops(base, a.steps, a.ops)
        for v in a.variants.split(","):
            hdet.stacking._reduce_in_backward = (lambda d: True) if "reduce" in v else reduce_default
            hdet.stacking._copy_into_bound = (lambda d: False) if "accumulate" in v else copy_default
            eng = ReplicaEngine(fresh(), N, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True),
                                lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=1e-3, total_steps=10_000,
                                                                      ensemble_lr_spread_ratio=0.2,
                                                                      model_sync_interval=1000, replicas=rep, model=m),
                                mode="merged" if "merged" in v else "vmap", gradient_layout="layout" in v)
            hdet.linear.PER_REPLICA_MIN = float("inf") if "baddbmm" in v else per_replica_default
            hdet.kernels.layer_norm_usable = (lambda *x: False) if "torchnorm" in v else norm_default
            hdet.kernels.EAGER_LAYER_NORM = "eagernorm" in v

            def eng_step(v=v):
                with amp(), torch.autograd.set_multithreading_enabled("onethread" not in v):
                    eng.step(data.view(N, B, ctx + 1), et.lm_loss, stacked=True)
            r[v] = measure(eng_step, a.steps, a.rows)
            if a.ops:
                r[v]["top_ops"] = ops(eng_step, a.steps, a.ops)
            r[v]["engine_mode"] = eng.mode
            r[v]["wall_ratio"] = r["baseline"]["wall_ms"] / r[v]["wall_ms"]
            r[v]["device_ratio"] = r["baseline"]["device_ms"] / r[v]["device_ms"]
            eng = None
            torch.cuda.empty_cache()
        hdet.stacking._reduce_in_backward = reduce_default
        hdet.stacking._copy_into_bound = copy_default
        hdet.linear.PER_REPLICA_MIN = per_replica_default
        hdet.kernels.layer_norm_usable = norm_default
        hdet.kernels.EAGER_LAYER_NORM = False
        res["sizes"][name] = r
        for v in ["baseline", *a.variants.split(",")]:
            x = r[v]
            print(f"== {name} {v}: wall {x['wall_ms']:.2f} ms (ratio {x.get('wall_ratio', 1):.3f}), device "
                  f"{x['device_ms']:.2f} ms (ratio {x.get('device_ratio', 1):.3f}), {x['launches_per_step']:.0f} launches")
            for k in x["top_kernels"][:a.rows]:
                print(f"{k['us_per_step']:9.1f} us {k['calls_per_step']:6.1f}x  {k['name'][:90]}")
            for k in x.get("top_ops", []):
                print(f"  op {k['us_per_step']:9.1f} us {k['calls_per_step']:6.1f}x  {k['op']}")
        one = opt = None
        torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
