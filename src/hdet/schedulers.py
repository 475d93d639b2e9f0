"""``HDETLR``, HDET around any base schedule, and ``OneCycleAutoLR``, a drop-in for
``torch.optim.lr_scheduler.OneCycleLR``: an ``HDETLR`` over a ``OneCycleLR`` under the reference's names.

Usage is the reference's: ``optimizer.step(); scheduler.step(loss)``. Step ``t`` (the number of
optimizer steps taken) is a sync step when ``t mod T == 0`` and at the last step. The method lives in
:mod:`hdet.ensemble`; the scheduler turns the base schedule into the ensemble's bases and this
replica's values, and owns what a training loop needs (the gradient guard, the checkpoint).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import numbers
import re
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, OneCycleLR, ReduceLROnPlateau

from . import scheduler_state, spectral
from .caller import user_stacklevel
from .config import OPTIONS, HDETConfig, spreading
from .controller import gamma_as_printed
from .ddp_watch import DDPWatch
from .ensemble import Ensemble, SyncRecord
from .guard import GuardSetting, ScalerWatch, SkipWatch, uncompiled, weak_method
from .hyper import AdamBeta, Dropout, Hyperparameter, LabelSmoothing, check_explored
from .loss_scale import LossScale
from .optimizers import check_lr_groups, check_optimizer, innermost, own_lr_tensors, say_maximize
from .replicas import (DEFAULT_BUCKET_CAP_MB, LocalReplica, Replicas, check_mesh_placements, check_not_fsdp1, is_sharded,
                       reshard_fsdp, resolve_replicas)
from .slots import LRControl
from .step_watch import StepWatch, keep_replicas_at_join_end, lrs_of
from .swap import AverageSwap, averaged, explored_bases
from .sync import check_memory_layout, health, persistent_float_buffers, unaveraged_buffers
from .values import as_float, int_number, real_number
from .warm_init import warm_noise_overwritten

__all__ = ["HDETLR", "OneCycleAutoLR"]

BaseSchedule = LRScheduler | Callable[[int], "float | Sequence[float]"] | None


class HDETLR(LRScheduler):
    """HDET around any base schedule: per-replica spread of each param group's LR (and of any explored
    hyperparameter), weight averaging every T steps, optional auto-LR. Each param group's LR is explored
    separately, with its own permutation (paper section 3.4).

    Args:
        optimizer: the replica's optimizer.
        base: an ``LRScheduler`` on the same optimizer (stepped by this scheduler, once per optimizer step: do not
            step it yourself, and give a schedule counted in epochs, such as ``CosineAnnealingWarmRestarts``'
            ``T_0`` or ``StepLR``'s ``step_size``, in optimizer steps; not ``ReduceLROnPlateau``, which steps on a
            validation metric),
            a callable ``step -> lr`` (one float, or one per group), or None for the groups' constant LRs.
        total_steps: the number of optimizer steps of the run.
        config: an :class:`hdet.HDETConfig`; its fields may also be given as keyword arguments (``**options``:
            ``ensemble_lr_spread_ratio``, ``model_sync_interval``, ``enable_auto_lr``, ...), which win.
        model: the module (DDP-wrapped or not) whose floating-point buffers are averaged too; needed by the
            fit controller and by the gradient guard.
        probe: with ``controller="fit"`` (the default when auto-LR is on): ``probe(model) -> scalar loss`` on a
            batch that every replica sees; called once per replica at each control sync, in eval mode.
        explore: extra hyperparameters to spread and control (:mod:`hdet.hyper`).
        replicas: the replicas explicitly (the one-process engine's views); default: from the process group.
        rank, world_size: checked against the process group when one is initialised.
        process_group: the replicas' group (default: the default group).
        device_mesh: FSDP2/HSDP: a (replicate, shard) mesh; HDET replicas are its replicate dimension.
        bucket_cap_mb: the converge step's bucket size.
        guard_gradients: "auto" (default), "skip", "skip-all", "hook" or False: keep one replica's non-finite
            gradient from reaching the others' weights (:mod:`hdet.guard`; "skip-all" reads every gradient, "skip"
            only those of biases and norm weights and every other's first row, which most NaNs reach; "auto" with a
            fused optimizer: "skip" under ``on_runaway="recover"``, "skip-all" otherwise).
        auto_lr_bounds: (low, high), or one pair per group: the paper controller keeps the LR inside.
        final_lr: per group, or one float: Eq. 8's decay target (default: ``base(total_steps)`` for a
            callable or a LambdaLR (the Hugging Face Trainer's schedules), OneCycle's ``min_lr``, otherwise no
            decay; a target of 0 is none either, and a warning says so when the paper controller runs).
        last_epoch: as in torch's schedulers.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, base: BaseSchedule, total_steps: int, *,
                 config: HDETConfig | None = None, model: nn.Module | None = None,
                 probe: Callable[[nn.Module], Any] | None = None, explore: Sequence[Hyperparameter] = (),
                 replicas: Replicas | None = None, rank: int | None = None, world_size: int | None = None,
                 process_group: Any = None, device_mesh: Any = None, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
                 guard_gradients: bool | str = "auto",
                 auto_lr_bounds: tuple[float, float] | Sequence[tuple[float, float]] | None = None,
                 final_lr: float | Sequence[float] | None = None, last_epoch: int = -1, **options: Any) -> None:
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise TypeError(f"{type(self).__name__}() got unexpected keyword argument(s) {unknown}; the HDET options "
                            f"are {list(OPTIONS)}")
        if config is not None and not isinstance(config, HDETConfig):
            raise ValueError(f"Expected config= to be an hdet.HDETConfig (or its fields as keywords), but got "
                             f"{type(config).__name__}")
        if replicas is not None and not all(hasattr(replicas, a) for a in ("rank", "world_size", "gather", "average_")):
            raise ValueError(f"Expected replicas= to be hdet.Replicas (rank, world_size, gather, average_), but got "
                             f"{type(replicas).__name__}")
        config = dataclasses.replace(config or HDETConfig(), **options)  # validated by __post_init__
        if config.auto_lr_warmup_steps is None:  # HDETLR's default (OneCycleAutoLR sets the reference's)
            config = dataclasses.replace(config, auto_lr_warmup_steps=0)
        total_steps = _as_int(total_steps)
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps <= 0:
            raise ValueError(f"Expected positive integer total_steps, but got {total_steps!r}")
        self.total_steps = total_steps
        self._built_total_steps = total_steps  # (a loaded state's total_steps replaces total_steps: said at the end)
        self.optimizer = optimizer
        if not isinstance(optimizer, torch.optim.Optimizer) or not optimizer.param_groups:
            raise ValueError("Expected a torch.optim.Optimizer with at least one param group, but got "
                             + (f"{type(optimizer).__name__}" if not isinstance(optimizer, torch.optim.Optimizer)
                                else "one with none"))
        if model is not None and not isinstance(model, nn.Module):  # (an AttributeError from deep inside before)
            raise ValueError(f"Expected model= a torch.nn.Module (the DDP-wrapped one, under DDP) or None, but got "
                             f"{type(model).__name__}")
        if replicas is not None and (rank is not None or world_size is not None):
            raise ValueError(f"Expected replicas= or rank=/world_size=, not both: the replicas say their own rank "
                             f"({getattr(replicas, 'rank', '?')}) and size ({getattr(replicas, 'world_size', '?')}), "
                             f"but got rank={rank!r}, world_size={world_size!r}")
        self._base, self._base_fn = _resolve_base(base, optimizer)
        self._host_base_lrs: dict[str, Any] = {}  # (the base's base LRs on the host: _last_lrs_on_host)
        _check_one_cycle_length(self._base, total_steps)
        explore = _explored(explore)
        check_explored(explore)  # (before the checks that read their spreads)
        last_epoch = _last_epoch(last_epoch)
        _check_cycled_beta1(bool(scheduler_state.momentum_cyclers(self._base)), explore)
        if config.enable_auto_lr and any(isinstance(h, LabelSmoothing) for h in explore):
            warnings.warn("hdet: the controller compares the replicas' losses, and label smoothing raises a replica's "
                          "loss by itself: give it the loss without smoothing (the fit controller reads probe(model): "
                          "compute it without smoothing; the paper's reads what step() gets), or it reads a lower "
                          "smoothing as better and drives it to 0 (docs/explore.md)", stacklevel=user_stacklevel())
        if config.enable_auto_lr and config.controller == "paper" and any(isinstance(h, Dropout) for h in explore):
            warnings.warn("hdet: the paper controller compares the replicas' training losses, and dropout raises a "
                          "replica's training loss by itself: it reads a lower dropout as better whatever it does to "
                          "the model (the fit controller's probe runs in eval mode, without dropout)",
                          stacklevel=user_stacklevel())
        _check_probe(config, probe, model)
        resolved = resolve_replicas(replicas, rank, world_size, process_group, bucket_cap_mb, device_mesh)
        self._replicas_given = replicas is not None  # (replicas=: the user's own group, DDP or not: no guard asked)
        params = [p for g in innermost(optimizer).param_groups for p in g["params"]]
        check_not_fsdp1(params, model)
        self._has_shards = any(is_sharded(p) for p in params)  # (FSDP2: writes need the model, to reshard it first)
        if replicas is None or device_mesh is not None:  # (replicas from a process group or mesh: whole replicas)
            check_mesh_placements(device_mesh, params)
            if model is None and self._has_shards:
                warnings.warn("hdet: sharded (FSDP2) parameters without model=: FSDP2 keeps the root's parameters "
                              "unsharded after a forward under no_grad, and hdet reshards the model before it writes "
                              "the shards only when it has the model: pass model= the fully_shard-ed module (without "
                              "it, swap_in_average()/averaged() is refused)", stacklevel=user_stacklevel())
        self._sharded = device_mesh is not None
        check_optimizer(optimizer, spreading(config, explore), config.average_optimizer_state, sharded=self._sharded,
                        lr_spread=config.ensemble_lr_spread_ratio > 0, recovering=config.recovering,
                        lr_moved=config.moves_lr)  # LR-free
        # optimizers: refused where they would break (before the ensemble puts its hooks on the optimizer)
        check_lr_groups(optimizer, config.enable_auto_lr, config.tie_lr_groups)
        say_maximize(optimizer, config.recovering or config.enable_auto_lr and config.controller_kind == "paper")
        self._constant = [as_float(g["lr"]) for g in optimizer.param_groups]
        self._final = self._resolve_final(final_lr)
        if config.enable_auto_lr and config.controller == "paper" and config.eq8 == "decay" and \
                (self._final is None or min(self._final) <= 0):
            warnings.warn("hdet: the paper controller's decay (Eq. 8) has no target here (the base schedule's last "
                          f"value is {self._final}: not a positive LR per group), so once the controller starts the "
                          "base LR no longer decays as the schedule would. Pass final_lr=..., or use the fit "
                          "controller (it corrects the schedule instead of replacing it)", stacklevel=user_stacklevel())
        elif config.enable_auto_lr and config.controller == "paper" and config.eq8 == "decay" and final_lr is not None:
            peak = self._peaks()
            above = [(j, f, p) for j, (f, p) in enumerate(zip(self._final, peak)) if f > p * (1 + 1e-9)]
            if above:  # (Eq. 8's "decay" to it grew the LR 10x, silently: an audit)
                warnings.warn(f"hdet: final_lr {above[0][1]:g} (param group {above[0][0]}) is above the base schedule's "
                              f"highest LR {above[0][2]:g}, so the paper controller's decay (Eq. 8) raises the base LR "
                              "towards it instead of lowering it. Pass the LR the run should end at",
                              stacklevel=user_stacklevel())
        ignored = [name for name, v in (("auto_lr_bounds", auto_lr_bounds), ("final_lr", final_lr)) if v is not None]
        if ignored and not (config.enable_auto_lr and config.controller_kind == "paper"):  # (taken, unused: an audit)
            warnings.warn(f"hdet: {' and '.join(ignored)} given, but only the paper controller (enable_auto_lr=True, "
                          f"controller='paper') reads {'them' if len(ignored) > 1 else 'it'}: ignored. "
                          + ("The fit controller corrects the base schedule by a factor within its own bounds "
                             "(controller=hdet.FitController(bounds=(lo, hi)))" if config.enable_auto_lr else
                             "Auto-LR is off: the LR follows the base schedule"), stacklevel=user_stacklevel())
        self._hdet = Ensemble(config, resolved, optimizer, model, explore, probe=probe,
                              lr_control=LRControl(bounds=self._bounds(auto_lr_bounds), finals=self._final,
                                                    given=(auto_lr_bounds is not None, final_lr is not None)))
        try:
            self._hdet.set_total_steps(total_steps)
            if config.eq8 == "as_printed" and isinstance(self._base, OneCycleLR) and self._hdet.num_control_syncs > 0:
                # (K <= 0: warm-up to the end, no controller update ever runs)
                self._hdet.lr_control.gamma_as_printed = gamma_as_printed(
                    *self._onecycle_factors(), self._hdet.num_control_syncs)  # Eq. 8 as printed
            self._loss_scale = LossScale()  # a torch.amp.GradScaler seen driving the optimizer (here or by the hook guard)
            self._guard = GuardSetting(guard_gradients, process_group, device_mesh, optimizer, resolved.world_size,
                                       self._loss_scale, recovering=config.recovering)
            self._history: dict[str, list[float]] | None = None
            self._watch = StepWatch(self._loss_scale)  # how this scheduler is driven, checked at each step
            self._ddp = DDPWatch()  # the DDP module around this replica, checked (hdet.ddp_watch)
            self._weights_expected: float | None = None  # a loaded state's weights' fingerprint (expect_weights)
            self._values_loaded: tuple[list[float], list[float]] | None = None  # a load's LRs and explored values
            self._weights_hook: Any = None  # (both checked at the first optimizer step after the load: _after_load)
            self._finished_at: int | None = None  # the step finish() averaged the replicas after
            self._closed = False  # close(): its hooks off, done
            self._swap = AverageSwap()  # this replica's own weights while the ensemble's average is in (swap_in_average)
            with _restored_on_failure(optimizer):
                _own_lr_tensors(optimizer, self._base, self._base_firsts())
                if self._base is not None:
                    _unalias_last_lrs(self._base, optimizer)  # (before this scheduler writes its own LRs)
                super().__init__(optimizer, last_epoch)
                self._watch.mark_lrs(optimizer)
                if _close_earlier(optimizer):  # (built: the earlier one's "hook" guard is this one's to take over)
                    self.reapply()  # (its values, which the earlier one's close() set to that one's base)
                # the guard last (DDP takes one comm hook, which a construction that failed after it left behind); an
                # install that fails takes back what it put on
                self._guard.install(model)
                _say_warm_noise_lost(model)  # (once built: a construction refused says nothing, and forgets nothing)
                self._ddp.note(model)
            keep_replicas_at_join_end(model, self)  # (an evaluation's join before the first step, too)
        except BaseException:  # the ensemble's hooks on a D-Adaptation/Prodigy optimizer: taken off again
            if self._hdet.step_scale is not None:
                self._hdet.step_scale.uninstall()
            raise
        self._open_hooks()

    def _open_hooks(self) -> None:
        """This scheduler's own hooks on (built, or reopened): the optimizer step counter, what runs when it is
        dropped unclosed, and its place among the optimizer's open schedulers (:func:`_close_earlier`)."""
        self._opt_hook = innermost(self.optimizer).register_step_post_hook(weak_method(self._count_optimizer_step))
        self._load_hook = innermost(self.optimizer).register_load_state_dict_post_hook(
            weak_method(self._optimizer_loaded))
        # what close() takes off, also when the scheduler is dropped unclosed (a trial of a search left early): its
        # hooks hold it weakly, so it is collected, and this runs then (every trial stayed in memory: an audit)
        self._release = weakref.finalize(self, _release, self._guard, self._hdet.step_scale)
        self._release.atexit = False
        _OPEN.setdefault(innermost(self.optimizer), weakref.WeakSet()).add(self)

    # -- the base schedule ----------------------------------------------------------------------
    def _onecycle_factors(self) -> tuple[float, float]:
        g = self.optimizer.param_groups[0]
        return as_float(g["max_lr"]) / as_float(g["initial_lr"]), as_float(g["initial_lr"]) / as_float(g["min_lr"])

    def _per_group(self, value: Any, what: str, used: bool = True) -> list[float]:
        """``value`` per param group: one LR for all or one each, every one finite and >= 0 where it is ``used`` (a
        ValueError that says what was got otherwise: a NaN or negative LR would train silently wrong)."""
        n = len(self.optimizer.param_groups)
        one = real_number(value)
        values = [one] * n if one is not None else (
            [real_number(v) for v in value] if isinstance(value, (list, tuple)) or (
                isinstance(value, torch.Tensor) and value.dim() == 1) else None)
        if values is None or len(values) != n or not all(
                v is not None and (not used or math.isfinite(v) and v >= 0) for v in values):
            raise ValueError(f"Expected {what} as one finite LR >= 0 or {n} such (one per param group), but got "
                             f"{value!r}")
        return values  # type: ignore[return-value]

    def _resolve_final(self, final_lr: Any) -> list[float] | None:
        if final_lr is not None:
            return self._per_group(final_lr, "final_lr")
        if isinstance(self._base, OneCycleLR):
            return [as_float(g["min_lr"]) for g in self.optimizer.param_groups]
        if self._base_fn is not None:
            return self._per_group(self._base_fn(self.total_steps), f"base({self.total_steps})")
        if isinstance(self._base, LambdaLR):  # (the Hugging Face Trainer's schedules): its value at the last step
            return [b * float(f(self.total_steps)) for b, f in zip(self._base.base_lrs, self._base.lr_lambdas)]
        return None

    def _bounds(self, bounds: Any) -> list[tuple[float, float]]:
        """Per group, the paper controller's (low, high): given, or OneCycle's ``(min_lr, 10 max_lr)``, a decaying
        LambdaLR's or function's ``(last value, inf)`` (the last value: ``final_lr`` where given), or (0, inf)."""
        groups = self.optimizer.param_groups
        if bounds is None:
            if isinstance(self._base, OneCycleLR):
                return [(as_float(g["min_lr"]), 10.0 * as_float(g["max_lr"])) for g in groups]
            if (isinstance(self._base, LambdaLR) or self._base_fn is not None) and self._final is not None:  # a
                # decaying schedule's last value is the floor, as OneCycle's min_lr is (a constant one's is its peak: no
                # floor then); a function of the step as the same LambdaLR (it had none: an audit)
                tops = self._base.base_lrs if isinstance(self._base, LambdaLR) else self._peaks()
                return [(f if 0 < f < b else 0.0, math.inf) for f, b in zip(self._final, tops)]
            return [(0.0, math.inf)] * len(groups)
        per_group = [bounds] * len(groups) if _is_pair(bounds) else list(bounds) if isinstance(bounds, (list, tuple)) else []
        pairs = [tuple(real_number(v) for v in b) for b in per_group if _is_pair(b)]
        if len(pairs) != len(groups) or not all(0 <= lo <= hi and lo < math.inf for lo, hi in pairs):
            raise ValueError(f"Expected auto_lr_bounds as (low, high) with 0 <= low <= high and a finite low, or one "
                             f"such pair per param group ({len(groups)}), but got {bounds!r}")
        return pairs  # type: ignore[return-value]

    def _peaks(self) -> list[float]:
        """Per param group, the base schedule's highest LR as far as it can be seen when built: OneCycleLR's
        ``max_lr``, a function of the step's highest at nine steps over the run, else the LR set now."""
        if isinstance(self._base, OneCycleLR):
            return [as_float(g["max_lr"]) for g in self.optimizer.param_groups]
        peaks = list(self._constant)
        for k in range(9):  # (step by step: a schedule that raises part-way keeps the peak before it)
            probe = scheduler_state.schedule_probe(self, self.total_steps, [round(k * self.total_steps / 8)])
            if probe is None:  # (not a function of the step, or it raised there)
                break
            peaks = [max(p, v) for p, v in zip(peaks, probe[0][1])]
        return peaks

    def _base_firsts(self) -> list[float] | None:
        """A torch scheduler's values per group at its current step, as far as they can be known without the param
        groups (which it has written): a ``LambdaLR``'s from its lambdas, another's ``base_lrs``; None for no torch
        scheduler (nothing has written the groups yet)."""
        if not isinstance(self._base, LRScheduler):
            return None
        try:
            values = self._base_at(max(self._base.last_epoch, 0))
        except Exception:  # (checked where it is used)
            values = None
        return values if values is not None else [as_float(b) for b in getattr(self._base, "base_lrs", [])] or None

    def _base_at(self, t: int) -> list[float] | None:
        """The base schedule's value per param group at any step ``t``, where it is a function of the step (a callable
        base, a ``LambdaLR``'s lambdas); None for a stateful torch scheduler. Compared on load (a schedule rebuilt
        otherwise that agrees at the saved step went on unsaid: :func:`hdet.scheduler_state.schedule_probe`)."""
        if self._base_fn is not None:
            return [as_float(v) for v in self._per_group(self._base_fn(t), f"base({t})", False)]
        if isinstance(self._base, LambdaLR) and type(self._base) is LambdaLR:
            return [b * float(f(t)) for b, f in zip(self._base.base_lrs, self._base.lr_lambdas)]
        return None

    def _scheduled_bases(self) -> list[float]:
        """The base schedule's value of every param group at step ``self.last_epoch`` (finite and >= 0, else a
        ValueError: a schedule that gives NaN or a negative LR would train silently wrong)."""
        used = self.last_epoch < self.total_steps  # (after the last step, torch's linear OneCycleLR goes below 0)
        if self._base is not None:
            return self._per_group(_last_lrs_on_host(self._base, self._host_base_lrs),
                                   f"{type(self._base).__name__}'s LR at step "
                                   f"{self.last_epoch}", used)
        if self._base_fn is not None:
            return self._per_group(self._base_fn(self.last_epoch), f"base({self.last_epoch})", used)
        return list(self._constant)

    # -- the guard ------------------------------------------------------------------------------
    @property
    def gradient_guard(self) -> str | None:
        """The gradient guard installed, if any: "hook", "skip" or "skip-all" (:mod:`hdet.guard`)."""
        return self._guard.installed

    skip_guard = property(lambda self: self._guard.skip)  # the SkipNonFiniteStep guard, if installed

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, foreach: bool | None = None) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over every gradient the optimizer steps; returns the total norm.

        Call it between ``loss.backward()`` and ``optimizer.step()`` instead of clipping yourself: under the
        "skip" gradient guard the norm then also decides whether the step is skipped (a non-finite norm
        means a NaN/Inf gradient), so the guard makes no pass over the gradients of its own that step. Unlike
        torch's clip alone, a step whose finite gradients' norm overflows (inf: 1e30 in float32 under the 2-norm)
        is skipped too, where torch would scale the gradients to 0 and step. ``norm_type`` <= 0 (torch's count of
        the non-zero elements, the smallest magnitude) stays finite over a NaN: the guard then reads the gradients
        itself. With a ``GradScaler``, call ``scaler.unscale_(optimizer)`` first, as before torch's own clip. Under
        the "hook" guard the norm is of the gradients after the hook zeroed a non-finite rank's share (finite, where
        plain DDP's would be NaN). ``max_norm``: a number >= 0 (inf: no clipping) or a 0-d tensor."""
        p_norm = _clip_arguments(max_norm, norm_type, foreach)
        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=p_norm, foreach=foreach)
        guard = self._guard.skip
        if guard is not None and not guard.agree_over and params and p_norm > 0:  # (sharded replicas check their own
            # shards; a "norm" of p <= 0 is finite with a NaN or Inf gradient: 0 counts the non-zero elements, -inf
            # takes the smallest magnitude, and a negative p makes an Inf 0, so the guard reads the gradients itself)
            guard.use_norm(norm, [p.grad for p in params])
        return norm

    def attach_model(self, model: nn.Module) -> None:
        """Give the scheduler its model after construction, for frameworks that wrap the model later (the
        Hugging Face Trainer, Lightning): its floating-point buffers are averaged from now on (when no model
        was given) and, once it is the DDP-wrapped module, the gradient guard is installed. Call it on every
        replica, before the first step (integrations do)."""
        if not isinstance(model, nn.Module):
            raise ValueError(f"Expected a torch.nn.Module, but got {type(model).__name__}")
        _say_warm_noise_lost(model)
        self._ddp.note(model)
        if self._hdet.model is None:
            self._hdet.model = model
        if self._closed:  # (a closed run's state loaded before: no guard, no hold on join(); _reopen installs them)
            return
        self._guard.install(model)
        keep_replicas_at_join_end(model, self)

    def close(self) -> None:
        """Take off what this scheduler put on the optimizer and the model, leaving them as plain training would:
        the gradient guard (a "hook" guard's comm hook, which DDP keeps, averages as DDP does from now on), its
        optimizer hooks, the step scale over D-Adaptation/Prodigy, its hold on ``model.join()``'s end; each param
        group's LR and each explored value at the base schedule's value now (the ensemble's, the same on every
        replica). A scheduler closes itself after its step at ``total_steps``; close one left before it (after
        ``finish()``) to train on without it, in a fine-tune, an SWA phase or the next trial of a search on the same
        model (left on, the guard zeroed or skipped what plain training would not, a later ``join()`` kept the
        ranks apart, and every trial's scheduler stayed in memory: an audit). Once closed, ``step()`` and
        ``finish()`` between converge steps raise; ``load_state_dict()`` of a run not over puts the hooks back.
        Idempotent; no collective; refused inside ``averaged()``."""
        if self._closed:
            return
        self._swap.check("close() was called")
        self._closed = True
        self._release.detach()
        self._guard.close()
        self._opt_hook.remove()
        self._load_hook.remove()
        if self._hdet.step_scale is not None:
            self._hdet.step_scale.turn_off()
        if self._weights_hook is not None:
            self._weights_hook.remove()
            self._weights_hook = None
        self._set_base_values()
        ens = self._hdet
        ddp = uncompiled(ens.model) if ens.model is not None else None
        open_ = ddp.__dict__.get("_hdet_open") if isinstance(ddp, nn.Module) else None
        if open_ is not None:
            open_.discard(self)

    def _set_base_values(self) -> None:
        """Each param group's LR and each explored value at the base's, the same on every replica (a closed run's)."""
        for group, lr in zip(self.optimizer.param_groups, self.base_lrs_now):  # (after the last step, torch's
            # OneCycleLR's value one step past its end, as it leaves its optimizer: a drop-in replacement)
            _set_lr(group, lr)
        for h, base in zip(self._hdet.hypers, explored_bases(self._hdet)):
            h.set(base)
        self._last_lr = lrs_of(self.optimizer)  # (get_last_lr(): what is used)
        self._watch.mark_lrs(self.optimizer)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run (by itself after the step at ``total_steps``)."""
        return self._closed

    def _reopen(self) -> None:
        """What :meth:`close` took off put back (a state of a run not over loaded into a closed scheduler)."""
        _close_earlier(self.optimizer)
        self._closed = False
        if self._hdet.step_scale is not None:
            self._hdet.step_scale.turn_on()
        self._guard.reopen(self._hdet.model)
        keep_replicas_at_join_end(self._hdet.model, self)
        self._open_hooks()

    def set_total_steps(self, total_steps: int) -> None:
        """Run to ``total_steps`` instead (a resume into a longer or shorter run, not shorter than the steps taken):
        HDET's last converge step moves there. A scheduler closed at its old end reopens, with its replicas' own
        values for the step now (the Hugging Face Trainer resumed from a run's last checkpoint into more steps)."""
        if isinstance(self._hdet.replicas, LocalReplica):
            raise ValueError("Expected a scheduler of its own replica (a process group's), but got one of a "
                             "ReplicaEngine's: its replicas step together; build the engine for the new length")
        least = self.last_epoch + (not self._closed)  # (an open run's last step, its final average, still to come)
        if not isinstance(total_steps, int) or isinstance(total_steps, bool) or total_steps < max(least, 1):
            raise ValueError(f"Expected total_steps as an integer of at least {max(least, 1)} (the {self.last_epoch} "
                             f"steps taken{'' if self._closed else ' and one more, the last converge step'}), but got "
                             f"{total_steps!r}")
        _check_one_cycle_length(self._base, total_steps)
        self._hdet.set_total_steps(total_steps)  # (checks auto-LR's and the range test's windows against it)
        at_end, self.total_steps = self.last_epoch == self.total_steps, total_steps
        if self._closed and self.last_epoch < total_steps:
            if at_end:  # (the replicas were averaged at the old end, as finish() does: is_sync_step says so still)
                self._finished_at = self.last_epoch
            self._reopen()
            self.reapply()
            if self.last_epoch > 0:
                self._guard.resumed()  # (what a load of an open run's state does)

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"hdet: {what} on a closed scheduler (closed after its step at total_steps="
                               f"{self.total_steps}, or by close() at step {self.last_epoch}): its hooks are off and "
                               "its replicas no longer averaged. Build a new scheduler to train with HDET again")

    def also_average(self, module: nn.Module) -> "HDETLR":
        """Average ``module`` with the weights from now on: an EMA or SWA copy of this replica's model
        (``torch.optim.swa_utils.AveragedModel``), updated from it after every step. Between converge steps each
        rank's copy follows its own replica; its floating-point parameters and buffers are averaged in place at
        every converge step, early recovery, ``finish()`` and ``swap_in_average()`` (``averaged()``), and stay so:
        an EMA or a running mean is linear in the weights, so the replicas' mean is the EMA of the ensemble's
        average, and averaging keeps it. Without it rank 0's EMA, the one saved, is its own replica's (at alpha
        0.5 and T 1000 an audit measured, mid-run, a loss of 0.25 for rank 0's EMA against 0.047 for the ensemble's).
        Call it on every replica (checked at the next converge step), on the weights' device; when resuming, before
        ``load_state_dict`` (a best sync of ``on_runaway="recover"`` keeps the module too, and a go-back puts it
        back), with each replica's own EMA saved and loaded as its model is (the registration is not saved). Integer
        buffers (the ``n_averaged`` count) are left as they are, equal on every replica. Returns the scheduler."""
        if isinstance(self._hdet.replicas, LocalReplica):
            raise RuntimeError("hdet: this scheduler is a ReplicaEngine's replica, whose models live in one process: "
                               "update one EMA from the ensemble's average instead (`with engine.averaged(): "
                               "ema.update_parameters(engine.models[0])`, docs/engine.md)")
        self._swap.check("also_average() was called")
        self._hdet.also_average(module)
        return self

    def _optimizer_loaded(self, optimizer: Any) -> None:
        """After ``optimizer.load_state_dict``: torch deep-copies the saved param groups, so one LR tensor that several
        groups held when saved is shared again (a review: the copies :func:`hdet.optimizers.own_lr_tensors` made were
        undone, and every group trained at the last LR set); each gets its own again, with this replica's values."""
        self._watch.forget_lrs()  # (the load wrote the LRs: the next step does not take them for another writer's)
        if own_lr_tensors([optimizer]):
            self.reapply()

    def _count_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._watch.optimizer_stepped()

    # -- LRScheduler ----------------------------------------------------------------------------
    def get_lr(self) -> list[float]:  # type: ignore[override]
        """This replica's LR per group (Eqs. 1, 9); also sets every explored hyperparameter's value."""
        ens = self._hdet
        self._bases_now = [as_float(b) for b in self._scheduled_bases()] + [h.base(self.last_epoch) for h in ens.hypers]
        return self._values(self._bases_now)

    def _values(self, bases: list[float]) -> list[float]:
        """This replica's LR per group from every slot's scheduled base now; sets the explored values."""
        ens = self._hdet
        values = ens.apply_schedule(bases)
        for h, v in zip(ens.hypers, values[ens.num_lr_slots:]):
            h.set(v)
        if not self._ddp.started and ens.hypers:  # (before the first step: what each reads back as set, compared
            # once after it under DDP's broadcast_buffers; read back, so a setter that rounds or a bf16 buffer is no
            # change)
            first = self._ddp.values_set is None
            self._ddp.values_set = [h.get() for h in ens.hypers]  # (HOST SYNC where a value lives in a tensor: before
            # the first step only)
            if first:
                _say_rounded(ens.hypers, values[ens.num_lr_slots:], self._ddp.values_set, self.rank,
                             ens.all_values()[ens.num_lr_slots:], lambda: ens.replicas.first_to_say("rounded"))
        if self._history is not None:  # the base of every slot in effect for step last_epoch + 1
            self._history[str(self.last_epoch)] = list(ens.current_bases)
        lrs = values[: ens.num_lr_slots]
        if ens.step_scale is not None:  # D-Adaptation/Prodigy: the same LR everywhere, rho_r on the step
            shared = [float(b) for b in ens.current_bases[: ens.num_lr_slots]]
            ens.step_scale.multipliers = [v / b if b > 0 else 1.0 for v, b in zip(lrs, shared)]
            return shared
        return lrs

    def observe(self, loss: torch.Tensor | float, counted: torch.Tensor | bool = True) -> None:
        """This replica's training loss of the optimizer step just taken (what ``step(loss)`` passes on).
        ``counted`` False, or a bool tensor that is False (read at the sync, no host sync here), for a step that
        measured nothing on this replica (no label token in any of its micro-batches): left out of the window's mean
        loss, and not taken for a non-finite loss (:class:`hdet.HDETTrainer` passes it)."""
        self._hdet.observe(loss, counted)

    def step(self, loss: torch.Tensor | float | None = None, **kwargs: Any) -> None:  # type: ignore[override]
        """Call after ``optimizer.step()``, with that step's training loss (needed by auto-LR).

        Off a sync step this only keeps the loss on its device (no host sync). On a sync step every
        replica must call it: it runs the collectives of :meth:`Ensemble.sync`."""
        if kwargs:  # (torch's deprecated step(epoch=...) gave Python's own "unexpected keyword argument")
            raise TypeError(f"Expected scheduler.step(loss) (this step's training loss, or nothing), but got the "
                            f"keyword(s) {sorted(kwargs)}: HDET steps its base schedule once per optimizer step and "
                            "takes no epoch")
        self._watch.check_loss(loss)
        if loss is not None:
            self._hdet.observe(loss)
        if getattr(self, "_step_count", 0) == 0:  # LRScheduler.__init__'s own first step
            return super().step()
        with _torch_first_step_checks(self.optimizer, self._step_count == 1):
            t = self.begin_step()
            stalled = self._guard.watch is not None and self._guard.watch.poll(t)  # skip: a lagged read; hook: a count
            if self._hdet.is_sync_step(t):
                self._ddp.check_unfrozen()
                rec = self._hdet.sync(t)
                if self._guard.watch is not None:
                    self._guard.watch.reset()
                self._loss_scale.after_sync(self._went_back(rec), not any(rec.nonfinite_losses))
            elif stalled:  # every step of a stretch skipped on every replica: reset the bad replica now
                self._recover_stall(t, self._guard.watch)
            self.end_step()
        self._hdet.raise_hook_error()  # (an on_sync hook's, now that the step is complete)

    def begin_step(self, lead: "HDETLR | None" = None) -> int:
        """The first half of :meth:`step` (the one-process engine runs the sync between the halves): checks,
        Prodigy's estimate shared under a process group (COLLECTIVE: :meth:`hdet.step_scale.StepScale.exchange`), the
        base schedule's step, the fit controller's window mean. Returns the optimizer step ``t``.

        ``lead``: another replica's scheduler of the same engine, whose base schedule has just stepped: this one's
        takes its state instead of computing the same values again (:meth:`follows`)."""
        self._swap.check("scheduler.step() was called")
        self._unexpect_weights()
        t = self.last_epoch + 1  # optimizer steps taken so far
        if t > self.total_steps:
            raise ValueError(f"Expected at most total_steps={self.total_steps} calls of scheduler.step() after "
                             f"optimizer steps, but this is call {t}; {self.past_the_end()}")
        self._check_open("scheduler.step() was called")
        if self._guard.waiting:  # (another scheduler's hook guard on the model: taken over once it is closed)
            self._guard.retry()
        if len(self.optimizer.param_groups) != len(self._constant):  # (add_param_group after building the scheduler)
            raise ValueError(f"Expected the {len(self._constant)} param group(s) the scheduler was built with, but the "
                             f"optimizer has {len(self.optimizer.param_groups)} now (optimizer.add_param_group after "
                             "the scheduler was built?): HDET's LR slots are fixed when it is built. Build the "
                             "scheduler after adding every param group (a group frozen for now can hold parameters "
                             "with requires_grad=False; but DistributedDataParallel all-reduces only the gradients of "
                             "the parameters that required grad when it was built: unfrozen later, that group's "
                             "gradients stay each replica's own unless DDP is built again, right after a converge "
                             "step or with init_sync=False (torch >= 2.5): its constructor copies rank 0's weights "
                             "to every rank, which mid-window replaces each replica's own with rank 0's)")
        if not self._ddp.started:  # (the replicas the user built, replicas=, may share no gradients: no guard asked)
            unguarded = not (self._replicas_given or isinstance(self._hdet.replicas, LocalReplica)) \
                and self._guard.missing(self._hdet.model)
            self._ddp.first_step(self._hdet.model, unguarded, self._hdet.hypers, self.rank)
        c = self._hdet.config
        self._watch.check_stepped(self._step_count, self.last_epoch, self._guard.local, self.optimizer,
                                  c.average_optimizer_state)
        self._watch.check_join(self._hdet.model, self)
        self._watch.check_capped_lr(self.optimizer, c.ensemble_lr_spread_ratio > 0 or c.moves_lr, t)
        if self._hdet.step_scale is not None:  # Prodigy under a process group: its estimate shared (COLLECTIVE)
            self._hdet.step_scale.exchange()
        if t == 1:  # again after the first step: an optimizer recognised only by what its first step leaves in the
            # param groups (schedulefree.ScheduleFreeWrapper's base optimizer)
            check_optimizer(self.optimizer, spreading(c, self._hdet.hypers), c.average_optimizer_state,
                            sharded=self._sharded, lr_spread=c.ensemble_lr_spread_ratio > 0,
                            recovering=c.recovering, lr_moved=c.moves_lr)
        if lead is None and self._base is not None:
            stepped = _step_count_of(self._base, self.last_epoch)
            if stepped != self.last_epoch:
                raise ValueError(f"Expected the base schedule ({type(self._base).__name__}) at step {self.last_epoch}, "
                                 f"as this scheduler, but it is at step {stepped}: it was stepped elsewhere, or built "
                                 "or loaded at another step (HDETLR steps it, once per optimizer step; a second "
                                 "base.step() runs the schedule at twice its speed). Step only the HDETLR, and resume "
                                 "with its load_state_dict")
        self._watch.check_lrs_kept(self.optimizer)  # (after that check: a base stepped elsewhere wrote the LRs too)
        if lead is not None:
            self._follow_base(lead)
        elif self._base is not None:
            # Chainable schedulers compute from group['lr']: give them their own last value, not base * rho (nor
            # the base, which holds the controller's correction and the LR cuts: they would compound every step);
            # OneCycleLR and LambdaLR compute from their own constants
            if type(self._base) not in (OneCycleLR, LambdaLR):
                for g, b in zip(self.optimizer.param_groups, self._scheduled_bases()):
                    _set_lr(g, b)
            self._base.step()
            _unalias_last_lrs(self._base, self.optimizer)
        self._hdet.after_optimizer_step(t)
        return t

    def end_step(self, lead: "HDETLR | None" = None) -> None:
        """The second half of :meth:`step`: this replica's values for the next step (from ``lead``'s scheduled
        bases, computed once for the engine's replicas, when given)."""
        if lead is None:
            self._advance()  # (what LRScheduler.step() does; its call-order checks at the first step are
            # _torch_first_step_checks', around step(); the engine, which calls this itself, orders its own calls)
        else:
            self._follow_step(lead)
        self._watch.mark_lrs(self.optimizer)
        if self.last_epoch >= self.total_steps:  # the run is over (its last converge step taken): hooks off
            self.close()

    def _follow_step(self, lead: "HDETLR") -> None:
        n = len(self.optimizer.param_groups)  # the LR slots' bases: the lead's; the explored ones: this replica's
        self._advance(lead._bases_now[:n])

    def _advance(self, lead_bases: list[float] | None = None) -> None:
        """What ``LRScheduler.step()`` does after its checks, without torch's machinery around it: one step counted,
        this replica's LR per group at the new step (:meth:`get_lr`; from ``lead_bases``, another replica's bases of
        the LR slots, where given: the engine's followers) written, in place where an LR is a tensor, and kept as the
        last LRs."""
        self._step_count += 1
        self.last_epoch += 1
        if lead_bases is None:
            values = self.get_lr()
        else:  # (the schedule not computed again)
            self._bases_now = lead_bases + [h.base(self.last_epoch) for h in self._hdet.hypers]
            values = self._values(self._bases_now)
        for group, lr in zip(self.optimizer.param_groups, values, strict=True):
            _set_lr(group, lr)
        self._last_lr = lrs_of(self.optimizer)

    def past_the_end(self) -> str:
        """What to do about a step past ``total_steps``: raise it, or (a loaded state kept a shorter run than this
        scheduler was built for) why raising it did not help."""
        built = getattr(self, "_built_total_steps", self.total_steps)
        if built == self.total_steps:
            return "raise total_steps or stop stepping" + (
                " (scheduler.step() ran without an optimizer.step() before: under gradient accumulation call it once "
                "per optimizer step, not on every micro-batch)" if self._watch.warned_double_step else "")
        return (f"this scheduler was built with total_steps={built}, and the state it loaded keeps its run's length, "
                f"{self.total_steps} (a resume cannot lengthen a run: start a new one from the checkpoint's weights, "
                "or stop at the saved length)")

    def follows(self, lead: "HDETLR") -> bool:
        """Whether this scheduler's base schedule is ``lead``'s, value for value, so that it can take ``lead``'s
        at every step (the engine steps the base schedule once for its N replicas): none, the same callable, or
        a ``OneCycleLR`` in the same state over param groups with the same schedule."""
        if type(self) is not type(lead) or self.last_epoch != lead.last_epoch:
            return False
        if self._base is None or lead._base is None:
            return self._base is lead._base and self._base_fn is lead._base_fn and (
                self._base_fn is not None or self._constant == lead._constant)
        if type(self._base) is not OneCycleLR or type(lead._base) is not OneCycleLR:
            return False
        keys = ("initial_lr", "max_lr", "min_lr", "base_momentum", "max_momentum")
        try:
            return self._base.state_dict() == lead._base.state_dict() and all(
                [g.get(k) for k in keys] == [h.get(k) for k in keys]
                for g, h in zip(self.optimizer.param_groups, lead.optimizer.param_groups, strict=True))
        except (RuntimeError, ValueError):  # tensors that do not compare as one bool: not the same
            return False

    def _follow_base(self, lead: "HDETLR") -> None:
        """This replica's base schedule, stepped by taking ``lead``'s state: OneCycleLR's step count, last LR and
        the momentum it writes into each param group (beta1 only: an explored beta2 stays this replica's)."""
        base, theirs = self._base, lead._base
        if base is None:
            return
        base.last_epoch, base._step_count, base._last_lr = theirs.last_epoch, theirs._step_count, list(theirs._last_lr)
        if base.cycle_momentum:
            for g, h in zip(self.optimizer.param_groups, lead.optimizer.param_groups):
                if base.use_beta1:
                    g["betas"] = (h["betas"][0], *g["betas"][1:])
                else:
                    g["momentum"] = h["momentum"]

    def _went_back(self, rec: SyncRecord) -> bool:
        """Whether this replica was reset at sync ``rec`` (so its GradScaler's scale goes back too): every replica where
        the ensemble went back to its best sync; with shared gradients every replica where one with non-finite
        weights was reset (each rank's scaler sees the same all-reduced gradients and keeps the same scale: they must
        stay equal); in local mode (the DDP model under ``no_sync()``: each rank's scaler its own) only a reset
        replica, non-finite or run away (a healthy one's scale was put back too before: 4x below its own in the
        test, 32x in an audit's run)."""
        if rec.went_back_to is not None:
            return True
        if self._guard.local:
            return self._hdet.replicas.rank in (*rec.recovered, *rec.runaway)
        return bool(rec.recovered)

    def _recover_stall(self, t: int, watch: SkipWatch | ScalerWatch) -> None:
        bad = self._hdet.recover(t)
        self._loss_scale.after_sync(bool(bad), False)
        if not bad:
            warnings.warn(f"hdet: every optimizer step of the last {watch.every} (at least) was skipped on "
                          "every replica, but every replica's weights are finite: the loss or gradients are "
                          "non-finite for another reason (data, loss scale, learning rate)",
                          stacklevel=user_stacklevel())
        watch.reset()

    def finish(self) -> SyncRecord | None:
        """Average the replicas now, for a run that ends before ``total_steps`` (early stopping, a time limit, a
        loop left early): a converge step after the last optimizer step taken, as the one at ``total_steps`` would
        have been. Otherwise each rank's model stays its own replica, trained at its own multiplier, not the
        ensemble's average. Every replica must call it (the collectives of a sync step). It is a whole sync over the
        window so far (the runaway check, the controller's deal, a new window): a checkpoint written after it holds
        the averaged replicas, and training may go on from it. Nothing (None) when that step was a sync step
        already, or no step was taken; otherwise the sync's record. The integrations call it when training ends
        (``on_train_end``)."""
        self._swap.check("finish() was called")
        t = self.last_epoch
        if t <= 0 or self._hdet.is_sync_step(t) or self._finished_at == t:
            return None
        self._check_open("finish() was called")
        rec = self._hdet.sync(t)
        self._finished_at = t
        if self._guard.watch is not None:
            self._guard.watch.reset()
        self._loss_scale.after_sync(self._went_back(rec), not any(rec.nonfinite_losses))
        self.reapply()  # the values the sync dealt, should training go on (step() sets them after a sync)
        self._hdet.raise_hook_error()
        return rec

    def swap_in_average(self) -> bool:
        """Put the ensemble's average into this replica's model, to evaluate or save the model the run is building
        between converge steps, keeping the replica's own weights and buffers aside (one copy, on their device) for
        :meth:`swap_back`, after which training goes on exactly as if nothing happened (:mod:`hdet.swap`).

        The average is Eq. 3's, of what a converge step averages in the model (its parameters and floating-point
        buffers; not the optimizer state), over the replicas whose weights are finite; the explored hyperparameters
        (label smoothing, an attention temperature, ...) are set to their base, the ensemble's value, meanwhile.
        Without it an evaluation between converge steps measures each rank's own replica on its share of the data. Every replica must call
        it, after ``scheduler.step()``; right after a converge step (or ``finish()``, or the last step) the replicas are equal and it
        changes nothing, with no collective; after a converge step mid-run, a model's floating-point buffers (BatchNorm's)
        are averaged, nothing else: a training forward since, a gradient accumulation's micro-batch, moved them apart. Until :meth:`swap_back`, ``optimizer.step()``, ``scheduler.step()``
        and ``finish()`` raise :class:`hdet.SwappedInError`. Returns whether the weights changed. The integrations
        call it around evaluations and the checkpoints saved with them. COLLECTIVES: one all_gather of one float64
        (a HOST SYNC), then one all_reduce per bucket."""
        ens = self._hdet
        if isinstance(ens.replicas, LocalReplica):
            raise RuntimeError("hdet: this scheduler is a ReplicaEngine's replica: call engine.swap_in_average() (or "
                               "use `with engine.averaged():`), which averages every replica at once")
        self._swap.check("swap_in_average() was called again")
        if ens.model is None and self._has_shards:
            raise ValueError("Expected the scheduler built with model= the fully_shard-ed module to evaluate the "
                             "average of sharded (FSDP2) replicas, but it has no model: after an evaluation's forward "
                             "FSDP2 reuses its unsharded copies, so the average written into the shards would go "
                             "unseen")
        reshard_fsdp(ens.model)  # (FSDP2: an evaluation's forward left the root's unsharded copies, which the next
        # forward would reuse, unseen the average written into the shards)
        t = self.last_epoch
        tensors, strict = ens.model_tensors()
        also = ens.also_tensors()  # (averaged in place and left so: also_average)
        finite = None
        ended = self._finished_at == t or t >= self.total_steps or self._closed  # (training over: no forward pending)
        params_equal = not self._watch.stepped_since and t > 0 and (ens.is_sync_step(t) or ended)
        equal = params_equal and (ended or all(strict))  # (floating-point buffers after a converge step mid-run: a
        # training forward since, a gradient accumulation's micro-batch before a validation, moved each replica's
        # BatchNorm statistics apart, an audit; only they are averaged then, the parameters left exactly as they are)
        only_buffers = params_equal and not equal and not ens.also_apart
        if ens.replicas.world_size > 1 and (ens.also_apart or not equal):  # (equal: a converge step, no step since;
            # also_apart: a module registered since)
            dev = ens.replicas.comm_device(tensors[0].device if tensors else None)
            ok = health(tensors, strict, dev)[0] if tensors else torch.ones((), dtype=torch.bool, device=dev)
            memory = torch.tensor([float(ens.replicas.memory_layout(tensors + also))], dtype=torch.float64, device=dev)
            rows = ens.replicas.gather(torch.cat([ok.to(torch.float64).reshape(1), memory]), shard_min=(0,))  # COLLECTIVE
            # + HOST SYNC
            check_memory_layout(t, rows[:, 1].tolist())
            finite = [bool(v >= 1) for v in rows[:, 0].tolist()]

        def average(bad: list[int]) -> None:
            some = [x for x, s in zip(tensors, strict) if not s] if only_buffers else tensors + also
            ens.replicas.average_(some, exclude=bad)  # COLLECTIVES: one all_reduce per bucket
            ens.also_apart = False
            over_shards = getattr(ens.replicas, "average_over_shards_", None)
            if over_shards is not None and ens.model is not None:  # HSDP: a replica's buffers, over its shard ranks
                over_shards(persistent_float_buffers(ens.model) + ens.also_buffers())  # COLLECTIVES: one per bucket
            spectral.refresh_(ens.model, lambda: tensors)  # (spectral norms' u, v for the averaged weights)

        owns = [h.get() for h in ens.hypers]  # (before the swap-in: it averages a value kept in a model's buffer)
        changed = self._swap.swap_in([tensors], finite, average, [innermost(self.optimizer)],
                                     keep=[unaveraged_buffers(ens.model)] if ens.model is not None else ())
        self._swap.hold_values(ens.hypers, explored_bases(ens), owns)
        return changed

    def swap_back(self) -> bool:
        """Put this replica's own weights and buffers back after :meth:`swap_in_average` (nothing otherwise; no
        collective), and its explored values. Returns whether the average was in."""
        if self._swap.saved is not None:
            reshard_fsdp(self._hdet.model)  # (FSDP2: the evaluation's forward left the average's unsharded copies)
        return self._swap.swap_back()

    def averaged(self) -> contextlib.AbstractContextManager[bool]:
        """``with scheduler.averaged(): evaluate(model)``: :meth:`swap_in_average` on entry (it yields whether the
        weights changed), :meth:`swap_back` on exit. On every replica (collectives)."""
        return averaged(self)

    @property
    def average_swapped_in(self) -> bool:
        """Whether :meth:`swap_in_average` is in effect (until :meth:`swap_back`)."""
        return self._swap.active

    def reapply(self) -> None:
        """Set this replica's current values on the optimizer (and explored hyperparameters) again. For
        frameworks that restore one rank's optimizer state on every rank (the Hugging Face Trainer saves
        rank 0's), which would otherwise give every replica rank 0's learning rate until the next step."""
        if self._closed:  # (the base's values, as close() left them: the integrations call it after a load)
            self._set_base_values()
            return
        with warnings.catch_warnings():  # torch warns when get_lr runs outside step()
            warnings.simplefilter("ignore", UserWarning)
            values = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, values):
            _set_lr(group, lr)  # (a tensor LR in place: a captured or compiled step reads that tensor)
        self._last_lr = lrs_of(self.optimizer)
        self._watch.mark_lrs(self.optimizer)

    def record_schedule(self) -> "HDETLR":
        """Remember, from now on, every step's base value per explored slot (see :mod:`hdet.replay`).
        The record is part of the state_dict, so a resumed run keeps it."""
        if self._history is None:
            self._history = {str(self.last_epoch): list(self._hdet.current_bases)}
        return self

    def discovered_schedule(self) -> dict[str, Any]:
        """The recorded bases as plain data: ``{"names": [...], "bases": [[per slot] per step]}``, step 0
        first (what :class:`hdet.ReplayLR` plays back)."""
        if not self._history:
            raise ValueError("Expected sched.record_schedule() to have been called before training, but nothing "
                             "was recorded")
        steps = sorted(int(k) for k in self._history)
        if steps != list(range(steps[0], steps[-1] + 1)) or steps[0] != 0:
            raise ValueError(f"Expected a record from step 0 without gaps, but it covers steps {steps[0]}..{steps[-1]}"
                             f" with {len(steps)} entries (call record_schedule() before the first step)")
        return {"names": list(self._hdet.names), "bases": [self._history[str(t)] for t in steps]}

    # -- conveniences ---------------------------------------------------------------------------
    @property
    def multipliers(self) -> list[float]:
        """This replica's current multiplier per param group (1 once closed: every replica at the base)."""
        if self._closed:
            return [1.0] * self._hdet.num_lr_slots
        return [self._hdet.multiplier(j) for j in range(self._hdet.num_lr_slots)]

    @property
    def effective_lrs(self) -> list[float]:
        """This replica's LR per group as it acts on the weights: ``get_last_lr()``, times the multiplier on
        the step for D-Adaptation/Prodigy (whose optimizer holds the ensemble's base LR, :mod:`hdet.step_scale`)."""
        scale = self._hdet.step_scale if not self._closed else None  # (closed: its step scale is off)
        lrs = self.get_last_lr()
        return lrs if scale is None else [lr * m for lr, m in zip(lrs, scale.multipliers)]

    @property
    def base_lrs_now(self) -> list[float]:
        """The base (pre-multiplier) learning rate per group in effect for the next step."""
        return list(self._hdet.current_bases[: self._hdet.num_lr_slots])

    @property
    def hyperparameters(self) -> dict[str, float]:
        """This replica's current value of every explored hyperparameter other than the LR."""
        return {h.name: h.get() for h in self._hdet.hypers}

    rank = property(lambda self: self._hdet.replicas.rank)
    world_size = property(lambda self: self._hdet.replicas.world_size)
    ensemble = property(lambda self: self._hdet)
    last_sync: SyncRecord | None = property(lambda self: self._hdet.last_sync)  # type: ignore[assignment]

    def is_sync_step(self, t: int | None = None) -> bool:
        """Whether optimizer step ``t`` (default: the last one taken) was a sync step (a converge step, or
        :meth:`finish`'s: the replicas are equal after it)."""
        t = self.last_epoch if t is None else t
        return self._hdet.is_sync_step(t) or (t > 0 and t == self._finished_at)

    # -- state (hdet.scheduler_state) -----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain data only, so ``torch.load(weights_only=True)`` reads it: the scheduler's counters and last LRs,
        the base scheduler's state under ``"base"``, the ensemble's versioned state under ``"hdet"``. Live
        objects (the optimizer, the guard, callables) stay out. Not for ``torch.distributed.checkpoint`` as it is
        (refused there: :class:`hdet.RankState`)."""
        scheduler_state.refuse_dcp(sys._getframe(1))
        return scheduler_state.state_dict(self)

    def check_state_dict(self, state_dict: Any) -> dict[str, Any]:
        """Check a state completely, change nothing (ValueError on any problem)."""
        return scheduler_state.check(self, state_dict)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict`. Everything is checked before anything is set: a foreign,
        corrupted or newer state raises ValueError and leaves the scheduler as it was. Then this replica's own
        values are set on the optimizer (:meth:`reapply`): a state saved by another rank never gives this
        replica another replica's learning rate. Under a process group, a state this rank saved holds its weights'
        fingerprint, compared at the next optimizer step (:meth:`expect_weights`). A closed run's state (saved after
        the last step, or after :meth:`close`) loads closed, at the base's values; an open run's reopens a closed
        scheduler."""
        parsed = scheduler_state.check(self, state_dict)
        # a state of a closed run (after its last step, or closed after finish()) loads closed, its values the
        # base's; before, each rank resumed at its own multiplied LR with HDET's hooks on (an audit: plain training
        # after a resume from a run's last checkpoint drifted the ranks 7e-3 apart)
        closing = scheduler_state.closed(self, state_dict)
        was_closed = self._closed
        self._swap.check("load_state_dict() was called (what it loads, and a model loaded with it, would be undone "
                         "when this replica's own weights and values are put back)")  # (before anything is set)
        try:
            if was_closed and not closing:  # a closed scheduler given an open run's state: its hooks back on, as when
                self._reopen()  # it was built (before the load, which sets this replica's own values then)
            scheduler_state.load(self, state_dict, parsed)
        except BaseException:  # (a base schedule or a warning filter that raises in the load: closed as it was)
            if was_closed and not self._closed:
                self.close()
            raise
        if closing and not self._closed:
            self.close()
        if self.last_epoch > 0 and not self._closed:  # a resumed run has taken steps: a stall right after it is one
            self._guard.resumed()  # (the guards' watches)
        self._watch.resumed()  # (a resumed run counts optimizer steps from here)
        if not self._closed:
            self._expect_values()

    def _expect_values(self) -> None:
        """Keep this replica's LRs and explored values as the load set them, to set them again at the first optimizer
        step if an optimizer state loaded since replaced them: rank 0's checkpoint loaded on every rank, scheduler
        first (its param groups hold rank 0's LR and weight decay), trained every replica's first resumed step at
        replica 0's values, silently (an audit: weights 1.4e-2 off at the end). Torch's order-free resume holds. Not
        for a ReplicaEngine's replicas: the engine loads the optimizers first (and a hook would keep its stacked step
        off)."""
        if isinstance(self._hdet.replicas, LocalReplica):
            return
        self._values_loaded = ([as_float(lr) for lr in lrs_of(self.optimizer)], [h.get() for h in self._hdet.hypers])
        self._hook_after_load()

    def expect_weights(self, fingerprint: float) -> None:
        """Say (a warning) if this replica's weights at the next optimizer step are not those whose fingerprint
        (:meth:`hdet.ensemble.Ensemble.weights_fingerprint`) the loaded state holds: a model state loaded before
        ``DistributedDataParallel(...)`` was built is overwritten by rank 0's (its constructor broadcasts them), and the
        resumed run went on from rank 0's replica on every rank, silently (an audit). One HOST SYNC, at that step."""
        self._weights_expected = fingerprint
        self._hook_after_load()

    def _hook_after_load(self) -> None:
        if self._weights_hook is None:  # (taken off at the next scheduler step: not from inside the hooks' loop)
            self._weights_hook = innermost(self.optimizer).register_step_pre_hook(weak_method(self._after_load))

    def _after_load(self, *_: Any) -> None:
        """At the first optimizer step after a load: this replica's values as the load set them (:meth:`_expect_values`),
        then its weights (:meth:`expect_weights`)."""
        values, self._values_loaded = self._values_loaded, None
        if values is not None and not self._closed:
            lrs, hypers = values
            now = [as_float(lr) for lr in lrs_of(self.optimizer)]  # (HOST SYNC where an LR is a tensor, once)
            if now != lrs or [h.get() for h in self._hdet.hypers] != hypers:
                self.reapply()  # (the base schedule's value again: OneCycleLR reads max_lr from the groups loaded)
                for h, v in zip(self._hdet.hypers, hypers):
                    h.set(v)
        self._check_weights()

    def _check_weights(self) -> None:
        expected, self._weights_expected = self._weights_expected, None
        if expected is None:
            return
        now = self._hdet.weights_fingerprint()
        if now is not None and (math.isfinite(now) or math.isfinite(expected)) and \
                not math.isclose(now, expected, rel_tol=1e-9, abs_tol=1e-30):  # (non-finite both: saved so)
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else self.rank
            who = f"rank {rank}" if rank == self.rank else f"global rank {rank} (replica {self.rank})"  # (HSDP: a
            # replica's shard ranks; "rank 0's" on global rank 1 read as another rank's, an audit)
            warnings.warn(f"hdet: {who}'s weights at its first optimizer step after load_state_dict are not "
                          f"the ones saved with its scheduler state (weights' fingerprint {now:.10g} against "
                          f"{expected:.10g} saved), so the run does not go on from this replica as it was saved. "
                          "DistributedDataParallel(...) copies rank 0's weights to every rank when it is built: load "
                          "each rank's model state after wrapping the model (or build it with init_sync=False, "
                          "torch >= 2.5). Or the model's state was saved inside averaged() (the replicas' average: "
                          "the run goes on from there), or not loaded", stacklevel=user_stacklevel())

    def _unexpect_weights(self) -> None:
        """The weights' check taken off once it has run (at a scheduler step: the values' check too, the step sets
        them)."""
        self._values_loaded = None
        if self._weights_hook is not None and self._weights_expected is None:
            self._weights_hook.remove()
            self._weights_hook = None


