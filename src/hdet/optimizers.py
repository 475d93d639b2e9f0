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
* **Schedule-Free** (``AdamWScheduleFree``, ...): the parameters hold ``y``, an interpolation of the
  optimizer's ``z`` (its state) and the average ``x``; averaging ``y`` alone leaves ``z`` behind, and each
  replica's LR also enters its averaging weights. Averaging ``y`` together with ``z``
  (``average_optimizer_state=True``) keeps the three sequences consistent; a spread still changes the
  averaging weights, so it is refused.

Such optimizers are recognised by their param groups (``d`` and ``k``; ``train_mode`` or ``weight_sum``),
not by class, so forks and new versions are caught too.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["lr_free_kind", "check_optimizer", "innermost", "decoupled", "coupled_weight_decay"]


def innermost(optimizer: Any) -> Any:
    """The optimizer that really steps, under wrappers that keep it as ``.optimizer`` (Accelerate's
    ``AcceleratedOptimizer``, ...): its ``step()`` reads ``found_inf`` and runs the step hooks; its param
    groups hold the optimizer's own scalars."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def decoupled(optimizer: Any, group: dict[str, Any]) -> bool:
    """Whether ``group``'s weight decay is decoupled (AdamW's, or Adam's with ``decoupled_weight_decay``) rather
    than added to the gradient, where each replica's own weights then shape its optimizer's moments."""
    return bool(group.get("decoupled_weight_decay", isinstance(innermost(optimizer), torch.optim.AdamW)))


def coupled_weight_decay(optimizer: Any) -> bool:
    """Whether some param group adds a weight decay to the gradient (:func:`decoupled` is False there)."""
    return any(float(g.get("weight_decay", 0.0) or 0.0) > 0 and not decoupled(optimizer, g)
               for g in innermost(optimizer).param_groups)


def lr_free_kind(optimizer: torch.optim.Optimizer) -> str | None:
    """``"distance"`` (D-Adaptation, Prodigy), ``"schedule-free"``, or None for an ordinary optimizer."""
    groups = innermost(optimizer).param_groups
    if any("d" in g and "k" in g for g in groups):
        return "distance"
    if any("train_mode" in g or "weight_sum" in g for g in groups):
        return "schedule-free"
    return None


def check_optimizer(optimizer: torch.optim.Optimizer, spreading: bool, average_optimizer_state: bool,
                    sharded: bool = False) -> None:
    """Refuse, with the reason, an optimizer that a spread (``spreading``: any alpha > 0) or a converge step
    would silently break. Averaging alone (alpha 0) is allowed; distance estimators take the multiplier on
    their step (:mod:`hdet.step_scale`), which does not handle ``sharded`` (FSDP2/HSDP, DTensor) parameters."""
    kind = lr_free_kind(optimizer)
    name = type(innermost(optimizer)).__name__
    if kind == "distance" and spreading and sharded:
        raise ValueError(f"Expected an optimizer other than D-Adaptation or Prodigy ({name}) with device_mesh and a "
                         "spread: the multiplier on their step (hdet.step_scale) does not handle sharded (DTensor) "
                         "parameters yet. Use DDP replicas, or no spread")
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
