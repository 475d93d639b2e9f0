"""The one-process engine against real gloo processes: same model, data and seeds."""

import contextlib
import copy
import functools
import io
import re
import warnings

import pytest

import hdet
import torch
from torch import nn
from torch.nn import functional as F

from dist_workers import engine_run, spectral_norms, train
from hdet.engine import ReplicaEngine
from helpers import check_ok, one_thread, run_gloo

pytestmark = pytest.mark.distributed


def _train_kw(rank, world, kw):
    return train(rank, world, **kw)


@functools.lru_cache(maxsize=None)
def _gloo_result(world, auto):
    """The gloo run of one (world, auto) case, shared by the loop and vmap comparisons."""
    kw = dict(steps=30, alpha=0.3, T=10, auto=auto, warm=10, opt="sgd")
    return check_ok(run_gloo(_train_kw, world, kw)), kw


# Tolerance: the engine sums the N gradients (and weights at a sync) in replica order; gloo's
# all-reduce may add them in another order, and float addition is not associative, so results can
# differ in the last bits (~1e-7 relative). SGD keeps such differences that small; Adam would not here
# (the bias of a Linear before BatchNorm has an exactly-zero true gradient, and Adam normalises its
# rounding noise into full-size steps). With 2 replicas
# a + b = b + a, so the loop agrees bit for bit; vmap runs batched kernels (a batched matmul sums in
# another order than N separate ones), so it agrees within the same tolerance at 2 and 4. Both sides use one intra-op thread: a different thread
# count changes the summation order inside matmuls, and Adam amplifies those last-bit differences.
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("auto", [False, True])
@pytest.mark.parametrize("mode", ["loop", "vmap"])
def test_engine_equals_gloo_processes(world, auto, mode):
    dist_res, kw = _gloo_result(world, auto)
    with one_thread():  # as the gloo workers (tests/helpers.py)
        eng = engine_run(world, mode=mode, **kw)
    for r in range(world):
        for p_eng, p_dist in zip(eng["params"][r], dist_res[r]["params"]):
            if world == 2 and mode == "loop":
                assert torch.equal(p_eng, p_dist)
            else:
                torch.testing.assert_close(p_eng, p_dist, rtol=1e-5, atol=1e-6)
        for k, b in dist_res[r]["buffers"].items():
            torch.testing.assert_close(eng["buffers"][r][k], b, rtol=1e-5, atol=1e-6)
        assert [row[r] for row in eng["lrs"]] == pytest.approx(dist_res[r]["lrs"], rel=1e-6)


@pytest.mark.parametrize("mode", ["loop", "vmap"])
def test_engine_local_mode_equals_gloo_processes_under_no_sync(mode):
    """share_gradients=False is DDP's no_sync() on every step: 2 gloo processes against the engine,
    SGD, spread and auto-LR, 3 syncs; the replicas differ between syncs (no gradient sharing)."""
    kw = dict(steps=30, alpha=0.3, T=10, auto=True, warm=10, opt="sgd", local=True)
    dist_res = check_ok(run_gloo(_train_kw, 2, {**kw, "check_syncs": True}))
    with one_thread():  # as the gloo workers (tests/helpers.py)
        eng = engine_run(2, mode=mode, **kw)
    assert all(dist_res[0]["differ_before_sync"]) and all(dist_res[0]["equal_after_sync"])
    for r in range(2):
        for p_eng, p_dist in zip(eng["params"][r], dist_res[r]["params"]):
            torch.testing.assert_close(p_eng, p_dist, rtol=1e-5, atol=1e-6)
        assert [row[r] for row in eng["lrs"]] == pytest.approx(dist_res[r]["lrs"], rel=1e-6)
    shared = engine_run(2, mode=mode, **{**kw, "local": False})
    assert not torch.allclose(shared["params"][0][0], eng["params"][0][0])  # local mode is another run


def test_engine_bad_input():
    from torch import nn

    from hdet.engine import ReplicaEngine

    def make_sched(o, rep, m):
        return hdet.OneCycleAutoLR(o, max_lr=0.1, total_steps=5, replicas=rep)

    with pytest.raises(ValueError, match="positive integer number of replicas, but got 0"):
        ReplicaEngine(nn.Linear(2, 1), 0, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), make_sched)
    with pytest.raises(ValueError, match="replicas=<the given view>"):
        ReplicaEngine(nn.Linear(2, 1), 2, lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                      lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=0.1, total_steps=5))
    eng = ReplicaEngine(nn.Linear(2, 1), 2, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), make_sched)
    with pytest.raises(ValueError, match=r"one batch per replica \(2\), but got 3"):
        eng.step([None] * 3, lambda m, b: m(b).sum())


def _sched(steps=5, alpha=0.0):

    return lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=0.1, total_steps=steps, ensemble_lr_spread_ratio=alpha,
                                                 replicas=rep, model=m)


def _sgd(lr=0.1):
    return lambda m: torch.optim.SGD(m.parameters(), lr=lr)


@pytest.mark.parametrize("mode", ["loop", "vmap"])
def test_engine_dropout_differs_per_replica(mode):
    from torch import nn

    from hdet.engine import ReplicaEngine

    torch.manual_seed(0)
    eng = ReplicaEngine(nn.Sequential(nn.Linear(4, 64), nn.Dropout(0.5)), 3, _sgd(0.0), _sched(), mode=mode)
    # the per-replica output (64 values, half of them dropped) is the loss, so the losses tell the masks apart
    losses = eng.step([torch.ones(1, 4)] * 3, lambda m, b: (m(b) ** 2).sum() * 0 + m(b).ne(0).sum().float())
    assert eng.mode == mode
    assert len(set(losses.tolist())) > 1  # identical weights and inputs: only the masks differ


def test_engine_vmap_matches_loop_and_keeps_views():
    """vmap and loop on a model with tied weights, a frozen parameter and dropout 0: same parameters after
    a sync-crossing run; every replica's parameters are views of the stacked tensors; stacked=True input."""
    from torch import nn

    from hdet.engine import ReplicaEngine

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.mid = nn.Linear(8, 8)
            self.frozen = nn.Parameter(torch.ones(8), requires_grad=False)
            self.out = nn.Linear(8, 10, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, x):
            return self.out(torch.tanh(self.mid(self.emb(x))) * self.frozen)

    torch.manual_seed(0)
    model = Tied()
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 10, (12, 4, 5), generator=g)
    loss_fn = lambda m, b: nn.functional.cross_entropy(m(b[:, :-1]).flatten(0, 1), b[:, 1:].flatten())  # noqa: E731
    runs = {}
    for mode in ("loop", "vmap"):
        eng = ReplicaEngine(model, 4, _sgd(0.5), _sched(steps=12, alpha=0.5), mode=mode)
        for t in range(3):  # T = 1000 > steps: the sync is the last step's
            eng.step(data[4 * t: 4 * t + 4], loss_fn, stacked=True)
        runs[mode] = eng
    for ma, mb in zip(runs["loop"].models, runs["vmap"].models):
        assert ma.out.weight is ma.emb.weight and mb.out.weight is mb.emb.weight
        for a, b in zip(ma.parameters(), mb.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert torch.equal(mb.frozen, torch.ones(8))
    # replicas differ (alpha 0.5, no sync yet) and each is a view of the stacked tensor
    v = runs["vmap"]
    assert not torch.equal(v.models[0].mid.weight, v.models[3].mid.weight)
    for r, m in enumerate(v.models):
        assert m.mid.weight.data_ptr() == v.stacked_params["mid.weight"][r].data_ptr()


def test_engine_falls_back_to_loop_with_a_warning():
    from torch import nn

    from hdet.engine import ReplicaEngine

    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 1)

        def forward(self, x):
            y = self.lin(x)
            return y * 2 if y.sum() > 0 else y  # data-dependent control flow: vmap cannot batch it

    eng = ReplicaEngine(DataDependent(), 2, _sgd(), _sched())
    with pytest.warns(UserWarning, match="vmap cannot run this model"):
        eng.step([torch.ones(2, 3)] * 2, lambda m, b: m(b).sum())
    assert eng.mode == "loop"
    eng.step([torch.ones(2, 3)] * 2, lambda m, b: m(b).sum())  # and keeps training
    with pytest.raises(RuntimeError, match="vmap"):
        ReplicaEngine(DataDependent(), 2, _sgd(), _sched(), mode="vmap").step(
            [torch.ones(2, 3)] * 2, lambda m, b: m(b).sum())
    with pytest.raises(ValueError, match="mode in"):
        ReplicaEngine(DataDependent(), 2, _sgd(), _sched(), mode="fast")
    with pytest.raises(ValueError, match=r"one batch per replica \(2\), but got 3"):
        eng.step(torch.ones(3, 2, 3), lambda m, b: m(b).sum(), stacked=True)
    with pytest.raises(ValueError, match="scalar loss"):
        eng.step([torch.ones(2, 3)] * 2, lambda m, b: m(b))


class _Branchy(nn.Module):
    """fc2 only where the batch's mean is positive (data-dependent: the loop runs it), dropout before the branch."""

    def __init__(self, p=0.0):
        super().__init__()
        self.fc1, self.drop, self.fc2, self.out = nn.Linear(3, 4), nn.Dropout(p), nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x):
        h = self.drop(torch.relu(self.fc1(x)))
        if x.mean().item() > 0:
            h = torch.relu(self.fc2(h))
        return self.out(h)


def test_the_loop_averages_a_parameter_some_replicas_used_as_ddp_does():
    """A data-dependent branch that uses fc2 on replicas 0 and 2 and not on 1: the loop raised "Parameter 2 has a
    gradient on some replicas and not on others" (an audit) where DDP (find_unused_parameters=True) trains, each rank
    taking (g_0 + g_2) / 3; now the same, on every replica. A parameter frozen on some replicas only is named."""
    torch.manual_seed(0)
    model = _Branchy()
    xs = [torch.randn(5, 3).abs(), -torch.randn(5, 3).abs(), torch.randn(5, 3).abs()]
    ys = [torch.randn(5, 1) for _ in xs]
    eng = ReplicaEngine(model, 3, _sgd(0.1), _sched(steps=4), mode="loop")
    eng.step(list(zip(xs, ys)), lambda m, b: F.mse_loss(m(b[0]), b[1]))
    grads = []  # the reference: each replica's gradients alone, None where its loss did not reach
    for x, y in zip(xs, ys):
        ref = copy.deepcopy(model)
        F.mse_loss(ref(x), y).backward()
        grads.append([p.grad for p in ref.parameters()])
    for i, p0 in enumerate(model.parameters()):  # (the step's LR: OneCycleLR's first, max_lr / 25, at alpha 0)
        mean = sum(g[i] if g[i] is not None else torch.zeros_like(p0) for g in grads) / 3
        for m in eng.models:
            torch.testing.assert_close(list(m.parameters())[i].detach(), p0.detach() - 0.1 / 25 * mean)
    with torch.no_grad():
        eng.models[1].fc2.weight.requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"'fc2.weight' trainable on every replica or on none, but replica\(s\) \[1\]"):
        eng.step(list(zip(xs, ys)), lambda m, b: F.mse_loss(m(b[0]), b[1]))


def test_auto_falling_back_to_the_loop_draws_what_the_loop_draws():
    """The failed vmap attempt drew dropout masks: auto's fallback put the buffers back but not the random state, so its
    losses differed from mode="loop"'s from the same seed (0.96 against 0.67 on replica 0: an audit)."""
    out = {}
    for mode in ("auto", "loop"):
        torch.manual_seed(0)
        eng = ReplicaEngine(_Branchy(0.5), 3, _sgd(), _sched(), mode=mode)
        torch.manual_seed(123)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out[mode] = (eng.step(torch.randn(3, 5, 3), lambda m, b: m(b).sum(), stacked=True), torch.get_rng_state())
        assert eng.mode == "loop"
    assert torch.equal(out["auto"][0], out["loop"][0]) and torch.equal(out["auto"][1], out["loop"][1])


class _Skips(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.out = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x, use_fc2=True):
        h = torch.relu(self.fc1(x))
        return self.out(torch.relu(self.fc2(h)) if use_fc2 else h)


