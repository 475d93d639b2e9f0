"""Explored hyperparameters beyond the LR: spreads, bounds, per-hyperparameter control, independence of
assignments, telemetry, state, engine and torchrun behaviour."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import hdet
from hdet import AdamBeta, Dropout, GradClip, LabelSmoothing, Setter, Spread, WeightDecay
from helpers import ScriptedReplicas


def _sgd(wd=0.01):
    m = nn.Linear(3, 1)
    return m, torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=wd)


# --------------------------------------------------------------------------- spreads
def test_spread_kinds_and_bounds():
    lin = Spread("linear", 0.2).offsets(4)
    assert lin == hdet.linear_multipliers(4, 0.2)
    log = Spread("log", 1.0).offsets(4)
    assert log[0] == pytest.approx(0.5) and log[-1] == pytest.approx(2.0)  # rho and 1/rho
    assert all(a * b == pytest.approx(1.0) for a, b in zip(log, reversed(log)))  # log-symmetric
    assert math.prod(log) == pytest.approx(1.0)
    add = Spread("additive", 0.1, (0.0, 0.999))
    assert add.offsets(3) == pytest.approx([-0.1, 0.0, 0.1])
    assert [add.apply(0.05, o) for o in add.offsets(3)] == pytest.approx([0.0, 0.05, 0.15])  # clamped at 0
    assert add.apply(0.95, 0.1) == 0.999  # never reaches 1
    with pytest.raises(ValueError, match="0 <= alpha < 1 for a linear spread, but got 1.0"):
        Spread("linear", 1.0)
    with pytest.raises(ValueError, match="spread kind in"):
        Spread("cubic", 0.1)
    with pytest.raises(ValueError, match="bounds >= 0 for a log spread"):
        Spread("log", 0.5, (-1.0, 1.0))
    with pytest.raises(ValueError, match="low <= high"):
        Spread("additive", 0.1, (1.0, 0.0))


def test_builtins_get_set_and_bad_input():
    m, opt = _sgd()
    wd = WeightDecay(opt)
    assert wd.get() == 0.01 and wd.name == "weight_decay/0"
    wd.set(0.02)
    assert opt.param_groups[0]["weight_decay"] == 0.02 and type(opt.param_groups[0]["weight_decay"]) is float
    b1 = AdamBeta(opt, index=1)
    b1.set(0.99)
    assert opt.param_groups[0]["betas"] == (0.9, 0.99) and all(type(b) is float for b in opt.param_groups[0]["betas"])
    net = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.3), nn.Sequential(nn.Dropout(0.3)))
    d = Dropout(net)
    d.set(0.1)
    assert [x.p for x in net.modules() if isinstance(x, nn.Dropout)] == [0.1, 0.1]
    ce = nn.CrossEntropyLoss(label_smoothing=0.1)
    LabelSmoothing(ce).set(0.2)
    assert ce.label_smoothing == 0.2
    box = {"t": 1.0}
    temp = Setter("temperature", lambda: box["t"], lambda v: box.__setitem__("t", v), Spread("log", 0.2))
    temp.set(2.0)
    assert box["t"] == 2.0 and not temp.vmap_safe
    for bad in (None, torch.ones(2)):  # float()'s own error named no hyperparameter (an audit)
        with pytest.raises(ValueError, match="Expected 'scale''s getter to return a number, but it returned"):
            Setter("scale", lambda bad=bad: bad, lambda v: None, Spread("log", 0.2))
    clip = GradClip(1.0)
    m(torch.ones(1, 3)).sum().mul(100).backward()
    clip.set(0.5)
    clip.clip_(m.parameters())
    assert torch.cat([p.grad.flatten() for p in m.parameters()]).norm() <= 0.5 + 1e-6
    with pytest.raises(ValueError, match="at least one nn.Dropout"):
        Dropout(nn.Linear(2, 2))
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.1)  # its attention's dropout is a float
    Dropout(layer).set(0.3)
    assert layer.self_attn.dropout == 0.3 and [m.p for m in layer.modules() if isinstance(m, nn.Dropout)] == [0.3] * 3
    mixed = nn.Sequential(nn.MultiheadAttention(8, 2), nn.Dropout(0.1))  # attention dropout 0, the rest 0.1
    with pytest.warns(UserWarning, match=r"leaves out 1 nn.MultiheadAttention.*\[0.0\] is not the other modules' p"):
        d = Dropout(mixed, base=0.1)  # (one value for all: the attention's 0 is not taken over silently)
    d.set(0.2)
    assert mixed[0].dropout == 0.0 and mixed[1].p == 0.2
    with pytest.raises(ValueError, match=r"p in \[0.0, 0.2\].*attention=False"):
        Dropout(mixed, attention=True)
    Dropout(mixed, attention=False).set(0.3)
    assert mixed[0].dropout == 0.0 and mixed[1].p == 0.3
    with pytest.raises(ValueError, match="param group index in"):
        WeightDecay(opt, group=3)
    with pytest.raises(ValueError, match="label_smoothing attribute"):
        LabelSmoothing(nn.MSELoss())
    with pytest.raises(ValueError, match=r"base value inside \(0.0, 0.999\), but got 1.5"):
        Dropout(net, base=1.5)
    with pytest.raises(ValueError, match="base value > 0 for weight_decay/0's log spread"):
        WeightDecay(torch.optim.AdamW(m.parameters(), weight_decay=0.0))
    with pytest.raises(ValueError, match="distinct hyperparameter names"):
        hdet.HDETLR(opt, None, 10, explore=[WeightDecay(opt), WeightDecay(opt)])
    with pytest.raises(ValueError, match="hdet hyperparameters"):
        hdet.HDETLR(opt, None, 10, explore=["dropout"])
    with pytest.raises(ValueError, match="cycle_momentum=False when exploring beta1"):
        hdet.OneCycleAutoLR(opt, max_lr=0.1, total_steps=10, explore=[AdamBeta(opt, 0)])
    with pytest.raises(ValueError, match="cycle_momentum=False when exploring beta1"):  # HDETLR over a OneCycleLR too
        adam = torch.optim.AdamW(m.parameters(), lr=0.1)
        hdet.HDETLR(adam, torch.optim.lr_scheduler.OneCycleLR(adam, 0.1, total_steps=10), 10,
                    explore=[AdamBeta(adam, 0)])
    for wrap in ("chained", "tuple", "sequential"):  # one inside a ChainedScheduler or SequentialLR (an audit: accepted, and
        adam = torch.optim.AdamW(m.parameters(), lr=0.1)  # beta1 silently lost its cycle)
        L = torch.optim.lr_scheduler
        cyclic = L.CyclicLR(adam, 0.01, 0.1, base_momentum=0.8, max_momentum=0.9)
        base = (L.ChainedScheduler([cyclic]) if wrap == "chained" else L.ChainedScheduler((cyclic,)) if wrap == "tuple"
                else
                L.SequentialLR(adam, [L.LinearLR(adam, 0.1, total_iters=3), L.OneCycleLR(adam, 0.1, total_steps=10)],
                               milestones=[3]))
        with pytest.raises(ValueError, match="cycle_momentum=False when exploring beta1"):
            hdet.HDETLR(adam, base, 10, explore=[AdamBeta(adam, 0)])
    two = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.0), nn.Linear(3, 3), nn.Dropout(0.3))
    with pytest.raises(ValueError, match=r"one p to explore as one value, but got p in \[0.0, 0.3\]"):
        Dropout(two)  # every module would have been set to one value spread around the first's 0.0
    assert Dropout(two[3]).get() == 0.3 and Dropout(two, base=0.1).get() == 0.0
    with pytest.raises(ValueError, match=r"weight_decay > 0 to explore, but every group of Adam has \[0\]"):
        WeightDecay.per_group(torch.optim.Adam(m.parameters()))  # it returned [] (nothing explored, silently)


def test_a_log_schedule_that_reaches_zero_is_an_error_under_the_paper_controller_not_a_nan():
    """A weight decay scheduled to 0 on a log spread: the paper controller, which works on log(value), set NaN on the
    optimizer (the weights went non-finite a step later, and the run stopped at the next sync). Now a clear error at
    that sync; without it (or with the fit controller) a schedule that ends at 0 gives every replica 0, as asked."""
    import warnings

    def run(**kw):
        opt = torch.optim.AdamW(nn.Linear(3, 1).parameters(), lr=0.1, weight_decay=0.1)
        wd = WeightDecay(opt, schedule=lambda t: 0.0 if t < 20 else 0.1)
        s = hdet.HDETLR(opt, None, 40, model_sync_interval=5, replicas=ScriptedReplicas(0, 2), explore=[wd], **kw)
        for _ in range(12):
            opt.step()
            s.step(torch.tensor(1.0))
        return opt.param_groups[0]["weight_decay"]

    assert run() == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=r"weight_decay/0's values > 0 under the paper controller.*reached 0"):
            run(enable_auto_lr=True, controller="paper", auto_lr_warmup_steps=5, final_lr=0.01)


def test_a_schedule_that_leaves_its_bounds_holds_the_base_there_and_says_so_once():
    """A schedule past the spread's bounds: every replica's value was clamped to the bound (the spread gone) while the
    sync records showed the schedule's value (weight decay -0.11, dropout 1.5), silently (an audit). Now the base is
    held at the bound, the records show it, the replicas spread around it, and one warning says so."""
    m = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.1), nn.Linear(3, 1))
    opt = torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.1)
    wd = WeightDecay(opt, schedule=lambda t: 0.1 - 0.03 * t)
    drop = Dropout(m, alpha=0.05, schedule=lambda t: 0.1 + 0.2 * t)
    s = hdet.HDETLR(opt, None, 20, model_sync_interval=4, replicas=ScriptedReplicas(0, 2), explore=[wd, drop])
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        for _ in range(8):
            opt.step()
            s.step(torch.tensor(1.0))
    said = [str(w.message) for w in got if "outside its bounds" in str(w.message)]
    assert len(said) == 2, said  # once each
    assert "weight_decay/0's schedule gave -0.02 at step 4" in said[0] and "held at 0 there" in said[0]
    assert "dropout's schedule gave 1.1 at step 5" in said[1] and "held at 0.999 there" in said[1]
    bases = dict(zip(s.last_sync.names, s.last_sync.bases))
    assert bases["weight_decay/0"] == 0.0 and bases["dropout"] == 0.999
    assert m[1].p == pytest.approx(0.999 - 0.05)  # replica 0 of 2: the base minus alpha (it was clamped to 0.999)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.3)  # a linear decay to 0 ends -5.6e-17 (a
    s = hdet.HDETLR(opt, None, 20, model_sync_interval=4, replicas=ScriptedReplicas(0, 2),  # review): clamped,
                    explore=[WeightDecay(opt, schedule=lambda t: 0.3 - 0.1 * t)])  # not said
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            opt.step()
            s.step(torch.tensor(1.0))
    assert opt.param_groups[0]["weight_decay"] == 0.0


def test_explored_hyperparameters_take_any_seed_and_numpy_bounds():
    """A seed from time.time_ns() overflowed the first permutation's generator; numpy float32 bounds broke the
    agreement check's fingerprint at the first sync."""
    import numpy as np

    opt = torch.optim.AdamW(nn.Linear(3, 1).parameters(), lr=0.1, weight_decay=0.1)
    hdet.HDETLR(opt, None, 10, replicas=ScriptedReplicas(0, 2), seed=1_800_000_000_000_000_000,
                explore=[WeightDecay(opt)])
    wd = WeightDecay(opt, bounds=(np.float32(0.0), np.float32(1.0)))
    s = hdet.HDETLR(opt, None, 10, model_sync_interval=5, replicas=ScriptedReplicas(0, 2), explore=[wd])
    for _ in range(5):
        opt.step()
        s.step(torch.tensor(1.0))
    assert s.last_sync.step == 5


