"""Which optimizers HDET can spread over, and a clear refusal for those it cannot (issue 15, item 4).

HDET gives each replica ``lr * rho_r``. Learning-rate-free optimizers keep estimates of their own that
this would break, silently:

* **Distance estimators** (D-Adaptation's ``DAdaptAdam``/``SGD``/..., Prodigy): each replica's step size is
  ``d * lr`` where ``d`` is estimated from that replica's own past steps, which would carry ``rho_r``, so
  ``d`` feeds on the multiplier. Measured with the multiplier on the LR (Fashion-MNIST MLP, engine, N = 8,
  T = 100): at alpha 0.2 the eight ``d`` fanned out 29x, at alpha 0.5 they ran away and the run diverged.
  So hdet puts the multiplier on the step instead (:mod:`hdet.step_scale`): every replica's optimizer sees
  the same base LR, its estimate is one for the ensemble, and the converge step averages the scalar
  estimates with the weights.
  Dual-averaging ones (``DAdaptSGD``, ``DAdaptAdaGrad``) set the weights from their start point and a running
  sum (``theta = x0 - s``) instead of adding an update: a multiplier on the step moves a replica along the
  shared trajectory, ahead or behind, but not faster (measured, alpha 0.2 over two replicas: 0.95x and 1.03x
  the displacement instead of 0.8x and 1.2x), so an LR spread over them is refused.
* **Schedule-Free** (``AdamWScheduleFree``, ...): the parameters hold ``y``, an interpolation of the
  optimizer's ``z`` (its state) and the average ``x``; averaging ``y`` alone leaves ``z`` behind, and each
  replica's LR also enters its averaging weights. Averaging ``y`` together with ``z``
  (``average_optimizer_state=True``) keeps the three sequences consistent; a spread still changes the
  averaging weights, so it is refused.

* **Mechanic** (``mechanic_pytorch.mechanize(...)``): it scales the base optimizer's summed updates by a scale
  ``s`` that it learns from the replica's own displacement from its start (``<theta - theta0, g>``), so under
  any spread each replica's ``s`` takes its own value (measured on a toy at alpha 0.5: the eight ``s`` 2.5-6x
  apart) and the spread is not what the telemetry shows: refused under a spread, allowed with averaging alone.

Such optimizers are recognised by their param groups (``d`` and ``k``; ``train_mode`` or ``weight_sum``),
not by class, so forks and new versions are caught too; Mechanic by its state's ``_mechanic`` entry or its
``Mechanic`` base class (without importing it).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from .caller import user_stacklevel
from .warm_init import warm_initialised

__all__ = ["lr_free_kind", "dual_averaging", "check_optimizer", "check_shared_gradients", "innermost", "decoupled",
           "coupled_weight_decay", "replica_own_state", "own_lr_tensors", "say_maximize"]


def replica_own_state(optimizer: Any) -> frozenset[str]:
    """The optimizer state keys each replica keeps as its own where the rest is averaged (``average_optimizer_state``)
    or reset to the healthy replicas' mean: the step counts, and state that follows the replica's own LR or explored
    value rather than the weights: ASGD's ``eta`` (the step size its next step uses, from this replica's LR: averaged,
    every replica took the first step of each window at the mean LR, an audit: weights 1.6e-2 off), NAdam's
    ``mu_product`` (the product of its momentum schedule, from this replica's beta1)."""
    inner = innermost(optimizer)
    extra = {torch.optim.ASGD: {"eta"}, torch.optim.NAdam: {"mu_product"}}
    return frozenset({"step"}.union(*(keys for cls, keys in extra.items() if isinstance(inner, cls))))


def innermost(optimizer: Any) -> Any:
    """The optimizer that really steps, under wrappers that keep it as ``.optimizer`` (Accelerate's
    ``AcceleratedOptimizer``, ...): its ``step()`` reads ``found_inf`` and runs the step hooks; its param
    groups hold the optimizer's own scalars."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


# optimizers whose weight decay multiplies the weights by (1 - lr * weight_decay), never the gradient (torch's Muon
# and Adafactor: read as coupled, a resume that was exact was said not to be, an audit)
_DECOUPLED = tuple(c for c in (torch.optim.AdamW, getattr(torch.optim, "Muon", None),
                               getattr(torch.optim, "Adafactor", None)) if c is not None)


def decoupled(optimizer: Any, group: dict[str, Any]) -> bool:
    """Whether ``group``'s weight decay is decoupled (AdamW's, Muon's, Adafactor's, Adam's with
    ``decoupled_weight_decay``, D-Adaptation's and Prodigy's with ``decouple``) rather than added to the gradient,
    where each replica's own weights then shape its optimizer's moments."""
    return bool(group.get("decoupled_weight_decay",
                          group.get("decouple", isinstance(innermost(optimizer), _DECOUPLED))))


def coupled_weight_decay(optimizer: Any) -> bool:
    """Whether some param group adds a weight decay to the gradient (:func:`decoupled` is False there)."""
    return any(float(g.get("weight_decay", 0.0) or 0.0) > 0 and not decoupled(optimizer, g)
               for g in innermost(optimizer).param_groups)


def lr_free_kind(optimizer: torch.optim.Optimizer) -> str | None:
    """``"distance"`` (D-Adaptation, Prodigy), ``"schedule-free"``, ``"mechanic"``, or None for an ordinary
    optimizer."""
    inner = innermost(optimizer)
    if "_mechanic" in inner.state or any(c.__name__ == "Mechanic" and c.__module__.startswith("mechanic_pytorch")
                                         for c in type(inner).__mro__):
        return "mechanic"
    groups = inner.param_groups
    if any("d" in g and "k" in g for g in groups):
        return "distance"
    if any("train_mode" in g or "weight_sum" in g for g in groups):
        return "schedule-free"
    return None


def dual_averaging(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a distance estimator sets its weights from its start point (``x0`` in its state: D-Adaptation's
    SGD and AdaGrad), recognised before its first step by its param groups (``momentum`` without ``betas``)."""
    inner = innermost(optimizer)
    return lr_free_kind(inner) == "distance" and (
        any("momentum" in g and "betas" not in g for g in inner.param_groups)
        or any("x0" in st for st in inner.state.values()))