def _say_warm_noise_lost(model: Any) -> None:
    """The first scheduler given a DDP module whose parameters :func:`hdet.warm_init_` perturbed and something wrote
    since says so: ``DistributedDataParallel(...)`` built after ``warm_init_`` broadcasts rank 0's weights, noise
    included, so every replica started equal and Eq. 10 did nothing, unsaid (an audit). Once: the versions are
    forgotten after the check (a later DDP over the trained module, or a later scheduler, is no broadcast of the
    noise)."""
    ddp = uncompiled(model) if model is not None else None
    if isinstance(ddp, torch.nn.parallel.DistributedDataParallel) and warm_noise_overwritten(ddp.module.parameters(),
                                                                                            forget=True):
        warnings.warn("hdet: warm_init_ perturbed this model's parameters before DistributedDataParallel(...) wrapped "
                      "it (or they were written since): DDP's constructor copies rank 0's weights, noise included, to "
                      "every rank, so the replicas start equal and Eq. 10's noise is lost. Call "
                      "hdet.warm_init_(model.module) after DDP(...) and after building the scheduler (README)",
                      stacklevel=user_stacklevel())


def _release(guard: GuardSetting, step_scale: Any) -> None:
    """A scheduler dropped unclosed (``weakref.finalize``, which may run inside a step or a forward: nothing is taken
    off a hook dict there): its guard's and step scale's hooks idle (a hook guard's comm hook goes on zeroing until
    the next scheduler on the model takes it over); its own hooks hold it weakly and do nothing now."""
    guard.orphan()
    if step_scale is not None:
        step_scale.active = False


