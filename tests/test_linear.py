"""hdet.linear: F.linear for vmapped replicas (one batched matmul, the weight gradient in the weight's layout),
against torch's own vmapped F.linear; autocast as F.linear."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap

import hdet
import hdet.linear
from hdet.engine import ReplicaEngine
from hdet.linear import routed

N = 4


def _inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(N, 3, 5, 7, generator=g), torch.randn(N, 6, 7, generator=g), torch.randn(N, 6, generator=g))


def _run(fn, args, in_dims, route):
    """fn vmapped over args (fresh leaves), and the gradients of sum(|y|^2)."""
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in args]
    if route:
        with routed():
            y = vmap(fn, in_dims=in_dims)(*leaves)
    else:
        y = vmap(fn, in_dims=in_dims)(*leaves)
    y.abs().float().pow(2).sum().backward()
    return y.detach(), [None if t is None else t.grad for t in leaves]


CASES = {  # name: (args from (x, w, b), in_dims)
    "all batched": (lambda x, w, b: (x, w, b), (0, 0, 0)),
    "no bias": (lambda x, w, b: (x, w, None), (0, 0, None)),
    "one input for all": (lambda x, w, b: (x[0], w, b), (None, 0, 0)),
    "one weight, own biases": (lambda x, w, b: (x, w[0], b), (0, None, 0)),
    "one weight and bias": (lambda x, w, b: (x, w[0], b[0]), (0, None, None)),
    "one bias": (lambda x, w, b: (x, w, b[0]), (0, 0, None)),
    "1-d input": (lambda x, w, b: (x[:, 0, 0], w, b), (0, 0, 0)),
    "replica axis elsewhere": (lambda x, w, b: (x.movedim(0, 2), w.movedim(0, 1), b.movedim(0, 1)), (2, 1, 1)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_vmapped_linear_matches_torch(case, monkeypatch):
    make, in_dims = CASES[case]
    args = make(*_inputs())
    calls = []
    apply = hdet.linear._BatchedLinear.apply
    monkeypatch.setattr(hdet.linear._BatchedLinear, "apply", lambda *a: calls.append(1) or apply(*a))
    y0, g0 = _run(lambda *a: F.linear(*a), args, in_dims, route=False)
    assert not calls
    y1, g1 = _run(lambda *a: F.linear(*a), args, in_dims, route=True)
    assert len(calls) == (in_dims[1] is not None)  # the batched matmul for stacked weights; else torch's call
    torch.testing.assert_close(y1, y0)
    for a, b in zip(g1, g0):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b)
            assert a.shape == b.shape


def test_nested_vmap_and_multihead_attention_match_torch():
    x, w, b = _inputs()
    inner = lambda x_, w_, b_: vmap(lambda xx: F.linear(xx, w_, b_))(x_)  # noqa: E731 - vmap inside the replicas'
    (y0, g0), (y1, g1) = (_run(inner, (x, w, b), (0, 0, 0), route) for route in (False, True))
    torch.testing.assert_close(y1, y0)
    for a, r in zip(g1, g0):
        torch.testing.assert_close(a, r)
    xx, ww, bb = torch.randn(2, N, 3, 7), torch.randn(2, N, 6, 7), torch.randn(2, N, 6)  # vmap around the replicas'
    outer = lambda a, c, d: vmap(F.linear)(a, c, d)  # noqa: E731
    ys = [_run(outer, (xx, ww, bb), (0, 0, 0), route) for route in (False, True)]
    torch.testing.assert_close(ys[1][0], ys[0][0])
    mha = nn.MultiheadAttention(7, 1, batch_first=True)  # its projections call F.linear inside torch
    params = {k: torch.stack([v.detach() + 0.1 * torch.randn_like(v) for _ in range(N)])
              for k, v in mha.named_parameters()}
    grads = []
    for route in (False, True):
        p = {k: v.clone().requires_grad_() for k, v in params.items()}
        with routed() if route else torch.enable_grad():
            y = vmap(lambda q, s: functional_call(mha, q, (s, s, s))[0])(p, x[:, 0])
        y.pow(2).sum().backward()
        grads.append({k: v.grad for k, v in p.items()})
    for k in params:
        torch.testing.assert_close(grads[1][k], grads[0][k])


def test_weight_gradient_comes_in_the_weights_layout():
    """The backward's own gradient (autograd.grad: a .grad is made contiguous whatever the backward gives)."""
    x, w, b = _inputs()
    w = w.requires_grad_()
    calls = []
    apply = hdet.linear._BatchedLinear.apply
    with routed(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(hdet.linear._BatchedLinear, "apply", lambda *a: calls.append(1) or apply(*a))
        y = vmap(lambda *a: F.linear(*a))(x, w, b)  # (F.linear looked up inside: routed, it is hdet's; torch's
    gw, = torch.autograd.grad(y.pow(2).sum(), w)  # vmapped F.linear gives the transpose, torch 2.13)
    assert calls and gw.shape == w.shape and gw.is_contiguous()


def test_autocast_casts_as_f_linear_does():
    """Under autocast, each replica's layer computes in the autocast dtype, as F.linear on one replica does
    (torch's vmapped F.linear with a bias runs in float32 instead: measured on torch 2.13)."""
    x, w, b = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        one = torch.stack([F.linear(x[r], w[r], b[r]) for r in range(N)])
        with routed():
            y = vmap(F.linear)(x, w, b)
    assert one.dtype == y.dtype == torch.bfloat16
    torch.testing.assert_close(y, one)
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    with torch.autocast("cpu", dtype=torch.bfloat16), routed():
        vmap(F.linear)(xr, wr, br).float().sum().backward()  # the backward meets the forward's dtypes
    assert wr.grad.dtype == torch.float32 and torch.isfinite(wr.grad).all()


def test_engine_under_autocast_computes_as_the_loop():
    """A user's bf16 autocast around the engine's step: the vmapped replicas' layers run in bfloat16, as the
    loop's do (they ran in float32: torch's vmapped F.linear drops autocast with a bias)."""
    seen = {}

    def loss_fn(m, batch):
        out = m(batch[0])
        seen.setdefault(mode, set()).add(out.dtype)
        return F.cross_entropy(out.float(), batch[1])

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x, y = torch.randn(N, 5, 8), torch.randint(0, 4, (N, 5))
    losses = {}
    for mode in ("loop", "vmap"):
        eng = ReplicaEngine(model, N, lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                            lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=0.1, total_steps=4, replicas=rep,
                                                                  ensemble_lr_spread_ratio=0.2),
                            mode=mode)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses[mode] = torch.stack([eng.step((x, y), loss_fn, stacked=True) for _ in range(3)])
    assert seen == {"loop": {torch.bfloat16}, "vmap": {torch.bfloat16}}
    torch.testing.assert_close(losses["vmap"][0], losses["loop"][0], rtol=1e-2, atol=1e-2)  # the same start