def test_exploring_label_smoothing_under_the_controller_says_what_to_pass():
    crit = nn.CrossEntropyLoss(label_smoothing=0.1)
    opt = torch.optim.SGD(nn.Linear(3, 1).parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="label smoothing raises a replica's loss by itself"):
        hdet.HDETLR(opt, None, 20, enable_auto_lr=True, controller="paper", model_sync_interval=5, final_lr=0.01,
                    explore=[LabelSmoothing(crit)])


def test_values_spread_from_step_one_and_all_replicas_form_the_spread():
    """Replica r of 4 applies its own weight decay from the first step; across replicas the values are the
    spread's, a permutation after each controller sync; bounds hold for dropout."""
    seen = []
    for r in range(4):
        m, opt = _sgd(0.01)
        net = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.02))
        hdet.HDETLR(opt, None, 20, ensemble_lr_spread_ratio=0.2, model_sync_interval=5,
                        replicas=ScriptedReplicas(r, 4, lambda: [1.0, 1.0, 1.0, 1.0]),
                        explore=[WeightDecay(opt, alpha=1.0), Dropout(net, alpha=0.05)])
        seen.append((opt.param_groups[0]["weight_decay"], net[1].p))
    assert sorted(w for w, _ in seen) == pytest.approx([0.005, 0.01 * 2 ** (-1 / 3), 0.01 * 2 ** (1 / 3), 0.02])
    assert sorted(p for _, p in seen) == pytest.approx([0.0, 0.02 - 0.05 / 3, 0.02 + 0.05 / 3, 0.07])  # 0.02-0.05 -> 0
    assert min(p for _, p in seen) >= 0


