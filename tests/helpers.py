"""Shared test helpers: a scripted stand-in for N replicas in one process, a gloo spawner, and a state's
trip through torch.save / torch.load(weights_only=True)."""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
import traceback
from datetime import timedelta
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hdet.replicas import Replicas

try:  # FSDP2's fully_shard: torch.distributed.fsdp since torch 2.6, torch.distributed._composable.fsdp before (2.4-2.5,
    from torch.distributed.fsdp import fully_shard  # the package supports both: hdet.replicas)
except ImportError:  # pragma: no cover - torch < 2.6
    import torch.distributed._composable.fsdp as _fsdp2
    fully_shard = _fsdp2.fully_shard


def roundtrip(obj):
    """``obj`` through ``torch.save`` and ``torch.load(weights_only=True)``, as a checkpoint holds it."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


class ScriptedReplicas(Replicas):
    """Replica ``rank`` of ``world_size``, alone in this process. ``gather`` returns this replica's
    vector for its own row and, for the others, the vector with its loss entries replaced by
    ``other_losses(step)`` (a list of N window-loss means); ``average_`` does nothing. The rows' weight
    fingerprints differ, as those of replicas at different LRs do."""

    def __init__(self, rank: int, world_size: int, window_losses: Callable[[], list[float]] | None = None):
        self.rank = rank
        self.world_size = world_size
        self.window_losses = window_losses
        self.gathers = 0

    def gather(self, local: torch.Tensor, shard_sum=(), shard_min=(), shard_max=()) -> torch.Tensor:
        from hdet.sync import SyncVector

        self.gathers += 1
        rows = local.detach().to(torch.float64).reshape(1, -1).repeat(self.world_size, 1)
        if self.window_losses is not None:
            count = rows[0, 2].item()
            rows[:, 0] = torch.tensor(self.window_losses(), dtype=torch.float64) * count
        rows[:, SyncVector._fields.index("weights")] += torch.arange(self.world_size, dtype=torch.float64)
        return rows

    def average_(self, tensors, exclude=(), into=None):
        return None


def file_init_method(folder: str) -> str:
    """A ``file://`` rendezvous in ``folder`` (fresh per run): no TCP port is probed, so no other process can
    take it between the probe and the bind (EADDRINUSE on a busy machine)."""
    return "file://" + os.path.join(os.path.abspath(folder), "rendezvous")


def _entry(rank: int, world_size: int, fn, args, out_dir: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=file_init_method(out_dir), rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=120))  # a hang becomes an error, never a stuck CI
    try:
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException as e:  # report to the parent, which re-raises
        torch.save({"ok": False, "type": type(e).__name__, "msg": str(e), "tb": traceback.format_exc()},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        try:
            dist.barrier()  # let every rank finish its collectives before any tears the group down
        finally:
            dist.destroy_process_group()
    # The result is on disk. Leave without running C++ destructors: a gloo/DDP teardown abort
    # ("terminate called without an active exception") was seen once here after a clean run.
    os._exit(0)


def run_gloo(fn, world_size: int, *args) -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned gloo processes; return the
    per-rank results, or per-rank error dicts ``{"error": type, "msg": ...}`` if a rank raised."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_entry, args=(world_size, fn, args, out_dir), nprocs=world_size, join=True)
        outs = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
    return [o["result"] if o["ok"] else {"error": o["type"], "msg": o["msg"], "tb": o["tb"]} for o in outs]


def check_ok(results: list) -> list:
    for r, res in enumerate(results):
        if isinstance(res, dict) and "error" in res and "tb" in res:
            raise AssertionError(f"rank {r} raised {res['error']}: {res['msg']}\n{res['tb']}")
    return results


@contextlib.contextmanager
def one_thread():
    """One intra-op thread, as the gloo workers use: the same summation order inside matmuls on both sides
    of an engine-vs-processes comparison."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def in_gloo_world_of_one(tmp_path, run) -> None:
    """``run()`` in this process as rank 0 of a gloo world of one (a ``file://`` rendezvous in ``tmp_path``), the process
    group destroyed after it. ``run``'s objects (DDP models, their reducers and comm hooks, schedulers) are gone before
    the group is. (In one of two clean-clone CI runs on 2026-11-30 the pytest process stood still right after the two
    tests that use this, its main thread waiting on a lock beside live gloo threads: most likely a DDP model of theirs,
    freed only after its group was destroyed, at a garbage collection in a later test.)"""
    import gc

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=file_init_method(str(tmp_path)), rank=0, world_size=1)
    try:
        run()
    finally:
        gc.collect()
        dist.destroy_process_group()
