"""The Triton kernels of :mod:`hdet.kernels` (imported at their first use on a CUDA device, never on a CPU-only run)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 2048


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
    g_row = tl.full([], 1, tl.int64) * g_row  # (64-bit: N rows of a large model pass 2^31 elements; a stride of 1
    # comes as a constant, which has no .to)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < cols
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for r in tl.static_range(N):
        acc += tl.load(g + r * g_row + offs, mask=inside, other=0.0).to(tl.float32)
    if tl.min((acc == acc).to(tl.int32) * (tl.abs(acc) != float("inf")).to(tl.int32), axis=0) == 0:  # a NaN or Inf
        for r in tl.static_range(N):  # in the sum: which rows hold one? (none, where finite values overflowed it)
            x = tl.load(g + r * g_row + offs, mask=inside, other=0.0).to(tl.float32)
            if tl.min((x == x).to(tl.int32) * (tl.abs(x) != float("inf")).to(tl.int32), axis=0) == 0:
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
    n_rows, cols = theta.shape
    grid = (triton.cdiv(cols, _BLOCK), n_rows)
    _scale_add_kernel[grid](theta, d, b if a is None else a, b, cols, theta.stride(0),
                            d.stride(0) if d.shape[0] > 1 else 0, HAS_A=a is not None, BLOCK=_BLOCK)


def finite_row_mean(G: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
    N, cols = G.shape
    mean = torch.empty(cols, dtype=torch.float32, device=G.device)
    bad = torch.zeros(N, dtype=torch.int32, device=G.device)
    grid = (triton.cdiv(cols, _BLOCK),)
    _sum_rows_kernel[grid](G, mean, bad, cols, G.stride(0), N=N, BLOCK=_BLOCK)
    _finite_mean_kernel[grid](G, mean, bad, dest, cols, G.stride(0), N=N, BLOCK=_BLOCK)
    return bad


def check(device: torch.device) -> None:
    """Compile the kernels and check them on a few numbers on ``device`` (raises where they do not give them); one
    host read, once per device."""
    theta = torch.tensor([[1.0, 2.0], [3.0, 4.0]], device=device)
    scale_add_rows_(theta, torch.tensor([[1.0, 1.0]], device=device), torch.tensor([2.0, 1.0], device=device),
                    torch.tensor([1.0, -1.0], device=device))
    G = torch.tensor([[1.0, 2.0], [float("nan"), 4.0]], device=device)
    out = torch.empty(1, 2, device=device)
    bad = finite_row_mean(G, out)
    got = (theta.flatten().tolist(), out.flatten().tolist(), bad.tolist())  # HOST SYNC (once per device)
    if got != ([3.0, 5.0, 2.0, 3.0], [0.5, 1.0], [0, 1]):
        raise RuntimeError(f"the fused kernels computed {got} for ([3, 5, 2, 3], [0.5, 1], [0, 1])")
