"""The sync exchange: what each replica contributes to a sync's all_gather (:class:`SyncVector`), which
tensors a converge step averages, and the checks every replica runs on the gathered rows.

A sync is two phases with the transport in between (:meth:`hdet.ensemble.Ensemble.prepare_sync`, then
:meth:`~hdet.ensemble.Ensemble.finish_sync`): the transport (``Replicas`` or the one-process engine) only
moves the vectors and averages tensors.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

__all__ = ["SyncVector", "ReplicaMismatchError", "averaged", "as_real", "memory_key", "persistent_float_buffers", "health",
           "layout_signature"]


class ReplicaMismatchError(RuntimeError):
    """At a converge step the replicas disagree on what they are: a different step, sync interval,
    total_steps, configuration or tensor layout (e.g. one rank resumed from an older checkpoint)."""


class SyncVector(NamedTuple):
    """One replica's contribution to a sync (float64 on the wire), or, after the gather, every replica's
    (each field then a list indexed by rank)."""

    loss_sum: Any  # the window's sum of finite training losses
    loss_n: Any  # how many of them were finite
    observed: Any  # losses observed in the window (finite or not)
    finite: Any  # 1 when the weights (and optimizer state) are finite and the buffers hold no NaN/+Inf
    buf_inf: Any  # -Inf elements in the buffers (an attention mask may hold them: compared across replicas)
    layout: Any  # hash of the averaged tensors' shapes and dtypes
    ntensors: Any  # how many tensors are averaged
    seed: Any  # of the permutation generator
    probe: Any  # the fit controller's probe loss at the window mean (NaN when not measured)
    step: Any  # optimizer steps taken
    interval: Any  # model_sync_interval
    total_steps: Any  # -1 when unknown
    config: Any  # fingerprint of the settings
    loss_sq: Any  # the sum of the squares of the window's finite training losses (its noise, hdet.stability)
    nonfinite: Any  # the window's non-finite training losses (observed - loss_n; a replica of shards: their max)
    state_layout: Any  # hash of which parameter holds which optimizer state (averaged, or reset at a recovery)
    start_ok: Any  # 1 unless the state kept after step 1 (recover, before the first best sync) is unhealthy
    start_sum: Any  # while that state is kept: the first step's training loss where finite, else 0
    start_n: Any  # and 1 where it was finite (0: not kept, not observed, or not finite)
    weights: Any  # fingerprint of the weights (:func:`fingerprint`): equal on replicas that hold the same weights
    memory: Any  # hash of the collectives the converge step issues (Replicas.memory_layout): where the tensors lie
    key: Any  # hash of (seed, step, interval, total_steps, config): min-reduced over a replica's shard ranks...
    key_neg: Any  # ...and its negation, min-reduced too (minus the max): apart where the shard ranks disagree

    def to_tensor(self, dev: torch.device) -> torch.Tensor:
        """The 1-D float64 vector on ``dev`` (tensors stay on their device until this copy: no host sync; the
        Python numbers go over in one copy)."""
        numbers = torch.tensor([0.0 if isinstance(x, torch.Tensor) else float(x) for x in self], dtype=torch.float64)
        if dev.type == "cuda":  # pinned and asynchronous: a plain copy would wait for the device (a host sync)
            numbers = numbers.pin_memory().to(dev, non_blocking=True)
        else:
            numbers = numbers.to(dev)
        parts = [x.reshape(1).to(dev, torch.float64) if isinstance(x, torch.Tensor) else numbers[i:i + 1]
                 for i, x in enumerate(self)]
        return torch.cat(parts)

    @classmethod
    def from_rows(cls, rows: torch.Tensor) -> "SyncVector":
        """Every replica's vector (a CPU ``[N, k]`` tensor) as fields of per-replica lists. Host: ``tolist``."""
        return cls(*[list(col) for col in zip(*rows.tolist())])


# FSDP2/HSDP: one replica is several ranks; these fields are summed (or min-reduced) over its shard ranks first
SHARD_SUM = tuple(SyncVector._fields.index(f) for f in ("loss_sum", "loss_n", "observed", "buf_inf", "loss_sq",
                                                        "start_sum", "start_n", "probe", "weights"))  # (probe: each
# rank's / shards; weights: a replica's is its shards')
SHARD_MIN = tuple(SyncVector._fields.index(f) for f in ("finite", "start_ok", "key", "key_neg"))
SHARD_MAX = (SyncVector._fields.index("nonfinite"),)


def averaged(t: torch.Tensor) -> bool:
    """Whether a tensor is averaged at a converge step: floating point, or complex (as a real view)."""
    return t.is_floating_point() or t.is_complex()


