"""hdet.lr_sweep: N independent short runs at LRs apart, the model left at its start weights or the best run's."""

import copy
import math
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import hdet
from hdet.sweep import pick_lr, sweep_lrs

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import check_ok, one_thread, run_gloo  # noqa: E402

N, STEPS = 4, 12


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))


def data(r: int, i: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * r + i)
    x = torch.randn(n, 6, generator=g)
    return x, x[:, :1] * 2 - x[:, 1:2] + 0.1 * torch.randn(n, 1, generator=g)


def batches(r: int):
    return (data(r, i) for i in range(STEPS))


def loss_fn(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def make_opt(params, lr):
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)


def held_out(model):
    x, y = data(99, 0, 64)
    return nn.functional.mse_loss(model(x), y)


def hand_run(lr, r, make=make_opt):
    """One sweep run by hand, as benchmarks/sweep_then_train.py runs it: the model from its seed, AdamW, OneCycle over
    the sweep on replica r's batches; its first loss, its tail's mean, and the model."""
    model = make_model()
    opt = make(model.parameters(), lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=STEPS, pct_start=0.3)
    tail = []
    for i, b in enumerate(batches(r)):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model, b)
        loss.backward()
        opt.step()
        sched.step()
        if i == 0:
            first = loss.item()
        if i >= STEPS - max(1, STEPS // 10):
            tail.append(loss.item())
    return first, sum(tail) / len(tail), model


def judged(model):
    model.eval()
    with torch.no_grad():
        value = held_out(model).item()
    return value if math.isfinite(value) else math.inf


def reference(guess, judge, factor=None, n=N, make=make_opt, replicas=None):
    """The sweep written out by hand: the grid of n LRs 32 ** (2 / (n - 1)) apart from guess / factor / 32, moved to
    the nearest power (halves up) of that ratio's smallest root that is at most 3; then, while the best run has fewer
    than need = min(3, (n - 1) // 2) runs on a side and the run at that end is within half the best one's gain of it,
    runs further out on that side (where no run ended below the start: need of them, one at least, beyond the end whose
    run is the best, below if every run blew up), the i-th of a round on batches(i), up to 3 rounds and the grid's reach
    again a side. With fewer replicas than points, run r on batches(r % replicas); the factor sqrt(max(replicas, 8)) by default."""
    replicas = n if replicas is None else replicas
    factor = math.sqrt(max(replicas, 8)) if factor is None else factor
    ratio = 32.0 ** (2 / (n - 1))
    fine = ratio ** (1 / math.ceil(math.log(ratio, 3)))  # the lattice: at most 3x apart
    k0 = math.floor(math.log(guess / factor / ratio ** ((n - 1) / 2), fine) + 0.5 + 1e-9) * math.log(fine, ratio)
    runs, firsts = {}, []  # k grid ratios above the grid's first LR -> (judged loss, state)
    start = judged(make_model()) if judge else None
    for r in range(n):
        first, tail, model = hand_run(ratio ** (k0 + r), r % replicas, make)
        firsts.append(first)
        runs[r] = (judged(model) if judge else tail, copy.deepcopy(model.state_dict()))
    start = start if judge else sum(firsts[:replicas]) / len(firsts[:replicas])  # (the first round's)
    need = min(3, (n - 1) // 2)
    for _ in range(3):
        ks = sorted(runs)
        best = min(ks, key=lambda k: runs[k][0])  # (inf where non-finite; of equal losses the lowest LR)
        kept = lambda k: runs[k][0] < (runs[best][0] + start) / 2  # noqa: E731
        if not runs[best][0] < start:
            more = [ks[0] - 1 - j for j in range(max(need, 1))] if best == ks[0] else []
            top = best == ks[-1] and math.isfinite(runs[best][0])
            more += [ks[-1] + 1 + j for j in range(max(need, 1))] if top else []
        else:
            more = [ks[0] - 1 - j for j in range(need - (best - ks[0]))] if kept(ks[0]) else []
            more += [ks[-1] + 1 + j for j in range(need - (ks[-1] - best))] if kept(ks[-1]) else []
        more = sorted(k for k in more if -(n - 1) <= k <= 2 * (n - 1))  # at most the grid's reach again a side
        if not more:
            break
        for i, k in enumerate(more):
            _, tail, model = hand_run(ratio ** (k0 + k), i % replicas, make)
            runs[k] = (judged(model) if judge else tail, copy.deepcopy(model.state_dict()))
    ks = sorted(runs)
    return [ratio ** (k0 + k) for k in ks], [runs[k][0] for k in ks], [runs[k][1] for k in ks], start


@pytest.mark.parametrize("judge, keep", [(True, "winner"), (False, "winner"), (True, None)])
def test_one_process_is_the_hand_written_sweep(judge, keep):
    model = make_model()
    before = copy.deepcopy(model.state_dict())
    res = hdet.lr_sweep(model, make_opt, loss_fn, batches, guess=0.1, steps=STEPS, num_replicas=N,
                        judge=held_out if judge else None, **({"keep": keep} if keep else {}))
    lrs, losses, states, start = reference(0.1, judge)
    assert res.lrs == pytest.approx(lrs, rel=1e-12)
    assert res.losses == pytest.approx(losses, rel=1e-6)
    best = min(range(len(lrs)), key=lambda i: losses[i])
    assert res.winner == best
    held = states[best] if keep == "winner" else before  # (keep="start", the default: the weights it came with)
    assert not all(torch.equal(v, states[best][k]) for k, v in before.items())
    for k, v in model.state_dict().items():  # the best run's weights and BatchNorm statistics, or the start's
        assert torch.equal(v, held[k]), k
    assert res.start_loss == pytest.approx(start, rel=1e-6)
    assert res.pick == pytest.approx(pick_lr(lrs, losses, start), rel=1e-9)
    assert res.max_lr == pytest.approx(res.pick * math.sqrt(8), rel=1e-12)  # (N = 4: the floor, sqrt(8))
    assert res.lr_factor == pytest.approx(math.sqrt(8))
    assert model.training


class Counting(nn.Module):
    """The test model with a non-persistent buffer that training adds to (out of state_dict)."""

    def __init__(self):
        super().__init__()
        self.net = make_model()
        self.register_buffer("seen", torch.zeros(()), persistent=False)

    def forward(self, x):
        if self.training:
            self.seen += x.mean()
        return self.net(x)


def test_non_persistent_buffers_come_from_the_best_run_and_errors_leave_the_model_as_it_came():
    model = Counting()
    res = hdet.lr_sweep(model, make_opt, loss_fn, batches, guess=0.1, steps=STEPS, num_replicas=N, judge=held_out,
                        keep="winner")
    assert float(model.seen) == pytest.approx(sum(float(data(res.winner, i)[0].mean()) for i in range(STEPS)))
    model = Counting()
    hdet.lr_sweep(model, make_opt, loss_fn, batches, guess=0.1, steps=STEPS, num_replicas=N, judge=held_out)
    assert float(model.seen) == 0.0  # keep="start": back to the start, non-persistent buffers too
    calls = []

    def failing(m):
        calls.append(1)
        if len(calls) == 3:
            raise KeyError("judge failed")
        return held_out(m)
    model = Counting()
    start = [t.clone() for t in (*model.parameters(), *model.buffers())]
    with pytest.raises(KeyError):
        hdet.lr_sweep(model, make_opt, loss_fn, batches, guess=0.1, steps=STEPS, num_replicas=N, judge=failing)
    assert all(torch.equal(t, s) for t, s in zip((*model.parameters(), *model.buffers()), start))
    assert model.training


def test_per_group_peaks_and_optimizers_without_momentum():
    def two_groups(params, lr):
        params = list(params)
        return torch.optim.AdamW([{"params": params[:2], "lr": lr}, {"params": params[2:], "lr": lr / 10}])
    model = make_model()
    res = hdet.lr_sweep(model, two_groups, loss_fn, batches, guess=0.1, steps=STEPS, num_replicas=N, judge=held_out,
                        keep="winner")
    ref = make_model()  # the winner's run by hand: OneCycle to lr and lr / 10
    opt = two_groups(ref.parameters(), res.lrs[res.winner])
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[res.lrs[res.winner], res.lrs[res.winner] / 10],
                                                total_steps=STEPS, pct_start=0.3)
    for b in batches(res.winner):
        opt.zero_grad(set_to_none=True)
        loss_fn(ref, b).backward()
        opt.step()
        sched.step()
    for k, v in ref.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k
    res = hdet.lr_sweep(make_model(), lambda p, lr: torch.optim.Adagrad(p, lr=lr), loss_fn, batches, guess=0.1,
                        steps=STEPS, num_replicas=N, judge=held_out)  # no momentum to cycle: OneCycle's LR alone
    assert math.isfinite(res.max_lr)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        hdet.lr_sweep(make_model(), lambda p, lr: None, loss_fn, batches, guess=0.1, steps=STEPS, num_replicas=N)


def test_sync_batchnorm_is_refused():
    model = nn.SyncBatchNorm.convert_sync_batchnorm(make_model())
    with pytest.raises(TypeError, match="SyncBatchNorm"):
        hdet.lr_sweep(model, make_opt, loss_fn, batches, guess=0.1, steps=STEPS, num_replicas=N)


def test_lr_factor_moves_the_grid_and_the_peak():
    grids = []
    for factor in (1.5, 15.0):  # (a grid ratio, 10.08, apart: the lattice keeps them apart)
        res = hdet.lr_sweep(make_model(), make_opt, loss_fn, batches, guess=0.1, steps=STEPS, num_replicas=N,
                            judge=held_out, lr_factor=factor)
        grid = sweep_lrs(0.1 / factor, N, 32.0)  # the grid's N points, the runs beyond it (if any) beside them
        i = min(range(len(res.lrs)), key=lambda j: abs(res.lrs[j] - grid[0]))
        assert res.lrs[i:i + N] == pytest.approx(grid, rel=1e-12)
        assert res.max_lr == pytest.approx(res.pick * factor)
        grids.append(grid)
    assert grids[1] == pytest.approx([v / 10.079368399158986 for v in grids[0]], rel=1e-9)


def test_pick_is_the_benchmarks_confirmed_rule():
    """pick_lr is sweep_then_train.py's --pick fit7, the rule its fifth call ran on fresh seeds."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from sweep_then_train import pick_fit
    g = torch.Generator().manual_seed(0)
    lrs = sweep_lrs(1e-3, 8, 32.0)
    for _ in range(50):
        losses = (torch.rand(8, generator=g) + 0.3 * (torch.arange(8) - 3.5 * torch.rand(1, generator=g)) ** 2).tolist()
        if torch.rand(1, generator=g) < 0.3:
            losses[7] = math.inf
        assert pick_lr(lrs, losses) == pytest.approx(pick_fit(lrs, losses, 3), rel=1e-12)


@pytest.mark.parametrize("n", [2, 3, 4, 8, 16])
def test_the_grid_is_on_a_lattice_that_guesses_a_power_of_its_ratio_apart_share(n):
    ratio = 32.0 ** (2 / (n - 1))
    g = torch.Generator().manual_seed(n)
    for centre in (10 ** (-6 * torch.rand(20, generator=g, dtype=torch.float64))).tolist():
        lrs = sweep_lrs(centre, n, 32.0)
        assert [b / a for a, b in zip(lrs, lrs[1:])] == pytest.approx([ratio] * (n - 1), rel=1e-9)
        moved = lrs[0] / (centre / 32.0)  # from the grid around centre itself, at most sqrt(3)x (the lattice's
        assert 3 ** -0.5 - 1e-9 <= moved <= 3 ** 0.5 + 1e-9  # step, ratio ** (1 / m), is at most 3)
        for j in (1, 2, 5):  # a guess j ratios higher: the same points, j further on
            higher = sweep_lrs(centre * ratio ** j * (1 + 1e-9), n, 32.0)
            assert higher[:max(n - j, 0)] == pytest.approx(lrs[j:], rel=1e-9)
            assert higher[0] == pytest.approx(lrs[0] * ratio ** j, rel=1e-9)
    on = sweep_lrs(1.0, n, 32.0)  # a centre on the lattice: an even grid lies half a step off it, halves round up
    for j in range(-40, 40):  # (whatever the rounding of the logs)
        assert sweep_lrs(ratio ** j, n, 32.0)[0] == pytest.approx(on[0] * ratio ** j, rel=1e-9), j
    assert len(sweep_lrs(1.0, n, 1 + 1e-10)) == n  # a span within rounding of 1: no division by zero


def test_pick_finds_a_parabolas_vertex_and_stays_inside_the_points():
    lrs = sweep_lrs(1e-3, 8, 32.0)
    x = [math.log(v) for v in lrs]
    vertex = math.log(2.5e-3)
    assert pick_lr(lrs, [(v - vertex) ** 2 + 1 for v in x]) == pytest.approx(2.5e-3, rel=1e-9)
    falling = [-v for v in x]  # lowest at the high end: the vertex is clipped to the points used
    assert pick_lr(lrs, falling) == pytest.approx(lrs[-1])
    assert pick_lr(lrs, [math.inf] * 7 + [1.0]) == lrs[-1]  # one finite point: its LR
    with pytest.raises(RuntimeError, match="non-finite"):
        pick_lr(lrs, [math.inf] * 8)


def test_runs_that_blew_up_and_settled_near_the_start_are_out_of_the_fit():
    """The study's call 5, seed 3 from 10x (Fashion-MNIST, held-out losses; the untrained CNN's loss is ~ln 10): two
    runs that blew up ended at chance, finite; in the fit they moved the pick from 0.0087 to 0.0134."""
    lrs = [0.16 / math.sqrt(8) * 32.0 ** ((2 * r - 7) / 7) for r in range(8)]  # the study's grid (not on the lattice)
    losses = [0.364, 0.361, 0.363, 0.355, 0.394, 0.5, 2.308, 2.312]
    assert pick_lr(lrs, losses) == pytest.approx(0.0134, rel=0.01)  # the study's rule
    assert pick_lr(lrs, losses, start=math.log(10)) == pytest.approx(0.0087, rel=0.01)
    assert pick_lr(lrs, losses, start=math.log(10)) == pytest.approx(pick_lr(lrs[:6], losses[:6]), rel=1e-12)
    with pytest.raises(RuntimeError, match="No sweep run ended below the start's loss"):
        pick_lr(lrs, losses, start=0.3)


def test_a_diverged_run_is_judged_inf_and_the_edge_warns_without_runs_beyond_the_grid():
    """Far too high a guess: the high runs blow up (judged inf), the best is the lowest LR, which warns with
    extend=0; by default the sweep runs LRs below the grid (at N = 4 one a round) until the best has one on each
    side that the fit keeps (or the end below it barely trained)."""
    model = make_model()
    sgd = lambda p, lr: torch.optim.SGD(p, lr=lr)  # noqa: E731
    with pytest.warns(UserWarning, match="low end"):
        res = hdet.lr_sweep(model, sgd, loss_fn, batches, guess=5.0, steps=STEPS, num_replicas=N, judge=held_out,
                            extend=0)
    assert math.isinf(res.losses[-1]) and res.winner == 0 and res.at_edge and len(res.lrs) == N
    assert all(torch.isfinite(p).all() for p in model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message=".*cycle momentum")  # (plain SGD: the runs' momentum, said)
        more = hdet.lr_sweep(make_model(), sgd, loss_fn, batches, guess=5.0, steps=STEPS, num_replicas=N,
                             judge=held_out)
    assert more.lrs[-N:] == pytest.approx(res.lrs, rel=1e-12) and more.losses[-N:] == pytest.approx(res.losses)
    assert len(more.lrs) == N + 1 and more.lrs[0] == pytest.approx(res.lrs[0] / 10.079368399158986, rel=1e-9)
    assert more.winner == 1 and not more.at_edge and more.pick == more.lrs[1]  # (the one below: out of the fit)
    with pytest.raises(RuntimeError, match="far too high"):  # every run of the grid blew up
        hdet.lr_sweep(make_model(), sgd, loss_fn, batches, guess=30.0, steps=STEPS, num_replicas=N, judge=held_out,
                      extend=0)
    more = hdet.lr_sweep(make_model(), sgd, loss_fn, batches, guess=30.0, steps=STEPS, num_replicas=N, judge=held_out)
    assert len(more.lrs) == N + 2 and all(math.isinf(v) for v in more.losses[2:])  # two rounds below, the pick there
    assert more.losses[1] < more.start_loss and more.pick == more.lrs[1]
    with pytest.raises(ValueError, match="extend to be an int of at least 0"):
        hdet.lr_sweep(make_model(), sgd, loss_fn, batches, guess=10.0, steps=STEPS, num_replicas=N, extend=-1)


@pytest.mark.parametrize("judge", [True, False])
def test_a_guess_too_low_runs_above_the_grid_as_the_hand_written_sweep(judge):
    """The best run at the grid's high end: rounds above it (up to the grid's reach again), the winner one of them,
    its weights in the model (keep="winner"), as the sweep written out by hand."""
    model = make_model()
    guess = (1e-4 if judge else 1e-3) * math.sqrt(2)  # (the grid around guess / sqrt(8): 1e-4 / 2, 1e-3 / 2)
    res = hdet.lr_sweep(model, make_opt, loss_fn, batches, guess=guess, steps=STEPS, num_replicas=N,
                        judge=held_out if judge else None, keep="winner")
    lrs, losses, states, start = reference(guess, judge)
    grid = sweep_lrs(guess / math.sqrt(8), N, 32.0)
    assert res.lrs[:N] == pytest.approx(grid, rel=1e-12) and len(res.lrs) > N  # every run beyond it above it
    assert res.lrs == pytest.approx(lrs, rel=1e-12) and res.losses == pytest.approx(losses, rel=1e-6)
    assert res.winner >= N and res.start_loss == pytest.approx(start, rel=1e-6)
    for k, v in model.state_dict().items():
        assert torch.equal(v, states[res.winner][k]), k


def test_equal_losses_keep_the_lowest_lr_as_the_winner_and_its_weights():
    """A judge that reads equal losses (a quantised metric): the winner is the lowest LR among them, a run below the
    grid that ran after the grid's, and the model holds that run's weights."""
    sgd = lambda p, lr: torch.optim.SGD(p, lr=lr)  # noqa: E731

    def coarse(m):
        v = held_out(m).item()
        return 1.0 if v < 4.0 else v  # (every run that trained reads 1.0)
    model = make_model()
    res = hdet.lr_sweep(model, sgd, loss_fn, batches, guess=5.0, steps=STEPS, num_replicas=N, judge=coarse,
                        keep="winner")
    grid = sweep_lrs(5.0 / 2, N, 32.0)
    assert res.losses[res.winner] == 1.0 and res.lrs[res.winner] < grid[0]
    assert [v for v in res.losses if v == 1.0] == [1.0, 1.0]  # (the grid's lowest run too)
    _, _, ref = hand_run(res.lrs[res.winner], 0, sgd)  # the first run of its round: batches(0)
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref.state_dict()[k]), k


@pytest.mark.parametrize("how", ["diverged", "nan judge"])
def test_every_run_non_finite_raises_and_leaves_the_start_weights(how):
    model = make_model()
    start = copy.deepcopy(model.state_dict())
    opt = (lambda p, lr: torch.optim.SGD(p, lr=lr)) if how == "diverged" else make_opt
    with pytest.raises(RuntimeError, match="guess is far too high"):
        hdet.lr_sweep(model, opt, loss_fn, batches, guess=1e12 if how == "diverged" else 0.1, steps=STEPS,
                      num_replicas=N, judge=held_out if how == "diverged" else (lambda m: float("nan")))
    for k, v in model.state_dict().items():
        assert torch.equal(v, start[k]), k


@pytest.mark.parametrize("kwargs, match", [
    (dict(guess=0.0), "guess"), (dict(guess=float("inf")), "guess"), (dict(guess="1e-3"), "guess"),
    (dict(steps=0), "steps"), (dict(steps=2.5), "steps"), (dict(steps=9), "steps to be an int of at least 10"),
    (dict(steps=10, pct_start=0.1), "pct_start x steps \\(10\\) to be other than one step"),
    (dict(num_replicas=1), "num_replicas"),
    (dict(num_replicas=None), "num_replicas"), (dict(span=1.0), "span"), (dict(lr_factor=0), "lr_factor"),
    (dict(pct_start=1.0), "pct_start"),
    (dict(keep="best"), "keep to be one of 'start', 'winner'"),
])
def test_bad_arguments_say_what_was_expected(kwargs, match):
    args = {**dict(guess=0.1, steps=STEPS, num_replicas=N), **kwargs}
    with pytest.raises(ValueError, match=match):
        hdet.lr_sweep(make_model(), make_opt, loss_fn, batches, **args)


@pytest.mark.parametrize("keep", ["start", "winner"])
def test_gradients_and_submodules_modes_come_back_as_they_came(keep):
    """The runs leave no gradient behind (a stale one would add into the main run's first step if it zeroes its
    gradients after stepping), and a submodule the user put in eval mode (a frozen BatchNorm) is neither trained nor
    switched to train mode."""
    model = make_model()
    model.train()
    model[1].eval()  # frozen: its running statistics must not move
    held = torch.ones_like(model[0].weight)
    model[0].weight.grad = held  # a gradient the user holds; every other parameter has none
    frozen = {k: v.clone() for k, v in model[1].named_buffers()}  # (its affine weights train: eval mode is not
    # requires_grad=False)
    hdet.lr_sweep(model, make_opt, loss_fn, batches, guess=0.1, steps=STEPS, num_replicas=N, judge=held_out, keep=keep)
    assert model[0].weight.grad is held and torch.equal(held, torch.ones_like(held))
    assert all(p.grad is None for n, p in model.named_parameters() if n != "0.weight")
    assert model.training and not model[1].training and model[3].training
    for k, v in model[1].named_buffers():
        assert torch.equal(v, frozen[k]), k


@pytest.mark.parametrize("keep", ["start", "winner"])
def test_torchs_rng_ends_as_it_came(keep):
    """The runs' dropout draws from torch's RNG, and the sweep leaves it as it came: the main run after a sweep
    with keep="start" draws what the run without a sweep draws (the same run, as `hdet train --lr-sweep-then restart`
    promises), and ranks whose rounds ran different numbers of runs stay in step."""
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.3), nn.ReLU(), nn.Linear(16, 1))
    torch.manual_seed(5)
    before = torch.get_rng_state()
    hdet.lr_sweep(model, make_opt, loss_fn, batches, guess=0.1, steps=STEPS, num_replicas=N, keep=keep)
    assert torch.equal(torch.get_rng_state(), before)
    calls = []

    def failing(model, batch):  # the third step's loss fails, after two of dropout's draws
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("the user's loss failed")
        return loss_fn(model, batch)
    with pytest.raises(RuntimeError, match="the user's loss failed"):
        hdet.lr_sweep(model, make_opt, failing, batches, guess=0.1, steps=STEPS, num_replicas=N, keep=keep)
    assert torch.equal(torch.get_rng_state(), before)  # (an error too)


def test_a_model_in_eval_mode_sweeps_in_train_mode_and_ends_in_eval_mode():
    model = make_model().eval()
    start = model[1].running_mean.clone()
    hdet.lr_sweep(model, make_opt, loss_fn, batches, guess=0.1, steps=STEPS, num_replicas=N, judge=held_out,
                  keep="winner")
    assert not model.training and not any(m.training for m in model.modules())
    assert not torch.equal(model[1].running_mean, start)  # the winner's BatchNorm trained: its statistics moved


class FrozenNorm(nn.Sequential):
    """Fine-tuning's frozen BatchNorm: its train() keeps the norm in eval mode (as torch's QAT ConvBn with
    freeze_bn=True)."""

    def train(self, mode: bool = True):
        super().train(mode)
        self[1].eval()
        return self


def test_a_train_override_that_freezes_a_norm_is_kept_when_the_model_comes_in_eval_mode():
    model = make_model()
    model = FrozenNorm(*model).eval()
    start = {k: v.clone() for k, v in model[1].named_buffers()}
    hdet.lr_sweep(model, make_opt, loss_fn, batches, guess=0.1, steps=STEPS, num_replicas=N, judge=held_out,
                  keep="winner")
    for k, v in model[1].named_buffers():
        assert torch.equal(v, start[k]), k
    assert not any(m.training for m in model.modules())


def test_a_parameter_the_optimizer_leaves_out_keeps_its_gradients_values():
    """backward() adds into a .grad it finds: the sweep clears every parameter's first, not only the optimizer's."""
    model = make_model()
    held = torch.ones_like(model[3].weight)
    model[3].weight.grad = held

    def first_layers_only(params, lr):
        return make_opt(list(model[0].parameters()), lr)  # (model[3] is trained by nobody, but has requires_grad)
    hdet.lr_sweep(model, first_layers_only, loss_fn, batches, guess=0.1, steps=STEPS, num_replicas=N)
    assert model[3].weight.grad is held and torch.equal(held, torch.ones_like(held))


@pytest.mark.parametrize("judge", [True, False])
def test_more_points_than_replicas_run_in_rounds_as_the_hand_written_sweep(judge):
    """points=8 with 2 replicas: the grid of 8 LRs 2.69x apart (not 2 LRs 1024x apart), run 2 at a time, run r on
    batches(r % 2); the factor sqrt(8) (the floor: at N = 2 sqrt(8) beat the batch ratio's sqrt(2))."""
    model = make_model()
    res = hdet.lr_sweep(model, make_opt, loss_fn, batches, guess=0.1, steps=STEPS, num_replicas=2, points=8,
                        judge=held_out if judge else None, keep="winner")
    lrs, losses, states, start = reference(0.1, judge, n=8, replicas=2)
    assert res.lrs == pytest.approx(lrs, rel=1e-12) and res.losses == pytest.approx(losses, rel=1e-6)
    assert res.start_loss == pytest.approx(start, rel=1e-6) and res.lr_factor == pytest.approx(math.sqrt(8))
    assert len(res.lrs) >= 8 and res.lrs[1] / res.lrs[0] == pytest.approx(32.0 ** (2 / 7))
    for k, v in model.state_dict().items():
        assert torch.equal(v, states[res.winner][k]), k
    with pytest.raises(ValueError, match="points to be None"):
        hdet.lr_sweep(make_model(), make_opt, loss_fn, batches, guess=0.1, steps=STEPS, num_replicas=2, points=1)
    res = hdet.lr_sweep(make_model(), make_opt, loss_fn, batches, guess=0.1, steps=STEPS, num_replicas=2, points=5,
                        judge=held_out if judge else None)  # (a last round of one: the start's loss the first round's)
    lrs, losses, _, start = reference(0.1, judge, n=5, replicas=2)
    assert res.lrs == pytest.approx(lrs, rel=1e-12) and res.start_loss == pytest.approx(start, rel=1e-6)
    far = 1e-4 if judge else 30.0  # a guess far off: runs beyond the grid of 8 (three a side, up to its reach again)
    model = make_model()
    res = hdet.lr_sweep(model, make_opt, loss_fn, batches, guess=far, steps=STEPS, num_replicas=2, points=8,
                        judge=held_out if judge else None, keep="winner")
    lrs, losses, states, _ = reference(far, judge, n=8, replicas=2)
    assert len(res.lrs) > 8 and res.lrs == pytest.approx(lrs, rel=1e-12)
    assert res.losses == pytest.approx(losses, rel=1e-6)
    for k, v in model.state_dict().items():
        assert torch.equal(v, states[res.winner][k]), k


def test_batches_that_give_one_shot_iterators_fail_clearly_when_runs_go_beyond_the_grid():
    made = {r: batches(r) for r in range(N)}  # one generator per replica, used up by its first run
    model = make_model()
    start = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="a fresh iterable at each call: runs beyond the grid call it again"):
        hdet.lr_sweep(model, lambda p, lr: torch.optim.SGD(p, lr=lr), loss_fn, lambda r: made[r], guess=5.0,
                      steps=STEPS, num_replicas=N, judge=held_out)
    assert all(torch.equal(v, start[k]) for k, v in model.state_dict().items())