def _ensemble_with(hypers, N=4, rank=0, alpha=0.2, auto=True, T=1, warm=0, sigma=0.1, script=None):
    m, opt = _sgd()
    s = hdet.HDETLR(opt, None, 100_000, ensemble_lr_spread_ratio=alpha, model_sync_interval=T,
                    controller="paper", enable_auto_lr=auto, auto_lr_warmup_steps=warm, loss_scale=sigma,
                    replicas=ScriptedReplicas(rank, N, script or (lambda: [1.0] * N)), explore=hypers(opt))
    return s, opt


def _chi_square(counts):
    n = sum(map(sum, counts))
    rows, cols = [sum(r) for r in counts], [sum(c) for c in zip(*counts)]
    return sum((counts[i][j] - rows[i] * cols[j] / n) ** 2 / (rows[i] * cols[j] / n)
               for i in range(len(rows)) for j in range(len(cols)))


def test_assignments_of_two_hyperparameters_are_independent():
    """Over 3000 controller syncs, the joint counts of (replica 0's position for the LR, for the weight
    decay) pass a chi-square test of independence (df 9, p = 0.001 critical value 27.88); the same test
    does flag a dependent pairing, so it can fail."""
    N = 4
    s, opt = _ensemble_with(lambda o: [WeightDecay(o)], N=N)
    ens = s.ensemble
    joint = [[0] * N for _ in range(N)]
    dependent = [[0] * N for _ in range(N)]
    prev_lr = 0
    for _ in range(3000):
        opt.step()
        s.step(torch.tensor(1.0))
        a, b = ens.perms[0][0], ens.perms[1][0]
        joint[a][b] += 1
        dependent[a][prev_lr] += 1  # position now against the LR's own previous position: independent too
        prev_lr = a
    assert _chi_square(joint) < 27.88
    assert _chi_square([[n if i == j else 0 for j, n in enumerate(row)] for i, row in enumerate(joint)]) > 27.88
    assert all(c > 0 for row in joint for c in row)
    assert _chi_square(dependent) < 27.88


