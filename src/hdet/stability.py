"""``on_runaway="recover"``: what the ensemble does when training turns unstable while every value is finite.

At each sync, from the replicas' window losses (the same numbers on every replica, so every replica
decides the same, with no communication):

* a **runaway** replica, whose window loss is far above the others' (more than ``outlier_threshold``
  deviations above the median: 1.4826 MAD across replicas, but at least 2% of the median and the standard
  error of one replica's window mean) and above the best ensemble loss so far, is left out of the average
  and reset to the others' mean, like a non-finite one (among 3 replicas or more: of two, neither is an outlier);
* the ensemble is **rising** when its median window loss is above the best so far by more than
  ``rise_threshold`` of it and by more than ``NOISE_Z`` standard errors of the two windows' losses (from
  the spread of the step losses inside the windows: a noisy loss's plateau is not a rise): then every
  replica goes back to the weights (and optimizer state) it had, averaged, at the sync with the best
  loss, kept in memory like a checkpoint;
* either way the LR schedule is cut for the rest of the run, the k-th time by ``lr_cut ** k``, to
  ``MIN_LR_SCALE`` at most.

Both are judged over windows of at least ``judge_steps`` (25) steps: where T is shorter, ``ceil(judge_steps / T)``
windows are pooled (each replica's loss sums added up) and only every such sync judges them, and keeps a best sync
(where its last window is no more than ``rise_threshold`` above the pool's loss: the pool lags the state kept); at every
sync a window no noise explains is acted on (a replica's loss 10x the median's magnitude above it, an ensemble's 10x
its best's); the run's last sync (``total_steps``, or ``finish()``'s) judges what is pooled (a rise by a margin
wider as the pool is shorter; no best from it). Before the first
judgment, a clean sync at or below the first step's loss (the lowest so far) is where a collapse goes back to: the
same state on every replica, so that a checkpoint of one rank's state at a converge step holds every rank's.
Short windows' losses move together by more than their steps' spread says (on a 128M GPT, 5-step windows rose 7-14%
above a lucky best while the loss fell, and the rule went back three times and cut the LR to 0.12x: an audit of
``benchmarks/results/gpu_4x_h200/gpt128m_sweep/``). Non-finite values are acted on at every sync.

Every replica non-finite at once (a collapse) goes back to the best sync too. Before the first best sync, the state
after the run's first step is kept (:meth:`StabilityGuard.keep_start`, where every replica's is healthy; again, before
the first sync, at a step where it stops fitting the optimizer's state: :meth:`StabilityGuard.keep_start_again`): a
collapse or a window with no finite loss goes back there, and a sync ``RISE_CEILING`` times the first step's loss
magnitude above it is no best; one that is also that many times the last or the lowest window's loss magnitude above
it (a blow-up) is a rise, back to the start, unless the first step's loss is within ``NEAR_ZERO`` of 0.

Memory: one copy of the averaged tensors and the optimizer state per replica (taken at syncs, and at the start); in the
one-process engine, tensors that the replicas share (its one copy of the moments) are copied once
(:class:`SharedCopies`).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import warnings
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import torch

from .caller import user_stacklevel
from .config import HDETConfig, _is_real
from .sync import memory_key

__all__ = ["StabilityGuard", "NOISE_Z", "MIN_LR_SCALE", "Copier", "SharedCopies", "fit_snapshot"]

NOISE_Z = 4.0  # a rise must exceed this many standard errors of the window losses
MIN_LR_SCALE = 1 / 64  # the LR schedule is never cut below this fraction of itself
RISE_CEILING = 9.0  # a window loss this much of the best above it (10x a positive best), and above the first sync's,
# is a rise whatever the noise
NEAR_ZERO = 1e-3  # a first step's loss below this in magnitude is near 0 by design (a student that starts as its
# teacher, a masked first batch): no window is taken as blown up from it


def window_noise(col: Any, ok: list[int]) -> tuple[float, float]:
    """From every replica's window (sum, sum of squares, count of finite step losses): the standard error of
    one replica's window mean, and of the ensemble's (median ~ 1.25 x the mean's), from the median replica's
    spread of step losses. That spread includes the window's own trend: an overestimate, on the safe side."""
    n = [col.loss_n[r] for r in ok if col.loss_n[r] > 0]
    if not n:
        return 0.0, 0.0
    var = [max(col.loss_sq[r] / col.loss_n[r] - (col.loss_sum[r] / col.loss_n[r]) ** 2, 0.0)
           for r in ok if col.loss_n[r] > 0]
    sigma2 = statistics.median(var)  # robust: a runaway replica's own spread does not hide it
    return math.sqrt(sigma2 / (sum(n) / len(n))), 1.25 * math.sqrt(sigma2 / sum(n))


SAME_WEIGHTS_RTOL = 1e-10  # identical replicas' fingerprints: about 1e-16 apart a sum; a window's training: far more


def same_weights(col: Any, replicas: list[int]) -> bool:
    """Whether ``replicas`` (two or more) hold the same weights: their fingerprints (:func:`hdet.sync.fingerprint`,
    in the gathered rows) agree within ``SAME_WEIGHTS_RTOL`` (sums of the same values in another order differ in their
    last bits; replicas one window apart at a spread of 0.2 and an LR 1e-4 of its peak, by about 1e-8 of it in a
    model of 1e8 weights). A column without them (a state or test from before, a run without the guard) says no."""
    marks = getattr(col, "weights", None)
    if marks is None or len(replicas) < 2:
        return False
    ref = marks[replicas[0]]
    return ref != 0 and all(abs(marks[r] - ref) <= SAME_WEIGHTS_RTOL * abs(ref) for r in replicas)


def median_first_loss(col: Any, n: int) -> float:
    """The replicas' median first-step loss, from the gathered rows of ``n`` replicas (NaN where none kept one)."""
    firsts = [col.start_sum[r] / col.start_n[r] for r in range(n) if col.start_n[r] > 0]
    return statistics.median(firsts) if firsts else math.nan


class SharedCopies:
    """What the replicas of one process share when they keep copies of their state: where their tensors are
    the same memory (the engine's one copy of the moments), the k-th copy a replica makes in a sync is the
    k-th copy that an earlier replica made of the same view in that sync. Every replica makes the same copies
    in the same order (its decisions are the same arithmetic on the same gathered numbers), so both are
    copies of the same state. The engine clears it around every sync."""

    def __init__(self) -> None:
        self.generation = 0
        self._made: dict[tuple[Any, ...], torch.Tensor] = {}
        self._written: set[int] = set()  # ids of the copies written in this sync
        self._saved: dict[int, torch.Tensor] | None = None  # id of a kept copy -> its CPU copy (saving())

    def clear(self) -> None:
        self.generation += 1
        self._made, self._written = {}, set()

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """While the engine builds its state_dict: :meth:`saved` makes one CPU copy per kept tensor (a nested
        call, from a hook inside one, shares the outer one's copies)."""
        outer = self._saved is not None
        if not outer:
            self._saved = {}
        try:
            yield
        finally:
            if not outer:
                self._saved = None

    def saved(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of the kept ``t`` on the CPU for a checkpoint: within :meth:`saving`, one per kept tensor
        however many replicas hold it (``torch.save`` then stores it once)."""
        if self._saved is None:
            return t.detach().cpu().clone()
        c = self._saved.get(id(t))
        if c is None:
            c = self._saved[id(t)] = t.detach().cpu().clone()
        return c

    def copy(self, k: int, tensors: list[torch.Tensor], into: list[torch.Tensor] | None) -> list[torch.Tensor]:
        out = []
        for i, t in enumerate(tensors):
            key = (k, *memory_key(t))
            c = self._made.get(key)
            if c is None:
                # an earlier copy of a tensor the replicas shared, which another replica wrote in this sync: the
                # replicas' tensors have parted since (moments stacked per replica), so each gets its own again
                reuse = into is not None and id(into[i]) not in self._written
                c = into[i].copy_(t) if reuse else t.detach().clone()
                self._made[key] = c
                self._written.add(id(c))
            out.append(c)
        return out


class Copier:
    """Copies of a list of tensors (a snapshot), into an earlier snapshot of the same layout when given; with
    ``shared`` set (the engine), a view that another replica copied in this sync is not copied again."""

    def __init__(self) -> None:
        self.shared: SharedCopies | None = None
        self._generation, self._k = -1, 0

    @torch.no_grad()
    def __call__(self, tensors: list[torch.Tensor], into: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        if self.shared is None:
            if into is None:
                return [t.detach().clone() for t in tensors]
            torch._foreach_copy_(into, tensors)
            return into
        if self._generation != self.shared.generation:  # a new sync: count this replica's copies from 0
            self._generation, self._k = self.shared.generation, 0
        self._k += 1
        return self.shared.copy(self._k, tensors, into)

    def saved(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """CPU copies of kept tensors, for a state_dict (shared ones once, see :meth:`SharedCopies.saved`)."""
        if self.shared is None:
            return [t.detach().cpu().clone() for t in tensors]
        return [self.shared.saved(t) for t in tensors]


class StabilityGuard:
    """The best ensemble loss so far and the state of the run at that sync."""

    def __init__(self, config: HDETConfig, first_to_say: Callable[[str], bool] = lambda what: True) -> None:
        self.config = config
        self.first_to_say = first_to_say  # (Replicas.first_to_say: a warning once for the engine's N replicas)
        self.best_loss: float | None = None  # the healthy replicas' median window loss, lowest so far
        self.best_step: int | None = None
        self.best_se = 0.0  # the standard error of the best sync's ensemble loss
        self.first_loss: float | None = None  # the first sync's (the loss the run started from, about)
        self.lowest: tuple[float, int] | None = None  # the lowest loss of any sync and its step, whether or not it
        # became the best one (the range test's patience counts the windows since)
        self._snapshot: list[torch.Tensor] | None = None  # the tensors at the best sync (on their devices),
        # or, until the first best sync, each replica's own start (keep_start), and whether it is healthy
        self.starting = False
        self.start_ok: torch.Tensor | bool = True
        self._start_loss: tuple[torch.Tensor | float, torch.Tensor | float] = (0.0, 0.0)  # its first loss: (sum, n)
        self._start_rise: tuple[float, float] | None = None  # (window loss, first step's loss): blown up from it
        self._said_blown = False
        self._start_grown: tuple[float, float] | None = None  # (window loss, the last or lowest one): a rise, no best
        self.last_loss: float | None = None  # the last sync's median window loss (after going back: the state's)
        # T < judge_steps: the windows pooled since the last judgment, per replica [loss sums, sums of squares,
        # counts], how many, and whether one of them left a replica out or saw a non-finite loss (no best then)
        self._pool: list[list[float]] | None = None
        self._pooled = 0
        self._pool_dirty = False
        self._judged: tuple[list[float], Any] | None = None  # this sync's pooled (losses, columns), once full
        self._pooling: bool | None = None  # whether this sync's judgment pooled (None: not judged)
        self._said_pool: list[float] | None = None  # what warn() says of this sync: the pooled losses judged,
        self._said_gross: tuple[float, float] | None = None  # a window 10x the best (its loss, the best)
        self.copier = Copier()

    @property
    def on(self) -> bool:
        return self.config.recovering

    def judge(self, losses: list[float], bad: list[int], col: Any, pool: bool = True,
              last: bool = False) -> tuple[list[int], bool]:
        """The runaway replicas and whether the ensemble is rising (pure arithmetic on the gathered rows).

        A replica with finite weights whose every loss in the window was non-finite (its loss overflowed) ran away
        too (no replica runs away from others that hold the same weights: :func:`same_weights`); when no replica has a
        finite window loss, the ensemble is rising (before, such windows were dropped
        and a run whose weights reached 1e19 trained on to the end: an audit). A rise is judged against the
        window losses' noise, but a window loss ``RISE_CEILING`` times the best's magnitude above it (10x a positive
        best) and above the first sync's loss is a rise whatever the noise: the spread of the step losses in a window
        includes its trend, so a loss growing 3x or more a step read as noise (a window mean 886x the best was not a
        rise: an audit). (The first sync's loss keeps a best near 0 from making every noisy window a rise.) ``pool``:
        windows shorter than ``judge_steps`` are pooled and judged together (the module's docstring); False during the
        range test's ramp, which judges every window itself. ``last``: the run's last sync (``total_steps``, or
        ``finish()``'s), which judges what is pooled however few windows it holds (a rise in a run's last windows was
        never judged: an audit)."""
        c = self.config
        if not self.on:
            return [], False
        ok = [r for r, x in enumerate(losses) if r not in bad and math.isfinite(x)]
        nonfinite = getattr(col, "nonfinite", None)
        lost = [r for r, x in enumerate(losses) if r not in bad and not math.isfinite(x) and nonfinite is not None
                and nonfinite[r] > 0]  # observed losses, none of them finite
        # Replicas that hold the same weights (shared gradients at one LR: data parallel with the guard, alpha 0) differ
        # in their window losses by their data alone: none of them runs away from the others (at alpha 0 with 4
        # replicas, one replica's noisier shard was "reset" at every sync, a no-op, and the LR cut to its floor: an
        # audit). The ensemble's rules below still judge them.
        same = same_weights(col, [r for r in range(len(losses)) if r not in bad])
        apart = [] if same else lost  # (a lost replica of the same weights: its batches' losses, not its weights')
        best = self.best_loss
        times = max(RISE_CEILING, c.rise_threshold)
        self._start_rise = self._start_grown = None
        self._said_pool = self._said_gross = None  # (what warn() says: the pooled losses judged, a window 10x the best)
        pooling = self._pooling = pool and c.judged_windows > 1
        self._judged = self._pool_window(col, len(losses), last) if pooling else None
        if best is None and self.starting:  # no best yet: the start (after step 1, or kept again) is where to go back
            if not ok:  # no replica has a finite window loss: a rise, back to the start (nobody left out: all go back)
                return [], bool(lost)
            start = median_first_loss(col, len(losses))
            now = statistics.median(losses[r] for r in ok)
            if math.isfinite(start) and now > start + times * abs(start):
                self._start_rise = (now, start)  # blown up from the first step's loss: no best (after_average)
                low = None if self.lowest is None else self.lowest[0]
                grown = [x for x in (self.last_loss, low) if x is not None and now > x + times * abs(x)]
                if abs(start) >= NEAR_ZERO and grown:
                    # and grown that much past the last window or the lowest one (the same numbers on every replica):
                    # a blow-up, back to the start. A run blown up to 1e30 from step 1 stayed there with finite losses:
                    # no best, so no rise was caught (an audit). Not from a first loss near 0 (by design: a student
                    # that starts as its teacher, a masked first batch), which makes every window "blown": such a loss
                    # drifting up 1.3x a window went back at every sync (three reviews)
                    self._start_grown = (now, grown[0])
                    return apart, True
            return apart, False
        if not ok:
            return [], bool(lost) and best is not None
        if len(ok) < 2 or best is None:
            return apart, False
        gross: list[int] = []
        blown_now = False
        if pooling:  # judged over the pooled windows, or not at this sync; at every sync, what no noise explains in
            # this window alone (a blow-up): a replica's window loss 10x the median's magnitude above it, or the
            # ensemble's 10x the best's (both above the first sync's loss, as below); a window read alone caught the
            # 128M GPT's noise, this does not. (At a judged sync too: the pooled losses lag a blow-up in the last
            # window, which passed there and ended a run at 28x its best: an audit.)
            med = statistics.median(losses[r] for r in ok)
            first = self.first_loss
            if first is not None:  # (a state from before it: no floor, so none of this, as the judged rule's)
                gross = [r for r in ok if len(ok) >= 3 and not same and losses[r] > max(med + times * abs(med), best,
                                                                                        first)]
                now = statistics.median(losses[r] for r in ok if r not in gross)
                blown_now = now > max(best + times * abs(best), first)
                self._said_gross = (now, best) if blown_now else None
            if self._judged is None:
                return sorted(gross + apart), blown_now
            losses, col = self._judged
            self._said_pool = list(losses)
            ok = [r for r in ok if col.loss_n[r] > 0]
            if len(ok) < 2:
                return sorted(gross + apart), blown_now
        se_replica, se_ensemble = window_noise(col, ok)
        med = statistics.median(losses[r] for r in ok)
        scale = max(1.4826 * statistics.median(abs(losses[r] - med) for r in ok), 0.02 * abs(med), se_replica)
        runaway = [r for r in ok if len(ok) >= 3 and not same and losses[r] - med > c.outlier_threshold * scale
                   and losses[r] > best]
        healthy = [losses[r] for r in ok if r not in runaway]
        # (a partial pool, judged at the run's last sync: its windows' shared noise, which their steps' spread does not
        # see, is sqrt(short) times a full pool's; judged as a full one, a run with no instability went back at its last
        # sync in 34 of 200 simulated runs with one window pooled, 4 of 200 with a full pool: a review)
        short = getattr(col, "short", 1.0)
        margin = max(c.rise_threshold * abs(best) * math.sqrt(short), NOISE_Z * math.hypot(se_ensemble, self.best_se))
        now = statistics.median(healthy)
        blown = self.first_loss is not None and now > max(best + times * abs(best), self.first_loss)
        return sorted(set(runaway + gross + apart)), now > best + margin or blown or blown_now

    @torch.no_grad()
    def after_average(self, step: int, losses: list[float], exclude: list[int], rising: bool,
                      tensors: list[torch.Tensor], col: Any) -> bool:
        """After the sync's average (every replica holds the same ``tensors``): go back to the best sync's
        state when ``rising``, or remember this one when its loss is the best so far. Returns whether it went
        back. No collective; one foreach copy on the tensors' devices when it remembers or goes back."""
        if not self.on:
            return False
        judged, self._judged = self._judged, None
        pooling, self._pooling = bool(self._pooling), None
        dirty = self._pool_dirty
        if judged is not None:
            self._pool_dirty = False
        self.forget(exclude)
        if rising and self.can_go_back(tensors):
            copy_kept(tensors, self._snapshot)
            self._went_back()
            return True
        keep = [r for r, x in enumerate(losses) if r not in exclude and math.isfinite(x)]
        if not keep:
            return False
        loss = self.last_loss = statistics.median(losses[r] for r in keep)
        if self.first_loss is None:
            self.first_loss = loss
        if self.lowest is None or loss < self.lowest[0]:
            self.lowest = (loss, step)
        blown, self._start_rise = self._start_rise, None
        if blown is not None and not self._said_blown:
            self._said_blown = True  # (in the state: not said again after a resume)
            times = max(RISE_CEILING, self.config.rise_threshold)
            if self.first_to_say("blown"):  # (said once for the one-process engine's replicas)
                warnings.warn(f"hdet: at sync step {step} the ensemble's loss ({blown[0]:.4g}) is more than {times:g}x "
                              f"its first step's loss magnitude above it ({blown[1]:.4g}): not kept as a best sync (a "
                              "run that blew up within its first window went back to such a sync at every later "
                              "one); a collapse, or a window with no finite loss, goes back to the start (the state "
                              f"after step {self.best_step}) until a sync is kept, and so does a window also "
                              f"{times:g}x the last or the lowest one's loss magnitude above it (a blow-up; not from a "
                              f"first loss within {NEAR_ZERO:g} of 0). If a first loss near 0 is by design (a student "
                              "that starts as its teacher), no other rise is caught until then",
                              stacklevel=user_stacklevel())
        clean = not exclude and blown is None and (self.best_loss is None or not any(getattr(col, "nonfinite", ())))
        # (no replica reset, and after the first best no non-finite loss: a sync that reset a runaway replica kept the
        # weights its huge gradients had already reached, under a loss measured before them, a best no later window
        # could reach, and every sync after it went back there: an audit; nor, before any best, one whose loss blew up
        # from the first step's: a run that blew up within its first window went back to that sync at every later one)
        if pooling:  # pooled windows: a best only where they were judged, over all of them
            if judged is None:
                self._pool_dirty = dirty or not clean
                if clean and self.starting and self.lowest is not None and self.lowest[1] == step:
                    self._keep_synced_start(step, loss, tensors, col)
                return False
            clean = clean and not dirty
            window = loss  # this window's alone: the state kept is its end's
            losses, col = judged
            keep = [r for r in keep if col.loss_n[r] > 0]
            if not keep:
                return False
            loss = statistics.median(losses[r] for r in keep)
            # a best only where the last window is no worse than the pool by more than rise_threshold (no noise
            # margin: the spread of a blowing-up window's steps is its trend; not keeping a best costs nothing): the
            # pooled loss lags the state, and a window 4x the pool's at the end of it was kept as the best, every later
            # rise going back to that damaged state (an audit)
            clean = clean and window <= loss + self.config.rise_threshold * abs(loss)
            # and none from a partial pool (the last sync's, or finish()'s mid-run, after which training may go on: the
            # lucky best of a short pool, which pooling is for)
            clean = clean and getattr(col, "short", 1.0) <= 1.0
        if clean and (self.best_loss is None or loss < self.best_loss):
            self.best_loss, self.best_step, self.best_se = loss, step, window_noise(col, keep)[1]
            self._snapshot = self.copier(tensors, self._recyclable(tensors))
            self.starting, self.start_ok = False, True
        return False

    def _keep_synced_start(self, step: int, loss: float, tensors: list[torch.Tensor], col: Any) -> None:
        """Pooled windows, before the first judged sync: a clean sync with the lowest window loss so far, at or below
        the first step's (the replicas' median), is where a collapse, a window with no finite loss or a blow-up goes
        back to, instead of each replica's own state after step 1, and that median is every replica's first loss from
        now on: the same on every replica (no best yet, so no rise is judged against it). A checkpoint of one rank's
        state (the Trainer's, Lightning's, Accelerate's) at such a sync gave every rank that rank's own start, and a
        go-back before the first judgment put rank 0's step-1 state on every replica: not the run's (an audit). (At
        T >= judge_steps the first sync is a best.) A window above the first step's loss keeps the start: it may be
        the beginning of a blow-up."""
        first = median_first_loss(col, len(col.start_n))
        if not loss <= first:  # (no first loss observed: NaN, the start kept)
            return
        self._start_loss = (first, 1.0)
        self._snapshot = self.copier(tensors, self._recyclable(tensors))
        self.best_step, self.start_ok = step, True

    def _pool_window(self, col: Any, n: int, last: bool = False) -> tuple[list[float], Any] | None:
        """Add this window's per-replica loss sums to the pool; once it holds ``judged_windows`` windows (or at the
        run's ``last`` sync), empty it and return its per-replica losses (NaN where none was finite) and sums (as
        ``col``'s fields), else None."""
        rows = [[float(x) for x in col.loss_sum[:n]], [float(x) for x in col.loss_sq[:n]],
                [float(x) for x in col.loss_n[:n]]]
        if self._pool is not None and len(self._pool[0]) != n:  # another world size (an elastic resume): afresh
            self._pool, self._pool_dirty = None, False
        if self._pool is None:
            self._pool, self._pooled = rows, 1
        else:
            self._pool = [[a + b for a, b in zip(p, w)] for p, w in zip(self._pool, rows)]
            self._pooled += 1
        if self._pooled < self.config.judged_windows and not last:
            return None
        total, sq, count = self._pool
        short = self.config.judged_windows / self._pooled  # (> 1: the last sync's partial pool)
        self._pool, self._pooled = None, 0
        return ([x / k if k else math.nan for x, k in zip(total, count)],
                SimpleNamespace(loss_sum=total, loss_sq=sq, loss_n=count, short=short))

    def forget(self, replicas: list[int]) -> None:
        """Replicas reset to the others' mean (at a sync or an early recovery) are judged on their windows from now
        on: their pooled sums from before the reset made a healthy replica a runaway again at the next judgment (two
        reviews)."""
        if self._pool is not None:
            for r in replicas:
                if r < len(self._pool[0]):
                    for row in self._pool:
                        row[r] = 0.0

    def _went_back(self) -> None:
        """After every replica went back to the kept state: the pool is gone, and the last loss is the best sync's
        (at the start, none: each replica's own first loss differs, and the replicas must decide alike: a review)."""
        self.clear_pool()
        self.last_loss = self.best_loss

    def clear_pool(self) -> None:
        """Forget the pooled windows (the state went back: what they measured is gone)."""
        self._pool, self._pooled, self._pool_dirty, self._judged, self._pooling = None, 0, False, None, None

    def keep_start(self, step: int, tensors: list[torch.Tensor], ok: torch.Tensor,
                   first: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Before any sync (no best yet): the state after the run's first optimizer step, each replica its own, for a
        collapse (every replica non-finite) until the first best sync to go back to (it raised: nothing was kept).
        ``ok``: whether that state is healthy (a device flag, :func:`hdet.sync.health`): every replica's rides in the
        sync vector (``start_ok``), and one unhealthy start is dropped everywhere (going back to a non-finite state
        went on doing so to the end of the run: a review). ``first``: the sum of the first step's finite training
        losses and their count (their mean: about the loss at the initial weights; None if none was observed): until
        the first best sync, a sync whose window loss is ``RISE_CEILING`` times its magnitude above it is no best (a
        run that blew up within its first window made that sync its best and went back there, already damaged, at
        every later sync). One foreach copy, no host sync."""
        if self.on and self._snapshot is None and self.best_step is None:
            self.best_step, self.starting, self.start_ok = step, True, ok
            self._snapshot = self.copier(tensors)
            if first is not None:  # this replica's first loss: the mean of the finite ones, weight 1 if any
                total, n = first
                self._start_loss = (total / n.clamp(min=1), (n > 0).to(total.dtype))

    def keep_start_again(self, step: int, tensors: list[torch.Tensor], ok: torch.Tensor) -> None:
        """The start kept again, at ``step``, where the one kept no longer fits the optimizer's state (a first step
        that a GradScaler skipped made no moments under a non-fused optimizer; LBFGS changes its state's types at step
        2; a parameter first trained later): the first loss kept."""
        if self.on and self.starting:
            self.best_step, self.start_ok, self._snapshot = step, ok, None  # (the old copy freed before the new one)
            self._snapshot = self.copier(tensors)

    def kept_start_at(self, step: int) -> bool:
        """Whether the start was kept (again) after optimizer step ``step``."""
        return self.starting and self.best_step == step

    def start_fits(self, tensors: list[torch.Tensor]) -> bool:
        """Whether a kept start fits ``tensors`` (the kept tensors now)."""
        return self._snapshot is not None and same_layout(self._snapshot, tensors)

    def start_loss(self) -> tuple[torch.Tensor | float, torch.Tensor | float]:
        """This replica's first loss for the sync vector, ``(start_sum, start_n)``: (0, 0) unless a start is kept."""
        return self._start_loss if self.starting else (0.0, 0.0)

    def start_health(self, tensors: list[torch.Tensor] | None = None) -> torch.Tensor | float:
        """This replica's ``start_ok`` for the sync vector: 1 unless a kept start is not finite, or no longer fits
        ``tensors`` (the kept tensors now: every first-window step skipped, so the optimizer made its state after the
        last chance to keep it again; in local mode on one rank and not another, so the fit is gathered too, not judged
        alone)."""
        if not self.starting:
            return 1.0
        if tensors is not None and not self.start_fits(tensors):
            return 0.0
        return self.start_ok

    def drop_start(self, every_start_ok: list[float]) -> None:
        """Drop the kept start where some replica's is unhealthy or does not fit (``every_start_ok``: the gathered
        :meth:`start_health` of every replica): every replica decides the same."""
        if self.starting and min(every_start_ok) < 1.0:
            self._snapshot, self.best_step, self.starting, self.start_ok = None, None, False, True
            self._start_loss = (0.0, 0.0)

    def _recyclable(self, tensors: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """The kept snapshot, when a new one can be copied into it (the same shapes)."""
        return self._snapshot if self._snapshot is not None and same_layout(self._snapshot, tensors, strict=True) else None

    def can_go_back(self, tensors: list[torch.Tensor]) -> bool:
        """Whether a best sync's state is kept for these tensors."""
        return self._snapshot is not None and same_layout(self._snapshot, tensors)

    @torch.no_grad()
    def go_back(self, tensors: list[torch.Tensor]) -> bool:
        """Every replica back to the best sync's state (the range test's end); False without a snapshot."""
        if not self.can_go_back(tensors):
            return False
        copy_kept(tensors, self._snapshot)
        self._went_back()
        return True

    @torch.no_grad()
    def remember(self, step: int, loss: float, tensors: list[torch.Tensor]) -> None:
        """Make the state in ``tensors`` (that of sync ``step``, median loss ``loss``) the best sync: where the
        range test went back to."""
        self.best_loss, self.best_step = (loss if math.isfinite(loss) else self.best_loss), step
        self.lowest = None if self.best_loss is None else (self.best_loss, step)
        self._snapshot = self.copier(tensors, self._recyclable(tensors))
        self.starting, self.start_ok = False, True
        self._went_back()

    def warn(self, t: int, runaway: list[int], losses: list[float], rising: bool, back: bool, scale: float,
             collapsed: bool = False, at: str = "sync step", uncut: int = 0) -> None:
        """Say what this sync did (a UserWarning pointing at the training loop); ``at``: what step ``t`` was;
        ``uncut``: this event is the uncut-th of the first ``lr_cut_after`` (0: it cut the LR). Said once for the
        one-process engine's replicas (it said the same N times)."""
        if not self.first_to_say(f"event at {at} {t}"):
            return
        warnings.warn(
            f"hdet: at {at} {t} " + ("every replica had non-finite weights or buffers; " if collapsed else "")
            + (f"replica(s) {runaway} ran away (window losses {[round(losses[r], 4) for r in runaway]}"
            + (f"; over the windows pooled since the last judgment: {[round(self._said_pool[r], 4) for r in runaway]}"
               if self._said_pool is not None else "")
            + "): left out of the average, reset to the others' mean and ranked worst; " if runaway else "")
            + (self._rise_said() if rising and not collapsed else "")
            + (f"every replica went back to its state at step {self.best_step}; " if back else "")
            + (f"the LR schedule is cut to {scale:.3g} of its value" if not uncut else
               f"the LR schedule is not cut (event {uncut} of the first lr_cut_after={self.config.lr_cut_after}, "
               f"which cut nothing; it stays at {scale:.3g} of its value)"), stacklevel=user_stacklevel())

    def _rise_said(self) -> str:
        if self._said_gross is not None:
            now, best = self._said_gross
            times = max(RISE_CEILING, self.config.rise_threshold)
            return (f"the ensemble's window loss ({now:.4g}) is more than {times:g}x its best's magnitude above it "
                    f"({best:.4f}); ")
        if self._start_grown is not None:
            now, low = self._start_grown
            times = max(RISE_CEILING, self.config.rise_threshold)
            return (f"before any best sync, the ensemble's loss ({now:.4g}) is more than {times:g}x both its first "
                    f"step's and its last or lowest window's ({low:.4g}) magnitude above them; ")
        if self.best_loss is not None:
            return f"the ensemble's loss rose more than {self.config.rise_threshold:g} above its best ({self.best_loss:.4f}); "
        return "no healthy replica had a finite training loss in the window, before any best sync; "

    def state_dict(self) -> dict[str, Any]:
        return {"best_loss": self.best_loss, "best_step": self.best_step, "best_se": self.best_se,
                "first_loss": self.first_loss, "lowest": None if self.lowest is None else list(self.lowest),
                "last_loss": self.last_loss,
                **({"said_blown": True} if self._said_blown else {}),  # (its warning once a run, resumes included)
                "snapshot": None if self._snapshot is None else self.copier.saved(self._snapshot),
                # the kept start (HOST SYNC, while one is kept: its health flag, read with the copies)
                **({"start": {"ok": bool(self.start_ok), "loss": [float(x) for x in self._start_loss]}}
                   if self.starting else {}),
                # T < judge_steps: the windows pooled since the last judgment (plain numbers)
                **({"pool": {"sums": [list(x) for x in self._pool], "windows": self._pooled, "dirty": self._pool_dirty}}
                   if self._pool is not None else {})}

    @staticmethod
    def parse(state: dict[str, Any] | None) -> dict[str, Any]:
        state = state or {}
        best = state.get("best_loss")
        if best is not None and (not _is_real(best) or not math.isfinite(best)):
            raise ValueError(f"Expected the state's best_loss as a finite number or None, but got {best!r}")
        step, se = state.get("best_step"), state.get("best_se", 0.0)
        if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
            raise ValueError(f"Expected the state's best_step as a step (an integer >= 0) or None, but got {step!r}")
        if not _is_real(se) or not math.isfinite(se) or se < 0:
            raise ValueError(f"Expected the state's best_se as a finite number >= 0, but got {se!r}")
        first = state.get("first_loss")  # (states saved before it have none: no ceiling until the next run)
        if first is not None and (not _is_real(first) or not math.isfinite(first)):
            raise ValueError(f"Expected the state's first_loss as a finite number or None, but got {first!r}")
        lowest = state.get("lowest", None if best is None else [best, step])  # (before it: the best sync's)
        if lowest is not None and not (isinstance(lowest, (list, tuple)) and len(lowest) == 2 and _is_real(lowest[0])
                                       and math.isfinite(lowest[0]) and isinstance(lowest[1], int)
                                       and not isinstance(lowest[1], bool) and lowest[1] >= 0):
            raise ValueError(f"Expected the state's lowest as [a finite loss, a step] or None, but got {lowest!r}")
        snap = state.get("snapshot")
        if snap is not None and (not isinstance(snap, list) or not all(isinstance(t, torch.Tensor) for t in snap)):
            raise ValueError("Expected the state's stability snapshot as a list of tensors: a corrupted state_dict")
        start = state.get("start")  # (states saved before it kept none)
        first_step = start.get("loss", [0.0, 0.0]) if isinstance(start, dict) else None
        if start is not None and not (isinstance(start, dict) and isinstance(start.get("ok"), bool) and snap is not None
                                      and best is None and isinstance(first_step, list) and len(first_step) == 2
                                      and all(_is_real(x) and math.isfinite(x) for x in first_step)
                                      and first_step[1] in (0, 1)):
            raise ValueError(f"Expected the state's start as {{'ok': a bool, 'loss': [a finite sum, 0 or 1]}} with a "
                             f"snapshot and no best loss, but got {start!r}")
        last = state.get("last_loss")  # (states saved before it: none until the next sync)
        if last is not None and (not _is_real(last) or not math.isfinite(last)):
            raise ValueError(f"Expected the state's last_loss as a finite number or None, but got {last!r}")
        pool = state.get("pool")  # (states saved before it, or at T >= judge_steps, pooled nothing)
        sums = pool.get("sums") if isinstance(pool, dict) else None
        if pool is not None and not (
                isinstance(sums, list) and len(sums) == 3 and all(isinstance(x, list) for x in sums)
                and len({len(x) for x in sums}) == 1 and len(sums[0]) > 0
                and all(_is_real(v) and not math.isnan(v) for x in sums for v in x)  # (a sum of squares may overflow)
                and all(math.isfinite(v) and v >= 0 for v in sums[2])
                and isinstance(pool.get("windows"), int) and not isinstance(pool["windows"], bool)
                and pool["windows"] >= 1 and isinstance(pool.get("dirty"), bool)):
            raise ValueError("Expected the state's pool as {'sums': [three lists of numbers (no NaN), one a replica, "
                             "the counts finite and >= 0], 'windows': an integer >= 1, 'dirty': a bool}, but got "
                             f"{pool!r}")
        said = state.get("said_blown", False)  # (states saved before it: said again, once)
        if not isinstance(said, bool):
            raise ValueError(f"Expected the state's said_blown as a bool, but got {said!r}")
        return {"start": start, "best_loss": None if best is None else float(best), "best_step": state.get("best_step"),
                "said_blown": said,
                "best_se": float(state.get("best_se", 0.0)), "first_loss": None if first is None else float(first),
                "lowest": None if lowest is None else (float(lowest[0]), int(lowest[1])), "snapshot": snap,
                "last_loss": None if last is None else float(last),
                "pool": None if pool is None else ([[float(v) for v in x] for x in sums], pool["windows"],
                                                   pool["dirty"])}

    def load(self, parsed: dict[str, Any], tensors: list[torch.Tensor], counts: int = 0,
             optimizer_empty: bool = False, also: int = 0) -> None:
        """``optimizer_empty``: the optimizer holds no state yet (loaded after the scheduler?), said if the saved
        best sync does not fit."""
        self.best_loss, self.best_step, self.best_se = parsed["best_loss"], parsed["best_step"], parsed["best_se"]
        self.first_loss = parsed.get("first_loss")
        self.lowest = parsed.get("lowest")
        self.last_loss = parsed.get("last_loss")
        self._said_blown = parsed.get("said_blown", False)
        self.clear_pool()
        if parsed.get("pool") is not None:
            self._pool, self._pooled, self._pool_dirty = parsed["pool"]
        snap = None if parsed["snapshot"] is None else fit_snapshot(parsed["snapshot"], tensors, counts, also)
        start = parsed.get("start")
        self.starting, self.start_ok = start is not None, True if start is None else start["ok"]
        self._start_loss = (0.0, 0.0) if start is None else tuple(float(x) for x in start.get("loss", [0.0, 0.0]))
        if start is not None and snap is not None and not same_layout(snap, tensors):
            # (the optimizer loaded after the scheduler, or moments made after step 1: whether it fits is gathered at
            # the next sync, start_health, and every replica drops it or none)
            dev = tensors[0].device if tensors else torch.device("cpu")
            self._snapshot = [x.to(dev, copy=True) for x in snap]
            return
        if snap is not None and not same_layout(snap, tensors):
            why = ("the optimizer holds no state yet: load the optimizer's state_dict before the scheduler's"
                   if optimizer_empty and len(snap) > len(tensors) else
                   "another model or optimizer, or a checkpoint from before hdet averaged D-Adaptation's/Prodigy's "
                   "estimates")
            warnings.warn(f"hdet: the checkpoint's best sync ({len(snap)} tensors) does not fit this run's "
                          f"{len(tensors)} tensors ({why}): it is dropped, and on_runaway='recover' "
                          "can go back only to syncs from now on", stacklevel=user_stacklevel())
            snap = None
        self._snapshot = None if snap is None else [
            s.to(t.device, t.dtype, copy=True) for s, t in zip(snap, tensors)]  # never the caller's tensors


def fit_snapshot(snap: list[torch.Tensor], tensors: list[torch.Tensor], counts: int, also: int = 0
                 ) -> list[torch.Tensor]:
    """A saved snapshot for ``tensors``, whose last ``counts`` are step counts (the optimizer's, then the model's
    integer buffers: :meth:`hdet.Ensemble.kept_tensors`): one saved before hdet kept some or all of them fits the
    others, and goes back to the missing ones as the run resumed with them (before, a go-back left them as they were).
    ``also``: the :meth:`hdet.Ensemble.also_average` modules' tensors, just before the counts: one saved without them
    (a run that registered its EMA only now) takes theirs as they are (it was dropped, a review)."""
    a = len(tensors) - counts - also
    if also and a <= len(snap) <= len(tensors) - also and same_layout(snap[:a], tensors[:a]):
        snap = list(snap[:a]) + [t.detach().clone() for t in tensors[a:a + also]] + list(snap[a:])
    n = len(tensors) - counts
    if n <= len(snap) < len(tensors) and same_layout(snap, tensors[:len(snap)]):
        return list(snap) + [t.detach().clone() for t in tensors[len(snap):]]
    return snap


def same_layout(a: list[torch.Tensor], b: list[torch.Tensor], strict: bool = False) -> bool:
    """Whether a kept copy ``a`` fits the tensors ``b`` (a snapshot of the same tensors): the same dtypes and
    shapes, or (unless ``strict``) the same elements where one of the two is flat. Prodigy keeps ``s`` and
    ``p0`` flat, and the engine's stacked step binds them as views shaped like the parameter: a resume, or
    leaving the stacked step, switches a kept tensor between the two (:func:`copy_kept` reshapes)."""
    return len(a) == len(b) and all(x.dtype == y.dtype and same_shape(x, y, strict) for x, y in zip(a, b))


def same_shape(x: torch.Tensor, y: torch.Tensor, strict: bool = False) -> bool:
    """:func:`same_layout`'s shape rule for one tensor."""
    return x.shape == y.shape or (not strict and x.numel() == y.numel() and min(x.dim(), y.dim()) == 1)


@torch.no_grad()
def copy_kept(tensors: list[torch.Tensor], kept: list[torch.Tensor]) -> None:
    """Copy a kept snapshot that :func:`same_layout` fits into ``tensors`` (a flat one reshaped, in logical order)."""
    torch._foreach_copy_(tensors, [k if k.shape == t.shape else k.reshape(t.shape) for k, t in zip(kept, tensors)])
