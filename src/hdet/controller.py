"""Auto-LR controllers over per-replica losses and values. Pure Python: no torch.distributed.

* :class:`PaperController` (``controller="paper"``): the paper's Eqs. 4-8 on the replicas' training
  losses of the window. It is written for learning rates but, as the paper's Remark 1 notes, it applies
  to any scalar hyperparameter ``h``: ``Delta = h~ - h_bar`` is a zero-order estimate of ``-dL/dh``.
  It replaces the base schedule by its own value.
* :class:`FitController` (``controller="fit"``): hdet's own. Between two converge steps the replicas
  share every gradient, so (with Adam's shared moments) replica r sits at ``x0 + rho_r * D`` on one line
  along the window's update ``D``: the replicas are a line search over the step size. The window's
  training loss answers it with the short-horizon bias (a shorter step has less noise *now*, so it
  always wins). hdet instead evaluates every replica at the *average of its iterates over the window*
  (Polyak), on one probe batch that every replica sees (a paired comparison: no data noise): averaging
  removes the noise term, so what is left is progress. It fits the probe losses against the replicas'
  log multipliers with a parabola, and moves a multiplicative correction of the base schedule (kept in
  log space, so the schedule's shape is kept) toward the fitted optimum, within a trust region.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Literal

from .values import check_bool, real_number

__all__ = ["softmax_weights", "gamma_as_printed", "gamma_decay", "PaperController", "FitController", "ControllerStep",
           "Observation", "fit_parabola", "CONTROLLERS", "controller_from_state"]

GammaMode = Literal["decay", "as_printed"]


def _number(name: str, v: Any, ok: Any, want: str) -> float:
    """``v`` as a float where it is one real number with ``ok(v)``; else a ValueError saying ``want``."""
    x = real_number(v)
    if x is None or math.isnan(x) or not ok(x):
        raise ValueError(f"Expected {want.format(name)}, but got {v!r}")
    return x


def _finite(name: str, v: Any) -> float:
    return _number(name, v, math.isfinite, "a finite number for {}")


def _bounds(v: Any) -> tuple[float, float]:
    """``(lo, hi)``, two numbers (infinite allowed) with lo <= hi."""
    pair = tuple(v) if isinstance(v, (tuple, list)) else ()
    if len(pair) != 2 or any(real_number(b) is None or math.isnan(real_number(b)) for b in pair):
        raise ValueError(f"Expected bounds as (lo, hi), two numbers (not NaN), but got {v!r}")
    lo, hi = (real_number(b) for b in pair)
    if lo > hi:
        raise ValueError(f"Expected bounds (lo, hi) with lo <= hi, but got {v!r}")
    return lo, hi


def softmax_weights(losses: Sequence[float], sigma: float) -> list[float]:
    """Eq. 4: ``s_r = (mean(L) - L_r) / sigma``, ``w = softmax(s)``, max-shifted before the division:
    ``s_r - max(s) = (min(L) - L_r) / sigma`` (a tiny sigma then gives 0 and -inf, never inf - inf = NaN)."""
    sigma = _number("sigma", sigma, lambda x: 0 < x < math.inf, "a finite {} > 0")
    if not losses:
        raise ValueError("Expected at least one loss, but got none")
    L_min = min(losses)
    e = [math.exp((L_min - L_r) / sigma) for L_r in losses]
    Z = sum(e)
    return [e_r / Z for e_r in e]


def gamma_as_printed(div_factor: float, final_div_factor: float, K: float) -> float:
    """Eq. 8 exactly as printed: ``gamma = 1 - exp(-log(f_div / f_final) / K)``.

    With OneCycleLR's defaults (25, 1e4) this is negative: with no signal the base grows by
    ``f_final / f_div`` (x400) over the K controller steps."""
    for name, v in (("div_factor", div_factor), ("final_div_factor", final_div_factor), ("K", K)):
        _number(name, v, lambda x: 0 < x < math.inf, "a finite {} > 0")
    return 1.0 - math.exp(-math.log(div_factor / final_div_factor) / K)


def gamma_decay(start: float, final: float, K: float) -> float:
    """The evident intent of Eq. 8: a per-sync decay that takes ``start`` to ``final`` in K syncs,
    ``(1 - gamma)^K = final / start``. For OneCycle, ``final`` is its floor ``min_lr``."""
    K = _number("K", K, lambda x: 0 < x < math.inf, "a finite {} > 0")
    start, final = _finite("start", start), _finite("final", final)
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
    kind: str = "paper"  # "fit": h_tilde = x*, h_bar = weight, delta = the log step, velocity = m, factor set
    factor: float | None = None  # fit: the correction of the base schedule after this update
    base: float | None = None  # the slot's base after this update (its natural space), set by the slot table


@dataclass
class Observation:
    """What a controller sees of one slot at a control sync, one entry per replica (rank order).

    ``values`` and ``offsets`` are in the slot's natural space (a learning rate, a dropout p); a controller
    that works in log space (log spreads) maps them itself."""

    values: list[float]  # h_r: replica r's value during the window
    offsets: list[float]  # replica r's multiplier (linear, log spreads) or offset (additive) from the base
    window_losses: list[float]  # replica r's mean training loss over the window (non-finite ones ranked worst)
    probe_losses: list[float]  # replica r's probe loss at its window mean (NaN: not measured)
    anchor: float | None  # the base to update from (None: h_bar, the paper's choice)
    weight: float  # in [0, 1]: how near the base schedule is to its peak so far


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
    log_space: bool = False  # a log spread: Eqs. 4-7 on log values; ``bounds`` in log space too
    value: float | None = None  # the base it set at its last update (natural space): it replaces the schedule

    kind: ClassVar[str] = "paper"
    uses_probe: ClassVar[bool] = False

    def __post_init__(self) -> None:
        """The same ranges as the scheduler's ``momentum_of_lr``, ``loss_scale`` and ``lr_of_lr`` (a controller
        built by hand took NaN or zero unchecked and turned every later base into NaN: an audit); ``gamma`` <= 1
        (Eq. 8 as printed is negative: the base grows; a decay over a fraction of a sync rounds to 1)."""
        self.beta = _number("beta", self.beta, lambda x: 0 <= x < 1, "0 <= {} < 1")
        self.sigma = _number("sigma", self.sigma, lambda x: 0 < x < math.inf, "a finite {} > 0")
        self.lam = _number("lam", self.lam, lambda x: 0 <= x < math.inf, "a finite {} >= 0")
        self.gamma = _number("gamma", self.gamma, lambda x: -math.inf < x <= 1, "a finite {} <= 1")
        self.bounds = _bounds(self.bounds)
        self.v = _finite("v", self.v)
        self.log_space = check_bool("log_space", self.log_space)
        if self.value is not None:
            self.value = _finite("value", self.value)

    def base(self, scheduled: float) -> float:
        """The slot's base: the controller's own value once it has updated (Eq. 7 replaces the schedule)."""
        return scheduled if self.value is None else self.value

    def scale(self, factor: float) -> None:
        """The LR schedule was cut by ``factor`` (:mod:`hdet.stability`): so is the controller's own base."""
        if self.value is not None:
            self.value *= factor

    def control(self, obs: Observation) -> ControllerStep:
        """Eqs. 4-7 on the window's training losses (log values for a log spread)."""
        to = (lambda v: math.log(v) if v > 0 else -math.inf) if self.log_space else (lambda v: v)
        anchor = None if obs.anchor is None else to(obs.anchor)
        step = self.update([to(v) for v in obs.values], obs.window_losses, anchor)
        self.value = math.exp(step.new_base) if self.log_space else step.new_base
        return step

    def update(self, values: Sequence[float], losses: Sequence[float], anchor: float | None = None) -> ControllerStep:
        """One sync: ``values[r]`` is replica r's value during the window, ``losses[r]`` its mean loss.

        ``anchor`` replaces ``h_bar`` as the point Eq. 7 updates from. They are equal for a symmetric
        spread; when bounds clamp some values, h_bar drifts away from the base, and the base is the
        better anchor (hdet passes it for hyperparameters other than the LR)."""
        if len(values) != len(losses) or not values:
            raise ValueError(f"Expected one value per loss, but got {len(values)} values and {len(losses)} losses")
        w = softmax_weights(losses, self.sigma)  # Eq. 4 (a loss of +inf: weight 0)
        h_tilde = sum(w_r * h_r for w_r, h_r in zip(w, values))  # Eq. 5
        # a replica whose window measured nothing (+inf: observe(counted=False) at every step) is left out of h_bar
        # too: counted there, it moved the base towards the replicas that measured something, whatever their losses
        # (a review: two equal losses and one empty replica gave a delta of -0.025 at LRs 0.05 / 0.10 / 0.15)
        measured = [h_r for h_r, L_r in zip(values, losses) if L_r != math.inf] or list(values)
        h_bar = sum(measured) / len(measured)  # Eq. 5
        delta = h_tilde - h_bar  # Eq. 6
        self.v = self.beta * self.v + (1.0 - self.beta) * delta  # Eq. 7
        if anchor is None:  # Eq. 7 goes on from every replica's mean (the base), not the measured ones'
            anchor = sum(values) / len(values)
        new_base = anchor * (1.0 - self.gamma) + self.v * self.lam  # Eq. 7
        lo, hi = self.bounds
        clamped = not lo <= new_base <= hi
        new_base = min(max(new_base, lo), hi)
        self.updates += 1
        return ControllerStep(list(values), list(losses), w, h_tilde, h_bar, delta, self.v, new_base, clamped)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "paper", "beta": self.beta, "sigma": self.sigma, "lam": self.lam, "gamma": self.gamma,
                "bounds": tuple(self.bounds), "v": self.v, "updates": self.updates, "log_space": self.log_space,
                "value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        value = state.get("value")
        if value is not None and not math.isfinite(float(value)):
            raise ValueError(f"Expected a finite controlled base, but got {value!r}")
        fields = {key: float(state[key]) for key in ("beta", "sigma", "lam", "gamma", "v")}
        # (checked as when built, on a copy: a state refused leaves this controller as it was)
        checked = replace(self, **fields, bounds=(float(state["bounds"][0]), float(state["bounds"][1])),
                          updates=int(state["updates"]), log_space=bool(state.get("log_space", False)),
                          value=None if value is None else float(value))
        self.__dict__.update(checked.__dict__)


