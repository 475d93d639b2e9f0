"""Throughput of the one-process engine: N replicas of a small GPT against one copy at N x the batch.

Same FLOPs per step on both sides: the engine runs N replicas on B sequences each; the baseline runs one
model (AdamW + OneCycleLR, no hdet) on N * B sequences. Each timed step is forward + backward +
optimizer + scheduler (the engine also averages gradients across replicas and weights every T steps).
Reported: tokens/s of each and the ratio engine / baseline, for the vmap fast path and the loop
fallback, plus peak GPU memory and the optimizer state's bytes. A mode ending in ``/per-replica`` runs the
engine with ``stacked_optimizer=False`` (each replica's own ``optimizer.step()``), the engine before issue 19.
Writes JSON (with the command, device, versions) to --out.

    python benchmarks/engine_throughput.py --out benchmarks/results/gpu_h100/engine_throughput.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

import hdet
import hdet.kernels
import hdet.linear
from hdet.engine import ReplicaEngine
from hdet.app.tasks import ByteGPT


SIZES = {"tiny": dict(d=128, layers=2, heads=4, ctx=64, B=16),  # B: sequences a replica
         "small": dict(d=384, layers=6, heads=6, ctx=256, B=8),
         "medium": dict(d=768, layers=8, heads=12, ctx=256, B=8)}


def lm_loss(m, b):
    logits = m(b[..., :-1])
    return F.cross_entropy(logits.reshape(-1, 256), b[..., 1:].reshape(-1))


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_steps(step, n_warm: int, n_timed: int, device) -> float:
    for _ in range(n_warm):
        step()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(n_timed):
        step()
    sync(device)
    return (time.perf_counter() - t0) / n_timed


def bench(size: dict, N: int, B: int, steps: int, warm: int, T: int, device, modes: list[str], optim: str,
          engine_attn: str = "auto", compile_kwargs: dict | None = None, autocast: str = "none") -> dict:
    ctx = size["ctx"]
    g = torch.Generator(device=device).manual_seed(0)
    data = torch.randint(0, 256, (N * B * 4, ctx + 1), device=device, generator=g)
    out = {"size": size, "N": N, "batch_per_replica": B, "tokens_per_step": N * B * ctx, "T": T, "optimizer": optim,
           "engine_attention": engine_attn, "autocast": autocast}
    amp = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if autocast == "bf16" else contextlib.nullcontext
    kw = {"fused": True} if optim == "fused" else {"foreach": True}
    total = warm + steps + 4  # compiled modes warm up 3 more steps

    def fresh_model(attn="auto"):
        torch.manual_seed(0)
        return ByteGPT(ctx, size["d"], size["layers"], size["heads"], attn=attn).to(device)

    for key, base_attn, comp in (("baseline", "auto", False), ("baseline_math_attention", "math", False),
                                 ("baseline_compiled", "auto", True)):
        if comp and not any("+compile" in m for m in modes):
            continue
        out[key] = bench_single(fresh_model(base_attn), data, N, B, ctx, total, warm, steps, device, kw,
                                comp and (compile_kwargs or True), amp)
    out["params"] = sum(p.numel() for p in fresh_model().parameters())
    for mode in modes:
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine_mode, _, path = mode.partition("/")
            fused_passes, per_replica_min, native_max = (hdet.kernels.AVAILABLE, hdet.linear.PER_REPLICA_MIN,
                                                         hdet.linear.NATIVE_MAX)
            norm_usable = hdet.kernels.layer_norm_usable
            try:  # (every toggle put back, whatever fails: the next mode measures the code as it is)
                hdet.kernels.AVAILABLE = fused_passes and path != "torch-passes"  # ("/torch-passes": no hdet.kernels)
                if path == "baddbmm":  # ("/baddbmm": every linear layer one baddbmm, none one addmm per replica)
                    hdet.linear.PER_REPLICA_MIN = float("inf")
                if path == "native":  # ("/native": every merged linear layer torch's baddbmm, autograd's backward)
                    hdet.linear.NATIVE_MAX = float("inf")
                if path == "function":  # ("/function": every merged linear layer hdet's autograd.Function)
                    hdet.linear.NATIVE_MAX = 0
                if path == "torchnorm":  # ("/torchnorm": the merged layer norms in torch's ops, in graphs too)
                    hdet.kernels.layer_norm_usable = lambda *x: False
                eng = ReplicaEngine(
                    fresh_model(engine_attn), N, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, **kw),
                    lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=1e-3, total_steps=total,
                                                          ensemble_lr_spread_ratio=0.2, model_sync_interval=T,
                                                          replicas=rep, model=m),
                    mode=engine_mode.split("+")[0],
                    compile=engine_mode.endswith("+compile") and (compile_kwargs or True),
                    cuda_graph=engine_mode.endswith("+graph"), stacked_optimizer=path != "per-replica")
                j = [0]

                def eng_step():
                    b = data[(j[0] % 4) * N * B: (j[0] % 4 + 1) * N * B].view(N, B, ctx + 1)
                    j[0] += 1
                    with amp():
                        eng.step(b, lm_loss, stacked=True)

                dt = time_steps(eng_step, warm + (3 if "+" in mode else 0), steps, device)
            finally:
                hdet.kernels.AVAILABLE, hdet.linear.PER_REPLICA_MIN = fused_passes, per_replica_min
                hdet.linear.NATIVE_MAX = native_max
                hdet.kernels.layer_norm_usable = norm_usable
        out[mode] = {"seconds_per_step": dt, "tokens_per_s": N * B * ctx / dt,
                     "ratio_to_baseline": out["baseline"]["seconds_per_step"] / dt,
                     "ratio_to_baseline_math_attention": out["baseline_math_attention"]["seconds_per_step"] / dt,
                     **({"ratio_to_baseline_compiled": out["baseline_compiled"]["seconds_per_step"] / dt}
                        if "baseline_compiled" in out else {}),
                     "engine_mode": eng.mode, "optimizer_path": eng.optimizer_path,
                     "optimizer_state_bytes": state_bytes(eng.optimizers),
                     "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
                     "warnings": sorted({str(w.message)[:200] for w in caught})}
        eng = None  # free it before the next mode
    return out


def state_bytes(optimizers) -> int:
    """Bytes of optimizer state (each storage counted once: the stacked step shares one copy)."""
    seen = {}
    for o in optimizers:
        for st in o.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    seen[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
    return sum(seen.values())


def bench_single(model, data, N, B, ctx, total, warm, steps, device, kw, comp=False,
                 amp=contextlib.nullcontext) -> dict:
    """One model (plain AdamW + OneCycleLR, no hdet) at N x B sequences per step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **kw)
    if comp:
        model = torch.compile(model, **(comp if isinstance(comp, dict) else {}))
        warm += 3
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=total)
    i = [0]

    def base_step():
        b = data[(i[0] % 4) * N * B: (i[0] % 4 + 1) * N * B]
        i[0] += 1
        with amp():  # (the whole step, as the engine's)
            loss = lm_loss(model, b)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    dt = time_steps(base_step, warm, steps, device)
    return {"seconds_per_step": dt, "tokens_per_s": N * B * ctx / dt, "optimizer_state_bytes": state_bytes([opt]),
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warm", type=int, default=5)
    p.add_argument("--T", type=int, default=25)
    p.add_argument("--sizes", default="small", help="comma list of: tiny, small, medium")
    p.add_argument("--modes", default="vmap,vmap+compile,loop,vmap/per-replica",
                   help="comma list of vmap, vmap+compile, merged, merged+graph (cuda_graph=True), loop, each with an "
                        "optional /per-replica (per-replica optimizers), /torch-passes (the stacked step and the "
                        "gradients' mean in torch's ops, not hdet.kernels' fused passes), /baddbmm (every linear layer "
                        "one baddbmm, none one addmm per replica: hdet.linear.PER_REPLICA_MIN) or /torchnorm (the "
                        "merged layer norms in torch's ops: hdet.kernels.layer_norm_usable)")
    p.add_argument("--optimizers", default="fused,foreach", help="AdamW implementations to run (comma list)")
    p.add_argument("--engine-attn", default="auto", choices=["auto", "sdpa", "math"],
                   help="the engine's attention (ByteGPT attn=): auto is explicit attention under vmap")
    p.add_argument("--compile-kwargs", default=None, type=json.loads,
                   help='torch.compile keyword arguments for every compiled mode, one model\'s included (JSON, e.g. '
                        '\'{"mode": "reduce-overhead"}\')')
    p.add_argument("--autocast", default="none", choices=["none", "bf16"],
                   help="bf16: every step (one model's and the engine's) under torch.autocast(bfloat16)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    results = []
    for optim in a.optimizers.split(","):
        for name in a.sizes.split(","):
            s = dict(SIZES[name])
            B = s.pop("B")
            try:
                r = bench({**s, "name": name}, a.replicas, B, a.steps, a.warm, a.T, device, a.modes.split(","), optim,
                          a.engine_attn, a.compile_kwargs, a.autocast)
            except Exception as e:  # noqa: BLE001 - a configuration that cannot run is a result too
                print(json.dumps({"size": name, "optimizer": optim, "error": f"{type(e).__name__}: {e}"[:500]}))
                results.append({"size": {**s, "name": name}, "optimizer": optim, "engine_attention": a.engine_attn,
                                "error": f"{type(e).__name__}: {e}"[:2000]})
                continue
            print(json.dumps({"size": name, "optimizer": optim, "params": r["params"],
                              **{m: {k: round(v, 4) for k, v in r[m].items() if k.startswith(("ratio", "tokens"))}
                                 for m in ("baseline", "baseline_compiled", *a.modes.split(",")) if m in r}}),
                  flush=True)
            results.append(r)
    rec = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name() if device.type == "cuda"
           else platform.processor() or "cpu", "python": platform.python_version(), "torch": torch.__version__,
           "hdet": hdet.__version__, "tf32": device.type == "cuda", "results": results}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
