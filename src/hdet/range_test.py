"""``lr_range_test=True``: an LR range test inside the run, during the warm-up (issue 15, item 3).

The user's peak LR becomes a first guess. From step 0 to ``auto_lr_warmup_steps`` (the warm-up), the LR
schedule is multiplied by a factor ``c`` that starts at ``RANGE_START`` (1/25: a start 10x too high still
begins with a gentle warm-up; measured, a transformer's first 50 steps at its best LR without one left it
damaged for good) and grows by ``growth`` at every sync (``growth = (range_max_factor / RANGE_START) ** (T /
S_warm)``, at most 2: unchecked, it reaches ``range_max_factor`` at the end of the warm-up), so the ramp
runs past the user's ``max_lr`` when that is too low. The test ends when the LR is too
high, which the ensemble's median window loss ``L_k`` shows (every replica sees the same numbers):

* its improvement collapses: ``(L_{k-1} - L_k) / L_{k-1}`` falls below ``COLLAPSE`` of the median
  improvement of the ramp's windows so far (measured on the GPT: the improvement falls from 7-12% a window
  to under 3% one or two windows before the loss rises; ``benchmarks/results/evidence/signals``),
* or it makes no new best for ``range_patience`` windows,
* or the stability guard sees a runaway replica or a rising loss (:mod:`hdet.stability`).

The peak LR becomes ``P = lr_good / range_backoff``, where ``lr_good`` is slot 0's LR at the end of the
last window before the one that ended the test. A transformer is damaged by a few dozen steps far above
its best LR before its loss shows it (measured: going back to the best sync alone left the GPT 7% short),
so every replica goes back to the ramp's last sync whose LR was at most ``P`` (:class:`RampSnapshots`):
the state of a warm-up to ``P``. For the rest of the warm-up the LR stays at ``P``; after it, the
schedule's own shape continues from ``P`` (the LR is ``P * s(t) / max_s``, ``s`` the schedule, ``max_s``
its peak so far). A test that sees no edge by the end of the warm-up ends at ``P = lr_good`` (the
highest LR that still made progress).

The decisions are pure arithmetic on gathered numbers: every replica decides the same, with no
communication.
"""

from __future__ import annotations

import math
import statistics
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .caller import user_stacklevel
from .stability import Copier, copy_kept, fit_snapshot, same_layout, same_shape

__all__ = ["RangeTest", "RampSnapshots", "MAX_RANGE_GROWTH", "COLLAPSE", "RANGE_START"]

RANGE_START = 1 / 25  # the ramp starts at this fraction of the schedule (OneCycle: max_lr / 625)

MAX_RANGE_GROWTH = 2.0  # the ramp at most doubles the LR from one window to the next (short warm-ups)
COLLAPSE = 1 / 3  # an improvement below this fraction of the ramp's median improvement ends the test


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
    last_loss: float | None = None  # the previous window's median loss
    improvements: list[float] = field(default_factory=list)  # per window of the ramp: (L_{k-1} - L_k) / L_{k-1}
    good_lr: float | None = None  # slot 0's LR at the end of the last window that made progress
    peak: float | None = None  # P, once the test has ended
    ended_at: int | None = None  # the sync step where it ended
    reason: str | None = None  # why: "collapse", "stalled", "runaway", "rising" or "warm-up over"

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

    def keep_from(self) -> float:
        """The lowest peak the test can still end at: snapshots of windows at lower LRs are no longer needed."""
        return (self.good_lr or 0.0) / self.backoff

    def update(self, t: int, window_lr: float, loss: float, stale_windows: int, runaway: bool, rising: bool,
               last: bool) -> bool:
        """One sync of the ramp. ``window_lr``: slot 0's LR at the end of the window that just ended; ``loss``:
        its median window loss (NaN: none finite); ``stale_windows``: windows since the best one. Returns
        whether the test ended here because the LR is too high (the caller then goes back)."""
        reason = "runaway" if runaway else "rising" if rising else None
        if reason is None and not math.isfinite(loss):
            reason = "rising"
        if reason is None and self.last_loss is not None and self.last_loss != 0:
            gain = (self.last_loss - loss) / abs(self.last_loss)  # (a loss below 0, a Gaussian NLL's: the same sign)
            if len(self.improvements) >= 2 and gain < COLLAPSE * max(statistics.median(self.improvements), 0.0):
                reason = "collapse"
            self.improvements.append(gain)
        if reason is None and stale_windows >= self.patience:
            reason = "stalled"
        if reason is None:
            self.good_lr, self.last_loss = window_lr, loss
        if self.good_lr is None:  # too high from the first window on
            self.good_lr = window_lr / self.growth
        if reason is not None:
            self._end(t, self.good_lr / self.backoff, reason)
            return True
        if last:
            self._end(t, self.good_lr, "warm-up over")
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
        for name in ("factor", "good_lr", "peak"):
            v = getattr(rt, name)
            if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                                      and v > 0):
                raise ValueError(f"Expected the range test's {name} as a positive number, but got {v!r}")
        if not (isinstance(rt.patience, int) and not isinstance(rt.patience, bool) and rt.patience >= 1):
            raise ValueError(f"Expected the range test's patience as an integer >= 1, but got {rt.patience!r}")
        last = rt.last_loss
        if last is not None and not (isinstance(last, (int, float)) and not isinstance(last, bool)
                                     and math.isfinite(last)):
            raise ValueError(f"Expected the range test's last_loss as a finite number or None, but got {last!r}")
        if (rt.ended_at is None) != (rt.peak is None) or (rt.ended_at is not None and (
                not isinstance(rt.ended_at, int) or isinstance(rt.ended_at, bool) or rt.ended_at < 0)):
            raise ValueError(f"Expected the range test's ended_at (a step) and peak both set or both None, but got "
                             f"{rt.ended_at!r} and {rt.peak!r}")
        if not isinstance(rt.improvements, list) or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) for x in rt.improvements):
            raise ValueError(f"Expected the range test's improvements as a list of numbers, but got {rt.improvements!r}")
        rt.improvements = [float(x) for x in rt.improvements]
        return rt


