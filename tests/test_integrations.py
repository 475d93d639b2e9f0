"""Framework integrations with the real libraries on CPU (tiny models from configs, no downloads)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.distributed
transformers = pytest.importorskip("transformers")
WORKER = str(Path(__file__).with_name("hf_worker.py"))


def _torchrun(out: Path, *args: str) -> None:
    out.mkdir(exist_ok=True)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        WORKER, "--out", str(out), *args], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]


def _results(out: Path):
    return [torch.load(out / f"result_rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "full"
    _torchrun(out)
    return out, _results(out)


def test_hf_trainer_two_gloo_processes(full_run):
    """HDETTrainer on a tiny GPT-2 (GPT2Config), 2 gloo processes, gradient accumulation 2, 20 optimizer
    steps: each rank steps with its own LR, the controller ran at steps 10, 15, 20 (HDET counted
    optimizer steps, not micro-batches), and the replicas end with equal weights."""
    _, res = full_run
    r0, r1 = res
    assert r0["world"] == 2 and r0["step"] == 20 and r0["updates"] == r1["updates"] == 3
    assert len(r0["lrs"]) == 20 and r0["lrs"] != r1["lrs"]  # the spread
    assert r0["bases"] == r1["bases"] and r0["perms"] == r1["perms"]
    assert all(torch.equal(a, b) for a, b in zip(r0["params"], r1["params"]))


def test_hf_trainer_resume_from_checkpoint(full_run, tmp_path):
    """Stopped right after the checkpoint at step 10 and resumed with resume_from_checkpoint: the HDET state
    and the final weights match the uninterrupted run."""
    full_out, full = full_run
    out = tmp_path / "resumed"
    _torchrun(out, "--stop-at", "10")
    _torchrun(out, "--resume", str(out / "checkpoint-10"))
    res = _results(out)
    for got, ref in zip(res, full):
        assert got["step"] == 20 and got["updates"] == ref["updates"]
        assert got["bases"] == pytest.approx(ref["bases"], rel=1e-6) and got["perms"] == ref["perms"]
        assert got["lrs"] == pytest.approx(ref["lrs"][10:], rel=1e-6)
        for a, b in zip(got["params"], ref["params"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_accelerate_two_gloo_processes(tmp_path):
    """HDET next to Accelerate (prepared model and optimizer, gradient accumulation 2): 12 optimizer steps
    from 24 micro-batches, per-rank LRs, 3 controller updates, the gradient guard on the prepared DDP
    model, equal weights at the end."""
    pytest.importorskip("accelerate")
    out = tmp_path / "acc"
    out.mkdir()
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(Path(__file__).with_name("accelerate_worker.py")), "--out", str(out)],
                       capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    r0, r1 = (torch.load(out / f"result_rank{r}.pt", weights_only=True) for r in range(2))
    assert r0["done"] == r1["done"] == 12 and r0["updates"] == r1["updates"] == 3
    assert r0["guard"] and r0["lrs"] != r1["lrs"]
    assert all(torch.equal(a, b) for a, b in zip(r0["params"], r1["params"]))


LIGHTNING_WORKER = str(Path(__file__).with_name("lightning_worker.py"))


def _lightning(out: Path, *args: str) -> list:
    out.mkdir(exist_ok=True)
    p = subprocess.run([sys.executable, LIGHTNING_WORKER, "--out", str(out), *args], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    return [torch.load(out / f"result_rank{r}.pt", weights_only=True) for r in range(2)]


def test_lightning_ddp_spawn_and_resume(tmp_path):
    """Lightning, ddp_spawn on CPU with 2 devices, accumulate_grad_batches=2, a step-interval HDET
    scheduler and HDETCallback: 16 optimizer steps, 4 controller updates, per-rank LRs, equal weights;
    stopped after the checkpoint of step 8 and resumed from it, the run ends where the uninterrupted
    one does."""
    pytest.importorskip("lightning")
    full = _lightning(tmp_path / "full")
    r0, r1 = full
    assert r0["step"] == 16 and r0["updates"] == r1["updates"] == 4
    assert r0["lrs"] != r1["lrs"] and torch.equal(r0["params"][0], r0["params"][1])
    out = tmp_path / "resumed"
    _lightning(out, "--max-steps", "8")
    res = _lightning(out, "--resume", str(out / "epoch=0-step=8.ckpt"))
    for got, ref in zip(res, full):
        assert got["step"] == 16 and got["updates"] == 4 and got["bases"] == pytest.approx(ref["bases"], rel=1e-6)
        assert got["lrs"] == pytest.approx(ref["lrs"][16:], rel=1e-6)  # per micro-batch, after the resume
        torch.testing.assert_close(got["params"], ref["params"], rtol=1e-5, atol=1e-6)
