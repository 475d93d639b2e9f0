"""The "skip" gradient guard on its own (one process): hdet.guard.SkipNonFiniteStep."""

import warnings

import pytest
import torch

from hdet.guard import SkipNonFiniteStep, resolve_guard


def _setup(fused=True):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5))
    q = torch.nn.Parameter(torch.randn(3, 2))
    return p, q, torch.optim.AdamW([{"params": [p]}, {"params": [q], "lr": 0.1}], lr=0.01, fused=fused)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_gradient_skips_the_step_and_a_finite_one_does_not(bad):
    p, q, opt = _setup()
    guard = SkipNonFiniteStep(opt)
    p.grad, q.grad = torch.ones(5), torch.ones(3, 2)
    opt.step()
    after1 = [p.detach().clone(), q.detach().clone()]
    state1 = {k: v.clone() for k, v in opt.state[q].items()}
    q.grad = torch.ones(3, 2)
    q.grad[1, 0] = bad
    opt.step()  # skipped: nothing moves, Adam's step count stays
    assert torch.equal(p, after1[0]) and torch.equal(q, after1[1])
    assert all(torch.equal(v, state1[k]) for k, v in opt.state[q].items())
    assert not hasattr(opt, "found_inf")  # the post-hook removed what the pre-hook set
    q.grad = torch.ones(3, 2)
    opt.step()
    assert not torch.equal(q, after1[1]) and float(opt.state[q]["step"]) == 2.0
    assert float(guard.skipped) == 1.0


@pytest.mark.parametrize("closure", [False, True])
def test_a_compiled_step_is_guarded_as_an_eager_one(closure):
    """torch.compile(opt.step) over a fused optimizer (torch's recipe for a fast step): dynamo traced the pre-hook's
    found_inf into a graph that did not hand it to the step, so a NaN gradient was stepped, and the post-hook raised
    AttributeError at the first step (an audit of session 46). With a closure (``step(closure)``, Lightning's way,
    compiled) the guard's check after it was traced the same way (session 46's review, B1). The hooks and that check
    run eagerly around the compiled step now: the NaN step is skipped and the weights are the eager run's, bit for
    bit."""
    runs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        p, q, opt = _setup()
        guard = SkipNonFiniteStep(opt)
        step = torch.compile(opt.step, backend="eager") if compiled else opt.step
        for t in range(4):
            def backward(t=t):
                opt.zero_grad()
                loss = (p * (0.5 + t)).sum() + q.sum() * (float("nan") if t == 2 else 1.0)
                loss.backward()
                return loss
            if closure:
                step(backward)
            else:
                backward()
                step()
            assert not hasattr(opt, "found_inf")
        assert float(guard.skipped) == 1.0 and float(opt.state[q]["step"]) == 3.0
        runs.append([p.detach().clone(), q.detach().clone()])
    assert all(torch.isfinite(w).all() for w in runs[1])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("how", ["keyword", "positional"])
def test_a_closure_that_makes_a_nan_gradient_inside_the_step_is_caught(how):
    """optimizer.step(closure) (Lightning's way): the backward runs inside the step, after the pre-hook. The verdict
    is taken on the closure's gradients (this step's NaN is skipped, the finite step before and after are taken), not
    on the gradients left from the step before; the closure's loss is returned."""
    p, q, opt = _setup()
    guard = SkipNonFiniteStep(opt)

    def closure_with(bad):
        def closure():
            opt.zero_grad()
            loss = (p.sum() + q.sum()) * (bad if bad is not None else 1.0)
            loss.backward()
            return loss
        return closure

    def step(bad=None):
        c = closure_with(bad)
        return opt.step(closure=c) if how == "keyword" else opt.step(c)

    assert float(step()) == pytest.approx(float(p.sum() + q.sum()), abs=1.0)  # (the loss before the update)
    before = [p.detach().clone(), q.detach().clone()]
    assert torch.isnan(step(float("nan")))  # this step's gradients are NaN: skipped
    assert torch.equal(p, before[0]) and torch.equal(q, before[1]) and float(guard.skipped) == 1.0
    step()  # finite again (the NaN gradients of the step before are not judged): taken
    assert not torch.equal(p, before[0]) and torch.isfinite(p).all() and float(guard.skipped) == 1.0
    assert float(opt.state[p]["step"]) == 2.0 and guard.checked == 3


