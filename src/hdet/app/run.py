"""One training run of a task with HDET: in the one-process engine, or one replica per process under
torchrun (DDP). Writes a run folder: ``config.json``, ``metrics.jsonl`` (training loss and LRs every
``log_every`` steps, each the mean over replicas and over the steps since the previous record;
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import __version__
from ..controller import CONTROLLERS
from ..engine import MODES, ReplicaEngine
from ..ensemble import NonFiniteReplicaError
from ..hyper import Dropout, GradClip, Hyperparameter, WeightDecay
from ..warm_init import warm_init_
from ..schedulers import HDETLR, OneCycleAutoLR
from .tasks import Task, make_task, param_groups
from ..telemetry import SyncLogger

__all__ = ["RunConfig", "RunError", "train", "resolve_device"]


class RunError(ValueError):
    """A run cannot start with what was given (the CLI prints it as one line)."""


@dataclass
class RunConfig:
    task: str = "bytes"
    data: str | None = None
    replicas: int | None = None  # None: 4 in one process, the world size under torchrun
    steps: int = 400
    batch: int = 16  # per replica
    ctx: int = 64
    width: int = 128
    layers: int = 2
    dropout: float = 0.0
    max_lr: float = 3e-3
    weight_decay: float = 0.01
    alpha: float = 0.2
    T: int = 25
    auto_lr: bool = False
    warmup: int | None = None  # auto-LR warmup steps; None: 30% of the run (fit), half of it (paper)
    controller: str = "fit"  # auto-LR controller: fit | paper
    probe_batches: int = 4  # fit controller: batches (of --batch examples) in each sync's common probe
    tie_lr_groups: bool | None = None  # one LR multiplier per replica for all groups; None: with the fit controller
    local: bool = False  # local mode: no gradient averaging between converge steps (DDP no_sync)
    eq8: str = "decay"
    warm_init: bool = False
    nu: float = 0.01
    init_from: str | None = None  # a model.pt to start from
    device: str = "auto"
    mode: str = "auto"  # engine: auto | vmap | loop
    seed: int = 0
    out: str = "runs/latest"
    log_every: int | None = None  # steps between records; None: steps // 100, between 1 and 10 (a short run's warm-up shows)
    eval_every: int | None = None  # steps; rounded up to a sync step; None: every sync
    eval_batches: int = 8
    tensorboard: bool = False
    progress: bool = True
    data_bytes: int = 4_000_000
    label: str | None = None
    explore: tuple[str, ...] = ()  # of EXPLORE
    clip: float = 1.0  # base gradient-clipping norm for --explore grad-clip
    optimizer: str = "adamw"  # of OPTIMIZERS; the LR-free ones are peers for the benchmarks (alpha 0 only)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise RunError(f"Expected --device auto, cpu, cuda or cuda:N, but got {name!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RunError(f"Expected a CUDA device for --device {name}, but torch sees none")
    return dev


def _check(cfg: RunConfig) -> None:
    for name in ("steps", "batch", "ctx", "width", "layers", "T", "log_every", "eval_batches", "probe_batches"):
        v = getattr(cfg, name)
        if name == "log_every" and v is None:
            continue
        if not isinstance(v, int) or v < 1:
            raise RunError(f"Expected --{name.replace('_', '-')} to be a positive integer, but got {v!r}")
    if cfg.eval_every is not None and (not isinstance(cfg.eval_every, int) or cfg.eval_every < 1):
        raise RunError(f"Expected --eval-every to be a positive integer, but got {cfg.eval_every!r}")
    if not (cfg.weight_decay >= 0 and math.isfinite(cfg.weight_decay)):
        raise RunError(f"Expected --weight-decay >= 0, but got {cfg.weight_decay}")
    if cfg.ctx > MAX_CTX:
        raise RunError(f"Expected --ctx at most {MAX_CTX} (the embedded tasks' models are small; attention memory "
                       f"grows with ctx squared), but got {cfg.ctx}")
    if cfg.replicas is not None and cfg.replicas < 1:
        raise RunError(f"Expected --replicas to be at least 1, but got {cfg.replicas}")
    if not 0 <= cfg.alpha < 1:
        raise RunError(f"Expected --alpha in [0, 1), but got {cfg.alpha}")
    if not (cfg.max_lr > 0 and math.isfinite(cfg.max_lr)):
        raise RunError(f"Expected --max-lr > 0, but got {cfg.max_lr}")
    if not 0 <= cfg.dropout < 1:
        raise RunError(f"Expected --dropout in [0, 1), but got {cfg.dropout}")
    if cfg.controller not in CONTROLLERS:
        raise RunError(f"Expected --controller {' or '.join(CONTROLLERS)}, but got {cfg.controller!r}")
    if cfg.mode not in MODES:
        raise RunError(f"Expected --mode auto, vmap or loop, but got {cfg.mode!r}")
    bad = [e for e in cfg.explore if e not in EXPLORE]
    if bad:
        raise RunError(f"Expected --explore items from {', '.join(EXPLORE)}, but got {', '.join(bad)}")
    if cfg.optimizer not in OPTIMIZERS:
        raise RunError(f"Expected --optimizer in {', '.join(OPTIMIZERS)}, but got {cfg.optimizer!r}")
    if cfg.init_from is not None and not Path(cfg.init_from).is_file():
        raise RunError(f"Expected --init-from to name a model.pt file, but {cfg.init_from} does not exist")


MAX_CTX = 4096
OUTPUTS = ("config.json", "metrics.jsonl", "syncs.jsonl", "summary.json", "schedule.json", "model.pt", "loss.png",
           "lr.png", "hparams.png", "tb")  # what a run writes: an earlier run's copies go first


def _prepare_out(out: Path, keep: str | None = None) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        earlier_run = (out / "config.json").is_file() and (out / "metrics.jsonl").is_file()
        for name in OUTPUTS if earlier_run else ():  # no stale file from an earlier run here (runs/latest)
            old = out / name
            if keep is not None and old.exists() and old.resolve() == Path(keep).resolve():
                continue  # --init-from may point into the folder it writes to
            if old.is_dir():
                shutil.rmtree(old)
            elif old.exists():
                old.unlink()
        probe = out / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise RunError(f"Expected a writable output folder at {out}, but got: {e.strerror or e}") from None


OPTIMIZERS = ("adamw", "dadapt-adam", "prodigy", "schedulefree-adamw")


def _make_optimizer(task: Task, cfg: RunConfig):
    """AdamW (hdet's default), or a learning-rate-free peer (pip install hdet[bench]): D-Adaptation Adam and
    Prodigy at ``--max-lr`` (1 is their documented use) under the same OneCycle shape, or Schedule-Free AdamW
    at a constant ``--max-lr`` after its own warm-up (5% of the run), with no schedule (its documented use)."""
    def make(module: nn.Module) -> torch.optim.Optimizer:
        groups = param_groups(module, task.group_of, cfg.weight_decay)
        if cfg.optimizer == "adamw":
            return torch.optim.AdamW(groups, lr=cfg.max_lr)
        try:
            if cfg.optimizer == "dadapt-adam":
                import dadaptation

                return dadaptation.DAdaptAdam(groups, lr=cfg.max_lr, decouple=True)
            if cfg.optimizer == "prodigy":
                import prodigyopt

                return prodigyopt.Prodigy(groups, lr=cfg.max_lr, decouple=True)
            import schedulefree

            opt = schedulefree.AdamWScheduleFree(groups, lr=cfg.max_lr, warmup_steps=max(1, cfg.steps // 20))
            opt.train()
            return opt
        except ImportError as e:
            raise RunError(f"Expected the package for --optimizer {cfg.optimizer} (pip install 'hdet[bench]'), but "
                           f"got: {e}") from None
    return make


@contextlib.contextmanager
def eval_weights(task: Task, model: nn.Module, optimizers: list[torch.optim.Optimizer], cfg: RunConfig,
                 device: torch.device):
    """The weights to evaluate: as they are, or for Schedule-Free its average ``x`` (``optimizer.eval()``),
    with BatchNorm statistics recomputed at ``x`` on 50 training batches (the recipe in schedulefree's README);
    everything is put back afterwards."""
    sf = [o for o in optimizers if hasattr(o, "eval") and any("train_mode" in g for g in o.param_groups)]
    if not sf:
        yield
        return
    for o in sf:
        o.eval()  # y -> x
    bn = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    saved = [{k: v.clone() for k, v in m.state_dict().items()} for m in bn]
    try:
        if bn:
            was = model.training
            model.train()
            g = torch.Generator().manual_seed(54321)
            with torch.no_grad():
                for _ in range(50):
                    task.loss_fn(model, _to(task.sample("train", cfg.batch, g), device))
            model.train(was)
        yield
    finally:
        for m, st in zip(bn, saved):
            m.load_state_dict(st)
        for o in sf:
            o.train()  # x -> y


EXPLORE = ("lr-groups", "weight-decay", "dropout", "grad-clip")


def _explored(cfg: RunConfig, optimizer: torch.optim.Optimizer, module: nn.Module) -> list[Hyperparameter]:
    """The CLI's ``--explore`` choices (the LR of every param group is always explored when alpha > 0)."""
    out: list[Hyperparameter] = []
    if "weight-decay" in cfg.explore:
        out += WeightDecay.per_group(optimizer, alpha=1.0)  # x2 .. /2, log scale
    if "dropout" in cfg.explore:
        out.append(Dropout(module, alpha=0.05))  # +-0.05, kept in [0, 0.999]
    if "grad-clip" in cfg.explore:
        out.append(GradClip(cfg.clip, alpha=1.0))  # x2 .. /2
    return out


def _clip(sched: OneCycleAutoLR) -> GradClip | None:
    return next((h for h in sched.ensemble.hypers if isinstance(h, GradClip)), None)


class _Probe:
    """The fit controller's probe: ``probe_batches`` training batches, the same on every replica at the
    same sync (the k-th call of every replica draws from a generator seeded by the run's seed and k)."""

    def __init__(self, task: Task, cfg: RunConfig, device: torch.device) -> None:
        self.task, self.cfg, self.device, self.calls = task, cfg, device, 0

    def __call__(self, model: nn.Module) -> torch.Tensor:
        g = torch.Generator().manual_seed(1_000_003 * (self.cfg.seed + 1) + self.calls)
        self.calls += 1
        losses = [self.task.loss_fn(model, _to(self.task.sample("train", self.cfg.batch, g), self.device))
                  for _ in range(self.cfg.probe_batches)]
        return torch.stack(losses).mean()


def _make_scheduler(cfg: RunConfig, warmup: int, task: Task, device: torch.device):
    def make(optimizer: torch.optim.Optimizer, replicas: Any = None, module: nn.Module | None = None):
        assert module is not None
        inner = module.module if hasattr(module, "module") else module  # DDP wraps the model
        if cfg.optimizer == "schedulefree-adamw":  # no schedule: Schedule-Free's own warm-up, then constant
            return HDETLR(optimizer, None, total_steps=cfg.steps, ensemble_lr_spread_ratio=cfg.alpha,
                          model_sync_interval=cfg.T, model=module, seed=cfg.seed, replicas=replicas,
                          average_optimizer_state=True)
        return OneCycleAutoLR(optimizer, max_lr=cfg.max_lr, total_steps=cfg.steps,
                              ensemble_lr_spread_ratio=cfg.alpha, model_sync_interval=cfg.T,
                              enable_auto_lr=cfg.auto_lr, auto_lr_warmup_steps=warmup, eq8=cfg.eq8,
                              model=module, seed=cfg.seed, replicas=replicas,
                              explore=_explored(cfg, optimizer, inner), controller=cfg.controller,
                              probe=_Probe(task, cfg, device) if cfg.controller == "fit" else None,
                              tie_lr_groups=cfg.tie_lr_groups if cfg.tie_lr_groups is not None else
                              (cfg.auto_lr and cfg.controller == "fit"))
    return make


class _EngineReplicas:
    """All N replicas in this process (:class:`~hdet.engine.ReplicaEngine`)."""

    def __init__(self, task: Task, model: nn.Module, N: int, cfg: RunConfig, warmup: int, device: torch.device) -> None:
        self.task = task
        self.engine = ReplicaEngine(model, N, _make_optimizer(task, cfg), _make_scheduler(cfg, warmup, task, device),
                                    mode=cfg.mode, share_gradients=not cfg.local,
                                    before_optimizer_step=self._clip_grads)
        self.local = list(range(N))
        self.N = N
        self.schedulers = self.engine.schedulers
        if cfg.warm_init:
            for r, m in enumerate(self.engine.models):
                warm_init_(m, rank=r, nu=cfg.nu, seed=cfg.seed)

    def _clip_grads(self, r: int, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        clip = _clip(self.engine.schedulers[r])
        if clip is not None:
            clip.clip_(module.parameters())

    @property
    def mode(self) -> str:
        return "engine-" + self.engine.mode

    def step(self, batches: list[Any]) -> torch.Tensor:
        return self.engine.step(batches, self.task.loss_fn)

    def mean_loss(self, loss_sum: torch.Tensor, count: int) -> float:
        return loss_sum.item() / count / self.N  # host sync (logging steps only)

    def eval_model(self) -> nn.Module:
        return self.engine.models[0]

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.engine.optimizers[0]]  # replica 0's: the evaluated model's


class _DDPReplicas:
    """One replica per process under torchrun: DDP on the default process group."""

    def __init__(self, task: Task, model: nn.Module, cfg: RunConfig, warmup: int, device: torch.device) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.task = task
        self.model = model
        self.ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        self.optimizer = _make_optimizer(task, cfg)(model)
        self.schedulers = [_make_scheduler(cfg, warmup, task, device)(self.optimizer, None, self.ddp)]
        self.local = [dist.get_rank()]
        self.N = dist.get_world_size()
        self.mode = "ddp-" + dist.get_backend()
        self.local_mode = cfg.local
        if cfg.warm_init:
            warm_init_(model, nu=cfg.nu, seed=cfg.seed)  # rank from the process group

    def step(self, batches: list[Any]) -> torch.Tensor:
        with self.ddp.no_sync() if self.local_mode else contextlib.nullcontext():  # local mode: no all-reduce
            loss = self.task.loss_fn(self.ddp, batches[0])
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()  # COLLECTIVE: gradient all-reduce (DDP), unless local mode
        clip = _clip(self.schedulers[0])
        if clip is not None:
            clip.clip_(self.model.parameters())
        self.optimizer.step()
        self.schedulers[0].step(loss)
        return loss.detach()[None]

    def mean_loss(self, loss_sum: torch.Tensor, count: int) -> float:
        x = loss_sum.clone()
        dist.all_reduce(x)  # collective + host sync below (logging steps only)
        return x.item() / count / self.N

    def eval_model(self) -> nn.Module:
        return self.model

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.optimizer]


def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    return type(batch)(_to(b, device) for b in batch)


@torch.no_grad()
def evaluate(task: Task, model: nn.Module, n_batches: int, batch: int, device: torch.device) -> float:
    """Mean validation loss over a fixed set of held-out batches (the same for every run)."""
    g = torch.Generator().manual_seed(12345)
    was = model.training
    model.eval()
    total = sum(task.loss_fn(model, _to(task.sample("val", batch, g), device)).item()  # host sync
                for _ in range(n_batches))
    model.train(was)
    return total / n_batches


@torch.no_grad()
def final_metrics(task: Task, model: nn.Module, device: torch.device, limit: int = 2048) -> dict[str, float]:
    """The held-out split, deterministically: Fashion-MNIST's whole test set (loss and accuracy); for the
    byte GPT, loss over up to ``limit`` consecutive non-overlapping windows from the start of the
    held-out files."""
    was = model.training
    model.eval()
    try:
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
    finally:
        model.train(was)


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


def train(cfg: RunConfig, argv: list[str] | None = None) -> dict[str, Any]:
    """Run ``cfg``; returns the summary (also written to ``<out>/summary.json`` on rank 0)."""
    _check(cfg)
    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    owns_group = False
    device = resolve_device(cfg.device)
    if distributed and not dist.is_initialized():
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        owns_group = True
    rank = dist.get_rank() if distributed else 0
    N = dist.get_world_size() if distributed else (cfg.replicas or 4)
    if distributed and cfg.replicas not in (None, N):
        raise RunError(f"Expected --replicas to match the torchrun world size ({N}), but got {cfg.replicas}")
    if cfg.warmup is not None:
        warmup = cfg.warmup
    elif cfg.controller == "fit":  # the end of OneCycle's warm-up (pct_start 0.3), as in the evidence suite
        warmup = int(0.3 * cfg.steps) // cfg.T * cfg.T
    else:
        warmup = cfg.steps // 2
    if cfg.auto_lr and not 0 <= warmup < cfg.steps:
        raise RunError(f"Expected --warmup in [0, --steps) with --auto-lr, but got {warmup} (steps {cfg.steps})")
    out = Path(cfg.out)
    if rank == 0:
        _prepare_out(out, keep=cfg.init_from)
    task = make_task(cfg.task, data=cfg.data, ctx=cfg.ctx, width=cfg.width, layers=cfg.layers,
                     dropout=cfg.dropout, data_bytes=cfg.data_bytes)

    torch.manual_seed(cfg.seed)
    model = task.make_model()
    if cfg.init_from is not None:
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
    reps = (_DDPReplicas(task, model, cfg, warmup, device) if distributed
            else _EngineReplicas(task, model, N, cfg, warmup, device))
    gens = {r: torch.Generator().manual_seed(cfg.seed * 1000 + r) for r in reps.local}  # each replica its data
    sched0 = reps.schedulers[0].record_schedule()  # the discovered schedule, for hdet.ReplayLR
    groups = [g.get("name", str(j)) for j, g in enumerate(sched0.optimizer.param_groups)]
    eval_every = cfg.eval_every or cfg.T
    log_every = cfg.log_every or min(10, max(1, cfg.steps // 100))

    writer = metrics_f = syncs_f = None
    if rank == 0:
        meta = {"command": "hdet " + " ".join(argv if argv is not None else sys.argv[1:]),
                "config": dataclasses.asdict(cfg), "replicas": N, "groups": groups, "task": task.describe,
                "python": platform.python_version(), "torch": torch.__version__, "hdet": __version__,
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else
                (platform.processor() or platform.machine() or "cpu")}
        (out / "config.json").write_text(json.dumps(meta, indent=1))
        metrics_f = (out / "metrics.jsonl").open("w")
        syncs_f = SyncLogger(sched0, out / "syncs.jsonl")
        if cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise RunError("Expected the tensorboard package for --tensorboard (pip install tensorboard), "
                               "but it is not installed") from None
            writer = SummaryWriter(str(out / "tb"))

    def log(f, rec: dict[str, Any]) -> None:
        if rank == 0:
            f.write(json.dumps(rec) + "\n")
            f.flush()

    progress = _Progress(cfg.progress and rank == 0, cfg.steps, cfg.label or f"{cfg.task} x{N}")
    crashed, train_losses, val_curve = None, [], []
    t0 = time.perf_counter()
    t = last_eval = n_logged = 0
    loss_sum = torch.zeros((), device=device)
    try:
        for t in range(1, cfg.steps + 1):
            batches = [_to(task.sample("train", cfg.batch, gens[r]), device) for r in reps.local]
            try:
                losses = reps.step(batches)
            except NonFiniteReplicaError as e:
                crashed = f"step {t}: {e}"
                break
            sync = sched0.is_sync_step(t)
            loss_sum = loss_sum + losses.detach().float().sum()  # on the device: no host sync
            n_logged += 1
            if t % log_every == 0 or sync or t == cfg.steps:
                loss = reps.mean_loss(loss_sum, n_logged)  # mean over replicas and steps since the last record
                loss_sum, n_logged = torch.zeros((), device=device), 0
                train_losses.append((t, loss))
                rec = {"step": t, "train_loss": loss,
                       "lr": dict(zip(groups, sched0.get_last_lr())),  # replica 0 (rank 0 under torchrun)
                       "lr_mean": dict(zip(groups, sched0.base_lrs_now)),  # mean over replicas (mean rho = 1)
                       "seconds": time.perf_counter() - t0}
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
    finally:
        progress.close()
    elapsed = time.perf_counter() - t0
    final_val, final = None, {}
    if crashed is None:  # the last step is a sync step and was evaluated in the loop: the same model and batches
        with eval_weights(task, reps.eval_model(), reps.optimizers, cfg, device):
            final_val = val_curve[-1][1] if val_curve and val_curve[-1][0] == t else \
                evaluate(task, reps.eval_model(), cfg.eval_batches, 32, device)
            final = final_metrics(task, reps.eval_model(), device)
    tail = [v for s, v in train_losses if s > cfg.steps * 0.9] or [v for _, v in train_losses[-1:]]
    summary = {**({} if rank else meta), "mode": reps.mode, "steps_done": t,
               "crashed": crashed, "train_seconds": elapsed, "steps_per_second": t / elapsed if elapsed else None,
               "final_train_loss": sum(tail) / len(tail) if tail else None, "final_val_loss": final_val,
               "final_metrics": final,
               "val_curve": val_curve}
    if rank == 0:
        metrics_f.close()
        syncs_f.close()
        if writer is not None:
            writer.close()
        (out / "schedule.json").write_text(json.dumps(sched0.discovered_schedule()))
        if crashed is None:
            # clone: in vmap mode the weights are views of [N, ...] tensors, which torch.save would store whole
            with eval_weights(task, reps.eval_model(), reps.optimizers, cfg, device):  # Schedule-Free: its x
                torch.save({k: v.detach().clone() for k, v in reps.eval_model().state_dict().items()}, out / "model.pt")
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if owns_group:
        dist.barrier()  # every rank is done with its collectives before the group goes
        dist.destroy_process_group()
    return summary
