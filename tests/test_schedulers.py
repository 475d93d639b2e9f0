import contextlib
import math
import random
import warnings

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import CosineAnnealingLR, ExponentialLR, LambdaLR, OneCycleLR

import hdet
from hdet import HDETLR, FitController, OneCycleAutoLR, linear_multipliers
from helpers import ScriptedReplicas, roundtrip


def _opt(kind="sgd", groups=1, lr=0.1):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    params = [{"params": m[0].parameters()}, {"params": m[1].parameters()}] if groups == 2 else m.parameters()
    if kind == "sgd":
        return m, torch.optim.SGD(params, lr=lr, momentum=0.9)
    return m, torch.optim.Adam(params, lr=lr)


ONECYCLE_CASES = [
    dict(max_lr=0.1, total_steps=60),
    dict(max_lr=0.1, epochs=3, steps_per_epoch=20),
    dict(max_lr=0.05, total_steps=50, pct_start=0.5, anneal_strategy="linear", div_factor=10.0,
         final_div_factor=100.0),
    dict(max_lr=0.1, total_steps=45, three_phase=True, cycle_momentum=False),
    dict(max_lr=[0.1, 0.02], total_steps=40, base_momentum=[0.8, 0.7], max_momentum=[0.9, 0.95]),
]


@pytest.mark.parametrize("kwargs", ONECYCLE_CASES)
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_alpha_zero_equals_onecyclelr_exactly(kwargs, kind):
    groups = 2 if isinstance(kwargs["max_lr"], list) else 1
    _, o1 = _opt(kind, groups)
    _, o2 = _opt(kind, groups)
    s1 = OneCycleLR(o1, **kwargs)
    s2 = OneCycleAutoLR(o2, **kwargs, model_sync_interval=7)
    total = s1.total_steps
    mom = "betas" if kind == "adam" else "momentum"
    for _ in range(total):
        assert s1.get_last_lr() == s2.get_last_lr()
        assert [g[mom] for g in o1.param_groups] == [g[mom] for g in o2.param_groups]
        o1.step()
        o2.step()
        s1.step()
        s2.step(torch.tensor(0.5))
    assert s1.get_last_lr() == s2.get_last_lr()


@pytest.mark.parametrize("world", [2, 4])
def test_spread_applied_from_first_step(world):
    for rank in range(world):
        _, o = _opt()
        _, o_ref = _opt()
        ref = OneCycleLR(o_ref, max_lr=0.1, total_steps=40)
        s = OneCycleAutoLR(o, max_lr=0.1, total_steps=40, ensemble_lr_spread_ratio=0.3,
                           model_sync_interval=10, replicas=ScriptedReplicas(rank, world))
        rho = linear_multipliers(world, 0.3)[rank]
        for _ in range(40):
            assert s.get_last_lr()[0] == pytest.approx(ref.get_last_lr()[0] * rho, rel=1e-15)
            o.step(); o_ref.step()
            s.step(1.0); ref.step()


def _reference_auto_lr(S, T, S_warm, N, rank, alpha, sigma, beta, lam, seed, base_of_t, min_lrs, max_lrs, script):
    """Eqs. 1, 4-9 written out independently, in plain Python, per param group."""
    delta_ = max((N - 1) / 2, 0.5)
    rho = [1 + alpha * (r - (N - 1) / 2) / delta_ for r in range(N)]
    G = len(min_lrs)
    perm = [list(range(N)) for _ in range(G)]
    gen = torch.Generator().manual_seed(seed)
    controlled = [None] * G
    v = [0.0] * G
    gamma = [None] * G
    cur = list(base_of_t(0))
    out = [[cur[j] * rho[perm[j][rank]] for j in range(G)]]
    k = 0
    for t in range(1, S + 1):
        if t % T == 0 and t >= S_warm:
            L = script[k]
            k += 1
            L_bar = sum(L) / N
            e = [math.exp((L_bar - Lr) / sigma) for Lr in L]
            w = [x / sum(e) for x in e]
            for j in range(G):
                if gamma[j] is None:
                    K = (S - S_warm) / T
                    gamma[j] = 1 - (min_lrs[j] / cur[j]) ** (1 / K)
                vals = [cur[j] * rho[perm[j][r]] for r in range(N)]
                d = sum(wr * x for wr, x in zip(w, vals)) - sum(vals) / N
                v[j] = beta * v[j] + (1 - beta) * d
                new = (sum(vals) / N) * (1 - gamma[j]) + lam * v[j]
                controlled[j] = min(max(new, min_lrs[j]), 10 * max_lrs[j])
                perm[j] = torch.randperm(N, generator=gen).tolist()
        b = base_of_t(t)
        cur = [controlled[j] if controlled[j] is not None else b[j] for j in range(G)]
        out.append([cur[j] * rho[perm[j][rank]] for j in range(G)])
    return out


@pytest.mark.parametrize("rank", [0, 3])
def test_auto_lr_matches_plain_python_equations(rank):
    S, T, S_warm, N = 200, 10, 50, 4
    cfg = dict(alpha=0.25, sigma=0.05, beta=0.8, lam=0.7, seed=5)
    rng = random.Random(1)
    script = [[1.0 + 0.1 * rng.uniform(-1, 1) for _ in range(N)] for _ in range(S // T)]
    calls = iter(script)

    def window_losses():
        return next(calls)

    _, o = _opt("adam", groups=2)
    s = OneCycleAutoLR(o, max_lr=[0.01, 0.002], total_steps=S, ensemble_lr_spread_ratio=cfg["alpha"],
                       model_sync_interval=T, auto_lr_warmup_steps=S_warm, controller="paper", enable_auto_lr=True,
                       loss_scale=cfg["sigma"], momentum_of_lr=cfg["beta"], lr_of_lr=cfg["lam"],
                       seed=cfg["seed"], replicas=ScriptedReplicas(rank, N, None))
    # only syncs from S_warm on consume the script: pre-warmup syncs gather but do not control
    s.ensemble.replicas.window_losses = lambda: next(calls) if s.last_epoch + 1 >= S_warm else [1.0] * N
    _, o_ref = _opt("adam", groups=2)
    ref_sched = OneCycleLR(o_ref, max_lr=[0.01, 0.002], total_steps=S)
    bases = [ref_sched.get_last_lr()]
    for _ in range(S):
        o_ref.step(); ref_sched.step()
        bases.append(ref_sched.get_last_lr())
    min_lrs = [g["min_lr"] for g in o_ref.param_groups]
    expected = _reference_auto_lr(S, T, S_warm, N, rank, cfg["alpha"], cfg["sigma"], cfg["beta"], cfg["lam"],
                                  cfg["seed"], lambda t: bases[t], min_lrs, [0.01, 0.002], script)
    got = [s.get_last_lr()]
    for _ in range(S):
        o.step()
        s.step(1.0)
        got.append(s.get_last_lr())
        assert all(isinstance(g["lr"], float) for g in o.param_groups)
    for t, (g, e) in enumerate(zip(got[:S], expected[:S])):
        assert g == pytest.approx(e, rel=1e-6), f"step {t}"
    assert s.closed and got[S] == pytest.approx(s.base_lrs_now, rel=1e-12)  # (closed after step S: the base's)
    # the controller really moved the schedule away from OneCycle, per group differently
    assert abs(got[-2][0] / bases[-2][0] - 1) > 1e-3
    assert s.ensemble.controllers[0].updates == (S - S_warm) // T + 1


def _auto_lr_run(eq8, bounds=None, S=300, T=10, S_warm=100):
    _, o = _opt("adam")
    s = OneCycleAutoLR(o, max_lr=0.01, total_steps=S, ensemble_lr_spread_ratio=0.2, model_sync_interval=T,
                       auto_lr_warmup_steps=S_warm, controller="paper", enable_auto_lr=True, eq8=eq8, auto_lr_bounds=bounds,
                       replicas=ScriptedReplicas(1, 4, lambda: [2.0] * 4))
    bases = []
    for _ in range(S):
        o.step()
        s.step(2.0)
        bases.append(s.base_lrs_now[0])
    return s, o, bases


def test_eq8_decay_default_stays_below_max_lr_with_equal_losses():
    s, o, bases = _auto_lr_run("decay")
    max_lr, min_lr = o.param_groups[0]["max_lr"], o.param_groups[0]["min_lr"]
    assert max(bases) <= max_lr
    # monotone decay from the auto-LR start toward OneCycle's floor, reached at the last sync
    after = bases[100:]
    assert all(b2 <= b1 for b1, b2 in zip(after, after[1:]))
    assert bases[-1] == pytest.approx(min_lr, rel=1e-6)


def test_eq8_as_printed_grows_the_lr():
    _, o, bases = _auto_lr_run("as_printed", bounds=(0.0, math.inf))
    start = bases[99]
    assert bases[-1] / start == pytest.approx(400.0, rel=1e-6)  # the paper's sign: LR x400
    assert bases[-1] > o.param_groups[0]["max_lr"]
    # with the default bounds it is capped at 10 x max_lr
    _, o, bases = _auto_lr_run("as_printed")
    assert max(bases) == pytest.approx(10 * o.param_groups[0]["max_lr"])


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.Adam(p, lr=0.01, foreach=True),
    lambda p: torch.optim.AdamW(p, lr=0.01, fused=True),
    lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, foreach=True),
])
def test_lr_stays_float_and_foreach_fused_optimizers_work(make_opt):
    torch.manual_seed(0)
    m = nn.Linear(4, 1)
    o = make_opt(m.parameters())
    s = OneCycleAutoLR(o, max_lr=0.01, total_steps=40, ensemble_lr_spread_ratio=0.2, model_sync_interval=5,
                       auto_lr_warmup_steps=5, controller="paper", enable_auto_lr=True,
                       replicas=ScriptedReplicas(0, 4, lambda: [1.0, 0.9, 1.1, 1.0]))
    x = torch.randn(8, 4)
    for _ in range(40):
        loss = m(x).pow(2).mean()
        o.zero_grad()
        loss.backward()
        o.step()
        s.step(loss)
        assert isinstance(o.param_groups[0]["lr"], float)
    assert s.ensemble.controllers[0].updates == 8


class _HostReadSpy(torch.Tensor):
    """A loss tensor that records every host read (item, float, tolist, numpy, bool, cpu copies)."""

    reads: list = []
    _HOST = {"item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__", "cpu", "__format__",
             "__repr__", "__array__"}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name in cls._HOST:
            cls.reads.append(name)
        return super().__torch_function__(func, types, args, kwargs or {})


