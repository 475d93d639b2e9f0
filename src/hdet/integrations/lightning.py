"""Lightning: ``HDETCallback`` feeds each rank's own training loss to the HDET scheduler and re-applies
each rank's learning rate after a checkpoint is restored.

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        sched = hdet.OneCycleAutoLR(opt, max_lr=1e-3, total_steps=steps, ensemble_lr_spread_ratio=0.2,
                                    model_sync_interval=100)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    trainer = L.Trainer(strategy="ddp", callbacks=[HDETCallback()], ...)

Lightning steps a step-interval scheduler once per optimizer step, without arguments; the callback
observes this rank's loss of every training batch before its backward pass (``on_before_backward``, so
before Lightning steps the scheduler), times ``accumulate_grad_batches`` (Lightning divides it for the
accumulation window) and divided by the GradScaler's scale under ``precision="16-mixed"`` (Lightning hands the
callback the scaled loss), so every micro-batch counts toward the window mean with its true value. When
training starts, the callback gives every HDET scheduler the strategy's (DDP-wrapped) model if it has
none (BatchNorm statistics are then averaged) and installs the gradient guard on it. Each sync's
scalars (window losses, bases, spread, Delta) go to the trainer's loggers at the sync's step. Lightning saves rank 0's checkpoint only;
after a resume each rank re-applies its own LR (as with the Hugging Face Trainer). Install with
``pip install 'hdet[lightning]'``.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ..caller import user_stacklevel
from ..optimizers import innermost
from ..schedulers import HDETLR
from ..telemetry import sync_scalars
from ..values import check_bool
from . import explored_clips, finish_at_train_end

try:
    from lightning.pytorch import LightningModule
    from lightning.pytorch.callbacks import Callback
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("hdet.integrations.lightning needs lightning: pip install 'hdet[lightning]'") from e

__all__ = ["HDETCallback"]


def _hdet_schedulers(trainer: Any) -> list[HDETLR]:
    return [cfg.scheduler for cfg in trainer.lr_scheduler_configs if isinstance(cfg.scheduler, HDETLR)]


def _weight_averaging(trainer: Any) -> list[Any]:
    """Lightning's ``WeightAveraging`` callbacks (``EMAWeightAveraging``, ...) with an average model, in order."""
    return [c for c in getattr(trainer, "callbacks", ()) if isinstance(getattr(c, "_average_model", None), torch.nn.Module)
            and any(k.__name__ == "WeightAveraging" for k in type(c).__mro__)]


