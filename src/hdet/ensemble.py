"""One HDET replica's view of the ensemble: observe losses -> at a sync step: exchange -> check ->
converge (Eq. 3) or recover -> control (Eqs. 4-8, or hdet's fit) -> deal (Eq. 9) -> record.

The pieces, one job each: :class:`~hdet.slots.Slots` (spreads, permutations, bases, controllers),
:class:`~hdet.window.LossWindow` and :class:`~hdet.window.WindowMean` (what a replica remembers between
syncs), :class:`~hdet.sync.SyncVector` (what it tells the others). The transport moves vectors and
averages tensors; it never calls back in. A sync runs in two phases so that the one-process engine can
drive N ensembles itself: :meth:`Ensemble.prepare_sync` on every replica, the gather, then
:meth:`Ensemble.check_sync`, the averaging, and :meth:`Ensemble.finish_sync`. :meth:`Ensemble.sync` is
that sequence through ``torch.distributed``. Glossary: ``docs/architecture.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import statistics
import warnings
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from . import ensemble_state, spectral
from .caller import user_stacklevel
from .config import HDETConfig
from .controller import ControllerStep
from .hyper import Hyperparameter, check_explored
from .optimizers import innermost, lr_free_kind, replica_own_state
from .replicas import ProcessGroupReplicas, Replicas, ReplicaSyncError, local_shard, reshard_fsdp
from .range_test import MAX_RANGE_GROWTH, RANGE_START, RampSnapshots, RangeTest
from .slots import LRControl, Slots
from .stability import MIN_LR_SCALE, SharedCopies, StabilityGuard
from .step_scale import StepScale
from .sync import (SHARD_MAX, SHARD_MIN, SHARD_SUM, ReplicaMismatchError, SyncVector, as_real, averaged, batch_counts,
                   check_agreement, check_state_layout, fingerprint, health, layout_signature, memory_key,
                   persistent_float_buffers)
from .window import LossWindow, Probe, WindowMean, coarse_loss

__all__ = ["Ensemble", "Verdict", "NonFiniteReplicaError", "ReplicaSyncError", "ReplicaMismatchError", "SyncRecord",
           "STATE_VERSION", "HDETConfig"]

STATE_VERSION = ensemble_state.STATE_VERSION


class NonFiniteReplicaError(FloatingPointError):
    """A replica's window loss or weights are NaN/Inf at a converge step; nothing was averaged."""


class Verdict(NamedTuple):
    """What :meth:`Ensemble.check_sync` decided from every replica's vector (the same on every replica)."""

    col: SyncVector  # every replica's vector, by field
    exclude: list[int]  # left out of the average, reset to the others' mean: nonfinite + runaway
    nonfinite: list[int]  # non-finite weights or buffers
    runaway: list[int]  # finite, but the window loss ran away from the others' (outlier_threshold)
    rising: bool  # the ensemble's median window loss is more than rise_threshold above its best so far
    losses: list[float]  # per replica: the window's mean training loss (NaN without a finite one)
    collapsed: bool = False  # every replica non-finite, and the stability guard goes back to its best sync
    early: bool = False  # an early recovery's check (no window judged), not a sync's


@dataclass
class SyncRecord:
    """What one sync step saw and did; ``controller`` holds one entry per slot when auto-LR ran."""

    step: int
    losses: list[float] | None
    multipliers: list[list[float]]  # per slot, per replica, after dealing (offsets for additive spreads)
    bases: list[float]  # per slot, after the update (a scheduled slot: the schedule's value at this step; the next
    # step's LRs follow the schedule from there)
    controller: list[ControllerStep] | None  # per slot; log-spread slots in log space
    names: list[str] | None = None  # per slot: "lr/<group>" or the hyperparameter's name
    values: list[list[float]] | None = None  # per slot, per replica: ``bases`` times the multipliers dealt for the
    # next window (a scheduled slot's next-step value is its schedule's next value times the same multiplier)
    recovered: list[int] = field(default_factory=list)  # replicas with non-finite weights, reset to the others' mean
    nonfinite_losses: list[int] = field(default_factory=list)  # per replica: non-finite losses in the window
    runaway: list[int] = field(default_factory=list)  # replicas whose finite window loss ran away, reset too
    lr_scale: float = 1.0  # the LR schedule's cut so far (runaway replicas or a rising ensemble loss)
    went_back_to: int | None = None  # the sync step whose state every replica went back to (a rising loss, a
    # collapse), or the step of the start: each replica's state after the first step, or after the step where that
    # stopped fitting the optimizer's state (a collapse, or a window with no finite loss, before the first best sync)
    range_scale: float | None = None  # lr_range_test: what the range test multiplies the LR schedule by now
    range_ended: str | None = None  # lr_range_test: why the test ended at this sync (None: it did not end here)
    recovered_early: list[int] = field(default_factory=list)  # replicas reset at an early recovery since the last sync


