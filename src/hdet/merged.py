"""The engine's replicas as one batch: :class:`MergedReplicas` (``ReplicaEngine(..., mode="merged")``).

Under ``torch.func.vmap`` every operation of the forward and backward goes through functorch's batching layer, which
on small models costs more host time than the kernels themselves (a 2-layer GPT on one CPU core: 2.2 ms for the
vmapped forward and backward of 8 replicas, 0.9 ms for one model at 8x the batch). A model whose parameters all live
in standard layers (``nn.Linear``, ``nn.LayerNorm``, ``nn.Embedding``, ``nn.RMSNorm``) and whose forward treats the
rows of its batch independently can run all replicas as one batch instead: the replicas' batches ``[N, B, ...]``
become one ``[N * B, ...]`` batch, replica-major, and each of those layers computes its rows with its replica's
weights (one ``baddbmm`` for a linear layer, :mod:`hdet.linear`'s backward; a normalisation over the rows with the
replica's affine; a lookup in the replica's table). Everything else in the forward (activations, dropout, attention,
reshapes) runs once, as for one model. ``loss_fn`` itself still runs under vmap, on each replica's rows of the
model's output, so it returns each replica's loss as before.

What is checked, and what falls back to vmap (with a warning that names the reason): a parameter outside those layers
(a raw ``nn.Parameter`` used in ``forward``), a buffer (BatchNorm's statistics), a subclass of one of the layers (its
own forward), forward hooks, an input every replica shares, a layer that gets rows that are not the batch's, and
``loss_fn`` reading the module's layers or tensors. A forward that mixes rows (a statistic over the batch) is not
visible in the module's structure, so the first merged step is computed both ways, merged and vmapped, from the same
weights and random state with dropout off, and the losses and gradients must agree (to float32 rounding, more under
TF32 or autocast): otherwise vmap from then on.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from . import kernels
from .attention import without_dropout
from .linear import batched_linear
from .values import PLAIN

__all__ = ["MergedReplicas", "NotMergeable", "reason_not_mergeable", "check_merged", "LEAVES"]

_functorch = torch._C._functorch
try:
    from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter as _interpreter
except ImportError:  # pragma: no cover - no functorch
    _interpreter = None

_RMSNorm = getattr(nn, "RMSNorm", None)
LEAVES: tuple[type, ...] = (nn.Linear, nn.LayerNorm, nn.Embedding) + ((_RMSNorm,) if _RMSNorm is not None else ())


class NotMergeable(Exception):
    """The replicas cannot run as one batch; the message says why."""


def reason_not_mergeable(module: nn.Module) -> str | None:
    """Why ``module``'s structure rules the merged batch out, or None."""
    if _interpreter is None or not hasattr(_functorch, "_unwrap_batched"):
        return "this torch has no functorch interpreter API"
    hooks = [getattr(nn.modules.module, h, {}) for h in ("_global_forward_hooks", "_global_forward_pre_hooks",
                                                         "_global_backward_hooks", "_global_backward_pre_hooks")]
    if any(hooks):
        return "global module hooks are registered"
    for name, mod in module.named_modules():
        where = repr(name) if name else "the model"
        buffers = [k for k, b in mod._buffers.items() if b is not None]
        if buffers:
            return f"{where} ({type(mod).__name__}) holds buffers ({', '.join(buffers)})"
        params = [k for k, p in mod._parameters.items() if p is not None]
        if params and type(mod) not in LEAVES:
            return (f"{where} ({type(mod).__name__}) holds parameters ({', '.join(params)}) and is not one of "
                    f"{', '.join(t.__name__ for t in LEAVES)}")
        if any(getattr(mod, h, None) for h in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                                               "_backward_pre_hooks")):
            return f"{where} has hooks"
        if "forward" in mod.__dict__:  # (a forward set on the instance: a wrapper, e.g. compiled or Accelerate's)
            return f"{where} has a forward of its own (set on the instance)"
        if isinstance(mod, nn.Embedding) and (mod.padding_idx is not None or mod.max_norm is not None
                                              or mod.scale_grad_by_freq or mod.sparse):
            return f"{where} (Embedding) uses padding_idx, max_norm, scale_grad_by_freq or sparse"
    return None