def fit_parabola(x: Sequence[float], y: Sequence[float]) -> tuple[float, float, float]:
    """Least squares ``y ~ a + b x + q x^2``; returns ``(a, b, q)``. Needs 3 distinct x (else q = 0 and a
    straight line; a single x gives b = q = 0)."""
    n = len(x)
    mx = sum(x) / n
    rms = math.sqrt(sum((xi - mx) ** 2 for xi in x) / n) or 1.0
    u = [(xi - mx) / rms for xi in x]  # centred and scaled: the degeneracy test below does not depend on the spread's
    # width (unscaled, the determinant went as width^6 against a fixed floor, and a spread under about 0.015 in log LR,
    # or an additive beta2 spread, was fitted by a straight line and sent to the edge: an audit)
    S = [sum(ui ** k for ui in u) for k in range(5)]  # S0..S4
    T = [sum(yi * ui ** k for yi, ui in zip(y, u)) for k in range(3)]
    A = [[S[0], S[1], S[2]], [S[1], S[2], S[3]], [S[2], S[3], S[4]]]
    det = _det3(A)
    scale = max(abs(v) for row in A for v in row) ** 3 or 1.0
    if len(set(x)) >= 3 and abs(det) > 1e-12 * scale:
        sol = []
        for col in range(3):  # Cramer's rule on a 3x3 system
            M = [row[:] for row in A]
            for i in range(3):
                M[i][col] = T[i]
            sol.append(_det3(M) / det)
        a, b, q = sol
    elif len(set(x)) >= 2:
        q = 0.0
        b = T[1] / S[2]
        a = T[0] / S[0]
    else:
        return (T[0] / S[0], 0.0, 0.0)
    b, q = b / rms, q / (rms * rms)  # back from the scaled variable, then the centred one: y = a + b (x - mx) + q (x - mx)^2
    return (a - b * mx + q * mx * mx, b - 2 * q * mx, q)