def _ramp(T: int, warm: int, max_factor: float) -> tuple[float, float]:
    """The range test's growth a window over a warm-up of ``warm`` steps, and the factor it reaches in its last window
    (it starts at RANGE_START; a short warm-up grows slower: at most MAX_RANGE_GROWTH a window)."""
    growth = min((max_factor / RANGE_START) ** (T / warm), MAX_RANGE_GROWTH)
    return growth, min(RANGE_START * growth ** (warm // T - 1), max_factor)


class Ensemble:
    """The HDET state of one replica. Collectives happen only in :meth:`sync` and :meth:`recover`.

    Args:
        config: the ensemble's options.
        replicas: how this replica reaches the others (its ``rank`` and ``world_size``).
        optimizer: the optimizer whose param groups' LRs are the first slots.
        model: the module whose persistent floating-point buffers are averaged too (and that the probe sees).
        hypers: extra explored hyperparameters, one slot each.
        probe: ``probe(model) -> loss`` on a batch every replica sees (the fit controller's signal).
        lr_control: what the base schedule tells the LR slots' controllers (bounds, Eq. 8's targets).
    """

    def __init__(self, config: HDETConfig, replicas: Replicas, optimizer: torch.optim.Optimizer,
                 model: nn.Module | None = None, hypers: list[Hyperparameter] | tuple[Hyperparameter, ...] = (), *,
                 probe: Probe | None = None, lr_control: LRControl | None = None) -> None:
        hypers = list(hypers)
        check_explored(hypers)
        names = [h.name for h in hypers]
        lr_names = [f"lr/{g.get('name', j)}" for j, g in enumerate(optimizer.param_groups)]
        if len(set(names + lr_names)) != len(names + lr_names):
            raise ValueError(f"Expected distinct hyperparameter names, none an LR slot's {lr_names}, but got {names}")
        inner = innermost(optimizer)
        foreign = [h.name for h in hypers if getattr(h, "optimizer", inner) is not optimizer
                   and innermost(getattr(h, "optimizer", inner)) is not inner]
        if foreign:
            raise ValueError(f"Expected the explored optimizer values {foreign} on this scheduler's optimizer, but "
                             "they were built on another one (their spread would never reach training)")
        if model is not None and not isinstance(model, nn.Module):
            raise ValueError(f"Expected model to be a torch.nn.Module, but got {type(model).__name__}")
        if config.auto_lr_warmup_steps is None:  # (HDETConfig's "the scheduler's own": HDETLR's 0)
            config = dataclasses.replace(config, auto_lr_warmup_steps=0)
        self.config = config
        self.replicas = replicas
        self.optimizer = optimizer
        self.model = model
        self.hypers = hypers
        self.probe = probe
        self.slots = Slots(config, replicas.world_size, [f"lr/{g.get('name', j)}" for j, g in
                                                         enumerate(optimizer.param_groups)],
                           [h.spread for h in hypers], names)
        self.lr_control = lr_control or LRControl(bounds=[(0.0, math.inf)] * self.slots.num_lr_slots)
        self.window = LossWindow()
        self.said_coarse = False  # (a bfloat16 loss under a controller: said once, observe)
        self._clamp_checked = False  # (the first values checked against the spreads' bounds: _warn_clamped)
        self.window_mean = WindowMean(self._float_params()) if config.probing else None
        self.total_steps: int | None = None
        self.stability = StabilityGuard(config, replicas.first_to_say)  # on_runaway="recover"
        self._start_checked: tuple[Any, bool] = (None, True)  # (_start_misfits: the state's signature, start fits)
        self.load_warnings: list[str] = []  # what the last load_state_dict warned about (hdet.ensemble_state)
        self._ramp = RampSnapshots()  # lr_range_test: the ramp's recent states
        self.last_sync: SyncRecord | None = None
        self.early_recovered: dict[int, int] = {}  # replica -> the step of its early recovery since the last sync
        self.failed_sync: str | None = None  # why the last converge step failed part-way (state_dict refuses then)
        self.on_sync: list[Callable[[SyncRecord], None]] = []
        self.also: list[nn.Module] = []  # modules averaged with the weights (an EMA, an SWA model): also_average()
        self.also_apart = False  # a module registered since the last averaging (the next swap-in must average)
        self.hook_error: Exception | None = None  # an on_sync hook's, raised once the scheduler's step is complete
        params = self._params()
        _warn_if_masters(model, params)
        if config.probing and any(p.is_complex() for p in params):
            raise ValueError("controller='fit' does not support complex parameters (its probe averages real "
                             "iterates); use controller='paper' or auto-LR off")
        # D-Adaptation/Prodigy: the LR multiplier goes on the step, their estimates are averaged with the weights
        # (installed last: hooks on the optimizer, which a construction that failed would leave behind)
        self.step_scale = StepScale.install(optimizer) if lr_free_kind(optimizer) == "distance" else None
        if self.step_scale is not None and isinstance(replicas, ProcessGroupReplicas) and replicas.world_size > 1:
            # Prodigy: its estimate shared at every step, over the replicas (each rank's own values; prodigyopt
            # 1.1.2 itself does not step FSDP2's sharded parameters: its flatten of a DTensor shard fails)
            self.step_scale.share = replicas.gather

    def share_copies(self, guard: SharedCopies, ramp: SharedCopies) -> None:
        """Replicas of one process (the engine): copies of tensors they share are made once per sync, for the
        stability guard's best state and for the range test's ramp (one :class:`SharedCopies` each)."""
        self.stability.copier.shared, self._ramp.copier.shared = guard, ramp

    # the slot table, as the scheduler and telemetry read it
    num_lr_slots = property(lambda self: self.slots.num_lr_slots)
    num_slots = property(lambda self: self.slots.num_slots)
    rho = property(lambda self: self.slots.rho)
    names = property(lambda self: self.slots.names)
    perms = property(lambda self: self.slots.perms)
    controllers = property(lambda self: self.slots.controllers)
    current_bases = property(lambda self: self.slots.bases)

    # ----------------------------------------------------------------- schedule
    def set_total_steps(self, total_steps: int) -> None:
        c = self.config
        self.total_steps = total_steps
        if c.lr_range_test:
            T, warm = c.model_sync_interval, c.auto_lr_warmup_steps
            if not 2 * T <= warm < total_steps:
                raise ValueError(
                    f"Expected auto_lr_warmup_steps (the range test's length) in [2 * model_sync_interval, total_steps) "
                    f"= [{2 * T}, {total_steps}) with lr_range_test=True, but got {warm}: the test needs at least two "
                    "windows of the warm-up (e.g. OneCycle's pct_start * total_steps)")
            growth, reach = _ramp(T, warm, c.range_max_factor)
            if reach < 1:
                need = next((k * T for k in range(2, 100_000) if _ramp(T, k * T, c.range_max_factor)[1] >= 1), None)
                warnings.warn(
                    f"hdet: the range test's warm-up ({warm} steps, {warm // T} windows of model_sync_interval={T}) is "
                    f"too short for its ramp to pass the LR you gave: it starts at {RANGE_START:g}x the schedule and "
                    f"at most doubles a window, so it ends at most at {reach:.2g}x, where no edge is seen, and the run "
                    "trains below your LR. " + (f"Give auto_lr_warmup_steps >= {need} (or a shorter "
                                               "model_sync_interval)" if need is not None else
                                               f"No warm-up does with range_max_factor={c.range_max_factor:g} < 1"),
                    stacklevel=user_stacklevel())
            if self.slots.range is None:
                self.slots.range = RangeTest(growth=growth, max_factor=c.range_max_factor, factor=RANGE_START,
                                             backoff=c.range_backoff, patience=c.range_patience)
        if c.enable_auto_lr:
            if c.auto_lr_warmup_steps >= total_steps:
                raise ValueError(
                    f"Expected auto_lr_warmup_steps < total_steps with enable_auto_lr=True, but got "
                    f"auto_lr_warmup_steps={c.auto_lr_warmup_steps} and total_steps={total_steps}"
                )
            if self.first_control_step() > total_steps:
                raise ValueError(
                    f"enable_auto_lr=True but no sync step (a multiple of model_sync_interval="
                    f"{c.model_sync_interval}) falls in [auto_lr_warmup_steps={c.auto_lr_warmup_steps}, "
                    f"total_steps={total_steps}]: the controller would never run"
                )
            if c.controller_kind == "paper" and (c.ensemble_lr_spread_ratio == 0 or self.replicas.world_size < 2) \
                    and self.replicas.rank == 0:
                warnings.warn(
                    "hdet: the paper controller with " + ("ensemble_lr_spread_ratio=0" if self.replicas.world_size > 1
                                                          else "one replica") + " has no spread of LRs to rank, but "
                    "Eq. 8 still decays the base at every control sync, from the schedule's value toward its end "
                    "value: the run is not plain training at the base schedule (an audit: 1.3e-4 against "
                    "OneCycleLR's 2.4e-3 mid-run). Give a spread and several replicas, or leave enable_auto_lr off",
                    stacklevel=user_stacklevel())
            elif c.controller_kind == "fit" and (c.ensemble_lr_spread_ratio == 0 or self.replicas.world_size < 2) \
                    and self.replicas.rank == 0:  # (said for the paper controller; the fit one sat still, unsaid: an
                # audit)
                one = self.replicas.world_size < 2
                explored = self.slots.num_slots > self.slots.num_lr_slots
                warnings.warn(
                    "hdet: the fit controller with " + ("one replica" if one else "ensemble_lr_spread_ratio=0")
                    + " has no spread of LRs to fit, so it never moves the LR: the run trains at the base schedule"
                    + (" (nor any explored hyperparameter: one replica has no spread at all)" if one else
                       " (the explored hyperparameters are still fitted)" if explored else "")
                    + (". Give a spread and several replicas, or leave enable_auto_lr off" if one or not explored else
                       ""), stacklevel=user_stacklevel())

    def first_control_step(self) -> int:
        T = self.config.model_sync_interval
        return max(T, -(-self.config.auto_lr_warmup_steps // T) * T)

    @property
    def num_control_syncs(self) -> float:
        """K of Eq. 8: ``(S - S_warm) / T``."""
        assert self.total_steps is not None
        return (self.total_steps - self.config.auto_lr_warmup_steps) / self.config.model_sync_interval

    def fingerprint(self) -> int:
        """The settings every replica must share, as one number exchanged at each sync: the HDET options
        (:meth:`HDETConfig.fingerprint`), every explored hyperparameter's name, spread and unscheduled base, and every
        slot's scheduled base now, to 6 significant digits (the LR schedules' and the scheduled explored values':
        replicas that explore different things, the same thing differently, or from another schedule, a max_lr of each
        rank's own say, would average silently)."""
        hypers = [[h.name, h.spread.kind, float(h.spread.alpha), [float(b) for b in h.spread.bounds],
                   None if h.schedule is not None else float(h.initial)] for h in self.hypers]
        # (to 6 significant digits: a base each rank computes from the same numbers may differ in its last bits, as an
        # LR sweep's pick through LAPACK once did, and a mismatch error there would stop a run that is right)
        scheduled = [float(f"{float(b):.6g}") for b in self.slots.scheduled]
        return zlib.crc32(json.dumps([self.config.fingerprint(), hypers, scheduled]).encode())  # < 2**32: exact

    def is_sync_step(self, t: int) -> bool:
        """Converge after optimizer step ``t`` when ``t mod T == 0``, and after the last step."""
        return t > 0 and (t % self.config.model_sync_interval == 0 or t == self.total_steps)

    def is_control_step(self, t: int) -> bool:
        """The controller updates at the syncs ``t mod T == 0`` from ``auto_lr_warmup_steps`` on."""
        c = self.config
        return c.enable_auto_lr and t >= c.auto_lr_warmup_steps and t % c.model_sync_interval == 0

    def multiplier(self, j: int) -> float:
        """This replica's multiplier (offset for additive spreads) for slot ``j`` (Eq. 9)."""
        return self.slots.multiplier(j, self.replicas.rank)

    def apply_schedule(self, scheduled_bases: list[float]) -> list[float]:
        """The base schedules' values now -> this replica's value per slot for the next step (Eqs. 1, 9)."""
        values = self.slots.apply_schedule(scheduled_bases, self.replicas.rank)
        if not self._clamp_checked:
            self._clamp_checked = True
            self._warn_clamped()
        return values

    def _warn_clamped(self) -> None:
        """Once, at the first values (replica 0 says it): an explored hyperparameter whose spread reaches past its
        bounds, so that several replicas are clamped to one value and the spread is lopsided (dropout around 0,
        beta2 around 0.999)."""
        sl = self.slots
        if self.replicas.rank != 0 or sl.world_size < 2:
            return
        for k, h in enumerate(self.hypers):
            j = sl.num_lr_slots + k
            sp, base = sl.spreads[j], sl.bases[j]
            raw = [sp.unclamped(base, o) for o in sl.offsets[j]]
            lo, hi = sp.bounds
            out = [v for v in raw if not lo <= v <= hi]
            if out:
                warnings.warn(f"hdet: {h.name}'s spread around {base:g} ({sp.kind}, alpha {sp.alpha:g}) reaches "
                              f"{min(raw):g}..{max(raw):g}, past its bounds [{lo:g}, {hi:g}]: {len(out)} of the "
                              f"{sl.world_size} replicas are clamped to a bound, so they share a value and the spread is "
                              "lopsided around the base. A smaller alpha, or a base further inside the bounds, keeps "
                              "it even", stacklevel=user_stacklevel())

    def all_values(self) -> list[list[float]]:
        """Every replica's value per slot, from the current bases (what each replica uses next)."""
        return self.slots.all_values()

    # ----------------------------------------------------------------- between syncs
    def observe(self, loss: torch.Tensor | float, counted: torch.Tensor | bool = True) -> None:
        """Keep this replica's training loss of the step just taken (on its device, no host sync); ``counted``:
        :meth:`hdet.window.LossWindow.observe`."""
        self.say_coarse(loss, "the training loss given to the scheduler")
        self.window.observe(loss, counted)

    def say_coarse(self, loss: Any, what: str) -> None:
        """A bfloat16 training loss where the paper controller ranks the losses (the fit one ranks its probes): said
        once (:func:`hdet.window.coarse_loss`). Integrations that cast the loss before :meth:`observe` call it first
        (the warning never came from them before: an audit)."""
        if not self.said_coarse and self.config.enable_auto_lr and not self.config.probing and \
                isinstance(loss, torch.Tensor):
            self.said_coarse = coarse_loss(loss, what)

    def after_optimizer_step(self, t: int) -> None:
        """Optimizer step ``t`` is done: the fit controller's window mean takes the parameters (once per step;
        not in windows that end before the controller starts)."""
        T = self.config.model_sync_interval
        if self.window_mean is not None and -(-t // T) * T >= self.config.auto_lr_warmup_steps:
            self.window_mean.add()
        if not self.stability.on:
            return
        if t == 1:  # under recover: a state to go back to before the first best sync's
            self.window.fold()  # (step 1's losses, one a micro-batch where the loop observes each: their finite sum)
            first = None if self.window.sum is None else (self.window.sum, self.window.finite)
            self.stability.keep_start(t, *self._start_state(), first)
        elif self.stability.starting and t < self.config.model_sync_interval and self._start_misfits():
            # a first step that a GradScaler (or the guard, fused SGD's momentum) skipped made no optimizer state, so
            # the start kept then could never fit: kept again at the first step where it no longer fits (before the first
            # sync only; the same test after a resume, so a resumed run keeps it again where the first run did)
            self.stability.keep_start_again(t, *self._start_state())

    def _start_state(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The state to keep as the start (:meth:`kept_tensors`'s) and its health (a device flag: no host sync)."""
        tensors, strict, moments = self._kept_parts()
        also, also_strict = self._also()
        ok = health(tensors + moments + also, strict + [True] * len(moments) + also_strict,
                    self.replicas.comm_device())[0]
        kept = tensors + moments + also + self.step_counts()  # (kept_tensors' order)
        if self.step_scale is not None:  # (its estimates were read for the copy, not for a sync: nothing to
            self.step_scale.unfill()  # take back into the param groups before the next step)
        self._start_checked = (self._state_signature(), True)  # (it fits the state it is kept from)
        return kept, ok

    def _start_misfits(self) -> bool:
        """Whether the kept start no longer fits the state it would go back to (the tensors' layout). Checked again
        only where the optimizer's state changed its keys, types, dtypes or shapes since the last check (the rest of
        what is kept keeps its layout): host work over the state's entries a step, and a host sync only then (a step
        scale's counts copied to the device)."""
        signature = self._state_signature()
        if signature != self._start_checked[0]:
            kept = self.kept_tensors()
            if self.step_scale is not None:  # (its estimates were read for the layout only)
                self.step_scale.unfill()
            self._start_checked = (signature, self.stability.start_fits(kept))
        return not self._start_checked[1]

    def _state_signature(self) -> tuple[Any, ...]:
        """The optimizer's state entries' keys, and the types of their values (a tensor's dtype and shape)."""
        return tuple((k, v.dtype, v.shape) if isinstance(v, torch.Tensor) else (k, type(v))
                     for s in self.optimizer.state.values() for k, v in s.items())

    # ----------------------------------------------------------------- tensors
    def tensors(self) -> list[torch.Tensor]:
        """The tensors to average, in an order fixed by the optimizer and the model: floating-point
        parameters of the param groups, the model's persistent floating-point buffers (BatchNorm
        statistics; integer and non-persistent buffers are left alone) and, optionally, the optimizer's
        floating-point state (except ``step``)."""
        return self._tensors()[0]

    def _tensors(self, own: bool = False) -> tuple[list[torch.Tensor], list[bool]]:
        """The tensors to average, and per tensor whether it must be finite (parameters, optimizer
        state) or only free of NaN (buffers: a mask may hold -inf). ``own``: with each replica's own optimizer state
        too (:func:`hdet.optimizers.replica_own_state`: kept and gone back to, never averaged)."""
        params = self._params()
        out, strict = self.model_tensors()
        if self.config.average_optimizer_state:
            state = self._optimizer_state(params, own)
            out += state
            strict += [True] * len(state)
        if self.step_scale is not None and out:
            estimates = self.step_scale.estimates(out[0])
            out += estimates
            strict += [True] * len(estimates)
        return out, strict

    def weights_fingerprint(self) -> float | None:
        """This replica's parameters' fingerprint (:func:`hdet.sync.fingerprint`) where the replicas are the ranks of a
        process group, whose checkpoints hold each rank's own replica; None otherwise. Without the weights of the
        model's embeddings with ``max_norm``, which the forward renormalises in place (compared at the first optimizer
        step after a load, a resume done right was said to be wrong, an audit). HOST SYNC: read as a float."""
        if not isinstance(self.replicas, ProcessGroupReplicas) or self.replicas.world_size == 1 or \
                lr_free_kind(self.optimizer) == "schedule-free":  # (its train()/eval() move the weights: a checkpoint
            return None  # saved in eval mode, as its docs say, resumes in train mode)
        params = self._param_tensors()
        renormed = {memory_key(m.weight.detach()) for m in (self.model.modules() if self.model is not None else ())
                    if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None
                    and isinstance(m.weight, torch.Tensor) and not hasattr(m.weight, "placements")}
        params = [p for p in params if memory_key(p) not in renormed] if renormed else params
        dev = params[0].device if params else torch.device("cpu")
        return float(fingerprint(params, [True] * len(params), dev))  # HOST SYNC

    def _param_tensors(self) -> list[torch.Tensor]:
        """The parameters' local shards (real views of complex ones), each memory once (two Parameters on one memory,
        nn.Parameter(emb.weight) as a tied head: averaged twice in place under a process group, a wrong mean; a
        review)."""
        return _distinct([as_real(local_shard(p.detach())) for p in self._params()])

    def model_tensors(self) -> tuple[list[torch.Tensor], list[bool]]:
        """The model's part of :meth:`tensors` (its parameters' local shards, then its persistent floating-point
        buffers: what an evaluation of the average needs, :meth:`hdet.HDETLR.swap_in_average`), and per tensor
        whether it must be finite."""
        out = self._param_tensors()
        strict = [True] * len(out)
        if self.model is not None:
            buffers = persistent_float_buffers(self.model)
            out += buffers
            strict += [False] * len(buffers)
        return out, strict

    def also_average(self, module: nn.Module) -> None:
        """Average ``module``'s floating-point parameters and persistent buffers with the weights from now on (at
        converge steps, early recoveries and swap-ins): an EMA or SWA copy of this replica's model
        (:meth:`hdet.HDETLR.also_average`)."""
        if not isinstance(module, nn.Module):
            raise ValueError(f"Expected also_average(a torch.nn.Module: an EMA or SWA copy of the model), but got "
                             f"{type(module).__name__}")
        if any(m is module for m in self.also):
            return
        own = {memory_key(t) for t in self.model_tensors()[0]}
        shared = [name for name, t in [*module.named_parameters(), *module.named_buffers()]
                  if averaged(t) and memory_key(as_real(local_shard(t.detach()))) in own]
        if shared:
            raise ValueError(f"Expected also_average(a module apart from the model and the optimizer's parameters, "
                             f"such as torch.optim.swa_utils.AveragedModel(model), which copies them), but "
                             f"{len(shared)} of its tensors ({', '.join(shared[:3])}{', ...' if len(shared) > 3 else ''})"
                             " are the weights hdet averages already")
        own_devices = {t.device for t in self.model_tensors()[0]}
        elsewhere = sorted({str(t.device) for t in self._also_of(module)[0] if t.device not in own_devices})
        if own_devices and elsewhere:
            raise ValueError(f"Expected also_average(a module on the weights' device, {sorted(map(str, own_devices))}), "
                             f"but got one on {elsewhere} (an EMA kept on the CPU: AveragedModel(device=...), "
                             "WeightAveraging(device=...)): it is averaged with the weights, through their "
                             "collectives. Keep it on the weights' device")
        self.also.append(module)
        self.also_apart = True  # (registered after a converge step: the next swap-in averages it)

    def also_tensors(self) -> list[torch.Tensor]:
        """The floating-point parameters and persistent buffers of the :meth:`also_average` modules (local shards,
        each memory once). Averaged in place, never swapped back: an EMA is linear in the weights, so the mean of
        the replicas' EMAs is the EMA of the ensemble's average, and averaging keeps that mean."""
        return self._also()[0]

    def also_buffers(self) -> list[torch.Tensor]:
        """The :meth:`also_average` modules' persistent floating-point buffers (HSDP averages them over a replica's
        shard ranks too, as the model's)."""
        return self._also_of(*self.also)[2]

    def _also(self) -> tuple[list[torch.Tensor], list[bool]]:
        """:meth:`also_tensors`, and per tensor whether it must be finite (parameters; buffers only free of NaN)."""
        return self._also_of(*self.also)[:2]

    @staticmethod
    def _also_of(*modules: nn.Module) -> tuple[list[torch.Tensor], list[bool], list[torch.Tensor]]:
        params = _distinct([as_real(local_shard(p.detach())) for m in modules for p in m.parameters() if averaged(p)])
        seen = {memory_key(p) for p in params}
        buffers = _distinct([b for m in modules for b in persistent_float_buffers(m) if memory_key(b) not in seen])
        return params + buffers, [True] * len(params) + [False] * len(buffers), buffers

    def _optimizer_state(self, params: list[torch.Tensor], own: bool = False) -> list[torch.Tensor]:
        left_out = {"step"} if own else replica_own_state(self.optimizer)
        out = []
        for p in params:
            state = self.optimizer.state.get(p, {})
            for key in sorted(state):
                v = state[key]
                if key not in left_out and isinstance(v, torch.Tensor) and averaged(v):
                    out.append(as_real(local_shard(v.detach())))
        return out

    def _state_layout(self) -> int:
        """Which parameter holds which optimizer state (averaged with average_optimizer_state, or reset at a recovery;
        checked then: :func:`hdet.sync.check_state_layout`)."""
        def keys(p: torch.Tensor) -> str:
            state = self.optimizer.state.get(p, {})
            return ",".join(sorted(k for k, v in state.items() if k != "step" and isinstance(v, torch.Tensor)))
        text = ";".join(f"{i}:{keys(p)}" for i, p in enumerate(self._params()))
        return zlib.crc32(text.encode())  # (< 2**32: exact in float64)

    def recovery_tensors(self) -> list[torch.Tensor]:
        """What a recovery resets besides :meth:`tensors`: the optimizer state (moments), unless it is averaged
        anyway; the reset replicas get the healthy ones' mean, the healthy keep theirs. (The window mean is left
        alone: a reset replica's probe is NaN for that one fit.)"""
        return [] if self.config.average_optimizer_state else self._optimizer_state(self._params())

    def param_steps(self) -> list[torch.Tensor]:
        """The optimizer's per-parameter step counts (Adam's ``state["step"]`` tensors)."""
        steps = (self.optimizer.state.get(p, {}).get("step") for p in self._params())
        return [s for s in steps if isinstance(s, torch.Tensor)]

    def step_counts(self) -> list[torch.Tensor]:
        """The optimizer's step counts: Adam's ``state["step"]`` tensors (one per parameter) and D-Adaptation's and
        Prodigy's ``k`` (their param groups', :meth:`hdet.step_scale.StepScale.counts`). Not averaged (equal on every
        replica), but kept with a best sync, so that going back to it restores the bias correction that its moments
        were made with (left at the later step, Adam's first steps after going back were too long,
        more the further back it went). Last, BatchNorm's ``num_batches_tracked`` (which weights its cumulative
        statistics under ``momentum=None``; left at the later step before, an audit)."""
        out = []
        for p in self._params():
            step = self.optimizer.state.get(p, {}).get("step")
            if isinstance(step, torch.Tensor):
                out.append(step)
        out += self.step_scale.counts() if self.step_scale is not None else []
        return out + (batch_counts(self.model) if self.model is not None else [])

    def kept_tensors(self) -> list[torch.Tensor]:
        """What a best sync (``on_runaway="recover"``) and the range test's snapshots keep and go back to: the
        averaged tensors, the moments when they are not among them, and the step counts (last, so that a
        checkpoint's snapshot from before they were kept still fits: :func:`hdet.stability.fit_snapshot`)."""
        tensors, _, moments = self._kept_parts()  # (first: it fills the step scale's estimates and counts for this
        # sync)
        return tensors + moments + self.also_tensors() + self.step_counts()  # (an EMA goes back too:
        # left NaN after every replica's weights went back, every later sync found the replicas bad and went back
        # again, a review)

    def _kept_parts(self) -> tuple[list[torch.Tensor], list[bool], list[torch.Tensor]]:
        """:meth:`kept_tensors`' first parts: the averaged tensors (with each replica's own optimizer state where the
        state is averaged) and their strictness, then the moments where they are not averaged, own state included
        (ASGD's eta: a go-back left it at the later step's, a review)."""
        tensors, strict = self._tensors(own=True)
        moments = [] if self.config.average_optimizer_state else self._optimizer_state(self._params(), own=True)
        return tensors, strict, moments

    def _params(self) -> list[torch.Tensor]:
        """The parameters a converge step averages: every floating-point one of the optimizer's, frozen ones too (one
        frozen after the replicas parted is brought back together; equal copies may move in the last bit)."""
        return [p for g in self.optimizer.param_groups for p in g["params"] if averaged(p)]

    def _shards(self) -> int:
        """How many ranks hold this replica's shards (FSDP2/HSDP), 1 where a replica is one rank."""
        group = getattr(self.replicas, "shard_group", None)
        return dist.get_world_size(group) if group is not None else 1

    def _float_params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"] if p.is_floating_point()]

    # ----------------------------------------------------------------- the sync, phase 1: what this replica says
    def prepare_sync(self, t: int, new_window: bool = True) -> torch.Tensor:
        """This replica's :class:`SyncVector` after optimizer step ``t``, on the communication device. Runs the
        user's probe at a control sync (fit controller). ``new_window``: start a new loss window (a sync; an
        early recovery keeps it). No host sync."""
        c = self.config
        tensors, strict = self._tensors()
        also, also_strict = self._also()  # (in the health, layout and memory checks: every replica averages them)
        every = tensors + also
        self.window.fold()
        dev = self.replicas.comm_device()
        finite, buf_inf = health(every, strict + also_strict, dev)
        start_sum, start_n = self.stability.start_loss()
        zero = torch.zeros((), dtype=torch.float64)
        probe = torch.full((), float("nan"), dtype=torch.float64)
        if self.window_mean is not None and self.probe is not None and self.model is not None and new_window \
                and self.is_control_step(t):
            probe = self.window_mean.probe(self.model, self.probe) / self._shards()  # (FSDP2: each shard rank of a
            # replica ran the same probe; the gather sums the entry over them, so their mean is what every one reads)
        total, config = -1 if self.total_steps is None else self.total_steps, self.fingerprint()
        key = zlib.crc32(json.dumps([c.seed, t, c.model_sync_interval, total, config]).encode())  # (the
        # agreement fields as one number: its min and max over a replica's shard ranks tell whether they agree)
        vec = SyncVector(
            loss_sum=self.window.sum if self.window.sum is not None else zero,
            loss_n=self.window.finite if self.window.finite is not None else zero,
            loss_sq=self.window.sq if self.window.sq is not None else zero, observed=self.window.count,
            nonfinite=self.window.nonfinite,
            finite=finite, buf_inf=buf_inf, layout=layout_signature(every), ntensors=len(every), seed=c.seed,
            probe=probe, step=t, interval=c.model_sync_interval,
            total_steps=total, config=config,
            state_layout=self._state_layout(),
            start_ok=self.stability.start_health(self.kept_tensors() if self.stability.starting else None),
            start_sum=start_sum, start_n=start_n,
            weights=fingerprint(tensors, strict, dev) if self.stability.on else zero,  # (read by the guard alone)
            memory=self.replicas.memory_layout(every), key=key, key_neg=-key,
        ).to_tensor(dev)
        if new_window:
            self.window.reset()
        return vec

    # ----------------------------------------------------------------- phase 2: checks on every replica's rows
    def check_sync(self, t: int, rows: torch.Tensor, everyone: bool = True) -> Verdict:
        """Every replica's vectors (``[N, k]`` on the CPU) checked for agreement; decides which replicas to leave
        out of the average: non-finite weights or buffers, and (at a sync, ``everyone``) replicas whose finite
        window loss ran away. Raises, before anything is averaged, on disagreement, with
        ``on_nonfinite="raise"``, or when every replica is bad. Pure arithmetic on the rows: every replica
        decides the same."""
        col = SyncVector.from_rows(rows)
        check_agreement(t, col, state=self.config.average_optimizer_state)
        N = self.replicas.world_size
        bad = [r for r in range(N) if col.finite[r] != 1.0 or col.buf_inf[r] > min(col.buf_inf)]
        bad_loss = [r for r in range(N) if col.nonfinite[r] > 0]
        # every replica bad: with on_runaway="recover" (or the range test) and a best sync to go back to, that
        # is where every replica goes (a collapse, at a sync or an early recovery); otherwise nothing can be recovered
        self.stability.drop_start(col.start_ok)  # (a replica's unhealthy start: no replica goes back there)
        collapsed = len(bad) == N and self.stability.on and self.stability.can_go_back(self.kept_tensors())
        if ((bad or (bad_loss and everyone)) and self.config.on_nonfinite == "raise") or (len(bad) == N and not collapsed):
            raise NonFiniteReplicaError(
                f"At {'sync' if everyone else 'an early recovery at'} step {t}: non-finite training losses on replica(s) "
                f"{bad_loss}, non-finite weights on "
                f"replica(s) {bad} (parameters or buffers)"
                + (" (every replica)" if len(bad) == N else "")
                + ". Nothing was averaged, so the other replicas are untouched."
            )
        losses = [col.loss_sum[r] / col.loss_n[r] if col.loss_n[r] else float("nan") for r in range(N)]
        if collapsed:  # nothing healthy to average: every replica is overwritten by the best sync's state
            return Verdict(col, [], bad, [], True, losses, collapsed=True, early=not everyone)
        rt = self.slots.range  # (the range test's ramp judges every window itself: nothing pooled during it)
        ramping = rt is not None and rt.ramping and t <= self.config.auto_lr_warmup_steps
        last = t == self.total_steps or not self.is_sync_step(t)  # (the run's last sync, or finish()'s)
        runaway, rising = self.stability.judge(losses, bad, col, pool=not ramping, last=last) if everyone else ([], False)
        if (bad or runaway) and not self.config.average_optimizer_state:  # (their moments reset to the others' mean)
            check_state_layout(t, col, f"reset replica(s) {sorted(bad + runaway)}'s optimizer state to the others' mean")
        return Verdict(col, sorted(bad + runaway), bad, runaway, rising, losses, early=not everyone)

    # ----------------------------------------------------------------- phase 3: control, deal, record
    def finish_sync(self, t: int, verdict: Verdict) -> SyncRecord:
        """After the average: cut the LR if the ensemble is unstable, rank faulty replicas worst, run the
        controller at a control sync, deal, record."""
        c = self.config
        N = self.replicas.world_size
        for h in self.hypers:  # (hdet.GradClip: a norm nobody clips with is reported, never applied)
            h.check_applied(t)
        col, bad, losses = verdict.col, verdict.exclude, list(verdict.losses)
        if verdict.nonfinite and not verdict.collapsed:
            _warn_recovered(t, verdict.nonfinite, "sync")
        kept = self.kept_tensors() if self.stability.on else []  # listed once, when it is on
        if verdict.collapsed:
            back = self.stability.go_back(kept)
        else:
            back = self.stability.on and self.stability.after_average(t, losses, bad, verdict.rising, kept, verdict.col)
        rt = self.slots.range
        range_ended = None
        restored = False  # gone back to the best sync, the controllers with it
        if rt is not None and rt.ramping and t <= c.auto_lr_warmup_steps:  # the range test decides, no cut
            back = self._range_step(t, verdict, back, kept)
            range_ended = rt.reason if not rt.ramping else None
        elif verdict.runaway or verdict.rising:
            # the k-th cut of the run is lr_cut ** k: the first event says the LR is at the edge of stability, each
            # further one that it is further past it (measured: benchmarks/results/evidence/sweep_then_train/call21);
            # the first lr_cut_after events cut nothing (a spike of its batches': the run goes back past them)
            if back:  # the controllers as at the sync gone back to (their moves since rode the discarded windows)
                self.slots.restore_controllers()
                restored = True
            self.slots.cuts += 1
            k = self.slots.cuts - c.lr_cut_after
            if k > 0:
                self.slots.cut_lr(max(c.lr_cut ** k, MIN_LR_SCALE / self.slots.lr_scale))
            self.stability.warn(t, verdict.runaway, losses, verdict.rising, back, self.slots.lr_scale, verdict.collapsed,
                                "sync step" if self.is_sync_step(t) else "an early recovery at step" if verdict.early
                                else "the sync of finish() at step", uncut=0 if k > 0 else self.slots.cuts)
        nonfinite_losses = [int(col.nonfinite[r]) for r in range(N)]
        bad_loss = [r for r in range(N) if nonfinite_losses[r] > 0]
        healthy_loss = [r for r in bad_loss if r not in bad and r not in verdict.nonfinite]  # (a collapse excludes none)
        early = sorted(self.early_recovered)
        reset_early = [r for r in healthy_loss if r in self.early_recovered]
        healthy_loss = [r for r in healthy_loss if r not in self.early_recovered]
        if reset_early:
            warnings.warn(
                f"hdet: at sync step {t} replica(s) {reset_early} had non-finite training losses "
                f"({[nonfinite_losses[r] for r in reset_early]} in the window): their weights were non-finite and "
                f"were reset at early recoveries (steps {[self.early_recovered[r] for r in reset_early]}; "
                "sched.last_sync.recovered_early), ranked worst by the controller where one runs; training goes on",
                stacklevel=user_stacklevel())
        if healthy_loss:
            warnings.warn(
                f"hdet: at sync step {t} replica(s) {healthy_loss} had non-finite training losses "
                f"({[nonfinite_losses[r] for r in healthy_loss]} in the window) but finite weights (a step whose "
                "gradient the guard skipped or zeroed, or a bad batch): counted in sched.last_sync.nonfinite_losses, "
                "ranked worst by the controller where one runs; training goes on", stacklevel=user_stacklevel())
        self.early_recovered = {}
        window = list(losses)  # each replica's own window mean (NaN where it had no finite loss): what is reported
        worst_ranked = set(bad) | set(bad_loss)
        healthy = [losses[r] for r in range(N) if r not in worst_ranked and math.isfinite(losses[r])]
        nothing = [r for r in range(N) if r not in worst_ranked and not math.isfinite(losses[r])]
        if worst_ranked:  # the controller ranks them worst: ten loss temperatures above the worst healthy loss
            worst = (max(healthy) if healthy else 0.0) + 10 * c.loss_scale
            losses = [worst if r in worst_ranked else x for r, x in enumerate(losses)]
        if nothing:  # every step of the window measured nothing there (observe's counted=False): no weight in Eq. 4,
            # nor in Eq. 5's h_bar (+inf: PaperController.update). Where no healthy replica measured anything, they
            # are the healthy ones (0, the worst-ranked at 10 temperatures above; a review: the worst-ranked
            # replica's stand-in loss was read as a measurement there, and it got all the weight)
            losses = [(math.inf if healthy else 0.0) if r in nothing else x for r, x in enumerate(losses)]
        steps: list[ControllerStep] | None = None
        if self.is_control_step(t) and not restored:  # (gone back: this window's losses and probes are of the
            # discarded weights)
            missing = [r for r in range(N) if col.observed[r] == 0]
            if missing:
                raise ValueError(
                    f"enable_auto_lr=True needs the training loss: call scheduler.step(loss) after each "
                    f"optimizer step; replica(s) {missing} passed no loss in the window ending at step {t}")
            if c.probing and self.probe is None:
                raise ValueError("controller='fit' needs probe=: a function probe(model) -> loss on a batch that is "
                                 "the same on every replica")
            probes = [float("nan") if r in bad else col.probe[r] for r in range(N)]  # bad: left out
            overflowed = [r for r in range(N) if r not in bad and not math.isfinite(probes[r])]
            finite = [v for v in probes if math.isfinite(v)]
            if overflowed and finite:  # a healthy replica whose probe overflowed (inf, or NaN): ranked worst, as a
                # window loss is (left out, an inf at the highest LR read as no verdict and the fit moved up: an audit)
                probes = [max(finite) + 10 * c.loss_scale if r in overflowed else v for r, v in enumerate(probes)]
            steps = self.slots.control(losses, probes, self.lr_control, self.num_control_syncs)
        if self.stability.on and self.stability.best_step == t:  # a new best sync: a go-back restores these
            self.slots.keep_controllers()
        if self.window_mean is not None:  # a new window starts (after finish() mid-window too, as the losses' does:
            self.window_mean.reset()  # it went on averaging each replica's own iterates from before; an audit)
        record = SyncRecord(step=t, losses=window if any(col.observed) else None, multipliers=self.slots.all_offsets(),
                            bases=list(self.slots.bases), controller=steps, names=list(self.names),
                            values=self.all_values(), recovered=verdict.nonfinite, nonfinite_losses=nonfinite_losses,
                            runaway=verdict.runaway, lr_scale=self.slots.lr_scale,
                            went_back_to=self.stability.best_step if back else None,
                            range_scale=None if rt is None else rt.scale(self.slots.peak0), range_ended=range_ended,
                            recovered_early=early)
        self.last_sync = record
        spectral.refresh_(self.model, lambda: self.model_tensors()[0])  # spectral norms' u, v for the weights now in
        # (averaged, or gone back to), before the hooks see the model
        if self.step_scale is not None:  # the averaged (or gone-back-to) estimates into the param groups now
            self.step_scale.take_estimates()
        for hook in self.on_sync:  # (a logger's error, a full disk or a tracker's network, is raised after the step:
            try:  # raised here it left the scheduler half-stepped, and no checkpoint could be written after it)
                hook(record)
            except Exception as e:  # noqa: BLE001 - every hook still runs; the first error is raised
                if self.hook_error is None:
                    self.hook_error = e
        return record

    def raise_hook_error(self) -> None:
        """Raise the first error an ``on_sync`` hook raised at this step's sync (the scheduler calls it once its step
        is complete), and forget it."""
        e, self.hook_error = self.hook_error, None
        if e is not None:
            raise e

    def _range_step(self, t: int, verdict: Verdict, back: bool, tensors: list[torch.Tensor]) -> bool:
        """One sync of the LR range test (:mod:`hdet.range_test`): keep this sync's state (``tensors``: the
        averaged tensors and optimizer state) and grow the ramp, or end it and go back to the ramp's last sync at
        an LR of at most the new peak. Returns whether every replica went back. No collective; a foreach copy of
        the tensors per sync of the ramp."""
        rt, guard, T = self.slots.range, self.stability, self.config.model_sync_interval
        assert rt is not None
        ok = [x for r, x in enumerate(verdict.losses) if r not in verdict.exclude and math.isfinite(x)]
        loss = statistics.median(ok) if ok else math.nan
        stale = 0 if guard.lowest is None else (t - guard.lowest[1]) // T  # (windows since the lowest loss)
        lr = self.slots.bases[0]
        if rt.update(t, lr, loss, stale_windows=stale, runaway=bool(verdict.runaway),
                     rising=verdict.rising or verdict.collapsed, last=t + T > self.config.auto_lr_warmup_steps):
            gone = self._ramp.go_back(rt.peak, tensors)
            if gone is not None:
                guard.remember(gone[0], gone[1], tensors)
                back = True
        elif rt.ramping:
            self._ramp.add(t, lr, loss, tensors, rt.keep_from())
        if not rt.ramping:
            self._ramp.clear()
        self.slots.refresh()
        return back

    # ----------------------------------------------------------------- the three phases through torch.distributed
    def sync(self, t: int) -> SyncRecord:
        """Converge (and maybe control and deal) after optimizer step ``t``. Runs on every replica.

        Collectives: one all_gather of a few float64 scalars, then one all_reduce per bucket of
        flattened tensors. Host syncs: the gathered scalars are read on the host once."""
        reshard_fsdp(self.model)  # (FSDP2: the writes below must reach what the next forward reads)
        with self.marking_failure(t):
            verdict = self.check_sync(t, self._gather(t, self.prepare_sync(t)))
            self._average(t, self.tensors() + self.also_tensors(), verdict.exclude)  # Eq. 3 over the healthy replicas
            self.also_apart = False
            if verdict.exclude:
                self._reset_moments(t, verdict.exclude)
            return self.finish_sync(t, verdict)

    @contextlib.contextmanager
    def marking_failure(self, t: int) -> Iterator[None]:
        """Any exception out of a converge step (a failed collective, an out-of-memory, Ctrl-C, every replica
        non-finite, ...) leaves the scheduler half-stepped and maybe the weights partly averaged: remember it, so
        that :meth:`state_dict` refuses to write a checkpoint that would resume silently wrong."""
        try:
            yield
        except BaseException as e:
            if self.failed_sync is None:
                self.failed_sync = f"the converge step after optimizer step {t} did not finish ({type(e).__name__})"
            raise

    def recover(self, t: int) -> list[int]:
        """An early converge between syncs, for replicas with non-finite weights or buffers (the scheduler
        calls it when the skip guard skipped every step of a stretch). The healthy replicas are averaged
        only when some replica is bad; the loss window and the controller are left alone. Returns the bad
        replicas. When every replica is bad, with a best sync to go back to (``on_runaway="recover"``), every
        replica goes back to it now, as at a sync (a :class:`SyncRecord` at step ``t`` says so). Collectives as
        :meth:`sync`."""
        reshard_fsdp(self.model)
        with self.marking_failure(t):
            verdict = self.check_sync(t, self._gather(t, self.prepare_sync(t, new_window=False)), everyone=False)
            if verdict.collapsed:  # every replica bad: back to the best sync now, as a sync would (a record says so)
                self.finish_sync(t, verdict)
                self.early_recovered = {r: t for r in verdict.nonfinite}  # (the next sync's window holds their NaNs)
                return verdict.nonfinite
            bad = verdict.exclude
            if bad:
                self._average(t, self.tensors() + self.also_tensors(), bad)
                self._reset_moments(t, bad)
                spectral.refresh_(self.model, lambda: self.model_tensors()[0])
                for r in bad:  # (said at the next sync: sched.last_sync.recovered_early)
                    self.early_recovered.setdefault(r, t)
                self.stability.forget(bad)  # (judged on their windows from now on)
        if bad:
            _warn_recovered(t, bad, "an early recovery at")
        if self.step_scale is not None:
            self.step_scale.take_estimates()
        return bad

    def _gather(self, t: int, local: torch.Tensor) -> torch.Tensor:
        try:  # COLLECTIVE (all_gather) + HOST SYNC
            return self.replicas.gather(local, shard_sum=SHARD_SUM, shard_min=SHARD_MIN, shard_max=SHARD_MAX)
        except ReplicaSyncError as e:
            self.failed_sync = f"the converge step after optimizer step {t} failed in its first collective"
            raise ReplicaSyncError(f"hdet: the converge step after optimizer step {t} failed in its first "
                                   f"collective (all_gather): {e}. The scheduler is half-stepped: resume every "
                                   "replica from the last checkpoint") from e

    def _reset_moments(self, t: int, exclude: list[int]) -> None:
        """The reset replicas' optimizer moments (:meth:`recovery_tensors`) and step counts become the healthy
        replicas' mean (the count rounded: in local mode a replica whose guard skipped steps kept a count of its own,
        and Adam's bias correction then no longer matched the moments it got, an audit); a healthy replica keeps its
        own. COLLECTIVES: as :meth:`_average`, and one all_reduce of the counts."""
        self._average(t, self.recovery_tensors(), exclude, into=exclude)
        steps = self.param_steps()
        if steps:
            device = local_shard(self._params()[0].detach()).device
            counts = torch.stack([s.detach().to(device, torch.float64).reshape(()) for s in steps])
            self._average(t, [counts], exclude, into=exclude)
            with torch.no_grad():
                for s, c in zip(steps, counts.round()):
                    s.copy_(c)

    def _average(self, t: int, tensors: list[torch.Tensor], exclude: list[int],
                 into: list[int] | None = None) -> None:
        """Eq. 3 through the replicas (``into``: only these receive the mean); a failed collective names the step.
        COLLECTIVES: one all_reduce per bucket."""
        if not tensors:
            return
        try:
            self.replicas.average_(tensors, exclude=exclude, **({} if into is None else {"into": into}))
            over_shards = getattr(self.replicas, "average_over_shards_", None)
            if over_shards is not None and into is None and self.model is not None:  # HSDP: buffers are whole on
                over_shards(persistent_float_buffers(self.model) + self.also_buffers())  # each shard rank
                # (COLLECTIVES: one per bucket)
        except ReplicaSyncError as e:
            self.failed_sync = f"the converge step after optimizer step {t} failed while averaging"
            raise ReplicaSyncError(f"hdet: the converge step after optimizer step {t} failed while averaging: "
                                   f"{e}. This process's weights may hold a partial average (an all-reduce in place) "
                                   "and its scheduler is half-stepped: resume every replica from the last "
                                   "checkpoint") from e

    # ----------------------------------------------------------------- state (hdet.ensemble_state)
    def state_dict(self) -> dict[str, Any]:
        """Plain data (numbers, strings, lists, dicts, CPU tensors): loads with ``torch.load(weights_only=True)``.
        Refused (RuntimeError) after a converge step failed part-way: the state would be half-stepped."""
        if self.failed_sync is not None:
            raise RuntimeError(f"hdet: Expected a scheduler whose last converge step finished, but {self.failed_sync}"
                               ": its state is half-stepped and this process's weights may hold a "
                               "partial average, so a checkpoint of them would resume silently wrong. Resume every "
                               "replica from the last checkpoint")
        return ensemble_state.state_dict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a saved state. Everything is checked first; a state that is corrupted, foreign, or from a
        newer hdet gets a ValueError that says why, and nothing is changed. Saved with another number of
        replicas (elastic resume), the bases, velocities and controllers are kept, the multipliers are
        re-dealt for this number, the current loss window is dropped, and a warning says so."""
        self.commit_state(self.check_state(state), state)

    def check_state(self, state: Any) -> dict[str, Any]:
        """Check a saved state completely, change nothing; returns what :meth:`commit_state` sets."""
        return ensemble_state.parse(self, state)

    def commit_state(self, parsed: dict[str, Any], state: dict[str, Any]) -> None:
        """Set a state checked by :meth:`check_state` (cannot fail)."""
        ensemble_state.commit(self, parsed, state)
        self.failed_sync = None


def _warn_recovered(t: int, bad: list[int], when: str) -> None:
    warnings.warn(
        f"hdet: at {when} step {t} replica(s) {bad} had non-finite weights or buffers; they were left out of the "
        "average, reset to the other replicas' mean, and ranked worst by the controller where one runs",
        stacklevel=user_stacklevel())


def _distinct(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` without a second view of the same memory (:func:`hdet.sync.memory_key`)."""
    seen: set[tuple[Any, ...]] = set()
    out = []
    for t in tensors:
        key = memory_key(t)
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


def _warn_if_masters(model: nn.Module | None, params: list[torch.Tensor]) -> None:
    """Said where the optimizer holds master copies of ``model=``'s parameters: each of its parameters outside the
    model matches, by shape, a parameter of the model in another dtype that the optimizer does not hold (an fp16 or
    bf16 model trained through float32 masters: apex's O2, a hand-written mixed-precision loop). A converge step
    averages the optimizer's parameters, so the model's own weights hold the average only once the loop copies the
    masters in again; after the last converge step (at ``total_steps``, or ``finish()``), a model saved without that
    copy is one replica's, not the ensemble's (an audit noted it, silent). Not said for tensors the optimizer trains
    outside the model otherwise (a soft prompt beside a frozen ``model=``), nor for DTensors (FSDP2: after a forward
    under ``no_grad`` the root's parameters are unsharded ones, in the policy's dtype: not masters)."""
    if model is None or not params or any(hasattr(p, "placements") for p in params):
        return
    held = {id(p) for p in params}
    own = list(model.parameters())
    own_ids = {id(q) for q in own}
    outside = [p for p in params if id(p) not in own_ids]
    if not outside:
        return
    left = {}  # the model's parameters the optimizer does not hold, by shape
    for q in own:
        if id(q) not in held and q.is_floating_point():
            left.setdefault(tuple(q.shape), set()).add(q.dtype)
    if all(any(d != p.dtype for d in left.get(tuple(p.shape), ())) for p in outside):
        warnings.warn(f"hdet: {len(outside)} of the optimizer's {len(params)} parameters are copies of model= "
                      f"({type(model).__name__})'s parameters in another dtype, which the optimizer does not hold "
                      "(float32 master copies of a half-precision model?). HDET averages the optimizer's parameters at "
                      "each converge step: copy them into the model after every scheduler.step() that converges, and "
                      "after the last one (total_steps, or finish()), or the model keeps one replica's weights, not "
                      "the ensemble's average", stacklevel=user_stacklevel())