def test_no_host_read_of_the_loss_off_sync_steps():
    _, o = _opt()
    s = OneCycleAutoLR(o, max_lr=0.1, total_steps=30, model_sync_interval=10, auto_lr_warmup_steps=10,
                       controller="paper", enable_auto_lr=True, ensemble_lr_spread_ratio=0.1)
    _HostReadSpy.reads = []
    for t in range(1, 30):
        loss = torch.tensor(1.0 + t).as_subclass(_HostReadSpy)
        o.step()
        s.step(loss)
        if t % 10 != 0:
            assert _HostReadSpy.reads == [], f"host read of the loss at step {t}: {_HostReadSpy.reads}"
        _HostReadSpy.reads = []


def test_scheduler_never_touches_global_rng():
    m, o = _opt()
    torch.manual_seed(123)
    state = torch.get_rng_state()
    s = OneCycleAutoLR(o, max_lr=0.1, total_steps=50, ensemble_lr_spread_ratio=0.2, model_sync_interval=5,
                       auto_lr_warmup_steps=5, controller="paper", enable_auto_lr=True,
                       replicas=ScriptedReplicas(2, 4, lambda: [1.0, 1.1, 0.9, 1.0]))
    for _ in range(50):
        o.step()
        s.step(1.0)
    assert torch.equal(torch.get_rng_state(), state)


def test_constructor_does_not_touch_weights():
    m, o = _opt()
    before = [p.detach().clone() for p in m.parameters()]
    OneCycleAutoLR(o, max_lr=0.1, total_steps=50, ensemble_lr_spread_ratio=0.5, model_sync_interval=5, model=m)
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))


def _run_and_save(kw, replicas, S, stop):
    """An Adam + OneCycleAutoLR(**kw) run of S steps with a loss of 1: the scheduler, every step's LRs, and the
    scheduler's and optimizer's states after step ``stop`` (through torch.save / load)."""
    _, o = _opt("adam")
    s = OneCycleAutoLR(o, **kw, replicas=replicas)
    full = []
    for t in range(S):
        o.step()
        s.step(torch.tensor(1.0))
        full.append(s.get_last_lr())
        if t + 1 == stop:
            saved_sched, saved_opt = roundtrip(s.state_dict()), roundtrip(o.state_dict())
    return s, full, saved_sched, saved_opt


@pytest.mark.parametrize("stop", [20, 23])
def test_state_dict_resume_into_differently_built_instance(stop):
    S = 60
    script = lambda: [1.0, 1.2, 0.8, 1.1]  # noqa: E731
    kw = dict(max_lr=0.05, total_steps=S, ensemble_lr_spread_ratio=0.2, model_sync_interval=5,
              auto_lr_warmup_steps=10, controller="paper", enable_auto_lr=True, loss_scale=0.05)
    s, full, saved_sched, saved_opt = _run_and_save(kw, ScriptedReplicas(1, 4, script), S, stop)
    _, o2 = _opt("adam")
    s2 = OneCycleAutoLR(o2, max_lr=0.5, total_steps=S, ensemble_lr_spread_ratio=0.0, model_sync_interval=3,
                        controller="paper", enable_auto_lr=False, seed=9, replicas=ScriptedReplicas(1, 4, script))
    o2.load_state_dict(saved_opt)
    s2.load_state_dict(saved_sched)
    ref = s.state_dict()  # compare every field at the stop point
    a = roundtrip(s2.state_dict())
    for key in saved_sched:
        if key != "hdet":
            assert _eq(a[key], saved_sched[key]), key
    for key in saved_sched["hdet"]:
        assert _eq(a["hdet"][key], saved_sched["hdet"][key]), key
    assert s2.get_last_lr() == full[stop - 1]
    resumed = []
    for _ in range(stop, S):
        o2.step()
        s2.step(torch.tensor(1.0))
        resumed.append(s2.get_last_lr())
    assert resumed == full[stop:]
    assert ref["hdet"]["controllers"][0]["updates"] > 0


