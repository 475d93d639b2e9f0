"""One HDET ensemble: observe losses -> at a sync step: converge (Eq. 3), control (Eqs. 4-8), deal (Eq. 9).

The ensemble explores one scalar per "slot": the learning rate of each optimizer param group (paper
section 3.4), then any extra :class:`~hdet.hyper.Hyperparameter` (Remark 1). Slot ``j`` has a base
value, a :class:`~hdet.hyper.Spread`, a permutation ``pi_j`` (replica ``r`` takes position ``pi_j[r]``
of the spread) and, once the controller has started, a controller: the paper's owns the slot's base
value; hdet's ``"fit"`` controller corrects the base schedule by a factor (an offset for additive
spreads) and ranks replicas by a probe loss at the mean of their iterates over the window.
"""

from __future__ import annotations

import json
import math
import numbers
import warnings
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from .controller import CONTROLLERS, ControllerStep, FitController, PaperController
from .hyper import Hyperparameter, Spread
from .replicas import Replicas, ReplicaSyncError, local_shard
from .spread import Dealer, check_alpha, linear_multipliers

__all__ = ["HDETConfig", "Ensemble", "NonFiniteReplicaError", "ReplicaSyncError", "ReplicaMismatchError",
           "SyncRecord", "STATE_VERSION"]

STATE_VERSION = 2  # of Ensemble.state_dict(); 1: before the version field (hdet <= 0.1 sessions 1-13)


class ReplicaMismatchError(RuntimeError):
    """At a converge step the replicas disagree on what they are: a different step, sync interval,
    total_steps, configuration or tensor layout (e.g. one rank resumed from an older checkpoint)."""


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
        """Check every field; numpy scalars become Python numbers."""
        self.alpha = check_alpha(self.alpha)
        self.sync_interval = _check_int("model_sync_interval", self.sync_interval, lo=1)
        self.auto_lr = _check_bool("enable_auto_lr", self.auto_lr)
        self.average_optimizer_state = _check_bool("average_optimizer_state", self.average_optimizer_state)
        self.tie_lr_groups = _check_bool("tie_lr_groups", self.tie_lr_groups)
        self.auto_lr_warmup_steps = _check_int("auto_lr_warmup_steps", self.auto_lr_warmup_steps, lo=0)
        if not _is_real(self.sigma) or not self.sigma > 0 or not math.isfinite(self.sigma):
            raise ValueError(f"Expected loss_scale (sigma) > 0, but got {self.sigma!r}")
        if not _is_real(self.lam) or not self.lam >= 0 or not math.isfinite(self.lam):
            raise ValueError(f"Expected lr_of_lr (lambda) >= 0, but got {self.lam!r}")
        if not _is_real(self.beta) or not 0.0 <= self.beta < 1.0:
            raise ValueError(f"Expected 0 <= momentum_of_lr (beta) < 1, but got {self.beta!r}")
        self.sigma, self.lam, self.beta = float(self.sigma), float(self.lam), float(self.beta)
        if self.eq8 not in ("decay", "as_printed"):
            raise ValueError(f"Expected eq8 to be 'decay' or 'as_printed', but got {self.eq8!r}")
        self.seed = _check_int("seed", self.seed, lo=0)
        if self.controller not in CONTROLLERS:
            raise ValueError(f"Expected controller in {CONTROLLERS}, but got {self.controller!r}")
        if self.on_nonfinite not in ("recover", "raise"):
            raise ValueError(f"Expected on_nonfinite to be 'recover' or 'raise', but got {self.on_nonfinite!r}")

    def fingerprint(self) -> int:
        """A hash of every setting, exchanged at each sync: replicas built differently are an error."""
        return zlib.crc32(json.dumps(asdict(self), sort_keys=True).encode())  # < 2**32: exact in float64


def _is_real(x: Any) -> bool:
    """A real number, numpy scalars included (they register as ``numbers.Real``); not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_bool(name: str, value: Any) -> bool:
    """``value`` as a bool (a numpy bool included), or a ValueError naming ``name``."""
    item = value.item() if hasattr(value, "item") and getattr(value, "shape", None) == () else value
    if not isinstance(item, bool):
        raise ValueError(f"Expected {name} to be a bool, but got {value!r}")
    return item


def _check_int(name: str, value: Any, lo: int) -> int:
    """``value`` as an int (numpy integers included), or a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < lo:
        raise ValueError(f"Expected integer {name} >= {lo}, but got {value!r}")
    return int(value)


