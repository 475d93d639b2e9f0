"""An LR sweep inside the run: :func:`lr_sweep`.

Steps before the run (a fifth of its steps in the measured recipe) as independent short runs, N at a time (one per
replica), each on its own batches (1/N of the ensemble's: what N ranks without their all-reduce, or N replicas in local
mode, compute side by side at the cost of that many ensemble steps), at ``points`` LRs (N by default)
``span ** (2 / (points - 1))`` apart from about ``centre / span`` to ``centre * span`` (moved by at most sqrt(3)x to a
lattice, so that guesses a power of that ratio apart get the same LRs: :func:`sweep_lrs`), each with its own OneCycle
over the sweep. Each run is then judged (by ``judge``, a held-out loss, or by its training loss over its last tenth).
Where the best run has fewer than three runs on a side that the fit keeps (``(points - 1) // 2`` below 7 points), more
runs go beyond the grid on that side, one ratio apart (``extend`` rounds at most; where no run ended below the start,
beyond the end whose run was the best): an off-centre guess gets the neighbourhood a centred one gets. The pick is the
vertex of a least-squares parabola in log LR through the best judged loss and up to three finite neighbours on each
side, leaving out runs that kept less than half the best one's gain over the start (they blew up and settled near
chance); the main run's peak LR is the pick times ``lr_factor`` (sqrt(max(N, 8)) by default: the main run's batch is N
times a sweep run's, Adam's best LR grows about as the square root of the batch, and a sweep's short runs pick low
whatever N is: at N = 2 sqrt(8) beat sqrt(2) and 2, see below). The model ends holding its start weights
(``keep="start"``: the main run then trains all its steps from them at the found peak, the sweep's steps on top), or
the best run's weights (``keep="winner"``: the main run goes on from there, with a fresh optimizer, for the remaining
steps), on every rank.

Measured (``benchmarks/results/evidence/sweep_then_train/``, the evidence suite's two tasks, N = 8, the sweep 20% of
1500 steps, then HDET at alpha 0.2, T 25, ``on_runaway="recover"``), from 0.1x, 1x and 10x the grid's best LR, through
``hdet train --lr-sweep 0.2`` (this function, judged by the training loss): with ``keep="start"`` and all 1500 steps
after the sweep, a byte-level GPT ends +0.25% / +0.32% / +0.51% from the grid's best validation loss (16 seeds; from
10x at 16 more seeds +0.30%) and a BatchNorm CNN on Fashion-MNIST -0.09 / -0.10 / -0.10 point from its best accuracy
(3 seeds), the GPT picking about the same LRs from every start (without the lattice and the runs beyond the grid, and
with the stability guard's cut 0.5 each time: +0.43% / -0.00% / +0.86% and -0.06 / -0.05 / -0.17 point at the same
seeds, the picks lower from 0.1x and 10x); with ``keep="winner"`` and the remaining 1200 steps, +1.1% /
+1.2% / +1.9% (12 seeds) and about -0.45 point (6 seeds): the picks were right, the steps the sweep took from the main
run were not (its best run saw 1/N of the data). Hence ``keep="start"`` by default. Without HDET's spread in the
run after the sweep (alpha 0, the stability guard kept: ``hdet train --lr-sweep``'s default since 2026-12-01),
+0.37% / +0.57% / +0.43% and -0.10 / -0.06 / -0.01 point (6 seeds): seed for seed the same as with it
(``benchmarks/results/evidence/sweep_alpha0/``), and the spread costs about 2% at 128M. At N = 2 (the same tasks, the
ensemble's batch kept at N = 8's, 8 points, ``benchmarks/results/evidence/sweep_factor_n2/``) the picks were about half
the grid's best as at N = 8, and the GPT ended -0.33% / +0.7% / +1.5% from its grid best at factors sqrt(8) / 2 /
sqrt(2) (4 seeds from 1x; sqrt(8) better than sqrt(2) in all 4; from 1x, 10x and 0.1x together +0.38%, 12 runs),
Fashion-MNIST level at all three (92.13-92.17%, 3 seeds); a
128M GPT on 2 GPUs likewise (``benchmarks/results/gpu_2x_h200/gpt128m_sweep/``): hence the floor of sqrt(8). Not
measured above N = 8; pass ``lr_factor`` where the batch rule is known. Leaving out the runs that kept less than half
the best one's gain is this function's own (the study's fit took them in).

Under torch.distributed (initialised, world size > 1) every rank is one replica: rank r runs the r-th LR on its own
batches (and the r-th of each round beyond the grid), the judged losses are all-gathered and (``keep="winner"``)
the best run's weights and buffers broadcast from the rank that ran it. In one process the runs go one after the
other on the same module, from the same initial weights.
"""

from __future__ import annotations

import contextlib
import json
import math
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .caller import user_stacklevel
from .controller import fit_parabola
from .guard import uncompiled
from .replicas import ProcessGroupReplicas
from .values import int_number, real_number

__all__ = ["lr_sweep", "SweepResult", "SweepFoundNothing", "sweep_lrs", "pick_lr"]

KEEP = ("start", "winner")  # what the model holds after the sweep
MIN_STEPS = 10  # a sweep run's fewest steps: its judged loss must show what its LR did (1 step: the start's loss)
SNAP = 3.0  # the grid moves to a lattice at most this ratio apart (sweep_lrs)
FIT_NEIGHBOURS = 3  # the pick's parabola: the best judged loss and up to this many finite neighbours on each side


class SweepFoundNothing(RuntimeError):
    """The sweep found no LR: every run's judged loss was non-finite, or none ended below the start's."""