class MergedReplicas:
    """Runs ``loss_fn(module, batch)`` for N replicas with their batches merged into one (see the module's doc).

    ``module``: replica 0's module (its structure and train/eval flags); ``stacked``: the stacked ``[N, ...]``
    parameters by name (:attr:`hdet.stacking.StackedReplicas.params`), which the standard layers read."""

    def __init__(self, module: nn.Module, stacked: dict[str, torch.Tensor], num_replicas: int) -> None:
        self.module = module
        self.stacked = stacked
        self.N = num_replicas
        names = {id(p): n for n, p in module.named_parameters()}  # (a tied weight: its first name)
        self.leaves = [(mod, {k: stacked[names[id(p)]] for k, p in mod._parameters.items() if p is not None})
                       for mod in module.modules() if type(mod) in LEAVES]
        self.rows = 0  # the merged batch's rows while the module runs (N * the replicas' batch)
        self.calls = 0  # the module's calls in this loss_fn

    def losses(self, batch: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
               scalar: Callable[[Any], torch.Tensor]) -> torch.Tensor:
        """``[N]``: each replica's ``scalar(loss_fn(module, its batch))``, the module run on the merged batch."""
        proxy = _Proxy(self)

        def one(b: Any) -> torch.Tensor:
            self.calls = 0
            loss = scalar(loss_fn(proxy, b))
            if self.calls and not _functorch.is_batchedtensor(loss):  # (vmap would give every replica this one value)
                raise NotMergeable("loss_fn's loss is one value for every replica (not computed from each one's rows)")
            return loss
        return torch.func.vmap(one, randomness="different")(batch)

    def call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The module's call from inside the vmapped ``loss_fn``: inputs merged, outputs split back per replica."""
        interp = _interpreter()
        if interp is None or interp.level() != 1:
            raise NotMergeable("the engine's vmap is not the only transform around the module's call")
        level = interp.level()
        flat, spec = tree_flatten((args, kwargs))
        per = None
        merged = []
        for t in flat:
            if not isinstance(t, torch.Tensor):
                merged.append(t)
                continue
            if not (_functorch.is_batchedtensor(t) and _functorch.maybe_get_level(t) == level):
                raise NotMergeable("an input to the module is shared by the replicas (not from their batches)")
            x, bdim = _functorch._unwrap_batched(t, level)
            if _functorch.is_functorch_wrapped_tensor(x) or x.dim() < 2:
                raise NotMergeable("an input to the module has no batch axis of its own")
            x = x.movedim(bdim, 0)
            if per is None:
                per = x.shape[1]
            elif x.shape[1] != per:
                raise NotMergeable(f"the module's inputs have {per} and {x.shape[1]} rows a replica")
            merged.append(x.reshape(self.N * x.shape[1], *x.shape[2:]))
        if per is None:
            raise NotMergeable("the module got no tensor input")
        args, kwargs = tree_unflatten(merged, spec)
        self.rows = self.N * per
        self.calls += 1
        with interp.lower(), self._stacked_leaves():
            out = self.module(*args, **kwargs)
        flat, spec = tree_flatten(out)
        split = []
        for y in flat:
            if isinstance(y, torch.Tensor):
                if y.dim() == 0 or y.shape[0] % self.N:
                    raise NotMergeable(f"the module returned a tensor of shape {tuple(y.shape)}, whose leading axis "
                                       f"does not split into the {self.N} replicas' rows")
                y = _functorch._add_batch_dim(y.reshape(self.N, y.shape[0] // self.N, *y.shape[1:]), 0, level)
            elif not isinstance(y, PLAIN):  # (an object holding tensors that tree_flatten does not reach)
                raise NotMergeable(f"the module returned a {type(y).__name__}, whose tensors cannot be split into the "
                                   "replicas' rows (return tensors, or tuples, lists or dicts of them)")
            split.append(y)
        return tree_unflatten(split, spec)

    @contextlib.contextmanager
    def _stacked_leaves(self) -> Iterator[None]:
        """Inside: each standard layer's forward reads its stacked weights (an instance attribute over the class's)."""
        for mod, ws in self.leaves:
            mod.forward = _FORWARDS[type(mod)](self, mod, ws)
        try:
            yield
        finally:
            for mod, _ in self.leaves:
                del mod.forward

    # -- the rows of one replica -------------------------------------------------------------------------
    def split(self, x: torch.Tensor, name: str) -> tuple[torch.Tensor, bool]:
        """``x``'s rows grouped by replica, ``[N, rows a replica, ...]``; a leading axis of 1 (a tensor the replicas'
        rows share, e.g. positions ``[1, T]``) is given to every replica (second value True)."""
        if x.dim() == 0 or x.shape[0] not in (self.rows, 1):
            raise NotMergeable(f"a {name} got an input of shape {tuple(x.shape)}, whose leading axis is not the "
                               f"merged batch's {self.rows} rows")
        if x.shape[0] == 1 and self.rows != 1:
            return x.expand(self.N, *x.shape[1:]), True
        return x.view(self.N, self.rows // self.N, *x.shape[1:]) if x.is_contiguous() else \
            x.reshape(self.N, self.rows // self.N, *x.shape[1:]), False

    def join(self, y: torch.Tensor, shared: bool) -> torch.Tensor:
        """:meth:`split`'s inverse: ``[N, rows a replica, ...]`` as ``[rows, ...]`` (a shared input's result given to
        each of its replica's rows)."""
        if shared:
            y = y.unsqueeze(1).expand(self.N, self.rows // self.N, *y.shape[1:])
        return y.reshape(self.rows, *y.shape[2:])


class _Proxy:
    """What ``loss_fn`` gets as the module: calling it runs the merged batch; plain attributes (``training``, a
    config's numbers) are the module's; its layers and tensors are not reachable (they are per replica)."""

    def __init__(self, merged: MergedReplicas) -> None:
        object.__setattr__(self, "_merged", merged)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._merged.call(args, kwargs)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._merged.module, name)
        if isinstance(value, PLAIN) or (isinstance(value, tuple) and all(isinstance(v, PLAIN) for v in value)):
            return value
        raise NotMergeable(f"loss_fn reads the module's {name!r} ({type(value).__name__}), which is per replica")

    def __setattr__(self, name: str, value: Any) -> None:
        raise NotMergeable(f"loss_fn sets the module's {name!r}")


# -- the standard layers, on the merged rows ---------------------------------------------------------------
def _linear(mr: MergedReplicas, mod: nn.Linear, ws: dict[str, torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    w, b = ws["weight"], ws.get("bias")

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2:  # [features]: one row, no batch axis (merged, the replicas' features would be joined)
            raise NotMergeable(f"a Linear got an input of shape {tuple(x.shape)}, with no batch axis")
        fast = x.shape[0] == mr.rows and x.is_contiguous()  # (the common case, at the least host cost)
        x3, shared = (x.view(mr.N, -1, x.shape[-1]), False) if fast else mr.split(x, "Linear")
        lead = x.shape[1:-1] if fast else x3.shape[1:-1]
        y = batched_linear(x3.reshape(mr.N, -1, x3.shape[-1]), w, b, native=True)
        return y.view(*x.shape[:-1], y.shape[-1]) if fast else mr.join(y.view(mr.N, *lead, y.shape[-1]), shared)
    return forward


def _affine(y: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None, k: int) -> torch.Tensor:
    """``y * w + b`` with one ``[...]`` weight and bias per replica (``y``: ``[N, rows, ..., *normalized]``)."""
    if w is None and b is None:
        return y
    shape = lambda t: t.view(t.shape[0], *([1] * (y.dim() - 1 - k)), *t.shape[1:])  # noqa: E731
    out = y + shape(b) if w is None else torch.addcmul(shape(b), y, shape(w)) if b is not None else y * shape(w)
    return out.to(y.dtype)  # (the norm's dtype, as torch's norm with its affine returns it: float32 weights on a
    # bfloat16 input under CPU autocast promoted it to float32; an audit)


def _layer_norm(mr: MergedReplicas, mod: nn.LayerNorm, ws: dict[str, torch.Tensor]) -> Callable[..., torch.Tensor]:
    shape = tuple(mod.normalized_shape)
    w, b = ws.get("weight"), ws.get("bias")
    D = math.prod(shape)

    def forward(x: torch.Tensor) -> torch.Tensor:
        x3, shared = mr.split(x, "LayerNorm")
        if (not shared and w is not None and b is not None and kernels.layer_norm_wanted(x3)
                and tuple(x3.shape[x3.dim() - len(shape):]) == shape):  # (hdet.kernels' fused layer norm, where it
            # may run: the cheap conditions before the cast)
            xf = x3.float() if x3.dtype in (torch.float16, torch.bfloat16) and torch.is_autocast_enabled(
                "cuda") else x3  # (autocast runs layer_norm in float32)
            x2, w2, b2 = xf.view(mr.N, -1, D), w.reshape(mr.N, D), b.reshape(mr.N, D)  # (views, or copies of N x D)
            if kernels.layer_norm_usable(x2, w2, b2):
                return mr.join(_ReplicaLayerNorm.apply(x2, w2, b2, mod.eps).view(x3.shape), shared)
        return mr.join(_affine(F.layer_norm(x3, shape, None, None, mod.eps), w, b, len(shape)), shared)
    return forward


class _ReplicaLayerNorm(torch.autograd.Function):
    """``F.layer_norm(x[r], (D,), w[r], b[r], eps)`` for every replica ``r`` of ``x`` (``[N, R, D]``) in one pass, and
    its backward in another (:func:`hdet.kernels.layer_norm_rows`). Torch's ops take five passes and a temporary more:
    the norm, the affine's ``addcmul`` forward; ``dy * w``, ``dy * x_hat`` and its sum, the sum of ``dy``, the norm's
    backward."""

    @staticmethod
    def forward(ctx, x, w, b, eps):  # noqa: ANN001, ANN205 - torch's protocol
        y, mean, rstd = kernels.layer_norm_rows(x, w, b, eps)
        ctx.save_for_backward(x, w, mean, rstd)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):  # noqa: ANN001, ANN205
        x, w, mean, rstd = ctx.saved_tensors
        dx, dw, db = kernels.layer_norm_rows_backward(dy.contiguous(), x, w, mean, rstd)
        need_x, need_w, need_b, _ = ctx.needs_input_grad
        return dx if need_x else None, dw if need_w else None, db if need_b else None, None


def _rms_norm(mr: MergedReplicas, mod: nn.Module, ws: dict[str, torch.Tensor]) -> Callable[..., torch.Tensor]:
    shape = tuple(mod.normalized_shape)

    def forward(x: torch.Tensor) -> torch.Tensor:
        x3, shared = mr.split(x, "RMSNorm")
        return mr.join(_affine(F.rms_norm(x3, shape, None, mod.eps), ws.get("weight"), None, len(shape)), shared)
    return forward


def _embedding(mr: MergedReplicas, mod: nn.Embedding, ws: dict[str, torch.Tensor]) -> Callable[..., torch.Tensor]:
    w = ws["weight"]  # [N, V, D]

    def forward(idx: torch.Tensor) -> torch.Tensor:
        i3, shared = mr.split(idx, "Embedding")
        rows = torch.arange(mr.N, device=w.device).view(mr.N, *([1] * (i3.dim() - 1)))
        valid = (i3 >= 0) & (i3 < w.shape[1])  # (an id out of range: NaN, as hdet.embedding makes it under vmap; -1
        # read the replica's last row, silently, where one replica's lookup raises: an audit)
        out = w[rows, torch.where(valid, i3, 0)].masked_fill(~valid.unsqueeze(-1), float("nan"))
        return mr.join(out, shared)  # each replica's rows from its own table
    return forward


_FORWARDS: dict[type, Callable[..., Callable[..., torch.Tensor]]] = {
    nn.Linear: _linear, nn.LayerNorm: _layer_norm, nn.Embedding: _embedding,
    **({_RMSNorm: _rms_norm} if _RMSNorm is not None else {})}


# -- the first step's check --------------------------------------------------------------------------------
def check_merged(mr: MergedReplicas, batch: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
                 scalar: Callable[[Any], torch.Tensor], vmapped: Callable[[], torch.Tensor],
                 restore: Callable[[], None]) -> str | None:
    """Why the merged batch does not compute what vmap does for this step, or None: the losses and gradients of
    both, from the same weights and random state, with dropout off, must agree to rounding (a forward that mixes
    rows, a statistic over the batch, shows here). ``vmapped(batch)``: the vmapped forward's ``[N]`` losses;
    ``restore()``: the buffers and random state as before the step. Nothing changes: no ``.grad``, the random state
    as before, and the batch (each forward here gets a copy of it: one that writes into its input in place finds the
    same input each time). Python state the forward keeps (a counter) sees these forwards, three in all."""
    params = [p for p in mr.stacked.values() if p.requires_grad]
    device = params[0].device if params else torch.device("cpu")
    try:
        with no_dropout():
            got_v = vmapped(_copy(batch))
            grads_v = torch.autograd.grad(got_v.sum(), params, allow_unused=True)
            restore()
            try:
                got_m = mr.losses(_copy(batch), loss_fn, scalar)
                grads_m = torch.autograd.grad(got_m.sum(), params, allow_unused=True)
            except NotMergeable as e:
                return str(e)
            except Exception as e:  # noqa: BLE001 - vmap ran this step: merging it is what fails
                return failure(e)
    finally:
        restore()
    tol = tolerance(params, device)
    worst = max(disagreement([got_m], [got_v]), disagreement(grads_m, grads_v))
    if not worst <= tol:
        return (f"at the first step the merged batch's losses or gradients differ from vmap's by {worst:.2g} "
                f"(relative; rounding allows {tol:g}): the forward mixes the rows of its batch")
    for i in (0, mr.N - 1) if mr.N > 1 else ():  # replicas that start equal on one batch mix rows unseen: the first
        # made different, then the last (a forward that reads the batch's last rows, x[-1:], reads replica N-1's)
        moved = math.inf
        for how in ("halved", "copied", None):  # inputs that cannot be halved, or replaced: replica i's weights
            try:  # alone, as before
                moved = _isolation(mr, batch, loss_fn, scalar, params, got_m, grads_m, restore, how, i)
                break
            except Exception:  # noqa: BLE001 - the forward on changed inputs failed: change them less
                continue
        if not moved <= tol:
            return (f"changing replica {i}'s weights and inputs changed the other replicas' merged losses or gradients "
                    f"by {moved:.2g} (relative; rounding allows {tol:g}): the forward mixes the rows of its batch")
    return None


def tolerance(params: list[torch.Tensor], device: torch.device) -> float:
    """The relative disagreement rounding allows between the merged and the vmapped step: a half-precision step
    (autocast, or fp16/bf16 parameters: an H200's bf16 GEMMs, blocked apart, differed by 6e-4) 5e-2, TF32 on CUDA
    1e-2, float32 1e-4. A forward that mixes rows moves the others' values by far more (0.39 for a statistic over
    the batch)."""
    if torch.is_autocast_enabled(device.type) or any(p.dtype in (torch.float16, torch.bfloat16) for p in params):
        return 5e-2
    return 1e-2 if device.type == "cuda" and torch.get_float32_matmul_precision() != "highest" else 1e-4


def _copy(batch: Any) -> Any:
    """The batch with every tensor in it cloned."""
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, batch)


def _moved_inputs(batch: Any, how: str | None, i: int = 0) -> Any:
    """A copy of the batch (every tensor's leading axis the replicas') with replica ``i``'s rows changed (``how``):
    ``"halved"``, floating-point ones halved (a statistic over the merged batch, its spread or its mean, moves with
    them; float labels or indices stay in range, so no device-side assert on a GPU) and others (token ids, masks) to
    a neighbour's (replica 1's for replica 0, else replica i - 1's); ``"copied"``, all to the neighbour's (real inputs
    whatever they hold); None, none. (A largest value over the batch that replica i's rows do not hold is not moved by
    either.)"""
    j = 1 if i == 0 else i - 1

    def move(t: Any) -> Any:
        if how is None or not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] < 2:
            return t
        t = t.clone()
        t[i] = t[i] * 0.5 if how == "halved" and (t.is_floating_point() or t.is_complex()) else t[j]
        return t
    return tree_map(move, batch)


@torch.no_grad()
def _isolation(mr: MergedReplicas, batch: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
               scalar: Callable[[Any], torch.Tensor], params: list[torch.Tensor], got: torch.Tensor,
               grads: Sequence[torch.Tensor | None], restore: Callable[[], None], how: str | None, i: int = 0) -> float:
    """How far the merged losses and gradients of the replicas other than ``i`` move when only replica i's weights and
    inputs change (a forward that treats rows independently: not at all). Replica i's weights get noise of a tenth of
    their size, from a generator of its own, and are put back exactly; its inputs are changed in a copy of the batch
    (:func:`_moved_inputs`): a statistic of the inputs over the merged batch moves the others' losses."""
    moved = [p for p in mr.stacked.values() if p.is_floating_point()]  # (frozen ones too)
    g = torch.Generator(device=moved[0].device).manual_seed(0)
    kept = [p[i].clone() for p in moved]
    try:
        for p in moved:  # HOST SYNC (the first merged step only: each tensor's size)
            p[i].add_(torch.randn(p[i].shape, generator=g, device=p.device, dtype=p.dtype),
                      alpha=0.1 * float(p[i].abs().mean()) + 1e-3)
        with torch.enable_grad(), no_dropout():
            restore()
            got2 = mr.losses(_moved_inputs(batch, how, i), loss_fn, scalar)
            grads2 = torch.autograd.grad(got2.sum(), params, allow_unused=True)
    finally:
        for p, k in zip(moved, kept):
            p[i].copy_(k)
        restore()
    others = [r for r in range(mr.N) if r != i]
    rest = lambda ts: [t[others] if t is not None else None for t in ts]  # noqa: E731
    return max(disagreement([got2[others]], [got[others]]), disagreement(rest(grads2), rest(grads)))


def failure(e: BaseException) -> str:
    """``"TypeName: the message's first line"``, for a fallback's warning."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


_DROPOUTS = ("dropout", "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d")


@contextlib.contextmanager
def no_dropout() -> Iterator[None]:
    """Inside: torch.nn.functional's dropouts are the identity, and its ``scaled_dot_product_attention`` drops nothing
    (the two ways of running the replicas need not draw their masks alike)."""
    before = {name: getattr(F, name) for name in (*_DROPOUTS, "scaled_dot_product_attention") if hasattr(F, name)}
    sdpa = before.get("scaled_dot_product_attention")
    for name in _DROPOUTS:
        if name in before:
            setattr(F, name, lambda input, *args, **kwargs: input)  # noqa: ARG005
    if sdpa is not None:
        F.scaled_dot_product_attention = without_dropout(sdpa)  # (hdet.attention.routed routes it for vmap still)
    try:
        yield
    finally:
        for name, fn in before.items():
            setattr(F, name, fn)


def disagreement(a: Sequence[torch.Tensor | None], b: Sequence[torch.Tensor | None]) -> float:
    """The largest relative difference, ``||a - b|| / ||b||``, over pairs of tensors (inf where one is missing)."""
    worst = 0.0
    for x, y in zip(a, b):
        if x is None or y is None:
            if (x is None) != (y is None):
                return math.inf
            continue
        x, y = x.detach().double(), y.detach().double()
        diff = float(torch.linalg.vector_norm(x - y))  # HOST SYNC (the first merged step only)
        scale = float(torch.linalg.vector_norm(y))
        if not (math.isfinite(diff) and math.isfinite(scale)):
            if not bool(torch.equal(torch.isfinite(x), torch.isfinite(y))):
                return math.inf
            continue
        worst = max(worst, diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf))
    return worst