def test_too_few_batches_and_a_bad_judge_are_errors():
    with pytest.raises(ValueError, match="at least steps=12 batches"):
        hdet.lr_sweep(make_model(), make_opt, loss_fn, lambda r: [data(r, 0)] * 3, guess=0.1, steps=STEPS,
                      num_replicas=N)
    with pytest.raises(TypeError, match="one real number"):
        hdet.lr_sweep(make_model(), make_opt, loss_fn, batches, guess=0.1, steps=STEPS, num_replicas=N,
                      judge=lambda m: torch.zeros(2))
    with pytest.raises(TypeError, match="torch.nn.Module"):
        hdet.lr_sweep(lambda x: x, make_opt, loss_fn, batches, guess=0.1, steps=STEPS, num_replicas=N)


def _sweep_worker(rank, world, ddp, keep):
    import torch.distributed as dist
    model = make_model()
    wrapped = nn.parallel.DistributedDataParallel(model) if ddp else model  # (its constructor broadcasts rank 0's)
    with torch.no_grad():  # every rank's model apart: the sweep starts every rank from rank 0's weights
        for p in model.parameters():
            p.add_(rank)
    res = hdet.lr_sweep(wrapped, make_opt, loss_fn, batches, guess=0.1 * math.sqrt(8 / world), steps=STEPS,
                        judge=held_out, keep=keep)  # (the grid around 0.1 / sqrt(world), under the factor's floor)
    swept = {k: v.tolist() for k, v in model.state_dict().items()}
    flat = torch.cat([t.detach().reshape(-1).double() for t in model.state_dict().values()])
    out = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(out, flat)
    with pytest.raises(ValueError, match="process group's size"):
        hdet.lr_sweep(model, make_opt, loss_fn, batches, guess=0.1, steps=STEPS, num_replicas=world + 1)
    # the docs' recipe on: the main run at res.max_lr from the best run's weights, HDET over the DDP model
    main = nn.parallel.DistributedDataParallel(model)
    opt = make_opt(main.parameters(), res.max_lr)
    sched = hdet.OneCycleAutoLR(opt, max_lr=res.max_lr, total_steps=8, ensemble_lr_spread_ratio=0.2,
                                model_sync_interval=4, on_runaway="recover", model=main)
    lrs = []
    for i in range(8):
        loss = loss_fn(main, data(rank, 100 + i))
        opt.zero_grad()
        loss.backward()
        opt.step()
        lrs.append(opt.param_groups[0]["lr"])
        sched.step(loss)
    after = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    synced = [torch.empty_like(after) for _ in range(world)]
    dist.all_gather(synced, after)
    return {"main_lrs": lrs, "main_equal_after_last_sync": all(torch.equal(o, synced[0]) for o in synced),
            "main_finite": bool(torch.isfinite(after).all()),"max_lr": res.max_lr, "losses": res.losses, "winner": res.winner, "lrs": res.lrs,
            "state": swept,
            "same_on_every_rank": all(torch.equal(o, out[0]) for o in out)}


