"""What a scheduler checks about the ``DistributedDataParallel`` module around its replica: :class:`DDPWatch`.

DDP does three things without a word that would leave a run reading as HDET while it is not:

- **one replica's NaN or Inf gradient reaches every replica** through DDP's all-reduce where no gradient guard is on
  (``model=`` left out, or given the module inside DDP): said at the first step (:meth:`DDPWatch.first_step`);
- **a parameter unfrozen after DDP was built is not all-reduced** (DDP fixes what its buckets hold when it is built):
  each replica trains it on its own batches alone; said at a converge step (:meth:`DDPWatch.check_unfrozen`);
- **``broadcast_buffers=True`` copies rank 0's buffers** to every rank at each forward, so an explored value kept in a
  buffer trains every replica at rank 0's while the records show the spread: said after the first step.

Each is said once, on every rank it concerns; host-side only (no collectives), one host read of the explored values
before the first step. :class:`hdet.HDETLR` keeps one watch.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .caller import user_stacklevel
from .guard import uncompiled
from .warm_init import warm_noise_overwritten

__all__ = ["DDPWatch"]

DDP = torch.nn.parallel.DistributedDataParallel


class DDPWatch:
    """The DDP module given to one replica's scheduler (``model=``, :meth:`hdet.HDETLR.attach_model`) and what it was
    found to train; whether the first step has been checked; the explored values as they read back before it."""

    def __init__(self) -> None:
        self.started = False  # the first step's checks ran (first_step)
        self.trained: tuple[DDP, set[int]] | None = None  # the DDP given and the parameters its all-reduce holds
        self.values_set: list[float] | None = None  # each explored value as it read back when set, before the first
        # step (the scheduler records it: compared once after it, under broadcast_buffers)

    def note(self, model: nn.Module | None) -> None:
        """A DDP module handed over (``model=``, or ``attach_model``: one built again after unfreezing, as
        :meth:`check_unfrozen` advises): the parameters that require grad now, what its all-reduce holds where it was
        built just before (checked at each converge step against what requires grad then). Where they disagree with
        the count and size DDP logged when it was built (a layer unfrozen in between: a review), DDP's own buckets are
        the reference. The same DDP again keeps what it had (host-side only)."""
        ddp = uncompiled(model) if model is not None else None
        if isinstance(ddp, DDP) and (self.trained is None or self.trained[0] is not ddp):
            trained = _trained_ids(ddp)
            if not _as_built(ddp):
                trained = _reduced_ids(ddp) or trained
            self.trained = (ddp, trained)

    def check_unfrozen(self) -> None:
        """At a sync step under DDP: a parameter that requires grad now but did not when the DDP module was given
        (unfrozen mid-run, a fine-tuning schedule's usual move) is not in DDP's all-reduce, which is fixed when DDP is
        built: each replica trained it on its own batches alone, and only the converge steps averaged it, while the
        run read as data-parallel (torch's DDP says nothing either). One that looks so is looked up in DDP's own
        buckets (one trainable when DDP was built, frozen and unfrozen since, is all-reduced: an audit), which are the
        reference from then on. Said once, on every rank, naming it (host-side only)."""
        if self.trained is None:
            return
        ddp, trained = self.trained
        new = [(n, p) for n, p in _trainable(ddp) if p.requires_grad and id(p) not in trained]
        if new:
            reduced = _reduced_ids(ddp)
            if reduced is not None:
                self.trained = (ddp, reduced)
                new = [(n, p) for n, p in new if id(p) not in reduced]
        if new:
            self.trained = None
            more = f" and {len(new) - 1} more" if len(new) > 1 else ""
            warnings.warn(f"hdet: the parameter {new[0][0]!r}{more} requires grad now but did not when DDP was built "
                          "(unfrozen mid-run?): DistributedDataParallel all-reduces only the gradients of the "
                          "parameters that required grad when it was built, so each replica has trained it on its own "
                          "batches alone since, averaged only at HDET's converge steps. Build DDP again right after "
                          "a converge step (or with init_sync=False, torch >= 2.5) and give it to "
                          "scheduler.attach_model() to train it data-parallel, or unfreeze it before building DDP",
                          stacklevel=user_stacklevel())

    def first_step(self, model: nn.Module | None, unguarded: bool, hypers: Sequence[Any], rank: int) -> None:
        """At the first step (once): where ``unguarded`` (a process group's replica whose gradient guard is asked for
        but not installed), why; under a DDP model, its broadcast of the weights is no longer warm init's noise
        overwritten (:func:`hdet.warm_init.warm_noise_overwritten`), and the explored values ``hypers`` are checked
        against :attr:`values_set` (``broadcast_buffers``)."""
        self.started = True
        if unguarded:
            _say_no_guard(model)
        ddp = uncompiled(model) if model is not None else None
        if isinstance(ddp, DDP):  # (trained from here: a later DDP over it is no broadcast of the noise)
            warm_noise_overwritten(ddp.module.parameters(), forget=True)
            self._check_values_kept(ddp, hypers, rank)

    def _check_values_kept(self, ddp: DDP, hypers: Sequence[Any], rank: int) -> None:
        """Each explored value still the one set for the first step. DDP's default ``broadcast_buffers=True`` copies
        rank 0's buffers to every rank at each forward, so a value kept in a buffer (a ``Setter`` writing it in place)
        trained every replica at rank 0's while the records showed the spread (a review). Said once, on the ranks whose
        value moved, against what each value read back as right after it was set; read under such a DDP only (HOST
        SYNC, once)."""
        if not getattr(ddp, "broadcast_buffers", False):
            return
        said = [(h.name, v, h.get()) for h, v in zip(hypers, self.values_set or [])]
        moved = [(n, v, g) for n, v, g in said if g != v and not (math.isnan(g) and math.isnan(v))]
        if moved:
            name, v, got = moved[0]
            warnings.warn(f"hdet: the explored {name!r} on rank {rank} is {got:.6g} after the first step, not the "
                          f"{v:.6g} hdet set for it, so this replica trained at another value than its records say: "
                          "this DDP has broadcast_buffers=True, which copies rank 0's buffers to every rank at each "
                          "forward. Build it with broadcast_buffers=False where a buffer holds an explored value",
                          stacklevel=user_stacklevel())


def _say_no_guard(model: nn.Module | None) -> None:
    """A process group's replica whose gradient guard is asked for (``guard_gradients``, on by default) but not
    installed because the scheduler never got a DDP module (``model=`` left out, or the module DDP wraps: its
    ``.module``, the one ``warm_init_`` takes). Under DDP one rank's NaN gradient then reached every replica through the
    all-reduce, and the run stopped, or went back and cut its LR, at the next converge step, with no word why (an
    audit): said once, on every rank."""
    got = ("model= was not given" if model is None else
           f"model= is a {type(uncompiled(model)).__name__}, not a DistributedDataParallel module (DDP(...) "
           "returns one; its .module is the model inside)")
    warnings.warn(f"hdet: no gradient guard on this replica: {got}. If the model is wrapped in DDP, one replica's "
                  "NaN or Inf gradient reaches every replica through the gradients' all-reduce, and the run stops "
                  "(or, with on_runaway='recover', goes back and cuts its LR) at the next converge step. Pass "
                  "model= the DDP-wrapped model (or device_mesh= for FSDP2/HSDP; integrations call "
                  "attach_model), or guard_gradients=False to run without the guard",
                  stacklevel=user_stacklevel())


def _trainable(ddp: DDP) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters of a DDP module that DDP does not ignore (``_set_params_and_buffers_to_ignore_for_model``)."""
    ignored = getattr(ddp, "parameters_to_ignore", ()) or ()
    return [(n, p) for n, p in ddp.module.named_parameters() if n not in ignored]


def _trained_ids(ddp: DDP) -> set[int]:
    """The parameters that require grad in a DDP module now (at the first step: what DDP's all-reduce holds)."""
    return {id(p) for _, p in _trainable(ddp) if p.requires_grad}


def _as_built(ddp: DDP) -> bool:
    """Whether the parameters that require grad now match, in number and bytes, those DDP logged at its
    construction (what its all-reduce holds); True where this torch does not say (host-side, no allocation)."""
    try:
        built = ddp._get_ddp_logging_data()
        now = [p for _, p in _trainable(ddp) if p.requires_grad]
        return (int(built["num_parameter_tensors"]) == len(now) and
                int(built["total_parameter_size_bytes"]) == sum(p.numel() * p.element_size() for p in now))
    except (AttributeError, KeyError, RuntimeError, TypeError, ValueError):
        return True


def _reduced_ids(ddp: DDP) -> set[int] | None:
    """The parameters in DDP's reducer's buckets: what its all-reduce holds, fixed when it was built; None where this
    torch or DDP does not say. (Zeroed copies of the buckets for a moment: looked up only where a parameter looks
    unfrozen, once per DDP.)"""
    try:
        return {id(p) for b in ddp.reducer._get_zeros_like_grad_buckets() for p in b.parameters()}
    except (AttributeError, RuntimeError, TypeError):
        return None
