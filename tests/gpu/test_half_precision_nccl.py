"""fp16/bf16 averages under NCCL on real GPUs (2 processes): run on the GPU machine."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]


def test_half_precision_averages_under_nccl(tmp_path):
    """tests/test_distributed.py::test_half_precision_averages_are_summed_in_float32 on CUDA with NCCL (ReduceOp.AVG):
    the converge step's mean of fp16 running variances whose fp16 sum overflows, rounded once, and the "hook" guard's
    mean of fp16 gradients of 4e4 (plain DDP's: 4e4)."""
    worker = Path(__file__).with_name("half_nccl.py")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(worker), str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for case in res[0]:
        dtype = torch.float16 if "float16" in case and "bfloat16" not in case else torch.bfloat16
        before = [torch.tensor(r[case]["before"], dtype=torch.float64) for r in res]
        want = ((before[0] + before[1]) / 2).to(dtype).double()
        for r in res:
            assert r[case]["guard"] == "hook"
            assert torch.equal(torch.tensor(r[case]["after"], dtype=torch.float64), want), (case, r[case]["after"])
            assert r[case]["grad"] == [[torch.tensor(4e4, dtype=dtype).item()] * 4], (case, r[case]["grad"])
