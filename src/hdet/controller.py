"""Auto-LR controllers over per-replica window losses and values. Pure Python: no torch.distributed.

The paper's controller (Eqs. 4-8) is :class:`PaperController`. It is written for learning rates but,
as the paper's Remark 1 notes, it applies to any scalar hyperparameter ``h``: ``Delta = h~ - h_bar``
is a zero-order estimate of ``-dL/dh``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["softmax_weights", "gamma_as_printed", "gamma_decay", "PaperController", "ControllerStep"]

GammaMode = Literal["decay", "as_printed"]


def softmax_weights(losses: Sequence[float], sigma: float) -> list[float]:
    """Eq. 4: ``s_r = (mean(L) - L_r) / sigma``, ``w = softmax(s)`` (max-shifted for stability)."""
    L_bar = sum(losses) / len(losses)
    s = [(L_bar - L_r) / sigma for L_r in losses]
    s_max = max(s)
    e = [math.exp(s_r - s_max) for s_r in s]
    Z = sum(e)
    return [e_r / Z for e_r in e]


def gamma_as_printed(div_factor: float, final_div_factor: float, K: float) -> float:
    """Eq. 8 exactly as printed: ``gamma = 1 - exp(-log(f_div / f_final) / K)``.

    With OneCycleLR's defaults (25, 1e4) this is negative: with no signal the base grows by
    ``f_final / f_div`` (x400) over the K controller steps."""
    return 1.0 - math.exp(-math.log(div_factor / final_div_factor) / K)


def gamma_decay(start: float, final: float, K: float) -> float:
    """The evident intent of Eq. 8: a per-sync decay that takes ``start`` to ``final`` in K syncs,
    ``(1 - gamma)^K = final / start``. For OneCycle, ``final`` is its floor ``min_lr``."""
    if start <= 0 or final <= 0:
        return 0.0
    return 1.0 - math.exp(-math.log(start / final) / K)


@dataclass
class ControllerStep:
    """What one controller update saw and did (a telemetry record)."""

    values: list[float]
    losses: list[float]
    weights: list[float]
    h_tilde: float
    h_bar: float
    delta: float
    velocity: float
    new_base: float
    clamped: bool = False


@dataclass
class PaperController:
    """The paper's auto-LR controller, Eqs. 4-7, with Eq. 8's gamma given.

    Notation to match the paper: ``beta`` momentum of the velocity, ``sigma`` loss temperature,
    ``lam`` (lambda) step size of the meta-update, ``gamma`` per-sync decay, ``v`` velocity.
    ``bounds`` clamps the new base value (never active in the paper's setting; it keeps a runaway
    signal from producing a negative or exploding learning rate)."""

    beta: float = 0.9
    sigma: float = 0.1
    lam: float = 0.5
    gamma: float = 0.0
    bounds: tuple[float, float] = (0.0, math.inf)
    v: float = 0.0
    updates: int = field(default=0)

    def update(self, values: Sequence[float], losses: Sequence[float], anchor: float | None = None) -> ControllerStep:
        """One sync: ``values[r]`` is replica r's value during the window, ``losses[r]`` its mean loss.

        ``anchor`` replaces ``h_bar`` as the point Eq. 7 updates from. They are equal for a symmetric
        spread; when bounds clamp some values, h_bar drifts away from the base, and the base is the
        better anchor (hdet passes it for hyperparameters other than the LR)."""
        if len(values) != len(losses) or not values:
            raise ValueError(f"Expected one value per loss, but got {len(values)} values and {len(losses)} losses")
        w = softmax_weights(losses, self.sigma)  # Eq. 4
        h_tilde = sum(w_r * h_r for w_r, h_r in zip(w, values))  # Eq. 5
        h_bar = sum(values) / len(values)  # Eq. 5
        delta = h_tilde - h_bar  # Eq. 6
        self.v = self.beta * self.v + (1.0 - self.beta) * delta  # Eq. 7
        new_base = (h_bar if anchor is None else anchor) * (1.0 - self.gamma) + self.v * self.lam  # Eq. 7
        lo, hi = self.bounds
        clamped = not lo <= new_base <= hi
        new_base = min(max(new_base, lo), hi)
        self.updates += 1
        return ControllerStep(list(values), list(losses), w, h_tilde, h_bar, delta, self.v, new_base, clamped)

    def state_dict(self) -> dict[str, Any]:
        return {"beta": self.beta, "sigma": self.sigma, "lam": self.lam, "gamma": self.gamma,
                "bounds": tuple(self.bounds), "v": self.v, "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("beta", "sigma", "lam", "gamma", "v"):
            setattr(self, key, float(state[key]))
        self.bounds = (float(state["bounds"][0]), float(state["bounds"][1]))
        self.updates = int(state["updates"])