def _judge_worker(rank, world, own_data):
    import warnings

    def judge(model):  # (own_data: each rank's own held-out batch, which the docs rule out)
        x, y = data(99 + (rank if own_data else 0), 0, 64)
        return nn.functional.mse_loss(model(x), y)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        hdet.lr_sweep(make_model(), make_opt, loss_fn, batches, guess=0.1 * math.sqrt(8 / world), steps=STEPS,
                      judge=judge, points=4)
    return [str(w.message) for w in got if "judge gave" in str(w.message)]


def test_a_judge_that_reads_each_ranks_own_data_is_said():
    """Every rank judges rank 0's start weights: a judge giving them different losses reads different data on different
    ranks (each run then judged on its own rank's data), accepted silently before (an audit). Rank 0 says so."""
    said = check_ok(run_gloo(_judge_worker, 2, True))
    assert len(said[0]) == 1 and "must read the same held-out data on every rank" in said[0][0] and said[1] == []
    assert check_ok(run_gloo(_judge_worker, 2, False)) == [[], []]


def _failing_worker(rank, world, how="batches"):
    short = (lambda r: [data(r, 0)] * 3) if rank == 1 and how == "batches" else batches  # rank 1's batches end early
    model = make_model()
    with torch.no_grad():  # every rank's own weights (the sweep runs from rank 0's): a failure gives back its own
        for p in model.parameters():
            p.add_(rank)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    rounds = []

    def on_round(progress):  # rank 1's checkpoint write fails at round 2 (a full disk); rank 0 passes none
        rounds.append(progress["rounds"])
        if progress["rounds"] == 2:
            raise OSError("No space left on device")

    try:
        hdet.lr_sweep(model, make_opt, loss_fn, short, guess=0.1, steps=STEPS, judge=held_out,
                      on_round=on_round if how == "on_round" and rank == 1 else None)
    except Exception as e:  # noqa: BLE001
        return {"raised": type(e).__name__, "msg": str(e),
                "at_start": all(torch.equal(v, start[k]) for k, v in model.state_dict().items())}
    return {"raised": None}


