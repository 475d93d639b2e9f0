"""Fused attention for the engine's replicas: :func:`scaled_dot_product_attention`.

Under ``torch.func.vmap`` (the engine's fast path) ``F.scaled_dot_product_attention`` has no batching rule on the
CPU (functorch runs it once per replica, with a warning) and on CUDA the memory-efficient kernel's backward fails
("LSE is not correctly aligned"), so a model that calls it fell back to the engine's loop (0.07-0.22x one model,
docs/engine.md). Here the replica axis is folded into the attention's own batch axis, ``[N, B, ...] -> [N * B, ...]``,
and the fused kernel runs once for all replicas, forward and backward (autograd records the call on the plain
tensors). Outside vmap it is ``F.scaled_dot_product_attention`` itself.

:class:`hdet.engine.ReplicaEngine` (eager vmap) routes ``torch.nn.functional.scaled_dot_product_attention`` here
while it runs the replicas' forward (:func:`routed`); a model that imported the function by name can call this
one instead. Under ``torch.compile`` the rule is not used (Dynamo traces the function's body): compiled
models keep what they call.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F

from .patching import patched

__all__ = ["scaled_dot_product_attention", "routed", "under_vmap", "without_dropout"]

_SDPA = torch._C._nn.scaled_dot_product_attention  # torch's own (F.scaled_dot_product_attention)


def under_vmap(t: Any) -> bool:
    """Whether ``t`` is a tensor batched by ``torch.func.vmap`` (seen from inside the vmapped function)."""
    is_batched = getattr(torch._C._functorch, "is_batchedtensor", None)
    return isinstance(t, torch.Tensor) and is_batched is not None and bool(is_batched(t))


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` (same arguments), one fused call for all vmapped replicas."""
    if not any(under_vmap(t) for t in (query, key, value, attn_mask)):
        return _torch_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return _FoldedAttention.apply(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _torch_sdpa(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa):  # noqa: ANN001, ANN202
    """torch's own function (``enable_gqa`` passed only when set: torch < 2.5 has no such argument)."""
    kw = {"enable_gqa": True} if enable_gqa else {}
    return _SDPA(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **kw)


class _FoldedAttention(torch.autograd.Function):
    """Only its vmap rule runs (outside vmap :func:`scaled_dot_product_attention` calls torch's directly)."""

    @staticmethod
    def forward(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa):  # noqa: ANN001, ANN205 - torch's protocol
        return _torch_sdpa(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa)

    @staticmethod
    def setup_context(ctx, inputs, output):  # noqa: ANN001, ANN205
        pass

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        raise RuntimeError("hdet: _FoldedAttention's backward runs only through its vmap rule")

    @staticmethod
    def vmap(info, in_dims, q, k, v, mask, dropout_p, is_causal, scale, enable_gqa):  # noqa: ANN001, ANN205
        n = info.batch_size
        if dropout_p > 0 and info.randomness != "different":
            raise RuntimeError(f"Expected vmap(randomness='different') for attention dropout over the replicas (each "
                               f"its own mask, as the engine runs them), but got randomness={info.randomness!r}")
        q, k, v = (_front(t, d, n) for t, d in zip((q, k, v), in_dims[:3]))  # [N, *one replica's shape]
        batch = tuple(q.shape[1:-2])  # one replica's batch axes (before L, E)
        if batch:  # fold the replicas into the first batch axis: [N * B, ...]
            k, v = (_fold(_expand_batch(t, batch)) for t in (k, v))
            q = _fold(q)
        if mask is not None and (in_dims[3] is not None or mask.dim() > 2):  # ([L, S] broadcasts as it is)
            mask = _front(mask, in_dims[3], n)
            mask = _expand_batch(mask, batch)
            mask = _fold(mask) if batch else mask
        out = _torch_sdpa(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa)
        return (out.view(n, out.shape[0] // n, *out.shape[1:]) if batch else out), 0


def _front(t: torch.Tensor, d: int | None, n: int) -> torch.Tensor:
    """``t`` with the replica axis first: moved there, or (one tensor for all replicas) expanded to ``n``."""
    return t.expand(n, *t.shape) if d is None else t.movedim(d, 0)


def _expand_batch(t: torch.Tensor, batch: tuple[int, ...]) -> torch.Tensor:
    """``[N, ..., X, Y]`` with as many batch axes as ``batch`` (missing ones added in front, as broadcasting does) and
    the first one expanded to ``batch[0]``, the axis the replicas fold into; the others broadcast in the kernel as
    they did for one replica (grouped-query heads included)."""
    one = t.shape[1:]
    missing = len(batch) + 2 - len(one)
    if missing > 0:
        t = t.reshape(t.shape[0], *([1] * missing), *one)
    return t.expand(t.shape[0], batch[0], *t.shape[2:]) if batch else t


def _fold(t: torch.Tensor) -> torch.Tensor:
    """``[N, B, ...] -> [N * B, ...]`` (a copy only where ``t`` is expanded or strided so)."""
    return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])


def routed() -> contextlib.AbstractContextManager:
    """``torch.nn.functional.scaled_dot_product_attention`` is :func:`scaled_dot_product_attention` inside (where F
    holds torch's own, or :func:`without_dropout` of it; a user's wrapper of it keeps being called)."""
    def route(before: Any) -> Any:
        if before is _SDPA:
            return scaled_dot_product_attention
        if getattr(before, "__wrapped__", None) is _SDPA and getattr(before, "_hdet_without_dropout", False):
            # (merged mode's check runs vmap with dropout off: unrouted, vmap's own SDPA ran, whose memory-efficient
            # CUDA backward fails under vmap, "LSE is not correctly aligned", and the first merged step raised)
            return without_dropout(scaled_dot_product_attention)
        return before
    return patched("attention", F, {"scaled_dot_product_attention": route})


def without_dropout(sdpa: Any) -> Any:
    """``sdpa`` with its ``dropout_p`` at 0 (the merged check's runs draw no masks)."""
    def no_drop_sdpa(*args: Any, **kwargs: Any) -> torch.Tensor:
        if len(args) > 4:  # (query, key, value, attn_mask, dropout_p, ...)
            args = (*args[:4], 0.0, *args[5:])
        else:
            kwargs["dropout_p"] = 0.0
        return sdpa(*args, **kwargs)
    no_drop_sdpa.__wrapped__ = sdpa  # type: ignore[attr-defined]
    no_drop_sdpa._hdet_without_dropout = True  # type: ignore[attr-defined]
    return no_drop_sdpa
