"""How a scheduler is driven, checked at each of its steps (:class:`StepWatch`).

HDET counts optimizer steps through its scheduler: a schedule stepped twice per optimizer step, a loss that is really an
epoch counter, an LR that something else wrote between two steps, an optimizer that caps its own LR, or torch's
``join()`` around the training steps each trained the replicas at other values than the records show, with no error.
:class:`hdet.HDETLR` keeps one watch and asks it at every step; each finding is said once, as a warning (or refused,
where training on would be wrong). None of these checks reads a device tensor (no host sync).
"""

from __future__ import annotations

import math
import warnings
import weakref
from typing import Any

import torch

from .caller import user_stacklevel
from .guard import uncompiled
from .loss_scale import LossScale
from .optimizers import check_shared_gradients, innermost
from .values import as_float

__all__ = ["StepWatch", "lr_marks", "lrs_of"]

_ADAFACTOR = getattr(torch.optim, "Adafactor", None)  # (torch >= 2.5)


class StepWatch:
    """One scheduler's checks of how it is driven, and what they keep between its steps.

    ``loss_scale``: the scheduler's :class:`hdet.loss_scale.LossScale` (a GradScaler that drives the optimizer skips
    optimizer steps on purpose: a scheduler step without one is then no misuse)."""

    def __init__(self, loss_scale: LossScale) -> None:
        self.loss_scale = loss_scale
        # optimizer steps counted by a post-hook (the real optimizer under wrappers): a second scheduler.step() with
        # none in between is what a prepared Accelerate scheduler does (num_processes calls per step)
        self.opt_steps = self.opt_steps_seen = 0
        self.unmatched = 0  # scheduler steps with no optimizer step (a GradScaler's skips, or a prepared scheduler)
        self.first_unmatched = 0  # (the scheduler step where the first of them was seen)
        self.scaler_idle = False  # an unmatched scheduler.step() came with no GradScaler update since the one before
        self.scale_version: int | None = None  # the GradScaler scale's in-place version at the last scheduler.step()
        self.warned_double_step = self.warned_missed_step = self.warned_epoch = self.checked_local = False
        self.first_floats: list[float] | None = []  # the first losses given as numbers (an epoch counter?)
        self.warned_cap = False  # (Adafactor's cap on its LR, said once: check_capped_lr)
        self.lr_marks: list[Any] | None = None  # each group's LR as the scheduler left it (check_lrs_kept)
        self.warned_lr_written = False
        self._plain: Any = None  # the model last found to be no DDP module (check_join has nothing to do for it)
        self._ddp: tuple[Any, Any] | None = None  # (the DDP model check_join has seen, its DDP module)
        self._adafactor: tuple[Any, Any] | None = None  # (the optimizer, the torch Adafactor inside it, or None)

    # -- optimizer steps against scheduler steps -------------------------------------------------------------
    def optimizer_stepped(self) -> None:
        """The optimizer's step post-hook: one optimizer step taken."""
        self.opt_steps += 1
        if self.unmatched or self.opt_steps <= 100:  # a GradScaler? (its first steps, and after an unmatched one)
            self.loss_scale.look()

    @property
    def stepped_since(self) -> bool:
        """Whether an optimizer step ran since the scheduler's last step."""
        return self.opt_steps != self.opt_steps_seen

    def resumed(self) -> None:
        """A state was loaded: optimizer steps count from here (torch.distributed.checkpoint's ``set_state_dict``
        steps a fresh optimizer once at lr 0 to make its state, which read as a missed step, a review)."""
        self.opt_steps_seen = self.opt_steps

    def check_stepped(self, step_count: int, last_epoch: int, local: bool, optimizer: torch.optim.Optimizer,
                      average_optimizer_state: bool) -> None:
        """At each scheduler step: one optimizer step since the last one, or said once why not. ``local``: the
        replicas share no gradients (each replica's own optimizer state is then checked once)."""
        scale = getattr(self.loss_scale.scaler, "_scale", None)
        version = scale._version if isinstance(scale, torch.Tensor) else None  # update() writes the scale in place
        if self.opt_steps == self.opt_steps_seen and step_count > 1:
            # (at the first step torch's own check says it: _torch_first_step_checks)
            self.unmatched += 1  # said at the next optimizer step, unless a GradScaler drives it (then it skipped)
            if self.unmatched == 1:
                self.first_unmatched = last_epoch
            if version is not None and version == self.scale_version:  # a step the scaler skipped still runs its
                self.scaler_idle = True  # update(): none since the scheduler step before, so no skipped step
        elif self.unmatched and not self.warned_double_step and (self.loss_scale.scaler is None or self.scaler_idle):
            self.warned_double_step = True
            warnings.warn(
                "hdet: scheduler.step() was called with no optimizer.step() since the previous call (first at the "
                f"step() call that took last_epoch from {self.first_unmatched}): HDET counts optimizer steps, so its "
                "converge steps and schedule now run ahead of training. Under gradient accumulation, call "
                "scheduler.step(loss) once per optimizer "
                "step, after optimizer.step(), not on every micro-batch (total_steps counts optimizer steps), with the "
                "step's loss as it is, the mean over its micro-batches, not divided by their number (the paper "
                "controller's loss_scale is in the loss's own units). A scheduler passed to accelerator.prepare() is "
                "stepped num_processes times per optimizer step: do not prepare it. "
                + ("Also, no torch.amp.GradScaler steps this optimizer (whose skipped steps would explain it)"
                   if self.loss_scale.scaler is None else
                   "Also, no scaler.update() of the torch.amp.GradScaler that steps it ran (a step the scaler skipped "
                   "would explain it)") + ": with one, keep calling scheduler.step() after each scaler.step(), as "
                "torch's AMP recipe does. Said once",
                stacklevel=user_stacklevel())
        self.scale_version = version
        if local and not self.checked_local:  # (once: it reads every parameter's optimizer state)
            check_shared_gradients(optimizer, average_optimizer_state)
            self.checked_local = True
        if self.opt_steps > self.opt_steps_seen + 1 and local and not self.warned_missed_step:
            # (local mode only: under DDP every replica skips alike, e.g. a step GradScaler skipped on the device)
            self.warned_missed_step = True
            warnings.warn(
                f"hdet: optimizer.step() ran {self.opt_steps - self.opt_steps_seen} times since the previous "
                "scheduler.step(). HDET counts optimizer steps by its scheduler: this replica's schedule and converge "
                "steps now run behind its training, and in local mode (no gradient all-reduce) it is averaged with the "
                "others at another step without any other error. Call scheduler.step() after every optimizer.step(), "
                "on every replica", stacklevel=user_stacklevel())
        self.opt_steps_seen = self.opt_steps

    # -- the loss given ------------------------------------------------------------------------------------
    def check_loss(self, loss: Any) -> None:
        """What ``scheduler.step(loss)`` got: an int is an epoch (torch's deprecated ``step(epoch)``), and three first
        floats in an exact arithmetic progression upward an epoch counter (torch documents
        ``CosineAnnealingWarmRestarts.step(epoch + i / iters)``): taken as losses, silently, before. Said once."""
        integral = isinstance(loss, torch.Tensor) and not loss.is_floating_point() and not loss.is_complex()
        if (integral or isinstance(loss, int) and not isinstance(loss, bool)) and not self.warned_epoch:
            self.warned_epoch = True
            warnings.warn(f"hdet: scheduler.step({loss}) got an int: HDET's step takes this step's training loss, not "
                          "an epoch (torch's deprecated step(epoch) is not supported); it was taken as a loss. Pass "
                          "the loss (a tensor or float), or nothing", stacklevel=user_stacklevel())
        elif isinstance(loss, float) and self.first_floats is not None:
            self.first_floats.append(loss)
            if len(self.first_floats) < 3:
                return
            a, b, c = self.first_floats
            self.first_floats = None
            if b > a and math.isclose(c - b, b - a, rel_tol=1e-9) and not self.warned_epoch:
                self.warned_epoch = True
                warnings.warn(f"hdet: scheduler.step() got {a!r}, {b!r}, {c!r}: an epoch counter (torch's step(epoch "
                              "+ i / iters))? HDET's step takes this step's training loss (they were taken as losses) "
                              "and steps the base schedule once per optimizer step: pass the loss, or nothing, and "
                              "give the base's periods (CosineAnnealingWarmRestarts' T_0) in optimizer steps",
                              stacklevel=user_stacklevel())

    # -- LRs written by another --------------------------------------------------------------------------
    def mark_lrs(self, optimizer: torch.optim.Optimizer) -> None:
        """Each param group's LR as the scheduler has just set it."""
        self.lr_marks = lr_marks(optimizer)

    def forget_lrs(self) -> None:
        """Something that is no other writer set the LRs (an optimizer's load): the next step does not check them."""
        self.lr_marks = None

    def check_lrs_kept(self, optimizer: torch.optim.Optimizer) -> None:
        """Each param group's LR as the scheduler set it after its previous step, or something else wrote it since:
        a loop that sets ``group['lr']`` itself (nanoGPT's ``get_lr(it)``) trained every replica at its own schedule,
        no spread, while the records showed one; a ``ReduceLROnPlateau`` stepped beside HDET cut the LR for one step,
        then hdet's value was back (an audit). Said once. A tensor LR by identity and in-place version (no host
        sync)."""
        marks, self.lr_marks = self.lr_marks, None
        if marks is None or self.warned_lr_written:
            return
        now = lr_marks(optimizer)
        if now == marks:  # (a float compares by value, a tensor's mark by identity and version)
            return
        moved = [i for i, (a, b) in enumerate(zip(marks, now)) if a != b]
        if moved:
            self.warned_lr_written = True
            i = moved[0]
            got = f" to {now[i]:.6g}" if isinstance(now[i], float) else ""
            was = f" ({marks[i]:.6g})" if isinstance(marks[i], float) else ""
            warnings.warn(f"hdet: param group {i}'s LR was written{got} after this scheduler set it{was} at its "
                          "previous step, by something else (a loop that sets group['lr'] itself, ReduceLROnPlateau "
                          "or another scheduler stepped beside it): that step ran at the other writer's LR, not at "
                          "this replica's spread one that the records show, and hdet sets its own value again now: a "
                          "cut made there lasts one step, and a writer that runs before every step replaces HDET's LRs "
                          "at every step (no spread for the whole run). Give your schedule to HDETLR as its base (a "
                          "torch scheduler, or a callable of the step) and step only the HDETLR; ReduceLROnPlateau "
                          "cannot be one (it steps on a metric, not on the step). Said once",
                          stacklevel=user_stacklevel())

    # -- torch's join() ----------------------------------------------------------------------------------
    def check_join(self, model: Any, sched: Any) -> None:
        """torch's ``model.join()`` (uneven inputs across ranks): its stand-ins for a finished rank's collectives cannot
        match a converge step's (every rank waited out the process group's timeout, then a ReplicaSyncError blamed a dead
        replica, an audit): training inside one without ``throw_on_early_termination=True`` is refused. And the end of a
        join block (:func:`keep_replicas_at_join_end`) copied the last rank's model to every rank: ``finish()`` after
        it averaged N copies of one replica, silently. ``sched``: the open scheduler on ``model``, the watch's own.
        Nothing for a model that is no DDP module, and the join end's hold taken once for a DDP one (remembered: about
        no cost a step; a closed scheduler that reopens takes the hold again itself)."""
        if model is None or model is self._plain:
            return
        if self._ddp is not None and self._ddp[0] is model:
            ddp = self._ddp[1]  # (its join end already kept the replicas apart, this scheduler among its open ones)
        else:
            ddp = keep_replicas_at_join_end(model, sched)
            if ddp is None:
                self._plain = model
                return
            self._ddp = (model, ddp)
        config = getattr(ddp, "_join_config", None)
        if getattr(config, "enable", False) and not config.throw_on_early_termination \
                and config is not ddp.__dict__.get("_hdet_join_ended"):  # (torch leaves a block's config on after it)
            raise ValueError("Expected model.join(throw_on_early_termination=True) around HDET's training steps, but "
                             "got join() without it: its stand-ins for a finished rank's collectives cannot match a "
                             "converge step's, so a rank that runs out of batches leaves the others waiting until the "
                             "process group's timeout. With throw_on_early_termination=True every rank stops at the "
                             "shortest one's step: catch that error, then call sched.finish() on every rank")

    # -- an optimizer that caps its LR -------------------------------------------------------------------
    def check_capped_lr(self, optimizer: torch.optim.Optimizer, spread_or_moved: bool, t: int) -> None:
        """torch's Adafactor steps at ``min(lr, 1 / sqrt(t))``: under a spread (or the controller) the replicas whose
        LR is above that step alike, and the spread is narrower than the LRs and the records say (an audit: at base
        LR 1, every replica's step was the same from step 6 on). Said once, at the first step where it happens.
        ``spread_or_moved``: the LRs are spread or moved by the controller."""
        if self.warned_cap or _ADAFACTOR is None or not spread_or_moved:
            return
        if self._adafactor is None or self._adafactor[0] is not optimizer:
            inner = innermost(optimizer)
            self._adafactor = (optimizer, inner if isinstance(inner, _ADAFACTOR) else None)
        inner = self._adafactor[1]
        if inner is None:
            return
        steps = [st.get("step") for st in inner.state.values()]
        steps = [float(x) for x in steps if isinstance(x, torch.Tensor) and x.device.type == "cpu"]  # (no host sync)
        t = max(steps) if steps else t  # torch's own count (skipped steps, an optimizer stepped before): its cap's
        cap = 1.0 / math.sqrt(t)
        over = [as_float(g["lr"]) for g in inner.param_groups if as_float(g["lr"]) > cap]
        if over:
            self.warned_cap = True
            warnings.warn(f"hdet: torch's Adafactor steps at min(lr, 1/sqrt(t)), {cap:.3g} at step {t:g}, below this "
                          f"replica's LR {max(over):.3g}: replicas whose LR is above it take the same step, so the "
                          "spread (and the controller's moves) acts less than the LRs and records say, and less as the "
                          "run goes on. Use a base LR well below 1/sqrt(total_steps), or another optimizer",
                          stacklevel=user_stacklevel())