def test_controller_runs_per_hyperparameter_in_log_space():
    """A log-spread weight decay: the controller sees log(value), its base moves toward the replica with
    the lowest loss, and the recorded telemetry names every slot with every replica's value."""
    N = 4
    s, opt = _ensemble_with(lambda o: [WeightDecay(o, alpha=1.0)], N=N, alpha=0.0, sigma=0.05)
    ens = s.ensemble
    bases = []
    for _ in range(6):
        wds = ens.all_values()[1]  # every replica's weight decay this window
        best = min(range(N), key=lambda r: wds[r])  # the replica with the smallest weight decay ...
        losses = [1.0 + (0.0 if r == best else 0.2) for r in range(N)]  # ... has the lowest loss
        ens.replicas.window_losses = lambda losses=losses: losses
        opt.step()
        s.step(torch.tensor(1.0))
        rec = s.last_sync
        step = rec.controller[1]
        assert rec.names == ["lr/0", "weight_decay/0"]
        assert step.h_bar == pytest.approx(sum(math.log(v) for v in wds) / N)  # log space
        assert step.h_tilde == pytest.approx(sum(w * math.log(v) for w, v in zip(step.weights, wds)))
        assert step.delta < 0
        bases.append(rec.bases[1])
    assert bases == sorted(bases, reverse=True) and bases[-1] < 0.01 * 0.8
    assert sorted(rec.values[1]) == pytest.approx(sorted(bases[-1] * o for o in Spread("log", 1.0).offsets(N)))


@pytest.mark.parametrize("mode", ["loop", "auto"])
def test_lower_dropout_wins_and_the_base_dropout_decreases(mode):
    """A task built so that dropout only hurts (a linear regression with dropout on its input): with the
    controller on, the base dropout falls over the syncs. In the engine, a dropout hyperparameter makes
    mode 'auto' run the loop (vmap would share one p across replicas)."""
    from hdet.engine import ReplicaEngine

    torch.manual_seed(0)
    w_true = torch.randn(16, 1)
    model = nn.Sequential(nn.Dropout(0.3), nn.Linear(16, 1))
    eng = ReplicaEngine(
        model, 4, lambda m: torch.optim.SGD(m.parameters(), lr=0.05),
        lambda o, rep, m: hdet.HDETLR(o, None, 300, model_sync_interval=10, controller="paper", enable_auto_lr=True,
                                      auto_lr_warmup_steps=20, loss_scale=0.05, replicas=rep, model=m,
                                      explore=[Dropout(m, alpha=0.1)]), mode=mode)
    assert eng.mode == "loop"
    g = torch.Generator().manual_seed(1)
    for _ in range(300):
        xs = [torch.randn(32, 16, generator=g) for _ in range(4)]
        eng.step([(x, x @ w_true) for x in xs], lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]))
    bases = [eng.schedulers[0].ensemble.current_bases[1]]
    ctrl = eng.schedulers[0].ensemble.controllers[1]
    assert ctrl.updates == 29  # syncs 20, 30, ..., 300
    assert bases[-1] < 0.3 - 0.15
    assert all(0.0 <= s.hyperparameters["dropout"] <= 0.999 for s in eng.schedulers)
    with pytest.raises(ValueError, match="vmap can batch"):
        ReplicaEngine(model, 2, lambda m: torch.optim.SGD(m.parameters(), lr=0.05),
                      lambda o, rep, m: hdet.HDETLR(o, None, 10, replicas=rep, explore=[Dropout(m)]), mode="vmap")