def test_a_grad_scalers_verdict_taken_before_a_positional_closure_is_not_trusted():
    """Accelerate calls scaler.step(optimizer, closure) (torch's GradScaler refuses only a keyword closure): the scaler
    checks the gradients before the closure runs the backward. The guard judges the closure's own gradients (here NaN)
    instead of taking the scaler's stale verdict: the step is skipped."""
    p, q, opt = _setup()
    guard = SkipNonFiniteStep(opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)

    def closure_with(bad):
        def closure():
            opt.zero_grad()
            loss = (p.sum() + q.sum()) * bad
            scaler.scale(loss).backward()
            return loss
        return closure

    closure_with(1.0)()  # finite gradients for the scaler's first check
    scaler.step(opt, closure_with(1.0))
    scaler.update()
    before = [p.detach().clone(), q.detach().clone()]
    scaler.step(opt, closure_with(float("nan")))  # the scaler checked the finite gradients of before
    assert torch.equal(p, before[0]) and torch.equal(q, before[1]) and float(guard.skipped) == 1.0


def test_huge_finite_gradients_and_other_dtypes_are_checked_elementwise():
    """Only NaN/Inf count (a finite 1e30 steps; the gradient is not rescaled), in every dtype group."""
    p, q, opt = _setup()
    r = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    opt.add_param_group({"params": [r], "fused": True})
    guard = SkipNonFiniteStep(opt)
    p.grad, q.grad, r.grad = torch.full((5,), 1e30), torch.zeros(3, 2), torch.zeros(2, dtype=torch.float64)
    before = p.detach().clone()
    opt.step()
    assert not torch.equal(p, before) and float(guard.skipped) == 0.0 and (p.grad == 1e30).all()
    r.grad = torch.tensor([0.0, float("nan")], dtype=torch.float64)
    before = [t.detach().clone() for t in (p, q, r)]
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, (p, q))) and float(guard.skipped) == 1.0


def test_a_found_inf_set_by_someone_else_is_combined_and_restored():
    """torch.amp.GradScaler hands its own found_inf to fused optimizers: the guard must keep it (max of
    both) and leave it in place afterwards."""
    p, q, opt = _setup()
    SkipNonFiniteStep(opt)
    theirs = torch.ones(())  # "their" inf: skip although our gradients are finite
    opt.found_inf = theirs
    p.grad, q.grad = torch.ones(5), torch.ones(3, 2)
    before = p.detach().clone()
    opt.step()
    assert torch.equal(p, before) and opt.found_inf is theirs


def test_guard_arguments_are_checked():
    p, q, opt = _setup(fused=False)
    with pytest.raises(ValueError, match=r"fused=True in every param group.*got AdamW with fused=\[False, False\]"):
        SkipNonFiniteStep(opt)
    assert resolve_guard(True, opt) == "hook" and resolve_guard("auto", opt) == "hook"
    assert resolve_guard(False, opt) is None and resolve_guard("skip", opt) == "skip"
    assert resolve_guard("skip-all", opt) == "skip-all" and resolve_guard("skip-all", opt, mesh=True) == "skip-all"
    assert resolve_guard("auto", _setup(fused=True)[2]) == "skip-all"
    assert resolve_guard("auto", _setup(fused=True)[2], recovering=True) == "skip"
    with pytest.raises(ValueError, match=r"guard_gradients in \('auto', 'hook', 'skip', 'skip-all'\).*got 'always'"):
        resolve_guard("always", opt)


def test_auto_on_a_device_with_a_non_fused_optimizer_says_what_the_hook_costs():
    """Off the CPU (here the meta device stands in for a GPU), "auto" falling back to the slow hook warns
    once with the remedy; an explicit choice is silent."""
    import warnings

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3, device="meta"))], lr=0.1, foreach=False)
    with pytest.warns(UserWarning, match=r"not fused.*'hook'.*fused=True"):
        assert resolve_guard("auto", opt) == "hook"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_guard("hook", opt) == "hook" and resolve_guard("auto", _setup()[2]) == "skip-all"
        assert resolve_guard("auto", _setup(fused=False)[2]) == "hook"  # on the CPU: no warning
        assert resolve_guard("auto", opt, advise=False) == "hook"  # no DDP model: nothing is installed