def _eq(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_eq(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_eq(x, y) for x, y in zip(a, b))
    return a == b


def test_load_state_dict_rejects_foreign_state():
    _, o = _opt()
    s = OneCycleAutoLR(o, max_lr=0.1, total_steps=10)
    _, o2 = _opt()
    plain = OneCycleLR(o2, max_lr=0.1, total_steps=10)
    with pytest.raises(ValueError, match="Expected a OneCycleAutoLR state_dict"):
        s.load_state_dict(plain.state_dict())
    good = s.state_dict()
    for corrupt, match in [
        (lambda st: st["hdet"].pop("dealer"), r"lacks \['dealer'\]: a corrupted or foreign state_dict"),
        (lambda st: st["hdet"].__setitem__("perms", [[0, 0]]), "a corrupted state_dict"),
        (lambda st: st["hdet"].__setitem__("current_bases", [float("nan")]), "a corrupted state_dict"),
        (lambda st: st.__setitem__("hdet", [1, 2]), "Expected an hdet ensemble state \\(a dict\\), but got list"),
    ]:
        st = roundtrip(good)
        corrupt(st)
        with pytest.raises(ValueError, match=match):
            s.load_state_dict(st)


def test_elastic_resume_keeps_bases_and_velocity_and_redeals():
    """A state saved by 4 replicas (controller running) resumed on 2 and on 8: bases and velocities are
    kept, multipliers are re-dealt for the new N (a permutation of its rho, the same on every replica),
    the loss window is dropped, a warning says so, and training goes on."""
    kw = dict(max_lr=0.05, total_steps=60, ensemble_lr_spread_ratio=0.2, model_sync_interval=5,
              auto_lr_warmup_steps=10, controller="paper", enable_auto_lr=True, loss_scale=0.05)
    _, o = _opt("adam")
    s = OneCycleAutoLR(o, **kw, replicas=ScriptedReplicas(1, 4, lambda: [1.0, 1.2, 0.8, 1.1]))
    for _ in range(23):
        o.step()
        s.step(torch.tensor(1.0))
    saved = roundtrip(s.state_dict())
    for M in (2, 8):
        perms = []
        for r in range(M):
            _, o2 = _opt("adam")
            s2 = OneCycleAutoLR(o2, **kw, replicas=ScriptedReplicas(r, M, lambda M=M: [1.0] * M))
            with pytest.warns(UserWarning, match=f"elastic resume from 4 to {M} replicas"):
                s2.load_state_dict(saved)
            e = s2.ensemble
            assert e.current_bases == s.ensemble.current_bases
            assert e.controllers[0].v == s.ensemble.controllers[0].v and e.controllers[0].updates == 3
            assert e.rho == hdet.linear_multipliers(M, 0.2) and sorted(e.perms[0]) == list(range(M))
            assert e.window.count == 0
            perms.append(e.perms)
            assert s2.get_last_lr()[0] == pytest.approx(e.current_bases[0] * e.rho[e.perms[0][r]])
            for _ in range(10):
                o2.step()
                s2.step(torch.tensor(1.0))
            assert math.isfinite(s2.get_last_lr()[0]) and s2.get_last_lr()[0] > 0
        assert all(p == perms[0] for p in perms)  # one shared deal


@pytest.mark.parametrize("kwargs,match", [
    (dict(ensemble_lr_spread_ratio=-0.1), r"0 <= ensemble_lr_spread_ratio \(alpha\) < 1, but got -0.1"),
    (dict(ensemble_lr_spread_ratio=1.0), r"0 <= ensemble_lr_spread_ratio \(alpha\) < 1, but got 1.0"),
    (dict(model_sync_interval=0), r"model_sync_interval >= 1, but got 0"),
    (dict(model_sync_interval=2.5), r"model_sync_interval >= 1, but got 2.5"),
    (dict(controller="paper", enable_auto_lr=True, auto_lr_warmup_steps=100), r"auto_lr_warmup_steps < total_steps.*got "
                                                         r"auto_lr_warmup_steps=100 and total_steps=50"),
    (dict(controller="paper", enable_auto_lr=True, auto_lr_warmup_steps=10, model_sync_interval=60), r"controller would never run"),
    (dict(loss_scale=0.0), r"loss_scale \(sigma\) > 0, but got 0.0"),
    (dict(loss_scale=-1), r"loss_scale \(sigma\) > 0, but got -1"),
    (dict(momentum_of_lr=1.0), r"0 <= momentum_of_lr \(beta\) < 1, but got 1.0"),
    (dict(momentum_of_lr=-0.5), r"0 <= momentum_of_lr \(beta\) < 1, but got -0.5"),
    (dict(lr_of_lr=-1.0), r"lr_of_lr \(lambda\) >= 0, but got -1.0"),
    (dict(eq8="bogus"), r"eq8 to be 'decay' or 'as_printed', but got 'bogus'"),
    (dict(world_size=4), r"rank=0 and world_size=1 without an initialised torch.distributed process group"),
    (dict(auto_lr_bounds=(1.0, 0.5)), r"auto_lr_bounds as \(low, high\)"),
    (dict(seed=-3), r"seed >= 0 and < 9223372036854775808, but got -3"),
    (dict(final_div_factor=-1), r"final_div_factor as a finite number > 0, but got -1"),
    (dict(div_factor=0), r"div_factor as a finite number > 0, but got 0"),
])
def test_bad_input_raises_value_error_naming_argument(kwargs, match):
    """...and leaves the optimizer's param groups as they were (OneCycleLR rewrites them before hdet's checks: a
    caller who fixed the argument and built again started from max_lr / div_factor with stale OneCycle keys)."""
    _, o = _opt()
    before = [{k: v for k, v in g.items() if k != "params"} for g in o.param_groups]
    with pytest.raises(ValueError, match=match):
        OneCycleAutoLR(o, max_lr=0.1, total_steps=50, **kwargs)
    assert [{k: v for k, v in g.items() if k != "params"} for g in o.param_groups] == before


def test_a_failed_construction_puts_a_tensor_lr_back_in_place():
    """A tensor LR (fused or capturable optimizers keep one) is written in place by torch's first step: a failed
    construction put the same, changed, tensor back (a review). Its value is restored, in the same tensor."""
    _, o = _opt()
    o.param_groups[0]["lr"] = lr = torch.tensor(0.01)
    with pytest.raises(ValueError, match="seed"):
        OneCycleAutoLR(o, max_lr=0.1, total_steps=50, seed=-3)
    assert o.param_groups[0]["lr"] is lr and torch.equal(lr, torch.tensor(0.01))


def test_stepping_past_total_steps():
    _, o = _opt()
    s = OneCycleAutoLR(o, max_lr=0.1, total_steps=5)
    for _ in range(5):
        o.step()
        s.step()
    o.step()
    with pytest.raises(ValueError, match="at most total_steps=5 calls of scheduler.step.*this is call 6"):
        s.step()


def test_step_without_loss_when_auto_lr_needs_it():
    _, o = _opt()
    s = OneCycleAutoLR(o, max_lr=0.1, total_steps=30, model_sync_interval=10, auto_lr_warmup_steps=10,
                       controller="paper", enable_auto_lr=True)
    for _ in range(9):
        o.step()
        s.step()
    o.step()
    with pytest.raises(ValueError, match=r"enable_auto_lr=True needs the training loss.*scheduler.step\(loss\)"):
        s.step()


def test_bad_loss_shape():
    _, o = _opt()
    s = OneCycleAutoLR(o, max_lr=0.1, total_steps=30)
    with pytest.raises(ValueError, match=r"Expected a scalar loss, but got a tensor of shape \(3,\)"):
        s.step(torch.ones(3))


def test_single_replica_non_finite_loss_is_counted_and_the_run_goes_on():
    """A non-finite loss with finite weights is a handled fault (issue 17.9): counted, reported, ranked
    worst, and the run goes on; the next window starts clean. on_nonfinite='raise' stops, naming it."""
    _, o = _opt()
    s = OneCycleAutoLR(o, max_lr=0.1, total_steps=30, model_sync_interval=5)
    for t in range(1, 5):
        o.step()
        s.step(torch.tensor(float("inf")) if t == 3 else torch.tensor(1.0))
    o.step()
    with pytest.warns(UserWarning, match=r"replica\(s\) \[0\] had non-finite training losses \(\[1\] in the window\)"):
        s.step(torch.tensor(2.0))
    assert s.last_sync.nonfinite_losses == [1] and s.last_sync.recovered == []
    for t in range(6, 11):  # the next window holds no stale Inf: no warning, no error
        o.step()
        s.step(torch.tensor(1.0))
    assert s.last_sync.step == 10 and s.last_sync.nonfinite_losses == [0] and s.last_sync.losses == [1.0]

    _, o = _opt()
    s = OneCycleAutoLR(o, max_lr=0.1, total_steps=30, model_sync_interval=5, on_nonfinite="raise")
    for t in range(1, 5):
        o.step()
        s.step(torch.tensor(float("nan")) if t == 3 else torch.tensor(1.0))
    o.step()
    with pytest.raises(hdet.NonFiniteReplicaError, match=r"non-finite training losses on replica\(s\) \[0\]"):
        s.step(torch.tensor(1.0))


# ------------------------------------------------------------------ the general form
def test_hdetlr_alpha_zero_equals_wrapped_scheduler():
    _, o1 = _opt()
    _, o2 = _opt()
    ref = CosineAnnealingLR(o1, T_max=30, eta_min=1e-4)
    s = HDETLR(o2, CosineAnnealingLR(o2, T_max=30, eta_min=1e-4), total_steps=30, model_sync_interval=4)
    for _ in range(30):
        assert s.get_last_lr() == pytest.approx(ref.get_last_lr(), rel=1e-12)
        o1.step(); o2.step()
        ref.step(); s.step(1.0)


def test_hdetlr_chainable_base_is_not_compounded_by_the_multiplier():
    _, o1 = _opt()
    _, o2 = _opt()
    ref = ExponentialLR(o1, gamma=0.9)
    s = HDETLR(o2, ExponentialLR(o2, gamma=0.9), total_steps=30, ensemble_lr_spread_ratio=0.5,
               model_sync_interval=4, replicas=ScriptedReplicas(3, 4))
    rho = linear_multipliers(4, 0.5)[3]
    for _ in range(30):
        assert s.get_last_lr()[0] == pytest.approx(ref.get_last_lr()[0] * rho, rel=1e-12)
        o1.step(); o2.step()
        ref.step(); s.step(1.0)


@pytest.mark.parametrize("factor", ["lr cut", "controller"])
def test_hdetlr_chainable_base_is_not_compounded_by_a_cut_or_a_correction(factor):
    """A chainable base schedule steps from its own last value: an LR cut (on_runaway's) or the fit controller's
    correction multiplies the schedule once, as with an equivalent LambdaLR, instead of compounding at every step
    (with ExponentialLR, a cut of 0.5 halved the LR again at every later step, silently)."""
    _, o1 = _opt()
    _, o2 = _opt()
    kw = dict(total_steps=30, ensemble_lr_spread_ratio=0.5, model_sync_interval=4)
    chained = HDETLR(o1, ExponentialLR(o1, gamma=0.9), replicas=ScriptedReplicas(3, 4), **kw)
    lam = HDETLR(o2, LambdaLR(o2, lambda t: 0.9 ** t), replicas=ScriptedReplicas(3, 4), **kw)
    for t in range(1, 30):
        for s in (chained, lam):
            s.optimizer.step()
            s.step(1.0)
            if t == 4:
                if factor == "lr cut":
                    s.ensemble.slots.cut_lr(0.5)
                else:  # the fit controller's correction of the schedule (x1.5), as a sync sets it
                    s.ensemble.slots.controllers[0] = FitController(c=math.log(1.5))
                    s.ensemble.slots.refresh()
                s.reapply()
        assert chained.get_last_lr()[0] == pytest.approx(lam.get_last_lr()[0], rel=1e-9), t
    assert chained.get_last_lr()[0] == pytest.approx(
        0.1 * 0.9 ** 29 * (0.5 if factor == "lr cut" else 1.5) * linear_multipliers(4, 0.5)[3], rel=1e-9)


def test_hdetlr_callable_per_group_and_each_group_its_own_permutation():
    _, o = _opt(groups=2)
    base = lambda t: [0.1 * (1 - t / 100), 0.01]  # noqa: E731
    s = HDETLR(o, base, total_steps=100, ensemble_lr_spread_ratio=0.3, model_sync_interval=5,
               controller="paper", enable_auto_lr=True, auto_lr_warmup_steps=0, final_lr=[1e-3, 1e-3],
               replicas=ScriptedReplicas(0, 8, lambda: [1.0 + 0.01 * r for r in range(8)]))
    assert s.get_last_lr() == pytest.approx([0.1 * 0.7, 0.01 * 0.7])
    differ = 0
    for _ in range(100):
        o.step()
        s.step(1.0)
        perms = s.ensemble.perms
        assert all(sorted(p) == list(range(8)) for p in perms)
        differ += perms[0] != perms[1]
        assert all(isinstance(g["lr"], float) for g in o.param_groups)
    assert differ > 50
    # lower-LR replicas scripted as better: the controller pushes the base below the schedule
    assert s.base_lrs_now[1] < 0.01


def test_hdetlr_rejects_bad_base():
    _, o = _opt()
    _, other = _opt()
    with pytest.raises(ValueError, match="same optimizer"):
        HDETLR(o, CosineAnnealingLR(other, T_max=5), total_steps=5)
    with pytest.raises(ValueError, match="Expected base to be an LRScheduler, a callable"):
        HDETLR(o, 3.0, total_steps=5)
    with pytest.raises(ValueError, match="positive integer total_steps, but got 0"):
        HDETLR(o, None, total_steps=0)


# ------------------------------------------------------------------ warm init (Eq. 10)
def test_warm_init_eq10_std_and_independent_per_rank():
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(50, 50), nn.Linear(50, 10))
    theta0 = torch.cat([p.detach().flatten() for p in base.parameters()])
    replicas = []
    models = [nn.Sequential(nn.Linear(50, 50), nn.Linear(50, 10)) for _ in range(2)]
    rng_state = torch.get_rng_state()
    for rank, m in enumerate(models):
        m.load_state_dict(base.state_dict())
        std = hdet.warm_init_(m, rank=rank, nu=0.01)
        assert std == pytest.approx(0.01 * theta0.norm().item() / theta0.numel() ** 0.5, rel=1e-5)
        eps = torch.cat([p.detach().flatten() for p in m.parameters()]) - theta0
        assert eps.std().item() == pytest.approx(std, rel=0.05)
        replicas.append(eps)
    assert torch.equal(torch.get_rng_state(), rng_state)
    assert torch.corrcoef(torch.stack(replicas))[0, 1].abs() < 0.05
    with pytest.raises(ValueError, match="nu >= 0, but got -1"):
        hdet.warm_init_(base, nu=-1)


