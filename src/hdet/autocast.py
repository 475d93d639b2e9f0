"""Autocast for the engine's vmapped replicas: :func:`routed`.

Under ``torch.func.vmap`` several of the layers that autocast computes in lower precision lose it: a vmapped
``F.linear`` with a bias and ``F.conv1d/2d/3d`` with a bias run in float32 inside ``torch.autocast`` (torch 2.13 on
the CPU, where also bias-free convolutions and ``F.conv_transpose*d`` do; torch 2.11 on CUDA), where one replica's
call runs in the autocast dtype (``benchmarks/vmap_autocast.py``). The engine's replicas then computed
differently from the same model under DDP (and slower), with no warning. While :class:`hdet.engine.ReplicaEngine`
runs its replicas' forward (eager vmap), these functions cast their floating inputs to the autocast dtype
themselves when autocast is on for their device, as autocast does for one replica, and call torch's function.
Outside vmap, or with autocast off, they are torch's functions with one check more.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from .attention import under_vmap

__all__ = ["routed", "cast", "CAST"]

CAST = ("linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d")
_TORCH = {name: getattr(F, name) for name in CAST}  # torch's own, whatever F holds while routed


def cast(t: Any, dtype: torch.dtype) -> Any:
    """``t`` in ``dtype`` where autocast would cast it (a floating tensor, not float64), else ``t``."""
    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64 and t.dtype != dtype:
        return t.to(dtype)
    return t


def _autocast(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def call(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *args: Any,
             **kwargs: Any) -> torch.Tensor:
        device = input.device.type
        if torch.is_autocast_enabled(device) and (under_vmap(input) or under_vmap(weight) or under_vmap(bias)):
            dtype = torch.get_autocast_dtype(device)
            input, weight, bias = cast(input, dtype), cast(weight, dtype), cast(bias, dtype)
        return fn(input, weight, bias, *args, **kwargs)

    call.__name__ = call.__qualname__ = fn.__name__
    call.__doc__ = f"``F.{fn.__name__}``, cast as autocast casts it also under vmap (see :mod:`hdet.autocast`)."
    return call


_ROUTED = {name: _autocast(fn) for name, fn in _TORCH.items()}
linear = _ROUTED["linear"]  # (hdet.linear's calls that are not its own)


@contextlib.contextmanager
def routed() -> Iterator[None]:
    """``torch.nn.functional``'s :data:`CAST` functions cast as autocast does under vmap, inside."""
    before = {name: getattr(F, name) for name in CAST}
    for name, fn in _ROUTED.items():
        setattr(F, name, fn)
    try:
        yield
    finally:
        for name, fn in before.items():
            setattr(F, name, fn)
