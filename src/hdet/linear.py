"""Linear layers for the engine's replicas: :func:`linear`, one batched matmul per call, gradients in the weight's layout.

Under ``torch.func.vmap`` (the engine's fast path) ``F.linear`` with one weight per replica runs as
``bmm(x, W^T)``, and autograd computes the weight's gradient as ``x^T @ dy``: ``[N, in, out]``, the transpose of the
weight, read across afterwards. Stacked MLP replicas trained through autograd ran at 0.39x one model at N times
the batch on 2 CPU cores, and at 0.67x with the weight gradient computed as ``dy^T @ x`` in the weight's own
layout (``benchmarks/engine_mlp_bound.py``, one run side by side). Here the replicas' call is one ``baddbmm`` on the plain stacked
tensors (taken out of vmap's wrappers and put back, as torch's own ``autograd.Function`` support does, without
its per-call cost: 150 us a call on that CPU), and the backward computes ``dW = dy^T @ x``, ``dx = dy @ W`` and
``db = sum(dy)`` with batched matmuls, ``dW`` already in the weight's layout. Under autocast the inputs are cast
as autocast casts ``F.linear``'s (:mod:`hdet.autocast`). Anything else (one weight for all replicas, nested
transforms, complex tensors, a 1-d weight or a 0-d bias, outside vmap) is torch's ``F.linear`` (routed: the
function ``F.linear`` was, so a user's wrapper of it keeps being called).

:class:`hdet.engine.ReplicaEngine` (eager vmap) routes ``torch.nn.functional.linear`` here while it runs the
replicas' forward (:func:`routed`), so ``nn.Linear``, ``nn.MultiheadAttention``'s projections and any model calling
``F.linear`` use it. Under ``torch.compile`` the rule is not used.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator, Mapping

import torch
import torch.nn.functional as F

from . import autocast
from .attention import under_vmap
from .patching import patched

__all__ = ["linear", "routed", "batched_linear"]

_TORCH_LINEAR = torch._C._nn.linear  # torch's own F.linear
_BMM, _BADDBMM, _ADDMM, _MM = torch.bmm, torch.baddbmm, torch.addmm, torch.mm  # torch's own (the engine routes
# torch.baddbmm and torch.addmm: hdet.autocast)
_functorch = getattr(torch._C, "_functorch", None)
try:  # functorch's interpreter stack (torch's own autograd.Function support under vmap uses the same calls)
    from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter as _interpreter
except ImportError:  # pragma: no cover - no functorch: every call is torch's
    _interpreter = None
_FAST = _interpreter is not None and all(hasattr(_functorch, name) for name in (
    "is_batchedtensor", "maybe_get_level", "_unwrap_batched", "_add_batch_dim", "is_functorch_wrapped_tensor"))
_OTHERWISE = autocast.casting(_TORCH_LINEAR)  # torch's F.linear, cast as autocast casts it under vmap


def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` (same arguments): one batched matmul for the replicas of one vmap over stacked weights."""
    return _linear(input, weight, bias, _OTHERWISE)


def _linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            otherwise: Callable[..., torch.Tensor]) -> torch.Tensor:
    level = _replica_level(weight)
    if level is not None:
        x, xd = _unwrap(input, level)
        w, wd = _unwrap(weight, level)
        b, bd = _unwrap(bias, level)
        # the fast path: plain real floating tensors under one vmap, each replica's weight 2-d, its bias 1-d
        if (not any(_wrapped(t) for t in (x, w, b)) and wd is not None and w.dim() == 3
                and (b is None or b.dim() - (bd is not None) == 1)
                and all(t is None or t.is_floating_point() for t in (x, w, b))):
            return _stacked_linear(x, xd, w, wd, b, bd, level)
    return otherwise(input, weight, bias)


def _replica_level(weight: torch.Tensor) -> int | None:
    """The vmap level at which ``weight`` is batched, if it is the only (innermost and outermost) transform."""
    if not _FAST or not under_vmap(weight):
        return None
    level = _functorch.maybe_get_level(weight)
    interp = _interpreter()
    return level if level == 1 and interp is not None and interp.level() == 1 else None


def _unwrap(t: torch.Tensor | None, level: int) -> tuple[torch.Tensor | None, int | None]:
    if not under_vmap(t) or _functorch.maybe_get_level(t) != level:
        return t, None
    return _functorch._unwrap_batched(t, level)


def _wrapped(t: torch.Tensor | None) -> bool:
    return isinstance(t, torch.Tensor) and _functorch.is_functorch_wrapped_tensor(t)