@pytest.mark.parametrize("case", ["complex", "0-d bias", "1-d weight"])
def test_shapes_and_dtypes_the_batched_matmul_does_not_take_are_torchs(case):
    """hdet.linear's batched matmul takes real floating tensors, each replica's weight 2-d and its bias 1-d; anything
    else is torch's call (a complex weight got gradients without the conjugate, a 0-d bias was broadcast along
    the rows, a 1-d weight failed)."""
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(N, 5, 4, generator=g), torch.randn(N, 3, 4, generator=g), torch.randn(N, generator=g)
    if case == "complex":
        x, w = x.to(torch.complex64), w.to(torch.complex64) * (1 + 1j)
        args, in_dims = (x, w, None), (0, 0, None)
    elif case == "0-d bias":
        x = torch.randn(N, N, 4, generator=g)  # rows == replicas: the wrong broadcast ran without an error
        args, in_dims = (x, w, b), (0, 0, 0)
    else:
        args, in_dims = (x, w[:, 0], None), (0, 0, None)
    out = [_run(lambda *a: F.linear(*a), args, in_dims, route) for route in (False, True)]
    torch.testing.assert_close(out[1][0], out[0][0])
    for a, r in zip(out[1][1], out[0][1]):
        if r is not None:
            torch.testing.assert_close(a, r)


