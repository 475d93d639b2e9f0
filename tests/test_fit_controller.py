"""hdet's fit controller: the parabola fit, the trust region and bounds, and its wiring into the ensemble
(the probe at each replica's mean iterate, a multiplicative correction of the schedule, state, errors)."""

import math
import random
import warnings

import pytest
import torch
from torch import nn

import hdet
from hdet import FitController
from hdet.controller import fit_parabola
from hdet.engine import ReplicaEngine

from dist_workers import Probe, batch, engine_run, train
from helpers import check_ok, one_thread, roundtrip, run_gloo

LOG_RHO = [math.log(r) for r in (0.5, 0.643, 0.786, 0.929, 1.071, 1.214, 1.357, 1.5)]


def test_fit_parabola_recovers_coefficients_and_degenerates_cleanly():
    xs = [-0.7, -0.2, 0.1, 0.4, 0.9]
    a, b, q = fit_parabola(xs, [1.5 - 2.0 * x + 3.0 * x * x for x in xs])
    assert (a, b, q) == pytest.approx((1.5, -2.0, 3.0), rel=1e-9)
    a, b, q = fit_parabola([0.0, 1.0, 0.0, 1.0], [1.0, 3.0, 1.0, 3.0])  # two distinct x: a line
    assert (a, b, q) == pytest.approx((1.0, 2.0, 0.0))
    assert fit_parabola([0.3, 0.3, 0.3], [1.0, 2.0, 3.0]) == (2.0, 0.0, 0.0)  # one x: no slope


@pytest.mark.parametrize("opt", [0.25, -0.3])
def test_moves_toward_the_fitted_optimum_within_the_trust_region(opt):
    c = FitController(kappa=0.5, beta=0.0, max_step=0.4)
    w = (max(LOG_RHO) - min(LOG_RHO)) / 2
    step = c.update(LOG_RHO, [(x - opt) ** 2 for x in LOG_RHO])
    assert step.h_tilde == pytest.approx(opt, rel=1e-9)  # x* of the parabola
    assert step.delta == pytest.approx(max(min(0.5 * opt, 0.4 * w), -0.4 * w))
    assert c.factor == pytest.approx(math.exp(step.delta))
    far = FitController(kappa=1.0, beta=0.0, max_step=0.4)
    step = far.update(LOG_RHO, [(x - 5.0) ** 2 for x in LOG_RHO])  # x* beyond the spread: clipped
    assert step.h_tilde == pytest.approx(2 * w) and step.delta == pytest.approx(0.4 * w)


def test_no_signal_no_move_and_weight_scales_the_step():
    c = FitController(beta=0.0)
    assert c.update(LOG_RHO, [2.0] * 8).delta == 0.0  # flat: a line with b = 0
    assert c.update(LOG_RHO, [(x - 0.1) ** 2 for x in LOG_RHO], weight=0.0).delta == 0.0
    half = FitController(beta=0.0).update(LOG_RHO, [(x - 0.1) ** 2 for x in LOG_RHO], weight=0.5).delta
    full = FitController(beta=0.0).update(LOG_RHO, [(x - 0.1) ** 2 for x in LOG_RHO], weight=1.0).delta
    assert half == pytest.approx(full / 2) and full > 0


@pytest.mark.parametrize("n, alpha, loss", [(4, 0.5, 0.422673), (4, 0.2, 0.65625), (8, 0.2, 2.5), (3, 0.3, 2.5),
                                             (5, 0.1, 0.1234567)])
def test_tied_probe_losses_move_nothing(n, alpha, loss):
    """Every replica's probe the same loss (a bf16 probe, one that cannot tell the replicas apart): the fit's own
    rounding left b ~ 1e-16, whose sign sent x* to the spread's edge (the LR 1.00 -> 1.71 in an engine run on no
    signal: an audit). A real difference of one float32 rounding step still moves it."""
    x = [math.log(r) for r in hdet.spread.linear_multipliers(n, alpha)]
    c = FitController()
    for _ in range(10):
        step = c.update(x, [loss] * n)
        assert step.h_tilde == 0.0
    assert c.factor == 1.0
    ulp = torch.finfo(torch.float32).eps * loss  # the lowest LR's probe one float32 step lower: a line downhill
    moved = FitController().update(x, [loss - ulp * (i == 0) for i in range(n)])
    assert moved.h_tilde < 0 and moved.delta < 0