def _stacked_linear(x: torch.Tensor, xd: int | None, w: torch.Tensor, wd: int, b: torch.Tensor | None,
                    bd: int | None, level: int) -> torch.Tensor:
    n = w.shape[wd]
    w = w.movedim(wd, 0)  # [N, out, in]
    x = x.movedim(xd, 0) if xd is not None else x.expand(n, *x.shape)
    if b is not None:
        b = b.movedim(bd, 0) if bd is not None else b.expand(n, *b.shape)
    lead = x.shape[1:-1]  # one replica's batch axes
    if x.shape[-1] != w.shape[-1]:  # torch's own message for one replica (baddbmm's would name batch2)
        raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied ({math.prod(lead)}x{x.shape[-1]} and "
                           f"{w.shape[-1]}x{w.shape[1]})")
    with _interpreter().lower():  # plain tensors, autograd as usual (vmap is this function's only transform)
        y = batched_linear(x.reshape(n, -1, x.shape[-1]), w, b)  # [N, R, in] rows
        y = y.view(n, *lead, y.shape[-1])
    return _functorch._add_batch_dim(y, 0, level)


def batched_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, native: bool = False) -> torch.Tensor:
    """``y[r] = x[r] @ w[r]^T + b[r]`` on plain ``[N, R, in]``, ``[N, out, in]``, ``[N, out]`` tensors, one ``baddbmm``
    (:class:`_BatchedLinear`; with ``native``, a CUDA layer below :data:`NATIVE_MAX` runs torch's own with autograd's
    backward), cast as autocast casts ``F.linear``."""
    device = x.device.type
    fn = _native if (native and x.is_cuda and x.shape[1] * w.shape[1] * w.shape[2] < NATIVE_MAX
                     and not _per_replica(x, w, b)) else _BatchedLinear.apply
    if torch.is_autocast_enabled(device):
        return autocast.cast_and_call(device, fn, x, w, b)
    return fn(x, w, b)


NATIVE_MAX = 1 << 31  # rows x outputs x inputs of one replica's CUDA layer below which the merged replicas' layer runs
# torch's own baddbmm with autograd's backward: no Python backward, the host time that bounds small models (dW then
# comes transposed), unless it runs one addmm a replica (_per_replica); 0: never. The tiny and small GPTs merged on an
# H200: 1.06-1.10x the Function's speed a round side by side, but not faster in a sequential run (mixed evidence); the
# medium one (its layers above it but one) unchanged (benchmarks/results/gpu_h200/native_linear/)