class HDETCallback(Callback):
    """Observe this rank's loss for every HDET scheduler of the module; re-apply LRs after a restore.

    ``observe_loss=False``: leave the loss to you (``sched.step(loss)`` or ``sched.observe(loss)``), for manual
    optimization whose ``manual_backward`` gets the loss divided by the number of micro-batches, which the callback
    cannot undo (the paper controller reads the loss in its own units: docs/lightning.md)."""

    def __init__(self, observe_loss: bool = True) -> None:
        self._observe_loss = check_bool("observe_loss", observe_loss)
        self._restored = False
        self._logged: dict[int, int] = {}  # scheduler index -> the sync step last logged
        self._swapped: list[HDETLR] = []  # the schedulers whose average is in for a validation
        self._backward_at: dict[int, int] = {}  # manual optimization: scheduler index -> its step at the last backward
        self._said_manual = False

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        if not self._observe_loss:
            return
        scale = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1  # undo Lightning's division
        true = loss.detach().float() * scale
        scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
        for sched in _hdet_schedulers(trainer):  # (the loss before the cast)
            sched.ensemble.say_coarse(loss, "the training loss (on_before_backward's)")
        if scaler is not None and scaler.is_enabled():  # "16-mixed": the loss here is already multiplied by the
            # GradScaler's scale (a power of two: dividing is exact); its device tensor, so no host sync
            amp = scaler._get_scale_async() if hasattr(scaler, "_get_scale_async") else scaler.get_scale()
            true = true / amp
        scheds = _hdet_schedulers(trainer)
        if not pl_module.automatic_optimization:
            self._say_divided(scheds)
        for sched in scheds:
            sched.observe(true)  # this rank's own loss, on its device

    def _say_divided(self, scheds: list[HDETLR]) -> None:
        """Manual optimization: a second ``manual_backward`` with no scheduler stepped since the one before is
        gradient accumulation, whose loss Lightning's recipe divides by the number of micro-batches; the paper
        controller reads it in its own units (``loss_scale``, sigma of Eq. 4). Said once, then (at train start it was
        said for every manual loop, one backward a step included: an audit; two optimizers, each with one backward and
        its scheduler's step, are no accumulation: a review)."""
        now = {k: s.last_epoch for k, s in enumerate(scheds)}
        last, self._backward_at = self._backward_at, now
        if last == now and not self._said_manual and any(
                s._hdet.config.enable_auto_lr and s._hdet.config.controller_kind == "paper" for s in scheds):
            self._said_manual = True
            warnings.warn("hdet: under manual optimization HDETCallback observes the loss given to manual_backward() "
                          "as it is, and manual_backward() ran more than once before this scheduler's step (gradient "
                          "accumulation): the paper controller reads the loss in its own units (loss_scale, sigma of "
                          "Eq. 4), so if you divide it by the number of micro-batches, pass "
                          "HDETCallback(observe_loss=False) and give the scheduler the undivided loss yourself "
                          "(sched.step(loss), docs/lightning.md)", stacklevel=user_stacklevel())

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Each new sync's scalars (:func:`hdet.sync_scalars`) to the trainer's loggers, once, at the sync's step
        (the optimizer steps HDET counts), from global rank 0 (every rank holds the same record). Not through
        ``self.log``: Lightning flushes a value logged there at its logging steps, so a sync went out at several
        steps or, between two logging steps, not at all. (Lightning's ``LearningRateMonitor`` reads the optimizer,
        i.e. this rank's multiplied LR: the base is ``hdet/base/lr/...`` here.)"""
        for k, sched in enumerate(_hdet_schedulers(trainer)):
            self._log_sync(trainer, k, sched.last_sync)

    def _log_sync(self, trainer: Any, k: int, rec: Any) -> None:
        """Scheduler ``k``'s sync record to the loggers, once (global rank 0)."""
        if rec is not None and rec.step != self._logged.get(k):
            self._logged[k] = rec.step
            if trainer.is_global_zero:
                metrics = {f"{key}" if k == 0 else f"{key}/{k}": v for key, v in sync_scalars(rec).items()}
                for logger in trainer.loggers:
                    logger.log_metrics(metrics, step=rec.step)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """Training stopped before the schedulers' ``total_steps`` (``EarlyStopping``, ``max_time``, a smaller
        ``max_steps``): the replicas are averaged now (:meth:`hdet.HDETLR.finish`, on every rank), so that the module
        after ``fit`` is the ensemble's average, not each rank's own replica."""
        self._swap_back()
        for k, sched in enumerate(_hdet_schedulers(trainer)):
            self._log_sync(trainer, k, finish_at_train_end(sched))  # (that sync's scalars too: an audit)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """Each ``WeightAveraging`` callback's average model is registered (:meth:`hdet.HDETLR.also_average`) before a
        resume loads the schedulers' states, whose best sync keeps it (Lightning restores them after this hook). A new
        ``fit``'s syncs are logged anew (a second ``fit`` with this callback skipped those at steps logged before)."""
        self._logged, self._backward_at = {}, {}
        for sched in _hdet_schedulers(trainer):
            for cb in _weight_averaging(trainer):
                sched.also_average(cb._average_model)

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        self._restored = True

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        """An explored ``hdet.GradClip``: this replica's norm applied to the gradients of the optimizer it explores
        (after a GradScaler's unscale, as Lightning's own clipping), which Lightning's ``gradient_clip_val`` would
        replace (refused with it: :meth:`on_train_start`)."""
        for sched in _hdet_schedulers(trainer):
            clips = explored_clips(sched)
            if not clips or innermost(sched.optimizer) is not innermost(optimizer):
                continue
            params = [p for g in sched.optimizer.param_groups for p in g["params"] if p.grad is not None]
            scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
            if scaler is not None and scaler.is_enabled() and getattr(innermost(optimizer), "_step_supports_amp_scaling",
                                                                      False):
                # "16-mixed" with an optimizer that unscales inside its step (fused Adam): Lightning leaves the
                # gradients scaled here, so the norm is scaled too (clipped to max_norm, the true norm came out
                # max_norm / scale: a review). The scale's device tensor: no host sync
                amp = scaler._get_scale_async() if hasattr(scaler, "_get_scale_async") else scaler.get_scale()
                torch.nn.utils.clip_grad_norm_(params, clips[0].max_norm * amp)
            else:
                clips[0].clip_(params)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        """A validation measures the ensemble's average (:meth:`hdet.HDETLR.swap_in_average`, on every rank, explored
        values at their base; nothing to swap right after a converge step or ``fit`` but BatchNorm's statistics, which a gradient
        accumulation's micro-batch since may have moved): between converge steps each
        rank's module is its own replica, and the logged metrics (and what ``ModelCheckpoint(monitor=...)`` and
        ``EarlyStopping`` read) were a mix of them, each on its share of the validation data. Not in the sanity check
        before training."""
        if trainer.sanity_checking:
            return
        for sched in _hdet_schedulers(trainer):
            if not sched.average_swapped_in:
                sched.swap_in_average()  # COLLECTIVES (off converge steps)
                self._swapped.append(sched)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._swap_back()

    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        """``trainer.test()``: as a validation (after ``fit`` the weights are equal; the explored values at their
        base)."""
        self.on_validation_start(trainer, pl_module)

    def on_test_end(self, trainer: Any, pl_module: Any) -> None:
        self._swap_back()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._swap_back()

    def _swap_back(self) -> None:
        for sched in reversed(self._swapped):  # last in, first out: several schedulers of one module each keep its
            sched.swap_back()  # buffers aside, and the later ones kept the average the earlier ones put in
        self._swapped = []

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        """A checkpoint saved between converge steps holds the ensemble's average (the model the run is building)
        in its ``state_dict``, not rank 0's replica, which Lightning would save; with rank 0's optimizer and
        scheduler state, as before. Every rank runs this (Lightning's ``save_checkpoint`` is called on all of them;
        rank 0 writes). Lightning calls no callback for a weights-only checkpoint: see :meth:`on_train_start`."""
        scheds = [s for s in _hdet_schedulers(trainer) if not s.average_swapped_in]
        if not scheds or not isinstance(checkpoint.get("state_dict"), dict):
            return
        swapped: list[HDETLR] = []
        try:
            for s in scheds:
                s.swap_in_average()  # COLLECTIVES (off converge steps)
                swapped.append(s)
            if any(s.average_swapped_in for s in swapped):
                mean = pl_module.state_dict()  # (a copy: the weights go back before Lightning writes the file)
                # a WeightAveraging callback that saved before this one moved the module's state to
                # "current_model_state" and put its average model's in "state_dict": each is the ensemble's now (the
                # average model was averaged in place by the swap-in: also_average, on_train_start)
                averaging = _weight_averaging(trainer) if "current_model_state" in checkpoint else []
                key = "current_model_state" if averaging else "state_dict"
                checkpoint[key] = {k: mean[k].clone() if isinstance(mean.get(k), torch.Tensor) else v
                                   for k, v in checkpoint[key].items()}
                if averaging:
                    state = averaging[-1]._average_model.state_dict()
                    checkpoint["state_dict"] = {k: state["module." + k].clone() if isinstance(
                        state.get("module." + k), torch.Tensor) else v for k, v in checkpoint["state_dict"].items()}
                # the schedulers' states (taken before this callback) hold their replicas' weights' fingerprints,
                # checked at the first step after a resume: the checkpoint's weights are the average's
                for cfg, state in zip(trainer.lr_scheduler_configs, checkpoint.get("lr_schedulers") or []):
                    if isinstance(cfg.scheduler, HDETLR) and isinstance(state, dict) and "weights" in state:
                        state["weights"] = cfg.scheduler.ensemble.weights_fingerprint()  # HOST SYNC
        finally:
            for s in reversed(swapped):  # last in, first out (see _swap_back)
                s.swap_back()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        for cfg in trainer.lr_scheduler_configs:
            if isinstance(cfg.scheduler, HDETLR) and (cfg.interval != "step" or cfg.frequency != 1):
                raise ValueError(
                    f"Expected the HDET scheduler with {{'interval': 'step', 'frequency': 1}}, but got interval "
                    f"{cfg.interval!r}, frequency {cfg.frequency}: HDET counts optimizer steps (its converge steps "
                    "and schedule would run once per epoch). Return {'optimizer': opt, 'lr_scheduler': "
                    "{'scheduler': sched, 'interval': 'step'}} from configure_optimizers")
        if trainer.gradient_clip_val and any(explored_clips(s) for s in _hdet_schedulers(trainer)):
            raise ValueError(f"Expected no gradient_clip_val with an explored hdet.GradClip (HDETCallback clips to each "
                             f"replica's explored norm; Lightning would clip again to {trainer.gradient_clip_val} after "
                             "it, so every replica would step at that norm while hdet reports the spread): leave "
                             "gradient_clip_val out")
        if pl_module is not None and any(explored_clips(s) for s in _hdet_schedulers(trainer)) and \
                type(pl_module).configure_gradient_clipping is not LightningModule.configure_gradient_clipping:
            warnings.warn("hdet: the module overrides configure_gradient_clipping, which Lightning runs after "
                          "HDETCallback has clipped each replica to its explored hdet.GradClip norm: a clip of its own "
                          "there overrides the spread hdet reports", stacklevel=user_stacklevel())
        swa = [c for c in getattr(trainer, "callbacks", ()) if type(c).__name__ == "StochasticWeightAveraging"]
        if swa and _hdet_schedulers(trainer):
            raise ValueError("Expected no StochasticWeightAveraging callback with an HDET scheduler, but got one: at "
                             "its first SWA epoch it replaces the schedulers with its SWALR, so HDET would stop "
                             "without averaging the replicas and each rank would go on at its own LR. Use "
                             "lightning's WeightAveraging (or EMAWeightAveraging), whose average model HDETCallback "
                             "averages with the replicas")
        count = len(_hdet_schedulers(trainer))
        if self._observe_loss and pl_module is not None and not pl_module.automatic_optimization and count > 1:
            warnings.warn("hdet: under manual optimization HDETCallback gives the loss of every manual_backward() to "
                          f"each of the {count} HDET schedulers (it cannot tell which "
                          "optimizer a loss is for: each scheduler's window mixes the other models' losses, a review): "
                          "pass HDETCallback(observe_loss=False) and give each scheduler its own model's loss "
                          "(sched.step(loss))", stacklevel=user_stacklevel())
        for sched in _hdet_schedulers(trainer):
            sched.attach_model(trainer.strategy.model)  # buffers averaged if no model= was given; the guard on DDP
            for cb in _weight_averaging(trainer):  # each rank's average model follows its own replica: averaged
                sched.also_average(cb._average_model)  # with it (an EMA is linear in the weights; on_fit_start did)
        weights_only = [c for c in trainer.checkpoint_callbacks if getattr(c, "save_weights_only", False)]
        if weights_only and _hdet_schedulers(trainer) and trainer.world_size > 1:
            warnings.warn("hdet: ModelCheckpoint(save_weights_only=True) saves without calling any callback, so its "
                          "checkpoints saved between converge steps hold rank 0's replica, not the ensemble's average "
                          "(a full checkpoint holds the average): save at multiples of model_sync_interval "
                          "(every_n_train_steps), or save_weights_only=False", stacklevel=user_stacklevel())
        if self._restored:  # rank 0's optimizer and scheduler states were loaded on every rank
            for sched in _hdet_schedulers(trainer):
                sched.reapply()
            self._restored = False
