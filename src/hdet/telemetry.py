"""Per-sync telemetry of an HDET scheduler: JSON Lines always, TensorBoard when installed, and any
callback (W&B, MLflow, ...). Only the process of replica 0 writes; the others stay quiet.

    hdet.SyncLogger(sched, "syncs.jsonl", tensorboard_dir="tb", callback=lambda rec: wandb.log(...))
"""

from __future__ import annotations

import importlib
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from .ensemble import SyncRecord

__all__ = ["SyncLogger", "sync_record_dict", "sync_scalars", "records_up_to", "strict_json"]


def strict_json(x: Any) -> Any:
    """``x`` with every non-finite float as None (null): strict JSON, which Python's ``NaN`` is not (``jq``,
    JavaScript and most JSON readers refuse it)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: strict_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [strict_json(v) for v in x]
    return x


def records_up_to(path: Path, step: int) -> list[str] | None:
    """The JSON-lines records of ``path`` up to optimizer step ``step`` (a resumed run drops those written after its
    checkpoint), or None if there is no such file. A last line cut short (a run killed while writing it) goes too;
    any other line that is not a record is a ValueError."""
    if not path.is_file():
        return None
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    keep = []
    for i, line in enumerate(lines):
        try:
            at = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            if i == len(lines) - 1:
                break
            raise ValueError(f"Expected one JSON record a line in {path}, but line {i + 1} is not one") from None
        if at <= step:
            keep.append(line)
    return keep


def sync_record_dict(rec: SyncRecord) -> dict[str, Any]:
    """One sync as plain data: step, per-replica window losses, per slot its name, every replica's
    multiplier and value, the base, and with the controller per slot: the paper's weights w, h~, h_bar,
    Delta, velocity; or the fit controller's fitted optimum x*, weight, log step, smoothed m, factor and
    the replicas' probe losses."""
    out: dict[str, Any] = {"step": rec.step, "names": rec.names, "losses": rec.losses,
                           "multipliers": rec.multipliers, "bases": rec.bases, "values": rec.values,
                           "recovered": rec.recovered, "recovered_early": rec.recovered_early,
                           "runaway": rec.runaway, "lr_scale": rec.lr_scale,
                           "went_back_to": rec.went_back_to, "range_scale": rec.range_scale,
                           "range_ended": rec.range_ended}
    if rec.controller is not None:
        out["controller"] = [
            {"kind": "fit", "x_star": c.h_tilde, "weight": c.h_bar, "step": c.delta, "m": c.velocity,
             "factor": c.factor, "base": c.base, "clamped": c.clamped, "probe_losses": c.losses}
            if c.kind == "fit" else
            {"kind": "paper", "weights": c.weights, "h_tilde": c.h_tilde, "h_bar": c.h_bar, "delta": c.delta,
             "velocity": c.velocity, "base": c.base if c.base is not None else c.new_base, "clamped": c.clamped}
            # (the base in the slot's own units: a log spread's controller works on log values)
            for c in rec.controller]
    return out


def sync_scalars(rec: SyncRecord) -> dict[str, float]:
    """One sync as flat scalars, for the trackers frameworks log to (TensorBoard, W&B, MLflow through the
    Hugging Face Trainer's ``report_to``, Lightning's logger, ``accelerator.log``): per replica its window
    loss (the window that ended), per slot the base after the sync (the schedule's value at this step, or where the
    controller or the guard's cut moved it: what the next window's values follow) and the spread's lowest and highest
    value dealt for the next window, at this step's base (the multipliers dealt times it: the next step's LR is the
    schedule's next value times them, which an LR monitor such as Lightning's logs at this same step, an audit),
    and the controller's Delta (the fit controller: its log step); how many replicas were reset (non-finite, runaway), how many losses were
    non-finite, and the LR schedule's cut so far."""
    if not isinstance(rec, SyncRecord):
        raise ValueError(f"Expected a hdet SyncRecord (what on_sync hooks get, or sched.last_sync once a sync has run), "
                         f"but got {type(rec).__name__}")
    out: dict[str, float] = {}
    for r, loss in enumerate(rec.losses or []):
        out[f"hdet/window_loss/replica{r}"] = loss
    for j, name in enumerate(rec.names or []):
        out[f"hdet/base/{name}"] = rec.bases[j]
        if rec.values is not None:
            out[f"hdet/min/{name}"], out[f"hdet/max/{name}"] = min(rec.values[j]), max(rec.values[j])
        if rec.controller is not None:
            out[f"hdet/delta/{name}"] = rec.controller[j].delta
    out["hdet/recovered"] = float(len(rec.recovered))
    out["hdet/runaway"] = float(len(rec.runaway))
    out["hdet/lr_scale"] = rec.lr_scale
    if rec.range_scale is not None:
        out["hdet/range_scale"] = rec.range_scale
    out["hdet/nonfinite_losses"] = float(sum(rec.nonfinite_losses))
    return out


