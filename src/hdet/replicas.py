"""Where replicas live. The only module that knows how replicas talk to each other.

Two implementations share one interface:

* :class:`ProcessGroupReplicas`: one replica per process (or per replicate-group of processes),
  talking through ``torch.distributed`` collectives (NCCL on GPUs, gloo on CPU).
* :class:`SingleReplica`: a lone replica (no process group); reductions fall back to local values,
  so a one-replica run goes through the same code path as a distributed one.

Both offer the two operations HDET needs at a sync step: gather a small vector of scalars from every
replica, and average a list of tensors in place, bucketed (one collective per bucket, not per tensor).
"""

from __future__ import annotations

import contextlib
import os
import zlib
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .flat import contiguous_runs
from .values import int_number

__all__ = ["Replicas", "SingleReplica", "ProcessGroupReplicas", "LocalReplicaGroup", "LocalReplica", "plan_buckets",
           "resolve_replicas", "ReplicaSyncError", "average_local"]


class ReplicaSyncError(RuntimeError):
    """A converge step's collective failed, usually because a replica never arrived within the process
    group's timeout (it died, hung, or skipped ``scheduler.step()``)."""


@contextlib.contextmanager
def _collective(what: str) -> Iterator[None]:
    """Turn a failed collective (a timeout, a closed connection: gloo and NCCL raise RuntimeError
    subclasses) into a :class:`ReplicaSyncError` that says what it usually means."""
    try:
        yield
    except (ReplicaSyncError, torch.OutOfMemoryError, getattr(torch, "AcceleratorError", torch.OutOfMemoryError)):
        raise  # this process's own failure (out of memory, a CUDA error), not another replica's
    except RuntimeError as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ReplicaSyncError(
            f"{what} failed: {first}. Usually a replica never arrived within the process group's timeout: it "
            "died, hung, or skipped scheduler.step() at this step (every replica must call it after every "
            "optimizer step)."
        ) from e

DEFAULT_BUCKET_CAP_MB = 100.0  # a converge step overlaps no compute: fewer, larger buckets are faster


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2), or the tensor itself: averaging and checks run on local shards."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def is_sharded(t: Any) -> bool:
    """Whether ``t`` is a DTensor sharded over more than one rank (FSDP2; a mesh dimension of one rank leaves it whole
    on every rank): a forward may run on unsharded copies."""
    placements, mesh = getattr(t, "placements", None), getattr(t, "device_mesh", None)
    return placements is not None and mesh is not None and any(
        pl.is_shard() and mesh.size(i) > 1 for i, pl in enumerate(placements))


HALF = (torch.float16, torch.bfloat16)  # averaged in float32: their own sum overflows fp16 (a mean of finite values
# came out +Inf: BatchNorm's running_var 38240 and 38976, an audit) and rounds at every addition (bf16 replicas that
# were equal moved by up to 0.94% after a converge step of N = 8)


def accumulation(dtype: torch.dtype) -> torch.dtype:
    """The dtype a sum over the replicas runs in: float32 for fp16/bf16, else the tensors' own."""
    return torch.float32 if dtype in HALF else dtype