@pytest.mark.parametrize("lead", [(6,), (2, 3), ()])
def test_a_shape_mismatch_reads_as_torchs(lead):
    """Inputs that do not fit the weight: the routed call raises torch's own message for one replica (not the
    batched matmul's, which names tensors the user never made)."""
    x, w = torch.randn(N, *lead, 4), torch.randn(N, 2, 3)
    with pytest.raises(RuntimeError) as torch_err:
        F.linear(x[0], w[0])
    with routed(), pytest.raises(RuntimeError) as routed_err:
        vmap(lambda a, b: F.linear(a, b))(x, w)
    assert str(routed_err.value) == str(torch_err.value)


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("case", [c for c in CASES
                                  if c not in ("no bias", "one weight, own biases", "one weight and bias")])
def test_one_addmm_per_replica_computes_what_the_batched_matmul_does(case, autocast, monkeypatch):
    """Large layers with a bias on a CUDA device run one addmm per replica (the bias in cuBLASLt's epilogue instead of
    a copy into the output that the GEMM reads back): forced here on the CPU, the same values and gradients for
    stacked, shared (stride 0) and moved inputs, under autocast too; without a bias, the batched matmul still."""
    make, in_dims = CASES[case]
    args = make(*_inputs())
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else torch.enable_grad
    with ctx():
        y0, g0 = _run(lambda *a: F.linear(*a), args, in_dims, route=True)
    calls = []
    addmm = hdet.linear._ADDMM
    monkeypatch.setattr(hdet.linear, "_ADDMM", lambda *a, **k: calls.append(1) or addmm(*a, **k))
    monkeypatch.setattr(hdet.linear, "_per_replica", lambda x_, w_, b_: b_ is not None)
    with ctx():
        y1, g1 = _run(lambda *a: F.linear(*a), args, in_dims, route=True)
    assert len(calls) == N  # one addmm a replica
    assert y1.dtype == y0.dtype == (torch.bfloat16 if autocast else torch.float32)
    torch.testing.assert_close(y1, y0)
    for a, r in zip(g1, g0):
        torch.testing.assert_close(a, r)
    calls.clear()
    _run(lambda *a: F.linear(*a), (args[0], args[1], None), (in_dims[0], in_dims[1], None), route=True)
    assert not calls


def test_the_per_replica_addmm_is_for_large_cuda_layers_with_a_bias():
    x, w, b = torch.randn(2, 4096, 8), torch.randn(2, 1024, 8), torch.randn(2, 1024)
    assert not hdet.linear._per_replica(x, w, b)  # (the CPU)
    meta = [t.to("meta") for t in (x, w, b)]
    assert not hdet.linear._per_replica(*meta)
    fake_cuda = type("T", (), {"is_cuda": True})
    big = type("X", (fake_cuda,), {"shape": (2, 4096, 8), "dtype": torch.float32})()
    small = type("X", (fake_cuda,), {"shape": (2, 4095, 8), "dtype": torch.float32})()
    assert hdet.linear._per_replica(big, w, b)  # 4096 rows x 1024 outputs = PER_REPLICA_MIN
    assert not hdet.linear._per_replica(small, w, b)
    assert not hdet.linear._per_replica(big, w, None)
    assert not hdet.linear._per_replica(big, w, b.half())
    assert not hdet.linear._per_replica(big, torch.randn(3, 1024, 8), torch.randn(3, 1024))  # (baddbmm raises)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))


