"""The engine's vmap path and the models users bring: F.scaled_dot_product_attention folded into one call for all
replicas (hdet.attention); train/eval flags, first-step errors, uneven batches, frozen parameters."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import vmap

import hdet
from hdet.attention import scaled_dot_product_attention as folded
from hdet.engine import ReplicaEngine

N = 3
SDPA = F.scaled_dot_product_attention


@pytest.mark.parametrize("qs,ks,vs,mask,batched_kv,kw", [
    ((2, 4, 8, 16), (2, 4, 8, 16), (2, 4, 8, 16), None, True, {"is_causal": True}),
    ((5, 8, 16), (5, 6, 16), (5, 6, 8), None, True, {}),
    ((8, 16), (6, 16), (6, 8), None, True, {}),  # one replica's tensors have no batch axis
    ((2, 4, 8, 16), (2, 4, 6, 16), (2, 4, 6, 16), None, False, {}),  # keys/values shared by the replicas
    ((2, 4, 8, 16), (2, 4, 6, 16), (2, 4, 6, 16), "bool2d", True, {}),
    ((2, 4, 8, 16), (2, 4, 6, 16), (2, 4, 6, 16), "float4d", True, {}),
    ((2, 4, 8, 16), (2, 4, 6, 16), (2, 4, 6, 16), "batched", True, {"scale": 0.3}),
    ((2, 4, 8, 16), (2, 2, 6, 16), (2, 2, 6, 16), None, True, {"enable_gqa": True}),
])
def test_folded_attention_is_each_replicas_own(qs, ks, vs, mask, batched_kv, kw):
    """Under vmap, values and gradients are those of each replica's own F.scaled_dot_product_attention call, with
    no per-replica fallback (functorch warns when it loops over the batch)."""
    if kw.get("enable_gqa") and "enable_gqa" not in SDPA.__doc__:
        pytest.skip("this torch has no enable_gqa")
    torch.manual_seed(0)
    q = torch.randn(N, *qs, requires_grad=True)
    k = torch.randn(*((N,) if batched_kv else ()), *ks, requires_grad=True)
    v = torch.randn(*((N,) if batched_kv else ()), *vs, requires_grad=True)
    m = {None: None, "bool2d": torch.rand(8, 6) > 0.3, "float4d": torch.randn(2, 1, 8, 6),
         "batched": torch.randn(N, 8, 6)}[mask]
    kv_dim = 0 if batched_kv else None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = vmap(lambda a, b, c, mm: folded(a, b, c, attn_mask=mm, **kw),
                   in_dims=(0, kv_dim, kv_dim, 0 if mask == "batched" else None))(q, k, v, m)
    ref = torch.stack([SDPA(q[r], k[r] if batched_kv else k, v[r] if batched_kv else v,
                            attn_mask=m[r] if mask == "batched" else m, **kw) for r in range(N)])
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    got = torch.autograd.grad(out.square().sum(), (q, k, v))
    want = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_outside_vmap_it_is_torchs_own_and_dropout_needs_different_masks():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 16, requires_grad=True) for _ in range(3))
    a, b = folded(q, k, v, is_causal=True), SDPA(q, k, v, is_causal=True)
    assert torch.equal(a, b)
    assert all(torch.equal(x, y) for x, y in zip(torch.autograd.grad(a.sum(), (q, k, v)),
                                                 torch.autograd.grad(b.sum(), (q, k, v))))
    qs = torch.randn(N, 2, 4, 8, 16)
    with pytest.raises(RuntimeError, match="randomness='different'"):
        vmap(lambda x: folded(x, x, x, dropout_p=0.1), randomness="same")(qs)
    out = vmap(lambda x: folded(x, x, x, dropout_p=0.5), randomness="different")(qs)
    assert out.shape == qs.shape and not torch.equal(out[0], out[1])


class _Attn(nn.Module):
    """A block that calls F.scaled_dot_product_attention, as most transformer code does."""

    def __init__(self, d: int = 16, heads: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, d = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.out(a.transpose(1, 2).reshape(B, L, d)).mean(1)


def _engine(mode: str, dropout: float = 0.0) -> ReplicaEngine:
    torch.manual_seed(0)
    # SGD: Adam would turn the key bias's gradient, zero but for rounding (softmax ignores it), into full steps
    return ReplicaEngine(_Attn(dropout=dropout), N, lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                         lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=0.1, total_steps=20,
                                                               ensemble_lr_spread_ratio=0.2, model_sync_interval=5,
                                                               replicas=rep, model=m), mode=mode)


def test_the_engine_runs_a_model_that_calls_sdpa_vmapped():
    """A model calling F.scaled_dot_product_attention stays on the vmap path (before: the CPU's per-replica
    fallback, with functorch's warning; on CUDA its backward failed and the engine fell back to the loop), with
    the loop's losses and weights; torch's function is restored after each step."""
    torch.manual_seed(1)
    batches = [(torch.randn(N, 4, 6, 16), torch.randint(0, 4, (N, 4))) for _ in range(6)]

    def loss_fn(m, b):
        return F.cross_entropy(m(b[0]), b[1])

    fast, slow = _engine("auto"), _engine("loop")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for b in batches:
            lf = fast.step(b, loss_fn, stacked=True)
            ls = slow.step(b, loss_fn, stacked=True)
            torch.testing.assert_close(lf, ls, rtol=1e-5, atol=1e-6)
    assert fast.mode == "vmap" and F.scaled_dot_product_attention is SDPA
    for mf, ms in zip(fast.models, slow.models):
        for (n, a), b in zip(mf.state_dict().items(), ms.state_dict().values()):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=n)
    drop = _engine("vmap", dropout=0.3)  # attention dropout: each replica its own mask
    assert torch.isfinite(drop.step(batches[0], loss_fn, stacked=True)).all()


def test_torchs_own_attention_modules_are_folded_too():
    """nn.TransformerEncoderLayer (nn.MultiheadAttention calls F.scaled_dot_product_attention inside): vmapped with no
    per-replica fallback (before: functorch's "performance drop" warning every step), the loop's losses."""
    class Enc(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
            self.out = nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.enc(x)).mean(1)

    def engine(mode: str) -> ReplicaEngine:
        torch.manual_seed(0)
        return ReplicaEngine(Enc(), N, lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                             lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=0.1, total_steps=10, replicas=rep,
                                                                   model=m), mode=mode)

    fast, slow = engine("auto"), engine("loop")
    torch.manual_seed(2)
    b = (torch.randn(N, 4, 6, 16), torch.randint(0, 4, (N, 4)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            lf = fast.step(b, lambda m, bb: F.cross_entropy(m(bb[0]), bb[1]), stacked=True)
            ls = slow.step(b, lambda m, bb: F.cross_entropy(m(bb[0]), bb[1]), stacked=True)
            torch.testing.assert_close(lf, ls, rtol=1e-5, atol=1e-6)
    assert fast.mode == "vmap"


def test_vmap_refuses_replicas_in_different_train_eval_modes_and_auto_keeps_vmap_after_a_loss_fn_error():
    """vmap runs every replica in replica 0's train/eval flags: a replica left in eval mode after evaluating it is an
    error that names it (before: replica 0's eval mode silently trained them all in eval mode); in auto mode a mistake
    in loss_fn at the first step is the caller's error and the engine stays auto (before: it fell back to the loop
    for good, blaming vmap); uneven batches say what to do."""
    def engine(mode, model=None, params=None):
        torch.manual_seed(0)
        m = model or nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.2), nn.Linear(8, 3))
        return ReplicaEngine(m, 3, lambda mm: torch.optim.SGD(params(mm) if params else mm.parameters(), lr=0.1),
                             lambda o, rep, mm: hdet.OneCycleAutoLR(o, max_lr=0.1, total_steps=20, replicas=rep,
                                                                    model=mm), mode=mode)

    x, y = torch.randn(3, 5, 4), torch.randint(0, 3, (3, 5))
    good = lambda m, b: F.cross_entropy(m(b[0]), b[1])  # noqa: E731
    e = engine("vmap")
    e.step((x, y), good, stacked=True)
    e.models[0].eval()  # evaluated replica 0, forgot .train()
    with pytest.raises(ValueError, match=r"'the model' is in eval mode on replica 0 and in train mode on replica 1"):
        e.step((x, y), good, stacked=True)
    e.models[0].train()
    e.step((x, y), good, stacked=True)
    assert [int(m[1].num_batches_tracked) for m in e.models] == [2, 2, 2]
    a = engine("auto")
    with pytest.raises(ValueError, match="scalar loss"), warnings.catch_warnings():
        warnings.simplefilter("error")  # no "vmap cannot run this model" warning: the error is the loss_fn's
        a.step((x, y), lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="none"), stacked=True)
    a.step((x, y), good, stacked=True)
    assert a.mode == "vmap" and a.optimizer_path == "stacked"
    with pytest.raises(ValueError, match=r"one shape .*drop_last=True"):
        e.step([(x[r, :5 - r], y[r, :5 - r]) for r in range(3)], good)


@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_a_frozen_parameter_in_the_optimizer_keeps_the_stacked_step(opt):
    """The optimizer given model.parameters() with a frozen one in it (fine-tuning): torch's optimizers skip it (its
    .grad stays None) and so does the stacked step (before: the per-replica path); the loop's values, the frozen
    weight not trained (converge steps average its equal copies: the last bit may move), no optimizer state for it."""
    def engine(mode):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        m[0].bias.requires_grad_(False)
        make = ((lambda mm: torch.optim.AdamW(mm.parameters(), lr=0.05, weight_decay=0.1)) if opt == "adamw" else
                (lambda mm: torch.optim.SGD(mm.parameters(), lr=0.1, momentum=0.9)))
        return ReplicaEngine(m, 3, make, lambda o, rep, mm: hdet.OneCycleAutoLR(
            o, max_lr=0.05, total_steps=12, ensemble_lr_spread_ratio=0.2, model_sync_interval=4, replicas=rep,
            model=mm), mode=mode)

    fast, slow = engine("vmap"), engine("loop")
    assert fast.optimizer_path == "stacked"
    before = fast.models[0][0].bias.detach().clone()
    torch.manual_seed(3)
    for _ in range(10):
        b = (torch.randn(3, 5, 4), torch.randint(0, 3, (3, 5)))
        for e in (fast, slow):
            e.step(b, lambda m, bb: F.cross_entropy(m(bb[0]), bb[1]), stacked=True)
    assert fast.optimizer_path == "stacked"
    for mf, ms in zip(fast.models, slow.models):
        torch.testing.assert_close(mf[0].bias, before, rtol=0, atol=1e-6)
        assert torch.equal(mf[0].bias, fast.models[0][0].bias)
        for a, c in zip(mf.parameters(), ms.parameters()):
            torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)
    assert all(mf[0].bias not in o.state for mf, o in zip(fast.models, fast.optimizers))


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_a_zero_dim_parameter_trains_in_vmap_mode_as_in_the_loop(opt):
    """A scalar nn.Parameter (a learned temperature): vmap mode ran into a TypeError in the flat layout's view."""
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 2)
            self.temperature = nn.Parameter(torch.tensor(1.5))

        def forward(self, x):
            return self.fc(x) * self.temperature

    make = (lambda m: torch.optim.SGD(m.parameters(), lr=0.1)) if opt == "sgd" else \
        (lambda m: torch.optim.AdamW(m.parameters(), lr=0.01))
    torch.manual_seed(0)
    model = Scaled()
    x, y = torch.randn(4, N, 5, 6), torch.randint(0, 2, (4, N, 5))
    engines = {}
    for mode in ("loop", "vmap"):
        eng = ReplicaEngine(model, N, make, lambda o, rep, m: hdet.OneCycleAutoLR(
            o, max_lr=0.1, total_steps=4, ensemble_lr_spread_ratio=0.3, model_sync_interval=2, replicas=rep, model=m),
            mode=mode)
        for t in range(4):
            eng.step((x[t], y[t]), lambda m, b: F.cross_entropy(m(b[0]), b[1]), stacked=True)
        engines[mode] = eng
    assert engines["vmap"].mode == "vmap" and engines["vmap"].optimizer_path.startswith("stacked")
    for a, b in zip(engines["loop"].models, engines["vmap"].models):
        assert b.temperature.shape == () and a.temperature.item() != 1.5
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)