@dataclass
class SweepResult:
    """What :func:`lr_sweep` found. ``max_lr``: the main run's peak LR (``pick * lr_factor``); ``pick``: the sweep's
    best LR; ``lrs`` and ``losses``: each sweep run's LR (ascending: the grid's points and any beyond it) and judged
    loss (inf: non-finite); ``start_loss``: the start weights' (judged, or their first training losses' mean);
    ``winner``: the best run (of equal losses the lowest LR; the model holds its weights with ``keep="winner"``);
    ``at_edge``: the best judged loss was at an end of all the runs (the best LR may lie beyond it)."""

    max_lr: float
    pick: float
    lr_factor: float
    lrs: list[float]
    losses: list[float]
    start_loss: float
    winner: int
    at_edge: bool


def sweep_lrs(centre: float, n: int, span: float) -> list[float]:
    """``n`` LRs evenly apart in log LR, ``span ** (2 / (n - 1))`` apart (``centre / span`` to ``centre * span``),
    moved by at most ``sqrt(SNAP)`` to the lattice of integer powers of that ratio's m-th root (the smallest m that
    makes the root at most ``SNAP``): guesses apart by a power of the ratio get the same points."""
    base, step = _lattice(centre, n, span)
    return [_on_lattice(r, base, step) for r in range(n)]


def _lattice(centre: float, n: int, span: float) -> tuple[float, float]:
    """The log of the grid's first LR, on the lattice, and the log of the grid's ratio."""
    step = 2 * math.log(span) / (n - 1)
    fine = step / max(1, math.ceil(step / math.log(SNAP) - 1e-9))
    # (halves round up, whatever the rounding of the logs: an even grid around a centre on the lattice lies half a
    # step off it)
    return math.floor((math.log(centre) - step * (n - 1) / 2) / fine + 0.5 + 1e-9) * fine, step


def _on_lattice(k: int, base: float, step: float) -> float:
    """The LR ``k`` grid ratios above the grid's first."""
    return math.exp(base + k * step)


def _needed(losses: list[float], start: float | None, neighbours: int) -> tuple[int, int]:
    """How many more runs below and above the grid (one grid ratio apart) the pick's fit needs: up to ``neighbours`` a
    side of the best run, where the grid's end on that side is a run the fit keeps (a run there that blew up, or
    barely trained, says that LRs beyond it are worse still). Where no run ended below the start's loss, as many (one
    at least) below if every run was non-finite or the best is the lowest LR, above if it is the highest, else none."""
    ok = [i for i, v in enumerate(losses) if math.isfinite(v)]
    failed = max(neighbours, 1)
    if not ok:
        return failed, 0
    best = min(ok, key=lambda i: losses[i])
    if start is not None and math.isfinite(start):
        if not losses[best] < start:
            return (failed if best == 0 else 0), (failed if best == len(losses) - 1 else 0)
        ok = [i for i in ok if losses[i] < (losses[best] + start) / 2]
    low = neighbours - best if 0 in ok else 0
    high = neighbours - (len(losses) - 1 - best) if len(losses) - 1 in ok else 0
    return max(low, 0), max(high, 0)


FACTOR_FLOOR_N = 8  # the default factor is sqrt(N) from N = 8 up, sqrt(8) below (measured at N = 2 and 8)


def default_factor(n: int) -> float:
    """The main run's peak over the sweep's pick by default: sqrt(max(N, 8)) (the batch rule from N = 8 up; below it
    a sweep's short runs still pick about half the best, as at N = 8: module docstring)."""
    return math.sqrt(max(n, FACTOR_FLOOR_N))


def pick_lr(lrs: list[float], losses: list[float], start: float | None = None,
            neighbours: int = FIT_NEIGHBOURS) -> float:
    """The vertex (in log LR) of the least-squares parabola through the lowest finite loss and up to ``neighbours``
    finite ones on each side, clipped to their range; the lowest's own LR where fewer than three points or the fit is
    not convex. With ``start`` (the loss before the sweep), a run that kept less than half of the best run's gain
    (``loss >= (best + start) / 2``: it blew up and settled near chance, say) is left out of the fit."""
    ok = [i for i, v in enumerate(losses) if math.isfinite(v)]
    if not ok:
        raise SweepFoundNothing(f"Every sweep run's judged loss was non-finite (LRs {_fmt(lrs)}): the guess is far "
                                "too high, or the loss is non-finite at any LR (try the model and loss at a small one)")
    best = min(ok, key=lambda i: losses[i])
    if start is not None and not losses[best] < start:
        raise SweepFoundNothing(f"No sweep run ended below the start's loss ({start:.4g}; the best, "
                                f"{losses[best]:.4g}, at LR {lrs[best]:.3g} of {_fmt(lrs)}): the guess is far off, or "
                                "the sweep too short")
    if start is not None and math.isfinite(start):
        ok = [i for i in ok if losses[i] < (losses[best] + start) / 2]
    idx = [i for i in ok if abs(i - best) <= neighbours]
    if len(idx) < 3:
        return lrs[best]
    x = [math.log(lrs[i]) for i in idx]
    # In plain Python, not LAPACK: the same losses give the same bits on every rank and in every process (LAPACK's
    # result can move in the last bits with the buffers' alignment, and ranks' peaks then differ).
    _, b, q = fit_parabola(x, [losses[i] for i in idx])
    if not q > 0:
        return lrs[best]
    return math.exp(min(max(-b / (2 * q), min(x)), max(x)))