def _undone_average(optimizer: torch.optim.Optimizer, why: str) -> str:
    return (f"Expected average_optimizer_state=True with {type(innermost(optimizer)).__name__} under {why}: D-Adaptation's "
            "dual averaging sets the weights from its start point and its running sum at every step, so a converge "
            "step's average of the weights alone does not last (one step after it the weights equal a never-averaged "
            "run's to 2e-12 in an audit's run). Pass average_optimizer_state=True (its start point and sum are "
            "averaged with the weights), or use DAdaptAdam or Prodigy")


ONE_LR = ("DAdaptAdam", "DAdaptLion", "DAdaptSGD", "Prodigy")  # their step refuses param groups of different LRs


def own_lr_tensors(optimizers: list[Any]) -> bool:
    """Give every param group whose ``lr`` is a tensor another group also holds (the same object: an optimizer built
    with ``lr=torch.tensor(...)`` gives it to every group, and the engine's ``make_optimizer`` one tensor to every
    replica) a copy of its own, on its device: hdet sets each group's LR in place in a tensor, so one shared tensor
    held the last value set, and every replica (or LR group) trained at it while the records showed the spread, unsaid
    (an audit: both replicas at 0.075 instead of 0.025 and 0.075). Returns whether any was copied."""
    seen: set[int] = set()
    copied = False
    for opt in optimizers:
        for g in innermost(opt).param_groups:
            lr = g.get("lr")
            if isinstance(lr, torch.Tensor):
                if id(lr) in seen:
                    g["lr"], copied = lr.detach().clone(), True
                seen.add(id(g["lr"]))
    return copied


def say_maximize(optimizer: Any, reads_loss: bool) -> None:
    """Warn where an optimizer maximizes (``maximize=True``) and hdet reads the training loss (the paper controller,
    ``on_runaway="recover"``, the range test): it takes the value given to ``step(loss)`` as a loss, lower better, so
    a rising objective passed as it is was judged a runaway, the replicas sent back and the LR cut (an audit)."""
    if reads_loss and any(g.get("maximize") for g in innermost(optimizer).param_groups):
        warnings.warn("hdet: the optimizer has maximize=True, and hdet reads the value given to scheduler.step(loss) "
                      "as a loss, lower is better (the paper controller, on_runaway='recover', the range test): pass "
                      "the quantity the run minimises (the negated objective), not the objective itself",
                      stacklevel=user_stacklevel())