def test_complex_gradients_are_checked_in_both_parts():
    """Complex parameters (each replica's own optimizer step): the gradient check reads both parts (its float64 sum
    cast complex to real: a torch warning at every step, and an imaginary part unseen), and a replica whose input
    holds a NaN is left out of the average, as the loop leaves it out."""
    torch.manual_seed(0)
    model = nn.Linear(6, 3, dtype=torch.complex64)
    x = torch.randn(3, N, 5, 6, dtype=torch.complex64)
    x[1, 2, 0, 0] = complex(1.0, float("nan"))  # replica 2, step 2
    engines = {}
    for mode in ("loop", "vmap"):
        eng = ReplicaEngine(model, N, lambda m: torch.optim.AdamW(m.parameters(), lr=0.01),
                            lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=0.01, total_steps=3, replicas=rep, model=m,
                                                                  ensemble_lr_spread_ratio=0.2), mode=mode)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="Casting complex values to real")  # (torch warned so)
            for t in range(3):
                eng.step((x[t],), lambda m, b: m(b[0]).abs().pow(2).mean(), stacked=True)
        engines[mode] = eng
    for a, b in zip(engines["loop"].models, engines["vmap"].models):
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.isfinite(torch.view_as_real(q)).all()
            torch.testing.assert_close(q, p)


