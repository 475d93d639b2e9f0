"""An ensemble's state_dict: plain data, versioned, checked completely before anything is set.

Version 3 (this hdet): the config under its public option names, each controller's own state (the
paper controller's base included). Version 2 (the previous sessions' format: the config's short names,
a separate ``controlled`` list) and version 1 (no version field) still load.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from .caller import user_stacklevel
from .config import LEGACY_NAMES, OPTIONS, HDETConfig, _is_real, spreading
from .controller import PaperController, controller_from_state
from .hyper import AdamBeta, GradClip
from .optimizers import check_lr_groups, check_optimizer, coupled_weight_decay
from .range_test import RampSnapshots, RangeTest
from .slots import LRControl
from .spread import Dealer, linear_multipliers
from .stability import StabilityGuard
from .values import int_number
from .window import LossWindow, WindowMean

if TYPE_CHECKING:
    from .ensemble import Ensemble

__all__ = ["STATE_VERSION", "state_dict", "parse", "commit"]

STATE_VERSION = 3
REQUIRED = ("config", "world_size", "rank", "rho", "perms", "current_bases", "controllers", "dealer", "loss_sum",
            "loss_count", "total_steps")


def state_dict(ens: "Ensemble") -> dict[str, Any]:
    s = ens.slots
    return {
        "version": STATE_VERSION,
        "config": ens.config.to_dict(),
        "world_size": ens.replicas.world_size,
        "rank": ens.replicas.rank,
        "shard_rank": _shard_rank(ens),  # FSDP2/HSDP: which of the replica's ranks saved it (its own loss window)
        "rho": list(s.rho),
        "perms": [list(p) for p in s.perms],
        "current_bases": list(s.bases),
        "controllers": [c.state_dict() if c is not None else None for c in s.controllers],
        "window_mean": None if ens.window_mean is None else ens.window_mean.state_dict(),
        "peak0": s.peak0,
        "scheduled": list(s.scheduled),
        "dealer": s.dealer.state_dict(),
        **ens.window.state_dict(),
        "total_steps": ens.total_steps,
        "names": list(s.names),
        "lr_scale": s.lr_scale,
        "lr_cuts": s.cuts,
        "kept_controllers": None if s.kept is None else {"controllers": list(s.kept[0]), "lr_scale": s.kept[1]},
        "stability": ens.stability.state_dict(),
        "range_test": None if s.range is None else s.range.state_dict(),
        "range_snapshots": ens._ramp.state_dict(),
        "lr_control": _lr_control_state(ens.lr_control),
        "early_recovered": [[r, t] for r, t in sorted(ens.early_recovered.items())],
    }


def _lr_control_state(c: LRControl) -> dict[str, Any]:
    """The paper controller's inputs that the scheduler works out from how it was built (Eq. 8's targets, the LR
    bounds, Eq. 8's gamma as printed): saved, so that a resume before the first control sync uses the saved run's."""
    return {"bounds": [[float(lo), float(hi)] for lo, hi in c.bounds],
            "finals": None if c.finals is None else [float(f) for f in c.finals],
            "gamma_as_printed": c.gamma_as_printed, "given": list(c.given)}


def _parse_lr_control(state: Any, ens: "Ensemble") -> LRControl | None:
    """A saved :class:`LRControl` (None in a state saved before it was kept: the built one stays)."""
    if state is None:
        return None
    n = len(ens.lr_control.bounds)
    bounds, finals, gamma = state.get("bounds"), state.get("finals"), state.get("gamma_as_printed")
    if (not isinstance(bounds, list) or len(bounds) != n
            or not all(isinstance(b, list) and len(b) == 2 and all(_is_real(x) for x in b) for b in bounds)
            or not (finals is None or isinstance(finals, list) and len(finals) == n and all(map(_is_real, finals)))
            or not (gamma is None or _is_real(gamma))):
        raise ValueError(f"Expected the state's lr_control to hold {n} LR bounds (low, high), None or {n} final LRs, "
                         f"and None or a number, but got {state!r}: a corrupted state_dict")
    given = state.get("given", list(ens.lr_control.given))  # (states saved before it: as this scheduler was built)
    if not (isinstance(given, list) and len(given) == 2 and all(isinstance(g, bool) for g in given)):
        raise ValueError(f"Expected the state's lr_control 'given' as two booleans, but got {given!r}: a corrupted "
                         "state_dict")
    return LRControl(bounds=[(float(lo), float(hi)) for lo, hi in bounds],
                     finals=None if finals is None else [float(f) for f in finals],
                     gamma_as_printed=None if gamma is None else float(gamma), given=(given[0], given[1]))


def _replaced_lr_control(saved: LRControl | None, built: LRControl, config: HDETConfig) -> list[str]:
    """The paper controller's inputs the state replaces (said only where the paper controller runs)."""
    if saved is None or not (config.enable_auto_lr and config.controller == "paper"):
        return []
    return [f"{name} {a} (built with {b})" for name, a, b in (
        ("final_lr (Eq. 8's target)", saved.finals, built.finals), ("auto_lr_bounds", saved.bounds, built.bounds),
        ("Eq. 8's gamma as printed", saved.gamma_as_printed, built.gamma_as_printed)) if a != b]


