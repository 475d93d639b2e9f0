"""Warm noisy initialisation, Eq. 10: ``theta_r = theta_0 + eps_r``, ``eps_r ~ N(0, nu^2 ||theta_0||^2 / d)``."""

from __future__ import annotations

import hashlib
import math
import warnings
from collections.abc import Iterable

import torch
from torch import nn

from .values import int_number, real_number

__all__ = ["warm_init_"]


@torch.no_grad()
def warm_init_(
    params: nn.Module | Iterable[torch.Tensor],
    rank: int | None = None,
    nu: float = 0.01,
    seed: int = 0,
    scope: str = "model",
) -> float:
    """Add independent Gaussian noise to this replica's parameters, in place, and return its std.

    Call it once on every replica, after wrapping the model in DDP (DDP broadcasts rank 0's weights
    when it wraps) and after building the scheduler; HDET never averages before the first sync step,
    so the noise survives until then. ``rank`` defaults to the process group rank (0 without one);
    replica ``r`` draws from a dedicated generator on the parameters' device, seeded by a hash of ``(seed, r)``
    (not ``seed`` itself, which seeds the model's initial weights, nor ``seed + r``), so the caller's global RNG
    is untouched.

    ``scope="model"`` is Eq. 10: one std ``nu * ||theta_0|| / sqrt(d)`` over all parameters.
    ``scope="tensor"`` uses each tensor's own ``nu * ||theta|| / sqrt(numel)`` (the reference README).

    Args:
        params: this replica's module (the DDP-wrapped one's ``.module``: its trainable parameters; frozen ones are
            left as they are, equal on every replica, and a converge step keeps them so up to rounding) or the
            tensors to perturb.
        rank: this replica's index (default: the process group's rank; without one, 0 and a warning: in the
            one-process engine pass ``rank=r`` for replica ``r``, ``for r, m in enumerate(engine.models)``).
        nu: the noise scale of Eq. 10.
        seed: replica ``r`` draws from a generator seeded by a hash of ``(seed, r)``.
        scope: "model" (Eq. 10) or "tensor".
    """
    x = real_number(nu)
    if x is None or not 0 <= x < math.inf:
        raise ValueError(f"Expected a finite nu >= 0, but got {nu!r}")
    nu = x
    if scope not in ("model", "tensor"):
        raise ValueError(f"Expected scope 'model' or 'tensor', but got {scope!r}")
    if rank is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank()
        else:
            rank = 0
            warnings.warn("hdet: warm_init_ with no process group and no rank draws replica 0's noise: every call "
                          "adds the same noise. In the one-process engine give each replica its own, "
                          "warm_init_(model, rank=r) for replica r", stacklevel=2)
    r, s = int_number(rank), int_number(seed)
    if r is None or r < 0 or s is None or s < 0:
        raise ValueError(f"Expected integers rank >= 0 and seed >= 0, but got rank={rank!r}, seed={seed!r}")
    rank, seed = r, s
    if isinstance(params, nn.Module):  # its trainable parameters: a frozen one is never averaged, so its noise
        tensors = [p for p in params.parameters() if p.is_floating_point() and p.requires_grad]  # would stay
    else:
        tensors = [p for p in params if p.is_floating_point()]
    if not tensors:
        raise ValueError("Expected at least one floating-point parameter, but got none")
    if any(hasattr(p, "placements") for p in tensors):  # DTensors: torch's "mixed Tensor and DTensor" error else
        raise ValueError("Expected plain (DDP) parameters, but got FSDP2/HSDP DTensor parameters: warm_init_ does not "
                         "support sharded replicas yet (it is optional: leave it out)")
    generators: dict[torch.device, torch.Generator] = {}

    def noise_like(p: torch.Tensor) -> torch.Tensor:
        if p.device not in generators:
            generators[p.device] = torch.Generator(device=p.device).manual_seed(_stream(seed, rank))
        return torch.randn(p.shape, generator=generators[p.device], device=p.device, dtype=torch.float32)

    if scope == "model":
        d = sum(p.numel() for p in tensors)
        sq = sum(float(p.detach().float().pow(2).sum()) for p in tensors)  # host sync, once
        std = nu * (sq / d) ** 0.5
        for p in tensors:
            p.add_(noise_like(p).mul_(std).to(p.dtype))
        return std
    stds = []
    for p in tensors:
        std = nu * float(p.detach().float().norm()) / p.numel() ** 0.5  # host sync, once per tensor
        p.add_(noise_like(p).mul_(std).to(p.dtype))
        stds.append(std)
    return max(stds)


def _stream(seed: int, rank: int) -> int:
    """Replica ``rank``'s generator seed for ``seed``: a hash, so that it is no seed a user sets. Seeded ``seed +
    rank``, replica 0's noise came from the stream ``torch.manual_seed(seed)`` had drawn the model's initial
    weights from (correlated with them: tests/test_inputs.py), and run seed s's replica 1 was
    run seed s + 1's replica 0."""
    digest = hashlib.sha256(f"hdet.warm_init:{seed}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # < 2**63
