"""The ensemble's average swapped into the replicas' models between converge steps, to evaluate or save the model
the run is building: :class:`AverageSwap`.

Between converge steps each replica is its own model, trained at its own multiplier. An evaluation there (the
Hugging Face Trainer's ``eval_steps``, Lightning's validation at the end of an epoch, a user's validation loop under
DDP) measured a mix: each rank its own replica on its share of the data, reported as one number; and a checkpoint
saved then held rank 0's replica. The run's model is the replicas' average (Eq. 3): :class:`AverageSwap` puts it
into every replica (the mean of the replicas whose weights are finite; a replica whose weights are not finite
contributes nothing and gets the others' mean, as at a converge step, which under ``on_runaway="recover"`` may also
leave out a runaway replica), keeps each replica's own weights and buffers (one copy), and puts them back, so
training goes on exactly as if nothing happened. A swap-in that fails (a failed collective, out of memory for the
copy) leaves each replica's own weights, with nothing swapped in.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .caller import user_stacklevel

__all__ = ["AverageSwap", "SwappedInError", "explored_bases"]


@contextlib.contextmanager
def averaged(owner: Any) -> Iterator[bool]:
    """``with owner.averaged():`` for a scheduler or an engine: ``owner.swap_in_average()`` on entry (it yields
    whether the weights changed), ``owner.swap_back()`` on exit, whatever happens inside."""
    changed = owner.swap_in_average()
    try:
        yield changed
    finally:
        owner.swap_back()


def explored_bases(ensemble: Any) -> list[float]:
    """Each explored hyperparameter's base now (the value at the spread's centre, in its bounds), in ``hypers``'
    order: what the ensemble stands for, rather than one replica's own value."""
    sl = ensemble.slots
    return [sl.spreads[j].clamp(sl.bases[j]) for j in range(sl.num_lr_slots, sl.num_slots)]


class SwappedInError(RuntimeError):
    """Training was asked to go on while the ensemble's average is swapped in (its own weights are kept aside)."""


def _refuse(what: str) -> SwappedInError:
    return SwappedInError(f"hdet: {what} while the ensemble's average is swapped into the model for evaluation "
                          "(swap_in_average() or averaged()): this replica's own weights are kept aside, and a step "
                          "now would be lost when they are put back. Call swap_back() (or leave the `with "
                          "averaged():` block) before training on")