def memory_key(t: torch.Tensor) -> tuple[Any, ...]:
    """The memory a tensor views (its storage, offset, shape, strides, dtype and device): two views with one key are
    one tensor, whatever their Python objects."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)


def as_real(t: torch.Tensor) -> torch.Tensor:
    """A complex tensor as a real ``[..., 2]`` view of the same memory (averaged and checked in place)."""
    return torch.view_as_real(t) if t.is_complex() else t


def _persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The model's persistent buffers with their names in their modules, each once."""
    out, seen = [], set()
    for mod in model.modules():
        for name, b in mod._buffers.items():
            if b is None or name in mod._non_persistent_buffers_set or id(b) in seen:
                continue
            seen.add(id(b))
            out.append((name, b.detach()))
    return out


def persistent_float_buffers(model: nn.Module) -> list[torch.Tensor]:
    """The model's persistent floating-point buffers (BatchNorm statistics), each once."""
    return [as_real(b) for _, b in _persistent_buffers(model) if averaged(b)]


def batch_counts(model: nn.Module) -> list[torch.Tensor]:
    """BatchNorm's ``num_batches_tracked`` buffers, each once (other integer buffers, a quantization observer's
    switches, are the user's to set: a go-back leaves them alone)."""
    return [b for name, b in _persistent_buffers(model) if name == "num_batches_tracked" and not averaged(b)]


def unaveraged_buffers(model: nn.Module) -> list[torch.Tensor]:
    """The model's persistent buffers a converge step does not average (integer and boolean: BatchNorm's
    ``num_batches_tracked``), each once: an evaluation of the average keeps and puts back these too
    (:class:`hdet.swap.AverageSwap`)."""
    return [b for _, b in _persistent_buffers(model) if not averaged(b)]


def health(tensors: list[torch.Tensor], strict: list[bool], dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """On ``dev``: (every ``strict`` tensor is finite and no tensor holds a NaN or +Inf, the number of -Inf
    elements in the non-strict tensors (buffers)). A buffer may hold -inf by design (a persistent
    attention mask), so its -Inf count is compared across replicas at the sync instead; +Inf (a BatchNorm
    variance gone to infinity) is a fault everywhere. No host sync (one small copy per device)."""
    by_device: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]] = {}
    for x, must_be_finite in zip(tensors, strict):
        finite, oks, infs = by_device.setdefault(x.device, ([], [], []))
        if must_be_finite:
            if x.numel():
                finite.append(x)
        else:
            oks.append(~(torch.isnan(x) | torch.isposinf(x)).any())
            infs.append(torch.isneginf(x).sum())
    ok = torch.ones((), dtype=torch.bool, device=dev)
    inf = torch.zeros((), dtype=torch.float64, device=dev)
    for finite, oks, infs in by_device.values():
        if finite:
            oks.append(torch.isfinite(max_abs(finite)))
        if oks:
            ok = ok & torch.stack(oks).all().to(dev)
        if infs:
            inf = inf + torch.stack(infs).sum().to(dev, torch.float64)
    return ok, inf