@pytest.mark.parametrize("mode", ["vmap", "merged"])
def test_a_resume_after_the_stacked_step_gave_way_goes_on_per_replica_exactly(mode):
    """fc2 unused at step 3 sends the engine to each replica's optimizer.step(); a state saved after that and loaded
    into a fresh engine ran the stacked step again, which rounds otherwise (momentum 1.2e-7 off by step 10: an
    audit). The saved path is kept now: the resume is bit for bit."""
    steps, save_at = 8, 4
    torch.manual_seed(0)
    base = _Skips()
    data = [(torch.randn(3, 5, 3), torch.randn(3, 5, 1)) for _ in range(steps)]

    def loss_at(t):
        return lambda m, b: F.mse_loss(m(b[0], t != 3), b[1])

    def engine():
        return ReplicaEngine(copy.deepcopy(base), 3, lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9,
                                                                               nesterov=True, weight_decay=0.1),
                             _sched(steps=12, alpha=0.3), mode=mode)

    def run(eng, a, b):
        for t in range(a, b + 1):
            eng.step(data[t - 1], loss_at(t), stacked=True)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full, part = engine(), engine()
        run(full, 1, steps)
        run(part, 1, save_at)
        assert part.optimizer_path.startswith("per-replica")
        buf = io.BytesIO()
        torch.save(part.state_dict(), buf)
        resumed = engine()
        assert resumed.optimizer_path == "stacked"
    with pytest.warns(UserWarning, match="the saved engine had gone over to each replica's optimizer step"):
        resumed.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    assert resumed.optimizer_path.startswith("per-replica") and resumed.optimizer_path.endswith("as the saved engine")
    assert resumed.state_dict()["stacked_gave_way"] == part.state_dict()["stacked_gave_way"]  # (a second resume
    # says the reason once)
    run(resumed, save_at + 1, steps)
    assert full.mode == resumed.mode == mode
    with warnings.catch_warnings():  # a state of an engine that stepped per replica from the start (its mode or its
        warnings.simplefilter("error")  # choice, not a switch during the run) leaves a stacked engine stacked (a
        for how in ({"mode": "loop"}, {"stacked_optimizer": False}):  # review)
            other = ReplicaEngine(copy.deepcopy(base), 3, lambda m: torch.optim.SGD(m.parameters(), lr=0.05), _sched(),
                                  **{"mode": mode, **how})
            fresh = ReplicaEngine(copy.deepcopy(base), 3, lambda m: torch.optim.SGD(m.parameters(), lr=0.05), _sched(),
                                  mode=mode)
            fresh.load_state_dict(other.state_dict())
            assert fresh.optimizer_path == "stacked"
    for a, b, oa, ob in zip(full.models, resumed.models, full.optimizers, resumed.optimizers):
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.equal(p, q)
            assert torch.equal(oa.state[p]["momentum_buffer"], ob.state[q]["momentum_buffer"])


def test_an_engine_resumed_into_a_longer_schedule_says_the_run_keeps_its_length():
    """A review: the engine's own end-of-run check fired first, saying "raise total_steps", which the user had."""
    def engine(total):
        torch.manual_seed(0)
        return ReplicaEngine(nn.Linear(3, 1), 2, _sgd(), _sched(steps=total))
    a = engine(4)
    for _ in range(4):
        a.step(torch.randn(2, 5, 3), lambda m, b: m(b).pow(2).mean(), stacked=True)
    b = engine(8)
    with pytest.warns(UserWarning, match=r"total_steps 4 \(built with 8\)"):
        b.load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match=r"step 5; this scheduler was built with total_steps=8, and the state it "
                                         r"loaded keeps its run's length, 4"):
        b.step(torch.randn(2, 5, 3), lambda m, b: m(b).pow(2).mean(), stacked=True)


