"""One optimizer step for all N replicas of the one-process engine (issue 19, item 1).

In vmap mode the engine lays the replicas' trainable parameters out as one ``[N, D]`` tensor ``theta``
(row r: replica r, columns: the parameters in the order of the optimizer's param groups) with the
gradients in another, ``G`` (:meth:`hdet.ReplicaEngine._flatten`). :class:`StackedStep` then steps every
replica with a few whole-tensor kernels per param group, whatever N is, instead of N optimizers of one
kernel (or more) per parameter each.

With shared gradients (DDP's semantics: every replica steps on ``g = sum_r g_r / N``) and the same betas
on every replica, Adam's moments and SGD's momentum are the same on every replica, so one copy is kept
(``rows == 1``): the update ``u`` is computed once and each replica applies it with its own learning rate,
``theta_r <- theta_r - lr_r / (1 - beta1^t) * u`` (AdamW: ``theta_r <- (1 - lr_r wd_r) theta_r`` first).
Optimizer memory is then one replica's. Where the moments differ (local mode, a ``before_optimizer_step``
hook that changes gradients per replica, Adam/SGD's coupled weight decay, per-replica betas or momentum),
they are kept stacked, ``[N, D]`` (``rows == N``), with every per-replica value as an ``[N, 1]`` column.

Each replica's optimizer stays what the user built: its param groups (where the schedulers set each
replica's LR and explored values, read here every step), its ``state`` (views of the stacked moments:
``state_dict()``, checkpoints, moment averaging and the guards' snapshots see what torch would hold) and
its step post-hooks (called here, as ``optimizer.step()`` would). Supported: ``torch.optim.Adam``,
``AdamW`` (``amsgrad`` and ``maximize`` included), ``SGD`` (momentum, dampening, Nesterov, weight
decay, ``maximize``), D-Adaptation's ``DAdaptAdam`` and ``prodigyopt.Prodigy`` with shared gradients and
decoupled (or no) weight decay (:meth:`StackedStep._dadapt_step`, :meth:`StackedStep._prodigy_step`);
:func:`unsupported` names why anything else steps per replica.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from . import kernels
from .optimizers import decoupled
from .step_scale import prodigy_estimate

__all__ = ["foreign_pre_hooks", "Segment", "StackedStep", "Unstackable", "param_view", "unsupported"]

KINDS = {torch.optim.Adam: "adam", torch.optim.AdamW: "adam", torch.optim.SGD: "sgd"}
# D-Adaptation: the group values its shared state reads, the same on every replica (its weight decay may differ)
DADAPT_SAME = ("betas", "eps", "layer_scale", "use_bias_correction", "growth_rate", "decouple", "d", "k",
               "numerator_weighted", "fsdp_in_use")
PRODIGY_FLAT = ("s", "p0")  # the state Prodigy keeps flat (bound: views shaped like the parameter)
# Prodigy: likewise (its d, d_max and sums are shared at every step: hdet.step_scale)
PRODIGY_SAME = ("betas", "beta3", "eps", "use_bias_correction", "growth_rate", "decouple", "d", "d0", "d_max",
                "d_coef", "d_numerator", "k", "safeguard_warmup", "slice_p", "fsdp_in_use")
DISTANCE = {("dadaptation", "DAdaptAdam"): "dadapt", ("prodigyopt", "Prodigy"): "prodigy"}
# per group, values that must be the same on every replica (the rest become [N, 1] columns)
SAME = {"adam": ("amsgrad", "maximize", "differentiable"), "sgd": ("nesterov", "maximize", "differentiable")}


class Unstackable(RuntimeError):
    """The replicas' optimizers cannot be stepped as one (the engine then steps each; the message says why)."""