def test_module_attributes_restored_exactly_on_load():
    def build(p=0.3, wd=0.01):
        net = nn.Sequential(nn.Linear(3, 3), nn.Dropout(p))
        opt = torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=wd)
        s = hdet.HDETLR(opt, None, 50, ensemble_lr_spread_ratio=0.2, model_sync_interval=5, controller="paper", enable_auto_lr=True,
                        auto_lr_warmup_steps=5, loss_scale=0.05,
                        replicas=ScriptedReplicas(2, 4, lambda: [1.0, 1.3, 0.9, 1.1]),
                        explore=[Dropout(net, alpha=0.1), WeightDecay(opt, alpha=0.5)])
        return net, opt, s

    net, opt, s = build()
    for _ in range(17):
        opt.step()
        s.step(torch.tensor(1.0))
    saved = s.state_dict()
    net2, opt2, s2 = build(p=0.0, wd=0.5)
    s2.load_state_dict(saved)
    assert net2[1].p == net[1].p and opt2.param_groups[0]["weight_decay"] == opt.param_groups[0]["weight_decay"]
    for _ in range(10):  # and they go on identically
        for o, sc in ((opt, s), (opt2, s2)):
            o.step()
            sc.step(torch.tensor(1.0))
        assert net2[1].p == net[1].p and s2.hyperparameters == s.hyperparameters
    _, opt3, s3 = build()
    s3_small = hdet.HDETLR(opt3, None, 50, replicas=ScriptedReplicas(2, 4, lambda: [1.0] * 4))
    with pytest.raises(ValueError, match="explored slots"):
        s3_small.load_state_dict(saved)


def _explore(rank, world):
    from dist_workers import explore_hypers

    return explore_hypers(rank, world)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_explore_under_gloo(world):
    """Real DDP: every step the replicas' weight decays, beta2s and clipping norms are the spread's values
    (one each), dealt independently of the LR; weights end equal; group values stay floats."""
    from helpers import check_ok, run_gloo

    res = check_ok(run_gloo(_explore, world))
    r0 = res[0]
    assert r0["names"] == ["lr/0", "weight_decay/0", "beta2/0", "grad_clip_norm"]
    assert len(r0["ctrl"]) == 4
    wd_offsets = Spread("log", 1.0).offsets(world)
    for step in r0["seen"][:9]:  # before the first controller sync: bases are the initial values
        assert sorted(row[1] for row in step) == pytest.approx(sorted(0.05 * o for o in wd_offsets))
        assert sorted(row[2] for row in step) == pytest.approx(sorted(min(0.999 + o, 0.9999) for o in  # bound
                                                               Spread("additive", 0.02).offsets(world)))
        assert sorted(row[3] for row in step) == pytest.approx(sorted(wd_offsets))
    lr_rank = [tuple(sorted(range(world), key=lambda r: step[r][0])) for step in r0["seen"]]
    wd_rank = [tuple(sorted(range(world), key=lambda r: step[r][1])) for step in r0["seen"]]
    if world == 4:  # dealt separately (with 2 replicas and 4 controller syncs they may agree by chance)
        assert lr_rank != wd_rank
    assert all(torch.equal(r["params"][0], r["params"][-1]) for r in res)
    assert all(r["floats"] for r in res)