def _sharing_run(shares, mode, bad=None, steps=8):
    """An engine of N replicas (AdamW, HDET with syncs every 3 steps) trained ``steps`` steps, with the weights'
    gradient shares (hdet.linear.sharing) or without; ``bad(t, r)``: whether replica r's step t gets a gradient that is
    not finite, in its linear layers (a NaN input) or in the last layer's bias only (sqrt's gradient at 0, times 0: the
    weights' shares finite). Returns the
    engine, the mean gradient after each step, the losses, how many steps reduced shares and how many ran again."""
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(N, 8, 6, generator=g), torch.randint(0, 3, (N, 8), generator=g)) for _ in range(steps)]
    eng = ReplicaEngine(_mlp(), N, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
                        lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=1e-2, total_steps=steps,
                                                              ensemble_lr_spread_ratio=0.3, model_sync_interval=3,
                                                              replicas=rep, model=m), mode=mode)
    if not shares:
        eng._takes_shares = lambda: False
    def loss_fn(m, b):  # (merged: loss_fn cannot reach a replica's parameters)
        loss = F.cross_entropy(m(b[0]), b[1])
        return loss if mode == "merged" else loss + (m[4].bias.sum() * b[2]).abs().sqrt() * 1e-3
    counts = {"shares": 0, "again": 0}
    reduce = eng.stack._reduce

    def counting(names, grads):
        counts["shares"] += any(g is not None and g.stride(0) == 0 for g in grads)
        reduce(names, grads)
        counts["again"] += eng.stack.redo
    eng.stack._reduce = counting
    grads, losses = [], []
    for t, (x, y) in enumerate(data):
        flag = torch.ones(N)
        if bad is not None:
            for r in range(N):
                if bad(t, r) == "input":
                    x = x.clone()
                    x[r, 0, 0] = float("nan")
                elif bad(t, r) == "bias":
                    flag[r] = 0.0
        losses.append(eng.step((x, y, flag), loss_fn, stacked=True))
        grads.append(eng.stack.grad.clone())
    return eng, grads, losses, counts


@pytest.mark.filterwarnings("ignore:hdet. at sync step")
@pytest.mark.parametrize("mode,bad", [("vmap", None), ("vmap", "input"), ("vmap", "bias"), ("merged", None),
                                      ("merged", "input")])
