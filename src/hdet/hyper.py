"""Explored hyperparameters beyond the learning rate (paper Remark 1, section 3.4).

Any scalar that leaves the architecture unchanged can be spread across replicas and steered by the
controller: each :class:`Hyperparameter` can read its current value on this replica, set it, and
carries a :class:`Spread` (how replicas' values are placed around the base, and the bounds they never
leave). Pass them to a scheduler: ``OneCycleAutoLR(..., explore=[WeightDecay(opt), Dropout(model)])``.
Each gets its own synchronised permutation and, with the controller on, its own velocity.

Built-ins: :class:`WeightDecay` (per param group), :class:`AdamBeta`, :class:`Dropout` (chosen
modules), :class:`LabelSmoothing` (a loss object), :class:`GradClip` (a clipping norm you apply), and
:class:`Setter` (any getter/setter pair, e.g. an attention temperature).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from .caller import user_stacklevel
from .spread import Spread
from .values import check_bool, int_number, real_number

__all__ = ["Spread", "Hyperparameter", "WeightDecay", "AdamBeta", "Dropout", "LabelSmoothing", "GradClip",
           "Setter", "group_params"]

UNIT = (0.0, 0.999)  # [0, 1) values (dropout, label smoothing) stay at most here


class Hyperparameter:
    """One explored scalar. Subclasses implement :meth:`get` and :meth:`set`.

    ``base`` is the value the spread is centred on: by default the value read when the object is
    made; ``schedule(step) -> base`` replaces it with a schedule. ``vmap_safe`` is False for values
    that live in a module's or loss's Python state, which the engine's vmap path shares across
    replicas (the engine then runs its loop)."""

    vmap_safe = True

    def __init__(self, name: str, spread: Spread, base: float | None = None,
                 schedule: Callable[[int], float] | None = None) -> None:
        if not isinstance(spread, Spread):
            raise ValueError(f"Expected spread to be an hdet.Spread, but got {type(spread).__name__}")
        if schedule is not None and not callable(schedule):  # (it failed at the first step: 'float' object is not
            raise ValueError(f"Expected {name}'s schedule= as a function of the step (or None), but got "  # callable)
                             f"{schedule!r}")
        if not isinstance(name, str) or not name:  # (a number or None named the records' columns and the telemetry)
            raise ValueError(f"Expected name= to be a non-empty str, but got {name!r}")
        self.name = name
        self.spread = spread
        self.schedule = schedule
        start = self.get() if base is None else float(base)
        if not math.isfinite(start) or spread.clamp(start) != start:
            raise ValueError(f"Expected {name}'s base value inside {spread.bounds}, but got {start!r}")
        if spread.kind == "log" and start <= 0:
            raise ValueError(f"Expected a base value > 0 for {name}'s log spread (a scale), but got {start!r}")
        self.initial = start

    def get(self) -> float:
        raise NotImplementedError

    def set(self, value: float) -> None:
        raise NotImplementedError

    def check_applied(self, t: int) -> None:
        """Called at every sync (step ``t``): a value that needs the user to apply it can say it was not
        (:class:`GradClip`); nothing by default."""

    def base(self, step: int) -> float:
        """The base at ``step``: the value when made, or the schedule's, clamped into the spread's bounds (a schedule
        that leaves them warns once: every replica's value was clamped there while the records showed the schedule's
        value, silently; a base given outside them is refused when the object is made)."""
        if self.schedule is None:
            return self.initial
        v = float(self.schedule(step))
        if not math.isfinite(v):
            raise ValueError(f"Expected {self.name}'s schedule to give a finite value at step {step}, but it gave {v!r}")
        inside = self.spread.clamp(v)
        if not math.isclose(inside, v, rel_tol=1e-9, abs_tol=1e-12) and not getattr(self, "_said_outside", False):
            # (a linear decay to a bound ends a rounding past it, -5.6e-17: clamped, not said)
            self._said_outside = True
            warnings.warn(f"hdet: {self.name}'s schedule gave {v:g} at step {step}, outside its bounds "
                          f"{self.spread.bounds}: its base is held at {inside:g} there (and the replicas' values spread "
                          "around it, clamped into the bounds); keep the schedule inside them",
                          stacklevel=user_stacklevel())
        return inside

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.spread})"


class _GroupValue(Hyperparameter):
    """A value that lives in one optimizer param group. The group is looked up on every read and write:
    ``optimizer.load_state_dict()`` replaces the param-group dicts, so a kept reference would go stale
    (hdet would report values the optimizer no longer uses)."""

    optimizer: torch.optim.Optimizer
    group_index: int

    @property
    def group(self) -> dict[str, Any]:
        return self.optimizer.param_groups[self.group_index]


def check_explored(hypers: Sequence[Any]) -> None:
    """That ``explore=`` holds hdet hyperparameters (a ValueError naming what it holds otherwise)."""
    for h in hypers:
        if not isinstance(h, Hyperparameter):
            raise ValueError(f"Expected explore= to hold hdet hyperparameters, but got {type(h).__name__}")
    seen: dict[int, str] = {}  # a module or loss explored twice (under two names): it held the value set last, and
    for h in hypers:  # the other's records described values never applied (an audit)
        for obj in list(getattr(h, "modules", None) or []) + ([h.loss] if isinstance(h, LabelSmoothing) else []):
            other = seen.setdefault(id(obj), h.name)
            if other != h.name:
                raise ValueError(f"Expected each module explored once, but the {type(obj).__name__} "
                                 f"is in both {other!r} and {h.name!r}")


def _domain(h: Hyperparameter, low: float, high: float, high_open: bool = False) -> None:
    """A built-in's ``bounds=`` inside the values its setting can take (weight decay >= 0, a probability in [0, 1], a
    beta in [0, 1)): bounds outside them dealt replicas a negative weight decay or a beta of 1.9, silently (an audit)."""
    lo, hi = h.spread.bounds
    if lo < low or hi > high or (high_open and hi >= high):
        inside = f"[{low:g}, {high:g}{')' if high_open else ']'}"
        raise ValueError(f"Expected {h.name}'s bounds within {inside}, but got {h.spread.bounds}")


def _group_index(optimizer: torch.optim.Optimizer, group: int | str) -> int:
    if not isinstance(getattr(optimizer, "param_groups", None), list):
        raise ValueError(f"Expected a torch optimizer (with param_groups), but got {type(optimizer).__name__}")
    groups = optimizer.param_groups
    j = int_number(group)
    if j is not None and 0 <= j < len(groups):
        return j
    names = [g.get("name") for g in groups]
    if isinstance(group, str) and group in names:
        return names.index(group)
    raise ValueError(f"Expected a param group index in [0, {len(groups)}) or a name in {names}, but got {group!r}")


class WeightDecay(_GroupValue):
    """``param_groups[group]['weight_decay']``, explored on a log scale by default (x (1+alpha)^{+-1})."""

    def __init__(self, optimizer: torch.optim.Optimizer, group: int | str = 0, alpha: float = 1.0,
                 kind: str = "log", bounds: tuple[float, float] = (0.0, math.inf), **kw: Any) -> None:
        self.optimizer, self.group_index = optimizer, _group_index(optimizer, group)
        if "weight_decay" not in self.group:
            raise ValueError(f"Expected an optimizer with weight_decay, but {type(optimizer).__name__} has none")
        name = self.group.get("name", str(self.group_index))
        super().__init__(f"weight_decay/{name}", Spread(kind, alpha, bounds), **kw)
        _domain(self, 0.0, math.inf)

    @classmethod
    def per_group(cls, optimizer: torch.optim.Optimizer, **kw: Any) -> list[WeightDecay]:
        """One per param group whose weight decay is not 0 (a log spread of 0 stays 0); none is an error (nothing
        would be explored, silently)."""
        out = [cls(optimizer, j, **kw) for j, g in enumerate(optimizer.param_groups) if g.get("weight_decay")]
        if not out:
            raise ValueError(f"Expected a param group with weight_decay > 0 to explore, but every group of "
                             f"{type(optimizer).__name__} has {[g.get('weight_decay') for g in optimizer.param_groups]}")
        return out

    def get(self) -> float:
        return float(self.group["weight_decay"])

    def set(self, value: float) -> None:
        self.group["weight_decay"] = float(value)


class AdamBeta(_GroupValue):
    """``betas[index]`` of one param group (Adam, AdamW, ...); additive spread in [0, 0.9999] by default."""

    def __init__(self, optimizer: torch.optim.Optimizer, index: int = 0, group: int | str = 0, alpha: float = 0.02,
                 kind: str = "additive", bounds: tuple[float, float] = (0.0, 0.9999), **kw: Any) -> None:
        j = _group_index(optimizer, group)
        self.optimizer, self.group_index = optimizer, j
        if "betas" not in self.group or isinstance(index, bool) or int_number(index) not in (0, 1):
            raise ValueError(f"Expected an optimizer with betas and index 0 or 1, but got "
                             f"{type(optimizer).__name__} and index {index!r}")
        if isinstance(self.group["betas"][index], torch.Tensor):
            raise ValueError("Expected float betas; tensor betas are not supported")
        self.index = index = int_number(index)
        super().__init__(f"beta{index + 1}/{self.group.get('name', str(j))}", Spread(kind, alpha, bounds), **kw)
        _domain(self, 0.0, 1.0, high_open=True)

    def get(self) -> float:
        return float(self.group["betas"][self.index])

    def set(self, value: float) -> None:
        betas = list(self.group["betas"])
        betas[self.index] = float(value)
        self.group["betas"] = tuple(betas)


class Dropout(Hyperparameter):
    """The dropout probability of every ``nn.Dropout*`` module inside ``modules`` (its ``p``) and of every
    ``nn.MultiheadAttention`` there (its ``dropout``, a float that ``nn.Transformer*`` layers set from the same
    argument); one shared value, additive spread, kept in [0, 0.999]. ``attention``: None (the default) takes the
    attention modules in where their dropout is the other modules' p (as ``nn.Transformer*`` layers build them) and
    leaves them out with a warning where it differs; True always, False never. Attention dropout given as a float
    elsewhere (e.g. a Hugging Face config's ``attention_dropout``) is not reached: explore it with a :class:`Setter`."""

    vmap_safe = False

    def __init__(self, modules: nn.Module | Iterable[nn.Module], alpha: float = 0.05, kind: str = "additive",
                 bounds: tuple[float, float] = UNIT, name: str = "dropout", attention: bool | None = None,
                 **kw: Any) -> None:
        if attention is not None:  # (None, True or False: "no" or 0 was read by truthiness, an audit)
            attention = check_bool("attention", attention)
        roots = [modules] if isinstance(modules, nn.Module) else list(modules) if isinstance(modules, Iterable) else []
        if not roots or not all(isinstance(m, nn.Module) for m in roots):
            raise ValueError(f"Expected a torch.nn.Module or modules whose dropout to explore, but got {modules!r}")
        found = [m for root in roots for m in root.modules()]
        drops = [m for m in found if isinstance(m, nn.modules.dropout._DropoutNd)]
        attn = [m for m in found if isinstance(m, nn.MultiheadAttention)] if attention is not False else []
        if attention is None and drops and attn and {self._p(m) for m in attn} != {self._p(m) for m in drops}:
            warnings.warn(f"hdet: Dropout leaves out {len(attn)} nn.MultiheadAttention module(s): their dropout "
                          f"{sorted({self._p(m) for m in attn})} is not the other modules' p "
                          f"{sorted({self._p(m) for m in drops})} (attention=True explores them too, attention=False "
                          "says you mean it)", stacklevel=user_stacklevel())
            attn = []
        self.modules = drops + attn
        floats = sorted({f"{type(m).__name__}.{k}={v:g}" for m in found if not isinstance(m, nn.MultiheadAttention)
                         for k, v in vars(m).items() if "dropout" in k.lower() and isinstance(v, float) and v > 0})
        if not self.modules:
            raise ValueError("Expected at least one nn.Dropout module to explore, but found none" + (
                f" (these modules keep their dropout as a plain float: {', '.join(floats[:4])}; explore it with a "
                "hdet.Setter)" if floats else ""))
        if floats:  # (Hugging Face attention modules keep attention_dropout as a float the forward hands to SDPA)
            warnings.warn(f"hdet: Dropout explores the p of nn.Dropout modules, but these modules also keep a dropout "
                          f"as a plain float, which stays as it is: {', '.join(floats[:4])}"
                          + (f" and {len(floats) - 4} more" if len(floats) > 4 else "") + ". Explore it with a "
                          "hdet.Setter (or set it to 0) if the forward uses it", stacklevel=user_stacklevel())
        ps = sorted({self._p(m) for m in self.modules})
        if len(ps) > 1 and kw.get("base") is None and kw.get("schedule") is None:
            raise ValueError(f"Expected dropout modules with one p to explore as one value, but got p in {ps}: every "
                             "module would be set to one value spread around the first's. Pass the modules of one p "
                             "(one Dropout per group of modules, each with its own name=), attention=False to leave "
                             "nn.MultiheadAttention's dropout out, or base= for one value")
        super().__init__(name, Spread(kind, alpha, bounds), **kw)
        _domain(self, 0.0, 1.0)

    @staticmethod
    def _p(m: nn.Module) -> float:
        return float(m.dropout if isinstance(m, nn.MultiheadAttention) else m.p)

    def get(self) -> float:
        return self._p(self.modules[0])

    def set(self, value: float) -> None:
        for m in self.modules:
            if isinstance(m, nn.MultiheadAttention):
                m.dropout = float(value)
            else:
                m.p = float(value)


class LabelSmoothing(Hyperparameter):
    """``label_smoothing`` of a loss object (e.g. ``nn.CrossEntropyLoss``), or the ``epsilon`` of a Hugging Face
    Trainer's ``label_smoother`` (``TrainingArguments(label_smoothing_factor=...)``); additive, kept in [0, 0.999]."""

    vmap_safe = False

    def __init__(self, loss: Any, alpha: float = 0.05, kind: str = "additive", bounds: tuple[float, float] = UNIT,
                 **kw: Any) -> None:
        self.attr = "label_smoothing" if hasattr(loss, "label_smoothing") else "epsilon" if hasattr(loss, "epsilon") \
            else None
        if self.attr is None:
            raise ValueError(f"Expected a loss with a label_smoothing attribute (or a Hugging Face LabelSmoother's "
                             f"epsilon), but got {type(loss).__name__}")
        self.loss = loss
        super().__init__("label_smoothing", Spread(kind, alpha, bounds), **kw)
        _domain(self, 0.0, 1.0)

    def get(self) -> float:
        return float(getattr(self.loss, self.attr))

    def set(self, value: float) -> None:
        setattr(self.loss, self.attr, float(value))


class GradClip(Hyperparameter):
    """A gradient-clipping norm that you apply: ``clip.clip_(model.parameters())`` between the last
    ``loss.backward()`` of an optimizer step and ``optimizer.step()``, once per optimizer step (with gradient
    accumulation, after the last micro-batch, on unscaled gradients: under Accelerate
    ``if accelerator.sync_gradients: accelerator.clip_grad_norm_(params, clip.max_norm)``; with a GradScaler,
    ``scaler.unscale_(opt)`` first; in the engine: ``before_optimizer_step``). ``HDETTrainer`` and
    ``HDETCallback`` apply it themselves, in place of the Trainer's ``max_grad_norm`` and Lightning's
    ``gradient_clip_val``. Log spread. A sync whose window read the norm neither through :meth:`clip_` nor
    ``max_norm`` warns (once): the explored norms would be reported, never applied."""

    def __init__(self, max_norm: float, alpha: float = 1.0, kind: str = "log",
                 bounds: tuple[float, float] = (1e-8, math.inf), **kw: Any) -> None:
        norm = real_number(max_norm)
        if norm is None or not 0 < norm < math.inf:
            raise ValueError(f"Expected a finite max_norm > 0, but got {max_norm!r}")
        self._norm = norm
        self.applied = False  # the norm read (to clip with) since the last sync: see check_applied
        self._warned = False
        super().__init__("grad_clip_norm", Spread(kind, alpha, bounds), **kw)

    @property
    def max_norm(self) -> float:
        """This replica's norm, to clip with (reading it counts as applying it)."""
        self.applied = True
        return self._norm

    @max_norm.setter
    def max_norm(self, value: float) -> None:
        self._norm = float(value)

    def get(self) -> float:
        return self._norm

    def set(self, value: float) -> None:
        self._norm = float(value)

    def clip_(self, parameters: Iterable[torch.Tensor]) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(parameters, self.max_norm)

    def check_applied(self, t: int) -> None:
        """At each sync (step ``t``): warn once if the window's steps never read the norm to clip with."""
        if not self.applied and not self._warned:
            self._warned = True
            warnings.warn(f"hdet: the clipping norm is explored (hdet.GradClip), but no step before sync step {t} "
                          "read it (clip.clip_(params) or clip.max_norm): the gradients are not clipped to the "
                          "explored norms that hdet reports. Keep the GradClip object and call clip.clip_(params) "
                          "between backward() and optimizer.step() (the Trainer and Lightning integrations do)",
                          stacklevel=user_stacklevel())
        self.applied = False


class Setter(Hyperparameter):
    """Any scalar through a getter/setter pair, e.g. an attention temperature:
    ``Setter("temperature", lambda: attn.scale, lambda v: setattr(attn, "scale", v), Spread("log", 0.2, (0, inf)))``.
    ``vmap_safe`` defaults to False (the value usually lives in the module: the engine then runs its loop). Pass True
    only where ``set`` writes a tensor the forward reads in place (a registered buffer: ``lambda v: m.temp.fill_(v)``)
    or an optimizer's param group: a Python attribute (a float) is one value for every replica under the engine's vmap
    and merged modes, which run replica 0's module (an audit: every replica trained at replica 0's, unsaid)."""

    def __init__(self, name: str, get: Callable[[], float], set: Callable[[float], None], spread: Spread,
                 vmap_safe: bool = False, **kw: Any) -> None:
        if type(self).get is Setter.get and not callable(get) or type(self).set is Setter.set and not callable(set):
            raise ValueError(f"Expected get and set to be callables, but got {type(get).__name__} and "
                             f"{type(set).__name__}")
        self._get, self._set = get, set
        self.vmap_safe = check_bool("vmap_safe", vmap_safe)
        super().__init__(name, spread, **kw)

    def get(self) -> float:
        v = self._get()
        try:
            return float(v)
        except (TypeError, ValueError):  # (float()'s own error named no hyperparameter: an audit)
            raise ValueError(f"Expected {self.name!r}'s getter to return a number, but it returned {v!r} "
                             f"({type(v).__name__})") from None

    def set(self, value: float) -> None:
        self._set(float(value))


def group_params(model: nn.Module, group_of: Callable[[str, nn.Parameter], str],
                 **per_group: dict[str, Any]) -> list[dict[str, Any]]:
    """Optimizer param groups by a user-given grouping: ``group_of(name, param) -> group name``, in
    first-seen order, each with ``name`` set (its LR is explored separately) and ``per_group[name]``'s
    options, e.g. the paper's four groups::

        group_params(model, lambda n, p: "embedding" if "emb" in n else "no_decay" if p.ndim < 2 else
                     "transformer" if "blocks" in n else "non_embedding", no_decay={"weight_decay": 0.0})
    """
    groups: dict[str, list[nn.Parameter]] = {}
    for name, p in model.named_parameters():
        groups.setdefault(group_of(name, p), []).append(p)
    unknown = set(per_group) - set(groups)
    if unknown:
        raise ValueError(f"Expected options only for existing groups {sorted(groups)}, but got {sorted(unknown)}")
    return [{"params": ps, "name": g, **per_group.get(g, {})} for g, ps in groups.items()]
