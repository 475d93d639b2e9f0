"""What one replica remembers between two syncs: its training losses (:class:`LossWindow`) and, for the
fit controller, the mean of its iterates (:class:`WindowMean`) with the probe evaluated there.

Neither talks to other replicas; neither reads a value on the host (no host sync).
"""

from __future__ import annotations

import contextlib
import numbers
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .caller import user_stacklevel
from .replicas import local_shard, reshard_fsdp

__all__ = ["LossWindow", "WindowMean", "Probe"]

Probe = Callable[[nn.Module], "torch.Tensor | float"]


@contextlib.contextmanager
def eval_mode(module: nn.Module) -> Iterator[None]:
    """``module.eval()`` inside, and every submodule's own mode back after: ``module.train(was)`` alone would set
    every submodule to the root's mode, and so turn a submodule the user keeps in eval mode (frozen BatchNorm
    statistics) back to training. ``train(was)`` still runs first, so that a module whose ``train``/``eval`` do more
    than set the flag (a LoRA layer merging its adapter in eval mode) undoes it; then each flag that differs from
    before is set back."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        module.train(modes[0][1])
        for m, training in modes:
            if m.training != training:
                m.training = training

class LossWindow:
    """This replica's training losses since the last sync: one copy per step on the loss's device (so a loss
    tensor reused in place, or a CUDA-graph output, keeps its step's value), reduced at the sync."""

    def __init__(self) -> None:
        self._kept: list[torch.Tensor] = []  # this window's losses, not yet reduced
        self.sum: torch.Tensor | None = None  # sum of the reduced finite losses
        self.finite: torch.Tensor | None = None  # how many of them were finite
        self.sq: torch.Tensor | None = None  # sum of their squares (the window's noise, hdet.stability)
        self.empty: torch.Tensor | None = None  # how many finite ones measured nothing (``counted`` False)
        self._counted: list[Any] = []  # each kept loss's ``counted`` (True, or a bool tensor on the device)
        self.count = 0  # losses observed (finite or not)

    def observe(self, loss: torch.Tensor | float, counted: torch.Tensor | bool = True) -> None:
        """Keep one step's loss. ``counted`` False (or a bool tensor, on the device: no host read) for a step that
        measured nothing (no label token on this rank: the Hugging Face Trainer's loss is 0 there): left out of the
        mean, and not taken for a non-finite loss (a non-finite one still is)."""
        if isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                raise ValueError(f"Expected a scalar loss, but got a tensor of shape {tuple(loss.shape)}")
            kept = loss.detach().clone()
        elif isinstance(loss, numbers.Real) and not isinstance(loss, bool):
            kept = torch.tensor(float(loss), dtype=torch.float64)
        else:
            raise ValueError(f"Expected the loss as a scalar tensor or a float, but got {type(loss).__name__}")
        if not (isinstance(counted, bool) or isinstance(counted, torch.Tensor) and counted.numel() == 1
                and counted.dtype == torch.bool):
            raise ValueError(f"Expected counted= as a bool or a one-element bool tensor, but got {counted!r}")
        self._kept.append(kept)
        self._counted.append(counted if isinstance(counted, bool) else counted.detach().clone())  # (copied as the
        # loss is: a flag buffer written again at every step gave each kept step the last step's flag; a review)
        self.count += 1

    def keep(self, loss: torch.Tensor) -> None:
        """:meth:`observe` without the copy, for a scalar tensor nobody writes again (the engine's own copy of
        its N losses: one copy a step instead of N)."""
        self._kept.append(loss)
        self._counted.append(True)
        self.count += 1

    def fold(self) -> None:
        """Reduce the kept losses into :attr:`sum` (finite ones) and :attr:`finite` (their count), on the
        losses' device: one stack and a few small ops. A non-finite loss is counted, not summed."""
        if not self._kept:
            return
        w, self._kept = self._kept, []
        counted, self._counted = self._counted, []
        dev = w[0].device
        dtype = torch.float32 if dev.type == "mps" else torch.float64
        if all(x.device == dev and x.dtype == w[0].dtype for x in w):
            vals = torch.stack([x.reshape(()) for x in w]).to(dtype)  # one kernel for the whole window
        else:
            vals = torch.stack([x.reshape(()).to(dev, dtype) for x in w])
        ok = torch.isfinite(vals)
        empty = None
        if not all(c is True for c in counted):  # (steps that measured nothing: finite, left out of the mean)
            use = torch.stack([torch.as_tensor(c).reshape(()).to(dev) for c in counted])  # (a Python flag: one
            # host-to-device copy of one bool, at the fold: a sync step, a state_dict)
            empty, ok = (ok & ~use).sum().to(dtype), ok & use
        kept = torch.where(ok, vals, torch.zeros_like(vals))
        s, q = kept.sum(), kept.square().sum()
        n = ok.sum().to(dtype)
        if empty is not None:
            self.empty = empty if self.empty is None else self.empty.to(dev, dtype) + empty
        if self.sum is None or self.finite is None:
            self.sum, self.finite, self.sq = s, n, q
        else:  # a window restored from a state_dict, continued
            self.sum = self.sum.to(dev, dtype) + s
            self.finite = self.finite.to(dev, dtype) + n
            self.sq = q if self.sq is None else self.sq.to(dev, dtype) + q

    @property
    def nonfinite(self) -> torch.Tensor | int:
        """How many of the observed losses were non-finite (those that measured nothing left out), after
        :meth:`fold`."""
        return self.count - (self.finite if self.finite is not None else 0) - (self.empty if self.empty is not None
                                                                                 else 0)

    def reset(self) -> None:
        self._kept, self._counted, self.sum, self.finite, self.sq, self.empty, self.count = [], [], None, None, None, \
            None, 0

    def state_dict(self) -> dict[str, Any]:
        self.fold()
        return {"loss_sum": None if self.sum is None else self.sum.detach().cpu().clone(),
                "loss_n": None if self.finite is None else self.finite.detach().cpu().clone(),
                "loss_sq": None if self.sq is None else self.sq.detach().cpu().clone(),
                "loss_empty": None if self.empty is None else self.empty.detach().cpu().clone(),
                "loss_count": self.count}

    @staticmethod
    def parse(state: dict[str, Any]) -> tuple[Any, ...]:
        """``(sum, finite, count, sq, empty)`` from a saved state, checked (ValueError); changes nothing."""
        count = state["loss_count"]
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"Expected the state's loss_count as an integer >= 0, but got {count!r}")
        loss_sum, loss_n, loss_sq = state["loss_sum"], state.get("loss_n"), state.get("loss_sq")
        loss_empty = state.get("loss_empty")  # (saved since session 44: none before, none measured nothing)
        for name, x in (("loss_sum", loss_sum), ("loss_n", loss_n), ("loss_sq", loss_sq), ("loss_empty", loss_empty)):
            if x is not None and (not isinstance(x, torch.Tensor) or x.numel() != 1):
                raise ValueError(f"Expected the state's {name} as None or a scalar tensor, but got {x!r}")
        if loss_sum is not None and loss_n is None:  # version 1: every observed loss was summed
            loss_n = torch.tensor(float(count), dtype=loss_sum.dtype)
        return (None if loss_sum is None else loss_sum.clone().reshape(()),
                None if loss_n is None else loss_n.clone().reshape(()), count,
                None if loss_sq is None else loss_sq.clone().reshape(()),
                None if loss_empty is None else loss_empty.clone().reshape(()))

    def load(self, parsed: tuple[Any, ...]) -> None:
        self._kept, self._counted = [], []
        self.sum, self.finite, self.count, self.sq, self.empty = parsed


