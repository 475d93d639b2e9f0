"""The engine's mode="merged" (hdet.merged): the replicas' batches as one batch through standard layers. Each test runs
the same replicas vmapped (or in the loop) beside it and compares what a user reads: losses, weights, learning rates."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hdet
from hdet.app.tasks import ByteGPT
from hdet.engine import ReplicaEngine
from hdet.merged import NotMergeable, reason_not_mergeable

N, B, CTX = 4, 3, 8


def lm_loss(m, b):
    logits = m(b[..., :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[..., 1:].reshape(-1))


def xy_loss(m, b):
    return F.mse_loss(m(b[0]), b[1])


def _engine(model, mode, steps=12, alpha=0.3, T=4, opt="adamw", **kw):
    make_opt = {"adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1),
                "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
                "rmsprop": lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-3)}[opt]
    return ReplicaEngine(model, N, make_opt,
                         lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=o.defaults["lr"], total_steps=steps,
                                                               ensemble_lr_spread_ratio=alpha, model_sync_interval=T,
                                                               replicas=rep, model=m), mode=mode, **kw)


def _run(make_model, mode, batches, loss_fn, steps=12, **kw):
    eng = _engine(make_model(), mode, steps=steps, **kw)
    losses = [eng.step(batches[t], loss_fn, stacked=True) for t in range(steps)]
    return eng, torch.stack(losses)


def _gpt(dropout=0.0):
    torch.manual_seed(0)
    return ByteGPT(CTX, 16, 2, 2, dropout=dropout)


def _tokens(steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (steps, N, B, CTX + 1), generator=g)


def _assert_same(a: ReplicaEngine, b: ReplicaEngine, la, lb, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(la, lb, rtol=rtol, atol=atol)
    for ma, mb in zip(a.models, b.models):
        for (n, p), q in zip(ma.named_parameters(), mb.parameters()):
            torch.testing.assert_close(p, q, rtol=rtol, atol=atol, msg=n)
    assert [s.get_last_lr() for s in a.schedulers] == [s.get_last_lr() for s in b.schedulers]


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_merged_trains_the_gpt_as_vmap_and_the_loop_do(share, opt):
    """ByteGPT (embeddings, a tied head, attention, LayerNorm, positions shared by every row): 12 steps, 3 syncs; in
    local mode too. The loop is the reference semantics. (Adam: the key projection's bias has an exactly-zero true
    gradient, and Adam turns the rounding noise of another summation order into full steps, so its weights agree to
    1e-3 where the losses agree to 2e-5.)"""
    data = _tokens(12)
    tol = dict(rtol=2e-4, atol=2e-5) if opt == "sgd" else dict(rtol=1e-3, atol=2e-3)
    loop, l_loop = _run(_gpt, "loop", data, lm_loss, share_gradients=share, opt=opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback
        merged, l_merged = _run(_gpt, "merged", data, lm_loss, share_gradients=share, opt=opt)
    assert merged.mode == "merged" and merged.optimizer_path == "stacked"
    torch.testing.assert_close(l_merged, l_loop, rtol=2e-4, atol=2e-5)
    _assert_same(merged, loop, l_merged, l_loop, **tol)
    vm, l_vm = _run(_gpt, "vmap", data, lm_loss, share_gradients=share, opt=opt)
    _assert_same(merged, vm, l_merged, l_vm, **tol)


class Mixed(nn.Module):
    """Every standard layer, with the options that change their forward: no bias, no affine, several normalized axes,
    RMSNorm, an embedding used twice, a linear layer called twice and one shared by two names."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.a = nn.Linear(6, 12, bias=False)
        self.ln = nn.LayerNorm((2, 6))
        self.ln_plain = nn.LayerNorm(12, elementwise_affine=False)
        self.ln_nobias = nn.LayerNorm(12, bias=False)
        self.rms = nn.RMSNorm(12) if hasattr(nn, "RMSNorm") else nn.LayerNorm(12)
        self.b = nn.Linear(12, 12)
        self.again = self.b
        self.drop = nn.Dropout(0.0)
        self.out = nn.Linear(12, 3)

    def forward(self, idx):
        h = self.emb(idx) + self.emb(idx.flip(-1))  # [rows, 4, 6]
        h = self.a(h)
        h = self.ln(h.view(*h.shape[:-1], 2, 6)).flatten(-2)
        h = self.ln_nobias(self.ln_plain(h))
        h = torch.tanh(self.again(self.rms(self.b(h))))
        return self.out(self.drop(h)).mean(1)  # [rows, 3]


def _mixed():
    torch.manual_seed(0)
    return Mixed()


def _mixed_data(steps):
    g = torch.Generator().manual_seed(2)
    return [(torch.randint(0, 11, (N, B, 4), generator=g), torch.randn(N, B, 3, generator=g)) for _ in range(steps)]


