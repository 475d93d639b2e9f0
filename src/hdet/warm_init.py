"""Warm noisy initialisation, Eq. 10: ``theta_r = theta_0 + eps_r``, ``eps_r ~ N(0, nu^2 ||theta_0||^2 / d)``."""

from __future__ import annotations

import hashlib
import math
import warnings
from collections.abc import Iterable

import torch
from torch import nn

from .caller import user_stacklevel
from .replicas import reshard_fsdp
from .values import int_number, real_number

__all__ = ["warm_init_", "warm_initialised", "warm_noise_overwritten"]

# A tensor warm_init_ perturbed carries two marks in its __dict__ (no weak reference to it: one made
# torch.utils.swap_tensors, and so module.to() of FSDP2's DTensors, refuse the tensor, a review): _hdet_warm, for good,
# and _hdet_warm_version, its in-place version right after the noise, until a scheduler has checked it.


def warm_noise_overwritten(params: Iterable[torch.Tensor], forget: bool = False) -> bool:
    """Whether a tensor :func:`warm_init_` perturbed was written in place since (its version moved):
    ``DistributedDataParallel(...)`` built after it broadcasts rank 0's weights, noise included, to every rank (an
    audit: the replicas started equal, unsaid). The caller says it where nothing else should have written them yet;
    ``forget``: the versions are dropped after (a later DDP over the trained module is no broadcast of the noise)."""
    moved = False
    for p in params:
        version = p.__dict__.get("_hdet_warm_version")
        moved = moved or (version is not None and p._version != version)
        if forget:
            p.__dict__.pop("_hdet_warm_version", None)
    return moved


def warm_initialised(params: Iterable[torch.Tensor]) -> bool:
    """Whether :func:`warm_init_` added noise to any of ``params`` (an optimizer that broadcasts each parameter from one
    rank, ZeroRedundancyOptimizer, replaces it: :func:`hdet.optimizers.check_optimizer`)."""
    return any(p.__dict__.get("_hdet_warm", False) for p in params)


@torch.no_grad()
def warm_init_(
    params: nn.Module | Iterable[torch.Tensor],
    rank: int | None = None,
    nu: float = 0.01,
    seed: int = 0,
    scope: str = "model",
) -> float:
    """Add independent Gaussian noise to this replica's parameters, in place, and return its std.

    Call it once on every replica, after wrapping the model in DDP (DDP broadcasts rank 0's weights
    when it wraps) and after building the scheduler; HDET never averages before the first sync step,
    so the noise survives until then (not under ZeroRedundancyOptimizer, which broadcasts each parameter from its
    owner rank after every step: refused there). ``rank`` defaults to the process group rank (0 without one);
    replica ``r`` draws from a dedicated generator on the parameters' device, seeded by a hash of ``(seed, r)``
    (not ``seed`` itself, which seeds the model's initial weights, nor ``seed + r``), so the caller's global RNG
    is untouched.

    ``scope="model"`` is Eq. 10: one std ``nu * ||theta_0|| / sqrt(d)`` over all parameters.
    ``scope="tensor"`` uses each tensor's own ``nu * ||theta|| / sqrt(numel)`` (the reference README).
    A tensor initialised to zero, a LoRA adapter's ``B``, gets the model's noise under ``scope="model"``, so the model
    at step 0 is no longer the base model (1.1% off in its output in an audit's LoRA run, 2026-12-02);
    ``scope="tensor"`` leaves a zero tensor zero.

    Args:
        params: this replica's module (the DDP-wrapped one's ``.module``: its trainable parameters; frozen ones are
            left as they are, equal on every replica, and a converge step keeps them so up to rounding) or the
            tensors to perturb. FSDP2/HSDP (DTensor) parameters, all on one device mesh: each rank perturbs its
            own shards, with the norm of the whole replica (one all_reduce over the mesh's shard dimensions) and a
            stream of its own per (replica, shard); the replica is the rank's coordinate on the mesh's
            ``"replicate"`` dimension (a 2-D mesh's first without names; a mesh without one holds one replica).
        rank: this replica's index (default: the process group's rank, or with DTensors the replicate coordinate;
            without a process group, 0 and a warning: in the one-process engine pass ``rank=r`` for replica ``r``,
            ``for r, m in enumerate(engine.models)``).
        nu: the noise scale of Eq. 10.
        seed: replica ``r`` draws from a generator seeded by a hash of ``(seed, r)``.
        scope: "model" (Eq. 10) or "tensor".
    """
    x = real_number(nu)
    if x is None or not 0 <= x < math.inf:
        raise ValueError(f"Expected a finite nu >= 0, but got {nu!r}")
    nu = x
    if scope not in ("model", "tensor"):
        raise ValueError(f"Expected scope 'model' or 'tensor', but got {scope!r}")
    if isinstance(params, nn.Module):  # its trainable parameters: a frozen one is never averaged, so its noise
        reshard_fsdp(params)  # (FSDP2: a forward under no_grad leaves the root's parameters unsharded copies)
        tensors = [p for p in params.parameters() if p.is_floating_point() and p.requires_grad]  # would stay
    else:
        tensors = [p for p in params if p.is_floating_point()]
    if not tensors:
        raise ValueError("Expected at least one floating-point parameter, but got none")
    sharded = _Sharded.of(tensors)
    if rank is None and sharded is not None:
        rank = sharded.replica
    elif rank is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank()
        else:
            rank = 0
            warnings.warn("hdet: warm_init_ with no process group and no rank draws replica 0's noise: every call "
                          "adds the same noise. In the one-process engine give each replica its own, "
                          "warm_init_(model, rank=r) for replica r", stacklevel=user_stacklevel())
    r, s = int_number(rank), int_number(seed)
    if r is None or r < 0 or s is None or s < 0:
        raise ValueError(f"Expected integers rank >= 0 and seed >= 0, but got rank={rank!r}, seed={seed!r}")
    rank, seed = r, s
    local = [p.to_local() if sharded else p for p in tensors]  # DTensors: this rank's shards (views of them)
    shard = sharded.shard if sharded else ()
    generators: dict[torch.device, torch.Generator] = {}

    def noise_like(p: torch.Tensor) -> torch.Tensor:
        if p.device not in generators:
            generators[p.device] = torch.Generator(device=p.device).manual_seed(_stream(seed, rank, shard))
        return torch.randn(p.shape, generator=generators[p.device], device=p.device, dtype=torch.float32)

    # every tensor's sum of squares over the whole replica: HOST SYNC, once (and with DTensors one COLLECTIVE)
    sq = torch.stack([p.detach().float().pow(2).sum().to(local[0].device, torch.float64) for p in local])
    sq = (sharded.sum_over_shards(sq) if sharded else sq).tolist()
    numels = [p.numel() for p in tensors]  # (a DTensor's: the whole tensor's)
    if scope == "model":
        stds = [nu * (sum(sq) / sum(numels)) ** 0.5] * len(local)
    else:  # the reference README's: each tensor's own
        stds = [nu * (q / n) ** 0.5 for q, n in zip(sq, numels)]
    for p, std in zip(local, stds):
        p.add_(noise_like(p).mul_(std).to(p.dtype))
    for p in tensors:
        p.__dict__["_hdet_warm"] = True
        p.__dict__["_hdet_warm_version"] = p._version
    return max(stds)


