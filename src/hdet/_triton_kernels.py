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


@triton.jit
def _ln_forward_kernel(x, y, w, b, mean, rstd, D, R, w_row, b_row, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # one row of the merged batch, replica row // R's
    rep = row // R
    cols = tl.arange(0, BLOCK)
    inside = cols < D
    xv = tl.load(x + row * D + cols, mask=inside, other=0.0).to(tl.float32)
    mu = tl.sum(xv, axis=0) / D
    xc = tl.where(inside, xv - mu, 0.0)
    rs = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / D + eps)  # (the biased variance, as torch's layer_norm)
    wv = tl.load(w + rep * w_row + cols, mask=inside, other=0.0).to(tl.float32)
    bv = tl.load(b + rep * b_row + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(y + row * D + cols, (xc * rs * wv + bv).to(y.dtype.element_ty), mask=inside)
    tl.store(mean + row, mu)
    tl.store(rstd + row, rs)


@triton.jit
def _ln_backward_kernel(x, dy, dx, w, mean, rstd, dw_part, db_part, D, R, w_row, ROWS, BLOCK: tl.constexpr):
    rep = tl.program_id(0).to(tl.int64)  # replica
    p = tl.program_id(1).to(tl.int64)  # its p-th chunk of ROWS rows
    parts = tl.num_programs(1)
    cols = tl.arange(0, BLOCK)
    inside = cols < D
    wv = tl.load(w + rep * w_row + cols, mask=inside, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, ROWS):
        r = p * ROWS + i
        if r < R:
            row = rep * R + r
            xv = tl.load(x + row * D + cols, mask=inside, other=0.0).to(tl.float32)
            g = tl.load(dy + row * D + cols, mask=inside, other=0.0).to(tl.float32)
            xh = tl.where(inside, (xv - tl.load(mean + row)) * tl.load(rstd + row), 0.0)
            wg = wv * g
            c1 = tl.sum(xh * wg, axis=0) / D
            c2 = tl.sum(wg, axis=0) / D
            tl.store(dx + row * D + cols, ((wg - (xh * c1 + c2)) * tl.load(rstd + row)).to(dx.dtype.element_ty),
                     mask=inside)
            dw += g * xh
            db += g
    tl.store(dw_part + (rep * parts + p) * D + cols, dw, mask=inside)
    tl.store(db_part + (rep * parts + p) * D + cols, db, mask=inside)


def _ln_warps(block: int) -> int:
    return min(max(block // 256, 1), 8)


def layer_norm_rows(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    N, R, D = x.shape
    y = torch.empty_like(x)
    mean, rstd = torch.empty(2, N * R, dtype=torch.float32, device=x.device)  # (one allocation: host time)
    block = triton.next_power_of_2(D)
    _ln_forward_kernel[(N * R,)](x, y, w, b, mean, rstd, D, R, w.stride(0), b.stride(0), eps, BLOCK=block,
                                 num_warps=_ln_warps(block))
    return y, mean, rstd


def layer_norm_rows_backward(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, mean: torch.Tensor,
                             rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    N, R, D = x.shape
    rows = triton.cdiv(R, max(1, min(R, 512 // N)))  # about 512 programs in all, each summing its rows' dw, db
    parts = triton.cdiv(R, rows)
    dx = torch.empty_like(x)
    part = torch.empty(2, N, parts, D, dtype=torch.float32, device=x.device)  # dw's and db's parts: one allocation
    block = triton.next_power_of_2(D)
    _ln_backward_kernel[(N, parts)](x, dy, dx, w, mean, rstd, part[0], part[1], D, R, w.stride(0), rows,
                                    BLOCK=block, num_warps=_ln_warps(block))
    dw, db = part.sum(2)  # (one sum over the parts for both: host time)
    return dx, dw.to(w.dtype), db.to(w.dtype)


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
    x = torch.tensor([[[1.0, 3.0]], [[2.0, 4.0]]], device=device)  # [N=2, R=1, D=2]
    y, _, rstd = layer_norm_rows(x, torch.tensor([[1.0, 2.0], [1.0, 1.0]], device=device),
                                 torch.tensor([[0.0, 1.0], [5.0, 5.0]], device=device), 0.0)
    got = (theta.flatten().tolist(), out.flatten().tolist(), bad.tolist(), y.flatten().tolist(),
           rstd.tolist())  # HOST SYNC (once per device)
    want = ([3.0, 5.0, 2.0, 3.0], [0.5, 1.0], [0, 1], [-1.0, 3.0, 4.0, 6.0], [1.0, 1.0])
    if got != want:
        raise RuntimeError(f"the fused kernels computed {got} for {want}")
    g = torch.Generator(device=device).manual_seed(0)  # the layer norm's backward against torch's
    x, w, b, dy = (torch.randn(2, 3, 5, device=device, generator=g), torch.randn(2, 5, device=device, generator=g),
                   torch.randn(2, 5, device=device, generator=g), torch.randn(2, 3, 5, device=device, generator=g))
    _, mean, rstd = layer_norm_rows(x, w, b, 1e-5)
    got = layer_norm_rows_backward(dy, x, w, mean, rstd)
    with torch.inference_mode(False), torch.enable_grad():  # (whatever mode the first caller runs in)
        x, w, b, dy = (t.clone() for t in (x, w, b, dy))
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        ref = torch.stack([torch.nn.functional.layer_norm(leaves[0][r], (5,), leaves[1][r], leaves[2][r], 1e-5)
                           for r in range(2)])
        want = torch.autograd.grad(ref, leaves, dy)
    if not all(torch.allclose(a, e, rtol=1e-4, atol=1e-5) for a, e in zip(got, want)):  # HOST SYNC (once)
        raise RuntimeError("the fused layer norm's backward does not compute torch's gradients")
