"""Replay what an HDET run discovered in a plain single-replica run.

``sched.record_schedule()`` makes an HDET scheduler remember, for every step, the base value of every
explored slot (each param group's LR and every other hyperparameter): the centre the replicas' values are
spread around (the arithmetic mean for a linear spread, the geometric mean for a log spread; before any clamp at
a bound: see docs/telemetry.md), the schedule
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

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from .caller import user_stacklevel
from .hyper import Hyperparameter
from .values import real_number

__all__ = ["ReplayLR"]


class ReplayLR(LRScheduler):
    """Sets each param group's LR (and each given hyperparameter, matched by name) to the recorded base
    value of the current step. Steps past the recording raise a ValueError."""

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: dict[str, Any],
                 explore: Sequence[Hyperparameter] = (), last_epoch: int = -1) -> None:
        if not isinstance(schedule, dict) or "names" not in schedule or "bases" not in schedule:
            raise ValueError("Expected a schedule from sched.discovered_schedule() (keys 'names', 'bases')")
        names, rows = schedule["names"], schedule["bases"]
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"Expected the schedule's names as a list of strings, but got {names!r}")
        names = list(names)
        if not isinstance(rows, (list, tuple)) or not rows or not all(
                isinstance(row, (list, tuple)) and len(row) == len(names) for row in rows):
            raise ValueError(f"Expected the schedule's bases as one list of {len(names)} values (one per name) for "
                             "every recorded step")
        bases = [[real_number(v) for v in row] for row in rows]
        lr_names = [n for n in names if n.startswith("lr/")]
        # every value finite, an LR >= 0, a replayed hyperparameter's within its own bounds (> 0 for a log spread:
        # a weight decay or a dropout is never negative, an explored Setter's values may be signed)
        spreads = {h.name: h.spread for h in explore}

        def fine(name: str, v: float | None, used: bool) -> bool:
            if v is None or not math.isfinite(v):
                return False
            if name.startswith("lr/"):  # (the last row is set after the last step and never used: torch's linear
                return v >= 0 or not used  # OneCycleLR, and the run that recorded it, go below 0 there)
            sp = spreads.get(name)
            return sp is None or (sp.clamp(v) == v and (sp.kind != "log" or v >= 0))  # (a log spread keeps 0 at 0:
            # a weight decay warmed up from 0, or decayed to it)

        def row_fine(t: int, row: list[float | None]) -> bool:
            return all(fine(n, v, t < len(bases) - 1) for n, v in zip(names, row))
        if not all(row_fine(t, row) for t, row in enumerate(bases)):
            bad = next(t for t, row in enumerate(bases) if not row_fine(t, row))
            raise ValueError(f"Expected finite recorded values for {names} (LRs >= 0, each replayed hyperparameter "
                             f"within its bounds), but step {bad} holds {rows[bad]!r}")
        groups = [f"lr/{g.get('name', j)}" for j, g in enumerate(optimizer.param_groups)]
        if sorted(groups) != sorted(lr_names):  # by each group's 'name' (its index without one), never by position
            raise ValueError(f"Expected an optimizer whose param groups are the recorded ones {lr_names} (by the "
                             f"group's 'name', else its index), but its groups are {groups}")
        missing = [h.name for h in explore if h.name not in names]
        if missing:
            raise ValueError(f"Expected recorded hyperparameters {[n for n in names if n not in lr_names]}, but "
                             f"{missing} were not recorded")
        left = [n for n in names if n not in lr_names and n not in {h.name for h in explore}]
        if left:
            warnings.warn(f"hdet: the schedule also recorded {left}, which this replay leaves alone: pass them in "
                          "explore= (e.g. hdet.WeightDecay(optimizer)) to replay them", stacklevel=user_stacklevel())
        self._replay_bases = bases
        self._lr_index = [names.index(n) for n in groups]
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
        """Restore :meth:`state_dict`'s state of a replay of the same schedule (a ValueError otherwise, nothing
        changed), then set the optimizer's LRs and each replayed value to the step's (a fresh optimizer, from a
        weights-only checkpoint, went on at its own LRs for a step)."""
        if not isinstance(state_dict, dict) or state_dict.get("_replay_bases") != self._replay_bases or not all(
                isinstance(state_dict.get(k), int) and not isinstance(state_dict.get(k), bool)
                for k in ("last_epoch", "_step_count")):
            raise ValueError("Expected a state_dict() of a ReplayLR of this schedule, but got "
                             + (f"one with keys {sorted(state_dict)[:8]}" if isinstance(state_dict, dict) else
                                type(state_dict).__name__) + " (another scheduler's, or another schedule's)")
        t = state_dict["last_epoch"]
        if not 0 <= t < self.total_steps:
            raise ValueError(f"Expected the state's last_epoch in [0, {self.total_steps}), but got {t}")
        self.__dict__.update({k: v for k, v in state_dict.items()
                              if k not in ("optimizer", "_hypers", "_replay_bases", "_lr_index", "total_steps")})
        row = self._replay_bases[t]
        for g, j in zip(self.optimizer.param_groups, self._lr_index):
            g["lr"] = row[j]
        self._last_lr = [row[j] for j in self._lr_index]
        for h, j in self._hypers:
            h.set(row[j])