def keep_replicas_at_join_end(model: Any, sched: Any = None) -> torch.nn.parallel.DistributedDataParallel | None:
    """At the end of a ``model.join()`` block torch copies the last rank's model to every rank
    (``DistributedDataParallel._sync_final_model``), for ranks that stopped stepping earlier: each replica's own weights
    were lost (an audit). Under HDET a block that training steps run in throws on uneven inputs (refused otherwise), so
    the end runs only where every rank took every step: the copy is left out, and the config of the block that ended
    kept (torch leaves it enabled: an evaluation's join without throw_on_early_termination is no training's). Returns
    the DDP module (inside ``torch.compile``'s wrapper), None where the model is not one. ``sched``: an open scheduler
    on the model; with none left open (closed, or gone) torch's copy runs again (a plain ``join()`` after HDET's run
    left the ranks apart, an audit)."""
    ddp = uncompiled(model) if model is not None else None
    if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
        return None
    if sched is not None and not sched.closed:
        ddp.__dict__.setdefault("_hdet_open", weakref.WeakSet()).add(sched)
    if getattr(ddp.__dict__.get("_sync_final_model"), "_hdet", False):
        return ddp

    def keep_replicas(is_last_joiner: bool) -> None:
        ddp.__dict__["_hdet_join_ended"] = getattr(ddp, "_join_config", None)  # (a plain join's too: the next
        # scheduler on the model is not refused for it, a review)
        if not ddp.__dict__.get("_hdet_open"):
            type(ddp)._sync_final_model(ddp, is_last_joiner)

    keep_replicas._hdet = True  # type: ignore[attr-defined]
    ddp._sync_final_model = keep_replicas
    return ddp


def lr_marks(optimizer: torch.optim.Optimizer) -> list[Any]:
    """Each param group's LR as it is now, to tell later whether anything wrote it: a float as it is, a tensor by its
    identity and in-place version (no host sync)."""
    return [(id(g["lr"]), g["lr"]._version) if isinstance(g["lr"], torch.Tensor) else g["lr"]
            for g in optimizer.param_groups]


def lrs_of(optimizer: torch.optim.Optimizer) -> list[Any]:
    """Every param group's LR as torch's ``get_last_lr()`` gives it: a copy of a tensor LR, a float as it is."""
    return [g["lr"].clone() if isinstance(g["lr"], torch.Tensor) else g["lr"] for g in optimizer.param_groups]
