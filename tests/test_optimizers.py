"""Learning-rate-free optimizers under HDET (issue 15, item 4): distance estimators (D-Adaptation, Prodigy)
take the multiplier on their step and keep one estimate; Schedule-Free is refused with the reason where a
spread or a converge step would silently break it; averaging alone works."""

from __future__ import annotations

import dataclasses
import json
import math
import warnings

import pytest
import torch
from torch import nn

import hdet
from hdet.engine import ReplicaEngine
from hdet.optimizers import lr_free_kind
from hdet.step_scale import StepScale
from helpers import ScriptedReplicas, roundtrip

dadaptation = pytest.importorskip("dadaptation")
prodigyopt = pytest.importorskip("prodigyopt")
schedulefree = pytest.importorskip("schedulefree")

DISTANCE = [lambda ps: dadaptation.DAdaptAdam(ps, lr=1.0), lambda ps: dadaptation.DAdaptLion(ps, lr=1.0),
            lambda ps: prodigyopt.Prodigy(ps, lr=1.0)]


def _sched(o, **kw):
    return hdet.HDETLR(o, None, total_steps=20, replicas=ScriptedReplicas(0, 4), model_sync_interval=5, **kw)


@pytest.mark.parametrize("make", DISTANCE)
def test_distance_estimators_take_the_multiplier_on_the_step(make):
    """Under a spread, a distance estimator's LR is the base on every replica (so its estimate d is one for the
    ensemble) and replica r's multiplier scales the update it makes."""
    m = nn.Linear(3, 1)
    o = make(m.parameters())
    assert lr_free_kind(o) == "distance"
    scheds = [hdet.HDETLR(make(nn.Linear(3, 1).parameters()), None, total_steps=20,
                          replicas=ScriptedReplicas(r, 4), model_sync_interval=5, ensemble_lr_spread_ratio=0.2)
              for r in range(4)]
    assert [s.optimizer.param_groups[0]["lr"] for s in scheds] == [1.0] * 4  # the base, not 1.0 * rho_r
    assert sorted(s.ensemble.step_scale.multipliers[0] for s in scheds) == pytest.approx(
        hdet.linear_multipliers(4, 0.2))
    _sched(o, explore=[hdet.WeightDecay(o, alpha=0.5, kind="additive")])  # other spreads: allowed too


def test_the_step_scale_is_exactly_a_multiplier_on_the_update():
    """theta <- theta + m (step(theta) - theta): for SGD that is exactly lr * m; a multiplier of 1 copies nothing."""

    torch.manual_seed(0)
    a, b = nn.Linear(4, 2), nn.Linear(4, 2)
    b.load_state_dict(a.state_dict())
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1 * 1.7)
    scale = StepScale(oa)
    scale.multipliers = [1.7]
    x = torch.randn(8, 4)
    for model, opt in ((a, oa), (b, ob)):
        model(x).square().mean().backward()
        opt.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7)
    scale.multipliers = [1.0]
    oa.step()
    assert scale._stepped is None  # nothing saved for a step at multiplier 1
    scale.remove()


@pytest.mark.parametrize("kind", ["dadapt", "prodigy"])
def test_a_spread_over_a_distance_estimator_keeps_one_estimate_and_trains(kind):
    """The engine (shared gradients) at alpha 0.2: d is the same on every replica after every step
    (D-Adaptation's state reads only the shared gradients and the base LR; Prodigy's numerator, which also
    reads each replica's distance from its start, is averaged at every step). The ensemble trains like the
    optimizer alone (the multiplier on the LR had run the d's apart: 29x at alpha 0.2, divergence at 0.5).
    (This toy runs D-Adaptation at its edge of stability, where alpha 0.5's highest replicas blow up within
    a window: late loss 0.62 against 0.33 at alpha 0, with d equal.)"""
    def make(m):
        if kind == "dadapt":
            return dadaptation.DAdaptAdam(m.parameters(), lr=1.0, decouple=True, weight_decay=0.01)
        return prodigyopt.Prodigy(m.parameters(), lr=1.0, decouple=True, weight_decay=0.01)

    def run(alpha, steps=150, T=25):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4))
        eng = ReplicaEngine(model, 4, make, lambda o, rep, m: hdet.HDETLR(
            o, torch.optim.lr_scheduler.OneCycleLR(o, 1.0, total_steps=steps), total_steps=steps,
            model_sync_interval=T, replicas=rep, model=m, ensemble_lr_spread_ratio=alpha), mode="loop")
        g = torch.Generator().manual_seed(0)
        W = torch.randn(10, 4, generator=g)
        d_equal, losses = [], []
        for t in range(1, steps + 1):
            x = torch.randn(4, 32, 10, generator=g)
            y = (x @ W).argmax(-1)
            losses.append(eng.step((x, y), lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]),
                                   stacked=True).mean().item())
            d = [o.param_groups[0]["d"] for o in eng.optimizers]
            d_equal.append(all(v == d[0] for v in d))
        return d_equal, losses, eng.optimizers[0].param_groups[0]["d"]

    d_equal, losses, d = run(0.2)
    assert all(d_equal) and len(d_equal) == 150
    _, losses0, d0 = run(0.0)
    assert all(math.isfinite(x) for x in losses)
    late, late0 = sum(losses[-25:]) / 25, sum(losses0[-25:]) / 25
    assert late < 0.5 * losses[0] and late < 1.5 * late0  # it trained, about as well as at alpha 0
    assert 0.5 < d / d0 < 2  # and its estimate stayed the optimizer's own


def _prodigy_toy(alpha, steps=200, T=50, N=8):
    """A spread over Prodigy in the engine on a toy classification; per step: the replicas' d, the mean loss."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 4))
    eng = ReplicaEngine(model, N, lambda m: prodigyopt.Prodigy(m.parameters(), lr=1.0, decouple=True, weight_decay=0.01),
                        lambda o, rep, m: hdet.HDETLR(o, torch.optim.lr_scheduler.OneCycleLR(o, 1.0, total_steps=steps),
                                                      total_steps=steps, model_sync_interval=T, replicas=rep, model=m,
                                                      ensemble_lr_spread_ratio=alpha), mode="loop")
    g = torch.Generator().manual_seed(0)
    W = torch.randn(10, 4, generator=g)
    ds, losses = [], []
    for _ in range(steps):
        x = torch.randn(N, 32, 10, generator=g)
        loss = eng.step((x, (x @ W).argmax(-1)), lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]), stacked=True)
        ds.append([o.param_groups[0]["d"] for o in eng.optimizers])
        losses.append(loss.mean().item())
    return ds, losses


def test_prodigy_under_a_wide_spread_keeps_one_estimate_every_step():
    """Prodigy at alpha 0.5, T 50: its estimate reads each replica's distance from its start, which grows with
    the replica's multiplier; averaged only at converge steps the eight d's fanned out 750x within 30 steps and
    the highest replicas blew up (mean loss 33 at step 50, 0.16 at the end against 0.045 at alpha 0). Shared
    at every step, d is one for the ensemble, ends within 10% of alpha 0's and the ensemble trains as well."""
    ds, losses = _prodigy_toy(0.5)
    ds0, losses0 = _prodigy_toy(0.0)
    assert all(len(set(d)) == 1 for d in ds)
    assert 0.9 < ds[-1][0] / ds0[-1][0] < 1.1
    assert max(losses) < 2 * losses[0]  # no blow-up on the way
    assert sum(losses[-20:]) / 20 < 1.5 * sum(losses0[-20:]) / 20