def test_controller_update_never_leaves_the_bounds():
    """Losses always favour the lowest dropout: the base is pushed below 0 by the controller and clamped
    there; no replica's value ever leaves [0, 0.999]."""
    net = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.05))
    s, opt = _ensemble_with(lambda o: [Dropout(net, alpha=0.04)], N=4, alpha=0.0, sigma=0.01)
    ens = s.ensemble
    for _ in range(40):
        ps = ens.all_values()[1]
        ens.replicas.window_losses = lambda ps=ps: [1.0 + p for p in ps]  # lower dropout, lower loss
        opt.step()
        s.step(torch.tensor(1.0))
        assert all(0.0 <= v <= 0.999 for v in s.last_sync.values[1])
    assert ens.current_bases[1] == 0.0 and ens.controllers[1].bounds == (0.0, 0.999)
    assert any(c.clamped for c in [s.last_sync.controller[1]])


def test_group_params_by_a_user_grouping():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.LayerNorm(4))
    groups = hdet.group_params(model, lambda n, p: "embedding" if n.startswith("0.") else
                               "no_decay" if p.ndim < 2 else "transformer", no_decay={"weight_decay": 0.0})
    assert [g["name"] for g in groups] == ["embedding", "transformer", "no_decay"]
    assert [len(g["params"]) for g in groups] == [1, 1, 3] and groups[2]["weight_decay"] == 0.0
    opt = torch.optim.AdamW(groups, lr=0.1, weight_decay=0.1)
    s = hdet.HDETLR(opt, None, 10, ensemble_lr_spread_ratio=0.2, replicas=ScriptedReplicas(0, 4))
    assert s.ensemble.names == ["lr/embedding", "lr/transformer", "lr/no_decay"]
    with pytest.raises(ValueError, match="options only for existing groups"):
        hdet.group_params(model, lambda n, p: "all", decay={"weight_decay": 0.1})


def test_explored_hyperparameters_start_from_permutations_of_their_own():
    """Without auto-LR (which deals them, Eq. 9) every slot kept the identity: replica 0 had the lowest LR, weight
    decay and clipping norm, replica 3 the highest of each, so no window loss could tell their effects apart. The
    LR keeps the paper's start (replica r takes rho_r); each other slot starts from its own permutation, the same
    on every replica for a seed."""
    def values(seed):
        out = []
        for r in range(4):
            o = torch.optim.AdamW(nn.Linear(3, 1).parameters(), lr=0.1, weight_decay=0.01)
            s = hdet.HDETLR(o, None, 20, ensemble_lr_spread_ratio=0.3, seed=seed, replicas=ScriptedReplicas(r, 4),
                            explore=[WeightDecay(o, alpha=1.0), hdet.GradClip(1.0, alpha=1.0)])
            out.append([o.param_groups[0]["lr"], s.hyperparameters["weight_decay/0"], s.hyperparameters["grad_clip_norm"]])
        return out

    for seed in (0, 1):
        lr, wd, clip = zip(*values(seed))
        order = [sorted(col).index(v) for col in (lr, wd, clip) for v in col]
        ranks = [order[0:4], order[4:8], order[8:12]]
        assert ranks[0] == [0, 1, 2, 3]  # the LR: the paper's start
        assert all(sorted(r) == [0, 1, 2, 3] for r in ranks)  # each slot a permutation of the positions
        assert ranks[1] != ranks[0] and ranks[2] != ranks[0] and ranks[1] != ranks[2]  # no two ranked alike
    assert values(0) == values(0)


def test_a_spread_past_its_bounds_says_so_once():
    """Dropout explored around 0 (the CLI's default --dropout) with alpha 0.05: two of four replicas were clamped to 0
    and shared it, silently; now one warning says so (replica 0's). Around 0.1 it stays inside: no warning."""
    import warnings

    from hdet.engine import ReplicaEngine

    def build(p):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 8), nn.Dropout(p), nn.Linear(8, 3))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ReplicaEngine(m, 4, lambda mm: torch.optim.SGD(mm.parameters(), lr=0.1),
                          lambda o, rep, mm: hdet.OneCycleAutoLR(o, max_lr=0.1, total_steps=10, replicas=rep, model=mm,
                                                                 explore=[hdet.Dropout(mm, alpha=0.05)]), mode="loop")
        return [str(c.message) for c in caught if "past its bounds" in str(c.message)]

    said = build(0.0)
    assert len(said) == 1 and "dropout's spread around 0 (additive, alpha 0.05) reaches -0.05..0.05" in said[0]
    assert "2 of the 4 replicas are clamped" in said[0]
    assert build(0.1) == []