@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_merged_runs_every_standard_layer_as_vmap_does(opt):
    data = _mixed_data(12)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        merged, lm = _run(_mixed, "merged", data, xy_loss, opt=opt)
    assert merged.mode == "merged"
    vm, lv = _run(_mixed, "vmap", data, xy_loss, opt=opt)
    _assert_same(merged, vm, lm, lv, rtol=1e-4, atol=1e-5)


def test_dropout_draws_each_replicas_own_masks_and_training_matches_in_distribution():
    data = _tokens(6)
    eng = _engine(_gpt(dropout=0.5), "merged", steps=6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        losses = [eng.step(data[t], lm_loss, stacked=True) for t in range(6)]
    assert eng.mode == "merged" and all(torch.isfinite(x).all() for x in losses)
    torch.manual_seed(5)  # one step from equal weights, the same batch for every replica: the masks differ
    eng = _engine(_gpt(dropout=0.5), "merged", steps=6, alpha=0.0)
    same = data[0][:1].expand(N, B, CTX + 1)
    got = eng.step(same, lm_loss, stacked=True)
    assert len(set(got.tolist())) == N
    eval_eng = _engine(_gpt(dropout=0.5), "merged", steps=6, alpha=0.0)
    for m in eval_eng.models:
        m.eval()
    got = eval_eng.step(same, lm_loss, stacked=True)  # eval mode: no dropout, equal replicas, equal losses
    assert len(set(got.tolist())) == 1


class RawParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.scale = nn.Parameter(torch.ones(2))

    def forward(self, x):
        return self.lin(x) * self.scale


class RowMixing(nn.Module):
    """Standard layers, but the forward centres each feature over the batch: merged, the replicas' rows would mix."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x):
        h = self.lin(x)
        return h - h.mean(0, keepdim=True)


class Sub(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


class Returns(nn.Module):
    def __init__(self, what):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.what = what

    def forward(self, x):
        y = self.lin(x)
        return y.sum() if self.what == "scalar" else y


class Boxed(nn.Module):
    """Returns its output inside an object torch's pytree does not open."""

    class Out:
        def __init__(self, y):
            self.y = y

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x):
        return Boxed.Out(self.lin(x))


class HardBatch(nn.Module):
    """A forward with the batch size written in: a view that merged rows do not fit (vmap runs it)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x):
        return self.lin(x.view(3, 3))


def _xy(steps, rows=B, k=3):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(N, rows, k, generator=g), torch.randn(N, rows, 2, generator=g)) for _ in range(steps)]


def _hooked():
    m = nn.Sequential(nn.Linear(3, 2))
    m[0].register_forward_hook(lambda mod, i, o: None)
    return m


@pytest.mark.parametrize("make, why", [
    (RawParameter, r"'' \(RawParameter\) holds parameters \(scale\)|the model \(RawParameter\) holds parameters"),
    (lambda: nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)), r"BatchNorm1d\) holds buffers"),
    (lambda: nn.Sequential(Sub(3, 2)), r"\(Sub\) holds parameters"),
    (_hooked, "has hooks"),
    (lambda: nn.Sequential(nn.Embedding(5, 3, padding_idx=0)), "padding_idx"),
])
def test_a_model_merged_cannot_run_is_vmapped_from_the_start_with_the_reason(make, why):
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match=r"mode='merged' cannot run these replicas as one batch \(.*" + why):
        eng = _engine(make(), "merged")
    assert eng.mode == "vmap"
    assert reason_not_mergeable(make()) is not None


def _step_both(make, loss_fn, data, steps=6):
    torch.manual_seed(0)
    model = make()
    eng = _engine(model, "merged", steps=steps)
    torch.manual_seed(0)
    ref = _engine(make(), "vmap", steps=steps)
    la = [eng.step(data[t], loss_fn, stacked=True) for t in range(steps)]
    lb = [ref.step(data[t], loss_fn, stacked=True) for t in range(steps)]
    return eng, ref, torch.stack(la), torch.stack(lb)


@pytest.mark.parametrize("make, loss_fn, why", [
    (RowMixing, xy_loss, "the forward mixes the rows of its batch"),
    (lambda: Returns("scalar"), lambda m, b: m(b[0]), "does not split into the 4 replicas' rows"),
    (lambda: Returns("rows"), lambda m, b: F.mse_loss(m(b[0]) + m.lin.bias, b[1]), r"reads the module's 'lin'"),
    (lambda: Returns("rows"), lambda m, b: F.mse_loss(m(torch.ones(B, 3)), b[1]), "shared by the replicas"),
    (lambda: Returns("rows"), lambda m, b: F.mse_loss(m(b[0][0]), b[1][0]), "a Linear got an input of shape"),
    (HardBatch, xy_loss, r"RuntimeError: shape '\[3, 3\]' is invalid"),
    (Boxed, lambda m, b: F.mse_loss(m(b[0]).y, b[1]), "returned a Out, whose tensors cannot be split"),
])
def test_a_step_merged_would_get_wrong_is_checked_and_run_vmapped_as_vmap_runs_it(make, loss_fn, why):
    """What the module's structure cannot show: the first step is computed both ways (or cannot be merged at all), the
    engine says why and runs vmap, and the run is the vmapped engine's."""
    data = _xy(6)
    with pytest.warns(UserWarning, match=why):
        eng, ref, la, lb = _step_both(make, loss_fn, data)
    assert eng.mode == "vmap"
    _assert_same(eng, ref, la, lb, rtol=0, atol=0)