@pytest.mark.distributed
def test_a_rank_that_fails_fails_every_rank_without_a_hang():
    res = check_ok(run_gloo(_failing_worker, 2))
    assert res[1]["raised"] == "ValueError" and "at least steps=12" in res[1]["msg"]
    assert res[0]["raised"] == "RuntimeError" and "rank(s) [1]" in res[0]["msg"]
    assert res[0]["at_start"] and res[1]["at_start"]


@pytest.mark.distributed
def test_an_on_round_that_raises_on_one_rank_raises_on_every_rank():
    """An on_round that raises on one rank alone (rank 0 passes none): every rank raises after that round, each model
    back at its own start; before, the other rank waited for it in the next round's collective (a hang)."""
    res = check_ok(run_gloo(_failing_worker, 2, "on_round"))
    assert res[1]["raised"] == "OSError" and "No space" in res[1]["msg"]
    assert res[0]["raised"] == "RuntimeError" and "on_round raised on rank(s) [1]" in res[0]["msg"]
    assert res[0]["at_start"] and res[1]["at_start"]


@pytest.mark.distributed
@pytest.mark.parametrize("world, ddp, keep", [(2, False, "winner"), (4, True, "winner"), (2, False, "start"),
                                              (4, True, "start")])
def test_every_rank_one_replica_then_the_best_ranks_weights(world, ddp, keep):
    """Under gloo, rank r runs the r-th LR on its own batches; every rank ends with the best rank's weights (or rank 0's
    start weights, where the ranks' own differed) and the one-process sweep's result."""
    res = check_ok(run_gloo(_sweep_worker, world, ddp, keep))
    one = make_model()
    with one_thread():  # as the workers: the same summation order (Adam turns rounding into a step's sign)
        ref = hdet.lr_sweep(one, make_opt, loss_fn, batches, guess=0.1 * math.sqrt(8 / world), steps=STEPS,
                            num_replicas=world, judge=held_out, keep=keep)
    if keep == "start":
        assert all(torch.equal(v, make_model().state_dict()[k]) for k, v in one.state_dict().items())
    for r in res:
        assert r["same_on_every_rank"]
        assert r["lrs"] == pytest.approx(ref.lrs, rel=1e-15)
        assert r["losses"] == pytest.approx(ref.losses, rel=1e-6)
        assert r["winner"] == ref.winner and r["max_lr"] == pytest.approx(ref.max_lr, rel=1e-9)
        for k, v in one.state_dict().items():
            assert torch.tensor(r["state"][k], dtype=v.dtype).equal(v), k
        assert r["main_equal_after_last_sync"] and r["main_finite"]
        assert max(r["main_lrs"]) <= ref.max_lr * 1.2 + 1e-12  # OneCycle to res.max_lr, times rho_r <= 1 + alpha
    rho = hdet.linear_multipliers(world, 0.2)
    peaks = [max(r["main_lrs"]) for r in res]
    assert peaks == pytest.approx([max(res[0]["main_lrs"]) / rho[0] * p for p in rho], rel=1e-9)