def _flat_for_sum(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors copied back to back into a new buffer, in :func:`accumulation`'s dtype (never a view of one of
    them: torch's ``_flatten_dense_tensors`` of one tensor is its view, and a replica outside ``into`` then got the
    mean written into its own tensor by the all_reduce)."""
    acc = accumulation(tensors[0].dtype)
    if acc == tensors[0].dtype and len(tensors) > 1:
        return _flatten_dense_tensors(tensors)  # (one new buffer already)
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=acc, device=tensors[0].device)
    torch._foreach_copy_(list(_unflatten_dense_tensors(flat, tensors)), list(tensors))  # (fp16/bf16: no half copy)
    return flat


def _copy_back(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """The averaged buffer back into the tensors, in their dtype."""
    torch._foreach_copy_(list(tensors), _unflatten_dense_tensors(flat.to(tensors[0].dtype), tensors))


def plan_buckets(tensors: Sequence[torch.Tensor], cap_bytes: int) -> list[list[int]]:
    """Split tensor indices into buckets of one (device, dtype), each at most ``cap_bytes``
    (a single larger tensor gets a bucket of its own). Order within a bucket follows ``tensors``;
    the plan depends only on shapes, dtypes and devices, so it is identical on every replica."""
    buckets: list[list[int]] = []
    open_bucket: dict[tuple[torch.device, torch.dtype], tuple[list[int], int]] = {}
    for i, t in enumerate(tensors):
        key = (t.device, t.dtype)
        nbytes = t.numel() * t.element_size()
        idx, size = open_bucket.get(key, ([], 0))
        if idx and size + nbytes > cap_bytes:
            buckets.append(idx)
            idx, size = [], 0
        idx.append(i)
        open_bucket[key] = (idx, size + nbytes)
    buckets.extend(idx for idx, _ in open_bucket.values() if idx)
    return buckets


class Replicas(ABC):
    """The replicas of one HDET ensemble, seen from one of them."""

    rank: int
    world_size: int

    @abstractmethod
    def gather(self, local: torch.Tensor, shard_sum: Sequence[int] = (), shard_min: Sequence[int] = (),
               shard_max: Sequence[int] = ()) -> torch.Tensor:
        """All replicas' copies of a 1-D float64 vector, as a CPU tensor of shape ``[world_size, k]``.
        Where one replica is several ranks (FSDP2/HSDP shards), the entries ``shard_sum`` are first summed,
        ``shard_min`` min-reduced and ``shard_max`` max-reduced over them.

        Host sync: the result is copied to the CPU. A failed collective raises :class:`ReplicaSyncError`."""

    @abstractmethod
    def average_(self, tensors: Sequence[torch.Tensor], exclude: Sequence[int] = (),
                 into: Sequence[int] | None = None) -> None:
        """Replace each tensor by its mean over replicas, in place (Eq. 3). Replicas in ``exclude``
        (the same list on every replica) contribute nothing and receive the others' mean. ``into`` (the same
        list on every replica): only these replicas receive the mean; the others contribute and keep theirs."""

    def comm_device(self, hint: torch.device | None = None) -> torch.device:
        """The device a vector handed to :meth:`gather` should live on."""
        return torch.device("cpu")

    def first_to_say(self, what: str) -> bool:
        """Whether this replica is the first of its process to say ``what`` (a warning every replica of the
        one-process engine would give: said once there, not N times); a process's only replica always is."""
        return True

    def memory_layout(self, tensors: Sequence[torch.Tensor]) -> int:
        """A hash of the collectives :meth:`average_` issues for ``tensors``, which follow where they lie in memory,
        so it must be the same on every replica. 0 where averaging issues none."""
        return 0


class SingleReplica(Replicas):
    """One replica, no process group: gather returns the local vector, averaging is a no-op."""

    def __init__(self) -> None:
        self.rank = 0
        self.world_size = 1

    def gather(self, local: torch.Tensor, shard_sum: Sequence[int] = (), shard_min: Sequence[int] = (),
               shard_max: Sequence[int] = ()) -> torch.Tensor:
        return local.detach().to("cpu", torch.float64).reshape(1, -1)  # host sync (device -> CPU copy)

    def average_(self, tensors: Sequence[torch.Tensor], exclude: Sequence[int] = (),
                 into: Sequence[int] | None = None) -> None:
        return None


