"""One training run of a task with HDET: in the one-process engine, or one replica per process under
torchrun (DDP). Writes a run folder: ``config.json``, ``metrics.jsonl`` (training loss and LRs every
``log_every`` steps: the loss the mean over replicas and over the steps since the previous record, the LRs
those of the record's own step;
validation loss at evaluations), ``syncs.jsonl`` (one record per sync: step,
per-replica window losses, multipliers and values, controller weights w, Delta, velocity, base),
``summary.json``, ``model.pt`` (the averaged model), ``schedule.json`` (every step's base values, for
:class:`hdet.ReplayLR`) and optionally TensorBoard events under ``tb/``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import __version__
from ..ensemble import NonFiniteReplicaError
from ..telemetry import SyncLogger, strict_json
from ..window import eval_mode
from . import checkpoint, stop
from .options import (RunConfig, RunError, after_sweep, check, default_warmup, resolve, resolve_device,
                      sweep_steps)
from .runs import DDPRun, EngineRun, eval_weights, lr_sweep, to_device
from .tasks import Task, make_task

__all__ = ["RunConfig", "RunError", "train", "resolve_device"]


OUTPUTS = ("config.json", "metrics.jsonl", "syncs.jsonl", "summary.json", "schedule.json", "model.pt", "loss.png",
           "lr.png", "hparams.png", "tb", "compare.json")  # what a run writes: an earlier run's copies go first
FINAL = ("summary.json", "schedule.json", "model.pt", "loss.png", "lr.png", "hparams.png")  # written at the end
# (compare.json: `hdet compare`'s table, which `hdet plot` would show instead of this run)


def checkpoint_every(cfg: RunConfig) -> int:
    """Steps between checkpoints (``--checkpoint-every``; by default a tenth of the run; 0: none)."""
    return cfg.checkpoint_every if cfg.checkpoint_every is not None else max(1, cfg.steps // 10)


def _sweep_saver(path: Path, cfg: RunConfig, N: int, device: torch.device, distributed: bool) -> Any:
    """The sweep's ``on_round``: each round's progress written (a run killed inside the sweep goes on from it). A
    write that fails (a full disk) is said once and the sweep goes on without saving more on this rank: an error
    here on one rank alone would leave the others waiting in the next round (a resume takes the newest round every
    rank holds)."""
    failed: list[BaseException] = []

    def save(progress: dict[str, Any]) -> None:
        if failed:
            return
        try:
            checkpoint.save_sweep(path, cfg, N, progress, device.type, keep_previous=distributed)
        except Exception as e:  # noqa: BLE001 - any failed write: said, and the sweep goes on
            failed.append(e)
            print(f"warning: the LR sweep's progress could not be written to {path} ({type(e).__name__}: {e}); it "
                  "goes on without saving it", file=sys.stderr, flush=True)
    return save


def _sweep_resumed(path: Path, cfg: RunConfig, N: int, distributed: bool, rank: int,
                   device: torch.device, asked: RunConfig | None = None) -> dict[str, Any] | None:
    """The progress a stopped sweep goes on from: this process's newest (under torchrun, of the newest round every
    rank holds: COLLECTIVE, one all_gather_object), or None (the sweep starts again, said)."""
    found = checkpoint.sweep_progress(path, cfg, N, device.type, asked)
    rounds = set(found)
    if distributed:
        held: list[Any] = [None] * N
        dist.all_gather_object(held, sorted(rounds))
        rounds = set.intersection(*(set(h) for h in held))
    if not rounds:
        if rank == 0:
            print(f"lr sweep: {'no round that every rank holds' if distributed else 'no progress of it'}: it starts "
                  "again", flush=True)
        return None
    return found[max(rounds)]


def tail_mean(train_losses: list[tuple[int, float]], after: float) -> float | None:
    """The mean training loss of the records after step ``after`` (else of the last record): each record is the mean
    over the steps since the record before it, and is weighted by their number. None if one of them is not finite (a
    record is non-finite only when every replica's loss was: the run ended there)."""
    prev, rows = 0, []
    for s, v in train_losses:
        rows.append((s, s - prev, v))
        prev = s
    tail = [(n, v) for s, n, v in rows if s > after] or [(n, v) for _, n, v in rows[-1:]]
    if not tail or any(v is None or not math.isfinite(v) for _, v in tail):
        return None
    n = sum(n for n, _ in tail)
    return sum(n * v for n, v in tail) / n


def _stopped(out: Path) -> str | None:
    """What a stopped (killed, not finished) run left in ``out``: its newest checkpoint or sweep progress, or None (no
    run there, or a finished one, which a new run replaces: ``runs/latest``)."""
    if (out / "summary.json").is_file():
        return None
    left = sorted(p.name for p in [*out.glob("checkpoint*.pt"), *out.glob("sweep*.pt")])
    return f"it left {', '.join(left[:3])}" if left else None


def check_out(out: Path, rank: int = 0) -> None:
    """That ``out`` is a folder this process can write to (made if missing); nothing in it is touched. Every torchrun
    rank checks (each its own probe file), so that a bad ``--out`` is an error on every rank, not rank 0's alone while
    the others wait for it in the process group's first collective."""
    if out.exists() and not out.is_dir():
        raise RunError(f"Expected --out to be a folder, but {out} is a file")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / (".write-test" if rank == 0 else f".write-test-{rank}")
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise RunError(f"Expected a writable output folder at {out}, but got: {e.strerror or e}") from None


def clear_earlier(out: Path) -> None:
    """Remove an earlier run's (or comparison's) outputs from ``out`` (runs/latest), once this run has been built:
    a command that is refused leaves the folder as it was."""
    earlier = ((out / "config.json").is_file() and (out / "metrics.jsonl").is_file()) or (out / "compare.json").is_file()
    try:
        for old in ([out / name for name in OUTPUTS] + sorted(out.glob("checkpoint*.pt*")) if earlier else ()):
            if old.is_dir():
                shutil.rmtree(old)
            elif old.exists():
                old.unlink()
    except OSError as e:
        raise RunError(f"Expected a writable output folder at {out}, but got: {e.strerror or e}") from None


@torch.no_grad()
def evaluate(task: Task, model: nn.Module, n_batches: int, batch: int, device: torch.device) -> float:
    """Mean validation loss over a fixed set of held-out batches (the same for every run)."""
    g = torch.Generator().manual_seed(12345)
    with eval_mode(model):
        total = sum(task.loss_fn(model, to_device(task.sample("val", batch, g), device)).item()  # host sync
                    for _ in range(n_batches))
    return total / n_batches


@torch.no_grad()
def final_metrics(task: Task, model: nn.Module, device: torch.device, limit: int = 2048) -> dict[str, float]:
    """The held-out split, deterministically: Fashion-MNIST's whole test set (loss and accuracy); for the
    byte GPT, loss over up to ``limit`` consecutive non-overlapping windows from the start of the
    held-out files."""
    with eval_mode(model):
        split = task.splits.get("val") if task.splits else None
        if split is None:
            return {}
        if task.name == "fashion":
            x, y = split
            loss = correct = 0.0
            for i in range(0, x.shape[0], 1000):
                logits = model(x[i:i + 1000].to(device))
                yy = y[i:i + 1000].to(device)
                loss += torch.nn.functional.cross_entropy(logits, yy, reduction="sum").item()  # host sync
                correct += (logits.argmax(-1) == yy).sum().item()  # host sync
            return {"test_loss": loss / x.shape[0], "test_accuracy": 100.0 * correct / x.shape[0]}
        ctx = task.ctx
        n = min(limit, (split.numel() - 1) // ctx)
        windows = split.unfold(0, ctx + 1, ctx)[:n].long()  # window i: bytes i*ctx .. i*ctx + ctx
        total = sum(task.loss_fn(model, windows[i:i + 64].to(device)).item() * windows[i:i + 64].shape[0]
                    for i in range(0, n, 64))  # host sync per chunk
        return {"val_loss_full": total / n, "val_tokens": n * ctx}


class _Progress:
    """A rich progress bar with loss, base LR and the multipliers' spread (or nothing)."""

    def __init__(self, enabled: bool, total: int, label: str) -> None:
        self.p = None
        try:
            found = importlib.util.find_spec("rich.progress") is not None  # the progress bar is optional
        except (ImportError, ValueError):
            found = False
        enabled = enabled and found
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.p = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                              TextColumn("{task.fields[info]}"), TimeRemainingColumn(), transient=False)
            self.p.start()
            self.task = self.p.add_task(label, total=total, info="")

    def update(self, step: int, info: str | None = None) -> None:
        if self.p is not None:
            self.p.update(self.task, completed=step, **({"info": info} if info is not None else {}))

    def close(self) -> None:
        if self.p is not None:
            self.p.stop()


def _step_size_estimate(optimizer: torch.optim.Optimizer) -> float | None:
    """D-Adaptation's/Prodigy's estimate d (their step: d * lr), Mechanic's scale s (s * lr), else None."""
    g0 = optimizer.param_groups[0]
    if "d" in g0:
        return float(g0["d"])
    if "_mechanic" in optimizer.state:
        return float(optimizer.state["_mechanic"]["s"].sum())
    return None


def _lock_out(out: Path, held: contextlib.ExitStack) -> str | None:
    """Rank 0's hold on ``out`` for the whole run: an exclusive ``flock`` on ``out/.hdet.lock`` (the kernel lets go at
    any end, a SIGKILL's too). Two runs started at once into one folder both said they had finished while it held one
    of them, and the other wrote into files the later one's start had deleted (an audit). Returns why not ("another
    hdet run, pid N, ..."), None once held (or where there is no flock: not POSIX, or a folder not made yet)."""
    try:
        import fcntl
    except ImportError:  # (not POSIX: no hold)
        return None
    made = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        f = open(out / ".hdet.lock", "a+", errors="replace")  # (any bytes there: read, never raised)
    except OSError:  # (check_out says what is wrong with the folder)
        return None
    if made:  # a run refused after the hold (an --init-from it cannot read, say) left an empty folder with the lock
        held.callback(_unmake, out)  # (a review): the folder goes with it again (after the lock's release: below)
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # (EAGAIN / EWOULDBLOCK: another process holds it)
        f.seek(0)
        pid = f.read(32).strip()
        f.close()
        return f"another hdet run{f' (pid {pid})' if pid.isdigit() else ''} is writing to it"
    except OSError as e:  # a file system without flock (Lustre without -o flock: ENOSYS; NFS with nolock: ENOLCK)
        f.close()  # was read as "another run" for ever (a review): no hold there, said
        print(f"hdet: warning: {out} cannot be locked ({e.strerror or e}): nothing stops another run from writing "
              "to it at the same time", file=sys.stderr, flush=True)
        return None
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    held.callback(f.close)  # (closing the file lets go of the lock)
    return None


def _unmake(out: Path) -> None:
    """Remove ``out``, made by :func:`_lock_out`, where the run wrote nothing into it but the lock."""
    try:
        if [p.name for p in out.iterdir()] == [".hdet.lock"]:
            (out / ".hdet.lock").unlink()
            out.rmdir()
    except OSError:  # (another process's file there meanwhile: left as it is)
        pass


def train(cfg: RunConfig, argv: list[str] | None = None, dry_run: bool = False,
          held: contextlib.ExitStack | None = None) -> dict[str, Any]:
    """Run ``cfg``; returns the summary (also written to ``<out>/summary.json`` on rank 0). ``dry_run``: check
    the options and build the run (task, model, optimizers, schedulers; ``--init-from`` is not read), then return
    ``{}`` without writing anything (``hdet compare`` checks every row so before it trains any). Rank 0 holds the
    folder (:func:`_lock_out`) until ``train`` returns, or until ``held`` closes where one is given (``hdet train``
    holds it while it writes the plots)."""
    with contextlib.ExitStack() as own:
        return _train(cfg, argv, dry_run, own if held is None else held)


def _train(cfg: RunConfig, argv: list[str] | None, dry_run: bool, held: contextlib.ExitStack) -> dict[str, Any]:
    check(cfg)
    cfg = resolve(cfg)
    swept_steps, asked = sweep_steps(cfg), cfg
    cfg = after_sweep(cfg)  # --lr-sweep: the run after the sweep is the run these options describe (max_lr: below)
    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    owns_group = False
    device = resolve_device(cfg.device)
    if distributed and not dist.is_initialized():
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        owns_group = True
    if cfg.cuda_graph and device.type != "cuda" and not distributed:
        raise RunError(f"Expected --cuda-graph on a CUDA device, but the run is on {device.type}")
    rank = dist.get_rank() if distributed else 0
    N = dist.get_world_size() if distributed else (cfg.replicas or 4)
    if distributed and cfg.replicas not in (None, N):
        raise RunError(f"Expected --replicas to match the torchrun world size ({N}), but got {cfg.replicas}")
    warmup = cfg.warmup if cfg.warmup is not None else default_warmup(cfg.steps, cfg.T, cfg.controller == "fit" or
                                                                         cfg.range_test, cfg.pct_start)
    if cfg.auto_lr and not 0 <= warmup < cfg.steps:
        raise RunError(f"Expected --warmup in [0, --steps) with --auto-lr, but got {warmup} (steps {cfg.steps})")
    if cfg.auto_lr and max(cfg.T, -(-warmup // cfg.T) * cfg.T) > cfg.steps:
        raise RunError(f"Expected a sync step (a multiple of --T {cfg.T}) from the controller's start (step {warmup}) "
                       f"to --steps {cfg.steps} with --auto-lr, but there is none: the controller would never run. "
                       "Lower --T or --warmup, or raise --steps")
    if cfg.range_test and not 2 * cfg.T <= warmup < cfg.steps:
        raise RunError(f"Expected --warmup (the range test's length) in [2 T, --steps) = [{2 * cfg.T}, {cfg.steps}) "
                       f"with --range-test, but got {warmup}")
    out = Path(cfg.out)
    sweep_file = checkpoint.sweep_path(out, rank if distributed else None)
    # killed inside its LR sweep (no config.json yet): the sweep goes on from its last round, then the run starts
    sweep_resume = bool(cfg.resume and swept_steps and not dry_run and not (out / "config.json").is_file()
                        and any(out.glob("sweep-rank*.pt" if distributed else "sweep*.pt")))  # (every rank alike)
    if sweep_resume:
        cfg = dataclasses.replace(cfg, resume=False)
    if cfg.resume and not dry_run and not (out / "config.json").is_file():
        raise RunError(f"Expected a run folder to resume at {out} (--out), but there is no run there")
    looks = not (cfg.resume or sweep_resume or dry_run) and rank == 0  # (the others take rank 0's look)
    busy = _lock_out(out, held) if rank == 0 and not dry_run else None
    stopped = _stopped(out) if looks and busy is None else None
    if distributed and not dry_run:  # COLLECTIVE (once): rank 0's look, before it removes anything, on every rank
        said = [stopped, busy]  # (a slower rank looking while rank 0 cleared the folder raised alone, and rank 0 hung)
        dist.broadcast_object_list(said, src=0)
        stopped, busy = said
    if busy:
        raise RunError(f"Expected --out to be a folder no other run writes to, but {busy} ({out}): wait for it to end, "
                       "or pass another --out")
    if stopped:  # (a forgotten --resume wiped a stopped run's checkpoint, silently: an audit)
        raise RunError(f"Expected --resume to go on with the run stopped in {out} ({stopped}), or another --out: a new "
                       "run there would delete it. To start afresh there, delete the folder first")
    if not dry_run:
        check_out(out, rank)
    task = make_task(cfg.task, data=cfg.data, ctx=cfg.ctx, width=cfg.width, layers=cfg.layers,
                     dropout=cfg.dropout, data_bytes=cfg.data_bytes)

    torch.manual_seed(cfg.seed)
    model = task.make_model()
    if cfg.init_from is not None and not dry_run and not cfg.resume:  # (resumed: the checkpoint holds the weights)
        try:
            state = torch.load(cfg.init_from, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unreadable file: one line, what it is
            raise RunError(f"Expected --init-from to be a model.pt written by hdet train (torch.save of a state "
                           f"dict), but {cfg.init_from} could not be read as one ({type(e).__name__})") from None
        if not isinstance(state, dict):
            raise RunError(f"Expected --init-from to hold a state dict, but it holds a {type(state).__name__}")
        try:
            model.load_state_dict(state)
        except RuntimeError as e:
            detail = " ".join(line.strip() for line in str(e).splitlines()[1:])[:600]
            raise RunError(f"Expected --init-from to hold this task's model weights (same --task, --width, "
                           f"--layers, --ctx), but they differ: {detail}") from None
    model.to(device)
    swept, sweep_resumed = None, None
    if swept_steps and not dry_run:  # COLLECTIVES under torchrun (hdet.lr_sweep: every rank one of its runs)
        if cfg.resume:  # the sweep ran before the checkpoints: its peak LR is in the run's config.json
            swept = json.loads((out / "config.json").read_text()).get("lr_sweep")
            if not isinstance(swept, dict) or not isinstance(swept.get("max_lr"), float):
                raise RunError(f"Expected the run at {out} to have swept its LR (--lr-sweep), but its config.json "
                               "records no sweep")
            if swept.get("guess") != cfg.max_lr:  # (check_config below sees the swept peak, not the guess)
                raise RunError(f"Expected the options of the checkpointed run to resume it, but these differ: "
                               f"--max-lr {swept.get('guess')!r} -> {cfg.max_lr!r}")
        else:
            if distributed and N < 2:
                raise RunError("Expected 2 or more ranks with --lr-sweep under torchrun (each rank runs one of its "
                               "LRs a round), but the world size is 1")
            resume_from = _sweep_resumed(sweep_file, cfg, N, distributed, rank, device, asked) if sweep_resume else None
            if rank == 0:  # an earlier run's outputs go before the sweep: a run killed inside it leaves no stale
                clear_earlier(out)  # checkpoint that --resume would take for this run's
            if resume_from is None:
                checkpoint.clear_sweep(sweep_file)  # (an earlier sweep's progress: not this one's)
            else:
                sweep_resumed = resume_from["rounds"]
                if rank == 0:
                    print(f"lr sweep: going on after its round {sweep_resumed} ({sweep_file.name})", flush=True)
            on_round = _sweep_saver(sweep_file, cfg, N, device, distributed) if checkpoint_every(cfg) else None
            try:
                swept = lr_sweep(task, model, cfg, N, swept_steps, device, progress=rank == 0,
                                 distributed=distributed, resume_from=resume_from, on_round=on_round)
            except RunError:  # the sweep found no LR: nothing to go on from (its progress left the folder refused
                checkpoint.clear_sweep(sweep_file)  # as a stopped run's, and --resume refused another --max-lr)
                raise
        cfg = dataclasses.replace(cfg, max_lr=swept["max_lr"])
    reps = (DDPRun(task, model, cfg, warmup, device) if distributed
            else EngineRun(task, model, N, cfg, warmup, device))
    if dry_run:
        if owns_group:
            dist.destroy_process_group()
        return {}
    gens = {r: torch.Generator().manual_seed(cfg.seed * 1000 + r) for r in reps.local}  # each replica its data
    sched0 = reps.schedulers[0].record_schedule()  # the discovered schedule, for hdet.ReplayLR
    ckpt_path = checkpoint.path_for(out, rank if distributed else None)
    device_type = device.type
    start, loop = 0, {}
    if cfg.resume:
        if distributed:  # COLLECTIVE: every rank resumes from the newest step that all of them hold (each its own files)
            found = checkpoint.available(ckpt_path)
            mine = (sorted(found), sorted({st.get("replicas", N) for _, st in found.values()}))
            held: list[Any] = [None] * N
            dist.all_gather_object(held, mine)
            worlds = sorted({w for _, ws in held for w in ws})
            common = set.intersection(*(set(h) for h, _ in held))
            if worlds and worlds != [N]:
                raise RunError(f"Expected the options of the checkpointed run to resume it, but these differ: replicas "
                               f"(the world size under torchrun) {', '.join(map(str, worlds))} -> {N}")
            if not common:
                raise RunError(f"Expected a checkpoint of one step on every rank to resume from ({ckpt_path.name} or "
                               f"{checkpoint.previous(ckpt_path).name}), but the ranks hold steps "
                               f"{'; '.join(f'rank {r}: {h or None}' for r, (h, _) in enumerate(held))}"
                               + checkpoint.other_kind(out, distributed))
            chosen, saved = found[max(common)]
        else:
            chosen, saved = ckpt_path, checkpoint.load(ckpt_path, hint=checkpoint.other_kind(out, distributed))
        checkpoint.check_config(saved, cfg, N, reps.mode, device_type, asked)
        start, loop = int(saved["step"]), saved["loop"]
        reps.load_state_dict(saved["run"])
        checkpoint.restore_rng(saved, gens)
        checkpoint.adopt(ckpt_path, chosen)
        for s, calls in zip(reps.schedulers, loop.get("probe_calls", [])):  # the fit controller's probe batches
            if s.ensemble.probe is not None:
                s.ensemble.probe.calls = calls
    every = checkpoint_every(cfg)
    groups = [g.get("name", str(j)) for j, g in enumerate(sched0.optimizer.param_groups)]
    eval_every = cfg.eval_every or cfg.T
    log_every = cfg.log_every or min(10, max(1, cfg.steps // 100))

    writer = metrics_f = syncs_f = None
    if rank == 0:
        local = os.environ.get("LOCAL_WORLD_SIZE", str(N))  # (torchrun's other flags are not known here)
        nodes = N // int(local) if local.isdigit() and int(local) > 0 else 1
        launcher = ("torchrun " + (f"--nnodes {nodes} " if nodes > 1 else "") + f"--nproc-per-node {local} -m "
                    if distributed else "")
        meta = {"command": launcher + "hdet " + " ".join(argv if argv is not None else sys.argv[1:]),
                "config": dataclasses.asdict(cfg), **({"lr_sweep": swept} if swept is not None else {}),
                "replicas": N, "groups": groups, "task": task.describe,
                "python": platform.python_version(), "torch": torch.__version__, "hdet": __version__,
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else
                (platform.processor() or platform.machine() or "cpu")}
        if cfg.resume:  # the records up to the checkpoint stay; the run goes on writing after them
            earlier = json.loads((out / "config.json").read_text()) if (out / "config.json").is_file() else {}
            meta["resumed"] = earlier.get("resumed", []) + [{"command": meta["command"], "from_step": start}]
            meta["command"] = earlier.get("command", meta["command"])
            kept = {name: checkpoint.read_records(out / name, start) for name in ("metrics.jsonl", "syncs.jsonl")}
            for name, lines in kept.items():  # (both read before either is written)
                checkpoint.write_records(out / name, lines)
            for name in FINAL:  # an earlier end's (a crash, or the run had finished): this run writes its own
                (out / name).unlink(missing_ok=True)
        else:
            clear_earlier(out)
            if sweep_resumed is not None:  # killed inside its sweep: the command before is not known (no config.json)
                meta["resumed"] = [{"command": meta["command"], "from_step": 0, "after_sweep_round": sweep_resumed}]
        (out / "config.json").write_text(json.dumps(meta, indent=1))
        metrics_f = (out / "metrics.jsonl").open("a" if cfg.resume else "w")
        syncs_f = SyncLogger(sched0, out / "syncs.jsonl", append=cfg.resume,  # (its TensorBoard scalars in a folder
                             tensorboard_dir=out / "tb" / "syncs" if cfg.tensorboard else None)  # of their own: a purge
        # reads across one folder's files)
        if cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise RunError("Expected the tensorboard package for --tensorboard (pip install tensorboard), "
                               "but it is not installed") from None
            writer = SummaryWriter(str(out / "tb"), purge_step=start + 1 if cfg.resume else None)

    def log(f, rec: dict[str, Any]) -> None:
        if rank == 0:
            f.write(json.dumps(strict_json(rec)) + "\n")
            f.flush()

    progress = _Progress(cfg.progress and rank == 0, cfg.steps, cfg.label or f"{cfg.task} x{N}")
    crashed = None
    train_losses = [tuple(x) for x in loop.get("train_losses", [])]
    val_curve = [tuple(x) for x in loop.get("val_curve", [])]
    t0 = time.perf_counter()
    t, last_eval, n_logged = start, loop.get("last_eval", 0), loop.get("n_logged", 0)
    last_save = start
    # since the last record: the finite losses summed, and how many were not finite (on the device: no host sync)
    loss_sum = loop.get("loss_sum", torch.zeros(2)).to(device)
    if loss_sum.dim() == 0:  # a checkpoint from before the count: every loss counted was finite
        loss_sum = torch.stack([loss_sum, torch.zeros_like(loss_sum)])
    before = loop.get("seconds", 0.0)  # training time before the resume

    def save(step: int) -> None:  # HOST SYNC: the states are copied to the CPU and saved
        checkpoint.save(ckpt_path, cfg, N, reps.mode, device_type, step, reps.state_dict(), gens, {
            "train_losses": train_losses, "val_curve": val_curve, "last_eval": last_eval, "n_logged": n_logged,
            "loss_sum": loss_sum.detach().cpu(), "seconds": before + time.perf_counter() - t0,
            "probe_calls": [getattr(s.ensemble.probe, "calls", 0) for s in reps.schedulers]},
            keep_previous=distributed)
    progress.update(start)
    try:
        if swept is not None and not cfg.resume:  # the sweep's work kept: a run killed before its first checkpoint
            if every:  # resumes from here instead of sweeping again
                save(0)
            if distributed:  # COLLECTIVE: every rank's step-0 checkpoint is written before any rank drops its
                dist.barrier()  # sweep progress
            checkpoint.clear_sweep(sweep_file)  # (its rounds' progress: no longer needed)
        for t in range(start + 1, cfg.steps + 1):
            stop.check()  # a SIGTERM whose exception a finalizer swallowed (hdet.app.stop)
            batches = [to_device(task.sample("train", cfg.batch, gens[r]), device) for r in reps.local]
            lrs, bases = sched0.effective_lrs, sched0.base_lrs_now  # this step's (the scheduler steps in reps.step)
            d = _step_size_estimate(reps.optimizers[0])  # the one this step uses (the step updates it)
            try:
                losses = reps.step(batches)
            except NonFiniteReplicaError as e:
                crashed = f"step {t}: {e}"
                break
            if "scheduled_lr" in reps.optimizers[0].param_groups[0]:  # Schedule-Free: its own warm-up, this step's
                lrs = bases = [float(g["scheduled_lr"]) for g in reps.optimizers[0].param_groups]
            sync = sched0.is_sync_step(t)
            losses = losses.detach().float()
            finite = torch.isfinite(losses)
            loss_sum = loss_sum + torch.stack([torch.where(finite, losses, 0.0).sum(), (~finite).sum().float()])
            n_logged += 1
            if t % log_every == 0 or sync or t == cfg.steps:
                # mean over the replicas' finite losses and the steps since the last record (a replica that is not
                # finite is reset at the next sync and the run goes on; every loss non-finite ends it, below)
                loss, nonfinite = reps.mean_loss(loss_sum, n_logged)
                loss_sum, n_logged = torch.zeros(2, device=device), 0
                train_losses.append((t, loss))
                rec = {"step": t, "train_loss": loss,
                       "lr": dict(zip(groups, lrs)),  # replica 0's at this step (rank 0 under torchrun)
                       "lr_mean": dict(zip(groups, bases)),  # mean over replicas (mean rho = 1)
                       "seconds": before + time.perf_counter() - t0}
                if nonfinite:
                    rec["nonfinite_losses"] = nonfinite
                if d is not None:  # D-Adaptation/Prodigy: the step size d * lr; Mechanic: its scale s, the step s * lr
                    rec["d"] = d
                if sync:
                    if t - last_eval >= eval_every or t == cfg.steps:  # after averaging: replicas are equal
                        last_eval = t
                        with eval_weights(task, reps.eval_model(), reps.optimizers, cfg, device):
                            rec["val_loss"] = evaluate(task, reps.eval_model(), cfg.eval_batches, 32, device)
                        val_curve.append((t, rec["val_loss"]))
                log(metrics_f, rec)
                if writer is not None:
                    writer.add_scalar("train/loss", loss, t)
                    for g, v in rec["lr_mean"].items():
                        writer.add_scalar(f"lr_mean/{g}", v, t)
                    if "val_loss" in rec:
                        writer.add_scalar("val/loss", rec["val_loss"], t)
                ms = sched0.ensemble.rho  # all replicas' multipliers (Eq. 1)
                progress.update(t, f"loss {loss:.3f}  base lr {sched0.base_lrs_now[0]:.2e}  "
                                   f"rho {min(ms):.2f}..{max(ms):.2f}" if N > 1 else f"loss {loss:.3f}")
                if not math.isfinite(loss):
                    crashed = f"step {t}: training loss is {loss}"
                    break
            else:
                progress.update(t)
            due = every and ((t - last_save >= every and sync) if distributed and cfg.local else t % every == 0)
            if due and t < cfg.steps:
                last_save = t
                save(t)
    finally:
        progress.close()
    elapsed = time.perf_counter() - t0
    final_val, final = None, {}
    if crashed is None:  # the last step is a sync step and was evaluated in the loop: the same model and batches
        with eval_weights(task, reps.eval_model(), reps.optimizers, cfg, device):
            final_val = val_curve[-1][1] if val_curve and val_curve[-1][0] == t else \
                evaluate(task, reps.eval_model(), cfg.eval_batches, 32, device)
            final = final_metrics(task, reps.eval_model(), device)
    tail = tail_mean(train_losses, cfg.steps * 0.9)
    engine = getattr(reps, "engine", None)
    summary = {**({} if rank else meta), "mode": reps.mode, "steps_done": t,
               **({"resumed_from": start} if cfg.resume else {}),
               **({"optimizer_path": engine.optimizer_path} if engine is not None else {}),
               "crashed": crashed, "train_seconds": before + elapsed,
               "steps_per_second": (t - start) / elapsed if elapsed else None,
               "final_train_loss": tail, "final_val_loss": final_val,
               "final_metrics": final,
               "val_curve": val_curve}
    if rank == 0:
        metrics_f.close()
        syncs_f.close()
        if writer is not None:
            writer.close()
        (out / "schedule.json").write_text(json.dumps(sched0.discovered_schedule()))
        if crashed is None:
            # clone: in vmap mode the weights are views of [N, ...] tensors, which torch.save would store whole (and,
            # with the engine's gradient layout, non-contiguous: saved row-major, as a plain model's)
            with eval_weights(task, reps.eval_model(), reps.optimizers, cfg, device):  # Schedule-Free: its x
                torch.save({k: v.detach().clone(memory_format=torch.contiguous_format)
                            for k, v in reps.eval_model().state_dict().items()}, out / "model.pt")
        (out / "summary.json").write_text(json.dumps(strict_json(summary), indent=1))
    if owns_group:
        dist.barrier()  # every rank is done with its collectives before the group goes
        dist.destroy_process_group()
    return summary