def test_a_forward_that_mixes_rows_only_at_a_later_step_is_caught_there_and_not_applied():
    """A NotMergeable raised after the first step (here: a new batch size the module cannot split) happens in the
    forward, before any gradient or weight changed; the engine goes on vmapped from that very step."""
    eng = _engine(nn.Sequential(nn.Linear(3, 2)), "merged", steps=6)
    ref = _engine(nn.Sequential(nn.Linear(3, 2)), "vmap", steps=6)
    for e in (eng, ref):
        torch.manual_seed(0)
        nn.init.normal_(e.stacked_params["0.weight"])
    with torch.no_grad():
        ref.stacked_params["0.weight"].copy_(eng.stacked_params["0.weight"])
        ref.stacked_params["0.bias"].copy_(eng.stacked_params["0.bias"])
    data = _xy(2)

    def later(m, b):  # a module call the merged batch cannot take, from step 2 on: an input shared by the replicas
        return F.mse_loss(m(b[0] if later.t < 2 else torch.ones(B, 3)), b[1])
    for t in range(1, 4):
        later.t = t
        if t == 2:
            with pytest.warns(UserWarning, match="shared by the replicas"):
                la = eng.step(data[t % 2], later, stacked=True)
        else:
            la = eng.step(data[t % 2], later, stacked=True)
        lb = ref.step(data[t % 2], later, stacked=True)
        torch.testing.assert_close(la, lb)
    assert eng.mode == "vmap"
    _assert_same(eng, ref, la, lb, rtol=1e-6, atol=1e-7)


def test_merged_refuses_compile_and_explored_module_state():
    with pytest.raises(ValueError, match="compile=False with mode='merged'"):
        _engine(_gpt(), "merged", compile=True)
    m = _gpt(dropout=0.1)
    with pytest.raises(ValueError, match="hyperparameters that vmap can batch"):
        ReplicaEngine(m, N, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
                      lambda o, rep, mod: hdet.OneCycleAutoLR(o, max_lr=1e-2, total_steps=5,
                                                              ensemble_lr_spread_ratio=0.2, model_sync_interval=2,
                                                              replicas=rep, model=mod,
                                                              explore=[hdet.Dropout(mod, alpha=0.05)]),
                      mode="merged")


def test_a_resumed_merged_engine_continues_exactly_and_averaged_swaps_in_the_mean():
    data = _tokens(12)
    full = _engine(_gpt(), "merged")
    l_full = [full.step(data[t], lm_loss, stacked=True) for t in range(12)]
    first = _engine(_gpt(), "merged")
    for t in range(5):
        first.step(data[t], lm_loss, stacked=True)
    state = first.state_dict()
    with first.averaged():
        mean = [p.detach().clone() for p in first.models[0].parameters()]
        assert all(torch.equal(a, b) for m in first.models[1:] for a, b in zip(mean, m.parameters()))
    want = [torch.stack([p for p in ps]).mean(0) for ps in zip(*[list(m.parameters()) for m in first.models])]
    for a, b in zip(mean, want):
        torch.testing.assert_close(a, b)
    second = _engine(_gpt(), "merged")
    second.load_state_dict(state)
    l_second = [second.step(data[t], lm_loss, stacked=True) for t in range(5, 12)]
    torch.testing.assert_close(torch.stack(l_second), torch.stack(l_full[5:]), rtol=0, atol=0)
    for a, b in zip(full.models, second.models):
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_a_non_finite_replica_is_left_out_and_reset_as_in_vmap():
    data = _tokens(8)

    def run(mode):
        eng = _engine(_gpt(), mode, steps=8, opt="sgd")
        out = []
        for t in range(8):
            if t == 2:
                with torch.no_grad():
                    eng.models[1].head.weight[0, 0] = float("nan")
            if t == 3:
                with pytest.warns(UserWarning, match=r"replica\(s\) \[1\]"):
                    out.append(eng.step(data[t], lm_loss, stacked=True))
            else:
                out.append(eng.step(data[t], lm_loss, stacked=True))
        return eng, torch.stack(out)
    merged, lm = run("merged")
    vm, lv = run("vmap")
    assert merged.mode == "merged"
    assert all(torch.isfinite(p).all() for m in merged.models for p in m.parameters())
    torch.testing.assert_close(lm.nan_to_num(7.0), lv.nan_to_num(7.0), rtol=2e-4, atol=2e-5)
    _assert_same(merged, vm, lm.nan_to_num(7.0), lv.nan_to_num(7.0), rtol=2e-4, atol=2e-5)