class ProcessGroupReplicas(Replicas):
    """One replica per rank of a process group (the default group when ``group`` is None).

    ``bucket_cap_mb`` bounds the extra memory of averaging: two flat buckets at a time (one being
    reduced while the next is flattened), never a copy of the whole model; contiguous parameters
    (:func:`hdet.contiguous_parameters_`) need no bucket at all. Averaging runs in each tensor's own dtype, fp16 and
    bf16 in float32 (:func:`accumulation`: through buckets, never in place); NCCL averages with ``ReduceOp.AVG`` (its
    own accumulation precision), other backends sum then divide by N."""

    def __init__(self, group: Any = None, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB, shard_group: Any = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "ProcessGroupReplicas needs an initialised torch.distributed process group; "
                "call torch.distributed.init_process_group() first"
            )
        if not bucket_cap_mb > 0:
            raise ValueError(f"Expected bucket_cap_mb > 0, but got {bucket_cap_mb!r}")
        self.group = group
        self.shard_group = shard_group  # the ranks that hold one replica's shards (FSDP2/HSDP), or None
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        self.cap_bytes = int(bucket_cap_mb * 2**20)

    def comm_device(self, hint: torch.device | None = None) -> torch.device:
        if "nccl" in self.backend:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def memory_layout(self, tensors: Sequence[torch.Tensor]) -> int:
        """A hash of the collectives :meth:`average_` issues for ``tensors`` (without ``into``): the tensors of each
        all_reduce, in order (a run reduced in place and a bucket of the same tensors are the same collective)."""
        runs, rest = self._plan(tensors)
        buckets = [[rest[i] for i in idx] for idx in plan_buckets([tensors[i] for i in rest], self.cap_bytes)]
        return zlib.crc32(repr([idx for idx, _ in runs] + buckets).encode())  # < 2**32: exact in float64

    def _plan(self, tensors: Sequence[torch.Tensor]) -> tuple[list[tuple[list[int], torch.Tensor]], list[int]]:
        """What :meth:`average_` all-reduces where it lives (without ``into``): the runs of tensors back to back in one
        storage (:func:`hdet.flat.contiguous_runs`), not fp16/bf16, and any single tensor of at least one bucket; and
        the indices of the rest, which go through buckets."""
        runs = [(idx, flat) for idx, flat in contiguous_runs(tensors) if flat is not None and flat.dtype not in HALF
                and not (len(idx) == 1 and flat.numel() * flat.element_size() < self.cap_bytes)]
        taken = {i for idx, _ in runs for i in idx}
        return runs, [i for i in range(len(tensors)) if i not in taken]

    def gather(self, local: torch.Tensor, shard_sum: Sequence[int] = (), shard_min: Sequence[int] = (),
               shard_max: Sequence[int] = ()) -> torch.Tensor:
        local = local.detach().to(self.comm_device(), torch.float64).reshape(-1)
        with _collective("the all_gather of the replicas' sync vectors"):
            if self.shard_group is not None and dist.get_world_size(self.shard_group) > 1:
                # one replica = its shard group: sum some entries over its ranks (losses, counts), min others (flags),
                # max others (the count of non-finite losses: a step is one step whichever shard saw it)
                local = local.clone()
                for idx, op in ((list(shard_sum), dist.ReduceOp.SUM), (list(shard_min), dist.ReduceOp.MIN),
                                (list(shard_max), dist.ReduceOp.MAX)):
                    if idx:
                        part = local[idx].clone()
                        dist.all_reduce(part, op=op, group=self.shard_group)  # COLLECTIVE (a few values)
                        local[idx] = part
            out = torch.empty(self.world_size * local.numel(), dtype=local.dtype, device=local.device)
            gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            gather_single(out, local, group=self.group)  # COLLECTIVE: one all_gather of k float64
            return out.view(self.world_size, -1).cpu()  # host sync

    def average_(self, tensors: Sequence[torch.Tensor], exclude: Sequence[int] = (),
                 into: Sequence[int] | None = None) -> None:
        """Tensors that lie back to back in one storage (:func:`hdet.flat.contiguous_parameters_`), and
        any tensor of at least one bucket, are all-reduced where they live: no copy. The rest goes
        through flat buckets, pipelined: while bucket k is being all-reduced, bucket k+1 is flattened (at
        most two buckets of extra memory), then bucket k is copied back. With ``into``, everything goes
        through buckets (every replica the same collectives) and only those replicas copy back."""
        if self.world_size == 1 or not tensors:
            return
        with _collective("the all_reduce of the averaged tensors"):
            self._average(tensors, exclude, into)

    def average_over_shards_(self, tensors: Sequence[torch.Tensor]) -> None:
        """FSDP2/HSDP: tensors that each rank of a replica holds whole, not as shards (its buffers: BatchNorm's
        statistics, which each rank updates from its own part of the batch), averaged over the replica's shard ranks
        too, after :meth:`average_` over the replicas: every rank then holds their mean over the whole mesh. Without
        it each shard rank averaged only with the same shard rank of the other replicas, and a replica's ranks kept
        different statistics (which one a checkpoint or an evaluation got depended on the rank)."""
        if self.shard_group is None or dist.get_world_size(self.shard_group) == 1 or self.world_size == 1 or not tensors:
            return  # (one replica: plain FSDP2, whose ranks keep their own, as without hdet)
        with _collective("the all_reduce of the buffers over a replica's shard ranks"), torch.no_grad():
            for bucket in plan_buckets(list(tensors), self.cap_bytes):
                part = [tensors[i] for i in bucket]
                flat = _flat_for_sum(part)
                dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.shard_group)  # COLLECTIVE (one per bucket)
                flat.div_(dist.get_world_size(self.shard_group))
                _copy_back(flat, part)

    def _average(self, tensors: Sequence[torch.Tensor], exclude: Sequence[int],
                 into: Sequence[int] | None = None) -> None:
        n = self.world_size - len(set(exclude))
        if n <= 0:
            raise ValueError(f"Expected at least one replica to average over, but exclude= leaves out all "
                             f"{self.world_size} (nothing changed)")
        use_avg = "nccl" in self.backend and n == self.world_size
        op = dist.ReduceOp.AVG if use_avg else dist.ReduceOp.SUM
        excluded = self.rank in exclude
        receive = into is None or self.rank in into

        def finish(item: tuple[Any, torch.Tensor, list[torch.Tensor] | None]) -> None:
            work, flat, bucket = item
            work.wait()  # NCCL: the current stream waits for the collective (no host block)
            if not use_avg:
                flat.div_(n)
            if bucket is not None and receive:
                _copy_back(flat, bucket)

        with torch.no_grad():
            direct: list[tuple[Any, torch.Tensor, None]] = []  # reduced where they live
            runs, rest = ([], list(range(len(tensors)))) if into is not None else self._plan(tensors)
            for idx, flat in runs:
                if excluded:
                    flat.zero_()  # NaN * 0 is NaN: contribute exact zeros instead (this replica gets the mean)
                direct.append((dist.all_reduce(flat, op=op, group=self.group, async_op=True), flat, None))  # COLLECTIVE (one per run)
            in_flight: list[tuple[Any, torch.Tensor, list[torch.Tensor] | None]] = []
            for idx in plan_buckets([tensors[i] for i in rest], self.cap_bytes):
                bucket = [tensors[rest[i]] for i in idx]
                flat = _flat_for_sum(bucket)  # (fp16/bf16: summed in float32, then rounded once)
                if excluded:
                    flat.zero_()
                work = dist.all_reduce(flat, op=op, group=self.group, async_op=True)  # COLLECTIVE (one per bucket)
                in_flight.append((work, flat, bucket))
                if len(in_flight) > 1:
                    finish(in_flight.pop(0))
            for item in direct + in_flight:
                finish(item)