def parse(ens: "Ensemble", state: Any) -> dict[str, Any]:
    """What a saved state sets, all checked; raises ValueError and changes nothing."""
    if not isinstance(state, dict):
        raise ValueError(f"Expected an hdet ensemble state (a dict), but got {type(state).__name__}")
    version = state.get("version", 1)
    if not isinstance(version, int) or version < 1:
        raise ValueError(f"Expected an hdet ensemble state version >= 1, but got {version!r}: a corrupted state")
    if version > STATE_VERSION:
        raise ValueError(f"Expected an hdet ensemble state of version <= {STATE_VERSION}, but got version "
                         f"{version}: it was saved by a newer hdet; upgrade hdet to load it")
    missing = [k for k in REQUIRED if k not in state]
    if missing:
        raise ValueError(f"Expected an hdet ensemble state with keys {list(REQUIRED)}, but it lacks {missing}: a "
                         "corrupted or foreign state_dict")
    try:
        return _parse_fields(ens, state, version)
    except ValueError:
        raise
    except (KeyError, TypeError, AttributeError, IndexError, RuntimeError) as e:
        raise ValueError(f"Expected a well-formed hdet ensemble state, but reading it failed "
                         f"({type(e).__name__}: {e}): a corrupted state_dict") from e


def _parse_config(cfg: Any, version: int) -> HDETConfig:
    if not isinstance(cfg, dict):
        raise ValueError(f"Expected the state's config as a dict, but got {type(cfg).__name__}")
    if version <= 2:  # the short field names of before
        cfg = {LEGACY_NAMES.get(k, k): v for k, v in cfg.items()}
    unknown = sorted(set(cfg) - set(OPTIONS))
    if unknown:
        raise ValueError(f"Expected the settings of this hdet ({sorted(OPTIONS)}), but the state also has {unknown}: "
                         "it was saved by a newer hdet, or is corrupted")
    return HDETConfig(**{"controller": "paper", "judge_steps": 1, **cfg})  # states before "fit" existed: the
    # paper's; before judge_steps (2026-11-30): every window judged alone


def _replaced_settings(saved: HDETConfig, built: HDETConfig) -> list[str]:
    """The settings the state's replace (a resume continues the saved run, as torch's schedulers do)."""
    return [f"{f.name} {getattr(saved, f.name)!r} (built with {getattr(built, f.name)!r})"
            for f in dataclasses.fields(HDETConfig) if getattr(saved, f.name) != getattr(built, f.name)
            and not (f.name == "judge_steps"
                     and (saved.judged_windows == built.judged_windows or not saved.recovering))]
    # (judge_steps: only where it changes what is judged; every state from before it says 1)


