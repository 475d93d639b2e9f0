"""The in-run LR range test (``lr_range_test=True``, issue 15 item 3): the ramp, its ends (collapse, rise,
stall, runaway, end of the warm-up), going back to the ramp's state at the new peak, the LR after it, the
state, and every rank deciding the same."""

from __future__ import annotations

import copy
import io
import math
import warnings

import pytest
import torch
from helpers import ScriptedReplicas
from torch import nn

import hdet
from hdet.engine import ReplicaEngine
from hdet.range_test import COLLAPSE, RANGE_START, RampSnapshots, RangeTest


def _scripted(script, T=5, warm=100, total=200, **kw):
    """One replica of 8 whose gathered window losses follow ``script`` (one list per sync), a constant LR 0.1."""
    torch.manual_seed(0)
    m = nn.Linear(3, 1)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    it = iter(script)
    s = hdet.HDETLR(o, None, total_steps=total, model=m, replicas=ScriptedReplicas(0, 8, lambda: next(it)),
                    ensemble_lr_spread_ratio=0.2, model_sync_interval=T, lr_range_test=True,
                    auto_lr_warmup_steps=warm, **kw)
    return m, o, s


def _window(m, o, s, T=5, move=0.0):
    for _ in range(T):
        o.step()
        with torch.no_grad():
            for p in m.parameters():
                p.add_(move)
        s.step(torch.tensor(1.0))


def test_the_ramp_grows_from_a_gentle_start_and_ends_at_a_collapse_going_back_to_the_new_peak():
    # improvements 10% a window, then 1%: a collapse (below a third of the median) at the sync of step 30
    losses = [2.0 * 0.9 ** k for k in range(6)]
    losses.append(losses[-1] * 0.99)
    m, o, s = _scripted([[x] * 8 for x in losses] + [[1.0] * 8] * 20)
    rt = s.ensemble.slots.range
    growth = (300 / RANGE_START) ** (5 / 100)
    assert rt.growth == pytest.approx(growth) and rt.factor == RANGE_START
    assert s.base_lrs_now[0] == pytest.approx(0.1 * RANGE_START)
    states = {}
    for k in range(6):
        _window(m, o, s, move=1.0)  # the weights move every step: each sync's state differs
        states[5 * (k + 1)] = [p.detach().clone() for p in m.parameters()]
        assert s.base_lrs_now[0] == pytest.approx(0.1 * RANGE_START * growth ** (k + 1))
        assert s.last_sync.range_ended is None
    good = 0.1 * RANGE_START * growth ** 5  # the LR of the last window that made progress (steps 26-30)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the range test's end is no warning
        _window(m, o, s, move=1.0)
    rec = s.last_sync
    assert rec.range_ended == "collapse" and rt.reason == "collapse" and rt.ended_at == 35
    assert rt.peak == pytest.approx(good / 2)  # range_backoff 2 (the default)
    # back to the ramp's last sync at an LR of at most the peak: the LRs at the syncs grow by `growth` (1.56), so
    # that is the sync two windows before the last good one (step 20: good / 1.56 ** 2 <= good / 2)
    assert rec.went_back_to == 20 and s.ensemble.stability.best_step == 20
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), states[20]))
    assert s.base_lrs_now[0] == pytest.approx(good / 2) and rec.range_scale == pytest.approx(good / 2 / 0.1)
    assert rec.lr_scale == 1.0  # the range test's end does not also cut the schedule
    assert s.ensemble._ramp.items == []  # the snapshots are freed
    for _ in range(3):
        _window(m, o, s)
    assert s.base_lrs_now[0] == pytest.approx(good / 2)  # constant base: the peak stays


def test_a_rise_ends_the_test_and_nothing_is_cut_twice():
    m, o, s = _scripted([[2.0] * 8, [1.8] * 8, [1.6] * 8, [2.4] * 8] + [[1.5] * 8] * 20)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(4):
            _window(m, o, s, move=0.5)
    rt = s.ensemble.slots.range
    assert rt.reason == "rising" and s.last_sync.range_ended == "rising" and s.last_sync.lr_scale == 1.0
    assert rt.peak == pytest.approx(0.1 * RANGE_START * rt.growth ** 2 / 2)  # the sync of step 15's LR / 2