def test_the_guard_reaches_the_real_optimizer_under_accelerate():
    """Accelerate's AcceleratedOptimizer keeps the real optimizer as .optimizer and has no step hooks of its
    own: "auto" sees the fused optimizer inside and the skip happens there."""
    accelerate = pytest.importorskip("accelerate")
    p, q, opt = _setup()
    wrapped = accelerate.Accelerator(cpu=True).prepare(opt)
    assert resolve_guard("auto", wrapped) == "skip-all"
    guard = SkipNonFiniteStep(wrapped)
    p.grad, q.grad = torch.ones(5), torch.full((3, 2), float("nan"))
    before = p.detach().clone()
    wrapped.step()
    assert torch.equal(p, before) and float(guard.skipped) == 1.0


def test_a_step_that_raises_does_not_leave_a_stale_flag():
    """optimizer.step() raising after the pre-hook (no post-hook): the flag it left must not be taken for
    someone else's found_inf at the next step, or every later step would be skipped."""
    p, q, opt = _setup()
    guard = SkipNonFiniteStep(opt)

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    handle = opt.register_step_pre_hook(boom)  # runs after the guard's pre-hook
    p.grad, q.grad = torch.ones(5), torch.full((3, 2), float("nan"))
    with pytest.raises(RuntimeError, match="boom"):
        opt.step()
    handle.remove()
    q.grad = torch.ones(3, 2)
    before = p.detach().clone()
    opt.step()  # finite gradients: this step happens
    assert not torch.equal(p, before) and not hasattr(opt, "found_inf")
    assert float(guard.skipped) == 1.0  # the aborted step's check counted; the real step did not skip


def test_sharded_replicas_have_only_the_skip_guard():
    """With device_mesh (FSDP2/HSDP) there is no DDP hook: "hook" is refused, "auto" with a non-fused
    optimizer installs nothing and says so, "auto" with a fused one gives "skip-all"."""
    import warnings

    opt = _setup(fused=False)[2]
    with pytest.raises(ValueError, match=r"'skip', 'skip-all', 'auto' or False with device_mesh.*got 'hook'"):
        resolve_guard("hook", opt, mesh=True)
    with pytest.warns(UserWarning, match=r"no gradient guard for these sharded replicas.*fused=True"):
        assert resolve_guard("auto", opt, mesh=True) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_guard("auto", _setup()[2], mesh=True) == "skip-all"
        assert resolve_guard(False, opt, mesh=True) is None


def test_sharded_replicas_get_advice_that_applies_to_them():
    """An audit of FSDP2/HSDP (2026-11-28): "skip" with a non-fused optimizer advised guard_gradients='hook', which
    sharded replicas refuse; the fit controller without a probe asked for a probe first, and only then said that it
    did not support sharded replicas at all (it does since 2026-11-30: the probe is what it asks for)."""
    import hdet

    opt = _setup(fused=False)[2]
    with pytest.raises(ValueError, match=r"pass fused=True, or guard_gradients=False \(sharded replicas have no 'hook'"):
        SkipNonFiniteStep(opt, agree_over=[object()])
    with pytest.raises(ValueError, match="use guard_gradients='hook'"):
        SkipNonFiniteStep(opt)
    with pytest.raises(ValueError, match=r"Expected probe=.* for the auto-LR controller 'fit'"):  # (sharded replicas
        hdet.OneCycleAutoLR(opt, max_lr=0.1, total_steps=10, enable_auto_lr=True, device_mesh=object())  # take it now)