def _beyond_worker(rank, world, guess, points):
    import torch.distributed as dist
    model = make_model()
    with torch.no_grad():  # every rank's model apart: every run starts from rank 0's weights
        for p in model.parameters():
            p.add_(rank)
    res = hdet.lr_sweep(model, lambda p, lr: torch.optim.SGD(p, lr=lr), loss_fn, batches,
                        guess=guess * math.sqrt(8 / world), steps=STEPS,  # (the grid around guess / sqrt(world))
                        judge=held_out, keep="winner", points=points)
    flat = torch.cat([t.detach().reshape(-1).double() for t in model.state_dict().values()])
    out = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(out, flat)
    return {"lrs": res.lrs, "losses": res.losses, "winner": res.winner, "pick": res.pick,
            "state": {k: v.tolist() for k, v in model.state_dict().items()},
            "same_on_every_rank": all(torch.equal(o, out[0]) for o in out)}


@pytest.mark.distributed
@pytest.mark.parametrize("world, guess, points", [(4, 5.0, None), (4, 30.0, None), (2, 30.0, None), (2, 0.1, 8),
                                                 (2, 30.0, 8), (2, 0.1, 5)])
def test_runs_beyond_the_grid_under_ranks_are_the_one_process_sweeps(world, guess, points):
    """A guess too high: rounds of runs below the grid, rank r running a round's r-th; every rank ends with the best
    run's weights, whether a rank ran it in the grid and then another run beyond it (4, 5.0: the winner is rank 0's
    grid run), or beyond the grid (4, 30.0: every grid run blew up), or in a grid of more points than ranks (2, 0.1,
    8: in rounds; 2, 30.0, 8: and beyond it; 2, 0.1, 5: a last round with a rank idle), as the one-process sweep
    does."""
    res = check_ok(run_gloo(_beyond_worker, world, guess, points))
    sgd = lambda p, lr: torch.optim.SGD(p, lr=lr)  # noqa: E731
    one = make_model()
    with one_thread():  # as the workers: the same summation order
        guess = guess * math.sqrt(8 / world)  # (as the workers': the grid around the parameter / sqrt(world))
        ref = hdet.lr_sweep(one, sgd, loss_fn, batches, guess=guess, steps=STEPS, num_replicas=world, judge=held_out,
                            keep="winner", points=points)
        lrs, losses, states, _ = reference(guess, True, n=points or world, make=sgd, replicas=world)
    assert len(ref.lrs) > world and ref.lrs == pytest.approx(lrs, rel=1e-12)
    assert ref.losses == pytest.approx(losses, rel=1e-6)
    for k, v in one.state_dict().items():  # the winner's weights, as the hand-written sweep's
        assert torch.equal(v, states[ref.winner][k]), k
    for r in res:
        assert r["same_on_every_rank"]
        assert r["lrs"] == pytest.approx(ref.lrs, rel=1e-12) and r["losses"] == pytest.approx(ref.losses, rel=1e-6)
        assert r["winner"] == ref.winner and r["pick"] == pytest.approx(ref.pick, rel=1e-9)
        for k, v in one.state_dict().items():
            assert torch.tensor(r["state"][k], dtype=v.dtype).equal(v), k


