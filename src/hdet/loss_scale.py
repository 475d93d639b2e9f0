"""``torch.amp.GradScaler`` as hdet meets it: found among the optimizer step's callers (torch tells an optimizer
nothing of the scaler that steps it), and its loss scale taken back to a healthy sync's when hdet resets a replica."""

from __future__ import annotations

import sys
import warnings
from typing import Any

import torch

from .caller import user_stacklevel

__all__ = ["driving_scaler", "LossScale"]


def driving_scaler(depth: int = 12) -> tuple[Any, dict[str, Any]] | None:
    """The ``torch.amp.GradScaler`` whose ``step`` is running this optimizer step, with its state for the optimizer
    (``optimizer_state``), from the callers' frames (``GradScaler.step`` / ``_maybe_opt_step``); None when no
    scaler drives it. Call it from an optimizer step hook."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return None
        if frame.f_code.co_name in ("_maybe_opt_step", "step"):
            local = frame.f_locals
            scaler = local.get("self")
            if isinstance(scaler, torch.amp.GradScaler) and isinstance(local.get("optimizer_state"), dict):
                return scaler, local["optimizer_state"]
        frame = frame.f_back
    return None


def _the_only_scaler() -> Any:
    """The one ``torch.amp.GradScaler`` in use (its scale made) among the callers' local variables (the training
    loop's), else among the process's live objects; None when there is none or more than one. For a run resumed
    inside an overflow stall: every step since was skipped, so no optimizer step showed the scaler, and a reset left
    its collapsed scale (16x below the whole run's in an audit). At such a reset only: a walk up the stack, and at
    most once a collection and one walk of the garbage collector's objects."""
    def scalers(objects: Any) -> list[Any]:
        seen = {id(o): o for o in objects if issubclass(type(o), torch.amp.GradScaler)  # (type(): no __class__ read)
                and isinstance(getattr(o, "_scale", None), torch.Tensor)}
        return list(seen.values())

    frame, found = sys._getframe(1), []
    while frame is not None and not found:
        found = scalers(frame.f_locals.values())
        frame = frame.f_back
    if len(found) != 1:
        import gc

        gc.collect()  # (a scaler of an earlier run in this process, unreachable but not yet collected, is not this one)
        found = scalers(gc.get_objects())
    return found[0] if len(found) == 1 else None


class LossScale:
    """The GradScaler that drives an optimizer, once seen, and its scale at the last healthy sync.

    A replica whose weights turn non-finite makes every step overflow on every replica until hdet resets it (at a
    converge step, or the "skip" guard's early recovery): the scaler skips each step meanwhile and halves its scale
    each time, down to where fp16 gradients underflow (a scale of 1e-14 after 56 such steps from 1024), and at its
    growth of 2x per 2000 clean steps training barely moves again. So when hdet resets a replica the scale goes back
    to the scale of the last optimizer step taken (kept by the gradient guard's watch at every step:
    :meth:`step_taken`), or of the last sync whose window held no non-finite loss if later (and its growth count
    starts again). A device copy of the scale at such points; no host sync. The kept scale is part of
    the scheduler's state (:meth:`kept_value`, :meth:`set_kept`): a resumed run goes back to it as the whole run does."""

    def __init__(self) -> None:
        self.scaler: Any = None
        self._kept: torch.Tensor | float | None = None  # (a float: loaded from a checkpoint, before the scaler is seen)
        self._searched = False  # whether a reset has looked for the scaler among the live objects

    def look(self) -> None:
        """From an optimizer step hook: the scaler driving this step, if any (kept once found)."""
        if self.scaler is None:
            found = driving_scaler()
            self.scaler = None if found is None else found[0]

    def copy(self) -> torch.Tensor | None:
        """A device copy of the scale now (None without a scaler in use); no host sync."""
        scale = getattr(self.scaler, "_scale", None)
        return scale.detach().clone() if isinstance(scale, torch.Tensor) else None

    def keep(self, scale: torch.Tensor | None) -> None:
        """``scale`` (a :meth:`copy`) is healthy: a recovery goes back to it. The guards' watches keep one after
        a stretch of steps that were taken, between converge steps (a reset before the first healthy sync)."""
        if scale is not None:
            self._kept = scale

    def step_taken(self, found: torch.Tensor | None) -> None:
        """After each optimizer step under a GradScaler: keep the scale when that step was taken, ``found``
        the step's skip flag on the device (> 0: skipped; None: taken, known on the host). A recovery then goes
        back to the scale of the last step taken before the stall, even one that starts before any stretch of taken
        steps or healthy sync (before, the scale stayed collapsed: 16384 -> 1.2e-4 with a NaN weight at step 3).
        One small kernel a step, no host sync; nothing without a scaler in use."""
        scale = getattr(self.scaler, "_scale", None)
        if not isinstance(scale, torch.Tensor):
            return
        if found is None or self._kept is None:
            self._kept = scale.detach().clone()
            return
        kept = (self._kept.to(scale.device) if isinstance(self._kept, torch.Tensor)
                else torch.full_like(scale, self._kept))  # (a float from a checkpoint: a fill, no host copy)
        self._kept = torch.where(found.to(scale.device) > 0, kept, scale.detach())

    def kept_value(self) -> float | None:
        """The kept scale as a float, for a checkpoint (a host read), or None."""
        return None if self._kept is None else float(self._kept)

    def set_kept(self, value: float | None) -> None:
        """The kept scale from a checkpoint (:meth:`kept_value`)."""
        self._kept = None if value is None else float(value)

    def after_sync(self, recovered: bool, healthy: bool) -> None:
        """After a converge step (or an early recovery): back to the kept scale where a replica was reset, else keep
        this one when the window was healthy."""
        if recovered and self.scaler is None and self._kept is not None and not self._searched:
            self._searched = True  # (once: a search that found none finds none again)
            self.scaler = _the_only_scaler()  # (resumed into a stall: no step taken since, so none seen; an audit)
            if self.scaler is None:
                warnings.warn("hdet: a replica was reset, and the checkpoint kept a GradScaler's scale to put back, but "
                              "no optimizer step has shown which GradScaler drives this optimizer since the resume "
                              "and this process holds none or several: its scale is left as it is (collapsed by the "
                              "skipped steps, it grows back at the scaler's own pace)", stacklevel=user_stacklevel())
        scale = getattr(self.scaler, "_scale", None)
        if not isinstance(scale, torch.Tensor):  # no scaler, or not yet used
            return
        if recovered:
            if self._kept is None:
                return
            if isinstance(self._kept, float):  # (loaded from a checkpoint)
                scale.fill_(self._kept)
            else:
                scale.copy_(self._kept)
            tracker = getattr(self.scaler, "_growth_tracker", None)
            if isinstance(tracker, torch.Tensor):
                tracker.zero_()
        elif healthy:
            self.keep(self.copy())
