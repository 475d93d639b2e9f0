"""``F.embedding``'s ``padding_idx`` for the engine's vmapped replicas: :func:`routed`.

``nn.Embedding(..., padding_idx=p)`` promises that row ``p`` gets no gradient from the lookup (it stays as it is,
a padding vector). Under ``torch.func.vmap`` with an ordinary backward after it, as the engine runs its replicas,
torch loses that: the padding row gets the gradient of every padding token, and trains (torch 2.13 on the CPU;
``vmap(grad(f))`` keeps it, a vmapped forward followed by ``.backward()`` does not). So while the engine runs its
replicas' forward, ``F.embedding`` with a ``padding_idx`` detaches its output where the input is the padding index
(the values are the same; no gradient flows from them to the padding row), as torch's own backward for one
replica does. A weight tied to another layer (an output projection) still gets that layer's gradient in the row.
The cost is one ``torch.where`` over the lookup's output (the size of the output, not of the weight).

An id out of the table's range (a tokenizer that does not match the model) makes one replica's lookup raise; under
vmap the stacked tables are looked up as one, and the id read a row of another replica's table, silently. Here it
reads NaN instead: the replica's loss is NaN, its step is left out by the engine's gradient guard, and the sync says
so (two comparisons and a fill over the ids and the output).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from .patching import patched

__all__ = ["routed", "detached_padding"]


def detached_padding(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``fn`` (``F.embedding``, or what F held) with the padding row's gradient through the lookup kept at 0, and an id
    out of the table's range looked up as NaN (not as another replica's row)."""

    def embedding(input: torch.Tensor, weight: torch.Tensor, padding_idx: int | None = None,
                  max_norm: float | None = None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                  sparse: bool = False) -> torch.Tensor:
        if not isinstance(input, torch.Tensor) or input.is_floating_point():
            return fn(input, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)
        valid = (input >= 0) & (input < weight.size(0))  # (vmap's lookup reads the stacked tables as one: an id
        # out of range read another replica's row, silently, where one replica's lookup raises; an audit)
        out = fn(torch.where(valid, input, 0), weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)
        out = out.masked_fill(~valid.unsqueeze(-1), float("nan"))  # its loss NaN: the replica's step is skipped, said
        if padding_idx is None:
            return out
        pad = padding_idx + weight.size(0) if padding_idx < 0 else padding_idx
        return torch.where((input == pad).unsqueeze(-1), out.detach(), out)  # the padding tokens' rows: no gradient

    embedding.__wrapped__ = fn  # type: ignore[attr-defined]
    return embedding


@contextlib.contextmanager
def routed() -> Iterator[Any]:
    """Inside: ``F.embedding`` (whatever F holds: torch's, or a user's wrapper) keeps ``padding_idx``'s row out of
    the lookup's gradient, also under vmap."""
    with patched("embedding", F, {"embedding": detached_padding}):
        yield
