"""The slot table: one row per explored scalar (each param group's LR, then each extra hyperparameter).

A slot ``j`` has a :class:`~hdet.spread.Spread` (its positions ``offsets[j]``: multipliers, or offsets
for additive spreads), a permutation ``perms[j]`` (replica ``r`` takes position ``perms[j][r]``, Eq. 9), a
base value and, once auto-LR has started, a controller. A replica's value is ``spread.apply(base,
offsets[j][perms[j][r]])`` (Eqs. 1, 9). Pure bookkeeping: no tensors, no collectives.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .config import HDETConfig
from .controller import (CONTROLLERS, ControllerStep, FitController, Observation, PaperController,
                         controller_from_state, gamma_decay)
from .range_test import RangeTest
from .spread import Dealer, Spread, linear_multipliers

__all__ = ["Slots", "LRControl"]

Controller = PaperController | FitController


@dataclass
class LRControl:
    """What the base schedule tells the LR slots' controllers (plain data, given by the scheduler).

    Args:
        bounds: per param group, the (low, high) range the paper controller keeps the LR in.
        finals: per param group, the schedule's last value (Eq. 8's decay target), or None (no decay).
        gamma_as_printed: Eq. 8's gamma as printed (OneCycle bases only), or None.
        given: whether the bounds and the finals were given (``auto_lr_bounds=``, ``final_lr=``); those set from the
            schedule scale with the range test's factor, as the schedule does.
    """

    bounds: list[tuple[float, float]]
    finals: list[float] | None = None
    gamma_as_printed: float | None = None
    given: tuple[bool, bool] = (False, False)  # (bounds, finals) given by the user, not set from the schedule


class Slots:
    """Every slot's spread, positions, permutation, base and controller, seen from replica ``rank``."""

    def __init__(self, config: HDETConfig, world_size: int, lr_names: list[str], spreads: list[Spread],
                 names: list[str]) -> None:
        self.config = config
        self.world_size = world_size
        self.num_lr_slots = len(lr_names)
        self.spreads = [Spread("linear", config.ensemble_lr_spread_ratio)] * self.num_lr_slots + list(spreads)
        self.names = list(lr_names) + list(names)
        self.num_slots = len(self.names)
        self.resize(world_size, redeal=False)  # rho (Eq. 1) and every slot's positions
        self.perms: list[list[int]] = [list(range(world_size)) for _ in range(self.num_slots)]  # rank r -> position
        for j in range(self.num_lr_slots, self.num_slots):
            # another hyperparameter starts from a permutation of its own, drawn independently of the others' (with
            # every slot at the identity, replica 0 held the lowest value of everything, and no window loss could
            # tell their effects apart) until the controller deals them (Eq. 9), or for the whole run without it.
            # The LR keeps the paper's start (replica r takes rho_r), and the dealer's stream is left as it is: the
            # same on every replica, from the seed alone
            self.perms[j] = Dealer((config.seed * 65_537 + j) % 2 ** 63).permutation(world_size)
        self.bases: list[float] = [0.0] * self.num_slots  # in effect for the next step
        self.scheduled: list[float] = [0.0] * self.num_slots  # the base schedules' values now
        self.peak0 = 0.0  # the largest scheduled base of slot 0 so far (the fit controller's weight)
        self.controllers: list[Controller | None] = [None] * self.num_slots
        self.dealer = Dealer(config.seed)
        self.lr_scale = 1.0  # the cuts of the LR schedule so far (runaway replicas, an unstable ensemble)
        self.cuts = 0  # the stability guard's events (the k-th past lr_cut_after cuts by lr_cut ** k)
        self.range: RangeTest | None = None  # the in-run LR range test (lr_range_test=True), set with the run's length
        self.kept: tuple[list[dict | None], float] | None = ([None] * self.num_slots, 1.0)  # the controllers' states
        # and lr_scale at the stability guard's best sync (as built: none has run), which a go-back restores; None:
        # not known (a state saved before they were kept)

    def resize(self, world_size: int, redeal: bool) -> None:
        """Positions for ``world_size`` replicas under the current config (after a load); ``redeal``: a fresh
        permutation for every slot (Eq. 9; an elastic resume)."""
        self.world_size = world_size
        self.rho = linear_multipliers(world_size, self.config.ensemble_lr_spread_ratio)
        self.spreads[: self.num_lr_slots] = [Spread("linear", self.config.ensemble_lr_spread_ratio)] * self.num_lr_slots
        self.offsets = [s.offsets(world_size) for s in self.spreads]
        for j in range(self.num_slots if redeal else 0):
            self.deal(j)

    # ----------------------------------------------------------------- values
    def multiplier(self, j: int, rank: int) -> float:
        """Replica ``rank``'s multiplier (offset for additive spreads) for slot ``j``: ``rho[pi_j[rank]]`` (Eq. 9)."""
        return self.offsets[j][self.perms[j][rank]]

    def apply_schedule(self, scheduled: list[float], rank: int) -> list[float]:
        """Take the base schedules' values now; returns replica ``rank``'s value per slot for the next step.

        A slot whose controller has started takes its base from the controller (the paper's replaces the
        schedule, hdet's fit corrects it); values are clamped into the spread's bounds."""
        if len(scheduled) != self.num_slots:
            raise ValueError(f"Expected {self.num_slots} base values, but got {len(scheduled)}")
        self.scheduled = [float(b) for b in scheduled]
        self.peak0 = max(self.peak0, self.scheduled[0])
        for j in range(self.num_slots):
            self.bases[j] = self._base(j)
        return [self.spreads[j].apply(self.bases[j], self.multiplier(j, rank)) for j in range(self.num_slots)]

    def _base(self, j: int) -> float:
        """Slot ``j``'s base now: the schedule's value (LR slots: times :meth:`lr_factor`), or its controller's."""
        b = self.scheduled[j] * (self.lr_factor() if j < self.num_lr_slots else 1.0)
        ctrl = self.controllers[j]
        return b if ctrl is None else self.spreads[j].clamp(ctrl.base(b))

    def lr_factor(self) -> float:
        """What multiplies every LR slot's schedule: the cuts so far, and the range test's scale."""
        return self.lr_scale * (1.0 if self.range is None else self.range.scale(self.peak0))

    def refresh(self) -> None:
        """Recompute every base after the LR factor changed (the range test's step)."""
        for j in range(self.num_slots):
            self.bases[j] = self._base(j)

    def cut_lr(self, factor: float) -> None:
        """Multiply every LR slot's base by ``factor`` from now on (a paper controller's own base too)."""
        self.lr_scale *= factor
        for j in range(self.num_lr_slots):
            ctrl = self.controllers[j]
            if ctrl is not None:
                ctrl.scale(factor)
            self.bases[j] = self._base(j)

    def keep_controllers(self) -> None:
        """The controllers as they are now: the best sync's (a go-back restores them, :meth:`restore_controllers`)."""
        self.kept = ([None if c is None else c.state_dict() for c in self.controllers], self.lr_scale)

    def restore_controllers(self) -> None:
        """The controllers as :meth:`keep_controllers` kept them, with the cuts made since (a paper controller's own
        base scaled): a go-back to the best sync took the weights back there, and the LR the controllers had raised
        since stayed (3.6x the best sync's after a go-back and a 0.7 cut: an audit). Nothing where not known."""
        if self.kept is None:
            return
        states, scale = self.kept
        self.controllers = [None if st is None else controller_from_state(st) for st in states]
        for ctrl in self.controllers[: self.num_lr_slots]:
            if ctrl is not None and scale != self.lr_scale:
                ctrl.scale(self.lr_scale / scale)
        self.refresh()

    def offsets_of(self, j: int) -> list[float]:
        """Every replica's multiplier (offset for additive spreads) for slot ``j``, in rank order."""
        return [self.offsets[j][p] for p in self.perms[j]]

    def values_of(self, j: int) -> list[float]:
        """Every replica's value for slot ``j`` from its current base, in rank order."""
        return [self.spreads[j].apply(self.bases[j], o) for o in self.offsets_of(j)]

    def all_values(self) -> list[list[float]]:
        """Every replica's value per slot, from the current bases (what each replica uses next)."""
        return [self.values_of(j) for j in range(self.num_slots)]

    def all_offsets(self) -> list[list[float]]:
        """Every replica's multiplier (offset for additive spreads) per slot."""
        return [self.offsets_of(j) for j in range(self.num_slots)]

    def deal(self, j: int) -> None:
        """Eq. 9: a fresh permutation for slot ``j`` (tied LR groups share slot 0's)."""
        if self.config.tie_lr_groups and 0 < j < self.num_lr_slots:
            self.perms[j] = list(self.perms[0])
        else:
            self.perms[j] = self.dealer.permutation(self.world_size)

    # ----------------------------------------------------------------- control (Eqs. 4-9)
    def control(self, window_losses: list[float], probe_losses: list[float], lr: LRControl,
                num_control_syncs: float) -> list[ControllerStep]:
        """One controller update per slot, then a fresh permutation per slot (drawn in slot order)."""
        ratio = self.scheduled[0] / self.peak0 if self.peak0 > 0 else 1.0
        weight = min(max((ratio - 0.5) / 0.5, 0.0), 1.0)  # near the peak only: see FitController
        steps = []
        for j in range(self.num_slots):
            ctrl = self.controllers[j]
            if ctrl is None:
                ctrl = self.controllers[j] = self._new_controller(j, lr, num_control_syncs)
            lr_slot = j < self.num_lr_slots
            obs = Observation(values=self.values_of(j), offsets=self.offsets_of(j),
                              window_losses=window_losses, probe_losses=probe_losses,
                              anchor=None if lr_slot else self.bases[j], weight=weight)
            if isinstance(ctrl, PaperController) and ctrl.log_space and min(obs.values) <= 0:
                raise ValueError(f"Expected {self.names[j]}'s values > 0 under the paper controller, which works on "
                                 f"their logs (a log spread), but got {obs.values} (its schedule reached 0): keep the "
                                 "schedule above 0, or use the fit controller")
            step = ctrl.control(obs)
            if isinstance(ctrl, FitController) and not lr_slot:
                self._no_windup(j, ctrl, step)
            self.bases[j] = step.base = self._base(j)
            self.deal(j)
            steps.append(step)
        return steps

    def _no_windup(self, j: int, ctrl: FitController, step: ControllerStep) -> None:
        """Keep slot ``j``'s correction where the base stays inside the spread's bounds: the base is clamped there, and
        a correction that ran on past them would hold it at the bound for syncs after the signal turned."""
        lo, hi = self.spreads[j].bounds
        s = self.scheduled[j]
        if ctrl.log_scale:
            if s <= 0:
                return
            c_lo, c_hi = (math.log(lo / s) if lo > 0 else -math.inf), (math.log(hi / s) if hi < math.inf else math.inf)
        else:
            c_lo, c_hi = lo - s, hi - s
        c = min(max(ctrl.c, c_lo), c_hi)
        if c != ctrl.c:
            ctrl.c = c
            step.factor = step.new_base = ctrl.factor  # the record says what is in effect
            step.clamped = True

    def _new_controller(self, j: int, lr: LRControl, K: float) -> Controller:
        """Slot ``j``'s controller, started from its current base (the registry's kind in the config)."""
        c = self.config
        spread = self.spreads[j]
        template = c.controller if isinstance(c.controller, FitController) else None
        if CONTROLLERS[c.controller_kind] is FitController:
            if j < self.num_lr_slots:
                return FitController() if template is None else dataclasses.replace(template, c=0.0, m=0.0, updates=0)
            additive = spread.kind == "additive"
            return FitController(log_scale=not additive, **({"bounds": (-math.inf, math.inf)} if additive else {}))
        if j >= self.num_lr_slots:
            return PaperController(beta=c.momentum_of_lr, sigma=c.loss_scale, lam=c.lr_of_lr, gamma=0.0,
                                   bounds=spread.ctrl_bounds(), log_space=spread.kind == "log")
        # the range test scaled the schedule (its peak P in place of the LR given): the bounds and Eq. 8's target,
        # set from the schedule, scale with it (unscaled, a test that ended at 20x clamped the first update to 10x)
        k = 1.0 if self.range is None else self.range.scale(self.peak0)
        k_bounds, k_finals = (1.0 if given else k for given in lr.given)  # (the user's own: as given)
        if c.eq8 == "as_printed":
            if lr.gamma_as_printed is None:
                raise ValueError("eq8='as_printed' needs OneCycle's div_factor and final_div_factor; use "
                                 "OneCycleAutoLR (or a OneCycleLR base)")
            gamma = lr.gamma_as_printed
        else:
            gamma = 0.0 if lr.finals is None else gamma_decay(self.bases[j], k_finals * lr.finals[j], K)
        lo, hi = lr.bounds[j]
        return PaperController(beta=c.momentum_of_lr, sigma=c.loss_scale, lam=c.lr_of_lr, gamma=gamma,
                               bounds=(k_bounds * lo, k_bounds * hi))
