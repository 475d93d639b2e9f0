"""The engine's replicas as stacked tensors (its vmap path): :class:`StackedReplicas`.

N copies of a module's parameters and buffers are stacked into ``[N, ...]`` tensors (:attr:`params`,
:attr:`buffers`), and each replica's module holds views ``stacked[r]`` of them, so its optimizer and
scheduler see an ordinary module. :meth:`StackedReplicas.flatten` then lays the trainable parameters out as
one ``[N, D]`` tensor ``theta`` (row r: replica r; columns in the order of the optimizers' param groups, so
each group is one run of columns: what :class:`hdet.stacked_optim.StackedStep` steps) and, from the first
backward, their gradients as views of a second one, ``grad``, ``[N, D]``, into which later backwards'
gradients are copied; :meth:`StackedReplicas.average_gradients` is DDP's all-reduce over the replica axis. On the CPU,
with shared gradients, ``grad`` is one row, the mean, and :meth:`StackedReplicas.backward` sums the backward's
per-replica gradients straight into it, where they lie in memory (no ``[N, D]`` buffer to zero, add into and
sum again: 1.3x an MLP's step on 2 cores; on an H100 its per-parameter launches cost more than the passes they
save, 0.68-1.01x: ``benchmarks/results/gpu_h100/engine_ab/``).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch import nn

from . import kernels
from .replicas import HALF, accumulation
from .stacked_optim import Segment, param_view, trained
from .sync import as_real

__all__ = ["StackedReplicas"]


class StackedReplicas:
    """The stacked tensors of ``models`` (N copies of one module, changed in place to hold views of them).

    ``one_grad_row``: every replica's ``.grad`` is a view of ``grad``'s row 0, which holds the average (shared
    gradients, nothing that changes one replica's gradient; flattened on the CPU, :meth:`backward` reduces into
    it); else each replica's is its own row."""

    def __init__(self, models: Sequence[nn.Module], one_grad_row: bool, relayout: bool = False) -> None:
        self.N = len(models)
        self.one_grad_row = one_grad_row
        self.relayout = relayout  # store each flattened parameter in the order of its gradient (bind_grads)
        self.params: dict[str, torch.Tensor] = {}
        self.buffers: dict[str, torch.Tensor] = {}
        for kind, named, store in (("param", "named_parameters", self.params), ("buffer", "named_buffers", self.buffers)):
            per_replica = [dict(getattr(m, named)()) for m in models]
            for name, t in per_replica[0].items():
                s = torch.stack([d[name].detach() for d in per_replica])
                store[name] = s.requires_grad_(t.requires_grad) if kind == "param" else s
        for r, m in enumerate(models):  # each replica's module: views stacked[r] (tied weights stay tied)
            new: dict[int, torch.Tensor] = {}
            for name, p in m.named_parameters():
                new[id(p)] = nn.Parameter(self.params[name].data[r], requires_grad=p.requires_grad)
            for name, b in m.named_buffers():
                new[id(b)] = self.buffers[name][r]
            for mod in m.modules():
                for k, p in mod._parameters.items():
                    if p is not None:
                        mod._parameters[k] = new[id(p)]
                for k, b in mod._buffers.items():
                    if b is not None:
                        mod._buffers[k] = new[id(b)]
        self.views = {name: [dict(m.named_parameters())[name] for m in models] for name in self.params}
        self.theta: torch.Tensor | None = None  # [N, D] once flattened
        self.grad: torch.Tensor | None = None
        self.segments: list[Segment] = []
        self.columns: dict[str, tuple[int, int]] = {}  # name -> its columns of theta
        self.grads_bound = False  # the .grad of every flattened parameter is a view of self.grad
        self._grads: dict[str, torch.Tensor] = {}  # name -> the stacked parameter's .grad view
        self._rows: dict[str, list[torch.Tensor] | None] = {}  # name -> its rows of grad (each dense), or None
        self._replica_grads: dict[str, list[torch.Tensor]] = {}  # name -> each replica's .grad view
        self.orders: dict[str, tuple[int, ...] | None] = {}  # name -> its dims' storage order in theta
        self._segment_names: list[list[str]] = []
        self._raw_strides: dict[str, tuple[int, ...]] = {}  # name -> its first gradient's strides, as produced
        self._stride_hooks: list[torch.utils.hooks.RemovableHandle] = []
        self.reduce = False  # flattened, one_grad_row, on the CPU: the backward reduces into grad's one row
        self._reducing: bool | None = None  # reduce, and every parameter got a gradient (None: no backward yet)
        self.redo = False  # the last backward's gradients hold shares (hdet.linear.sharing) where each replica's own
        # is needed (not finite; a first backward leaving a parameter without one): run the step again without them
        # (hdet.ReplicaEngine._vmap_losses)
        self.took: set[str] = set()  # the parameters whose gradient holds a share at this step (hdet.linear.sharing)
        self._share_leaves: dict[int, str] | None = None
        self.missing: list[str] = []  # bound: the flattened parameters the last backward did not reach

    # -- the flat layout -------------------------------------------------------------------------------
    def flatten(self, optimizers: Sequence[torch.optim.Optimizer]) -> str | None:
        """Make the trainable stacked parameters views of one ``[N, D]`` tensor :attr:`theta`, in the order of
        the optimizers' param groups (each group one run of columns: :attr:`segments`). The tensors keep their
        identity (``.data`` is re-pointed): optimizers and modules keep working. Returns why not, or None."""
        N = self.N
        trainable = [n for n, t in self.params.items() if t.requires_grad]
        if not trainable or len({(self.params[n].device, self.params[n].dtype) for n in trainable}) != 1:
            return "the parameters do not share one device and dtype"
        names_of = [{id(self.views[n][r]): n for n in self.views} for r in range(N)]
        groups0 = optimizers[0].param_groups
        order: list[str] = []
        segments = []
        for k, g in enumerate(groups0):
            names = [names_of[0].get(id(p)) for p in trained(g)]  # (a frozen parameter: the optimizer skips it)
            if any(n is None or n not in trainable for n in names):
                return "an optimizer holds tensors that are not the model's trainable parameters"
            if any(len(o.param_groups) != len(groups0) or [names_of[r].get(id(p)) for p in trained(o.param_groups[k])]
                   != names for r, o in enumerate(optimizers)):
                return "the replicas' optimizers group their parameters differently"
            start = sum(self.params[n][0].numel() for n in order)
            order += names
            stop = start + sum(self.params[n][0].numel() for n in names)
            segments.append(Segment(start, stop, [self.params[n].shape[1:] for n in names]))
            self._segment_names.append(names)
        if len(set(order)) != len(order):
            return "a parameter is in two param groups"
        order += [n for n in trainable if n not in set(order)]  # trained by no optimizer: left as they are
        first = self.params[order[0]]
        D = sum(self.params[n][0].numel() for n in order)
        self.theta = torch.empty(N, D, device=first.device, dtype=first.dtype)
        self.reduce = self.one_grad_row and _reduce_in_backward(first.device)
        self.grad = torch.zeros(1 if self.reduce else N, D, device=first.device, dtype=first.dtype)
        self.segments = segments
        col = 0
        with torch.no_grad():
            for n in order:
                s = self.params[n]
                k = s[0].numel()
                self.theta[:, col:col + k].copy_(s.detach().reshape(N, k))
                s.data = self.theta[:, col:col + k].view(s.shape)  # the same leaf tensor, now a view
                for r, p in enumerate(self.views[n]):
                    p.data = self.theta[r, col:col + k].view(s.shape[1:])  # the same Parameter: optimizers keep it
                self.columns[n] = (col, col + k)
                self.orders[n] = None
                col += k
        return None

    def drop_stride_hooks(self) -> None:
        """The first backward's stride hooks, once no longer needed (or the flat step was given up)."""
        for h in self._stride_hooks:
            h.remove()
        self._stride_hooks = []

    def _strides_hook(self, name: str):
        def hook(g: torch.Tensor) -> None:
            self._raw_strides.setdefault(name, g.stride()[1:])
        return hook

    def _gradient_order(self, name: str) -> tuple[int, ...] | None:
        """The order a parameter's dims are stored in by its first gradient (None: row-major, or unknown)."""
        shape, st = tuple(self.params[name].shape[1:]), self._raw_strides.get(name)
        if st is None or len(shape) < 2:
            return None

        def strides(order: Sequence[int]) -> list[int]:  # of a tensor of this shape stored in this dim order
            out, step = [0] * len(shape), 1
            for i in reversed(order):
                out[i], step = step, step * shape[i]
            return out

        order = tuple(sorted(range(len(shape)), key=lambda i: (-st[i], i)))
        if any(shape[i] > 1 and x != st[i] for i, x in enumerate(strides(order))):
            return None  # not a dense permutation of the parameter's dims: keep row-major
        if all(shape[i] == 1 or x == st[i] for i, x in enumerate(strides(range(len(shape))))):
            return None  # row-major already
        return order

    @torch.no_grad()
    def _store_as_gradients(self) -> None:
        """Before the gradients are bound: store each flattened parameter in the order its gradient came in
        (the same columns of theta, the values moved), so that every later backward adds into :attr:`grad` in
        memory order (an ``nn.Linear`` weight's gradient under vmap is transposed: accumulating it into a
        row-major buffer reads it across)."""
        self.drop_stride_hooks()
        self.set_layout({n: self._gradient_order(n) for n in self.columns})

    @torch.no_grad()
    def set_layout(self, orders: dict[str, tuple[int, ...] | None]) -> None:
        """Store each named flattened parameter with its dims in this order (None: row-major), the values kept: how
        the first backward laid them out (:meth:`_store_as_gradients`), or as a saved engine had them (a resumed
        run computes in the same memory order, so its sums round as the uninterrupted run's)."""
        for n, order in orders.items():
            if n not in self.columns or order == self.orders[n]:
                continue
            a, b = self.columns[n]
            s = self.params[n]
            shape = s.shape[1:]
            values = s.detach().clone()
            s.data = param_view(self.theta[:, a:b], shape, order)
            s.data.copy_(values)
            for r, p in enumerate(self.views[n]):
                p.data = param_view(self.theta[r, a:b], shape, order)
            self.orders[n] = order
        for seg, names in zip(self.segments, self._segment_names):
            seg.orders[:] = [self.orders[n] for n in names]

    # -- gradients ---------------------------------------------------------------------------------------
    def before_backward(self) -> None:
        """Bound: zero :attr:`grad` (the backward adds into it; not where :meth:`backward` reduces into it),
        binding again any ``.grad`` (stacked or a replica's) set by hand to None or to another tensor (the step or
        a per-replica hook would otherwise see none, or zeros). Not bound: every ``.grad`` to None."""
        if not self.grads_bound:
            for p in self.params.values():
                p.grad = None
            if self.relayout and self.theta is not None and not self._stride_hooks and not self._raw_strides:
                for n in self.columns:  # the first backward: how each gradient comes (see bind_grads)
                    self._stride_hooks.append(self.params[n].register_hook(self._strides_hook(n)))
            return
        if not self._reducing and not self._copying():  # (copied in: every column is written)
            self.grad.zero_()
        for n, v in self._grads.items():
            p = self.params[n]
            if p.grad is not v:
                p.grad = v
            for q, w in zip(self.views[n], self._replica_grads[n]):  # each replica's view (zero_grad sets None)
                if q.grad is not w:
                    q.grad = w

    def backward(self, losses: torch.Tensor) -> None:
        """The backward of ``losses.sum()``. With :attr:`reduce` (shared gradients, flat parameters, the CPU),
        each parameter's per-replica gradients (``[N, ...]``, as vmap's backward leaves them) are summed over the
        replica axis straight into :attr:`grad`'s one row, the mean (:meth:`_reduce`); otherwise they are copied
        (once bound; before, accumulated) into the ``.grad`` of the stacked parameters (:meth:`average_gradients`
        then averages them)."""
        self.missing = []
        self.redo = False
        if self.grads_bound and self._copying():
            self._copy_grads(*self._param_grads(losses))
            return
        if not self.reduce or self._reducing is False:
            with warnings.catch_warnings():  # the .grad views of the [N, D] gradient are strided as their parameters
                warnings.filterwarnings("ignore", message="grad and param do not obey the gradient layout contract")
                losses.sum().backward()
            return
        names, grads = self._param_grads(losses)
        if self._reducing is None:  # the first backward
            if any(g is None for g in grads):  # a parameter got no gradient: as the accumulating path leaves it
                if self.took:  # (which needs each replica's own: the step again without shares)
                    self.redo = True
                    return
                for n, g in zip(names, grads):  # (a copy: autograd may hand one expanded tensor to several)
                    self.params[n].grad = None if g is None else g.clone(memory_format=torch.contiguous_format)
                self._reducing = False
                return
            for n, g in zip(names, grads):
                self._raw_strides.setdefault(n, g.stride()[1:])
            self._reducing = True
            self._bind()
        self._reduce(names, grads)

    def share_leaves(self) -> dict[int, str]:
        """The stacked parameters a linear layer's weight may take a share for (:func:`hdet.linear.sharing`), by id
        (the flattened ones, whose gradients :meth:`_reduce` sums; they keep their identity)."""
        if self._share_leaves is None:
            self._share_leaves = {id(self.params[n]): n for n in self.columns}
        return self._share_leaves

    @property
    def takes_shares(self) -> bool:
        """Whether the next backward may give the weights the replicas' shares of their summed gradient
        (:func:`hdet.linear.sharing`): it reduces them on the CPU (from the first backward on, so that a resumed engine
        rounds as the uninterrupted one; the accumulating path, taken where that backward leaves a parameter without a
        gradient, needs each replica's own: that step runs again without shares)."""
        return self.reduce and self._reducing is not False and _free_host_read(self.grad.device)  # (the check
        # that sends a step with a NaN or Inf among them back reads the host)

    def _copying(self) -> bool:
        return not self.reduce and _copy_into_bound(self.grad.device)

    def _param_grads(self, losses: torch.Tensor) -> tuple[list[str], Sequence[torch.Tensor | None]]:
        """The backward of ``losses.sum()`` as the flattened parameters' own gradients (``[N, ...]`` each; None where
        the loss did not reach one), not accumulated anywhere."""
        names = list(self.columns)
        return names, torch.autograd.grad(losses.sum(), [self.params[n] for n in names], allow_unused=True)

    def _copy_grads(self, names: list[str], grads: Sequence[torch.Tensor | None]) -> None:
        """The backward's own gradients copied into the bound ``.grad`` views (one pass over each, where
        accumulating into views zeroed before reads the buffer twice and writes it once, through a strided kernel)."""
        dests, srcs = [], []
        with torch.no_grad():
            for n, g in zip(names, grads):
                if g is None:  # the loss did not reach it this time (see unbind_missing)
                    self._grads[n].zero_()
                    self.missing.append(n)
                elif g.is_contiguous() and self._rows[n] is not None:  # row by row: dense pairs, the fused path
                    dests += self._rows[n]
                    srcs += g.unbind(0)
                else:
                    dests.append(self._grads[n])
                    srcs.append(g)
            if dests:  # (torch's foreach copy takes its fused, vectorised kernel only where every pair is dense and
                # alike; a replica's row of the [N, D] gradient is, the [N, ...] view across rows is not: 3.4 ms of
                # strided copies a step for the medium GPT on an H200, benchmarks/results/gpu_h200/merged/)
                dense = [i for i, (d, g) in enumerate(zip(dests, srcs)) if d.stride() == g.stride()]
                if len(dense) == len(dests):
                    torch._foreach_copy_(dests, srcs)
                else:  # (either part may be empty: no gradient in its .grad's layout, e.g. bias-free layers
                    # whose weight gradients come transposed; torch's foreach copy refuses an empty list, an audit)
                    rest = sorted(set(range(len(dests))) - set(dense))
                    for part in (dense, rest):
                        if part:
                            torch._foreach_copy_([dests[i] for i in part], [srcs[i] for i in part])

    @torch.no_grad()
    def _reduce(self, names: list[str], grads: Sequence[torch.Tensor]) -> None:
        """DDP's all-reduce over the replica axis, from the backward's own gradients: :attr:`grad`'s row gets
        ``sum_r g_r / N`` over the finite replicas (a replica with a NaN or Inf anywhere counts as 0, the gradient
        guard, :mod:`hdet.guard`). Each ``[N, ...]`` gradient is read once, in its memory order (an ``nn.Linear``
        weight's under vmap is transposed: reading it across, as accumulating it into a row-major buffer does,
        costs more than the whole reduction). A parameter the loss did not reach this time gets 0 and is listed in
        :attr:`missing` (see :meth:`unbind_missing`)."""
        rows, dests, shares = [], [], []
        for n, g in zip(names, grads):
            if g is None:
                self._grads[n][0].zero_()
                self.missing.append(n)
                continue
            order = [0] + sorted(range(1, g.dim()), key=lambda i: (-g.stride(i), i))
            row = g.permute(order).reshape(self.N, -1)  # [N, k] in memory order: a view of a dense g
            dest = self._grads[n][0].permute([i - 1 for i in order[1:]])  # the mean's view, that order
            if n in self.took and row.stride(0) == 0:  # a share alone: the replicas' sum, divided (hdet.linear.sharing)
                shares.append((row, dest))
            else:
                rows.append(row)
                dests.append(dest)
        if not rows and not shares:
            return
        G = self.grad
        if _free_host_read(G.device):  # mask only when needed
            self._sum_rows(rows, dests, None)
            for r, d in shares:
                d.copy_(r[0].view(d.shape))
            if not _all_finite(G):  # HOST SYNC (CPU: free): a NaN/Inf somewhere
                if self.took:  # which replica's it is cannot be told from a share, alone or added to another
                    self.redo = True  # use's gradient: the caller runs the step again without them
                    return  # (hdet.ReplicaEngine._vmap_losses)
                ok = torch.stack([torch.isfinite(r).all(1) for r in rows]).all(0)
                self._sum_rows(rows, dests, ok)
        else:
            if shares:  # (hdet.linear.sharing runs on the CPU only)
                raise RuntimeError("hdet: internal error: the replicas' gradient shares reached a device-side reduce")
            ok = torch.isfinite(torch.stack([r.sum(1, dtype=torch.float64) for r in rows]).sum(0))  # [N] (float64:
            # no sum of finite float32 values overflows, so no healthy replica is left out)
            self._sum_rows(rows, dests, ok)
        if G.dtype in HALF:  # (fp16/bf16: divided in the sum's float32, _sum_rows)
            return
        if not shares:
            G.div_(self.N)
        elif dests:
            torch._foreach_div_(dests, self.N)

    def _sum_rows(self, rows: list[torch.Tensor], dests: list[torch.Tensor], ok: torch.Tensor | None) -> None:
        """``dest = sum_r rows[r]`` for each tensor, over the replicas ``ok`` says are finite (all: None); fp16/bf16:
        ``sum_r rows[r] / N``, summed and divided in float32 (their own sum of N finite gradients overflowed fp16)."""
        for r, d in zip(rows, dests):
            if ok is not None:
                r = r[ok] if _free_host_read(r.device) else r.masked_fill(~ok.unsqueeze(1), 0)
            if d.dtype in HALF:
                d.copy_(r.sum(0, dtype=torch.float32).div_(self.N).view(d.shape))
            elif d.is_contiguous():
                torch.sum(r, 0, out=d.view(-1))
            else:
                d.copy_(r.sum(0).view(d.shape))

    def bind_grads(self) -> bool:
        """After the first backward: copy the gradients into :attr:`grad` and make every flattened stacked
        parameter's (and replica view's) ``.grad`` a view of it. False when a parameter got no gradient (the
        stacked step would move it; per-replica optimizers skip it)."""
        if self.grads_bound:
            return True
        if any(self.params[n].grad is None for n in self.columns):
            self.drop_stride_hooks()
            return False
        firsts = {n: self.params[n].grad for n in self.columns}
        self._bind()
        with torch.no_grad():
            for n, g in firsts.items():
                self._grads[n].copy_(g)
        return True

    def _bind(self) -> None:
        """Every flattened stacked parameter's ``.grad`` (and each replica view's) a view of :attr:`grad` (with
        :attr:`reduce`, one row: the stacked parameter's is that row expanded over the replicas), stored as the
        parameter is (after moving it to its gradient's order, with ``relayout``, which drops the stride hooks)."""
        if self.relayout:
            self._store_as_gradients()
        for n, (a, b) in self.columns.items():
            s = self.params[n]
            rows = [0] * self.N if self.one_grad_row else range(self.N)
            self._replica_grads[n] = [param_view(self.grad[r, a:b], s.shape[1:], self.orders[n]) for r in rows]
            view = param_view(self.grad[:, a:b], s.shape[1:], self.orders[n])
            s.grad = self._grads[n] = view.expand(s.shape) if self.reduce else view
            self._rows[n] = list(view.unbind(0)) if not self.reduce and all(
                v.is_contiguous() for v in view.unbind(0)) else None  # (_copy_grads)
            for p, v in zip(self.views[n], self._replica_grads[n]):
                p.grad = v
        self.grads_bound = True

    @torch.no_grad()
    def own_grads(self) -> None:
        """Each replica's ``.grad`` its own tensor from now on (the per-replica optimizer steps that follow a stacked
        step given up): with :attr:`one_grad_row` every replica's is a view of one row, and an in-place change to one
        replica's (torch's foreach SGD with Nesterov adds the momentum into it; Prodigy's coupled weight decay; a step
        pre-hook) reached every replica after it (losses 5% apart by step 5: an audit). The gradients are unbound (each
        backward accumulates a fresh ``[N, ...]`` one, averaged by :meth:`average_gradients`, each replica's a row of
        it: :meth:`point_grads`), as a resumed engine's are; the current step's mean is copied to every replica."""
        if not self.one_grad_row:
            return
        self.one_grad_row = self.reduce = False
        self._reducing = False
        held = self.grad  # (freed: each backward makes its own [N, ...] gradients from now on; kept, it doubled the
        # gradients' memory: a review; an empty one keeps its device and dtype)
        self.grad = held.new_empty(0, held.shape[1]) if held is not None else None
        if not self.grads_bound:
            return
        self.grads_bound = False
        for n in self.columns:
            s = self.params[n]
            if s.grad is None:  # (unbind_missing's, this step)
                continue
            mean = self._replica_grads[n][0]
            s.grad = mean.expand(s.shape).clone(memory_format=torch.contiguous_format)
            for r, p in enumerate(self.views[n]):
                p.grad = None if p.grad is None else s.grad[r]
        self._grads, self._replica_grads, self._rows = {}, {}, {}

    def unbind_missing(self) -> None:
        """The parameters the last backward did not reach (:attr:`missing`) get no ``.grad`` (None, on the stacked
        parameter and every replica's view) until the next backward, which binds them again: an optimizer then
        skips them, as torch's optimizers skip a parameter whose gradient is None, where a zero gradient would
        still move it (Adam's moments, weight decay)."""
        for n in self.missing:
            self.params[n].grad = None
            for p in self.views[n]:
                p.grad = None

    def rebind_grads(self) -> list[str]:
        """A hook that set a replica's ``p.grad`` to a new tensor (not in place): copy it into :attr:`grad`. Returns
        the parameters a hook set to None on some replica (left None: that replica's optimizer skips them, as torch's
        skip a None gradient, where the stacked step would move them on a zero one: Adam's moments, weight decay)."""
        dropped: list[str] = []
        if not self.grads_bound:
            return dropped
        with torch.no_grad():
            for n, views in self._replica_grads.items():
                for p, v in zip(self.views[n], views):
                    if p.grad is None:
                        if n not in self.missing and n not in dropped:  # (missing: unbind_missing's, this step)
                            dropped.append(n)
                    elif p.grad is not v:
                        v.copy_(p.grad)
                        p.grad = v
        return dropped

    def point_grads(self) -> None:
        """Not bound: each replica's parameter views get the matching slice of the stacked gradient."""
        if self.grads_bound:
            return
        for name, s in self.params.items():
            for r, p in enumerate(self.views[name]):
                p.grad = None if s.grad is None else s.grad[r]

    @torch.no_grad()
    def average_gradients(self) -> None:
        """DDP's all-reduce over the replica axis: every replica gets ``sum_r g_r / N`` over the finite
        replicas, a replica with a NaN or Inf anywhere counting as 0 (the gradient guard, :mod:`hdet.guard`).
        Nothing to do where :meth:`backward` reduced into the mean."""
        if self._reducing:
            return
        if not self.grads_bound:
            grads = [s.grad for s in self.params.values() if s.grad is not None]
            ok = torch.stack([torch.isfinite(as_real(g).reshape(len(g), -1).sum(1, dtype=torch.float64))  # (complex:
                              for g in grads]).all(0)  # both parts; casting to float64 dropped the imaginary one; a 0-d
            # parameter's [N] gradient: reshape, not flatten(1))
            for g in grads:
                keep = ok.view(-1, *[1] * (g.dim() - 1))
                g.copy_(torch.where(keep, g, torch.zeros_like(g)).mean(0, keepdim=True).expand_as(g))
            return
        G = self.grad
        acc = accumulation(G.dtype)  # fp16/bf16: summed in float32 (their own sum of N finite gradients overflowed)
        if _free_host_read(G.device):  # a host read costs nothing here (the CPU): mask only when needed
            total = G.sum(0, keepdim=True, dtype=acc)
            if not _all_finite(total):  # HOST SYNC (CPU: free): a NaN/Inf in a row
                G.masked_fill_(~torch.isfinite(G).all(1, keepdim=True), 0)
                total = G.sum(0, keepdim=True, dtype=acc)
        elif kernels.usable(G) and G.is_contiguous():  # (a CUDA device, with Triton) one read of G instead of the
            # four passes below (0.58 against 2.53 ms a step for the medium GPT's on an H200:
            # benchmarks/merged_kernels.py)
            if self.one_grad_row:  # every replica's .grad is a view of row 0
                kernels.finite_row_mean(G, G[:1])
            else:
                mean = torch.empty_like(G[:1])
                kernels.finite_row_mean(G, mean)
                G.copy_(mean.expand_as(G))
            return
        else:
            ok = torch.isfinite(torch.linalg.vector_norm(G, float("inf"), dim=1))  # [N]: the largest |g| of each
            # row, NaN or Inf where one is (a maximum of finite values never overflows, so no healthy replica is left
            # out; a sum needed float64, a [N, D] copy to float64 first: 1.9 ms a step of the medium GPT on an H200)
            G.masked_fill_(~ok.unsqueeze(1), 0)
            total = G.sum(0, keepdim=True, dtype=acc)
        mean = total.div_(self.N)
        if self.one_grad_row:  # every replica's .grad is a view of row 0
            G[:1].copy_(mean)
        else:
            G.copy_(mean.expand_as(G))