# --------------------------------------------- models an audit brought (2026-11-28): vmap must match the loop
def _run_both(make_model, steps, opt="adamw", batch=None, **kw):
    """The same replicas trained in vmap and in loop mode (T = 3: converge steps included); per mode the engine."""
    out = {}
    for mode in ("vmap", "loop"):
        torch.manual_seed(0)
        model = make_model()
        mk_opt = ((lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)) if opt == "adamw" else
                  (lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)))
        eng = ReplicaEngine(model, N, mk_opt, lambda o, rep, m: hdet.HDETLR(o, None, 20, ensemble_lr_spread_ratio=0.5,
                                                                           model_sync_interval=3, model=m,
                                                                           replicas=rep), mode=mode,
                           **{k: v for k, v in kw.items() if mode == "vmap" or k != "compile"})  # (the loop: eager)
        g = torch.Generator().manual_seed(1)
        for t in range(1, steps + 1):
            eng.step(batch(t, g), lambda m, b: F.mse_loss(m(b[0]), b[1]))
        out[mode] = eng
    return out["vmap"], out["loop"]


def _assert_same_replicas(a, b, atol=1e-6):
    for ma, mb in zip(a.models, b.models):
        for (n, x), (_, y) in zip(list(ma.named_parameters()) + list(ma.named_buffers()),
                                  list(mb.named_parameters()) + list(mb.named_buffers())):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=atol, msg=n)