def test_autocast_bf16_runs_merged_close_to_vmap():
    data = _tokens(4)

    def run(mode):
        eng = _engine(_gpt(), mode, steps=4)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return eng, torch.stack([eng.step(data[t], lm_loss, stacked=True) for t in range(4)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        merged, lm = run("merged")
    vm, lv = run("vmap")
    assert merged.mode == "merged"
    torch.testing.assert_close(lm, lv, rtol=2e-2, atol=2e-2)


def test_the_proxy_gives_plain_attributes_and_refuses_layers():
    eng = _engine(_gpt(), "merged", steps=3)
    seen = {}

    def loss_fn(m, b):
        seen["training"], seen["heads"] = m.training, m.blocks[0].heads if False else None
        return lm_loss(m, b)
    eng.step(_tokens(1)[0], loss_fn, stacked=True)
    assert seen["training"] is True and eng.mode == "merged"
    from hdet.merged import MergedReplicas, _Proxy
    proxy = _Proxy(MergedReplicas(eng.models[0], eng.stacked_params, N))
    with pytest.raises(NotMergeable, match="'blocks'"):
        proxy.blocks  # noqa: B018
    with pytest.raises(NotMergeable, match="sets the module's 'x'"):
        proxy.x = 1


def test_a_bytegpt_state_dict_from_before_the_position_layer_loads():
    m = _gpt()
    old = {("pos" if k == "pos.weight" else k): v for k, v in m.state_dict().items()}
    fresh = ByteGPT(CTX, 16, 2, 2)
    fresh.load_state_dict(old)
    assert torch.equal(fresh.pos.weight, m.pos.weight)


@pytest.mark.parametrize("how", ["rmsprop", "stacked_optimizer=False"])
def test_merged_trains_with_each_replicas_own_optimizer_as_vmap_does(how):
    """An optimizer the stacked step does not take (or stacked_optimizer=False): each replica's optimizer.step() reads
    its .grad, which a merged step must point at its rows of the stacked gradient (it left them None: nothing
    trained, silently; a review, 2026-11-29)."""
    data = _tokens(8)
    kw = dict(opt="rmsprop") if how == "rmsprop" else dict(opt="sgd", stacked_optimizer=False)
    merged, lm = _run(_gpt, "merged", data, lm_loss, steps=8, **kw)
    vm, lv = _run(_gpt, "vmap", data, lm_loss, steps=8, **kw)
    assert merged.mode == "merged" and merged.optimizer_path.startswith("per-replica")
    start = _gpt()
    assert not torch.equal(merged.models[0].head.weight, start.head.weight)  # it trained
    torch.testing.assert_close(lm, lv, rtol=2e-4, atol=2e-5)  # (RMSprop, like Adam, turns the key bias's rounding
    _assert_same(merged, vm, lm, lv, **(dict(rtol=1e-3, atol=2e-3) if how == "rmsprop" else dict(rtol=2e-4, atol=2e-5)))
    # noise, its true gradient 0, into full steps)


class Unused(nn.Module):
    """A layer the loss reaches only on odd steps (``self.t``): its gradient is None on the others."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 2)
        self.b = nn.Linear(3, 2)
        self.t = 0

    def forward(self, x):
        return self.a(x) + (self.b(x) if self.t % 2 else 0)


def test_a_parameter_the_loss_skips_at_a_step_gets_no_gradient_as_in_vmap():
    data = _xy(8)
    engines = {}
    for mode in ("merged", "vmap"):
        torch.manual_seed(0)
        eng = _engine(Unused(), mode, steps=8)
        out = []
        for t in range(8):
            for m in eng.models:
                m.t = t
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (the engine's note that it steps each replica from then on)
                out.append(eng.step(data[t], xy_loss, stacked=True))
        engines[mode] = (eng, torch.stack(out))
    (merged, lm), (vm, lv) = engines["merged"], engines["vmap"]
    assert merged.mode == "merged"
    _assert_same(merged, vm, lm, lv, rtol=1e-5, atol=1e-6)


class Centred(nn.Module):
    """Centres each feature over the batch after a bias-free layer: mixes the rows, which equal replicas on one batch
    cannot show."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2, bias=False)

    def forward(self, x):
        h = self.lin(x)
        return h - h.mean(0, keepdim=True)


@pytest.mark.parametrize("make", [Centred, lambda: nn.Sequential(nn.Linear(3, 2)).append(Flip())])
def test_row_mixing_is_caught_when_every_replica_gets_the_same_batch(make):
    """Full-batch training (every replica the same batch) from equal weights: merged and vmap agree at the first step
    even for a forward that mixes rows, so the check also changes replica 0's weights alone and asks that no other
    replica's loss or gradient moves (a review found the first check passed here and the runs parted later)."""
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(B, 3, generator=g), torch.randn(B, 2, generator=g)
    data = [(x.expand(N, B, 3), y.expand(N, B, 2))] * 6
    with pytest.warns(UserWarning, match="changing replica 0's weights and inputs changed the other replicas"):
        eng, ref, la, lb = _step_both(make, xy_loss, data)
    assert eng.mode == "vmap"
    _assert_same(eng, ref, la, lb, rtol=0, atol=0)


class Flip(nn.Module):
    def forward(self, h):
        return h.flip(0)


class InputScaled(nn.Module):
    """Standard layers, but the forward scales its input by the batch's largest value (or its spread): merged, by the
    replicas' together."""

    def __init__(self, stat="amax"):
        super().__init__()
        self.stat, self.lin = stat, nn.Linear(3, 2)

    def forward(self, x):
        return self.lin(x / (x.abs().amax() if self.stat == "amax" else x.std(correction=0)))


def test_a_statistic_of_the_inputs_that_the_first_batch_hides_is_caught():
    """Every replica's first batch has the same spread (each scaled to a standard deviation of 1), so merged and vmap
    agree there and moving replica 0's weights moves no other replica: the check also changes replica 0's inputs (an
    audit found a batch statistic of the inputs hidden this way, the merged run scaling each replica by the others'
    data from the second step on, silently)."""
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(N, B, 3, generator=g), torch.randn(N, B, 2, generator=g)) for _ in range(6)]
    x0 = data[0][0]
    x0 -= x0.reshape(N, -1).mean(1).view(N, 1, 1)  # (every replica's mean 0 and spread 1 at the first step: the
    x0 /= x0.reshape(N, -1).std(1, correction=0).view(N, 1, 1)  # merged batch's too)
    with pytest.warns(UserWarning, match="changing replica 0's weights and inputs changed the other replicas"):
        eng, ref, la, lb = _step_both(lambda: InputScaled("std"), xy_loss, data)
    assert eng.mode == "vmap"
    _assert_same(eng, ref, la, lb, rtol=0, atol=0)


