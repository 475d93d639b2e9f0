"""``lr_range_test=True``: an LR range test inside the run, during the warm-up (issue 15, item 3).

The user's peak LR becomes a first guess. From step 0 to ``auto_lr_warmup_steps`` (the warm-up), the LR
schedule is multiplied by a factor ``c`` that grows by ``growth`` at every sync (``growth =
range_max_factor ** (T / S_warm)``, at most 2: unchecked, it reaches ``range_max_factor`` at the end of the
warm-up),
so the ramp runs past the user's ``max_lr`` when that is too low. The test ends when the LR is too high:

* the ensemble's median window loss has made no new best for ``range_patience`` windows (the loss
  stalls: measured, this comes one to three windows before it rises; ``benchmarks/results/evidence/signals``),
* or the stability guard sees a runaway replica or a rising ensemble loss (:mod:`hdet.stability`).

Then every replica goes back to the state of the best sync, and the peak LR becomes ``P = lr_best /
range_backoff``, where ``lr_best`` is slot 0's LR at the end of the best window. For the rest of the
warm-up the LR stays at ``P``; after it, the schedule's own shape continues from ``P`` (the LR is
``P * s(t) / max_s``, ``s`` the schedule, ``max_s`` its peak so far). A test that finds no edge by the end
of the warm-up ends at ``P = lr_best`` (the highest LR that still made a new best).

Every replica computes the same from the same gathered numbers: no communication. Pure Python.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["RangeTest", "MAX_RANGE_GROWTH"]

MAX_RANGE_GROWTH = 2.0  # the ramp at most doubles the LR from one window to the next (short warm-ups)


@dataclass
class RangeTest:
    """The state of one range test (slot 0's LR decides; every LR slot is scaled alike).

    ``factor`` (c) multiplies the LR schedule while the ramp runs; once it has ended, :meth:`scale` keeps
    slot 0's LR at ``peak`` (P) relative to the schedule's peak so far."""

    growth: float  # c's factor per sync
    max_factor: float  # c never exceeds this
    backoff: float
    patience: int  # windows without a new best that end the test
    factor: float = 1.0  # c
    best_lr: float | None = None  # slot 0's LR at the end of the window with the best loss so far
    peak: float | None = None  # P, once the test has ended
    ended_at: int | None = None  # the sync step where it ended
    reason: str | None = None  # why: "stalled", "runaway", "rising" or "warm-up over"

    def __post_init__(self) -> None:
        for name in ("growth", "max_factor", "backoff"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 1):
                raise ValueError(f"Expected the range test's {name} >= 1, but got {v!r}")

    @property
    def ramping(self) -> bool:
        return self.peak is None

    def scale(self, peak0: float) -> float:
        """What multiplies every LR slot's schedule now, given slot 0's schedule peak so far (``peak0``)."""
        if self.peak is None:
            return self.factor
        return self.peak / peak0 if peak0 > 0 else 1.0

    def update(self, t: int, window_lr: float, new_best: bool, stale_windows: int, runaway: bool, rising: bool,
               last: bool) -> bool:
        """One sync of the ramp. ``window_lr``: slot 0's LR at the end of the window that just ended;
        ``new_best``: its loss is the best so far; ``stale_windows``: windows since the best one. Returns
        whether the test ended here because the LR is too high (the caller then goes back to the best sync)."""
        if new_best or self.best_lr is None:
            self.best_lr = window_lr
        reason = "runaway" if runaway else "rising" if rising else (
            "stalled" if stale_windows >= self.patience else None)
        if reason is not None:
            self._end(t, self.best_lr / self.backoff, reason)
            return True
        if last:
            self._end(t, self.best_lr, "warm-up over")
        else:
            self.factor = min(self.factor * self.growth, self.max_factor)
        return False

    def _end(self, t: int, peak: float, reason: str) -> None:
        self.peak, self.ended_at, self.reason = peak, t, reason

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state(cls, state: Any) -> "RangeTest":
        if not isinstance(state, dict):
            raise ValueError(f"Expected the range test's state as a dict, but got {type(state).__name__}")
        try:
            rt = cls(**state)
        except TypeError as e:
            raise ValueError(f"Expected a range test state with keys {sorted(cls.__dataclass_fields__)}: {e}") from e
        for name in ("factor", "best_lr", "peak"):
            v = getattr(rt, name)
            if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"Expected the range test's {name} as a positive number, but got {v!r}")
        return rt
