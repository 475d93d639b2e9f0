"""The one list of HDET options. The field names are the keyword arguments both schedulers take (the
reference implementation's names); the paper's symbols are in brackets. Validated once, in
``__post_init__``; a config is plain data (it goes into every state_dict and is exchanged, as a
fingerprint, at every sync).
"""

from __future__ import annotations

import copy
import json
import math
import numbers
import zlib
from dataclasses import asdict, dataclass, fields
from typing import Any

from .controller import CONTROLLERS, FitController
from .spread import check_alpha
from .values import check_bool, int_number, real_number

__all__ = ["HDETConfig", "OPTIONS", "spreading"]


@dataclass
class HDETConfig:
    """Every option of one HDET ensemble (README.md's options table says what each does).

    Args:
        ensemble_lr_spread_ratio: [alpha] replica r's LR is ``base * rho_r``, ``rho_r`` in
            ``[1 - alpha, 1 + alpha]`` (Eq. 1); in [0, 1). Default 0 (no spread).
        model_sync_interval: [T] average the replicas every T optimizer steps (Eq. 3). Default 1000.
        enable_auto_lr: run the controller (Eqs. 4-9, or hdet's ``"fit"``). Default False.
        auto_lr_warmup_steps: [S_warm] optimizer steps before the controller starts. Default None: the
            scheduler's own, 0 for HDETLR and the reference's 100000 for OneCycleAutoLR (with ``lr_range_test``,
            OneCycle's warm-up); a number given here, 0 included, is used by both.
        loss_scale: [sigma] the paper controller's loss temperature (Eq. 4). Default 0.1.
        lr_of_lr: [lambda] the paper controller's step size (Eq. 7). Default 0.5.
        momentum_of_lr: [beta] the paper controller's velocity momentum (Eq. 7). Default 0.9.
        eq8: "decay" (gamma takes the base to the schedule's final value) or "as_printed" (the paper's formula).
        seed: seed of the permutation generator (Eq. 9); the same on every replica. Default 0.
        average_optimizer_state: average the optimizer's floating-point state too. Default False.
        on_nonfinite: "recover" (a non-finite replica is left out and reset to the others' mean) or "raise".
        controller: "fit" (default), "paper", or a :class:`hdet.FitController` whose settings every LR slot copies.
        tie_lr_groups: one multiplier per replica for all its LR groups (one permutation). Default False.
        on_runaway: "ignore" (default: the paper's HDET) or "recover" (:mod:`hdet.stability`): a replica whose
            window loss is finite but runs away from the others' is reset like a non-finite one; when the
            ensemble's loss rises, every replica goes back to its state at the best sync; and the LR schedule
            is cut. Keeps one copy of the weights and optimizer state in memory.
        outlier_threshold: with "recover": a replica runs away when its window loss is above the replicas'
            median by more than this many robust deviations (1.4826 MAD, at least 2% of the median) and above
            the best ensemble loss so far. Default 5.
        rise_threshold: with "recover": the ensemble is rising when its median window loss is more than this
            fraction above its best so far. Default 0.05.
        judge_steps: with "recover": a runaway or a rise is judged over windows of at least this many steps:
            where T is shorter, ``ceil(judge_steps / T)`` windows are pooled (their losses summed per replica) and
            only every such sync judges them (on a 128M GPT, 5-step windows set the rule off on their noise in 2 of
            3 seeds at the right LR: ``docs/reliability.md``). Non-finite values, and windows no noise explains (a
            replica 10x the others, an ensemble 10x its best), are acted on at every sync. Default 25.
        lr_cut: with "recover": at each sync with a runaway replica or a rising ensemble, the LR schedule is
            cut for the rest of the run, the k-th time by ``lr_cut ** k`` (0.7, then 0.49, ... of what it was:
            a repeated event says the LR is further past the edge). Default 0.7 (measured against 0.5, 0.85 and
            every cut by the same factor: ``docs/reliability.md``).
        lr_cut_after: with "recover": the first this many events go back (and reset their runaway replicas) without
            cutting the LR; the k-th after them cuts by ``lr_cut ** k``. A loss spike is often its batches' and not
            the LR's, and the data moves on past them when the run goes back (PaLM's rewind and skip: arXiv
            2204.02311). Default 0: every event cuts. ``hdet train`` and ``examples/ddp_train.py`` use 1, the rule
            the LR sweep's recipe was measured with (confirmed at fresh seeds: ``docs/reliability.md``); from a start
            10x too high without a sweep the two were about even.
        lr_range_test: an LR range test during the warm-up (the first ``auto_lr_warmup_steps`` steps,
            :mod:`hdet.range_test`): the LR schedule is multiplied by a factor that starts at 1/25 and grows at
            every sync until the ensemble's loss stops making progress or turns unstable; the peak LR becomes the
            last good window's LR over ``range_backoff`` and every replica goes back to the ramp's state at that
            LR. The user's peak LR is a first guess. Turns ``on_runaway="recover"`` on (the test drives the LR
            to the edge on purpose). Default False.
        range_max_factor: with the range test: the most its factor multiplies the schedule by (reached at the
            end of the warm-up if nothing stops it). Default 300.
        range_backoff: with the range test: the peak LR is the last good window's LR over this. Default 2.
        range_patience: with the range test: this many windows without a new best loss end it. Default 3.
    """

    ensemble_lr_spread_ratio: float = 0.0
    model_sync_interval: int = 1000
    enable_auto_lr: bool = False
    auto_lr_warmup_steps: int | None = None  # (None: the scheduler's default, resolved when it is built)
    loss_scale: float = 0.1
    lr_of_lr: float = 0.5
    momentum_of_lr: float = 0.9
    eq8: str = "decay"
    seed: int = 0
    average_optimizer_state: bool = False
    on_nonfinite: str = "recover"
    controller: str | FitController = "fit"
    tie_lr_groups: bool = False
    on_runaway: str = "ignore"
    outlier_threshold: float = 5.0
    rise_threshold: float = 0.05
    judge_steps: int = 25
    lr_cut: float = 0.7
    lr_cut_after: int = 0
    lr_range_test: bool = False
    range_max_factor: float = 300.0
    range_backoff: float = 2.0
    range_patience: int = 3

    def __post_init__(self) -> None:
        """Check every field; numpy scalars become Python numbers."""
        self.ensemble_lr_spread_ratio = check_alpha(self.ensemble_lr_spread_ratio)
        self.model_sync_interval = _check_int("model_sync_interval", self.model_sync_interval, lo=1)
        if self.auto_lr_warmup_steps is not None:
            self.auto_lr_warmup_steps = _check_int("auto_lr_warmup_steps", self.auto_lr_warmup_steps, lo=0)
        self.seed = _check_int("seed", self.seed, lo=0, hi=2 ** 63)  # (a torch.Generator seed)
        self.range_patience = _check_int("range_patience", self.range_patience, lo=1)
        self.judge_steps = _check_int("judge_steps", self.judge_steps, lo=1)
        self.lr_cut_after = _check_int("lr_cut_after", self.lr_cut_after, lo=0)
        for name in ("enable_auto_lr", "average_optimizer_state", "tie_lr_groups", "lr_range_test"):
            setattr(self, name, check_bool(name, getattr(self, name)))
        for name, symbol, ok, want in (("loss_scale", "sigma", lambda v: v > 0, "{} > 0"),
                                       ("lr_of_lr", "lambda", lambda v: v >= 0, "{} >= 0"),
                                       ("momentum_of_lr", "beta", lambda v: 0 <= v < 1, "0 <= {} < 1"),
                                       ("outlier_threshold", "", lambda v: v > 0, "{} > 0"),
                                       ("rise_threshold", "", lambda v: v > 0, "{} > 0"),
                                       ("lr_cut", "", lambda v: 0 < v <= 1, "0 < {} <= 1"),
                                       ("range_max_factor", "", lambda v: v >= 1, "{} >= 1"),
                                       ("range_backoff", "", lambda v: v >= 1, "{} >= 1")):
            v = getattr(self, name)
            x = real_number(v)
            if x is None or not math.isfinite(x) or not ok(x):
                raise ValueError(f"Expected {want.format(f'{name} ({symbol})' if symbol else name)}, but got {v!r}")
            setattr(self, name, x)
        if self.eq8 not in ("decay", "as_printed"):
            raise ValueError(f"Expected eq8 to be 'decay' or 'as_printed', but got {self.eq8!r}")
        if self.on_runaway not in ("ignore", "recover"):
            raise ValueError(f"Expected on_runaway to be 'ignore' or 'recover', but got {self.on_runaway!r}")
        if self.on_nonfinite not in ("recover", "raise"):
            raise ValueError(f"Expected on_nonfinite to be 'recover' or 'raise', but got {self.on_nonfinite!r}")
        if isinstance(self.controller, dict):  # from a state_dict: a FitController's settings
            keep = ("kappa", "beta", "max_step", "bounds", "log_scale")
            unknown = sorted(set(self.controller) - set(keep) - {"kind", "c", "m", "updates"})
            if unknown:
                raise ValueError(f"Expected a FitController's settings {list(keep)} in controller=, but got {unknown}")
            self.controller = FitController(**{k: (tuple(v) if k == "bounds" else v)
                                               for k, v in self.controller.items() if k in keep})
        if not isinstance(self.controller, (FitController, str)) or (
                isinstance(self.controller, str) and self.controller not in CONTROLLERS):
            raise ValueError(f"Expected controller in {tuple(CONTROLLERS)} or a hdet.FitController, but got "
                             f"{self.controller!r}")

    @property
    def controller_kind(self) -> str:
        """The controller's registry name: "fit" or "paper"."""
        return "fit" if isinstance(self.controller, FitController) else str(self.controller)

    @property
    def moves_lr(self) -> bool:
        """Whether the ensemble's LR is moved off its schedule for every replica (the controller, the range test)."""
        return self.enable_auto_lr or self.lr_range_test

    @property
    def recovering(self) -> bool:
        """Whether runaway replicas and a rising loss are acted on (``on_runaway="recover"``, or the range test)."""
        return self.on_runaway == "recover" or self.lr_range_test

    @property
    def judged_windows(self) -> int:
        """How many windows the stability guard pools for one judgment: ``ceil(judge_steps / T)`` (1 at T >= it)."""
        return -(-self.judge_steps // self.model_sync_interval)

    @property
    def probing(self) -> bool:
        """Whether the controller reads a probe at each replica's window mean (it needs ``probe=``)."""
        return self.enable_auto_lr and CONTROLLERS[self.controller_kind].uses_probe

    def to_dict(self) -> dict[str, Any]:
        """Plain data (a FitController template as its settings)."""
        out = asdict(self)
        if isinstance(self.controller, FitController):
            out["controller"] = {k: out["controller"][k] for k in ("kappa", "beta", "max_step", "bounds", "log_scale")}
        return out

    def fingerprint(self) -> int:
        """A hash of every setting, exchanged at each sync: replicas built differently are an error. Computed
        again only when a setting changed (the JSON of every setting costs about 0.2 ms)."""
        key = [getattr(self, f.name) for f in fields(self)]
        cached = self.__dict__.get("_fingerprint")
        if cached is None or cached[0] != key:
            cached = (copy.deepcopy(key), zlib.crc32(json.dumps(self.to_dict(), sort_keys=True).encode()))
            self.__dict__["_fingerprint"] = cached
        return cached[1]  # < 2**32: exact in float64


OPTIONS = tuple(f.name for f in fields(HDETConfig))  # the keyword names both schedulers accept for the config

# The field names before hdet 0.1 session 16 (state_dict version <= 2), for loading older states.
LEGACY_NAMES = {"alpha": "ensemble_lr_spread_ratio", "sync_interval": "model_sync_interval", "auto_lr": "enable_auto_lr",
                "sigma": "loss_scale", "lam": "lr_of_lr", "beta": "momentum_of_lr"}


def _is_real(x: Any) -> bool:
    """A real number, numpy scalars included (they register as ``numbers.Real``); not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_int(name: str, value: Any, lo: int, hi: int | None = None) -> int:
    """``value`` as an int (numpy integers and 0-d integer tensors included), or a ValueError naming ``name``."""
    x = int_number(value)
    if x is None or x < lo or (hi is not None and x >= hi):
        raise ValueError(f"Expected integer {name} >= {lo}" + (f" and < {hi}" if hi is not None else "")
                         + f", but got {value!r}")
    return x


def spreading(config: HDETConfig, hypers: Any) -> bool:
    """Whether the replicas' values differ: an LR spread, or an explored hyperparameter with a spread."""
    return config.ensemble_lr_spread_ratio > 0 or any(h.spread.alpha > 0 for h in hypers)