def _parse_fields(ens: "Ensemble", state: dict[str, Any], version: int) -> dict[str, Any]:
    config = _parse_config(state["config"], version)
    check_optimizer(ens.optimizer, spreading(config, ens.hypers), config.average_optimizer_state,
                    lr_spread=config.ensemble_lr_spread_ratio > 0, recovering=config.recovering,
                    lr_moved=config.moves_lr)  # the saved
    check_lr_groups(ens.optimizer, config.enable_auto_lr, config.tie_lr_groups)  # settings' refusals too
    if config.eq8 != ens.config.eq8:  # (Eq. 8 as printed needs OneCycle's factors, fixed at construction)
        raise ValueError(f"Expected the state's eq8 to be this scheduler's ({ens.config.eq8!r}), but it was saved with "
                         f"{config.eq8!r}: build the scheduler with eq8={config.eq8!r} to resume it")
    if config.probing and (ens.probe is None or ens.model is None):
        raise ValueError("Expected probe= and model= for this state: it was saved with the fit controller running "
                         "(enable_auto_lr=True, controller='fit'), which probes the model; build the scheduler "
                         "with them")
    N, W = ens.replicas.world_size, state["world_size"]
    if isinstance(W, bool) or not isinstance(W, int) or W < 1:
        raise ValueError(f"Expected the state's world_size as a positive integer, but got {W!r}")
    rank = state["rank"]
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < W:
        raise ValueError(f"Expected the state's rank in [0, {W}), but got {rank!r}")
    rho = state["rho"]
    want = linear_multipliers(W, config.ensemble_lr_spread_ratio)
    if (not isinstance(rho, list) or len(rho) != W or not all(_is_real(x) for x in rho)
            or any(abs(float(x) - y) > 1e-9 for x, y in zip(rho, want))):
        raise ValueError(f"Expected the state's rho to be Eq. 1's multipliers for {W} replicas at alpha "
                         f"{config.ensemble_lr_spread_ratio} ({want}), but got {rho!r}: a corrupted state_dict")
    n = ens.num_slots
    perms = state["perms"]
    names = list(state.get("names", ens.names[: len(perms) if isinstance(perms, list) else 0]))
    if not isinstance(perms, list) or len(perms) != n or names != ens.names:
        raise ValueError(f"Expected a state for the explored slots {ens.names}, but got one for {names}")
    if not all(isinstance(p, list) and sorted(p) == list(range(W)) for p in perms):
        raise ValueError(f"Expected the state's perms to be permutations of range({W}), but got {perms!r}: "
                         "a corrupted state_dict")
    controlled = state.get("controlled", [None] * n)  # version <= 2: the paper controllers' bases, apart
    if not all(isinstance(state[k], list) and len(state[k]) == n for k in ("current_bases", "controllers")) or (
            not isinstance(controlled, list) or len(controlled) != n):
        raise ValueError(f"Expected current_bases, controlled and controllers with one entry per slot ({n}), but "
                         "they do not: a corrupted state_dict")
    bases = state["current_bases"]
    if not all(_is_real(x) and math.isfinite(x) for x in bases):
        raise ValueError(f"Expected finite base values in the state, but got {bases!r}: a corrupted state_dict")
    if not all(x is None or (_is_real(x) and math.isfinite(x)) for x in controlled):
        raise ValueError(f"Expected None or finite values in the state's 'controlled', but got {controlled!r}: "
                         "a corrupted state_dict")
    controllers = [None if cs is None else controller_from_state(cs) for cs in state["controllers"]]
    for j, (ctrl, value) in enumerate(zip(controllers, controlled)):
        if isinstance(ctrl, PaperController) and value is not None:
            ctrl.value = float(value)
            ctrl.log_space = ens.slots.spreads[j].kind == "log"
    dealer = Dealer(0)
    dealer.load_state_dict(state["dealer"])
    total = state["total_steps"]
    if total is not None and (isinstance(total, bool) or not isinstance(total, int) or total < 1):
        raise ValueError(f"Expected the state's total_steps as a positive integer, but got {total!r}")
    window = LossWindow.parse(state)
    scheduled = [float(x) for x in state.get("scheduled", ens.slots.scheduled)]
    if len(scheduled) != n:
        raise ValueError(f"Expected one scheduled value per slot ({n}), but got {scheduled}")
    elastic = W != N
    window_mean = (None, 0)
    mean = (ens.window_mean or WindowMean(ens._float_params())) if config.probing else None  # the saved config's
    if mean is not None and not elastic:  # (another shard rank's sums are of other shards: dropped, the probe NaN
        # for this window, n = -1; a state saved at a sync step holds none)
        saved = state.get("window_mean") or {}
        foreign = mean.sharded and state.get("shard_rank", 0) != _shard_rank(ens) and saved.get("n")
        window_mean = (None, -1) if foreign else mean.parse(state.get("window_mean"))
    lr_control = _parse_lr_control(state.get("lr_control"), ens)
    replaced = _replaced_settings(config, ens.config) + _replaced_lr_control(lr_control, ens.lr_control, config) + (
        [f"total_steps {total} (built with {ens.total_steps})"] if total != ens.total_steps else [])
    return {"elastic": elastic, "config": config, "replaced": replaced, "mean": mean, "lr_control": lr_control,
            "bases": [float(x) for x in bases], "controllers": controllers,
            "dealer": dealer, "total_steps": total, "peak0": float(state.get("peak0", 0.0)), "scheduled": scheduled,
            "perms": [[int(i) for i in p] for p in perms], "window": (None, None, 0, None, None) if elastic else window,
            "window_mean": window_mean, "lr_scale": _positive(state.get("lr_scale", 1.0), "lr_scale"),
            "lr_cuts": _cuts(state, config), "kept_controllers": _kept_controllers(state.get("kept_controllers"), n),
            "stability": StabilityGuard.parse(state.get("stability")),
            "range_test": _parse_range(state.get("range_test"), config, ens),
            "range_snapshots": RampSnapshots.parse(state.get("range_snapshots")),
            "early_recovered": {} if elastic else _parse_early(state.get("early_recovered", []), ens)}