class _Pad(nn.Module):
    def __init__(self, tied=False):
        super().__init__()
        self.emb = nn.Embedding(11, 6, padding_idx=0)
        self.out = nn.Linear(6, 11, bias=False)
        if tied:
            self.out.weight = self.emb.weight

    def forward(self, x):
        return self.out(self.emb(x)).mean(1)


@pytest.mark.parametrize("tied", [False, True], ids=["embedding", "tied-output"])
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_an_embeddings_padding_row_gets_no_gradient_from_the_lookup_in_vmap_mode(tied, compile):
    """nn.Embedding(padding_idx=0): torch's vmapped lookup followed by .backward() gave the padding row the gradient
    of every padding token, so it trained in vmap mode (0.0084 after 3 SGD steps, 0 in the loop; an audit found it).
    Now vmap matches the loop; tied to an output layer, the row still gets that layer's gradient."""
    def batch(t, g):
        x = torch.randint(0, 11, (N, 4, 5), generator=g)
        x[:, :, 0] = 0  # every sequence starts with the padding token
        return list(zip(x, torch.randn(N, 4, 11, generator=g)))

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="hdet:")  # (compiled: no fall-back to eager)
        v, lp = _run_both(lambda: _Pad(tied), 7, "sgd", batch, compile=compile)
    _assert_same_replicas(v, lp)
    pad = v.models[0].emb.weight[0]
    assert (pad.abs().max() > 0) if tied else (pad.abs().max() == 0)


