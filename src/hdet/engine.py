"""N replicas of a module in one process, with the semantics of N DDP processes.

Each replica is a copy of the module with its own optimizer and its own HDET scheduler; the schedulers
talk through a :class:`~hdet.replicas.LocalReplicaGroup`, so the HDET maths is the very code the
distributed path runs (reductions over the replica axis instead of collectives). A step: every replica
runs forward/backward on its own micro-batch with its own dropout masks, gradients are averaged across
replicas as DDP's all-reduce does (``sum_r g_r / N``), every replica steps with its own
hyperparameters, then the schedulers step (weights averaged every T steps, controller, permutation).

Two ways to run the replicas:

* ``"vmap"`` (fast path): the replicas' parameters and buffers are stacked into tensors with a leading
  replica axis ``[N, ...]`` (:mod:`hdet.stacking`); one ``torch.func.vmap`` of ``functional_call`` runs all
  N forward/backward passes as batched kernels (``randomness="different"``: each replica draws its own
  dropout masks). Each replica's module and optimizer see views ``stacked[r]`` of those tensors, so
  schedulers and weight averaging are unchanged, and Adam/AdamW/SGD step every replica at once
  (:mod:`hdet.stacked_optim`). ``F.scaled_dot_product_attention`` runs once for all replicas, fused
  (:mod:`hdet.attention`).
* ``"loop"`` (fallback): a plain loop over the replica copies; works for any module.

``mode="auto"`` (default) uses vmap and falls back to the loop, with a warning naming the reason, if
the first step cannot be vectorised (data-dependent control flow, ``.item()`` in forward, ...).

``share_gradients=False`` is the local mode (DDP's ``no_sync`` on every step): each replica steps on
its own gradient and the replicas meet only at converge steps.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import math
import operator
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, vmap
from torch.utils._pytree import tree_leaves

from . import attention, autocast, cross_entropy, embedding, linear, spectral
from .caller import user_stacklevel
from .graphs import StepGraphs, function_key
from .merged import MergedReplicas, NotMergeable, check_merged, failure, reason_not_mergeable
from .ensemble import ReplicaMismatchError
from .guard import all_finite
from .replicas import LocalReplicaGroup, Replicas, accumulation, average_local
from .optimizers import check_shared_gradients, innermost, own_lr_tensors
from .stability import SharedCopies
from .stacked_optim import StackedStep, Unstackable, foreign_pre_hooks, unsupported
from .stacking import StackedReplicas
from .step_scale import share_local
from .swap import AverageSwap, averaged, explored_bases
from .window import coarse_loss
from .sync import health, unaveraged_buffers
from .values import check_bool, int_number

__all__ = ["ReplicaEngine"]

MakeOptimizer = Callable[[nn.Module], torch.optim.Optimizer]
MakeScheduler = Callable[[torch.optim.Optimizer, Replicas, nn.Module], Any]
LossFn = Callable[[nn.Module, Any], torch.Tensor]
MODES = ("auto", "vmap", "loop", "merged")


def _stack_batches(batches: Sequence[Any]) -> Any:
    """N per-replica batches (tensors, or tuples/lists/dicts of them) -> one batch with a leading N axis."""
    first = batches[0]
    if isinstance(first, torch.Tensor):
        shapes = [tuple(b.shape) for b in batches]
        if len(set(shapes)) > 1:
            raise ValueError(f"Expected the replicas' batches to have one shape (vmap stacks them into one tensor), but "
                             f"got shapes {shapes}: drop an uneven last batch (DataLoader(drop_last=True)) or use "
                             "mode='loop'")
        return torch.stack(list(batches))
    if isinstance(first, (tuple, list)):
        return type(first)(_stack_batches([b[i] for b in batches]) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: _stack_batches([b[k] for b in batches]) for k in first}
    raise TypeError(f"Expected batches made of tensors, tuples, lists or dicts, but got {type(first).__name__}")


def _index_batch(batch: Any, r: int) -> Any:
    """Replica ``r``'s batch out of a stacked batch (inverse of :func:`_stack_batches`)."""
    if isinstance(batch, torch.Tensor):
        return batch[r]
    if isinstance(batch, (tuple, list)):
        return type(batch)(_index_batch(b, r) for b in batch)
    if isinstance(batch, dict):
        return {k: _index_batch(v, r) for k, v in batch.items()}
    raise TypeError(f"Expected a stacked batch of tensors, tuples, lists or dicts, but got {type(batch).__name__}")


def _leading(batch: Any) -> int | None:
    """Size of the leading axis shared by the tensors of a stacked batch (None if they disagree)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else None
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (tuple, list)) else None
    if not items:
        return None
    sizes = {_leading(b) for b in items}
    return sizes.pop() if len(sizes) == 1 else None


class _Call(nn.Module):
    """``loss_fn(module, batch)`` as a module, so that ``functional_call`` can swap its tensors. Returns the loss and
    the buffers that the forward reassigned (``self.mu = 0.9 * self.mu + ...``, not in place), by their names under
    this wrapper: ``functional_call`` puts the tensors it swapped in back afterwards, so a reassigned value would
    otherwise be lost (the engine copies it into the stacked buffer)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.m = module
        slots = [(mod, k, f"m.{name}.{k}" if name else f"m.{k}", b) for name, mod in module.named_modules()
                 for k, b in mod._buffers.items()]
        self._buffer_slots = [(mod, k, name) for mod, k, name, b in slots if b is not None]
        self._none_slots = [(mod, k, name) for mod, k, name, b in slots if b is None]  # (registered as None: a
        # forward that creates it, a lazily made running mean, cannot be stacked; see forward)
        # a submodule under two names (self.block2 = self.block1): functional_call swaps its tensors in twice and
        # puts back, under the second name, what it swapped in under the first (torch 2.13), leaving replica 0's
        # module holding the vmapped tensors; their own tensors, to put back after each call (restore)
        aliased = len(list(module.named_modules(remove_duplicate=False))) > len(list(module.named_modules()))
        self._own = [(d, k, t) for mod in module.modules() for d in (mod._parameters, mod._buffers)
                     for k, t in d.items() if t is not None] if aliased else []

    def restore(self) -> None:
        """After a ``functional_call``: every tensor of the module is its own again (see ``_own``)."""
        for d, k, t in self._own:
            if d[k] is not t:
                d[k] = t

    def forward(self, batch: Any, loss_fn: LossFn) -> tuple[torch.Tensor, dict[str, Any]]:
        before = [mod._buffers[k] for mod, k, _ in self._buffer_slots]
        loss = _scalar_loss(loss_fn(self.m, batch))
        made = [(mod, k, name) for mod, k, name in self._none_slots if mod._buffers[k] is not None]
        if made:  # left there, replica 0's module held a tensor escaped from vmap (a replica's own value), the others
            for mod, k, _ in made:  # None, and the first converge step raised functorch's "escaped" error (an audit);
                mod._buffers[k] = None  # a plain value, later updated from each replica's batch, did the same or failed
            raise ValueError(f"Expected the buffers the vmapped replicas hold, but the forward assigned "  # (a review)
                             f"{', '.join(repr(n[2:]) for _, _, n in made)}, registered as None when the engine was "
                             "built: it cannot be stacked for the replicas. Create it in __init__ as a tensor of its "
                             "final shape (or run one forward before building the engine), or use mode='loop'")
        return loss, {name: mod._buffers[k] for (mod, k, name), b in zip(self._buffer_slots, before)
                      if mod._buffers[k] is not b and isinstance(mod._buffers[k], torch.Tensor)}  # (None: dropped)


def _scalar_loss(loss: Any) -> torch.Tensor:
    """What ``loss_fn`` returned, checked: one replica's scalar loss tensor."""
    if not isinstance(loss, torch.Tensor):
        raise ValueError(f"Expected loss_fn to return a scalar loss tensor, but got {type(loss).__name__}")
    if loss.dim() != 0:
        raise ValueError(f"Expected loss_fn to return a scalar loss, but got shape {tuple(loss.shape)}")
    return loss


def _same(a: float, b: float) -> bool:
    """One value read twice: equal, or both NaN."""
    return a == b or (math.isnan(a) and math.isnan(b))


def _probe_values(v: float, bounds: tuple[float, float]) -> list[float]:
    """Values inside ``bounds`` well apart from ``v`` (a quarter of it, 0.1 from it, twice or half it, 1 from it, the
    bounds' middle), in the order tried, to tell whether setting one moves another replica's read
    (:meth:`ReplicaEngine._check_own_values`): a setter may reject one (a probability's 1.125) or round it away (an
    int's 1.25), and the next is tried."""
    lo, hi = bounds
    mid = (lo + hi) / 2 if math.isfinite(lo) and math.isfinite(hi) else lo + 1.0 if math.isfinite(lo) else hi - 1.0
    out: list[float] = []
    for p in (v * 1.25, v * 0.8, v + 0.1, v - 0.1, v * 2, v / 2, v + 1, v - 1, mid):
        if math.isfinite(p) and lo <= p <= hi and p != v and p not in out:
            out.append(p)
    return out


def _probe(h: Any, want: float, got: float, bounds: tuple[float, float]) -> float:
    """The first of :func:`_probe_values` that ``h`` takes and reads back apart from ``got`` (a value its setter
    rejects, or rounds back onto ``got``, shows nothing: the next is tried); ``want`` where none does (nothing can
    be told then, as before the probe)."""
    for v in _probe_values(want, bounds):
        try:
            h.set(v)
        except Exception:  # (the user's setter refused a value of ours: not an error of theirs)
            continue
        if not _same(h.get(), got):
            return v
    return want


def _unscaled_fp16(p: torch.Tensor | None) -> bool:
    """Warn (and return True) where the engine steps under float16 autocast: it runs the backward itself, with no
    ``GradScaler``, so small gradients underflow to 0 in float16 (an audit: 13% of a first layer's gradient elements 0,
    26% relative error, late in a run), where the same model under DDP has the scaler."""
    dev = p.device.type if p is not None else "cpu"
    if not (torch.is_autocast_enabled(dev) and torch.get_autocast_dtype(dev) == torch.float16):
        return False
    warnings.warn("hdet: engine.step() under float16 autocast: the engine runs the backward without loss scaling (no "
                  "GradScaler), so small gradients underflow to 0. Use bfloat16 autocast (the same speed on recent "
                  "GPUs, no scaling needed)", stacklevel=user_stacklevel())
    return True