def max_abs(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The largest magnitude over non-empty ``tensors`` of one device, a 0-dim tensor on it: their max-abs
    norms (one fused read on CUDA) and the max of those. A NaN or Inf anywhere makes it non-finite (both
    propagate through a max), and no max of finite values overflows, unlike a sum or a 2-norm. On the CPU one
    ``abs().amax()`` per tensor: 5x faster there than the fused norm on the engine's strided views."""
    if tensors[0].device.type == "cpu":
        return torch.stack([t.abs().amax() for t in tensors]).amax()
    return torch.stack(torch._foreach_norm(tensors, float("inf"))).amax()


def fingerprint(tensors: list[torch.Tensor], strict: list[bool], dev: torch.device) -> torch.Tensor:
    """On ``dev``, float64: the sum of the ``strict`` floating-point tensors' L1 norms (the parameters, and the
    optimizer state where it is averaged), each accumulated in float64. Replicas that hold the same weights give the
    same number up to the order of its sums (a replica's views in the engine's stacked tensors sit at other alignments
    on CUDA, which changes it: about 1e-16 relative a sum); replicas apart by a window's training differ by far more
    (:func:`hdet.stability.same_weights` compares them within ``SAME_WEIGHTS_RTOL``). No host sync where ``dev`` is the
    tensors' device (one fused read per device on CUDA); a blocking copy to the CPU, as :func:`health`'s, under gloo
    with CUDA tensors."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for x, must_be_finite in zip(tensors, strict):
        if must_be_finite and x.numel() and x.is_floating_point():
            by_device.setdefault(x.device, []).append(x)
    out = torch.zeros((), dtype=torch.float64, device=dev)
    for xs in by_device.values():
        out = out + _l1_float64(xs).to(dev)
    return out


def _l1_float64(xs: list[torch.Tensor]) -> torch.Tensor:
    """The sum of the L1 norms of one device's tensors, each accumulated in float64 (in the weights' own dtype a bf16
    norm keeps 8 bits, an fp16 one overflows): one fused read on CUDA, one norm a tensor elsewhere."""
    if xs[0].device.type == "cuda":
        try:
            return torch.stack(torch._foreach_norm(xs, 1, dtype=torch.float64)).sum()
        except TypeError:  # (a torch without the dtype argument)
            pass
    return torch.stack([torch.linalg.vector_norm(x, 1, dtype=torch.float64) for x in xs]).sum()


def layout_signature(tensors: list[torch.Tensor]) -> int:
    text = ";".join(f"{tuple(t.shape)}:{t.dtype}" for t in tensors)
    return zlib.crc32(text.encode())  # < 2**32: exact in float64


def check_state_layout(t: int, col: SyncVector, what: str) -> None:
    """That every replica's optimizer holds state for the same parameters, before ``what`` uses it (lined up by
    position, one parameter's moments were averaged into another's of the same shape, silently; or, of another count,
    the collectives mismatched and the run aborted: an audit)."""
    if len(set(col.state_layout)) > 1:
        raise ReplicaMismatchError(
            f"At sync step {t} the replicas' optimizers hold state for different parameters (layout hashes "
            f"{[int(x) for x in col.state_layout]}), and hdet must {what}: a parameter one replica never stepped "
            "(its loss never reached it, or its GradScaler skipped every step so far) has none there. Step every "
            "parameter on every replica, or average no optimizer state")


def check_memory_layout(t: int, memory: Sequence[Any]) -> None:
    """That every replica lays out the averaged tensors alike in memory (:meth:`hdet.Replicas.memory_layout`): the
    converge step all-reduces runs of tensors back to back where they live and the rest through buckets, so replicas
    laid out otherwise issue other collectives (an audit: gloo aborted on a size mismatch, NCCL hung until its
    timeout)."""
    if len(set(memory)) > 1:
        raise ReplicaMismatchError(
            f"At sync step {t} the replicas' parameters are laid out differently in memory (hashes "
            f"{[int(x) for x in memory]}): hdet.contiguous_parameters_ on some ranks and not on others, or undone on some "
            "(module.to(...), load_state_dict(..., assign=True) on some ranks only), or scheduler.also_average(module) "
            "called on some ranks only, and the converge step's collectives would not match. Nothing was averaged. "
            "Call each on every rank (contiguous_parameters_ after loading), or on none")


def check_agreement(t: int, col: SyncVector, state: bool = False) -> None:
    """Every replica must be at the same step of the same run: same layout, seed, step, T, total_steps and
    settings (and, ``state``: its optimizer state averaged, the same parameters holding it). Averaging replicas
    that disagree would be silently wrong."""
    apart = [r for r, (lo, neg) in enumerate(zip(col.key, col.key_neg)) if lo != -neg]
    if apart:  # (first: the other fields are compared shard position by shard position, and a rank that
        # raised there alone would leave the others in the averaging's collectives)
        raise ReplicaMismatchError(
            f"At the converge step after optimizer step {t} the shard ranks of replica(s) {apart} (FSDP2/HSDP: one "
            "replica's ranks along the mesh's shard dimension) disagree on their optimizer steps, model_sync_interval, "
            "total_steps, seed or settings (the HDET options, explored hyperparameters and schedules): halves of one "
            "replica would train with different values. Nothing was averaged. Build every rank's scheduler with the "
            "same settings (a value computed on each rank from its own shard of the gradients or weights differs by "
            "shard) and resume every rank from the same checkpoint step.")
    if len(set(zip(col.layout, col.ntensors))) > 1:
        raise ReplicaMismatchError(
            f"At sync step {t} the replicas hold different tensors to average "
            f"(count per replica: {[int(n) for n in col.ntensors]}, layout hashes: {[int(x) for x in col.layout]}). "
            "Every replica must build the optimizer, its param groups and the model identically, and call "
            "scheduler.also_average() alike."
        )
    check_memory_layout(t, col.memory)
    if state:
        check_state_layout(t, col, "average their optimizer state (average_optimizer_state=True)")
    if len(set(col.seed)) > 1:
        raise ValueError(f"Expected the same seed on every replica, but got {[int(x) for x in col.seed]}")
    named = {"optimizer steps": col.step, "model_sync_interval": col.interval, "total_steps": col.total_steps,
             "settings fingerprints (the HDET options, explored hyperparameters and schedules)": col.config}
    differ = {name: [int(x) for x in v] for name, v in named.items() if len(set(v)) > 1}
    if differ:
        raise ReplicaMismatchError(
            f"At the converge step after optimizer step {t} the replicas disagree: "
            + "; ".join(f"{name} per replica {v}" for name, v in differ.items())
            + ". Nothing was averaged. Every replica must be built with the same settings and resume from "
            "the same checkpoint step."
        )