def test_warm_init_leaves_frozen_parameters_alone():
    """A frozen parameter is never averaged (the optimizer does not hold it), so noise on it would stay in each
    replica for good, the evaluated and saved replica 0's included: warm_init_ on a module perturbs the
    trainable parameters only."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    m[0].weight.requires_grad_(False)
    frozen = m[0].weight.detach().clone()
    trainable = m[1].weight.detach().clone()
    hdet.warm_init_(m, rank=1, nu=0.1)
    assert torch.equal(m[0].weight, frozen) and not torch.equal(m[1].weight, trainable)


def test_buffers_averaged_are_persistent_floats_and_masks_may_hold_inf():
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    m.register_buffer("mask", torch.full((2, 2), float("-inf")), persistent=False)
    m.register_buffer("table", torch.tensor([0.0, float("-inf")]))  # persistent, -inf is allowed
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    s = OneCycleAutoLR(o, max_lr=0.1, total_steps=4, model_sync_interval=2, model=m)
    got = {n for n, b in m.named_buffers() for t in s.ensemble.tensors() if t.data_ptr() == b.data_ptr()}
    assert got == {"1.running_mean", "1.running_var", "table"}
    for _ in range(2):
        o.step()
        s.step(1.0)  # the sync at step 2 accepts -inf in buffers
    with torch.no_grad():
        m[1].running_mean[0] = float("nan")
    for _ in range(2):
        o.step()
        with pytest.raises(hdet.NonFiniteReplicaError) if _ == 1 else contextlib.nullcontext():
            s.step(1.0)


def test_average_optimizer_state_option_adds_moments_not_step():
    torch.manual_seed(0)
    m = nn.Linear(3, 2)
    o = torch.optim.Adam(m.parameters(), lr=0.01)
    seen = []

    class Recording(ScriptedReplicas):
        def average_(self, tensors, exclude=(), into=None):
            seen.append([t.data_ptr() for t in tensors])

    s = OneCycleAutoLR(o, max_lr=0.01, total_steps=4, model_sync_interval=2, average_optimizer_state=True,
                       replicas=Recording(0, 2))
    m(torch.randn(4, 3)).sum().backward()
    for _ in range(2):
        o.step()
        s.step(1.0)
    state_ptrs = {k: [o.state[p][k].data_ptr() for p in m.parameters()] for k in ("exp_avg", "exp_avg_sq", "step")}
    assert len(seen) == 1 and len(seen[0]) == 2 + 4
    assert set(state_ptrs["exp_avg"] + state_ptrs["exp_avg_sq"]) <= set(seen[0])
    assert not set(state_ptrs["step"]) & set(seen[0])


def test_a_state_saved_with_recovery_on_resumes_with_it_whatever_the_scheduler_was_built_with():
    """Saved at step 20 with on_runaway="recover", loaded into a scheduler built without it (or with other
    settings): the saved settings drive everything, the stability guard included (before, the state's config
    replaced the built one but the guard kept the constructor's, so the rise at step 25 went unanswered), and a
    warning names each replaced setting."""
    S, stop = 60, 20

    def script(start):
        k = {"n": start}

        def losses():
            k["n"] += 1
            return [1.0 * 0.9 ** k["n"]] * 4 if k["n"] <= 4 else [2.0] * 4  # the ensemble's loss rises at sync 5
        return losses

    kw = dict(max_lr=0.05, total_steps=S, ensemble_lr_spread_ratio=0.2, model_sync_interval=5, on_runaway="recover",
              judge_steps=1)
    s, full, saved_sched, saved_opt = _run_and_save(kw, ScriptedReplicas(1, 4, script(0)), S, stop)
    assert s.ensemble.slots.lr_scale < 0.5  # the uninterrupted run cut the LR at the rise (and after)
    _, o2 = _opt("adam")
    s2 = OneCycleAutoLR(o2, **{**kw, "on_runaway": "ignore", "model_sync_interval": 4},
                        replicas=ScriptedReplicas(1, 4, script(4)))
    o2.load_state_dict(saved_opt)
    with pytest.warns(UserWarning, match=r"replace this scheduler's.*model_sync_interval 5 \(built with 4\).*"
                                         r"on_runaway 'recover' \(built with 'ignore'\)"):
        s2.load_state_dict(saved_sched)
    resumed = []
    for _ in range(stop, S):
        o2.step()
        s2.step(torch.tensor(1.0))
        resumed.append(s2.get_last_lr())
    assert resumed == full[stop:] and s2.ensemble.slots.lr_scale == s.ensemble.slots.lr_scale


@pytest.mark.parametrize("built", [dict(total=40), dict(final_lr=0.001), dict(auto_lr_bounds=(0.0, 0.06))],
                         ids=["total_steps", "final_lr", "auto_lr_bounds"])
def test_a_resume_before_the_first_control_sync_keeps_the_saved_eq8_target_and_bounds(built):
    """The paper controller starts at its first control sync (step 8) with Eq. 8's target (``final_lr``, or a
    LambdaLR's value at total_steps) and the LR bounds that the scheduler worked out when it was built. They were not
    in the state, so a checkpoint of step 6 loaded into a scheduler built with another total_steps, final_lr or bounds
    ran on with the new ones (base LR 0.0454 / 0.0217 at step 8 against 0.0499, silently; an audit found it), while
    total_steps itself was the saved one, also silently. Now the resume is exact and a warning names each."""
    def build(total=24, **kw):
        p = nn.Parameter(torch.zeros(3))
        opt = torch.optim.SGD([p], lr=0.1)
        base = LambdaLR(opt, lambda t: 1.0 / (1 + 0.1 * t))
        return opt, HDETLR(opt, base, total, ensemble_lr_spread_ratio=0.2, model_sync_interval=4, enable_auto_lr=True,
                           controller="paper", auto_lr_warmup_steps=8, loss_scale=0.05,
                           replicas=ScriptedReplicas(0, 2, lambda: [1.0, 0.9]), **kw)

    def run(opt, s, t0, t1):
        lrs = []
        for t in range(t0 + 1, t1 + 1):
            opt.step()
            s.step(torch.tensor(1.0))
            lrs.append(s.base_lrs_now[0])
            if t == 6:
                saved.append(roundtrip(s.state_dict()))
        return lrs

    saved = []
    full = run(*build(), 0, 24)
    opt2, s2 = build(**built)
    says = {"total": r"total_steps 24 \(built with 40\)", "final_lr": r"final_lr \(Eq. 8's target\) \[0.02",
            "auto_lr_bounds": r"auto_lr_bounds \[\(0.0294.*\(built with \[\(0.0, 0.06\)\]\)"}[next(iter(built))]
    with pytest.warns(UserWarning, match="replace this scheduler's.*" + says):
        s2.load_state_dict(saved[0])
    assert run(opt2, s2, 6, 24) == full[6:]


@pytest.mark.parametrize("explore, says", [("beta", "beta"), ("coupled", "coupled"), ("wd_adamw", None),
                                           ("decoupled_adam", None), ("none", None)])
def test_loading_another_replicas_state_says_when_its_optimizer_moments_are_not_this_replicas(explore, says):
    """Rank 0's scheduler state loaded on rank 1 (what the HF Trainer, Lightning and Accelerate do): where each
    replica explores its own Adam beta, or adds a weight decay of its own weights to the gradient (Adam's
    coupled decay under the LR spread), rank 0's moments (loaded with it) are not rank 1's and the resume is
    not exact, so a warning says why; AdamW's (or Adam's decoupled) explored weight decay and the LR spread
    alone do not shape the moments: no warning."""
    def build(rank):
        torch.manual_seed(0)
        m = nn.Linear(4, 1)
        wd = 0.0 if explore in ("beta", "none") else 0.01
        kw = {"decoupled_weight_decay": True} if explore == "decoupled_adam" else {}
        o = (torch.optim.AdamW if explore == "wd_adamw" else torch.optim.Adam)(m.parameters(), lr=0.1,
                                                                                weight_decay=wd, **kw)
        hyp = [hdet.AdamBeta(o, index=1, alpha=0.02)] if explore == "beta" else \
            [hdet.WeightDecay(o)] if explore in ("wd_adamw", "decoupled_adam") else []
        return o, OneCycleAutoLR(o, max_lr=0.1, total_steps=20, ensemble_lr_spread_ratio=0.2, model_sync_interval=5,
                                 explore=hyp, replicas=ScriptedReplicas(rank, 4))

    o0, s0 = build(0)
    for _ in range(5):
        o0.step()
        s0.step(torch.tensor(1.0))
    state = roundtrip(s0.state_dict())
    _, s1 = build(1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        s1.load_state_dict(state)
    said = [str(w.message) for w in seen if "not exact" in str(w.message)]
    assert len(said) == (says is not None) and all(says in m for m in said)
    assert s1.ensemble.load_warnings == said


def test_the_paper_controller_decays_a_lambda_schedule_to_its_last_value_and_says_when_it_cannot():
    """A LambdaLR base (every Hugging Face Trainer schedule): Eq. 8's decay target is its value at the last step,
    so the paper controller takes the base there (before: no target, the base held after the controller
    started); a schedule that ends at 0 has no target, and a warning says so at construction."""
    def build(floor):
        _, o = _opt("adam")
        lam = torch.optim.lr_scheduler.LambdaLR(o, lambda t: max(floor, 1 - t / 40))
        return o, HDETLR(o, lam, total_steps=40, model_sync_interval=5, enable_auto_lr=True, controller="paper",
                         auto_lr_warmup_steps=10, ensemble_lr_spread_ratio=0.2, replicas=ScriptedReplicas(0, 4))

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        o, s = build(0.1)
    assert not [w for w in seen if "no target" in str(w.message)]
    for _ in range(40):
        o.step()
        s.step(torch.tensor(1.0))
    assert s.base_lrs_now[0] == pytest.approx(0.1 * 0.1, rel=1e-6)  # base_lr 0.1 x the schedule's last value
    with pytest.warns(UserWarning, match="has no target"):
        build(0.0)


def test_a_constant_lambda_schedule_gives_the_paper_controller_no_floor():
    """A LambdaLR that does not decay (the HF Trainer's "constant"): its last value is its peak, which must not
    become the paper controller's floor (it could then only raise the LR); a decaying one's last value is."""
    for lam, low in ((lambda t: 1.0, 0.0), (lambda t: max(0.1, 1 - t / 40), 0.01)):
        _, o = _opt("adam")
        s = HDETLR(o, torch.optim.lr_scheduler.LambdaLR(o, lam), total_steps=40, model_sync_interval=5,
                   enable_auto_lr=True, controller="paper", final_lr=None, replicas=ScriptedReplicas(0, 4))
        assert s._bounds(None) == [(pytest.approx(low), math.inf)]
        _, o = _opt("adam")  # the same schedule as a function of the step: the same floor (it had none: an audit)
        lr = o.param_groups[0]["lr"]
        f = HDETLR(o, lambda t, lam=lam: lr * lam(t), total_steps=40, model_sync_interval=5, enable_auto_lr=True,
                   controller="paper", replicas=ScriptedReplicas(0, 4))
        assert f._bounds(None) == [(pytest.approx(low), math.inf)]


def test_a_missed_scheduler_step_in_local_mode_is_said_once(tmp_path):
    """In local mode (DDP's no_sync every step) a replica that skips scheduler.step() after an optimizer step runs
    its schedule and converge steps behind its training, and nothing else notices: it is averaged with the others
    at another step. Its next scheduler.step() says so (once). A loop that steps both every time is silent, and so
    is DDP with all-reduced gradients (where every replica skips alike, e.g. a step GradScaler skipped)."""
    import warnings

    from torch.nn.parallel import DistributedDataParallel as DDP

    from helpers import in_gloo_world_of_one

    def run():
        for local in (False, True):
            m = DDP(torch.nn.Linear(3, 1))
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            sched = hdet.HDETLR(opt, None, 20, model_sync_interval=100, model=m)

            def step(sched_too=True):
                with m.no_sync() if local else torch.enable_grad():
                    m(torch.ones(2, 3)).sum().backward()
                opt.step()
                opt.zero_grad()
                if sched_too:
                    sched.step()

            with warnings.catch_warnings():
                warnings.simplefilter("error")
                for _ in range(3):
                    step()
                step(sched_too=False)  # the scheduler misses this one
                if not local:
                    step()
                    continue
            with pytest.warns(UserWarning, match=r"optimizer.step\(\) ran 2 times since the previous scheduler"):
                step()
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                step(sched_too=False)
                step()  # said once

    in_gloo_world_of_one(tmp_path, run)


def test_gradient_accumulation_under_ddp_is_not_local_mode(tmp_path):
    """no_sync() on the micro-steps of an accumulation whose last micro-step syncs: the optimizer steps on all-reduced
    gradients, so a step the scheduler misses (e.g. after GradScaler skipped it) is not the local-mode warning."""
    import warnings

    from torch.nn.parallel import DistributedDataParallel as DDP

    from helpers import in_gloo_world_of_one

    def run():
        m = DDP(torch.nn.Linear(3, 1))
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        sched = hdet.HDETLR(opt, None, 20, model_sync_interval=100, model=m)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for k in range(4):
                for micro in range(3):
                    with m.no_sync() if micro < 2 else torch.enable_grad():
                        m(torch.ones(2, 3)).sum().backward()
                opt.step()
                opt.zero_grad()
                if k != 1:  # the scheduler misses the second optimizer step
                    sched.step()
        assert not sched._guard.local

    in_gloo_world_of_one(tmp_path, run)


def test_an_evaluation_through_the_ddp_model_does_not_end_local_mode(tmp_path):
    """Local mode (every training forward inside ``ddp.no_sync()``) with an evaluation through the DDP model, outside
    ``no_sync()`` and with autograd off, between the backward and the optimizer step: the run stays local (before, that
    step counted as shared: its sync's stall watch would enter a collective the other ranks skip)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from helpers import in_gloo_world_of_one

    def run():
        m = DDP(torch.nn.Linear(3, 1))
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        sched = hdet.HDETLR(opt, None, 20, model_sync_interval=100, model=m)
        seen = []
        for k in range(3):
            with m.no_sync():
                loss = m(torch.ones(2, 3)).sum()
            loss.backward()
            with torch.no_grad():
                m(torch.zeros(2, 3))  # an evaluation, outside no_sync()
            with torch.inference_mode():
                m(torch.zeros(2, 3))
            opt.step()
            opt.zero_grad()
            seen.append(sched._guard.local)
            sched.step(loss.detach())
        assert seen == [True, True, True]
        m(torch.ones(2, 3)).sum().backward()  # a training forward outside no_sync(): shared again
        assert not sched._guard.local

    in_gloo_world_of_one(tmp_path, run)


def test_torchs_first_step_checks_are_said_once_at_the_callers_line_and_an_int_step_warns():
    """As OneCycleLR: one "scheduler.step() before optimizer.step()" warning, at the caller's line (before: hdet's
    own, then torch's twice from inside hdet); scheduler.step(5), torch's deprecated step(epoch), is taken as a loss
    and says so."""
    import warnings as w

    def warned(cls, **kw):
        m = nn.Linear(2, 2)
        o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        s = cls(o, max_lr=0.1, total_steps=10, **kw)
        with w.catch_warnings(record=True) as caught:
            w.simplefilter("always")
            s.step()
            o.step()
            s.step()
        return [(str(c.message)[:40], c.filename) for c in caught]

    torch_says = warned(torch.optim.lr_scheduler.OneCycleLR)
    assert len(torch_says) == 1 and torch_says[0][1] == __file__
    assert warned(hdet.OneCycleAutoLR) == torch_says
    m = nn.Linear(2, 2)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    s = hdet.OneCycleAutoLR(o, max_lr=0.1, total_steps=10)
    o.step()
    with pytest.warns(UserWarning, match=r"scheduler.step\(5\) got an int: HDET's step takes this step's training loss"):
        s.step(5)


def test_a_onecycle_lr_state_says_how_to_go_on_under_hdet():
    """A drop-in user resuming a OneCycleLR checkpoint: the error says how, and the recipe it gives continues the
    schedule exactly (LRs equal to the uninterrupted OneCycleLR's at every later step, at alpha 0)."""
    torch.manual_seed(0)
    m = nn.Linear(3, 1)
    o = torch.optim.AdamW(m.parameters(), lr=0.1)
    s = torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=100)
    for _ in range(40):
        o.step()
        s.step()
    o2 = torch.optim.AdamW(m.parameters(), lr=0.1)
    o2.load_state_dict(o.state_dict())
    with pytest.raises(ValueError, match=r"torch's OneCycleLR's\. To go on .* last_epoch=39"):
        OneCycleAutoLR(o2, max_lr=0.1, total_steps=100).load_state_dict(s.state_dict())
    o3 = torch.optim.AdamW(m.parameters(), lr=0.1)
    o3.load_state_dict(o.state_dict())
    s3 = OneCycleAutoLR(o3, max_lr=0.1, total_steps=100, last_epoch=39)
    for _ in range(60):
        assert o3.param_groups[0]["lr"] == o.param_groups[0]["lr"]
        o.step()
        s.step()
        o3.step()
        s3.step()
    assert s3.last_sync.step == 100


def test_misused_bases_and_step_arguments_get_clear_errors():
    """An audit: a scheduler class for base was called with total_steps (its constructor's error named no base); a
    OneCycleLR base shorter than total_steps failed at its end, torch's error after every replica's optimizer step
    (replica 0 left at the plain LR), and a longer one ended near its peak, silently; step(epoch=5) gave Python's
    "unexpected keyword"; step(torch.tensor(5)) was taken as a loss without the int's warning."""
    def opt():
        return torch.optim.SGD(nn.Linear(3, 1).parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"got the class StepLR: build it, e.g. StepLR\(optimizer"):
        hdet.HDETLR(opt(), torch.optim.lr_scheduler.StepLR, 20)
    o = opt()
    with pytest.raises(ValueError, match=r"OneCycleLR base's total_steps \(20\) to be the HDETLR's total_steps \(40\)"):
        hdet.HDETLR(o, OneCycleLR(o, 0.1, total_steps=20), 40)
    o = opt()
    with pytest.warns(UserWarning, match=r"total_steps \(40\) is more than the HDETLR's \(20\): the run ends before"):
        hdet.HDETLR(o, OneCycleLR(o, 0.1, total_steps=40), 20)
    o = opt()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hdet.HDETLR(o, OneCycleLR(o, 0.1, total_steps=20), 20)  # the same length: nothing said
    s = hdet.HDETLR(opt(), None, 10)
    s.optimizer.step()
    with pytest.raises(TypeError, match=r"got the keyword\(s\) \['epoch'\]: HDET steps its base schedule once"):
        s.step(epoch=5)
    with pytest.warns(UserWarning, match=r"scheduler.step\(5\) got an int"):
        s.step(torch.tensor(5))


def test_a_resume_into_a_longer_run_says_the_run_keeps_its_saved_length():
    """Lightning's ckpt_path or Accelerate's load_state into a scheduler rebuilt for 24 steps from a 16-step run: the
    load says the state's total_steps replaces 24, then step 17 failed saying "raise total_steps", which the user had
    (an audit). The error says why now."""
    def sched(total):
        o = torch.optim.SGD(nn.Linear(3, 1).parameters(), lr=0.1)
        return hdet.OneCycleAutoLR(o, max_lr=0.1, total_steps=total)
    a = sched(16)
    for _ in range(8):
        a.optimizer.step()
        a.step(1.0)
    b = sched(24)
    with pytest.warns(UserWarning, match=r"total_steps 16 \(built with 24\)"):
        b.load_state_dict(a.state_dict())
    for _ in range(8):
        b.optimizer.step()
        b.step(1.0)
    b.optimizer.step()
    with pytest.raises(ValueError, match=r"call 17; this scheduler was built with total_steps=24, and the state it "
                                         r"loaded keeps its run's length, 16 \(a resume cannot lengthen a run"):
        b.step(1.0)
    c = sched(16)
    for _ in range(16):
        c.optimizer.step()
        c.step(1.0)
    c.optimizer.step()
    with pytest.raises(ValueError, match="call 17; raise total_steps or stop stepping"):
        c.step(1.0)


def test_an_epoch_counter_passed_as_the_loss_is_said():
    """torch documents CosineAnnealingWarmRestarts.step(epoch + i / iters); under HDETLR those numbers were taken as
    losses and the base counted optimizer steps, silently (an audit: LRs 0.05, 0.1, 0.05, ... for torch's 0.1,
    0.0962, 0.0854, ...). Three first losses in an exact arithmetic progression upward now warn; losses do not."""
    from torch.optim.lr_scheduler import CosineAnnealingWarmRestarts

    def build():
        p = torch.nn.Parameter(torch.zeros(2))
        o = torch.optim.SGD([p], lr=0.1)
        return o, hdet.HDETLR(o, CosineAnnealingWarmRestarts(o, T_0=2), total_steps=20)
    o, s = build()
    with pytest.warns(UserWarning, match=r"got 0\.0, 0\.25, 0\.5: an epoch counter"):
        for i in range(3):
            o.step()
            s.step(0 + i / 4)
    o, s = build()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for loss in (2.31, 2.2, 2.25, 2.0, 0.0, 0.25, 0.5):  # losses, and an arithmetic run after the first three
            o.step()
            s.step(loss)


def test_a_base_schedule_stepped_elsewhere_is_an_error():
    """base.step() besides HDETLR's step ran the base at twice its speed, silently (an audit: StepLR(4, 0.5) halved
    the LR every 2 steps, 0.0015625 at step 12 instead of 0.025)."""
    from torch.optim.lr_scheduler import StepLR

    p = torch.nn.Parameter(torch.zeros(2))
    o = torch.optim.SGD([p], lr=0.1)
    base = StepLR(o, step_size=4, gamma=0.5)
    s = hdet.HDETLR(o, base, total_steps=12)
    o.step()
    s.step(1.0)  # fine
    o.step()
    base.step()
    with pytest.raises(ValueError, match=r"Expected the base schedule \(StepLR\) at step 1, as this scheduler, but it "
                                         r"is at step 2: it was stepped elsewhere"):
        s.step(1.0)
    from torch.optim.lr_scheduler import ChainedScheduler, ExponentialLR  # (it keeps no count of its own: its
    o = torch.optim.SGD([p], lr=0.1)                                       # schedules' is read)
    chained = ChainedScheduler([StepLR(o, step_size=4, gamma=0.5), ExponentialLR(o, gamma=0.9)])
    s = hdet.HDETLR(o, chained, total_steps=12)
    o.step()
    s.step(1.0)
    o.step()
    chained.step()
    with pytest.raises(ValueError, match=r"Expected the base schedule \(ChainedScheduler\) at step 1"):
        s.step(1.0)


@pytest.mark.parametrize("make", [lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                                  lambda ps: torch.optim.AdamW(ps, lr=0.1, betas=(0.9, 0.99))])
@pytest.mark.parametrize("saved", [True, False])
def test_a_state_saved_with_the_other_cycle_momentum_loads_as_torchs_does(saved, make):
    """A state saved with cycle_momentum=True loaded into a scheduler built with False (or the reverse) was refused
    ("its keys differ: unexpected ['use_beta1']", an audit), where torch loads it and the saved setting wins (as
    docs/reliability.md says of a base's own settings): it loads, and every later LR and momentum is torch's."""
    runs = {}
    for cls in (OneCycleLR, OneCycleAutoLR):
        p = nn.Parameter(torch.zeros(2, dtype=torch.float64))
        o = make([p])
        s = cls(o, max_lr=0.05, total_steps=12, cycle_momentum=saved)
        for _ in range(4):
            o.step()
            s.step()
        state = roundtrip(s.state_dict())
        o2 = make([nn.Parameter(torch.zeros(2, dtype=torch.float64))])
        s2 = cls(o2, max_lr=0.05, total_steps=12, cycle_momentum=not saved)
        o2.load_state_dict(o.state_dict())
        s2.load_state_dict(state)
        seen = []
        for _ in range(8):
            o2.step()
            s2.step()
            g = o2.param_groups[0]
            seen.append((g["lr"], g.get("momentum", g.get("betas", (None,))[0])))
        runs[cls] = seen
    assert runs[OneCycleAutoLR] == runs[OneCycleLR]
    assert (len({m for _, m in runs[OneCycleLR]}) > 4) == saved  # (cycled as saved, or held)


def test_close_leaves_the_optimizer_as_plain_training_would_and_a_second_scheduler_closes_the_first():
    """close() after finish(), to train on without HDET (a fine-tune, an SWA phase): every hook off the optimizer,
    each group's LR and each explored value at the base (the same on every replica; each replica's own multiplied
    value stayed before), and step(), finish() mid-window and load_state_dict() refused; a scheduler closes itself
    after its step at total_steps. A second scheduler built on the same optimizer (a notebook cell run again) closes
    the first, saying so (both drove the LRs, their guards read the gradients twice: an audit)."""
    import warnings

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Dropout(0.1), torch.nn.Linear(4, 1))
    o = torch.optim.AdamW(m.parameters(), lr=0.1)
    hooks = lambda: (len(o._optimizer_step_pre_hooks), len(o._optimizer_step_post_hooks))  # noqa: E731
    plain = hooks()
    reps = ScriptedReplicas(rank=1, world_size=4)
    s = OneCycleAutoLR(o, max_lr=0.1, total_steps=20, ensemble_lr_spread_ratio=0.5, model_sync_interval=5,
                       replicas=reps, explore=[hdet.Dropout(m, alpha=0.05)])
    for _ in range(7):
        m(torch.randn(4, 3)).pow(2).mean().backward()
        o.step()
        o.zero_grad()
        s.step(torch.tensor(1.0))
    assert o.param_groups[0]["lr"] != pytest.approx(s.base_lrs_now[0])  # (replica 1's own multiplier)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        s2 = OneCycleAutoLR(o, max_lr=0.1, total_steps=20, ensemble_lr_spread_ratio=0.5, model_sync_interval=5,
                            replicas=ScriptedReplicas(rank=1, world_size=4))
    assert s.closed and not s2.closed and any("already had an HDET scheduler, open at step 7" in str(w.message)
                                              for w in said)
    assert hooks() == (plain[0], plain[1] + 1)  # (the second's step counter only)
    open_state = roundtrip(s2.state_dict())
    s2.close()
    assert hooks() == plain and o.param_groups[0]["lr"] == pytest.approx(s2.base_lrs_now[0])
    with pytest.raises(RuntimeError, match="closed scheduler"):
        s2.step(torch.tensor(1.0))
    s2.load_state_dict(s2.state_dict())  # (its own state, closed: it stays closed, at the base's LR)
    assert s2.closed and hooks() == plain and o.param_groups[0]["lr"] == pytest.approx(s2.base_lrs_now[0])
    s2.load_state_dict(open_state)  # (a state of a run not over: its hooks back on, as when it was built)
    assert not s2.closed and hooks() == (plain[0] + 1, plain[1] + 1)  # (+ the check of the first optimizer step
    s2.close()  # after a load: HDETLR._after_load)
    s3 = OneCycleAutoLR(o, max_lr=0.1, total_steps=4, ensemble_lr_spread_ratio=0.5, model_sync_interval=2,
                        replicas=ScriptedReplicas(rank=1, world_size=4), explore=[hdet.Dropout(m, alpha=0.05)])
    for t in range(4):
        o.step()
        s3.step(torch.tensor(1.0))
        assert s3.closed == (t == 3)
    assert hooks() == plain and m[1].p == pytest.approx(0.1) and s3.finish() is None