def check_lr_groups(optimizer: torch.optim.Optimizer, auto_lr: bool, tie_lr_groups: bool) -> None:
    """Refuse auto-LR with untied LR groups over an optimizer that takes one LR for all its param groups
    (D-Adaptation's Adam, Lion and SGD, Prodigy: "Setting different lr values in different parameter groups is only
    supported for values of 0"): each LR group's controller moves its own base, and the optimizer's step failed
    mid-run (an audit: after the second control sync)."""
    inner = innermost(optimizer)
    groups = [g for g in inner.param_groups if g.get("lr", 0) != 0]
    if auto_lr and not tie_lr_groups and len(groups) > 1 and lr_free_kind(inner) == "distance" \
            and type(inner).__name__ in ONE_LR:
        raise ValueError(f"Expected tie_lr_groups=True with enable_auto_lr=True over {type(inner).__name__} with "
                         f"{len(groups)} param groups: it takes one LR for all its groups, and each group's controller "
                         "would move its own. Pass tie_lr_groups=True (one base for every group), or one param group")


def check_shared_gradients(optimizer: torch.optim.Optimizer, average_optimizer_state: bool = False) -> None:
    """Refuse Mechanic without shared gradients (local mode): each replica's scale then learns from its own
    gradients (8.9x apart after 300 steps at alpha 0 on a toy, with its state averaged too), and Mechanic rebuilds
    each replica's weights from its start point and its own scale, so a converge step's average does not last. So
    do D-Adaptation's SGD and AdaGrad (dual averaging) unless their state is averaged too."""
    if dual_averaging(optimizer) and not average_optimizer_state:
        raise ValueError(_undone_average(optimizer, "local mode (each replica's running sum is its own)"))
    if isinstance(innermost(optimizer), torch.optim.LBFGS):
        raise ValueError("Expected shared gradients (an all-reduce every step) with LBFGS, but this is local mode: each "
                         "replica's curvature history (lists, never averaged) follows its own gradients, at odds with "
                         "the averaged weights after each converge step. Average the gradients every step, or use "
                         "another optimizer")
    if lr_free_kind(optimizer) == "mechanic":
        raise ValueError(f"Expected shared gradients (an all-reduce every step) with {type(innermost(optimizer)).__name__} "
                         "(Mechanic), but this is local mode: each replica's scale would learn from its own gradients "
                         "and drift from the others', and Mechanic rebuilds the weights from that scale, undoing the "
                         "converge step's average. Average the gradients every step, or use another optimizer")


