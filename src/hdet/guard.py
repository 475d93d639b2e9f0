"""A DDP communication hook that averages only the finite gradient contributions.

With gradients all-reduced every step, one replica's NaN/Inf gradient would reach every replica at
once, before any converge step could leave it out. This hook, installed by the HDET schedulers when
``model=`` is a ``DistributedDataParallel`` module, all-reduces each bucket with non-finite
contributions replaced by zeros, plus a count of finite contributors, and divides by that count. All on
the device: no host sync. The non-finite replica's own window loss (or weights) are caught at the next
converge step, which resets it (see ``on_nonfinite``).
"""

import warnings
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["finite_allreduce_hook", "install_gradient_guard"]


def finite_allreduce_hook(process_group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    # (no `from __future__ import annotations` here: DDP checks these annotations at registration)
    """``sum of finite contributions / number of finite contributors``, per bucket (one all_reduce)."""
    buf = bucket.buffer()
    ok = torch.isfinite(buf).all()
    packed = torch.cat([torch.where(ok, buf, torch.zeros_like(buf)), ok.to(buf.dtype).reshape(1)])
    fut = dist.all_reduce(packed, group=process_group, async_op=True).get_future()  # COLLECTIVE

    def finish(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        out = f.value()[0]
        # no finite contributor at all: zero gradient (the converge step then stops the run)
        return out[:-1].div_(out[-1:].clamp_(min=1))

    return fut.then(finish)


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
