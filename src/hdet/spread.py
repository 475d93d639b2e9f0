"""Eq. 1 multipliers, the :class:`Spread` of any explored value around its base, and the dealing of
positions to replicas by a synchronised permutation (Eq. 9)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .values import int_number, real_number

__all__ = ["linear_multipliers", "Spread", "Dealer"]


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
    x = real_number(alpha)
    if x is None or not 0.0 <= x < 1.0:
        raise ValueError(f"Expected 0 <= {name} (alpha) < 1, but got {alpha!r}")
    return x


KINDS = ("linear", "log", "additive")


@dataclass(frozen=True)
class Spread:
    """How N replicas' values sit around a base value ``b``; position ``z_r = (r - (N-1)/2) / delta`` in
    [-1, 1] (Eq. 1's normalisation):

    * ``"linear"`` (Eq. 1): ``b * (1 + alpha z)``, alpha in [0, 1);
    * ``"log"`` (scale-like values): ``b * (1 + alpha)^z``, so the extremes are ``b * rho`` and ``b / rho``
      (alpha >= 0); the controller then works on ``log(value)``;
    * ``"additive"``: ``b + alpha z`` (alpha >= 0), for values whose base may be 0 (dropout).

    Values, and the controller's new base, are clamped into ``bounds`` (inclusive)."""

    kind: str = "linear"
    alpha: float = 0.0
    bounds: tuple[float, float] | None = None  # default: (0, inf) for log, unbounded otherwise

    def __post_init__(self) -> None:
        if self.bounds is None:
            object.__setattr__(self, "bounds", (0.0, math.inf) if self.kind == "log" else (-math.inf, math.inf))
        if self.kind not in KINDS:
            raise ValueError(f"Expected a spread kind in {KINDS}, but got {self.kind!r}")
        a = real_number(self.alpha)
        if a is None or not math.isfinite(a) or a < 0 or (self.kind == "linear" and a >= 1):
            want = "0 <= alpha < 1" if self.kind == "linear" else "a finite alpha >= 0"
            raise ValueError(f"Expected {want} for a {self.kind} spread, but got {self.alpha!r}")
        object.__setattr__(self, "alpha", a)
        pair = tuple(self.bounds) if isinstance(self.bounds, (tuple, list)) else ()
        if len(pair) != 2 or any(real_number(b) is None for b in pair):
            raise ValueError(f"Expected bounds as (low, high), two numbers, but got {self.bounds!r}")
        object.__setattr__(self, "bounds", tuple(real_number(b) for b in pair))
        lo, hi = self.bounds  # type: ignore[misc]
        if not lo <= hi:
            raise ValueError(f"Expected bounds (low, high) with low <= high, but got {self.bounds!r}")
        if self.kind == "log" and lo < 0:
            raise ValueError(f"Expected bounds >= 0 for a log spread (values are scales), but got {self.bounds!r}")

    def offsets(self, n: int) -> list[float]:
        """Per position: the multiplier (linear, log) or the offset (additive)."""
        if self.kind == "linear":
            return linear_multipliers(n, self.alpha)
        centre, delta = (n - 1) / 2, max((n - 1) / 2, 0.5)
        z = [(r - centre) / delta for r in range(n)]
        return [(1.0 + self.alpha) ** x for x in z] if self.kind == "log" else [self.alpha * x for x in z]

    def clamp(self, v: float) -> float:
        return min(max(v, self.bounds[0]), self.bounds[1])

    def unclamped(self, base: float, offset: float) -> float:
        return base + offset if self.kind == "additive" else base * offset

    def apply(self, base: float, offset: float) -> float:
        return self.clamp(self.unclamped(base, offset))

    # the controller's space: log for scale-like values
    def to_ctrl(self, v: float) -> float:
        return (math.log(v) if v > 0 else -math.inf) if self.kind == "log" else v

    def from_ctrl(self, x: float) -> float:
        return self.clamp(math.exp(x) if self.kind == "log" else x)

    def ctrl_bounds(self) -> tuple[float, float]:
        return (self.to_ctrl(self.bounds[0]), self.to_ctrl(self.bounds[1])) if self.kind == "log" else self.bounds


class Dealer:
    """Deals multipliers to replicas by permutations drawn from a dedicated generator (Eq. 9).

    Every replica holds a ``Dealer`` seeded identically, so every replica draws the same
    permutation without communicating. The caller's global RNG is never read, seeded or advanced.
    """

    def __init__(self, seed: int) -> None:
        x = int_number(seed)
        if x is None or not 0 <= x < 2 ** 63:
            raise ValueError(f"Expected an integer seed in [0, 2**63), but got {seed!r}")
        self.seed = x
        self._generator = torch.Generator(device="cpu")
        self._generator.manual_seed(x)

    def permutation(self, n: int) -> list[int]:
        """A fresh permutation ``pi`` of ``range(n)``: replica ``r`` gets multiplier ``rho[pi[r]]``."""
        return torch.randperm(n, generator=self._generator).tolist()  # CPU generator: no device sync

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "generator": self._generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed = int(state["seed"])
        self._generator.set_state(state["generator"])