def test_without_an_edge_the_ramp_runs_to_the_end_of_the_warmup_and_keeps_the_last_good_lr():
    with pytest.warns(UserWarning, match=r"warm-up \(20 steps, 4 windows of model_sync_interval=5\) is too short.*at "
                                         r"most at 0.32x.*auto_lr_warmup_steps >= 30"):
        m, o, s = _scripted([[2.0 * 0.9 ** k] * 8 for k in range(40)], T=5, warm=20, total=100)
    for _ in range(4):
        _window(m, o, s)
    rt = s.ensemble.slots.range
    assert rt.reason == "warm-up over" and rt.ended_at == 20
    assert rt.peak == pytest.approx(0.1 * RANGE_START * rt.growth ** 3)  # no backoff: no edge was seen
    assert s.last_sync.went_back_to is None


def test_range_test_logic_alone():
    rt = RangeTest(growth=1.5, max_factor=4.0, backoff=2.0, patience=3)
    assert rt.ramping and rt.scale(1.0) == 1.0
    for k, loss in enumerate([3.0, 2.7, 2.4, 2.1]):
        assert not rt.update(25 * (k + 1), 0.1 * 1.5 ** k, loss, 0, False, False, False)
    assert rt.factor == 4.0  # capped at max_factor
    assert rt.improvements == pytest.approx([0.1, 1 / 9, 0.125])
    # a drop of 1% is below COLLAPSE x the median (11%)
    assert 0.01 < COLLAPSE * 0.111
    assert rt.update(125, 0.5, 2.1 * 0.99, 0, False, False, False)
    assert rt.reason == "collapse" and rt.peak == pytest.approx(0.1 * 1.5 ** 3 / 2)
    assert rt.scale(peak0=2.0) == pytest.approx(rt.peak / 2.0)  # after the end: the peak, the schedule's shape
    # too high from the first window on (non-finite): the peak is below the first window's LR
    rt = RangeTest(growth=2.0, max_factor=10.0, backoff=2.0, patience=3)
    assert rt.update(5, 0.4, math.nan, 0, False, False, False) and rt.peak == pytest.approx(0.1)
    # a loss below 0 (a Gaussian NLL) collapses alike: the improvement over |L| (none was recorded below 0, and the
    # test ran on to the end of the warm-up, 128x higher in an audit's run)
    for shift in (0.0, -10.0):
        rt = RangeTest(growth=1.5, max_factor=4.0, backoff=2.0, patience=3)
        for k, loss in enumerate([5.0, 4.5, 4.05, 3.645]):
            assert not rt.update(10 * (k + 1), 0.1 * 1.5 ** k, loss + shift, 0, False, False, False)
        assert rt.update(50, 0.5, 3.62 + shift, 0, False, False, False) and rt.reason == "collapse"
    for bad in (dict(growth=0.5), dict(backoff=math.inf)):
        with pytest.raises(ValueError, match="range test's"):
            RangeTest(**{**dict(growth=1.5, max_factor=4.0, backoff=2.0, patience=3), **bad})


def test_snapshots_keep_only_what_can_be_gone_back_to():
    snaps = RampSnapshots()
    t = [torch.zeros(3)]
    for k in range(6):
        t[0].fill_(k)
        snaps.add(k, lr=2.0 ** k, loss=1.0, tensors=t, keep_from=2.0 ** k / 8)
    assert [i[0] for i in snaps.items] == [2, 3, 4, 5]  # 2 ** 2 = 4 is the last LR at or below 32 / 8
    assert snaps.go_back(9.0, t) == (3, 1.0) and torch.equal(t[0], torch.full((3,), 3.0))
    assert snaps.go_back(0.5, t) == (2, 1.0)  # below every kept LR: the earliest kept


def test_validation():
    m = nn.Linear(3, 1)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"auto_lr_warmup_steps \(the range test's length\) in .* = \[10, 100\) .* but got 5"):
        hdet.HDETLR(o, None, total_steps=100, model_sync_interval=5, lr_range_test=True, auto_lr_warmup_steps=5)
    with pytest.raises(ValueError, match=r"range_backoff >= 1, but got 0.5"):
        hdet.HDETConfig(range_backoff=0.5)
    with pytest.raises(ValueError, match=r"range_patience >= 1, but got 0"):
        hdet.HDETConfig(range_patience=0)
    # OneCycleAutoLR: the range test runs during OneCycle's warm-up unless told otherwise
    s = hdet.OneCycleAutoLR(o, max_lr=0.1, total_steps=200, model_sync_interval=10, lr_range_test=True)
    assert s.ensemble.config.auto_lr_warmup_steps == 60 and s.ensemble.config.recovering
    o2 = torch.optim.SGD(m.parameters(), lr=0.1)
    assert hdet.OneCycleAutoLR(o2, max_lr=0.1, total_steps=200).ensemble.config.auto_lr_warmup_steps == 100_000