def test_concave_fit_goes_downhill_and_nan_losses_are_left_out():
    c = FitController(beta=0.0)
    step = c.update(LOG_RHO, [-(x ** 2) - 0.5 * x for x in LOG_RHO])  # concave, falling with x
    assert step.delta > 0
    ys = [(x - 0.2) ** 2 for x in LOG_RHO]
    ys[3] = float("nan")
    step = FitController(beta=0.0).update(LOG_RHO, ys)
    assert step.h_tilde == pytest.approx(0.2, rel=1e-9)
    assert FitController().update(LOG_RHO[:2] + [0.0] * 6, [float("nan")] * 8).delta == 0.0


def test_bounds_hold_under_any_signal():
    rng = random.Random(0)
    c = FitController(kappa=5.0, beta=0.0, max_step=10.0, bounds=(0.25, 4.0))
    for _ in range(200):
        ys = [rng.gauss(0, 1) + rng.choice([-3, 3]) * x for x in LOG_RHO]
        step = c.update(LOG_RHO, ys)
        assert 0.25 - 1e-12 <= c.factor <= 4.0 + 1e-12 and math.isfinite(step.new_base)


@pytest.mark.parametrize("start", [0.1, 10.0])
def test_closed_loop_finds_the_scale_on_a_noisy_landscape(start):
    """Probe loss (log(scale * rho) - log(best))^2 + noise: from 0.1x or 10x the scale ends near best."""
    rng = random.Random(1)
    c = FitController()
    for _ in range(60):
        ys = [(math.log(start * c.factor) + x) ** 2 + rng.gauss(0, 0.01) for x in LOG_RHO]
        c.update(LOG_RHO, ys)
    assert abs(math.log(start * c.factor)) < 0.15


def test_bad_settings_are_clear_errors():
    with pytest.raises(ValueError, match="kappa > 0"):
        FitController(kappa=0.0)
    with pytest.raises(ValueError, match="0 <= beta < 1"):
        FitController(beta=1.0)
    with pytest.raises(ValueError, match="lo <= 1 <= hi"):
        FitController(bounds=(2.0, 4.0))
    with pytest.raises(ValueError, match="one offset per loss"):
        FitController().update([0.0, 1.0], [1.0])


def test_state_dict_round_trip():
    c = FitController(kappa=0.3)
    c.update(LOG_RHO, [(x - 0.2) ** 2 for x in LOG_RHO])
    d = FitController()
    d.load_state_dict(c.state_dict())
    assert d == c


# -- in the ensemble ------------------------------------------------------------------------------------
def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 1))


class RecordingProbe(Probe):
    """The test probe, also recording the parameters and mode it was called with."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __call__(self, model):
        self.seen.append(([p.detach().clone() for p in model.parameters()], model.training))
        return super().__call__(model)


def _engine(N=4, steps=40, T=10, warm=10, probe_cls=RecordingProbe, mode="loop", **kw):
    probes = []

    def make_sched(o, rep, m):
        probes.append(probe_cls())
        return hdet.OneCycleAutoLR(o, max_lr=0.05, total_steps=steps, ensemble_lr_spread_ratio=0.5,
                                   model_sync_interval=T, enable_auto_lr=True, auto_lr_warmup_steps=warm, model=m,
                                   replicas=rep, controller="fit", probe=probes[-1], **kw)

    eng = ReplicaEngine(_model(), N, lambda m: torch.optim.AdamW(m.parameters(), lr=0.05), make_sched, mode=mode)
    return eng, probes


def _loss(m, b):
    return nn.functional.mse_loss(m(b[0]), b[1])


@pytest.mark.parametrize("mode", ["loop", "vmap"])
def test_probe_sees_each_replicas_mean_iterate_in_eval_mode_and_weights_come_back(mode):
    """The probe at a sync sees mean_r = (w_1 + ... + w_T) / T of replica r's iterates. The last iterate
    w_T (before averaging) is not observable from outside, but it follows: w_T = T mean_r - (w_1 + ... +
    w_{T-1}), and the weights after the sync must be the replicas' average of those w_T (Eq. 3)."""
    N, T = 4, 10
    eng, probes = _engine(N=N, T=T, mode=mode)
    sums = [[torch.zeros_like(p, dtype=torch.float64) for p in m.parameters()] for m in eng.models]
    for t in range(1, 21):
        eng.step([batch(r, t) for r in range(N)], _loss)
        if t % T:
            for r, m in enumerate(eng.models):
                for s, p in zip(sums[r], m.parameters()):
                    s += p.detach().double()
            continue
        last = []
        for r in range(N):
            params, training = probes[r].seen[-1]
            assert training is False
            last.append([T * mean.double() - s for mean, s in zip(params, sums[r])])  # w_T of replica r
        assert any(not torch.allclose(a, b) for a, b in zip(last[0], last[1]))  # replicas differed
        for m in eng.models:
            assert m.training  # train mode restored
            for p, *ws in zip(m.parameters(), *last):  # the weights came back and were averaged
                torch.testing.assert_close(p.detach().double(), sum(ws) / N, rtol=1e-4, atol=1e-5)
        sums = [[torch.zeros_like(p, dtype=torch.float64) for p in m.parameters()] for m in eng.models]
    assert [len(p.seen) for p in probes] == [2] * N  # one call per replica per control sync