def test_close_leaves_torchs_lr_and_a_failed_second_scheduler_leaves_the_first_open():
    """At total_steps, close() leaves each group at the LR a plain OneCycleLR stepped as often leaves (its value one
    step past the end: below zero with a linear anneal, torch's own formula), on every replica; a second scheduler
    whose construction fails leaves the first open (it was closed, and its step() raised: a review)."""
    for anneal in ("linear", "cos"):
        m = torch.nn.Linear(3, 1)
        o = torch.optim.AdamW(m.parameters(), lr=1e-3)
        s = OneCycleAutoLR(o, max_lr=1e-2, total_steps=10, ensemble_lr_spread_ratio=0.3, model_sync_interval=5,
                           anneal_strategy=anneal, replicas=ScriptedReplicas(rank=1, world_size=2))
        o2 = torch.optim.AdamW(torch.nn.Linear(3, 1).parameters(), lr=1e-3)
        plain = torch.optim.lr_scheduler.OneCycleLR(o2, max_lr=1e-2, total_steps=10, anneal_strategy=anneal)
        for _ in range(10):
            o.step()
            s.step(torch.tensor(1.0))
            o2.step()
            plain.step()
        assert s.closed and o.param_groups[0]["lr"] == pytest.approx(o2.param_groups[0]["lr"], rel=1e-9), anneal
    m = torch.nn.Linear(3, 1)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    first = hdet.HDETLR(o, lambda t: 0.1, 10, ensemble_lr_spread_ratio=0.2)
    with pytest.raises(ZeroDivisionError):
        hdet.HDETLR(o, lambda t: 0.1 * t ** -0.5, 10, ensemble_lr_spread_ratio=0.2)
    assert not first.closed
    o.step()
    first.step(torch.tensor(1.0))


