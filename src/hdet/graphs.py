"""The engine's step replayed from CUDA graphs: :class:`StepGraphs` (``ReplicaEngine(..., cuda_graph=True)``).

The forward and backward of a loss function, vmapped or merged (:mod:`hdet.merged`), are captured with
``torch.cuda.make_graphed_callables`` over the stacked parameters and a copy of the batch's tensors the graph owns,
and replayed at later steps: the host then launches one graph instead of every kernel (the tiny GPT on an H200 ran
1.2x one eager model vmapped, 1.6x merged: ``benchmarks/results/gpu_h200/step_graph/``). A graph replays what it
captured, so its key
holds everything the engine can see that changes the computation: the loss function's code and what it closes over
(a ``functools.partial``'s arguments, closure cells and defaults: values, or objects by identity, kept alive with
the graph), the batch's structure, shapes and dtypes, the modules' train/eval flags, autocast, the trainable
parameters, and the matmul precision flags. What it cannot see (a global the loss function reads, a Python value in
the model's forward that changes, a host sync, a data-dependent branch) the user must keep out.

Captured in ``thread_local`` mode, so CUDA work in other threads (a ``DataLoader`` pinning memory) neither breaks the
capture nor is broken by it; with autocast's weight cache off (a graph cannot replay it; the casts are recorded).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import kernels
from .caller import user_stacklevel
from .values import PLAIN

__all__ = ["StepGraphs", "MAX_GRAPHS", "function_key"]

MAX_GRAPHS = 4  # graphs kept (each holds its own memory pool and a copy of its batch)


class StepGraphs:
    """Graphed steps, most recently used last. ``run(batch, loss_fn)`` is the eager forward of one batch (the merged or
    the vmapped one), ``(losses, reassigned)``: the buffers that forward reassigned (a graph cannot keep them, so such a
    step is not captured and the engine keeps them from the eager run). ``keeping()``: a context that puts back what a
    forward changes besides its outputs (the stacked buffers: BatchNorm's statistics), around a capture's warm-up runs.
    Captures and replays run on ``device`` (the current CUDA device may be another)."""

    def __init__(self, run: Callable[[Any, Any], tuple[torch.Tensor, dict[str, Any]]], device: torch.device,
                 keeping: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> None:
        self.run = run
        self.device = device
        self.keeping = keeping
        self.entries: dict[Any, tuple[Callable[..., torch.Tensor] | None, list[Any], list[torch.Tensor]]] = {}
        self.captures = 0
        self._churn_warned = False

    def clear(self) -> None:
        self.entries.clear()

    def losses(self, batch: Any, loss_fn: Any, params: dict[str, torch.Tensor],
               flags: tuple[bool, ...]) -> tuple[torch.Tensor, dict[str, Any], bool]:
        """The losses of ``batch`` (replayed from a graph where one is or can be captured), the buffers an eager run
        reassigned, and whether a graph ran. ``params``: the trainable stacked parameters by name; ``flags``: the
        modules' train/eval flags."""
        leaves, spec = tree_flatten(batch)
        if not all(isinstance(t, torch.Tensor) and t.device == self.device for t in leaves):
            return (*self.run(batch, loss_fn), False)  # (a batch with other leaves: eagerly)
        fn_key, keep = function_key(loss_fn)
        dev = self.device.type
        on = torch.is_autocast_enabled(dev)
        key = (fn_key, spec, tuple((t.shape, t.dtype, t.stride()) for t in leaves), flags, on,
               torch.get_autocast_dtype(dev) if on else None, tuple(params),
               torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32,
               torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
               torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction)
        entry = self.entries.pop(key, None)
        if entry is None:
            entry = self._capture(loss_fn, list(params.values()), leaves, spec, keep)
        self.entries[key] = entry
        while len(self.entries) > MAX_GRAPHS:
            del self.entries[next(iter(self.entries))]
        graph = entry[0]
        if graph is None:
            return (*self.run(batch, loss_fn), False)
        with torch.cuda.device(self.device):
            return graph(*params.values(), *leaves), {}, True  # (the leaves are copied into the graph's own)

    def _capture(self, loss_fn: Any, params: list[torch.Tensor], leaves: list[torch.Tensor], spec: Any,
                 keep: list[Any]) -> tuple[Callable[..., torch.Tensor] | None, list[Any], list]:
        """(the graphed callable or None, what its key refers to, its batch). HOST SYNC: while capturing."""
        self.captures += 1
        if self.captures > 2 * MAX_GRAPHS and not self._churn_warned:
            self._churn_warned = True
            warnings.warn(f"hdet: the replicas' step was captured in a CUDA graph {self.captures} times (new batch "
                          f"shapes, flags or loss functions; {MAX_GRAPHS} kept): each capture costs three warm-up steps, "
                          "a host sync and memory. Keep batches to a few shapes, or leave cuda_graph off",
                          stacklevel=user_stacklevel())
        k, run = len(params), self.run
        static = [t.clone() for t in leaves]  # the graph's own batch (the caller's tensors are not written into)
        reassigned: list[str] = []

        def losses(*args: torch.Tensor) -> torch.Tensor:
            out, new = run(tree_unflatten(list(args[k:]), spec), loss_fn)
            reassigned.extend(new)
            return out
        try:  # (its warm-up and capture runs draw dropout masks, as steps would; they change no weight)
            with torch.cuda.device(self.device), self.keeping(), _thread_local_capture(), _no_autocast_cache(), \
                    warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="The AccumulateGrad node's stream does not match")  # (the
                # eager steps' accumulators; the capture takes gradients with autograd.grad, which never runs them)
                with kernels.for_graphs():  # (the merged replicas' layer norms fused: hdet.kernels)
                    graph = torch.cuda.make_graphed_callables(losses, (*params, *static), allow_unused_input=True)
        except Exception as e:  # noqa: BLE001 - a forward that cannot be captured (a host sync, ...): eagerly
            _after_failed_capture(self.device)
            warnings.warn(f"hdet: the replicas' forward cannot be captured in a CUDA graph ({type(e).__name__}: "
                          f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}); running it eagerly",
                          stacklevel=user_stacklevel())
            return None, keep, []
        if reassigned:
            warnings.warn(f"hdet: the forward reassigns the buffers {sorted(set(n[2:] for n in reassigned))}, which a "
                          "CUDA graph cannot keep: these steps run without one", stacklevel=user_stacklevel())
            return None, keep, []
        return graph, keep, static


