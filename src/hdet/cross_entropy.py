"""``F.cross_entropy`` for the engine's vmapped replicas: :func:`routed`.

Under ``torch.func.vmap`` torch runs ``F.cross_entropy`` through its decomposition (``log_softmax``, then
``nll_loss`` as a gather, a ``where`` and sums over the replica axis: about ten operations a call; 114 us against
30 us for the same rows in one call on 2 CPU cores), and the engine's tiny and small models are bound by such host
work. While the engine runs its replicas' loss, the common form (class-index targets ``[B]`` for logits ``[B, C]``, no
class weights, ``reduction="mean"``) runs as one call over every replica's rows with ``reduction="none"``, then each
replica's mean over its counted rows (``ignore_index`` and ``label_smoothing`` as torch's own mean takes them; int64
targets: torch's call for one replica takes no other); anything else is torch's vmapped call. Where ``F`` holds a
user's or a library's own wrapper (a z-loss, a ``functools.partial``), nothing is routed: the wrapper is called as it
was. Under ``torch.autocast`` the routed loss is float32, as one replica's is (torch's vmapped call returns the
autocast dtype). Under ``torch.compile`` the rule is not used.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from .linear import _functorch, _interpreter, _replica_level, _unwrap, _wrapped
from .patching import patched

__all__ = ["routed", "replicas_cross_entropy"]

_TORCH_CROSS_ENTROPY = F.cross_entropy  # torch's own (a user's wrapper installed later is left alone)


def replicas_cross_entropy(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``fn`` (torch's ``F.cross_entropy``) with the replicas' common form as one call (see the module); any other
    function (a user's wrapper: its own signature, defaults and terms, which one call over every replica's rows would
    mix across replicas; a review) is returned as it is."""
    if fn is not _TORCH_CROSS_ENTROPY:
        return fn

    def cross_entropy(input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                      size_average: bool | None = None, ignore_index: int = -100, reduce: bool | None = None,
                      reduction: str = "mean", label_smoothing: float = 0.0) -> torch.Tensor:
        level = _replica_level(input) if isinstance(input, torch.Tensor) else None
        if level is not None and weight is None and size_average is None and reduce is None and reduction == "mean":
            x, xd = _unwrap(input, level)
            y, yd = _unwrap(target, level) if isinstance(target, torch.Tensor) else (None, None)
            if (xd is not None and y is not None and not _wrapped(x) and not _wrapped(y) and x.is_floating_point()
                    and y.dtype == torch.long and x.dim() == 3
                    and y.dim() - (yd is not None) == 1):
                n = x.shape[xd]
                x = x.movedim(xd, 0)  # [N, B, C]
                y = y.movedim(yd, 0) if yd is not None else y.expand(n, *y.shape)  # [N, B]
                if y.shape[1] == x.shape[1]:  # (else torch's own error, from its call)
                    with _interpreter().lower():  # plain tensors, autograd as usual
                        rows = fn(x.reshape(-1, x.shape[-1]), y.reshape(-1), None, None, ignore_index, None, "none",
                                  label_smoothing).view(n, -1)
                        counted = (y != ignore_index).sum(1).to(rows.dtype)  # (all ignored: 0 / 0, NaN, as torch's)
                        loss = rows.sum(1) / counted
                    return _functorch._add_batch_dim(loss, 0, level)
        return fn(input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing)

    cross_entropy.__wrapped__ = fn  # type: ignore[attr-defined]
    return cross_entropy


@contextlib.contextmanager
def routed() -> Iterator[Any]:
    """Inside: ``F.cross_entropy`` (whatever F holds: torch's, or a user's wrapper) runs the replicas' common form as
    one call under the engine's vmap."""
    with patched("cross_entropy", F, {"cross_entropy": replicas_cross_entropy}):
        yield
