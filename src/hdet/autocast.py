"""Autocast for the engine's vmapped replicas: :func:`routed`.

Under ``torch.func.vmap`` several of the layers that autocast computes in lower precision lose it: a vmapped
``F.linear`` with a bias and ``F.conv1d/2d/3d`` with a bias run in float32 inside ``torch.autocast`` (torch 2.13 on
the CPU, where also bias-free convolutions and ``F.conv_transpose*d`` do; torch 2.11 on CUDA), where one replica's
call runs in the autocast dtype (``benchmarks/vmap_autocast.py``). The engine's replicas then computed
differently from the same model under DDP (and slower), with no warning. While :class:`hdet.engine.ReplicaEngine`
runs its replicas' forward (eager vmap), these functions cast their floating inputs to the autocast dtype
themselves when autocast is on for their device, as autocast does for one replica, and call the function F held
(torch's, or a user's wrapper of it). Outside vmap, or with autocast off, they are that function with one check more.
So do ``torch.addmm``, ``torch.baddbmm`` and ``torch.addbmm`` (:data:`CAST_TORCH`; vmapped, they too ran in float32
under autocast on the CPU: Hugging Face's GPT-2 computes its layers with ``torch.addmm``); the methods
(``x.addmm(...)``) are not routed.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from .attention import under_vmap
from .patching import patched

__all__ = ["routed", "cast", "cast_and_call", "casting", "norm_in_float", "CAST", "CAST_TORCH"]

CAST = ("linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d")
CAST_TORCH = ("addmm", "baddbmm", "addbmm")  # of the torch namespace


def cast(t: Any, dtype: torch.dtype) -> Any:
    """``t`` in ``dtype`` where autocast would cast it (a floating tensor, not float64), else ``t``."""
    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64 and t.dtype != dtype:
        return t.to(dtype)
    return t


def cast_and_call(device: str, fn: Callable[..., torch.Tensor], *args: Any, autocast_off: bool = True,
                  **kwargs: Any) -> torch.Tensor:
    """``fn`` with its floating tensor arguments in the autocast dtype of ``device``, run with autocast off as autocast
    runs an op once it has cast its inputs (``autocast_off=False``: left on, for a wrapper with ops of its own)."""
    dtype = torch.get_autocast_dtype(device)
    args = tuple(cast(a, dtype) for a in args)
    kwargs = {k: cast(v, dtype) for k, v in kwargs.items()}
    with torch.autocast(device, enabled=False) if autocast_off else contextlib.nullcontext():
        return fn(*args, **kwargs)


def casting(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``fn(*args, **kwargs)`` with its floating tensor arguments cast to the autocast dtype first when autocast is on
    for their device and one of them is vmapped; torch's own function then runs with autocast off, as autocast runs an
    op once it has cast its inputs (a user's Python wrapper keeps autocast for its own ops)."""
    builtin = isinstance(fn, types.BuiltinFunctionType)

    def call(*args: Any, **kwargs: Any) -> torch.Tensor:
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        device = tensors[0].device.type if tensors else None
        if device is not None and torch.is_autocast_enabled(device) and any(under_vmap(t) for t in tensors):
            # (torch's own with autocast off: vmap's rule for addbmm sums, which CUDA autocast would keep in float32)
            return cast_and_call(device, fn, *args, autocast_off=builtin, **kwargs)
        return fn(*args, **kwargs)

    call.__name__ = call.__qualname__ = getattr(fn, "__name__", "call")
    call.__doc__ = "cast as autocast casts it, also under vmap (see :mod:`hdet.autocast`)"
    call.__wrapped__ = fn
    return call


def norm_in_float(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``F.batch_norm`` (and ``F.instance_norm``) for vmapped fp16/bf16 inputs with float32 statistics or affine (a
    convolution's output under autocast, the model in float32): torch's vmap rule refuses the mixed dtypes ("expected
    scalar type BFloat16 but found Float"; mode="auto" fell back to the loop, an audit) where one replica's batch norm
    takes them and returns the input's dtype. Computed on the input in float32 and returned in its dtype, as that
    kernel computes."""
    def call(input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if (isinstance(input, torch.Tensor) and input.dtype in (torch.float16, torch.bfloat16) and under_vmap(input)
                and any(isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in (*args, *kwargs.values()))):
            return fn(input.float(), *args, **kwargs).to(input.dtype)
        return fn(input, *args, **kwargs)

    call.__name__ = call.__qualname__ = getattr(fn, "__name__", "call")
    call.__doc__ = "in float32 for fp16/bf16 vmapped inputs with float32 statistics (see :mod:`hdet.autocast`)"
    call.__wrapped__ = fn
    return call


@contextlib.contextmanager
def routed() -> Iterator[None]:
    """Inside: ``torch.nn.functional``'s :data:`CAST` functions and torch's :data:`CAST_TORCH` (whatever the modules
    hold: torch's, or a user's wrapper of them) cast as autocast does, also under vmap; ``F.batch_norm`` and
    ``F.instance_norm`` take fp16/bf16 vmapped inputs with float32 statistics (:func:`norm_in_float`)."""
    with patched("autocast", F, {name: casting for name in CAST}), \
            patched("autocast", torch, {name: casting for name in CAST_TORCH}), \
            patched("autocast-norm", F, {"batch_norm": norm_in_float, "instance_norm": norm_in_float}):
        yield