def test_under_autocast_a_forward_that_mixes_its_inputs_is_caught():
    """Under autocast the first check allows 5e-2 (bfloat16 rounding), more than the mixing of an input's spread over
    the merged batch moved the losses here (an audit: it stayed merged, each replica's loss moving with the others'
    data): changing replica 0's inputs moves the others' far more."""
    g = torch.Generator().manual_seed(6)
    data = [(torch.randn(N, 256, 3, generator=g), torch.randn(N, 256, 2, generator=g)) for _ in range(3)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.warns(UserWarning, match="changing replica 0's weights and inputs changed the other replicas"):
            eng, ref, la, lb = _step_both(lambda: InputScaled("std"), xy_loss, data, steps=3)
    assert eng.mode == "vmap"
    _assert_same(eng, ref, la, lb, rtol=0, atol=0)


def test_half_precision_parameters_get_half_precisions_tolerance_and_mixing_is_still_caught():
    """bf16 parameters round as autocast does (an H200's bf16 GEMMs, merged against vmapped, differed by 6e-4 where
    float32's 1e-4 was allowed: a bf16 model ran vmapped, warned, for nothing); a forward mixing rows is still caught."""
    from hdet.merged import tolerance
    cpu = torch.device("cpu")
    assert tolerance([torch.zeros(2)], cpu) == 1e-4
    assert tolerance([torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16)], cpu) == 5e-2
    assert tolerance([torch.zeros(2, dtype=torch.float16)], cpu) == 5e-2
    g = torch.Generator().manual_seed(6)
    data = [(torch.randn(N, 256, 3, generator=g).bfloat16(), torch.randn(N, 256, 2, generator=g).bfloat16())
            for _ in range(3)]
    with pytest.warns(UserWarning, match="changing replica 0's weights and inputs changed the other replicas"):
        eng, ref, la, lb = _step_both(lambda: InputScaled("std").bfloat16(), xy_loss, data, steps=3)
    assert eng.mode == "vmap"
    _assert_same(eng, ref, la, lb, rtol=0, atol=0)


@pytest.mark.parametrize("target", ["labels", "embedding"])
def test_float_inputs_that_hold_indices_stay_merged(target):
    """The check's change of replica 0's floating-point inputs (2 x + 1) made float labels cast in the loss, or float
    indices into an embedding, point past their table, and the error escaped the step (a review: it ran merged
    before): such inputs are replaced by replica 1's instead, and the run stays merged, as vmap's."""
    g = torch.Generator().manual_seed(8)
    if target == "labels":
        make = lambda: nn.Sequential(nn.Linear(3, 3))  # noqa: E731
        fn = lambda m, b: F.cross_entropy(m(b[0]), b[1].long())  # noqa: E731
        data = [(torch.randn(N, B, 3, generator=g), torch.randint(0, 3, (N, B), generator=g).float())
                for _ in range(4)]
    else:
        make = lambda: nn.Sequential(nn.Embedding(10, 2))  # noqa: E731
        fn = lambda m, b: F.mse_loss(m(b[0].long()), b[1])  # noqa: E731
        data = [(torch.randint(0, 10, (N, B), generator=g).float(), torch.randn(N, B, 2, generator=g))
                for _ in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eng, ref, la, lb = _step_both(make, fn, data, steps=4)
    assert eng.mode == "merged"
    _assert_same(eng, ref, la, lb)


class InPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x):
        x /= 4.0  # (as `x /= 255` on image batches)
        return self.lin(x)


