"""Fused passes over the engine's stacked ``[N, D]`` weights and gradients on a CUDA device (Triton), for the
work whose size grows with N: the replicas' step and the mean of their gradients.

With shared gradients the engine keeps one copy of the optimizer's moments, so what costs N times one model's is
the weights' update, ``theta_r <- a_r theta_r + b_r d`` (AdamW's decay ``a_r = 1 - lr_r wd`` and step
``b_r = -lr_r / (1 - beta1^t)`` per replica), and the gradients' mean over the finite replicas. In torch's ops those
were two broadcasting passes over ``[N, D]`` for the update (``mul_``, ``addcmul_``; a broadcast operand keeps
torch's elementwise kernels off their vectorised path) and four for the mean (each row's largest ``|g|``, a masked
fill of the non-finite rows, the sum, the copy). Here the update is one pass and the mean one read of ``[N, D]``,
plus a second only on a step where a replica's gradient is not finite (decided on the device: no host sync).
Measured in ``benchmarks/merged_kernels.py``.

:data:`AVAILABLE` is False without Triton (the CPU wheel of torch has none), and the callers keep torch's ops;
:func:`usable` says whether a tensor can take the fused path.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU wheel of torch ships no Triton
    triton = tl = None

__all__ = ["AVAILABLE", "usable", "scale_add_rows_", "finite_row_mean"]

AVAILABLE = triton is not None
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_BLOCK = 2048


def usable(*tensors: torch.Tensor) -> bool:
    """Whether these tensors can take the fused path: CUDA floating tensors of float32/16/bf16 whose rows are dense
    (last stride 1), with Triton installed."""
    return AVAILABLE and all(t.is_cuda and t.dtype in _FLOATS and t.dim() == 2 and t.stride(1) == 1 for t in tensors)


if AVAILABLE:
    @triton.jit
    def _scale_add_kernel(theta, d, a, b, cols, theta_row, d_row, HAS_A: tl.constexpr, BLOCK: tl.constexpr):
        r = tl.program_id(1)
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < cols
        theta = theta + r.to(tl.int64) * theta_row  # (64-bit: N rows of a large model pass 2^31 elements)
        th = tl.load(theta + offs, mask=inside)
        x = tl.load(d + r.to(tl.int64) * d_row + offs, mask=inside).to(tl.float32)
        out = th.to(tl.float32)
        if HAS_A:
            out = out * tl.load(a + r)
        out = out + tl.load(b + r) * x
        tl.store(theta + offs, out.to(th.dtype), mask=inside)

    @triton.jit
    def _sum_rows_kernel(g, mean, bad, cols, g_row, N: tl.constexpr, BLOCK: tl.constexpr):
        g_row = tl.full([], 1, tl.int64) * g_row  # (64-bit: N rows of a large model pass 2^31 elements; a stride
        # of 1 comes as a constant, which has no .to)
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < cols
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(N):
            acc += tl.load(g + r * g_row + offs, mask=inside, other=0.0).to(tl.float32)
        if tl.min(((acc - acc) == 0).to(tl.int32), axis=0) == 0:  # a NaN or Inf in the sum (inf - inf is NaN): which
            for r in tl.static_range(N):  # rows hold one? (none, where finite values overflowed the sum: kept)
                x = tl.load(g + r * g_row + offs, mask=inside, other=0.0).to(tl.float32)
                if tl.min(((x - x) == 0).to(tl.int32), axis=0) == 0:
                    tl.store(bad + r, 1)  # (every program that finds one stores the same value)
        tl.store(mean + offs, acc / N, mask=inside)

    @triton.jit
    def _finite_mean_kernel(g, mean, bad, dest, cols, g_row, N: tl.constexpr, BLOCK: tl.constexpr):
        g_row = tl.full([], 1, tl.int64) * g_row
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < cols
        any_bad = 0
        for r in tl.static_range(N):
            any_bad += tl.load(bad + r)
        if any_bad == 0:
            acc = tl.load(mean + offs, mask=inside)
        else:  # a replica's gradient is not finite: the sum again without it (it counts as 0, as under DDP's guard)
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for r in tl.static_range(N):
                if tl.load(bad + r) == 0:
                    acc += tl.load(g + r * g_row + offs, mask=inside, other=0.0).to(tl.float32)
            acc = acc / N
        tl.store(dest + offs, acc.to(dest.dtype.element_ty), mask=inside)


def scale_add_rows_(theta: torch.Tensor, d: torch.Tensor, a: torch.Tensor | None, b: torch.Tensor) -> None:
    """``theta[r] = a[r] * theta[r] + b[r] * d[r or 0]`` in place, one pass, computed in float32 and rounded once
    to theta's dtype. ``theta``: ``[N, n]`` (dense rows, any row stride); ``d``: ``[1 or N, n]``; ``a`` (None: 1)
    and ``b``: ``N`` float32 numbers on the device."""
    n_rows, cols = theta.shape
    grid = (triton.cdiv(cols, _BLOCK), n_rows)
    _scale_add_kernel[grid](theta, d, b if a is None else a, b, cols, theta.stride(0),
                            d.stride(0) if d.shape[0] > 1 else 0, HAS_A=a is not None, BLOCK=_BLOCK)


def finite_row_mean(G: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
    """``dest = sum_r G[r] / N`` over the rows of ``G`` (``[N, D]``) that are finite, a non-finite row counting as
    0, summed in float32; ``dest``: ``[1, D]`` (may be ``G``'s row 0). Returns the ``[N]`` int32 flags of the
    non-finite rows. One read of ``G`` when every row is finite (the second kernel then copies the mean), two
    when one is not; no host sync."""
    N, cols = G.shape
    mean = torch.empty(cols, dtype=torch.float32, device=G.device)
    bad = torch.zeros(N, dtype=torch.int32, device=G.device)
    grid = (triton.cdiv(cols, _BLOCK),)
    _sum_rows_kernel[grid](G, mean, bad, cols, G.stride(0), N=N, BLOCK=_BLOCK)
    _finite_mean_kernel[grid](G, mean, bad, dest, cols, G.stride(0), N=N, BLOCK=_BLOCK)
    return bad
