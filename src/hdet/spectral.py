"""Spectral normalisation's estimates refreshed after the replicas' weights are averaged: :func:`refresh_`.

``torch.nn.utils.parametrizations.spectral_norm`` (and the older ``torch.nn.utils.spectral_norm`` hook) divides a
weight by ``sigma = u^T W v``, where ``u`` and ``v`` are buffers that a power iteration in each training forward keeps
near W's top singular vectors; in eval mode they are used as they are. A converge step averages them with the weights
(they are persistent floating-point buffers), but the mean of unit vectors is shorter than one: ``sigma`` came out too
small and the averaged model's eval-mode weight had a spectral norm above 1 (an audit: 1.0076 for a 16 -> 1 layer,
its outputs 0.9% off). After every write of averaged (or restored) weights into a model, :func:`refresh_` runs the
power iteration on the weight now in the model, from the averaged vectors, until ``sigma`` settles (a relative change
of at most 1e-6, at most 100 steps: one step, a training forward's, left 1.1% of a spectral norm of 1.71 after an
average of two replicas 0.3 apart; more, 1.0000). Deterministic: replicas with equal weights and buffers stay equal.
Sharded (DTensor) weights are left as they are.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from .sync import memory_key

__all__ = ["refresh_"]

try:  # torch's private classes: without them nothing is refreshed (and nothing else changes)
    from torch.nn.utils.parametrizations import _SpectralNorm
except ImportError:  # pragma: no cover - older or newer torch
    _SpectralNorm = None
_HookForm = getattr(importlib.import_module("torch.nn.utils.spectral_norm"), "SpectralNorm", None)


RTOL, MAX_STEPS = 1e-6, 100  # when sigma has settled; the most steps


@torch.no_grad()
def refresh_(model: nn.Module | None, averaged: Callable[[], Iterable[torch.Tensor]]) -> int:
    """Run the power iteration of every spectral norm in ``model`` whose weight or ``u`` is among ``averaged()`` (the
    tensors an average, a reset or a go-back just wrote, listed only where there are spectral norms) on its weight as
    it is now, until its ``sigma`` settles. Two schedulers over one model, each with ``model=``: each averages the
    model's buffers, the other's ``u``, ``v`` too, which are refreshed for that replica's own weight (its own until the
    other's converge step); a scheduler without ``model=`` averages no buffer and refreshes nothing. Returns how many
    were refreshed (0 when the model has none: one pass over its modules). HOST SYNC: one read per step of the
    iteration, where there are any."""
    if model is None:
        return 0
    keys = None
    done = 0
    for module in model.modules():
        found = []  # (weight, its matrix form, u, v, eps, u first)
        if _SpectralNorm is not None and parametrize.is_parametrized(module):
            for plist in module.parametrizations.values():
                for k, p in enumerate(plist):
                    if isinstance(p, _SpectralNorm):
                        found.append((plist.original, lambda w, k=k, plist=plist, p=p: _matrix(plist, k, p, w),
                                      p._u, p._v, p.eps, True))
        if _HookForm is not None:
            for hook in module._forward_pre_hooks.values():
                if isinstance(hook, _HookForm) and isinstance(getattr(module, hook.name + "_orig", None), torch.Tensor):
                    found.append((getattr(module, hook.name + "_orig"), hook.reshape_weight_to_matrix,
                                  getattr(module, hook.name + "_u"), getattr(module, hook.name + "_v"), hook.eps, False))
        for weight, matrix, u, v, eps, u_first in found:
            if keys is None:
                keys = {memory_key(t) for t in averaged()}
            if _is_dtensor(weight) or (memory_key(weight.detach()) not in keys and memory_key(u) not in keys):
                continue
            w = matrix(weight)
            if w is not None:
                _iterate(w, u, v, eps, u_first)
                done += 1
    return done


def _matrix(plist: nn.ModuleList, k: int, norm: nn.Module, weight: torch.Tensor) -> torch.Tensor | None:
    """The k-th parametrization's input as its matrix: the original weight through the parametrizations before it
    (None for a 1-d one, which is normalised exactly, with no estimate)."""
    for p in list(plist)[:k]:
        weight = p(weight)
    return norm._reshape_weight_to_matrix(weight) if weight.ndim > 1 else None


def _iterate(w: torch.Tensor, u: torch.Tensor, v: torch.Tensor, eps: float, u_first: bool) -> None:
    """Power iteration on ``w`` in place on ``u`` and ``v`` (in each form's order) until ``sigma = u^T w v`` settles."""
    last = None
    for _ in range(MAX_STEPS):
        if u_first:
            F.normalize(torch.mv(w, v), dim=0, eps=eps, out=u)
            F.normalize(torch.mv(w.H, u), dim=0, eps=eps, out=v)
        else:
            F.normalize(torch.mv(w.H, u), dim=0, eps=eps, out=v)
            F.normalize(torch.mv(w, v), dim=0, eps=eps, out=u)
        sigma = float(torch.vdot(u, torch.mv(w, v)).real)  # HOST SYNC
        if last is not None and abs(sigma - last) <= RTOL * abs(sigma):
            return
        last = sigma


def _is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "placements")
