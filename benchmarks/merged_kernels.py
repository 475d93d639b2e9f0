"""Candidate kernels for the engine's per-replica layers on one GPU (issue 19): forward + backward of

* a linear layer with one weight and bias per replica (``y[r] = x[r] @ w[r]^T + b[r]``):
  ``baddbmm`` over the broadcast bias (hdet's until 2026-11-30: the bias is first copied into the output through
  torch's strided copy kernel), the output initialised by an outer product (``ones @ b``, a GEMM) and then
  ``baddbmm_`` in place, ``bmm`` then a broadcast ``add_``, and one ``addmm`` per replica into a slice of the
  output (cuBLASLt's bias epilogue);
* a LayerNorm with one weight and bias per replica: the norm without affine then ``addcmul`` with the broadcast
  weights (hdet's until 2026-11-30: torch's strided elementwise kernels), and one ``native_layer_norm`` per replica
  (the affine fused, as one model's) joined by ``torch.cat``, its backward one ``native_layer_norm_backward`` per
  replica.

Each variant's device time (its kernels' summed time under ``torch.profiler``, 50 calls) and wall time a call
(issuing and running, the host's time where it is the slower), at the engine benchmark's shapes (N = 8; tiny, small and medium ``ByteGPT``), float32 (TF32 on) and
bfloat16. Writes JSON with the command, device and versions.

    python benchmarks/merged_kernels.py --out merged_kernels.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/src")
from hdet.linear import batched_linear  # noqa: E402
from hdet import merged as hm  # noqa: E402
from hdet import kernels  # noqa: E402


def baddbmm_bias(x, w, b):  # hdet's until now
    return batched_linear(x, w, b)


class _Linear(torch.autograd.Function):
    """The candidates' common backward (hdet's: dx = dy W, dW = dy^T x in W's layout, db = sum dy); a subclass's
    forward saves (x, w) and computes y."""

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        return torch.bmm(dy, w), torch.bmm(dy.transpose(1, 2), x), dy.sum(1)


class _OuterInit(_Linear):
    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        ones = torch.ones(x.shape[0], x.shape[1], 1, device=x.device, dtype=x.dtype)
        y = torch.bmm(ones, b.unsqueeze(1))
        return y.baddbmm_(x, w.transpose(1, 2))


class _AddAfter(_Linear):
    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return torch.bmm(x, w.transpose(1, 2)).add_(b.unsqueeze(1))


class _PerReplicaAddmm(_Linear):
    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        y = torch.empty(x.shape[0], x.shape[1], w.shape[1], device=x.device, dtype=x.dtype)
        for r in range(x.shape[0]):
            torch.addmm(b[r], x[r], w[r].t(), out=y[r])
        return y


LINEARS = {"baddbmm_broadcast_bias": baddbmm_bias, "outer_product_init": _OuterInit.apply,
           "bmm_then_add": _AddAfter.apply, "addmm_per_replica": _PerReplicaAddmm.apply}


def ln_affine_after(x, w, b, eps=1e-5):  # hdet's until now
    return hm._affine(F.layer_norm(x, (x.shape[-1],), None, None, eps), w, b, 1)


class _LNPerReplica(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, eps):
        outs, means, rstds = [], [], []
        for r in range(x.shape[0]):
            o, m, s = torch.native_layer_norm(x[r], (x.shape[-1],), w[r], b[r], eps)
            outs.append(o), means.append(m), rstds.append(s)
        ctx.save_for_backward(x, w, b, torch.stack(means), torch.stack(rstds))
        return torch.stack(outs)

    @staticmethod
    def backward(ctx, dy):
        x, w, b, mean, rstd = ctx.saved_tensors
        dxs, dws, dbs = [], [], []
        for r in range(x.shape[0]):
            dx, dw, db = torch.ops.aten.native_layer_norm_backward(dy[r], x[r], (x.shape[-1],), mean[r], rstd[r],
                                                                   w[r], b[r], [True, True, True])
            dxs.append(dx), dws.append(dw), dbs.append(db)
        return torch.stack(dxs), torch.stack(dws), torch.stack(dbs), None


def ln_per_replica(x, w, b, eps=1e-5):
    return _LNPerReplica.apply(x, w, b, eps)


def ln_fused(x, w, b, eps=1e-5):  # hdet's since 2026-11-30 on CUDA (float32, large enough: hdet.kernels)
    return hm._ReplicaLayerNorm.apply(x, w, b, eps)


NORMS = {"norm_then_addcmul": ln_affine_after, "native_per_replica": ln_per_replica, "fused_triton": ln_fused}

PARAMS = {"tiny": 437760, "small": 10844160, "medium": 57097728}  # the GPTs' parameters (the [N, D] passes)


def torch_mean(G):  # hdet's StackedReplicas.average_gradients on a GPU until 2026-11-30 (one gradient row)
    ok = torch.isfinite(torch.linalg.vector_norm(G, float("inf"), dim=1))
    G.masked_fill_(~ok.unsqueeze(1), 0)
    total = G.sum(0, keepdim=True, dtype=torch.float32)
    G[:1].copy_(total.div_(G.shape[0]))


SHAPES = {"tiny": (1024, 128), "small": (2048, 384), "medium": (2048, 768)}  # rows a replica, width


def timed(fn, calls: int) -> tuple[float, float]:
    """(device us a call: the kernels' summed time under torch.profiler, wall us a call: issuing and running)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) * 1e6 / calls
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    device = sum(e.self_device_time_total for e in prof.key_averages()
                 if e.device_type == torch.autograd.DeviceType.CUDA)
    return device / calls, wall


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--passes-only", action="store_true", help="only the [N, D] passes (no linear/LayerNorm variants)")
    p.add_argument("--norms-only", action="store_true", help="only the LayerNorm variants")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    dev = torch.device("cuda")
    n = a.replicas
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        for size, (rows, d) in ({} if a.passes_only else SHAPES).items():
            for mult in () if a.norms_only else (1, 4):
                x = torch.randn(n, rows, d, device=dev, dtype=dtype, requires_grad=True)
                w = (torch.randn(n, mult * d, d, device=dev, dtype=dtype) / d ** 0.5).requires_grad_()
                b = torch.randn(n, mult * d, device=dev, dtype=dtype, requires_grad=True)
                dy = torch.randn(n, rows, mult * d, device=dev, dtype=dtype)
                ref = None
                for name, f in LINEARS.items():
                    def step(f=f):
                        x.grad = w.grad = b.grad = None
                        f(x, w, b).backward(dy)
                    dt, ht = timed(step, a.calls)
                    y = f(x, w, b).float()
                    ref = y if ref is None else ref
                    results.append({"layer": "linear", "variant": name, "size": size, "dtype": str(dtype),
                                    "shape": [n, rows, d, mult * d], "device_us": dt, "wall_us": ht,
                                    "max_abs_diff_to_first": float((y - ref).abs().max().detach())})
            xs = torch.randn(n, rows, d, device=dev, dtype=dtype, requires_grad=True)
            ws = (1 + 0.1 * torch.randn(n, d, device=dev, dtype=dtype)).requires_grad_()
            bs = (0.1 * torch.randn(n, d, device=dev, dtype=dtype)).requires_grad_()
            dy = torch.randn(n, rows, d, device=dev, dtype=dtype)
            ref = None
            for name, f in NORMS.items():
                if name == "fused_triton" and dtype != torch.float32:  # (float32 only: merged runs norms in float32
                    continue  # under autocast)

                def step(f=f):
                    xs.grad = ws.grad = bs.grad = None
                    f(xs, ws, bs).backward(dy)
                dt, ht = timed(step, a.calls)
                y = f(xs, ws, bs)
                y.backward(dy)
                got = torch.cat([y.float().flatten(), xs.grad.float().flatten(), ws.grad.float().flatten()])
                ref = got if ref is None else ref
                results.append({"layer": "layer_norm", "variant": name, "size": size, "dtype": str(dtype),
                                "shape": [n, rows, d], "device_us": dt, "wall_us": ht,
                                "max_abs_diff_to_first": float((got - ref).abs().max())})
    for dtype in () if a.norms_only else (torch.float32, torch.bfloat16):
        for size, cols in PARAMS.items():
            theta = torch.randn(n, cols, device=dev, dtype=dtype)
            d = torch.randn(1, cols, device=dev, dtype=dtype)
            c = torch.stack([-1e-3 * (1 + torch.arange(n, device=dev, dtype=torch.float32)),
                             1 - 1e-4 * (1 + torch.arange(n, device=dev, dtype=torch.float32))]).view(2, n, 1)
            start = theta.clone()
            variants = {"torch_broadcast_mul_addcmul": lambda: theta.mul_(c[1]).addcmul_(d, c[0]),
                        "fused_scale_add": lambda: kernels.scale_add_rows_(theta, d, c[1], c[0])}
            outs = {}
            for name, f in variants.items():
                dt, wt = timed(f, a.calls)  # (theta drifts over the calls: no matter for the time)
                theta.copy_(start)
                f()
                outs[name] = theta.float().clone()
                theta.copy_(start)
                results.append({"layer": "step_update", "variant": name, "size": size, "dtype": str(dtype),
                                "shape": [n, cols], "device_us": dt, "wall_us": wt,
                                "max_abs_diff_to_first": float((outs[name] - next(iter(outs.values()))).abs().max())})
            G = torch.randn(n, cols, device=dev, dtype=dtype)
            for bad_row in (None, 3):
                if bad_row is not None:
                    G[bad_row, cols // 2] = float("nan")
                start = G.clone()
                ref = G.clone()
                torch_mean(ref)
                got = G.clone()
                kernels.finite_row_mean(got, got[:1])
                diff = float((got[0].float() - ref[0].float()).abs().max())
                for name, f in {"torch_norm_fill_sum_copy": lambda: torch_mean(G),
                                "fused_finite_mean": lambda: kernels.finite_row_mean(G, G[:1])}.items():
                    dt, wt = timed(f, a.calls)
                    G.copy_(start)
                    results.append({"layer": "grad_mean" + ("" if bad_row is None else "_one_nan_row"), "variant": name,
                                    "size": size, "dtype": str(dtype), "shape": [n, cols], "device_us": dt,
                                    "wall_us": wt, "max_abs_diff_to_first": diff if name.startswith("fused") else 0.0})
    for r in results:
        print(f"{r['layer']:10s} {r['size']:6s} {r['dtype']:15s} {str(r['shape']):22s} {r['variant']:24s} "
              f"device {r['device_us']:8.1f} us  wall {r['wall_us']:7.1f} us  diff {r['max_abs_diff_to_first']:.2e}")
    out = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "python": platform.python_version(), "results": results}
    with open(a.out, "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