def test_dropout_says_which_float_dropouts_it_leaves_alone():
    """Many Hugging Face attention modules keep attention_dropout as a float the forward hands to SDPA: Dropout(model)
    moved the nn.Dropout modules' p and left that float as it was, silently, while reporting dropout as explored (an
    audit on a GPT-NeoX). It now names them."""
    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention_dropout = 0.1
            self.resid = nn.Dropout(0.1)

    model = nn.Sequential(Attention(), nn.Linear(2, 2))
    with pytest.warns(UserWarning, match=r"also keep a dropout as a plain float.*Attention.attention_dropout=0.1"):
        Dropout(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to say: no float dropout, or one at 0
        Dropout(nn.Sequential(nn.Dropout(0.1), nn.Linear(2, 2)))
        model[0].attention_dropout = 0.0
        Dropout(model)


def test_label_smoothing_takes_a_hugging_face_label_smoother():
    """TrainingArguments(label_smoothing_factor=...) gives the Trainer a LabelSmoother whose value is `epsilon`:
    LabelSmoothing(trainer.label_smoother) was refused (an audit); it explores that epsilon now."""
    class LabelSmoother:  # (transformers.trainer_pt_utils.LabelSmoother's one field)
        epsilon = 0.1

    smoother = LabelSmoother()
    h = LabelSmoothing(smoother)
    assert h.get() == 0.1
    h.set(0.15)
    assert smoother.epsilon == 0.15
    with pytest.raises(ValueError, match="label_smoothing attribute"):
        LabelSmoothing(object())


def test_the_paper_controller_over_an_explored_dropout_says_it_reads_the_training_loss():
    model = nn.Sequential(nn.Dropout(0.1), nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="dropout raises a replica's training loss by itself"):
        hdet.HDETLR(opt, None, 20, enable_auto_lr=True, controller="paper", model_sync_interval=5, final_lr=0.01,
                    explore=[Dropout(model)])


@pytest.mark.parametrize("mode", ["loop", "auto"])
def test_averaged_evaluates_at_the_explored_bases_and_gives_each_replica_its_own_back(mode):
    """`with engine.averaged():` with an explored label smoothing: each replica evaluated the average with its own
    smoothing (its share of a validation measured 0.1% off the average's loss at the base: an audit); the explored
    values are at their base meanwhile, each replica's own back after."""
    from hdet.engine import ReplicaEngine

    torch.manual_seed(0)
    crits = {}

    def sched(o, rep, m):
        crits[id(m)] = nn.CrossEntropyLoss(label_smoothing=0.1)
        return hdet.HDETLR(o, None, 20, ensemble_lr_spread_ratio=0.2, model_sync_interval=5, replicas=rep, model=m,
                           explore=[LabelSmoothing(crits[id(m)], alpha=0.05)])

    eng = ReplicaEngine(nn.Linear(4, 3), 3, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), sched, mode=mode)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        eng.step([(torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(3)],
                 lambda m, b: crits[id(m)](m(b[0]), b[1]))
    own = [crits[id(m)].label_smoothing for m in eng.models]
    assert sorted(own) == pytest.approx([0.05, 0.1, 0.15])
    with eng.averaged():
        assert [crits[id(m)].label_smoothing for m in eng.models] == pytest.approx([0.1] * 3)
    assert [crits[id(m)].label_smoothing for m in eng.models] == own


def test_dropout_of_a_model_with_only_float_dropouts_names_them():
    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention_dropout = 0.1

    with pytest.raises(ValueError, match=r"found none \(these modules keep their dropout as a plain float: "
                                         r"Attention.attention_dropout=0.1"):
        Dropout(nn.Sequential(Attention(), nn.Linear(2, 2)))


def test_a_setter_that_raises_while_the_average_goes_in_leaves_nothing_swapped_in():
    """A Setter that raised while the average's explored values were set left the average in, with every later step
    refused (a review): each replica's own weights and values are now back, and nothing is swapped in."""
    from hdet.engine import ReplicaEngine

    armed, values = {"on": False}, {}

    def setter(r):
        def set_value(v):
            if armed["on"]:
                raise RuntimeError("setter failed")
            values[r] = v
        values[r] = 1.0
        return Setter("t", lambda: values[r], set_value, Spread("log", 0.1, (0, math.inf)))

    torch.manual_seed(0)
    eng = ReplicaEngine(nn.Linear(3, 1), 2, lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                        lambda o, rep, m: hdet.HDETLR(o, None, 10, ensemble_lr_spread_ratio=0.2, model_sync_interval=5,
                                                      replicas=rep, model=m, explore=[setter(rep.rank)]), mode="loop")
    for _ in range(2):
        eng.step([torch.randn(4, 3)] * 2, lambda m, b: m(b).pow(2).mean())
    own = [m.weight.detach().clone() for m in eng.models]
    armed["on"] = True
    with pytest.raises(RuntimeError, match="setter failed"):
        with eng.averaged():
            pass
    armed["on"] = False
    assert not eng._swap.active and all(torch.equal(m.weight, w) for m, w in zip(eng.models, own))
    assert sorted(values.values()) == pytest.approx([1 / 1.1, 1.1])  # (each replica's own value back)
    eng.step([torch.randn(4, 3)] * 2, lambda m, b: m(b).pow(2).mean())


@pytest.mark.parametrize("clips", [False, True])
def test_an_explored_clipping_norm_nobody_applies_says_so_once(clips):
    """README's explore snippet built hdet.GradClip(1.0) inline: its norms were reported at every sync, the gradients
    never clipped, and nothing said so (an audit). Now the first sync whose window never read the norm warns, once;
    a loop that clips (clip.clip_) hears nothing."""
    from hdet.engine import ReplicaEngine

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    clip_of = {}

    def sched(o, rep, mm):
        clip_of[len(clip_of)] = clip = hdet.GradClip(1.0)
        return hdet.OneCycleAutoLR(o, max_lr=0.1, total_steps=12, replicas=rep, model_sync_interval=4, explore=[clip])

    before = (lambda r, m, o: clip_of[r].clip_(m.parameters())) if clips else None
    eng = ReplicaEngine(model, 2, lambda mm: torch.optim.SGD(mm.parameters(), lr=0.1), sched, mode="loop",
                        before_optimizer_step=before)
    x, y = torch.randn(2, 8, 4), torch.randn(2, 8, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(12):
            eng.step([(x[r], y[r]) for r in range(2)], lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]))
    said = [str(c.message) for c in caught if "hdet.GradClip" in str(c.message)]
    if clips:
        assert said == []
    else:  # one a replica's GradClip (each replica has its own), at the first sync only
        assert len(said) == 2 and all("no step before sync step 4 read it" in s for s in said)