def test_a_refused_construction_leaves_no_hooks_on_the_optimizer():
    """A scheduler that refuses its optimizer (or fails later in its construction) leaves the optimizer as it was: the
    step-scale hooks that HDET puts on D-Adaptation and Prodigy used to stay on it after a refusal (a later scheduler
    or a plain run of the same optimizer then stepped through a dead ensemble's hooks)."""
    def hooks(o):
        return (len(o._optimizer_step_pre_hooks), len(o._optimizer_step_post_hooks),
                len(o._optimizer_load_state_dict_post_hooks), hasattr(o, "_hdet_step_scale"))

    m = nn.Linear(3, 1)
    o = dadaptation.DAdaptSGD(m.parameters(), lr=1.0)  # refused under an LR spread (dual averaging)
    with pytest.raises(ValueError, match="dual averaging"):
        _sched(o, ensemble_lr_spread_ratio=0.2)
    assert hooks(o) == (0, 0, 0, False)
    o = dadaptation.DAdaptAdam(m.parameters(), lr=1.0)  # accepted, but a later argument fails (the gradient guard's)
    with pytest.raises(ValueError, match="guard_gradients"):
        _sched(o, guard_gradients="sometimes")
    assert hooks(o) == (0, 0, 0, False)
    s = _sched(o)  # and the next construction installs its own, once
    assert hooks(o)[3] and o._hdet_step_scale is s._hdet.step_scale
    assert hooks(o)[:3] == (1, 2, 2)  # StepScale's pre, post and load hooks, the scheduler's step counter and its
    # load hook (an LR tensor a load shares again: own_lr_tensors)


@pytest.mark.parametrize("name", ["DAdaptSGD", "DAdaptAdaGrad"])
def test_dual_averaging_d_adaptation_is_refused_under_an_lr_spread(name):
    """DAdaptSGD and DAdaptAdaGrad set the weights from their start point and a running sum: the multiplier on the
    step only moved a replica along the shared trajectory (measured at alpha 0.2: 0.95x / 1.03x the displacement
    instead of 0.8x / 1.2x) while the telemetry reported the spread. Refused under an LR spread, before and after
    their first step and from a checkpoint; averaging alone is allowed. Under another explored spread, or in local
    mode, the replicas' running sums differ and the next step rebuilt the weights from them, undoing the converge
    step's average (2e-12 from a never-averaged run, an audit): refused there unless their state is averaged too."""
    cls = getattr(dadaptation, name)
    m = nn.Linear(3, 1)
    o = cls(m.parameters(), lr=1.0)
    with pytest.raises(ValueError, match=rf"adds its update.*got {name} \(dual averaging.*ensemble_lr_spread_ratio=0"):
        _sched(o, ensemble_lr_spread_ratio=0.2)
    plain = _sched(o)  # alpha 0: averaging only
    o2 = cls(m.parameters(), lr=1.0)
    with pytest.raises(ValueError, match=rf"average_optimizer_state=True with {name} under an explored "
                                         r"hyperparameter's spread.*does not last"):
        _sched(o2, explore=[hdet.WeightDecay(o2, alpha=0.5, kind="additive")])
    _sched(o2, explore=[hdet.WeightDecay(o2, alpha=0.5, kind="additive")], average_optimizer_state=True)

    def engine(**kw):
        return ReplicaEngine(nn.Linear(3, 1), 2, lambda mod: cls(mod.parameters(), lr=1.0),
                             lambda opt, rep, mod: hdet.HDETLR(opt, None, 10, model=mod, replicas=rep, **kw),
                             mode="loop", share_gradients=False)
    with pytest.raises(ValueError, match=rf"average_optimizer_state=True with {name} under local mode"):
        engine()
    engine(average_optimizer_state=True)
    m(torch.randn(4, 3)).pow(2).mean().backward()
    o.step()
    assert any("x0" in st for st in o.state.values())
    o.param_groups[0].pop("momentum")  # recognised by its state too
    with pytest.raises(ValueError, match="dual averaging"):
        _sched(o, ensemble_lr_spread_ratio=0.2)
    state = plain.state_dict()
    state["hdet"]["config"]["ensemble_lr_spread_ratio"] = 0.2
    with pytest.raises(ValueError, match="dual averaging"):
        _sched(o).load_state_dict(state)


@pytest.mark.parametrize("name", ["DAdaptAdam", "DAdaptLion", "DAdaptAdan", "Prodigy"])
def test_every_distance_estimator_keeps_one_estimate_under_a_spread(name):
    """Each of D-Adaptation's optimizers and Prodigy, at alpha 0.5 in the engine (loop mode, T 50): d equal on
    every replica after every step, and every loss finite (whether it trains as well as alone: the Prodigy and
    D-Adaptation Adam tests above; this short toy is at DAdaptAdam's own edge of stability, alone as well)."""
    cls = getattr(prodigyopt if name == "Prodigy" else dadaptation, name)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 4))
    steps = 60
    eng = ReplicaEngine(model, 4, lambda m: cls(m.parameters(), lr=1.0),
                        lambda o, rep, m: hdet.HDETLR(o, torch.optim.lr_scheduler.OneCycleLR(o, 1.0, total_steps=steps),
                                                      total_steps=steps, model_sync_interval=50, replicas=rep, model=m,
                                                      ensemble_lr_spread_ratio=0.5), mode="loop")
    g = torch.Generator().manual_seed(0)
    W = torch.randn(10, 4, generator=g)
    losses = []
    for t in range(steps):
        x = torch.randn(4, 32, 10, generator=g)
        loss = eng.step((x, (x @ W).argmax(-1)), lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]), stacked=True)
        d = [o.param_groups[0]["d"] for o in eng.optimizers]
        assert len(set(d)) == 1, (t, d)
        losses.append(loss.mean().item())
    assert all(math.isfinite(x) for x in losses)


def test_the_shared_prodigy_estimate_is_prodigys_own_rule():
    """One replica's own numerator and denominator through :meth:`StepScale.set_shared` give back exactly the
    d, d_max and d_hat that Prodigy computed itself (the rule replicated; catches a prodigyopt that changed it)."""
    torch.manual_seed(0)
    m = nn.Linear(6, 3)
    o = prodigyopt.Prodigy(m.parameters(), lr=1.0)
    scale = StepScale.install(o)
    assert scale.every_step and not StepScale(torch.optim.AdamW(m.parameters())).every_step
    for t in range(12):
        m(torch.randn(8, 6)).pow(2).mean().backward()
        o.step()
        o.zero_grad()
        before = {k: o.param_groups[0][k] for k in ("d", "d_max", "d_hat", "d_numerator", "d_denom")}
        scale.set_shared(list(scale.contribution))
        assert {k: o.param_groups[0][k] for k in before} == before, t
    assert o.param_groups[0]["d"] > 1e-5  # it grew from d0 = 1e-6
    scale.remove()