def test_a_handed_over_norm_decides_the_step_and_the_guard_makes_no_pass(monkeypatch):
    """use_norm: the clip's total norm decides (finite: the step runs; non-finite: skipped) and the guard's
    own pass over the gradients does not run; the norm counts for one step only."""
    import hdet.guard

    passes = []
    own = hdet.guard._nonfinite
    monkeypatch.setattr(hdet.guard, "_nonfinite", lambda grads, out: passes.append(len(grads)) or own(grads, out))
    p, q, opt = _setup()
    guard = SkipNonFiniteStep(opt)
    p.grad, q.grad = torch.ones(5), torch.ones(3, 2)
    norm = torch.nn.utils.clip_grad_norm_([p, q], 1e6)
    guard.use_norm(norm, [p.grad, q.grad])
    before = q.detach().clone()
    opt.step()
    assert not torch.equal(q, before) and passes == [] and float(guard.skipped) == 0.0
    p.grad, q.grad = torch.ones(5), torch.ones(3, 2)
    guard.use_norm(torch.tensor(float("nan")), [p.grad, q.grad])  # a NaN norm: skipped, no pass either
    before = q.detach().clone()
    opt.step()
    assert torch.equal(q, before) and passes == [] and float(guard.skipped) == 1.0
    opt.step()  # nothing handed over: the guard's own pass
    assert passes == [2] and not torch.equal(q, before)


@pytest.mark.parametrize("change", ["another backward", "new gradient tensor", "one more gradient"])
def test_a_norm_of_other_gradients_than_the_step_applies_is_not_used(change, monkeypatch):
    """A norm taken, then the gradients changed (accumulated into in place, replaced, or one more param got
    a gradient): the guard checks for itself, and a NaN that came after the norm still skips the step."""
    p, q, opt = _setup()
    guard = SkipNonFiniteStep(opt)
    p.grad = torch.ones(5)
    q.grad = None if change == "one more gradient" else torch.ones(3, 2)
    grads = [g for g in (p.grad, q.grad) if g is not None]
    guard.use_norm(torch.nn.utils.clip_grad_norm_([p, q], 1e6), grads)  # finite
    bad = torch.ones(3, 2)
    bad[0, 0] = float("nan")
    if change == "another backward":
        q.grad.add_(bad)  # what autograd's accumulation does: in place
    else:
        q.grad = bad
    before = [p.detach().clone(), q.detach().clone()]
    opt.step()
    assert torch.equal(p, before[0]) and torch.equal(q, before[1]) and float(guard.skipped) == 1.0


def test_scheduler_clip_grad_norm_clips_every_gradient_the_optimizer_steps():
    """HDETLR.clip_grad_norm_ is torch's clip over the optimizer's parameters (every group), returning the
    total norm; in one process there is no guard to hand it to."""
    import hdet

    p, q, opt = _setup()
    s = hdet.OneCycleAutoLR(opt, max_lr=0.01, total_steps=10)
    p.grad, q.grad = torch.full((5,), 3.0), torch.full((3, 2), 4.0)
    want = torch.cat([p.grad, q.grad.flatten()]).norm()
    norm = s.clip_grad_norm_(1.0)
    assert torch.allclose(norm, want)
    assert torch.allclose(torch.cat([p.grad, q.grad.flatten()]).norm(), torch.tensor(1.0), atol=1e-5)
    assert s.skip_guard is None


def _count_reads(monkeypatch):
    """Count the guard's own passes over the gradients."""
    import hdet.guard as guard_mod

    calls = []
    real = guard_mod._nonfinite
    monkeypatch.setattr(guard_mod, "_nonfinite", lambda grads, out: calls.append(len(grads)) or real(grads, out))
    return calls