def test_a_best_sync_saved_without_an_ema_fits_a_run_that_registers_one_before_loading():
    """fit_snapshot: a snapshot of (weights, moments, step counts) saved before an EMA was registered fits the kept
    tensors (weights, moments, EMA, step counts) of the run that registered it before load_state_dict, taking the
    EMA as it is (it was dropped, with a warning that blamed another model: a review)."""
    from hdet.stability import fit_snapshot

    w, mom, ema, count = torch.ones(3), torch.full((3,), 2.0), torch.full((3,), 5.0), torch.tensor(7.0)
    snap = [torch.zeros(3), torch.zeros(3), torch.tensor(1.0)]
    fitted = fit_snapshot(snap, [w, mom, ema, count], counts=1, also=1)
    assert [t.tolist() for t in fitted] == [[0.0] * 3, [0.0] * 3, [5.0] * 3, 1.0]
    assert fit_snapshot(snap, [w, mom, count], counts=1) is snap  # (nothing registered: as before)


def _steps(sched, n):
    """``n`` optimizer and scheduler steps (a loss of 1 each; the optimizer has no gradients: the LRs are what the
    tests read)."""
    for _ in range(n):
        sched.optimizer.step()
        sched.step(torch.tensor(1.0))


def test_a_state_saved_at_the_end_loads_closed_and_set_total_steps_reopens_it():
    """A state saved after the last step (where the scheduler closed itself) loaded into a fresh scheduler left it
    open: each replica at its own multiplied LR, HDET's hooks on (an audit: plain training after an Accelerate
    resume drifted the ranks 7e-3 apart). It loads closed now, at the base LR the uninterrupted run left, its hooks
    off; ``set_total_steps`` of a longer run (the Trainer resumed into more steps) reopens it at the replica's own
    LR, and refuses a length that leaves an open run no last converge step."""
    def build():
        o = torch.optim.AdamW(torch.nn.Linear(3, 1).parameters(), lr=1e-3)
        return o, OneCycleAutoLR(o, max_lr=1e-2, total_steps=6, ensemble_lr_spread_ratio=0.5,
                                 model_sync_interval=3, replicas=ScriptedReplicas(rank=1, world_size=2))
    o, s = build()
    _steps(s, 6)
    assert s.closed
    assert s.get_last_lr() == [o.param_groups[0]["lr"]] == s.effective_lrs and s.multipliers == [1.0]  # (they
    # reported this replica's own multiplied LR, 1.5x, after the close: an audit)
    o2, s2 = build()
    plain = len(o2._optimizer_step_post_hooks) - 1  # (without the open scheduler's step counter)
    s2.load_state_dict(roundtrip(s.state_dict()))
    assert s2.closed and len(o2._optimizer_step_post_hooks) == plain
    assert s2.get_last_lr() == [o2.param_groups[0]["lr"]] and s2.multipliers == [1.0]
    assert o2.param_groups[0]["lr"] == pytest.approx(o.param_groups[0]["lr"], rel=1e-12)
    assert o2.param_groups[0]["lr"] == pytest.approx(s2.base_lrs_now[0], rel=1e-12)
    s2.attach_model(torch.nn.Linear(3, 1))  # (what the integrations call after a load: the replica's own LR came
    s2.reapply()  # back, and a DDP model got the guard again: a review)
    assert s2.closed and s2.gradient_guard is None and len(o2._optimizer_step_post_hooks) == plain
    assert o2.param_groups[0]["lr"] == pytest.approx(o.param_groups[0]["lr"], rel=1e-12)
    with pytest.raises(ValueError, match="OneCycleLR"):  # (its cycle is 6 steps long)
        s2.set_total_steps(9)
    h = torch.optim.AdamW(torch.nn.Linear(3, 1).parameters(), lr=1e-3)
    s3 = hdet.HDETLR(h, lambda t: 1e-2, total_steps=6, ensemble_lr_spread_ratio=0.5, model_sync_interval=3,
                     replicas=ScriptedReplicas(rank=1, world_size=2))
    _steps(s3, 6)
    assert s3.closed and h.param_groups[0]["lr"] == pytest.approx(1e-2)
    s3.set_total_steps(9)
    assert not s3.closed and h.param_groups[0]["lr"] == pytest.approx(1e-2 * s3.multipliers[0]) \
        and s3.multipliers[0] != pytest.approx(1.0)
    assert s3.is_sync_step(6)  # (averaged at the old end: a checkpoint there is exact, finish() is no second sync)
    _steps(s3, 3)
    assert s3.closed and s3.last_epoch == 9
    for kind in ("lambda", "callable"):  # (the Hugging Face Trainer's base is a LambdaLR)
        lrs = []
        for _ in range(2):
            h = torch.optim.AdamW(torch.nn.Linear(3, 1).parameters(), lr=1e-2)
            base = torch.optim.lr_scheduler.LambdaLR(h, lambda t: 1 - t / 8) if kind == "lambda" else \
                (lambda t: 1e-2 * (1 - t / 8))
            s5 = hdet.HDETLR(h, base, total_steps=6, ensemble_lr_spread_ratio=0.5, model_sync_interval=3,
                             replicas=ScriptedReplicas(rank=1, world_size=2), explore=[hdet.WeightDecay(h, alpha=0.5)])
            if not lrs:
                _steps(s5, 6)
                end = roundtrip(s5.state_dict())
            else:
                s5.load_state_dict(end)
            lrs.append((s5.closed, h.param_groups[0]["lr"], h.param_groups[0]["weight_decay"]))
        assert lrs[0] == lrs[1] and lrs[0][0], (kind, lrs)
    _, s4 = build()
    _steps(s4, 2)
    with pytest.raises(ValueError, match="at least 3"):
        s4.set_total_steps(2)