def test_engine_compile_matches_eager():
    """compile=True (torch.compile of the vmapped forward) trains the same replicas as eager vmap."""
    from torch import nn

    from dist_workers import batch, make_model
    from hdet.engine import ReplicaEngine

    def run(compile):
        eng = ReplicaEngine(make_model(0), 4, lambda m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
                            _sched(steps=6, alpha=0.3), mode="vmap", compile=compile)
        for t in range(1, 7):
            eng.step([batch(r, t) for r in range(4)], lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]))
        return eng

    eager, compiled = run(False), run(True)
    for me, mc in zip(eager.models, compiled.models):
        for a, b in zip([*me.parameters(), *me.buffers()], [*mc.parameters(), *mc.buffers()]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _same(a, b, where="") -> None:
    """Nested state (dicts, lists, tensors, numbers) equal value for value."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    else:
        assert a == b or (a != a and b != b), (where, a, b)  # (NaN == NaN)


@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_replicas_follow_replica_0s_base_schedule_exactly(opt):
    """Issue 19: the engine steps the base schedule once (replica 0's) and the other replicas take its state
    (OneCycle's step count and last LR, and the momentum it cycles) instead of computing it again. Every
    replica's scheduler state, LR, momentum and explored values are those of each replica stepping its own,
    through syncs, the fit controller and explored beta2 / weight decay."""
    from torch import nn

    from dist_workers import batch, make_model
    from hdet.engine import ReplicaEngine

    def make_opt(m):
        if opt == "adamw":
            return torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.01)
        return torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9, weight_decay=0.01)

    def make_sched(o, rep, m):
        explore = [hdet.WeightDecay(o, alpha=0.5)] + ([hdet.AdamBeta(o, 1, alpha=0.01)] if opt == "adamw" else [])
        return hdet.OneCycleAutoLR(o, max_lr=0.02, total_steps=24, ensemble_lr_spread_ratio=0.3, model_sync_interval=4,
                                   enable_auto_lr=True, auto_lr_warmup_steps=8, replicas=rep, model=m,
                                   probe=lambda mod: mod(batch(0, 0)[0]).pow(2).mean(), explore=explore)

    def run(follow):
        eng = ReplicaEngine(make_model(0), 4, make_opt, make_sched, mode="vmap")
        eng.share_base_schedule = follow  # False: every replica steps its own base schedule
        for t in range(1, 22):
            eng.step([batch(r, t) for r in range(4)], lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]))
            assert eng._following is (follow or None)
        return eng

    fast, slow = run(True), run(False)
    for sf, ss, of, os_ in zip(fast.schedulers, slow.schedulers, fast.optimizers, slow.optimizers):
        _same(sf.state_dict(), ss.state_dict(), "scheduler")
        assert sf.get_last_lr() == ss.get_last_lr()
        for gf, gs in zip(of.param_groups, os_.param_groups):
            _same({k: v for k, v in gf.items() if k != "params"}, {k: v for k, v in gs.items() if k != "params"})
    assert len({tuple(s.get_last_lr()) for s in fast.schedulers}) == 4  # the spread: four LRs
    key = "betas" if opt == "adamw" else "momentum"
    assert fast.optimizers[0].param_groups[0][key] != make_opt(make_model(0)).param_groups[0][key]  # it cycled
    for mf, ms in zip(fast.models, slow.models):
        assert all(torch.equal(a, b) for a, b in zip(mf.parameters(), ms.parameters()))


def test_replicas_with_different_schedules_step_their_own():
    """A make_scheduler that gives replicas different base schedules: each steps its own (nothing is shared)."""
    from torch import nn

    from dist_workers import batch, make_model
    from hdet.engine import ReplicaEngine

    eng = ReplicaEngine(make_model(0), 2, _sgd(0.01),
                        lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=0.01 * (1 + rep.rank), total_steps=10,
                                                              ensemble_lr_spread_ratio=0.0, replicas=rep, model=m),
                        mode="vmap")
    for t in range(1, 4):
        eng.step([batch(r, t) for r in range(2)], lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]))
    assert eng._follow() is False
    lrs = [s.get_last_lr()[0] for s in eng.schedulers]
    assert lrs[1] == pytest.approx(2 * lrs[0])


def test_compile_runs_several_models_and_batch_sizes_in_one_process():
    """Issue 19: a second model in one process (or a new batch size) used to turn torch.compile's shapes dynamic,
    which vmap cannot trace ("Cannot call sizes() on tensor with symbolic sizes"), and the engine fell back to
    eager. Each shape now compiles on its own (``dynamic=False``): every engine stays compiled."""
    import warnings as _w

    from torch import nn

    from hdet.engine import ReplicaEngine

    def loss_fn(m, b):
        return nn.functional.mse_loss(m(b[0]), b[1])

    with _w.catch_warnings(record=True) as seen:
        _w.simplefilter("always")
        for width, batch in ((4, 3), (6, 3), (6, 5)):
            torch.manual_seed(0)
            eng = ReplicaEngine(nn.Sequential(nn.Linear(3, width), nn.Tanh(), nn.Linear(width, 1)), 2,
                                lambda m: torch.optim.SGD(m.parameters(), lr=0.1), _sched(steps=2, alpha=0.2),
                                mode="vmap", compile=True)
            for _ in range(2):
                eng.step((torch.randn(2, batch, 2, 3), torch.randn(2, batch, 2, 1)), loss_fn, stacked=True)
            assert eng._fns[loss_fn][1] is not None, width  # still the compiled function
    assert not [w for w in seen if "torch.compile cannot run" in str(w.message)]


@pytest.mark.parametrize("mode", ["loop", "vmap"])
@pytest.mark.parametrize("fault", ["weights", "loss"])
def test_engine_recovers_a_non_finite_replica(mode, fault):
    """The engine's semantics match the gloo test (tests/test_distributed.py): replica 2's NaN stays its
    own (guarded gradient average), the converge step resets it, training goes on."""
    from torch import nn

    from dist_workers import batch, make_model
    from hdet.engine import ReplicaEngine

    eng = ReplicaEngine(make_model(0), 4, lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
                        lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=0.02, total_steps=20,
                                                              ensemble_lr_spread_ratio=0.2, model_sync_interval=5,
                                                              controller="paper", enable_auto_lr=True, auto_lr_warmup_steps=5,
                                                              loss_scale=0.05, replicas=rep, model=m), mode=mode)

    def loss_fn(m, b):
        loss = nn.functional.mse_loss(m(b[0]), b[1])
        return loss * b[2]  # b[2]: 1, or NaN for the faulty replica's loss

    for t in range(1, 21):
        if fault == "weights" and t == 7:
            with torch.no_grad():
                eng.models[2][0].weight[0, 0] = float("nan")
        scale = [torch.tensor(float("nan") if (fault == "loss" and t == 7 and r == 2) else 1.0) for r in range(4)]
        with pytest.warns(UserWarning, match=r"replica\(s\) \[2\]") if t == 10 else contextlib.nullcontext():
            eng.step([(*batch(r, t), scale[r]) for r in range(4)], loss_fn)
        for r, m in enumerate(eng.models):
            ok = all(torch.isfinite(p).all() for p in m.parameters())
            assert ok or (r == 2 and fault == "weights" and 7 <= t < 10), (t, r)
    assert eng.schedulers[0].ensemble.controllers[0].updates == 4
    ref = list(eng.models[0].parameters())
    for m in eng.models[1:]:
        assert all(torch.equal(a, b) for a, b in zip(ref, m.parameters()))


def test_compile_that_fails_falls_back_to_eager_vmap_with_a_warning(monkeypatch):
    """torch.compile of a vmapped model can fail (issue 19: a second model in one process met a fake-tensor
    error): the engine says so and runs the same vmapped model eagerly, never a crash."""
    import warnings as _w

    import hdet
    from hdet.engine import ReplicaEngine

    def broken(fn, *a, **k):
        def call(*args, **kw):
            raise RuntimeError("RuntimeError when making fake tensor call\nmore lines")
        return call

    monkeypatch.setattr(torch, "compile", broken)
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 1)
    results = []
    for compile in (False, True):
        eng = ReplicaEngine(m, 2, lambda mod: torch.optim.SGD(mod.parameters(), lr=0.1),
                            lambda o, rep, mod: hdet.HDETLR(o, None, total_steps=4, replicas=rep, model=mod,
                                                            ensemble_lr_spread_ratio=0.2, model_sync_interval=2),
                            mode="vmap", compile=compile)
        g = torch.Generator().manual_seed(1)

        def loss_fn(mod, x):
            return mod(x).pow(2).mean()

        with _w.catch_warnings(record=True) as seen:
            _w.simplefilter("always")
            for _ in range(4):
                eng.step([torch.randn(4, 3, generator=g) for _ in range(2)], loss_fn)
        results.append([p.detach().clone() for p in eng.models[0].parameters()])
        msgs = [str(w.message) for w in seen if "torch.compile cannot run" in str(w.message)]
        assert len(msgs) == (1 if compile else 0) and eng.mode == "vmap"
        if compile:
            assert "RuntimeError: RuntimeError when making fake tensor call); running it eagerly" in msgs[0]
    assert all(torch.equal(a, b) for a, b in zip(*results))  # the same training, compiled or not


def test_loop_mode_averages_fp16_gradients_without_overflowing_the_check():
    """Loop mode, fp16 weights: replica 0's gradient is 1500 in each of 64 elements (finite; its sum, 96000,
    is above fp16's 65504), replica 1's is 10. The average is 755 (the finiteness check summed in fp16 and
    dropped replica 0's healthy gradient: 5)."""
    from torch import nn

    from hdet.engine import ReplicaEngine

    eng = ReplicaEngine(nn.Linear(64, 1, bias=False).half(), 2, _sgd(0.0), _sched(), mode="loop")
    eng.step([torch.tensor(1500.0, dtype=torch.float16), torch.tensor(10.0, dtype=torch.float16)],
             lambda m, b: (m.weight * b).sum())
    assert torch.equal(eng.models[0].weight.grad, torch.full((1, 64), 755.0, dtype=torch.float16))


def test_one_object_for_every_replica_is_refused_where_they_all_start_at_one_value():
    """A Setter on shared state whose replicas all hold one value when the engine is built (a KL weight warmed up from
    0): setting each replica's value again moved nothing to see, and every replica trained at the last one's value
    from the first step on, unsaid (an audit of session 46). A probe value apart from theirs tells; one object per
    replica, at one value each as well, is taken (the probe leaves each at its value)."""
    import types

    from torch import nn

    from hdet.engine import ReplicaEngine

    def make(cfg_of):
        def build(o, rep, m):
            cfg = cfg_of(m)
            return hdet.HDETLR(o, None, 8, ensemble_lr_spread_ratio=0.0, model_sync_interval=4, replicas=rep, model=m,
                               explore=[hdet.Setter("kl_weight", lambda: cfg.beta, lambda v: setattr(cfg, "beta", v),
                                                    hdet.Spread("log", 0.5, (0.0, 10.0)), base=1.0,
                                                    schedule=lambda t: min(1.0, t / 4))])
        return build
    shared = types.SimpleNamespace(beta=1.0)
    with pytest.raises(ValueError, match=r"explored kl_weight to act on its own object, but setting replica 0's"):
        ReplicaEngine(nn.Linear(4, 1), 3, _sgd(0.1), make(lambda m: shared))

    def own(m):
        m.cfg = types.SimpleNamespace(beta=1.0)
        return m.cfg
    eng = ReplicaEngine(nn.Linear(4, 1), 3, _sgd(0.1), make(own))
    assert [m.cfg.beta for m in eng.models] == [0.0, 0.0, 0.0]
    eng.step([(torch.randn(4, 4), torch.randn(4, 1))] * 3, lambda m, b: (m(b[0]) - b[1]).pow(2).mean() * m.cfg.beta)
    betas = [m.cfg.beta for m in eng.models]
    assert len(set(betas)) == 3 and betas == [s.ensemble.all_values()[-1][r] for r, s in enumerate(eng.schedulers)]


@pytest.mark.parametrize("kind", ["rejects", "rounds"])
def test_the_sharing_probe_respects_a_setter_that_rejects_or_rounds_its_value(kind):
    """The probe above set a value of its own choosing (a quarter above the replicas' common one): a Setter that
    rejects it (a probability, 0.9 -> 1.125, under the additive spread's unbounded default bounds) made the engine's
    construction fail, and a Setter that rounds to an int (1 -> 1.25 -> 1) moved nothing to see, so one shared
    object passed (session 46's review, B2 and H3). A rejected or unseen probe value gives way to the next one: one
    object per replica is built, one shared object is still refused."""
    import types

    from torch import nn

    from hdet.engine import ReplicaEngine

    start = 0.9 if kind == "rejects" else 1.0

    def setter(cfg):
        def set_(v):
            if kind == "rejects" and not 0.0 <= v <= 1.0:
                raise ValueError(f"a probability, got {v}")
            cfg.p = int(round(v)) if kind == "rounds" else v
        return set_

    def make(cfg_of):
        def build(o, rep, m):
            cfg = cfg_of(m)
            return hdet.HDETLR(o, None, 8, ensemble_lr_spread_ratio=0.0, model_sync_interval=4, replicas=rep, model=m,
                               explore=[hdet.Setter("p", lambda: cfg.p, setter(cfg), hdet.Spread("additive", 0.0),
                                                    base=start)])
        return build

    def own(m):
        m.cfg = types.SimpleNamespace(p=start)
        return m.cfg
    eng = ReplicaEngine(nn.Linear(4, 1), 3, _sgd(0.1), make(own))
    assert [m.cfg.p for m in eng.models] == [start] * 3
    shared = types.SimpleNamespace(p=start)
    with pytest.raises(ValueError, match=r"explored p to act on its own object, but setting replica 0's"):
        ReplicaEngine(nn.Linear(4, 1), 3, _sgd(0.1), make(lambda m: shared))
    assert shared.p == start


def test_one_explored_object_for_every_replica_is_refused_and_one_each_works():
    """LabelSmoothing on one criterion shared by the replicas: the last replica's value held for all of them
    while the records reported a spread (silently). Refused with the advice; one criterion per replica (built
    on the replica's module in make_scheduler) gives each replica its own value."""
    from torch import nn

    from hdet.engine import ReplicaEngine

    def make(explore):
        return lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=1e-2, total_steps=6, ensemble_lr_spread_ratio=0.2,
                                                     model_sync_interval=3, model=m, replicas=rep, explore=explore(m))
    crit = nn.CrossEntropyLoss(label_smoothing=0.1)
    with pytest.raises(ValueError, match=r"explored label_smoothing to act on its own object.*m\.crit"):
        ReplicaEngine(nn.Linear(4, 3), 4, _sgd(0.01), make(lambda m: [hdet.LabelSmoothing(crit)]))

    def own(m):
        m.crit = nn.CrossEntropyLoss(label_smoothing=0.1)
        return [hdet.LabelSmoothing(m.crit)]
    eng = ReplicaEngine(nn.Linear(4, 3), 4, _sgd(0.01), make(own))
    seen = []

    def loss_fn(m, b):
        seen.append(m.crit.label_smoothing)
        return m.crit(m(b[0]), b[1])
    eng.step([(torch.randn(2, 4), torch.tensor([0, 1]))] * 4, loss_fn)
    assert sorted(seen) == pytest.approx([0.05, 0.1 - 0.05 / 3, 0.1 + 0.05 / 3, 0.15])
    assert seen == pytest.approx([s.ensemble.all_values()[1][r] for r, s in enumerate(eng.schedulers)])


def test_a_value_each_replica_keeps_in_a_float32_buffer_is_its_own():
    """A vmap-safe Setter on a float32 buffer per replica (a temperature): its read-back differs from the value set
    by float32 rounding, which was taken for one object serving every replica (refused with the wrong advice)."""
    from torch import nn

    from hdet.engine import ReplicaEngine

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 3)
            self.register_buffer("temp", torch.tensor(1.0))

        def forward(self, x):
            return self.lin(x) / self.temp

    def engine(N, spread, dtype=torch.float32):
        def make(o, rep, m):
            return hdet.HDETLR(o, None, 12, ensemble_lr_spread_ratio=0.2, model_sync_interval=5, replicas=rep, model=m,
                               explore=[hdet.Setter("temperature", lambda: float(m.temp), lambda v: m.temp.fill_(v),
                                                    spread, vmap_safe=True)])
        return ReplicaEngine(M().to(dtype), N, _sgd(0.1), make, mode="vmap")

    eng = engine(4, hdet.Spread("log", 0.5))
    temps = [float(m.temp) for m in eng.models]
    assert temps == pytest.approx([s.ensemble.all_values()[1][r] for r, s in enumerate(eng.schedulers)], rel=1e-6)
    assert len(set(temps)) == 4
    # in a bfloat16 buffer a value rounded to midway between two replicas' was refused as "one object serves them
    # all" (an audit): said as the rounding it is, by the replica whose value moved, and the engine runs
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        eng = engine(4, hdet.Spread("linear", 0.01), torch.bfloat16)
    assert sorted(float(m.temp) for m in eng.models) == [0.98828125, 0.99609375, 1.0, 1.0078125]
    # said once for the engine's replicas, not by each replica whose value rounds (three of the four here)
    rounded = [str(x.message) for x in w if "reads back as" in str(x.message)]
    assert len(rounded) == 1, rounded
    # a rounding that lands on another replica's value (N = 3, a log spread of 0.003: replica 1's 1.003 held as the
    # middle replica's 1.0) is no shared object either (a review: still refused by a rule on the values read)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        eng = engine(3, hdet.Spread("log", 0.003), torch.bfloat16)
    assert sorted(float(m.temp) for m in eng.models) == [0.99609375, 1.0, 1.0]
    # said once, by the first replica whose value rounds (which one follows the deal of the multipliers); before,
    # each replica said its own
    rounded = [str(x.message) for x in w if "reads back as" in str(x.message)]
    got = re.search(r"'temperature' on rank [0-2] reads back as ([0-9.]+) right after hdet set it to ([0-9.]+) ",
                    rounded[0] if len(rounded) == 1 else "")
    assert got and float(got[1]) in (0.996094, 1.0) and float(got[1]) != float(got[2]), rounded


def test_the_record_reports_each_replicas_own_window_loss_after_a_non_finite_one():
    """Replica 1's batch is NaN at step 2 (its loss is NaN, its weights stay finite): the sync record's window loss
    for it is the mean of its finite losses (telemetry, sync_scalars and syncs.jsonl report it), not the
    controller's ranking proxy (the worst healthy loss plus ten loss temperatures, reported before)."""
    import warnings

    from torch import nn

    from hdet.engine import ReplicaEngine

    torch.manual_seed(0)
    eng = ReplicaEngine(nn.Linear(3, 1), 3, _sgd(0.05), _sched(steps=4, alpha=0.2), mode="vmap")
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the non-finite loss's warning
        for t in range(1, 5):
            x = torch.randn(3, 8, 3, generator=torch.Generator().manual_seed(t))
            if t == 2:
                x[1, 0, 0] = float("nan")
            seen.append(eng.step((x, x[..., :1].sin()), lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]),
                                 stacked=True).tolist())
    rec = eng.schedulers[0].last_sync
    assert rec.step == 4 and rec.nonfinite_losses == [0, 1, 0]
    own = [row[1] for row in seen if row[1] == row[1]]  # replica 1's finite losses
    assert rec.losses[1] == pytest.approx(sum(own) / len(own), rel=1e-6)
    assert rec.losses[0] == pytest.approx(sum(row[0] for row in seen) / 4, rel=1e-6)



def test_compile_takes_torch_compiles_keyword_arguments(monkeypatch):
    """``compile={"mode": "reduce-overhead"}`` (CUDA graphs) reaches torch.compile, with the engine's dynamic=False,
    and the stacked tensors become static addresses; anything but a bool or a dict is refused."""
    from torch import nn

    from hdet.engine import ReplicaEngine

    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(kw) or fn)

    def build(compile):
        torch.manual_seed(0)
        return ReplicaEngine(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)), 2,
                             lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
                             lambda o, rep, m: hdet.HDETLR(o, None, total_steps=4, replicas=rep, model=m),
                             mode="vmap", compile=compile)

    eng = build({"mode": "reduce-overhead"})
    x = torch.randn(2, 5, 3)
    eng.step((x, x[..., :1]), lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]), stacked=True)
    assert seen == [{"dynamic": False, "mode": "reduce-overhead"}]
    # CUDA graphs read the stacked tensors where they are (updated in place): static addresses, not copied inputs
    assert all(getattr(t, "_dynamo_static_input_type", None) for t in eng.stacked_params.values())
    plain = build({"mode": "default"})
    plain.step((x, x[..., :1]), lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]), stacked=True)
    assert not any(hasattr(t, "_dynamo_static_input_type") for t in plain.stacked_params.values())
    build({}).step((x, x[..., :1]), lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]), stacked=True)
    assert seen[-1] == {"dynamic": False}  # an empty dict compiles too (torch.compile's defaults)
    graphs = build({"options": {"triton.cudagraphs": True}})
    graphs.step((x, x[..., :1]), lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]), stacked=True)
    assert all(getattr(t, "_dynamo_static_input_type", None) for t in graphs.stacked_params.values())
    with pytest.raises(ValueError, match="Expected compile to be a bool or a dict of torch.compile's keyword arguments, "
                                         "but got str"):
        build("reduce-overhead")


