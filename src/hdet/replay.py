"""Replay what an HDET run discovered in a plain single-replica run.

``sched.record_schedule()`` makes an HDET scheduler remember, for every step, the base value of every
explored slot (each param group's LR and every other hyperparameter): the centre the replicas' values are
spread around (the arithmetic mean for a linear spread, the geometric mean for a log spread), the schedule
the ensemble as a whole followed (the controller's once it runs). Not OneCycle's momentum cycle: a replaying
run that wants it sets it itself. ``sched.discovered_schedule()``
returns it as plain data (JSON-able); :class:`ReplayLR` plays it back as an ordinary LRScheduler::

    sched.record_schedule()                      # in the HDET run, before training
    ...
    json.dump(sched.discovered_schedule(), open("schedule.json", "w"))   # rank 0

    replay = hdet.ReplayLR(opt, json.load(open("schedule.json")), explore=[hdet.WeightDecay(opt)])
    for batch in loader: ...; opt.step(); replay.step()
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from .hyper import Hyperparameter

__all__ = ["ReplayLR"]


class ReplayLR(LRScheduler):
    """Sets each param group's LR (and each given hyperparameter, matched by name) to the recorded base
    value of the current step. Steps past the recording raise a ValueError."""

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: dict[str, Any],
                 explore: Sequence[Hyperparameter] = (), last_epoch: int = -1) -> None:
        if not isinstance(schedule, dict) or "names" not in schedule or "bases" not in schedule:
            raise ValueError("Expected a schedule from sched.discovered_schedule() (keys 'names', 'bases')")
        names, bases = list(schedule["names"]), [list(map(float, row)) for row in schedule["bases"]]
        if not bases or any(len(row) != len(names) for row in bases):
            raise ValueError(f"Expected one base value per name ({len(names)}) at every recorded step")
        lr_names = [n for n in names if n.startswith("lr/")]
        if len(lr_names) != len(optimizer.param_groups):
            raise ValueError(f"Expected an optimizer with {len(lr_names)} param groups ({lr_names}), but it has "
                             f"{len(optimizer.param_groups)}")
        missing = [h.name for h in explore if h.name not in names]
        if missing:
            raise ValueError(f"Expected recorded hyperparameters {[n for n in names if n not in lr_names]}, but "
                             f"{missing} were not recorded")
        self._replay_bases = bases
        self._lr_index = [names.index(n) for n in lr_names]
        self._hypers = [(h, names.index(h.name)) for h in explore]
        self.total_steps = len(bases)
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:  # type: ignore[override]
        t = self.last_epoch
        if t >= self.total_steps:
            raise ValueError(f"Expected at most {self.total_steps - 1} steps (the recording's length), but this "
                             f"is step {t}")
        row = self._replay_bases[t]
        for h, j in self._hypers:
            h.set(row[j])
        return [row[j] for j in self._lr_index]

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "_hypers")}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.__dict__.update({k: v for k, v in state_dict.items() if k not in ("optimizer", "_hypers")})
        if self._hypers and self.last_epoch < self.total_steps:
            for h, j in self._hypers:
                h.set(self._replay_bases[self.last_epoch][j])
