"""N replicas of a module in one process, with the semantics of N DDP processes.

Each replica is a full copy of the module with its own optimizer and its own HDET scheduler; the
schedulers talk through a :class:`~hdet.replicas.LocalReplicaGroup`, so the HDET maths is the very
code the distributed path runs. A step: every replica runs forward/backward on its own micro-batch
(its own dropout masks, drawn in replica order from the global RNG), gradients are averaged across
replicas as DDP's all-reduce does (each divided by N, then summed in replica order), every replica
steps with its own hyperparameters, then the schedulers step (sync every T steps).

This is the plain loop over replica copies; it works for any module.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from .replicas import LocalReplicaGroup, Replicas

__all__ = ["ReplicaEngine"]

MakeOptimizer = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
MakeScheduler = Callable[[torch.optim.Optimizer, Replicas, nn.Module], Any]
LossFn = Callable[[nn.Module, Any], torch.Tensor]


class ReplicaEngine:
    """``num_replicas`` copies of ``model`` (identical start weights) trained as one HDET ensemble.

    ``make_optimizer(params)`` builds one replica's optimizer; ``make_scheduler(optimizer, replicas,
    module)`` builds its scheduler and must pass ``replicas=replicas`` (and usually ``model=module``)
    to ``OneCycleAutoLR``/``HDETLR``."""

    def __init__(self, model: nn.Module, num_replicas: int, make_optimizer: MakeOptimizer,
                 make_scheduler: MakeScheduler) -> None:
        self.group = LocalReplicaGroup(num_replicas)
        self.models = [copy.deepcopy(model) for _ in range(num_replicas)]
        self.optimizers = [make_optimizer(m.parameters()) for m in self.models]
        self.schedulers = [make_scheduler(o, self.group.views[r], m)
                           for r, (o, m) in enumerate(zip(self.optimizers, self.models))]
        for r, s in enumerate(self.schedulers):
            if getattr(s, "ensemble", None) is None or s.ensemble.replicas is not self.group.views[r]:
                raise ValueError("Expected make_scheduler to build an hdet scheduler with replicas=<the given view>")
        self.group.ensembles = [s.ensemble for s in self.schedulers]
        self.num_replicas = num_replicas
        self.steps_taken = 0

    def _average_gradients(self) -> None:
        """The all-reduce of DDP over the replica axis: ``sum_r g_r / N`` in replica order."""
        N = self.num_replicas
        params = [list(m.parameters()) for m in self.models]
        for i in range(len(params[0])):
            grads = [ps[i].grad for ps in params]
            if all(g is None for g in grads):
                continue
            if any(g is None for g in grads):
                raise RuntimeError(f"Parameter {i} has a gradient on some replicas and not on others")
            acc = grads[0] / N
            for g in grads[1:]:
                acc.add_(g / N)
            for g in grads:
                g.copy_(acc)

    def step(self, batches: Sequence[Any], loss_fn: LossFn) -> torch.Tensor:
        """One optimizer step of every replica on its own batch; returns the losses, shape ``[N]``
        (on the device, no host sync except at sync steps)."""
        if len(batches) != self.num_replicas:
            raise ValueError(f"Expected one batch per replica ({self.num_replicas}), but got {len(batches)}")
        losses = []
        for m, o, b in zip(self.models, self.optimizers, batches):
            o.zero_grad(set_to_none=True)
            loss = loss_fn(m, b)
            loss.backward()
            losses.append(loss.detach())
        self._average_gradients()
        for o in self.optimizers:
            o.step()
        for s, loss in zip(self.schedulers, losses):
            s.ensemble.observe(loss)
        self.steps_taken += 1
        self.group.step = self.steps_taken
        for s in self.schedulers:
            s.step()
        return torch.stack(losses)