@pytest.mark.parametrize("options", [dict(lr_range_test=True), dict(enable_auto_lr=True, controller="paper")])
def test_one_cycle_takes_the_warmup_from_a_config_as_from_keywords(options):
    """OneCycleAutoLR(config=HDETConfig(auto_lr_warmup_steps=100, ...)) ran the range test over OneCycle's warm-up
    (60 steps: 6 windows instead of 10, another peak) and the paper controller from step 100000, silently; the
    README gives config= and keywords as the same thing. HDETConfig's default (None) means unset; a config's explicit
    0 is 0, as the keyword's is (it gave 100000, silently, until an audit)."""
    m = nn.Linear(3, 1)

    def warmup(**kw):
        o = torch.optim.SGD(m.parameters(), lr=0.1)
        return hdet.OneCycleAutoLR(o, max_lr=0.1, total_steps=200, **kw).ensemble.config.auto_lr_warmup_steps

    given = dict(options, model_sync_interval=10, auto_lr_warmup_steps=100)
    assert warmup(config=hdet.HDETConfig(**given)) == warmup(**given) == 100
    assert warmup(config=hdet.HDETConfig(**given), auto_lr_warmup_steps=50) == 50  # the keyword wins, as for any option
    zero = dict(options, model_sync_interval=10, auto_lr_warmup_steps=0)
    if "lr_range_test" in options:  # too short for the range test: refused alike both ways
        for kw in (dict(config=hdet.HDETConfig(**zero)), zero):
            with pytest.raises(ValueError, match=r"range test's length.*but got 0"):
                warmup(**kw)
    else:
        assert warmup(config=hdet.HDETConfig(**zero)) == warmup(**zero) == 0
    assert hdet.HDETConfig().auto_lr_warmup_steps is None
    unset = dict(options, model_sync_interval=10)
    if "lr_range_test" in options:
        assert warmup(config=hdet.HDETConfig(**unset)) == warmup(**unset) == 60
    else:  # the reference's 100000, refused alike both ways on a 200-step run
        for kw in (dict(config=hdet.HDETConfig(**unset)), unset):
            with pytest.raises(ValueError, match="auto_lr_warmup_steps=100000 and total_steps=200"):
                warmup(**kw)


def test_the_state_round_trips_mid_ramp_and_the_runs_continue_alike():
    script = [[2.0 * 0.9 ** k] * 8 for k in range(5)] + [[1.3] * 8] + [[1.2] * 8] * 30
    m1, o1, s1 = _scripted(script)
    for _ in range(4):
        _window(m1, o1, s1, move=0.25)
    buf = io.BytesIO()
    torch.save({"sched": s1.state_dict(), "model": m1.state_dict()}, buf)
    saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    assert len(saved["sched"]["hdet"]["range_snapshots"]) >= 2
    m2, o2, s2 = _scripted(script[4:])
    m2.load_state_dict(saved["model"])
    s2.load_state_dict(saved["sched"])
    m1r, o1r, s1r = _scripted(script[4:])  # the uninterrupted run's remaining script
    for (ma, oa, sa) in ((m1, o1, s1), (m2, o2, s2)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(4):
                _window(ma, oa, sa, move=0.25)
    assert s1.ensemble.slots.range == s2.ensemble.slots.range
    assert s1.base_lrs_now == s2.base_lrs_now
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), m2.parameters()))


def _least_squares(start, range_test, steps=300, T=10, N=4, seed=0):
    """N replicas (shared gradients) of SGD on a noisy, ill-conditioned least-squares problem, OneCycle at
    ``start / L``; returns the final full-batch loss and the range test's peak (x L)."""
    torch.manual_seed(seed)
    d = 32
    A = torch.randn(2048, d) * torch.logspace(0, -1.5, d)
    y = A @ torch.randn(d, 1) + 0.3 * torch.randn(2048, 1)
    L = torch.linalg.eigvalsh(A.T @ A * 2 / 2048).max().item()
    eng = ReplicaEngine(nn.Linear(d, 1, bias=False), N, lambda mod: torch.optim.SGD(mod.parameters(), lr=start / L),
                        lambda o, rep, mod: hdet.OneCycleAutoLR(
                            o, max_lr=start / L, total_steps=steps, replicas=rep, model=mod, ensemble_lr_spread_ratio=0.2,
                            model_sync_interval=T, lr_range_test=range_test),
                        mode="loop")
    g = torch.Generator().manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(steps):
            idx = [torch.randint(0, 2048, (16,), generator=g) for _ in range(N)]
            try:
                losses = eng.step([(A[i], y[i]) for i in idx], lambda mod, b: (mod(b[0]) - b[1]).pow(2).mean())
            except hdet.NonFiniteReplicaError:  # every replica diverged (no recovery without the range test)
                return math.inf, None
    final = (eng.models[0](A) - y).pow(2).mean().item() if torch.isfinite(losses).all() else math.inf
    rt = eng.schedulers[0].ensemble.slots.range
    return final, None if rt is None else rt.peak * L