_OPEN: "weakref.WeakKeyDictionary[torch.optim.Optimizer, weakref.WeakSet[HDETLR]]" = weakref.WeakKeyDictionary()


def _close_earlier(optimizer: torch.optim.Optimizer) -> bool:
    """A second scheduler on one optimizer (a notebook's cell run again): the earlier one, still open, is closed and
    said (both drove the optimizer's LRs, and their guards read its gradients twice: an audit)."""
    earlier = [s for s in _OPEN.get(innermost(optimizer), ()) if not s.closed]
    for s in earlier:
        warnings.warn(f"hdet: this optimizer already had an HDET scheduler, open at step {s.last_epoch} of "
                      f"{s.total_steps}: it was closed (its hooks taken off; a cell run again?). One scheduler per "
                      "optimizer", stacklevel=user_stacklevel())
        s.close()
    return bool(earlier)


class OneCycleAutoLR(HDETLR):
    """``OneCycleLR`` with HDET: an :class:`HDETLR` over a ``OneCycleLR`` base, under the reference's names.

    Args:
        optimizer, max_lr, total_steps, epochs, steps_per_epoch, pct_start, anneal_strategy, cycle_momentum,
            base_momentum, max_momentum, div_factor, final_div_factor, three_phase, last_epoch: ``OneCycleLR``'s.
        auto_lr_warmup_steps: [S_warm] the reference's default, 100000 (``HDETLR``'s is 0); with
            ``lr_range_test=True``, OneCycle's warm-up (``int(pct_start * total_steps)``) unless given (as this
            keyword or in ``config=``, 0 included).
        **kwargs: every other :class:`HDETLR` keyword and HDET option (``ensemble_lr_spread_ratio``,
            ``model_sync_interval``, ``enable_auto_lr``, ``model``, ``probe``, ``explore``, ...). Eq. 8's decay
            targets OneCycle's ``min_lr``; ``auto_lr_bounds`` defaults to ``(min_lr, 10 max_lr)`` per group.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, max_lr: float | list[float], total_steps: int | None = None,
                 epochs: int | None = None, steps_per_epoch: int | None = None, pct_start: float = 0.3,
                 anneal_strategy: str = "cos", cycle_momentum: bool = True, base_momentum: float | list[float] = 0.85,
                 max_momentum: float | list[float] = 0.95, div_factor: float = 25.0, final_div_factor: float = 1e4,
                 three_phase: bool = False, last_epoch: int = -1, *, auto_lr_warmup_steps: int | None = None,
                 **kwargs: Any) -> None:
        with _restored_on_failure(optimizer):  # (OneCycleLR rewrites the groups before hdet's checks)
            own_lr_tensors([optimizer])  # (before OneCycleLR writes its first values: one per group)
            kwargs["explore"] = _explored(kwargs.get("explore"))  # (a list: a generator read here was empty there)
            _check_cycled_beta1(cycle_momentum, kwargs["explore"])
            last_epoch = _last_epoch(last_epoch)
            total_steps, epochs, steps_per_epoch = (_as_int(x) for x in (total_steps, epochs, steps_per_epoch))
            for name, factor in (("div_factor", div_factor), ("final_div_factor", final_div_factor)):
                value = real_number(factor)  # (torch takes any: a negative one gives negative LRs, met only late on)
                if value is None or not (math.isfinite(value) and value > 0):
                    raise ValueError(f"Expected {name} as a finite number > 0, but got {factor!r}")
            for name, m in (("base_momentum", base_momentum), ("max_momentum", max_momentum)) if cycle_momentum else ():
                ms = [real_number(v) for v in (m if isinstance(m, (list, tuple)) else [m])]  # (torch takes any: beta1
                if not ms or not all(v is not None and 0 <= v < 1 for v in ms):  # 1.5 or -0.5 trained unsaid, 1.0
                    raise ValueError(f"Expected {name} in [0, 1) (or one such per param group), but got {m!r}")  # /0)
            steps = total_steps if total_steps is not None else (
                epochs * steps_per_epoch if isinstance(epochs, int) and isinstance(steps_per_epoch, int) else None)
            pct = real_number(pct_start)
            if isinstance(steps, int) and pct is not None and pct * steps == 1:  # (torch's OneCycleLR divides by the
                raise ValueError(f"Expected pct_start x total_steps ({steps}) to be other than one step (OneCycleLR "
                                 f"cannot build a warm-up of exactly one step), but got pct_start {pct_start!r}")
            base = OneCycleLR(optimizer, max_lr, total_steps=total_steps, epochs=epochs,
                              steps_per_epoch=steps_per_epoch, pct_start=pct_start, anneal_strategy=anneal_strategy,
                              cycle_momentum=cycle_momentum, base_momentum=base_momentum, max_momentum=max_momentum,
                              div_factor=div_factor, final_div_factor=final_div_factor, three_phase=three_phase,
                              last_epoch=last_epoch)
            self.div_factor, self.final_div_factor = float(div_factor), float(final_div_factor)
            config = kwargs.get("config")
            if auto_lr_warmup_steps is None and getattr(config, "auto_lr_warmup_steps", None) is None:
                # not given (as a keyword nor in config=): the range test runs during OneCycle's warm-up
                ranging = kwargs.get("lr_range_test", getattr(config, "lr_range_test", False))
                auto_lr_warmup_steps = int(float(pct_start) * base.total_steps) if ranging is True else 100_000
            if auto_lr_warmup_steps is not None:  # (else the config's stands)
                kwargs["auto_lr_warmup_steps"] = auto_lr_warmup_steps
            super().__init__(optimizer, base, base.total_steps, last_epoch=last_epoch, **kwargs)

    def _onecycle_factors(self) -> tuple[float, float]:
        return self.div_factor, self.final_div_factor


def _check_cycled_beta1(cycle_momentum: bool, explore: Sequence[Any]) -> None:
    """A base schedule that cycles the momentum (OneCycleLR's, CyclicLR's, also inside a ChainedScheduler or
    SequentialLR) writes beta1 at every step: an explored beta1 would be overwritten (or would drop the cycle) while
    the records show a spread."""
    if cycle_momentum and any(isinstance(h, AdamBeta) and h.index == 0 for h in explore):
        raise ValueError("Expected cycle_momentum=False when exploring beta1 (AdamBeta(index=0)): "
                         "the base schedule's momentum cycle (OneCycleLR, CyclicLR, also inside a ChainedScheduler or "
                         "SequentialLR) writes beta1 too")


@contextlib.contextmanager
def _restored_on_failure(optimizer: Any) -> Iterator[None]:
    """A constructor that fails leaves the optimizer's param groups as they were: OneCycleLR's own constructor (and
    LRScheduler's) rewrite ``lr``, ``initial_lr``, ``max_lr``, ``min_lr`` and the momentum before hdet's checks can
    fail, and a caller who fixes the argument and builds again would start from the rewritten LRs."""
    groups = getattr(optimizer, "param_groups", None)
    saved = [{k: (v.clone(), v) if isinstance(v, torch.Tensor) else v for k, v in g.items() if k != "params"}
             for g in groups] if isinstance(groups, list) and all(isinstance(g, dict) for g in groups) else None
    try:
        yield
    except BaseException:
        if saved is not None and len(groups) == len(saved):
            for g, kept in zip(groups, saved):
                for k in [k for k in g if k != "params" and k not in kept]:
                    del g[k]
                for k, v in kept.items():
                    if isinstance(v, tuple) and len(v) == 2 and isinstance(v[1], torch.Tensor):  # a tensor LR (fused,
                        copy, obj = v  # capturable): written in place by torch's step; its value back in place
                        with torch.no_grad():
                            obj.copy_(copy)
                        g[k] = obj
                    else:
                        g[k] = v
        raise


def _step_count_of(base: LRScheduler, default: int) -> int:
    """The steps a base schedule has taken: its ``last_epoch``, or a ``ChainedScheduler``'s (which keeps none) its
    schedules' when they agree; ``default`` when there is nothing to read."""
    if hasattr(base, "last_epoch"):
        return base.last_epoch
    counts = {getattr(b, "last_epoch", None) for b in getattr(base, "_schedulers", ())}
    return counts.pop() if len(counts) == 1 and None not in counts else default


def _check_one_cycle_length(base: LRScheduler | None, total_steps: int) -> None:
    """A ``OneCycleLR`` base of another length than ``total_steps``: shorter, torch raises when it is stepped past its
    end (after every replica's optimizer step of that step: an audit left replica 0 at the plain LR and the others at
    theirs); longer, the run ends before its cycle does (near its peak LR, silently)."""
    if type(base) is not OneCycleLR:
        return
    if base.total_steps < total_steps:
        raise ValueError(f"Expected the OneCycleLR base's total_steps ({base.total_steps}) to be the HDETLR's "
                         f"total_steps ({total_steps}): OneCycleLR cannot be stepped past its end. Build both with the "
                         "same total_steps")
    if base.total_steps > total_steps:
        warnings.warn(f"hdet: the OneCycleLR base's total_steps ({base.total_steps}) is more than the HDETLR's "
                      f"({total_steps}): the run ends before the cycle does, at its step {total_steps}'s LR, not at "
                      "the cycle's final LR. Build both with the same total_steps", stacklevel=user_stacklevel())


def _resolve_base(base: Any, optimizer: torch.optim.Optimizer) -> tuple[LRScheduler | None, Callable | None]:
    if isinstance(base, ReduceLROnPlateau):
        raise ValueError("Expected a base schedule of the step (an LRScheduler stepped once per optimizer step, or a "
                         "callable of the step), but got ReduceLROnPlateau, which steps on a validation metric; "
                         "HDET cannot wrap it (lr_scheduler_type='reduce_lr_on_plateau' in the Hugging Face Trainer "
                         "is the same)")
    if isinstance(base, LRScheduler):
        if base.optimizer is not optimizer:
            raise ValueError("Expected the base scheduler to be built on the same optimizer as HDETLR")
        return base, None
    if isinstance(base, type):  # (a class is callable: it was called with the step, and failed in its constructor)
        raise ValueError(f"Expected base to be an LRScheduler built on the optimizer (an instance), a callable of the "
                         f"step, or None, but got the class {base.__name__}: build it, e.g. {base.__name__}(optimizer, "
                         "...)")
    if callable(base):
        return None, base
    if base is not None:
        raise ValueError(f"Expected base to be an LRScheduler, a callable of the step, or None, but got "
                         f"{type(base).__name__}")
    return None, None


def _check_probe(config: HDETConfig, probe: Any, model: Any) -> None:
    if not config.probing:
        return
    if probe is None or not callable(probe):
        raise ValueError(
            "Expected probe=<function(model) -> scalar loss on a batch that is the same on every replica> for the "
            f"auto-LR controller 'fit' (the default), but got {probe!r}. Or pass controller='paper' for the paper's "
            "controller (see docs/auto-lr.md for what each does)")
    if model is None:
        raise ValueError("Expected model=<the module> with controller='fit': the probe evaluates it at the mean of "
                         "its iterates over the window")


def _own_lr_tensors(optimizer: torch.optim.Optimizer, base: Any, firsts: list[float] | None) -> None:
    """:func:`hdet.optimizers.own_lr_tensors` as a scheduler is built; a torch scheduler built by the user over groups
    that shared one LR tensor has already written its first values into it, one for all, so where its values for the
    groups (``firsts``: a ``LambdaLR``'s at its step, else its ``base_lrs``) differ, it is refused (the first step
    would have run every group at the last one's, a review). Called inside :func:`_restored_on_failure`, which puts the
    user's shared tensor back where it is refused."""
    if own_lr_tensors([optimizer]) and firsts is not None and len({f"{v:.6g}" for v in firsts}) > 1:
        raise ValueError(f"Expected one LR tensor per param group under {type(base).__name__}, whose LRs differ by "
                         f"group ({[float(f'{v:.6g}') for v in firsts]}), but the groups share one tensor (an "
                         "optimizer built with lr=torch.tensor(...) gives every group the same one): the base "
                         "scheduler wrote its first values into it, the last group's for all. Give each group its "
                         "own, e.g. [{'params': ..., 'lr': torch.tensor(0.1)}, ...], before building the base "
                         "scheduler")


def _set_lr(group: dict[str, Any], lr: float) -> None:
    """A param group's LR set to ``lr``: in place where it is a tensor (a compiled or capturable optimizer's)."""
    if isinstance(group["lr"], torch.Tensor):
        group["lr"].fill_(lr)
    else:
        group["lr"] = lr


def _say_rounded(hypers: list[Hyperparameter], wanted: list[float], got: list[float], rank: int,
                 spread: list[list[float]], first: Callable[[], bool] = lambda: True) -> None:
    """Before the first step: an explored value that reads back further from the value set than float32 rounding
    (a ``Setter`` into a bfloat16 buffer: 1.00333 held as 1.0, a third of the spread's step, an audit) is said once:
    the replica trains at what it holds, while its records and the controller use the value set. Only where it
    matters: off by more than 1% of the step to the nearest other replica's value (``spread``: each slot's values,
    replica by replica), or by more than 0.1% of the value where no other replica's differs (a float16 buffer's
    2.4e-4 beside a 50% step was said too: an audit). Read once, before the first step (later reads would be host
    syncs where a value lives in a device tensor). Said by the ``first`` replica of a process that has one to say:
    once for the one-process engine's N replicas, not N times."""
    def material(w: float, g: float, others: list[float]) -> bool:
        gaps = [abs(w - o) for o in others if o != w and math.isfinite(o)]
        return abs(g - w) > (0.01 * min(gaps) if gaps else 1e-3 * abs(w) + 1e-12)
    off = [(h.name, w, g) for h, w, g, vs in zip(hypers, wanted, got, spread)
           if math.isfinite(w) and math.isfinite(g) and not math.isclose(g, w, rel_tol=1e-6, abs_tol=1e-12)
           and material(w, g, vs)]
    if off and first():
        name, w, g = off[0]
        warnings.warn(f"hdet: the explored {name!r} on rank {rank} reads back as {g:.6g} right after hdet set it to "
                      f"{w:.6g} (a bfloat16 or float16 buffer, or its setter, rounds it?): this replica trains at "
                      f"{g:.6g}, while its records and the controller use the value set. Keep the value in a float32 "
                      "tensor (the forward can cast it), and set it as given", stacklevel=user_stacklevel())


def _last_lrs_on_host(base: LRScheduler, host: dict[str, Any] | None = None) -> list[Any]:
    """The base scheduler's last LRs, read without a host sync where that can be, over device tensor LRs (a capturable
    or compiled optimizer's; reading them back was one host sync a step, found on an H200: tests/gpu). A ``OneCycleLR``
    gives its closed form at its step, in floats (what its ``step()`` wrote into the tensors; its ``get_lr`` sets the
    cycled momentum to the same value again); a ``LambdaLR`` (Hugging Face's schedules) its base LRs times its lambdas
    at its step, and torch's step-function schedulers (``CosineAnnealingLR``, ``StepLR``, ``MultiStepLR``,
    ``LinearLR``, ``ConstantLR``, ``ExponentialLR``, ``PolynomialLR``; not a subclass) their closed form at their step,
    over the base LRs read from the device once (:func:`_host_base_lrs`). Others (``SequentialLR``,
    ``ChainedScheduler``, ``CyclicLR``, ``MultiplicativeLR``, ``CosineAnnealingWarmRestarts``, a subclass, or one of
    those seven whose closed form is not its step: :func:`_closed_form_is_its_step`) are read back: one host sync a
    step."""
    values = base.get_last_lr()
    if not any(isinstance(v, torch.Tensor) and v.device.type != "cpu" for v in values):
        return values
    if isinstance(base, OneCycleLR) and 0 <= base.last_epoch <= base.total_steps:
        with warnings.catch_warnings():  # (torch warns when get_lr runs outside step())
            warnings.simplefilter("ignore", UserWarning)
            values = base.get_lr()
    elif type(base) is LambdaLR and host is not None and base.last_epoch >= 0:
        values = [b * float(f(base.last_epoch)) for b, f in zip(_host_base_lrs(base, host), base.lr_lambdas)]
    elif _closed_form_is_its_step(base) and host is not None and base.last_epoch >= 0:
        shadow = copy.copy(base)  # (its closed form over the base LRs on the host: floats, what its recursive
        shadow.base_lrs = _host_base_lrs(base, host)  # step computed on the device, to rounding)
        values = shadow._get_closed_form_lr()
    return values


_CLOSED_FORM = tuple(c for c in (getattr(torch.optim.lr_scheduler, n, None) for n in (
    "StepLR", "MultiStepLR", "ConstantLR", "LinearLR", "ExponentialLR", "CosineAnnealingLR", "PolynomialLR"))
    if c is not None and hasattr(c, "_get_closed_form_lr"))  # torch's schedulers whose value is a function of the step


def _closed_form_is_its_step(base: LRScheduler) -> bool:
    """Whether ``base`` is one of torch's step-function schedulers (:data:`_CLOSED_FORM`, exact type) whose closed
    form gives what its recursive ``step()`` does: not with ``total_iters``, ``T_max`` or ``step_size`` <= 0 (the closed
    form divides by it, or a 0-step ``ConstantLR`` keeps its factor only in the recursive form: a review), nor with a
    negative milestone (counted by the closed form only)."""
    if type(base) not in _CLOSED_FORM:
        return False
    for name in ("total_iters", "T_max", "step_size"):
        value = getattr(base, name, None)
        if value is not None and not value > 0:
            return False
    return all(m >= 0 for m in getattr(base, "milestones", ()))


def _unalias_last_lrs(base: LRScheduler, optimizer: torch.optim.Optimizer) -> None:
    """After ``base.step()``: a torch that keeps a tensor LR itself as the scheduler's last LR (2.4's ``LRScheduler``
    does; 2.13's keeps a copy) gets a copy of it there, or HDET's in-place write of this replica's LR became the base's
    last LR, which a chainable base then stepped from: the spread compounded at every step (a review, simulating
    2.4). An identity check a step; a clone only on such a torch."""
    last = getattr(base, "_last_lr", None)
    if last and any(isinstance(v, torch.Tensor) and v is g["lr"] for v, g in zip(last, optimizer.param_groups)):
        base._last_lr = [v.clone() if isinstance(v, torch.Tensor) else v for v in last]


def _host_base_lrs(base: LRScheduler, host: dict[str, Any]) -> list[float]:
    """A base scheduler's base LRs as floats, read from the device once (HOST SYNC, once: they are constants) and
    kept in ``host`` by the tensors' identity, in-place version and storage (a load replaces them)."""
    kept = host.get("kept", [])
    versions = [(b._version, b.data_ptr()) if isinstance(b, torch.Tensor) else b for b in base.base_lrs]  # (the
    # storage too: ``.data = ...`` keeps the version; a write through ``.data`` in place is seen by neither)
    if len(kept) != len(base.base_lrs) or any(a is not b for a, b in zip(kept, base.base_lrs)) or \
            host["versions"] != versions:  # (the same tensors, unwritten since)
        host.update(kept=list(base.base_lrs), versions=versions, floats=[as_float(b) for b in base.base_lrs])
    return host["floats"]


def _explored(explore: Any) -> list[Any]:
    """``explore=`` as a list: one hdet hyperparameter, or a list (any iterable) of them (checked by
    ``check_explored``); a ValueError otherwise (a number or a dict gave Python's own "not iterable", or iterated the keys)."""
    if isinstance(explore, Hyperparameter):
        return [explore]
    if explore is None:
        return []
    if isinstance(explore, (str, bytes, dict, torch.Tensor)) or not hasattr(explore, "__iter__"):
        raise ValueError(f"Expected explore= to be an hdet hyperparameter or a list of them, but got "
                         f"{type(explore).__name__} {explore!r}")
    return list(explore)


def _last_epoch(last_epoch: Any) -> int:
    """``last_epoch`` as an int >= -1 (torch's own schedulers took a string and failed on a missing 'initial_lr')."""
    value = int_number(last_epoch)
    if value is None or value < -1:
        raise ValueError(f"Expected last_epoch to be an int >= -1 (-1: a new run), but got {last_epoch!r}")
    return value


def _as_int(x: Any) -> Any:
    """numpy integers (``numbers.Integral``) as Python ints; anything else unchanged (checked later)."""
    return int(x) if isinstance(x, numbers.Integral) and not isinstance(x, bool) else x


def _clip_arguments(max_norm: Any, norm_type: Any, foreach: Any) -> float:
    """Check :meth:`HDETLR.clip_grad_norm_`'s arguments (torch takes a negative or NaN ``max_norm``, which turns the
    step around or makes every gradient NaN, silently); returns ``norm_type`` as a float. A tensor ``max_norm`` is
    taken as it is (reading it would be a host sync every step)."""
    if isinstance(max_norm, torch.Tensor):
        if max_norm.dim() != 0 or not max_norm.is_floating_point():
            raise ValueError(f"Expected max_norm as a number >= 0 or a 0-d floating-point tensor, but got a tensor of "
                             f"shape {tuple(max_norm.shape)} and dtype {max_norm.dtype}")
    else:
        value = real_number(max_norm)
        if value is None or math.isnan(value) or value < 0:
            raise ValueError(f"Expected max_norm as a number >= 0 (inf: no clipping), but got {max_norm!r}")
    p = real_number(norm_type)
    if p is None and isinstance(norm_type, str) and norm_type.strip().lower() in ("inf", "+inf", "-inf"):
        p = float(norm_type)
    if p is None or math.isnan(p):
        raise ValueError(f"Expected norm_type as a number (inf for the max-norm), but got {norm_type!r}")
    if foreach is not None and not isinstance(foreach, bool):
        raise ValueError(f"Expected foreach as None, True or False, but got {foreach!r}")
    return p


def _is_pair(x: Any) -> bool:
    return isinstance(x, (tuple, list)) and len(x) == 2 and all(real_number(v) is not None for v in x)


_TORCH_FIRST_STEP = ("Seems like `optimizer.step()` has been overridden", "Detected call of `lr_scheduler.step()` before")


@contextlib.contextmanager
def _torch_first_step_checks(optimizer: torch.optim.Optimizer, first: bool) -> Iterator[None]:
    """At a scheduler's first step: torch's own checks of the call order, said once, at the caller's line (as
    OneCycleLR says them), not again by the base schedule and by ``LRScheduler.step`` from inside hdet."""
    if not first:
        yield
        return
    if not hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        warnings.warn("Seems like `optimizer.step()` has been overridden after learning rate scheduler initialization. "
                      "Please, make sure to call `optimizer.step()` before `lr_scheduler.step()`. See more details at "
                      "https://pytorch.org/docs/stable/optim.html#how-to-adjust-learning-rate", UserWarning,
                      stacklevel=user_stacklevel())
    elif not getattr(optimizer, "_opt_called", False):
        warnings.warn("Detected call of `lr_scheduler.step()` before `optimizer.step()`. In PyTorch 1.1.0 and later, you "
                      "should call them in the opposite order: `optimizer.step()` before `lr_scheduler.step()`.  Failure "
                      "to do this will result in PyTorch skipping the first value of the learning rate schedule. See "
                      "more details at https://pytorch.org/docs/stable/optim.html#how-to-adjust-learning-rate",
                      UserWarning, stacklevel=user_stacklevel())
    with warnings.catch_warnings():
        for text in _TORCH_FIRST_STEP:
            warnings.filterwarnings("ignore", message=re.escape(text))
        yield