class _Tempered(nn.Module):
    """A linear layer whose output is divided by an explored temperature kept in a buffer (set in place)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("temp", torch.ones(()))

    def forward(self, x):
        return self.lin(x) / self.temp


def _temp_setter(m):
    return Setter("temp", lambda: float(m.temp), lambda v: m.temp.fill_(v), Spread("log", 0.5, (0, math.inf)),
                  vmap_safe=True)


@pytest.mark.parametrize("mode", ["loop", "vmap"])
def test_an_explored_value_kept_in_a_buffer_comes_back_after_averaged(mode):
    """An explored value a Setter keeps in a model's buffer (set in place: what vmap honours): `averaged()` averaged
    the buffer before it read each replica's own value, so every replica went on at the mean after the block (1.0556
    for 1, 1.5 and 0.6667) while the records said otherwise (an audit: the weights 0.02 off after 14 steps). Each
    replica's own value comes back; inside, every replica is at the base."""
    from hdet.engine import ReplicaEngine

    torch.manual_seed(0)
    eng = ReplicaEngine(_Tempered(), 3, lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                        lambda o, rep, m: hdet.HDETLR(o, None, 20, ensemble_lr_spread_ratio=0.2, model_sync_interval=5,
                                                      replicas=rep, model=m, explore=[_temp_setter(m)]), mode=mode)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        eng.step([(torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(3)],
                 lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]))
    own = [float(m.temp) for m in eng.models]
    assert sorted(own) == pytest.approx(sorted([1.0, 1.5, 1 / 1.5]))
    with eng.averaged():
        assert [float(m.temp) for m in eng.models] == pytest.approx([1.0] * 3)
    assert [float(m.temp) for m in eng.models] == own


def _buffer_setter_worker(rank, world):
    import torch.distributed as dist
    torch.manual_seed(0)
    model = _Tempered()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    sched = hdet.HDETLR(opt, None, 20, ensemble_lr_spread_ratio=0.2, model_sync_interval=5, model=ddp,
                        explore=[_temp_setter(model)])
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        loss = nn.functional.cross_entropy(ddp(torch.randn(8, 4, generator=g)), torch.randint(0, 3, (8,), generator=g))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step(loss)
    own = float(model.temp)
    with sched.averaged():
        inside = float(model.temp)
    dist.barrier()
    return {"own": own, "inside": inside, "after": float(model.temp)}


@pytest.mark.distributed
def test_an_explored_value_kept_in_a_buffer_comes_back_after_averaged_under_ddp():
    from helpers import check_ok, run_gloo

    res = check_ok(run_gloo(_buffer_setter_worker, 2))
    assert sorted(r["own"] for r in res) == pytest.approx([1 / 1.5, 1.5])
    assert all(r["inside"] == pytest.approx(1.0) and r["after"] == r["own"] for r in res), res