def _all_finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is finite. HOST SYNC. One pass in the common case: the sum, in ``t``'s own
    dtype (float32 for fp16/bf16), with no float64 copy (that copy was 0.15-0.37 ms of a 7 ms engine step, the CPU
    MLP of ``benchmarks/engine_mlp.py``); only where the sum is not finite (a NaN or Inf, or finite values whose sum
    overflowed) is every element read."""
    return bool(torch.isfinite(t.sum(dtype=accumulation(t.dtype)))) or bool(torch.isfinite(t).all())


def _free_host_read(device: torch.device) -> bool:
    """Whether reading a value on the host costs nothing (the CPU: no device to wait for), so that a check can
    decide what runs next instead of masking always."""
    return device.type == "cpu"


def _copy_into_bound(device: torch.device) -> bool:
    """Whether, with the gradients bound and not reduced in the backward, the backward's own gradients are copied
    into the bound views (:meth:`StackedReplicas._copy_grads`) rather than accumulated into them after a zero: on an
    H100, 1.004x / 1.03x / 1.01x the tiny / small / medium GPT's engine step, side by side
    (``benchmarks/results/gpu_h100/copy_grads/``). Accumulated (a torch without ``_foreach_copy_``, older than hdet
    supports), a parameter the backward did not reach keeps a zero gradient, not None (:attr:`missing` stays empty)."""
    return hasattr(torch, "_foreach_copy_")


def _reduce_in_backward(device: torch.device) -> bool:
    """Whether shared gradients are summed where the backward leaves them (:meth:`StackedReplicas.backward`),
    rather than accumulated into an ``[N, D]`` buffer and averaged there: on the CPU (fewer passes over memory);
    not on a GPU, where its per-parameter kernels cost more host time than the passes save."""
    return device.type == "cpu"
