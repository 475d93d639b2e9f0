"""How a run of the ``hdet`` command is built: the optimizer and scheduler of each replica, and the two
ways to run the replicas (:class:`EngineRun`: all N in this process; :class:`DDPRun`: one per process
under torchrun), which the training loop in :mod:`hdet.app.run` drives alike."""

from __future__ import annotations

import contextlib
import math
import sys
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import sweep
from ..caller import user_stacklevel
from ..engine import ReplicaEngine
from ..hyper import Dropout, GradClip, Hyperparameter, WeightDecay
from ..schedulers import HDETLR, OneCycleAutoLR
from ..warm_init import warm_init_
from .options import RunConfig, RunError
from .tasks import Task, param_groups

__all__ = ["EngineRun", "DDPRun", "make_optimizer", "make_scheduler", "eval_weights", "to_device", "lr_sweep"]


def make_optimizer(task: Task, cfg: RunConfig):
    """AdamW (hdet's default), or a learning-rate-free peer (pip install -e '.[bench]' in the clone): D-Adaptation Adam and
    Prodigy at ``--max-lr`` (1 is their documented use) under the same OneCycle shape (Prodigy's
    ``safeguard_warmup`` with ``--prodigy-safeguard``), or Schedule-Free AdamW
    at a constant ``--max-lr`` after its own warm-up (5% of the run), with no schedule (its documented use), or
    Mechanic's tuner over AdamW at ``--max-lr`` (1) under the OneCycle shape (its documented use)."""
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

                return prodigyopt.Prodigy(groups, lr=cfg.max_lr, decouple=True, safeguard_warmup=cfg.prodigy_safeguard)
            if cfg.optimizer == "mechanic-adamw":
                import mechanic_pytorch

                return mechanic_pytorch.mechanize(torch.optim.AdamW)(groups, lr=cfg.max_lr)
            import schedulefree

            opt = schedulefree.AdamWScheduleFree(groups, lr=cfg.max_lr, warmup_steps=max(1, cfg.steps // 20))
            opt.train()
            return opt
        except ImportError as e:
            raise RunError(f"Expected the package for --optimizer {cfg.optimizer} (pip install -e '.[bench]' in the clone), but "
                           f"got: {e}") from None
    return make


def lr_sweep(task: Task, model: nn.Module, cfg: RunConfig, N: int, steps: int, device: torch.device,
             progress: bool, distributed: bool, resume_from: dict[str, Any] | None = None,
             on_round: Any = None) -> dict[str, Any]:
    """``--lr-sweep``: :func:`hdet.lr_sweep` over ``steps`` with the run's AdamW and param groups, each replica on a
    data stream of its own (not the run's), judged by its training loss; ``model`` left at its start weights
    (``--lr-sweep-then restart``) or the best run's (``continue``). ``resume_from``, ``on_round``: hdet.lr_sweep's
    ``progress`` and ``on_round`` (a sweep stopped after a round goes on from it).
    What it found, for the run's config.json and summary."""
    def make(params: Any, lr: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(param_groups(model, task.group_of, cfg.weight_decay), lr=lr)

    def batches(r: int) -> Any:
        g = torch.Generator().manual_seed(SWEEP_SEED + cfg.seed * 1000 + r)
        return (to_device(task.sample("train", cfg.batch, g), device) for _ in range(steps))
    t0 = time.perf_counter()
    if not distributed and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise RunError("Expected no process group with --lr-sweep in one process (hdet.lr_sweep would take every rank "
                       "for one replica), but one is initialised; run under torchrun instead")
    restart = cfg.lr_sweep_then == "restart"  # (the sweep leaves torch's RNG as it came: hdet.lr_sweep forks it)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if steps < SHORT_SWEEP:
            warnings.warn(f"the sweep's runs have {steps} steps: it was measured with runs of 300 (--lr-sweep 0.2 of "
                          f"1500 steps), and short runs favour high LRs (the default job's 80 ran at 7x its LR and "
                          f"ended worse); sweep longer runs, or pass --max-lr without --lr-sweep",
                          stacklevel=user_stacklevel())
        points = cfg.lr_sweep_points or N
        if points < 4:
            warnings.warn(f"{points} {'points' if cfg.lr_sweep_points else 'replicas'} give the sweep a grid of "
                          f"{points} LRs {32.0 ** (2 / (points - 1)):.0f}x apart: its pick is little more than one of "
                          f"them (use 4 or more, --lr-sweep-points 8 say: run {N} at a time)",
                          stacklevel=user_stacklevel())
        factor = cfg.lr_sweep_factor
        plan = resume_from.get("plan") if isinstance(resume_from, dict) else None
        if factor is None and isinstance(plan, list) and len(plan) == 5 and isinstance(plan[4], float):
            factor = plan[4]  # (a sweep stopped under the default factor goes on with the factor it began with: the
            # default was sqrt(N) before it became sqrt(max(N, 8)), and the plan, the grid included, follows it)
        try:
            res = sweep.lr_sweep(model, make, task.loss_fn, batches, guess=cfg.max_lr, steps=steps,
                                 num_replicas=None if distributed else N, pct_start=cfg.pct_start,
                                 keep="start" if restart else "winner", points=cfg.lr_sweep_points,
                                 lr_factor=factor, progress=resume_from, on_round=on_round)
        except sweep.SweepFoundNothing as e:  # every run non-finite, or none below the start's: the guess is far off
            why = str(e)
            raise RunError(f"Expected --lr-sweep to find an LR around --max-lr {cfg.max_lr:g}, but "
                           f"{why[:1].lower() + why[1:]}") from None
    finite = lambda v: v if math.isfinite(v) else None  # noqa: E731 - strict JSON
    found = {"steps": steps, "then": cfg.lr_sweep_then, "guess": cfg.max_lr, "max_lr": res.max_lr, "pick": res.pick,
             "lr_factor": res.lr_factor, "lrs": res.lrs, "losses": [finite(v) for v in res.losses],
             "start_loss": finite(res.start_loss), "winner": res.winner, "at_edge": res.at_edge,
             "seconds": time.perf_counter() - t0}
    if progress:
        print(f"lr sweep: {len(res.lrs)} runs of {steps} steps at {res.lrs[0]:.3g} to {res.lrs[-1]:.3g}"
              f"{f' ({len(res.lrs) - points} beyond the first {points})' if len(res.lrs) > points else ''}; the best "
              f"at {res.lrs[res.winner]:.3g}, the pick {res.pick:.3g}; the run "
              f"{'starts again' if cfg.lr_sweep_then == 'restart' else 'goes on'} at --max-lr {res.max_lr:.3g}"
              + (f", HDET's spread at --alpha {cfg.alpha:g}" if cfg.alpha else ", without HDET's spread (--alpha 0)"),
              flush=True)
        for w in caught:
            print(f"warning: {w.message}", file=sys.stderr)
    return found


SWEEP_SEED = 1 << 40  # the sweep's data streams, apart from the run's (seed * 1000 + r)
SHORT_SWEEP = 150  # fewer steps a sweep run: warned (its picks run high: docs/cli.md)


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
                    task.loss_fn(model, to_device(task.sample("train", cfg.batch, g), device))
            model.train(was)
        yield
    finally:
        for m, st in zip(bn, saved):
            m.load_state_dict(st)
        for o in sf:
            o.train()  # x -> y


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
        losses = [self.task.loss_fn(model, to_device(self.task.sample("train", self.cfg.batch, g), self.device))
                  for _ in range(self.cfg.probe_batches)]
        return torch.stack(losses).mean()


def make_scheduler(cfg: RunConfig, warmup: int, task: Task, device: torch.device):
    def make(optimizer: torch.optim.Optimizer, replicas: Any = None, module: nn.Module | None = None):
        assert module is not None
        inner = module.module if hasattr(module, "module") else module  # DDP wraps the model
        if cfg.optimizer == "schedulefree-adamw":  # no schedule: Schedule-Free's own warm-up, then constant
            return HDETLR(optimizer, None, total_steps=cfg.steps, ensemble_lr_spread_ratio=cfg.alpha,
                          model_sync_interval=cfg.T, model=module, seed=cfg.seed, replicas=replicas,
                          average_optimizer_state=True)  # (no --explore: refused, options.check)
        return OneCycleAutoLR(optimizer, max_lr=cfg.max_lr, total_steps=cfg.steps, pct_start=cfg.pct_start,
                              ensemble_lr_spread_ratio=cfg.alpha, model_sync_interval=cfg.T,
                              enable_auto_lr=cfg.auto_lr, auto_lr_warmup_steps=warmup, eq8=cfg.eq8,
                              on_runaway=cfg.on_runaway, lr_cut=cfg.lr_cut, lr_cut_after=cfg.lr_cut_after,
                              judge_steps=cfg.judge_steps,
                              lr_range_test=cfg.range_test,
                              range_backoff=cfg.range_backoff,
                              model=module, seed=cfg.seed, replicas=replicas,
                              explore=_explored(cfg, optimizer, inner), controller=cfg.controller,
                              probe=_Probe(task, cfg, device) if cfg.controller == "fit" else None,
                              tie_lr_groups=cfg.tie_lr_groups if cfg.tie_lr_groups is not None else
                              (cfg.auto_lr and (cfg.controller == "fit" or cfg.optimizer in ("dadapt-adam", "prodigy"))))
                              # (one LR for all their groups: hdet.optimizers.check_lr_groups)
    return make


def _finite_mean(sum_and_bad: list[float], count: int, N: int) -> tuple[float, int]:
    """The mean of the finite losses of ``count`` steps of ``N`` replicas (NaN: none), and how many were not."""
    total, bad = sum_and_bad[0], round(sum_and_bad[1])
    if not bad:
        return total / count / N, 0
    n = count * N - bad
    return (total / n if n else float("nan")), bad


class EngineRun:
    """All N replicas in this process (:class:`~hdet.engine.ReplicaEngine`)."""

    def __init__(self, task: Task, model: nn.Module, N: int, cfg: RunConfig, warmup: int, device: torch.device) -> None:
        self.task = task
        self.engine = ReplicaEngine(model, N, make_optimizer(task, cfg), make_scheduler(cfg, warmup, task, device),
                                    mode=cfg.mode, compile=cfg.compile, cuda_graph=cfg.cuda_graph,
                                    share_gradients=not cfg.local,
                                    gradient_layout=True,  # the tasks never .view() a parameter
                                    # only with an explored clip: a hook keeps one moment copy per replica
                                    before_optimizer_step=self._clip_grads if "grad-clip" in cfg.explore else None)
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

    def mean_loss(self, loss_sum: torch.Tensor, count: int) -> tuple[float, int]:
        """From ``[sum of the finite losses, how many were not]`` over ``count`` steps: :func:`_finite_mean`."""
        return _finite_mean(loss_sum.tolist(), count, self.N)  # host sync (logging steps only)

    def eval_model(self) -> nn.Module:
        return self.engine.models[0]

    def state_dict(self) -> dict[str, Any]:
        return self.engine.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            self.engine.load_state_dict(state)
        except ValueError as e:
            raise RunError(f"Expected a checkpoint of this run's replicas, but: {e}") from None

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.engine.optimizers[0]]  # replica 0's: the evaluated model's


class DDPRun:
    """One replica per process under torchrun: DDP on the default process group."""

    def __init__(self, task: Task, model: nn.Module, cfg: RunConfig, warmup: int, device: torch.device) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.task = task
        self.model = model
        self.ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        self.optimizer = make_optimizer(task, cfg)(model)
        self.schedulers = [make_scheduler(cfg, warmup, task, device)(self.optimizer, None, self.ddp)]
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

    def mean_loss(self, loss_sum: torch.Tensor, count: int) -> tuple[float, int]:
        x = loss_sum.clone()
        dist.all_reduce(x)  # collective + host sync below (logging steps only)
        return _finite_mean(x.tolist(), count, self.N)

    def eval_model(self) -> nn.Module:
        return self.model

    def state_dict(self) -> dict[str, Any]:
        """This rank's replica: its model, optimizer and scheduler."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.schedulers[0].state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            self.schedulers[0].check_state_dict(state["scheduler"])  # checked before anything is set
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.schedulers[0].load_state_dict(state["scheduler"])
        except (ValueError, RuntimeError, KeyError) as e:
            raise RunError(f"Expected a checkpoint of this run's replica, but: {e}") from None

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.optimizer]


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    return type(batch)(to_device(b, device) for b in batch)
