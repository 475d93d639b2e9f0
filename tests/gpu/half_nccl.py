"""Run under torchrun on 2 GPUs (tests/gpu/test_half_precision_nccl.py): tests/dist_workers.half_averaging on CUDA
with NCCL, for fp16 and bf16, separate and contiguous parameters. Writes one JSON per rank to argv[1]."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the gloo tests' worker
from dist_workers import half_averaging  # noqa: E402


def main(out: str) -> None:
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    res = {}
    for dtype in (torch.float16, torch.bfloat16):
        for contiguous in (False, True):
            r = half_averaging(rank, world, dtype=dtype, contiguous=contiguous, device="cuda")
            res[f"{dtype}-{contiguous}"] = {k: (v.double().cpu().tolist() if torch.is_tensor(v) else v)
                                           for k, v in r.items()}
    Path(out, f"rank{rank}.json").write_text(json.dumps(res))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
