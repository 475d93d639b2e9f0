"""A scheduler's state_dict, chosen on purpose: torch's counters and last LRs, the recorded schedule, the
base scheduler's own state (``"base"``), and the ensemble's versioned state (``"hdet"``). Never the
optimizer, the guard, a hook or a callable. Checked completely before anything is set.
"""

from __future__ import annotations

import bisect
import copy
import io
import math
import warnings
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import OneCycleLR, SequentialLR

from .caller import user_stacklevel
from .guard import check_watch_state
from .values import as_float

if TYPE_CHECKING:
    from .schedulers import HDETLR

__all__ = ["state_dict", "check", "load", "check_plain", "momentum_cyclers", "RankState", "refuse_dcp"]

OWN = ("last_epoch", "_step_count", "_last_lr", "base_lrs", "total_steps", "_history", "_constant",
       "_finished_at")  # (the step finish() averaged after: a resumed run's finish() there again is no second sync)


class RankState:
    """An HDET scheduler in a ``torch.distributed.checkpoint`` (DCP) state dict: ``{"sched": hdet.RankState(sched)}``
    beside the model's and optimizer's. Each rank's own state, as the bytes of ``torch.save``, under its own key
    ``rank{r}`` (global rank), loaded back into the same rank's scheduler. The scheduler given as it is was refused:
    DCP builds the state to load from a freshly built scheduler, whose state has another shape (a loss window, a
    controller's or a go-back's state that a new run has none of yet: a checkpoint saved mid-window or with
    ``on_runaway="recover"`` could not be loaded, with DCP's own error, after the crash), and it keeps one copy of the
    values every rank saved alike, so a rank's own (its rank, last LRs, a go-back's start) was another's (an audit).
    Resume on the same number of ranks (a rank's state is its replica's)."""

    def __init__(self, scheduler: Any) -> None:
        if not (callable(getattr(scheduler, "state_dict", None)) and callable(getattr(scheduler, "load_state_dict",
                                                                                      None))):
            raise ValueError(f"Expected an hdet scheduler (HDETLR, OneCycleAutoLR), but got {type(scheduler).__name__}")
        self.scheduler = scheduler

    def _key(self) -> str:
        return f"rank{dist.get_rank() if dist.is_available() and dist.is_initialized() else 0}"

    def state_dict(self) -> dict[str, bytes]:
        buffer = io.BytesIO()
        torch.save(self.scheduler.state_dict(), buffer)
        return {self._key(): buffer.getvalue()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        key = self._key()
        if not isinstance(state_dict, dict) or not isinstance(state_dict.get(key), bytes):
            raise ValueError(f"Expected this rank's scheduler state under {key!r} (hdet.RankState's), but got "
                             f"{sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__}")
        self.scheduler.load_state_dict(torch.load(io.BytesIO(state_dict[key]), weights_only=True))


def refuse_dcp(caller: FrameType | None) -> None:
    """A scheduler's ``state_dict()`` called by ``torch.distributed.checkpoint`` (a ``Stateful`` in ``dcp.save`` or
    ``dcp.load``): refused, saying to wrap it in :class:`RankState` (a checkpoint that could not be loaded was found
    only at the resume: an audit)."""
    frame, depth, dcp = caller, 0, False
    while frame is not None and depth < 8 and not dcp:  # (a Stateful of the user's, torch's DCP tutorial's AppState,
        name = frame.f_globals.get("__name__", "")       # that returns sched.state_dict() among its own: a few up)
        if name == __name__:  # (RankState's own call)
            return
        dcp, frame, depth = name.startswith("torch.distributed.checkpoint"), frame.f_back, depth + 1
    if dcp:
        raise ValueError("Expected hdet.RankState(sched) in a torch.distributed.checkpoint state dict, but got the "
                         "scheduler itself: DCP keeps one copy of what every rank saves alike and loads into the state "
                         "of a new scheduler, whose shape differs from a running one's (a checkpoint saved mid-window "
                         "or with on_runaway='recover' could not be loaded). Use {'sched': hdet.RankState(sched)}, or "
                         "torch.save(sched.state_dict()) on each rank")


def state_dict(s: "HDETLR") -> dict[str, Any]:
    state: dict[str, Any] = {k: _copy(getattr(s, k)) for k in OWN if hasattr(s, k)}  # (a copy: the record and the
    # last LRs go on changing with the scheduler, a state taken in memory must not)
    state["hdet"] = s.ensemble.state_dict()
    state["hdet"]["scheduler"] = type(s).__name__
    own = dict((id(h), v) for h, v in s._swap._values)  # inside averaged(): the values put back after it, not the
    # bases held meanwhile (a checkpoint taken there resumed this replica's next step at the bases; an audit)
    state["hdet"]["hyper_values"] = [own.get(id(h), h.get()) if s._swap.active else h.get()
                                     for h in s.ensemble.hypers]  # restored exactly on load
    state["hdet"]["hyper_bases"] = [h.initial for h in s.ensemble.hypers]  # their unscheduled bases, too
    state["hdet"]["hyper_spreads"] = [_spread(h) for h in s.ensemble.hypers]  # compared on load (said if changed)
    if s._base is not None:
        state["base"] = s._base.state_dict()
        state["base_scheduler"] = type(s._base).__name__
    state["loss_scale_kept"] = s._loss_scale.kept_value()  # a GradScaler's scale at the last healthy sync (host read)
    state["closed"] = s.closed  # (a run closed before its end, after finish(), loads closed: HDETLR.load_state_dict)
    state["guard"] = s._guard.state_dict()  # the gradient guard's stall counts (HOST SYNC: its skip counter)
    probe = schedule_probe(s, s.total_steps)
    if probe is not None:
        state["schedule_probe"] = probe
    weights = s.ensemble.weights_fingerprint()  # (HOST SYNC) under a process group: checked at the first optimizer
    if weights is not None:  # step after a load (HDETLR.expect_weights)
        state["weights"] = weights
    check_plain(state, "state_dict()")
    return state


def schedule_probe(s: "HDETLR", total: int, steps: list[int] | None = None) -> list[list[Any]] | None:
    """The base schedule at nine steps over the run (0, total/8, ..., total), or at ``steps``: ``[[t, [value per
    group]], ...]``, for a base that is a function of the step (a callable, a ``LambdaLR``); None otherwise, or where
    the schedule cannot be evaluated there (it raised). A state holds it, and a load compares the rebuilt schedule at
    the same steps: a linear decay rebuilt as a cosine one to the same end, which agrees at the saved step, resumed
    on the cosine unsaid (an audit)."""
    steps = sorted({round(k * total / 8) for k in range(9)}) if steps is None else steps
    try:
        out = []
        for t in steps:
            values = s._base_at(t)
            if values is None:
                return None
            out.append([int(t), [float(v) for v in values]])
        return out
    except Exception:  # (a user's schedule defined on part of the range: no probe, nothing compared)
        return None


def _spread(h: Any) -> list[Any]:
    """An explored hyperparameter's spread as plain data: kind, alpha, bounds, and whether it has a schedule."""
    return [h.spread.kind, float(h.spread.alpha), [float(b) for b in h.spread.bounds], h.schedule is not None]


def _said_if_rebuilt_differently(s: "HDETLR", hdet_state: dict[str, Any], built: list[float], saved_base: Any,
                                 state_probe: Any = None) -> None:
    """A state loaded into a scheduler built with another schedule or spread resumes on the new one: said, where
    it was silent (an audit: a callable base 10x higher resumed at 10x the LR; an explored weight decay's alpha
    0.5 -> 0.9 moved its values at the next deal). The saved schedule's value at the saved step against the
    rebuilt one's (to 6 significant digits, as the replicas' settings fingerprint compares them); for a torch
    scheduler as the base (whose loaded state gives back the saved value), its ``base_lrs`` as built here against
    the saved ones (OneCycleLR's are max_lr / div_factor)."""
    from .ensemble_state import _say

    ens = s.ensemble
    saved = hdet_state.get("scheduled")
    now = ens.slots.scheduled
    moved: list[Any] = []
    if isinstance(saved, list) and len(saved) == len(now) and s.last_epoch >= 0:
        moved = [(name, float(a), float(b)) for name, a, b in zip(ens.slots.names, saved, now)
                 if f"{float(a):.6g}" != f"{float(b):.6g}"]
        if isinstance(saved_base, list) and len(saved_base) == len(built):
            moved += [(f"{type(s._base).__name__}'s base_lrs[{i}]", float(a), float(b))
                      for i, (a, b) in enumerate(zip(saved_base, built)) if f"{float(a):.6g}" != f"{float(b):.6g}"]
        if moved:
            _say(ens, f"hdet: the loaded state's schedule gave {', '.join(f'{n} {a:.6g}' for n, a, _ in moved)} at "
                      f"step {s.last_epoch}, and this scheduler's gives {', '.join(f'{b:.6g}' for _, _, b in moved)}: "
                      "it was built with another base schedule (max_lr, a callable, an explored value's schedule=), "
                      "and the resumed run does not follow the saved run's. Build it as the saved run was to resume "
                      "that run" + (" (or load the saved optimizer state after this: OneCycleLR reads max_lr and "
                                    "initial_lr from its param groups)" if isinstance(s._base, OneCycleLR) else ""))
    probe = [p for p in state_probe if isinstance(p, list) and len(p) == 2 and isinstance(p[0], int) and
             isinstance(p[1], list) and all(isinstance(v, (int, float)) for v in p[1])] \
        if isinstance(state_probe, list) else []  # (plain data, as saved; anything else is not compared)
    if probe and not moved and s.total_steps == s._built_total_steps:  # (said already at the saved step; a run of
        # another length, set_total_steps or the HF Trainer's resume, follows a schedule of that length, as it should)
        now = schedule_probe(s, s.total_steps, [p[0] for p in probe])
        apart = [(t, a, b) for (t, a), (_, b) in zip(probe, now or [])
                 if len(a) == len(b) and any(f"{float(x):.6g}" != f"{float(y):.6g}" for x, y in zip(a, b))]
        if now is not None and apart:
            _say(ens, "hdet: the loaded state's base schedule gave " + ", ".join(
                f"{[float(f'{x:.6g}') for x in a]} at step {t}" for t, a, _ in apart[:3]) + ", and this scheduler's "
                "gives " + ", ".join(f"{[float(f'{y:.6g}') for y in b]}" for _, _, b in apart[:3]) + " there: it was "
                "built with another base schedule (a callable, a LambdaLR's lambdas), which the resumed run follows "
                "from here on. Build it as the saved run was to resume that run")
    spreads = hdet_state.get("hyper_spreads")
    if isinstance(spreads, list) and len(spreads) == len(ens.hypers):
        changed = [(h.name, old, _spread(h)) for h, old in zip(ens.hypers, spreads) if list(old) != _spread(h)]
        if changed:
            _say(ens, "hdet: the loaded state's explored spreads differ from this scheduler's ("
                      + "; ".join(f"{n}: kind, alpha, bounds, scheduled {o} saved, {c} now" for n, o, c in changed)
                      + "): the resumed run's next step uses the saved values, and the steps after it this "
                      "scheduler's spreads (the window under way mixes both). Build the explored hyperparameters as "
                      "the saved run did to resume that run")


def _copy(x: Any) -> Any:
    """A copy of the scheduler's own entries (numbers, lists of numbers, the record: a dict of lists of floats),
    4x faster than ``copy.deepcopy`` on a record of 200k steps; anything else deep-copied."""
    if isinstance(x, dict):
        return {k: list(v) if isinstance(v, list) else _copy(v) for k, v in x.items()}
    if isinstance(x, list) and all(isinstance(v, (int, float)) for v in x):
        return list(x)
    return copy.deepcopy(x)


def check(s: "HDETLR", state: Any) -> dict[str, Any]:
    """Check a state completely, change nothing; returns the parsed ensemble state."""
    if not isinstance(state, dict) or "hdet" not in state:
        keys = sorted(state)[:8] if isinstance(state, dict) else type(state).__name__
        plain = isinstance(state, dict) and "_schedule_phases" in state and isinstance(state.get("last_epoch"), int)
        raise ValueError(f"Expected a {type(s).__name__} state_dict (with an 'hdet' entry), but got {keys}" + (
            f": torch's OneCycleLR's. To go on with that run under HDET, load the optimizer, then build "
            f"OneCycleAutoLR(optimizer, <the same OneCycleLR arguments>, last_epoch={state['last_epoch'] - 1}, ...) "
            "instead of loading this state: its schedule goes on exactly where OneCycleLR's stopped, and HDET starts "
            "there" if plain else ""))
    _check_own(s, state)
    parsed = s.ensemble.check_state(state["hdet"])  # (the explored slots: names and count)
    _check_hyper_bases(s, state)
    _check_base(s, state)
    return parsed


def closed(s: "HDETLR", state: dict[str, Any]) -> bool:
    """Whether a checked ``state`` is a closed run's: saved after :meth:`hdet.HDETLR.close` or after the run's last
    step (an older state, without ``"closed"``: its step count at its ``total_steps``)."""
    return bool(state.get("closed")) or state["last_epoch"] >= state.get("total_steps", s.total_steps)


def load(s: "HDETLR", state: dict[str, Any], parsed: dict[str, Any] | None = None) -> None:
    """Set a state (``parsed``: :func:`check`'s answer for it, if it was checked already)."""
    from .ensemble_state import _shard_rank

    parsed = check(s, state) if parsed is None else parsed
    hdet_state = state["hdet"]
    same_replica = not parsed["elastic"] and hdet_state["rank"] == s.rank
    s.ensemble.commit_state(parsed, hdet_state)
    # each explored value's base as saved: one read from an optimizer loaded before this scheduler was built holds
    # this replica's spread value, and the spread would compound on it (states of hdet <= 0.1 have none)
    for h, b in zip(s.ensemble.hypers, hdet_state.get("hyper_bases") or []):
        h.initial = float(b)
    if s.ensemble.hypers and "hyper_bases" not in hdet_state:
        warnings.warn("hdet: this checkpoint predates saved explored bases: each explored hyperparameter keeps the "
                      "base it read when this scheduler was built. If the optimizer was loaded before the scheduler "
                      "was built, that is this replica's spread value, and the replicas will disagree at the next "
                      "sync (ReplicaMismatchError): build the scheduler, then load the optimizer and the scheduler",
                      stacklevel=user_stacklevel())
    recording = s._history is not None
    for key in OWN:
        if key in state:
            setattr(s, key, _copy(state[key]))  # (the scheduler's own: the state may be loaded again)
    if recording and s._history is None:  # a state saved before record_schedule() was called
        s._history = {}
        warnings.warn(f"hdet: record_schedule() was called, but the loaded state holds no record (it was saved before "
                      f"record_schedule() was called): the record goes on from step {s.last_epoch} only, and "
                      "discovered_schedule() refuses a record that does not start at step 0",
                      stacklevel=user_stacklevel())
    s._finished_at = state.get("_finished_at")  # (None in states before it, and when finish() never ran)
    s._guard.load_state_dict(state.get("guard"))  # (states before it have none: the guard's resumed() rule)
    built = list(getattr(s._base, "base_lrs", None) or [])  # the base scheduler's own, as built here (OneCycleLR's
    if isinstance(s._base, OneCycleLR):  # from the param groups, which it reads: an optimizer loaded before this holds
        built = [as_float(g.get("initial_lr", b)) for g, b in zip(s.optimizer.param_groups, built)]  # the saved run's)
    if s._base is not None:
        _load_base(s, state)
        _cycled_momentum(s._base)
    if "loss_scale_kept" in state:  # (states saved before it: the scale kept by this process, if any)
        s._loss_scale.set_kept(state["loss_scale_kept"])
    s.reapply()  # this replica's values on the optimizer and hyperparameters
    _said_if_rebuilt_differently(s, hdet_state, built, (state.get("base") or {}).get("base_lrs"),
                                 state.get("schedule_probe"))
    if same_replica and not s.closed:  # exactly the values this replica had (they equal what reapply computed; a
        for h, v in zip(s.ensemble.hypers, hdet_state.get("hyper_values", [])):  # closed scheduler's are the base's)
            h.set(v)
        if isinstance(state.get("weights"), float) and hdet_state.get("shard_rank", 0) == _shard_rank(s.ensemble):
            s.expect_weights(state["weights"])  # (HSDP: the same shard rank of the replica saved it)


def _check_own(s: "HDETLR", state: dict[str, Any]) -> None:
    kind = state["hdet"].get("scheduler") if isinstance(state["hdet"], dict) else None
    if kind is None and isinstance(state["hdet"], dict):  # states saved before the field: their own keys tell
        kind = "OneCycleAutoLR" if "_schedule_phases" in state else "HDETLR" if "_final" in state else None
    if kind is not None and kind != type(s).__name__:
        raise ValueError(f"Expected a {type(s).__name__} state_dict, but got one saved by {kind}")
    n = len(s.optimizer.param_groups)
    last = state.get("last_epoch")
    if isinstance(last, bool) or not isinstance(last, int) or last < -1:
        raise ValueError(f"Expected the state's last_epoch as an integer >= -1, but got {last!r}")
    total = state.get("total_steps", s.total_steps)
    if isinstance(total, bool) or not isinstance(total, int) or last > total:
        raise ValueError(f"Expected the state's total_steps as an integer >= last_epoch ({last}), but got {total!r}")
    for key in ("_last_lr", "base_lrs", "_constant"):
        v = state.get(key)
        if v is not None and (not isinstance(v, list) or len(v) != n):
            raise ValueError(f"Expected the state's {key} with one value per param group ({n}), but got {v!r}")
    done = state.get("_finished_at")
    if done is not None and (isinstance(done, bool) or not isinstance(done, int) or not 0 < done <= last):
        raise ValueError(f"Expected the state's _finished_at as a step in 1..last_epoch ({last}) or None, but got "
                         f"{done!r}")
    if not isinstance(state.get("closed", False), bool):
        raise ValueError(f"Expected the state's closed as True or False, but got {state['closed']!r}")
    check_watch_state(state.get("guard"))
    kept = state.get("loss_scale_kept")
    if kept is not None and (isinstance(kept, bool) or not isinstance(kept, (int, float)) or not math.isfinite(kept)
                             or kept <= 0):
        raise ValueError(f"Expected the state's loss_scale_kept as a finite scale > 0 or None, but got {kept!r}")


def _check_hyper_bases(s: "HDETLR", state: dict[str, Any]) -> None:
    bases = state["hdet"].get("hyper_bases")
    hypers = s.ensemble.hypers
    if bases is not None and (not isinstance(bases, list) or len(bases) != len(hypers) or not all(
            isinstance(b, (int, float)) and not isinstance(b, bool) and math.isfinite(b)
            and h.spread.clamp(b) == b and (h.spread.kind != "log" or b > 0) for b, h in zip(bases, hypers))):
        raise ValueError(f"Expected the state's hyper_bases with one valid base per explored hyperparameter "
                         f"({[h.name for h in hypers]}), but got {bases!r}")


def _flat_onecycle(s: "HDETLR", state: dict[str, Any]) -> bool:
    """A OneCycleAutoLR state of hdet <= session 15: OneCycleLR's fields at the top level, no "base"."""
    return isinstance(s._base, OneCycleLR) and "base" not in state and "_schedule_phases" in state


def _check_base(s: "HDETLR", state: dict[str, Any]) -> None:
    base_state = state.get("base")
    if s._base is None:
        if base_state is not None:
            raise ValueError(f"Expected a state of an HDETLR without a base scheduler, but this one was saved with "
                             f"a {state.get('base_scheduler', 'base scheduler')}")
        return
    if _flat_onecycle(s, state):
        return
    kind, want = state.get("base_scheduler"), type(s._base).__name__
    if not isinstance(base_state, dict):
        raise ValueError(f"Expected the state of a {want} base, but the state holds {base_state!r}")
    if kind is not None and kind != want:
        raise ValueError(f"Expected the state of a {want} base, but the state holds a {kind}'s")
    optional = {"use_beta1"}  # (OneCycleLR and CyclicLR keep it only with cycle_momentum: a state saved with the
    # other setting loads, the saved one winning, as torch loads it)
    public = {k for k in s._base.state_dict() if not k.startswith("_")} - optional  # private keys vary with torch
    got = {k for k in base_state if not k.startswith("_")} - optional
    if got != public:
        raise ValueError(f"Expected the state of a {want} base, but its keys differ: missing "
                         f"{sorted(public - got)}, unexpected {sorted(got - public)}")


def momentum_cyclers(base: Any, active: bool = False) -> list[Any]:
    """The schedules in ``base`` that cycle the momentum (OneCycleLR's, CyclicLR's ``cycle_momentum``): ``base``
    itself, or inside a ``ChainedScheduler`` or ``SequentialLR`` (before, a wrapped one was missed: an explored
    beta1 silently dropped its cycle, and a resume's first step ran at ``max_momentum``). ``active``: only those that
    set it at the current step (a ``SequentialLR``'s current schedule; every one of a ``ChainedScheduler``, in order:
    the last writes last)."""
    children = getattr(base, "_schedulers", None)
    if isinstance(children, (list, tuple)):  # (torch keeps the sequence as given)
        if active and isinstance(base, SequentialLR):
            children = [children[bisect.bisect_right(base._milestones, base.last_epoch)]]
        return [c for child in children for c in momentum_cyclers(child, active)]
    return [base] if getattr(base, "cycle_momentum", False) else []


def _cycled_momentum(base: Any) -> None:
    """A base that cycles the momentum (OneCycleLR's, CyclicLR's, or one inside a ChainedScheduler or SequentialLR)
    sets it as a side effect of computing its LRs: set it for the loaded step, as torch set it there (an optimizer
    loaded before this scheduler was built had it overwritten by the base's constructor: beta1 at ``max_momentum``
    for the first resumed step)."""
    for cycler in momentum_cyclers(base, active=True):
        with warnings.catch_warnings():  # torch warns when get_lr runs outside step()
            warnings.simplefilter("ignore", UserWarning)
            cycler.get_lr()


def _load_base(s: "HDETLR", state: dict[str, Any]) -> None:
    base = s._base
    assert base is not None
    if not _flat_onecycle(s, state):
        base.load_state_dict(state["base"])
        return
    base.load_state_dict({k: state[k] for k in base.state_dict() if k in state and k != "_last_lr"})
    with warnings.catch_warnings():  # torch warns when get_lr runs outside step()
        warnings.simplefilter("ignore", UserWarning)
        base._last_lr = base.get_lr()  # the schedule's own value at last_epoch (the saved one was base * rho)


def check_plain(x: Any, where: str) -> None:
    """A state must be plain data: what ``torch.load(weights_only=True)`` reads back."""
    if x is None or isinstance(x, (bool, int, float, str, torch.Tensor, torch.dtype, torch.device)):
        return
    if isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            check_plain(v, f"{where}[{i}]")
        return
    if isinstance(x, dict):
        for k, v in x.items():
            check_plain(v, f"{where}[{k!r}]")
        return
    raise TypeError(f"hdet bug: {where} holds a {type(x).__name__}, which is not plain data")