def _parse_early(state: Any, ens: "Ensemble") -> dict[int, int]:
    """The replicas reset at early recoveries since the last sync, as ``[[replica, step], ...]``."""
    n = ens.replicas.world_size
    if not isinstance(state, list) or not all(
            isinstance(x, list) and len(x) == 2 and all(int_number(v) is not None for v in x)
            and 0 <= x[0] < n and x[1] >= 1 for x in state) or len({int(x[0]) for x in state}) != len(state):
        raise ValueError(f"Expected the state's early_recovered as [[replica, step], ...] with distinct replicas below "
                         f"{n}, but got {state!r}: a corrupted state_dict")
    return {int(r): int(t) for r, t in state}


def _parse_range(state: Any, config: HDETConfig, ens: "Ensemble") -> RangeTest | None:
    """The saved range test; a state saved without one (or before it existed) keeps this run's fresh test."""
    if not config.lr_range_test:
        return None
    if state is None:
        return ens.slots.range
    return RangeTest.from_state(state)


def _positive(x: Any, name: str) -> float:
    if not _is_real(x) or not 0 < x < math.inf:
        raise ValueError(f"Expected the state's {name} as a positive number, but got {x!r}: a corrupted state_dict")
    return float(x)


def _kept_controllers(state: Any, n: int) -> tuple[list[dict[str, Any] | None], float] | None:
    """The controllers' states at the best sync (:attr:`hdet.slots.Slots.kept`), checked; None: a state saved before
    they were kept (a go-back then leaves the controllers as they are, as it did)."""
    if state is None:
        return None
    states = state.get("controllers") if isinstance(state, dict) else None
    if not isinstance(states, list) or len(states) != n or not all(x is None or isinstance(x, dict) for x in states):
        raise ValueError(f"Expected the state's kept_controllers as {{'controllers': one controller state or None per "
                         f"slot ({n}), 'lr_scale': ...}}, but got {state!r}: a corrupted state_dict")
    for x in states:
        if x is not None:
            controller_from_state(x)  # (raises on a corrupted one)
    return [None if x is None else dict(x) for x in states], _positive(state.get("lr_scale"), "kept lr_scale")


def _cuts(state: dict[str, Any], config: HDETConfig) -> int:
    """How many events the stability guard acted on (each cut the LR schedule but the first ``lr_cut_after``): saved,
    or, in a state from before it was (and before ``lr_cut_after``: 0, every event a cut), what the rule of then (every
    cut by ``lr_cut``) left in ``lr_scale`` (from there the run cuts by the rule of now, the k-th by ``lr_cut ** k``,
    which is not how it would have gone on: :func:`commit` says so)."""
    if "lr_cuts" not in state:
        scale = _positive(state.get("lr_scale", 1.0), "lr_scale")
        return round(math.log(scale) / math.log(config.lr_cut)) if scale < 1 and config.lr_cut < 1 else 0
    k = state["lr_cuts"]
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"Expected the state's lr_cuts as a whole number >= 0, but got {k!r}: a corrupted state_dict")
    return k


def _shard_rank(ens: "Ensemble") -> int:
    """This rank's index among its replica's shard ranks (FSDP2/HSDP), 0 where a replica is one rank."""
    group = getattr(ens.replicas, "shard_group", None)
    return dist.get_rank(group) if group is not None else 0


def _moment_shaping(ens: "Ensemble", config: HDETConfig) -> list[str]:
    """What makes the optimizer's moments differ per replica although the gradients are averaged: explored betas
    or clipping, and a weight decay added to the gradient (each replica's own weights) under any spread."""
    why = [h.name for h in ens.hypers if h.spread.alpha > 0 and isinstance(h, (AdamBeta, GradClip))]
    if spreading(config, ens.hypers) and coupled_weight_decay(ens.optimizer):
        why.append("weight decay added to the gradient (coupled)")
    return why