def _after_failed_capture(device: torch.device) -> None:
    """A capture that failed can leave the CUDA random generator in capture mode (its next eager draw then fails,
    "Offset increment outside graph capture"): an empty capture that succeeds ends it. Then wait for the warm-up runs'
    kernels, so that nothing restored afterwards races with them."""
    with torch.cuda.device(device):
        try:
            with _thread_local_capture():
                with torch.cuda.graph(torch.cuda.CUDAGraph()):
                    pass
        except Exception:  # noqa: BLE001 - nothing more to undo
            pass
        torch.cuda.synchronize()


def function_key(loss_fn: Any, closure: bool = True) -> tuple[Any, list[Any]]:
    """What tells loss functions apart for a graph: the code, a partial's arguments, the closure's cells, defaults and a
    bound method's object, as values (plain ones) or identities (the objects, returned to be kept alive). ``closure``
    False (merged mode's check, :func:`hdet.engine._merge_key`): not the closure's cells and defaults, which may change
    every step, and a tensor by its shape, dtype and device (not kept alive)."""
    keep: list[Any] = []

    def value(v: Any) -> Any:
        if isinstance(v, PLAIN):
            return ("=", type(v), v)
        if not closure and isinstance(v, torch.Tensor):
            return ("tensor", tuple(v.shape), v.dtype, v.device)
        keep.append(v)
        return ("id", id(v))
    parts: list[Any] = []
    f = loss_fn
    while isinstance(f, functools.partial):
        parts.append((tuple(value(a) for a in f.args), tuple(sorted((k, value(v)) for k, v in f.keywords.items()))))
        f = f.func
    if hasattr(f, "__self__"):  # a bound method: its object
        parts.append(value(f.__self__))
    code = getattr(f, "__code__", None)
    if code is None:  # a callable object: itself
        parts.append(value(f))
        return tuple(parts), keep
    parts.append(code)
    if not closure:
        return tuple(parts), keep
    for cell in getattr(f, "__closure__", None) or ():
        try:
            parts.append(value(cell.cell_contents))
        except ValueError:  # an empty cell
            parts.append(None)
    parts += [value(d) for d in getattr(f, "__defaults__", None) or ()]
    parts += [(k, value(d)) for k, d in sorted((getattr(f, "__kwdefaults__", None) or {}).items())]
    return tuple(parts), keep


@contextlib.contextmanager
def _thread_local_capture() -> Iterator[None]:
    """Inside: ``torch.cuda.graph`` captures in ``thread_local`` mode (``make_graphed_callables`` takes no mode)."""
    base = torch.cuda.graph

    class graph(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kw: Any) -> None:
            kw.setdefault("capture_error_mode", "thread_local")
            super().__init__(*args, **kw)
    torch.cuda.graph = graph
    try:
        yield
    finally:
        torch.cuda.graph = base


@contextlib.contextmanager
def _no_autocast_cache() -> Iterator[None]:
    """Inside: autocast's cache of cast weights off (``make_graphed_callables`` refuses it: a graph records the casts)."""
    before = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(before)