class _Reassigns(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.register_buffer("mu", torch.zeros(4))
        self.register_buffer("n", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        if self.training:  # reassigned, not updated in place
            self.mu = 0.9 * self.mu + 0.1 * x.detach().mean(0)
            self.n = self.n + 1
        return self.lin(x - self.mu)


def _xy(t, g):
    return list(zip(torch.randn(N, 8, 4, generator=g) + 3, torch.randn(N, 8, 2, generator=g)))


class _ScalesBy(nn.Module):
    """Uses its buffer in the graph (saved for the backward), then reassigns it: the copy must wait for the backward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.register_buffer("sd", torch.ones(2))

    def forward(self, x):
        y = self.lin(x) / self.sd  # (its backward needs sd)
        if self.training:
            self.sd = 0.9 * self.sd + 0.1 * y.detach().std(0)
        return y


@pytest.mark.parametrize("model", [_Reassigns, _ScalesBy], ids=["running-mean", "saved-for-backward"])
def test_a_buffer_the_forward_reassigns_is_kept_in_vmap_mode(model):
    """``self.mu = 0.9 * self.mu + ...`` in forward: functional_call puts back the tensors it swapped in, so vmap mode
    dropped every update (n stayed 0 where the loop counts 7, with other losses), silently, and "auto" chose vmap. Now
    the reassigned values are copied into the stacked buffers, after the backward (which may have saved the old
    value: copied before it, autograd raised "modified by an inplace operation")."""
    v, lp = _run_both(model, 7, batch=_xy)
    if model is _Reassigns:
        assert [int(m.n) for m in v.models] == [7] * N
    _assert_same_replicas(v, lp)


def test_a_buffer_reassigned_with_another_shape_is_left_with_a_warning():
    """A cache the forward rebuilds with another shape (a longer sequence's) or dtype cannot be kept stacked: it is
    left as torch.func.functional_call leaves it (training goes on, as before), and a warning says so once."""
    class Grows(_Reassigns):
        def forward(self, x):
            self.mu = torch.cat([self.mu, self.mu])
            return self.lin(x)

    eng = ReplicaEngine(Grows(), N, lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                        lambda o, rep, m: hdet.HDETLR(o, None, 5, model=m, replicas=rep), mode="vmap")
    with pytest.warns(UserWarning, match=r"reassigns the buffer 'mu' as a torch.float32 tensor of shape \(8,\), where"
                                         r" the vmapped replicas hold a torch.float32 one of shape \(4,\)"):
        for t in range(1, 3):
            eng.step(_xy(t, torch.Generator().manual_seed(t)), lambda m, b: F.mse_loss(m(b[0]), b[1]))
    assert eng.models[0].mu.shape == (4,) and eng.mode == "vmap"


class _Sometimes(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.aux = nn.Linear(4, 2)
        self.use_aux = True

    def forward(self, x):
        return self.lin(x) + (self.aux(x) if self.use_aux else 0)


@pytest.mark.parametrize("share", [True, False], ids=["shared", "local"])
def test_a_parameter_the_loss_stops_reaching_stays_put_in_vmap_mode(share):
    """A head used at the first steps only: in vmap mode the stacked AdamW kept stepping it on a zero gradient (moments
    and weight decay moved it: -0.32894 -> -0.31272 in 3 steps), where each replica's optimizer skips a parameter with
    no gradient. Now its gradient is None, as in the loop, and the replicas step on their own from then on."""
    def batch(t, g):
        if t == 3:
            for eng in engines:
                for m in eng.models:
                    m.use_aux = False
        return _xy(t, g)

    engines = []
    out = {}
    for mode in ("vmap", "loop"):
        torch.manual_seed(0)
        eng = ReplicaEngine(_Sometimes(), N, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1),
                            lambda o, rep, m: hdet.HDETLR(o, None, 20, ensemble_lr_spread_ratio=0.5,
                                                          model_sync_interval=3, model=m, replicas=rep),
                            mode=mode, share_gradients=share)
        engines.append(eng)
        g = torch.Generator().manual_seed(1)
        for t in range(1, 8):
            eng.step(batch(t, g), lambda m, b: F.mse_loss(m(b[0]), b[1]))
            if t == 2:
                kept = [m.aux.weight.detach().clone() for m in eng.models]
        out[mode] = (eng, kept)
    (v, kept), (lp, _) = out["vmap"], out["loop"]
    assert "no gradient at step 3" in v.optimizer_path
    _assert_same_replicas(v, lp)
    mean = torch.stack(kept).mean(0)  # (the converge steps at 3 and 6 average the replicas; nothing else moves it)
    for m in v.models:
        torch.testing.assert_close(m.aux.weight, mean, rtol=0, atol=1e-7)
        assert m.aux.weight.grad is None


class _SharedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.block1 = nn.Linear(4, 4)
        self.block2 = self.block1  # one submodule under two names (ALBERT-style sharing)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.block2(torch.tanh(self.block1(x)))))


def test_a_submodule_under_two_names_keeps_replica_0_usable_in_vmap_mode():
    """torch's functional_call put a vmapped tensor back into replica 0's shared submodule (it swaps its weight in
    under both names and restores the second from the first swap), so after one vmapped step models[0](x),
    models[0].state_dict() and eng.state_dict() raised "tensor may have escaped"; training itself was right."""
    v, lp = _run_both(_SharedBlock, 5, batch=_xy)
    _assert_same_replicas(v, lp)
    m0 = v.models[0]
    assert isinstance(m0.block1.weight, nn.Parameter) and m0.block2.weight is m0.block1.weight
    m0(torch.randn(2, 4))
    v.state_dict()