@pytest.mark.parametrize("mode", ["loop", "vmap"])
def test_a_submodule_kept_in_eval_mode_stays_so_after_the_probe(mode):
    """An audit: the probe ran in ``module.eval()`` and then ``module.train(was)``, which set every submodule to the
    root's mode: a BatchNorm the user kept in eval mode (its statistics frozen) trained again after the first control
    sync, silently. Now every submodule's own mode comes back, and the probe sees all of them in eval mode."""
    class ModeProbe(Probe):
        def __init__(self):
            super().__init__()
            self.modes = []

        def __call__(self, model):
            self.modes.append({m.training for m in model.modules()})
            return super().__call__(model)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
    probes = []

    def make_sched(o, rep, m):
        probes.append(ModeProbe())
        return hdet.OneCycleAutoLR(o, max_lr=0.05, total_steps=20, ensemble_lr_spread_ratio=0.5, model_sync_interval=5,
                                   enable_auto_lr=True, auto_lr_warmup_steps=0, model=m, replicas=rep,
                                   controller="fit", probe=probes[-1])

    eng = ReplicaEngine(model, 2, lambda m: torch.optim.AdamW(m.parameters(), lr=0.05), make_sched, mode=mode)
    for m in eng.models:
        m[1].eval()
    frozen = eng.models[0][1].running_mean.clone()
    for t in range(1, 16):
        eng.step([batch(r, t) for r in range(2)], _loss)
    assert [len(p.modes) for p in probes] == [3, 3] and all(modes == {False} for p in probes for modes in p.modes)
    for m in eng.models:
        assert m.training and m[0].training and not m[1].training
        assert torch.equal(m[1].running_mean, frozen)  # never updated: eval mode throughout


def test_lr_is_the_schedule_times_the_correction_within_bounds():
    eng, _ = _engine(N=4, steps=60, T=5, warm=5)
    ref = torch.optim.lr_scheduler.OneCycleLR(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.05),
                                              max_lr=0.05, total_steps=60)
    for t in range(1, 60):
        eng.step([batch(r, t) for r in range(4)], _loss)
        ref.step()
        s = eng.schedulers[0]
        ctrl = s.ensemble.controllers[0]
        factor = ctrl.factor if ctrl is not None else 1.0
        assert s.base_lrs_now[0] == pytest.approx(ref.get_last_lr()[0] * factor, rel=1e-9)
        assert 1 / 32 <= factor <= 32
    assert s.ensemble.controllers[0].updates == 11  # syncs 5..55


def test_tied_lr_groups_share_one_multiplier():
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))

    def make_opt(m):
        return torch.optim.AdamW([{"params": m[0].parameters()}, {"params": m[2].parameters()}], lr=0.05)

    def make_sched(o, rep, m):
        return hdet.OneCycleAutoLR(o, max_lr=0.05, total_steps=30, ensemble_lr_spread_ratio=0.5, model_sync_interval=5,
                                   enable_auto_lr=True, auto_lr_warmup_steps=5, model=m, replicas=rep,
                                   controller="fit", probe=Probe(), tie_lr_groups=True)

    eng = ReplicaEngine(model, 4, make_opt, make_sched, mode="loop")
    for t in range(1, 26):
        eng.step([batch(r, t) for r in range(4)], _loss)
        for s in eng.schedulers:
            assert s.multipliers[0] == s.multipliers[1]
    assert len({tuple(s.multipliers) for s in eng.schedulers}) == 4  # still one multiplier per replica