def _say(ens: "Ensemble", message: str) -> None:
    """A load's warning, also kept in ``ens.load_warnings`` (the Hugging Face Trainer drops the warnings raised
    while it loads the scheduler; HDETTrainer raises these again after its load)."""
    ens.load_warnings.append(message)
    warnings.warn(message, stacklevel=user_stacklevel())


def commit(ens: "Ensemble", new: dict[str, Any], state: dict[str, Any]) -> None:
    """Set a parsed state (cannot fail)."""
    elastic = new["elastic"]
    ens.load_warnings = []
    saved_shard, shard = state.get("shard_rank", 0), _shard_rank(ens)  # HSDP: a replica's ranks
    if not elastic and (state["rank"] != ens.replicas.rank or saved_shard != shard) and state["loss_count"]:
        _say(ens, f"hdet: loading replica {state['rank']}'s HDET state (saved by its shard rank "
                  f"{saved_shard}) into replica {ens.replicas.rank}'s shard rank {shard} in "
                  "the middle of a window: the window's loss accumulator is not this rank's (nor the fit controller's "
                  "window mean: another replica's is taken, another shard rank's dropped), and the optimizer state "
                  f"loaded with it is replica {state['rank']}'s (the weights too, unless they were saved as the "
                  "replicas' average: sched.averaged(), as HDETTrainer and HDETCallback save them). Save each rank's "
                  "state, or save at a sync step.")
    shaping = _moment_shaping(ens, new["config"])
    if state["rank"] != ens.replicas.rank and shaping and not new["config"].average_optimizer_state:
        _say(ens, f"hdet: loading replica {state['rank']}'s HDET state into replica {ens.replicas.rank}: the optimizer "
                  "state loaded with it (rank 0's, as the Hugging Face Trainer, Lightning and Accelerate save it) "
                  f"holds moments that differ per replica here ({'; '.join(shaping)}), so this resume is not exact. "
                  "Save each rank's optimizer state, or set average_optimizer_state=True (the moments are then equal "
                  "after every sync)")
    if new["replaced"]:
        _say(ens, "hdet: the loaded state's settings replace this scheduler's (a resume continues the saved run): "
                  + ", ".join(new["replaced"]))
    ens.config = ens.slots.config = ens.stability.config = new["config"]  # everything judges by the saved settings
    ens.window_mean = new["mean"]
    ens.total_steps = new["total_steps"]
    if new["lr_control"] is not None:
        ens.lr_control = new["lr_control"]
    s = ens.slots
    s.bases, s.controllers, s.dealer = new["bases"], new["controllers"], new["dealer"]
    s.peak0, s.scheduled, s.perms, s.lr_scale = new["peak0"], new["scheduled"], new["perms"], new["lr_scale"]
    s.cuts, s.kept = new["lr_cuts"], new["kept_controllers"]
    if "lr_cuts" not in state and s.cuts:
        _say(ens, f"hdet: this state was saved before the stability guard's cuts were counted: its LR schedule, cut to "
                  f"{s.lr_scale:.3g} of itself, is taken as {s.cuts} cut(s) of {ens.config.lr_cut:g}, and the next cut "
                  f"is lr_cut ** {s.cuts + 1} (the rule since: the k-th cut lr_cut ** k, where every cut was lr_cut)")
    s.range = new["range_test"]
    kept, counts = ens.kept_tensors(), len(ens.step_counts())
    empty = not ens.optimizer.state  # (a snapshot with moments cannot fit before the optimizer's state is loaded)
    also = len(ens.also_tensors())
    ens._ramp.load(new["range_snapshots"], kept, counts, empty, also)
    ens.stability.load(new["stability"], kept, counts, empty, also)
    ens._start_checked = (None, True)  # (whether the loaded start fits: checked at the next step)
    ens.window.load(new["window"])
    ens.early_recovered = dict(new["early_recovered"])
    if ens.window_mean is not None:
        ens.window_mean.load(new["window_mean"])
    if elastic:  # Eq. 9 for the new N: a fresh permutation per slot from the (restored) shared dealer
        s.resize(ens.replicas.world_size, redeal=True)
        _say(ens, f"hdet: elastic resume from {state['world_size']} to {ens.replicas.world_size} replicas: kept the "
                  f"bases and controller velocities, re-dealt the multipliers for {ens.replicas.world_size}, dropped "
                  "the current loss window")
    else:
        s.resize(ens.replicas.world_size, redeal=False)  # the loaded config's alpha