@pytest.mark.parametrize("stacked", [True, False])
def test_half_precision_gradients_and_averages_are_summed_in_float32(stacked):
    """fp16 replicas in the engine: the shared gradient summed N fp16 gradients of 1e4 to +Inf before dividing (the
    weights went non-finite; the loop gave 1e4), and a converge step summed BatchNorm's running_var (~9e3 on 8
    replicas) to +Inf. Both are now summed in float32 and rounded once."""
    from hdet.engine import ReplicaEngine

    torch.manual_seed(0)
    net = nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 1, bias=False)).half()
    N = 8
    eng = ReplicaEngine(net, N, lambda m: torch.optim.SGD(m.parameters(), lr=1e-9),
                        lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=1e-9, total_steps=4, model_sync_interval=2,
                                                              ensemble_lr_spread_ratio=0.2, model=m, replicas=rep),
                        mode="vmap", stacked_optimizer=stacked)
    x = torch.randn(N, 16, 4).half()

    def loss(m, b):  # the weight's gradient: 1e4 on every replica
        return m(b).float().sum() * 0 + (m[1].weight.float() * 1e4).sum()
    eng.step(x, loss, stacked=True)
    assert torch.equal(eng.models[0][1].weight.grad, torch.full((1, 4), 1e4, dtype=torch.float16))
    for r, m in enumerate(eng.models):
        m[0].running_var.fill_(9000.0 + 100 * r)
    before = torch.stack([m[0].running_var.double() for m in eng.models])
    for m in eng.models:  # (eval: the step's forward leaves the statistics as set)
        m.eval()
    eng.step(x, loss, stacked=True)  # a converge step
    want = before.mean(0).half()
    assert all(torch.equal(m[0].running_var, want) for m in eng.models)
    assert all(torch.isfinite(p).all() for m in eng.models for p in m.parameters())


def test_equal_bf16_replicas_stay_equal_through_a_converge_step():
    """bf16 replicas equal before a converge step changed after it (summed in bf16 at N = 8: up to 0.94% of a frozen
    layer's weights, an audit); the mean of any bf16 values is now rounded once from a float32 sum."""
    from hdet.replicas import average_local

    torch.manual_seed(0)
    w = torch.randn(1000).bfloat16()
    lists = [[w.clone()] for _ in range(8)]
    average_local(lists)
    assert all(torch.equal(t[0], w) for t in lists)
    apart = [[(w.float() * (1 + 0.01 * r)).bfloat16()] for r in range(3)]
    want = (sum(t[0].double() for t in apart) / 3).bfloat16()
    average_local(apart)
    assert (apart[0][0].float() - want.float()).abs().max() <= want.float().abs().max() * 2 ** -8  # within an ulp
    assert (apart[0][0] != want).float().mean() < 0.01  # the correctly rounded mean but for double-rounding ties


@pytest.mark.parametrize("mode", ["loop", "vmap"])
def test_both_modes_average_bf16_gradients_in_float32(mode):
    """Three bf16 replicas with the same gradient: its mean is that gradient. Loop mode divided each by N in bf16 and
    summed (32 replicas: up to 2.9% off; here, N = 3: some elements a bit off), where vmap mode sums in float32."""
    from hdet.engine import ReplicaEngine

    torch.manual_seed(0)
    c = (1 + torch.rand(1, 40)).bfloat16()  # each replica's weight gradient
    eng = ReplicaEngine(nn.Linear(40, 1, bias=False).bfloat16(), 3, lambda m: torch.optim.SGD(m.parameters(), lr=1e-9),
                        lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=1e-9, total_steps=4, model_sync_interval=2,
                                                              ensemble_lr_spread_ratio=0.2, model=m, replicas=rep),
                        mode=mode)
    eng.step(torch.zeros(3, 2, 40).bfloat16(), lambda m, b: (m(b).float().sum() * 0 + (m.weight.float() * c.float()).sum()),
             stacked=True)
    assert all(torch.equal(m.weight.grad, c) for m in eng.models)


@pytest.mark.parametrize("mode", ["loop", "vmap"])
def test_engine_finish_averages_the_replicas_of_a_run_left_early(mode):
    """Steps 1-7 of 20 (T = 5): the replicas are apart after step 7; finish() averages them (their mean, once), as
    the last step would have; after step 10, a sync step, it does nothing."""
    from hdet.engine import ReplicaEngine

    torch.manual_seed(0)
    sched = lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=0.1, total_steps=20, ensemble_lr_spread_ratio=0.5,  # noqa: E731
                                                  model_sync_interval=5, replicas=rep, model=m)
    eng = ReplicaEngine(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)), 3, _sgd(0.1), sched, mode=mode)
    g = torch.Generator().manual_seed(1)
    loss_fn = lambda m, b: nn.functional.mse_loss(m(b), b[:, :1])  # noqa: E731
    for _ in range(7):
        eng.step([torch.randn(8, 4, generator=g) for _ in range(3)], loss_fn)
    flat = lambda m: torch.cat([p.detach().reshape(-1) for p in m.parameters()])  # noqa: E731
    before = [flat(m).clone() for m in eng.models]
    assert not torch.equal(before[0], before[1])
    assert eng.finish() and not eng.finish()
    mean = sum(before) / 3
    for m in eng.models:
        torch.testing.assert_close(flat(m), mean, rtol=1e-6, atol=1e-7)
    for _ in range(3):
        eng.step([torch.randn(8, 4, generator=g) for _ in range(3)], loss_fn)
    assert eng.steps_taken == 10 and not eng.finish()


def test_engine_finish_after_a_resume_from_its_own_checkpoint_is_no_second_sync():
    """finish() at step 10 (T = 4, the range test ramping), a checkpoint, a resume, finish() again (an integration
    that resumes from its last checkpoint and ends at once): whether finish() ran was not in the state, so the resumed
    run synced again over an empty window, whose NaN loss ended the range test as "rising" and went back, the LR 4x
    lower (an audit). It does nothing now, as in the process that saved it."""
    import io

    from hdet.engine import ReplicaEngine

    def build():
        torch.manual_seed(0)
        sched = lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=0.02, total_steps=60, ensemble_lr_spread_ratio=0.3,  # noqa: E731
                                                      model_sync_interval=4, replicas=rep, model=m, lr_range_test=True,
                                                      auto_lr_warmup_steps=24)
        return ReplicaEngine(nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1)), 4,
                             lambda m: torch.optim.AdamW(m.parameters(), lr=0.02), sched, mode="loop")

    eng = build()
    for t in range(1, 11):
        x = torch.randn(4, 16, 3, generator=torch.Generator().manual_seed(t))
        eng.step((x, x[..., :1].sin()), lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), stacked=True)
    assert eng.finish()
    buf = io.BytesIO()
    torch.save(eng.state_dict(), buf)
    buf.seek(0)
    resumed = build()
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    assert not resumed.finish() and not eng.finish()
    rt = resumed.schedulers[0].ensemble.slots.range
    assert rt.ramping and rt.reason is None
    assert resumed.schedulers[0].get_last_lr() == eng.schedulers[0].get_last_lr()


def test_engine_finish_sets_the_values_its_sync_deals():
    """finish() is a whole sync: under the range test its ramp moves there, and the replicas' LRs must follow for
    training to go on (they kept the values from before it: a review)."""
    from hdet.engine import ReplicaEngine

    torch.manual_seed(0)
    sched = lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=0.1, total_steps=20, ensemble_lr_spread_ratio=0.5,  # noqa: E731
                                                  model_sync_interval=5, replicas=rep, model=m, lr_range_test=True,
                                                  auto_lr_warmup_steps=15)
    eng = ReplicaEngine(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)), 3, _sgd(0.1), sched, mode="loop")
    g = torch.Generator().manual_seed(1)
    loss_fn = lambda m, b: nn.functional.mse_loss(m(b), b[:, :1])  # noqa: E731
    for _ in range(7):
        eng.step([torch.randn(8, 4, generator=g) for _ in range(3)], loss_fn)
    lrs = [o.param_groups[0]["lr"] for o in eng.optimizers]
    assert eng.finish()
    for sch, o, lr in zip(eng.schedulers, eng.optimizers, lrs):
        assert o.param_groups[0]["lr"] == sch._values(sch._bases_now)[0] != lr



@pytest.mark.parametrize("mode", ["loop", "vmap"])
def test_engine_averaged_evaluates_the_replicas_mean_and_training_goes_on_unchanged(mode):
    """`with engine.averaged(): evaluate(engine.models[0])` after step 7 of 20 (T = 5), one replica's weight NaN:
    every replica holds the mean of the finite replicas' weights and BatchNorm statistics, step() and finish() are
    refused inside, every replica's own weights (the NaN too) come back bit for bit, BatchNorm's num_batches_tracked
    too after a forward in training mode inside, and the run goes on exactly as one that never evaluated; right after
    the converge step at 10 every replica is the same, and after a forward in training mode since (BatchNorm's
    statistics moved apart) the mean again."""
    from hdet.engine import ReplicaEngine

    def run(evaluate):
        torch.manual_seed(0)
        sched = lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=0.05, total_steps=20, ensemble_lr_spread_ratio=0.5,  # noqa: E731
                                                      model_sync_interval=5, replicas=rep, model=m)
        net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
        eng = ReplicaEngine(net, 3, lambda m: torch.optim.AdamW(m.parameters(), lr=0.05), sched, mode=mode)
        g = torch.Generator().manual_seed(1)
        loss_fn = lambda m, b: nn.functional.mse_loss(m(b), b[:, :1])  # noqa: E731
        flat = lambda m: torch.cat([t.detach().reshape(-1) for t in [*m.parameters(), *m.buffers()]  # noqa: E731
                                    if t.is_floating_point()]).clone()
        seen = {}
        for t in range(1, 21):
            eng.step([torch.randn(8, 4, generator=g) for _ in range(3)], loss_fn)
            if t == 7:
                with torch.no_grad():
                    eng.models[2][0].weight[0, 0] = 0.5
            if t == 7 and evaluate:
                with torch.no_grad():
                    eng.models[2][0].weight[0, 0] = float("nan")
                own = [flat(m) for m in eng.models]
                if evaluate:
                    with eng.averaged() as seen["changed"]:
                        seen["inside"] = [flat(m) for m in eng.models]
                        for call in (lambda: eng.step([torch.randn(8, 4)] * 3, loss_fn), eng.finish):
                            with pytest.raises(hdet.SwappedInError):
                                call()
                        with torch.no_grad():  # a forward in training mode: BatchNorm counts a batch, moves its stats
                            eng.models[1](torch.randn(8, 4))
                    seen["mean"] = (own[0] + own[1]) / 2
                    seen["restored"] = all(torch.equal(torch.nan_to_num(flat(m), 7.0), torch.nan_to_num(o, 7.0))
                                           for m, o in zip(eng.models, own))
                    with torch.no_grad():
                        eng.models[2][0].weight[0, 0] = 0.5  # (a NaN replica would be reset at the converge step)
            if t == 10 and evaluate:
                at_sync = [flat(m) for m in eng.models]
                with eng.averaged() as seen["changed_at_sync"]:
                    seen["equal_at_sync"] = all(torch.equal(flat(m), a) for m, a in zip(eng.models, at_sync))
                    with torch.no_grad():  # (right after the converge step too: each replica's own back, a review)
                        eng.models[2](torch.randn(8, 4))
                kept = [copy.deepcopy(m.state_dict()) for m in eng.models]
                with torch.no_grad():  # a forward in training mode since the converge step moves each replica's
                    for m in eng.models:  # BatchNorm statistics apart (a gradient accumulation's micro-batch)
                        m(torch.randn(8, 4))
                own = [flat(m) for m in eng.models]
                with eng.averaged():
                    seen["after_a_forward"] = [flat(m) for m in eng.models]
                seen["mean_after_a_forward"] = sum(own) / 3
                seen["restored_after_a_forward"] = all(torch.equal(flat(m), o) for m, o in zip(eng.models, own))
                for m, k in zip(eng.models, kept):
                    m.load_state_dict(k)
        counts = [int(m[1].num_batches_tracked) for m in eng.models]
        return [flat(m) for m in eng.models], seen, counts

    with one_thread():
        plain, _, plain_counts = run(False)
        done, seen, counts = run(True)
    assert seen["changed"] and seen["restored"] and seen["equal_at_sync"] and seen["restored_after_a_forward"]
    for inside in seen["inside"]:
        torch.testing.assert_close(inside, seen["mean"], rtol=1e-6, atol=1e-7)
    for inside in seen["after_a_forward"]:  # (each replica's own statistics, without a swap: an audit)
        torch.testing.assert_close(inside, seen["mean_after_a_forward"], rtol=1e-6, atol=1e-7)
    assert all(torch.equal(a, b) for a, b in zip(done, plain))
    assert counts == plain_counts == [20] * 3  # (the forward inside counted no batch: an audit)


