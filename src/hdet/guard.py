"""A DDP communication hook that averages only the finite gradient contributions.

With gradients all-reduced every step, one replica's NaN/Inf gradient would reach every replica at
once, before any converge step could leave it out. This hook, installed by the HDET schedulers when
``model=`` is a ``DistributedDataParallel`` module, all-reduces each bucket with non-finite
contributions replaced by zeros, and a count of finite contributors, and divides by that count. All on
the device: no host sync. Its cost over DDP's default hook: one extra read and write of each bucket
and one one-element all_reduce per bucket (measured in ``benchmarks/ddp_overhead.py``). The non-finite replica's own window loss (or weights) are caught at the next
converge step, which resets it (see ``on_nonfinite``).
"""

import warnings
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["finite_allreduce_hook", "install_gradient_guard"]


def finite_allreduce_hook(process_group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    # (no `from __future__ import annotations` here: DDP checks these annotations at registration)
    """``sum of finite contributions / number of finite contributors``, per bucket: the bucket (zeroed
    in place if any value is non-finite) and a one-element count are all-reduced together."""
    buf = bucket.buffer()
    ok = torch.isfinite(buf).all()  # one read of the bucket, on the device
    buf.masked_fill_(~ok, 0.0)  # NaN * 0 is NaN: zero the whole contribution instead
    count = ok.to(buf.dtype).reshape(1)
    f_buf = dist.all_reduce(buf, group=process_group, async_op=True).get_future()  # COLLECTIVE
    f_cnt = dist.all_reduce(count, group=process_group, async_op=True).get_future()  # COLLECTIVE (1 value)

    def finish(f: torch.futures.Future[list[torch.futures.Future[Any]]]) -> torch.Tensor:
        # no finite contributor at all: zero gradient (the converge step then stops the run)
        return buf.div_(count.clamp_(min=1))

    return torch.futures.collect_all([f_buf, f_cnt]).then(finish)


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
