"""Contiguous parameters: lay a module's parameters out back to back, so a converge step all-reduces
them where they live, with no copy.

A converge step averages every weight (Eq. 3). Parameters that are separate tensors must be copied into
a flat bucket, all-reduced, and copied back: two extra passes over the model's memory.
:func:`contiguous_parameters_` makes each (device, dtype) group of a module's parameters views of one
flat buffer; :func:`contiguous_runs` finds such runs in any list of tensors, and
``ProcessGroupReplicas.average_`` all-reduces each run in place (one collective over the run's own
memory), so the converge step is as cheap as one all_reduce of a ready flat buffer of the same bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from .sync import memory_key

__all__ = ["contiguous_parameters_", "contiguous_runs"]


def contiguous_parameters_(module: nn.Module, order: torch.optim.Optimizer | Iterable[torch.Tensor] | None = None
                           ) -> dict[tuple[torch.device, torch.dtype], torch.Tensor]:
    """Make every parameter of ``module`` a view of one flat buffer per (device, dtype), in
    ``module.parameters()`` order (values unchanged, the same ``Parameter`` objects). Returns the buffers.

    ``order``: an optimizer (or parameters in order): its param groups' parameters of the module are laid out first,
    in the order the converge step averages them, then the module's others. With several param groups (weight decay on the
    matrices only, say) the module's order interleaves the groups, and the converge step, which walks them group by
    group, finds only short runs to reduce in place (an audit: the matrices went through buckets); the optimizer
    keeps working, as its parameters stay the same objects.

    Call it after moving the module to its device and before wrapping it (DDP, torch.compile) and
    building the optimizer (or after building it, with ``order=``); a later ``module.to(...)`` gives each parameter
    its own storage again (the
    averaging then falls back to copying through buckets: slower, the same result up to the order of the sums at
    more than 2 replicas). Gradients keep their
    own layout (DDP's ``gradient_as_bucket_view`` handles those). Each parameter is stored row-major: a ``channels_last``
    convolution weight loses that layout (the results are the same; its speed may differ). fp16/bf16 runs are
    averaged through float32 buckets, not in place (:mod:`hdet.replicas`). The parameters then share one storage:
    ``torch.save``, ``safetensors.torch.save_file`` of a state_dict and Hugging Face's ``save_pretrained`` save them
    as usual (``torch.save`` keeps a shared storage whole: a state_dict of part of the model writes the whole buffer;
    save clones for a part); ``safetensors.torch.save_model`` refuses them (it wants each tensor to cover its
    storage)."""
    groups: dict[tuple[torch.device, torch.dtype], list[nn.Parameter]] = {}
    aliases: list[tuple[nn.Parameter, nn.Parameter]] = []  # (a parameter, the earlier one it shares its memory with)
    owner: dict[tuple[Any, ...], nn.Parameter] = {}
    for p in _ordered(module, order):
        key = memory_key(p) if p.device.type != "meta" and p.numel() else None
        if key is not None and key in owner:  # another Parameter object over the same memory: tied weights (a tied
            aliases.append((p, owner[key]))  # model loaded with load_state_dict(assign=True), nn.Parameter(w)), kept
            continue  # tied: it became a copy of its own, trained apart, silently (an audit)
        if key is not None:
            owner[key] = p
        groups.setdefault((p.device, p.dtype), []).append(p)
    _check_no_overlap([p for params in groups.values() for p in params])
    flats = {}
    with torch.no_grad():
        for (device, dtype), params in groups.items():
            flat = torch.empty(sum(p.numel() for p in params), device=device, dtype=dtype)
            offset = 0
            for p in params:
                n = p.numel()
                view = flat[offset:offset + n].view_as(p)
                view.copy_(p)
                p.data = view
                offset += n
            flats[(device, dtype)] = flat
        for p, first in aliases:
            p.data = first.data
    return flats


def _ordered(module: nn.Module, order: Any) -> list[nn.Parameter]:
    """The module's parameters, each once, ``order``'s first (an optimizer's: its param groups' order)."""
    own = list(module.parameters())  # (one Parameter under two names: once)
    if order is None:
        return own
    if isinstance(order, torch.optim.Optimizer):
        order = [p for g in order.param_groups for p in g["params"]]
    ids = {id(p) for p in own}
    first, seen = [], set()
    for p in order:
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"Expected order= as an optimizer or parameters, but it holds a {type(p).__name__}")
        if id(p) not in ids:  # (an optimizer's parameter outside the module, a loss's temperature: not laid out)
            continue
        if id(p) not in seen:
            seen.add(id(p))
            first.append(p)
    return first + [p for p in own if id(p) not in seen]


def _check_no_overlap(params: list[nn.Parameter]) -> None:
    """Refuse parameters that share some of their elements without being the same view (one a slice of another):
    laid out apart, they would stop sharing them, and the model would train otherwise than it was built. Views that
    interleave without sharing an element (column blocks of one matrix) are fine: they shared nothing."""
    spans: dict[tuple[int, torch.device], list[tuple[int, int, nn.Parameter]]] = {}
    for p in params:
        if p.device.type == "meta" or not p.numel():
            continue
        start = p.storage_offset() * p.element_size()
        end = (_last_element(p) + 1) * p.element_size()
        spans.setdefault((p.untyped_storage().data_ptr(), p.device), []).append((start, end, p))
    for ranges in spans.values():
        ranges.sort(key=lambda r: r[0])
        active: list[tuple[int, int, nn.Parameter]] = []  # the earlier spans still open at this one's start
        for s1, e1, p1 in ranges:
            active = [a for a in active if a[1] > s1]
            for _, _, p0 in active:
                if _share_elements(p0, p1):
                    raise ValueError(f"Expected parameters that share no memory, or share all of it (tied weights), "
                                     f"but one of shape {tuple(p1.shape)} overlaps one of shape {tuple(p0.shape)}: laid "
                                     "out back to back they would stop sharing it. Leave such a module's parameters as "
                                     "they are")
            active.append((s1, e1, p1))


def _share_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two views of one storage (whose spans overlap) share an element: marked on the CPU, element by element
    (bytes where their dtypes differ)."""
    if a.dtype != b.dtype:
        return True  # (views of one storage in two dtypes: taken as sharing)
    lo = min(a.storage_offset(), b.storage_offset())
    hi = max(_last_element(a), _last_element(b)) + 1
    marks = torch.zeros(hi - lo, dtype=torch.int8)
    marks.as_strided(a.shape, a.stride(), a.storage_offset() - lo).fill_(1)
    return bool(marks.as_strided(b.shape, b.stride(), b.storage_offset() - lo).any())


def _last_element(t: torch.Tensor) -> int:
    """The storage offset (in elements) of the last element ``t`` views (a non-empty tensor)."""
    return t.storage_offset() + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


def contiguous_runs(tensors: Sequence[torch.Tensor]) -> list[tuple[list[int], torch.Tensor | None]]:
    """Split ``tensors`` (in order) into runs of consecutive tensors that lie back to back in one
    storage (same device and dtype, each contiguous). Returns ``(indices, flat)`` per run, where ``flat``
    is a view of the run's memory (writing it writes the tensors: 1-D for several tensors, the tensor itself for one),
    or None for a tensor that cannot be viewed so (not contiguous). Host work only, each tensor's storage read once
    (a converge step walks the averaged tensors: 3000 separate tensors took 3.1 ms against 7.9 ms before, 3000 views of
    one buffer 1.5 against 2.2 ms, side by side on a 2-core CPU, one thread, 2026-12-01)."""
    runs: list[tuple[list[int], torch.Tensor | None]] = []
    open_key: tuple[Any, ...] | None = None  # (storage, device, dtype) of the open run
    end = -1  # storage offset (elements) just past the open run
    for i, t in enumerate(tensors):
        if not t.is_contiguous():
            runs.append(([i], None))
            open_key = None
            continue
        key = (t.untyped_storage().data_ptr(), t.device, t.dtype)
        offset = t.storage_offset()
        if key == open_key and offset == end:
            runs[-1][0].append(i)
        else:
            runs.append(([i], t))
            open_key = key
        end = offset + t.numel()
    out: list[tuple[list[int], torch.Tensor | None]] = []
    for idx, first in runs:
        if first is None or len(idx) == 1:
            out.append((idx, None if first is None else first.detach()))
        else:
            total = sum(tensors[i].numel() for i in idx)
            out.append((idx, first.detach().as_strided((total,), (1,), first.storage_offset())))
    return out