@dataclass
class Segment:
    """One param group's columns ``[start, stop)`` of the flat tensors, and its parameters' shapes in the
    group's order (each replica's optimizer holds views of these columns, in this order) and the order their
    dims are stored in (None: row-major; see :func:`param_view`)."""

    start: int
    stop: int
    shapes: list[torch.Size]
    orders: list[tuple[int, ...] | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.orders = self.orders or [None] * len(self.shapes)


def trained(group: dict[str, Any]) -> list[torch.Tensor]:
    """A param group's parameters that the stacked step updates: those that get gradients (torch's optimizers skip a
    frozen one, ``requires_grad=False``, whose ``.grad`` stays None)."""
    return [p for p in group["params"] if p.requires_grad]


def param_view(cols: torch.Tensor, shape: Sequence[int], order: tuple[int, ...] | None) -> torch.Tensor:
    """One parameter's columns of a flat tensor (``[..., n]``) as the parameter (``[..., *shape]``), its dims
    stored in ``order`` (None: row-major). The engine stores a parameter in the order its gradient comes out
    of the backward (an ``nn.Linear`` weight's under vmap: transposed), so that accumulating it into the flat
    gradient reads memory in order."""
    lead = tuple(cols.shape[:-1])
    if order is None:
        return cols.view(lead + tuple(shape))  # (a tuple: a 0-d parameter of one replica is view(()))
    k = len(lead)
    stored = cols.view(lead + tuple(shape[i] for i in order))
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return stored.permute(*range(k), *[k + i for i in inverse])


def _kind(optimizer: torch.optim.Optimizer) -> str | None:
    """"adam", "sgd", "dadapt" (D-Adaptation's ``DAdaptAdam``), "prodigy" (``prodigyopt.Prodigy``; both recognised
    without importing them) or None."""
    t = type(optimizer)
    if t in KINDS:
        return KINDS[t]
    return DISTANCE.get((t.__module__.split(".")[0], t.__name__))


def foreign_pre_hooks(optimizers: Sequence[torch.optim.Optimizer]) -> str | None:
    """What step pre-hooks the stacked step would leave uncalled, or None: a global one, or one on an optimizer, that
    is not hdet's own (a pre-hook may change or skip one replica's step; hdet's, a loaded state's checks or the
    average swapped in for an evaluation, are its own business, and D-Adaptation's/Prodigy's step scale is applied by
    the stacked step itself)."""
    if any(not _hdets(h) for h in _global_optimizer_pre_hooks.values()):
        return "global optimizer step pre-hooks are registered"
    if any(not _hdets(h) for o in optimizers for h in o._optimizer_step_pre_hooks.values()):
        return "an optimizer has step pre-hooks"
    return None


def _hdets(hook: Any) -> bool:
    return (getattr(hook, "__module__", None) or "").split(".")[0] == "hdet"


def _only_step_scale_hooks(o: torch.optim.Optimizer) -> bool:
    """Whether every step pre-hook of ``o`` is its :class:`hdet.step_scale.StepScale`'s (the stacked step applies
    the multiplier itself)."""
    scale = getattr(o, "_hdet_step_scale", None)
    hooks = o._optimizer_step_pre_hooks.values()
    return scale is not None and all(getattr(h, "__self__", None) is scale for h in hooks)


def unsupported(optimizers: Sequence[torch.optim.Optimizer]) -> str | None:
    """Why these optimizers cannot take the stacked step (None: they can)."""
    kinds = {_kind(o) for o in optimizers}
    if len(kinds) != 1 or None in kinds:
        return f"{sorted({type(o).__name__ for o in optimizers})} is not one of Adam, AdamW, SGD, DAdaptAdam, Prodigy"
    if _global_optimizer_pre_hooks:
        return "global optimizer step pre-hooks are registered"
    for o in optimizers:
        if kinds & {"dadapt", "prodigy"}:
            if why := _distance_unsupported(o):
                return why
        elif o._optimizer_step_pre_hooks:  # a pre-hook may change or skip one replica's step
            return "an optimizer has step pre-hooks"
        for g in o.param_groups:
            if g.get("differentiable") or any(p.is_complex() for p in g["params"]):
                return "differentiable or complex parameters"
    return None


class StackedStep:
    """``optimizer.step()`` of every replica at once on the flat ``theta`` / ``G`` (see the module doc).

    ``shared``: every replica's gradient is the same (shared gradients, no per-replica hook): the step
    reads ``G``'s first row only and keeps one copy of the moments while the optimizers' values allow it.
    """

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer], theta: torch.Tensor, grad: torch.Tensor,
                 segments: Sequence[Segment], shared: bool) -> None:
        self.optimizers = list(optimizers)
        self.kind = _kind(self.optimizers[0])
        self.theta, self.grad, self.segments, self.shared = theta, grad, list(segments), shared
        self.N = theta.shape[0]
        self.rows = 0  # 1 or N once bound; 0: bind at the next step
        self.moments: dict[str, torch.Tensor] = {}  # name -> [rows, D]
        self.steps: list[int] = []  # per group: Adam's t, SGD's steps with a momentum buffer
        self._step_t: list[torch.Tensor] = []  # per group: the "step" tensor every state of the group shows
        self._bound: list[Any] = []  # each optimizer's state object when bound (load_state_dict replaces it), its size
        self._pinned: list[tuple[torch.Tensor, Any]] = []
        self._work: torch.Tensor | None = None  # (CPU) Adam's direction written here: _workspace
        self._slot = 0
        self._state_steps: list[tuple[dict[str, Any], int]] = []  # Prodigy: each bound state and its group
        self._zero_momentum: dict[int, tuple[bool, ...]] = {}  # SGD: per group, which replicas' momentum was 0
        for o in self.optimizers:
            o.register_state_dict_post_hook(_own_step_tensors)

    # -- the optimizers' state as views of the stacked moments ------------------------------------------
    def _adopt(self, rows: int, values: list[dict[str, Any]]) -> None:
        """(Re)bind: take the optimizers' current state (empty: a first step; else loaded, or this object's
        own views) into ``rows`` stacked copies, then point every optimizer state at views of them."""
        D, dev, dt = self.theta.shape[1], self.theta.device, self.theta.dtype
        names = self._moment_names(values)
        all_states = [[[o.state.get(p) for p in trained(o.param_groups[k])] for o in self.optimizers]
                      for k in range(len(self.segments))]
        if rows == 1 and any(not _same_state(per_replica, names) for per_replica in all_states):
            rows = self.N  # loaded moments that differ between replicas stay apart
        self.moments = {k: torch.zeros(rows, D, device=dev, dtype=dt) for k in names}
        steps = []
        for k, seg in enumerate(self.segments):
            states = all_states[k]
            got = [s for per in states for s in per if s]
            step = 0
            if got:
                counts = {int(float(s.get("step", 1))) for s in got}  # SGD: a buffer exists, so a step was taken
                if len(got) != self.N * len(seg.shapes) or len(counts) != 1:
                    raise Unstackable("the replicas' optimizer states differ in which parameters have state or in "
                                      f"their step counts ({sorted(counts)})")
                step = counts.pop()
                for name, dst in self.moments.items():
                    for r in range(rows):
                        col = seg.start
                        for s, shape, order in zip(states[r], seg.shapes, seg.orders):
                            n = shape.numel()
                            v = s.get(name)
                            if v is not None:  # Prodigy's flat s and p0 (a zero p0: one 0-d zero)
                                param_view(dst[r, col:col + n], shape, order).copy_(
                                    v.view(shape) if v.dim() == 1 and len(shape) != 1 else v)
                            col += n
            steps.append(step)
        self.steps = steps
        self._step_t = [torch.tensor(float(s), dtype=torch.float32) for s in steps]
        self.rows = rows
        self._bind()

    def _moment_names(self, values: list[dict[str, Any]]) -> list[str]:
        """The state each parameter keeps, from every group's values on every replica (:meth:`_values`)."""
        if self.kind == "dadapt":
            return ["exp_avg", "exp_avg_sq", "s"]
        if self.kind == "prodigy":
            return (["exp_avg"] if self.optimizers[0].param_groups[0]["betas"][0] > 0 else []) + ["exp_avg_sq", "s", "p0"]
        if self.kind == "sgd":  # SGD keeps no state without momentum
            return ["momentum_buffer"] if any(any(v["momentum"]) for v in values) else []
        return ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if any(v["amsgrad"] for v in values) else [])

    def _bind(self) -> None:
        for r, o in enumerate(self.optimizers):
            row = 0 if self.rows == 1 else r
            for k, seg in enumerate(self.segments):
                col = seg.start
                for p, shape, order in zip(trained(o.param_groups[k]), seg.shapes, seg.orders):
                    n = shape.numel()
                    st: dict[str, Any] = {}
                    if self.kind in ("adam", "dadapt"):
                        st["step"] = self._step_t[k]
                    elif self.kind == "prodigy":  # Prodigy's own: an int (kept current by the stacked step)
                        if not self.steps[k]:  # no state before its first step (Prodigy initialises it then)
                            o.state.pop(p, None)
                            col += n
                            continue
                        st["step"] = self.steps[k]
                    if self.kind in ("adam", "dadapt", "prodigy") or (self.steps[k] > 0 and float(o.param_groups[k]["momentum"])):
                        for name, m in self.moments.items():
                            if name == "max_exp_avg_sq" and not o.param_groups[k].get("amsgrad"):
                                continue  # (a group without amsgrad keeps none in torch: a zero one was shown here)
                            st[name] = param_view(m[row, col:col + n], shape, order)
                    if st:
                        o.state[p] = st
                    else:  # torch keeps no state for SGD without momentum
                        o.state.pop(p, None)
                    col += n
        self._bound = [(o.state, len(o.state)) for o in self.optimizers]
        self._state_steps = [(o.state[p], k) for o in self.optimizers for k, g in enumerate(o.param_groups)
                             for p in trained(g) if p in o.state] if self.kind == "prodigy" else []

    def _unbound(self) -> bool:
        """Whether an optimizer's state is no longer the one bound: replaced (``load_state_dict``, a new dict) or
        emptied in place (``state.clear()``, ``del state[p]``: torch's step then starts those parameters afresh; the
        stacked step went on with its moments, unsaid, and the states saved none, a review). (A key added is not
        counted: a read of ``state[p]`` for a parameter without state adds an empty one.)"""
        return any(o.state is not b or len(o.state) < n for o, (b, n) in zip(self.optimizers, self._bound))

    def release(self) -> None:
        """Give every optimizer its own copy of its state (so that ``optimizer.step()`` may run on each
        replica again): after this, nothing is shared (also a loaded state that shares one copy)."""
        for o in self.optimizers:
            for k, g in enumerate(o.param_groups):
                on_device = g.get("fused") or g.get("capturable")
                for p in g["params"]:
                    st = o.state.get(p)
                    if st:
                        dev = p.device if on_device else torch.device("cpu")
                        o.state[p] = {key: self._own(key, v, dev) for key, v in st.items()}
        self.rows, self.moments, self._bound, self._state_steps = 0, {}, [], []
        self._work = None

    def _own(self, key: str, v: Any, device: torch.device) -> Any:
        """One state entry as its optimizer's own: a tensor ``step`` a new tensor (bound: kept current every step;
        Prodigy's is an int), any other tensor a copy (Prodigy's ``s`` and ``p0`` flat, as it keeps them)."""
        if not isinstance(v, torch.Tensor):
            return v
        if key == "step":  # (D-Adaptation's own is an int, as Prodigy's: an audit found a float tensor)
            return int(v) if self.kind == "dadapt" else torch.tensor(float(v), dtype=torch.float32, device=device)
        return (_flat(key, v) if self.kind == "prodigy" else v).clone()

    # -- one step --------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        """``optimizer.step()`` of every replica (then each optimizer's step post-hooks, as torch runs them)."""
        if self.kind in ("adam", "dadapt") and self.rows:  # the counts the states show (a go-back to a best sync
            self.steps = [int(c) for c in self._step_t]   # of on_runaway="recover" sets them back)
        if self.kind == "dadapt":
            return self._dadapt_step()
        if self.kind == "prodigy":
            return self._prodigy_step()
        values = [self._values(k) for k in range(len(self.segments))]
        want = 1 if self.shared and all(v["same"] for v in values) else self.N
        if not self.rows or self._unbound() or list(self.moments) != self._moment_names(values):  # (a momentum
            # switched on: its buffer appears)
            self._adopt(want, values)
        elif want > self.rows:  # the replicas' moments part from here (e.g. a weight decay that became coupled)
            self._adopt(want, values)
        host: list[float] = []
        for k, v in enumerate(values):
            if self.kind == "adam" or any(v["momentum"]):  # SGD counts the steps of its momentum buffer
                self.steps[k] += 1
            v["at"] = len(host) // self.N  # its first row of the columns
            host += self._columns(v, self.steps[k])
        cols = self._to_device(host)
        g_all = self.grad[:1] if self.shared else self.grad  # shared: row 0 holds the mean
        direction = self._adam_direction if self.kind == "adam" else self._sgd_direction
        for ks in self._spans(values):  # groups whose moments follow the same values: one set of kernels
            v0, first, last = values[ks[0]], self.segments[ks[0]], self.segments[ks[-1]]
            a, b = first.start, last.stop
            mom = {name: m[:, a:b] for name, m in self.moments.items()}
            g = -g_all[:, a:b] if v0["maximize"] else g_all[:, a:b]

            def update(lo: int, hi: int, d: torch.Tensor, ks: list[int] = ks, a: int = a) -> None:
                """Columns [a + lo, a + hi) of every group in the span: its own LR (and decoupled weight decay),
                per replica, from the direction ``d`` of those columns."""
                for k in ks:
                    seg, c = self.segments[k], cols[values[k]["at"]:]
                    s0, s1 = max(seg.start - a, lo), min(seg.stop - a, hi)
                    if s0 >= s1:
                        continue
                    th, dk = self.theta[:, a + s0:a + s1], d[:, s0 - lo:s1 - lo]
                    decay = self.kind == "adam" and values[k]["decoupled"] and any(values[k]["wd"])  # (each group's
                    # own: a span holds groups of either kind where the moments agree)
                    if _fused_update(th, dk, values[k]):  # one pass, stored once (a CUDA device, with Triton)
                        kernels.scale_add_rows_(th, dk, c[1] if decay else None, c[0])
                    elif th.dtype != dk.dtype:  # fp16/bf16 weights of a fused optimizer, a float32 direction:
                        t32 = th.float()  # computed in float32 and stored once, as torch's fused Adam does
                        if decay:
                            t32.mul_(c[1])
                        th.copy_(t32.addcmul_(dk, c[0]))
                    else:
                        if decay:
                            th.mul_(c[1])  # theta_r *= 1 - lr_r wd_r
                        th.addcmul_(dk, c[0])  # theta_r -= step_r * d
            direction(self.theta[:, a:b], g, mom, v0, cols[v0["at"]:], self.steps[ks[0]], update)
            for k in ks:
                self._step_t[k].fill_(float(self.steps[k]))
        if self.kind == "sgd" and 1 in self.steps:
            self._bind()  # torch's SGD shows a momentum buffer from its first step on
        self._post_hooks()

    def _post_hooks(self) -> None:
        for o in self.optimizers:
            o._opt_called = True  # what torch's LRScheduler checks for "scheduler stepped before optimizer"
            for hook in (*o._optimizer_step_post_hooks.values(), *_global_optimizer_post_hooks.values()):
                hook(o, (), {})

    def _dadapt_step(self) -> None:
        """D-Adaptation Adam's step (``dadaptation.DAdaptAdam``, decoupled or no weight decay) for every replica
        at once. With shared gradients its state (moments, ``s``, the estimate ``d`` and its sums) reads only the
        mean gradient and the base LR, the same on every replica: one copy, one update ``u``; replica r then
        applies its multiplier on the step (:mod:`hdet.step_scale`): ``theta_r -= rho_r (decay dlr theta_r + u)``.
        One host read a step (the two sums that set ``d``), where the optimizer itself reads two per parameter."""
        scales, lr = self._distance_checks("D-Adaptation", DADAPT_SAME)
        groups0 = self.optimizers[0].param_groups
        g0 = groups0[0]
        beta1, beta2 = g0["betas"]
        k, d, nw = g0["k"], float(g0["d"]), float(g0["numerator_weighted"])
        bc = ((1 - beta2 ** (k + 1)) ** 0.5) / (1 - beta1 ** (k + 1)) if g0["use_bias_correction"] else 1.0
        dlr, sqrt_b2 = d * lr * bc, beta2 ** 0.5
        G = self.grad[:1]
        m, v, s_ = self.moments["exp_avg"], self.moments["exp_avg_sq"], self.moments["s"]
        num, sk = [], []
        for seg, group in zip(self.segments, groups0):
            a, b = seg.start, seg.stop
            if float(group["lr"]) == 0.0 or a == b:
                continue
            r, g = float(group["layer_scale"]), G[:, a:b]
            denom = v[:, a:b].sqrt().add_(group["eps"])
            num.append(r * dlr * (g * s_[:, a:b].div(denom)).sum(dtype=torch.float64))
            m[:, a:b].mul_(beta1).add_(g, alpha=r * dlr * (1 - beta1))
            v[:, a:b].mul_(beta2).addcmul_(g, g, value=1 - beta2)
            s_[:, a:b].mul_(sqrt_b2).add_(g, alpha=dlr * (1 - sqrt_b2))
            sk.append(r * s_[:, a:b].abs().sum(dtype=torch.float64))
        zero = torch.zeros((), dtype=torch.float64, device=G.device)
        numerator_acum, sk_l1 = torch.stack([sum(num, zero), sum(sk, zero)]).tolist()  # HOST SYNC: once a step
        nw = sqrt_b2 * nw + (1 - sqrt_b2) * numerator_acum
        if sk_l1 == 0:  # no progress possible yet: D-Adaptation returns before it moves anything
            return self._post_hooks()
        if lr > 0.0:
            d = max(d, min(nw / ((1 - sqrt_b2) * sk_l1), d * g0["growth_rate"]))
        self._apply(scales, dlr, lambda a, b, group: m[:, a:b] / v[:, a:b].sqrt().add_(group["eps"]))
        for o in self.optimizers:
            for group in o.param_groups:
                group["numerator_weighted"], group["d"], group["k"] = nw, d, group["k"] + 1
        self._post_hooks()

    def _distance_checks(self, name: str, same: Sequence[str]) -> tuple[list[Any], float]:
        """What the stacked D-Adaptation/Prodigy step needs (else :class:`Unstackable`, the engine then steps each
        replica): shared gradients, the same LR and state values on every replica, one copy of the state (bound
        here). Returns the replicas' step scales (their estimates taken from the last converge step) and the LR."""
        if not self.shared:
            raise Unstackable(f"{name} without shared gradients (each replica's own estimate)")
        for o in self.optimizers:
            if why := _distance_unsupported(o):
                raise Unstackable(why)
        scales = [getattr(o, "_hdet_step_scale", None) for o in self.optimizers]
        for sc in scales:
            if sc is not None:
                sc.take_estimates()  # what the last converge step averaged
        groups0 = self.optimizers[0].param_groups
        lrs = [[float(g["lr"]) for g in o.param_groups] for o in self.optimizers]
        if any(x != lrs[0] for x in lrs[1:]):
            raise Unstackable(f"the replicas' {name} LRs differ (without hdet's multiplier on the step)")
        if any(x not in (0.0, max(lrs[0])) for x in lrs[0]):
            raise Unstackable(f"{name}'s param groups have different LRs (it refuses them itself)")
        for key in same:  # the shared state's values: one for the ensemble (weight decay may differ)
            if any(g.get(key) != g0.get(key) for o in self.optimizers[1:] for g, g0 in zip(o.param_groups, groups0)):
                raise Unstackable(f"the replicas' {name} optimizers differ in {key!r}")
        if not self.rows or self._unbound():
            self._adopt(1, [])
        if self.rows != 1:
            self.release()
            raise Unstackable(f"the replicas' {name} states differ (loaded so)")
        return scales, max(lrs[0])

    def _apply(self, scales: list[Any], dlr: float, update: Any) -> None:
        """Every replica's step with its multiplier on it (:mod:`hdet.step_scale`), per group:
        ``theta_r -= rho_r (decay_r dlr theta_r + dlr-scaled update)`` (decoupled decay: each replica's own);
        ``update(a, b, group)`` is the shared update of columns ``[a, b)``, its LR included."""
        K = len(self.segments)
        groups0 = self.optimizers[0].param_groups
        decays = [[float(o.param_groups[kk]["weight_decay"]) for o in self.optimizers] for kk in range(K)]
        host = [sc.multipliers[kk] if sc is not None else 1.0 for kk in range(K) for sc in scales]
        cols = self._to_device(host + [x for per in decays for x in per])  # [2 K, N, 1]: rho_r, then decay_r; one copy
        for kk, (seg, group) in enumerate(zip(self.segments, groups0)):
            a, b = seg.start, seg.stop
            th, rho = self.theta[:, a:b], cols[kk]
            if any(decays[kk]) and group["decouple"]:  # theta_r -= rho_r decay_r dlr theta_r (decoupled: per replica)
                th.mul_(1 - rho * cols[K + kk] * dlr)
            th.addcmul_(update(a, b, group), rho, value=-1.0)
            self.steps[kk] += 1
            if self.kind == "dadapt":
                self._step_t[kk].fill_(float(self.steps[kk]))

    def _prodigy_step(self) -> None:
        """Prodigy's step (``prodigyopt.Prodigy``, ``slice_p=1``, decoupled or no weight decay) for every replica at
        once. With shared gradients its moments and ``s`` are the same on every replica, and so is ``p0``, the
        point the run started from; its numerator reads each replica's distance from it, ``<g, p0 - theta_r>``,
        whose mean over the replicas (what :mod:`hdet.step_scale` shares at every step) is ``<g, p0 -
        mean_r theta_r>``: one copy of the state, one host read a step (Prodigy itself: two per parameter)."""
        scales, lr = self._distance_checks("Prodigy", PRODIGY_SAME)
        groups0 = self.optimizers[0].param_groups
        g0 = groups0[0]
        beta1, beta2 = g0["betas"]
        beta3 = g0["beta3"] if g0["beta3"] is not None else beta2 ** 0.5
        k, d, d_max, d0 = g0["k"], float(g0["d"]), float(g0["d_max"]), float(g0["d0"])
        bc = ((1 - beta2 ** (k + 1)) ** 0.5) / (1 - beta1 ** (k + 1)) if g0["use_bias_correction"] else 1.0
        dlr = d * lr * bc
        G, mean_theta = self.grad[:1], self.theta.mean(0, keepdim=True)
        spans = [(seg.start, seg.stop) for seg, group in zip(self.segments, groups0)
                 if float(group["lr"]) != 0.0 and seg.start != seg.stop]
        zero = torch.zeros((), dtype=torch.float64, device=G.device)
        if not self._state_steps:  # Prodigy's first step: p0 is where the run starts (the replicas' mean, of the
            # replicas with finite weights: a NaN in p0 would reach every replica's d at every step)
            ok = torch.isfinite(self.theta).all(1)
            finite = bool(ok.all())  # HOST SYNC (the first step only)
            self.moments["p0"].copy_(mean_theta if finite or not bool(ok.any()) else self.theta[ok].mean(0, keepdim=True))
        m, v, s_, p0 = (self.moments.get(n) for n in ("exp_avg", "exp_avg_sq", "s", "p0"))

        def numerator(centre: torch.Tensor) -> torch.Tensor:  # <g, p0 - centre>, Prodigy's weighting
            return sum(((d / d0) * dlr * (G[:, a:b] * (p0[:, a:b] - centre[:, a:b])).sum(dtype=torch.float64)
                        for a, b in spans), zero)

        num = numerator(mean_theta)
        den = []
        for a, b in spans:
            g = G[:, a:b]
            if m is not None:
                m[:, a:b].mul_(beta1).add_(g, alpha=d * (1 - beta1))
            v[:, a:b].mul_(beta2).addcmul_(g, g, value=d * d * (1 - beta2))
            s_[:, a:b].mul_(beta3).add_(g, alpha=(d / d0) * (d if g0["safeguard_warmup"] else dlr))
            den.append(s_[:, a:b].abs().sum(dtype=torch.float64))
        delta, d_denom = torch.stack([num, sum(den, zero)]).tolist()  # HOST SYNC: once a step
        if not math.isfinite(delta):  # a replica's weights are not finite (reset at the next sync): its distance
            # is left out, as each replica's own Prodigy would be (hdet.step_scale); a second read, this step only
            ok = torch.isfinite(self.theta).all(1)
            delta = float(numerator(self.theta[ok].mean(0, keepdim=True))) if bool(ok.any()) else 0.0  # HOST SYNC
        if d_denom == 0:  # no progress possible yet: Prodigy returns before it moves anything
            return self._post_hooks()
        d_numerator = float(g0["d_numerator"]) * beta3 + delta
        est = prodigy_estimate(g0, d, d_max, d_numerator, d_denom) if lr > 0.0 else \
            {"d_numerator": d_numerator, "d_denom": d_denom, "d": d, "d_max": d_max, "d_hat": d}
        d = est["d"]
        eps = float(g0["eps"])
        self._apply(scales, dlr, lambda a, b, group: (m[:, a:b] if m is not None else G[:, a:b] * d)
                    / v[:, a:b].sqrt().add_(d * eps) * dlr)
        for o in self.optimizers:
            for group in o.param_groups:
                group.update(est, k=group["k"] + 1)
        self._bind_steps()
        self._post_hooks()

    def _bind_steps(self) -> None:
        """Prodigy's per-parameter ``step`` (a Python int in its state) after a step: the stacked step's count; after
        its first, its state appears (views of the moments, p0 included)."""
        if not self._state_steps:
            self._bind()
        for st, kk in self._state_steps:
            st["step"] = self.steps[kk]

    def _values(self, k: int) -> dict[str, Any]:
        """Group ``k``'s values on every replica; ``same``: those that shape the moments agree (and no
        coupled weight decay mixes each replica's own weights into its gradient)."""
        groups = [o.param_groups[k] for o in self.optimizers]
        g0 = groups[0]
        for g in groups[1:]:
            for key in SAME[self.kind]:
                if g.get(key) != g0.get(key):
                    raise Unstackable(f"the replicas' optimizers differ in {key!r} ({g0.get(key)} and {g.get(key)})")
        # float(): a tensor LR on the GPU would be a host read here (torch's own optimizers read it too)
        v: dict[str, Any] = {"maximize": bool(g0.get("maximize")),
                             "lr": [float(g["lr"]) for g in groups],
                             "wd": [float(g["weight_decay"]) for g in groups]}
        if self.kind == "adam":
            v["b1"] = [float(g["betas"][0]) for g in groups]
            v["b2"] = [float(g["betas"][1]) for g in groups]
            v["eps"] = [float(g["eps"]) for g in groups]
            v["amsgrad"] = bool(g0["amsgrad"])
            v["fused"] = bool(g0.get("fused"))
            v["decoupled"] = decoupled(self.optimizers[0], g0)
            shaping = ("b1", "b2", "eps")
        else:
            v["momentum"] = [float(g["momentum"]) for g in groups]
            zero, last = tuple(m == 0 for m in v["momentum"]), self._zero_momentum.get(k)
            if zero != last and (any(zero) or last is not None) and self._buffers_held(k):
                raise Unstackable(f"SGD's momentum went to or from 0 on some replica with momentum buffers held "
                                  f"({v['momentum']}: torch keeps a buffer unused while its momentum is 0, and starts "
                                  "one afresh where there was none)")
            self._zero_momentum[k] = zero
            v["dampening"] = [float(g["dampening"]) for g in groups]
            v["nesterov"] = bool(g0["nesterov"])
            v["decoupled"] = False
            shaping = ("momentum", "dampening")
        v["same"] = all(len(set(v[key])) == 1 for key in shaping) and (v["decoupled"] or not any(v["wd"]))
        return v

    def _buffers_held(self, k: int) -> bool:
        """Whether group ``k``'s parameters hold SGD momentum buffers (bound: the stacked ones; else, loaded: the
        optimizers' states)."""
        if self.rows and not self._unbound():
            return "momentum_buffer" in self.moments and self.steps[k] > 0
        return any("momentum_buffer" in (o.state.get(p) or {}) for o in self.optimizers
                   for p in trained(o.param_groups[k]))

    def _columns(self, v: dict[str, Any], t: int) -> list[float]:
        """The per-replica numbers of one group's step, N each, in the order the directions and
        :meth:`step` read them (row 0: minus the step size; row 1: AdamW's decay factor; ...)."""
        out: list[float] = []
        if self.kind == "adam":
            out += [-lr / (1 - b1 ** t) for lr, b1 in zip(v["lr"], v["b1"])]  # -step_size
            out += [1 - lr * wd for lr, wd in zip(v["lr"], v["wd"])]  # AdamW's decay (or the coupled wd below)
            out += v["wd"] + [1 - b for b in v["b1"]] + v["b2"] + [1 - b for b in v["b2"]]
            out += [math.sqrt(1 - b2 ** t) for b2 in v["b2"]] + v["eps"]
        else:
            out += [-lr for lr in v["lr"]] + v["wd"] + v["momentum"]
            out += [1 - d if mu else 1.0 for mu, d in zip(v["momentum"], v["dampening"])]  # no momentum: d = g
        return out

    def _to_device(self, host: list[float]) -> torch.Tensor:
        """``host`` as an ``[len / N, N, 1]`` tensor on theta's device: one copy (pinned and asynchronous on
        CUDA, through a ring of buffers so a copy still queued is never overwritten; the host waits only when
        it runs 4 steps ahead of the device)."""
        dtype = torch.float64 if self.theta.dtype == torch.float64 else torch.float32  # bf16 weights: fp32 scalars
        src = torch.tensor(host, dtype=dtype).view(-1, self.N, 1)
        if self.theta.device.type != "cuda":
            return src.to(self.theta.device)
        if len(self._pinned) < 4 or self._pinned[0][0].shape != src.shape:
            self._pinned = [(torch.empty(src.shape, dtype=dtype).pin_memory(), None) for _ in range(4)]
        self._slot = (self._slot + 1) % len(self._pinned)
        buf, event = self._pinned[self._slot]
        if event is not None:
            event.synchronize()  # HOST SYNC, on a copy 4 steps old: waits only if the host is that far ahead
        buf.copy_(src)
        dev = buf.to(self.theta.device, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.theta.device))  # the stream the copy was queued on
        self._pinned[self._slot] = (buf, event)
        return dev

    def _one(self, c: torch.Tensor, i: int, per_replica: list[float]) -> Any:
        """Column ``i`` of ``c`` (an [N, 1] tensor), or the plain number when every replica has the same."""
        return per_replica[0] if len(set(per_replica)) == 1 else c[i]

    def _spans(self, values: list[dict[str, Any]]) -> list[list[int]]:
        """Runs of consecutive groups whose moment updates agree (same betas/eps or momentum on every replica,
        same step, no coupled weight decay): their moments update as one block of columns."""
        def key(k: int) -> Any:
            v = values[k]
            if any(v["wd"]) and not v["decoupled"]:
                return ("alone", k)  # the L2 term reads each group's own weight decay
            shaping = ("b1", "b2", "eps", "amsgrad") if self.kind == "adam" else ("momentum", "dampening", "nesterov")
            return (v["maximize"], v.get("fused"), self.steps[k],  # (fused: fp16/bf16 computed in float32, a review)
                    *(tuple(v[s]) if isinstance(v[s], list) else v[s] for s in shaping))
        spans: list[list[int]] = []
        for k in range(len(values)):
            if spans and key(spans[-1][-1]) == key(k):
                spans[-1].append(k)
            else:
                spans.append([k])
        return spans

    def _adam_direction(self, th: torch.Tensor, g: torch.Tensor, mom: dict[str, torch.Tensor], v: dict[str, Any],
                        c: torch.Tensor, t: int, update: Callable[[int, int, torch.Tensor], None]) -> None:
        """Adam's moments, updated in place, and ``u = m / (sqrt(v / (1 - beta2^t)) + eps)``: ``[rows, n]``,
        computed once for the ensemble when rows == 1 (the LR and ``1 / (1 - beta1^t)`` are in ``c[0]``), handed to
        ``update(lo, hi, u)`` for its columns [lo, hi)."""
        l2 = self._one(c, 2, v["wd"]) if any(v["wd"]) and not v["decoupled"] else None  # Adam's L2 term: the
        # replicas' moments differ (rows == N)
        half = v["fused"] and th.dtype in (torch.float16, torch.bfloat16)
        if l2 is not None and not half:
            g = g + l2 * th
        b1c = self._one(c, 3, [1 - b for b in v["b1"]])
        b2, b2c = self._one(c, 4, v["b2"]), self._one(c, 5, [1 - b for b in v["b2"]])
        bc2 = self._one(c, 6, [math.sqrt(1 - b ** t) for b in v["b2"]])
        eps = self._one(c, 7, v["eps"])
        if half:  # as torch's fused Adam: in float32 (in fp16,
            # eps = 1e-8 is 0, and every weight was NaN after the first step: an audit), a slice at a time, and the
            # direction kept in float32 for the update, one slice at a time (rounded to bf16 first, the decay's
            # multiply then rounded each weight back to itself: no decay at all, an audit; a whole float32 direction
            # raised the step's peak memory by 2 bytes a weight and row, a review)
            n = mom["exp_avg"].shape[1]
            for a in range(0, n, OPMATH_SLICE):
                cols = slice(a, min(a + OPMATH_SLICE, n))
                part = {name: m[:, cols] for name, m in mom.items()}
                gs = g[:, cols].float()  # (the L2 term in float32 too: added in the weights' dtype, 4-13% of the
                if l2 is not None:  # weights an ulp or more off torch's fused Adam, a review)
                    gs = gs + l2 * th[:, cols].float()
                update(cols.start, cols.stop, _adam_moments(gs, part, v["amsgrad"], b1c, b2, b2c, bc2, eps,
                                                            opmath=True))
            return
        s = mom["exp_avg_sq"]
        update(0, g.shape[1], _adam_moments(g, mom, v["amsgrad"], b1c, b2, b2c, bc2, eps, opmath=False,
                                            out=self._workspace(s, bc2, eps)))

    def _workspace(self, s: torch.Tensor, *scalars: Any) -> torch.Tensor | None:
        """On the CPU: a buffer shaped like ``s`` (the second moments of a span), kept from step to step, for Adam's
        direction, computed there in place (the same operations, so the same values). Into new ``[rows, n]`` tensors,
        the direction's two divisions took about 0.2 ms each inside the step of ``benchmarks/engine_mlp.py``'s MLP,
        into the kept buffer 0.04 ms (``torch.profiler``; the engine 1.03-1.04x side by side, docs/engine.md). None (a
        new tensor, as before) on other devices, where a buffer kept would add a copy of the moments to the engine's
        memory, and where a ``scalars`` tensor (per-replica betas or eps) would broadcast the direction to more rows
        than ``s`` or promote it to another dtype (float32 scalars with bf16 weights: the direction is float32 there, and
        in fp16 eps = 1e-8 would be 0, a review)."""
        if s.device.type != "cpu" or any(isinstance(c, torch.Tensor) and (c.shape[0] > s.shape[0] or c.dtype != s.dtype)
                                         for c in scalars):
            return None
        if self._work is None or self._work.numel() < s.numel() or self._work.dtype != s.dtype:
            self._work = torch.empty(s.numel(), dtype=s.dtype, device=s.device)  # (not the default device)
        return self._work[:s.numel()].view(s.shape)

    def _sgd_direction(self, th: torch.Tensor, g: torch.Tensor, mom: dict[str, torch.Tensor], v: dict[str, Any],
                       c: torch.Tensor, t: int, update: Callable[[int, int, torch.Tensor], None]) -> None:
        """SGD's direction (the LR is in ``c[0]``): the gradient (with the L2 term), or its momentum buffer, handed to
        ``update(0, n, d)``."""
        update(0, g.shape[1], self._sgd_d(th, g, mom, v, c, t))

    def _sgd_d(self, th: torch.Tensor, g: torch.Tensor, mom: dict[str, torch.Tensor], v: dict[str, Any],
               c: torch.Tensor, t: int) -> torch.Tensor:
        if any(v["wd"]):
            g = g + self._one(c, 1, v["wd"]) * th  # SGD's L2 term: the replicas' buffers differ (rows == N)
        if not any(v["momentum"]):
            return g
        mu = self._one(c, 2, v["momentum"])
        keep = self._one(c, 3, [1 - d if m else 1.0 for m, d in zip(v["momentum"], v["dampening"])])
        buf = mom["momentum_buffer"]
        if t == 1:
            buf.copy_(g.expand_as(buf))  # torch: the first buffer is the gradient itself
        elif isinstance(keep, torch.Tensor):
            buf.mul_(mu).add_(g * keep)
        else:
            buf.mul_(mu).add_(g, alpha=keep)
        return g + mu * buf if v["nesterov"] else buf