def reshard_fsdp(model: Any) -> None:
    """Reshard every FSDP2 module of ``model`` (a no-op where it is sharded already, and without FSDP2), before hdet
    writes its sharded parameters: FSDP2 keeps the root's parameters unsharded after a forward under ``no_grad`` (an
    evaluation: no backward reshards them), and its next forward reuses those copies, so a write into the shards would
    be unseen (an evaluation of the average measured the replica's own weights; training went on from the average).
    No collective."""
    if model is None:
        return
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # (torch < 2.6: FSDP2 lived in torch.distributed._composable.fsdp)
        try:
            from torch.distributed._composable.fsdp import FSDPModule  # type: ignore[no-redef]
        except ImportError:
            return
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def check_not_fsdp1(params: Any, model: Any) -> None:
    """Refuse FSDP1 (``FullyShardedDataParallel``): each rank holds a flat shard of one model, not a replica, and a
    converge step averaged rank 0's shard with rank 1's, other parameters (an audit: the model's first half written
    over its second, no word); with ``use_orig_params=True`` it was met only at the first converge step. FSDP2
    (``fully_shard``) with ``device_mesh=`` is the sharded form hdet supports (docs/sharded.md)."""
    flat = next((p for p in params if getattr(p, "_fsdp_flattened", False)), None)  # FSDP1's FlatParameter
    wrapped = None
    if model is not None:
        try:
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
        except ImportError:  # pragma: no cover - a torch without distributed
            pass
        else:
            wrapped = next((m for m in model.modules() if isinstance(m, FSDP1)), None)
    if flat is not None or wrapped is not None:
        raise ValueError(
            "Expected whole replicas on each rank (DDP) or FSDP2 (fully_shard, with device_mesh=), but got "
            + ("a model wrapped in FSDP1's FullyShardedDataParallel" if wrapped is not None else
               f"FSDP1's flattened parameters (shape {tuple(flat.shape)})")
            + ": its ranks hold shards of one model, and HDET would take each shard for a replica and average "
              "different parameters together. Use FSDP2 (torch.distributed.fsdp.fully_shard over a (replicate, shard) "
              "mesh, passed as device_mesh=; Accelerate: fsdp_version=2) or DDP")


