"""Learning-rate-free optimizers under HDET (issue 15, item 4): refused with the reason where a spread or
a converge step would silently break them; averaging alone works."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import hdet
from hdet.engine import ReplicaEngine
from hdet.optimizers import lr_free_kind
from helpers import ScriptedReplicas

dadaptation = pytest.importorskip("dadaptation")
prodigyopt = pytest.importorskip("prodigyopt")
schedulefree = pytest.importorskip("schedulefree")

DISTANCE = [lambda ps: dadaptation.DAdaptAdam(ps, lr=1.0), lambda ps: dadaptation.DAdaptSGD(ps, lr=1.0),
            lambda ps: prodigyopt.Prodigy(ps, lr=1.0)]


def _sched(o, **kw):
    return hdet.HDETLR(o, None, total_steps=20, replicas=ScriptedReplicas(0, 4), model_sync_interval=5, **kw)


@pytest.mark.parametrize("make", DISTANCE)
def test_distance_estimators_are_refused_with_a_spread(make):
    m = nn.Linear(3, 1)
    o = make(m.parameters())
    assert lr_free_kind(o) == "distance"
    with pytest.raises(ValueError, match=r"own distance estimate d \(D-Adaptation/Prodigy\)"):
        _sched(o, ensemble_lr_spread_ratio=0.2)
    with pytest.raises(ValueError, match="ensemble_lr_spread_ratio=0 and no explored spread"):
        _sched(o, explore=[hdet.WeightDecay(o, alpha=0.5, kind="additive")])
    _sched(o)  # averaging only: allowed


def test_schedule_free_needs_its_state_averaged_and_no_spread():
    m = nn.Linear(3, 1)
    o = schedulefree.AdamWScheduleFree(m.parameters(), lr=1e-2)
    assert lr_free_kind(o) == "schedule-free"
    with pytest.raises(ValueError, match="Schedule-Free.*a spread breaks its x/y/z sequences"):
        _sched(o, ensemble_lr_spread_ratio=0.2, average_optimizer_state=True)
    with pytest.raises(ValueError, match="Expected average_optimizer_state=True"):
        _sched(o)
    _sched(o, average_optimizer_state=True)
    assert lr_free_kind(torch.optim.AdamW(m.parameters())) is None


def _engine(make_opt, share_gradients=True, steps=10, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    eng = ReplicaEngine(model, 2, make_opt,
                        lambda o, rep, m: hdet.HDETLR(o, None, total_steps=steps, model_sync_interval=5, replicas=rep,
                                                      model=m, **kw),
                        mode="loop", share_gradients=share_gradients)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(2, 16, 4, generator=g)
        eng.step((x, x[..., :1].cos()), lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), stacked=True)
    return eng


def test_distance_estimator_with_averaging_only_keeps_one_estimate():
    eng = _engine(lambda m: dadaptation.DAdaptAdam(m.parameters(), lr=1.0))
    d = [o.param_groups[0]["d"] for o in eng.optimizers]
    assert d[0] == d[1] and d[0] > 1e-6  # it adapted, and both replicas hold the same estimate


def test_schedule_free_local_mode_converge_keeps_y_and_z_consistent():
    """No gradient sharing: the replicas differ between syncs; the converge step at 10 averages y (the
    parameters) and z (the state) together, so the replicas are equal in both afterwards."""
    def make(m):
        o = schedulefree.AdamWScheduleFree(m.parameters(), lr=1e-2)
        o.train()
        return o

    eng = _engine(make, share_gradients=False, average_optimizer_state=True)
    for pa, pb in zip(eng.models[0].parameters(), eng.models[1].parameters()):
        assert torch.equal(pa, pb)
        assert torch.equal(eng.optimizers[0].state[pa]["z"], eng.optimizers[1].state[pb]["z"])


def test_the_cli_run_trains_with_each_peer(tmp_path):
    """`hdet train --optimizer ...` (what benchmarks/evidence.py --peers runs): each peer trains at alpha 0;
    Schedule-Free is evaluated at its average x and left in train mode; a spread over a peer is a one-line error."""
    from hdet.app.run import RunConfig, RunError, train

    tiny = dict(steps=20, T=10, alpha=0.0, replicas=2, width=16, layers=1, ctx=16, batch=4, progress=False,
                data_bytes=200_000, device="cpu", mode="loop")
    for opt, lr in (("dadapt-adam", 1.0), ("prodigy", 1.0), ("schedulefree-adamw", 3e-3)):
        s = train(RunConfig(**tiny, optimizer=opt, max_lr=lr, out=str(tmp_path / opt)))
        assert s["crashed"] is None and math.isfinite(s["final_val_loss"]), opt
    with pytest.raises(ValueError, match="own distance estimate d"):
        train(RunConfig(**{**tiny, "alpha": 0.2}, optimizer="prodigy", max_lr=1.0, out=str(tmp_path / "x")))
    with pytest.raises(RunError, match="Expected --optimizer in adamw, dadapt-adam"):
        train(RunConfig(**tiny, optimizer="sgd", out=str(tmp_path / "y")))
