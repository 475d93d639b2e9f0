"""The LR multiplier on the step, for optimizers that estimate their own step size (issue 15, item 4).

D-Adaptation (``DAdaptAdam``, ``DAdaptLion``, ...) and Prodigy scale every step by ``d * lr``, where ``d`` is
estimated from the optimizer's own past steps. Given ``lr * rho_r``, each replica's estimate feeds on its
own multiplier and the estimates run apart (measured: 29x at alpha 0.2, divergence at 0.5). So for these
optimizers hdet gives every replica the ensemble's base LR, the same on every replica, and applies the
replica's multiplier to the update the optimizer made instead:

    theta_r <- theta_r + rho_r * (optimizer_step(theta_r) - theta_r)

For AdamW this is exactly ``lr * rho_r``; for a distance estimator the estimate is computed from the base
LR only. (D-Adaptation's dual-averaging SGD and AdaGrad set the weights instead of adding an update, which this
cannot scale: they are refused under an LR spread, :func:`hdet.optimizers.check_optimizer`.) With averaged gradients (DDP, the engine's default) D-Adaptation's state (``d``, its sums, the
moments) depends on the gradients and the base LR alone, so it is the same on every replica: one estimate
for the ensemble, and the converge step's averaged weights stay consistent with it. Prodigy's estimate also
reads the distance from the initial point, ``<g, p0 - theta_r>``, which differs between replicas by their
multipliers; left to each replica between converge steps, the replicas' d fan out (measured on a toy at
alpha 0.5, T 50: 750x within 30 steps, the highest replicas blew up). So its numerator (and denominator) are
averaged at every step and d is recomputed from them by Prodigy's own rule (:meth:`StepScale.set_shared`): the
mean of the replicas' numerators is the numerator at the ensemble's mean iterate, the one the converge step
makes, so d is one for the ensemble at every step. Cost: one all_gather of three float64 a step under a
process group (Prodigy itself reads a scalar to the host per parameter per step). Coupled weight
decay (D-Adaptation's ``decouple=False`` with ``weight_decay > 0``) or an explored hyperparameter that the
estimate reads (weight decay, betas) also makes the estimates differ between converge steps; they are
averaged at each.

Cost: one copy of the trainable parameters (kept between steps) and three passes over them a step, on the
parameters' devices; no host sync and no collective but Prodigy's sharing above. At a sync: the few scalar
estimates ride in the converge step's average (one more small bucket) and are read back on the host once. The
engine's stacked D-Adaptation and Prodigy steps (:mod:`hdet.stacked_optim`) apply the multiplier in their own
update and take Prodigy's numerator at the replicas' mean iterate, without these hooks.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Sequence

import torch

from .caller import user_stacklevel
from .optimizers import innermost

__all__ = ["StepScale", "ESTIMATES", "prodigy_estimate", "reads_weights"]

# the param-group scalars of the distance estimators that the converge step averages and a go-back restores
# (D-Adaptation, Prodigy; DAdaptAdan's and DAdaptAdaGrad's sums too: left at their later values by a go-back, d
# stalled, 383x off in an audit's run; DAdaptSGD's g0_norm, the norm of each replica's own first gradient in local
# mode, which divides its every step: left per replica, steps 1.7x apart at alpha 0, an audit)
ESTIMATES = ("d", "d_max", "d_numerator", "numerator_weighted", "gsq_weighted", "skl1", "sksq_weighted", "g0_norm")
_PRODIGY = ("d0", "d_coef", "d_max", "d_numerator", "growth_rate")  # its param groups' signature


def prodigy_estimate(group: dict[str, Any], d: float, d_max: float, numerator: float,
                     denominator: float) -> dict[str, float]:
    """Prodigy's rule (prodigyopt 1.1): from ``d`` and ``d_max`` before a step and that step's numerator and
    denominator, the values its param groups hold after it (``d_hat = d_coef * num / den``; the first growth
    from ``d0``; ``d_max`` the running max; growth at most ``growth_rate`` a step)."""
    d_hat = group["d_coef"] * numerator / denominator
    if d == group["d0"]:
        d = max(d, d_hat)
    d_max = max(d_max, d_hat)
    return {"d_numerator": numerator, "d_denom": denominator, "d": min(d_max, d * group["growth_rate"]),
            "d_max": d_max, "d_hat": d_hat}


def reads_weights(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's estimate reads the weights (Prodigy's ``<g, p0 - theta>``), recognised by its
    param groups; such an estimate is shared at every step (:meth:`StepScale.set_shared`)."""
    return all(k in innermost(optimizer).param_groups[0] for k in _PRODIGY)