def check_mesh_placements(device_mesh: Any, params: Any) -> None:
    """That the ranks the replicas are taken from hold whole replicas' parameters: no parameter sharded along the
    mesh's replicate dimension (``fully_shard`` over a 1-D mesh shards one model whatever the mesh's name, so its ranks
    hold parts of one model, not replicas), and a parameter sharded at all (an FSDP2 DTensor) only with the 2-D
    (replicate, shard) ``device_mesh`` whose shard dimension holds its shards: without a mesh (the default group, a
    ``process_group``) or with a 1-D one (``mesh["replicate"]`` of an HSDP mesh) each shard rank would be taken for a
    replica or judge its replica alone (its own LR and window loss; the gradient guard not installed)."""
    for p in params:
        placements, mesh = getattr(p, "placements", None), getattr(p, "device_mesh", None)  # DTensors only
        if placements is None or mesh is None:
            continue
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        if is_sharded(p) and (device_mesh is None or device_mesh.ndim == 1 and mesh.ndim > 1):
            raise ValueError(
                f"Expected device_mesh= the (replicate, shard) device mesh the model is sharded over, but a parameter "
                f"of shape {tuple(p.shape)} is sharded (a DTensor placed {tuple(placements)} on a mesh named "
                f"{names or None}) and the scheduler got "
                + ("no device_mesh (its replicas would be the default group's or process_group's ranks: each shard "
                   "of one model its own replica)" if device_mesh is None else
                   f"a 1-D mesh named {tuple(getattr(device_mesh, 'mesh_dim_names', None) or ()) or None} (its ranks "
                   "would judge their replica from their own shard alone)")
                + ": pass device_mesh= the 2-D (replicate, shard) mesh it is sharded over (FSDP2: the mesh of "
                  "fully_shard(model, mesh=mesh); a tensor-parallel layer's shards likewise along the shard dimension), "
                  "whose replicate dimension holds HDET's replicas")
        if device_mesh is None:
            continue
        dim = names.index("replicate") if "replicate" in names else 0 if mesh.ndim == device_mesh.ndim else None
        if dim is not None and placements[dim].is_shard():
            raise ValueError(
                f"Expected the parameters replicated along the device mesh's replicate dimension (its ranks are HDET's "
                f"replicas), but a parameter of shape {tuple(p.shape)} is placed {tuple(placements)} on a mesh named "
                f"{names or None}: "
                + ("fully_shard over a 1-D mesh shards one model, whatever the mesh's name" if mesh.ndim == 1 else
                   f"fully_shard replicates along a {mesh.ndim}-D mesh's first dimension and shards along the next, "
                   "whatever their names, and "
                   + (f"this mesh's 'replicate' dimension is its dimension {dim}" if "replicate" in names else
                      "this parameter is sharded along the mesh's first dimension, which holds HDET's replicas"))
                + ". For HSDP use a 2-D mesh, init_device_mesh(..., (replicas, shards), mesh_dim_names=('replicate', "
                  "'shard')), and fully_shard(model, mesh=mesh)")


