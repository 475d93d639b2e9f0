"""One HDET ensemble: observe losses -> at a sync step: converge (Eq. 3), control (Eqs. 4-8), deal (Eq. 9).

The ensemble explores one scalar per "slot": the learning rate of each optimizer param group (paper
section 3.4), then any extra :class:`~hdet.hyper.Hyperparameter` (Remark 1). Slot ``j`` has a base
value, a :class:`~hdet.hyper.Spread`, a permutation ``pi_j`` (replica ``r`` takes position ``pi_j[r]``
of the spread) and, once the controller has started, a controller: the paper's owns the slot's base
value; hdet's ``"fit"`` controller corrects the base schedule by a factor (an offset for additive
spreads) and ranks replicas by a probe loss at the mean of their iterates over the window.
"""

from __future__ import annotations

import math
import warnings
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from .controller import CONTROLLERS, ControllerStep, FitController, PaperController
from .hyper import Hyperparameter, Spread
from .replicas import Replicas, local_shard
from .spread import Dealer, check_alpha, linear_multipliers

__all__ = ["HDETConfig", "Ensemble", "NonFiniteReplicaError", "ReplicaSyncError", "SyncRecord"]


class ReplicaSyncError(RuntimeError):
    """A converge step's collective failed, usually because a replica never arrived within the process
    group's timeout (it died, hung, or skipped ``scheduler.step()``)."""


class NonFiniteReplicaError(FloatingPointError):
    """A replica's window loss or weights are NaN/Inf at a converge step; nothing was averaged."""


@dataclass
class HDETConfig:
    """Settings of one ensemble; names after the reference implementation, paper symbols noted."""

    alpha: float = 0.0  # spread ratio, Eq. 1 (ensemble_lr_spread_ratio)
    sync_interval: int = 1000  # T, Eq. 3 (model_sync_interval)
    auto_lr: bool = False  # enable_auto_lr
    auto_lr_warmup_steps: int = 100_000  # S_warm
    sigma: float = 0.1  # loss temperature, Eq. 4 (loss_scale)
    lam: float = 0.5  # lambda, Eq. 7 (lr_of_lr)
    beta: float = 0.9  # velocity momentum, Eq. 7 (momentum_of_lr)
    eq8: str = "decay"  # "decay" (toward the schedule's final value) or "as_printed"
    seed: int = 0  # seed of the permutation generator, identical on every replica
    average_optimizer_state: bool = False
    on_nonfinite: str = "recover"  # "recover": drop and reset non-finite replicas; "raise": stop
    controller: str = "fit"  # "fit" (hdet.controller.FitController) or "paper" (Eqs. 4-8 on window losses)
    tie_lr_groups: bool = False  # one multiplier per replica for all its LR groups (one permutation)

    def validate(self) -> None:
        check_alpha(self.alpha)
        _check_int("model_sync_interval", self.sync_interval, lo=1)
        if not isinstance(self.auto_lr, bool):
            raise ValueError(f"Expected enable_auto_lr to be a bool, but got {self.auto_lr!r}")
        _check_int("auto_lr_warmup_steps", self.auto_lr_warmup_steps, lo=0)
        if not _is_real(self.sigma) or not self.sigma > 0 or not math.isfinite(self.sigma):
            raise ValueError(f"Expected loss_scale (sigma) > 0, but got {self.sigma!r}")
        if not _is_real(self.lam) or not self.lam >= 0 or not math.isfinite(self.lam):
            raise ValueError(f"Expected lr_of_lr (lambda) >= 0, but got {self.lam!r}")
        if not _is_real(self.beta) or not 0.0 <= self.beta < 1.0:
            raise ValueError(f"Expected 0 <= momentum_of_lr (beta) < 1, but got {self.beta!r}")
        if self.eq8 not in ("decay", "as_printed"):
            raise ValueError(f"Expected eq8 to be 'decay' or 'as_printed', but got {self.eq8!r}")
        _check_int("seed", self.seed, lo=0)
        if not isinstance(self.tie_lr_groups, bool):
            raise ValueError(f"Expected tie_lr_groups to be a bool, but got {self.tie_lr_groups!r}")
        if self.controller not in CONTROLLERS:
            raise ValueError(f"Expected controller in {CONTROLLERS}, but got {self.controller!r}")
        if self.on_nonfinite not in ("recover", "raise"):
            raise ValueError(f"Expected on_nonfinite to be 'recover' or 'raise', but got {self.on_nonfinite!r}")