@pytest.mark.parametrize("unscale_first", [False, True])
def test_under_a_grad_scaler_the_guard_takes_its_verdict_and_reads_nothing(monkeypatch, unscale_first):
    """torch.amp.GradScaler.step has checked every gradient (its own check, or unscale_ before a clip) and hands
    the verdict over as found_inf: the guard skips the same steps, counts them, and makes no pass of its own;
    without the scaler it reads the gradients once a step."""
    calls = _count_reads(monkeypatch)
    p, q, opt = _setup()
    guard = SkipNonFiniteStep(opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    for bad in (None, float("nan"), None, float("inf")):
        opt.zero_grad()
        scaler.scale(p.sum() + q.sum()).backward()
        if bad is not None:
            q.grad[0, 1] = bad
        if unscale_first:
            scaler.unscale_(opt)  # a user who clips
        before = [p.detach().clone(), q.detach().clone()]
        scaler.step(opt)
        scaler.update()
        moved = not torch.equal(p, before[0])
        assert moved == (bad is None) and torch.equal(q, before[1]) != moved
        assert not hasattr(opt, "found_inf") and not hasattr(opt, "grad_scale")
    # after an explicit unscale_ (a clipping user) the scaler's verdict is from that call: the guard reads itself
    assert calls == ([2] * 4 if unscale_first else []) and float(guard.skipped) == 2.0
    p.grad, q.grad = torch.ones(5), torch.full((3, 2), float("nan"))
    calls.clear()
    opt.step()  # no scaler this time: the guard's own read decides
    assert calls == [2] and float(guard.skipped) == 3.0


def test_a_gradient_turned_nan_after_the_scalers_unscale_is_still_caught():
    """The scaler's found_inf after unscale_ is from that call: a gradient made non-finite between unscale_ and
    step() stepped the weights into NaN when the guard took that verdict."""
    p, q, opt = _setup()
    guard = SkipNonFiniteStep(opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(p.sum() + q.sum()).backward()
    scaler.unscale_(opt)
    q.grad[0, 0] = float("nan")
    before = q.detach().clone()
    scaler.step(opt)
    assert torch.equal(q, before) and torch.isfinite(q).all() and float(guard.skipped) == 1.0


def test_someone_elses_found_inf_without_a_grad_scale_is_not_taken_for_a_full_check(monkeypatch):
    """Only GradScaler's hand-over (found_inf with grad_scale) replaces the guard's read: a found_inf of 0 set by
    another party does not hide a NaN gradient."""
    calls = _count_reads(monkeypatch)
    p, q, opt = _setup()
    guard = SkipNonFiniteStep(opt)
    opt.found_inf = torch.zeros(())
    p.grad, q.grad = torch.ones(5), torch.full((3, 2), float("nan"))
    before = p.detach().clone()
    opt.step()
    assert torch.equal(p, before) and calls == [2] and float(guard.skipped) == 1.0


def test_the_sentinel_read_takes_biases_norm_weights_and_each_matrix_first_row(monkeypatch):
    """reads="sentinels" (the "skip" guard's): the own pass reads the gradients of parameters with at most one
    dimension, where any NaN of a loss or an activation lands, and the first row of every other parameter's; a NaN
    born in one element of a matrix's gradient off that row is what it misses (documented), "all" sees it; with no
    parameter of at most one dimension (no bias or norm weight to carry a NaN of the loss), every gradient is read."""
    import hdet.guard

    passes = []
    own = hdet.guard._nonfinite
    monkeypatch.setattr(hdet.guard, "_nonfinite", lambda grads, out: passes.append([tuple(g.shape) for g in grads])
                        or own(grads, out))
    p, q, opt = _setup()
    guard = SkipNonFiniteStep(opt, reads="sentinels")
    p.grad, q.grad = torch.ones(5), torch.ones(3, 2)
    p.grad[2] = float("nan")  # the sentinel's gradient: skipped
    before = [p.detach().clone(), q.detach().clone()]
    opt.step()
    assert torch.equal(p, before[0]) and torch.equal(q, before[1]) and float(guard.skipped) == 1.0
    assert passes == [[(5,), (2,)]]
    p.grad, q.grad = torch.ones(5), torch.ones(3, 2)
    q.grad[0, 1] = float("inf")  # in the matrix's first row: skipped
    opt.step()
    assert torch.equal(q, before[1]) and float(guard.skipped) == 2.0
    p.grad, q.grad = torch.ones(5), torch.ones(3, 2)
    q.grad[1:, 0] = float("nan")  # off the first row: not read, stepped
    opt.step()
    assert not torch.isfinite(q).all() and float(guard.skipped) == 2.0 and passes[-1] == [(5,), (2,)]
    p2, q2, opt2 = _setup()
    full = SkipNonFiniteStep(opt2, reads="all")
    p2.grad, q2.grad = torch.ones(5), torch.full((3, 2), float("nan"))
    opt2.step()
    assert torch.isfinite(q2).all() and float(full.skipped) == 1.0 and passes[-1] == [(5,), (3, 2)]
    p2.grad = None  # no bias or norm weight has a gradient: every gradient is read
    q2.grad = torch.ones(3, 2)
    q2.grad[2, 1] = float("nan")  # off the first row
    opt2 = torch.optim.AdamW([p2, q2], lr=0.1, fused=True)
    mats = SkipNonFiniteStep(opt2, reads="sentinels")
    opt2.step()
    assert torch.isfinite(q2).all() and float(mats.skipped) == 1.0 and passes[-1] == [(3, 2)]
    with pytest.raises(ValueError, match=r"Expected reads in \('sentinels', 'all'\), but got 'some'"):
        SkipNonFiniteStep(opt2, reads="some")


@pytest.mark.parametrize("layout", ["linear", "conv1d"])
def test_a_nan_in_rows_the_loss_leaves_out_is_seen_by_the_first_rows_without_a_norm_layer(layout):
    """A NaN in an input row the loss leaves out (selected away by indexing: its gradient rows are exact zeros), in an
    MLP with biases and no norm layer: every bias's gradient stays finite (0 for that row), which the sentinels read
    before 2026-11-30 (1-D parameters only) saw as a healthy step, and the NaN stepped into every replica; each
    weight's gradient ``dY^T X`` holds ``0 * NaN`` in whole rows or columns, and from the second layer on in its first
    row, in torch's ``[out, in]`` layout and in Hugging Face's ``Conv1D`` ``[in, out]``: the "skip" guard skips the
    step."""

    class Conv1D(torch.nn.Module):  # Hugging Face's GPT-2 layer: y = x @ W + b, W of shape [in, out]
        def __init__(self, i, o):
            super().__init__()
            self.weight, self.bias = torch.nn.Parameter(torch.randn(i, o) / i ** 0.5), torch.nn.Parameter(torch.zeros(o))

        def forward(self, x):
            return x @ self.weight + self.bias

    torch.manual_seed(0)
    layer = torch.nn.Linear if layout == "linear" else Conv1D
    net = torch.nn.Sequential(layer(5, 8), torch.nn.ReLU(), layer(8, 16), torch.nn.ReLU(), layer(16, 10))
    opt = torch.optim.AdamW(net.parameters(), lr=0.1, fused=True)
    guard = SkipNonFiniteStep(opt, reads="sentinels")
    x, y = torch.randn(6, 5), torch.randint(0, 10, (6,))
    x[2, 3] = float("nan")  # a row the loss leaves out (a padded example, say)
    keep = torch.arange(6) != 2
    loss = torch.nn.functional.cross_entropy(net(x)[keep], y[keep])
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in net.parameters() if p.dim() == 1)  # the biases: blind
    assert all(not torch.isfinite(p.grad[0]).all() for p in (net[2].weight, net[4].weight))
    before = [p.detach().clone() for p in net.parameters()]
    opt.step()
    assert float(guard.skipped) == 1.0 and all(torch.equal(p, b) for p, b in zip(net.parameters(), before))


def test_a_nan_loss_reaches_every_sentinel_of_a_real_model():
    """Why the sentinels suffice: a NaN loss (here one example's) and a NaN in an activation's gradient make every
    bias and norm weight gradient the backward reaches after it non-finite, in a small transformer-like stack."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 16),
                              torch.nn.GELU(), torch.nn.Linear(16, 8, bias=False), torch.nn.LayerNorm(8),
                              torch.nn.Linear(8, 11))
    x = torch.randint(0, 11, (4, 6))
    logits = net(x)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 11), x.reshape(-1), reduction="none")
    loss = torch.cat([loss[:-1], loss[-1:] * float("nan")]).mean()  # one token's loss is NaN
    loss.backward()
    vectors = {n: p.grad for n, p in net.named_parameters() if p.dim() <= 1}
    assert len(vectors) == 6 and all(not torch.isfinite(g).all() for g in vectors.values()), vectors
    net.zero_grad()

    def poison(grad):  # a NaN born in the backward, at the second LayerNorm's input gradient
        return torch.where(torch.arange(grad.numel()).view_as(grad) == 5, float("nan"), grad)

    h = net[:5](x)
    h.register_hook(poison)
    net[5:](h).sum().backward()
    upstream = [net[1].weight, net[1].bias, net[2].bias]  # before the poisoned gradient in the backward: reached
    assert all(not torch.isfinite(p.grad).all() for p in upstream)
    assert all(torch.isfinite(p.grad).all() for p in (net[5].weight, net[5].bias, net[6].bias))  # after: not


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_the_one_kernel_check_of_small_gradients_agrees_with_the_read_only_one_and_changes_nothing(dtype, device,
                                                                                                  monkeypatch):
    """Up to hdet.guard.SMALL elements (the sentinels) _nonfinite runs GradScaler's fused check at scale 1, which
    writes every element back: the verdict is the max-abs read's, and every gradient keeps its bits (-0.0, the
    largest finite values and NaN included)."""
    import hdet.guard

    big = torch.finfo(dtype).max
    cases = {"clean": [], "nan": [(1, 2, float("nan"))], "inf": [(0, 0, float("inf"))], "-inf": [(1, 0, -float("inf"))],
             "huge": [(0, 1, big), (1, 1, -big)]}
    for name, planted in cases.items():
        grads = [torch.tensor([1.5, -0.0, 3.0], dtype=dtype, device=device),
                 torch.tensor([0.25, 7.0, -2.0], dtype=dtype, device=device)]
        for i, j, v in planted:
            grads[i][j] = v
        bits = [g.clone() for g in grads]
        small = float(hdet.guard._nonfinite(grads, torch.full((), 5.0, device=device)))  # a stale flag: overwritten
        assert all(torch.equal(g.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)) for g, b in zip(grads, bits))
        monkeypatch.setattr(hdet.guard, "SMALL", 0)
        read = float(hdet.guard._nonfinite(grads, torch.full((), 5.0, device=device)))
        monkeypatch.undo()
        assert small == read == (0.0 if name in ("clean", "huge") else 1.0), (name, small, read)
    hand_set = [torch.zeros(1, dtype=dtype, device=device).expand(4)]  # a gradient set by hand as an expanded view:
    assert float(hdet.guard._nonfinite(hand_set, torch.full((), 5.0, device=device))) == 0.0  # read, not written


def test_a_scheduler_stepped_twice_under_a_grad_scaler_is_warned():
    """A scheduler stepped twice per optimizer step (one passed to accelerator.prepare(), which steps it once per
    process) runs HDET's schedule and converge steps ahead of training. hdet said so without a GradScaler only, since
    a step the scaler skips also comes with no optimizer.step(): under fp16 the double step went silent (an audit).
    A skipped step still runs scaler.update(), which writes the scale in place; a second scheduler.step() comes
    with none, and is said. The scaler's own skipped steps are not."""
    import hdet

    def run(twice):
        torch.manual_seed(0)
        net = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        sched = hdet.OneCycleAutoLR(opt, max_lr=0.1, total_steps=40, model_sync_interval=5)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(8):
                loss = net(torch.randn(8, 4)).pow(2).mean() * (float("inf") if step == 3 else 1.0)
                opt.zero_grad()
                scaler.scale(loss).backward()
                scaler.step(opt)  # step 3: skipped by the scaler
                scaler.update()
                sched.step()
                if twice:
                    sched.step()
        return [str(w.message) for w in caught if "no optimizer.step()" in str(w.message)]

    assert run(twice=False) == []
    said = run(twice=True)
    assert len(said) == 1 and "no scaler.update()" in said[0] and "accelerator.prepare()" in said[0], said


def test_fused_sgd_whose_first_step_is_skipped_inside_a_closure_starts_its_momentum_afresh():
    """optimizer.step(closure) (Lightning's way): the gradients are made inside the step, after the pre-hook, so the
    parameters about to get a momentum buffer are known only after the closure. The guard looked before it, found
    none, and kept the uninitialised buffers of a skipped first step (weights 7e29: a review)."""
    def run(skip_first, closure):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(6))
        opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, fused=True)
        SkipNonFiniteStep(opt)

        def step(value):
            def make():
                p.grad = torch.full_like(p, value)
                return torch.zeros(())
            if closure:
                p.grad = None  # (Lightning zeroes with set_to_none inside its closure)
                opt.step(make)
            else:
                make()
                opt.step()
        if skip_first:
            step(float("nan"))
        for k in range(3):
            step(1.0 + k)
        return p.detach().clone()

    empty_like = torch.empty_like  # uninitialised memory, made to hold garbage every time
    torch.empty_like = lambda x, *a, **k: empty_like(x, *a, **k).fill_(3e30)
    try:
        for closure in (False, True):
            assert torch.equal(run(True, closure), run(False, closure)), closure
    finally:
        torch.empty_like = empty_like