def test_prodigy_estimates_are_averaged_by_the_converge_step():
    """The converge step writes the ensemble's mean of each scalar estimate into every replica's param group."""
    eng = _engine(lambda m: prodigyopt.Prodigy(m.parameters(), lr=1.0), steps=10, ensemble_lr_spread_ratio=0.5)
    g0, g1 = (o.param_groups[0] for o in eng.optimizers)
    for key in ("d", "d_max", "d_numerator"):
        assert g0[key] == g1[key], key
    assert g0["d"] > 1e-6


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
    # going back to a best sync would leave its k, weight_sum and lr_max at the later step (an audit: 1.6x long steps)
    for recovering in ({"on_runaway": "recover"}, {"lr_range_test": True, "auto_lr_warmup_steps": 10}):
        with pytest.raises(ValueError, match="Expected on_runaway='ignore' and no lr_range_test with AdamWScheduleFree"):
            _sched(o, average_optimizer_state=True, **recovering)


def test_mechanic_is_refused_under_a_spread_and_keeps_one_scale_with_averaging_alone():
    """Mechanic learns its scale s from each replica's own displacement: under a spread the replicas' s drift
    apart (2.5-6x at alpha 0.5 on a toy), so any spread is refused with the reason; averaging alone keeps one s."""
    mechanic_pytorch = pytest.importorskip("mechanic_pytorch")

    def make(m):
        return mechanic_pytorch.mechanize(torch.optim.AdamW)(m.parameters(), lr=1.0)

    o = make(nn.Linear(3, 1))
    assert lr_free_kind(o) == "mechanic"
    with pytest.raises(ValueError, match="Mechanic.*scales drift apart"):
        _sched(o, ensemble_lr_spread_ratio=0.2)
    with pytest.raises(ValueError, match="Mechanic"):
        _sched(o, explore=[hdet.WeightDecay(o, alpha=0.5, kind="additive")])
    _sched(o)  # averaging only
    eng = _engine(make)
    s = [float(o.state["_mechanic"]["s"].sum()) for o in eng.optimizers]
    assert s[0] == s[1] and s[0] > 1e-6  # it grew from s_init = 1e-8, one scale on both replicas
    assert eng.optimizer_path.startswith("per-replica")  # a subclass of AdamW, not stepped as AdamW


def test_mechanic_needs_shared_gradients_and_is_never_skipped_by_the_fused_guard():
    """Local mode: each replica's Mechanic scale would learn from its own gradients (8.9x apart after 300 steps on a
    toy) and its weights are rebuilt from that scale, so the engine refuses it. A fused Mechanic AdamW is not
    "skippable": its tuner reads the NaN gradient itself after the fused step skipped, so the guard is the hook."""
    mechanic_pytorch = pytest.importorskip("mechanic_pytorch")
    from hdet.guard import _fused

    def make(m, **kw):
        return mechanic_pytorch.mechanize(torch.optim.AdamW)(m.parameters(), lr=1.0, **kw)

    with pytest.raises(ValueError, match="Expected shared gradients .*Mechanic.*local mode"):
        _engine(make, share_gradients=False)
    assert not _fused(make(nn.Linear(3, 1), fused=True))
    assert _fused(torch.optim.AdamW(nn.Linear(3, 1).parameters(), fused=True))


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


def test_prodigy_in_local_mode_keeps_one_estimate_every_step():
    """No gradient sharing (local mode) and a spread: each replica's Prodigy reads its own gradients, and its
    numerator and denominator are still averaged at every step, so d is one for the ensemble throughout (the
    engine steps each replica: its stacked step needs shared gradients)."""
    eng = _dadapt_engine(True, steps=30, share_gradients=False, kind="prodigy", train=False)
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        x = torch.randn(4, 32, 10, generator=g)
        eng.step((x, x[..., :4].argmax(-1)), lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]), stacked=True)
        d = {o.param_groups[0]["d"] for o in eng.optimizers}
        assert len(d) == 1, d
    assert eng.optimizer_path.startswith("per-replica: Prodigy without shared gradients")
    assert d.pop() > 1e-5  # it grew from d0 = 1e-6
    assert len({o.param_groups[0]["d_denom"] for o in eng.optimizers}) == 1


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


@pytest.mark.parametrize("inside", ["eval", "none"])
def test_schedule_free_evaluated_inside_averaged_trains_on_as_without_it(inside):
    """The Hugging Face Trainer's order: ``with averaged(): optimizer.eval(); evaluate`` then ``optimizer.train()``.
    The replicas' own weights (y, train mode) went back while the optimizer was in eval mode, and its train() then
    moved them as if they were x: 1.3e-3 off after 15 steps (4.7e-3 under HDETTrainer; an audit). The mode is now put
    back first; training goes on exactly as without the evaluation."""
    def run(evaluate):
        torch.manual_seed(0)
        eng = ReplicaEngine(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1)), 2,
                            lambda m: schedulefree.AdamWScheduleFree(m.parameters(), lr=0.01, warmup_steps=2),
                            lambda o, rep, m: hdet.HDETLR(o, None, total_steps=20, ensemble_lr_spread_ratio=0.0,
                                                          average_optimizer_state=True, model_sync_interval=10,
                                                          replicas=rep, model=m),
                            mode="loop")
        for o in eng.optimizers:
            o.train()
        for t in range(1, 16):
            if t == 6 and evaluate:
                with eng.averaged() as changed:
                    assert changed
                    for o in eng.optimizers:
                        if inside == "eval":
                            o.eval()
                    assert all(o.param_groups[0]["train_mode"] is (inside != "eval") for o in eng.optimizers)
                assert all(o.param_groups[0]["train_mode"] for o in eng.optimizers)  # as at the swap-in
                for o in eng.optimizers:
                    o.train()
            batches = []
            for r in range(2):
                x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1000 * t + r))
                batches.append((x, x[:, :1] * 2 - x[:, 1:2]))
            eng.step(batches, lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]))
        return [p.detach().clone() for m in eng.models for p in m.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain, evaluated = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, evaluated))


def test_the_cli_run_trains_with_each_peer(tmp_path):
    """`hdet train --optimizer ...` (what benchmarks/evidence.py --peers runs): each peer trains at alpha 0;
    Schedule-Free is evaluated at its average x and left in train mode; a spread over a peer is a one-line error."""
    from hdet.app.run import RunConfig, RunError, train

    tiny = dict(steps=20, T=10, alpha=0.0, replicas=2, width=16, layers=1, ctx=16, batch=4, progress=False,
                data_bytes=200_000, device="cpu", mode="loop")
    pytest.importorskip("mechanic_pytorch")
    for opt, lr in (("dadapt-adam", 1.0), ("prodigy", 1.0), ("schedulefree-adamw", 3e-3), ("mechanic-adamw", 1.0)):
        s = train(RunConfig(**tiny, optimizer=opt, max_lr=lr, out=str(tmp_path / opt)))
        assert s["crashed"] is None and math.isfinite(s["final_val_loss"]), opt
        # (Mechanic's state does not reload: its runs write no checkpoint; the others' do)
        assert (tmp_path / opt / "checkpoint.pt").is_file() is (opt != "mechanic-adamw"), opt
    for opt in ("dadapt-adam", "prodigy"):  # a spread over a distance estimator: the multiplier on its step
        s = train(RunConfig(**{**tiny, "alpha": 0.2}, optimizer=opt, out=str(tmp_path / f"{opt}-a")))
        assert s["crashed"] is None and math.isfinite(s["final_val_loss"]), opt
        assert s["config"]["max_lr"] == 1.0  # their documented lr, when --max-lr is not given
        recs = [json.loads(x) for x in (tmp_path / f"{opt}-a" / "metrics.jsonl").read_text().splitlines()]
        assert all(r["d"] > 0 for r in recs) and recs[-1]["d"] > recs[0]["d"]  # their estimate, as it grew
    assert train(RunConfig(**{**tiny, "steps": 2}, out=str(tmp_path / "adamw")))["config"]["max_lr"] == 3e-3
    with pytest.raises(ValueError, match="Schedule-Free.*a spread breaks"):
        train(RunConfig(**{**tiny, "alpha": 0.2}, optimizer="schedulefree-adamw", max_lr=3e-3,
                        out=str(tmp_path / "x")))
    with pytest.raises(RunError, match="Expected --optimizer in adamw, dadapt-adam"):
        train(RunConfig(**tiny, optimizer="sgd", out=str(tmp_path / "y")))


