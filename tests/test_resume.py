"""Crash and resume for real: torchrun restarts the ranks after one dies, they resume from the last
complete checkpoint, and the finished run equals an uninterrupted one bit for bit."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


pytestmark = pytest.mark.distributed
WORKER = str(Path(__file__).with_name("crash_worker.py"))


def _torchrun(out: Path, *args: str) -> subprocess.CompletedProcess:
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", WORKER, "--out", str(out), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "run"
    p = _torchrun(out)
    assert p.returncode == 0, p.stderr[-3000:]
    return torch.load(out / "final.pt", weights_only=True)


@pytest.mark.parametrize("kill_at, when", [(7, "before_step"), (10, "before_sync"), (13, "before_step")])
def test_killed_rank_restarts_from_checkpoint_and_matches(tmp_path, reference, kill_at, when):
    """Rank 1 dies at step 7 (off a sync step), inside the converge step of step 10 (the others wait in
    its collective), or at 13; checkpoints every 4 steps (on and off sync steps, T = 5)."""
    out = tmp_path / "run"
    p = _torchrun(out, "--kill-at", str(kill_at), "--kill-when", when)
    assert p.returncode == 0, p.stderr[-3000:]
    got = torch.load(out / "final.pt", weights_only=True)
    assert got["attempt"] == 1 and got["start"] == (kill_at - 1) // 4 * 4  # resumed from the last checkpoint
    for a, b in zip(got["params"] + got["buffers"], reference["params"] + reference["buffers"]):
        assert torch.equal(a, b)
    assert got["lrs"] == reference["lrs"][got["start"]:]