def _mismatch_worker(rank, world, what="guess"):
    model = make_model()
    differ = {"guess": 0.1 * (1 + rank)} if what == "guess" else {"guess": 0.1, "lr_factor": None if rank else 1.0}
    try:
        hdet.lr_sweep(model, make_opt, loss_fn, batches, steps=STEPS, judge=held_out, **differ)
    except ValueError as e:
        return {"raised": str(e), "at_start": all(torch.equal(v, make_model().state_dict()[k])
                                                  for k, v in model.state_dict().items())}
    return {"raised": None}


@pytest.mark.distributed
@pytest.mark.parametrize("what", ["guess", "lr_factor"])
def test_ranks_that_sweep_different_grids_all_raise_instead_of_picking_apart(what):
    """A guess that differs by rank (read from a per-rank config, say) would give every rank its own grid and its own
    pick, silently; an lr_factor that differs (the same grid) every rank its own main-run peak: every rank raises
    after the first round's gather, its model back at its start weights."""
    res = check_ok(run_gloo(_mismatch_worker, 2, what))
    for r in res:
        assert r["raised"] and "Expected every rank to sweep the same grid" in r["raised"] and r["at_start"]


def _dropout_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))


def _saved(progress):
    """What a checkpoint of the progress holds: written and read back (weights_only)."""
    import io
    buf = io.BytesIO()
    torch.save(progress, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("keep", ["start", "winner"])
@pytest.mark.parametrize("stop_after", [1, 2, 3])
def test_a_stopped_sweep_goes_on_from_its_progress_as_the_uninterrupted_one(keep, stop_after):
    """on_round gives the progress after each round; a sweep given the progress of round k (read back from a file)
    runs only the rounds after it, and ends as the uninterrupted sweep, bit for bit: the same LRs, losses and pick,
    the same weights after it (keep="winner": the best run's, also when an earlier round ran it), and torch's RNG as
    it came (dropout: the resumed rounds draw as the uninterrupted ones did)."""
    kw = dict(guess=3.0 * math.sqrt(8 / 3), steps=STEPS, num_replicas=3, points=6, keep=keep)  # (around 3 / sqrt(3))  # 2 rounds of 3, then runs below the grid
    seen = []
    model = _dropout_model()
    torch.manual_seed(5)
    whole = hdet.lr_sweep(model, make_opt, loss_fn, batches, on_round=lambda p: seen.append(_saved(p)), **kw)
    after = torch.get_rng_state()
    assert len(seen) >= 3 and [p["rounds"] for p in seen] == list(range(1, len(seen) + 1))
    runs = []
    again = _dropout_model()
    torch.manual_seed(5)
    part = hdet.lr_sweep(again, lambda p, lr: runs.append(lr) or make_opt(p, lr), loss_fn, batches,
                         progress=seen[stop_after - 1], **kw)
    assert torch.equal(torch.get_rng_state(), after)
    assert (part.lrs, part.losses, part.pick, part.winner) == (whole.lrs, whole.losses, whole.pick, whole.winner)
    assert len(runs) == len(whole.lrs) - len(seen[stop_after - 1]["loss"])  # (the finished rounds are not run again)
    for a, b in zip(model.state_dict().values(), again.state_dict().values()):
        assert torch.equal(a, b)


def test_progress_of_another_sweep_is_refused_before_anything_runs():
    seen = []
    hdet.lr_sweep(make_model(), make_opt, loss_fn, batches, guess=0.1, steps=STEPS, num_replicas=N,
                  on_round=seen.append)
    model = make_model()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="Expected progress of this sweep"):
        hdet.lr_sweep(model, make_opt, loss_fn, batches, guess=0.1, steps=STEPS + 2, num_replicas=N,
                      progress=seen[0])
    with pytest.raises(ValueError, match="Expected progress as lr_sweep's on_round gives it"):
        hdet.lr_sweep(model, make_opt, loss_fn, batches, guess=0.1, steps=STEPS, num_replicas=N, progress={"rounds": 1})
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def _progress_worker(rank, world, mode):
    model = make_model()
    seen = []
    kw = dict(guess=0.1, steps=STEPS, points=8, judge=held_out, keep="winner")
    whole = hdet.lr_sweep(model, make_opt, loss_fn, batches, on_round=lambda p: seen.append(_saved(p)), **kw)
    again = make_model()
    progress = seen[1] if mode == "same" else (seen[1] if rank == 0 else None)
    if mode == "foreign":  # rank 0's progress of another sweep (more steps), rank 1's of this one
        progress = dict(seen[1], plan=[*seen[1]["plan"][:3], STEPS + 2, seen[1]["plan"][4]]) if rank == 0 else seen[1]
    try:
        part = hdet.lr_sweep(again, make_opt, loss_fn, batches, progress=progress, **kw)
    except ValueError as e:
        return {"raised": str(e)}
    return {"same": (part.lrs, part.losses, part.pick) == (whole.lrs, whole.losses, whole.pick)
            and all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values())),
            "rounds": [p["rounds"] for p in seen]}


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["same", "one_rank_only", "foreign"])
def test_ranks_go_on_from_their_progress_or_all_refuse_progress_that_differs(mode):
    """Under ranks (gloo, 2: 4 rounds of 2 at 8 points) every rank passes its own progress of round 2 and the sweep
    ends as the uninterrupted one on both; progress on one rank only, or one rank's of another sweep, is refused on
    every rank before anything runs (a review: the other rank waited in the next round's broadcast)."""
    res = check_ok(run_gloo(_progress_worker, 2, mode))
    for rank, r in enumerate(res):
        if mode == "same":
            assert r["same"] and r["rounds"][:4] == [1, 2, 3, 4]
        elif mode == "one_rank_only":
            assert "Expected every rank to pass its progress of the same round, or none" in r["raised"]
        else:
            assert ("Expected progress of this sweep" if rank == 0 else
                    "Expected every rank's progress to be of this sweep, but rank(s) [0]'s are not") in r["raised"]