def test_weight_gradient_shares_train_as_each_replicas_own_gradients(mode, bad):
    """On the CPU the linear layers' weights get the replicas' shares of their summed gradient (one mm over all
    rows, stride 0 over the replicas) from the first step on: the mean gradient, the losses and the trained
    replicas are the per-replica gradients' (to rounding). A replica whose gradient is not finite at a step, in its
    linear layers or only in a bias (its weights' shares finite), is left out of the mean as
    without shares: that step runs again without them."""
    when = {None: None, "input": lambda t, r: "input" if (t, r) in ((2, 1), (4, 3)) else None,
            "bias": lambda t, r: "bias" if (t, r) == (4, 2) else None}[bad]
    eng, grads, losses, counts = _sharing_run(True, mode, when)
    ref, ref_grads, ref_losses, ref_counts = _sharing_run(False, mode, when)
    assert counts["shares"] == 8 and ref_counts["shares"] == 0  # (the runs this test compares)
    assert counts["again"] == {None: 0, "input": 2, "bias": 1}[bad]
    assert eng.mode == mode
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=1e-5, atol=1e-7, equal_nan=True)
    for m, mr in zip(eng.models, ref.models):
        for p, q in zip(m.parameters(), mr.parameters()):
            assert torch.isfinite(p).all()
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_a_second_run_of_a_step_draws_what_the_first_drew():
    """A step run again without the shares (a replica's gradient not finite) draws the same dropout masks and
    updates BatchNorm's statistics once, as the step run once without shares does."""
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Dropout(0.3), nn.ReLU(), nn.Linear(16, 3))

    def run(shares):
        torch.manual_seed(5)
        eng = ReplicaEngine(model(), N, lambda m: torch.optim.SGD(m.parameters(), lr=1e-2),
                            lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=1e-2, total_steps=4,
                                                                  model_sync_interval=2, replicas=rep, model=m),
                            mode="vmap")
        if not shares:
            eng._takes_shares = lambda: False
        g = torch.Generator().manual_seed(2)
        for t in range(4):
            x = torch.randn(N, 8, 6, generator=g)
            if t == 1:
                x[2, 0, 0] = float("nan")
            eng.step((x, torch.randint(0, 3, (N, 8), generator=g)), lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                     stacked=True)
        return eng
    a, b = run(True), run(False)
    for k in a.stacked_buffers:
        torch.testing.assert_close(a.stacked_buffers[k], b.stacked_buffers[k], rtol=1e-5, atol=1e-6, equal_nan=True)
    for p, q in zip(a.stacked_params.values(), b.stacked_params.values()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


class _Derived(nn.Module):
    """A layer whose weight is computed from the parameter (tanh), one used twice (tied), and a scalar parameter added
    to the loss (its gradient comes expanded over the replicas, stride 0, without being a share)."""

    def __init__(self, tied_only=False):
        super().__init__()
        torch.manual_seed(0)
        self.tied_only = tied_only  # a's weight computed too: b, used twice, is the only layer that shares
        self.a, self.b = nn.Linear(6, 16), nn.Linear(16, 16)
        self.w = nn.Parameter(torch.randn(16, 16) * 0.3)  # (as many outputs as a replica's rows: it could share)
        self.p = nn.Parameter(torch.zeros(()))

    def forward(self, x):
        a = F.linear(x, self.a.weight * 1.0, self.a.bias) if self.tied_only else self.a(x)
        h = torch.tanh(self.b(torch.tanh(self.b(torch.tanh(a)))))  # b tied: used twice
        return F.linear(h, torch.tanh(self.w))  # w: a weight computed from the parameter


@pytest.mark.filterwarnings("ignore:hdet. at sync step")
@pytest.mark.parametrize("nan", [False, True])
@pytest.mark.parametrize("tied_only", [False, True])
def test_a_weight_computed_from_its_parameter_takes_no_share_and_tied_uses_leave_a_nan_replica_out(nan, tied_only):
    """A share is each replica's only where the weight is the stacked parameter or a view of it: a weight computed from
    it (tanh here; dropped out, a LoRA sum, a parametrization) gets each replica's own gradient (a share through its
    per-replica Jacobian trained every replica wrong, a review), and a parameter used twice, whose gradient is a share
    added to another, or whose gradient comes expanded without being one (added to the loss), is not taken for a
    share: with a NaN on one replica that replica alone is left out, as without shares (every replica was left out,
    or all went NaN, in the review's runs)."""
    def run(shares):
        eng = ReplicaEngine(_Derived(tied_only), N, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
                            lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=1e-2, total_steps=6,
                                                                  ensemble_lr_spread_ratio=0.3, model_sync_interval=3,
                                                                  replicas=rep, model=m), mode="vmap")
        if not shares:
            eng._takes_shares = lambda: False
        g, grads, took = torch.Generator().manual_seed(1), [], []
        for t in range(6):
            x = torch.randn(N, 8, 6, generator=g)
            if nan and t == 2:
                x[1, 0, 0] = float("nan")
            eng.step((x, torch.randint(0, 3, (N, 8), generator=g)),
                     lambda m, b: F.cross_entropy(m(b[0]), b[1]) + (0.5 * m.p if tied_only else m.p), stacked=True)
            if t < 5:  # (the last step closes the engine, which gives each replica its own .grad: grad freed)
                grads.append(eng.stack.grad.clone())
            took.append(set(eng.stack.took))
        return eng, grads, took
    (eng, grads, took), (ref, ref_grads, _) = run(True), run(False)
    assert took[0] == ({"b.weight"} if tied_only else {"a.weight", "b.weight"})  # (not w: computed; not p)
    if nan:
        assert took[2] == set()  # (the step ran again without shares)
    for a, b in zip(grads, ref_grads):
        assert torch.isfinite(a).all() and a.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    for p, q in zip(eng.stacked_params.values(), ref.stacked_params.values()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_a_compiled_step_takes_no_share_and_copies_nothing_for_a_second_run():
    """A compiled forward never calls hdet's linear layers, so its steps take no share: the buffers and the random
    state are not copied for a second run (they were at every compiled step). Its eager steps still take them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))

    def engine(compile):
        return ReplicaEngine(model, N, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
                             lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=1e-2, total_steps=4, model_sync_interval=2,
                                                                   replicas=rep, model=m), mode="vmap", compile=compile)
    x, y = torch.randn(N, 8, 6), torch.randint(0, 3, (N, 8))
    for compile, copies in ((True, 0), (False, 3)):
        eng = engine(compile)
        before, calls = eng._before_shares, []
        eng._before_shares = lambda: calls.append(1) or before()
        for _ in range(3):
            eng.step((x, y), lambda m, b: F.cross_entropy(m(b[0]), b[1]), stacked=True)
        assert len(calls) == copies, compile
        assert (eng._fns[next(iter(eng._fns))][1] is not None) == compile  # (the compiled function ran the steps)
        assert bool(eng.stack.took) != compile
