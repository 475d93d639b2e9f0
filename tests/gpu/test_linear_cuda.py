"""hdet.linear on a GPU: large layers with a bias run one addmm per replica (cuBLASLt's bias epilogue) and compute what
the batched matmul does, in float32 (TF32 off and on) and under bf16 autocast, in the engine's merged mode too (run on
the GPU machine: `python -m pytest tests/gpu`)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hdet
import hdet.linear
from hdet.engine import ReplicaEngine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _layer(per_replica, autocast, monkeypatch, bias=True, native=False, shape=(4096, 1024, 96)):
    """y and the gradients of a 3-replica layer (by default large enough for the per-replica path: 4096 rows x 1024
    outputs), with it on or off, how many addmm calls it made, and whether hdet's autograd.Function computed it
    (``native``: torch's baddbmm where the layer is below NATIVE_MAX)."""
    monkeypatch.setattr(hdet.linear, "PER_REPLICA_MIN", 1 << 22 if per_replica else float("inf"))
    calls = []
    addmm = torch.addmm
    monkeypatch.setattr(hdet.linear, "_ADDMM", lambda *a, **k: calls.append(1) or addmm(*a, **k))
    rows, out, inp = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(3, rows, inp, device="cuda", generator=g).requires_grad_()
    w = (torch.randn(3, out, inp, device="cuda", generator=g) / 10).requires_grad_()
    b = torch.randn(3, out, device="cuda", generator=g).requires_grad_() if bias else None
    dy = torch.randn(3, rows, out, device="cuda", generator=g)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        y = hdet.linear.batched_linear(x, w, b, native=native)
    function = isinstance(y.grad_fn, torch.autograd.function.BackwardCFunction)
    y.float().backward(dy)
    return y.detach(), [t.grad for t in (x, w, b) if t is not None], len(calls), function


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("tf32", [False, True])
def test_one_addmm_per_replica_matches_the_batched_matmul(autocast, tf32, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", tf32)
    y0, g0, n0, _ = _layer(False, autocast, monkeypatch)
    y1, g1, n1, _ = _layer(True, autocast, monkeypatch)
    assert (n0, n1) == (0, 3)
    assert y1.dtype == y0.dtype == (torch.bfloat16 if autocast else torch.float32)
    tol = dict(rtol=2e-2, atol=2e-2) if autocast or tf32 else dict(rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(y1.float(), y0.float(), **tol)
    want = torch.stack([F.linear(x_, w_, b_) for x_, w_, b_ in zip(*(t.detach().double() for t in _inputs_again()))])
    err = (y1.double() - want).abs().max() / want.abs().max()
    assert err < (2e-2 if autocast or tf32 else 1e-6)  # both against float64: the per-replica path is not just
    # equal to the batched one, it is right
    for a, r in zip(g1, g0):  # (the backward is the same code: equal)
        torch.testing.assert_close(a, r)


def _inputs_again():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(3, 4096, 96, device="cuda", generator=g)
    w = torch.randn(3, 1024, 96, device="cuda", generator=g) / 10
    b = torch.randn(3, 1024, device="cuda", generator=g)
    return x, w, b


def test_small_layers_and_layers_without_a_bias_keep_the_batched_matmul(monkeypatch):
    assert _layer(True, False, monkeypatch, bias=False)[2] == 0
    x, w, b = (torch.randn(3, 64, 8, device="cuda"), torch.randn(3, 16, 8, device="cuda"),
               torch.randn(3, 16, device="cuda"))
    assert not hdet.linear._per_replica(x, w, b)


def test_the_engine_trains_the_same_with_one_addmm_per_replica(monkeypatch):
    """An MLP whose layers take the per-replica path, 3 steps of 3 replicas, against the batched matmul (merged: on a
    GPU the vmapped replicas' F.linear is torch's, ReplicaEngine._linear)."""
    mode = "merged"
    out, calls = {}, []
    addmm = torch.addmm
    monkeypatch.setattr(hdet.linear, "_ADDMM", lambda *a, **k: calls.append(per_replica) or addmm(*a, **k))
    for per_replica in (False, True):
        monkeypatch.setattr(hdet.linear, "PER_REPLICA_MIN", 1 << 20 if per_replica else float("inf"))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 1024), nn.GELU(), nn.Linear(1024, 8)).cuda()
        eng = ReplicaEngine(model, 3, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
                            lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=1e-3, total_steps=3, replicas=rep,
                                                                  ensemble_lr_spread_ratio=0.2, model=m), mode=mode)
        g = torch.Generator(device="cuda").manual_seed(1)
        x, y = torch.randn(3, 1024, 32, device="cuda", generator=g), torch.randn(3, 1024, 8, device="cuda", generator=g)
        losses = [eng.step((x, y), lambda m, b: F.mse_loss(m(b[0]), b[1]), stacked=True) for _ in range(3)]
        assert eng.mode == mode
        out[per_replica] = torch.stack(losses), [p.detach().clone() for p in eng.stacked_params.values()]
    assert calls and all(calls)  # the first layer's (1024 rows x 1024 outputs a replica), with the path on only
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-2, atol=1e-4)
    for a, b in zip(out[True][1], out[False][1]):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-4)


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_torchs_own_baddbmm_computes_what_the_function_does(autocast, bias, monkeypatch):
    """The merged replicas' small CUDA layers (``native=True``, below NATIVE_MAX) run torch's baddbmm with autograd's
    backward: y and every gradient as hdet's autograd.Function computes them (TF32 off), under bf16 autocast too."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    out = {native: _layer(False, autocast, monkeypatch, bias, native, shape=(64, 32, 48)) for native in (False, True)}
    assert (out[False][3], out[True][3]) == (True, False)  # (hdet's Function, then torch's baddbmm)
    assert out[True][0].dtype == out[False][0].dtype == (torch.bfloat16 if autocast else torch.float32)
    tol = dict(rtol=2e-2, atol=2e-2) if autocast else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[True][0].float(), out[False][0].float(), **tol)
    for a, r in zip(out[True][1], out[False][1]):
        torch.testing.assert_close(a, r, **tol)


def test_the_merged_engine_trains_the_same_with_torchs_own_baddbmm(monkeypatch):
    """A small GPT, 4 replicas merged, 10 steps with two syncs: with torch's baddbmm for its layers (the default below
    NATIVE_MAX) losses, weights and LRs as with hdet's autograd.Function (NATIVE_MAX 0), TF32 off."""
    from hdet.app.tasks import ByteGPT

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    native = hdet.linear._native
    out, calls = {}, []
    monkeypatch.setattr(hdet.linear, "_native", lambda *a: calls.append(limit) or native(*a))
    for limit in (0, hdet.linear.NATIVE_MAX):
        monkeypatch.setattr(hdet.linear, "NATIVE_MAX", limit)
        torch.manual_seed(0)
        eng = ReplicaEngine(ByteGPT(32, 64, 2, 2).cuda(), 4, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
                            lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=1e-3, total_steps=10, replicas=rep,
                                                                  ensemble_lr_spread_ratio=0.3, model_sync_interval=4,
                                                                  model=m), mode="merged")
        g = torch.Generator(device="cuda").manual_seed(1)
        data = torch.randint(0, 256, (10, 4, 8, 33), device="cuda", generator=g)
        losses = [eng.step(data[t], lambda m, b: F.cross_entropy(m(b[..., :-1]).reshape(-1, 256),
                                                                 b[..., 1:].reshape(-1)), stacked=True)
                  for t in range(10)]
        assert eng.mode == "merged"
        out[limit] = (torch.stack(losses), [p.detach().clone() for p in eng.stacked_params.values()],
                      [s.get_last_lr() for s in eng.schedulers])
    assert calls and all(calls) and hdet.linear.NATIVE_MAX > 0  # (torch's baddbmm by default, none at 0)
    torch.testing.assert_close(out[hdet.linear.NATIVE_MAX][0], out[0][0], rtol=1e-5, atol=1e-5)
    for a, b in zip(out[hdet.linear.NATIVE_MAX][1], out[0][1]):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)  # (Adam's rounding noise, as the graphed step's test)
    assert out[hdet.linear.NATIVE_MAX][2] == out[0][2]