def test_the_pick_is_plain_python_so_every_rank_and_process_gets_the_same_bits(monkeypatch):
    """LAPACK's least squares can move in the last bits with its buffers' alignment (ranks' peaks then differed, and a
    resumed sweep picked another LR than the run never stopped): the fit uses no LAPACK, and is exact on a parabola."""
    def no_lapack(*a, **k):
        raise AssertionError("pick_lr called LAPACK")
    monkeypatch.setattr(torch.linalg, "lstsq", no_lapack)
    lrs = sweep_lrs(1e-3, 8, 32.0)
    x = [math.log(v) for v in lrs]
    vertex = math.log(2.5e-3)
    losses = [0.7 * (v - vertex) ** 2 + 1.3 for v in x]
    picks = {pick_lr(list(lrs), list(losses)) for _ in range(5)}
    assert len(picks) == 1 and picks.pop() == pytest.approx(2.5e-3, rel=1e-12)


def test_the_default_factor_is_the_batch_rule_from_8_replicas_and_sqrt_8_below():
    """sqrt(max(N, 8)): at N = 2 and 8 a sweep's short runs picked about half the grid's best (measured), so below 8
    the batch ratio's sqrt(N) alone left the run too low; from 8 up the batch rule as measured at N = 8."""
    from hdet.sweep import default_factor
    assert [default_factor(n) for n in (1, 2, 4, 8, 16)] == [math.sqrt(8)] * 4 + [4.0]
    res = hdet.lr_sweep(make_model(), make_opt, loss_fn, batches, guess=0.1, steps=STEPS, num_replicas=16, points=4)
    assert res.lr_factor == 4.0 and res.max_lr == pytest.approx(res.pick * 4.0, rel=1e-12)



class _RunningNorm(nn.Module):
    """Running statistics updated by reassignment (``self.mean = 0.9 * self.mean + ...``), as EMA code often is."""

    def __init__(self, d):
        super().__init__()
        self.register_buffer("mean", torch.zeros(d))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        if self.training:
            self.mean = 0.9 * self.mean + 0.1 * x.mean(0).detach()
            self.count = self.count + 1
        return x - self.mean


def test_a_buffer_a_forward_reassigns_starts_each_run_afresh_and_comes_back():
    """The sweep kept the buffers' tensor objects and restored into them, so a buffer a forward reassigns carried from
    run to run (the judge saw counts 0, 12, 24, 36, 48, an audit) and the model kept the last run's: each run starts
    from the start's value now, and the model ends with it (keep="start") or the best run's (keep="winner")."""
    def make():
        torch.manual_seed(0)
        return nn.Sequential(_RunningNorm(4), nn.Linear(4, 1))

    def data(r):
        g = torch.Generator().manual_seed(r)
        for _ in range(STEPS):
            x = torch.randn(16, 4, generator=g) + 3.0
            yield x, x.sum(1, keepdim=True)

    fn = lambda m, b: nn.functional.mse_loss(m(b[0]), b[1])  # noqa: E731
    for keep in ("start", "winner"):
        m, seen = make(), []
        res = hdet.lr_sweep(m, lambda p, lr: torch.optim.SGD(p, lr=lr), fn, data, guess=1e-2, steps=STEPS,
                            num_replicas=4, keep=keep, extend=0,
                            judge=lambda mod: seen.append(int(mod[0].count)) or fn(mod, next(iter(data(99)))))
        assert seen == [0] + [STEPS] * 4
        if keep == "start":
            assert int(m[0].count) == 0 and torch.equal(m[0].mean, torch.zeros(4))
        else:  # the best run's statistics (one run's count, not the sum of the runs')
            assert int(m[0].count) == STEPS and not torch.equal(m[0].mean, torch.zeros(4)) and res.winner >= 0


def _compiled_ddp_worker(rank, world, how):
    torch.manual_seed(0)
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    wrapped = torch.compile(ddp, backend="eager") if how == "compiled" else ddp
    res = hdet.lr_sweep(wrapped, make_opt, loss_fn, batches, guess=0.1, steps=STEPS, judge=held_out, points=4,
                        extend=0, keep="winner")
    return {"losses": res.losses, "state": {k: v.tolist() for k, v in model.state_dict().items()}}