class WindowMean:
    """The mean of this replica's iterates over the window (Polyak), for the fit controller: a float32 sum
    (float64 for float64 parameters) of the parameters after each optimizer step, and the probe evaluated at the mean (the parameters'
    storage swapped for the mean's and back, as schedule_free's ``eval()`` swaps to its average).

    FSDP2 parameters (DTensors): each rank sums its local shards, and the probe runs at the mean written into them
    (and the rank's own values written back after): FSDP2 gathers a forward's weights from its own shard storage,
    where a swapped ``.data`` would be unseen, and keeps the root's gathered copies after a forward under ``no_grad``
    (:func:`hdet.replicas.reshard_fsdp` drops them before and after)."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params  # floating-point parameters (DTensors: their local shards are summed)
        self.sharded = any(callable(getattr(p, "to_local", None)) for p in params)
        self.sum: list[torch.Tensor] | None = None
        self.n = 0
        self.void = False  # this window's sums were dropped at a load (another shard rank's): its probe is NaN

    def _locals(self) -> list[torch.Tensor]:
        return [local_shard(p).detach() for p in self.params] if self.sharded else [p.detach() for p in self.params]

    @torch.no_grad()
    def add(self) -> None:
        """Add the parameters now: one foreach add on their devices, no host sync. Once per optimizer step."""
        params = self._locals()
        if self.sum is None:  # float32 sums (float64 for float64 parameters: their mean at their own precision)
            self.sum = [p.to(_sum_dtype(p), copy=True) for p in params]
        else:
            torch._foreach_add_(self.sum, [p if p.dtype == s.dtype else p.to(s.dtype) for p, s in zip(params, self.sum)])
        self.n += 1

    def reset(self) -> None:
        if self.sum is not None:
            for s in self.sum:
                s.zero_()
        self.n = 0
        self.void = False

    @torch.no_grad()
    def probe(self, model: nn.Module, probe: Probe) -> torch.Tensor:
        """``probe(model)`` at the window mean, in eval mode; a float64 scalar on the probe's device (NaN
        with nothing summed). The parameters are restored whatever happens."""
        if self.sharded:
            return self._sharded_probe(model, probe)
        if self.sum is None or self.n == 0 or self.void:
            return torch.full((), float("nan"), dtype=torch.float64)
        means = torch._foreach_div(self.sum, float(self.n))
        means = [m if m.dtype == p.dtype else m.to(p.dtype) for m, p in zip(means, self.params)]
        saved = [p.data for p in self.params]
        try:
            for p, m in zip(self.params, means):
                p.data = m
            with eval_mode(getattr(model, "module", model)):  # (the module under DDP)
                loss = probe(getattr(model, "module", model))
        finally:
            for p, d in zip(self.params, saved):
                p.data = d
        return _scalar(loss)

    def _sharded_probe(self, model: nn.Module, probe: Probe) -> torch.Tensor:
        """FSDP2: the mean written into this rank's shards, the probe run, the rank's own values written back (each
        shard swapped with its mean's buffer, one at a time: no copy of the shards beyond the means). A rank with
        nothing summed, or whose window's sums were dropped at a load (:attr:`void`), still runs the probe at its own
        values, since the forward's all-gathers need every shard rank, and says NaN: the replica's probe (the sum over
        its shard ranks) is then NaN."""
        params = self._locals()
        empty = self.sum is None or self.n == 0 or self.void
        means = [] if empty else torch._foreach_div(self.sum, float(self.n))  # (float32: each swapped in its dtype)
        written: list[int] = []
        try:
            reshard_fsdp(model)
            for i, (p, m) in enumerate(zip(params, means)):
                own = p.to(m.dtype, copy=True)
                p.copy_(m)
                m.copy_(own)  # (the buffer holds the rank's own values now)
                written.append(i)
            with eval_mode(model):  # (the FSDP2 root itself: a .module of it would skip the root's all-gather)
                value = _scalar(probe(model))  # (checked on every rank, a void one too: one raising alone left the
                # others waiting in the sync's collective)
            if value.is_cuda and any(p.device.type == "cpu" for p in params):
                torch.cuda.synchronize(value.device)  # HOST SYNC (shards offloaded to the CPU: the forward's copies of
                # them to the device, non-blocking, may still be queued when they are written back below)
        finally:
            for i in written:
                params[i].copy_(means[i])
            reshard_fsdp(model)  # (the probe's forward left the root's gathered copies of the mean)
        return torch.full((), float("nan"), dtype=torch.float64) if empty else value

    def state_dict(self) -> dict[str, Any] | None:
        if self.sum is None or (self.n == 0 and not self.void):  # (nothing summed: no zeros saved)
            return {"sum": [], "n": 0, "void": True} if self.void else None
        return {"sum": [x.detach().cpu().clone() for x in self.sum], "n": self.n,
                **({"void": True} if self.void else {})}

    def parse(self, state: dict[str, Any] | None) -> tuple[list[torch.Tensor] | None, int]:
        """``(sum, n)`` from a saved state, checked against the parameters (ValueError); changes nothing."""
        if state is None:
            return None, 0
        n, void = state.get("n"), state.get("void", False)
        if isinstance(n, bool) or not isinstance(n, int) or n < 0 or not isinstance(void, bool):
            raise ValueError(f"Expected the window mean's n as a whole number >= 0 and void as a bool, but got "
                             f"{n!r} and {void!r}: a corrupted state_dict")
        if void:  # (a window whose sums were dropped: still none)
            return None, -1
        if not n:  # (nothing summed: a state saved at a sync step)
            return None, 0
        sums = state["sum"]
        params = self._locals()  # (FSDP2: this rank's shards)
        if len(sums) != len(params) or any(tuple(x.shape) != tuple(p.shape) for x, p in zip(sums, params)):
            if self.sharded:  # another mesh's shards (the caller drops another shard rank's before): none this window
                warnings.warn("hdet: the fit controller's window mean in this state is of other shards (another mesh, "
                              "or another model): dropped, so this window's probe is NaN and the controller waits for "
                              "the next", stacklevel=user_stacklevel())
                return None, -1
            raise ValueError(f"Expected a window mean of {len(self.params)} tensors shaped like the parameters, but "
                             f"the state holds {len(sums)} that do not match")
        return [x.to(p.device, _sum_dtype(p), copy=True) for x, p in zip(sums, params)], int(state["n"])  # (never
        # the caller's; a float64 parameter's sum in float64 also when saved in float32, before that was so)

    def load(self, parsed: tuple[list[torch.Tensor] | None, int]) -> None:
        """Set what :meth:`parse` returned; ``n == -1``: this window's sums were dropped (FSDP2: another shard
        rank's, or another mesh's), so its probe says NaN (:attr:`void`) until the next window."""
        self.sum, self.n = parsed
        self.void = self.n == -1
        self.n = max(self.n, 0)


def coarse_loss(loss: Any, what: str) -> bool:
    """Warn (and return True) where ``loss`` is a bfloat16 tensor that a controller will compare: its 8-bit mantissa
    rounds each loss by up to 0.4%, more than the replicas' losses differ (0.02-0.3% measured), and the controllers
    acted on the rounding (an audit: the fit controller's optimum off by more than half the spread at 6-9 of 20 syncs,
    0-1 with the same logits' loss in float32). float16's 11 bits measured fine."""
    if not (isinstance(loss, torch.Tensor) and loss.dtype == torch.bfloat16):
        return False
    warnings.warn(f"hdet: {what} is a bfloat16 tensor: its rounding (up to 0.4% of each step's loss) is larger "
                  "than the replicas' losses differ, and the controller ranks them on it. Compute the loss in float32 (e.g. "
                  "F.cross_entropy(logits.float(), y))", stacklevel=user_stacklevel())
    return True


def _scalar(loss: "torch.Tensor | float") -> torch.Tensor:
    """A probe's loss as a float64 scalar (on its device; ValueError for a tensor of more than one element)."""
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1:
            raise ValueError(f"Expected probe(model) to return a scalar loss, but got shape {tuple(loss.shape)}")
        if loss.dtype == torch.bfloat16 and not getattr(_scalar, "said", False):  # (once a process: probes run at syncs)
            _scalar.said = coarse_loss(loss, "probe(model)'s loss")  # type: ignore[attr-defined]
        return loss.detach().reshape(()).to(torch.float64)
    return torch.tensor(float(loss), dtype=torch.float64)


def _sum_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype of a window sum of ``p``: float32, float64 for a float64 parameter."""
    return torch.float64 if p.dtype == torch.float64 else torch.float32
