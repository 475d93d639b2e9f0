"""A DDP communication hook that averages only the finite gradient contributions.

With gradients all-reduced every step, one replica's NaN/Inf gradient would reach every replica at
once, before any converge step could leave it out. This hook, installed by the HDET schedulers when
``model=`` is a ``DistributedDataParallel`` module, zeroes a replica's whole contribution to a bucket
when it holds a NaN or Inf and then averages as DDP does (so in such a step the healthy replicas' mean
gradient is scaled by (N - bad) / N: one collective, no extra count). All on the device, no host sync.
Its cost over DDP's default hook: one read and one select pass over each bucket
(``benchmarks/ddp_overhead.py``). A bucket whose finite values sum to infinity counts as non-finite. The non-finite replica's own window loss (or weights) are caught at the next
converge step, which resets it (see ``on_nonfinite``).
"""

import warnings
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["finite_allreduce_hook", "install_gradient_guard"]


def finite_allreduce_hook(process_group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    # (no `from __future__ import annotations` here: DDP checks these annotations at registration)
    """DDP's average with every non-finite contribution replaced by zeros: ``sum of finite
    contributions / N``. One read of the bucket (its sum: NaN and Inf propagate), one in-place select,
    then the same single all_reduce as DDP's default hook."""
    buf = bucket.buffer()
    ok = torch.isfinite(buf.sum())  # on the device: no host sync
    torch.where(ok, buf, torch.zeros((), dtype=buf.dtype, device=buf.device), out=buf)  # NaN * 0 is NaN
    avg = "nccl" in str(dist.get_backend(process_group))
    op = dist.ReduceOp.AVG if avg else dist.ReduceOp.SUM
    fut = dist.all_reduce(buf, op=op, group=process_group, async_op=True).get_future()  # COLLECTIVE
    world = dist.get_world_size(process_group)
    return fut.then(lambda f: f.value()[0] if avg else f.value()[0].div_(world))


def install_gradient_guard(ddp: "torch.nn.parallel.DistributedDataParallel", process_group: Any = None) -> bool:
    """Register :func:`finite_allreduce_hook` on ``ddp``; False (with a warning) if DDP refuses
    (a hook is already registered, or training has started)."""
    try:
        ddp.register_comm_hook(process_group, finite_allreduce_hook)
    except RuntimeError as e:
        warnings.warn(f"hdet: could not install the gradient guard on the DDP model ({e}); a non-finite "
                      "gradient on one replica will reach all of them", stacklevel=3)
        return False
    return True
