"""The fused passes over the engine's stacked weights and gradients (hdet.kernels, Triton) on a GPU, against float64
references and against torch's ops in the engine (run on the GPU machine: `python -m pytest tests/gpu`)."""

import importlib.util

import pytest
import torch
import torch.nn.functional as F

import hdet
from hdet import kernels
from hdet.app.tasks import ByteGPT
from hdet.engine import ReplicaEngine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d_rows", [1, 5, "5 strided"])
@pytest.mark.parametrize("decay", [True, False])
def test_scale_add_rows_is_one_rounding_of_the_exact_update_and_leaves_other_columns_alone(dtype, d_rows, decay):
    torch.manual_seed(0)
    N, D, a0, b0 = 5, 10007, 123, 9001  # a slice of columns at an odd offset, not a multiple of the block
    full = torch.randn(N, D, device="cuda").to(dtype)
    before = full.clone()
    th = full[:, a0:b0]
    d = torch.randn(5, b0 - a0 + 77, device="cuda").to(dtype)[:, 77:] if d_rows == "5 strided" else \
        torch.randn(d_rows, b0 - a0, device="cuda").to(dtype)
    a = 1 - 1e-3 * torch.arange(1, N + 1, device="cuda", dtype=torch.float32)
    b = -1e-2 * torch.arange(1, N + 1, device="cuda", dtype=torch.float32)
    want = (before[:, a0:b0].double() * (a.double()[:, None] if decay else 1) + b.double()[:, None] * d.double())
    kernels.scale_add_rows_(th, d, a.view(N, 1) if decay else None, b.view(N, 1))
    assert th.dtype == dtype
    eps = torch.finfo(dtype).eps  # (float32: computed in float32, the product maybe fused: within an ulp or two)
    torch.testing.assert_close(th.double(), want, rtol=2 * eps, atol=1e-6)
    assert torch.equal(full[:, :a0], before[:, :a0]) and torch.equal(full[:, b0:], before[:, b0:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [[], [2], [0, 3]])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_finite_row_mean_leaves_out_every_row_holding_a_nan_or_inf(dtype, bad, value, where):
    torch.manual_seed(1)
    N, D = 4, 70001
    G = torch.randn(N, D, device="cuda").to(dtype)
    col = {"first": 0, "middle": D // 2, "last": D - 1}[where]
    for r in bad:
        G[r, col] = value
    keep = [r for r in range(N) if r not in bad]
    want = G[keep].double().sum(0) / N
    for dest in ("own", "row 0"):
        g = G.clone()
        out = g[:1] if dest == "row 0" else torch.empty(1, D, device="cuda", dtype=dtype)
        flags = kernels.finite_row_mean(g, out)
        assert flags.tolist() == [int(r in bad) for r in range(N)]
        tol = 1e-6 if dtype == torch.float32 else torch.finfo(dtype).eps
        torch.testing.assert_close(out[0].double(), want, rtol=tol, atol=tol)
        torch.testing.assert_close(g[1:], G[1:], rtol=0, atol=0, equal_nan=True)  # the other rows: read, not written


def test_finite_row_mean_keeps_an_overflowed_sum_of_finite_rows_as_torch_does():
    """Finite float32 rows whose sum overflows: no row is left out, the mean is Inf (torch's sum overflows the same)."""
    G = torch.full((4, 3000), 3e38, device="cuda")
    out = torch.empty(1, 3000, device="cuda")
    assert kernels.finite_row_mean(G, out).tolist() == [0, 0, 0, 0]
    assert bool(torch.isinf(out).all()) and bool(torch.isinf(G.sum(0) / 4).all())


def test_one_column_and_rows_past_two_to_the_31_elements():
    """A row stride of 1 (one column: Triton passes it as a constant) and offsets past 2^31 elements (64-bit)."""
    G = torch.tensor([[1.0], [float("nan")], [3.0]], device="cuda")
    out = torch.empty(1, 1, device="cuda")
    assert kernels.finite_row_mean(G, out).tolist() == [0, 1, 0] and out.item() == pytest.approx(4 / 3)
    th = torch.ones(3, 1, device="cuda")
    kernels.scale_add_rows_(th, torch.ones(1, 1, device="cuda"), None, torch.tensor([1.0, 2.0, 3.0], device="cuda"))
    assert th.flatten().tolist() == [2.0, 3.0, 4.0]
    if torch.cuda.mem_get_info()[0] < 24 * 2 ** 30:
        pytest.skip("the large case needs 24 GiB free")
    N, D = 3, 2 ** 30 + 3  # 3 x 2^30 bf16 elements: the last row starts past 2^31
    G = torch.zeros(N, D, device="cuda", dtype=torch.bfloat16)
    G[:, -1] = torch.tensor([1.0, 2.0, 4.0])
    G[2, -2] = float("inf")
    out = torch.empty(1, D, device="cuda", dtype=torch.bfloat16)
    assert kernels.finite_row_mean(G, out).tolist() == [0, 0, 1] and out[0, -1].item() == 1.0
    d = torch.zeros(1, D, device="cuda", dtype=torch.bfloat16)
    d[0, -1] = 1
    kernels.scale_add_rows_(G, d, None, torch.tensor([1.0, 1.0, 4.0], device="cuda"))
    assert G[:, -1].tolist() == [2.0, 3.0, 8.0] and G[2, -2].item() == float("inf") and G[2, 0].item() == 0.0


def _lm(m, b):
    logits = m(b[..., :-1])
    return F.cross_entropy(logits.reshape(-1, 256), b[..., 1:].reshape(-1))


def _groups(m):
    """Two param groups: matrices with the optimizer's weight decay, the rest without."""
    return [{"params": [p for p in m.parameters() if p.dim() > 1]},
            {"params": [p for p in m.parameters() if p.dim() <= 1], "weight_decay": 0.0}]


OPTIMIZERS = {
    "adamw": lambda m: torch.optim.AdamW(_groups(m), lr=1e-2, weight_decay=1.0, fused=True),
    "adam_l2": lambda m: torch.optim.Adam(_groups(m), lr=1e-2, weight_decay=0.1),  # coupled: N rows of moments
    "sgd_nesterov": lambda m: torch.optim.SGD(_groups(m), lr=1e-1, momentum=0.9, nesterov=True, weight_decay=0.1),
    "adamw_bf16": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=1.0, fused=True),
}


def _run(mode, fused_kernels, monkeypatch, optimizer="adamw", steps=3, nan_at=None, hook=None):
    calls = []
    with monkeypatch.context() as mp:
        for name in ("scale_add_rows_", "finite_row_mean"):
            real = getattr(kernels, name)
            mp.setattr(kernels, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
        mp.setattr(kernels, "AVAILABLE", fused_kernels)
        mp.setattr(kernels, "MIN_ELEMENTS", 0)  # (these models are small)
        mp.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
        torch.manual_seed(0)
        model = ByteGPT(32, 64, 2, 2).cuda()
        if optimizer.endswith("bf16"):
            model = model.to(torch.bfloat16)
        eng = ReplicaEngine(model, 4, OPTIMIZERS[optimizer],
                            lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=o.param_groups[0]["lr"], total_steps=12,
                                                                  ensemble_lr_spread_ratio=0.2, model_sync_interval=5,
                                                                  replicas=rep, model=m),
                            mode=mode, before_optimizer_step=hook)
        g = torch.Generator(device="cuda").manual_seed(1)
        data = torch.randint(0, 256, (12, 4, 8, 33), device="cuda", generator=g)
        for t in range(1, steps + 1):
            if t == nan_at:
                with torch.no_grad():
                    eng.models[1].blocks[0].qkv.weight[0, 0] = float("nan")
            eng.step(data[t - 1], _lm, stacked=True)
        assert eng.optimizer_path == "stacked"
        if optimizer.endswith("bf16"):  # merged, where float32's tolerance had sent bf16 weights to vmap, warned
            assert eng.mode == mode
    return [torch.cat([p.detach().float().flatten() for p in m.parameters()]) for m in eng.models], calls


@pytest.mark.parametrize("mode", ["vmap", "merged"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("hook", [None, "no-op"])
def test_the_engine_steps_the_same_with_the_fused_passes_as_with_torchs_ops(mode, optimizer, hook, monkeypatch):
    """Three steps at a weight decay whose factor moves the weights 1% a step (a decay left out or applied twice
    shows); two param groups (one without decay); coupled L2 (every replica its own moments: N rows of directions);
    SGD with Nesterov momentum; bf16 weights; a before_optimizer_step hook (each replica's gradient its own row)."""
    hook = (lambda r, m, o: None) if hook else None
    fused, calls = _run(mode, True, monkeypatch, optimizer, hook=hook)
    plain, plain_calls = _run(mode, False, monkeypatch, optimizer, hook=hook)
    assert calls.count("finite_row_mean") == 3 and calls.count("scale_add_rows_") >= 3 and not plain_calls
    for a, b in zip(fused, plain):
        _agree(a, b, **(dict(rtol=2e-2, atol=2e-3, bound=(4e-2, 6e-2)) if optimizer.endswith("bf16")  # (bf16: once
                        else dict(rtol=1e-4, atol=1e-6)))  # rounded against twice, 59% of the weights an ulp apart, 99%
        # within 1e-3, measured on an H200; an element whose gradient is about 0 can take Adam's step of lr = 1e-2 one
        # way in one run and the other way in the other: at most 2 lr a step, 6e-2 over the 3 steps; merged bf16,
        # checked since it stays merged, had one weight 0.016 apart, 99% within 2e-3)


def _agree(a, b, rtol, atol, most=0.99, bound=(0.0, 1e-3)):
    """``a`` and ``b`` agree to ``rtol``/``atol`` in ``most`` of their elements and within ``bound`` in all: the
    gradients' mean sums in another order (an ulp), and Adam turns that into a visible difference where an element's
    gradient is about 0 (a few per thousand here), where a decay left out or a wrong row moves nearly every one."""
    close = (a - b).abs() <= atol + rtol * b.abs()
    assert close.float().mean().item() >= most, (close.float().mean().item(), (a - b).abs().max().item())
    torch.testing.assert_close(a, b, rtol=bound[0], atol=bound[1])


@pytest.mark.parametrize("mode", ["vmap", "merged"])
def test_a_nan_replica_trains_the_same_with_the_fused_passes_as_with_torchs_ops(mode, monkeypatch):
    with pytest.warns(UserWarning, match=r"replica\(s\) \[1\]"):
        fused, calls = _run(mode, True, monkeypatch, steps=12, nan_at=4)
    with pytest.warns(UserWarning, match=r"replica\(s\) \[1\]"):
        plain, _ = _run(mode, False, monkeypatch, steps=12, nan_at=4)
    assert calls.count("finite_row_mean") == 12
    for a, b in zip(fused, plain):
        assert bool(torch.isfinite(a).all())
        _agree(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_the_kernels_run_on_their_tensors_device_not_the_current_one():
    assert torch.cuda.current_device() == 0
    dev = torch.device("cuda", 1)
    th = torch.ones(3, 5000, device=dev)
    kernels.scale_add_rows_(th, torch.ones(1, 5000, device=dev), torch.full((3,), 2.0, device=dev),
                            torch.tensor([1.0, 2.0, 3.0], device=dev))
    assert th[:, -1].tolist() == [3.0, 4.0, 5.0] and th.device == dev
    G = torch.arange(15000.0, device=dev).view(3, 5000)
    G[2, 7] = float("nan")
    out = torch.empty(1, 5000, device=dev)
    assert kernels.finite_row_mean(G, out).tolist() == [0, 0, 1]
    torch.testing.assert_close(out[0], (G[0] + G[1]) / 3)
    assert torch.cuda.current_device() == 0


@pytest.mark.parametrize("N,R,D", [(1, 1, 7), (3, 5, 768), (8, 1000, 1000), (2, 4097, 4096), (2, 3, 1)])
@pytest.mark.parametrize("nan_row", [False, True])
def test_the_replicas_layer_norm_and_its_backward_against_float64(N, R, D, nan_row):
    """kernels.layer_norm_rows: each replica's rows normalised with its own weight and bias (strided rows of a larger
    tensor, as the engine's flat weights are), against F.layer_norm per replica in float64; a NaN in one row of
    replica 0 stays in that row's outputs and replica 0's dw (db, the sum of dy, does not read x: finite, as torch's;
    the other replicas' are finite)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(N, R, D, device="cuda", generator=g) * 3 + 1
    flat = torch.randn(N, 2 * D + 5, device="cuda", generator=g)
    w, b = flat[:, 5:5 + D], flat[:, 5 + D:]
    dy = torch.randn(N, R, D, device="cuda", generator=g)
    if nan_row:
        x[0, R // 2, 0] = float("nan")
    y, mean, rstd = kernels.layer_norm_rows(x, w, b, 1e-5)
    dx, dw, db = kernels.layer_norm_rows_backward(dy, x, w, mean, rstd)
    leaves = [t.detach().double().requires_grad_() for t in (x, w, b)]
    ref = torch.stack([F.layer_norm(leaves[0][r], (D,), leaves[1][r], leaves[2][r], 1e-5) for r in range(N)])
    want = torch.autograd.grad(ref, leaves, dy.double())
    ok = torch.ones(N, R, dtype=torch.bool, device="cuda")
    if nan_row:
        ok[0, R // 2] = False
        assert bool(y[0, R // 2].isnan().all()) and bool(dx[0, R // 2].isnan().all())
        assert bool(dw[0].isnan().all()) and bool(want[1][0].isnan().all())
    torch.testing.assert_close(y[ok].double(), ref.detach()[ok], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx[ok].double(), want[0][ok], rtol=1e-4, atol=1e-4)
    first = 1 if nan_row else 0
    torch.testing.assert_close(dw[first:].double(), want[1][first:], rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(db.double(), want[2], rtol=1e-4, atol=1e-3)
    assert y.dtype == dx.dtype == dw.dtype == torch.float32


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("how", ["eager", "graph"])
def test_the_merged_engine_trains_the_same_with_the_fused_layer_norm(autocast, how, monkeypatch):
    """ByteGPT's LayerNorms through kernels.layer_norm_rows (the engine's flat weights as the norms' weights) against
    torch's norm and addcmul, 4 replicas, 3 steps (a graph: captured at the first, replayed at the others), float32
    and bf16 autocast; the other fused passes on in both. Eager steps take it only with EAGER_LAYER_NORM."""
    def run(fused_norm):
        calls = []
        with monkeypatch.context() as mp:
            mp.setattr(kernels, "MIN_ELEMENTS", 0)
            mp.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
            real = kernels.layer_norm_rows
            mp.setattr(kernels, "layer_norm_rows", lambda *a: calls.append(1) or real(*a))
            mp.setattr(kernels, "EAGER_LAYER_NORM", how == "eager")
            if not fused_norm:
                mp.setattr(kernels, "layer_norm_usable", lambda *a: False)
            torch.manual_seed(0)
            eng = ReplicaEngine(ByteGPT(32, 64, 2, 2).cuda(), 4, OPTIMIZERS["adamw"],
                                lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=1e-2, total_steps=12, model=m,
                                                                      ensemble_lr_spread_ratio=0.2, replicas=rep),
                                mode="merged", cuda_graph=how == "graph")
            g = torch.Generator(device="cuda").manual_seed(1)
            data = torch.randint(0, 256, (3, 4, 8, 33), device="cuda", generator=g)
            losses = []
            for t in range(3):
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                    losses.append(eng.step(data[t], _lm, stacked=True))
            assert eng.mode == "merged"
            if how == "graph":
                assert eng._graphs is not None and eng._graphs.captures == 1
        return torch.stack(losses), torch.cat([p.detach().flatten() for p in eng.stacked_params.values()]), calls
    l1, p1, c1 = run(True)
    l0, p0, c0 = run(False)
    assert c1 and not c0  # (5 norms a forward: 2 blocks x 2, and the final one)
    if how == "graph":  # the capture's three warm-up runs and the capture itself (eager steps and replays: none)
        assert len(c1) == 5 * 4
    torch.testing.assert_close(l1, l0, rtol=1e-2 if autocast else 1e-5, atol=1e-3 if autocast else 1e-6)
    if not autocast:  # (under autocast a norm's output rounded to bf16 either side of a boundary, then Adam's step
        _agree(p1, p0, rtol=1e-4, atol=1e-6)  # of 1e-2 on a near-0 gradient: the losses are the comparison there)


def test_eager_steps_keep_torchs_layer_norm_by_default(monkeypatch):
    calls = []
    monkeypatch.setattr(kernels, "MIN_ELEMENTS", 0)
    monkeypatch.setattr(kernels, "layer_norm_rows", lambda *a: calls.append(1))
    torch.manual_seed(0)
    eng = ReplicaEngine(ByteGPT(32, 64, 2, 2).cuda(), 2, OPTIMIZERS["adamw"],
                        lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=1e-2, total_steps=3, model=m, replicas=rep),
                        mode="merged")
    eng.step(torch.randint(0, 256, (2, 4, 33), device="cuda"), _lm, stacked=True)
    assert eng.mode == "merged" and not calls and not kernels.EAGER_LAYER_NORM


@pytest.mark.parametrize("fused_kernels", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_fused_adamw_decays_as_torchs_fused_adamw_on_the_gpu(dtype, fused_kernels, monkeypatch):
    """The CPU test of tests/test_stacked_optim.py on CUDA: bf16/fp16 weights under AdamW(fused=True, weight_decay=0.1)
    took no weight decay in the stacked step (the direction rounded to the weights' dtype before the decay's multiply;
    an audit, 2026-12-01). With the float32 direction, through the Triton pass (one rounding) or torch's ops, each
    replica's weights are near torch's own fused AdamW's (the loop) and apart from the run at weight_decay 0."""
    monkeypatch.setattr(kernels, "AVAILABLE", fused_kernels and kernels.AVAILABLE)
    monkeypatch.setattr(kernels, "MIN_ELEMENTS", 0)
    torch.manual_seed(0)
    w0 = (torch.randn(64, 64, device="cuda") * 0.5).to(dtype)
    grads = [(torch.randn(64, 64, device="cuda") * 1e-3).to(dtype) for _ in range(100)]

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(w0.clone())

    def run(mode, wd):
        eng = ReplicaEngine(M(), 4, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=wd, fused=True),
                            lambda o, rep, m: hdet.HDETLR(o, None, 101, ensemble_lr_spread_ratio=0.3,
                                                          model_sync_interval=10 ** 6, model=m, replicas=rep), mode=mode)
        for g in grads:
            eng.step([g] * 4, lambda m, c: (m.w.float() * c.float()).sum())
        return eng.optimizer_path, [m.w.detach().clone() for m in eng.models]

    path, stacked = run("vmap", 0.1)
    _, undecayed = run("vmap", 0.0)
    _, looped = run("loop", 0.1)
    assert path == "stacked"
    for a, b, c in zip(stacked, looped, undecayed):  # (the distance to torch's run as a share of its movement: without
        moved = (b.double() - w0.double()).norm()  # the decay it was 0.17 on the CPU; torch's CUDA kernel updates
        off = float((a.double() - b.double()).norm() / moved)  # Adam's moments in another order of float32 ops, a
        gone = float((a.double() - c.double()).norm() / moved)  # moment an ulp apart now and then)
        assert off < 0.02 and off < gone / 4, (off, gone)  # (measured: bf16 0.0004-0.002 against > 0.1; fp16 4.5e-4
        # against 3.7e-3, a decay's share of the movement that fp16's finer steps make small)