class SyncLogger:
    """Attach to a scheduler (``OneCycleAutoLR``/``HDETLR``): every sync is written as one JSON line to
    ``path``, as TensorBoard scalars under ``tensorboard_dir`` (if given and tensorboard is installed),
    and handed to ``callback(record_dict)``. Replicas other than 0 write nothing. ``close()`` at the end.

    Args:
        scheduler: an hdet scheduler (``OneCycleAutoLR`` or ``HDETLR``).
        path: a JSON-lines file, one line per sync (None: none).
        tensorboard_dir: write TensorBoard scalars here (needs tensorboard; None: none).
        callback: called with each sync's record as a dict (e.g. ``wandb.log``).
        append: add to ``path`` instead of starting it afresh (a resumed run: at its first sync the records of
            that step and after, which the run before the resume wrote past its checkpoint, are dropped, from
            ``path`` and, through ``purge_step``, from TensorBoard, so that each sync is recorded once; give the logger
            a TensorBoard folder of its own: TensorBoard applies a purge to every file of the folder).
    """

    def __init__(self, scheduler: Any, path: str | Path | None = None, tensorboard_dir: str | Path | None = None,
                 callback: Callable[[dict[str, Any]], None] | None = None, append: bool = False) -> None:
        # replica 0's first rank only (under HSDP a replica is several ranks; a one-process engine's replicas share
        # the process's rank, so the replica decides too)
        self.active = scheduler.rank == 0 and (not (dist.is_available() and dist.is_initialized()) or
                                               dist.get_rank() == 0)
        self.callback = callback
        self.append = append
        self._path = Path(path) if path is not None else None
        self._file = self._path.open("a" if append else "w") if (self.active and path is not None) else None
        self._tb: Any = None
        self._tb_dir = tensorboard_dir if self.active else None
        if self._tb_dir is not None:
            try:
                importlib.import_module("torch.utils.tensorboard")  # (the writer is made at the first sync)
            except ImportError:
                raise ValueError("Expected the tensorboard package for tensorboard_dir (pip install tensorboard), "
                                 "but it is not installed") from None
        self._started = False
        scheduler.ensemble.on_sync.append(self)

    def _start(self, step: int) -> None:
        """At the first sync: with ``append``, drop the records of ``step`` and after (written past the checkpoint
        the run resumed from) from the file, and open TensorBoard purging them."""
        self._started = True
        if self.append and self._file is not None:
            self._file.close()
            self._path.write_text("".join(line + "\n" for line in records_up_to(self._path, step - 1) or []))
            self._file = self._path.open("a")
        if self._tb_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self._tb_dir), purge_step=step if self.append else None)

    def __call__(self, rec: SyncRecord) -> None:
        if not self.active:
            return
        if not self._started:
            self._start(rec.step)
        d = sync_record_dict(rec)
        if self._file is not None:
            self._file.write(json.dumps(strict_json(d)) + "\n")  # (a NaN loss: null)
            self._file.flush()
        if self._tb is not None:
            for key, value in sync_scalars(rec).items():
                self._tb.add_scalar(key, value, rec.step)
        if self.callback is not None:
            self.callback(d)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