class _Sharded:
    """FSDP2/HSDP (DTensor) parameters on one device mesh: this rank's replica, its coordinates on the shard
    dimensions, and the sum of a vector over the replica's shards."""

    def __init__(self, mesh: object, replicate: int | None) -> None:
        self.mesh = mesh
        self.shard_dims = [d for d in range(mesh.ndim) if d != replicate]
        self.replica = mesh.get_local_rank(replicate) if replicate is not None else 0
        # (a dimension of size 1 shards nothing: on an (R, 1) mesh each replica draws the noise it draws under DDP)
        self.shard = tuple(mesh.get_local_rank(d) for d in self.shard_dims if mesh.size(d) > 1)

    @classmethod
    def of(cls, tensors: list[torch.Tensor]) -> "_Sharded | None":
        marked = [hasattr(p, "placements") for p in tensors]
        if not any(marked):
            return None
        meshes = {id(getattr(p, "device_mesh", None)) for p in tensors}
        if not all(marked) or not callable(getattr(tensors[0], "to_local", None)) or len(meshes) != 1:
            raise ValueError("Expected every parameter a DTensor on one device mesh (FSDP2/HSDP) or none, but got "
                             f"{sum(marked)} of {len(tensors)} DTensors on {len(meshes)} mesh(es)")
        mesh = tensors[0].device_mesh
        if mesh.ndim > 2:
            raise ValueError(f"Expected a 1-D or 2-D (replicate, shard) device mesh, but got {mesh.ndim} dimensions")
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        # the scheduler's reading (hdet.replicas.resolve_replicas): a 2-D mesh's replicas are its "replicate"
        # dimension, else its first; a 1-D mesh named ("replicate",) holds whole replicas, another 1-D one shards one
        replicate = names.index("replicate") if "replicate" in names else 0 if mesh.ndim == 2 else None
        for p in tensors:  # FSDP2/HSDP's placements: Replicate along the replicas, Shard along the other dimension
            for d, placement in enumerate(p.placements):
                if placement.is_shard() == (d == replicate):
                    raise ValueError(f"Expected each parameter replicated along the mesh's replicate dimension and "
                                     f"sharded along the other (FSDP2/HSDP), but got placements {p.placements}: "
                                     "warm_init_ does not support this layout")
        return cls(mesh, replicate)

    def sum_over_shards(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        kind = self.mesh.device_type  # the collective's device (the shards may be offloaded to the CPU)
        x = x.to(torch.device(kind, torch.get_device_module(kind).current_device()) if kind != "cpu" else "cpu")
        for d in self.shard_dims:
            dist.all_reduce(x, group=self.mesh.get_group(d))  # COLLECTIVE: the replica's shards' sums
        return x


def _stream(seed: int, rank: int, shard: tuple[int, ...] = ()) -> int:
    """Replica ``rank``'s generator seed for ``seed``: a hash, so that it is no seed a user sets. Seeded ``seed +
    rank``, replica 0's noise came from the stream ``torch.manual_seed(seed)`` had drawn the model's initial
    weights from (correlated with them: tests/test_inputs.py), and run seed s's replica 1 was
    run seed s + 1's replica 0. ``shard``: a sharded replica's coordinates on the mesh's shard dimensions (each
    shard draws its own noise)."""
    key = f"hdet.warm_init:{seed}:{rank}" + "".join(f":{i}" for i in shard)
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # < 2**63