def test_a_forward_that_writes_into_its_input_is_checked_on_copies():
    """The first step's check ran its forwards on the caller's batch: a forward that divides its input in place found
    it divided by the check's runs, the check blamed row mixing, and the step ran on an input divided three times (an
    audit): the check's forwards get copies; the run is vmap's, and the caller's batch is divided once, as vmap
    leaves it."""
    base = _xy(4)
    runs = {}
    for mode in ("merged", "vmap"):
        data = [(x.clone(), y.clone()) for x, y in base]
        torch.manual_seed(0)
        eng = _engine(InPlace(), mode, steps=4)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            losses = torch.stack([eng.step(data[t], xy_loss, stacked=True) for t in range(4)])
        runs[mode] = (eng, losses, data)
    (eng, la, da), (ref, lb, db) = runs["merged"], runs["vmap"]
    assert eng.mode == "merged"
    _assert_same(eng, ref, la, lb)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[0], x / 4) for a, b, (x, _) in zip(da, db, base))


def test_the_check_turns_every_functional_dropout_off():
    """The first-step check compares the merged batch with vmap with dropout off: F.dropout only, before (an audit),
    so nn.AlphaDropout, nn.Dropout1d/2d/3d and the attention's own dropout_p stayed on; all are off inside now, and
    back after."""
    from hdet.merged import no_dropout
    g = torch.Generator().manual_seed(7)
    x, q = torch.randn(4, 3, 5, 6, generator=g), torch.randn(2, 2, 4, 8, generator=g)
    sdpa = F.scaled_dot_product_attention
    with no_dropout():
        for name in ("dropout", "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d"):
            assert torch.equal(getattr(F, name)(x if name != "dropout1d" else x[0], 0.5, True),
                               x if name != "dropout1d" else x[0]), name
        for kw in ({"dropout_p": 0.9}, {}):
            got = F.scaled_dot_product_attention(q, q, q, None, 0.9) if not kw else F.scaled_dot_product_attention(
                q, q, q, **kw)
            assert torch.equal(got, sdpa(q, q, q))
    assert F.scaled_dot_product_attention is sdpa
    assert not torch.equal(F.alpha_dropout(x, 0.5, True), x)


def test_the_check_changes_nothing_a_user_sees():
    """The first merged step's two checks (against vmap, and replica 0 moved alone) leave the weights, the random
    state and the gradients as they were: the run equals one whose check is skipped."""
    data = _tokens(4)
    eng = _engine(_gpt(dropout=0.2), "merged", steps=4)
    torch.manual_seed(11)
    la = [eng.step(data[t], lm_loss, stacked=True) for t in range(4)]
    skip = _engine(_gpt(dropout=0.2), "merged", steps=4)
    from hdet.engine import _merge_key

    skip._merge_checked[_merge_key(data[0], lm_loss)[0]] = []
    torch.manual_seed(11)
    lb = [skip.step(data[t], lm_loss, stacked=True) for t in range(4)]
    assert eng.mode == skip.mode == "merged"
    _assert_same(eng, skip, torch.stack(la), torch.stack(lb), rtol=0, atol=0)


def test_a_layer_with_a_forward_of_its_own_is_not_merged():
    m = nn.Sequential(nn.Linear(3, 2))
    m[0].forward = lambda x: torch.zeros(x.shape[0], 2)  # e.g. a wrapper put on the instance
    assert "forward of its own" in reason_not_mergeable(m)
    with pytest.warns(UserWarning, match="forward of its own"):
        eng = _engine(m, "merged")
    assert eng.mode == "vmap" and "forward" in eng.models[0][0].__dict__


def test_an_engine_state_saved_before_the_position_layer_loads_and_goes_on_exactly():
    """A ReplicaEngine (or `hdet train --resume`) state of ByteGPT from before its positions were an nn.Embedding:
    the key was `pos`; the model's own load hook maps it, and the engine's check of the state sees it mapped."""
    data = _tokens(8)
    full = _engine(_gpt(), "vmap", steps=8)
    l_full = [full.step(data[t], lm_loss, stacked=True) for t in range(8)]
    first = _engine(_gpt(), "vmap", steps=8)
    for t in range(3):
        first.step(data[t], lm_loss, stacked=True)
    state = first.state_dict()
    for rs in state["replicas"]:
        rs["model"] = {("pos" if k == "pos.weight" else k): v for k, v in rs["model"].items()}
    second = _engine(_gpt(), "vmap", steps=8)
    second.load_state_dict(state)
    l_second = [second.step(data[t], lm_loss, stacked=True) for t in range(3, 8)]
    torch.testing.assert_close(torch.stack(l_second), torch.stack(l_full[3:]), rtol=0, atol=0)