def test_a_load_that_fails_leaves_a_closed_scheduler_closed():
    """A closed scheduler given an open run's state that its base schedule cannot give a value for (a list of LRs
    shorter than the loaded run) raised in the load after its hooks were back on, leaving it open at a half-loaded
    step (a review): it stays closed, its hooks off."""
    lrs = [1e-2] * 7
    o = torch.optim.SGD(torch.nn.Linear(3, 1).parameters(), lr=1e-2)
    s = hdet.HDETLR(o, lambda t: lrs[t], total_steps=6, ensemble_lr_spread_ratio=0.5, model_sync_interval=3,
                    replicas=ScriptedReplicas(rank=1, world_size=2))
    _steps(s, 6)
    plain = len(o._optimizer_step_post_hooks)
    o2 = torch.optim.SGD(torch.nn.Linear(3, 1).parameters(), lr=1e-2)
    longer = hdet.HDETLR(o2, lambda t: 1e-2, total_steps=12, ensemble_lr_spread_ratio=0.5, model_sync_interval=3,
                         replicas=ScriptedReplicas(rank=1, world_size=2))
    _steps(longer, 8)
    with pytest.raises(IndexError):
        s.load_state_dict(roundtrip(longer.state_dict()))
    assert s.closed and len(o._optimizer_step_post_hooks) == plain


def test_a_tensor_lr_stays_the_optimizers_tensor_through_reapply_and_close():
    """A tensor LR (a compiled or captured optimizer step reads that tensor): reapply() replaced it with a float (the
    integrations call it after every load), and a closed scheduler's get_last_lr() gave floats where torch gives the
    groups' type (a review). The group keeps its tensor, filled in place; get_last_lr() gives tensors."""
    o = torch.optim.Adam(torch.nn.Linear(3, 1).parameters(), lr=torch.tensor(0.01))
    lr = o.param_groups[0]["lr"]
    s = OneCycleAutoLR(o, max_lr=0.01, total_steps=4, ensemble_lr_spread_ratio=0.5, model_sync_interval=2,
                       replicas=ScriptedReplicas(rank=1, world_size=2))
    s.reapply()
    assert o.param_groups[0]["lr"] is lr and isinstance(s.get_last_lr()[0], torch.Tensor)
    for _ in range(4):
        o.step()
        s.step(torch.tensor(1.0))
    assert s.closed and o.param_groups[0]["lr"] is lr and isinstance(s.get_last_lr()[0], torch.Tensor)
    assert float(s.get_last_lr()[0]) == pytest.approx(s.base_lrs_now[0])


def test_a_scheduler_stepped_on_every_micro_batch_says_gradient_accumulation():
    """`sched.step(loss)` on each of k micro-batches of gradient accumulation (one optimizer step per k): the warning
    named GradScaler and Accelerate only, and the error past the end advised raising total_steps (an audit): both
    say now to step once per optimizer step."""
    import warnings
    net = nn.Linear(4, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    sched = hdet.OneCycleAutoLR(opt, max_lr=0.1, total_steps=4, model_sync_interval=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="under gradient accumulation call it once per optimizer step"):
            for _ in range(4):
                for micro in range(3):
                    net(torch.randn(8, 4)).square().mean().div(3).backward()
                    if micro == 2:
                        opt.step()
                        opt.zero_grad()
                    sched.step(1.0)
    said = [str(w.message) for w in caught if "no optimizer.step()" in str(w.message)]
    assert len(said) == 1 and "Under gradient accumulation, call scheduler.step(loss) once per optimizer step" in said[0]
    assert "(first at the step() call that took last_epoch from 1)" in said[0]  # (the first unmatched call: a review)


@pytest.mark.parametrize("writer", ["loop", "plateau", None])
@pytest.mark.parametrize("tensor_lr", [False, True])
def test_an_lr_written_beside_the_scheduler_is_said(writer, tensor_lr):
    """A loop that sets group['lr'] itself before every step (nanoGPT's get_lr(it)) trained every replica at that
    schedule, no spread, while the records showed one; a ReduceLROnPlateau stepped beside HDET cut the LR for one
    step, then hdet's value was back (an audit: 10x above plain DDP for the rest of the run). Said once now, naming
    the group; an optimizer's state loaded mid-run (which writes the LRs), and a loop that leaves them alone, say
    nothing. A tensor LR is told by its in-place version (no host read)."""
    import warnings

    torch.manual_seed(0)
    m = torch.nn.Linear(3, 1)
    o = torch.optim.Adam([{"params": [m.weight]}, {"params": [m.bias]}],
                         lr=torch.tensor(0.01) if tensor_lr else 0.01)
    s = hdet.HDETLR(o, torch.optim.lr_scheduler.CosineAnnealingLR(o, 12), 12)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=0) if writer == "plateau" else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in range(1, 9):
            if writer == "loop":
                for g in o.param_groups[1:]:
                    if tensor_lr:
                        g["lr"].fill_(1e-3 * t)
                    else:
                        g["lr"] = 1e-3 * t
            o.zero_grad()
            loss = m(torch.randn(4, 3)).square().mean()
            loss.backward()
            o.step()
            s.step(loss)
            if plateau is not None:
                plateau.step(1.0)  # (no improvement after the first: a cut of 10x)
            if t == 4:
                o.load_state_dict(o.state_dict())
    said = [str(w.message) for w in caught if "LR was written" in str(w.message)]
    if writer is None:
        assert said == []
    else:
        assert len(said) == 1, said
        assert said[0].startswith(f"hdet: param group {1 if writer == 'loop' else 0}'s LR was written")
        assert "Give your schedule to HDETLR as its base" in said[0]


def test_a_step_that_measured_nothing_is_left_out_of_the_window_and_kept_across_a_resume():
    """observe(loss, counted=False), or a bool tensor read only at the sync: a step with no label token (the Hugging
    Face Trainer's loss is 0 there) is left out of the window's mean and is no non-finite loss; a non-finite loss is
    one whatever counted says; a window saved mid-way keeps its left-out steps (session 44's audit: such a step
    counted as a loss of 0)."""
    from hdet.window import LossWindow

    w = LossWindow()
    for loss, counted in ((2.0, True), (0.0, torch.tensor(False)), (4.0, torch.tensor(True)), (0.0, False),
                          (float("nan"), False)):
        w.observe(torch.tensor(loss), counted)
    w.fold()
    assert float(w.sum) / float(w.finite) == 3.0 and float(w.empty) == 2 and float(w.nonfinite) == 1
    with pytest.raises(ValueError, match="counted= as a bool"):
        w.observe(1.0, torch.tensor([1.0]))
    w, flag = LossWindow(), torch.tensor(True)  # one flag buffer written again at every step (a CUDA graph's): each
    for loss, counted in ((2.0, True), (0.0, False), (4.0, True), (0.0, False)):  # step keeps its own (a review:
        flag.fill_(counted)  # every step took the last one's, and the mean was NaN)
        w.observe(torch.tensor(loss), flag)
    w.fold()
    assert float(w.sum) / float(w.finite) == 3.0 and float(w.empty) == 2 and float(w.nonfinite) == 0

    def run(split):
        torch.manual_seed(0)
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = hdet.HDETLR(opt, None, total_steps=8, model_sync_interval=4, rank=0, world_size=1)
        syncs = []
        for t in range(1, 9):
            opt.step()
            sched.step(torch.tensor(float(t)) if t % 3 else None)
            if t % 3 == 0:
                sched.observe(torch.tensor(0.0), torch.tensor(False))  # steps 3 and 6 measured nothing
            if t == split:  # a resume: a new optimizer and scheduler, the state loaded
                state = sched.state_dict()
                sched.close()
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                sched = hdet.HDETLR(opt, None, total_steps=8, model_sync_interval=4, rank=0, world_size=1)
                sched.load_state_dict(state)
            if sched.last_sync is not None and sched.last_sync.step == t:
                syncs.append((t, sched.last_sync.losses, sched.last_sync.nonfinite_losses))
        return syncs

    assert run(None) == run(3) == run(6) == [(4, [(1 + 2 + 4) / 3], [0]), (8, [(5 + 7 + 8) / 3], [0])]


class _OnGPU(torch.Tensor):
    """A CPU tensor that says it is on a GPU (hdet's device checks), standing in for one; each read of its value on
    the host (``item``, ``float``, ``tolist``: a host sync on a GPU) is counted in :attr:`reads`."""

    reads: list[str] = []

    @property
    def device(self):
        return torch.device("cuda", 0)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.item, torch.Tensor.__float__, torch.Tensor.tolist):
            cls.reads.append(func.__name__)
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_lambdalr_bases_host_copy_follows_its_base_lrs():
    """Over device tensor LRs a LambdaLR base's LRs are its lambdas times base LRs kept on the host (no host sync a
    step); the kept copy is read again when a base LR is written in place, replaced, loaded, or given new storage
    through ``.data =`` (which keeps the tensor's version: a review found that one stale). A tensor subclass that
    says it is on a GPU stands in for one."""
    from hdet.schedulers import _last_lrs_on_host

    def check(change):
        o = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=torch.tensor(0.1).as_subclass(_OnGPU))
        base, host = LambdaLR(o, lambda t: 1.0 - t / 100), {}
        for _ in range(3):
            o.step()
            base.step()
            _last_lrs_on_host(base, host)
        change(base)
        o.step()
        base.step()
        wrote = float(torch.Tensor.as_subclass(base.get_last_lr()[0], torch.Tensor))
        assert _last_lrs_on_host(base, host)[0] == pytest.approx(wrote, rel=1e-6)
        return wrote

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert check(lambda b: None) == pytest.approx(0.096)
        assert check(lambda b: torch.Tensor.fill_(b.base_lrs[0], 0.2)) == pytest.approx(0.192)
        assert check(lambda b: b.base_lrs.__setitem__(0, torch.tensor(0.2).as_subclass(_OnGPU))) == pytest.approx(0.192)
        assert check(lambda b: setattr(b.base_lrs[0], "data", torch.tensor(0.2))) == pytest.approx(0.192)


STEP_FUNCTION_BASES = {  # name: (torch's class, its arguments, whether its closed form is taken)
    "CosineAnnealingLR": ("CosineAnnealingLR", dict(T_max=7, eta_min=0.01), True),
    "StepLR": ("StepLR", dict(step_size=3, gamma=0.5), True),
    "MultiStepLR": ("MultiStepLR", dict(milestones=[2, 5, 5], gamma=0.3), True),
    "LinearLR": ("LinearLR", dict(start_factor=0.2, total_iters=4), True),
    "ConstantLR": ("ConstantLR", dict(factor=0.5, total_iters=3), True),
    "ExponentialLR": ("ExponentialLR", dict(gamma=0.9), True),
    "PolynomialLR": ("PolynomialLR", dict(total_iters=6, power=2.0), True),
    # where the closed form is not the recursive step (a review: 0 steps divided by zero, or a 0-step ConstantLR
    # lost its factor; a negative milestone counted): read back, as before
    "LinearLR, 0 steps": ("LinearLR", dict(start_factor=0.5, total_iters=0), False),
    "ConstantLR, 0 steps": ("ConstantLR", dict(factor=0.5, total_iters=0), False),
    "PolynomialLR, 0 steps": ("PolynomialLR", dict(total_iters=0), False),
    "MultiStepLR, a negative milestone": ("MultiStepLR", dict(milestones=[-1, 2], gamma=0.5), False),
}


