"""Eq. 1 multipliers and their dealing to replicas by a synchronised permutation (Eq. 9)."""

from __future__ import annotations

import numbers
from typing import Any

import torch

__all__ = ["linear_multipliers", "Dealer"]


def linear_multipliers(num_replicas: int, alpha: float) -> list[float]:
    """Eq. 1: ``rho_r = 1 + alpha * (r - (N-1)/2) / delta`` with ``delta = max((N-1)/2, 0.5)``.

    The mean of the returned multipliers is 1 and each lies in ``[1 - alpha, 1 + alpha]``.
    ``alpha`` must be in ``[0, 1)``: ``alpha >= 1`` gives a zero or negative learning rate.
    """
    if not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"Expected a positive integer number of replicas, but got {num_replicas!r}")
    check_alpha(alpha)
    centre = (num_replicas - 1) / 2  # (N-1)/2
    delta = max(centre, 0.5)  # Eq. 1
    return [1.0 + alpha * (r - centre) / delta for r in range(num_replicas)]


def check_alpha(alpha: float, name: str = "ensemble_lr_spread_ratio") -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not 0.0 <= alpha < 1.0:
        raise ValueError(f"Expected 0 <= {name} (alpha) < 1, but got {alpha!r}")
    return float(alpha)


class Dealer:
    """Deals multipliers to replicas by permutations drawn from a dedicated generator (Eq. 9).

    Every replica holds a ``Dealer`` seeded identically, so every replica draws the same
    permutation without communicating. The caller's global RNG is never read, seeded or advanced.
    """

    def __init__(self, seed: int) -> None:
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
            raise ValueError(f"Expected a non-negative integer seed, but got {seed!r}")
        self.seed = int(seed)
        self._generator = torch.Generator(device="cpu")
        self._generator.manual_seed(seed)

    def permutation(self, n: int) -> list[int]:
        """A fresh permutation ``pi`` of ``range(n)``: replica ``r`` gets multiplier ``rho[pi[r]]``."""
        return torch.randperm(n, generator=self._generator).tolist()  # CPU generator: no device sync

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "generator": self._generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed = int(state["seed"])
        self._generator.set_state(state["generator"])