@pytest.mark.parametrize("explore", [False, True])
@pytest.mark.parametrize("mode", ["loop", "vmap"])
def test_engine_state_saved_inside_averaged_resumes_exactly(mode, explore):
    """`with engine.averaged(): evaluate(...); torch.save(engine.state_dict(), ...)` mid-window saved the average as
    every replica's weights beside each replica's own optimizer and scheduler state (an audit: the resumed run's
    weights 7e-5 from the uninterrupted one's): the state holds each replica's own weights and BatchNorm statistics,
    and, with an explored weight decay held at its base there, each replica's own value (a review: 0.1 for all three
    after the resume, the weights 0.14 off), and a resume from it matches the run that never stopped, bit for bit."""
    from hdet.engine import ReplicaEngine

    def build():
        torch.manual_seed(0)
        sched = lambda o, rep, m: hdet.OneCycleAutoLR(  # noqa: E731
            o, max_lr=0.05, total_steps=20, ensemble_lr_spread_ratio=0.5, model_sync_interval=5, replicas=rep, model=m,
            explore=[hdet.WeightDecay(o, alpha=0.5)] if explore else None)
        net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
        return ReplicaEngine(net, 3, lambda m: torch.optim.AdamW(m.parameters(), lr=0.05, weight_decay=0.1), sched,
                             mode=mode)

    loss_fn = lambda m, b: nn.functional.mse_loss(m(b), b[:, :1])  # noqa: E731
    flat = lambda m: torch.cat([t.detach().reshape(-1) for t in [*m.parameters(), *m.buffers()]  # noqa: E731
                                if t.is_floating_point()]).clone()
    with one_thread():
        eng, g = build(), torch.Generator().manual_seed(1)
        saved = None
        for t in range(1, 21):
            eng.step([torch.randn(8, 4, generator=g) for _ in range(3)], loss_fn)
            if t == 7:
                own = [flat(m) for m in eng.models]
                wd = [o.param_groups[0]["weight_decay"] for o in eng.optimizers]
                with eng.averaged() as changed:
                    average = flat(eng.models[0])
                    buf = io.BytesIO()
                    torch.save(eng.state_dict(), buf)
                saved = (buf.getvalue(), g.get_state())
                after = [o.param_groups[0]["weight_decay"] for o in eng.optimizers]
        done = [flat(m) for m in eng.models]
        eng2 = build()
        eng2.load_state_dict(torch.load(io.BytesIO(saved[0]), weights_only=True))
        assert changed and all(torch.equal(flat(m), o) for m, o in zip(eng2.models, own))
        assert [o.param_groups[0]["weight_decay"] for o in eng2.optimizers] == wd and (len(set(wd)) > 1) == explore
        assert after == wd  # (after averaged(): its own again)
        assert not torch.equal(own[0], average)
        g.set_state(saved[1])
        for t in range(8, 21):
            eng2.step([torch.randn(8, 4, generator=g) for _ in range(3)], loss_fn)
    assert all(torch.equal(a, b) for a, b in zip(done, [flat(m) for m in eng2.models]))


def test_a_swap_in_that_fails_leaves_every_replicas_own_weights(monkeypatch):
    """A failure while the average is put in (out of memory for the copy, a failed collective) left the replicas
    partly averaged, the swap marked in and every later step refused (a review): each replica's own weights are now
    back, nothing is swapped in, and training goes on."""
    import hdet.engine as engine_mod

    torch.manual_seed(0)
    sched = lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=0.05, total_steps=20, ensemble_lr_spread_ratio=0.5,  # noqa: E731
                                                  model_sync_interval=5, replicas=rep, model=m)
    eng = engine_mod.ReplicaEngine(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)), 3, _sgd(0.1), sched,
                                   mode="vmap")
    loss_fn = lambda m, b: nn.functional.mse_loss(m(b), b[:, :1])  # noqa: E731
    for _ in range(3):
        eng.step(torch.randn(3, 8, 4), loss_fn, stacked=True)
    own = [torch.cat([p.detach().reshape(-1) for p in m.parameters()]).clone() for m in eng.models]

    def half_then_fail(lists, bad):
        with torch.no_grad():
            lists[0][0].mul_(0.5)  # part of the average written, then the failure
        raise RuntimeError("simulated failure")
    monkeypatch.setattr(engine_mod, "average_local", half_then_fail)
    with pytest.raises(RuntimeError, match="simulated"):
        with eng.averaged():
            pass
    assert not eng._swap.active
    assert all(torch.equal(torch.cat([p.detach().reshape(-1) for p in m.parameters()]), o)
               for m, o in zip(eng.models, own))
    eng.step(torch.randn(3, 8, 4), loss_fn, stacked=True)


def _bn_engine(compile, mode="vmap", steps=4, **kw):
    from hdet.engine import ReplicaEngine

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4, bias=False), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 1))
    return ReplicaEngine(net, 2, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), _sched(steps=steps, alpha=0.2),
                         mode=mode, compile=compile, **kw)


def _bn_steps(eng, loss_fn, steps=3):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        eng.step((torch.randn(2, 5, 3, generator=g), torch.randn(2, 5, 1, generator=g)), loss_fn, stacked=True)
    return [t.detach().clone() for m in eng.models for t in [*m.parameters(), *m.buffers()]]


def _mse(m, b):
    return nn.functional.mse_loss(m(b[0]), b[1])


def test_compile_options_torch_does_not_take_are_refused_when_the_engine_is_built():
    """compile={"backend": "nonexistent"} or a misspelt keyword surfaced at the first step as a failure of vmap
    itself, and mode="auto" then ran the loop, uncompiled, with a warning that blamed vmap (an audit)."""
    for bad, said in [({"backend": "nonexistent"}, "backend among torch's"), ({"fullgrpah": True}, "'fullgrpah'")]:
        with pytest.raises(ValueError, match=said):
            _bn_engine(bad, mode="auto")
    with pytest.warns(UserWarning, match="compile has no effect here"):
        _bn_engine(True, mode="loop")


def test_a_compiled_backward_that_fails_falls_back_before_anything_changed():
    """torch compiles a function's backward lazily, at the first backward, outside the fallback that catches a
    compile's failure: a failing backward compile raised at every step (mode="vmap") with BatchNorm's statistics
    updated each time (an audit). It is now compiled with the forward: the engine warns once, runs eagerly (still
    vmapped), and trains as the eager engine does, bit for bit."""
    from torch._dynamo.backends.common import aot_autograd

    if not hasattr(torch._functorch.config, "force_non_lazy_backward_lowering"):
        pytest.skip("this torch compiles the backward lazily, with no switch (the fallback cannot catch it)")

    def no_backward(gm, example_inputs):
        raise RuntimeError("simulated backward compile failure")

    backend = aot_autograd(fw_compiler=lambda gm, ex: gm, bw_compiler=no_backward)
    with one_thread():
        eager = _bn_steps(_bn_engine(False), _mse)
        eng = _bn_engine({"backend": backend})
        with pytest.warns(UserWarning, match="torch.compile cannot run this vmapped model"):
            got = _bn_steps(eng, _mse)
    assert eng.mode == "vmap" and all(torch.equal(a, b) for a, b in zip(got, eager))


def test_a_compiled_model_whose_losses_are_non_finite_where_eagers_are_not_runs_eagerly():
    """torch's compiled vmap of scaled_dot_product_attention with dropout gives NaN losses where the eager vmapped
    model's are finite (an audit: the run never learned, and the warnings blamed the data). At the first compiled
    step the engine now checks the losses against the eager model's, warns, and runs eagerly. (Here a backend that
    makes the loss NaN stands in for that bug.)"""
    def nan_losses(gm, example_inputs):
        def run(*args):
            out = gm(*args)
            return (out[0] * float("nan"), *out[1:]) if isinstance(out, (tuple, list)) else out * float("nan")
        return run

    with one_thread():
        eager = _bn_steps(_bn_engine(False), _mse)
        eng = _bn_engine({"backend": nan_losses})
        with pytest.warns(UserWarning, match="non-finite losses where the eager vmapped model's are finite"):
            got = _bn_steps(eng, _mse)
    assert all(torch.equal(a, b) for a, b in zip(got, eager))


def test_a_loss_function_written_inline_does_not_grow_the_engines_cache():
    """The docs' `eng.step(batches, lambda m, b: ...)` makes a new function every step, and the engine kept a vmapped
    (and compiled) form of each, for good (12 entries after 12 steps: an audit). The cache is bounded now."""
    eng = _bn_engine(False, steps=12)
    g = torch.Generator().manual_seed(1)
    for _ in range(12):
        eng.step((torch.randn(2, 5, 3, generator=g), torch.randn(2, 5, 1, generator=g)),
                 lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), stacked=True)
    eng2 = _bn_engine(False, steps=12)
    for _ in range(12):
        eng2.step((torch.randn(2, 5, 3, generator=g), torch.randn(2, 5, 1, generator=g)), _mse, stacked=True)
    assert len(eng._fns) <= 8 and len(eng2._fns) == 1


def test_compiled_attention_with_dropout_runs_eagerly_instead_of_training_on_nan():
    """The real case (torch 2.13, CPU, inductor): compiled, a vmapped `F.scaled_dot_product_attention(...,
    dropout_p=0.5)` gave NaN losses at every step and the replicas never moved (an audit); eager vmap is finite. The
    engine now runs it eagerly, with the warning, and its losses are finite."""
    import warnings as _w

    from hdet.engine import ReplicaEngine

    class Attention(nn.Module):
        def __init__(self, d=8):
            super().__init__()
            self.emb, self.qkv, self.head = nn.Embedding(11, d), nn.Linear(d, 3 * d), nn.Linear(d, 11)

        def forward(self, idx):
            q, k, v = self.qkv(self.emb(idx)).reshape(*idx.shape, 3, 2, 4).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.5 if self.training else 0.0)
            return self.head(a.transpose(1, 2).reshape(*idx.shape, 8))

    torch.manual_seed(0)
    eng = ReplicaEngine(Attention(), 3, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), _sched(steps=2, alpha=0.2),
                        mode="vmap", compile=True)
    idx = torch.randint(0, 11, (3, 4, 6))
    with _w.catch_warnings():
        _w.simplefilter("ignore")  # (the fallback's warning while torch has the bug; none once it is fixed)
        losses = [eng.step(idx, lambda m, b: F.cross_entropy(m(b).flatten(0, 1), b.flatten()), stacked=True)
                  for _ in range(2)]
    assert all(bool(torch.isfinite(x).all()) for x in losses), losses


def test_an_inline_loss_function_is_checked_against_eager_once(monkeypatch):
    """The first compiled step's check (its losses against the eager model's: a host read, the buffers copied) ran at
    every step for a loss function written inline, a new object each step: it runs once per function's code."""
    import hdet.engine as engine_mod

    reads = []  # the check's copies of the buffers (the one place a vmap-mode step reads them all)
    real = engine_mod.ReplicaEngine.stacked_buffers
    monkeypatch.setattr(engine_mod.ReplicaEngine, "stacked_buffers", property(lambda e: reads.append(1) or real.fget(e)))
    with one_thread():
        eng = _bn_engine(True, steps=4)
        reads.clear()
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            eng.step((torch.randn(2, 5, 3, generator=g), torch.randn(2, 5, 1, generator=g)),
                     lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), stacked=True)
    assert len(reads) == 1



@pytest.mark.parametrize("fault", ["nan", "no_backward"])
def test_a_compile_that_failed_is_not_tried_again_for_an_inline_loss_function(fault):
    """A loss function written inline is a new object each step: after a compile failed (or gave non-finite losses
    where eager's are finite), each new one was compiled and failed again, every step, with its warning, extra eager
    forwards and host reads (0.4-0.6 s a step against 2 ms: a review). Now said once, and eager from then on; the
    discarded forward's random numbers are given back, so the run is the eager one's, dropout included."""
    import warnings as _w

    from torch._dynamo.backends.common import aot_autograd

    from hdet.engine import ReplicaEngine

    def nan_losses(gm, example_inputs):
        return lambda *args: [x * float("nan") if i == 0 else x for i, x in enumerate(gm(*args))]

    def no_backward(gm, example_inputs):
        raise RuntimeError("simulated backward compile failure")

    backend = nan_losses if fault == "nan" else aot_autograd(fw_compiler=lambda gm, ex: gm, bw_compiler=no_backward)
    if fault == "no_backward" and not hasattr(torch._functorch.config, "force_non_lazy_backward_lowering"):
        pytest.skip("this torch compiles the backward lazily, with no switch")

    def run(compile):
        torch._dynamo.reset()  # (the vmapped function's code is shared: a graph compiled by an earlier test is kept)
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.3), nn.Tanh(), nn.Linear(8, 1))
        eng = ReplicaEngine(net, 2, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), _sched(steps=6, alpha=0.2),
                            mode="vmap", compile=compile)
        g = torch.Generator().manual_seed(1)
        with _w.catch_warnings(record=True) as seen:
            _w.simplefilter("always")
            losses = [eng.step((torch.randn(2, 5, 3, generator=g), torch.randn(2, 5, 1, generator=g)),
                               lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), stacked=True).clone()
                      for _ in range(6)]
        return losses, [str(w.message) for w in seen if "torch.compile cannot run" in str(w.message)]

    with one_thread():
        eager, _ = run(False)
        got, said = run({"backend": backend})
    assert len(said) == 1, said
    assert all(torch.equal(a, b) for a, b in zip(got, eager))