@pytest.mark.distributed
def test_a_compiled_ddp_model_is_swept_as_independent_runs():
    """torch.compile(DDP(model)) (the order torch's docs show) was swept through DDP: every step all-reduced, so the
    ranks' runs shared their gradients (other losses than DDP(model)'s, an audit) and a round with an idle rank hung
    until the timeout. It is unwrapped as DDP is: the same losses and winner as DDP(model)."""
    plain = check_ok(run_gloo(_compiled_ddp_worker, 2, "ddp"))
    compiled = check_ok(run_gloo(_compiled_ddp_worker, 2, "compiled"))
    for a, b in zip(plain, compiled):
        assert a["losses"] == b["losses"] and a["state"] == b["state"]


def test_an_optimizer_that_steps_parameters_outside_the_model_is_refused():
    """make_optimizer adding a parameter the model does not hold (a loss's learnable temperature): the sweep restores
    the model alone, so that parameter carried from run to run (0, -0.005, -0.054, ... an audit) and was left at the
    last run's value; refused with the reason, before any step, the model as it came."""
    model = make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    temperature = nn.Parameter(torch.zeros(()))
    with pytest.raises(ValueError, match="step only the model's parameters, but it steps 1 other"):
        hdet.lr_sweep(model, lambda ps, lr: make_opt([*ps, temperature], lr), loss_fn, batches, guess=0.1,
                      steps=STEPS, num_replicas=2)
    assert float(temperature) == 0.0 and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_an_optimizer_that_ignores_the_sweeps_lr_is_refused():
    """make_optimizer that drops its ``lr`` (every run at its own default): the runs differed only by their
    batches' noise and the sweep picked 3.5e-7 for an AdamW at 1e-3 (an audit); refused after two runs with what it
    gave, the model as it came. Groups at fixed fractions of ``lr``, a group at a fixed LR beside a swept one, and LRs
    the user rounds are fine (a review: the first check refused the last two)."""
    model = make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"set its param groups' learning rates from lr, but they summed to 0\.001 "
                                         r"in the runs at lr [\d.e-]+, [\d.e-]+ alike:"):
        hdet.lr_sweep(model, lambda ps, lr: torch.optim.AdamW(ps), loss_fn, batches, guess=0.1, steps=STEPS,
                      num_replicas=N, judge=held_out)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())

    def tenths(ps, lr):  # no group at lr itself
        ps = list(ps)
        return torch.optim.AdamW([{"params": ps[:2], "lr": lr / 10}, {"params": ps[2:], "lr": lr / 2}])

    def fixed_head(ps, lr):  # the last layer at a fixed LR
        ps = list(ps)
        return torch.optim.AdamW([{"params": ps[:2], "lr": lr}, {"params": ps[2:], "lr": 1e-3}])
    for make in (tenths, fixed_head, lambda ps, lr: torch.optim.AdamW(ps, lr=float(f"{lr:.2g}"))):
        assert math.isfinite(hdet.lr_sweep(make_model(), make, loss_fn, batches, guess=0.1, steps=STEPS,
                                           num_replicas=N, judge=held_out).max_lr)


def test_momentum_the_runs_add_to_an_optimizer_without_it_is_said():
    """OneCycle's momentum cycle, as torch's OneCycleLR gives it to a main run, trains ``SGD(momentum=0)`` with
    momentum 0.85-0.95 (picks several times apart from the runs without): a warning says so, once a sweep; also for
    Adam's beta1 at 0; none for ``cycle_momentum=False``, an SGD with momentum or an Adam."""
    def sgd(momentum):
        return lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=momentum)
    cases = [(sgd(0.0), 0.1, "SGD with momentum=0"),
             (lambda ps, lr: torch.optim.Adam(ps, lr=lr, betas=(0.0, 0.999)), 0.01, "Adam with beta1=0")]
    for make, guess, what in cases:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            hdet.lr_sweep(make_model(), make, loss_fn, batches, guess=guess, steps=STEPS, num_replicas=N,
                          judge=held_out)
        said = [str(w.message) for w in seen if "cycle momentum" in str(w.message)]
        assert len(said) == 1 and f"0.85-0.95 into an optimizer whose momentum is 0 ({what})" in said[0], said
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*cycle momentum")
        hdet.lr_sweep(make_model(), sgd(0.0), loss_fn, batches, guess=0.1, steps=STEPS, num_replicas=N, judge=held_out,
                      cycle_momentum=False)
        hdet.lr_sweep(make_model(), sgd(0.9), loss_fn, batches, guess=0.01, steps=STEPS, num_replicas=N, judge=held_out)
        hdet.lr_sweep(make_model(), make_opt, loss_fn, batches, guess=0.1, steps=STEPS, num_replicas=N, judge=held_out)


def test_a_resumed_sweep_still_refuses_an_optimizer_that_ignores_its_lr():
    """The runs' LRs are part of the progress: a sweep resumed with a make_optimizer that drops ``lr`` is refused at
    its second run (a review: the first run after the resume was taken as the reference)."""
    kw = dict(guess=0.1, steps=STEPS, num_replicas=4, points=6, judge=held_out, extend=0)
    seen = []
    hdet.lr_sweep(make_model(), make_opt, loss_fn, batches, on_round=lambda p: seen.append(_saved(p)), **kw)
    assert len(seen) == 2
    with pytest.raises(ValueError, match="learning rates from lr, but they summed to 0.001 in the runs at"):
        hdet.lr_sweep(make_model(), lambda ps, lr: make_opt(ps, 1e-3), loss_fn, batches, progress=seen[0], **kw)


def _zero_worker(rank, world):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    model = make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        hdet.lr_sweep(nn.parallel.DistributedDataParallel(model),
                      lambda ps, lr: ZeroRedundancyOptimizer(ps, torch.optim.AdamW, lr=lr), loss_fn, batches,
                      guess=0.1, steps=STEPS, points=3)
    except TypeError as e:
        return {"msg": str(e), "at_start": all(torch.equal(v, before[k]) for k, v in model.state_dict().items())}
    return {"msg": None}


@pytest.mark.distributed
def test_a_zero_redundancy_optimizer_is_refused_on_every_rank():
    """A ZeroRedundancyOptimizer from make_optimizer broadcasts each rank's shard after its step: the ranks' runs
    mixed (the best moved 7x, an audit) and the round with an idle rank hung. Refused, every rank back at its start."""
    for r in check_ok(run_gloo(_zero_worker, 2)):
        assert r["msg"] and "ZeroRedundancyOptimizer" in r["msg"] and r["at_start"], r


def _ignored_lr_worker(rank, world):
    model = make_model()
    try:
        hdet.lr_sweep(model, lambda ps, lr: torch.optim.AdamW(ps), loss_fn, batches, guess=0.1, steps=STEPS, points=2,
                      extend=0)
    except ValueError as e:
        return {"msg": str(e)}
    return {"msg": None}


@pytest.mark.distributed
def test_an_optimizer_that_ignores_the_sweeps_lr_is_refused_on_every_rank_after_one_round():
    for r in check_ok(run_gloo(_ignored_lr_worker, 2)):
        assert r["msg"] and "learning rates from lr" in r["msg"], r
