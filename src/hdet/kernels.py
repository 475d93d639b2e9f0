"""Fused passes over the engine's stacked ``[N, D]`` weights and gradients on a CUDA device (Triton), for the
work whose size grows with N: the replicas' step and the mean of their gradients; and the merged replicas' layer norm.

With shared gradients the engine keeps one copy of the optimizer's moments, so what costs N times one model's is
the weights' update, ``theta_r <- a_r theta_r + b_r d`` (AdamW's decay ``a_r = 1 - lr_r wd`` and step
``b_r = -lr_r / (1 - beta1^t)`` per replica), and the gradients' mean over the finite replicas. In torch's ops those
were two broadcasting passes over ``[N, D]`` for the update (``mul_``, ``addcmul_``; a broadcast operand keeps
torch's elementwise kernels off their vectorised path) and four for the mean (each row's largest ``|g|``, a masked
fill of the non-finite rows, the sum, the copy). Here the update is one pass and the mean one read of ``[N, D]``,
plus a second only on a step where a replica's gradient is not finite (decided on the device: no host sync).
Measured in ``benchmarks/merged_kernels.py``.

The merged replicas' layer norms (:mod:`hdet.merged`) have a fused forward and backward here too
(:func:`layer_norm_rows`), used while the engine captures its step in a CUDA graph (:func:`for_graphs`).

:func:`usable` says whether tensors take the fused path: CUDA tensors large enough that the device, not the host,
bounds their pass (Triton's launch costs more host time than torch's: the tiny GPT's engine ran 4-8% slower with
them), with Triton importable and working. Triton is imported, and its kernels compiled and checked on a few numbers,
at the first such tensors (never on a CPU-only run); where that fails (no Triton, no C compiler, a GPU older than
compute capability 7.0) the callers keep torch's ops, with a warning. The kernels themselves are in
:mod:`hdet._triton_kernels`.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Any

import torch

from .caller import user_stacklevel

__all__ = ["AVAILABLE", "usable", "scale_add_rows_", "finite_row_mean", "layer_norm_usable", "for_graphs",
           "layer_norm_rows", "layer_norm_rows_backward"]

AVAILABLE = True  # False: never take the fused path (set when Triton is missing or fails; benchmarks set it too)
MIN_ELEMENTS = 1 << 22  # smaller passes stay torch's: bound by the host, where a Triton launch costs more
MAX_NORMALIZED = 4096  # the longest row the layer norm's kernels take (one row a program, in registers; the widest
# tested on a GPU)
EAGER_LAYER_NORM = False  # True: the fused layer norm in eager steps too, not only in CUDA graphs
# (see layer_norm_usable)
_graphing = threading.local()  # .depth > 0 inside for_graphs(), in this thread
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
    index = _index(device)
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


def _index(device: torch.device) -> int:
    """A CUDA device's index (the current device's where it names none)."""
    return device.index if device.index is not None else torch.cuda.current_device()


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


def layer_norm_usable(x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Whether the replicas' layer norm takes the fused kernels: while the engine captures its step in a CUDA graph
    (:func:`for_graphs`; :data:`EAGER_LAYER_NORM`: in eager steps too), ``x`` ``[N, R, D]`` float32 and contiguous on
    a CUDA device, of at least :data:`MIN_ELEMENTS` elements, ``D`` at most :data:`MAX_NORMALIZED`, a float32 weight
    and bias ``[N, D]`` each (dense rows, any row stride: views of the engine's flat ``[N, D]`` weights), outside
    ``torch.compile`` (which fuses torch's ops itself) and not in a CUDA graph's capture before the kernels were
    checked on the device (the check reads values on the host)."""
    if not layer_norm_wanted(x) or w is None or b is None:
        return False
    if not (x.dtype == w.dtype == b.dtype == torch.float32 and x.dim() == 3 and w.shape == b.shape == (
            x.shape[0], x.shape[2]) and w.stride(1) == b.stride(1) == 1 and w.device == b.device == x.device):
        return False
    if x.shape[2] > MAX_NORMALIZED or torch.compiler.is_compiling():
        return False
    if _index(x.device) not in _checked and torch.cuda.is_current_stream_capturing():
        return False
    return _ready(x.device)


def layer_norm_wanted(x: torch.Tensor) -> bool:
    """The cheap half of :func:`layer_norm_usable` (asked first, before an input is cast for it): whether the fused
    layer norm may run at all here (inside :func:`for_graphs` in this thread, or :data:`EAGER_LAYER_NORM`), on ``x``
    (or a cast of it): contiguous, on a CUDA device, of at least :data:`MIN_ELEMENTS` elements."""
    return _wanted_here() and x.is_cuda and x.is_contiguous() and x.numel() >= MIN_ELEMENTS


def _wanted_here() -> bool:
    """Inside :func:`for_graphs` in this thread, or :data:`EAGER_LAYER_NORM`, with the kernels not ruled out."""
    return AVAILABLE and (getattr(_graphing, "depth", 0) > 0 or EAGER_LAYER_NORM)


@contextlib.contextmanager
def for_graphs() -> Any:
    """Inside (:class:`hdet.graphs.StepGraphs`' capture, its warm-up runs included: the kernels compile there, before
    the capture): the merged replicas' layer norms take the fused kernels (:func:`layer_norm_usable`). Measured on an
    H200 (``benchmarks/results/gpu_h200/fused_norm/``), the fused norm takes a third of torch's device time but more
    host time (through autograd, up to 220 us more than torch's ops a forward and backward, of which its two Triton
    launches are 16-28 us each: ``benchmarks/results/gpu_h200/triton_launch/``), so eager steps bound by the host, the
    small GPT's and the medium one's under bf16 autocast, ran slower with it; a graph replays without the host."""
    _graphing.depth = getattr(_graphing, "depth", 0) + 1
    try:
        yield
    finally:
        _graphing.depth -= 1


def layer_norm_rows(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Replica ``r``'s rows of ``x`` (``[N, R, D]``) normalised, times ``w[r]``, plus ``b[r]``, as
    ``F.layer_norm(x[r], (D,), w[r], b[r], eps)``, in one pass; returns ``y`` and each row's mean and ``1 / std``
    (``[N * R]``, float32) for :func:`layer_norm_rows_backward`. Call where :func:`layer_norm_usable` says so."""
    _need(x.device)
    with _on(x.device):
        return _impl.layer_norm_rows(x, w, b, eps)


def layer_norm_rows_backward(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, mean: torch.Tensor,
                             rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`layer_norm_rows`' gradients ``(dx, dw, db)`` from ``dy`` (contiguous, as ``x``): one pass over the rows
    (``dw``, ``db`` summed in float32 by parts, then over the parts)."""
    _need(x.device)
    with _on(x.device):
        return _impl.layer_norm_rows_backward(dy, x, w, mean, rstd)


def _need(device: torch.device) -> None:
    if not (device.type == "cuda" and _ready(device)):
        raise RuntimeError(f"Expected a CUDA device where hdet's Triton kernels run, but got {device} (see usable())")