def test_loss_functions_are_told_apart_by_their_code_however_many_are_made():
    """The compile checks key loss functions by their code: a partial made each step (holding its bound tensors) was
    keyed by the object, and the engine's set of checked ones grew by one a step (a review)."""
    import functools as ft

    from hdet.engine import _code_of

    def loss(m, b, scale):
        return scale

    class Loss:
        def __call__(self, m, b):
            return 0

    made = {_code_of(ft.partial(loss, scale=torch.ones(1000))) for _ in range(5)}
    made |= {_code_of(lambda m, b: 0) for _ in range(5)} | {_code_of(Loss()) for _ in range(5)}
    assert len(made) == 3 and loss.__code__ in made and Loss in made  # (the five lambdas: one code)


def test_a_load_whose_settings_replace_the_engines_says_so_once_not_once_a_replica():
    """Each replica's scheduler warned the same on a load (4 copies at N = 4: an audit)."""
    import warnings

    from hdet.engine import ReplicaEngine


    def build(T):
        torch.manual_seed(0)
        return ReplicaEngine(nn.Linear(3, 1), 4, lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                             lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=0.1, total_steps=8, replicas=rep,
                                                                   ensemble_lr_spread_ratio=0.2,
                                                                   model_sync_interval=T), mode="loop")
    saved = build(4).state_dict()
    other = build(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        other.load_state_dict(saved)
    said = [str(w.message) for w in caught if "settings replace" in str(w.message)]
    assert len(said) == 1 and "model_sync_interval 4 (built with 2)" in said[0]


def test_optimizer_state_of_different_parameters_is_not_averaged_together():
    """Local mode, replica r's loss reaches head r only: Adam holds state for head 1 on replica 0 and head 2 on replica
    1, of one shape. The converge step lined them up by position and averaged head 1's moments with head 2's, silently
    (an audit); it raises ReplicaMismatchError now, naming the cause."""
    from torch import nn

    from hdet.engine import ReplicaEngine
    from hdet.sync import ReplicaMismatchError

    torch.manual_seed(0)
    eng = ReplicaEngine(nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)]), 2,
                        lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
                        lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=0.01, total_steps=10, model_sync_interval=2,
                                                              model=m, replicas=rep, average_optimizer_state=True,
                                                              ensemble_lr_spread_ratio=0.2),
                        mode="loop", share_gradients=False)
    g = torch.Generator().manual_seed(0)
    eng.step([(torch.randn(8, 4, generator=g), r) for r in range(2)], lambda m, b: m[1 + b[1]](m[0](b[0])).pow(2).mean())
    with pytest.raises(ReplicaMismatchError, match="optimizers hold state for different parameters"):
        eng.step([(torch.randn(8, 4, generator=g), r) for r in range(2)],
                 lambda m, b: m[1 + b[1]](m[0](b[0])).pow(2).mean())


def test_averaging_with_every_replica_left_out_is_refused():
    from hdet.replicas import average_local

    lists = [[torch.ones(3)], [torch.full((3,), 2.0)]]
    with pytest.raises(ValueError, match="exclude= leaves out all 2"):
        average_local(lists, exclude=[0, 1])
    assert torch.equal(lists[0][0], torch.ones(3))


def test_a_reset_replica_whose_optimizer_state_differs_is_refused_and_a_late_first_step_is_not():
    """Without average_optimizer_state the moments are averaged only into a reset replica: lined up by position there
    (an audit: another parameter's moments, or mismatched collectives); refused then, with the cause. A replica that
    has simply not stepped a parameter yet trains on while nobody is reset (its GradScaler skipping its first steps in
    local mode: a review found the layout check refusing that run)."""
    from torch import nn

    from hdet.engine import ReplicaEngine
    from hdet.sync import ReplicaMismatchError

    def run(poison):
        torch.manual_seed(0)
        eng = ReplicaEngine(nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)]), 2,
                            lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
                            lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=0.01, total_steps=10, model_sync_interval=2,
                                                                  model=m, replicas=rep, ensemble_lr_spread_ratio=0.2),
                            mode="loop", share_gradients=False)
        g = torch.Generator().manual_seed(0)
        for t in (1, 2):
            if t == 2 and poison:
                with torch.no_grad():
                    eng.models[1][0].weight[0, 0] = float("nan")
            eng.step([(torch.randn(8, 4, generator=g), r) for r in range(2)],
                     lambda m, b: m[1 + b[1]](m[0](b[0])).pow(2).mean())
        return eng
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert run(False).steps_taken == 2
        with pytest.raises(ReplicaMismatchError, match=r"reset replica\(s\) \[1\]'s optimizer state"):
            run(True)


def _spectral_net(form):
    from torch.nn.utils.parametrizations import spectral_norm

    torch.manual_seed(0)
    sn = spectral_norm if form == "parametrization" else nn.utils.spectral_norm
    return nn.Sequential(sn(nn.Linear(6, 16)), nn.Tanh(), sn(nn.Linear(16, 1)))


@pytest.mark.parametrize("form", ["parametrization", "hook"])
def test_spectral_norms_estimates_are_refreshed_for_the_averaged_weights(form):
    """A converge step averaged spectral_norm's u and v buffers with the weights: the mean of unit vectors is shorter,
    sigma = u^T W v too small, and the averaged model's eval-mode layers had spectral norms above 1 (an audit: 1.0076,
    outputs 0.9% off). After a converge step, and inside averaged() mid-window, every layer's is 1 again (the power
    iteration run on the weights now in), the replicas equal; each replica's own u, v come back after averaged()."""
    from hdet.engine import ReplicaEngine

    sched = lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=0.05, total_steps=20, ensemble_lr_spread_ratio=0.5,  # noqa: E731
                                                  model_sync_interval=10, replicas=rep, model=m)
    eng = ReplicaEngine(_spectral_net(form), 2, lambda m: torch.optim.Adam(m.parameters(), lr=0.05), sched, mode="loop")
    g = torch.Generator().manual_seed(1)

    def loss_fn(m, b):
        return F.mse_loss(m(b), (3 * b[:, :1]).sin())

    with one_thread():
        for t in range(1, 16):
            eng.step([torch.randn(32, 6, generator=g) * (1 + r) for r in range(2)], loss_fn)
            if t == 10:  # right after the converge step
                after_sync = [spectral_norms(m) for m in eng.models]
        own = [copy.deepcopy(m.state_dict()) for m in eng.models]
        with eng.averaged() as changed:
            inside = [spectral_norms(m) for m in eng.models]
    assert changed
    for norms in after_sync + inside:
        assert norms == pytest.approx([1.0, 1.0], abs=1e-5), (after_sync, inside)
    assert after_sync[0] == after_sync[1] and inside[0] == inside[1]
    for m, o in zip(eng.models, own):
        assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), o.values()))


class _LazyMean(nn.Module):
    """A buffer registered as None and made in the forward (a lazily created running mean)."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(4, 8), nn.Linear(8, 1)
        self.register_buffer("mu", None)

    def forward(self, x):
        h = self.l1(x)
        m = h.detach().mean(0)
        self.mu = m if self.mu is None else 0.9 * self.mu + 0.1 * m
        return self.l2(torch.tanh(h - self.mu))


def _none_buffer_run(mode, model=None):
    """Six steps of an engine (N = 2, T = 3) over ``model`` (a class; default :class:`_LazyMean`): it and its losses."""
    from hdet.engine import ReplicaEngine

    torch.manual_seed(0)
    eng = ReplicaEngine((model or _LazyMean)(), 2, lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                        lambda o, rep, m: hdet.HDETLR(o, None, total_steps=6, model_sync_interval=3,
                                                      ensemble_lr_spread_ratio=0.5, replicas=rep, model=m), mode=mode)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(6):
        losses.append(eng.step([torch.randn(5, 4, generator=g) for _ in range(2)],
                               lambda m, b: m(b).square().mean()).tolist())
    return eng, losses


def test_a_buffer_made_in_the_forward_falls_back_to_the_loop_or_is_refused_clearly():
    """A buffer registered as None and assigned in the forward: vmapped, replica 0's module kept a tensor escaped from
    vmap and the others None, and the first converge step raised functorch's "escaped" error, naming neither the buffer
    nor a way out (an audit). Now mode="auto" falls back to the loop (the same losses as mode="loop", through the
    converge steps), and an explicit "vmap"/"merged" raises a ValueError naming it, replica 0's buffer left None."""
    with one_thread():
        _, loop = _none_buffer_run("loop")
        with pytest.warns(UserWarning, match="'mu', registered as None"):
            eng, auto = _none_buffer_run("auto")
        assert eng.mode == "loop" and auto == loop
        for mode in ("vmap", "merged"):
            with pytest.raises(ValueError, match=r"the forward assigned 'mu', registered as None .* mode='loop'"):
                _none_buffer_run(mode)


class _LazyCache(nn.Module):
    """A non-persistent buffer registered as None and built in the forward from plain values (a positional cache)."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(4, 8), nn.Linear(8, 1)
        self.register_buffer("pos", None, persistent=False)

    def forward(self, x):
        if self.pos is None:
            self.pos = torch.linspace(0, 1, 8)
        return self.l2(torch.tanh(self.l1(x) + self.pos))


def test_a_cache_of_plain_values_made_in_the_forward_runs_in_the_loop():
    """A non-persistent cache built from plain values in the forward (a positional table) ran vmapped before the
    refusal above; allowed, a plain value later updated from each replica's batch failed at the second step or left an
    escaped tensor on replica 0 (a review): so it is refused too, and mode="auto" trains it in the loop, through the
    converge steps, with the loop's losses."""
    with one_thread():
        with pytest.warns(UserWarning, match="'pos', registered as None"):
            eng, auto = _none_buffer_run("auto", _LazyCache)
        _, looped = _none_buffer_run("loop", _LazyCache)
        with pytest.raises(ValueError, match="'pos', registered as None"):
            _none_buffer_run("vmap", _LazyCache)
    assert eng.mode == "loop" and auto == looped


@pytest.mark.parametrize("mode", ["loop", "auto"])
def test_a_lazy_module_is_refused_when_the_engine_is_built(mode):
    """nn.LazyLinear: in the loop each deep copy initialised its weights at its first forward from the global RNG, so the
    replicas started apart (0.91 after one step at alpha 0 in an audit) and the converge steps averaged independent
    networks, silently. Refused at construction, in every mode."""
    from hdet.engine import ReplicaEngine

    with pytest.raises(ValueError, match=r"\['0.weight', '0.bias'\] are uninitialised .* dummy batch"):
        ReplicaEngine(nn.Sequential(nn.LazyLinear(3), nn.ReLU(), nn.Linear(3, 1)), 2,
                      lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                      lambda o, rep, m: hdet.HDETLR(o, None, total_steps=4, replicas=rep, model=m), mode=mode)


@pytest.mark.skipif(not hasattr(Exception, "add_note"), reason="exception notes: Python 3.11+")
def test_torchs_error_in_an_explicit_vmap_mode_says_the_loop_runs_the_model():
    """mode="vmap" with an LSTM raised torch's bare "Batching rule not implemented" error (an audit): it keeps its type
    and message, with a note that mode='auto' or 'loop' runs such models."""
    from hdet.engine import ReplicaEngine

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn, self.out = nn.LSTM(3, 4, batch_first=True), nn.Linear(4, 1)

        def forward(self, x):
            return self.out(self.rnn(x)[0][:, -1])

    eng = ReplicaEngine(Net(), 2, lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                        lambda o, rep, m: hdet.HDETLR(o, None, total_steps=4, replicas=rep, model=m), mode="vmap")
    with pytest.raises(Exception) as e:
        eng.step([torch.randn(2, 5, 3)] * 2, lambda m, b: m(b).square().mean())
    notes = getattr(e.value, "__notes__", [])
    assert len(notes) == 1 and "mode='vmap'" in notes[0] and "mode='loop' uses it" in notes[0], notes