def _averaged(t: torch.Tensor) -> bool:
    """Whether a tensor is averaged at a converge step: floating point, or complex (as a real view)."""
    return t.is_floating_point() or t.is_complex()


def _as_real(t: torch.Tensor) -> torch.Tensor:
    """A complex tensor as a real ``[..., 2]`` view of the same memory (averaged and checked in place)."""
    return torch.view_as_real(t) if t.is_complex() else t


def _persistent_float_buffers(model: nn.Module) -> list[torch.Tensor]:
    out, seen = [], set()
    for mod in model.modules():
        for name, b in mod._buffers.items():
            if b is None or name in mod._non_persistent_buffers_set or not _averaged(b) or id(b) in seen:
                continue
            seen.add(id(b))
            out.append(_as_real(b.detach()))
    return out


def _health(tensors: list[torch.Tensor], strict: list[bool], dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """On ``dev``: (every ``strict`` tensor is finite and no tensor holds a NaN or +Inf, the number of -Inf
    elements in the non-strict tensors (buffers)). A buffer may hold -inf by design (a persistent
    attention mask), so its -Inf count is compared across replicas at the sync instead; +Inf (a BatchNorm
    variance gone to infinity) is a fault everywhere. No host sync (one small copy per device)."""
    by_device: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for x, must_be_finite in zip(tensors, strict):
        oks, infs = by_device.setdefault(x.device, ([], []))
        if must_be_finite:
            oks.append(torch.isfinite(x).all())
        else:
            oks.append(~(torch.isnan(x) | torch.isposinf(x)).any())
            infs.append(torch.isneginf(x).sum())
    ok = torch.ones((), dtype=torch.bool, device=dev)
    inf = torch.zeros((), dtype=torch.float64, device=dev)
    for oks, infs in by_device.values():
        ok = ok & torch.stack(oks).all().to(dev)
        if infs:
            inf = inf + torch.stack(infs).sum().to(dev, torch.float64)
    return ok, inf


# The vector each replica contributes to a sync's all_gather (float64), by column.
(V_LOSS_SUM, V_LOSS_N, V_OBSERVED, V_FINITE, V_BUF_INF, V_LAYOUT, V_NTENSORS, V_SEED, V_PROBE, V_STEP, V_T,
 V_TOTAL, V_CONFIG) = range(13)
SHARD_SUM = (V_LOSS_SUM, V_LOSS_N, V_OBSERVED, V_BUF_INF)  # FSDP2/HSDP: summed over one replica's shard ranks
SHARD_MIN = (V_FINITE,)  # ... and AND-ed (min) over them


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
    recovered: list[int] = field(default_factory=list)  # replicas with non-finite weights, reset to the others' mean
    nonfinite_losses: list[int] = field(default_factory=list)  # per replica: non-finite losses in the window


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
        self._window: list[torch.Tensor] = []  # this window's losses (copies), not yet reduced
        self._loss_sum: torch.Tensor | None = None  # sum of the window's finite losses so far, on the loss's device
        self._loss_n: torch.Tensor | None = None  # how many of them were finite (on the device: no host sync)
        self._loss_count = 0  # losses observed in the window (finite or not)
        # controller="fit": probe(model) -> loss on a batch every replica sees; the window's iterate sum
        self.probe: Probe | None = None
        self._polyak: list[torch.Tensor] | None = None  # float32 sum of the parameters after each step
        self._polyak_n = 0
        self._polyak_fresh = False  # this optimizer step's parameters are in the sum already
        self._probed: torch.Tensor | None = None  # this window's probe loss, once computed
        self._t = 0  # optimizer steps taken, counted by accumulate() (fit controller only)
        self._peak0 = 0.0  # the largest scheduled base of slot 0 so far (the fit controller's weight)
        self._scheduled: list[float] = [0.0] * self.num_slots  # the base schedules' values now
        if self.probing and any(p.is_complex() for p in self._params()):
            raise ValueError("controller='fit' does not support complex parameters (its probe averages real "
                             "iterates); use controller='paper' or auto-LR off")

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
        """Keep this replica's training loss of the step just taken for the window: one copy on its device
        (so a loss tensor reused in place, or a CUDA-graph output, keeps this step's value), no host sync; the
        sync reduces the window."""
        if isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                raise ValueError(f"Expected a scalar loss, but got a tensor of shape {tuple(loss.shape)}")
            self._window.append(loss.detach().clone())
        elif _is_real(loss):
            self._window.append(torch.tensor(float(loss), dtype=torch.float64))
        else:
            raise ValueError(f"Expected the loss as a scalar tensor or a float, but got {type(loss).__name__}")
        self._loss_count += 1

    def _fold_window(self) -> None:
        """Reduce the kept losses into the window's sum of finite losses and their count (a non-finite loss is
        counted, not summed: a handled fault), on the losses' device: one stack and a few small ops, at a sync
        or a save only."""
        if not self._window:
            return
        w, self._window = self._window, []
        dev = w[0].device
        dtype = torch.float32 if dev.type == "mps" else torch.float64
        if all(x.device == dev and x.dtype == w[0].dtype for x in w):
            vals = torch.stack([x.reshape(()) for x in w]).to(dtype)  # one kernel for the whole window
        else:
            vals = torch.stack([x.reshape(()).to(dev, dtype) for x in w])
        finite = torch.isfinite(vals)
        s = torch.where(finite, vals, torch.zeros_like(vals)).sum()
        n = finite.sum().to(dtype)
        if self._loss_sum is None or self._loss_n is None:
            self._loss_sum, self._loss_n = s, n
        else:  # a window restored from a state_dict, continued
            self._loss_sum = self._loss_sum.to(dev, dtype) + s
            self._loss_n = self._loss_n.to(dev, dtype) + n

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
        params = self._params()
        out = [_as_real(local_shard(p.detach())) for p in params]
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
                if key != "step" and isinstance(v, torch.Tensor) and _averaged(v):
                    out.append(_as_real(local_shard(v.detach())))
        return out

    def recovery_tensors(self) -> list[torch.Tensor]:
        """What a recovery averages besides :meth:`tensors`: the optimizer state (moments), unless it
        is averaged anyway. A non-finite replica's moments may be NaN; the healthy ones' are equal. (The
        fit controller's window sums are left alone: a reset replica's is NaN until the window ends, so its
        probe is left out of that one fit, and the healthy replicas keep their own signal.)"""
        if self.config.average_optimizer_state:
            return []
        return self._optimizer_state(self._params())

    def _params(self) -> list[torch.Tensor]:
        """The parameters averaged at a converge step: floating point and complex."""
        return [p for g in self.optimizer.param_groups for p in g["params"] if _averaged(p)]

    def _float_params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"] if p.is_floating_point()]

    @staticmethod
    def _layout_signature(tensors: list[torch.Tensor]) -> int:
        text = ";".join(f"{tuple(t.shape)}:{t.dtype}" for t in tensors)
        return zlib.crc32(text.encode())  # < 2**32: exact in float64

    # ----------------------------------------------------------------- the sync step
    def local_vector(self, t: int) -> torch.Tensor:
        """What this replica contributes to the all_gather of the sync after optimizer step ``t``, on the
        communication device: the columns ``V_*`` (window loss sum over finite losses, their count, losses
        observed, weights finite, buffer Inf count, layout hash, tensor count, seed, probe loss (NaN unless
        the fit controller runs at this sync), step, T, total_steps, config fingerprint). No host sync."""
        return self._local_vector(*self._tensors(), t)

    def _local_vector(self, tensors: list[torch.Tensor], strict: list[bool], t: int) -> torch.Tensor:
        self._fold_window()
        dev = self.replicas.comm_device()
        finite, buf_inf = _health(tensors, strict, dev)
        zero = torch.zeros((), dtype=torch.float64)
        loss_sum = self._loss_sum if self._loss_sum is not None else zero
        loss_n = self._loss_n if self._loss_n is not None else zero
        c = self.config
        return torch.cat([
            loss_sum.reshape(1).to(dev, torch.float64),
            loss_n.reshape(1).to(dev, torch.float64),
            torch.tensor([self._loss_count], dtype=torch.float64, device=dev),
            finite.reshape(1).to(torch.float64),
            buf_inf.reshape(1),
            torch.tensor([self._layout_signature(tensors), len(tensors), c.seed], dtype=torch.float64, device=dev),
            self._probe_at_mean().reshape(1).to(dev, torch.float64),
            torch.tensor([t, c.sync_interval, -1 if self.total_steps is None else self.total_steps, c.fingerprint()],
                         dtype=torch.float64, device=dev),
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

    def _exchange(self, t: int, tensors: list[torch.Tensor], strict: list[bool]) -> list[list[float]]:
        """The sync's all_gather of every replica's vector (columns ``V_*``), checked for agreement."""
        local = self._local_vector(tensors, strict, t)  # may run the user's probe: its errors stay its own
        try:
            g = self.replicas.gather(local, shard_sum=SHARD_SUM, shard_min=SHARD_MIN).tolist()  # COLLECTIVE (all_gather) + HOST SYNC
        except ReplicaSyncError as e:
            raise ReplicaSyncError(f"hdet: the converge step after optimizer step {t} failed in its first "
                                   f"collective (all_gather): {e}") from e
        col = [list(x) for x in zip(*g)]
        self._check_agreement(t, col)
        return col

    def _converge(self, t: int, tensors: list[torch.Tensor], col: list[list[float]], everyone: bool = True) -> list[int]:
        """Eq. 3, leaving out replicas with non-finite weights or buffers, which receive the others' mean
        (weights, buffers and optimizer moments). ``everyone=False`` (an early recovery): nothing is
        averaged when no replica is bad. Returns the bad replicas."""
        c = self.config
        N = self.replicas.world_size
        buf_inf = col[V_BUF_INF]
        bad = [r for r in range(N) if col[V_FINITE][r] != 1.0 or buf_inf[r] > min(buf_inf)]  # weights, buffers
        bad_loss = [r for r in range(N) if col[V_OBSERVED][r] > col[V_LOSS_N][r]]
        if ((bad or (bad_loss and everyone)) and c.on_nonfinite == "raise") or len(bad) == N:
            raise NonFiniteReplicaError(
                f"At sync step {t}: non-finite training losses on replica(s) {bad_loss}, non-finite weights on "
                f"replica(s) {bad} (parameters or buffers)"
                + (" (every replica)" if len(bad) == N else "")
                + ". Nothing was averaged, so the other replicas are untouched."
            )
        if everyone or bad:  # Eq. 3 (over the healthy replicas). COLLECTIVES: one all_reduce per bucket
            self._average(t, tensors, exclude=bad)
        if bad:  # recovery: the bad replicas now hold the healthy replicas' mean weights; moments too
            extra = self.recovery_tensors()
            if extra:
                self._average(t, extra, exclude=bad)  # COLLECTIVES: one all_reduce per bucket
            warnings.warn(
                f"hdet: at {'sync' if everyone else 'an early recovery at'} step {t} replica(s) {bad} had non-finite "
                "weights or buffers; they were left out of the average, reset to the other replicas' mean, and ranked "
                "worst by the controller",
                stacklevel=4,
            )
        return bad

    def recover(self, t: int) -> list[int]:
        """An early converge between syncs, for replicas with non-finite weights or buffers (the scheduler
        calls it when the skip guard skipped every step of a stretch: one NaN weight on one replica would
        otherwise freeze every replica until the next sync). The healthy replicas are averaged and the bad
        ones reset to their mean; the loss window and the controller are left alone. Returns the bad
        replicas (none: nothing was averaged). Collectives as :meth:`sync`."""
        tensors, strict = self._tensors()
        return self._converge(t, tensors, self._exchange(t, tensors, strict), everyone=False)

    def sync(self, t: int) -> SyncRecord:
        """Converge (and maybe control and deal) after optimizer step ``t``. Runs on every replica.

        Collectives: one all_gather of a few float64 scalars, then one all_reduce per bucket of
        flattened tensors. Host syncs: the gathered scalars are read on the host once."""
        c = self.config
        N = self.replicas.world_size
        tensors, strict = self._tensors()
        try:
            col = self._exchange(t, tensors, strict)
        finally:
            self._loss_sum, self._loss_n, self._loss_count, self._window = None, None, 0, []  # a new window, whatever happens
        bad = self._converge(t, tensors, col)
        sums, n_finite, observed = col[V_LOSS_SUM], col[V_LOSS_N], col[V_OBSERVED]
        nonfinite_losses = [int(observed[r] - n_finite[r]) for r in range(N)]
        bad_loss = [r for r in range(N) if nonfinite_losses[r] > 0]
        healthy_loss = [r for r in bad_loss if r not in bad]
        if healthy_loss:
            warnings.warn(
                f"hdet: at sync step {t} replica(s) {healthy_loss} had non-finite training losses "
                f"({[nonfinite_losses[r] for r in healthy_loss]} in the window) but finite weights (a step the "
                "gradient guard skipped, or a bad batch): counted in sched.last_sync.nonfinite_losses, ranked "
                "worst by the controller; training goes on",
                stacklevel=3,
            )

        losses = [sums[r] / n_finite[r] if n_finite[r] else float("nan") for r in range(N)]
        worst_ranked = set(bad) | set(bad_loss)
        if worst_ranked:  # rank them worst: ten loss temperatures above the worst healthy loss
            healthy = [losses[r] for r in range(N) if r not in worst_ranked and math.isfinite(losses[r])]
            worst = (max(healthy) if healthy else 0.0) + 10 * c.sigma
            losses = [worst if r in worst_ranked else x for r, x in enumerate(losses)]
        counts = observed
        probes = col[V_PROBE]
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
            nonfinite_losses=nonfinite_losses,
        )
        self.last_sync = record
        for hook in self.on_sync:
            hook(record)
        return record

    def _average(self, t: int, tensors: list[torch.Tensor], exclude: list[int] | None = None) -> None:
        """Eq. 3 through the replicas; a failed collective names the step."""
        try:
            self.replicas.average_(tensors, exclude=exclude or ())
        except ReplicaSyncError as e:
            raise ReplicaSyncError(f"hdet: the converge step after optimizer step {t} failed while averaging: "
                                   f"{e}") from e

    def _check_agreement(self, t: int, col: list[list[float]]) -> None:
        """Every replica must be at the same step of the same run: same layout, seed, step, T, total_steps
        and settings. Averaging replicas that disagree would be silently wrong."""
        if len(set(zip(col[V_LAYOUT], col[V_NTENSORS]))) > 1:
            raise ReplicaMismatchError(
                f"At sync step {t} the replicas hold different tensors to average "
                f"(count per replica: {[int(n) for n in col[V_NTENSORS]]}, layout hashes: "
                f"{[int(x) for x in col[V_LAYOUT]]}). Every replica must build the optimizer, its param groups and "
                "the model identically."
            )
        if len(set(col[V_SEED])) > 1:
            raise ValueError(f"Expected the same seed on every replica, but got {[int(x) for x in col[V_SEED]]}")
        fields = {"optimizer steps": V_STEP, "model_sync_interval": V_T, "total_steps": V_TOTAL,
                  "settings fingerprints": V_CONFIG}
        differ = {name: [int(x) for x in col[i]] for name, i in fields.items() if len(set(col[i])) > 1}
        if differ:
            raise ReplicaMismatchError(
                f"At the converge step after optimizer step {t} the replicas disagree: "
                + "; ".join(f"{name} per replica {v}" for name, v in differ.items())
                + ". Nothing was averaged. Every replica must be built with the same settings and resume from "
                "the same checkpoint step."
            )

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
        """Plain data (numbers, strings, lists, dicts, CPU tensors): loads with ``torch.load(weights_only=True)``."""
        self._fold_window()
        return {
            "version": STATE_VERSION,
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
            "loss_n": None if self._loss_n is None else self._loss_n.detach().cpu().clone(),
            "loss_count": self._loss_count,
            "total_steps": self.total_steps,
            "names": list(self.names),
        }

    _STATE_KEYS = ("config", "world_size", "rank", "rho", "perms", "current_bases", "controlled", "controllers",
                   "dealer", "loss_sum", "loss_count", "total_steps")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a saved state. Everything is checked first; a state that is corrupted, foreign, or from a
        newer hdet gets a ValueError that says why, and nothing is changed. Saved with another number of
        replicas (elastic resume), the bases, velocities and controllers are kept, the multipliers are
        re-dealt for this number, the current loss window is dropped, and a warning says so."""
        self.commit_state(self.check_state(state), state)

    def check_state(self, state: Any) -> dict[str, Any]:
        """Check a saved state completely, change nothing; returns what :meth:`commit_state` sets."""
        return self._parse_state(state)

    def commit_state(self, new: dict[str, Any], state: dict[str, Any]) -> None:
        """Set a state checked by :meth:`check_state` (cannot fail)."""
        new = dict(new)
        elastic = new.pop("elastic")
        if not elastic and state["rank"] != self.replicas.rank and state["loss_count"]:
            warnings.warn(
                f"Loading replica {state['rank']}'s HDET state into replica {self.replicas.rank} in the middle "
                "of a window: the window's loss accumulator is not this replica's. Save each rank's "
                "scheduler state, or save at a sync step.",
                stacklevel=3,
            )
        self.__dict__.update(new)
        n_lr = self.num_lr_slots
        self.spreads[:n_lr] = [Spread("linear", self.config.alpha)] * n_lr
        self.offsets[:n_lr] = [list(self.rho)] * n_lr
        self.offsets[n_lr:] = [sp.offsets(self.replicas.world_size) for sp in self.spreads[n_lr:]]
        if elastic:  # Eq. 9 for the new N: a fresh permutation per slot from the (restored) shared dealer
            for j in range(self.num_slots):
                self._deal(j)
            warnings.warn(
                f"hdet: elastic resume from {state['world_size']} to {self.replicas.world_size} replicas: kept the "
                f"bases and controller velocities, re-dealt the multipliers for {self.replicas.world_size}, dropped "
                "the current loss window", stacklevel=3)

    def _parse_state(self, state: Any) -> dict[str, Any]:
        """The attributes a saved state sets, all checked; raises ValueError and changes nothing."""
        if not isinstance(state, dict):
            raise ValueError(f"Expected an hdet ensemble state (a dict), but got {type(state).__name__}")
        version = state.get("version", 1)
        if not isinstance(version, int) or version < 1:
            raise ValueError(f"Expected an hdet ensemble state version >= 1, but got {version!r}: a corrupted state")
        if version > STATE_VERSION:
            raise ValueError(f"Expected an hdet ensemble state of version <= {STATE_VERSION}, but got version "
                             f"{version}: it was saved by a newer hdet; upgrade hdet to load it")
        missing = [k for k in self._STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"Expected an hdet ensemble state with keys {list(self._STATE_KEYS)}, but it lacks "
                             f"{missing}: a corrupted or foreign state_dict")
        try:
            return self._parse_fields(state)
        except ValueError:
            raise
        except (KeyError, TypeError, AttributeError, IndexError, RuntimeError) as e:
            raise ValueError(f"Expected a well-formed hdet ensemble state, but reading it failed "
                             f"({type(e).__name__}: {e}): a corrupted state_dict") from e

    def _parse_fields(self, state: dict[str, Any]) -> dict[str, Any]:
        cfg = state["config"]
        if not isinstance(cfg, dict):
            raise ValueError(f"Expected the state's config as a dict, but got {type(cfg).__name__}")
        unknown = sorted(set(cfg) - set(HDETConfig.__dataclass_fields__))
        if unknown:
            raise ValueError(f"Expected the settings of this hdet ({sorted(HDETConfig.__dataclass_fields__)}), but the "
                             f"state also has {unknown}: it was saved by a newer hdet, or is corrupted")
        config = HDETConfig(**{"controller": "paper", **cfg})  # states before "fit" existed: the paper's
        config.validate()
        N, W = self.replicas.world_size, state["world_size"]
        if isinstance(W, bool) or not isinstance(W, int) or W < 1:
            raise ValueError(f"Expected the state's world_size as a positive integer, but got {W!r}")
        rank = state["rank"]
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < W:
            raise ValueError(f"Expected the state's rank in [0, {W}), but got {rank!r}")
        rho = state["rho"]
        want = linear_multipliers(W, config.alpha)
        if (not isinstance(rho, list) or len(rho) != W or not all(_is_real(x) for x in rho)
                or any(abs(float(x) - y) > 1e-9 for x, y in zip(rho, want))):
            raise ValueError(f"Expected the state's rho to be Eq. 1's multipliers for {W} replicas at alpha "
                             f"{config.alpha} ({want}), but got {rho!r}: a corrupted state_dict")
        perms = state["perms"]
        names = list(state.get("names", self.names[: len(perms) if isinstance(perms, list) else 0]))
        if not isinstance(perms, list) or len(perms) != self.num_slots or names != self.names:
            raise ValueError(f"Expected a state for the explored slots {self.names}, but got one for {names}")
        if not all(isinstance(p, list) and sorted(p) == list(range(W)) for p in perms):
            raise ValueError(f"Expected the state's perms to be permutations of range({W}), but got {perms!r}: "
                             "a corrupted state_dict")
        lists = {k: state[k] for k in ("current_bases", "controlled", "controllers")}
        if not all(isinstance(x, list) and len(x) == self.num_slots for x in lists.values()):
            raise ValueError(f"Expected current_bases, controlled and controllers with one entry per slot "
                             f"({self.num_slots}), but they do not: a corrupted state_dict")
        bases = state["current_bases"]
        if not all(_is_real(x) and math.isfinite(x) for x in bases):
            raise ValueError(f"Expected finite base values in the state, but got {bases!r}: a corrupted state_dict")
        controlled = state["controlled"]
        if not all(x is None or (_is_real(x) and math.isfinite(x)) for x in controlled):
            raise ValueError(f"Expected None or finite values in the state's 'controlled', but got {controlled!r}: "
                             "a corrupted state_dict")
        controllers: list[Controller | None] = []
        for cs in state["controllers"]:
            if cs is None:
                controllers.append(None)
                continue
            ctrl = FitController() if cs.get("kind") == "fit" else PaperController()
            ctrl.load_state_dict(cs)
            controllers.append(ctrl)
        dealer = Dealer(0)
        dealer.load_state_dict(state["dealer"])
        total = state["total_steps"]
        if total is not None and (isinstance(total, bool) or not isinstance(total, int) or total < 1):
            raise ValueError(f"Expected the state's total_steps as a positive integer, but got {total!r}")
        count = state["loss_count"]
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"Expected the state's loss_count as an integer >= 0, but got {count!r}")
        loss_sum, loss_n = state["loss_sum"], state.get("loss_n")
        for name, x in (("loss_sum", loss_sum), ("loss_n", loss_n)):
            if x is not None and (not isinstance(x, torch.Tensor) or x.numel() != 1):
                raise ValueError(f"Expected the state's {name} as None or a scalar tensor, but got {x!r}")
        if loss_sum is not None and loss_n is None:  # version 1: every observed loss was summed
            loss_n = torch.tensor(float(count), dtype=loss_sum.dtype)
        elastic = W != N
        new: dict[str, Any] = {
            "elastic": elastic, "config": config, "rho": linear_multipliers(N, config.alpha) if elastic else want,
            "current_bases": [float(x) for x in bases],
            "_controlled": [None if x is None else float(x) for x in controlled],
            "controllers": controllers, "dealer": dealer, "total_steps": total,
            "_peak0": float(state.get("peak0", 0.0)),
            "_scheduled": [float(x) for x in state.get("scheduled", self._scheduled)],
            "_t": int(state.get("fit_steps", 0)), "_polyak_fresh": bool(state.get("fit_fresh")), "_probed": None,
            "_polyak": None, "_polyak_n": 0,
        }
        if len(new["_scheduled"]) != self.num_slots:
            raise ValueError(f"Expected one scheduled value per slot ({self.num_slots}), but got {new['_scheduled']}")
        wm = state.get("window_mean")
        if wm is not None and not elastic:
            params = self._float_params()
            sums = wm["sum"]
            if len(sums) != len(params) or any(tuple(x.shape) != tuple(local_shard(p).shape)
                                               for x, p in zip(sums, params)):
                raise ValueError(f"Expected a window mean of {len(params)} tensors shaped like the parameters, but the "
                                 f"state holds {len(sums)} that do not match")
            new["_polyak"] = [x.to(p.device) for x, p in zip(sums, params)]
            new["_polyak_n"] = int(wm["n"])
        if elastic:
            new.update(perms=[list(range(N)) for _ in range(self.num_slots)], _loss_sum=None, _loss_n=None,
                       _loss_count=0, _window=[])
        else:
            new.update(perms=[[int(i) for i in p] for p in perms],
                       _loss_sum=None if loss_sum is None else loss_sum.clone().reshape(()),
                       _loss_n=None if loss_n is None else loss_n.clone().reshape(()),
                       _loss_count=count, _window=[])
        return new