def _lr_value(lr):
    return float(torch.Tensor.as_subclass(lr, torch.Tensor)) if isinstance(lr, torch.Tensor) else lr


@pytest.mark.parametrize("case", list(STEP_FUNCTION_BASES))
def test_a_step_function_bases_lrs_over_device_tensor_lrs_are_read_once_not_every_step(case):
    """Over device tensor LRs (a capturable or compiled optimizer's) a torch scheduler whose LR is a function of the
    step gives HDETLR its closed form on the host, over base LRs read from the device once: it read the LRs back at
    every step (a host sync a step, docs/cost.md). The LRs set are those over float LRs, step for step, and a base
    LR written in place is read again (once). Where the closed form is not what the scheduler's step gives (0 steps,
    a negative milestone) its LRs are read back at every step, as before."""
    name, kwargs, closed = STEP_FUNCTION_BASES[case]
    reads = _OnGPU.reads

    def run(tensor_lr, write_at=None):
        torch.manual_seed(0)
        net = torch.nn.Linear(3, 1)
        lr = torch.tensor(0.1).as_subclass(_OnGPU) if tensor_lr else 0.1
        opt = torch.optim.SGD(net.parameters(), lr=lr)
        base = getattr(torch.optim.lr_scheduler, name)(opt, **kwargs)
        sched = hdet.HDETLR(opt, base, total_steps=10)
        lrs, counts = [], []
        for t in range(10):
            if t == write_at:
                torch.Tensor.mul_(base.base_lrs[0], 2)
            net(torch.ones(2, 3)).sum().backward()
            opt.step()
            opt.zero_grad()
            reads.clear()
            sched.step()
            counts.append(len(reads))
            lrs.append(_lr_value(opt.param_groups[0]["lr"]))
        return lrs, counts

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        floats, _ = run(False)
        tensors, counts = run(True)
        assert tensors == pytest.approx(floats, rel=1e-6)
        if not closed:
            assert all(c >= 1 for c in counts)  # (read back at every step)
            return
        assert len(set(floats)) > 1
        assert counts == [0] * 10  # (the base LR read once, when the scheduler was built)
        written, counts = run(True, write_at=3)
        assert counts == [0] * 3 + [1] + [0] * 6  # (written in place: read again, once)
        assert written[:3] == tensors[:3] and written[3] != pytest.approx(tensors[3])  # (the closed form follows it,
        # as torch's step(epoch) does; its recursive step() over float LRs does not read base_lrs again)


@pytest.mark.parametrize("device", ["cpu", "a stand-in GPU"])
def test_a_chainable_base_does_not_compound_the_spread_where_torch_keeps_the_lr_tensor_as_its_last_lr(device,
                                                                                                   monkeypatch):
    """torch 2.4's LRScheduler kept a tensor LR itself as the scheduler's last LR (2.13 keeps a copy): HDET's in-place
    write of a replica's LR then became the base's last LR, and a chainable base (StepLR) stepped from it, so the
    spread compounded at every step (a review found 0.025, 0.0125, ... where float LRs stay at 0.05). That torch is
    simulated here; the LRs must be those over float LRs."""
    import torch.optim.lr_scheduler as L
    if not hasattr(L, "_param_groups_val_list"):
        pytest.skip("this torch has no _param_groups_val_list to simulate 2.4's aliasing with")
    own = L._param_groups_val_list
    monkeypatch.setattr(L, "_param_groups_val_list",
                        lambda opt, key: [g[key] for g in opt.param_groups] if key == "lr" else own(opt, key))

    def run(kind):
        torch.manual_seed(0)
        net = torch.nn.Linear(3, 1)
        lr = {"float": 0.1, "cpu": torch.tensor(0.1, dtype=torch.float64),
              "a stand-in GPU": torch.tensor(0.1, dtype=torch.float64).as_subclass(_OnGPU)}[kind]
        opt = torch.optim.SGD(net.parameters(), lr=lr)
        sched = hdet.HDETLR(opt, L.StepLR(opt, step_size=4, gamma=0.5), total_steps=8, ensemble_lr_spread_ratio=0.5,
                            model_sync_interval=100, replicas=ScriptedReplicas(0, 2))
        out = []
        for _ in range(8):
            net(torch.ones(2, 3)).sum().backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            out.append(_lr_value(opt.param_groups[0]["lr"]))
        return out

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        floats = run("float")
        assert run(device) == pytest.approx(floats, rel=1e-9) and len(set(floats)) > 1


def test_a_bfloat16_loss_under_a_controller_is_said_once():
    """A bfloat16 loss (a bf16 model's cross-entropy) rounds each loss by up to 0.4%, more than the replicas' losses
    differ, and the controllers ranked the replicas on the rounding (an audit: the fit controller's optimum off by more
    than half the spread at 6-9 of 20 syncs). Said once where a controller runs (the scheduler's loss, the engine's
    losses, a probe's), not without one, and not for a float32 loss."""
    from hdet import ReplicaEngine

    def caught(auto, dtype, engine=False, controller="paper"):
        torch.manual_seed(0)
        net = torch.nn.Linear(2, 1)
        make = lambda o, rep=None, m=None, **kw: hdet.OneCycleAutoLR(  # noqa: E731
            o, max_lr=0.01, total_steps=8, model_sync_interval=2, enable_auto_lr=auto, auto_lr_warmup_steps=2,
            controller=controller, probe=(lambda m: torch.tensor(1.0)) if controller == "fit" else None,
            **({"replicas": rep, "model": m} if engine else
                                   {"replicas": ScriptedReplicas(rank=1, world_size=2), "model": net}))
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            if engine:
                eng = ReplicaEngine(torch.nn.Linear(2, 1), 2, lambda m: torch.optim.SGD(m.parameters(), lr=0.01), make,
                                    mode="loop")
                for _ in range(3):
                    x = torch.randn(2, 4, 2)
                    eng.step((x,), lambda m, b: m(b[0]).pow(2).mean().to(dtype), stacked=True)
            else:
                o = torch.optim.SGD(net.parameters(), lr=0.01)
                s = make(o)
                for _ in range(3):
                    o.step()
                    s.step(torch.tensor(1.5, dtype=dtype))
        return [str(x.message) for x in w if "bfloat16" in str(x.message)]

    for engine in (False, True):
        said = caught(True, torch.bfloat16, engine)
        assert len(said) == 1 and "Compute the loss in float32" in said[0], (engine, said)
        assert caught(False, torch.bfloat16, engine) == [] and caught(True, torch.float32, engine) == []
        assert caught(True, torch.bfloat16, engine, "fit") == []  # (it ranks its probes: a float32 one here)


def test_an_explored_value_that_reads_back_rounded_is_said():
    """A Setter into a bfloat16 buffer holds 1.00333 as 1.0 (a third of the spread's step): the replica trained at
    the rounded value while its records and the controller used the value set, unsaid (an audit). Said at the first
    set, once; a float32 buffer (rounding to 1e-7) is not."""
    def said(dtype, spread=hdet.Spread("linear", 0.01), rank=2):
        temp = torch.ones((), dtype=dtype)
        h = hdet.Setter("temp", lambda: temp, lambda v: temp.fill_(v), spread)
        o = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.01)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            s = hdet.HDETLR(o, None, total_steps=6, model_sync_interval=3, ensemble_lr_spread_ratio=0.0, explore=[h],
                            replicas=ScriptedReplicas(rank=rank, world_size=4))
            for _ in range(2):
                o.step()
                s.step(1.0)
        return [str(x.message) for x in w if "reads back" in str(x.message)]

    got = said(torch.bfloat16)
    assert len(got) == 1 and "'temp' on rank 2 reads back as 1 right after hdet set it to 1.00333" in got[0], got
    assert said(torch.float32) == []
    # only where it matters (session 46's audit): float16 holds rank 2's 1.14471 as 1.14453, 0.07% of the 0.271 step
    # to the nearest other replica's value (0.87358), which was said too; a bfloat16 buffer's 1.14844 (1.4%) is said
    log = hdet.Spread("log", 0.5)
    assert said(torch.float16, log) == []
    assert len(said(torch.bfloat16, log)) == 1


def test_the_step_watch_remembers_only_a_model_that_is_no_ddp(tmp_path):
    """StepWatch.check_join skips a model it found to be no DDP module (no cost a step, hdet.step_watch); a DDP module
    it is given afterwards is still checked: inside ``join()`` without throw_on_early_termination the step is
    refused."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from helpers import in_gloo_world_of_one
    from hdet.loss_scale import LossScale
    from hdet.step_watch import StepWatch

    def run():
        watch = StepWatch(LossScale())
        plain = nn.Linear(3, 1)
        watch.check_join(plain, None)
        watch.check_join(plain, None)  # remembered
        ddp = DDP(nn.Linear(3, 1))
        watch.check_join(ddp, None)  # (a step outside join(): checked, and not remembered)
        with ddp.join():
            with pytest.raises(ValueError, match=r"Expected model.join\(throw_on_early_termination=True\)"):
                watch.check_join(ddp, None)
        with ddp.join(throw_on_early_termination=True):
            watch.check_join(ddp, None)

    in_gloo_world_of_one(tmp_path, run)


def test_an_lr_written_on_one_engine_replica_is_said():
    """The engine's replicas past the first follow replica 0's base schedule (HDETLR.follows); each still checks its
    own optimizer's LRs: one written on replica 2's optimizer between steps is said, naming the group."""
    import warnings

    from hdet.engine import ReplicaEngine

    torch.manual_seed(0)
    eng = ReplicaEngine(nn.Linear(3, 1), 3, lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                        lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=0.1, total_steps=20, model_sync_interval=10,
                                                              ensemble_lr_spread_ratio=0.2, replicas=rep, model=m),
                        mode="vmap")
    batch = torch.randn(3, 4, 3)
    loss = lambda m, b: m(b).square().mean()  # noqa: E731
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in range(4):
            eng.step(batch, loss, stacked=True)
            if t == 1:
                eng.optimizers[2].param_groups[0]["lr"] = 0.5
    said = [str(w.message) for w in caught if "LR was written" in str(w.message)]
    assert len(said) == 1 and said[0].startswith("hdet: param group 0's LR was written to 0.5"), said