def lr_sweep(model: nn.Module, make_optimizer: Callable[[Iterable[nn.Parameter], float], torch.optim.Optimizer],
             loss_fn: Callable[[nn.Module, Any], torch.Tensor], batches: Callable[[int], Iterable[Any]], *,
             guess: float, steps: int, num_replicas: int | None = None,
             judge: Callable[[nn.Module], Any] | None = None, span: float = 32.0, lr_factor: float | None = None,
             pct_start: float = 0.3, cycle_momentum: bool | None = None, keep: str = "start", extend: int = 3,
             points: int | None = None, group: Any = None, progress: dict[str, Any] | None = None,
             on_round: Callable[[dict[str, Any]], None] | None = None) -> SweepResult:
    """Sweep the LR over ``steps``, then leave ``model`` at its start weights or the best run's (see the module).

    ``make_optimizer(params, lr)``: a fresh optimizer at peak LR ``lr`` (its param groups' LRs are each run's OneCycle
    peaks, so groups at a multiple of ``lr`` keep it; a main run that clips its gradients can have the sweep's runs clip
    alike through a step pre-hook registered there, as ``benchmarks/gpt_multi_gpu.py`` does; refused: one whose
    groups' LRs do not follow ``lr``, found after two runs, and a ``ZeroRedundancyOptimizer``, which mixes the ranks'
    runs); ``loss_fn(model, batch)``: the scalar training loss;
    ``batches(r)``: replica r's batches (at least ``steps`` of them; a fresh iterable at each call: a round beyond the
    grid calls it again, its i-th run with ``batches(i)``); ``guess``: the user's peak LR, the grid's centre over
    ``lr_factor``; ``num_replicas``: N in one process (under torch.distributed, the group's size); ``judge(model)``: a
    held-out loss (called under ``torch.no_grad()`` with the model in eval mode; under torch.distributed it must read
    the same data on every rank, or the ranks' runs are judged on different data), or None for the mean training loss
    over the run's last tenth (on the measured CNN it picked higher LRs than a held-out loss on the same seeds, and
    ended no worse); ``span``: the grid's reach each way from its centre (its points ``span ** (2 / (points - 1))``
    apart, on a lattice that gives guesses apart by a power of that ratio the same points: :func:`sweep_lrs`);
    ``lr_factor``: the main run's peak over the pick (default sqrt(max(N, 8)): :data:`FACTOR_FLOOR_N`); ``pct_start``, ``cycle_momentum``: each run's
    OneCycleLR (by default its momentum or beta1 cycles where the optimizer's defaults have one, as OneCycleLR and
    OneCycleAutoLR do in the main run the pick is for: ``SGD(momentum=0)``, ``RMSprop`` and ``Adam(betas=(0, ...))``
    then train with momentum 0.85-0.95, said by a warning; False for a main run that keeps it fixed); ``keep``: ``"start"`` (the model back at
    the weights the sweep started from, rank 0's on every rank, for a main run of all its steps: measured better) or
    ``"winner"`` (the best run's weights and buffers, for a main run of the steps left); ``extend``: the most rounds of
    runs beyond the grid (0: none), one grid ratio apart, up to the grid's own reach (``span ** 2``) again on each side,
    where the best run has fewer than ``min(3, (points - 1) // 2)`` runs on a side (at 8: the guess was off by more than
    about 4x) and the run at that end is kept in the fit; where no run ended below the start, that many (one at least)
    below if the best is the lowest LR or every run blew up, above if it is the highest (under torch.distributed a round
    of up to N runs, rank r running the r-th, costs a sweep run's time); ``points``: the grid's LRs (default N, one a
    replica; more run in rounds of N, as the runs beyond it: a grid fine enough for 2 ranks costs 4 rounds at 8 points).
    Each parameter's ``.grad``, each submodule's train/eval mode and torch's RNG (the CPU's and that of every
    accelerator device of the model: dropout's draws) end as they came; the runs train in the modes the
    model came in (a submodule in eval mode, a frozen BatchNorm, stays so), or all in train mode if the model came in
    eval mode. Any error leaves the model as it came (this rank's own weights). The model's forward and the judge must
    be this rank's own (no collective inside: a SyncBatchNorm is refused). With 2 points the grid is two LRs span^2
    apart: use 4 or more (8 measured). A ``DistributedDataParallel`` model sweeps its ``module`` (no gradient is
    shared). ``on_round(progress)`` (an error it raises on one rank is raised on every rank, the others' a RuntimeError):
    called on every rank after each round with this process's progress so far
    (plain data: the runs' losses, the first round's start losses, the RNG's state, and with ``keep="winner"`` this
    process's best run's tensors, copies); ``progress``: such a dict, from a sweep that was stopped, to go on from
    (the same model from the same start weights and the same arguments, checked: its finished rounds are not run
    again, and the result is the uninterrupted sweep's, bit for bit where the runs are deterministic; under
    torch.distributed every rank passes its own, of the same round, or none: checked on every rank before anything
    runs). Returns a :class:`SweepResult`; its ``max_lr`` is the peak for the main run."""
    module, n, rank = _replicas(model, num_replicas, group)
    guess_f, steps_i = real_number(guess), int_number(steps)
    if guess_f is None or not (math.isfinite(guess_f) and guess_f > 0):
        raise ValueError(f"Expected guess to be a positive finite LR, but got {guess!r}")
    if steps_i is None or steps_i < MIN_STEPS:
        raise ValueError(f"Expected steps to be an int of at least {MIN_STEPS} (each run's judged loss must show "
                         f"what its LR did: one step judges the start), but got {steps!r}")
    span_f = real_number(span)
    if span_f is None or not (math.isfinite(span_f) and span_f > 1):
        raise ValueError(f"Expected span to be a finite number above 1, but got {span!r}")
    factor = default_factor(n) if lr_factor is None else real_number(lr_factor)
    if factor is None or not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"Expected lr_factor to be a positive finite number or None, but got {lr_factor!r}")
    pct = real_number(pct_start)
    if pct is None or not 0.0 < pct < 1.0:
        raise ValueError(f"Expected pct_start in (0, 1), but got {pct_start!r}")
    if pct * steps_i == 1:  # (torch's OneCycleLR divides by the warm-up's length - 1)
        raise ValueError(f"Expected pct_start x steps ({steps_i}) to be other than one step (OneCycleLR cannot build a "
                         f"warm-up of exactly one step), but got pct_start {pct_start!r}")
    if keep not in KEEP:
        raise ValueError(f"Expected keep to be one of {', '.join(map(repr, KEEP))}, but got {keep!r}")
    extend_i = int_number(extend)
    if extend_i is None or extend_i < 0:
        raise ValueError(f"Expected extend to be an int of at least 0, but got {extend!r}")
    g = n if points is None else int_number(points)  # the grid's points
    if g is None or g < 2:
        raise ValueError(f"Expected points to be None (one a replica) or an int of at least 2, but got {points!r}")
    base, step = _lattice(guess_f / factor, g, span_f)
    tensors = _tensors(module)
    start = [t.clone() for t in tensors]  # this rank's own: the model as it came, whatever fails
    grads = [p.grad for p in module.parameters()]
    modes = [(m, m.training) for m in module.modules()]
    src0 = dist.get_global_rank(group, 0) if rank is not None and group is not None else 0
    with _forked_rng(tensors):  # the runs' draws (dropout) leave torch's RNG as it came
        try:
            for p in module.parameters():  # (a parameter the optimizer leaves out would add into the user's gradient)
                p.grad = None
            if not module.training:  # the runs' modes: as they came under a module in train mode (a frozen BatchNorm in
                module.train()  # eval stays frozen), else module.train()'s (a train() override that freezes is kept)
            runs = _Runs(module, tensors, start, make_optimizer, loss_fn, batches, steps_i, pct, judge, cycle_momentum,
                         [(m, m.training) for m in module.modules()], keep == "winner", n, rank, group, src0, g, base,
                         step, factor)
            runs.resume(progress, on_round)
            ks = list(range(g))  # the runs' places: LR = _on_lattice(k, base, step)
            start_loss = runs.grid(ks)
            for _ in range(extend_i):  # the fit's points on both sides of the best run, beyond the grid where needed
                low, high = _needed([runs.loss[k] for k in ks], start_loss, min(FIT_NEIGHBOURS, (g - 1) // 2))
                low, high = min(low, ks[0] + g - 1), min(high, 2 * (g - 1) - ks[-1])  # at most the grid's reach again
                more = [*range(ks[0] - low, ks[0]), *range(ks[-1] + 1, ks[-1] + 1 + high)]
                if not more:
                    break
                runs.more(more)
                ks = list(range(ks[0] - low, ks[-1] + 1 + high))
            lrs, losses = [_on_lattice(k, base, step) for k in ks], [runs.loss[k] for k in ks]
            pick = pick_lr(lrs, losses, start_loss)  # (the same on every rank: the same gathered losses)
            winner = min((i for i, v in enumerate(losses) if math.isfinite(v)), key=lambda i: losses[i])
            if keep == "start":  # rank 0's start weights on every rank
                _copy(tensors, start)
                if rank is not None:
                    for t in tensors:  # COLLECTIVE: one broadcast a tensor (once a sweep)
                        dist.broadcast(t, src=src0, group=group)
            else:
                runs.keep_winner(ks[winner])
        except BaseException:
            _restore(module, grads, modes)
            _copy(tensors, start)  # the model as it came, whatever failed
            raise
    _restore(module, grads, modes)
    at_edge = winner in (0, len(lrs) - 1)
    if at_edge:
        warnings.warn(f"hdet.lr_sweep: the best judged loss is at the {'low' if winner == 0 else 'high'} end of "
                      f"the sweep's LRs ({_fmt(lrs)}): the best LR may lie beyond it; sweep again around "
                      f"{pick * factor:.3g}", stacklevel=user_stacklevel())
    return SweepResult(max_lr=pick * factor, pick=pick, lr_factor=factor, lrs=lrs, losses=losses,
                       start_loss=start_loss, winner=winner, at_edge=at_edge)


def _progress_rounds(progress: dict[str, Any] | None) -> int:
    """The rounds a progress dict (from ``on_round``) holds, checked for its form (ValueError)."""
    if progress is None:
        return 0
    keys = {"version", "plan", "n", "keep_best", "rounds", "loss", "owner", "first", "best", "kept", "rng"}
    if not isinstance(progress, dict) or not keys <= set(progress) or progress["version"] != 1:
        raise ValueError(f"Expected progress as lr_sweep's on_round gives it (version 1, keys {sorted(keys)}), but got "
                         f"{sorted(progress) if isinstance(progress, dict) else type(progress).__name__}")
    rounds = int_number(progress["rounds"])
    if rounds is None or rounds < 1:
        raise ValueError(f"Expected the progress's rounds as an int of at least 1, but got {progress['rounds']!r}")
    return rounds


def _rng_devices(tensors: list[torch.Tensor]) -> dict[str, list[int]]:
    """The accelerator devices that hold one of ``tensors``, by type."""
    kinds: dict[str, set[int]] = {}
    for t in tensors:
        if t.device.type not in ("cpu", "meta"):
            kinds.setdefault(t.device.type, set()).add(t.device.index or 0)
    return {kind: sorted(idx) for kind, idx in kinds.items()}


@contextlib.contextmanager
def _forked_rng(tensors: list[torch.Tensor]) -> Iterator[None]:
    """torch's RNG forked (``torch.random.fork_rng``) on the CPU and every accelerator device that holds one of
    ``tensors``: what runs inside draws leaves it as it came."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=[]))  # the CPU's
        for kind, idx in _rng_devices(tensors).items():
            stack.enter_context(torch.random.fork_rng(devices=idx, device_type=kind))
        yield


def _rng_state(tensors: list[torch.Tensor]) -> dict[str, Any]:
    """torch's RNG state on the CPU and on every accelerator device of ``tensors`` (what :func:`_forked_rng` forks)."""
    return {"cpu": torch.get_rng_state(), "devices": [
        [kind, i, torch.get_device_module(kind).get_rng_state(i)] for kind, idx in _rng_devices(tensors).items()
        for i in idx]}


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    for kind, i, st in state["devices"]:
        torch.get_device_module(kind).set_rng_state(st, i)


class _Runs:
    """The sweep's runs, each from the start weights (under ranks rank 0's): in one process one after the other, or
    one a rank (the i-th LR of a round on rank i). A round's i-th run trains on ``batches(i)``. The run at place k is
    at LR ``_on_lattice(k, base, step)``, k grid ratios above the grid's first (k < 0: below it). ``loss[k]``: its
    judged loss, the same on every rank; with
    ``keep_best``, each process's own best run's tensors are kept (held by the module until a later run would overwrite
    them), and ``owner[k]`` is the rank that ran k."""

    def __init__(self, module: nn.Module, tensors: list[torch.Tensor], start: list[torch.Tensor], make_optimizer: Any,
                 loss_fn: Any, batches: Any, steps: int, pct: float, judge: Any, cycle: bool | None,
                 train: list[tuple[nn.Module, bool]], keep_best: bool, n: int, rank: int | None, group: Any,
                 src0: int, points: int, base: float, step: float, factor: float) -> None:
        self.module, self.tensors, self.start, self.judge, self.keep_best = module, tensors, start, judge, keep_best
        self.buffers = _buffer_slots(module)  # (a buffer a forward reassigns goes back in its slot after each run)
        self.base, self.step = base, step
        self.plan = (points, base, step, steps, factor)  # the grid, the runs' steps and the main run's factor: the
        # same on every rank, checked (guesses that fall on one lattice point sweep the same grid)
        self.n, self.rank, self.group, self.src0 = n, rank, group, src0
        self.args = (make_optimizer, loss_fn, batches, steps, pct, judge, cycle, train)
        self.loss: dict[int, float] = {}
        self.owner: dict[int, int] = {}
        self.best: tuple[float, int] = (math.inf, 0)  # this process's best run: (loss, place)
        self.kept, self.held = None, False  # its tensors; or still in the module
        self.lr_sums: dict[int, float] = {}  # place -> that run's param groups' LRs summed (_check_lrs_follow)
        self.said_momentum = False  # the warning that the runs cycle momentum into an optimizer without it
        self.rounds = 0  # rounds run so far (or taken from a progress dict: not run again)
        self.resumed = 0  # how many of the first rounds a progress dict holds
        self.first: tuple[list[float], list[float]] = ([], [])  # the first round's first losses and judged starts
        self.rng: dict[str, Any] | None = None  # the RNG's state after the last resumed round, set before the next
        self.on_round: Callable[[dict[str, Any]], None] | None = None

    def resume(self, progress: dict[str, Any] | None, on_round: Callable[[dict[str, Any]], None] | None) -> None:
        """Take a stopped sweep's progress (its rounds are not run again), after checking that it is this sweep's
        and, under ranks, that every rank has one of the same round, with the same runs, or none: every rank raises
        if one rank's is not (COLLECTIVE: one gather, before anything runs)."""
        self.on_round = on_round
        problem, rounds = None, 0
        try:
            rounds = _progress_rounds(progress)
            if progress is not None:
                want = {"plan": list(self.plan), "n": self.n, "keep_best": self.keep_best}
                got = {k: progress.get(k) for k in want}
                if got != want:
                    raise ValueError(f"Expected progress of this sweep (the same grid, steps, lr_factor, replicas and "
                                     f"keep), but it differs: {got} -> {want}")
                runs = zlib.crc32(json.dumps(sorted(int(k) for k in progress["loss"])).encode())
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            problem = e if isinstance(e, ValueError) else ValueError(f"Expected progress as lr_sweep's on_round gives "
                                                                      f"it, but it is not ({type(e).__name__}: {e})")
        if self.rank is not None:
            mine = [float(progress is not None), float(rounds), float(problem is None),
                    float(runs) if progress is not None and problem is None else -1.0]
            rows = ProcessGroupReplicas(self.group).gather(torch.tensor(mine, dtype=torch.float64)).tolist()
            bad = [r for r, row in enumerate(rows) if not row[2]]
            if problem is not None:
                raise problem
            if bad:
                raise ValueError(f"Expected every rank's progress to be of this sweep, but rank(s) {bad}'s are not "
                                 "(their error is raised there); nothing ran")
            if len({(row[0], row[1], row[3]) for row in rows}) > 1:
                raise ValueError(f"Expected every rank to pass its progress of the same round, or none, but they "
                                 f"differ: (has progress, rounds) by rank {[tuple(r[:2]) for r in rows]}")
        elif problem is not None:
            raise problem
        if progress is None:
            return
        self.loss = {int(k): float(v) for k, v in progress["loss"].items()}
        self.owner = {int(k): int(v) for k, v in progress["owner"].items()}
        self.first = (list(progress["first"][0]), list(progress["first"][1]))
        self.best = (float(progress["best"][0]), int(progress["best"][1]))
        kept = progress.get("kept")
        self.kept = None if kept is None else [k.to(t.device, t.dtype, copy=True) for k, t in zip(kept, self.tensors)]
        self.held = False
        self.resumed, self.rng = rounds, progress["rng"]
        self.lr_sums = {int(k): float(v) for k, v in (progress.get("lr_sums") or {}).items()}  # (older progress: none)

    def _progress(self) -> dict[str, Any]:
        """This process's progress after the rounds so far (plain data; the best run's tensors copied to the CPU)."""
        best = None
        if self.keep_best and (self.held or self.kept is not None):
            best = [t.detach().to("cpu", copy=True) for t in (self.tensors if self.held else self.kept)]
        return {"version": 1, "plan": list(self.plan), "n": self.n, "keep_best": self.keep_best, "rounds": self.rounds,
                "loss": dict(self.loss), "owner": dict(self.owner), "first": [list(self.first[0]), list(self.first[1])],
                "best": [self.best[0], self.best[1]], "kept": best, "rng": _rng_state(self.tensors),
                "lr_sums": dict(self.lr_sums)}

    def grid(self, ks: list[int]) -> float | None:
        """The grid's runs, ``n`` at a time; the start's loss: judged (one process: before the runs; under ranks: the
        ranks' mean), or the first round's runs' first training losses' mean (all from the start weights; later
        rounds start from them on the same first batches, so their first losses repeat these)."""
        start_loss = _judged(self.module, self.judge) if self.judge is not None and self.rank is None else None
        firsts, starts = self._round(ks[:self.n], first=True)
        self.more(ks[self.n:])
        if self.judge is None:
            finite = [f for f in firsts if math.isfinite(f)]
            return sum(finite) / len(finite) if finite else math.inf
        if self.rank == 0 and _apart(starts):  # (every rank judged rank 0's start weights)
            warnings.warn(f"hdet.lr_sweep: the judge gave the same start weights different losses on different ranks "
                          f"({', '.join(f'{v:.6g}' for v in starts)}): it must read the same held-out data on every "
                          "rank, or each run is judged on its own rank's data", stacklevel=user_stacklevel())
        return start_loss if self.rank is None else sum(starts) / len(starts)

    def more(self, ks: list[int]) -> None:
        """Runs at places ``ks`` (the grid's after its first round, or beyond the grid), ``n`` at a time."""
        for c in range(0, len(ks), self.n):
            self._round(ks[c:c + self.n], first=False)

    def _round(self, ks: list[int], first: bool) -> tuple[list[float], list[float]]:
        """The runs at places ``ks`` (or, where a progress dict holds them, what they gave): each one's first training
        loss, and (``first``, under ranks) each rank's judged start loss; then ``on_round``."""
        if self.rounds < self.resumed:
            if any(k not in self.loss for k in ks):
                raise ValueError(f"Expected the progress's round {self.rounds + 1} to hold the runs at places {ks}, but "
                                 f"it holds {sorted(self.loss)}: it is not this sweep's")
            self.rounds += 1
            return self.first if first else ([], [])
        if self.rng is not None:  # (the RNG as the uninterrupted sweep's after the resumed rounds)
            _set_rng_state(self.rng)
            self.rng = None
        got = self._run_round(ks, first)
        self.rounds += 1
        if first:
            self.first = got
        self._call_on_round()
        return got

    def _call_on_round(self) -> None:
        """``on_round(progress)``; under ranks, an error on one rank is raised on every rank (it raised there alone,
        and the others waited for it in the next round's collective)."""
        if self.rank is None:
            if self.on_round is not None:
                self.on_round(self._progress())
            return
        failed = None
        try:
            if self.on_round is not None:
                self.on_round(self._progress())
        except Exception as e:  # noqa: BLE001 - raised below, after every rank has heard of it
            failed = e
        fails = ProcessGroupReplicas(self.group).gather(  # COLLECTIVE (once a round): whether on_round raised
            torch.tensor([float(failed is not None)], dtype=torch.float64)).flatten().tolist()
        if failed is not None:
            raise failed
        if any(fails):
            raise RuntimeError(f"lr_sweep's on_round raised on rank(s) {[r for r, f in enumerate(fails) if f]} of the "
                               "group (their error is raised there); this rank's model is back at its start weights")

    def _run_round(self, ks: list[int], first: bool) -> tuple[list[float], list[float]]:
        if self.rank is None:
            firsts = []
            for i, k in enumerate(ks):
                self._from_start()
                value, f, lr_sum = self._run(i, k)
                self._check_lrs_follow({k: lr_sum})
                self._done(k, value)
                firsts.append(f)
            return firsts, []
        mine, judged, failed = (math.nan, math.nan, math.nan), math.nan, None
        try:  # (under ranks, the module holds this rank's own weights until now in the first round)
            self._from_start()
        except Exception as e:  # noqa: BLE001 - raised below, after every rank has heard of it
            failed = e
        for t in self.tensors:  # COLLECTIVE: one broadcast a tensor a round: rank 0's start weights on every rank
            dist.broadcast(t, src=self.src0, group=self.group)
        try:
            if failed is None and first and self.judge is not None:
                judged = _judged(self.module, self.judge)
            if failed is None and self.rank < len(ks):
                mine = self._run(self.rank, ks[self.rank])
        except Exception as e:  # noqa: BLE001 - raised below, after every rank has heard of it
            failed = e
        rows = ProcessGroupReplicas(self.group).gather(  # COLLECTIVE (once a round): [ranks, 5 + plan] on the host
            torch.tensor([*mine, judged, float(failed is not None), *self.plan], dtype=torch.float64))
        losses, firsts, sums, starts, fails = (col.tolist() for col in rows.T[:5])
        if any(len(set(col.tolist())) > 1 for col in rows.T[5:]):  # (every rank sees the same rows: all raise)
            raise ValueError(f"Expected every rank to sweep the same grid (the same guess, lr_factor, span, points and "
                             f"steps), but they differ: (points, log of the first LR, log of the ratio, steps, lr_factor) "
                             f"by rank "
                             f"{[tuple(r) for r in rows[:, 5:].tolist()]}")
        if failed is not None:
            raise failed
        if any(fails):
            raise RuntimeError(f"lr_sweep failed on rank(s) {[r for r, f in enumerate(fails) if f]} of the group "
                               "(their error is raised there); this rank's model is back at its start weights")
        self._check_lrs_follow(dict(zip(ks, sums)))  # (the same rows on every rank: all raise, or none)
        for i, k in enumerate(ks):
            self.loss[k], self.owner[k] = losses[i], i
        if self.rank < len(ks):
            self._done(ks[self.rank], losses[self.rank])
        return firsts[:len(ks)], starts

    def _check_lrs_follow(self, sums: dict[int, float]) -> None:
        """ValueError where two runs at different LRs had their param groups' LRs summed to the same value (``sums``:
        the new runs' by place): a ``make_optimizer`` that drops its ``lr`` trains every run at the same LRs, and the
        sweep would pick among its batches' noise (an audit: 3.5e-7 for an AdamW whose every run was at 1e-3). Groups
        at fixed LRs beside the swept ones, or LRs rounded by the user, move the sum: fine."""
        for k, v in sums.items():
            same = [j for j, w in self.lr_sums.items() if j != k and math.isclose(v, w, rel_tol=1e-9)]
            if same:
                lrs = [_on_lattice(j, self.base, self.step) for j in (same[0], k)]
                raise ValueError(f"Expected make_optimizer(params, lr) to set its param groups' learning rates from "
                                 f"lr, but they summed to {v:.4g} in the runs at lr {_fmt(lrs)} alike: those runs "
                                 "would train at the same learning rates")
            self.lr_sums[k] = v

    def _run(self, i: int, k: int) -> tuple[float, float, float]:
        """The run at place ``k``, the i-th of its round (on ``batches(i)``): its judged loss, its first training
        loss and its param groups' LRs summed."""
        make_optimizer, loss_fn, batches, steps, pct, judge, cycle, train = self.args
        try:
            value, first, lr_sum, added = _run(self.module, make_optimizer, loss_fn, batches(i),
                                               _on_lattice(k, self.base, self.step), steps, pct, judge, cycle, train)
        finally:
            _rebind(self.buffers)
        if added and not self.said_momentum and self.rank in (None, 0):  # (once a sweep, one rank)
            self.said_momentum = True
            warnings.warn(f"hdet.lr_sweep: the runs cycle momentum (beta1) 0.85-0.95 into an optimizer whose "
                          f"momentum is 0 ({added}), as torch's OneCycleLR (and OneCycleAutoLR) does in a main run: "
                          "pass cycle_momentum=False for a main run without momentum (the pick differs by several "
                          "times)", stacklevel=user_stacklevel())
        return value, first, lr_sum

    def _from_start(self) -> None:
        """The module back at this process's start weights; this process's best run's tensors kept first."""
        if self.held:
            self.kept, self.held = [t.clone() for t in self.tensors], False
        _copy(self.tensors, self.start)

    def _done(self, k: int, value: float) -> None:
        if self.rank is None:
            self.loss[k] = value
        if self.keep_best and math.isfinite(value) and (value, k) < self.best:  # (ties: the lowest LR, as the winner)
            self.best, self.kept, self.held = (value, k), None, True

    def keep_winner(self, k: int) -> None:
        """The run at place ``k``'s weights and buffers in the module, on every rank."""
        mine = self.rank is None or self.owner[k] == self.rank
        if mine and not self.held:
            _copy(self.tensors, self.kept)
        if self.rank is not None:
            src = dist.get_global_rank(self.group, self.owner[k]) if self.group is not None else self.owner[k]
            for t in self.tensors:  # COLLECTIVE: one broadcast a tensor (once a sweep)
                dist.broadcast(t, src=src, group=self.group)


def _apart(values: list[float], rtol: float = 1e-4) -> bool:
    """Whether finite ``values`` differ by more than rounding (``rtol`` of the largest)."""
    finite = [v for v in values if math.isfinite(v)]
    return bool(finite) and max(finite) - min(finite) > rtol * max(abs(v) for v in finite) + 1e-12


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    """The module's parameters and buffers (non-persistent ones too), each once, as the tensors themselves."""
    seen: set[int] = set()
    out = []
    for t in (*module.parameters(), *module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t.data if isinstance(t, nn.Parameter) else t)
    return out


def _buffer_slots(module: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """Every buffer's slot (its module and name) and the tensor in it now."""
    return [(m, name, b) for m in module.modules() for name, b in m._buffers.items() if b is not None]


@torch.no_grad()
def _rebind(slots: list[tuple[nn.Module, str, torch.Tensor]]) -> None:
    """A buffer a forward reassigned (``self.mean = 0.9 * self.mean + ...``, not in place) back in its slot as the
    tensor the sweep restores and keeps, holding the new value: else the next run started from the last one's value,
    and the model ended with it (an audit)."""
    for m, name, b in slots:
        now = m._buffers.get(name)
        if now is not b:
            if isinstance(now, torch.Tensor) and now.shape == b.shape:
                b.copy_(now)
            m._buffers[name] = b


def _restore(module: nn.Module, grads: list[torch.Tensor | None], modes: list[tuple[nn.Module, bool]]) -> None:
    """Each parameter's gradient (the tensor it held, or None) and each submodule's train/eval mode, as they came."""
    for p, g in zip(module.parameters(), grads):
        p.grad = g
    _set_modes(modes)


def _set_modes(modes: list[tuple[nn.Module, bool]]) -> None:
    for m, training in modes:
        m.training = training


@torch.no_grad()
def _copy(tensors: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    for t, v in zip(tensors, values):
        t.copy_(v)


def _replicas(model: nn.Module, num_replicas: int | None, group: Any) -> tuple[nn.Module, int, int | None]:
    """The module to sweep, N, and this process's replica (None: one process runs all N)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"Expected model to be a torch.nn.Module, but got {type(model).__name__}")
    inner = uncompiled(model)  # (torch.compile(DDP(net)): its steps all-reduce, so the runs shared their gradients)
    module = inner.module if isinstance(inner, nn.parallel.DistributedDataParallel) else model
    if type(module).__name__ in ("FSDPModule", "FullyShardedDataParallel") or any(
            type(p).__name__ == "DTensor" for p in module.parameters()):
        raise TypeError("Expected a module with plain (unsharded) parameters: lr_sweep runs one replica a rank and "
                        "broadcasts the best one's weights; sweep before sharding the model")
    if any(isinstance(m, nn.SyncBatchNorm) for m in module.modules()):
        raise TypeError("Expected no nn.SyncBatchNorm in the model: it all-reduces its batch statistics across ranks, "
                        "which would mix the sweep's independent runs; sweep before convert_sync_batchnorm")
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    if not distributed:
        n = int_number(num_replicas)
        if n is None or n < 2:
            raise ValueError(f"Expected num_replicas to be an int of at least 2 in one process, but got "
                             f"{num_replicas!r}")
        return module, n, None
    n = dist.get_world_size(group)
    if num_replicas is not None and int_number(num_replicas) != n:
        raise ValueError(f"Expected num_replicas to be None or the process group's size ({n}), but got "
                         f"{num_replicas!r}: under torch.distributed every rank is one replica")
    return module, n, dist.get_rank(group)


def _run(module: nn.Module, make_optimizer: Callable[..., torch.optim.Optimizer],
         loss_fn: Callable[[nn.Module, Any], torch.Tensor], batches: Iterable[Any], lr: float, steps: int,
         pct_start: float, judge: Callable[[nn.Module], Any] | None, cycle_momentum: bool | None,
         train: list[tuple[nn.Module, bool]]) -> tuple[float, float, float, str | None]:
    """One sweep run from the module's current weights: ``steps`` steps of OneCycle to ``lr``. Its judged loss (inf
    where non-finite), its first training loss (the start's, on its first batch), its param groups' LRs summed
    (:meth:`_Runs._check_lrs_follow`), and the optimizer where its momentum cycle adds momentum the optimizer did not
    have (``SGD(momentum=0)``, ``RMSprop``, ``Adam(betas=(0, ...))``; None otherwise)."""
    opt = make_optimizer(module.parameters(), lr)
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"Expected make_optimizer(params, lr) to return a torch.optim.Optimizer, but got "
                        f"{type(opt).__name__}")
    if any(c.__name__ == "ZeroRedundancyOptimizer" for c in type(opt).__mro__):  # (an audit: the runs' shards
        # mixed, then a round with an idle rank hung)
        raise TypeError("Expected make_optimizer to return an optimizer of this rank's own (each rank is one "
                        "independent run of the sweep), but got a ZeroRedundancyOptimizer, whose step broadcasts each "
                        "rank's shard of the weights to the others: return the optimizer it wraps for the sweep")
    lr_sum = sum(float(g["lr"]) for g in opt.param_groups)
    own = {id(p) for p in module.parameters()}
    outside = [p for g in opt.param_groups for p in g["params"] if id(p) not in own]
    if outside:  # (a loss module's learnable temperature, added in make_optimizer's closure)
        raise ValueError(f"Expected make_optimizer to step only the model's parameters, but it steps {len(outside)} "
                         f"other(s) (shapes {[tuple(p.shape) for p in outside][:4]}): the sweep restores the model "
                         "alone, so each run would start where the one before left them, and the run after the sweep "
                         "from the last run's; make them part of the model, or leave them out of the sweep's optimizer")
    cycle = cycle_momentum if cycle_momentum is not None else ("momentum" in opt.defaults or "betas" in opt.defaults)
    added = None
    if cycle_momentum is None and cycle and any(g.get("momentum", 1) == 0 or (g.get("betas") or (1,))[0] == 0
                                                for g in opt.param_groups):
        added = f"{type(opt).__name__} with " + ("momentum=0" if "momentum" in opt.defaults else "beta1=0")
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[g["lr"] for g in opt.param_groups],
                                                total_steps=steps, pct_start=pct_start, cycle_momentum=cycle)
    _set_modes(train)
    tail, last = [], max(1, steps // 10)
    it = iter(batches)
    for i in range(steps):
        try:
            batch = next(it)
        except StopIteration:
            raise ValueError(f"Expected batches(r) to yield at least steps={steps} batches (a fresh iterable at each "
                             f"call: runs beyond the grid call it again), but it ended after {i}") from None
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(module, batch)
        loss.backward()
        opt.step()
        sched.step()
        if i == 0:
            first = loss.detach().float()
        if i >= steps - last:
            tail.append(loss.detach().float())
    value, first_f = torch.stack([torch.stack(tail).mean(), first]).tolist()  # HOST SYNC (once a run)
    if judge is not None:
        value = _judged(module, judge)
    return (value if math.isfinite(value) else math.inf), first_f, lr_sum, added


def _judged(module: nn.Module, judge: Callable[[nn.Module], Any]) -> float:
    """``judge(module)`` as a float, under no_grad in eval mode (the caller restores the mode)."""
    module.eval()
    with torch.no_grad():
        got = judge(module)
    one = isinstance(got, torch.Tensor) and got.numel() == 1 and not got.is_complex()
    value = float(got.detach()) if one else real_number(got)  # HOST SYNC (once a run)
    if value is None:
        raise TypeError(f"Expected judge(model) to return one real number, but got {type(got).__name__}")
    return value if math.isfinite(value) else math.inf


def _fmt(lrs: list[float]) -> str:
    return ", ".join(f"{lr:.3g}" for lr in lrs)