class AverageSwap:
    """The replicas' own tensors, kept while their average is in (``None``: not swapped in).

    ``tensors[r]`` are local replica r's model tensors (one list under torch.distributed, N in the engine);
    ``average(exclude)`` replaces them by their mean over the replicas in place, leaving out ``exclude``."""

    def __init__(self) -> None:
        self.saved: list[list[torch.Tensor]] | None = None
        self.tensors: list[list[torch.Tensor]] = []
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._values: list[tuple[Any, float]] = []  # explored hyperparameters and their own values, to put back
        self._modes: list[tuple[Any, bool]] = []  # Schedule-Free optimizers and their train mode at swap-in

    @property
    def active(self) -> bool:
        return self.saved is not None

    def check(self, what: str) -> None:
        """Raise :class:`SwappedInError` if the average is in (``what``: what was asked, for the message)."""
        if self.saved is not None:
            raise _refuse(what)

    def swap_in(self, tensors: Sequence[Sequence[torch.Tensor]], finite: list[bool] | None,
                average: Callable[[list[int]], None], optimizers: Sequence[torch.optim.Optimizer] = (),
                keep: Sequence[Sequence[torch.Tensor]] = ()) -> bool:
        """Keep ``tensors`` (a copy of each, on its device), then ``average`` them in place over the replicas whose
        ``finite`` flag is set (``finite`` None: the replicas are equal already, right after a converge step, and
        nothing changes). ``keep[r]``: replica r's tensors that are not averaged but put back too (BatchNorm's
        ``num_batches_tracked``: a forward in training mode inside the evaluation counted a batch that training
        never took, an audit). Every replica non-finite: nothing changes either (a warning). Everything is kept and
        put back in every case. Until :meth:`swap_back`, the ``optimizers``' ``step()`` is refused, and a
        Schedule-Free optimizer's train/eval mode is put back as it was here before the tensors are (the Hugging Face
        Trainer calls ``optimizer.eval()`` inside the evaluation: its own weights then went back as the eval-mode
        point, and its next ``train()`` moved them, 4.7e-3 off in an audit's run). Returns whether the weights
        changed."""
        self.check("swap_in_average() was called again")
        self._modes = [(o, mode) for o in optimizers if (mode := _train_mode(o)) is not None]
        bad = [r for r, ok in enumerate(finite or []) if not ok]
        every = [list(ts) + list(keep[r] if r < len(keep) else []) for r, ts in enumerate(tensors)]
        with torch.no_grad():  # this replica's own: one copy (also where nothing is averaged, right after a converge
            kept = [[t.clone() for t in ts] for ts in every]  # step: a forward in training mode inside changed the
            # statistics and counts of one replica, which stayed apart from the others after it, a review)
        changed = finite is not None and len(bad) < len(finite)
        if finite is not None and not changed:
            warnings.warn("hdet: every replica's weights are non-finite: there is no average to evaluate, so each "
                          "replica keeps its own", stacklevel=user_stacklevel())
        elif changed:
            try:
                average(bad)
            except BaseException:  # (a failed collective, Ctrl-C): each replica's own back, nothing swapped in
                with torch.no_grad():
                    for ts, ks in zip(every, kept):
                        if ts:
                            torch._foreach_copy_(ts, ks)
                raise
        self.tensors, self.saved = every, kept
        self._hooks = [o.register_step_pre_hook(self._refuse_step) for o in optimizers]
        return changed

    def hold_values(self, hypers: Sequence[Any], bases: Sequence[float], owns: Sequence[float]) -> None:
        """While the average is in: each explored hyperparameter at its base (the ensemble's value: an evaluation's
        label smoothing or attention temperature), its own value ``owns`` (read before :meth:`swap_in`, which averages
        a value kept in a model's buffer) put back by :meth:`swap_back`."""
        try:
            for h, base, own in zip(hypers, bases, owns):
                self._values.append((h, own))
                h.set(base)
        except BaseException:  # (a Setter that raised): nothing swapped in, every value and weight back
            try:
                self.swap_back()
            except BaseException:  # noqa: BLE001 - the same setter again: the first error is the one to see
                pass
            raise

    def swap_back(self) -> bool:
        """Put each replica's own tensors back, and its explored values (the tensors first: a value's setter that
        raises leaves nothing swapped in, and its error is raised after). Returns whether the average was in."""
        values, self._values = self._values, []
        modes, self._modes = self._modes, []
        for o, mode in modes:  # first: Schedule-Free's train() / eval() move the weights between its two points
            if _train_mode(o) is not mode:
                (o.train if mode else o.eval)()
        was_in = self.saved is not None
        if was_in:
            with torch.no_grad():
                for ts, kept in zip(self.tensors, self.saved):
                    if ts:
                        torch._foreach_copy_(ts, kept)
            for h in self._hooks:
                h.remove()
            self.saved, self.tensors, self._hooks = None, [], []
        error = None
        for h, own in reversed(values):
            try:
                h.set(own)
            except BaseException as e:  # noqa: BLE001 - every other value still goes back; the first error is raised
                error = error or e
        if error is not None:
            raise error
        return was_in

    def _refuse_step(self, optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        raise _refuse("optimizer.step() was called")


def _train_mode(optimizer: Any) -> bool | None:
    """A Schedule-Free optimizer's mode (True: train, its weights at y; False: eval, at x), or None for another."""
    groups = getattr(optimizer, "param_groups", [])
    return bool(groups[0]["train_mode"]) if groups and "train_mode" in groups[0] else None