def test_d_adaptation_and_prodigy_decouple_counts_as_decoupled_weight_decay():
    """Their groups spell it ``decouple``: decouple=True counted as coupled, and a resume at a converge step warned
    that a coupled weight decay made it inexact (an audit)."""
    import prodigyopt

    from hdet.optimizers import coupled_weight_decay

    p = [nn.Parameter(torch.zeros(2))]
    for make in (lambda d: dadaptation.DAdaptAdam(p, lr=1.0, weight_decay=0.1, decouple=d),
                 lambda d: prodigyopt.Prodigy(p, lr=1.0, weight_decay=0.1, decouple=d)):
        assert not coupled_weight_decay(make(True)) and coupled_weight_decay(make(False))
    assert coupled_weight_decay(torch.optim.Adam(p, weight_decay=0.1))
    assert not coupled_weight_decay(torch.optim.AdamW(p, weight_decay=0.1))
    assert not coupled_weight_decay(torch.optim.Adam(p, weight_decay=0.1, decoupled_weight_decay=True))
    # torch's Muon and Adafactor multiply the weights by (1 - lr * wd): an exact resume was said not to be (an audit)
    m = [nn.Parameter(torch.zeros(2, 2))]
    if hasattr(torch.optim, "Muon"):
        assert not coupled_weight_decay(torch.optim.Muon(m, weight_decay=0.1))
    if hasattr(torch.optim, "Adafactor"):
        assert not coupled_weight_decay(torch.optim.Adafactor(m, weight_decay=0.1))


def test_prodigy_safeguard_is_a_flag_and_off_by_default():
    """`--prodigy-safeguard` builds Prodigy with safeguard_warmup (its advice under a warm-up; it estimated a
    smaller step on both evidence tasks); without the flag, prodigyopt's default (off)."""
    from hdet.app.cli import _config, build_parser
    from hdet.app.runs import make_optimizer
    from hdet.app.tasks import make_task

    task = make_task("bytes", ctx=16, width=16, layers=1, data_bytes=200_000)
    for extra, want in (([], False), (["--prodigy-safeguard"], True), (["--no-prodigy-safeguard"], False)):
        cfg = _config(build_parser().parse_args(["train", "--optimizer", "prodigy", *extra]))
        assert cfg.prodigy_safeguard is want
        opt = make_optimizer(task, dataclasses.replace(cfg, max_lr=1.0))(task.make_model())
        assert type(opt).__name__ == "Prodigy" and all(g["safeguard_warmup"] is want for g in opt.param_groups)


def _prodigy_engine(steps=20, stop=None, state=None):
    def make_sched(o, rep, m):
        return hdet.OneCycleAutoLR(o, max_lr=1.0, total_steps=steps, model_sync_interval=5, replicas=rep, model=m,
                                   ensemble_lr_spread_ratio=0.5, on_runaway="recover")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    eng = ReplicaEngine(model, 3, lambda m: prodigyopt.Prodigy(m.parameters(), lr=1.0), make_sched, mode="loop")
    start = 0
    if state is not None:
        eng.load_state_dict(state)
        start = eng.steps_taken
    for t in range(start + 1, steps + 1):
        g = torch.Generator().manual_seed(t)
        x = torch.randn(3, 16, 4, generator=g)
        eng.step((x, x[..., :1].cos()), lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), stacked=True)
        if t == stop:
            return roundtrip(eng.state_dict())
    return eng


@pytest.mark.parametrize("stop", [7, 10])
def test_a_resumed_spread_over_prodigy_trains_bit_for_bit(stop):
    """Mid-window and right after a converge step: the multipliers on the step and the averaged estimates
    come back with the state."""
    full = _prodigy_engine()
    resumed = _prodigy_engine(state=_prodigy_engine(stop=stop))
    for a, b in zip(full.models, resumed.models):
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert torch.equal(pa, pb)
    for a, b in zip(full.optimizers, resumed.optimizers):
        assert a.param_groups[0]["d"] == b.param_groups[0]["d"]
    assert len({s.ensemble.step_scale.multipliers[0] for s in full.schedulers}) == 3


def test_the_step_scale_with_a_closure_and_with_a_second_scheduler():
    """step(closure): the gradients do not exist when the step starts, the update is scaled all the same.
    A second scheduler over the same optimizer replaces the first one's hooks (rho, not rho squared)."""

    p = nn.Parameter(torch.tensor([1.0]))
    o = torch.optim.SGD([p], lr=0.1)
    StepScale.install(o).multipliers = [2.0]

    def closure():
        o.zero_grad(set_to_none=True)
        loss = (2 * p).sum()  # gradient 2
        loss.backward()
        return loss

    o.step(closure)
    assert p.item() == pytest.approx(1.0 - 2.0 * 0.1 * 2)
    StepScale.install(o).multipliers = [1.5]
    o.step(closure)
    assert p.item() == pytest.approx(0.6 - 1.5 * 0.1 * 2)


def test_estimates_averaged_by_any_transport_and_a_loaded_optimizer_wins():
    """What the converge step writes into the estimates (even a write that bumps no version counter, as an
    in-place all_reduce) reaches the param groups at the end of the sync; a loaded optimizer state is not
    overwritten by estimates gathered before it."""

    o = prodigyopt.Prodigy(nn.Linear(2, 1).parameters(), lr=1.0)
    scale = StepScale.install(o)
    (t,) = scale.estimates(torch.zeros(1))
    assert scale.estimates(torch.zeros(1))[0] is t  # filled once a sync
    t.data.fill_(0.25)  # .data: no version bump
    scale.take_estimates()
    assert o.param_groups[0]["d"] == 0.25 and o.param_groups[0]["d_numerator"] == 0.25
    saved = o.state_dict()
    scale.estimates(torch.zeros(1))[0].data.fill_(0.5)
    o.load_state_dict(saved)
    scale.take_estimates()
    assert o.param_groups[0]["d"] == 0.25


