"""The skip guard and its early recovery on real GPUs (NCCL, 2 processes): run on the GPU machine."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]


def test_nan_weight_under_the_skip_guard_is_reset_early_without_host_syncs(tmp_path):
    worker = Path(__file__).with_name("skip_guard_nccl.py")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(worker), str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    for r in range(2):
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert res["guard"] == "skip-all" and res["finite"]
        if r == 0:  # rank 1's own NaN never compares equal to itself
            assert res["frozen_steps"] == list(range(7, 31)), res["frozen_steps"]
        assert res["skipped"] == 24.0
        assert any("early recovery at step 30 replica(s) [1]" in w for w in res["warnings"])
        assert res["steps_under_sync_debug_error"] == 115  # steps 3-120 but the syncs at 100, 120 and the recovery


def test_under_a_grad_scaler_the_reset_takes_the_last_taken_steps_scale_without_host_syncs(tmp_path):
    """The same run under fp16 and a GradScaler: every step of the stall overflows and the scaler halves its scale
    (1024 -> 2^-14 by step 30); the early recovery resets rank 1 and puts the scale back to step 6's, the last step
    taken, which the guard's watch keeps on the device at every step (no host sync: every checked step passes)."""
    worker = Path(__file__).with_name("skip_guard_nccl.py")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(worker), str(tmp_path), "fp16"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    for r in range(2):
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert res["guard"] == "skip-all" and res["finite"]
        s = res["scales"]
        assert min(s[6:29]) < s[5] / 1000 and s[29] == s[5], s[:32]
        assert any("early recovery at step 30 replica(s) [1]" in w for w in res["warnings"])
        assert res["steps_under_sync_debug_error"] == 115


def test_a_run_resumed_in_a_stall_on_cuda_resets_where_the_whole_run_does(tmp_path):
    """The guard's counts (a CUDA counter, a pinned copy in flight) saved after step 20, in a stall since step 7, and
    restored in new objects: rank 1 is reset at step 30 in both runs, and the weights end equal."""
    worker = Path(__file__).with_name("stall_resume_nccl.py")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(worker), str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    for r in range(2):
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert res["guard"] == "skip-all" and res["saved_guard"]["kind"] == "skip"
        if r == 1:
            assert res["reset"] == [[30], [30]], res["reset"]
        assert res["diff"] == 0.0, res["diff"]