def check_optimizer(optimizer: torch.optim.Optimizer, spreading: bool, average_optimizer_state: bool,
                    sharded: bool = False, lr_spread: bool = False, recovering: bool = False,
                    lr_moved: bool = False) -> None:
    """Refuse, with the reason, an optimizer that a spread (``spreading``: any alpha > 0; ``lr_spread``: the LR's),
    a converge step or a go-back to a best sync (``recovering``: ``on_runaway="recover"``) would silently break.
    Averaging alone (alpha 0) is allowed; distance estimators take the multiplier on their step
    (:mod:`hdet.step_scale`), which does not handle ``sharded`` (FSDP2/HSDP, DTensor) parameters, nor dual
    averaging. ``lr_moved``: the LR is moved for the whole ensemble too (the controller, the range test)."""
    kind = lr_free_kind(optimizer)
    inner = innermost(optimizer)
    name = type(inner).__name__
    if (lr_spread or lr_moved) and isinstance(inner, torch.optim.Rprop):
        raise ValueError("Expected an optimizer whose steps follow its LR under an LR spread, the auto-LR controller or "
                         "the range test, but got Rprop: it reads group['lr'] only to set its first step sizes (its "
                         "state's step_size), so each replica keeps the step sizes of its first LR whatever the "
                         "schedule, the deal or the controller say (an audit: re-dealt replicas kept their first 3x "
                         "ratio; with average_optimizer_state=True the spread was gone after the first converge step), "
                         "while the records show them. Use ensemble_lr_spread_ratio=0 without auto-LR or the range "
                         "test (averaging only), or another optimizer")
    if (spreading or lr_moved) and isinstance(inner, torch.optim.LBFGS):
        raise ValueError("Expected an optimizer whose step follows its LR and whose state a converge step averages, "
                         "but got LBFGS under a spread, the auto-LR controller or the range test: its inner iterations "
                         "and line search make its step depend on far more than the LR (a 3x LR moved a replica "
                         "1.07-1.13x as far in an audit), and its curvature history (lists, never averaged) is each "
                         "replica's own, at odds with the averaged weights after a converge step. Use "
                         "ensemble_lr_spread_ratio=0 and no explored hyperparameter (averaging only), or another "
                         "optimizer")
    if spreading and isinstance(inner, torch.optim.ASGD) and not average_optimizer_state:
        raise ValueError("Expected average_optimizer_state=True with ASGD under a spread: its state holds ax, an "
                         "average of the weights (what its users evaluate), which a converge step of the weights alone "
                         "leaves each replica's own (an audit: 1.85e-2 apart after the last converge step while the "
                         "weights were equal). Pass average_optimizer_state=True, or use another optimizer")
    zero = any(c.__name__ == "ZeroRedundancyOptimizer" for c in type(inner).__mro__)
    if zero and recovering:
        raise ValueError(f"Expected on_runaway='ignore' and no lr_range_test with {name}: going back to a best sync "
                         "restores the weights and what optimizer.state holds, but ZeroRedundancyOptimizer keeps its "
                         "state in the optimizer it wraps (optimizer.optim), on the rank that owns each parameter, so "
                         "the moments and step counts stayed at the later step (an audit: Adam's exp_avg 4.3e-2 off "
                         "after going back, the weights 6e-3 off a plain AdamW's three steps later). Use the optimizer "
                         "it wraps (optimizer_class) with DDP, or on_runaway='ignore'")
    if zero and warm_initialised(p for g in optimizer.param_groups for p in g["params"]):
        raise ValueError(f"Expected no hdet.warm_init_ noise with {name}: it steps each parameter on its owner rank and "
                         "broadcasts it, so after the first step every replica holds the owner's noise instead of its "
                         "own, and the converge steps average identical replicas (an audit: the final model carried one "
                         "rank's noise, 3.1e-3 off a plain AdamW's run). Use the optimizer it wraps (optimizer_class) "
                         "with DDP, or leave out warm_init_")
    if spreading and zero:
        raise ValueError(f"Expected an optimizer that steps every parameter on every rank under a spread, but got {name}: "
                         "it steps each parameter on one rank and broadcasts it, so every replica would get the owner "
                         "rank's multiplier for that parameter and the replicas would stay identical (an audit: no "
                         "spread at all, silently). Use the optimizer it wraps (optimizer_class) with DDP, or FSDP2 "
                         "with device_mesh= to shard")
    if spreading and not lr_spread and dual_averaging(optimizer) and not average_optimizer_state:
        raise ValueError(_undone_average(optimizer, "an explored hyperparameter's spread (the replicas' running sums "
                                                    "differ)"))
    if lr_spread and dual_averaging(optimizer):
        raise ValueError(f"Expected an optimizer that adds its update to the weights under an LR spread, but got {name} "
                         "(dual averaging: it sets the weights from its start point and a running sum, so the "
                         "multiplier on its step moves a replica along the others' trajectory instead of scaling its "
                         "step, and the spread silently does almost nothing). Use DAdaptAdam or Prodigy, or "
                         "ensemble_lr_spread_ratio=0 (averaging only)")
    if kind == "distance" and spreading and sharded:
        raise ValueError(f"Expected an optimizer other than D-Adaptation or Prodigy ({name}) with device_mesh and a "
                         "spread: the multiplier on their step (hdet.step_scale) does not handle sharded (DTensor) "
                         "parameters yet. Use DDP replicas, or no spread")
    if kind == "mechanic" and spreading:
        raise ValueError(f"Expected an optimizer without a learned scale of its own under a spread, but got {name} "
                         "(Mechanic): it scales each replica's updates by a scale learned from that replica's own "
                         "displacement, so under a spread the replicas' scales drift apart (2.5-6x at alpha 0.5 on a "
                         "toy) and the spread is not what the telemetry shows. Use no spread (alpha 0 and no explored "
                         "hyperparameter: averaging only), or D-Adaptation/Prodigy, whose estimate hdet keeps one for the "
                         "ensemble")
    if kind == "schedule-free":
        if spreading:
            raise ValueError(
                f"Expected an optimizer without its own iterate averaging, but got {name} (Schedule-Free): each "
                "replica's LR also sets its averaging weights, so a spread breaks its x/y/z sequences. Use "
                "ensemble_lr_spread_ratio=0 with average_optimizer_state=True, or an ordinary optimizer."
            )
        if not average_optimizer_state:
            raise ValueError(
                f"Expected average_optimizer_state=True with {name} (Schedule-Free): its parameters hold y, an "
                "interpolation of its state z and the average x; averaging y without z makes them inconsistent."
            )
        if recovering:
            raise ValueError(
                f"Expected on_runaway='ignore' and no lr_range_test with {name} (Schedule-Free): going back to a best "
                "sync restores its y, z and moments but not the step count, weight sum and peak LR in its param "
                "groups, so its steps after it would be too long (1.6x in an audit's run) and its averaging weights "
                "wrong. A non-finite replica is still reset at the next converge step without it."
            )
