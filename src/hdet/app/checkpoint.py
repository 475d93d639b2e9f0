"""``hdet train``'s checkpoints, and ``--resume`` from them.

Every ``--checkpoint-every`` steps the run writes what it needs to go on exactly where it was: in the engine one
``checkpoint.pt`` (every replica's model, optimizer and scheduler: :meth:`hdet.engine.ReplicaEngine.state_dict`),
under torchrun one ``checkpoint-rank<r>.pt`` per rank (its replica's), each with the data generators' and torch's
random states and the training loop's own counters and curves. A file is written to a temporary name and renamed,
so a run killed while saving keeps the previous checkpoint whole. ``--resume`` loads it (plain data:
``torch.load(weights_only=True)``), cuts ``metrics.jsonl`` and ``syncs.jsonl`` back to the checkpoint's step and
goes on: on the CPU the resumed run's records, weights and losses are the uninterrupted run's, bit for bit
(``tests/test_cli.py``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch

from .options import RunConfig, RunError

__all__ = ["VERSION", "path_for", "save", "load", "check_config", "restore_rng", "truncate_jsonl", "SAME_RUN_EXEMPT"]

VERSION = 1
# options that may differ between a run and its resumption: how it is watched, not what it computes
SAME_RUN_EXEMPT = ("resume", "progress", "tensorboard", "label", "checkpoint_every", "out")


def path_for(out: Path, rank: int | None) -> Path:
    """The checkpoint of this process: ``checkpoint.pt`` in the engine, ``checkpoint-rank<r>.pt`` under torchrun."""
    return out / ("checkpoint.pt" if rank is None else f"checkpoint-rank{rank}.pt")


def _config(cfg: RunConfig) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in SAME_RUN_EXEMPT}


def save(path: Path, cfg: RunConfig, replicas: int, step: int, run_state: dict[str, Any],
         gens: dict[int, torch.Generator], loop: dict[str, Any]) -> None:
    """Write the checkpoint after optimizer step ``step`` (to a temporary file, then renamed over the old one)."""
    state = {"version": VERSION, "step": step, "config": _config(cfg), "replicas": replicas, "run": run_state,
             "data_rng": {str(r): g.get_state() for r, g in gens.items()},
             "torch_rng": torch.get_rng_state(),
             "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
             "loop": loop}
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load(path: Path) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save`; a missing or unreadable one is a one-line error."""
    if not path.is_file():
        raise RunError(f"Expected a checkpoint to resume from at {path} (written every --checkpoint-every steps), but "
                       "there is none")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file: one line, what it is
        raise RunError(f"Expected {path} to be a checkpoint written by hdet train, but it could not be read "
                       f"({type(e).__name__})") from None
    if not isinstance(state, dict) or "run" not in state or "step" not in state:
        raise RunError(f"Expected {path} to be a checkpoint written by hdet train, but it is not one")
    if state.get("version", 0) > VERSION:
        raise RunError(f"Expected a checkpoint of version <= {VERSION}, but {path} has version {state['version']}: "
                       "written by a newer hdet")
    return state


def check_config(state: dict[str, Any], cfg: RunConfig, replicas: int) -> None:
    """That the resumed run is the checkpointed one: every option that changes what is computed is the same, and the
    number of replicas (under torchrun the world size, which no option names)."""
    saved, now = state["config"], _config(cfg)
    diff = [f"--{k.replace('_', '-')} {saved.get(k)!r} -> {now[k]!r}" for k in now if saved.get(k) != now[k]]
    if state.get("replicas", replicas) != replicas:
        diff.append(f"replicas (the world size under torchrun) {state['replicas']} -> {replicas}")
    if diff:
        raise RunError(f"Expected the options of the checkpointed run to resume it, but these differ: {'; '.join(diff)}")


def restore_rng(state: dict[str, Any], gens: dict[int, torch.Generator]) -> None:
    """The data generators' and torch's random states as they were at the checkpoint."""
    saved = state["data_rng"]
    if sorted(saved) != sorted(str(r) for r in gens):
        raise RunError(f"Expected a checkpoint of replicas {sorted(gens)}, but it holds replicas {sorted(saved)}")
    for r, g in gens.items():
        g.set_state(saved[str(r)])
    torch.set_rng_state(state["torch_rng"])
    if state["cuda_rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])


def truncate_jsonl(path: Path, step: int) -> None:
    """Keep the records of ``path`` up to optimizer step ``step`` (those written after the checkpoint go)."""
    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in keep))