def _det3(m: list[list[float]]) -> float:
    return (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1]) - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
            + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))


@dataclass
class FitController:
    """hdet's controller: a log-space (multiplicative) correction ``c`` of the base schedule, moved at
    every control sync toward the parabola-fitted optimum of the replicas' probe losses.

    ``update(x, losses, weight)``: ``x[r]`` is replica r's offset from the base in the control coordinate
    (``log rho_r`` for learning rates), ``losses[r]`` its probe loss (non-finite entries are left out).
    With ``w`` the spread's half-width (``(max x - min x) / 2``):

    * ``x* = -b / 2q`` of the fit ``L ~ a + b x + q x^2``, clipped to ``[-2w, 2w]`` (the spread only sees
      that far); a concave or flat fit (``q <= 0``) means "go further in the downhill direction": ``x* =
      -2w sign(b)``.
    * smoothed: ``m = beta m + (1 - beta) x*``;
    * trust region: the step ``kappa * weight * m`` is clipped to ``[-max_step w, +max_step w]``;
      ``weight`` in [0, 1] is given by the caller: hdet passes ``clip((s / peak - 0.5) / 0.5, 0, 1)`` with
      ``s / peak`` the schedule's current value over its peak so far. The controller sets the scale
      while the schedule is near its peak and leaves the annealing alone: once the schedule decays, a
      faster decay always looks better over one window (the short-horizon bias again), averaging or not;
    * bounds: ``c`` stays in ``[log lo, log hi]`` (``bounds``, as factors of the base schedule).
    """

    kappa: float = 0.5
    beta: float = 0.5
    max_step: float = 0.6
    bounds: tuple[float, float] = (1 / 32, 32.0)
    log_scale: bool = True  # bounds are factors (LR, log spreads); False: additive offsets
    c: float = 0.0
    m: float = 0.0
    updates: int = field(default=0)

    kind: ClassVar[str] = "fit"
    uses_probe: ClassVar[bool] = True

    def __post_init__(self) -> None:
        for name in ("kappa", "max_step"):
            v = getattr(self, name)
            x = real_number(v)
            if x is None or not (x > 0 and math.isfinite(x)):
                raise ValueError(f"Expected {name} > 0, but got {v!r}")
            setattr(self, name, x)
        beta = real_number(self.beta)
        if beta is None or not 0.0 <= beta < 1.0:
            raise ValueError(f"Expected 0 <= beta < 1, but got {self.beta!r}")
        self.beta = beta
        if not isinstance(self.log_scale, bool):
            raise ValueError(f"Expected log_scale to be a bool, but got {self.log_scale!r}")
        bounds = tuple(self.bounds) if isinstance(self.bounds, (tuple, list)) else ()
        if len(bounds) != 2 or any(real_number(b) is None for b in bounds):
            raise ValueError(f"Expected bounds as (lo, hi), two numbers, but got {self.bounds!r}")
        self.bounds = lo, hi = tuple(real_number(b) for b in bounds)
        if self.log_scale and not 0 < lo <= 1 <= hi < math.inf:
            raise ValueError(f"Expected correction bounds (lo, hi) with 0 < lo <= 1 <= hi < inf, but got {self.bounds!r}")
        if not self.log_scale and not lo <= 0 <= hi:
            raise ValueError(f"Expected offset bounds (lo, hi) with lo <= 0 <= hi, but got {self.bounds!r}")
        self.c, self.m = _finite("c", self.c), _finite("m", self.m)

    @property
    def c_bounds(self) -> tuple[float, float]:
        lo, hi = self.bounds
        return (math.log(lo), math.log(hi)) if self.log_scale else (lo, hi)

    @property
    def factor(self) -> float:
        """What multiplies the base schedule (log-scale) or is added to it (additive)."""
        return math.exp(self.c) if self.log_scale else self.c

    def correct(self, base: float) -> float:
        """The base schedule's value corrected: ``base * factor``, or ``base + offset`` (additive)."""
        return base * self.factor if self.log_scale else base + self.c

    def base(self, scheduled: float) -> float:
        """The slot's base: the schedule's value, corrected."""
        return self.correct(scheduled)

    def scale(self, factor: float) -> None:
        """The LR schedule was cut: the correction applies to the cut schedule, so nothing changes here."""

    def control(self, obs: Observation) -> ControllerStep:
        """One fit on the probe losses against the replicas' offsets (log multipliers for scale-like values)."""
        x = [math.log(o) if self.log_scale else o for o in obs.offsets]
        return self.update(x, obs.probe_losses, obs.weight)

    def update(self, x: Sequence[float], losses: Sequence[float], weight: float = 1.0) -> ControllerStep:
        if len(x) != len(losses) or not x:
            raise ValueError(f"Expected one offset per loss, but got {len(x)} offsets and {len(losses)} losses")
        ok = [(xi, yi) for xi, yi in zip(x, losses) if math.isfinite(yi)]
        w = (max(x) - min(x)) / 2
        x_star = 0.0
        if len(ok) >= 2 and w > 0:  # two replicas: a line, so a step downhill
            ys = [p[1] for p in ok]
            _, b, q = fit_parabola([p[0] for p in ok], ys)
            tol = 1e-9 * max(abs(y) for y in ys)  # below the fit's own rounding: tied probe losses (bf16, a probe
            # that cannot tell the replicas apart) left b ~ 1e-16, and the sign of that moved the LR at full speed
            # (1.00 -> 1.71 on no signal: an audit)
            if abs(b) * w <= tol:
                b = 0.0
            if abs(q) * w * w <= tol:
                q = 0.0
            if q > 0:
                x_star = min(max(-b / (2 * q), -2 * w), 2 * w)
            elif b != 0:
                x_star = -2 * w * math.copysign(1.0, b)
        if len(ok) < 2:  # no verdict (every replica's probe NaN: a window whose means were dropped at a load under
            # FSDP2, or left out): nothing moves; read as a vote for x* = 0, the momentum still moved c (about 5% LR)
            self.updates += 1
            return ControllerStep(values=list(x), losses=list(losses), weights=[], h_tilde=0.0, h_bar=weight, delta=0.0,
                                  velocity=self.m, new_base=self.factor, clamped=False, kind="fit", factor=self.factor)
        self.m = self.beta * self.m + (1.0 - self.beta) * x_star
        step = min(max(self.kappa * min(max(weight, 0.0), 1.0) * self.m, -self.max_step * w), self.max_step * w)
        lo, hi = self.c_bounds
        new_c = self.c + step
        clamped = not lo <= new_c <= hi
        self.c = min(max(new_c, lo), hi)
        self.updates += 1
        return ControllerStep(values=list(x), losses=list(losses), weights=[], h_tilde=x_star, h_bar=weight,
                              delta=step, velocity=self.m, new_base=self.factor, clamped=clamped, kind="fit",
                              factor=self.factor)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "fit", "kappa": self.kappa, "beta": self.beta, "max_step": self.max_step,
                "bounds": tuple(self.bounds), "log_scale": self.log_scale, "c": self.c, "m": self.m,
                "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        fields = {key: float(state[key]) for key in ("kappa", "beta", "max_step", "c", "m")}
        # (checked as when built, on a copy: a state refused leaves this controller as it was)
        checked = replace(self, **fields, bounds=(float(state["bounds"][0]), float(state["bounds"][1])),
                          log_scale=bool(state["log_scale"]), updates=int(state["updates"]))
        self.__dict__.update(checked.__dict__)


CONTROLLERS: dict[str, type[PaperController] | type[FitController]] = {"paper": PaperController, "fit": FitController}


def controller_from_state(state: dict[str, Any]) -> PaperController | FitController:
    """A controller rebuilt from its ``state_dict()`` (states without a kind are the paper's)."""
    kind = state.get("kind", "paper")
    if kind not in CONTROLLERS:
        raise ValueError(f"Expected a controller state of kind {tuple(CONTROLLERS)}, but got {kind!r}")
    ctrl = CONTROLLERS[kind]()
    ctrl.load_state_dict(state)
    return ctrl