def test_cuda_graph_needs_a_cuda_device_and_no_loop_or_compile():
    with pytest.raises(ValueError, match="cuda_graph=True with mode 'auto', 'vmap' or 'merged', compile=False and the "
                                         "model on a CUDA device, but got mode='merged', compile=False on cpu"):
        _engine(_gpt(), "merged", cuda_graph=True)
    with pytest.raises(ValueError, match="mode='loop', compile=False"):
        _engine(_gpt(), "loop", cuda_graph=True)
    with pytest.raises(ValueError, match=r"mode='loop' \(explored \['dropout'\] need the loop\)"):
        ReplicaEngine(_gpt(dropout=0.1), N, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
                      lambda o, rep, mod: hdet.OneCycleAutoLR(o, max_lr=1e-2, total_steps=5,
                                                              ensemble_lr_spread_ratio=0.2, model_sync_interval=2,
                                                              replicas=rep, model=mod,
                                                              explore=[hdet.Dropout(mod, alpha=0.05)]),
                      cuda_graph=True)


@pytest.mark.parametrize("mode", ["merged", "vmap"])
def test_an_id_out_of_the_tables_range_reads_nan_not_another_replicas_row(mode):
    """Ids V (one past the table) and -1 on replicas 1 and 2, where one replica's lookup raises: the stacked tables were
    looked up as one, and vmap read replica 2's row 0 for replica 1's id V, merged the last row for -1, silently (an
    audit). They read NaN now (the replica's loss is NaN: its step is left out, and the sync says so); the others read
    their own rows."""
    V, D = 7, 4
    torch.manual_seed(0)
    eng = _engine(nn.Sequential(nn.Embedding(V, D)), mode, steps=2)
    with torch.no_grad():  # row value = r * V + row
        eng.stacked_params["0.weight"].copy_(torch.arange(N * V, dtype=torch.float).view(N, V, 1).expand(N, V, D))
    x = torch.zeros(N, 1, 1, dtype=torch.long)
    x[1, 0, 0], x[2, 0, 0], x[3, 0, 0] = V, -1, V - 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = eng.step(x, lambda m, b: m(b)[..., 0].sum(), stacked=True)
    assert eng.mode == mode
    assert got[0] == 0.0 and got[3] == 3 * V + V - 1 and got[1].isnan() and got[2].isnan()


def _loop_and_merged(make_model, batches, loss_fns):
    """The replicas in the loop and merged, on the same batches, a loss function a step: (loop, merged) engines and
    losses, and the merged run's hdet warnings."""
    out = []
    for mode in ("loop", "merged"):
        torch.manual_seed(0)
        eng = _engine(make_model(), mode, steps=len(batches), opt="sgd")
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            losses = torch.stack([eng.step(b, f, stacked=True).detach().clone() for b, f in zip(batches, loss_fns)])
        out.append((eng, losses, [str(w.message) for w in said if "mode='merged' cannot" in str(w.message)]))
    return out


class _Mixer(nn.Module):
    """``forward(x, mix)``: with ``mix``, each row averaged with its mirror row in the batch (mixes its batch's rows)."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(5, 8), nn.Linear(8, 2)

    def forward(self, x, mix=False):
        h = torch.tanh(self.l1(x))
        return self.l2(0.5 * h + 0.5 * h.flip(0) if mix else h)


class _Ghost(nn.Module):
    """Statistics over chunks of 4 rows (ghost batch norm): a chunk crosses the replicas once a replica's rows are
    not a multiple of 4."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(5, 8, bias=False), nn.Linear(8, 2)

    def forward(self, x):
        h = self.l1(x)
        return self.l2(torch.relu(torch.cat([F.batch_norm(c, None, None, training=True) for c in h.split(4, 0)])))


class _LastRow(nn.Module):
    """Each row relative to its batch's last row (``x[-1:]``, a leading axis of 1, taken for an input every replica
    shares)."""

    def __init__(self):
        super().__init__()
        self.l1, self.lr, self.l2 = nn.Linear(5, 8), nn.Linear(5, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x) - self.lr(x[-1:])))


def _mix_loss(m, b, mix):
    return F.mse_loss(m(b[0], mix=mix), b[1])