def test_a_checkpoint_from_before_the_estimates_were_averaged_loads_with_a_warning():
    """A best-sync state saved without the estimates tensor (hdet before it averaged D-Adaptation's estimates)
    does not fit: it is dropped with a warning that says so, and training goes on."""
    def build():
        torch.manual_seed(0)
        m = nn.Linear(3, 1)
        o = dadaptation.DAdaptAdam(m.parameters(), lr=1.0)
        return m, o, hdet.HDETLR(o, None, total_steps=20, model_sync_interval=5, on_runaway="recover", model=m,
                                 judge_steps=1)

    m, o, s = build()
    for _ in range(10):
        m(torch.randn(4, 3)).pow(2).mean().backward()
        o.step()
        o.zero_grad()
        s.step(1.0)
    state = s.state_dict()
    snap = state["hdet"]["stability"]["snapshot"]  # weight, bias, the estimates, 6 moments, k at the best sync (5)
    assert len(snap) == 10 and snap[2].dtype == torch.float64 and snap[-1].tolist() == [5.0]
    state["hdet"]["stability"]["snapshot"] = snap[:2] + snap[3:-1]  # the old layout: no estimates, no k
    m2, o2, s2 = build()
    o2.load_state_dict(o.state_dict())
    with pytest.warns(UserWarning, match="from before hdet averaged D-Adaptation's/Prodigy's estimates"):
        s2.load_state_dict(state)
    for _ in range(10):
        m2(torch.randn(4, 3)).pow(2).mean().backward()
        o2.step()
        o2.zero_grad()
        s2.step(1.0)
    assert s2.last_sync.step == 20


def _dadapt_engine(stacked, alpha=0.5, steps=60, wd=0.01, decouple=True, share_gradients=True, state=None, stop=None,
                   explore_wd=False, train=True, kind="dadapt", dtype=torch.float32, poison=None, hdet_kw=None,
                   **opt_kw):
    """D-Adaptation Adam or Prodigy (two param groups: with and without weight decay) on 4 replicas in vmap mode.
    ``poison``: (step, replica): that replica's first weight is NaN from that step on (until a sync resets it)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4)).to(dtype)

    def make(m):
        cls = dadaptation.DAdaptAdam if kind == "dadapt" else prodigyopt.Prodigy
        return cls([{"params": [m[0].weight, m[2].weight], "weight_decay": wd},
                    {"params": [m[0].bias, m[2].bias], "weight_decay": 0.0}], lr=0.3, decouple=decouple, **opt_kw)

    eng = ReplicaEngine(model, 4, make, lambda o, rep, m: hdet.HDETLR(
        o, torch.optim.lr_scheduler.OneCycleLR(o, 0.3, total_steps=steps), total_steps=steps, model_sync_interval=10,
        replicas=rep, model=m, ensemble_lr_spread_ratio=alpha,
        explore=[hdet.WeightDecay(o, alpha=0.5)] if explore_wd else (), **(hdet_kw or {})), mode="vmap",
        stacked_optimizer=stacked,
        share_gradients=share_gradients)
    if state is not None:
        eng.load_state_dict(state)
    g = torch.Generator().manual_seed(0)
    W = torch.randn(10, 4, generator=g).to(dtype)
    for t in range(1, steps + 1):
        if not train:  # built, no step taken
            return eng
        x = torch.randn(4, 32, 10, generator=g).to(dtype)
        if t <= eng.steps_taken:
            continue
        if poison is not None and t == poison[0]:
            with torch.no_grad():
                eng.models[poison[1]][0].weight[0, 0] = float("nan")
        eng.step((x, (x @ W).argmax(-1)), lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]), stacked=True)
        if t == steps - 1:  # (the replicas' own values, which close() after the last step sets to the base)
            eng.wd_before_end = [o.param_groups[0]["weight_decay"] for o in eng.optimizers]
        if t == stop:
            return roundtrip(eng.state_dict())
    return eng


def _close_models(a, b, **tol):
    """Every replica's parameters of engines ``a`` and ``b`` close (``torch.testing.assert_close`` tolerances)."""
    for ma, mb in zip(a.models, b.models):
        for pa, pb in zip(ma.parameters(), mb.parameters()):
            torch.testing.assert_close(pa, pb, **tol)


@pytest.mark.parametrize("alpha, explore_wd", [(0.0, False), (0.5, False), (0.5, True)])
def test_the_stacked_d_adaptation_step_is_its_per_replica_step(alpha, explore_wd):
    """The engine steps every replica's DAdaptAdam at once (one copy of its state, one host read a step) and
    ends where each replica's own optimizer.step() does, d and all (60 steps, converge steps every 10); an
    explored weight decay (decoupled: each replica's own) too."""
    fast, slow = _dadapt_engine(True, alpha, explore_wd=explore_wd), _dadapt_engine(False, alpha, explore_wd=explore_wd)
    if explore_wd:
        assert len(set(fast.wd_before_end)) > 1
    assert fast.optimizer_path == "stacked" and slow.optimizer_path.startswith("per-replica")
    _close_models(fast, slow, rtol=1e-4, atol=2e-5)
    for of, os_ in zip(fast.optimizers, slow.optimizers):
        for gf, gs in zip(of.param_groups, os_.param_groups):
            assert gf["d"] == pytest.approx(gs["d"], rel=1e-5) and gf["k"] == gs["k"] == 60
            assert gf["numerator_weighted"] == pytest.approx(gs["numerator_weighted"], rel=1e-4)
        pf, ps = next(iter(of.state)), next(iter(os_.state))
        torch.testing.assert_close(of.state[pf]["s"], os_.state[ps]["s"], rtol=1e-4, atol=1e-9)
        assert int(of.state[pf]["step"]) == int(os_.state[ps]["step"]) == 60
    assert fast.optimizers[0].param_groups[0]["d"] > 1e-3  # it adapted


def test_the_stacked_d_adaptation_step_resumes_bit_for_bit():
    full = _dadapt_engine(True, steps=30)
    resumed = _dadapt_engine(True, steps=30, state=_dadapt_engine(True, steps=30, stop=13))
    assert resumed.optimizer_path == "stacked"
    for a, b in zip(full.models, resumed.models):
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert full.optimizers[0].param_groups[0]["d"] == resumed.optimizers[0].param_groups[0]["d"]


def test_d_adaptation_replicas_whose_estimates_differ_step_per_replica():
    """A d that differs between replicas (set by hand here; a state loaded so) is not silently replaced by
    replica 0's: the engine steps each replica's own optimizer from then on, and says why."""
    eng = _dadapt_engine(True, steps=20, train=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 32, 10, generator=g)
    step = lambda: eng.step((x, x[..., :4].argmax(-1)), lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]),
                            stacked=True)
    step()
    assert eng.optimizer_path == "stacked"
    eng.optimizers[1].param_groups[0]["d"] = 1e-3
    step()
    assert eng.optimizer_path == "per-replica: the replicas' D-Adaptation optimizers differ in 'd'"
    assert eng.optimizers[1].param_groups[0]["d"] != eng.optimizers[0].param_groups[0]["d"]
    for o in eng.optimizers:  # its step count an int, as DAdaptAdam keeps it (a float tensor after the give-way and in
        # the stacked engine's state_dict: an audit)
        assert all(type(st["step"]) is int and st["step"] == 2 for st in o.state.values())
        assert all(type(st["step"]) is int for st in o.state_dict()["state"].values())


def test_the_stacked_d_adaptation_state_dict_keeps_an_int_step():
    eng = _dadapt_engine(True, steps=3)
    assert eng.optimizer_path == "stacked"
    assert all(type(st["step"]) is int and st["step"] == 3 for st in eng.optimizers[0].state_dict()["state"].values())


