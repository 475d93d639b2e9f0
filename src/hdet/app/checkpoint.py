"""``hdet train``'s checkpoints, and ``--resume`` from them.

Every ``--checkpoint-every`` steps the run writes what it needs to go on exactly where it was: in the engine one
``checkpoint.pt`` (every replica's model, optimizer and scheduler: :meth:`hdet.engine.ReplicaEngine.state_dict`),
under torchrun one ``checkpoint-rank<r>.pt`` per rank (its replica's), each with the data generators' and torch's
random states and the training loop's own counters and curves. A file is written to a temporary name and renamed,
so a run killed while saving keeps the previous checkpoint whole. Under torchrun each rank also keeps its previous
checkpoint (``checkpoint-rank<r>.prev.pt``): ranks killed while saving may hold different newest steps, and the run
resumes from the newest step that every rank holds. ``--resume`` loads it (plain data:
``torch.load(weights_only=True)``), cuts ``metrics.jsonl`` and ``syncs.jsonl`` back to the checkpoint's step and
goes on: on the CPU the resumed run's records, weights and losses are the uninterrupted run's, bit for bit
(``tests/test_cli.py``). Options are compared as the run resolves them (``--eval-every`` left out is ``--T``, a flag
with no effect on this run is no difference).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch

from ..telemetry import records_up_to
from .options import RunConfig, RunError, after_sweep, default_alpha, default_warmup

__all__ = ["VERSION", "path_for", "previous", "save", "load", "available", "check_config", "restore_rng",
           "read_records", "write_records", "adopt", "other_kind",
           "SAME_RUN_EXEMPT"]

VERSION = 2  # 2: the run's resolved mode and device kept (version 1 still loads)
CLI = {f.name: f.metadata["cli"] for f in dataclasses.fields(RunConfig) if "cli" in f.metadata}  # options with a flag
# options that may differ between a run and its resumption: how it is watched, not what it computes
SAME_RUN_EXEMPT = ("resume", "progress", "tensorboard", "label", "checkpoint_every", "out")


def path_for(out: Path, rank: int | None) -> Path:
    """The checkpoint of this process: ``checkpoint.pt`` in the engine, ``checkpoint-rank<r>.pt`` under torchrun."""
    return out / ("checkpoint.pt" if rank is None else f"checkpoint-rank{rank}.pt")


def previous(path: Path) -> Path:
    """Where a torchrun rank keeps its previous checkpoint: ``checkpoint-rank<r>.prev.pt``."""
    return path.with_name(path.stem + ".prev.pt")


ADDED = {"pct_start": 0.3, "lr_sweep": 0.0, "cuda_graph": False, "lr_sweep_points": None, "lr_cut": 0.5,  # options
         "lr_sweep_factor": None, "judge_steps": 1, "lr_cut_after": 0}
# added since checkpoints exist (and --lr-sweep-then, set in _resolved): what runs did before each, OneCycle's warm-up
# 0.3, no sweep, no CUDA graph, a sweep grid of one LR a replica, the recovery's LR cut 0.5 (its cuts after the
# resume the rule of now, 0.5 ** k: hdet.ensemble_state warns where one was made before), the sweep's factor by default (sqrt(N) then,
# sqrt(max(N, 8)) now: a sweep stopped under the old one goes on with its plan's factor, runs.py), every window judged
# alone by the stability guard (judge_steps 1; 25 now, which changes nothing at T >= 25), every event cutting the LR
# (lr_cut_after 0)


def _config(cfg: RunConfig) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in SAME_RUN_EXEMPT}


def _differing(saved: dict[str, Any], now: dict[str, Any], raw: dict[str, Any],
               given: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The options whose resolved values differ (``saved`` against ``now``), and of them those given differently
    (``raw``, the saved config as given, against ``given``): the others follow from those."""
    differ = [k for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
    return differ, [k for k in differ if raw.get(k) != given.get(k)]


def _steps_follow(named: list[str], raw: dict[str, Any], asked: RunConfig) -> int:
    """Drops ``"steps"`` from ``named`` where the saved run's steps (``raw``'s) follow from its sweep options given
    otherwise, not from ``--steps`` (``asked``: the options as given); returns these ``--steps`` under the saved sweep
    options."""
    as_saved = after_sweep(dataclasses.replace(
        asked, lr_sweep=raw.get("lr_sweep", 0.0), lr_sweep_then=raw.get("lr_sweep_then", "continue"))).steps
    if "steps" in named and raw.get("steps") == as_saved:
        named.remove("steps")
    return as_saved


def _resolved(c: dict[str, Any], mode: str, device: str) -> dict[str, Any]:
    """The options of config dict ``c`` as the run resolves them (``mode``, ``device``: what it ran as): defaults
    that depend on other options filled in, flags that have no effect on this run left out; replicas go apart (the
    world size under torchrun)."""
    c = {k: v for k, v in c.items() if k not in SAME_RUN_EXEMPT and k != "replicas"}
    c["mode"], c["device"] = mode, device
    c["eval_every"] = c.get("eval_every") or c.get("T")
    c["log_every"] = c.get("log_every") or min(10, max(1, c.get("steps", 0) // 100))
    auto, fit = c.get("auto_lr"), c.get("controller") == "fit"
    if c.get("lr_sweep"):  # (one from before --lr-sweep-then: it went on from the sweep's best run)
        c.setdefault("lr_sweep_then", "continue")
    for k, v in ADDED.items():  # an option added since checkpoints exist: what runs did before it
        c.setdefault(k, v)
    if c.get("warmup") is None and (auto or c.get("range_test")):
        c["warmup"] = default_warmup(c["steps"], c["T"], fit or c.get("range_test"), c["pct_start"])
    dead = {"warmup": not (auto or c.get("range_test")), "tie_lr_groups": not auto, "controller": not auto,
            "probe_batches": not (auto and fit), "eq8": not (auto and not fit), "range_backoff": not c.get("range_test"),
            "prodigy_safeguard": c.get("optimizer") != "prodigy", "lr_sweep_then": not c.get("lr_sweep"),
            "lr_sweep_points": not c.get("lr_sweep"), "lr_sweep_factor": not c.get("lr_sweep"),
            "on_runaway": c.get("optimizer") == "schedulefree-adamw",  # (its runs have no stability guard)
            "lr_cut": (c.get("on_runaway") != "recover" and not c.get("range_test"))
            or c.get("optimizer") == "schedulefree-adamw",  # (the range test turns the guard on)
            "judge_steps": (c.get("on_runaway") != "recover" and not c.get("range_test"))
            or c.get("optimizer") == "schedulefree-adamw",
            "lr_cut_after": (c.get("on_runaway") != "recover" and not c.get("range_test"))
            or c.get("optimizer") == "schedulefree-adamw",
            "pct_start": c.get("optimizer") == "schedulefree-adamw", "data": c.get("task") != "fashion",
            "nu": not c.get("warm_init"), "clip": "grad-clip" not in (c.get("explore") or ()),
            "compile": mode != "engine-vmap", "cuda_graph": mode not in ("engine-merged", "engine-vmap"), "ctx": c.get("task") == "fashion", "layers": c.get("task") == "fashion"}
    if c.get("T"):  # the steps judged together, a whole number of windows (1 and 25 at --T 25: both every window)
        c["judge_steps"] = c["T"] * -(-c["judge_steps"] // c["T"])
    if auto and c.get("tie_lr_groups") is None:
        c["tie_lr_groups"] = fit
    if c.get("alpha") is None:  # (--alpha left out: its default follows --lr-sweep)
        c["alpha"] = default_alpha(c.get("lr_sweep") or 0.0)
    if c["alpha"] > 0:  # the groups' LRs are explored whenever there is a spread
        c["explore"] = tuple(sorted(set(c.get("explore") or ()) | {"lr-groups"}))
    elif c.get("explore") is not None:
        c["explore"] = tuple(sorted(c["explore"]))
    return {k: v for k, v in c.items() if not dead.get(k, False)}


def save(path: Path, cfg: RunConfig, replicas: int, mode: str, device: str, step: int, run_state: dict[str, Any],
         gens: dict[int, torch.Generator], loop: dict[str, Any], keep_previous: bool = False) -> None:
    """Write the checkpoint after optimizer step ``step`` (to a temporary file, then renamed over the old one;
    ``keep_previous``: the old one renamed to :func:`previous` first)."""
    state = {"version": VERSION, "step": step, "config": _config(cfg), "replicas": replicas, "mode": mode,
             "device": device, "run": run_state,
             "data_rng": {str(r): g.get_state() for r, g in gens.items()},
             "torch_rng": torch.get_rng_state(),
             "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
             "loop": loop}
    _write(path, state, keep_previous)


def _write(path: Path, state: dict[str, Any], keep_previous: bool) -> None:
    """``torch.save`` to a temporary file, then renamed over ``path`` (``keep_previous``: the old one renamed to
    :func:`previous` first)."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    if keep_previous and path.is_file():  # killed between these two renames: the previous one is there, whole
        os.replace(path, previous(path))
    os.replace(tmp, path)


def sweep_path(out: Path, rank: int | None) -> Path:
    """The LR sweep's progress of this process (``--lr-sweep``, written after each of its rounds while it runs):
    ``sweep.pt`` in the engine, ``sweep-rank<r>.pt`` under torchrun."""
    return out / ("sweep.pt" if rank is None else f"sweep-rank{rank}.pt")


def save_sweep(path: Path, cfg: RunConfig, replicas: int, progress: dict[str, Any], device: str,
               keep_previous: bool) -> None:
    """Write the sweep's progress after a round (:func:`hdet.lr_sweep`'s ``on_round``), as :func:`save` writes."""
    _write(path, {"version": VERSION, "kind": "lr_sweep", "config": _config(cfg), "replicas": replicas,
                  "device": device, "progress": progress}, keep_previous)


def sweep_progress(path: Path, cfg: RunConfig, replicas: int, device: str,
                   asked: RunConfig | None = None) -> dict[int, dict[str, Any]]:
    """This process's readable sweep progress (newest and previous): rounds -> progress; a file of other options (as
    the run resolves them: ``--device cpu`` is ``auto`` on a CPU) is an error that names them (``asked``: the options
    as given, as :func:`check_config`'s)."""
    found: dict[int, dict[str, Any]] = {}
    for p in (path, previous(path)):
        try:
            state = torch.load(p, map_location="cpu", weights_only=True)
        except Exception:  # noqa: BLE001 - missing or unreadable: not there
            continue
        if not isinstance(state, dict) or state.get("kind") != "lr_sweep" or not isinstance(state.get("progress"), dict):
            continue
        # (the engine's mode plays no part in the sweep: one placeholder for both)
        now = _resolved(_config(cfg), "sweep", device)
        saved = _resolved(state.get("config") or {}, "sweep", str(state.get("device")))
        if saved != now or state.get("replicas") != replicas:
            differ, named = _differing(saved, now, state.get("config") or {}, _config(cfg))
            _steps_follow(named, state.get("config") or {}, asked or cfg)
            diff = [f"--{k.replace('_', '-')} {saved.get(k)!r} -> {now.get(k)!r}" for k in (named or differ)]
            if state.get("replicas") != replicas:
                diff.append(f"replicas (the world size under torchrun) {state.get('replicas')} -> {replicas}")
            raise RunError(f"Expected the options of the stopped LR sweep ({p.name}) to resume it, but these differ: "
                           + "; ".join(diff))
        rounds = state["progress"].get("rounds")
        if isinstance(rounds, int):
            found.setdefault(rounds, state["progress"])
    return found


def clear_sweep(path: Path) -> None:
    """Remove this process's sweep progress (the sweep is over, or a new one starts)."""
    for p in (path, previous(path), path.with_name(path.name + ".tmp")):
        p.unlink(missing_ok=True)


def available(path: Path) -> dict[int, tuple[Path, dict[str, Any]]]:
    """This rank's readable checkpoints, newest and previous: step -> (file, state) (an unreadable one is skipped: a
    torchrun rank resumes from a step that every rank holds)."""
    found: dict[int, tuple[Path, dict[str, Any]]] = {}
    for p in (path, previous(path)):
        try:
            state = load(p)
        except RunError:
            continue
        found.setdefault(int(state["step"]), (p, state))
    return found


def adopt(path: Path, chosen: Path) -> None:
    """After a resume from ``chosen``: it is this rank's newest checkpoint again (a newer one that not every rank
    held goes), so that the next save keeps it as the previous one."""
    if chosen != path:
        os.replace(chosen, path)


def other_kind(out: Path, distributed: bool) -> str:
    """What to add to "no checkpoint here" when ``out`` holds the other kind of run's checkpoints."""
    if distributed and (out / "checkpoint.pt").is_file():
        return ": the folder holds a one-process run's checkpoint.pt (resume it without torchrun)"
    if not distributed and any(out.glob("checkpoint-rank*.pt")):
        return ": the folder holds a torchrun run's checkpoint-rank<r>.pt files (resume it under torchrun)"
    return ""


def load(path: Path, hint: str = "") -> dict[str, Any]:
    """Read a checkpoint written by :func:`save`; a missing or unreadable one is a one-line error (``hint``: said
    after it, where the file is missing)."""
    if not path.is_file():
        raise RunError(f"Expected a checkpoint to resume from at {path} (written every --checkpoint-every steps), but "
                       f"there is none{hint}")
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


def check_config(state: dict[str, Any], cfg: RunConfig, replicas: int, mode: str, device: str,
                 asked: RunConfig | None = None) -> None:
    """That the resumed run is the checkpointed one: every option that changes what is computed is the same as the
    run resolves it (``mode``: the engine's mode or ``ddp-<backend>``; ``device``: cpu or cuda), and the number of
    replicas (under torchrun the world size, which no option names). ``asked``: the options as given, where ``cfg``
    is the run after an LR sweep (``--lr-sweep-then continue`` trains the steps left)."""
    raw = state["config"]
    saved_mode, saved_device = state.get("mode"), state.get("device")
    if saved_mode is None:  # version 1 kept the flags as given, not what they resolved to: equal as given, or named
        v = raw.get("mode", "auto")
        saved_mode = mode if v == cfg.mode or not mode.startswith("engine-") else "engine-" + v
        v = raw.get("device", "auto")
        saved_device = device if v == cfg.device else (torch.device(v).type if v != "auto" else "auto")
    if mode.endswith("-auto"):  # the engine resolves auto at its first step: as the checkpointed run's auto did, and
        # as vmap for a run that ran vmap when asked for it (auto tries vmap first; an explicit loop stays another run)
        mode = saved_mode if raw.get("mode", "auto") == "auto" or saved_mode == "engine-vmap" else mode
    if mode.endswith("-merged") and raw.get("mode") == "merged":  # merged runs vmapped where it cannot merge (decided
        mode = saved_mode  # when the engine is built or at its first step): as the checkpointed run resolved it
    saved = _resolved(raw, saved_mode, saved_device)
    now = _resolved(_config(cfg), mode, device)
    differ, named = _differing(saved, now, raw, _config(cfg))
    asked = asked or cfg
    as_saved = _steps_follow(named, raw, asked)

    def flag(k: str) -> str:
        cli = CLI.get(k)
        if cli is None:
            return k
        name = cli["flag"] or f"--{k.replace('_', '-')}"
        if cli["kw"].get("invert"):  # (--grad-sync is local's opposite: said as the flag, its values turned over)
            return f"{name} {not saved.get(k)!r} -> {not now.get(k)!r}"
        return f"{name} {_said(k, saved.get(k))} -> {_said(k, now.get(k))}"
    after = as_saved != asked.steps or cfg.steps != asked.steps  # either run's steps are those after its sweep
    diff = [flag(k) + (" (the steps after the sweep)" if k == "steps" and after else "") for k in (named or differ)]
    if state.get("replicas", replicas) != replicas:
        diff.append(f"replicas (the world size under torchrun) {state['replicas']} -> {replicas}")
    if diff:
        raise RunError(f"Expected the options of the checkpointed run to resume it, but these differ: {'; '.join(diff)}")


def _said(k: str, v: Any) -> str:
    """An option's value as a user gives it (an audit: the resolved mode 'engine-vmap', a default as None)."""
    if v is None:
        return "(its default)"
    if k == "mode" and isinstance(v, str):
        return repr(v.removeprefix("engine-")) if v.startswith("engine-") else \
            f"torchrun ({v.removeprefix('ddp-')})" if v.startswith("ddp-") else repr(v)
    return repr(v)


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


def read_records(path: Path, step: int) -> list[str] | None:
    """The records of ``path`` up to optimizer step ``step`` (those written after the checkpoint go), or None if
    there is no such file. A last line cut short (the run killed while writing it, after its checkpoint) goes too;
    any other line that is not a record is an error, raised before anything is written."""
    try:
        return records_up_to(path, step)
    except ValueError as e:
        raise RunError(f"{e}: the folder was changed since the run wrote it") from None


def write_records(path: Path, keep: list[str] | None) -> None:
    """Write back what :func:`read_records` kept."""
    if keep is not None:
        path.write_text("".join(line + "\n" for line in keep))
