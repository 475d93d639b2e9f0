"""Host time of one Triton launch, and of its parts, against torch's ops (issue 19: the fused layer norm stays out of
eager steps because its launches cost more host time than torch's seven ops).

On a CUDA device, with tensors small enough that the device never bounds the loop (the wall time a call is the host's):
the layer norm's forward kernel through Triton's JIT launch (``kernel[grid](...)``: its argument binder, cache key and
launch), through the compiled kernel's own launcher (``compiled.run(...)``, the key and binder skipped), the binder
alone, and torch's forward ops for the same norm; then the whole fused norm (forward and backward through autograd)
against torch's. Writes JSON with the command, machine and versions.

    python benchmarks/triton_launch.py --out $OUT/triton_launch.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import hdet
from hdet import kernels
from hdet import merged as hm


def per_call_us(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--shape", default="8,64,768", help="N,R,D of the norm's input (small: the host bounds it)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    import triton

    from hdet import _triton_kernels as tk

    dev = torch.device("cuda")
    N, R, D = map(int, a.shape.split(","))
    x = torch.randn(N, R, D, device=dev)
    w, b = torch.randn(N, D, device=dev), torch.randn(N, D, device=dev)
    assert kernels._ready(dev)
    y, mean, rstd = torch.empty_like(x), torch.empty(N * R, device=dev), torch.empty(N * R, device=dev)
    block = triton.next_power_of_2(D)
    warps = tk._ln_warps(block)
    args = (x, y, w, b, mean, rstd, D, R, w.stride(0), b.stride(0), 1e-5)
    grid = (N * R,)
    compiled = tk._ln_forward_kernel[grid](*args, BLOCK=block, num_warps=warps)
    all_args = (*args, block)  # (the compiled launcher takes the constexprs too, in the signature's order)
    stream = torch.cuda.current_stream().cuda_stream
    fn_run = compiled.run  # (the property loads its handles)

    def direct():
        fn_run(N * R, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *all_args)

    binder = tk._ln_forward_kernel.device_caches[torch.cuda.current_device()][-1]  # (Triton 3.6's cache tuple)
    ref = y.clone()
    y.zero_()
    direct()
    torch.cuda.synchronize()
    same = bool(torch.equal(y, ref))
    results = {
        "triton_jit_launch": per_call_us(lambda: tk._ln_forward_kernel[grid](*args, BLOCK=block, num_warps=warps),
                                         a.calls),
        "triton_compiled_run": per_call_us(direct, a.calls),
        "triton_binder_only": per_call_us(lambda: binder(*args, BLOCK=block, num_warps=warps), a.calls),
        "torch_empty_like": per_call_us(lambda: torch.empty_like(x), a.calls),
        "torch_norm_then_affine_forward": per_call_us(
            lambda: hm._affine(F.layer_norm(x.view(N, R, D), (D,), None, None, 1e-5), w, b, 1), a.calls),
        "hdet_layer_norm_rows_forward": per_call_us(lambda: kernels.layer_norm_rows(x, w, b, 1e-5), a.calls),
    }
    xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, b))
    dy = torch.randn_like(x)

    def fused_fb():
        hm._ReplicaLayerNorm.apply(xg, wg, bg, 1e-5).backward(dy)

    def torch_fb():
        hm._affine(F.layer_norm(xg, (D,), None, None, 1e-5), wg, bg, 1).backward(dy)

    _, m2, r2 = kernels.layer_norm_rows(x, w, b, 1e-5)
    results["hdet_layer_norm_rows_backward"] = per_call_us(
        lambda: kernels.layer_norm_rows_backward(dy, x, w, m2, r2), a.calls)
    rows = triton.cdiv(R, max(1, min(R, 512 // N)))
    parts = triton.cdiv(R, rows)
    dx, dwp, dbp = torch.empty_like(x), torch.empty(N, parts, D, device=dev), torch.empty(N, parts, D, device=dev)
    results["triton_backward_jit_launch"] = per_call_us(
        lambda: tk._ln_backward_kernel[(N, parts)](x, dy, dx, w, m2, r2, dwp, dbp, D, R, w.stride(0), rows,
                                                   BLOCK=block, num_warps=warps), a.calls)
    results["torch_two_sums"] = per_call_us(lambda: (dwp.sum(1).to(w.dtype), dbp.sum(1).to(w.dtype)), a.calls)

    def fused_f_only():
        with torch.no_grad():
            hm._ReplicaLayerNorm.apply(xg, wg, bg, 1e-5)

    results["fused_autograd_forward_no_grad"] = per_call_us(fused_f_only, a.calls)
    results["fused_forward_backward"] = per_call_us(fused_fb, a.calls // 2)

    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):  # noqa: ANN001, ANN205
            return t.view_as(t)

        @staticmethod
        def backward(ctx, g):  # noqa: ANN001, ANN205
            return g

    results["python_identity_forward_backward"] = per_call_us(lambda: Identity.apply(xg).backward(dy), a.calls // 2)
    results["torch_identity_forward_backward"] = per_call_us(lambda: (xg * 1.0).backward(dy), a.calls // 2)
    torch.autograd.set_multithreading_enabled(False)  # (the backward on this thread, not autograd's device thread)
    results["fused_forward_backward_one_thread"] = per_call_us(fused_fb, a.calls // 2)
    results["torch_forward_backward_one_thread"] = per_call_us(torch_fb, a.calls // 2)
    results["python_identity_forward_backward_one_thread"] = per_call_us(lambda: Identity.apply(xg).backward(dy),
                                                                         a.calls // 2)
    torch.autograd.set_multithreading_enabled(True)
    results["torch_forward_backward"] = per_call_us(torch_fb, a.calls // 2)
    rounds = {"fused": [], "torch": []}  # interleaved, so that the host's drift falls on both alike
    for _ in range(5):
        rounds["fused"].append(per_call_us(fused_fb, a.calls // 4))
        rounds["torch"].append(per_call_us(torch_fb, a.calls // 4))
    results["interleaved_forward_backward_rounds"] = rounds
    rec = {"command": "python " + " ".join(sys.argv), "python": platform.python_version(), "torch": torch.__version__,
           "triton": triton.__version__, "hdet": hdet.__version__, "gpu": torch.cuda.get_device_name(),
           "cpu": next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                   if ln.startswith("model name")), platform.machine()), "cpus": os.cpu_count(), "shape": [N, R, D],
           "compiled_run_same_output": same, "host_us_per_call": results}
    print(json.dumps(rec, indent=1))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