def test_fit_needs_a_probe_and_a_model():
    o = torch.optim.SGD(_model().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="probe="):
        hdet.OneCycleAutoLR(o, max_lr=0.1, total_steps=20, enable_auto_lr=True, auto_lr_warmup_steps=5,
                            model_sync_interval=5, controller="fit", model=_model())
    with pytest.raises(ValueError, match="model="):
        hdet.OneCycleAutoLR(o, max_lr=0.1, total_steps=20, enable_auto_lr=True, auto_lr_warmup_steps=5,
                            model_sync_interval=5, controller="fit", probe=Probe())
    with pytest.raises(ValueError, match="controller in"):
        hdet.OneCycleAutoLR(o, max_lr=0.1, total_steps=20, controller="pid")


def test_resume_mid_window_is_exact(tmp_path):
    """Save at step 13 (mid-window, window mean and controller state inside), load into a fresh engine."""
    def run(stop=None, resume=None):
        eng, _ = _engine(N=2, steps=30, T=5, warm=5, probe_cls=Probe)
        start = 0
        if resume is not None:
            ck = torch.load(resume, weights_only=False)
            for m, o, s, st in zip(eng.models, eng.optimizers, eng.schedulers, ck):
                m.load_state_dict(st["m"])
                o.load_state_dict(st["o"])
                s.load_state_dict(st["s"])
            for s in eng.schedulers:  # the probes' call counters (user objects)
                s.ensemble.probe.calls = ck[0]["calls"]
            torch.set_rng_state(ck[0]["rng"])  # dropout's masks
            start = ck[0]["t"]
        for t in range(start + 1, 31):
            eng.step([batch(r, t) for r in range(2)], _loss)
            if t == stop:
                torch.save([{"m": m.state_dict(), "o": o.state_dict(), "s": s.state_dict(), "t": t,
                             "calls": s.ensemble.probe.calls, "rng": torch.get_rng_state()}
                            for m, o, s in zip(eng.models, eng.optimizers, eng.schedulers)], tmp_path / "ck.pt")
                return None
        return [[p.detach().clone() for p in m.parameters()] for m in eng.models], \
            [s.ensemble.controllers[0].c for s in eng.schedulers]

    full_params, full_c = run()
    run(stop=13)
    res_params, res_c = run(resume=tmp_path / "ck.pt")
    assert res_c == full_c and full_c[0] != 0.0
    for a, b in zip(full_params, res_params):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def _train_kw(rank, world, kw):
    return train(rank, world, **kw)


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["loop", "vmap"])
def test_fit_engine_equals_gloo_processes(mode):
    """2 gloo processes (DDP, real collectives) and the engine: same weights, LRs and correction."""
    kw = dict(steps=30, alpha=0.3, T=10, auto=True, warm=10, opt="sgd", controller="fit")
    dist_res = check_ok(run_gloo(_train_kw, 2, kw))
    with one_thread():  # as the gloo workers (tests/helpers.py)
        eng = engine_run(2, mode=mode, **kw)
    for r in range(2):
        for p_eng, p_dist in zip(eng["params"][r], dist_res[r]["params"]):
            torch.testing.assert_close(p_eng, p_dist, rtol=1e-5, atol=1e-6)
        assert [row[r] for row in eng["lrs"]] == pytest.approx(dist_res[r]["lrs"], rel=1e-6)
    assert len(set(round(x, 12) for x in dist_res[0]["lrs"][11:])) > 1


