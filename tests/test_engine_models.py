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