def _is_real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_int(name: str, value: Any, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"Expected integer {name} >= {lo}, but got {value!r}")


def _persistent_float_buffers(model: nn.Module) -> list[torch.Tensor]:
    out, seen = [], set()
    for mod in model.modules():
        for name, b in mod._buffers.items():
            if b is None or name in mod._non_persistent_buffers_set or not b.is_floating_point() or id(b) in seen:
                continue
            seen.add(id(b))
            out.append(b.detach())
    return out


def _all_finite(tensors: list[torch.Tensor], strict: list[bool], dev: torch.device) -> torch.Tensor:
    """One bool on ``dev``: every element is finite (``strict``) or at least not NaN. No host sync
    (one small copy per device)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for x, must_be_finite in zip(tensors, strict):
        ok = torch.isfinite(x).all() if must_be_finite else ~torch.isnan(x).any()
        by_device.setdefault(x.device, []).append(ok)
    flags = [torch.stack(fs).all().to(dev) for fs in by_device.values()]
    return torch.stack(flags).all() if flags else torch.ones((), dtype=torch.bool, device=dev)


@dataclass
class SyncRecord:
    """What one sync step saw and did; ``controller`` holds one entry per slot when auto-LR ran."""

    step: int
    losses: list[float] | None
    multipliers: list[list[float]]  # per slot, per replica, after dealing (offsets for additive spreads)
    bases: list[float]  # per slot, after the update
    controller: list[ControllerStep] | None  # per slot; log-spread slots in log space
    names: list[str] | None = None  # per slot: "lr/<group>" or the hyperparameter's name
    values: list[list[float]] | None = None  # per slot, per replica: the value for the next window
    recovered: list[int] = field(default_factory=list)  # replicas reset after a non-finite window


Controller = PaperController | FitController
MakeController = Callable[[int, float], Controller]
Probe = Callable[[nn.Module], "torch.Tensor | float"]


class Ensemble:
    """The HDET state machine of one replica. Collectives happen only in :meth:`sync`."""

    def __init__(
        self,
        config: HDETConfig,
        replicas: Replicas,
        optimizer: torch.optim.Optimizer,
        model: nn.Module | None = None,
        hypers: list[Hyperparameter] | tuple[Hyperparameter, ...] = (),
    ) -> None:
        config.validate()
        hypers = list(hypers)
        for h in hypers:
            if not isinstance(h, Hyperparameter):
                raise ValueError(f"Expected explore= to hold hdet hyperparameters, but got {type(h).__name__}")
        names = [h.name for h in hypers]
        if len(set(names)) != len(names):
            raise ValueError(f"Expected distinct hyperparameter names, but got {names}")
        if model is not None and not isinstance(model, nn.Module):
            raise ValueError(f"Expected model to be a torch.nn.Module, but got {type(model).__name__}")
        self.config = config
        self.replicas = replicas
        self.optimizer = optimizer
        self.model = model
        self.hypers = hypers
        self.num_lr_slots = len(optimizer.param_groups)
        self.num_slots = self.num_lr_slots + len(hypers)
        N = replicas.world_size
        self.rho = linear_multipliers(N, config.alpha)  # Eq. 1
        self.spreads = [Spread("linear", config.alpha)] * self.num_lr_slots + [h.spread for h in hypers]
        self.offsets = [list(self.rho)] * self.num_lr_slots + [h.spread.offsets(N) for h in hypers]
        self.names = [f"lr/{g.get('name', j)}" for j, g in enumerate(optimizer.param_groups)] + names
        self.perms: list[list[int]] = [list(range(N)) for _ in range(self.num_slots)]  # rank r -> rho_r
        self.current_bases: list[float] = [0.0] * self.num_slots
        self.controllers: list[Controller | None] = [None] * self.num_slots
        self.dealer = Dealer(config.seed)
        self.total_steps: int | None = None
        self.make_controller: MakeController | None = None
        self.last_sync: SyncRecord | None = None
        self.on_sync: list[Callable[[SyncRecord], None]] = []
        self._controlled: list[float | None] = [None] * self.num_slots  # controller-owned bases
        self._loss_sum: torch.Tensor | None = None  # stays on the loss's device: no host sync
        self._loss_count = 0
        # controller="fit": probe(model) -> loss on a batch every replica sees; the window's iterate sum
        self.probe: Probe | None = None
        self._polyak: list[torch.Tensor] | None = None  # float32 sum of the parameters after each step
        self._polyak_n = 0
        self._polyak_fresh = False  # this optimizer step's parameters are in the sum already
        self._probed: torch.Tensor | None = None  # this window's probe loss, once computed
        self._t = 0  # optimizer steps taken, counted by accumulate() (fit controller only)
        self._peak0 = 0.0  # the largest scheduled base of slot 0 so far (the fit controller's weight)
        self._scheduled: list[float] = [0.0] * self.num_slots  # the base schedules' values now

    # ----------------------------------------------------------------- schedule
    def set_total_steps(self, total_steps: int) -> None:
        c = self.config
        self.total_steps = total_steps
        if c.auto_lr:
            if c.auto_lr_warmup_steps >= total_steps:
                raise ValueError(
                    f"Expected auto_lr_warmup_steps < total_steps with enable_auto_lr=True, but got "
                    f"auto_lr_warmup_steps={c.auto_lr_warmup_steps} and total_steps={total_steps}"
                )
            if self.first_control_step() > total_steps:
                raise ValueError(
                    f"enable_auto_lr=True but no sync step (a multiple of model_sync_interval="
                    f"{c.sync_interval}) falls in [auto_lr_warmup_steps={c.auto_lr_warmup_steps}, "
                    f"total_steps={total_steps}]: the controller would never run"
                )

    def first_control_step(self) -> int:
        T = self.config.sync_interval
        return max(T, -(-self.config.auto_lr_warmup_steps // T) * T)

    @property
    def num_control_syncs(self) -> float:
        """K of Eq. 8: ``(S - S_warm) / T``."""
        assert self.total_steps is not None
        return (self.total_steps - self.config.auto_lr_warmup_steps) / self.config.sync_interval

    def is_sync_step(self, t: int) -> bool:
        """Converge after optimizer step ``t`` when ``t mod T == 0``, and after the last step."""
        return t > 0 and (t % self.config.sync_interval == 0 or t == self.total_steps)

    def multiplier(self, j: int) -> float:
        """This replica's multiplier (offset for additive spreads) for slot ``j``: ``rho[pi_j[rank]]`` (Eq. 9)."""
        return self.offsets[j][self.perms[j][self.replicas.rank]]

    def values(self, scheduled_bases: list[float]) -> list[float]:
        """This replica's values for the next step, one per slot: ``base_j * rho[pi_j[rank]]`` for the LR
        (Eqs. 1, 9), the slot's spread for other hyperparameters, clamped into their bounds.

        ``scheduled_bases`` come from the base schedules; a slot whose controller has started
        uses the controller's base instead (Eq. 7 replaces the schedule)."""
        if len(scheduled_bases) != self.num_slots:
            raise ValueError(f"Expected {self.num_slots} base values, but got {len(scheduled_bases)}")
        out = []
        self._scheduled = [float(b) for b in scheduled_bases]
        self._peak0 = max(self._peak0, self._scheduled[0])
        for j, b in enumerate(scheduled_bases):
            controlled = self._controlled[j]
            ctrl = self.controllers[j]
            if isinstance(ctrl, FitController):  # a correction of the schedule: a factor, or an offset
                base = self.spreads[j].clamp(ctrl.correct(b))
            else:
                base = controlled if controlled is not None else b
            self.current_bases[j] = base
            out.append(self.spreads[j].apply(base, self.multiplier(j)))
        return out

    def all_values(self) -> list[list[float]]:
        """Every replica's value per slot, from the current bases (what each replica uses next)."""
        return [[self.spreads[j].apply(self.current_bases[j], self.offsets[j][p]) for p in self.perms[j]]
                for j in range(self.num_slots)]

    # ----------------------------------------------------------------- losses
    def observe(self, loss: torch.Tensor | float) -> None:
        """Accumulate this replica's training loss of the step just taken. No host sync."""
        if isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                raise ValueError(f"Expected a scalar loss, but got a tensor of shape {tuple(loss.shape)}")
            value = loss.detach().reshape(())
            dtype = torch.float32 if value.device.type == "mps" else torch.float64
            value = value.to(dtype)
        elif _is_real(loss):
            value = torch.tensor(float(loss), dtype=torch.float64)
        else:
            raise ValueError(f"Expected the loss as a scalar tensor or a float, but got {type(loss).__name__}")
        if self._loss_sum is None:
            self._loss_sum = value.clone()
        else:
            if self._loss_sum.device != value.device:
                self._loss_sum = self._loss_sum.to(value.device)  # once, after a load_state_dict
            self._loss_sum += value.to(self._loss_sum.dtype)
        self._loss_count += 1

    # ----------------------------------------------------------------- tensors
    def tensors(self) -> list[torch.Tensor]:
        """The tensors to average, in an order fixed by the optimizer and the model: floating-point
        parameters of the param groups, the model's persistent floating-point buffers (BatchNorm
        statistics; integer buffers such as ``num_batches_tracked`` and non-persistent buffers such as
        attention masks are left alone) and, optionally, the
        optimizer's floating-point state (except ``step``)."""
        return self._tensors()[0]

    def _tensors(self) -> tuple[list[torch.Tensor], list[bool]]:
        """The tensors to average, and per tensor whether it must be finite (parameters, optimizer
        state) or only free of NaN (buffers: a mask may hold -inf)."""
        params = self._float_params()
        out = [local_shard(p.detach()) for p in params]
        strict = [True] * len(out)
        if self.model is not None:
            buffers = _persistent_float_buffers(self.model)
            out += buffers
            strict += [False] * len(buffers)
        if self.config.average_optimizer_state:
            state = self._optimizer_state(params)
            out += state
            strict += [True] * len(state)
        return out, strict

    def _optimizer_state(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        out = []
        for p in params:
            state = self.optimizer.state.get(p, {})
            for key in sorted(state):
                v = state[key]
                if key != "step" and isinstance(v, torch.Tensor) and v.is_floating_point():
                    out.append(local_shard(v.detach()))
        return out

    def recovery_tensors(self) -> list[torch.Tensor]:
        """What a recovery averages besides :meth:`tensors`: the optimizer state (moments), unless it
        is averaged anyway. A non-finite replica's moments may be NaN; the healthy ones' are equal."""
        if self.config.average_optimizer_state:
            return []
        return self._optimizer_state(self._float_params())

    def _float_params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"] if p.is_floating_point()]

    @staticmethod
    def _layout_signature(tensors: list[torch.Tensor]) -> int:
        text = ";".join(f"{tuple(t.shape)}:{t.dtype}" for t in tensors)
        return zlib.crc32(text.encode())  # < 2**32: exact in float64

    # ----------------------------------------------------------------- the sync step
    def local_vector(self) -> torch.Tensor:
        """What this replica contributes to a sync's all_gather, on the communication device:
        ``[window loss sum, weights finite, loss count, layout hash, tensor count, seed, probe loss]``
        (the probe loss is NaN unless the fit controller runs at this sync). No host sync."""
        return self._local_vector(*self._tensors())

    def _local_vector(self, tensors: list[torch.Tensor], strict: list[bool]) -> torch.Tensor:
        dev = self.replicas.comm_device()
        finite = _all_finite(tensors, strict, dev)
        loss_sum = self._loss_sum if self._loss_sum is not None else torch.zeros((), dtype=torch.float64)
        return torch.cat([
            loss_sum.reshape(1).to(dev, torch.float64),
            finite.reshape(1).to(torch.float64),
            torch.tensor([self._loss_count, self._layout_signature(tensors), len(tensors), self.config.seed],
                         dtype=torch.float64, device=dev),
            self._probe_at_mean().reshape(1).to(dev, torch.float64),
        ])

    # ----------------------------------------------------------------- the fit controller's probe
    @property
    def probing(self) -> bool:
        return self.config.auto_lr and self.config.controller == "fit"

    @torch.no_grad()
    def accumulate(self) -> None:
        """Add this optimizer step's parameters to the window's sum (fit controller only; once per step).
        One foreach add on the parameters' devices, no host sync."""
        if not self.probing or self._polyak_fresh:
            return
        self._polyak_fresh = True
        self._t += 1  # optimizer steps taken (the fit controller's own count)
        T = self.config.sync_interval
        if -(-self._t // T) * T < self.config.auto_lr_warmup_steps:
            return  # this window ends before the controller starts: no probe, no sum
        params = [local_shard(p.detach()) for p in self._float_params()]
        if self._polyak is None:
            self._polyak = [p.to(torch.float32, copy=True) for p in params]
        else:
            torch._foreach_add_(self._polyak, [p.float() for p in params] if any(
                p.dtype != torch.float32 for p in params) else params)
        self._polyak_n += 1

    def step_done(self) -> None:
        """The scheduler's step is over: the next parameters belong to the next optimizer step."""
        self._polyak_fresh = False

    @torch.no_grad()
    def _probe_at_mean(self) -> torch.Tensor:
        """``probe(model)`` evaluated at the mean of this replica's iterates over the window (the
        parameters' storage is swapped for the mean's and back: no copy in float32), in eval mode.
        NaN when the fit controller does not run."""
        if not self.probing or self.probe is None or self.model is None:
            return torch.full((), float("nan"), dtype=torch.float64)
        self.accumulate()
        c = self.config
        if self._t % c.sync_interval or self._t < c.auto_lr_warmup_steps:  # not a control sync
            return torch.full((), float("nan"), dtype=torch.float64)
        if self._probed is not None:  # the engine asks each replica's vector more than once per sync
            return self._probed
        if self._polyak is None:
            return torch.full((), float("nan"), dtype=torch.float64)
        params = self._float_params()
        if any(p is not local_shard(p) for p in params):
            raise NotImplementedError("controller='fit' does not support sharded (FSDP2/DTensor) parameters yet")
        means = torch._foreach_div(self._polyak, float(self._polyak_n))
        means = [m if m.dtype == p.dtype else m.to(p.dtype) for m, p in zip(means, params)]
        saved = [p.data for p in params]
        model = getattr(self.model, "module", self.model)  # the module under DDP
        was_training = model.training
        try:
            for p, m in zip(params, means):
                p.data = m
            model.eval()
            loss = self.probe(model)
        finally:
            for p, d in zip(params, saved):
                p.data = d
            model.train(was_training)
        if isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                raise ValueError(f"Expected probe(model) to return a scalar loss, but got shape {tuple(loss.shape)}")
            self._probed = loss.detach().reshape(()).to(torch.float64)
        else:
            self._probed = torch.tensor(float(loss), dtype=torch.float64)
        return self._probed

    def _reset_window_mean(self) -> None:
        self._probed = None
        if self._polyak is not None:
            for s in self._polyak:
                s.zero_()
        self._polyak_n = 0

    def sync(self, t: int) -> SyncRecord:
        """Converge (and maybe control and deal) after optimizer step ``t``. Runs on every replica.

        Collectives: one all_gather of a few float64 scalars, then one all_reduce per bucket of
        flattened tensors. Host syncs: the gathered scalars are read on the host once."""
        c = self.config
        N = self.replicas.world_size
        tensors, strict = self._tensors()
        try:
            g = self.replicas.gather(self._local_vector(tensors, strict)).tolist()  # COLLECTIVE (all_gather) + HOST SYNC
        except RuntimeError as e:  # a timeout (DistBackendError), a closed connection, ...
            raise ReplicaSyncError(
                f"hdet: the converge step after optimizer step {t} failed in its first collective (all_gather): "
                f"{str(e).splitlines()[0] if str(e) else type(e).__name__}. A replica never arrived within the "
                "process group's timeout: it died, hung, or skipped scheduler.step() at this step (every replica "
                "must call it after every optimizer step)."
            ) from e
        sums, finite_r, counts, sigs, ntens, seeds, probes = (list(col) for col in zip(*g))

        if len(set(zip(sigs, ntens))) > 1:
            raise RuntimeError(
                f"At sync step {t} the replicas hold different tensors to average "
                f"(count per replica: {[int(n) for n in ntens]}, layout hashes: {[int(s) for s in sigs]}). "
                "Every replica must build the optimizer, its param groups and the model identically."
            )
        if len(set(seeds)) > 1:
            raise ValueError(f"Expected the same seed on every replica, but got {[int(s) for s in seeds]}")
        bad_loss = [r for r in range(N) if counts[r] > 0 and not math.isfinite(sums[r])]
        bad_weights = [r for r in range(N) if finite_r[r] != 1.0]
        bad = sorted(set(bad_loss) | set(bad_weights))
        if bad and (c.on_nonfinite == "raise" or len(bad) == N):
            raise NonFiniteReplicaError(
                f"At sync step {t}: non-finite window loss on replica(s) {bad_loss}, non-finite weights on "
                f"replica(s) {bad_weights}"
                + (" (every replica)" if len(bad) == N else "")
                + ". Nothing was averaged, so the other replicas are untouched."
            )

        if bad:  # Eq. 3 over the healthy replicas. COLLECTIVES: one all_reduce per bucket
            self.replicas.average_(tensors, exclude=bad)
        else:  # Eq. 3. COLLECTIVES: one all_reduce per bucket
            self.replicas.average_(tensors)
        if bad:  # recovery: the bad replicas now hold the healthy replicas' mean weights; moments too
            extra = self.recovery_tensors()
            if extra:
                self.replicas.average_(extra, exclude=bad)  # COLLECTIVES: one all_reduce per bucket
            warnings.warn(
                f"hdet: at sync step {t} replica(s) {bad} had a non-finite window loss or weights; they were "
                "left out of the average, reset to the other replicas' mean, and ranked worst by the controller",
                stacklevel=3,
            )

        losses = [sums[r] / counts[r] if counts[r] else float("nan") for r in range(N)]
        if bad:  # rank the bad replicas worst: ten loss temperatures above the worst healthy loss
            healthy = [losses[r] for r in range(N) if r not in bad and math.isfinite(losses[r])]
            worst = (max(healthy) if healthy else 0.0) + 10 * c.sigma
            losses = [worst if r in bad else x for r, x in enumerate(losses)]
        steps: list[ControllerStep] | None = None
        if c.auto_lr and t >= c.auto_lr_warmup_steps and t % c.sync_interval == 0:
            missing = [r for r in range(N) if counts[r] == 0]
            if missing:
                raise ValueError(
                    f"enable_auto_lr=True needs the training loss: call scheduler.step(loss) after each "
                    f"optimizer step; replica(s) {missing} passed no loss in the window ending at step {t}"
                )
            if c.controller == "fit":
                if self.probe is None:
                    raise ValueError("controller='fit' needs probe=: a function probe(model) -> loss on a batch that "
                                     "is the same on every replica")
                fit_losses = [float("nan") if r in bad else probes[r] for r in range(N)]  # bad: left out
                steps = self._control(fit_losses)
            else:
                steps = self._control(losses)
        if self.probing and t % c.sync_interval == 0:
            self._reset_window_mean()  # a new window starts
        record = SyncRecord(
            step=t,
            losses=losses if any(counts) else None,
            multipliers=[[self.offsets[j][p] for p in perm] for j, perm in enumerate(self.perms)],
            bases=list(self.current_bases),
            controller=steps,
            names=list(self.names),
            values=self.all_values(),
            recovered=bad,
        )
        self._loss_sum = None
        self._loss_count = 0
        self.last_sync = record
        for hook in self.on_sync:
            hook(record)
        return record

    def _control(self, losses: list[float]) -> list[ControllerStep]:
        """Eqs. 4-9 for every slot, then a fresh permutation per slot (drawn in slot order)."""
        if self.make_controller is None:
            raise RuntimeError("auto-LR is on but the scheduler gave the ensemble no controller factory")
        steps = []
        c = self.config
        for j in range(self.num_slots):
            spread = self.spreads[j]
            if self.controllers[j] is None:
                if j < self.num_lr_slots:
                    self.controllers[j] = self.make_controller(j, self.current_bases[j])
                elif c.controller == "fit":
                    self.controllers[j] = FitController(log_scale=spread.kind != "additive", **(
                        {} if spread.kind != "additive" else {"bounds": (-math.inf, math.inf)}))
                else:
                    self.controllers[j] = PaperController(beta=c.beta, sigma=c.sigma, lam=c.lam, gamma=0.0,
                                                          bounds=spread.ctrl_bounds())
            ctrl = self.controllers[j]
            assert ctrl is not None
            if isinstance(ctrl, FitController):  # x_r: log multiplier (an offset for additive spreads)
                offs = [self.offsets[j][p] for p in self.perms[j]]
                x = [math.log(o) if ctrl.log_scale else o for o in offs]
                ratio = self._scheduled[0] / self._peak0 if self._peak0 > 0 else 1.0
                weight = min(max((ratio - 0.5) / 0.5, 0.0), 1.0)  # near the peak only: see FitController
                step = ctrl.update(x, losses, weight)
                self.current_bases[j] = spread.clamp(ctrl.correct(self._scheduled[j]))  # corrected anew
                step.new_base = self.current_bases[j]
                self._deal(j)
                steps.append(step)
                continue
            values = [spread.apply(self.current_bases[j], self.offsets[j][p]) for p in self.perms[j]]  # h_r, Eq. 5
            anchor = None if j < self.num_lr_slots else spread.to_ctrl(self.current_bases[j])  # = h_bar unless clamped
            step = ctrl.update([spread.to_ctrl(v) for v in values], losses, anchor)  # Eqs. 4-7 (log space if log)
            new_base = step.new_base if j < self.num_lr_slots else spread.from_ctrl(step.new_base)
            self._controlled[j] = new_base
            self.current_bases[j] = new_base
            self._deal(j)
            steps.append(step)
        return steps

    def _deal(self, j: int) -> None:
        """Eq. 9: a fresh permutation for slot ``j`` (tied LR groups share slot 0's)."""
        if self.config.tie_lr_groups and 0 < j < self.num_lr_slots:
            self.perms[j] = list(self.perms[0])
        else:
            self.perms[j] = self.dealer.permutation(len(self.rho))

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {
            "config": asdict(self.config),
            "world_size": self.replicas.world_size,
            "rank": self.replicas.rank,
            "rho": list(self.rho),
            "perms": [list(p) for p in self.perms],
            "current_bases": list(self.current_bases),
            "controlled": list(self._controlled),
            "controllers": [c.state_dict() if c is not None else None for c in self.controllers],
            "window_mean": None if self._polyak is None else {
                "sum": [x.detach().cpu().clone() for x in self._polyak], "n": self._polyak_n},
            "fit_steps": self._t, "fit_fresh": self._polyak_fresh,
            "peak0": self._peak0,
            "scheduled": list(self._scheduled),
            "dealer": self.dealer.state_dict(),
            "loss_sum": None if self._loss_sum is None else self._loss_sum.detach().cpu().clone(),
            "loss_count": self._loss_count,
            "total_steps": self.total_steps,
            "names": list(self.names),
        }

    _STATE_KEYS = ("config", "world_size", "rank", "rho", "perms", "current_bases", "controlled", "controllers",
                   "dealer", "loss_sum", "loss_count", "total_steps")

    def _check_state(self, state: Any) -> None:
        if not isinstance(state, dict):
            raise ValueError(f"Expected an hdet ensemble state (a dict), but got {type(state).__name__}")
        missing = [k for k in self._STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"Expected an hdet ensemble state with keys {list(self._STATE_KEYS)}, but it lacks "
                             f"{missing}: a corrupted or foreign state_dict")
        W = state["world_size"]
        n = len(state["perms"]) if isinstance(state["perms"], list) else -1
        ok = (isinstance(W, int) and W >= 1 and isinstance(state["rho"], list) and len(state["rho"]) == W
              and all(isinstance(p, list) and sorted(p) == list(range(W)) for p in state["perms"])
              and all(isinstance(x, list) and len(x) == n for x in (state["current_bases"], state["controlled"],
                                                                   state["controllers"]))
              and all(isinstance(x, (int, float)) and math.isfinite(x) for x in state["rho"] + state["current_bases"]))
        if not ok:
            raise ValueError("Expected an hdet ensemble state whose world_size, rho, perms (permutations of the "
                             "replicas), bases and controllers agree, but they do not: a corrupted state_dict")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a saved state. Saved with another number of replicas (elastic resume), the bases,
        velocities and controllers are kept, the multipliers are re-dealt for this number, the current
        loss window is dropped, and a warning says so."""
        self._check_state(state)
        N = self.replicas.world_size
        elastic = state["world_size"] != N
        names = state.get("names", self.names[: len(state["perms"])])
        if len(state["perms"]) != self.num_slots or list(names) != self.names:
            raise ValueError(
                f"Expected a state for the explored slots {self.names}, but got one for {list(names)}"
            )
        if not elastic and state["rank"] != self.replicas.rank and state["loss_count"]:
            warnings.warn(
                f"Loading replica {state['rank']}'s HDET state into replica {self.replicas.rank} in the middle "
                "of a window: the window's loss accumulator is not this replica's. Save each rank's "
                "scheduler state, or save at a sync step.",
                stacklevel=3,
            )
        config = HDETConfig(**{"controller": "paper", **state["config"]})  # states before "fit" existed: the paper's
        config.validate()
        self.config = config
        n_lr = self.num_lr_slots
        self.rho = linear_multipliers(N, config.alpha) if elastic else [float(x) for x in state["rho"]]
        self.spreads[:n_lr] = [Spread("linear", config.alpha)] * n_lr
        self.offsets[:n_lr] = [list(self.rho)] * n_lr
        self.offsets[n_lr:] = [sp.offsets(N) for sp in self.spreads[n_lr:]]
        self.current_bases = [float(x) for x in state["current_bases"]]
        self._controlled = [None if x is None else float(x) for x in state["controlled"]]
        self.controllers = []
        for cs in state["controllers"]:
            if cs is None:
                self.controllers.append(None)
            else:
                ctrl = FitController() if cs.get("kind") == "fit" else PaperController()
                ctrl.load_state_dict(cs)
                self.controllers.append(ctrl)
        self._peak0 = float(state.get("peak0", 0.0))
        self._scheduled = [float(x) for x in state.get("scheduled", self._scheduled)]
        wm = state.get("window_mean")
        self._t, self._polyak_fresh, self._probed = int(state.get("fit_steps", 0)), bool(state.get("fit_fresh")), None
        if wm is None or elastic:
            self._polyak, self._polyak_n = None, 0
        else:
            devs = [p.device for p in self._float_params()]
            if len(wm["sum"]) != len(devs):
                raise ValueError(f"Expected a window mean of {len(devs)} tensors, but the state holds {len(wm['sum'])}")
            self._polyak = [x.to(d) for x, d in zip(wm["sum"], devs)]
            self._polyak_n = int(wm["n"])
        self.dealer.load_state_dict(state["dealer"])
        self.total_steps = state["total_steps"]
        if elastic:  # Eq. 9 for the new N: a fresh permutation per slot from the (restored) shared dealer
            for j in range(self.num_slots):
                self._deal(j)
            self._loss_sum, self._loss_count = None, 0
            warnings.warn(
                f"hdet: elastic resume from {state['world_size']} to {N} replicas: kept the bases and controller "
                f"velocities, re-dealt the multipliers for {N}, dropped the current loss window", stacklevel=3)
        else:
            self.perms = [[int(i) for i in p] for p in state["perms"]]
            self._loss_sum = None if state["loss_sum"] is None else state["loss_sum"].clone()
            self._loss_count = int(state["loss_count"])