def resolve_replicas(
    replicas: Replicas | None,
    rank: int | None,
    world_size: int | None,
    process_group: Any = None,
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
    device_mesh: Any = None,
) -> Replicas:
    """Choose the replicas from the arguments a scheduler was given.

    An explicit ``replicas`` wins. Otherwise, with torch.distributed initialised, the replicas are
    the ranks of ``process_group`` (default group); ``rank`` and ``world_size``, when passed, must
    agree with it. Without a process group there is one replica."""
    if replicas is not None:
        return replicas
    for name, value in (("rank", rank), ("world_size", world_size)):  # (a tensor rank compared as a tensor: torch's
        if value is not None and int_number(value) is None:  # "Boolean value of Tensor ... is ambiguous" at world 2)
            raise ValueError(f"Expected {name}= to be an int (or None: from the process group), but got {value!r}")
    rank, world_size = (None if v is None else int_number(v) for v in (rank, world_size))
    shard_group = None
    if device_mesh is not None:  # FSDP2/HSDP: replicas along dim 0 ("replicate"), shards along dim 1
        if process_group is not None:
            raise ValueError("Expected process_group or device_mesh, not both")
        if device_mesh.ndim not in (1, 2):
            raise ValueError(f"Expected a 1-D (replicate) or 2-D (replicate, shard) device mesh, but got "
                             f"{device_mesh.ndim} dimensions")
        names = tuple(getattr(device_mesh, "mesh_dim_names", None) or ())
        if device_mesh.ndim == 1 and names[:1] != ("replicate",):  # a plain FSDP2 mesh: one model's shards, whose
            # ranks would be taken for replicas (each shard its own LR, and shards of other parameters averaged)
            raise ValueError(f"Expected a 1-D device mesh named ('replicate',) (its ranks are HDET's replicas) or a "
                             f"2-D ('replicate', 'shard') mesh, but got a 1-D mesh named {names or None}: a 1-D FSDP2 "
                             "mesh shards one model, so its ranks are not replicas. Use init_device_mesh(..., "
                             "(replicas, shards), mesh_dim_names=('replicate', 'shard')) (HSDP), or "
                             "mesh_dim_names=('replicate',) when every rank holds a whole replica")
        process_group = device_mesh.get_group(0)
        shard_group = device_mesh.get_group(1) if device_mesh.ndim == 2 else None
    if dist.is_available() and dist.is_initialized():
        found = ProcessGroupReplicas(process_group, bucket_cap_mb, shard_group)
        if rank is not None and rank != found.rank:
            raise ValueError(f"Expected rank={found.rank} (from the process group), but got rank={rank}")
        if world_size is not None and world_size != found.world_size:
            raise ValueError(
                f"Expected world_size={found.world_size} (from the process group), but got world_size={world_size}"
            )
        return found
    env_world = os.environ.get("WORLD_SIZE", "1")
    if world_size is None and env_world.isdigit() and int(env_world) > 1:
        raise ValueError(
            f"Expected an initialised torch.distributed process group: the environment says WORLD_SIZE={env_world} "
            "(torchrun), but none is initialised yet, so this scheduler would silently be a single replica (no spread, "
            "no averaging). Build the scheduler after torch.distributed.init_process_group() (with the Hugging Face "
            "Trainer: after TrainingArguments, which initialise it), or pass world_size=1 to mean one replica."
        )
    if (world_size not in (None, 1)) or (rank not in (None, 0)):
        raise ValueError(
            f"Expected rank=0 and world_size=1 without an initialised torch.distributed process group, "
            f"but got rank={rank}, world_size={world_size}; call torch.distributed.init_process_group() "
            "before building the scheduler"
        )
    return SingleReplica()