@pytest.mark.parametrize("norm", ["batch", "instance"])
def test_a_conv_batchnorm_model_under_bf16_autocast_runs_vmapped_as_the_loop(norm):
    """Conv2d -> BatchNorm2d under torch.autocast("cpu", bfloat16): the vmapped convolution's output is bf16 (hdet's
    autocast routing) and torch's vmap rule for batch_norm refused it with float32 statistics ("expected scalar type
    BFloat16 but found Float"; mode="auto" fell back to the loop, an audit). It runs vmapped now, in float32 and
    returned in bf16 as one replica's batch norm is, with the loop's losses, weights and statistics to bf16's
    rounding. So does an InstanceNorm2d with running statistics (F.instance_norm, a review)."""
    from hdet.engine import ReplicaEngine

    def run(mode):
        torch.manual_seed(0)
        layer = nn.BatchNorm2d(8) if norm == "batch" else nn.InstanceNorm2d(8, affine=True, track_running_stats=True)
        net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), layer, nn.ReLU(),  # (a bias before
                            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))  # BatchNorm: a gradient of 0 whose
        # rounding noise Adam turns into steps of the LR, which no two orders of the same sums agree on)
        eng = ReplicaEngine(net, 2, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
                            lambda o, rep, m: hdet.HDETLR(o, None, 10, ensemble_lr_spread_ratio=0.2,
                                                          model_sync_interval=5, model=m, replicas=rep), mode=mode)
        g = torch.Generator().manual_seed(1)

        def loss_fn(m, b):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return F.cross_entropy(m(b[0]).float(), b[1])
        losses = [eng.step([(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g))
                            for _ in range(2)], loss_fn) for _ in range(3)]
        return eng.mode, torch.stack(losses), [m.state_dict() for m in eng.models]

    with one_thread():
        (mode, vl, vs), (_, ll, ls) = run("vmap"), run("loop")
    assert mode == "vmap"
    torch.testing.assert_close(vl, ll, rtol=2e-2, atol=1e-3)
    for a, b in zip(vs, ls):
        for k in a:
            torch.testing.assert_close(a[k].float(), b[k].float(), rtol=2e-2, atol=2e-3, msg=k)


def test_engine_ema_updated_inside_averaged_is_the_mean_of_the_replicas_emas():
    """docs/engine.md: an EMA of the run's model in one process is updated from the ensemble's average, `with
    engine.averaged(): ema.update_parameters(engine.models[0])`: by linearity that is the mean of each replica's own
    EMA (kept here as the reference), which an EMA of engine.models[0] alone is not (replica 0's, at its multiplier)."""
    from hdet.engine import ReplicaEngine
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    torch.manual_seed(0)
    sched = lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=0.05, total_steps=12, ensemble_lr_spread_ratio=0.5,  # noqa: E731
                                                  model_sync_interval=5, replicas=rep, model=m)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    eng = ReplicaEngine(net, 3, lambda m: torch.optim.AdamW(m.parameters(), lr=0.05), sched)
    ema_fn = get_ema_multi_avg_fn(0.8)
    ema, own = AveragedModel(net, multi_avg_fn=ema_fn), [AveragedModel(m, multi_avg_fn=ema_fn) for m in eng.models]
    g = torch.Generator().manual_seed(1)
    loss_fn = lambda m, b: nn.functional.mse_loss(m(b), b[:, :1])  # noqa: E731
    flat = lambda m: torch.cat([p.detach().reshape(-1) for p in m.parameters()])  # noqa: E731
    for t in range(1, 13):
        eng.step([torch.randn(8, 4, generator=g) for _ in range(3)], loss_fn)
        for e, m in zip(own, eng.models):
            e.update_parameters(m)
        with eng.averaged():
            ema.update_parameters(eng.models[0])
        if t in (7, 12):
            mean = torch.stack([flat(e) for e in own]).mean(0)
            assert torch.allclose(flat(ema), mean, atol=1e-6), t
            assert not torch.allclose(flat(own[0]), mean, atol=1e-3), t


@pytest.mark.parametrize("mode", ["auto", "merged"])
def test_a_replica_trains_on_alone_after_the_engine_run_as_plain_torch(mode):
    """After the run (closed by itself at total_steps), or engine.finish() then engine.close() before it: engine.models[0]
    with engine.optimizers[0] and a plain schedule trains exactly as a fresh model and AdamW loaded with their states
    (the stacked step's shared step tensors counted every parameter's step: 52 for 22 after 10 steps, weights 4.1e-3
    off, and replica 0's steps moved replica 1's moments: an audit)."""
    import copy

    from hdet.engine import ReplicaEngine

    for early in (False, True):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        eng = ReplicaEngine(net, 3, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
                            lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=1e-2, total_steps=12, ensemble_lr_spread_ratio=0.3,
                                                                  model_sync_interval=4, replicas=rep, model=m), mode=mode)
        g = torch.Generator().manual_seed(1)
        batches = lambda: [torch.randn(8, 4, generator=g) for _ in range(3)]  # noqa: E731
        loss_fn = lambda m, b: m(b).pow(2).mean()  # noqa: E731
        for t in range(7 if early else 12):
            eng.step(batches(), loss_fn)
            if t == 6:
                saved = eng.state_dict()
        if early:
            eng.finish()
            eng.close()
        assert all(s.closed for s in eng.schedulers) and eng._stacked is None
        assert eng.optimizer_path == ("per-replica: loop mode" if eng.mode == "loop" else "stacked")  # (what it ran)
        m, o = eng.models[0], eng.optimizers[0]
        fm = copy.deepcopy(m)
        fo = torch.optim.AdamW(fm.parameters(), lr=1e-2)
        fo.load_state_dict(copy.deepcopy(o.state_dict()))
        other = [t.clone() for t in eng.optimizers[1].state[next(iter(eng.models[1].parameters()))].values()]
        for model, opt in ((m, o), (fm, fo)):
            sch = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=5e-3, total_steps=10)
            g2 = torch.Generator().manual_seed(2)
            for _ in range(10):
                opt.zero_grad()
                model(torch.randn(8, 4, generator=g2)).pow(2).mean().backward()
                opt.step()
                sch.step()
        for a, b in zip(m.parameters(), fm.parameters()):
            assert torch.equal(a, b)
        assert [float(s["step"]) for s in o.state.values()] == [float(s["step"]) for s in fo.state.values()]
        after = list(eng.optimizers[1].state[next(iter(eng.models[1].parameters()))].values())
        assert all(torch.equal(x, y) for x, y in zip(other, after))
        if not early:  # a closed engine given a state of a run not over goes on from it (its schedulers open
            eng.load_state_dict(saved)  # again, each replica's optimizer.step() from now on)
            assert not any(s.closed for s in eng.schedulers)
            assert eng.optimizer_path == "per-replica: loaded after the engine closed"
            for _ in range(5):
                eng.step(batches(), loss_fn)
            assert all(s.closed for s in eng.schedulers)


@pytest.mark.parametrize("mode", ["vmap", "loop"])
def test_a_closed_engines_state_loads_closed_and_its_replica_trains_on_as_the_finished_one(mode):
    """A finished engine's state (closed at total_steps, or by finish() and close() before it) loaded into a fresh
    engine came back open, each replica at its own multiplied LR (0.7x-1.3x the base the run left) with the stacked
    step on again, and loaded into the closed engine itself spread its LRs again: replica 0 then fine-tuned at 0.7x the
    LR (1e-4 off after 3 steps: an audit). It loads closed now: the same LRs, each optimizer its own state, and
    replica 0 trains on exactly as the finished engine's."""
    import copy
    import io

    from hdet.engine import ReplicaEngine

    def build():
        torch.manual_seed(0)
        return ReplicaEngine(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), 3,
                             lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
                             lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=1e-2, total_steps=12,
                                                                   ensemble_lr_spread_ratio=0.3, model_sync_interval=4,
                                                                   replicas=rep, model=m), mode=mode)

    def finetune(m, o):
        g = torch.Generator().manual_seed(2)
        for _ in range(3):
            o.zero_grad()
            m(torch.randn(8, 4, generator=g)).pow(2).mean().backward()
            o.step()
        return torch.cat([p.detach().reshape(-1) for p in m.parameters()])

    for early in (False, True):
        eng = build()
        g = torch.Generator().manual_seed(1)
        for _ in range(7 if early else 12):
            eng.step([torch.randn(8, 4, generator=g) for _ in range(3)], lambda m, b: m(b).pow(2).mean())
        if early:
            eng.finish()
            eng.close()
        buf = io.BytesIO()
        torch.save(eng.state_dict(), buf)
        state = lambda: torch.load(io.BytesIO(buf.getvalue()), weights_only=True)  # noqa: E731
        lrs = [o.param_groups[0]["lr"] for o in eng.optimizers]
        assert len(set(lrs)) == 1
        fresh = build()
        fresh.load_state_dict(state())
        assert all(s.closed for s in fresh.schedulers) and fresh._stacked is None, early
        if early:  # (the optimizers stepped, then the schedulers refused: the weights a step ahead, a review)
            before = [p.detach().clone() for m in fresh.models for p in m.parameters()]
            with pytest.raises(RuntimeError, match="schedulers are closed"):
                fresh.step([torch.randn(8, 4) for _ in range(3)], lambda m, b: m(b).pow(2).mean())
            assert all(torch.equal(a, p) for a, p in zip(before, (p for m in fresh.models for p in m.parameters())))
        assert [o.param_groups[0]["lr"] for o in fresh.optimizers] == lrs
        eng.load_state_dict(state())  # (the closed engine itself given its own state: still the base's LRs)
        assert all(s.closed for s in eng.schedulers) and [o.param_groups[0]["lr"] for o in eng.optimizers] == lrs
        ref = copy.deepcopy(eng.models[0]), copy.deepcopy(eng.optimizers[0].state_dict())
        o = torch.optim.AdamW(ref[0].parameters(), lr=1e-2)
        o.load_state_dict(ref[1])
        assert torch.equal(finetune(fresh.models[0], fresh.optimizers[0]), finetune(ref[0], o)), early


def test_set_total_steps_is_refused_for_an_engines_replica():
    """An engine's replicas step together: set_total_steps on one of them left the engine half-stepped (replica 1
    stepped its optimizer, then its scheduler raised: a review); it is refused, saying what to do."""
    from hdet.engine import ReplicaEngine

    eng = ReplicaEngine(nn.Linear(3, 1), 2, lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                        lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=0.1, total_steps=8, ensemble_lr_spread_ratio=0.5,
                                                              model_sync_interval=4, replicas=rep, model=m), mode="loop")
    with pytest.raises(ValueError, match="ReplicaEngine"):
        eng.schedulers[0].set_total_steps(12)


def test_an_engine_state_loaded_inside_averaged_is_refused():
    """engine.load_state_dict() inside engine.averaged(): the replicas' own weights kept aside were put back over the
    loaded ones at the block's end (0.79 off the saved weights: an audit). Refused, before anything is loaded."""
    from hdet.engine import ReplicaEngine

    def build():
        torch.manual_seed(0)
        return ReplicaEngine(nn.Linear(3, 1), 2, lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                             lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=0.1, total_steps=12,
                                                                   ensemble_lr_spread_ratio=0.5, model_sync_interval=4,
                                                                   replicas=rep, model=m), mode="loop")
    x = torch.randn(2, 4, 3)
    e = build()
    for _ in range(6):
        e.step(x, lambda m, b: m(b).pow(2).mean(), stacked=True)
    mid = e.state_dict()
    e2 = build()
    for _ in range(2):
        e2.step(x, lambda m, b: m(b).pow(2).mean(), stacked=True)
    with e2.averaged():
        with pytest.raises(hdet.SwappedInError, match="engine.load_state_dict"):
            e2.load_state_dict(mid)
    assert e2.steps_taken == 2
    e2.load_state_dict(mid)
    assert all(torch.equal(a, b) for a, b in zip((p for m in e2.models for p in m.parameters()),
                                                 (p for m in e.models for p in m.parameters())))


def test_backward_hooks_run_in_the_loop_and_are_refused_where_vmap_would_drop_them():
    """Backward hooks (a module's full, pre or legacy hook, a parameter's) never ran under vmap or merged: their
    backward runs on the stacked tensors (a gradient reversal trained the other way, weights 0.1 off, unsaid: an
    audit); a parameter's hook on the model given was dropped in every mode (deep copies do not keep it). Now: a
    module's hook makes mode='auto' run the loop, where it runs, and is refused under mode='vmap' / 'merged'; a
    parameter's hook on the model given is refused; one registered on a replica later is refused at the next vmapped
    step, before anything runs."""
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))

    def sched(o, rep, m):
        return hdet.HDETLR(o, None, 20, ensemble_lr_spread_ratio=0.2, model_sync_interval=5, replicas=rep, model=m)

    def opt(m):
        return torch.optim.SGD(m.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(3, 8, 4, generator=g), torch.randint(0, 3, (3, 8), generator=g))

    def loss_fn(m, b):
        return F.cross_entropy(m(b[0]), b[1])

    reversed_ = model()
    reversed_[2].register_full_backward_hook(lambda mod, gin, gout: (-gin[0],))  # a gradient reversal below it
    eng = ReplicaEngine(reversed_, 3, opt, sched)
    assert eng.mode == "loop"
    calls = []
    for m in eng.models:
        m[2].register_full_backward_hook(lambda mod, gin, gout: calls.append(1))
    eng.step(batch, loss_fn, stacked=True)
    assert len(calls) == 3  # (every replica's hook ran)
    for mode in ("vmap", "merged"):
        with pytest.raises(ValueError, match=f"Expected no backward hooks under mode='{mode}', but '2' \\(Linear\\) on "
                                             "replica 0 has backward hooks"):
            ReplicaEngine(reversed_, 3, opt, sched, mode=mode)
    masked = model()
    masked[0].weight.register_hook(lambda grad: grad * 0)
    with pytest.raises(ValueError, match="hooks are registered on parameter '0.weight'"):
        ReplicaEngine(masked, 3, opt, sched, mode="loop")
    eng = ReplicaEngine(model(), 3, opt, sched, mode="vmap")
    eng.step(batch, loss_fn, stacked=True)
    eng.models[1][2].weight.register_hook(lambda grad: grad * 0)
    before = [p.detach().clone() for m in eng.models for p in m.parameters()]
    with pytest.raises(ValueError, match="parameter '2.weight' on replica 1 has hooks"):
        eng.step(batch, loss_fn, stacked=True)
    assert all(torch.equal(a, p) for a, p in zip(before, (p for m in eng.models for p in m.parameters())))