def _native(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    wt = w.transpose(1, 2)
    return _BMM(x, wt) if b is None else _BADDBMM(b.unsqueeze(1), x, wt)


PER_REPLICA_MIN = 1 << 22  # rows x outputs of one replica's layer from which a CUDA layer with a bias runs one addmm
# per replica (see _per_replica); float("inf"): never (benchmarks set it)


def _per_replica(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    """Whether the forward runs one ``addmm`` per replica instead of one ``baddbmm``: on a CUDA device, with a bias, for
    layers whose output is large enough that the device bounds them. ``baddbmm`` takes the broadcast bias as its C
    operand: a copy of it into the whole ``[N, R, out]`` output, then a GEMM that reads it back; ``addmm`` with a 1-d
    bias adds it in cuBLASLt's epilogue, at N launches' host time (the medium GPT's 768 -> 3072 layer: 0.90 against
    1.11 ms forward and backward on an H200, ``benchmarks/results/gpu_h200/fused_passes/merged_kernels_layers.json``;
    the engine: ``benchmarks/results/gpu_h200/addmm/``)."""
    return (b is not None and x.is_cuda and x.shape[1] * w.shape[1] >= PER_REPLICA_MIN
            and x.dtype == w.dtype == b.dtype and x.shape[0] == w.shape[0] == b.shape[0])  # (else baddbmm's error)


class _BatchedLinear(torch.autograd.Function):
    """``y[r] = x[r] @ w[r]^T + b[r]`` on plain ``[N, R, in]``, ``[N, out, in]``, ``[N, out]`` tensors (called with no
    functorch transform active, so the classic form)."""

    @staticmethod
    def forward(ctx, x, w, b):  # noqa: ANN001, ANN205 - torch's protocol
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        ctx.share = _takes_share(x, w)
        wt = w.transpose(1, 2)
        if _per_replica(x, w, b):
            y = x.new_empty(x.shape[0], x.shape[1], w.shape[1])
            for r in range(x.shape[0]):  # (one launch a replica: cuBLASLt adds the bias in the GEMM's epilogue)
                _ADDMM(b[r], x[r], wt[r], out=y[r])
            return y
        return _BMM(x, wt) if b is None else _BADDBMM(b.unsqueeze(1), x, wt)

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, ANN205
        x, w = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        dx = _BMM(dy, w) if need_x else None
        if need_w and ctx.share:  # the replicas' summed weight gradient in one mm over all N x R rows, each replica's
            n = x.shape[0]  # share of it (stride 0: one [out, in] tensor), see sharing()
            dw = _MM(dy.reshape(-1, dy.shape[-1]).t(), x.reshape(-1, x.shape[-1])).div_(n).expand(n, -1, -1)
        else:
            dw = _BMM(dy.transpose(1, 2), x) if need_w else None  # [N, out, in]: the weight's own layout
        db = dy.sum(1) if ctx.has_bias and need_b else None
        return dx, dw, db


_SHARING = threading.local()  # .leaves, .took: this thread's forward is under sharing()
SHARE_MAX_ROWS = 128  # a replica's rows up to which its layer's weight takes a share (and no more than the layer's
# outputs): on 2 CPU cores the one mm over every row, its A operand transposed, against N gradients and their sum
# (benchmarks/weight_share_gemm.py, benchmarks/results/cpu/weight_shares/gemm.json): 784 -> 256 and 256 -> 256 layers
# 1.28-1.29x at 32 rows a replica and 1.05-1.07x at 128, 1.03-1.26x at 256, 0.95-1.0x at 512 (the whole engine step
# 0.95x there); a 256 -> 10 layer 0.89x at 32 rows and 0.65-0.74x beyond
_SHARED_DTYPES = (torch.float32, torch.float64)  # (the engine sums fp16/bf16 gradients in float32: per replica)


def _takes_share(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether this call's weight gets a share in its backward (:func:`sharing`): under it, the weight one of the
    stacked parameters it names or a view of one (a view maps every replica's gradient alike, so their sum goes
    through it as theirs would; a weight computed from the parameter, dropped out, a LoRA sum, a parametrization,
    applies each replica's own Jacobian, which a share would skip), float32/float64, and no more rows a replica than
    :data:`SHARE_MAX_ROWS` and the layer's outputs. The parameter is recorded in ``took``."""
    leaves = getattr(_SHARING, "leaves", None)
    if (leaves is None or x.dtype not in _SHARED_DTYPES or x.dtype != w.dtype
            or x.shape[1] > min(SHARE_MAX_ROWS, w.shape[1])):
        return False
    name = leaves.get(id(w if w._base is None else w._base))
    if name is None:
        return False
    _SHARING.took.add(name)
    return True


@contextlib.contextmanager
def sharing(leaves: Mapping[int, str], took: set[str]) -> Iterator[None]:
    """Inside (the engine's forward, CPU, shared gradients): the backward of each :class:`_BatchedLinear` call whose
    weight is one of ``leaves`` (``id`` of a stacked ``[N, out, in]`` parameter -> its name) or a view of one gives it
    the replicas' *share* of their summed gradient, ``sum_r dy_r^T x_r / N`` computed as one ``mm`` over all N x R rows
    and expanded over the replicas (stride 0), instead of N gradients from one ``bmm``: the ``[N, out, in]`` output is
    neither written nor read back for the mean (the hand-written bound of ``benchmarks/engine_mlp_bound.py``: 0.67x
    -> 0.88x one model). Their sum is what the N gradients sum to (DDP's all-reduce of the replicas' gradients,
    :meth:`hdet.stacking.StackedReplicas._reduce`), through any other use of the parameter too, but no row is its
    replica's own gradient: the names of the parameters that took one are added to ``took``, for the caller to know
    which gradients are not each replica's (where one is needed, a replica with a NaN or Inf gradient left out of the
    mean, the engine runs the step again without shares). Conditions: :func:`_takes_share`."""
    before = getattr(_SHARING, "leaves", None), getattr(_SHARING, "took", None)
    _SHARING.leaves, _SHARING.took = leaves, took
    try:
        yield
    finally:
        _SHARING.leaves, _SHARING.took = before


def _routing(before: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """What F.linear is while routed: the fast path where F held torch's function (alone or cast by
    :mod:`hdet.autocast`), else the function F held (a user's wrapper keeps being called)."""
    if before is not _TORCH_LINEAR and getattr(before, "__wrapped__", None) is not _TORCH_LINEAR:
        return before

    def routed_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return _linear(input, weight, bias, before)
    return routed_linear


def routed() -> contextlib.AbstractContextManager:
    """``torch.nn.functional.linear`` is :func:`linear` inside (where F holds torch's own)."""
    return patched("linear", F, {"linear": _routing})