class StepScale:
    """Scales each optimizer step by this replica's multiplier per param group (:attr:`multipliers`), through
    the optimizer's step hooks. A step with every multiplier 1 is left alone (no copy). One per optimizer:
    :meth:`install` replaces an earlier one (a second scheduler over the same optimizer)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = innermost(optimizer)
        self.multipliers = [1.0] * len(self.optimizer.param_groups)
        self._before: list[list[torch.Tensor]] = []  # per group: the parameters before the step (reused)
        self._stepped: list[list[torch.Tensor]] | None = None
        self._estimates: torch.Tensor | None = None  # the group scalars, for the converge step to average
        self._host: torch.Tensor | None = None  # its pinned source while a copy to the device may be in flight
        self._keys: list[tuple[int, str]] = []
        self._counts: torch.Tensor | None = None  # the param groups' step counts "k" (kept with a best sync, not averaged)
        self._filled = False  # the tensor holds this sync's estimates, not yet taken back into the groups
        # Prodigy: the estimate is shared at every step. ``share(local)`` returns every replica's row (a process
        # group's all_gather); None: the caller shares (the engine: :func:`share_local`), or one replica alone
        self.every_step = reads_weights(self.optimizer)
        self.share: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._pre: tuple[float, float, int] | None = None  # d, d_max and k before the step
        self.contribution: list[float] | None = None  # this step's [numerator, denominator, 1] (or zeros)
        self._took = self._warned = False
        self._replaced: StepScale | None = None  # the one this replaced on the optimizer (a second scheduler's)
        self._hooks: tuple[Any, ...] = ()
        self.active = True  # False: its scheduler dropped unclosed (hdet.schedulers._release)
        self._register()

    def _register(self) -> None:
        self._hooks = (self.optimizer.register_step_pre_hook(self._save),
                       self.optimizer.register_step_post_hook(self._scale),
                       self.optimizer.register_load_state_dict_post_hook(self._loaded))

    @classmethod
    def install(cls, optimizer: torch.optim.Optimizer) -> "StepScale":
        inner = innermost(optimizer)
        old = getattr(inner, "_hdet_step_scale", None)
        if old is not None:
            old.remove()
        inner._hdet_step_scale = new = cls(inner)
        new._replaced = old
        return new

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = ()

    def turn_off(self) -> None:
        """Its hooks off and its place on the optimizer left (its scheduler closed: :meth:`turn_on` puts both back)."""
        self.remove()
        if getattr(self.optimizer, "_hdet_step_scale", None) is self:
            del self.optimizer._hdet_step_scale

    def turn_on(self) -> None:
        """Its hooks back on, as the optimizer's step scale (a closed scheduler reopened by a loaded state)."""
        self.active = True
        self._register()
        self.optimizer._hdet_step_scale = self

    def uninstall(self) -> None:
        """Take the hooks off (a scheduler whose construction failed): the one this replaced, if any, is put back."""
        self.remove()
        if getattr(self.optimizer, "_hdet_step_scale", None) is self:
            if self._replaced is not None:
                self._replaced._register()
                self.optimizer._hdet_step_scale = self._replaced
            else:
                del self.optimizer._hdet_step_scale

    @torch.no_grad()
    def _save(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self.active:  # (its scheduler dropped unclosed: the hooks idle, taken off only by close())
            return
        self.take_estimates()  # after a recovery between syncs
        if self.every_step:
            g = self.optimizer.param_groups[0]
            self._pre = (float(g["d"]), float(g["d_max"]), int(g["k"]))
        if all(m == 1.0 for m in self.multipliers):
            self._stepped = None
            return
        # every trainable parameter: with step(closure) the gradients do not exist yet (an unchanged one
        # comes out of the lerp exactly as it went in)
        self._stepped = [[p for p in g["params"] if p.requires_grad] for g in self.optimizer.param_groups]
        if len(self._before) != len(self._stepped) or any(
                len(b) != len(s) or any(x.shape != p.shape or x.dtype != p.dtype or x.device != p.device
                                        for x, p in zip(b, s)) for b, s in zip(self._before, self._stepped)):
            self._before = [[p.detach().clone() for p in s] for s in self._stepped]
        else:
            for b, s in zip(self._before, self._stepped):
                if s:
                    torch._foreach_copy_(b, [p.detach() for p in s])

    @torch.no_grad()
    def _scale(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self.active:
            return
        if self.every_step:
            self._contribute()
        if self._stepped is None:
            return
        for m, before, stepped in zip(self.multipliers, self._before, self._stepped):
            if m == 1.0 or not stepped:
                continue
            after = [p.detach() for p in stepped]
            torch._foreach_lerp_(before, after, m)  # before + m * (after - before)
            torch._foreach_copy_(after, before)
        self._stepped = None

    # -- Prodigy: the estimate shared at every step ---------------------------------------------------
    def _contribute(self) -> None:
        """This replica's numerator and denominator of the step just taken (shared by :meth:`exchange`, under a
        process group, or by the engine's :func:`share_local`)."""
        g = self.optimizer.param_groups[0]
        num, den = float(g["d_numerator"]), float(g.get("d_denom", 0.0))
        self._took = took = self._pre is not None and int(g["k"]) == self._pre[2] + 1
        if took and "d_denom" not in g and not self._warned:
            self._warned = True
            warnings.warn(f"hdet: {type(self.optimizer).__name__} keeps no 'd_denom' in its param groups (an older "
                          "Prodigy?): its estimate is averaged at converge steps only, and the replicas' estimates "
                          "may drift apart between them; upgrade prodigyopt (>= 1.1)", stacklevel=user_stacklevel())
        ok = took and den > 0 and math.isfinite(num) and math.isfinite(den)  # a non-finite replica is left out
        self.contribution = [num, den, 1.0] if ok else [0.0, 0.0, 0.0]

    def exchange(self) -> None:
        """Under a process group, at every scheduler step (which every rank takes every step, where an optimizer
        step skipped on one rank alone, a GradScaler's in local mode, made no collective there: the ranks' gathers
        paired steps apart and then met the converge step's, an abort; an audit): every replica's contribution of the
        optimizer step just taken, zeros from one that took none, into this one's groups (COLLECTIVE: one all_gather
        of three float64; HOST SYNC)."""
        if self.share is None or not self.every_step:
            return
        mine, self.contribution = self.contribution or [0.0, 0.0, 0.0], None
        rows = self.share(torch.tensor(mine, dtype=torch.float64))
        self.set_shared(rows.sum(0).tolist())
        self._took = False  # (set by the next step's contribution)

    def set_shared(self, total: list[float]) -> None:
        """The replicas' summed ``[numerator, denominator, count]`` of this step into this optimizer's groups:
        d recomputed from their means by Prodigy's rule (:func:`prodigy_estimate`). The step just taken used
        each replica's own new d only in its ``d * eps`` term. Nothing changes where no replica contributed or
        this one did not step; a replica whose own values were not finite takes the others'."""
        num, den, n = total
        if n == 0 or self._pre is None or not self._took:
            return
        d, d_max, _ = self._pre
        est = prodigy_estimate(self.optimizer.param_groups[0], d, d_max, num / n, den / n)
        for g in self.optimizer.param_groups:
            g.update(est)

    def _loaded(self, optimizer: Any) -> None:
        self._filled = False  # a loaded optimizer state wins over estimates gathered before it

    # -- the scalar estimates, averaged by the converge step ----------------------------------------
    def estimates(self, like: torch.Tensor) -> list[torch.Tensor]:
        """The optimizer's scalar estimates (:data:`ESTIMATES` of every param group that has them) in one
        float64 tensor on ``like``'s device, for the converge step to average with the weights; [] if the
        optimizer keeps none. Filled from the param groups once a sync (the first call); whatever writes
        into it afterwards (the average, a go-back to a saved sync) reaches the param groups at
        :meth:`take_estimates` (the end of the sync, or before the next optimizer step)."""
        keys = [(j, k) for j, g in enumerate(self.optimizer.param_groups) for k in ESTIMATES if k in g]
        if not keys:
            return []
        t = self._estimates
        if self._filled and t is not None and t.device == like.device and keys == self._keys:
            return [t]
        if t is None or t.numel() != len(keys) or t.device != like.device:
            t = self._estimates = torch.empty(len(keys), dtype=torch.float64, device=like.device)
        host = torch.tensor([float(self.optimizer.param_groups[j][k]) for j, k in keys], dtype=torch.float64)
        if t.is_cuda:  # a pinned source: the copy does not wait for the device
            host = host.pin_memory()
            t.copy_(host, non_blocking=True)
            self._host = host
        else:
            t.copy_(host)
        counts = [float(g["k"]) for g in self.optimizer.param_groups if "k" in g]
        self._counts = torch.tensor(counts, dtype=torch.float64, device=like.device) if counts else None
        self._keys, self._filled = keys, True
        return [t]

    def counts(self) -> list[torch.Tensor]:
        """The param groups' step counts ``k`` (what :meth:`estimates` read with the estimates this sync; [] before
        or without any): a go-back writes the best sync's into it, :meth:`take_estimates` sets them."""
        return [self._counts] if self._filled and self._counts is not None else []

    def unfill(self) -> None:
        """The estimates were read outside a sync (a snapshot of step 1): nothing to take back into the groups."""
        self._filled = False

    def take_estimates(self) -> None:
        """The tensor's estimates (averaged, or gone back to) into the param groups; the next sync fills it
        afresh."""
        if not self._filled or self._estimates is None:
            return
        for (j, k), v in zip(self._keys, self._estimates.tolist()):  # HOST SYNC: a few scalars, once a sync
            self.optimizer.param_groups[j][k] = v
        if self._counts is not None:
            counted = [g for g in self.optimizer.param_groups if "k" in g]
            for g, v in zip(counted, self._counts.tolist()):  # HOST SYNC (as above)
                g["k"] = int(v)
        self._filled = False


def share_local(scales: Sequence[StepScale | None]) -> None:
    """The engine's replicas after their optimizer steps: Prodigy's numerators and denominators summed over the
    replica axis and set into every replica's groups (:meth:`StepScale.set_shared`)."""
    live = [s for s in scales if s is not None and s.every_step and s.contribution is not None]
    if len(live) < 2:
        return
    total = [sum(c) for c in zip(*(s.contribution for s in live))]
    for s in live:
        s.set_shared(total)