def _fused_update(th: torch.Tensor, d: torch.Tensor, v: dict[str, Any]) -> bool:
    """Whether a group's ``theta_r = (1 - lr_r wd_r) theta_r - step_r d`` runs as one fused pass
    (:func:`hdet.kernels.scale_add_rows_`: computed in float32, stored once): float32 weights, or fp16/bf16 ones of
    a fused optimizer (torch's fused Adam stores them once too, from a direction it keeps in float32, as this one's
    Adam direction is; a non-fused optimizer rounds after each op, kept).
    Torch's broadcasting ``mul_`` and ``addcmul_`` took 2.9 ms a step over the medium GPT's 8 replicas on an H200,
    the fused pass 1.3 ms (bf16: 4.6 and 0.6 ms; ``benchmarks/merged_kernels.py``)."""
    return (th.dtype == torch.float32 == d.dtype or (bool(v.get("fused")) and d.dtype in (th.dtype, torch.float32))) \
        and kernels.usable(th, d)
    # (kernels.usable last: its first True imports Triton and compiles the kernels, not for a group that never uses them)


OPMATH_SLICE = 1 << 22  # columns computed in float32 at a time (fp16/bf16 weights): bounds the float32 copies


def _adam_moments(g: torch.Tensor, mom: dict[str, torch.Tensor], amsgrad: bool, b1c: Any, b2: Any, b2c: Any, bc2: Any,
                  eps: Any, opmath: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """Adam's moments in ``mom``, updated in place, and ``u = m / (sqrt(v) / bc2 + eps)``; ``opmath``: computed in
    float32 (the moments stored back in their dtype), as torch's fused Adam computes fp16/bf16 weights' steps.
    ``out``: a tensor shaped like the moments that ``u`` is computed in (in place, the same operations), else a new
    one."""
    m, s = mom["exp_avg"], mom["exp_avg_sq"]
    if opmath:
        m, s, g = m.float(), s.float(), g.float()
    if isinstance(b1c, torch.Tensor) and b1c.dtype != m.dtype:  # (an explored beta1 over fp16/bf16 moments: lerp_
        # takes a weight tensor of its own dtype only, and raised; computed in float32 and rounded once, as torch's
        # fp16/bf16 lerp_ computes with a float weight)
        m.copy_(m.float().lerp_(g.float(), b1c))
    else:
        m.lerp_(g, b1c)
    if isinstance(b2c, torch.Tensor):
        s.mul_(b2).add_(g * g * b2c)
    else:
        s.mul_(b2).addcmul_(g, g, value=b2c)
    if opmath:
        mom["exp_avg"].copy_(m)
        mom["exp_avg_sq"].copy_(s)
    if amsgrad:
        most = mom["max_exp_avg_sq"]
        s = torch.maximum(most.float(), s) if opmath else torch.maximum(most, s, out=most)
        if opmath:
            most.copy_(s)
    if out is None or opmath:
        return m / (s.sqrt() / bc2).add_(eps)
    denom = torch.sqrt(s, out=out).div_(bc2).add_(eps)
    return torch.div(m, denom, out=denom)


def _distance_unsupported(o: torch.optim.Optimizer) -> str | None:
    """Why D-Adaptation's/Prodigy's step cannot be stacked for ``o`` (None: it can): step pre-hooks other than
    hdet's step scale (whose multiplier the stacked step applies itself), FSDP, coupled weight decay, Prodigy's
    ``slice_p`` (its estimate from every slice_p-th weight)."""
    name = "Prodigy" if _kind(o) == "prodigy" else "D-Adaptation"
    if o._optimizer_step_pre_hooks and not _only_step_scale_hooks(o):
        return "an optimizer has step pre-hooks"  # a pre-hook may change or skip one replica's step
    for g in o.param_groups:
        if g.get("fsdp_in_use"):
            return f"{name} with fsdp_in_use"
        if float(g.get("weight_decay", 0)) != 0 and not g.get("decouple"):
            return f"{name}'s coupled weight decay (each replica's own weights in its gradient)"
        if g.get("slice_p", 1) != 1:
            return f"Prodigy with slice_p={g['slice_p']}"
    return None


def _same_state(per_replica: list[list[Any]], names: list[str]) -> bool:
    """Whether every replica's state of one group holds the same moments (as replica 0's)."""
    first = per_replica[0]
    for states in per_replica[1:]:
        for a, b in zip(first, states):
            for name in names:
                x, y = (a or {}).get(name), (b or {}).get(name)
                if (x is None) != (y is None) or (x is not None and not torch.equal(x, y)):
                    return False
    return True


def _own_step_tensors(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """A state_dict post-hook: every parameter's ``step`` its own tensor (D-Adaptation's an int, as it keeps it;
    the stacked step shares one per group; an optimizer that loaded a shared one would add 1 to it once per
    parameter), and Prodigy's ``s`` and ``p0`` flat, as Prodigy keeps them (bound, they are views shaped like the
    parameter)."""
    kind = _kind(optimizer)
    state_dict["state"] = {i: ({**s, "step": int(s["step"]) if kind == "dadapt" else s["step"].clone()}
                               if isinstance(s.get("step"), torch.Tensor) else s) for i, s in state_dict["state"].items()}
    if kind == "prodigy":
        state_dict["state"] = {i: {k: _flat(k, v) for k, v in s.items()} for i, s in state_dict["state"].items()}
    return state_dict


def _flat(key: str, v: Any) -> Any:
    """Prodigy's ``s`` or ``p0`` as Prodigy keeps it: flat, row-major (a bound view is shaped like its parameter);
    else ``v``. (For Prodigy only: D-Adaptation's ``s`` is shaped like the parameter.)"""
    return v.reshape(-1) if key in PRODIGY_FLAT and isinstance(v, torch.Tensor) and v.dim() > 1 else v
