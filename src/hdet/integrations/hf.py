"""Hugging Face Trainer: ``HDETTrainer`` is a ``transformers.Trainer`` whose scheduler is HDET around the
schedule the Trainer would have built (``lr_scheduler_type``, warmup, ...), or around the scheduler passed
as ``optimizers=(optimizer, scheduler)``.

    trainer = HDETTrainer(model=model, args=args, train_dataset=ds,
                          hdet=dict(ensemble_lr_spread_ratio=0.2, model_sync_interval=100))
    trainer.train()                      # under torchrun: one replica per process

Why a subclass: the Trainer's logged loss is already averaged over ranks and logging steps, and its
callbacks see no loss at all, so this rank's own training loss is captured from ``training_step``: the
micro-batches' losses as the Trainer returns them (each already divided for the accumulation window, or
normalised by the window's token count) are summed over the window and observed once per optimizer step,
right after it (``on_optimizer_step``), so HDET sees the loss the Trainer logs, whatever the accumulation
(under ``average_tokens_across_devices``, this rank's own per-token loss: see :meth:`HDETTrainer._get_num_items_in_batch`).
The logged learning rate is the base schedule's (the mean over replicas), not rank 0's multiplied one, and
each new sync's scalars (:func:`hdet.sync_scalars`: window losses, bases, spread, Delta) are logged through the
Trainer at the sync's step, so they reach every ``report_to`` tracker; the gradient guard is installed on the Trainer's
DDP-wrapped model when training starts. The Trainer steps the
scheduler once per optimizer step, but not after a step that the fp16 GradScaler skipped; HDET's scheduler is
stepped after those too (by :class:`_HDETHooks`, on every rank alike), as torch's AMP recipe does, so that it counts
the Trainer's steps and averages the replicas after the last one (before, each skipped step left it one step short
of ``max_steps``: no final average). Its scheduler state goes into the Trainer's checkpoints, so
``trainer.train(resume_from_checkpoint=...)`` resumes HDET; the Trainer saves rank 0's optimizer and
scheduler states only, so after loading them each rank re-applies its own learning rate, and
``save_steps`` should be a multiple of ``model_sync_interval`` (a warning says so otherwise). Install with ``pip install hdet[hf]``.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from typing import Any, Iterator

import torch
import torch.distributed as dist

from ..caller import user_stacklevel
from ..config import HDETConfig
from ..optimizers import innermost
from ..schedulers import HDETLR
from ..sync import fingerprint
from ..telemetry import sync_scalars
from . import explored_clips, finish_at_train_end

try:
    from transformers import Trainer, TrainerCallback
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("hdet.integrations.hf needs transformers: pip install 'hdet[hf]'") from e

__all__ = ["HDETTrainer"]


class HDETTrainer(Trainer):
    """``Trainer`` + HDET. ``hdet``: keyword arguments of :class:`hdet.HDETLR` (``ensemble_lr_spread_ratio``,
    ``model_sync_interval``, ``enable_auto_lr``, ``auto_lr_warmup_steps``, ``explore``, ...)."""

    def __init__(self, *args: Any, hdet: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.hdet_kwargs = dict(hdet or {})
        bad = {"optimizer", "base", "total_steps", "model"} & set(self.hdet_kwargs)
        if bad:
            raise ValueError(f"Expected HDETLR options other than {sorted(bad)} in hdet= (the Trainer supplies them)")
        super().__init__(*args, **kwargs)
        if getattr(self.args, "average_tokens_across_devices", False) and self.args.world_size > 1 and \
                not hasattr(Trainer, "_get_num_items_in_batch"):  # (transformers < 4.50: no way to undo it)
            raise ValueError("Expected average_tokens_across_devices=False in TrainingArguments with this transformers "
                             "version: with it, each rank's loss is divided by every rank's token count, and HDET "
                             "compares the replicas' own losses")
        self._hdet_loss: torch.Tensor | None = None  # this optimizer step's micro-batch losses, summed on the device
        self._hdet_token_scale: torch.Tensor | None = None  # this window's correction of a token-averaged loss
        self._hdet_has_tokens: torch.Tensor | None = None  # whether this rank's window had a label token (device)
        self._hdet_counted: torch.Tensor | bool = True  # this optimizer step's counted= (HDETLR.observe)
        self._hdet_trainer_loss = False  # this micro-step's loss came from the Trainer's own compute_loss
        self._hdet_max_grad_norm: float | None = None  # the user's max_grad_norm while an explored one is in args
        self.add_callback(_HDETHooks(self))
        self.callback_handler.callbacks.insert(0, _HDETFinish(self))  # first: the reporting callbacks' on_train_end
        # (WandbCallback's model upload, ...) then see the averaged model
        T = self._sync_interval()
        every = self.args.save_steps
        if every and 0 < every < 1:  # a ratio of the run: the Trainer saves every ceil(max_steps * ratio) steps
            every = math.ceil(self.args.max_steps * every) if self.args.max_steps > 0 else 0  # (epochs: unknown yet)
        if self.args.save_strategy == "steps" and every and every % T:
            warnings.warn(f"hdet: save_steps={self.args.save_steps} is not a multiple of model_sync_interval={T}; "
                          "the Trainer saves rank 0's scheduler state, so a resume between converge steps gives "
                          "every replica rank 0's loss window", stacklevel=user_stacklevel())

    def _load_best_model(self) -> None:
        """The Trainer's, noting whether it loaded anything on this rank: where the best checkpoint's files are not on
        this rank's disk (several nodes without ``save_on_each_node``) the Trainer logs that and keeps the weights, here
        one replica's own (:meth:`_HDETFinish.on_train_end` then settles it on every rank)."""
        found = self.is_deepspeed_enabled or self.is_fsdp_enabled or _best_files_here(self.state.best_model_checkpoint)
        before = None if found else _weights_mark(self.model)
        super()._load_best_model()
        self._hdet_best_loaded = found or not torch.equal(before, _weights_mark(self.model))

    def _hdet_settle_best(self) -> bool:
        """After ``load_best_model_at_end``, on every rank: whether every rank now holds the best checkpoint (the
        replicas' average). Where some ranks loaded it and others could not, theirs is broadcast from the first rank
        that did. Where none could, False: the replicas are then averaged as at a run's end, and a warning says so.
        COLLECTIVE (under torch.distributed): an all-gather of one flag a rank, and a broadcast of the model's
        parameters and buffers where ranks differ."""
        # (a rank where the Trainer recorded no best checkpoint, its folder not yet on this rank's disk when the
        # Trainer looked, did not load one: the Trainer records it only where the folder exists; an audit)
        loaded = self.state.best_model_checkpoint is not None and bool(getattr(self, "_hdet_best_loaded", True))
        tensors = [t for t in (*self.model.parameters(), *self.model.buffers())]
        flags = [loaded]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            nccl = "nccl" in str(dist.get_backend()).lower()
            mine = torch.tensor([float(loaded)], device=torch.device("cuda", torch.cuda.current_device()) if nccl
                                else "cpu")
            every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(every, mine)  # COLLECTIVE (HOST SYNC: the flags are read)
            flags = [bool(f.item()) for f in every]
        if all(flags):
            return True
        if any(flags):
            src = flags.index(True)
            for t in tensors:  # COLLECTIVE: the best checkpoint's weights to the ranks that could not load it
                dist.broadcast(t.data, src)
            warnings.warn(f"hdet: the best checkpoint could not be loaded on "
                          f"rank(s) {[r for r, f in enumerate(flags) if not f]} (its files are not on their disk: "
                          f"save_on_each_node=True keeps a copy on every node); rank {src}'s loaded model was "
                          "broadcast to them, so every rank holds the best checkpoint", stacklevel=user_stacklevel())
            return True
        step = getattr(self.state, "best_global_step", None)
        warnings.warn(f"hdet: the best checkpoint{f' (step {step})' if step else ''} could not be loaded on any rank: "
                      "the best evaluation was not saved (save_steps a multiple of eval_steps, or "
                      "save_strategy='best', saves it; plain Transformers then loads nothing), or its files are not on "
                      "the ranks' disks (save_on_each_node=True keeps a copy on every node). The replicas are averaged "
                      "as at the end of a run instead: the model is the run's last average, the best checkpoint's only "
                      "where that was the last step", stacklevel=user_stacklevel())  # (a review: only the disks were
        # named, where the usual cause is a best evaluation at no save step)
        return False

    def _sync_interval(self) -> int:
        """T as the scheduler will have it: a scheduler of the user's (``optimizers=``), ``config=``, or the keyword
        (before, the keyword or 1000: ``config=HDETConfig(model_sync_interval=100)`` was checked as 1000)."""
        if isinstance(self.lr_scheduler, HDETLR):
            return self.lr_scheduler.ensemble.config.model_sync_interval
        config = self.hdet_kwargs.get("config")
        return self.hdet_kwargs.get("model_sync_interval", (config if isinstance(config, HDETConfig) else
                                                            HDETConfig()).model_sync_interval)

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None):
        if isinstance(self.lr_scheduler, HDETLR):  # built already (or the user's own HDET scheduler)
            return self._check_clip(self.lr_scheduler)
        # the Trainer's own schedule, or the one passed as optimizers=(optimizer, scheduler): HDET wraps either
        base = self.lr_scheduler if self.lr_scheduler is not None else super().create_scheduler(num_training_steps,
                                                                                                 optimizer)
        opt = self.optimizer if optimizer is None else optimizer
        if innermost(opt) is getattr(base, "optimizer", None):  # (the Trainer's may wrap the one the schedule is on)
            opt = base.optimizer  # otherwise HDETLR refuses a schedule of another optimizer
        self.lr_scheduler = HDETLR(opt, base, total_steps=num_training_steps, model=self.model, **self.hdet_kwargs)
        self._hdet_total_steps = num_training_steps  # the run's length as this Trainer counts it (a resume keeps it)
        return self._check_clip(self.lr_scheduler)

    def _check_clip(self, sched: HDETLR) -> HDETLR:
        if explored_clips(sched) and self.args.max_grad_norm <= 0:
            raise ValueError(f"Expected max_grad_norm > 0 with an explored hdet.GradClip (the Trainer clips only then; "
                             f"HDETTrainer clips to each replica's explored norm in its place), but got "
                             f"max_grad_norm={self.args.max_grad_norm}")
        return sched

    def _clip_grad_norm(self, model: Any) -> Any:
        """With an explored ``hdet.GradClip``: the Trainer's own clip (every path of it: fp16's unscale, a mixed
        device mesh), to this replica's explored norm instead of ``max_grad_norm`` (which the Trainer applied, while
        hdet reported the explored norms: an audit)."""
        clips = explored_clips(self.lr_scheduler) if isinstance(self.lr_scheduler, HDETLR) else []
        if not clips:
            return super()._clip_grad_norm(model)
        kept, self.args.max_grad_norm = self.args.max_grad_norm, clips[0].max_norm
        try:
            return super()._clip_grad_norm(model)
        finally:
            self.args.max_grad_norm = kept

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        sched = self.lr_scheduler
        if checkpoint is not None and isinstance(sched, HDETLR):
            # the Trainer saved rank 0's optimizer and scheduler states and loads them on every rank
            sched.reapply()
            resized = self._follow_run_length(sched, checkpoint)
            for message in sched.ensemble.load_warnings:  # the Trainer dropped them (its filter keeps no
                if resized and message.endswith(resized):  # UserWarning raised while it loads): raised again
                    message = message[:-len(resized)].rstrip(", ")  # (but for the run's length, said below)
                    if message.endswith(":"):
                        continue
                warnings.warn(message, stacklevel=user_stacklevel())
            if resized:
                warnings.warn(f"hdet: resumed from {checkpoint} into a run of {sched.total_steps} optimizer steps, "
                              f"where the checkpoint's run had {resized.split()[1]}: the Trainer's own schedule "
                              "follows the new length, and so does HDET (its last converge step, where the replicas "
                              f"are averaged, is now step {sched.total_steps})", stacklevel=user_stacklevel())
            if sched.world_size > 1 and sched.last_epoch > 0 and not sched.is_sync_step(sched.last_epoch):
                # (warned here, after the Trainer's load: it drops the warnings raised while loading)
                warnings.warn(f"hdet: resumed from {checkpoint} at step {sched.last_epoch}, between converge steps "
                              f"(model_sync_interval={sched.ensemble.config.model_sync_interval}): the Trainer saved "
                              "one model (HDETTrainer saves the replicas' average between converge steps) and rank "
                              "0's optimizer and scheduler state only, so every replica goes on from them, replica 0's "
                              "loss window and optimizer moments included. Checkpoint at multiples of "
                              "model_sync_interval (save_steps) for an exact resume", stacklevel=user_stacklevel())

    def _follow_run_length(self, sched: HDETLR, checkpoint: str) -> str:
        """A resume into a run of another length (``max_steps`` or ``num_train_epochs`` changed): the Trainer builds
        its schedule for the new length and loads only its step count, while the loaded HDET state kept the saved
        run's ``total_steps``, so the replicas followed one schedule and HDET's final average the other (shortened:
        the run ended unaveraged, rank 0's model alone; lengthened: an error past the old end). HDET takes the
        Trainer's length. Returns the load warning's part that named the old length ("" if unchanged)."""
        want = getattr(self, "_hdet_total_steps", None)
        if want is None or want == sched.total_steps:
            return ""
        if want < sched.last_epoch:
            raise ValueError(f"Expected a run of at least the checkpoint's {sched.last_epoch} optimizer steps to "
                             f"resume {checkpoint}, but the Trainer's run has {want} (max_steps / num_train_epochs)")
        saved = sched.total_steps
        sched.set_total_steps(want)
        return f"total_steps {saved} (built with {want})"

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> Any:
        """The Trainer's token count of an accumulation window. With ``average_tokens_across_devices`` (its
        default) it is every rank's, and ``compute_loss`` returns ``own sum * world / all ranks' tokens``: a
        replica's loss weighted by its share of the tokens (with padding or masked labels, the replica with
        fewer tokens looks better). The ratio that turns it back into this rank's own per-token loss is kept
        for the window's losses (:meth:`training_step`); the gradients are left as the Trainer makes them."""
        n = super()._get_num_items_in_batch(batch_samples, device)
        self._hdet_token_scale = self._hdet_has_tokens = None
        args = self.args
        if n is not None and args.average_tokens_across_devices and args.world_size > 1 and args.n_gpu <= 1:
            args.average_tokens_across_devices = False
            try:
                own = super()._get_num_items_in_batch(batch_samples, device)  # this rank's count (no collective)
            finally:
                args.average_tokens_across_devices = True
            tp = self.get_tp_size() if hasattr(self, "get_tp_size") else 1  # (older transformers: no TP divisor)
            per_rank = self.accelerator.num_processes // tp  # compute_loss's multiplier
            own = torch.as_tensor(own, dtype=torch.float64, device=device)
            self._hdet_has_tokens = own.reshape(()) > 0  # (none: the loss is 0, a step that measured nothing; counted
            # as a loss of 0, it made that replica's window look better, and the paper controller ranked it so: an audit)
            own = own.clamp(min=1)
            self._hdet_token_scale = (torch.as_tensor(n, dtype=torch.float64, device=device) / (own * per_rank)).float()
        return n

    def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's own loss, noted as such: only its scaling by every rank's token count is undone
        (:meth:`_get_num_items_in_batch`); a subclass's ``compute_loss`` that does not call this one returns a loss
        hdet takes as it is (an audit: a plain per-token mean of the user's was rescaled, x0.6 and x2.4 at uneven
        token counts)."""
        self._hdet_trainer_loss = True
        return super().compute_loss(model, inputs, *args, **kwargs)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().train(*args, **kwargs)
        finally:  # (an error mid-step, before the optimizer step restored it)
            self._hdet_restore_max_grad_norm()

    def _hdet_restore_max_grad_norm(self) -> None:
        """The user's ``max_grad_norm`` back in ``args`` where :meth:`training_step` put an explored one in."""
        if self._hdet_max_grad_norm is not None:
            self.args.max_grad_norm, self._hdet_max_grad_norm = self._hdet_max_grad_norm, None

    def training_step(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        self._hdet_trainer_loss = False
        if not hasattr(Trainer, "_clip_grad_norm") and self._hdet_max_grad_norm is None:  # (older transformers: the
            clips = explored_clips(self.lr_scheduler) if isinstance(self.lr_scheduler, HDETLR) else []  # loop clips
            if clips:  # to args.max_grad_norm inline, and _clip_grad_norm was never called: every replica clipped
                # at the user's norm while hdet reported the explored ones, found on transformers 4.57; the explored
                # norm is put in args until the optimizer step is done, _HDETHooks.on_optimizer_step)
                self._hdet_max_grad_norm, self.args.max_grad_norm = self.args.max_grad_norm, clips[0].max_norm
        loss = super().training_step(model, inputs, *args, **kwargs)  # scaled for the window, as the Trainer logs it
        if isinstance(loss, torch.Tensor):
            if isinstance(self.lr_scheduler, HDETLR):  # (before the cast)
                self.lr_scheduler.ensemble.say_coarse(loss, "the Trainer's training loss")
            part = loss.detach().float().mean()
            if self._hdet_token_scale is not None and self._hdet_trainer_loss:
                part = part * self._hdet_token_scale  # averaged over every rank's tokens: back to this rank's own
                if self._hdet_has_tokens is not None:  # (one count for the optimizer step's micro-batches)
                    self._hdet_counted = self._hdet_has_tokens
            self._hdet_loss = part if self._hdet_loss is None else self._hdet_loss + part  # on the device
        return loss

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        """An evaluation during training (``eval_strategy``) measures the ensemble's average: between converge steps
        each rank's model is its own replica, and the Trainer's metrics were a mix of them, each on its share of the
        evaluation data (:meth:`hdet.HDETLR.swap_in_average`; nothing to do at a converge step or after training).
        Only the evaluation: a hyperparameter search's report (which may end a pruned trial) runs after it."""
        return self._with_average(lambda: super(HDETTrainer, self).evaluate(*args, **kwargs))

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        """A prediction during training (a callback's) measures the ensemble's average, as :meth:`evaluate` does
        (before, a mix of the replicas, each on its share of the data: an audit)."""
        return self._with_average(lambda: super(HDETTrainer, self).predict(*args, **kwargs))

    def _save_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """A checkpoint saved between converge steps holds the ensemble's average (the model the run is building),
        not rank 0's replica, which the Trainer would save; with rank 0's optimizer and scheduler state, as before.
        With the user's ``max_grad_norm`` in ``args`` (:meth:`_users_max_grad_norm`)."""
        with self._users_max_grad_norm():
            return self._with_average(lambda: super(HDETTrainer, self)._save_checkpoint(*args, **kwargs))

    def save_model(self, *args: Any, **kwargs: Any) -> Any:
        with self._users_max_grad_norm():
            return super().save_model(*args, **kwargs)

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> Any:
        with self._users_max_grad_norm():  # (its on_save callbacks after the checkpoint's save)
            return super()._maybe_log_save_evaluate(*args, **kwargs)

    @contextlib.contextmanager
    def _users_max_grad_norm(self) -> Iterator[None]:
        """The user's ``max_grad_norm`` in ``args`` while the model, the checkpoint and ``training_args.bin`` are
        saved, pushed to the Hub and told to the callbacks' ``on_save``: on a Trainer that clips inline an explored
        one is there between micro-steps, and a save after a stop mid-accumulation (the epoch's checkpoint) stored
        it (an audit, transformers 4.57), as its push did (a review). The explored one back after."""
        held = self._hdet_max_grad_norm
        if held is None:
            yield
            return
        explored, self.args.max_grad_norm = self.args.max_grad_norm, held
        try:
            yield
        finally:
            self.args.max_grad_norm = explored

    def _with_average(self, call: Any) -> Any:
        """``call()`` with the replicas' average in (once: not again inside an evaluation's save)."""
        sched = self.lr_scheduler
        if not isinstance(sched, HDETLR) or sched.average_swapped_in:
            return call()
        with sched.averaged():  # COLLECTIVES (off converge steps): on every rank, as the evaluation and the save
            return call()

    def _get_learning_rate(self) -> float:
        sched = self.lr_scheduler
        if isinstance(sched, HDETLR):
            return sched.base_lrs_now[0]  # the base schedule (mean over replicas), not this rank's multiplied LR
        return super()._get_learning_rate()


class _HDETHooks(TrainerCallback):
    """Observe the optimizer step's loss right after the step and before the Trainer steps the scheduler;
    install the gradient guard once the Trainer has wrapped the model."""

    def __init__(self, trainer: HDETTrainer) -> None:
        self.trainer = trainer
        self.logged: int | None = None  # the step of the last sync logged

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        t = self.trainer
        if isinstance(t.lr_scheduler, HDETLR):
            t.lr_scheduler.attach_model(t.model_wrapped)  # DDP under torchrun: the guard goes on it

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Each new sync's scalars as their own log entry at the sync's step (to every ``report_to`` tracker),
        whatever ``logging_steps`` is (joined to the Trainer's loss logs, syncs between two logs were lost and the
        others logged at the log's step)."""
        t = self.trainer
        sched = t.lr_scheduler
        if isinstance(sched, HDETLR) and t.accelerator.optimizer_step_was_skipped:
            sched.step()  # the Trainer does not step it after a step the GradScaler skipped: HDET counts that step
        rec = sched.last_sync if isinstance(sched, HDETLR) else None
        if rec is not None and rec.step != self.logged:
            self.logged = rec.step
            should_log = control.should_log  # the Trainer's own log of this step, if due (on_log clears the flag)
            t.log(sync_scalars(rec))
            control.should_log = should_log

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        t = self.trainer
        t._hdet_restore_max_grad_norm()  # (older transformers: the explored norm was in args for the clip)
        loss, t._hdet_loss = t._hdet_loss, None
        counted, t._hdet_counted = t._hdet_counted, True
        if loss is not None and isinstance(t.lr_scheduler, HDETLR):  # (a step the GradScaler skipped counts too)
            t.lr_scheduler.observe(loss, counted)  # this rank's own loss of the step, on its device; one with no
            # label token left out of its window's mean


def _best_files_here(checkpoint: str) -> bool:
    """Whether this rank sees the files the Trainer loads a best checkpoint from (its ``_load_best_model``'s test)."""
    from transformers.utils import (ADAPTER_SAFE_WEIGHTS_NAME, ADAPTER_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME,
                                    SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME)

    return any(os.path.exists(os.path.join(checkpoint, name)) for name in (
        WEIGHTS_NAME, SAFE_WEIGHTS_NAME, ADAPTER_WEIGHTS_NAME, ADAPTER_SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME,
        WEIGHTS_INDEX_NAME))


def _weights_mark(model: torch.nn.Module) -> torch.Tensor:
    """A fingerprint of the model's parameters (:func:`hdet.sync.fingerprint`): equal before and after a load that
    changed nothing."""
    params = [p.detach() for p in model.parameters() if p.is_floating_point()]  # (not a quantized model's integers)
    dev = params[0].device if params else torch.device("cpu")
    return fingerprint(params, [True] * len(params), dev)


class _HDETFinish(TrainerCallback):
    """Training stopped before ``total_steps`` (``EarlyStoppingCallback``, ``control.should_training_stop``): the
    replicas are averaged when it ends (:meth:`hdet.HDETLR.finish`, on every rank), before any other callback's
    ``on_train_end`` (this one is first in the list); not after ``load_best_model_at_end`` loaded the best checkpoint
    (already the average, on every rank)."""

    def __init__(self, trainer: HDETTrainer) -> None:
        self.trainer = trainer

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer._hdet_restore_max_grad_norm()  # (a stop between training_step and the optimizer step: a review)
        sched = self.trainer.lr_scheduler
        if args.load_best_model_at_end and state.best_metric is not None \
                and self.trainer._hdet_settle_best():  # COLLECTIVE (entered on every rank: best_metric comes from the
            # evaluations, the same everywhere; best_model_checkpoint only where its folder was on the rank's disk)
            # the Trainer has just loaded the best checkpoint (the replicas' average, the same on every rank): that
            # is the run's result. A closing sync would judge the windows of the weights it replaced, and a rise there
            # sent every replica back to the stability guard's best sync, over the model loaded (an audit). Where no
            # rank could load it, each rank still held its own replica, and the run ended unaveraged (an audit)
            return
        if isinstance(sched, HDETLR):
            rec = finish_at_train_end(sched)
            if rec is not None:  # that sync's scalars, as every sync's (to every report_to tracker: an audit)
                self.trainer.log(sync_scalars(rec))
