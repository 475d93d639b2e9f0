"""Framework integrations (each an optional extra; the core depends on torch only)."""

from __future__ import annotations

import warnings
from typing import Any

from ..caller import user_stacklevel


def explored_clips(sched: Any) -> list[Any]:
    """The scheduler's explored ``hdet.GradClip`` (at most one: each would clip the same gradients)."""
    from ..hyper import GradClip

    clips = [h for h in sched.ensemble.hypers if isinstance(h, GradClip)]
    if len(clips) > 1:
        raise ValueError(f"Expected at most one explored hdet.GradClip per scheduler (each clips the same gradients), "
                         f"but got {len(clips)}")
    return clips


def finish_at_train_end(sched: Any) -> Any:
    """At a framework's end of training: :meth:`hdet.HDETLR.finish`, and a warning when it averaged (the run
    stopped before ``total_steps``, off a converge step). Returns that sync's record (None when it did not
    average), for the integration to log as it logs every sync. The scheduler stays open (a checkpoint Lightning writes
    after this, ``last.ckpt``, must resume into more steps: closing here broke that, a review); each rank keeps its own
    LR and explored values until :meth:`hdet.HDETLR.close` (docs/hf_trainer.md)."""
    sched.swap_back()  # (an evaluation that raised may have left the average in: each replica's own first)
    rec = sched.finish()
    if rec is not None:
        warnings.warn(f"hdet: training ended after optimizer step {sched.last_epoch}, before total_steps="
                      f"{sched.total_steps} and off a converge step: the replicas were averaged then (a checkpoint "
                      "saved since the last converge step without sched.averaged() holds one replica, not the "
                      "average; HDETTrainer's and HDETCallback's full checkpoints hold the average)",
                      stacklevel=user_stacklevel())
    return rec