def _tensors(x):
    """Every tensor in a nested state (dicts, lists), in order."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return []


def test_loading_a_state_leaves_the_callers_dict_alone():
    """A scheduler state saved mid-window (the fit controller's window mean inside) and loaded: training on
    leaves the caller's dict as it was (the window mean's sums were the caller's tensors, added into in place,
    so loading the same dict again gave other probe losses)."""
    eng, _ = _engine(N=2, steps=30, T=5, warm=5, probe_cls=Probe)
    for t in range(1, 14):
        eng.step([batch(r, t) for r in range(2)], _loss)
    states = [s.state_dict() for s in eng.schedulers]
    assert any(t.numel() > 1 for t in _tensors(states[0]))  # the window mean's sums are in it
    before = [[t.clone() for t in _tensors(st)] for st in states]
    again, _ = _engine(N=2, steps=30, T=5, warm=5, probe_cls=Probe)
    for m, m2, o, o2, s, st in zip(eng.models, again.models, eng.optimizers, again.optimizers, again.schedulers,
                                   states):
        m2.load_state_dict(m.state_dict())
        o2.load_state_dict(o.state_dict())
        s.load_state_dict(st)
    for t in range(14, 18):
        again.step([batch(r, t) for r in range(2)], _loss)
    for st, b in zip(states, before):
        assert all(torch.equal(x, y) for x, y in zip(_tensors(st), b))


def test_an_additive_slots_correction_does_not_wind_up_past_the_spreads_bounds():
    """Dropout (additive, in [0, 0.999]) under the fit controller, the probe favouring lower values for 20 syncs:
    the base sat clamped at 0 while the offset c ran on to -0.33, so after the signal reversed the base stayed at
    0 for 10 more syncs (the paper controller, which clamps its own value, moved after 3)."""
    import math

    from hdet.slots import LRControl, Slots
    from hdet.spread import Spread

    cfg = hdet.HDETConfig(enable_auto_lr=True, controller="fit", model_sync_interval=1)
    s = Slots(cfg, 4, ["lr/0"], [Spread("additive", 0.05, (0.0, 0.999))], ["dropout"])
    s.apply_schedule([0.01, 0.02], 0)
    bases = []
    for k in range(30):
        losses = [v if k < 20 else -v for v in s.values_of(1)]  # lower dropout better, then higher
        s.control(losses, losses, LRControl(bounds=[(0, math.inf)]), 30)
        s.apply_schedule([0.01, 0.02], 0)
        bases.append(s.bases[1])
        assert s.bases[1] + 1e-12 >= 0 and s.controllers[1].c >= -0.02 - 1e-12  # base 0.02 + c: never below 0
    assert bases[19] == 0.0 and bases[20] > 0.0  # off the bound at the first sync after the reversal
    rec = s.controllers[1]
    log_slot = Slots(cfg, 4, ["lr/0"], [Spread("log", 1.0, (0.0, 0.12))], ["wd"])  # a log spread, bounded above
    log_slot.apply_schedule([0.01, 0.1], 0)
    for k in range(10):
        losses = [-v for v in log_slot.values_of(1)]  # higher is better: the base sits at the bound 0.12
        steps = log_slot.control(losses, losses, LRControl(bounds=[(0, math.inf)]), 30)
        log_slot.apply_schedule([0.01, 0.1], 0)
        assert log_slot.controllers[1].c <= math.log(1.2) + 1e-12  # no further than the bound (it ran to log 32)
    assert log_slot.bases[1] == pytest.approx(0.12) and steps[1].clamped and steps[1].factor == pytest.approx(1.2)
    assert rec.c >= -0.02 - 1e-12


def test_eval_mode_runs_a_modules_own_train_and_eval():
    """A module whose train()/eval() do more than set the flag (a LoRA layer merging its adapter in eval mode) must
    see both calls: a review found the flags set back directly, the adapter left merged in training mode."""
    from hdet.window import eval_mode

    class Merging(nn.Linear):
        merged = False

        def train(self, mode=True):
            super().train(mode)
            self.merged = not mode
            return self

    net = nn.Sequential(Merging(2, 2), nn.BatchNorm1d(2))
    net[1].eval()  # kept in eval mode by the user
    with eval_mode(net):
        assert net[0].merged and not any(m.training for m in net.modules())
    assert net.training and net[0].training and not net[0].merged and not net[1].training


def test_the_window_mean_of_float64_parameters_keeps_their_precision():
    """The fit controller's window sum was float32 for every parameter: a float64 model's probe saw its mean iterate
    rounded to float32 (1 + 2e-12 read as 1.0). float64 parameters are now summed in float64."""
    from hdet.window import WindowMean

    m = nn.Linear(1, 1, bias=False).double()
    wm = WindowMean(list(m.parameters()))
    for k in (1, 2, 3):
        with torch.no_grad():
            m.weight.fill_(1.0 + k * 1e-12)
        wm.add()
    seen = []
    wm.probe(m, lambda model: seen.append(model.weight.item()) or torch.zeros(()))
    assert seen[0] == pytest.approx(1.0 + 2e-12, abs=1e-15) and seen[0] != 1.0
    assert m.weight.item() == 1.0 + 3e-12  # the weights came back
    state = wm.state_dict()  # a state saved in float32 (before float64 sums) loads as float64
    state["sum"] = [x.float() for x in state["sum"]]
    again = WindowMean(list(m.parameters()))
    again.load(again.parse(state))
    assert all(x.dtype == torch.float64 for x in again.sum)


@pytest.mark.parametrize("alpha", [0.2, 0.01, 0.005])
@pytest.mark.parametrize("n", [3, 8])
def test_the_fit_finds_the_minimum_of_a_narrow_spread(n, alpha):
    """An exact parabola with its minimum inside the spread, at a quarter of its half-width: found whatever the width
    (the degeneracy test was not scale invariant: under a spread of about 0.015 in log LR the fit was a straight line,
    and x* went to 2w, 8x the minimum; an audit). An additive beta2 spread (5e-4 wide) is fitted too."""
    from hdet.spread import Spread, linear_multipliers

    x = [math.log(r) for r in linear_multipliers(n, alpha)]
    w = (max(x) - min(x)) / 2
    y = [1.0 + 5.0 * (xi - 0.25 * w) ** 2 for xi in x]
    assert fit_parabola(x, y)[2] == pytest.approx(5.0, rel=1e-6)
    assert FitController().update(x, y).h_tilde == pytest.approx(0.25 * w, rel=1e-6)
    off = Spread("additive", 0.0005, (0.0, 0.9999)).offsets(4)
    y = [1.0 + 1e4 * (o - 1e-4) ** 2 for o in off]
    assert FitController(log_scale=False, bounds=(-1, 1)).update(off, y).h_tilde == pytest.approx(1e-4, rel=1e-6)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_probe_that_overflows_on_a_healthy_replica_ranks_it_worst(bad):
    """The probe overflows (inf, or NaN) on the replica at the highest multiplier, its weights finite; the others'
    probes fall with the LR's multiplier. The fit ranks it worst, a loss above the others', and moves the LR down, as
    with a finite 1e30 there (it was left out, and the fit of the rest moved the LR up: 1.107x; an audit)."""
    scheds = []

    def make_sched(o, rep, m):
        def probe(model, rep=rep):
            mult = scheds[rep.rank].multipliers[0]
            return torch.tensor(bad if mult == max(scheds[rep.rank].ensemble.rho) else 3.0 - mult)
        s = hdet.OneCycleAutoLR(o, max_lr=0.05, total_steps=40, ensemble_lr_spread_ratio=0.2, model_sync_interval=10,
                                enable_auto_lr=True, auto_lr_warmup_steps=10, model=m, replicas=rep,
                                controller="fit", probe=probe)
        scheds.append(s)
        return s
    torch.manual_seed(0)
    eng = ReplicaEngine(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1)), 4,
                        lambda m: torch.optim.AdamW(m.parameters(), lr=0.05), make_sched, mode="loop")
    for t in range(1, 11):
        eng.step([batch(r, t) for r in range(4)], lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]))
    step = scheds[0].last_sync.controller[0]
    worst = step.losses[scheds[0].ensemble.rho.index(max(scheds[0].ensemble.rho))]
    assert math.isfinite(worst) and worst > max(v for v in step.losses if v != worst)
    assert step.factor < 1.0


def test_finish_mid_window_starts_the_probes_window_mean_afresh():
    """finish() at step 13, then training goes on: the probe at 20 sees the mean of the iterates 14..20, as the loss
    window covers 14..20 (it saw 11..20: each replica's own iterates from before finish() averaged them; an audit)."""
    seen, iterates = [], {}

    def make_sched(o, rep, m):
        def probe(model):
            if rep.rank == 0:
                seen.append([p.detach().clone() for p in model.parameters()])
            return torch.tensor(1.0)
        return hdet.OneCycleAutoLR(o, max_lr=0.05, total_steps=40, ensemble_lr_spread_ratio=0.5,
                                   model_sync_interval=10, enable_auto_lr=True, auto_lr_warmup_steps=10, model=m,
                                   replicas=rep, controller="fit", probe=probe)
    torch.manual_seed(0)
    eng = ReplicaEngine(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1)), 2,
                        lambda m: torch.optim.AdamW(m.parameters(), lr=0.05), make_sched, mode="loop")
    now = {"t": 0}  # replica 0's iterate after each optimizer step (what the window mean takes, before a sync)
    eng.optimizers[0].register_step_post_hook(lambda o, a, k: iterates.__setitem__(
        now["t"], [p.detach().clone() for p in eng.models[0].parameters()]))
    for t in range(1, 21):
        now["t"] = t
        eng.step([batch(r, t) for r in range(2)], lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]))
        if t == 13:
            eng.finish()
    mean = [sum(iterates[t][i] for t in range(14, 21)) / 7 for i in range(len(seen[-1]))]
    for a, b in zip(seen[-1], mean):
        torch.testing.assert_close(a, b)


