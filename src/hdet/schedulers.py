"""``OneCycleAutoLR`` (a drop-in for ``torch.optim.lr_scheduler.OneCycleLR``) and ``HDETLR``, the
general form around any base schedule. Both are thin: the method lives in :mod:`hdet.ensemble`.

Usage is the reference's: ``optimizer.step(); scheduler.step(loss)``. Step ``t`` (the number of
optimizer steps taken) is a sync step when ``t mod T == 0`` and at the last step.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler, OneCycleLR, ReduceLROnPlateau

from .controller import CONTROLLERS, FitController, PaperController, gamma_as_printed, gamma_decay
from torch.nn.parallel import DistributedDataParallel

from .ensemble import Ensemble, HDETConfig, SyncRecord
from .guard import SkipNonFiniteStep, SkipWatch, install_gradient_guard, resolve_guard
from .hyper import AdamBeta, Hyperparameter
from .optimizers import check_optimizer, innermost
from .replicas import DEFAULT_BUCKET_CAP_MB, Replicas, resolve_replicas

__all__ = ["OneCycleAutoLR", "HDETLR"]


def _float(x: float | torch.Tensor) -> float:
    return float(x) if not isinstance(x, torch.Tensor) else float(x.detach().cpu())


class _EnsembleScheduler(LRScheduler):
    """What OneCycleAutoLR and HDETLR share: ``step(loss)``, the sync step, ``get_lr`` = base x rho,
    and a state_dict that holds the ensemble's state and nothing unpicklable."""

    _hdet: Ensemble
    total_steps: int
    # live objects and this instance's own set-up: never saved, never overwritten by a load
    _STATE_EXCLUDE: tuple[str, ...] = ("optimizer", "_hdet", "skip_guard", "_skip_watch", "_fit_template",
                                       "gradient_guard", "_opt_hook", "_opt_steps", "_opt_steps_seen",
                                       "_warned_double_step", "_guard_setting")

    def _init_ensemble(self, optimizer: torch.optim.Optimizer, config: HDETConfig, model: nn.Module | None,
                       replicas: Replicas | None, rank: int | None, world_size: int | None,
                       process_group: Any, bucket_cap_mb: float, explore: Sequence[Hyperparameter] = (),
                       guard_gradients: bool | str = "auto", device_mesh: Any = None,
                       probe: Callable[[nn.Module], Any] | None = None) -> None:
        if isinstance(explore, Hyperparameter):
            explore = [explore]
        if config.auto_lr and config.controller == "fit":
            if probe is None or not callable(probe):
                raise ValueError(
                    "Expected probe=<function(model) -> scalar loss on a batch that is the same on every replica> for "
                    f"the auto-LR controller 'fit' (the default), but got {probe!r}. Or pass controller='paper' for the "
                    "paper's controller, which lowered the LR from every start in hdet's benchmarks (README, Auto-LR)")
            if model is None:
                raise ValueError("Expected model=<the module> with controller='fit': the probe evaluates it at the "
                                 "mean of its iterates over the window")
            if device_mesh is not None:
                raise ValueError("controller='fit' does not support device_mesh (sharded replicas) yet; use 'paper'")
        resolved = resolve_replicas(replicas, rank, world_size, process_group, bucket_cap_mb, device_mesh)
        self._hdet = Ensemble(config, resolved, optimizer, model, list(explore))
        spreading = config.alpha > 0 or any(h.spread.alpha > 0 for h in self._hdet.hypers)
        check_optimizer(optimizer, spreading, config.average_optimizer_state)  # LR-free optimizers: refused clearly
        self.gradient_guard: str | None = None  # the guard installed, if any: "hook", "skip" (hdet.guard)
        self.skip_guard: SkipNonFiniteStep | None = None
        self._skip_watch: SkipWatch | None = None  # early recovery when the skip guard stalls every replica
        self._guard_setting = (guard_gradients, process_group, device_mesh)
        resolve_guard(guard_gradients, optimizer, advise=False)  # a bad value fails here, not later
        self._install_guard(model)
        self._hdet.make_controller = self._make_controller
        self._hdet.probe = probe
        # optimizer steps counted by a post-hook (the real optimizer under wrappers): a second scheduler.step()
        # with none in between is what a prepared Accelerate scheduler does (num_processes calls per step)
        self._opt_steps = self._opt_steps_seen = 0
        self._opt_hook = innermost(optimizer).register_step_post_hook(self._count_optimizer_step)
        self._warned_double_step = False

    def _install_guard(self, model: nn.Module | None) -> None:
        """The gradient guard for ``model`` when its gradients are all-reduced (DDP with several replicas, or
        FSDP2/HSDP replicas); nothing otherwise."""
        guard_gradients, process_group, device_mesh = self._guard_setting
        N = self._hdet.replicas.world_size
        ddp = isinstance(model, DistributedDataParallel) and N > 1  # gradients all-reduced
        sharded = device_mesh is not None and N > 1  # FSDP2/HSDP with several replicas
        if self.gradient_guard is not None or not (ddp or sharded):
            return
        guard = resolve_guard(guard_gradients, self._hdet.optimizer, advise=ddp, mesh=sharded)
        if guard == "skip":
            # FSDP2/HSDP: ranks hold different shards, so they agree on the decision over the whole mesh
            mesh_groups = [device_mesh.get_group(i) for i in range(device_mesh.ndim)] if sharded else []
            self.skip_guard = SkipNonFiniteStep(self._hdet.optimizer, agree_over=mesh_groups)
            self._skip_watch = SkipWatch(self.skip_guard)
            self.gradient_guard = "skip"
        elif guard == "hook" and ddp and install_gradient_guard(model, process_group):
            self.gradient_guard = "hook"

    def attach_model(self, model: nn.Module) -> None:
        """Give the scheduler its model after construction, for frameworks that wrap the model later (the
        Hugging Face Trainer, Lightning): its floating-point buffers are averaged from now on (when no model
        was given) and, once it is the DDP-wrapped module, the gradient guard is installed. Call it on every
        replica, before the first step (integrations do)."""
        if not isinstance(model, nn.Module):
            raise ValueError(f"Expected a torch.nn.Module, but got {type(model).__name__}")
        if self._hdet.model is None:
            self._hdet.model = model
        self._install_guard(model)

    def _count_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._opt_steps += 1

    def _check_optimizer_stepped(self) -> None:
        if self._opt_steps == self._opt_steps_seen and not self._warned_double_step:
            self._warned_double_step = True
            warnings.warn(
                "hdet: scheduler.step() was called with no optimizer.step() since the previous call. HDET counts "
                "optimizer steps: its converge steps and schedule now run ahead of training. Causes: a scheduler "
                "passed to accelerator.prepare() (stepped num_processes times per optimizer step: do not prepare "
                "it), or a step skipped by GradScaler (then skip scheduler.step() too)", stacklevel=3)
        self._opt_steps_seen = self._opt_steps

    # -- the schedule underneath ------------------------------------------------------------
    def _scheduled_bases(self) -> list[float]:
        """The base schedule's value of every param group at step ``self.last_epoch``."""
        raise NotImplementedError

    def _final_bases(self) -> list[float] | None:
        """The base schedule's last value per group, the target of Eq. 8's decay; None if unknown."""
        return None

    def _default_bounds(self, j: int, start: float) -> tuple[float, float]:
        return (0.0, math.inf)

    def _gamma_as_printed(self, K: float) -> float:
        raise ValueError("eq8='as_printed' needs OneCycle's div_factor and final_div_factor; use OneCycleAutoLR")

    _fit_template: FitController | None = None

    @staticmethod
    def _controller_kind(controller: Any) -> tuple[str, FitController | None]:
        """``controller``: "paper", "fit", or a FitController whose settings every slot copies."""
        if isinstance(controller, FitController):
            return "fit", controller
        if controller not in CONTROLLERS:
            raise ValueError(f"Expected controller in {CONTROLLERS} or a hdet.FitController, but got {controller!r}")
        return controller, None

    def _make_controller(self, j: int, start: float) -> PaperController | FitController:
        c = self._hdet.config
        if c.controller == "fit":
            t = self._fit_template
            return FitController() if t is None else dataclasses.replace(t, c=0.0, m=0.0, updates=0)
        K = self._hdet.num_control_syncs
        if c.eq8 == "as_printed":
            gamma = self._gamma_as_printed(K)
        else:
            finals = self._final_bases()
            gamma = 0.0 if finals is None else gamma_decay(start, finals[j], K)
        bounds = self._auto_lr_bounds[j] if self._auto_lr_bounds is not None else self._default_bounds(j, start)
        return PaperController(beta=c.beta, sigma=c.sigma, lam=c.lam, gamma=gamma, bounds=bounds)

    _auto_lr_bounds: list[tuple[float, float]] | None = None

    def _set_bounds(self, bounds: tuple[float, float] | Sequence[tuple[float, float]] | None) -> None:
        if bounds is None:
            self._auto_lr_bounds = None
            return
        n = len(self.optimizer.param_groups)
        per_group = [bounds] * n if _is_pair(bounds) else list(bounds)  # type: ignore[list-item]
        if len(per_group) != n or not all(_is_pair(b) and 0 <= b[0] <= b[1] for b in per_group):
            raise ValueError(
                f"Expected auto_lr_bounds as (low, high) with 0 <= low <= high, or one such pair per param "
                f"group ({n}), but got {bounds!r}"
            )
        self._auto_lr_bounds = [(float(lo), float(hi)) for lo, hi in per_group]  # type: ignore[misc]

    # -- LRScheduler -------------------------------------------------------------------------
    def get_lr(self) -> list[float]:  # type: ignore[override]
        """This replica's LR per group (Eqs. 1, 9); also sets every explored hyperparameter's value."""
        ens = self._hdet
        bases = [_float(b) for b in self._scheduled_bases()] + [h.base(self.last_epoch) for h in ens.hypers]
        values = ens.values(bases)
        for h, v in zip(ens.hypers, values[ens.num_lr_slots:]):
            h.set(v)
        history = getattr(self, "_history", None)
        if history is not None:  # the base of every slot in effect for step last_epoch + 1
            history[str(self.last_epoch)] = list(ens.current_bases)
        return values[: ens.num_lr_slots]

    def reapply(self) -> None:
        """Set this replica's current values on the optimizer (and explored hyperparameters) again. For
        frameworks that restore one rank's optimizer state on every rank (the Hugging Face Trainer saves
        rank 0's), which would otherwise give every replica rank 0's learning rate until the next step."""
        with warnings.catch_warnings():  # torch warns when get_lr runs outside step()
            warnings.simplefilter("ignore", UserWarning)
            values = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, values):
            group["lr"] = lr
        self._last_lr = values

    def record_schedule(self) -> "_EnsembleScheduler":
        """Remember, from now on, every step's base value per explored slot (see :mod:`hdet.replay`).
        The record is part of the state_dict, so a resumed run keeps it."""
        if getattr(self, "_history", None) is None:
            self._history: dict[str, list[float]] | None = {str(self.last_epoch): list(self._hdet.current_bases)}
        return self

    def discovered_schedule(self) -> dict[str, Any]:
        """The recorded bases as plain data: ``{"names": [...], "bases": [[per slot] per step]}``, step 0
        first (what :class:`hdet.ReplayLR` plays back)."""
        history = getattr(self, "_history", None)
        if not history:
            raise ValueError("Expected sched.record_schedule() to have been called before training, but nothing "
                             "was recorded")
        steps = sorted(int(k) for k in history)
        if steps != list(range(steps[0], steps[-1] + 1)) or steps[0] != 0:
            raise ValueError(f"Expected a record from step 0 without gaps, but it covers steps {steps[0]}..{steps[-1]}"
                             f" with {len(steps)} entries (call record_schedule() before the first step)")
        return {"names": list(self._hdet.names), "bases": [history[str(t)] for t in steps]}

    def step(self, loss: torch.Tensor | float | None = None) -> None:  # type: ignore[override]
        """Call after ``optimizer.step()``, with that step's training loss (needed by auto-LR).

        Off a sync step this only accumulates the loss on its device (no host sync). On a sync
        step every replica must call it: it runs the collectives of :meth:`Ensemble.sync`."""
        if loss is not None:
            self._hdet.observe(loss)
        t = self.last_epoch + 1  # optimizer steps taken so far
        initial = getattr(self, "_step_count", 0) == 0  # the base constructor's own first step()
        if not initial:
            if t > self.total_steps:
                raise ValueError(
                    f"Expected at most total_steps={self.total_steps} calls of scheduler.step() after "
                    f"optimizer steps, but this is call {t}; raise total_steps or stop stepping"
                )
            self._check_optimizer_stepped()
            self._before_step(t)
            self._hdet.accumulate()  # the fit controller's window mean (no-op otherwise)
            stalled = self._skip_watch is not None and self._skip_watch.poll(t)  # every 10 steps: a lagged read
            if self._hdet.is_sync_step(t):
                self._hdet.sync(t)
                if self._skip_watch is not None:
                    self._skip_watch.reset()
            elif stalled:  # every step of a stretch skipped on every replica: reset the bad replica now
                if not self._hdet.recover(t):
                    warnings.warn(f"hdet: the gradient guard skipped every step of the last {self._skip_watch.every} "
                                  "(at least) on every replica, but every replica's weights are finite: the loss or "
                                  "gradients are non-finite for another reason (data, loss scale, learning rate)",
                                  stacklevel=2)
                self._skip_watch.reset()
        super().step()
        self._hdet.step_done()

    def _before_step(self, t: int) -> None:
        return None

    # -- conveniences ----------------------------------------------------------------------
    @property
    def multipliers(self) -> list[float]:
        """This replica's current multiplier per param group."""
        return [self._hdet.multiplier(j) for j in range(self._hdet.num_lr_slots)]

    @property
    def base_lrs_now(self) -> list[float]:
        """The base (pre-multiplier) learning rate per group in effect for the next step."""
        return list(self._hdet.current_bases[: self._hdet.num_lr_slots])

    @property
    def hyperparameters(self) -> dict[str, float]:
        """This replica's current value of every explored hyperparameter other than the LR."""
        return {h.name: h.get() for h in self._hdet.hypers}

    @property
    def rank(self) -> int:
        return self._hdet.replicas.rank

    @property
    def world_size(self) -> int:
        return self._hdet.replicas.world_size

    @property
    def last_sync(self) -> SyncRecord | None:
        return self._hdet.last_sync

    @property
    def ensemble(self) -> Ensemble:
        return self._hdet

    def is_sync_step(self, t: int | None = None) -> bool:
        """Whether optimizer step ``t`` (default: the last one taken) was a sync step."""
        return self._hdet.is_sync_step(self.last_epoch if t is None else t)

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain data only (numbers, strings, lists, dicts, CPU tensors), so ``torch.load(weights_only=True)``
        reads it: the scheduler's counters and last LRs (the keys torch's scheduler has, so an
        ``OneCycleAutoLR`` state also loads into ``OneCycleLR``), and under ``"hdet"`` the ensemble's
        versioned state. Live objects (the optimizer, the guard, a controller template, callables) stay out."""
        state = {k: v for k, v in self.__dict__.items() if k not in self._STATE_EXCLUDE}
        state["hdet"] = self._hdet.state_dict()
        state["hdet"]["scheduler"] = type(self).__name__
        state["hdet"]["hyper_values"] = [h.get() for h in self._hdet.hypers]  # restored exactly on load
        _check_plain(state, "state_dict()")
        return state

    def _check_own_state(self, state: dict[str, Any]) -> None:
        """The scheduler's own fields, before anything is set."""
        kind = state["hdet"].get("scheduler") if isinstance(state["hdet"], dict) else None
        if kind is None:  # states saved before the field: tell the two apart by their own keys
            kind = "HDETLR" if "_constant" in state else "OneCycleAutoLR" if "_schedule_phases" in state else None
        if kind is not None and kind != type(self).__name__:
            raise ValueError(f"Expected a {type(self).__name__} state_dict, but got one saved by {kind}")
        n = len(self.optimizer.param_groups)
        last = state.get("last_epoch")
        if isinstance(last, bool) or not isinstance(last, int) or last < -1:
            raise ValueError(f"Expected the state's last_epoch as an integer >= -1, but got {last!r}")
        total = state.get("total_steps", self.total_steps)
        if isinstance(total, bool) or not isinstance(total, int) or last > total:
            raise ValueError(f"Expected the state's total_steps as an integer >= last_epoch ({last}), but got {total!r}")
        for key in ("_last_lr", "base_lrs"):
            v = state.get(key)
            if v is not None and (not isinstance(v, list) or len(v) != n):
                raise ValueError(f"Expected the state's {key} with one value per param group ({n}), but got {v!r}")

    def check_state_dict(self, state_dict: Any) -> dict[str, Any]:
        """Check a state completely, change nothing (ValueError on any problem); returns the parsed ensemble
        state that :meth:`load_state_dict` sets."""
        if not isinstance(state_dict, dict) or "hdet" not in state_dict:
            keys = sorted(state_dict)[:8] if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(f"Expected a {type(self).__name__} state_dict (with an 'hdet' entry), but got {keys}")
        self._check_own_state(state_dict)
        parsed = self._hdet.check_state(state_dict["hdet"])
        self._check_extra_state(state_dict)
        return parsed

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict`. Everything is checked before anything is set: a foreign,
        corrupted or newer state raises ValueError and leaves the scheduler as it was. Then this replica's own
        values are set on the optimizer (:meth:`reapply`): a state saved by another rank (e.g. rank 0's,
        loaded on every rank) never gives this replica another replica's learning rate."""
        parsed = self.check_state_dict(state_dict)
        state = {k: v for k, v in state_dict.items() if k not in self._STATE_EXCLUDE + ("hdet", "base", "base_scheduler")}
        hdet_state = state_dict["hdet"]
        same_replica = not parsed["elastic"] and hdet_state["rank"] == self.rank
        self._hdet.commit_state(parsed, hdet_state)
        self.__dict__.update(state)
        self._load_extra_state(state_dict)
        self.reapply()  # this replica's values on the optimizer and hyperparameters
        if same_replica:  # exactly the values this replica had (they equal what reapply computed)
            for h, v in zip(self._hdet.hypers, hdet_state.get("hyper_values", [])):
                h.set(v)

    def _check_extra_state(self, state_dict: dict[str, Any]) -> None:
        return None

    def _load_extra_state(self, state_dict: dict[str, Any]) -> None:
        return None


def _check_plain(x: Any, where: str) -> None:
    """A state must be plain data: what ``torch.load(weights_only=True)`` reads back."""
    if x is None or isinstance(x, (bool, int, float, str, torch.Tensor, torch.dtype, torch.device)):
        return
    if isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            _check_plain(v, f"{where}[{i}]")
        return
    if isinstance(x, dict):
        for k, v in x.items():
            _check_plain(v, f"{where}[{k!r}]")
        return
    raise TypeError(f"hdet bug: {where} holds a {type(x).__name__}, which is not plain data")


def _as_int(x: Any) -> Any:
    """numpy integers (``numbers.Integral``) as Python ints; anything else unchanged (checked later)."""
    return int(x) if isinstance(x, numbers.Integral) and not isinstance(x, bool) else x


def _is_pair(x: Any) -> bool:
    return isinstance(x, (tuple, list)) and len(x) == 2 and all(isinstance(v, (int, float)) for v in x)


class OneCycleAutoLR(_EnsembleScheduler, OneCycleLR):
    """OneCycleLR with HDET: per-replica LR spread, weight averaging every T steps, optional auto-LR.

    Takes every ``OneCycleLR`` argument and the reference implementation's extra arguments under the
    same names (paper symbols in brackets):

    * ``ensemble_lr_spread_ratio`` [alpha], in [0, 1): replica r's LR is ``OneCycle(t) * rho_r`` (Eq. 1).
    * ``model_sync_interval`` [T]: average weights (and float buffers of ``model``) every T steps (Eq. 3).
    * ``enable_auto_lr``, ``auto_lr_warmup_steps`` [S_warm], ``loss_scale`` [sigma], ``lr_of_lr``
      [lambda], ``momentum_of_lr`` [beta]: the auto-LR controller (Eqs. 4-9).
    * ``rank``, ``world_size``: checked against the process group when one is initialised.

    hdet's own keyword arguments: ``model`` (whose floating-point buffers are averaged too), ``eq8``
    ("decay": gamma takes the base from its value when auto-LR starts to OneCycle's ``min_lr``;
    "as_printed": the paper's formula, which grows the LR), ``auto_lr_bounds`` (default: per group
    ``(min_lr, 10 * max_lr)``), ``seed`` (of the permutation generator; identical on all ranks),
    ``average_optimizer_state``, ``process_group``, ``replicas``, ``bucket_cap_mb``, ``explore`` (extra
    hyperparameters to spread and control, :mod:`hdet.hyper`), ``on_nonfinite`` ("recover": a replica
    with a non-finite window loss or weights is left out of the converge step and reset to the others'
    mean; "raise": stop with NonFiniteReplicaError), ``guard_gradients`` (when ``model`` is a DDP module,
    or with ``device_mesh``, keep one replica's NaN gradient from reaching the others' weights: "skip"
    skips the step on every replica on the device, for fused optimizers; "hook" averages only the finite
    contributions in a DDP comm hook, slower, DDP only; "auto" (default) picks "skip" when the optimizer is
    fused; False: none; :mod:`hdet.guard`),
    ``device_mesh`` (FSDP2/HSDP: a (replicate, shard) mesh; HDET replicas are the replicate dimension,
    weights are averaged over it on local shards, a replica's loss is the mean over its shard ranks),
    ``controller`` ("fit", the default, or a :class:`hdet.FitController` with other settings: hdet's controller, a bounded multiplicative
    correction of the schedule from a probe loss at each replica's mean iterate, see
    :mod:`hdet.controller`; "paper": Eqs. 4-8 on the window's training losses, replacing the schedule;
    see the README's "Auto-LR" for what each does on real tasks), ``probe`` (with "fit": ``probe(model) -> scalar loss`` on a batch that every
    replica sees, e.g. a few training batches from a generator seeded identically on every rank; it is
    called once per replica at each control sync, in eval mode, under no_grad), ``tie_lr_groups`` (one
    multiplier per replica for all its param groups, one permutation: the controller then sees the LR
    scale alone, not each group's LR through the others' noise).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        max_lr: float | list[float],
        total_steps: int | None = None,
        epochs: int | None = None,
        steps_per_epoch: int | None = None,
        pct_start: float = 0.3,
        anneal_strategy: str = "cos",
        cycle_momentum: bool = True,
        base_momentum: float | list[float] = 0.85,
        max_momentum: float | list[float] = 0.95,
        div_factor: float = 25.0,
        final_div_factor: float = 1e4,
        three_phase: bool = False,
        last_epoch: int = -1,
        *,
        ensemble_lr_spread_ratio: float = 0.0,
        model_sync_interval: int = 1000,
        auto_lr_warmup_steps: int = 100_000,
        enable_auto_lr: bool = False,
        loss_scale: float = 0.1,
        lr_of_lr: float = 0.5,
        momentum_of_lr: float = 0.9,
        rank: int | None = None,
        world_size: int | None = None,
        model: nn.Module | None = None,
        eq8: str = "decay",
        auto_lr_bounds: tuple[float, float] | Sequence[tuple[float, float]] | None = None,
        seed: int = 0,
        average_optimizer_state: bool = False,
        process_group: Any = None,
        replicas: Replicas | None = None,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        explore: Sequence[Hyperparameter] = (),
        on_nonfinite: str = "recover",
        guard_gradients: bool | str = "auto",
        device_mesh: Any = None,
        controller: str | FitController = "fit",
        probe: Callable[[nn.Module], Any] | None = None,
        tie_lr_groups: bool = False,
    ) -> None:
        kind, self._fit_template = self._controller_kind(controller)
        total_steps, epochs, steps_per_epoch = (_as_int(x) for x in (total_steps, epochs, steps_per_epoch))
        config = HDETConfig(
            alpha=ensemble_lr_spread_ratio, sync_interval=model_sync_interval, auto_lr=enable_auto_lr,
            auto_lr_warmup_steps=auto_lr_warmup_steps, sigma=loss_scale, lam=lr_of_lr, beta=momentum_of_lr,
            eq8=eq8, seed=seed, average_optimizer_state=average_optimizer_state, on_nonfinite=on_nonfinite,
            controller=kind, tie_lr_groups=tie_lr_groups,
        )
        if cycle_momentum and any(isinstance(h, AdamBeta) and h.index == 0 for h in
                                  ([explore] if isinstance(explore, Hyperparameter) else explore)):
            raise ValueError("Expected cycle_momentum=False when exploring beta1 (AdamBeta(index=0)): "
                             "OneCycleLR's momentum cycle would overwrite it")
        # Attributes first: OneCycleLR.__init__ already calls self.step().
        self.div_factor = float(div_factor)
        self.final_div_factor = float(final_div_factor)
        self._init_ensemble(optimizer, config, model, replicas, rank, world_size, process_group, bucket_cap_mb,
                            explore, guard_gradients, device_mesh, probe)
        self.total_steps = 0  # set for real by OneCycleLR.__init__ before its first step
        self.optimizer = optimizer
        self._set_bounds(auto_lr_bounds)
        super().__init__(
            optimizer, max_lr, total_steps=total_steps, epochs=epochs, steps_per_epoch=steps_per_epoch,
            pct_start=pct_start, anneal_strategy=anneal_strategy, cycle_momentum=cycle_momentum,
            base_momentum=base_momentum, max_momentum=max_momentum, div_factor=div_factor,
            final_div_factor=final_div_factor, three_phase=three_phase, last_epoch=last_epoch,
        )
        self._hdet.set_total_steps(self.total_steps)

    def _scheduled_bases(self) -> list[float]:
        return OneCycleLR.get_lr(self)  # type: ignore[return-value]  # also cycles momentum

    def _final_bases(self) -> list[float]:
        return [_float(g["min_lr"]) for g in self.optimizer.param_groups]

    def _default_bounds(self, j: int, start: float) -> tuple[float, float]:
        g = self.optimizer.param_groups[j]
        return (_float(g["min_lr"]), 10.0 * _float(g["max_lr"]))

    def _gamma_as_printed(self, K: float) -> float:
        return gamma_as_printed(self.div_factor, self.final_div_factor, K)  # Eq. 8 as printed


BaseSchedule = LRScheduler | Callable[[int], "float | Sequence[float]"] | None


class HDETLR(_EnsembleScheduler):
    """HDET around any base schedule.

    ``base`` is an ``LRScheduler`` built on the same optimizer (stepped by this scheduler: do not
    step it yourself), or a callable ``step -> lr`` (one float for all groups or one per group), or
    None for the groups' constant learning rates. Each param group's LR is explored separately,
    with its own permutation (paper section 3.4). Remaining arguments are OneCycleAutoLR's.
    ``final_lr`` (per group, or one float) is the target of Eq. 8's decay once auto-LR starts; for a
    callable base it defaults to ``base(total_steps)``, otherwise to no decay (gamma = 0).
    """

    _STATE_EXCLUDE = _EnsembleScheduler._STATE_EXCLUDE + ("_base", "_base_fn")

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        base: BaseSchedule,
        total_steps: int,
        *,
        ensemble_lr_spread_ratio: float = 0.0,
        model_sync_interval: int = 1000,
        auto_lr_warmup_steps: int = 0,
        enable_auto_lr: bool = False,
        loss_scale: float = 0.1,
        lr_of_lr: float = 0.5,
        momentum_of_lr: float = 0.9,
        final_lr: float | Sequence[float] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        model: nn.Module | None = None,
        auto_lr_bounds: tuple[float, float] | Sequence[tuple[float, float]] | None = None,
        seed: int = 0,
        average_optimizer_state: bool = False,
        process_group: Any = None,
        replicas: Replicas | None = None,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        last_epoch: int = -1,
        explore: Sequence[Hyperparameter] = (),
        on_nonfinite: str = "recover",
        guard_gradients: bool | str = "auto",
        device_mesh: Any = None,
        controller: str | FitController = "fit",
        probe: Callable[[nn.Module], Any] | None = None,
        tie_lr_groups: bool = False,
    ) -> None:
        total_steps = _as_int(total_steps)
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps <= 0:
            raise ValueError(f"Expected positive integer total_steps, but got {total_steps!r}")
        self._base: LRScheduler | None = None
        self._base_fn: Callable[[int], Any] | None = None
        if isinstance(base, ReduceLROnPlateau):
            raise ValueError("Expected a base schedule of the step (an LRScheduler stepped once per optimizer step, or a "
                             "callable of the step), but got ReduceLROnPlateau, which steps on a validation metric; "
                             "HDET cannot wrap it (lr_scheduler_type='reduce_lr_on_plateau' in the Hugging Face Trainer "
                             "is the same)")
        if isinstance(base, LRScheduler):
            if base.optimizer is not optimizer:
                raise ValueError("Expected the base scheduler to be built on the same optimizer as HDETLR")
            self._base = base
        elif callable(base):
            self._base_fn = base
        elif base is not None:
            raise ValueError(
                f"Expected base to be an LRScheduler, a callable of the step, or None, but got {type(base).__name__}"
            )
        kind, self._fit_template = self._controller_kind(controller)
        config = HDETConfig(
            alpha=ensemble_lr_spread_ratio, sync_interval=model_sync_interval, auto_lr=enable_auto_lr,
            auto_lr_warmup_steps=auto_lr_warmup_steps, sigma=loss_scale, lam=lr_of_lr, beta=momentum_of_lr,
            eq8="decay", seed=seed, average_optimizer_state=average_optimizer_state, on_nonfinite=on_nonfinite,
            controller=kind, tie_lr_groups=tie_lr_groups,
        )
        self.total_steps = total_steps
        self.optimizer = optimizer
        self._init_ensemble(optimizer, config, model, replicas, rank, world_size, process_group, bucket_cap_mb,
                            explore, guard_gradients, device_mesh, probe)
        self._hdet.set_total_steps(total_steps)
        self._constant = [_float(g["lr"]) for g in optimizer.param_groups]
        self._final = self._resolve_final(final_lr)
        self._set_bounds(auto_lr_bounds)
        super().__init__(optimizer, last_epoch)

    def _per_group(self, value: Any, what: str) -> list[float]:
        n = len(self.optimizer.param_groups)
        if isinstance(value, (int, float, torch.Tensor)) and not isinstance(value, bool):
            return [_float(value)] * n
        values = list(value)
        if len(values) != n:
            raise ValueError(f"Expected {what} as one float or {n} floats (one per param group), but got {value!r}")
        return [_float(v) for v in values]

    def _resolve_final(self, final_lr: Any) -> list[float] | None:
        if final_lr is not None:
            return self._per_group(final_lr, "final_lr")
        if self._base_fn is not None:
            return self._per_group(self._base_fn(self.total_steps), "base(step)")
        return None

    def _before_step(self, t: int) -> None:
        if self._base is not None:
            # Chainable schedulers compute from group['lr']: give them the base, not base * rho.
            for g, b in zip(self.optimizer.param_groups, self._hdet.current_bases):
                g["lr"] = b if not isinstance(g["lr"], torch.Tensor) else g["lr"].fill_(b)
            self._base.step()

    def _scheduled_bases(self) -> list[float]:
        if self._base is not None:
            return [_float(x) for x in self._base.get_last_lr()]
        if self._base_fn is not None:
            return self._per_group(self._base_fn(self.last_epoch), "base(step)")
        return list(self._constant)

    def _final_bases(self) -> list[float] | None:
        return self._final

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self._base is not None:
            state["base"] = self._base.state_dict()
            state["base_scheduler"] = type(self._base).__name__
            _check_plain(state["base"], "the base scheduler's state_dict()")
        return state

    def _check_extra_state(self, state_dict: dict[str, Any]) -> None:
        base_state = state_dict.get("base")
        if self._base is None:
            if base_state is not None:
                raise ValueError(f"Expected a state of an HDETLR without a base scheduler, but this one was saved with "
                                 f"a {state_dict.get('base_scheduler', 'base scheduler')}")
            return
        kind, want = state_dict.get("base_scheduler"), type(self._base).__name__
        if not isinstance(base_state, dict):
            raise ValueError(f"Expected the state of a {want} base, but the state holds {base_state!r}")
        if kind is not None and kind != want:
            raise ValueError(f"Expected the state of a {want} base, but the state holds a {kind}'s")
        public = {k for k in self._base.state_dict() if not k.startswith("_")}  # private keys vary with torch
        got = {k for k in base_state if not k.startswith("_")}
        if got != public:
            raise ValueError(f"Expected the state of a {want} base, but its keys differ: missing "
                             f"{sorted(public - got)}, unexpected {sorted(got - public)}")

    def _load_extra_state(self, state_dict: dict[str, Any]) -> None:
        if self._base is not None:
            self._base.load_state_dict(state_dict["base"])