@pytest.mark.parametrize("mode", ["vmap", "loop"])
def test_an_engine_state_whose_optimizer_part_does_not_load_loads_nothing(mode):
    """An SGD engine's state into an AdamW engine: torch's KeyError: 'step' came after replica 0's model was loaded,
    the others left at their own weights (0.107 apart: an audit). Now a ValueError says which optimizer, and nothing
    is loaded: the engine trains on as it was."""
    def engine(make):
        torch.manual_seed(0)
        return ReplicaEngine(nn.Linear(4, 3), 3, make,
                             lambda o, rep, m: hdet.HDETLR(o, None, 20, ensemble_lr_spread_ratio=0.2,
                                                           model_sync_interval=5, replicas=rep, model=m), mode=mode)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(3, 8, 4, generator=g), torch.randint(0, 3, (3, 8), generator=g)) for _ in range(4)]

    def loss_fn(m, b):
        return F.cross_entropy(m(b[0]), b[1])
    sgd = engine(lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
    for b in batches[:3]:
        sgd.step(b, loss_fn, stacked=True)
    adam = engine(lambda m: torch.optim.AdamW(m.parameters(), lr=0.01))
    adam.step(batches[0], loss_fn, stacked=True)
    before = copy.deepcopy(adam.state_dict())
    with pytest.raises(ValueError, match="replica 0's optimizer state to load into its AdamW, but it did not"):
        adam.load_state_dict(sgd.state_dict())
    after = adam.state_dict()
    for a, b in zip(before["replicas"], after["replicas"]):
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
        assert a["scheduler"]["last_epoch"] == b["scheduler"]["last_epoch"] == 1
        sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
        assert sa.keys() == sb.keys() and all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])
    adam.step(batches[1], loss_fn, stacked=True)
    sgd_before = copy.deepcopy(sgd.state_dict())  # the other way: torch loads AdamW's groups into SGD, without its
    with pytest.raises(ValueError, match=r"into its SGD, but it did not \(KeyError.*lack \['dampening', 'momentum'"):
        sgd.load_state_dict(adam.state_dict())  # momentum (its step raised a bare KeyError: an audit)
    for a, b in zip(sgd_before["replicas"], sgd.state_dict()["replicas"]):
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
        assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    sgd.step(batches[3], loss_fn, stacked=True)


def test_engine_state_of_a_model_with_extra_state_resumes_exactly():
    """A model with ``get_extra_state``/``set_extra_state`` (a module's own plain data in its state) made
    ``engine.load_state_dict`` raise AttributeError in its shape check (an audit): it loads now, each replica's extra
    state with it, and the resumed run matches the uninterrupted one bit for bit."""
    from hdet.engine import ReplicaEngine

    class Counted(nn.Linear):
        def __init__(self):
            super().__init__(4, 1)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return super().forward(x)

        def get_extra_state(self):
            return {"calls": self.calls}

        def set_extra_state(self, state):
            self.calls = state["calls"]

    def build():
        torch.manual_seed(0)
        sched = lambda o, rep, m: hdet.OneCycleAutoLR(  # noqa: E731
            o, max_lr=0.05, total_steps=12, ensemble_lr_spread_ratio=0.5, model_sync_interval=4, replicas=rep, model=m)
        return ReplicaEngine(Counted(), 2, lambda m: torch.optim.AdamW(m.parameters(), lr=0.05), sched, mode="loop")

    loss_fn = lambda m, b: nn.functional.mse_loss(m(b), b[:, :1])  # noqa: E731
    with one_thread():
        eng, g = build(), torch.Generator().manual_seed(1)
        for t in range(1, 13):
            eng.step([torch.randn(8, 4, generator=g) for _ in range(2)], loss_fn)
            if t == 6:
                buf = io.BytesIO()
                torch.save(eng.state_dict(), buf)
                saved = (buf.getvalue(), g.get_state())
        done = [torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in eng.models]
        eng2 = build()
        eng2.load_state_dict(torch.load(io.BytesIO(saved[0]), weights_only=True))
        assert [m.calls for m in eng2.models] == [6, 6]
        g.set_state(saved[1])
        for t in range(7, 13):
            eng2.step([torch.randn(8, 4, generator=g) for _ in range(2)], loss_fn)
    assert [m.calls for m in eng2.models] == [12, 12]
    for a, m in zip(done, eng2.models):
        assert torch.equal(a, torch.cat([p.detach().reshape(-1) for p in m.parameters()]))


def test_engine_averaged_after_a_converge_step_averages_batchnorm_statistics_alone():
    """After a converge step mid-run, a forward in training mode (a gradient accumulation's micro-batch before a
    validation) moves each replica's BatchNorm statistics apart: averaged() averages them, and nothing else (the
    parameters, equal, were averaged again too at first, 37 of 193 elements moved in their last bits at N = 7: a
    review); after the last step nothing is averaged (no forward of training is pending, and under a process group a
    rank-0-only evaluation there must enter no collective)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    eng = ReplicaEngine(net, 7, lambda m: torch.optim.SGD(m.parameters(), lr=0.05),
                        lambda o, rep, m: hdet.HDETLR(o, None, 4, ensemble_lr_spread_ratio=0.5, model_sync_interval=2,
                                                      replicas=rep, model=m), mode="loop")
    g = torch.Generator().manual_seed(1)
    loss_fn = lambda m, b: nn.functional.mse_loss(m(b), b[:, :1])  # noqa: E731
    params = lambda m: [p.detach().clone() for p in m.parameters()]  # noqa: E731
    stats = lambda m: torch.cat([m[1].running_mean, m[1].running_var]).clone()  # noqa: E731
    for t in (1, 2, 3, 4):
        eng.step([torch.randn(8, 4, generator=g) for _ in range(7)], loss_fn)
        with torch.no_grad():
            for m in eng.models:
                m(torch.randn(8, 4, generator=g))
        own = [(params(m), stats(m)) for m in eng.models]
        with eng.averaged() as changed:
            inside = [(params(m), stats(m)) for m in eng.models]
        if t == 2:  # (a converge step mid-run)
            assert changed and all(torch.equal(a, b) for (p, _), (q, _) in zip(own, inside) for a, b in zip(p, q))
            mean = sum(s for _, s in own) / 7
            assert all(torch.allclose(s, mean, rtol=1e-6, atol=1e-7) for _, s in inside)
            assert not all(torch.equal(own[0][1], s) for _, s in own[1:])
        if t == 4:  # (the last step: nothing averaged)
            assert not changed and all(torch.equal(a[1], b[1]) for a, b in zip(own, inside))


def test_an_engine_with_a_named_param_group_resumes_its_own_state():
    """A param group named (``{"name": "body"}``, what ``WeightDecay(opt, group="body")`` looks up) beside one that is
    not: the check that refuses another optimizer's state took every key of any group as this optimizer's, and refused
    the engine's own state (a review). Options every group holds are compared: AdamW's state into SGD still fails."""
    def engine():
        torch.manual_seed(0)
        return ReplicaEngine(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1)), 2,
                             lambda m: torch.optim.AdamW([{"params": m[0].parameters(), "name": "body"},
                                                          {"params": m[1].parameters()}], lr=0.01),
                             lambda o, rep, m: hdet.HDETLR(o, None, 10, ensemble_lr_spread_ratio=0.2,
                                                           model_sync_interval=5, replicas=rep, model=m), mode="loop")
    loss_fn = lambda m, b: nn.functional.mse_loss(m(b), b[:, :1])  # noqa: E731
    a = engine()
    a.step([torch.randn(4, 4)] * 2, loss_fn)
    b = engine()
    b.load_state_dict(a.state_dict())
    assert b.schedulers[0].last_epoch == 1


@pytest.mark.parametrize("mode", ["loop", "vmap"])
def test_one_lr_tensor_given_to_every_replica_trains_each_at_its_own_lr(mode):
    """make_optimizer closing over one LR tensor (torch's compiled-optimizer recipe, lr=torch.tensor(...)): torch keeps
    that object in every replica's param groups, and hdet sets a tensor LR in place, so every replica trained at the
    last value set while the records showed the spread (an audit: both at 0.075 instead of 0.025 and 0.075). Each
    replica's group gets a copy of its own: the same run as with a tensor per replica, bit for bit."""
    def run(shared):
        torch.manual_seed(0)
        lr = torch.tensor(0.05)
        eng = ReplicaEngine(nn.Linear(4, 2), 2, lambda m: torch.optim.Adam(m.parameters(), lr=lr if shared else
                                                                           torch.tensor(0.05)),
                            lambda o, rep, m: hdet.HDETLR(o, None, 6, replicas=rep, model_sync_interval=3,
                                                          ensemble_lr_spread_ratio=0.5), mode=mode)
        g = torch.Generator().manual_seed(1)
        for _ in range(2):
            eng.step([torch.randn(8, 4, generator=g) for _ in range(2)], lambda m, b: m(b).square().mean())
        return eng, [float(o.param_groups[0]["lr"]) for o in eng.optimizers], [p.detach().clone() for p in
                                                                               eng.models[1].parameters()]

    eng, lrs, params = run(shared=True)
    _, own_lrs, own_params = run(shared=False)
    assert lrs == own_lrs and lrs[1] == pytest.approx(3 * lrs[0])
    assert all(torch.equal(a, b) for a, b in zip(params, own_params))


def test_float16_autocast_without_loss_scaling_is_said_once():
    """The engine runs the backward itself, with no GradScaler: under float16 autocast small gradients underflow to 0
    (an audit: 13% of a first layer's gradient elements, late in a run), where the same model under DDP has the
    scaler. Said once; bfloat16 autocast (no scaling needed) and float32 are not."""
    def said(dtype):
        torch.manual_seed(0)
        eng = ReplicaEngine(nn.Linear(4, 2), 2, _sgd(0.1), _sched(steps=4), mode="loop")
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for _ in range(2):
                x = torch.randn(2, 3, 4)
                with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                    eng.step((x,), lambda m, b: m(b[0]).float().pow(2).mean(), stacked=True)
        return [str(x.message) for x in w if "float16 autocast" in str(x.message)]

    assert len(said(torch.float16)) == 1 and "Use bfloat16 autocast" in said(torch.float16)[0]
    assert said(torch.bfloat16) == [] and said(None) == []


def test_a_model_whose_gradients_all_come_transposed_steps_in_vmap_mode():
    """Bias-free layers used as ``x @ W.t()``: every weight gradient comes out of vmap's backward in the transposed
    layout, so no gradient matched its ``.grad``'s layout and torch's foreach copy was given an empty list at step 2
    (a crash, after mode="auto" had settled on vmap; an audit) wherever the gradients are copied rather than summed
    in the backward: share_gradients=False, a before_optimizer_step, or any run on a GPU. Same weights as the loop."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = nn.Parameter(torch.randn(32, 16) * 0.1)
            self.w2 = nn.Parameter(torch.randn(1, 32) * 0.1)

        def forward(self, x):
            return torch.tanh(x @ self.w1.t()) @ self.w2.t()

    for kw in (dict(share_gradients=False), dict(before_optimizer_step=lambda r, m, o: None)):
        weights = []
        for mode in ("vmap", "loop"):
            torch.manual_seed(0)
            eng = ReplicaEngine(M(), 2, _sgd(1e-2), _sched(steps=4, alpha=0.2), mode=mode, **kw)
            for t in range(3):
                x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(t))
                eng.step(x, lambda m, b: m(b).pow(2).mean(), stacked=True)
            weights.append([p.detach().clone() for m in eng.models for p in m.parameters()])
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(*weights)), kw