class ReplicaEngine:
    """``num_replicas`` copies of ``model`` (identical start weights) trained as one HDET ensemble.

    Args:
        model: the module; each replica gets a deep copy. :attr:`models` are the replicas' modules; in vmap
            mode their parameters and buffers are views of :attr:`stacked_params` / :attr:`stacked_buffers`.
        num_replicas: N.
        make_optimizer: ``make_optimizer(module)`` builds one replica's optimizer over ``module``'s parameters.
        make_scheduler: ``make_scheduler(optimizer, replicas, module)`` builds its hdet scheduler and must pass
            ``replicas=replicas`` (and usually ``model=module``) to ``OneCycleAutoLR``/``HDETLR``.
        mode: "auto" (vmap, the loop if the first step cannot be vectorised), "vmap", "loop" or "merged" (the
            replicas' batches as one batch through the module, for a module built of ``nn.Linear``, ``nn.LayerNorm``,
            ``nn.Embedding`` and ``nn.RMSNorm`` layers whose forward treats rows independently: :mod:`hdet.merged`;
            its first step is checked against vmap, and vmap runs where it cannot, with a warning). Explored values
            that live in a module's Python state (dropout p, label smoothing) make "auto" use the loop.
        compile: run the vmapped forward through ``torch.compile`` (vmap path only); a dict: ``torch.compile``'s
            keyword arguments, e.g. ``{"mode": "reduce-overhead"}`` (CUDA graphs).
        before_optimizer_step: ``f(r, module, optimizer)`` for every replica after the gradients are averaged
            (e.g. ``clip.clip_(module.parameters())`` with an explored :class:`hdet.GradClip`).
        share_gradients: False is the local mode: no gradient averaging between syncs (DDP's ``no_sync``).
        stacked_optimizer: in vmap mode, step every replica's Adam/AdamW/SGD at once on the stacked parameters
            (:mod:`hdet.stacked_optim`; with shared gradients one copy of the moments). False: each replica's
            ``optimizer.step()``. :attr:`optimizer_path` says which runs, and why.
        gradient_layout: with the stacked step, eager: from the first backward on, store each parameter in the
            order its gradient comes out of vmap's backward (a weight used as ``x @ W.T``, or on a GPU an
            ``nn.Linear`` weight, is transposed; on the CPU ``F.linear``'s comes in the weight's layout,
            :mod:`hdet.linear`), so that later backwards add into the flat gradient in memory order (2 CPU cores,
            an MLP, N = 8, before hdet.linear: 0.49x -> 0.53x one model at 8x the batch). The parameters are then
            non-contiguous: ``.view()`` on them (also in ``loss_fn``) fails where ``.reshape()`` works, hence off
            by default.
        cuda_graph: on a CUDA device, vmapped or merged, not compiled: capture the forward and backward in a CUDA
            graph (``torch.cuda.make_graphed_callables``) after a loss function's first step, and replay it while
            what it was captured with stays the same (:mod:`hdet.graphs`: a new batch shape, train/eval flags,
            autocast or loss function is captured anew, at most 4 kept). The graph replays what was captured:
            ``loss_fn`` and the model's forward must compute the same thing at every step (no global or Python value
            that changes between steps, no host sync, no data-dependent branch). Dropout draws new masks at each
            replay.
    """

    def __init__(self, model: nn.Module, num_replicas: int, make_optimizer: MakeOptimizer,
                 make_scheduler: MakeScheduler, *, mode: str = "auto", compile: bool | dict[str, Any] = False,
                 before_optimizer_step: Callable[[int, nn.Module, torch.optim.Optimizer], None] | None = None,
                 share_gradients: bool = True, stacked_optimizer: bool = True, gradient_layout: bool = False,
                 cuda_graph: bool = False) -> None:
        if mode not in MODES:
            raise ValueError(f"Expected mode in {MODES}, but got {mode!r}")
        if not isinstance(model, nn.Module):
            raise ValueError(f"Expected model to be a torch.nn.Module, but got {type(model).__name__}")
        share_gradients, stacked_optimizer, gradient_layout, cuda_graph = (check_bool(k, v) for k, v in (
            ("share_gradients", share_gradients), ("stacked_optimizer", stacked_optimizer),
            ("gradient_layout", gradient_layout), ("cuda_graph", cuda_graph)))  # ("no" was True: an audit)
        sparse = [n or type(m).__name__ for n, m in model.named_modules()
                  if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse]
        if sparse:  # (vmap's backward failed in a reshape, the loop in a masked average: torch's errors, no word why)
            raise ValueError(f"Expected layers with dense gradients, but {sparse} are embeddings with sparse=True: the "
                             "engine averages and stacks the replicas' gradients as dense tensors. Build them with "
                             "sparse=False (and a dense optimizer)")
        hooked = [n for n, p in model.named_parameters() if p._backward_hooks or p._post_accumulate_grad_hooks]
        if hooked:  # (dropped on every replica, in every mode, unsaid: an audit)
            raise ValueError(f"Expected no hooks on the model's parameters, but hooks are registered on {_names(hooked)} "
                             "(register_hook or register_post_accumulate_grad_hook): the replicas are deep copies, which "
                             "do not keep a parameter's hooks, so every replica would train without them. Register "
                             "them on each engine.models[r]'s parameters after building the engine, with mode='loop'")
        lazy = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if nn.parameter.is_lazy(t)]
        if lazy:  # (the loop's deep copies each initialised theirs at its first forward from the global RNG: the
            # replicas started apart and the first converge step averaged independent networks, an audit)
            raise ValueError(f"Expected a model whose parameters are initialised, but {lazy} are uninitialised (a lazy "
                             "module, nn.LazyLinear, ...): each replica would draw its own at its first forward. Run "
                             "the model once on a dummy batch before building the engine")
        n = int_number(num_replicas)  # (numpy, 0-d tensors)
        num_replicas = num_replicas if n is None else n
        self.group = LocalReplicaGroup(num_replicas)
        self.num_replicas = num_replicas
        self.models = [copy.deepcopy(model) for _ in range(num_replicas)]
        first = next(iter(model.parameters()), None)
        if first is not None:  # the sync vectors are built there and read in one copy
            self.group.device = first.device
        self.mode = mode
        # vmap: the replicas' tensors stacked [N, ...]; every replica's .grad the average's (row 0) when nothing
        # changes one replica's gradient
        self.stack = StackedReplicas(self.models, share_gradients and before_optimizer_step is None,
                                     relayout=gradient_layout and compile is False) \
            if mode != "loop" else None
        self.optimizers = [make_optimizer(m) for m in self.models]
        own_lr_tensors(self.optimizers)  # (one LR tensor given to every replica's optimizer: each its own copy)
        if any(isinstance(innermost(o), torch.optim.LBFGS) for o in self.optimizers):
            raise ValueError("Expected optimizers that step without a closure, but got LBFGS: the engine calls each "
                             "replica's optimizer.step() after the replicas' backward, with no closure to evaluate the "
                             "loss again")
        self.schedulers = [make_scheduler(o, self.group.views[r], m)
                           for r, (o, m) in enumerate(zip(self.optimizers, self.models))]
        for r, s in enumerate(self.schedulers):
            if getattr(s, "ensemble", None) is None or s.ensemble.replicas is not self.group.views[r]:
                raise ValueError("Expected make_scheduler to build an hdet scheduler with replicas=<the given view>")
            given = s.ensemble.model
            if given is not None and given is not self.models[r] and not _holds(given, self.models[r]):
                raise ValueError(  # (the outer model, or another replica's: its probe and its buffers' average were
                    # another model's, silently: an audit)
                    f"Expected make_scheduler to pass model= the replica's own module (its third argument), but "
                    f"replica {r}'s scheduler got a {type(given).__name__} that holds none of that replica's "
                    "parameters (the model given to the engine, or another replica's?): the fit controller would probe, "
                    "and each converge step average the buffers of, that model instead. Write "
                    "make_scheduler=lambda o, rep, m: hdet.OneCycleAutoLR(o, ..., replicas=rep, model=m)")
        self._check_own_values()
        self._copies = (SharedCopies(), SharedCopies())  # snapshots: shared tensors (moments) copied once
        for s in self.schedulers:
            s.ensemble.share_copies(*self._copies)
        hooked = _backward_hooks(self.models[0], self.stack.views if self.stack is not None else None)
        if hooked and self.mode != "loop":  # (vmap's backward runs on the stacked tensors: never reached, unsaid)
            if mode in ("vmap", "merged"):
                raise ValueError(f"Expected no backward hooks under mode={mode!r}, but {hooked}: the vmapped or "
                                 "merged backward runs on the replicas' stacked tensors and never calls them; use "
                                 "mode='loop' or 'auto' (hdet train: --mode loop or auto)")
            self.mode = "loop"
        loop_why = f"{hooked} (the loop runs backward hooks)" if hooked and mode != "loop" else None
        unsafe = [h.name for h in self.schedulers[0].ensemble.hypers if not h.vmap_safe]
        if unsafe and self.mode != "loop":
            if mode in ("vmap", "merged"):
                raise ValueError(f"Expected hyperparameters that vmap can batch, but {unsafe} live in the module's "
                                 "Python state, which vmap shares across replicas: use mode='loop' or 'auto' (hdet "
                                 "train: --mode loop or auto)")
            self.mode = "loop"  # per-replica Python attributes (dropout p, ...) need one module call each
        self.before_optimizer_step = before_optimizer_step
        self.share_gradients = share_gradients
        if not share_gradients:
            check_shared_gradients(self.optimizers[0], self.schedulers[0].ensemble.config.average_optimizer_state)
        self._call = _Call(self.models[0])  # (vmap: one call for all replicas, in replica 0's train/eval flags)
        self._modules = [list(m.modules()) for m in self.models]  # for the flags' check (_check_flags)
        # the names functional_call sees through the _Call wrapper (built once: the stacked tensors never change)
        self._call_params = {"m." + k: v for k, v in self.stacked_params.items()}
        self._call_buffers = {"m." + k: v for k, v in self.stacked_buffers.items()}
        _check_compile(compile)
        if compile is not False and self.mode == "merged":
            raise ValueError("Expected compile=False with mode='merged' (it runs eagerly; compile applies to mode='vmap')")
        if cuda_graph and (self.mode == "loop" or compile is not False or self.group.device.type != "cuda"):
            raise ValueError(f"Expected cuda_graph=True with mode 'auto', 'vmap' or 'merged', compile=False and the "
                             f"model on a CUDA device, but got mode={self.mode!r}"
                             + (f" (explored {unsafe} need the loop)" if unsafe and mode != "loop" else
                                f" ({loop_why})" if loop_why else "")
                             + f", compile={compile!r} on {self.group.device.type}")
        self.cuda_graph = bool(cuda_graph)
        self._graphs = StepGraphs(lambda b, f: (self._merged.losses(b, f, _scalar_loss), {}), self.group.device) \
            if cuda_graph else None  # the merged step's graphs; the vmapped step's:
        self._vgraphs = StepGraphs(self._eager_losses, self.group.device, self._keeping) if cuda_graph else None
        self._graph_ready: dict[Any, bool] = {}  # loss function code -> whether its vmapped step may be graphed
        self._merged: MergedReplicas | None = None
        self._grad_flags: tuple[list[torch.Tensor], list[bool]] | None = None  # (_check_frozen)
        self._hooks_seen: tuple[list[nn.Module], list[torch.Tensor]] | None = None  # (step: backward hooks)
        # (loss function, the batch's shapes) whose first merged step was checked, each with what its key refers to
        self._merge_checked: dict[Any, list[Any]] = {}
        if self.mode == "merged":
            why = reason_not_mergeable(self.models[0])
            if why:
                self._no_merge(why)
            else:
                self._merged = MergedReplicas(self.models[0], self.stack.params, num_replicas)
        if compile is not False and self.mode == "loop":
            warnings.warn("hdet: compile has no effect here: the engine runs its loop over replica copies ("
                          + ("mode='loop'" if mode == "loop" else f"explored {unsafe} live in the module's Python "
                             "state, which needs one call per replica" if unsafe else str(loop_why))
                          + "), and only the vmapped call is compiled",
                          stacklevel=user_stacklevel())
        self.compile = compile
        self._fns: dict[Any, list[Any]] = {}  # loss_fn -> [the vmapped function, its compiled form or None,
        # whether its first compiled losses are still to be checked against eager's]
        self._checked: set[Any] = set()  # the loss functions' code whose compiled losses were checked
        self._rejected: set[Any] = set()  # the loss functions' code that compile cannot run (eager from then on)
        self._unkept: set[str] = set()  # reassigned buffers whose new shape or dtype could not be kept (warned)
        self._stacked: StackedStep | None = None
        self._said_coarse = False  # (a bfloat16 loss under a controller: said once, step)
        self._said_fp16 = False  # (float16 autocast, no loss scaling here: said once, step)
        self._gave_way: str | None = None  # why the stacked step gave way to each replica's during the run
        self.share_base_schedule = True  # False: every replica steps its own base schedule (see _follow)
        self._following: bool | None = None
        self.optimizer_path = "per-replica: loop mode" if self.mode == "loop" else self._setup_stacked(stacked_optimizer)
        self._swap = AverageSwap()  # the replicas' own weights while their average is in (swap_in_average)

    def _check_own_values(self) -> None:
        """Every replica's explored values must act on that replica's own object: one loss criterion given to
        every replica's ``LabelSmoothing`` (or a ``Setter`` on shared state) holds the last replica's value for
        all of them while the records report a spread. Each scheduler has set its replica's values by now, so
        reading them back tells."""
        for k, h in enumerate(self.schedulers[0].ensemble.hypers):
            hs = [s.ensemble.hypers[k] for s in self.schedulers]
            got = [x.get() for x in hs]
            want = [s.ensemble.all_values()[s.ensemble.num_lr_slots + k][r] for r, s in enumerate(self.schedulers)]
            # one replica's value set again moves another's read: they share an object (asked directly: a value a
            # low-precision buffer rounds onto another replica's was taken for sharing, two reviews)
            shared = None  # (replica set, the value, the replica whose read moved, its read then)
            try:
                for r in range(len(hs)):
                    # a value another replica holds too (all of them at a warm-up's 0, say) moves nothing to see: a
                    # probe value apart from it instead (the replicas trained at one shared value, unsaid: an audit)
                    alike = any(_same(want[r], want[j]) for j in range(len(hs)) if j != r)
                    v = _probe(hs[r], want[r], got[r], h.spread.bounds) if alike else want[r]
                    hs[r].set(v)
                    moved = [(j, x) for j in range(len(hs)) if j != r and not _same(x := hs[j].get(), got[j])]
                    if moved:
                        shared = (r, v, *moved[0])
                        break
                    hs[r].set(want[r])  # (a probe value taken back before the next replica's)
            finally:
                for x, w in zip(hs, want):  # (as the schedulers set them, in order)
                    x.set(w)
            if shared is not None:
                r, v, j, x = shared
                raise ValueError(
                    f"Expected each replica's explored {h.name} to act on its own object, but setting replica {r}'s "
                    f"to {v:g} moved replica {j}'s read from {got[j]:g} to {x:g} (the schedulers set {want}, the "
                    f"replicas read {got}): one object serves them all (e.g. one loss criterion "
                    "for every replica's LabelSmoothing). Build it per replica inside make_scheduler, from that "
                    "replica's module (e.g. m.crit = nn.CrossEntropyLoss(); explore=[hdet.LabelSmoothing(m.crit)]), "
                    "and use it in loss_fn (m.crit(m(x), y))")

    # -- the stacked optimizer step (vmap path) ---------------------------------------------------------
    def _setup_stacked(self, wanted: bool) -> str:
        """Lay the trainable parameters out flat and build the stacked step; returns :attr:`optimizer_path`."""
        why = "per-replica: stacked_optimizer=False" if not wanted else None
        why = why or (f"per-replica: {r}" if (r := unsupported(self.optimizers)) else None)
        why = why or (f"per-replica: {r}" if (r := self.stack.flatten(self.optimizers)) else None)
        if why:
            return why
        self._stacked = StackedStep(self.optimizers, self.stack.theta, self.stack.grad, self.stack.segments,
                                    shared=self.stack.one_grad_row)
        return "stacked"

    def _stop_stacked(self, why: str, warn: bool = True) -> None:
        """From now on each replica's ``optimizer.step()`` (its own copy of the state); ``warn``: say so (N optimizer
        steps a step instead of one, and N copies of the moments: a cost the user should hear of once)."""
        if self._stacked is not None:
            self._gave_way = why  # (kept in a state_dict: a resume goes on as this run does)
        if self._stacked is not None and warn:
            warnings.warn(f"hdet: the engine steps each replica's optimizer from now on, instead of one stacked step for "
                          f"all ({why}): slower, with a copy of the optimizer state per replica",
                          stacklevel=user_stacklevel())
        if self._stacked is not None:
            self._stacked.release()
            self._stacked = None
        if self.stack is not None:
            self.stack.drop_stride_hooks()
            self.stack.own_grads()  # (one shared .grad row would take one replica's in-place change to every replica)
        self.optimizer_path = f"per-replica: {why}"

    # -- vmap path ------------------------------------------------------------------------------------
    @property
    def stacked_params(self) -> dict[str, torch.Tensor]:
        """vmap mode: every parameter stacked ``[N, ...]`` (the replicas' modules hold views of them)."""
        return self.stack.params if self.stack is not None else {}

    @property
    def stacked_buffers(self) -> dict[str, torch.Tensor]:
        return self.stack.buffers if self.stack is not None else {}

    def _before_forward(self) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor | None]:
        """What a forward changes besides its outputs: the stacked buffers (BatchNorm's statistics) and the random
        state (dropout), kept so that an eager re-run of the same step starts where the compiled one did."""
        dev = self.group.device
        cuda = torch.cuda.get_rng_state(dev) if dev.type == "cuda" else None
        return {k: b.clone() for k, b in self.stacked_buffers.items()}, torch.get_rng_state(), cuda

    @torch.no_grad()
    def _restore_forward(self, before: tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor | None]) -> None:
        """:meth:`_before_forward`'s state back (no backward has run)."""
        buffers, cpu, cuda = before
        for k, b in self.stacked_buffers.items():
            b.copy_(buffers[k])
        self._restore_rng(cpu, cuda)

    def _restore_rng(self, cpu: torch.Tensor, cuda: torch.Tensor | None) -> None:
        """The random state :meth:`_before_forward` kept."""
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, self.group.device)

    def _reject(self, fns: list[Any], key: Any, before: Any, why: str | None) -> None:
        """The compiled form of this loss function is not used: the forward's state back (``before``), and with a
        reason (``why``) for good, said once: every later function of the same code runs eagerly too (an inline
        lambda is a new object each step, and would be compiled and fail again)."""
        if before is not None:
            self._restore_forward(before)
        if why is None:
            return
        fns[1] = None
        fns[2] = False
        self._rejected.add(key)
        warnings.warn(f"hdet: torch.compile cannot run this vmapped model ({why}); running it eagerly (still vmapped)",
                      stacklevel=user_stacklevel())

    def _restore(self, buffers: dict[str, torch.Tensor]) -> None:
        """After a failed first step in auto mode: the buffers as they were, no gradients."""
        for k, b in self.stacked_buffers.items():
            b.copy_(buffers[k])
        for p in self.stacked_params.values():
            p.grad = None
        for m in self.models:
            for p in m.parameters():
                p.grad = None

    def _check_flags(self) -> None:
        """vmap runs every replica in replica 0's train/eval flags: that they agree (a replica left in eval mode after
        evaluating it would otherwise train the others in eval mode, or be trained in train mode)."""
        first = [m.training for m in self._modules[0]]
        for r, mods in enumerate(self._modules[1:], 1):
            if [m.training for m in mods] != first:
                i = next(i for i, (a, b) in enumerate(zip(mods, self._modules[0])) if a.training != b.training)
                name = [n for n, _ in self.models[0].named_modules()][i] or "the model"
                raise ValueError(
                    f"Expected every replica in the same train/eval mode for a vmapped step (one call runs them all), "
                    f"but {name!r} is in {'train' if first[i] else 'eval'} mode on replica 0 and in "
                    f"{'train' if mods[i].training else 'eval'} mode on replica {r}: call .train() (or .eval()) on "
                    "every replica, e.g. after evaluating one; nothing was run")

    def _check_frozen(self) -> None:
        """vmap differentiates the stacked parameters, which took the replicas' ``requires_grad`` when the engine was
        built: that no replica's parameter was frozen or unfrozen since (it kept training, or never started, silently;
        the stacked step's state went out of step with the parameters: an audit)."""
        if self.stack is None:
            return
        if self._grad_flags is None:  # (once: every replica's parameter, and the flag its stacked one holds)
            self._grad_flags = ([p for views in self.stack.views.values() for p in views],
                                [self.stack.params[n].requires_grad for n, views in self.stack.views.items()
                                 for _ in views])
        views, want = self._grad_flags
        if list(map(_REQUIRES_GRAD, views)) == want:  # (22 us for 8 x 52 parameters on a 2-core CPU)
            return
        for n, views in self.stack.views.items():
            want = self.stack.params[n].requires_grad
            for r, p in enumerate(views):
                if p.requires_grad is not want:
                    raise ValueError(
                        f"Expected {n!r} with requires_grad={want} on every replica, as when the engine was built (a "
                        f"vmapped step differentiates the replicas' stacked parameters, made then), but replica {r}'s "
                        f"has requires_grad={p.requires_grad}: freeze or unfreeze before building the engine, or use "
                        "mode='loop'; nothing was run")

    def _check_hooks(self) -> None:
        """vmapped and merged steps run the backward on the stacked tensors, which never call the replicas' backward
        hooks: that none was registered since the engine was built (a gradient reversal trained the other way,
        unsaid: an audit). The fast pass reads the cached flat lists (10-226 us a step on a 2-core CPU); only a hit
        walks the replicas again to name it."""
        if self._hooks_seen is None:  # (once: every replica's modules and parameter views, flat)
            self._hooks_seen = ([m for mods in self._modules for m in mods],
                                [p for views in self.stack.views.values() for p in views])
        mods, params = self._hooks_seen
        glob = nn.modules.module
        if not (any(map(_BWD, mods)) or any(map(_BWD_PRE, mods)) or any(map(_BWD, params))
                or any(map(_POST_ACC, params)) or glob._global_backward_hooks or glob._global_backward_pre_hooks):
            return
        hooked = next(filter(None, (_backward_hooks(m, self.stack.views, r) for r, m in enumerate(self.models))),
                      "hooks")
        raise ValueError(f"Expected no backward hooks in a vmapped step, but {hooked} (registered after the engine "
                         "was built): the vmapped or merged backward runs on the replicas' stacked tensors and never "
                         "calls them; build the engine with the hooks on (mode='auto' then runs the loop) or use "
                         "mode='loop'; nothing was run")

    def _linear(self) -> contextlib.AbstractContextManager:
        """F.linear through :mod:`hdet.linear` on the CPU (side by side against torch's vmapped F.linear: 1.03-1.13x
        an MLP's step and 1.04-1.05x the tiny GPT's on 2 cores; on an H100, where the host is the bottleneck,
        0.95-1.01x: ``benchmarks/results/gpu_h100/linear_routing/``)."""
        return linear.routed() if self.group.device.type == "cpu" else contextlib.nullcontext()

    def _vmap_losses(self, batch: Any, loss_fn: LossFn, merged: bool = False) -> torch.Tensor:
        """Forward + backward of all replicas at once; leaves ``sum_r g_r / N`` in every replica's grad
        (its own ``g_r`` in local mode). ``merged``: the forward on the replicas' merged batch (:mod:`hdet.merged`)."""
        shares = self._takes_shares() and (merged or self._vmap_fns(loss_fn)[1] is None)  # (a compiled forward never
        # calls hdet's linear layers: no share, no copy of the buffers for a second run)
        before = self._before_shares() if shares else None  # (what a second run of the step needs)
        losses, reassigned, graphed = self._losses(batch, loss_fn, merged, shares)
        self.stack.backward(losses)
        if self.stack.redo:  # a NaN or Inf among the shares: the step again, each replica's own weight gradients
            self._restore_shares(before)  # (the forward's random draws and buffer updates as the first run's)
            losses, reassigned, graphed = self._losses(batch, loss_fn, merged, False)
            self.stack.backward(losses)
            if self.stack.redo:  # (no share taken: the redo is never asked again)
                raise RuntimeError("hdet: internal error: a step run without weight-gradient shares asked for a "
                                   "second run")
        if graphed:  # the graph's next run writes over its output: what step() returns is the caller's
            losses = losses.detach().clone()
        self._keep_reassigned(reassigned)  # (after the backward: it may have saved the old value)
        if self._stacked is not None and not self.stack.grads_bound and not self.stack.bind_grads():
            unused = [n for n, p in self.stack.params.items() if p.requires_grad and p.grad is None]
            t = self.schedulers[0].last_epoch + 1  # (a resumed engine's first backward is a later step: an audit)
            when = "at the first step" if t == 1 else f"at step {t}, this engine's first"
            self._stop_stacked(f"{_names(unused)} got no gradient {when} (unused in the loss; freeze what it never "
                               "uses with requires_grad_(False) to keep the stacked step)")
        if self.share_gradients:  # (local mode: each replica keeps its own gradient)
            self.stack.average_gradients()
        return losses.detach()

    def _losses(self, batch: Any, loss_fn: LossFn, merged: bool, shares: bool
                ) -> tuple[torch.Tensor, dict[str, Any], bool]:
        """The forward of :meth:`_vmap_losses`: the losses, the reassigned buffers and whether a CUDA graph ran it;
        ``shares``: under :func:`hdet.linear.sharing`."""
        self.stack.took.clear()  # (the parameters whose gradient holds a share: hdet.linear.sharing fills it)
        with linear.sharing(self.stack.share_leaves(), self.stack.took) if shares else contextlib.nullcontext():
            if merged:
                self.stack.before_backward()
                (losses, graphed), reassigned = self._merged_forward(batch, loss_fn), {}
            else:
                losses, reassigned, graphed = self._vmapped_forward(batch, loss_fn)
        if losses.shape != (self.num_replicas,):
            raise ValueError(f"Expected loss_fn to return a scalar loss, but got shape {tuple(losses.shape[1:])}")
        return losses, reassigned, graphed

    def _before_shares(self) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """What a second run of a step with shares needs (:meth:`_vmap_losses`): a copy of the stacked buffers
        (BatchNorm's statistics; their version counters do not tell whether a vmapped forward changed them) and the
        random state."""
        return {k: b.clone() for k, b in self.stack.buffers.items()}, torch.get_rng_state()

    @torch.no_grad()
    def _restore_shares(self, before: tuple[dict[str, torch.Tensor], torch.Tensor]) -> None:
        """:meth:`_before_shares`' state back for the second run (no optimizer step has run)."""
        kept, rng = before
        for k, b in self.stack.buffers.items():
            b.copy_(kept[k])
        torch.set_rng_state(rng)

    def _takes_shares(self) -> bool:
        """Whether this step's eager backward gives the linear layers' weights the replicas' shares of their summed
        gradient (:func:`hdet.linear.sharing`): shared gradients reduced on the CPU
        (:attr:`StackedReplicas.takes_shares`; a compiled forward never calls hdet's linear layers). A replica's own
        weight gradient is then never formed: where one is not finite, the step runs again without the shares
        (:meth:`_vmap_losses`)."""
        return self.share_gradients and self.stack is not None and self.stack.takes_shares

    def _vmap_fns(self, loss_fn: LossFn) -> list[Any]:
        """``[the vmapped function, its compiled form or None, whether its first compiled losses are still to be
        checked]`` for ``loss_fn`` (cached, most recently used last)."""
        fns = self._fns.pop(loss_fn, None)
        key = _code_of(loss_fn)  # (an inline lambda: a new object, the same code, each step)
        if fns is None:
            def one(p: dict[str, torch.Tensor], b: dict[str, torch.Tensor], x: Any) -> torch.Tensor:
                return functional_call(self._call, (p, b), (x, loss_fn))

            eager = vmap(one, randomness="different")
            compiled = None if self.compile is False or key in self._rejected else self._compiled(eager, key)
            fns = [eager, compiled, key not in self._checked]
        self._fns[loss_fn] = fns  # (last: the most recently used)
        while len(self._fns) > MAX_LOSS_FNS:  # a loss function written inline is a new object every step: a bounded
            del self._fns[next(iter(self._fns))]  # cache, the least recently used first (one entry a step before)
        return fns

    def _eager_vmapped(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[torch.Tensor, dict[str, Any]]:
        """The eager vmapped call. SDPA: one fused call for all replicas (hdet.attention); linear and conv layers in
        the autocast dtype (hdet.autocast); F.linear on the CPU: one baddbmm, dW in W's layout (hdet.linear);
        F.embedding: padding_idx's row gets no gradient from the lookup (hdet.embedding); F.cross_entropy's common
        form: one call for all replicas (hdet.cross_entropy)."""
        with attention.routed(), autocast.routed(), self._linear(), embedding.routed(), cross_entropy.routed():
            return self._forward(fn, args)

    def _vmapped_forward(self, batch: Any, loss_fn: LossFn) -> tuple[torch.Tensor, dict[str, Any], bool]:
        """The vmapped forward (compiled where it can be): the losses, the reassigned buffers, and whether a CUDA
        graph ran it."""
        key = _code_of(loss_fn)
        fns = self._vmap_fns(loss_fn)
        self.stack.before_backward()
        args = (self._call_params, self._call_buffers, batch)
        losses = before = None
        if fns[1] is not None:
            before = self._before_forward() if fns[2] else None  # (a first compiled step: what an eager re-run needs)
            try:
                with embedding.routed(), _lower_backward_now():  # (padding_idx's row: no gradient from the lookup;
                    losses, reassigned = self._forward(fns[1], args)  # the backward compiled now, inside this try)
            except Exception as e:  # noqa: BLE001 - torch.compile of a vmapped model can fail: say so, run eagerly
                self._reject(fns, key, before, failure(e))
                losses = None
            if losses is not None and fns[2]:
                if bool(torch.isfinite(losses).all()):  # HOST SYNC (the first compiled step of a loss function only)
                    self._checked.add(key)
                    fns[2] = False
                else:  # the same step eagerly: non-finite there too, the model's or the data's (checked again next
                    self._reject(fns, key, before, None)  # step); finite, compile's (torch's compiled vmap of SDPA
                    losses = None  # with dropout gives NaN)
        if losses is None and self._vgraphs is not None and self._graph_ready.get(key):
            params = {n: p for n, p in self.stack.params.items() if p.requires_grad}
            return self._vgraphs.losses(batch, loss_fn, params, tuple(m.training for m in self._modules[0]))
        if losses is None:
            losses, reassigned = self._eager_vmapped(fns[0], args)
            if self._vgraphs is not None:  # graphed from this loss function's next step on (a capture whose forward
                self._graph_ready[key] = True  # reassigns a buffer is refused there)
            if before is not None and fns[1] is not None:  # the eager re-run of a check whose compiled losses were
                if bool(torch.isfinite(losses).all()):  # non-finite. HOST SYNC (that step only)
                    self._reject(fns, key, None, "non-finite losses where the eager vmapped model's are finite (torch's "
                                 "compiled vmap of scaled_dot_product_attention with dropout is one known case)")
        return losses, reassigned, fns[1] is not None and self._cuda_graphs

    def _eager_losses(self, batch: Any, loss_fn: LossFn) -> tuple[torch.Tensor, dict[str, Any]]:
        """The eager vmapped losses of one batch and the buffers it reassigned (what :attr:`_vgraphs` captures)."""
        return self._eager_vmapped(self._vmap_fns(loss_fn)[0], (self._call_params, self._call_buffers, batch))

    @contextlib.contextmanager
    def _keeping(self) -> Any:
        """Inside: forwards that change the stacked buffers (a capture's warm-up runs: BatchNorm's statistics would take
        three extra updates); after: the buffers as they were (the random state goes on, as after three steps)."""
        kept = {k: b.clone() for k, b in self.stacked_buffers.items()}
        try:
            yield
        finally:
            torch.cuda.synchronize(self.group.device)  # (the warm-up runs' side stream: done before the restore)
            with torch.no_grad():
                for k, b in self.stacked_buffers.items():
                    b.copy_(kept[k])

    # -- merged path ----------------------------------------------------------------------------------
    def _merged_forward(self, batch: Any, loss_fn: LossFn) -> tuple[torch.Tensor, bool]:
        """The merged forward's losses (replayed from a CUDA graph where ``cuda_graph``: :mod:`hdet.graphs`), and
        whether a graph ran."""
        with cross_entropy.routed():  # (the loss runs vmapped over the replicas' outputs)
            if self._graphs is None:
                return self._merged.losses(batch, loss_fn, _scalar_loss), False
            params = {n: p for n, p in self.stack.params.items() if p.requires_grad}
            losses, _, graphed = self._graphs.losses(batch, loss_fn, params, tuple(m.training for m in self._modules[0]))
            return losses, graphed

    def _no_merge(self, why: str) -> None:
        warnings.warn(f"hdet: mode='merged' cannot run these replicas as one batch ({why}); running them vmapped",
                      stacklevel=user_stacklevel())
        self.mode = "vmap"
        self._merged = None

    def _merged_step(self, batch: Any, loss_fn: LossFn) -> torch.Tensor | None:
        """The forward and backward on the merged batch; None where it cannot run (the engine is vmapped from then
        on). The first merged step of each loss function and batch shapes (:func:`_merge_key`) is checked against vmap
        first (:meth:`_check_merged`)."""
        key, keep = _merge_key(batch, loss_fn)
        if key not in self._merge_checked:
            if len(self._merge_checked) >= MAX_MERGE_CHECKS:
                self._no_merge(f"more than {MAX_MERGE_CHECKS} loss functions or batch shapes, each checked against vmap "
                               "at its first merged step")
                return None
            why = self._check_merged(batch, loss_fn)
            if why:
                self._no_merge(why)
                return None
            self._merge_checked[key] = keep
        try:
            return self._vmap_losses(batch, loss_fn, merged=True)
        except NotMergeable as e:  # (raised in the forward, before anything changed)
            self._no_merge(str(e))
            return None
        except Exception as e:  # noqa: BLE001 - the forward on the merged batch failed: vmapped if vmap runs it
            failed = e
        try:
            losses = self._vmap_losses(batch, loss_fn)
        except Exception:  # vmap fails too: the step's own error (loss_fn, batches), still merged for the next
            raise failed from None
        self._no_merge(failure(failed))
        return losses

    def _check_merged(self, batch: Any, loss_fn: LossFn) -> str | None:
        """Why the merged batch does not compute what vmap does for this step, or None (:func:`hdet.merged.check_merged`)."""
        before = self._before_forward()
        vmapped = lambda b: self._eager_vmapped(self._vmap_fns(loss_fn)[0],  # noqa: E731
                                                (self._call_params, self._call_buffers, b))[0]
        return check_merged(self._merged, batch, loss_fn, _scalar_loss, vmapped, lambda: self._restore_forward(before))

    @property
    def _cuda_graphs(self) -> bool:
        options = self.compile if isinstance(self.compile, dict) else {}
        return options.get("mode") in ("reduce-overhead", "max-autotune") or bool(
            (options.get("options") or {}).get("triton.cudagraphs"))

    def _compiled(self, eager: Callable[..., Any], key: Any) -> Callable[..., Any] | None:
        """``torch.compile`` of the vmapped function, or None (with the fallback's warning) where it cannot be built.
        dynamic=False: a new shape (another model in this process, a new batch size) compiles on its own; torch.compile
        would otherwise trace it with symbolic sizes, which vmap's batched tensors refuse."""
        options = {"dynamic": False, **(self.compile if isinstance(self.compile, dict) else {})}
        if self._cuda_graphs:  # CUDA graphs: the stacked tensors are updated in place and never replaced, so the
            for t in (*self._call_params.values(), *self._call_buffers.values()):  # graphs may read them where they
                torch._dynamo.mark_static_address(t)  # are (no copy a step)
        try:
            return torch.compile(eager, **options)
        except Exception as e:  # noqa: BLE001 - a compile that cannot be set up: eagerly, as below
            self._reject([eager, None, False], key, None, failure(e))
            return None

    def _forward(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[torch.Tensor, dict[str, Any]]:
        try:
            return fn(*args)
        finally:
            self._call.restore()  # (a submodule under two names: see _Call)

    @torch.no_grad()
    def _keep_reassigned(self, reassigned: dict[str, torch.Tensor]) -> None:
        """The buffers the vmapped forward reassigned (see :class:`_Call`), copied into the stacked buffers (the
        replicas' modules hold views of them), as each replica's module keeps its own in the loop. One reassigned
        with another shape or dtype (a cache rebuilt for a longer sequence, a mask cast to the input's dtype) cannot
        be kept stacked: it is left as it was, with a warning once (harmless for a cache the forward rebuilds; for
        state, update it in place or use mode='loop')."""
        for name, new in reassigned.items():
            old = self.stack.buffers[name[2:]]
            if new.shape != old.shape or new.dtype != old.dtype:
                if name not in self._unkept:
                    self._unkept.add(name)
                    warnings.warn(f"hdet: the forward reassigns the buffer {name[2:]!r} as a {new.dtype} tensor of shape "
                                  f"{tuple(new.shape[1:])}, where the vmapped replicas hold a {old.dtype} one of shape "
                                  f"{tuple(old.shape[1:])}: its new value is not kept (as torch.func.functional_call "
                                  "leaves it). Harmless for a cache the forward rebuilds; for state, update it in "
                                  "place, or use mode='loop'", stacklevel=user_stacklevel())
                continue
            old.copy_(new)

    # -- loop path ----------------------------------------------------------------------------------
    def _loop_losses(self, batches: Sequence[Any], loss_fn: LossFn) -> torch.Tensor:
        losses = []
        for m, b in zip(self.models, batches):
            for p in m.parameters():
                p.grad = None
            loss = _scalar_loss(loss_fn(m, b))
            loss.backward()
            losses.append(loss.detach())
        if self.share_gradients:
            self._average_gradients()
        return torch.stack(losses)

    def _average_gradients(self) -> None:
        """The all-reduce of DDP over the replica axis: ``sum_r g_r / N`` in replica order, leaving out
        non-finite contributions as hdet's gradient guard does under DDP."""
        N = self.num_replicas
        params = [list(m.parameters()) for m in self.models]
        oks = [torch.stack([all_finite(p.grad) for p in ps if p.grad is not None] or [torch.tensor(True)]).all()
               for ps in params]  # per replica: is every gradient finite (a float64 sum: no fp16 overflow)
        names = None
        for i in range(len(params[0])):
            grads = [ps[i].grad for ps in params]
            if all(g is None for g in grads):
                continue
            if any(g is None for g in grads):  # the loss reached it on some replicas only (a data-dependent branch):
                # they count 0, as DDP's find_unused_parameters=True does, and every replica gets the mean
                names = names or [n for n, _ in self.models[0].named_parameters()]
                frozen = [r for r, ps in enumerate(params) if grads[r] is None and not ps[i].requires_grad]
                if frozen:
                    raise RuntimeError(f"Expected {names[i]!r} trainable on every replica or on none, but replica(s) "
                                       f"{frozen} froze it (requires_grad=False) where others train it: freeze or "
                                       "unfreeze a parameter on every replica")
                like = next(g for g in grads if g is not None)
                for ps, g in zip(params, grads):
                    if g is None:
                        ps[i].grad = torch.zeros_like(like)
                grads = [ps[i].grad for ps in params]
            # sum_r g_r / N with a non-finite replica's gradient as 0 (the gradient guard, hdet.guard); fp16/bf16
            # summed in float32 and divided once, as vmap mode does (divided first in their dtype, 32 bf16 replicas'
            # mean was up to 2.9% off and small fp16 gradients came out 0: an audit)
            dtype = accumulation(grads[0].dtype)
            first = N if dtype == grads[0].dtype else 1  # divided first (as DDP), or once after a float32 sum
            acc = torch.where(oks[0], grads[0].to(dtype) / first, 0.0)
            for g, ok in zip(grads[1:], oks[1:]):
                acc.add_(torch.where(ok, g.to(dtype) / first, 0.0))
            if first == 1:
                acc.div_(N)
            for g in grads:
                g.copy_(acc)

    def finish(self) -> bool:
        """Average the replicas now, for a run that ends before ``total_steps`` (early stopping, a time limit): the
        converge step the last step would have run (:meth:`hdet.HDETLR.finish`). Nothing when the last step taken
        was a sync step, or none was taken. Returns whether it averaged."""
        self._swap.check("engine.finish() was called")
        t = self.steps_taken
        if t <= 0 or self.schedulers[0].ensemble.is_sync_step(t) or self._finished_at() == t:
            return False
        self._sync(t)
        for s in self.schedulers:
            s._finished_at = t  # (in their states: a resumed engine's finish() at t is not a second sync)
            s.reapply()  # the values the sync dealt, should training go on
        self._raise_hook_errors()
        return True

    def close(self) -> None:
        """Every replica's scheduler closed (:meth:`hdet.HDETLR.close`) and each optimizer given its own state: after
        the run (done by itself after the step at ``total_steps``) or after :meth:`finish`, so that a replica's model
        and optimizer train on alone as plain torch would (a fine-tune of ``models[0]`` with ``optimizers[0]`` shared
        the other replicas' moments and step counts with the stacked step: an audit). Idempotent."""
        self._swap.check("engine.close() was called")
        for s in self.schedulers:
            s.close()
        if self._stacked is not None:
            self._stacked.release()
            self._stacked = None  # (optimizer_path keeps what the run stepped with: summary.json reports it)
        if self.stack is not None:  # each replica its own .grad too (a closed engine that loads a state steps per
            self.stack.own_grads()  # replica, on one shared row otherwise: a review)

    def swap_in_average(self) -> bool:
        """Put the replicas' average into every replica, to evaluate (or save) the model the ensemble is building
        between converge steps: :meth:`hdet.HDETLR.swap_in_average` for the N replicas at once (the finite replicas'
        mean of the parameters and floating-point buffers, each replica's own kept aside: N copies). Right after a
        converge step nothing changes but a model's floating-point buffers (BatchNorm's: a forward in training mode
        since moves them apart), which are averaged; after :meth:`finish` or the last step nothing at all. Until :meth:`swap_back`, :meth:`step` and :meth:`finish` raise
        :class:`hdet.SwappedInError`. Returns whether the weights changed. HOST SYNC: one read of N flags."""
        self._swap.check("swap_in_average() was called again")
        ens = [s.ensemble for s in self.schedulers]
        lists = [e.model_tensors() for e in ens]
        t = self.steps_taken
        finite = None
        ended = self._finished_at() == t or t >= self.schedulers[0].total_steps
        params_equal = t > 0 and (ens[0].is_sync_step(t) or ended)
        equal = params_equal and (ended or all(all(s) for _, s in lists))
        if self.num_replicas > 1 and not equal:  # (floating-point buffers: a forward since the converge step may have
            # moved them apart, as a micro-batch of a DDP run's gradient accumulation did: an audit)
            dev = self.group.device
            oks = [health(ts, strict, dev)[0] if ts else torch.ones((), dtype=torch.bool, device=dev)
                   for ts, strict in lists]
            finite = torch.stack(oks).tolist()  # HOST SYNC
        tensors = [ts for ts, _ in lists]
        some = [[x for x, s in zip(ts, strict) if not s] for ts, strict in lists] if params_equal else tensors

        def average(bad: list[int]) -> None:
            average_local(some, bad)
            for m, ts in zip(self.models, tensors):  # (spectral norms' u, v for the averaged weights)
                spectral.refresh_(m, lambda ts=ts: ts)

        owns = [[h.get() for h in e.hypers] for e in ens]  # (before the swap-in: it averages a value in a buffer)
        changed = self._swap.swap_in(tensors, finite, average,
                                     [innermost(o) for o in self.optimizers],
                                     keep=[unaveraged_buffers(m) for m in self.models])
        for e, own in zip(ens, owns):  # every replica's explored values at their base meanwhile (its own objects)
            self._swap.hold_values(e.hypers, explored_bases(e), own)
        return changed

    def _finished_at(self) -> int | None:
        """The step :meth:`finish` averaged the replicas after (kept by the schedulers, in their states)."""
        return self.schedulers[0]._finished_at

    def swap_back(self) -> bool:
        """Put every replica's own weights and buffers back after :meth:`swap_in_average`. Returns whether the
        average was in."""
        return self._swap.swap_back()

    def averaged(self) -> contextlib.AbstractContextManager[bool]:
        """``with engine.averaged(): evaluate(engine.models[0])``: :meth:`swap_in_average`, then :meth:`swap_back`."""
        return averaged(self)

    @property
    def steps_taken(self) -> int:
        """Optimizer steps taken: the schedulers' own count (one counter, not two)."""
        return self.schedulers[0].last_epoch

    # -- state ----------------------------------------------------------------------------------------
    STATE_VERSION = 1

    def state_dict(self) -> dict[str, Any]:
        """Every replica's model, optimizer and scheduler state, as plain data (``torch.load(weights_only=True)``
        reads it). The global RNG (dropout masks, data order) is the caller's to save, as in any training loop.
        Snapshots the replicas share (:class:`hdet.stability.SharedCopies`) are one tensor in it. Inside
        :meth:`averaged` each replica's own weights and buffers, those kept aside, not the average swapped in (the
        resume is exact wherever it is saved; ``engine.models[0].state_dict()`` there is the average)."""
        with self._copies[0].saving(), self._copies[1].saving(), self._own_values():
            layout = {n: (list(o) if o is not None else None) for n, o in self.stack.orders.items()} \
                if self.stack is not None else {}  # the parameters' memory order (gradient_layout)
            return {"version": self.STATE_VERSION, "num_replicas": self.num_replicas,
                    "share_gradients": self.share_gradients, "layout": layout,
                    **({"stacked_gave_way": self._gave_way} if self._gave_way is not None else {}),
                    "replicas": [{"model": ms, "optimizer": o.state_dict(), "scheduler": s.state_dict()}
                                 for ms, o, s in zip(self._own_model_states(), self.optimizers, self.schedulers)]}

    @contextlib.contextmanager
    def _own_values(self) -> Iterator[None]:
        """Inside: every replica's own explored values, where :meth:`averaged` holds them at their base (the
        optimizer's param groups a state saves hold them); after: as they were."""
        held = [(h, h.get()) for h, _ in self._swap._values]
        try:
            for h, own in self._swap._values:
                h.set(own)
            yield
        finally:
            for h, v in held:
                h.set(v)

    def _own_model_states(self) -> list[dict[str, Any]]:
        """Every replica's ``model.state_dict()``, with its own tensors where the average is swapped in (the copies
        :class:`hdet.swap.AverageSwap` keeps, matched to the live tensors by storage, shape and strides)."""
        states = [m.state_dict() for m in self.models]
        swap = self._swap
        if not swap.active or not swap.tensors:
            return states
        for state, live, own in zip(states, swap.tensors, swap.saved):
            where = {(t.data_ptr(), tuple(t.shape), t.stride()): k for k, t in enumerate(live) if t.numel()}
            for name, v in state.items():
                k = where.get((v.data_ptr(), tuple(v.shape), v.stride())) if isinstance(v, torch.Tensor) else None
                if k is not None:
                    state[name] = own[k]
        return states

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`: the optimizers (every one, or none: :meth:`_load_optimizers`), then the models
        and schedulers (which set each replica's own values on its optimizer). The number of replicas and the gradient mode must match; every scheduler
        state is checked before anything is loaded. Refused inside :meth:`averaged` (the weights kept aside then would
        be put back over the loaded ones: 0.79 off in an audit's run)."""
        self._swap.check("engine.load_state_dict() was called (the replicas' own weights kept aside would be put "
                         "back over the loaded ones)")
        if not isinstance(state, dict) or not isinstance(state.get("replicas"), list) or "num_replicas" not in state:
            got = sorted(state)[:8] if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"Expected a ReplicaEngine state_dict (keys 'version', 'num_replicas', 'replicas'), but "
                             f"got {got}")
        version = state.get("version", 1)
        if int_number(version) is None or version > self.STATE_VERSION:
            raise ValueError(f"Expected a ReplicaEngine state of version <= {self.STATE_VERSION}, but got "
                             f"{version!r}" + (": saved by a newer hdet" if int_number(version) is not None else ""))
        if state["num_replicas"] != self.num_replicas or len(state["replicas"]) != self.num_replicas:
            raise ValueError(f"Expected a state of {self.num_replicas} replicas, but got one of "
                             f"{state['num_replicas']!r} ({len(state['replicas'])} entries)")
        if state.get("share_gradients", True) != self.share_gradients:
            raise ValueError(f"Expected a state saved with share_gradients={self.share_gradients}, but got "
                             f"share_gradients={state.get('share_gradients')}")
        for r, (rs, m, o, sched) in enumerate(zip(state["replicas"], self.models, self.optimizers, self.schedulers)):
            if not isinstance(rs, dict) or set(rs) != {"model", "optimizer", "scheduler"}:
                raise ValueError(f"Expected replica {r}'s state with 'model', 'optimizer' and 'scheduler', but got "
                                 f"{sorted(rs) if isinstance(rs, dict) else type(rs).__name__}")
            sched.check_state_dict(rs["scheduler"])  # everything checked before anything is loaded
            want = {k: _shape(v) for k, v in m.state_dict().items()}
            got = _as_loaded(m, rs["model"]) if isinstance(rs["model"], dict) else {}
            if {k: _shape(v) for k, v in got.items()} != want:
                raise ValueError(f"Expected replica {r}'s model state with this model's keys and shapes, but it "
                                 f"differs (missing {sorted(set(want) - set(got))[:5]}, unexpected "
                                 f"{sorted(set(got) - set(want))[:5]})")
            groups = rs["optimizer"].get("param_groups") if isinstance(rs["optimizer"], dict) else None
            if not isinstance(groups, list) or [len(g.get("params", ())) for g in groups] != [
                    len(g["params"]) for g in o.param_groups]:
                raise ValueError(f"Expected replica {r}'s optimizer state with this optimizer's param groups, but "
                                 "it differs")
        saved = state.get("layout") or {}
        params = self.stacked_params
        if self.stack is None and isinstance(saved, dict):  # a loop engine: a vmap engine's storage order does not
            saved = {}  # apply (each replica's own state is loaded as is)
        if not isinstance(saved, dict) or any(
                n not in params or not (o is None or (isinstance(o, (list, tuple)) and
                                                      sorted(o) == list(range(params[n].dim() - 1))))
                for n, o in saved.items()):
            raise ValueError("Expected the state's 'layout' to give each stacked parameter's dims in storage order "
                             "(a permutation of its dims, or None), but it does not: a corrupted or foreign state")
        steps = {rs["scheduler"]["last_epoch"] for rs in state["replicas"]}
        if len(steps) > 1:
            raise ValueError(f"Expected every replica's scheduler state at the same step, but got last_epoch "
                             f"{[rs['scheduler']['last_epoch'] for rs in state['replicas']]}")
        closed = self._stacked is None and self.optimizer_path == "stacked"  # (released by close(): the loaded run
        # goes on with each replica's optimizer.step())
        if self.stack is not None and self.stack.relayout and not self.stack.grads_bound and saved:
            # lay the parameters out as the saved engine had them (from its first backward on): the same memory
            # order, so the resumed run's sums round as the uninterrupted run's
            self.stack.set_layout({n: (tuple(o) if o is not None else None) for n, o in saved.items()})
        gave_way = state.get("stacked_gave_way")
        for graphs in (self._graphs, self._vgraphs):  # (captured again at the next step: a graph reads the tensors
            if graphs is not None:  # where they were)
                graphs.clear()
        with warnings.catch_warnings(record=True) as caught:  # each replica's scheduler says the same: once
            warnings.simplefilter("always")
            self._load_optimizers([rs["optimizer"] for rs in state["replicas"]])  # (first: the one load not checked
            for m, s, rs in zip(self.models, self.schedulers, state["replicas"]):  # before)
                m.load_state_dict(rs["model"])  # in place: in vmap mode the stacked tensors follow
                s.load_state_dict(rs["scheduler"])
        for message, category in dict.fromkeys((str(w.message), w.category) for w in caught):
            warnings.warn(message, category, stacklevel=user_stacklevel())
        if self._stacked is not None and isinstance(gave_way, str):
            # the saved run's stacked step had given way to each replica's optimizer.step() (a parameter without a
            # gradient, ...), which rounds otherwise: so does the resumed run's (it stacked again, 1e-7 off: an audit)
            warnings.warn(f"hdet: the saved engine had gone over to each replica's optimizer step ({gave_way}); this "
                          "one does too, to go on as it did", stacklevel=user_stacklevel())
            self._stop_stacked(gave_way, warn=False)  # (the reason kept as saved: a second resume says it once)
            self.optimizer_path += ", as the saved engine"
        if closed and not all(s.closed for s in self.schedulers):
            self.optimizer_path = "per-replica: loaded after the engine closed"
        elif all(s.closed for s in self.schedulers) and self._stacked is not None:  # (a closed run's state: each
            self._stacked.release()  # optimizer its own state, as after close(); an audit found the stacked step
            self._stacked = None  # back for a run that could take no step)
        self._following = None

    def _load_optimizers(self, states: list[Any]) -> None:
        """Each replica's optimizer state, or none: one that fails to load (another optimizer's state: torch's
        ``KeyError: 'step'`` for SGD's into AdamW, after replica 0's model was loaded, an audit; AdamW's into SGD, whose
        param groups then lack SGD's options, loads in torch and failed at the step) puts back every
        optimizer loaded so far, and a ValueError says which. The stacked step takes the loaded states in at its next
        step."""
        olds: list[dict[str, Any]] = []
        for r, (o, st) in enumerate(zip(self.optimizers, states)):
            olds.append(o.state_dict())  # (its own tensors: a load replaces them, it does not write into them)
            keys = {k for k in innermost(o).defaults if all(k in g for g in o.param_groups)}  # (its own options, as
            # every group of it holds them: not a group's name, nor a key some optimizers add at their first step)
            try:
                o.load_state_dict(st)
                lacks = sorted({k for g in o.param_groups for k in keys if k not in g})
                if lacks:  # (AdamW's into SGD: torch loads it, and its step raised a bare KeyError: 'momentum', an
                    raise KeyError(f"its param groups lack {lacks}")  # audit)
            except Exception as e:
                for q, old in zip(self.optimizers, olds):
                    q.load_state_dict(old)
                raise ValueError(f"Expected replica {r}'s optimizer state to load into its "
                                 f"{type(innermost(o)).__name__}, but it did not ({type(e).__name__}: {e}): a state "
                                 "of another optimizer? Nothing was loaded") from e
        for o in self.optimizers:
            for st in o.state.values():  # a state saved by the stacked step holds views of one shared copy
                st.update({k: v.clone() for k, v in st.items() if isinstance(v, torch.Tensor)})

    # -- one step ---------------------------------------------------------------------------------
    def step(self, batches: Sequence[Any] | Any, loss_fn: LossFn, *, stacked: bool = False) -> torch.Tensor:
        """One optimizer step of every replica on its own batch; returns the losses, shape ``[N]``
        (on the device, no host sync except at sync steps).

        ``batches``: a sequence of N per-replica batches, or with ``stacked=True`` one batch whose
        tensors have a leading replica axis of size N. ``loss_fn(module, batch)`` returns a scalar."""
        self._swap.check("engine.step() was called")
        N = self.num_replicas
        steps = {s.last_epoch for s in self.schedulers}  # host-side counters: no sync
        if len(steps) > 1:
            raise ReplicaMismatchError(f"Expected every replica's scheduler at the same step, but their last_epoch "
                                       f"values are {[s.last_epoch for s in self.schedulers]} (stepped or loaded "
                                       "apart?); nothing was run")
        t = steps.pop() + 1  # this step's number: the schedulers' count, right after a load_state_dict too
        total = self.schedulers[0].total_steps
        if t > total:  # before the step changes anything (the scheduler would refuse it after the optimizer's)
            raise ValueError(f"Expected at most total_steps={total} engine steps, but this is step {t}; "
                             f"{self.schedulers[0].past_the_end()} (nothing was run)")
        if any(s.closed for s in self.schedulers):  # (close() after finish(), or a closed run's state loaded: the
            # optimizers stepped, then the schedulers refused, the weights a step ahead of them: a review)
            raise RuntimeError(f"hdet: engine.step() at step {t} of an engine whose schedulers are closed (close() "
                               "after finish(), or a closed run's state loaded): nothing was run. Build a new engine "
                               "to train with HDET again, or train a replica alone with its own optimizer")
        if self._stacked is not None and (why := foreign_pre_hooks(self.optimizers)):  # (a dict's truth a replica)
            raise RuntimeError(f"hdet: engine.step() at step {t}: {why}, registered after the engine was built, and "
                               "the engine's stacked optimizer step calls no pre-hook (it would leave them uncalled; each "
                               "replica's own step would now share one averaged .grad, which a hook that changes it in "
                               "place would change N times): nothing was run. Register the hook before building the "
                               "engine (it then steps each replica's optimizer, each with its own .grad), or build it "
                               "with stacked_optimizer=False")
        n = _leading(batches) if stacked else (len(batches) if isinstance(batches, Sequence) else None)
        if n != N:
            raise ValueError(f"Expected one batch per replica ({N}), but got {n}")
        if not self._said_fp16:
            self._said_fp16 = _unscaled_fp16(next(self.models[0].parameters(), None))
        def vmapped() -> torch.Tensor:
            losses = self._vmap_losses(batches if stacked else _stack_batches(batches), loss_fn)
            self.stack.point_grads()
            self.stack.unbind_missing()  # a parameter the loss did not reach: no gradient (None), as in the loop
            return losses

        def looped() -> torch.Tensor:
            return self._loop_losses([_index_batch(batches, r) for r in range(N)] if stacked else list(batches),
                                     loss_fn)

        if self.mode != "loop":
            self._check_flags()
            self._check_frozen()
            self._check_hooks()
        losses = None
        if self.mode == "merged":  # (None: it fell back to vmap, self.mode says so)
            with _noting_the_mode("merged"):
                losses = self._merged_step(batches if stacked else _stack_batches(batches), loss_fn)
        if losses is not None:  # each replica's .grad its view of the stacked gradient (per-replica optimizers
            self.stack.point_grads()  # read them), None where the loss did not reach a parameter, as vmapped()
            self.stack.unbind_missing()
        elif self.mode == "vmap":
            with _noting_the_mode("vmap"):
                losses = vmapped()
        elif self.mode == "auto":
            saved, *rng = self._before_forward()  # (the failed attempt's dropout draws: the loop draws as mode="loop")
            try:
                losses = vmapped()
                self.mode = "vmap"
            except Exception as e:  # noqa: BLE001 - any failure of vmap: the loop, if the loop can run the step
                self._restore(saved)
                self._restore_rng(*rng)
                try:
                    losses = looped()
                except Exception:  # the loop fails too: the step's own error (loss_fn, batches), mode stays auto
                    self._restore(saved)
                    raise
                warnings.warn(f"hdet: torch.func.vmap cannot run this model ({type(e).__name__}: {e}); "
                              "using the loop over replica copies" + (" (cuda_graph has no effect there)"
                                                                      if self.cuda_graph else ""),
                              stacklevel=user_stacklevel())
                self.mode = "loop"
        else:
            losses = looped()
        if not self._said_coarse and any(s.ensemble.config.enable_auto_lr and not s.ensemble.config.probing
                                         for s in self.schedulers):  # (before anything steps: a warning raised as an
            # error leaves the optimizers and schedulers together; the fit controller ranks its probes instead)
            self._said_coarse = coarse_loss(losses, "the replicas' loss (loss_fn's)")
        if self.before_optimizer_step is not None:  # e.g. per-replica gradient clipping (hdet.GradClip)
            for r, (m, o) in enumerate(zip(self.models, self.optimizers)):
                self.before_optimizer_step(r, m, o)
            dropped = self.stack.rebind_grads() if self.stack is not None else []
            if self._stacked is not None and dropped:  # the stacked step moves every column: per-replica steps skip
                self._stop_stacked(f"before_optimizer_step set the gradient of {_names(dropped)} to None at step {t}")
        stepped = False
        if self._stacked is not None and self.stack.missing:  # the stacked step moves every column: per-replica
            self._stop_stacked(f"{_names(self.stack.missing)} got no gradient at step {t} (unused in the loss)")  # steps
            # skip it
        if self._stacked is not None and self.mode in ("vmap", "merged"):
            try:
                self._stacked.step()  # every replica's optimizer.step() at once
                stepped = True
            except Unstackable as e:  # raised before anything changed: step each replica, from now on
                self._stop_stacked(str(e))
        if not stepped:
            if self._stacked is not None:  # "auto" fell back to the loop (which warned)
                self._stop_stacked("loop mode", warn=False)
            for o in self.optimizers:
                o.step()
            share_local([s.ensemble.step_scale for s in self.schedulers])  # Prodigy's estimate, one per step
        kept = losses.detach().clone()  # the windows' copy (the caller may write into what step() returns)
        for s, loss in zip(self.schedulers, kept):
            s.ensemble.window.keep(loss)  # = s.observe(loss), with one copy for the N replicas
        self._begin_steps()
        if t == 1 or any(s.ensemble.stability.kept_start_at(t) for s in self.schedulers):
            # the start's snapshots (under recover) were made: the first sync's copies start afresh
            for c in self._copies:
                c.clear()
        if self.schedulers[0].ensemble.is_sync_step(t):
            self._sync(t)
        self._end_steps()
        if all(s.closed for s in self.schedulers):  # the run is over (each scheduler closed itself)
            self.close()
        self._raise_hook_errors()
        return losses

    def _raise_hook_errors(self) -> None:
        """The first error an ``on_sync`` hook (a logger) raised at this step's sync, once every replica's step is
        complete (raised inside the sync, it left the schedulers half-stepped, and no checkpoint could be written)."""
        errors = [s.ensemble.hook_error for s in self.schedulers]
        for s in self.schedulers:
            s.ensemble.hook_error = None
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    def _begin_steps(self) -> None:
        """Every scheduler's first half of its step; the base schedule computed once, by replica 0's."""
        lead = self.schedulers[0]
        following = lead if self._follow() else None  # (checked before the lead steps)
        lead.begin_step()
        for s in self.schedulers[1:]:
            s.begin_step(following)

    def _end_steps(self) -> None:
        """Every scheduler's second half: each replica's values for the next step, from replica 0's bases."""
        lead = self.schedulers[0]
        following = lead if self._follow() else None  # (checked before the lead steps)
        lead.end_step()
        for s in self.schedulers[1:]:
            s.end_step(following)

    def _follow(self) -> bool:
        """Whether every replica's scheduler can take replica 0's base schedule at each step (the same schedule
        in the same state: :meth:`hdet.HDETLR.follows`), checked at the first step, after each sync and load."""
        if not self.share_base_schedule:
            return False
        if self._following is None:
            self._following = all(s.follows(self.schedulers[0]) for s in self.schedulers[1:])
        return self._following

    def _sync(self, t: int) -> None:
        """One sync of the N ensembles, in the three phases of :class:`hdet.ensemble.Ensemble`, with the
        replica axis as the transport. HOST SYNC: the stacked vectors are read once."""
        ens = [s.ensemble for s in self.schedulers]
        with contextlib.ExitStack() as failing:  # an exception here leaves every replica's scheduler half-stepped
            for e in ens:
                failing.enter_context(e.marking_failure(t))
            self._sync_all(t, ens)

    def _sync_all(self, t: int, ens: list[Any]) -> None:
        rows = torch.stack([e.prepare_sync(t) for e in ens]).to("cpu", torch.float64)  # HOST SYNC: one copy
        verdicts = [e.check_sync(t, rows) for e in ens]  # the same verdict on every replica
        bad = verdicts[0].exclude
        average_local([e.tensors() for e in ens], bad)  # Eq. 3 over the healthy replicas
        if bad:
            average_local([e.recovery_tensors() for e in ens], bad, into=bad)  # the reset replicas' moments
            _reset_steps([e.param_steps() for e in ens], bad)
        try:
            for e, v in zip(ens, verdicts):
                e.finish_sync(t, v)
        finally:  # the next sync's copies start afresh (the snapshots keep what they need)
            for c in self._copies:
                c.clear()
            self._following = None  # checked again at the next step (a few us a replica)


MAX_LOSS_FNS = 8  # loss functions whose vmapped (and compiled) forms the engine keeps
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_BWD, _BWD_PRE = operator.attrgetter("_backward_hooks"), operator.attrgetter("_backward_pre_hooks")
_POST_ACC = operator.attrgetter("_post_accumulate_grad_hooks")


def _backward_hooks(module: nn.Module, views: dict[str, list[torch.Tensor]] | None, r: int = 0) -> str | None:
    """What backward hooks replica ``r``'s ``module`` has (its modules' full, pre and legacy ones, its parameters':
    ``views``, the engine's stacked parameters' per-replica views; torch's global ones), said; None where none (the
    vmapped and merged backward never reach them; tensor hooks set inside ``forward`` are not seen: docs/engine.md)."""
    glob = nn.modules.module
    if glob._global_backward_hooks or glob._global_backward_pre_hooks:
        return "global module backward hooks are registered"
    for name, m in module.named_modules():
        if m._backward_hooks or m._backward_pre_hooks:
            return f"{name or 'the model'!r} ({type(m).__name__}) on replica {r} has backward hooks"
    for name, ps in (views or {}).items():
        if ps[r]._backward_hooks or ps[r]._post_accumulate_grad_hooks:
            return f"parameter {name!r} on replica {r} has hooks"
    return None
MAX_MERGE_CHECKS = 16  # (loss function, batch shapes) pairs mode='merged' checks at their first step, then vmap


@contextlib.contextmanager
def _noting_the_mode(mode: str) -> Iterator[None]:
    """An error out of a step in an explicit ``mode="vmap"``/``"merged"`` (torch's own: "Batching rule not implemented",
    ".item() under vmap", an escaped tensor) gets a note that the loop runs such models (Python 3.11+)."""
    try:
        yield
    except Exception as e:
        if hasattr(e, "add_note"):
            e.add_note(f"hdet: raised in a ReplicaEngine step with mode={mode!r}, which runs the replicas under "
                       "torch.func.vmap: where one replica runs without error, vmap cannot run this model (LSTM, "
                       "spectral_norm, torch.utils.checkpoint, a host read in the forward, ...): mode='auto' falls "
                       "back to the loop over replica copies, mode='loop' uses it")
        raise


def _merge_key(batch: Any, loss_fn: LossFn) -> tuple[Any, list[Any]]:
    """What mode='merged' checks once, at its first step: the loss function (its code, a partial's arguments, a bound
    method's or a callable's object: the same code with other arguments mixed rows unseen, an audit; not a closure's
    cells, which may change every step, a loss weight's ramp, and would each be a new function) and the batch's shapes
    and dtypes (a new shape can make a statistic cross the replicas' rows); with the objects the key refers to."""
    fn_key, keep = function_key(loss_fn, closure=False)
    shapes = tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t) for t in tree_leaves(batch))
    return (fn_key, shapes), keep


def _code_of(loss_fn: Any) -> Any:
    """What tells loss functions apart for the compile checks, bounded however many are made: a function's code (an
    inline lambda is a new object with the same code each step), a partial's function's, else the callable's type."""
    while isinstance(loss_fn, functools.partial):
        loss_fn = loss_fn.func
    return getattr(loss_fn, "__code__", None) or type(loss_fn)


def _shape(value: Any) -> tuple[int, ...] | None:
    """A model state entry's shape; None for a module's extra state (``get_extra_state``: any object, which has
    none; it raised AttributeError in the load's check, an audit)."""
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _as_loaded(module: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` as ``module.load_state_dict`` will see it: after the modules' own load hooks (a model that renamed a
    tensor maps an older checkpoint's key to the new one, e.g. ``ByteGPT``'s ``pos``), on a shallow copy."""
    state = dict(state)
    for name, mod in module.named_modules():
        for hook in getattr(mod, "_load_state_dict_pre_hooks", {}).values():
            hook(state, f"{name}." if name else "", {}, True, [], [], [])
    return state


def _lower_backward_now() -> contextlib.AbstractContextManager:
    """The compiled function's backward compiled with its forward (torch compiles it lazily, at the first backward,
    outside the fallback that catches a compile's failure: a failing backward compile raised at every step, with
    BatchNorm's statistics updated each time; an audit)."""
    config = getattr(getattr(torch, "_functorch", None), "config", None)
    if config is None or not hasattr(config, "force_non_lazy_backward_lowering"):
        return contextlib.nullcontext()
    return config.patch(force_non_lazy_backward_lowering=True)


def _check_compile(compile: Any) -> None:
    """``compile``: a bool, or torch.compile's keyword arguments with a backend torch knows. A wrong one used to surface
    at the first step as a failure of vmap itself, and ``mode="auto"`` then ran the loop, uncompiled (an audit)."""
    if not isinstance(compile, (bool, dict)):
        raise ValueError(f"Expected compile to be a bool or a dict of torch.compile's keyword arguments, but got "
                         f"{type(compile).__name__}")
    if not isinstance(compile, dict):
        return
    parameters = inspect.signature(torch.compile).parameters
    known = set(parameters) - {"model"}
    unknown = sorted(set(compile) - known)
    if unknown and not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):  # (a wrapper takes anything)
        raise ValueError(f"Expected compile's keys among torch.compile's keyword arguments {sorted(known)}, but got "
                         f"{unknown}")
    backend = compile.get("backend", "inductor")
    listed = getattr(torch.compiler, "list_backends", None)
    if isinstance(backend, str) and listed is not None and backend not in listed(exclude_tags=()):
        raise ValueError(f"Expected compile's backend among torch's {sorted(listed(exclude_tags=()))} (or a callable), "
                         f"but got {backend!r}")


