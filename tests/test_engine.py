"""The one-process engine against real gloo processes: same model, data and seeds."""

import pytest
import torch

from dist_workers import engine_run, train
from helpers import check_ok, run_gloo

pytestmark = pytest.mark.distributed


def _train_kw(rank, world, kw):
    return train(rank, world, **kw)


# Tolerance: the engine sums the N gradients (and weights at a sync) in replica order; gloo's
# all-reduce may add them in another order, and float addition is not associative, so results can
# differ in the last bits (~1e-7 relative). SGD keeps such differences that small; Adam would not here
# (the bias of a Linear before BatchNorm has an exactly-zero true gradient, and Adam normalises its
# rounding noise into full-size steps). With 2 replicas
# a + b = b + a, so the runs agree bit for bit. Both sides use one intra-op thread: a different thread
# count changes the summation order inside matmuls, and Adam amplifies those last-bit differences.
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("auto", [False, True])
def test_engine_equals_gloo_processes(world, auto):
    kw = dict(steps=30, alpha=0.3, T=10, auto=auto, warm=10, opt="sgd")
    dist_res = check_ok(run_gloo(_train_kw, world, kw))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the gloo workers (tests/helpers.py)
    try:
        eng = engine_run(world, **kw)
    finally:
        torch.set_num_threads(threads)
    for r in range(world):
        for p_eng, p_dist in zip(eng["params"][r], dist_res[r]["params"]):
            if world == 2:
                assert torch.equal(p_eng, p_dist)
            else:
                torch.testing.assert_close(p_eng, p_dist, rtol=1e-5, atol=1e-6)
        for k, b in dist_res[r]["buffers"].items():
            torch.testing.assert_close(eng["buffers"][r][k], b, rtol=1e-5, atol=1e-6)
        assert [row[r] for row in eng["lrs"]] == pytest.approx(dist_res[r]["lrs"], rel=1e-6)


def test_engine_bad_input():
    from torch import nn

    import hdet
    from hdet.engine import ReplicaEngine

    def make_sched(o, rep, m):
        return hdet.OneCycleAutoLR(o, max_lr=0.1, total_steps=5, replicas=rep)

    with pytest.raises(ValueError, match="positive integer number of replicas, but got 0"):
        ReplicaEngine(nn.Linear(2, 1), 0, lambda p: torch.optim.SGD(p, lr=0.1), make_sched)
    with pytest.raises(ValueError, match="replicas=<the given view>"):
        ReplicaEngine(nn.Linear(2, 1), 2, lambda p: torch.optim.SGD(p, lr=0.1),
                      lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=0.1, total_steps=5))
    eng = ReplicaEngine(nn.Linear(2, 1), 2, lambda p: torch.optim.SGD(p, lr=0.1), make_sched)
    with pytest.raises(ValueError, match=r"one batch per replica \(2\), but got 3"):
        eng.step([None] * 3, lambda m, b: m(b).sum())
    # dropout: each replica draws its own mask
    drop = ReplicaEngine(nn.Sequential(nn.Linear(4, 64), nn.Dropout(0.5)), 2, lambda p: torch.optim.SGD(p, lr=0.0),
                         make_sched)
    outs = []
    drop.step([torch.ones(1, 4)] * 2, lambda m, b: outs.append(m(b)) or outs[-1].sum())
    assert not torch.equal(outs[0], outs[1])