class RampSnapshots:
    """The averaged tensors (weights, buffers, optimizer state) at the ramp's recent syncs, with each sync's
    step, LR and median loss: what the range test goes back to. Only the snapshots the test can still go
    back to are kept (those from the last one at an LR below :meth:`RangeTest.keep_from` on): with the
    default settings three to five copies, on the tensors' devices, during the warm-up only."""

    def __init__(self) -> None:
        self.items: list[tuple[int, float, float, list[torch.Tensor]]] = []
        self.copier = Copier()

    @torch.no_grad()
    def add(self, step: int, lr: float, loss: float, tensors: list[torch.Tensor], keep_from: float) -> None:
        older = [i for i, item in enumerate(self.items) if item[1] <= keep_from]
        recycled = None
        if len(older) > 1:  # only the latest one below keep_from can still be gone back to
            drop = set(older[:-1])
            recycled = self.items[older[0]][3]
            self.items = [item for i, item in enumerate(self.items) if i not in drop]
        copy = self.copier(tensors, recycled if recycled is not None and same_layout(recycled, tensors, strict=True) else None)
        self.items.append((step, lr, loss, copy))

    @torch.no_grad()
    def go_back(self, peak: float, tensors: list[torch.Tensor]) -> tuple[int, float] | None:
        """Copy the latest snapshot at an LR of at most ``peak`` (else the earliest kept) into ``tensors``;
        returns its (step, loss), or None when nothing is kept."""
        fits = [item for item in self.items if item[1] <= peak and same_layout(item[3], tensors)]
        item = fits[-1] if fits else next((i for i in self.items if same_layout(i[3], tensors)), None)
        if item is None:
            return None
        copy_kept(tensors, item[3])
        return item[0], item[2]

    def clear(self) -> None:
        self.items = []

    def state_dict(self) -> list[list[Any]]:
        return [[step, lr, loss, self.copier.saved(ts)] for step, lr, loss, ts in self.items]

    @staticmethod
    def parse(state: Any) -> list[tuple[int, float, float, list[torch.Tensor]]]:
        """A saved list of snapshots, checked (an absent one: none)."""
        if state is None:
            return []
        ok = isinstance(state, list) and all(
            isinstance(x, list) and len(x) == 4 and isinstance(x[0], int) and isinstance(x[1], float)
            and math.isfinite(x[1]) and x[1] > 0 and isinstance(x[2], float) and isinstance(x[3], list)
            and all(isinstance(t, torch.Tensor) for t in x[3])
            for x in state)
        if not ok:
            raise ValueError("Expected the range test's snapshots as [step, lr (> 0), loss, [tensors]] lists: a "
                             "corrupted state_dict")
        return [(x[0], x[1], x[2], x[3]) for x in state]

    def load(self, items: list[tuple[int, float, float, list[torch.Tensor]]], tensors: list[torch.Tensor],
             counts: int = 0, optimizer_empty: bool = False, also: int = 0) -> None:
        """Set parsed snapshots onto the devices of ``tensors`` (snapshots of another layout are dropped, with a
        warning; ``counts``, ``also``: see :func:`hdet.stability.fit_snapshot`)."""
        items = [(step, lr, loss, fit_snapshot(ts, tensors, counts, also)) for step, lr, loss, ts in items]
        self.items = [(step, lr, loss, [s.to(t.device, t.dtype, copy=True) for s, t in zip(ts, tensors)])
                      for step, lr, loss, ts in items if len(ts) == len(tensors)
                      and all(same_shape(s, t) for s, t in zip(ts, tensors))]
        if len(self.items) < len(items):
            warnings.warn(f"hdet: {len(items) - len(self.items)} of the checkpoint's range-test snapshots do not fit "
                          f"this run's {len(tensors)} tensors"
                          + (" (the optimizer holds no state yet: load the optimizer's state_dict before the "
                             "scheduler's)" if optimizer_empty and any(len(ts) > len(tensors) for _, _, _, ts in items)
                             else "")
                          + ": dropped (the test can go back only to the others)", stacklevel=user_stacklevel())