@torch.no_grad()
def _reset_steps(steps: list[list[torch.Tensor]], bad: list[int]) -> None:
    """The reset replicas' step counts (Adam's, per parameter) become the healthy replicas' mean, rounded (equal
    with shared gradients; in local mode a replica whose guard skipped steps has a count of its own)."""
    healthy = [r for r in range(len(steps)) if r not in bad]
    if not healthy or not steps[0] or any(len(s) != len(steps[0]) for s in steps):
        return
    for k in range(len(steps[0])):
        mean = torch.stack([steps[r][k].detach().double().reshape(()).cpu() for r in healthy]).mean().round()
        for r in bad:
            steps[r][k].copy_(mean)


def _holds(model: nn.Module, replica: nn.Module) -> bool:
    """Whether ``model`` holds a parameter of ``replica`` (the replica's module, a submodule or a wrapper of it)."""
    own = {id(p) for p in replica.parameters()}
    return any(id(p) in own for p in model.parameters())


def _names(names: Sequence[str]) -> str:
    """Parameter names for a message: the first three, and how many more."""
    shown = ", ".join(repr(n) for n in list(names)[:3])
    return f"parameter {shown}" if len(names) == 1 else f"parameters {shown}" + (
        f" and {len(names) - 3} more" if len(names) > 3 else "")