@pytest.mark.parametrize("case", ["second_loss_same_code", "new_batch_shape", "last_rows"])
def test_what_the_first_step_check_did_not_see_falls_back_later(case):
    """Three ways a merged run mixed the replicas' rows unseen (an audit): a second loss function with the first's code
    (a partial with other arguments: 0.02 off the loop's weights), a batch of a new shape (chunk statistics that now
    cross replicas: 9e-3), and a forward that reads its batch's last rows (every replica got replica N-1's: 0.06, when
    the first batch was the same on every replica). Each new (loss function, batch shapes) is checked at its first
    merged step, and the check moves the last replica as well as the first: the run falls back to vmap, as the loop."""
    g = torch.Generator().manual_seed(3)
    rows = [8, 8, 6, 6] if case == "new_batch_shape" else [6] * 4
    batches = [(torch.randn(N, r, 5, generator=g), torch.randn(N, r, 2, generator=g)) for r in rows]
    fns = [xy_loss] * 4
    if case == "second_loss_same_code":
        import functools
        fns = [functools.partial(_mix_loss, mix=False)] * 2 + [functools.partial(_mix_loss, mix=True)] * 2
    if case == "last_rows":  # the first batch the same for every replica (equal replicas mix unseen on it)
        batches[0] = tuple(t[:1].expand_as(t).contiguous() for t in batches[0])
    model = {"second_loss_same_code": _Mixer, "new_batch_shape": _Ghost, "last_rows": _LastRow}[case]
    (loop, l_loop, _), (merged, l_merged, said) = _loop_and_merged(model, batches, fns)
    assert merged.mode == "vmap" and len(said) == 1
    _assert_same(merged, loop, l_merged, l_loop)


def test_a_loss_closing_over_a_per_step_value_is_checked_once():
    """A loss function written inline each step over a changing weight (a ramp): one function, checked once, still
    merged after 20 steps (keyed by its closure's values, each step was a new one: 16 checks, then vmap; a review)."""
    torch.manual_seed(0)
    eng = _engine(nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2)), "merged", steps=20, opt="sgd")
    g = torch.Generator().manual_seed(5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for t in range(20):
            ramp = min(1.0, (t + 1) / 10)
            b = (torch.randn(N, 6, 5, generator=g), torch.randn(N, 6, 2, generator=g))
            eng.step(b, lambda m, b: ramp * F.mse_loss(m(b[0]), b[1]), stacked=True)
    assert eng.mode == "merged" and len(eng._merge_checked) == 1


def test_the_checks_vmapped_run_routes_attention_as_a_step_does():
    """The first-step check's vmapped run, with dropout off, still routes SDPA through hdet.attention (one fused call
    for the replicas): it did not (the dropout-free wrapper hid torch's SDPA from the routing), and on an H200 vmap's
    own SDPA backward failed ("LSE is not correctly aligned"), so the first merged step raised (found by the GPU tests,
    2026-11-30). Entered in either order."""
    import hdet.attention as attention
    from hdet.merged import no_dropout
    q = torch.randn(2, 2, 4, 8, generator=torch.Generator().manual_seed(7))
    for outer, inner in ((no_dropout, attention.routed), (attention.routed, no_dropout)):
        with outer(), inner():
            f = F.scaled_dot_product_attention
            assert f.__wrapped__ is attention.scaled_dot_product_attention and f._hdet_without_dropout
            assert torch.equal(f(q, q, q, dropout_p=0.9), attention.scaled_dot_product_attention(q, q, q))
    assert F.scaled_dot_product_attention is attention._SDPA


def test_the_fused_layer_norm_is_for_cuda_tensors_only(monkeypatch):
    """hdet.kernels' layer norm (Triton) takes CUDA float32 rows only: on the CPU the merged replicas' norms stay
    torch's layer_norm and addcmul (what every test above runs), and the gate never imports Triton there."""
    from hdet import kernels

    x, w, b = torch.zeros(2, 3, 4), torch.ones(2, 4), torch.zeros(2, 4)
    monkeypatch.setattr(kernels, "MIN_ELEMENTS", 0)
    monkeypatch.setattr(kernels, "EAGER_LAYER_NORM", True)  # (else every step says no before the device is asked)
    monkeypatch.setattr(kernels, "_ready", lambda device: pytest.fail("Triton checked for CPU tensors"))
    assert not kernels.layer_norm_usable(x, w, b)
    assert not kernels.layer_norm_usable(x.cuda() if torch.cuda.is_available() else x, None, b)
    monkeypatch.setattr(kernels, "layer_norm_rows", lambda *a: pytest.fail("the fused norm ran on the CPU"))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    eng = ReplicaEngine(net, 2, lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                        lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=0.1, total_steps=3, replicas=rep, model=m),
                        mode="merged")
    eng.step(torch.randn(2, 3, 4), lambda m, x: m(x).pow(2).mean(), stacked=True)
    with kernels.for_graphs():
        assert kernels._wanted_here()
        eng.step(torch.randn(2, 3, 4), lambda m, x: m(x).pow(2).mean(), stacked=True)
    assert eng.mode == "merged"
    monkeypatch.setattr(kernels, "EAGER_LAYER_NORM", False)
    assert not kernels._wanted_here()
    with kernels.for_graphs():
        assert kernels._wanted_here()
    assert not kernels._wanted_here()