class LocalReplicaGroup:
    """N replicas living in one process (the one-process engine): one :class:`LocalReplica` view per
    replica, handed to its scheduler. The engine drives every sync itself (each ensemble's
    ``prepare_sync``, the rows stacked, :func:`average_local`, ``finish_sync``), so the views never
    communicate: the maths is the distributed path's, with reductions over the replica axis."""

    def __init__(self, world_size: int) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"Expected a positive integer number of replicas, but got {world_size!r}")
        self.world_size = world_size
        self.device = torch.device("cpu")  # where the sync vectors are built (the engine sets its model's device)
        self.views = [LocalReplica(self, r) for r in range(world_size)]
        self.said: set[str] = set()  # the warnings one of the views gave (LocalReplica.first_to_say)


def average_local(lists: Sequence[Sequence[torch.Tensor]], exclude: Sequence[int] = (),
                  into: Sequence[int] | None = None) -> None:
    """Eq. 3 over the replica axis: ``lists[r]`` is replica r's tensors; sum in replica order (fp16/bf16 in float32,
    as :class:`ProcessGroupReplicas` does), divide by the count (as gloo does), copy back into every replica's
    (``into``: these replicas' only). Replicas in ``exclude`` are left out of the sum and receive the others' mean."""
    keep = [r for r in range(len(lists)) if r not in set(exclude)]
    if lists and not keep:
        raise ValueError(f"Expected at least one replica to average over, but exclude= leaves out all {len(lists)} "
                         "(nothing changed)")
    if not lists or not lists[0]:
        return
    with torch.no_grad():
        acc = [t.to(accumulation(t.dtype), copy=True) for t in lists[keep[0]]]
        for r in keep[1:]:
            torch._foreach_add_(acc, list(lists[r]))
        torch._foreach_div_(acc, len(keep))
        for r, tensors in enumerate(lists):
            if into is None or r in into:
                torch._foreach_copy_(list(tensors), acc)


class LocalReplica(Replicas):
    """Replica ``rank`` of a :class:`LocalReplicaGroup`: its rank and the group's size. It has no transport
    of its own: the engine runs the sync (:meth:`hdet.ReplicaEngine.step`)."""

    def __init__(self, group: LocalReplicaGroup, rank: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = group.world_size

    def first_to_say(self, what: str) -> bool:
        said = what in self.group.said
        self.group.said.add(what)
        return not said

    def comm_device(self, hint: torch.device | None = None) -> torch.device:
        """The engine's device: the N vectors are stacked there and read in one copy (one host sync a sync)."""
        return self.group.device

    def gather(self, local: torch.Tensor, shard_sum: Sequence[int] = (), shard_min: Sequence[int] = (),
               shard_max: Sequence[int] = ()) -> torch.Tensor:
        raise RuntimeError("A LocalReplica's sync is run by its ReplicaEngine (engine.step), not by the scheduler: "
                           "step the engine, not the replicas' schedulers")

    def average_(self, tensors: Sequence[torch.Tensor], exclude: Sequence[int] = (),
                 into: Sequence[int] | None = None) -> None:
        raise RuntimeError("A LocalReplica's averaging is run by its ReplicaEngine (engine.step)")