def test_no_finite_probe_is_no_verdict_and_moves_nothing():
    """Every replica's probe NaN (a window whose means were dropped at a load under FSDP2): the controller's
    correction and momentum stay as they were (read as a vote for x* = 0, the momentum still moved the LR by about
    5%, and halved); the update is counted."""
    ctrl = FitController()
    ctrl.update(LOG_RHO, [1.0 + 0.5 * x for x in LOG_RHO])  # a slope: momentum builds
    c, m, updates = ctrl.c, ctrl.m, ctrl.updates
    assert m != 0.0
    step = ctrl.update(LOG_RHO, [float("nan")] * len(LOG_RHO))
    assert (ctrl.c, ctrl.m, ctrl.updates, step.delta) == (c, m, updates + 1, 0.0)
    ctrl.update(LOG_RHO, [float("nan")] + [1.0] * (len(LOG_RHO) - 1))  # (one left out: still a fit of the others)
    assert ctrl.m != m


_LEVELS = {1: 1.0, 2: 0.9, 3: 0.8, 4: 0.81, 5: 0.82, 6: 0.83, 7: 0.9, 8: 0.79, 9: 0.78, 10: 0.77}  # each window's


def _goback_run(kind, steps=50, T=5, stop=None, state=None):
    """4 replicas whose window losses follow _LEVELS (best at sync 15, a rise at sync 35 that goes back there) and
    whose probe always prefers the highest LR (the fit controller raises it every sync); the base LR of each step."""
    def data(r, t):
        g = torch.Generator().manual_seed(1000 * t + r)
        x = torch.randn(16, 3, generator=g, dtype=torch.float64)
        return x, (x[:, :1] * 2 - x[:, 1:2]).sin(), torch.tensor(_LEVELS[(t - 1) // T + 1], dtype=torch.float64)

    def loss_fn(m, b):
        mse = nn.functional.mse_loss(m(b[0]), b[1])
        return mse - mse.detach() + b[2]
    eng = None

    def probe(m):
        r = [id(x) for x in eng.models].index(id(m))
        return torch.tensor(-math.log(eng.schedulers[r].multipliers[0]))

    def make(o, rep, m):
        kw = dict(ensemble_lr_spread_ratio=0.5, model_sync_interval=T, replicas=rep, model=m, on_runaway="recover",
                  judge_steps=T, enable_auto_lr=True)
        kw.update(probe=probe) if kind == "fit" else kw.update(controller="paper")
        return hdet.HDETLR(o, None, steps, **kw)
    torch.manual_seed(0)
    eng = ReplicaEngine(nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).double(), 4,
                        lambda m: torch.optim.Adam(m.parameters(), lr=0.01), make, mode="loop")
    if state is not None:
        eng.load_state_dict(state)
    bases, records = {}, []
    eng.schedulers[0].ensemble.on_sync.append(records.append)
    for t in range(eng.steps_taken + 1, steps + 1):
        bases[t] = eng.schedulers[0].base_lrs_now[0]
        eng.step([data(r, t) for r in range(4)], loss_fn)
        if t == stop:
            return roundtrip(eng.state_dict())
    return bases, records


@pytest.mark.parametrize("kind", ["fit", "paper"])
def test_a_go_back_takes_the_controllers_back_to_the_best_sync(kind):
    """on_runaway="recover" went back to the best sync's weights but kept the controller's moves since (made on the
    windows it discarded) and ran it at the go-back sync too: the fit controller's LR after the go-back and a 0.7
    cut was 3.64x the best sync's (an audit). The controllers go back with the weights (a paper controller's base
    cut as the schedule is), nothing is controlled at the go-back sync, and a resume goes on as the run does."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bases, records = _goback_run(kind)
        back = next(r for r in records if r.went_back_to is not None)
        assert (back.step, back.went_back_to, back.lr_scale) == (35, 15, 0.7) and back.controller is None
        # the window after the best sync ran at bases[16]; after the go-back, that times the cut
        assert bases[36] == pytest.approx(0.7 * bases[16], rel=1e-12)
        if kind == "fit":
            assert bases[16] > bases[15] and bases[35] > 2 * bases[16]  # it had raised the LR since
        resumed, _ = _goback_run(kind, state=_goback_run(kind, stop=25))
    assert all(resumed[t] == bases[t] for t in resumed) and len(resumed) == 25


def _built(n=4, make_model=None, **kw):
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    return ReplicaEngine(model, n, lambda m: torch.optim.SGD(m.parameters(), lr=0.1, weight_decay=0.01),
                         lambda o, rep, m: hdet.OneCycleAutoLR(
        o, max_lr=0.1, total_steps=30, model_sync_interval=5, replicas=rep,
        model=m if make_model is None else make_model(model, m),
        **{k: (v(o) if k == "explore" else v) for k, v in kw.items()}), mode="loop")


def _probe(m):
    return m(torch.ones(4, 2)).pow(2).mean()


@pytest.mark.parametrize("given", [{"auto_lr_bounds": (0.05, 0.06)}, {"final_lr": 0.05},
                                   {"auto_lr_bounds": (0.05, 0.06), "final_lr": 0.05}])
@pytest.mark.parametrize("auto", ["fit", "off"])
def test_options_only_the_paper_controller_reads_are_said_to_be_ignored(given, auto):
    """auto_lr_bounds= and final_lr= were taken under the fit controller (or auto-LR off) and did nothing, unsaid (an
    audit). Said now; under the paper controller, which reads them, nothing is said."""
    kw = {"enable_auto_lr": True, "auto_lr_warmup_steps": 10, "probe": _probe} if auto == "fit" else {}
    names = " and ".join(given)
    with pytest.warns(UserWarning, match=f"hdet: {names} given, but only the paper controller .* reads "
                                         f"{'them' if len(given) > 1 else 'it'}: ignored. "
                                         + ("The fit controller" if auto == "fit" else "Auto-LR is off")):
        _built(ensemble_lr_spread_ratio=0.3, **given, **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _built(ensemble_lr_spread_ratio=0.3, enable_auto_lr=True, auto_lr_warmup_steps=10, controller="paper", **given)
    assert not [w for w in caught if "only the paper controller" in str(w.message)]


@pytest.mark.parametrize("n, alpha, said", [(4, 0.0, "ensemble_lr_spread_ratio=0"), (1, 0.3, "one replica")])
def test_the_fit_controller_without_a_spread_says_it_never_moves(n, alpha, said):
    """The paper controller said it had no spread to rank; the fit controller sat still, unsaid (an audit)."""
    with pytest.warns(UserWarning, match=f"the fit controller with {said} has no spread of LRs to fit, so it never "
                                         "moves the LR"):
        eng = _built(n, ensemble_lr_spread_ratio=alpha, enable_auto_lr=True, auto_lr_warmup_steps=10, probe=_probe)
    for _ in range(30):
        eng.step([torch.randn(8, 2)] * n, lambda m, b: m(b).pow(2).mean())
    assert eng.schedulers[0].ensemble.controllers[0].factor == 1.0


def test_the_fit_controller_without_an_lr_spread_says_the_explored_values_are_still_fitted():
    with pytest.warns(UserWarning, match=r"never moves the LR: the run trains at the base schedule \(the explored "
                                         r"hyperparameters are still fitted\)$"):
        _built(ensemble_lr_spread_ratio=0.0, enable_auto_lr=True, auto_lr_warmup_steps=10, probe=_probe,
               explore=lambda o: [hdet.WeightDecay(o, alpha=1.0)])


def test_the_engine_refuses_a_scheduler_given_another_model_than_its_replicas():
    """make_scheduler passing model= the model given to the engine (not the replica's m): the fit controller probed
    that one model for every replica, and each converge step averaged its buffers, unsaid (an audit)."""
    kw = {"ensemble_lr_spread_ratio": 0.3, "enable_auto_lr": True, "auto_lr_warmup_steps": 10, "probe": _probe}
    with pytest.raises(ValueError, match=r"Expected make_scheduler to pass model= the replica's own module \(its third "
                                         r"argument\), but replica 0's scheduler got a Linear that holds none of"):
        _built(make_model=lambda outer, m: outer, **kw)
    wrapped = _built(make_model=lambda outer, m: nn.Sequential(m), **kw)  # (a wrapper of the replica's: fine)
    assert wrapped.schedulers[1].ensemble.model[0] is wrapped.models[1]