def test_on_a_real_problem_the_range_test_rescues_a_start_100x_too_low_and_one_30x_too_high():
    good, _ = _least_squares(1.0, False)
    low, _ = _least_squares(0.01, False)
    high, _ = _least_squares(30.0, False)
    assert low > 1.5 * good and high > 1e3  # 100x too low: far from converged; 30x too high: diverged
    for start in (0.01, 30.0):
        final, peak = _least_squares(start, True)
        assert 0.02 < peak < 2.0  # the found peak is a stable LR (below 2 / L)
        assert final < 1.5 * good
    # at the right LR it costs (here 0.131 against 0.092: an early rise stops the ramp at 0.02 / L), as it does on
    # the GPU tasks (docs/auto-lr.md): bounded, not free
    final, _ = _least_squares(1.0, True)
    assert good < final < 1.6 * good


def _rank_run(rank, world):
    torch.manual_seed(0)
    d = 8
    A = torch.randn(512, d) * torch.logspace(0, -1, d)
    y = A @ torch.randn(d, 1) + 0.3 * torch.randn(512, 1)
    L = torch.linalg.eigvalsh(A.T @ A * 2 / 512).max().item()
    m = nn.Linear(d, 1, bias=False)
    o = torch.optim.SGD(m.parameters(), lr=0.05 / L)
    s = hdet.OneCycleAutoLR(o, max_lr=0.05 / L, total_steps=120, model_sync_interval=10, ensemble_lr_spread_ratio=0.2,
                            lr_range_test=True, auto_lr_warmup_steps=80)
    g = torch.Generator().manual_seed(rank)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(120):
            i = torch.randint(0, 512, (16,), generator=g)  # every rank its own batches
            loss = (m(A[i]) - y[i]).pow(2).mean()
            o.zero_grad()
            loss.backward()
            o.step()
            s.step(loss.detach())
    return {"range": s.ensemble.slots.range.state_dict(), "w": m.weight.detach().clone(), "lr": s.base_lrs_now}


@pytest.mark.distributed
def test_gloo_world_2_every_rank_decides_the_same():
    from helpers import check_ok, run_gloo

    res = check_ok(run_gloo(_rank_run, 2))
    assert res[0]["range"] == res[1]["range"] and res[0]["range"]["peak"] is not None
    assert res[0]["lr"] == res[1]["lr"] and torch.equal(res[0]["w"], res[1]["w"])


@pytest.mark.parametrize("corrupt", [
    ("range_test", "patience", "3"), ("range_test", "patience", 0), ("range_test", "last_loss", float("nan")),
    ("range_test", "last_loss", "a"), ("range_test", "ended_at", 10), ("stability", "best_se", -1.0),
    ("stability", "best_se", float("nan")), ("stability", "best_step", "x"), ("stability", "said_blown", 1),
    ("range_snapshots", 1, float("nan"))])
def test_a_corrupted_range_test_or_stability_state_is_refused_up_front(corrupt):
    """An audit: these were taken at load and failed later, at a sync, with a TypeError (or ran on a NaN)."""
    script = [[2.0 * 0.9 ** k] * 8 for k in range(5)] + [[1.2] * 8] * 30
    m, o, s = _scripted(script)
    for _ in range(4):
        _window(m, o, s, move=0.25)
    state = copy.deepcopy(s.state_dict())
    part, key, value = corrupt
    assert state["hdet"][part] is not None
    if part == "range_snapshots":
        state["hdet"][part][0][key] = value
    else:
        state["hdet"][part][key] = value
    fresh = _scripted(script)[2]
    with pytest.raises(ValueError, match="Expected the (range test's|state's (best|said_blown))"):
        fresh.load_state_dict(state)