def test_d_adaptation_steps_per_replica_where_its_state_is_not_shared():
    coupled = _dadapt_engine(True, steps=2, decouple=False)
    assert coupled.optimizer_path == "per-replica: D-Adaptation's coupled weight decay (each replica's own weights " \
                                     "in its gradient)"
    local = _dadapt_engine(True, steps=2, share_gradients=False)
    assert local.optimizer_path.startswith("per-replica: D-Adaptation without shared gradients")


@pytest.mark.parametrize("alpha, explore_wd, betas, extra", [
    (0.0, False, (0.9, 0.999), {}), (0.5, False, (0.9, 0.999), {}), (0.5, True, (0.9, 0.999), {}),
    (0.5, False, (0.0, 0.999), {}),
    (0.5, False, (0.9, 0.99), dict(use_bias_correction=True, growth_rate=1.05, beta3=0.95)),
    (0.5, False, (0.9, 0.99), dict(safeguard_warmup=True))])
def test_the_stacked_prodigy_step_is_its_per_replica_step(alpha, explore_wd, betas, extra):
    """The engine steps every replica's Prodigy at once (one copy of its state, p0 included; one host read a step)
    and ends where each replica's own optimizer.step() with the estimate shared at every step does (60 steps,
    converge steps every 10; an explored weight decay; no first moment; Prodigy's other options). In float64 and
    with a negligible eps:
    each replica's own step puts its own new d (before the sharing) in its ``d * eps`` term, the stacked step
    the shared one, and Prodigy's early d grows exponentially from whatever differs (with eps 1e-8 the runs
    part by 1e-5 relative at step 60; in float32, by Prodigy's float32 dot products, 1e-3)."""
    kw = dict(kind="prodigy", explore_wd=explore_wd, betas=betas, dtype=torch.float64, eps=1e-300, **extra)
    fast, slow = _dadapt_engine(True, alpha, **kw), _dadapt_engine(False, alpha, **kw)
    assert fast.optimizer_path == "stacked" and slow.optimizer_path.startswith("per-replica")
    _close_models(fast, slow, rtol=1e-9, atol=1e-10)
    for of, os_ in zip(fast.optimizers, slow.optimizers):
        for gf, gs in zip(of.param_groups, os_.param_groups):
            for key in ("d", "d_max", "d_denom", "d_numerator"):
                assert gf[key] == pytest.approx(gs[key], rel=1e-9), key
            assert gf["k"] == gs["k"] == 60
        for pf, ps in zip(of.state, os_.state):
            assert set(of.state[pf]) == set(os_.state[ps]) and of.state[pf]["step"] == os_.state[ps]["step"] == 60
            for key in ("s", "exp_avg_sq", "p0"):
                a, b = of.state[pf][key], os_.state[ps][key]  # bound: shaped like the parameter; Prodigy's: flat
                # (the weights agree to 1e-9; s, a sum over 60 steps of d-weighted gradients, to 1e-7: with an explored
                # weight decay dealt apart from the LR, one element of 128 parted by 3e-8)
                torch.testing.assert_close(a.reshape(-1), b.reshape(-1).expand(a.numel()), rtol=1e-7, atol=1e-12)
            assert of.state_dict()["state"][0]["s"].shape == os_.state_dict()["state"][0]["s"].shape  # flat
    assert fast.optimizers[0].param_groups[0]["d"] > (1e-6 if extra else 1e-4)  # it adapted (d0 = 1e-6; slower
    # with Prodigy's options on)


def test_the_stacked_prodigy_step_resumes_bit_for_bit_and_into_a_per_replica_step():
    kw = dict(kind="prodigy", steps=30)
    full = _dadapt_engine(True, **kw)
    saved = _dadapt_engine(True, stop=13, **kw)
    resumed = _dadapt_engine(True, state=saved, **kw)
    assert resumed.optimizer_path == "stacked"
    for a, b in zip(full.models, resumed.models):
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert full.optimizers[0].param_groups[0]["d"] == resumed.optimizers[0].param_groups[0]["d"]
    slow = _dadapt_engine(False, state=saved, **kw)  # the same checkpoint, each replica's own Prodigy from there
    _close_models(full, slow, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("hdet_kw", [dict(lr_range_test=True, auto_lr_warmup_steps=40), dict(on_runaway="recover")])
def test_a_stacked_prodigy_resume_keeps_the_kept_syncs(hdet_kw):
    """The range test's ramp and the stability guard keep copies of Prodigy's state, taken from the stacked step's
    views (``s``, ``p0`` shaped like the parameter); a checkpoint loads them back beside Prodigy's own flat state.
    They were dropped (with a warning that the checkpoint fits another model), and the resumed run went back to
    another sync than the uninterrupted one."""
    kw = dict(kind="prodigy", steps=60, hdet_kw=hdet_kw)
    full = _dadapt_engine(True, **kw)
    saved = _dadapt_engine(True, stop=23, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "does not fit" warning
        warnings.filterwarnings("ignore", message="hdet: the range test's warm-up")  # (4 windows: short, said)
        resumed = _dadapt_engine(True, state=saved, train=False, **kw)
    ens = resumed.schedulers[0].ensemble
    kept = ens._ramp.items if "lr_range_test" in hdet_kw else [ens.stability._snapshot]
    assert kept and all(k is not None for k in kept)
    resumed = _dadapt_engine(True, state=saved, **kw)
    assert resumed.optimizer_path == "stacked"
    for a, b in zip(full.models, resumed.models):
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert [s.ensemble.slots.lr_scale for s in full.schedulers] == [s.ensemble.slots.lr_scale for s in resumed.schedulers]


def test_prodigy_steps_per_replica_where_it_cannot_be_stacked():
    coupled = _dadapt_engine(True, steps=2, decouple=False, kind="prodigy")
    assert coupled.optimizer_path == "per-replica: Prodigy's coupled weight decay (each replica's own weights " \
                                     "in its gradient)"
    sliced = _dadapt_engine(True, steps=2, kind="prodigy", slice_p=4)
    assert sliced.optimizer_path == "per-replica: Prodigy with slice_p=4"
    local = _dadapt_engine(True, steps=2, share_gradients=False, kind="prodigy")
    assert local.optimizer_path.startswith("per-replica: Prodigy without shared gradients")


def test_a_stacked_prodigy_handed_back_to_each_replica_keeps_its_state_as_prodigy_does():
    """When the stacked step gives up mid-run (here a d set by hand on one replica), each replica's Prodigy gets
    its own copy of the state as Prodigy keeps it (``s``, ``p0`` flat; ``step`` an int) and steps on from it as
    an engine that stepped each replica from the start does (float64, negligible eps: see above)."""
    kw = dict(steps=20, train=False, kind="prodigy", dtype=torch.float64, eps=1e-300)
    engines = [_dadapt_engine(True, **kw), _dadapt_engine(False, **kw)]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 32, 10, generator=g, dtype=torch.float64)
    for t in range(1, 6):
        for eng in engines:
            if t == 3:
                eng.optimizers[1].param_groups[0]["d"] *= 2
            eng.step((x, x[..., :4].argmax(-1)), lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]), stacked=True)
    fast, slow = engines
    assert fast.optimizer_path == "per-replica: the replicas' Prodigy optimizers differ in 'd'"
    _close_models(fast, slow, rtol=1e-9, atol=1e-12)
    for of, os_ in zip(fast.optimizers, slow.optimizers):
        for pf, ps in zip(of.param_groups[0]["params"], os_.param_groups[0]["params"]):
            st, ref = of.state[pf], os_.state[ps]
            assert st["s"].shape == st["p0"].shape == (pf.numel(),) and st["step"] == ref["step"] == 5
            torch.testing.assert_close(st["s"], ref["s"], rtol=1e-9, atol=1e-15)
    a, b = (o.state[o.param_groups[0]["params"][0]]["s"] for o in fast.optimizers[:2])
    assert a.data_ptr() != b.data_ptr()  # each replica's own copy


