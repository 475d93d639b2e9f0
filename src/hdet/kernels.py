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

:func:`usable` says whether tensors take the fused path: CUDA tensors large enough that the device, not the host,
bounds their pass (Triton's launch costs more host time than torch's: the tiny GPT's engine ran 4-8% slower with
them), with Triton importable and working. Triton is imported, and its kernels compiled and checked on a few numbers,
at the first such tensors (never on a CPU-only run); where that fails (no Triton, no C compiler, a GPU older than
compute capability 7.0) the callers keep torch's ops, with a warning. The kernels themselves are in
:mod:`hdet._triton_kernels`.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch

from .caller import user_stacklevel

__all__ = ["AVAILABLE", "usable", "scale_add_rows_", "finite_row_mean"]

AVAILABLE = True  # False: never take the fused path (set when Triton is missing or fails; benchmarks set it too)
MIN_ELEMENTS = 1 << 22  # smaller passes stay torch's: bound by the host, where a Triton launch costs more
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_impl: Any = None  # hdet._triton_kernels once imported and checked
_checked: set[int] = set()  # the CUDA devices the kernels were checked on


def usable(*tensors: torch.Tensor) -> bool:
    """Whether these tensors take the fused path: CUDA float32/16/bf16 matrices with dense rows (last stride 1), the
    first of at least :data:`MIN_ELEMENTS` elements, and the kernels working on their device."""
    if not AVAILABLE:
        return False
    if not all(t.is_cuda and t.dtype in _FLOATS and t.dim() == 2 and t.stride(1) == 1 for t in tensors):
        return False
    return tensors[0].numel() >= MIN_ELEMENTS and _ready(tensors[0].device)


def _ready(device: torch.device) -> bool:
    """Import Triton and check the kernels on ``device`` once (False, with a warning, where that fails)."""
    global AVAILABLE, _impl
    if not AVAILABLE:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index in _checked:
        return True
    try:
        if torch.cuda.get_device_capability(index) < (7, 0):
            raise RuntimeError(f"compute capability {torch.cuda.get_device_capability(index)}, Triton needs 7.0")
        if _impl is None:
            from . import _triton_kernels as impl
            _impl = impl
        with _on(torch.device("cuda", index)):
            _impl.check(torch.device("cuda", index))
    except Exception as e:  # (ImportError, a compiler missing, ...): torch's ops from now on
        AVAILABLE = False
        warnings.warn(f"hdet: the engine's fused passes over the replicas' weights (Triton) do not run here "
                      f"({type(e).__name__}: {str(e)[:200]}); torch's ops do the same work, more slowly on large "
                      "models", stacklevel=user_stacklevel())
        return False
    _checked.add(index)
    return True


def _on(device: torch.device) -> contextlib.AbstractContextManager:
    """The tensors' device as the current one where it is not (Triton launches on the current device's stream)."""
    return contextlib.nullcontext() if device.index == torch.cuda.current_device() else torch.cuda.device(device)


def scale_add_rows_(theta: torch.Tensor, d: torch.Tensor, a: torch.Tensor | None, b: torch.Tensor) -> None:
    """``theta[r] = a[r] * theta[r] + b[r] * d[r or 0]`` in place, one pass, computed in float32 from theta's and
    d's values and stored in theta's dtype. ``theta``: ``[N, n]`` (dense rows, any row stride); ``d``: ``[1 or N, n]``;
    ``a`` (None: 1) and ``b``: ``N`` float32 numbers on the device. Call where :func:`usable` says so."""
    _need(theta.device)
    with _on(theta.device):
        _impl.scale_add_rows_(theta, d, a, b)


def finite_row_mean(G: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
    """``dest = sum_r G[r] / N`` over the rows of ``G`` (``[N, D]``) that are finite, a non-finite row counting as
    0, summed in float32; ``dest``: ``[1, D]`` (may be ``G``'s row 0; the other rows are only read). Returns the
    ``[N]`` int32 flags of the non-finite rows. One read of ``G`` when every row is finite, two when one is not; no
    host sync. Call where :func:`usable` says so."""
    _need(G.device)
    with _on(G.device):
        return _impl.finite_row_mean(G, dest)


def _need(device: torch.device) -> None:
    if not (device.type == "cuda" and _ready(device)):
        raise RuntimeError(f"Expected a CUDA device where hdet's Triton kernels run, but got {device} (see usable())")