@pytest.mark.parametrize("warm, short", [(50, True), (60, False), (100, False)])
def test_a_warmup_too_short_for_the_ramp_to_pass_the_given_lr_is_said(warm, short):
    """The ramp starts at 1/25 and at most doubles a window: with fewer than 6 windows it cannot pass the LR given
    and, with no edge seen, the run trained below it, silently (0.64x at 5 windows of 10; an audit). Said at
    construction, with the warm-up that would do; the ramp's reach is the estimate's."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        m, o, s = _scripted([[2.0 * 0.9 ** k] * 8 for k in range(40)], T=10, warm=warm, total=200)
    said = [str(w.message) for w in said if "too short for its ramp" in str(w.message)]
    assert len(said) == short and (not short or "at most at 0.64x" in said[0] and ">= 60" in said[0])
    for _ in range(warm // 10):
        _window(m, o, s, T=10)
    rt = s.ensemble.slots.range
    assert rt.reason == "warm-up over" and (rt.peak < 0.1) is short


def _range_then_paper(steps, **kw):
    """OneCycleAutoLR(max_lr=0.01) with the range test (a loss falling 10% a window: no edge, it ends at the warm-up's
    end, 20x) and then the paper controller, ``steps`` steps of 400."""
    syncs = {"k": 0}
    torch.manual_seed(0)
    m = nn.Linear(2, 1)
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = hdet.OneCycleAutoLR(opt, max_lr=0.01, total_steps=400, pct_start=0.25, model=m,
                                replicas=ScriptedReplicas(0, 4, lambda: [2.0 * 0.9 ** syncs["k"]] * 4),
                                ensemble_lr_spread_ratio=0.2, model_sync_interval=10, lr_range_test=True,
                                enable_auto_lr=True, controller="paper", **kw)
    for t in range(1, steps + 1):
        opt.step()
        s.step(1.0)
        syncs["k"] += t % 10 == 0
    return s


def test_the_paper_controllers_bounds_and_decay_target_follow_the_range_tests_peak():
    """The range test ends at 20x the max_lr given (no edge seen); the paper controller's default bounds (min_lr,
    10 max_lr) and Eq. 8's target (min_lr) are of the schedule, which the test scaled: they scale with it. Unscaled, its
    first update was clamped to 10x max_lr, halving the LR at once, silently (an audit)."""
    s = _range_then_paper(100)
    rt, ctrl = s.ensemble.slots.range, s.ensemble.controllers[0]
    assert rt.reason == "warm-up over" and rt.peak > 10 * 0.01
    assert not s.last_sync.controller[0].clamped and s.last_sync.bases[0] > 10 * 0.01
    k = rt.peak / 0.01  # (OneCycle's peak is max_lr)
    assert ctrl.bounds == pytest.approx((k * 0.01 / 25 / 1e4, k * 10 * 0.01))


def test_bounds_the_user_gives_are_kept_under_the_range_test():
    """``auto_lr_bounds=`` given: the paper controller keeps them as given, whatever the range test's factor (a review
    found them scaled with the defaults: (1e-5, 0.02) became (2e-4, 0.41))."""
    s = _range_then_paper(120, auto_lr_bounds=(1e-5, 0.02))
    assert s.ensemble.slots.range.peak > 0.1 and s.ensemble.controllers[0].bounds == (1e-5, 0.02)
    assert s.last_sync.bases[0] <= 0.02


def test_a_step_loss_that_overflowed_now_and_then_does_not_end_the_ramp_as_stalled():
    """Every window 15% better, one step of replica 3's window non-finite from the third window on: a sync that saw a
    non-finite loss is not kept as the best one to go back to (the stability guard), and the range test's patience
    counted windows since that best, so the ramp ended at 25 as "stalled" (a review). It counts them since the lowest
    loss now, and the ramp runs to the end of its warm-up."""
    from helpers import ScriptedReplicas

    from hdet.sync import SyncVector

    windows = [0]

    class OneOverflow(ScriptedReplicas):
        def gather(self, local, shard_sum=(), shard_min=(), shard_max=()):
            rows = super().gather(local, shard_sum, shard_min, shard_max)
            if windows[0] >= 3:
                rows[3, SyncVector._fields.index("nonfinite")] = 1.0
            return rows

    def losses():
        windows[0] += 1
        return [2.0 * 0.85 ** windows[0]] * 4

    torch.manual_seed(0)
    m = nn.Linear(3, 1)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    s = hdet.OneCycleAutoLR(o, max_lr=0.1, total_steps=200, model=m, replicas=OneOverflow(0, 4, losses),
                            ensemble_lr_spread_ratio=0.2, model_sync_interval=5, lr_range_test=True,
                            auto_lr_warmup_steps=60)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(60):
            o.step()
            s.step(torch.tensor(1.0))
    rt = s.ensemble.slots.range
    assert rt.reason != "stalled" and rt.ended_at == 60, (rt.reason, rt.ended_at)