@pytest.mark.parametrize("at", [7, 1])
def test_a_non_finite_replica_under_the_stacked_prodigy_step_is_reset_like_the_others(at):
    """Prodigy in the engine's stacked step, replica 1's weight NaN at step 7: its distance from p0 is left out of
    the shared numerator (before, the NaN reached d on every replica, the engine fell back to the per-replica step,
    and the sync at step 10 found every replica non-finite and stopped the run); the sync resets replica 1 and the
    run ends where the per-replica path does. NaN before Prodigy's first step: the shared p0 (the replicas' mean)
    is the finite replicas' mean (it was NaN, and so was every replica's d from then on: the run stopped)."""
    pytest.importorskip("prodigyopt")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        stacked = _dadapt_engine(True, kind="prodigy", steps=30, poison=(at, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        own = _dadapt_engine(False, kind="prodigy", steps=30, poison=(at, 1))
    assert stacked.optimizer_path == "stacked"
    said = [str(w.message) for w in seen]
    assert any("replica(s) [1]" in m for m in said) and not any("differ" in m for m in said), said
    for o in stacked.optimizers:
        assert math.isfinite(float(o.param_groups[0]["d"]))
    _close_models(stacked, own, rtol=1e-4, atol=2e-5 if at > 1 else 5e-5)  # (at 1: p0 a float32 mean of 3 rows)


def test_a_schedule_free_wrapper_s_base_optimizer_is_refused_at_the_first_step():
    """schedulefree.ScheduleFreeWrapper is not a torch optimizer, so its base optimizer is what a scheduler gets; the
    base shows nothing of Schedule-Free until the wrapper's first step, and under a spread it was taken (an audit):
    the first scheduler step now checks the optimizer again and refuses it, with the reason."""
    schedulefree = pytest.importorskip("schedulefree")
    m = nn.Linear(3, 1)
    base = torch.optim.SGD(m.parameters(), lr=0.1)
    opt = schedulefree.ScheduleFreeWrapper(base, momentum=0.9)
    s = _sched(base, ensemble_lr_spread_ratio=0.5)  # taken: nothing says Schedule-Free yet
    opt.train()
    m(torch.randn(4, 3)).pow(2).mean().backward()
    opt.step()
    with pytest.raises(ValueError, match=r"without its own iterate averaging, but got SGD \(Schedule-Free\)"):
        s.step(1.0)


@pytest.mark.parametrize("make", [lambda gs: dadaptation.DAdaptAdam(gs, lr=1.0), lambda gs: prodigyopt.Prodigy(gs, lr=1.0)])
def test_auto_lr_over_one_lr_optimizers_needs_tied_groups(make):
    """D-Adaptation's Adam and Prodigy take one LR for all their param groups. With auto-LR each LR group's controller
    moved its own base, and the optimizer's step failed mid-run with its own error (an audit: step 11). Refused when
    the scheduler is built; with tie_lr_groups=True the groups keep one LR and the run goes on."""
    def groups():
        torch.manual_seed(0)
        return [{"params": [nn.Parameter(torch.randn(4))]}, {"params": [nn.Parameter(torch.randn(3))]}]

    def build(o, **kw):
        return hdet.HDETLR(o, None, total_steps=40, replicas=ScriptedReplicas(0, 4, lambda: [1.0, 1.3, 0.8, 1.1]),
                           model_sync_interval=5, ensemble_lr_spread_ratio=0.2, enable_auto_lr=True,
                           controller="paper", auto_lr_warmup_steps=5, loss_scale=0.05, **kw)
    with pytest.raises(ValueError, match=r"Expected tie_lr_groups=True with enable_auto_lr=True over \w+ with 2 param"):
        build(make(groups()))
    o = make(groups())
    s = build(o, tie_lr_groups=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(40):
            for g in o.param_groups:
                for p in g["params"]:
                    p.grad = p.detach().clone()
            o.step()
            s.step(torch.tensor(1.0))
            assert o.param_groups[0]["lr"] == o.param_groups[1]["lr"]
    assert s.ensemble.controllers[0].updates > 0
    adan = dadaptation.DAdaptAdan(groups(), lr=1.0)  # (takes groups of different LRs: not refused)
    build(adan)


def test_optimizers_whose_steps_do_not_follow_their_lr_are_refused_under_a_spread():
    """An audit of torch.optim under HDET's spread: Rprop reads the LR only for its first step sizes (re-dealt replicas
    kept their first multipliers' 3x ratio; with average_optimizer_state=True the spread was gone after the first
    converge step) and LBFGS's inner iterations and line search make its step depend on far more than the LR (3x the
    LR gave 1.07-1.13x the step), while the records showed the spread: refused under one, allowed without."""
    m = nn.Linear(3, 1)
    with pytest.raises(ValueError, match=r"got Rprop: it reads group\['lr'\] only to set its first step sizes"):
        _sched(torch.optim.Rprop(m.parameters(), lr=0.01), ensemble_lr_spread_ratio=0.2)
    _sched(torch.optim.Rprop(m.parameters(), lr=0.01))  # averaging only
    _sched(torch.optim.Rprop(m.parameters(), lr=0.01), explore=[])
    with pytest.raises(ValueError, match="got LBFGS under a spread.*inner iterations and line search"):
        _sched(torch.optim.LBFGS(m.parameters(), lr=0.5), ensemble_lr_spread_ratio=0.2)
    o = torch.optim.LBFGS(m.parameters(), lr=0.5)
    with pytest.raises(ValueError, match="got LBFGS"):
        _sched(o, explore=[hdet.GradClip(1.0, alpha=0.5)])
    _sched(torch.optim.LBFGS(m.parameters(), lr=0.5))


@pytest.mark.skipif(not hasattr(torch.optim, "Adafactor"), reason="torch.optim.Adafactor: torch >= 2.5")
def test_adafactors_cap_on_its_lr_is_said_once():
    """torch's Adafactor steps at min(lr, 1/sqrt(t)): replicas above the cap step alike (an audit: every replica the
    same step from step 6 at base LR 1), so the spread acts less than the records say. Said once, at the first step
    where a replica's LR is above the cap; not under a base LR far below it."""
    def run(lr, steps):
        m = nn.Linear(3, 1)
        o = torch.optim.Adafactor(m.parameters(), lr=lr)
        s = hdet.HDETLR(o, None, total_steps=20, replicas=ScriptedReplicas(3, 4), model_sync_interval=50,
                        ensemble_lr_spread_ratio=0.5)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(steps):
                m(torch.randn(4, 3)).square().mean().backward()
                o.step()
                o.zero_grad()
                s.step()
        return [str(w.message) for w in caught if "Adafactor steps at min(lr, 1/sqrt(t))" in str(w.message)]
    said = run(0.3, 12)  # replica 3's LR (0.3 x its multiplier, up to 1.5) is above 1/sqrt(t) within 12 steps
    assert len(said) == 1 and "below this replica's LR" in said[0]
    assert run(0.01, 12) == []


def test_asgd_needs_its_state_averaged_under_a_spread():
    """ASGD keeps ax, an average of the weights (what its users evaluate): it stayed each replica's own after the
    last converge step (1.85e-2 apart, an audit) while the weights were averaged. Refused under a spread unless
    average_optimizer_state=True, which averages it with them; allowed without a spread."""
    m = nn.Linear(3, 1)
    with pytest.raises(ValueError, match="average_optimizer_state=True with ASGD under a spread"):
        _sched(torch.optim.ASGD(m.parameters(), lr=0.01), ensemble_lr_spread_ratio=0.2)
    _sched(torch.optim.ASGD(m.parameters(), lr=0.01))
    torch.manual_seed(0)
    eng = ReplicaEngine(nn.Linear(4, 2), 2, lambda mod: torch.optim.ASGD(mod.parameters(), lr=0.05, t0=2),
                        lambda o, rep, mod: hdet.HDETLR(o, None, total_steps=6, replicas=rep, model=mod,
                                                        ensemble_lr_spread_ratio=0.5, model_sync_interval=3,
                                                        average_optimizer_state=True), mode="loop")
    x, y = torch.randn(2, 8, 4), torch.randn(2, 8, 2)
    for t in range(1, 7):
        eng.step((x, y), lambda mod, b: (mod(b[0]) - b[1]).square().mean(), stacked=True)
        ax = [[o.state[p]["ax"] for p in o.param_groups[0]["params"]] for o in eng.optimizers]
        apart = max(float((a - b).abs().max()) for a, b in zip(*ax))
        if t % 3 == 0:
            assert apart == 0, t  # averaged with the weights at each converge step
        elif t % 3 == 2:
            assert apart > 0, t  # (the first step after one runs at the averaged eta on both: equal there)


def test_rprop_and_lbfgs_are_refused_where_the_ensembles_lr_moves():
    """Rprop ignores its LR after the first step and LBFGS's step barely follows it: the controller and the range
    test, which move the whole ensemble's LR, measured nothing (a review). LBFGS in local mode: each replica's
    curvature history follows its own gradients."""
    m = nn.Linear(3, 1)
    for kw in (dict(enable_auto_lr=True, controller="paper"), dict(lr_range_test=True, auto_lr_warmup_steps=10)):
        with pytest.raises(ValueError, match="but got Rprop"):
            _sched(torch.optim.Rprop(m.parameters(), lr=0.01), **kw)
        with pytest.raises(ValueError, match="but got LBFGS"):
            _sched(torch.optim.LBFGS(m.parameters(), lr=0.5), **kw)
    with pytest.raises(ValueError, match="with LBFGS, but this is local mode"):
        hdet.optimizers.check_shared_gradients(torch.optim.LBFGS(m.parameters()))


def test_the_engine_refuses_sparse_embeddings_and_closure_optimizers():
    """nn.Embedding(sparse=True) failed deep in torch (a reshape in vmap's backward, a masked average in the loop)
    and LBFGS at its first step (no closure): the engine says why, when it is built."""
    emb = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1))
    sched = lambda o, rep, m: hdet.HDETLR(o, None, total_steps=4, replicas=rep, model=m)  # noqa: E731
    with pytest.raises(ValueError, match=r"\['0'\] are embeddings with sparse=True"):
        ReplicaEngine(emb, 2, lambda m: torch.optim.SparseAdam(m.parameters()), sched)
    with pytest.raises(ValueError, match="step without a closure, but got LBFGS"):
        ReplicaEngine(nn.Linear(3, 1), 2, lambda m: torch.optim.LBFGS(m.parameters()), sched)


def test_a_failed_second_scheduler_puts_the_first_ones_hooks_back():
    """A second scheduler built on the same D-Adaptation optimizer replaces the first's step-scale hooks; when its
    construction failed, it took its own off and left the optimizer with none (the first scheduler's multipliers
    silently stopped applying; a review). The first's are put back."""
    m = nn.Linear(3, 3)
    o = dadaptation.DAdaptAdam(m.parameters(), lr=1.0)
    a = hdet.HDETLR(o, None, total_steps=10)
    counts = (len(o._optimizer_step_pre_hooks), len(o._optimizer_step_post_hooks))
    with pytest.raises(ValueError, match="auto_lr_warmup_steps < total_steps"):
        hdet.HDETLR(o, None, total_steps=10, enable_auto_lr=True, controller="paper", auto_lr_warmup_steps=100)
    assert o._hdet_step_scale is a.ensemble.step_scale
    assert (len(o._optimizer_step_pre_hooks), len(o._optimizer_step_post_hooks)) == counts


def test_an_ensemble_built_from_a_default_config_takes_warmup_zero():
    """HDETConfig's auto_lr_warmup_steps is None ("the scheduler's own"); an Ensemble built from it directly (the
    public class) takes HDETLR's 0 (a review: its set_total_steps raised a TypeError on None)."""
    from hdet.replicas import SingleReplica
    o = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    e = hdet.Ensemble(hdet.HDETConfig(enable_auto_lr=True, controller="paper", model_sync_interval=10), SingleReplica(), o)
    e.set_total_steps(100)
    assert e.config.auto_lr_warmup_steps == 0 and e.first_control_step() == 10


def test_dadapt_sgds_first_gradient_norm_is_averaged_with_its_estimates_in_local_mode():
    """DAdaptSGD divides every step by ``g0_norm``, the norm of its first gradient: in local mode (no shared
    gradients) each replica's own, left per replica by the converge step that averaged d, so at alpha 0 the four
    replicas' steps stayed up to 1.7x apart for the whole run (an audit). Averaged with the other estimates now:
    after the converge step at step 8 every replica's g0_norm, d and step size d / g0_norm are the same."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    eng = ReplicaEngine(model, 4, lambda m: dadaptation.DAdaptSGD(m.parameters(), lr=1.0),
                        lambda o, rep, m: hdet.HDETLR(o, None, total_steps=12, model_sync_interval=8, replicas=rep,
                                                      model=m, ensemble_lr_spread_ratio=0.0,
                                                      average_optimizer_state=True),
                        share_gradients=False)
    g = torch.Generator().manual_seed(1)
    for t in range(1, 9):
        xs = [torch.randn(8, 6, generator=g) for _ in range(4)]  # (local mode: a batch per replica)
        eng.step([(x, x[:, :3].argmax(-1)) for x in xs], lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]))
        if t == 1:
            first = [float(o.param_groups[0]["g0_norm"]) for o in eng.optimizers]
            assert max(first) / min(first) > 1.05  # (each replica's own batch: its own first gradient)
    groups = [o.param_groups[0] for o in eng.optimizers]
    assert [float(gr["g0_norm"]) for gr in groups] == [pytest.approx(sum(first) / 4, rel=1e-6)] * 4
    assert len({float(gr["g0_norm"]) for gr in groups}) == len({float(gr["d"]) for gr in groups}) == 1
