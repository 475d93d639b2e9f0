"""The one-process engine on a GPU (run on the GPU machine: `python -m pytest tests/gpu`)."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hdet
from hdet.engine import ReplicaEngine
from hdet.app.tasks import ByteGPT

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _lm(m, b):
    logits = m(b[..., :-1])
    return F.cross_entropy(logits.reshape(-1, 256), b[..., 1:].reshape(-1))


def _engine(mode, N=4, steps=20, auto=True, attn="auto"):
    torch.manual_seed(0)
    model = ByteGPT(32, 64, 2, 2, attn=attn).cuda()
    return ReplicaEngine(model, N, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True),
                         lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=1e-3, total_steps=steps,
                                                               ensemble_lr_spread_ratio=0.2, model_sync_interval=5,
                                                               controller="paper", enable_auto_lr=auto, auto_lr_warmup_steps=5,
                                                               replicas=rep, model=m), mode=mode)


def test_vmap_on_cuda_matches_loop_and_never_syncs_off_sync_steps():
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device="cuda").manual_seed(1)
    data = torch.randint(0, 256, (20, 4, 8, 33), device="cuda", generator=g)
    engines = {m: _engine(m) for m in ("loop", "vmap", "merged")}
    for mode, eng in engines.items():
        for t in range(1, 21):
            sync = eng.schedulers[0].is_sync_step(t)
            torch.cuda.set_sync_debug_mode(0 if (sync or t == 1) else "error")  # step 1: vmap decides
            try:
                eng.step(data[t - 1], _lm, stacked=True)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        assert eng.mode == mode
    # the replicas folded into one SDPA call (vmap) and one call each (loop) round differently, and Adam magnifies it
    for other in ("vmap", "merged"):
        for a, b in zip(engines["loop"].models[0].parameters(), engines[other].models[0].parameters()):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
        assert engines[other].schedulers[0].ensemble.controllers[0].updates == 4


@pytest.mark.parametrize("mode", ["vmap", "merged"])
def test_a_nan_replica_is_left_out_of_the_shared_gradient_on_cuda(mode):
    """Replica 2's weight is NaN from step 4: its gradient is left out of the average (the others stay finite: the
    row check, the largest |g| of each row, sees NaN on the GPU), and the sync at step 5 resets it."""
    g = torch.Generator(device="cuda").manual_seed(1)
    data = torch.randint(0, 256, (8, 4, 8, 33), device="cuda", generator=g)
    eng = _engine(mode, steps=8)
    for t in range(1, 9):
        if t == 4:
            with torch.no_grad():
                eng.models[2].blocks[0].qkv.weight[0, 0] = float("nan")
        if t == 5:
            with pytest.warns(UserWarning, match=r"replica\(s\) \[2\]"):
                eng.step(data[t - 1], _lm, stacked=True)
        else:
            eng.step(data[t - 1], _lm, stacked=True)
        for r, m in enumerate(eng.models):
            finite = all(bool(torch.isfinite(p).all()) for p in m.parameters())
            assert finite or (r == 2 and t == 4), (t, r)
    assert eng.mode == mode


def test_a_model_calling_sdpa_stays_vmapped_on_cuda():
    """F.scaled_dot_product_attention under the engine's vmap is one fused call for all replicas (hdet.attention);
    before, the memory-efficient kernel's backward failed under vmap and the engine fell back to its loop."""
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device="cuda").manual_seed(1)
    data = torch.randint(0, 256, (6, 4, 8, 33), device="cuda", generator=g)
    engines = {m: _engine(m, attn="sdpa") for m in ("loop", "auto")}
    for eng in engines.values():
        for t in range(6):
            eng.step(data[t], _lm, stacked=True)
    assert engines["auto"].mode == "vmap"
    for a, b in zip(engines["loop"].models[0].parameters(), engines["auto"].models[0].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def test_engine_under_cuda_autocast_computes_as_its_loop():
    """bf16 autocast around the engine's step on CUDA: the vmapped replicas' conv and linear layers run in bfloat16,
    as the loop's (hdet.autocast; torch's vmapped F.linear with a bias and its convolutions lose autocast on the
    CPU: benchmarks/vmap_autocast.py records which do on the GPU)."""
    from torch import nn

    seen = {}

    def loss_fn(m, batch):
        out = m(batch[0])
        seen.setdefault(mode, set()).update({m[0](batch[0]).dtype, out.dtype})
        return F.cross_entropy(out.float(), batch[1])

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5)).cuda()
    x, y = torch.randn(4, 8, 1, 6, 6, device="cuda"), torch.randint(0, 5, (4, 8), device="cuda")
    losses = {}
    for mode in ("loop", "vmap"):
        eng = ReplicaEngine(model, 4, lambda m: torch.optim.SGD(m.parameters(), lr=0.05),
                            lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=0.05, total_steps=4, replicas=rep,
                                                                  ensemble_lr_spread_ratio=0.2, model=m), mode=mode)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            losses[mode] = eng.step((x, y), loss_fn, stacked=True)
    assert seen == {"loop": {torch.bfloat16}, "vmap": {torch.bfloat16}}
    torch.testing.assert_close(losses["vmap"], losses["loop"], rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("name", ["addmm", "baddbmm", "addbmm"])
def test_vmapped_torch_matmuls_keep_cuda_autocast_when_routed(name):
    """torch.addmm / baddbmm / addbmm vmapped under CUDA autocast run in float32 (torch 2.11); routed as the engine
    routes them (hdet.autocast), in bfloat16 as one replica's call, addbmm included (its vmap rule sums in float32
    under autocast unless the call runs, once cast, with autocast off as autocast itself runs it)."""
    from torch.func import vmap

    from hdet import autocast

    N = 3
    r = lambda *s: torch.randn(*s, device="cuda")  # noqa: E731
    args = {"addmm": (r(N, 6), r(N, 4, 5), r(N, 5, 6)), "baddbmm": (r(N, 2, 4, 6), r(N, 2, 4, 5), r(N, 2, 5, 6)),
            "addbmm": (r(N, 4, 6), r(N, 2, 4, 5), r(N, 2, 5, 6))}[name]
    fn = lambda *a: getattr(torch, name)(*a)  # noqa: E731
    with torch.autocast("cuda", dtype=torch.bfloat16):
        one = torch.stack([fn(*[t[i] for t in args]) for i in range(N)])
        with autocast.routed():
            vm = vmap(fn)(*args)
    assert one.dtype == vm.dtype == torch.bfloat16
    torch.testing.assert_close(vm.float(), one.float(), rtol=2e-2, atol=2e-2 * one.abs().max().item())


def test_averaged_on_cuda_holds_the_replicas_mean_and_puts_each_back():
    """`with engine.averaged():` between converge steps on the GPU (vmap): every replica holds the mean of the
    replicas' weights, and each one's own comes back bit for bit; one host sync (its N flags), none at a converge
    step."""
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device="cuda").manual_seed(1)
    data = torch.randint(0, 256, (10, 4, 8, 33), device="cuda", generator=g)
    eng = _engine("vmap", auto=False)
    flat = lambda m: torch.cat([p.detach().reshape(-1) for p in m.parameters()]).clone()  # noqa: E731
    for t in range(7):
        eng.step(data[t], _lm, stacked=True)
    own = [flat(m) for m in eng.models]
    with eng.averaged() as changed:
        inside = [flat(m) for m in eng.models]
    assert changed and all(torch.equal(flat(m), o) for m, o in zip(eng.models, own))
    mean = torch.stack(own).double().mean(0)
    for x in inside:
        torch.testing.assert_close(x.double(), mean, rtol=1e-6, atol=1e-7)
    for t in range(7, 10):
        eng.step(data[t], _lm, stacked=True)
    torch.cuda.set_sync_debug_mode("error")  # step 10 is a converge step: the replicas are equal, nothing to do
    try:
        with eng.averaged() as changed:
            pass
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert changed is False


def test_fused_sgd_whose_first_step_the_skip_guard_skips_starts_its_momentum_afresh_on_cuda():
    """torch's fused SGD (CUDA) makes its momentum buffers with empty_like at the first step and fills them only when
    it steps: the guard drops the buffers a skipped first step made, so the next step is a first step."""
    from hdet.guard import SkipNonFiniteStep

    def run(skip_first):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(1000, device="cuda"))
        opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, fused=True)
        SkipNonFiniteStep(opt)
        if skip_first:
            p.grad = torch.full_like(p, float("nan"))
            opt.step()
        for k in range(3):
            p.grad = torch.full_like(p, 1.0 + k)
            opt.step()
        return p.detach().clone()

    empty_like = torch.empty_like  # uninitialised memory, made to hold garbage every time (a fresh CUDA block is
    torch.empty_like = lambda x, *a, **k: empty_like(x, *a, **k).fill_(3e30)  # often zeros: the test must not pass
    try:  # by luck)
        assert torch.equal(run(True), run(False))
    finally:
        torch.empty_like = empty_like


@pytest.mark.parametrize("mode", ["vmap", "merged"])
def test_the_engines_replicas_of_the_same_weights_read_as_the_same_on_cuda(mode):
    """At alpha 0 with shared gradients the engine's replicas hold the same weights, as views of one [N, ...] tensor
    at other alignments (a parameter count not a multiple of 4): their fingerprints, summed by CUDA's fused norm in an
    order that depends on the alignment, agree within SAME_WEIGHTS_RTOL, so a replica's noisier shard is no runaway
    (as on the CPU, tests/test_runaway.py); in bf16, replicas apart are told apart (a review, 2026-12-01)."""
    from types import SimpleNamespace

    from hdet.stability import same_weights
    from hdet.sync import fingerprint

    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 1)).to(dev)  # 118 parameters
    N, S = 4, 100
    eng = ReplicaEngine(model, N, lambda m: torch.optim.AdamW(m.parameters(), lr=7e-3),
                        lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=7e-3, total_steps=S, model_sync_interval=25,
                                                              on_runaway="recover", model=m, replicas=rep), mode=mode)
    g = torch.Generator(device=dev).manual_seed(1)
    runaway = []
    for t in range(1, S + 1):
        xs = torch.randn(N, 32, 7, device=dev, generator=g)
        ys = torch.tanh(xs.sum(-1, keepdim=True))
        ys[3] += torch.randn(32, 1, device=dev, generator=g)  # replica 3: a noisier shard
        eng.step(list(zip(xs, ys)), lambda m, b: (m(b[0]) - b[1]).pow(2).mean())
        if eng.schedulers[0].is_sync_step(t):
            runaway += eng.schedulers[0].last_sync.runaway
    assert runaway == [] and eng.schedulers[0].ensemble.slots.lr_scale == 1.0
    w = torch.randn(1024, 8192, device=dev, dtype=torch.bfloat16) * 0.05
    moved = (w.float() * (1 + 1e-2 * torch.randn(w.shape, device=dev))).to(torch.bfloat16)
    a, b = (fingerprint([x], [True], dev).item() for x in (w, moved))
    assert not same_weights(SimpleNamespace(weights=[a, b, a]), [0, 1, 2])


def test_bias_free_layers_step_in_vmap_mode_on_cuda():
    """On a GPU the engine copies each replica's gradient (no sum in the backward): a model whose weight gradients
    all come transposed (bias-free layers as ``x @ W.t()``) gave torch's foreach copy an empty list at step 2 (an
    audit, simulated on the CPU; this is the GPU's own path). Default settings, vmap against the loop."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = nn.Parameter(torch.randn(32, 16) * 0.1)
            self.w2 = nn.Parameter(torch.randn(1, 32) * 0.1)

        def forward(self, x):
            return torch.tanh(x @ self.w1.t()) @ self.w2.t()

    torch.backends.cuda.matmul.allow_tf32 = False
    weights = []
    for mode in ("vmap", "loop"):
        torch.manual_seed(0)
        eng = ReplicaEngine(M().cuda(), 2, lambda m: torch.optim.SGD(m.parameters(), lr=1e-2),
                            lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=1e-2, total_steps=4,
                                                                  ensemble_lr_spread_ratio=0.2, model_sync_interval=2,
                                                                  replicas=rep, model=m), mode=mode)
        for t in range(3):
            x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(t)).cuda()
            eng.step(x, lambda m, b: m(b).pow(2).mean(), stacked=True)
        weights.append([p.detach().clone() for m in eng.models for p in m.parameters()])
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(*weights))


@pytest.mark.parametrize("mode", ["vmap", "merged"])
def test_after_the_stacked_step_gives_way_each_replica_steps_on_its_own_gradient_on_cuda(mode):
    """torch's SGD with Nesterov runs foreach by default on CUDA and adds the momentum into ``.grad`` in place: after
    the stacked step gave way (a layer the loss skips at step 3), every replica's ``.grad`` was one shared row, so each
    replica's step changed the next one's gradient (an audit, on the CPU with foreach=True). Each replica has its own
    now: the same training as stacked_optimizer=False."""
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device="cuda").manual_seed(1)
    xs, ys = torch.randn(8, 3, 6, 5, device="cuda", generator=g), torch.randn(8, 3, 6, 2, device="cuda", generator=g)
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2), nn.Linear(2, 2)).cuda()

    def run(stacked):
        eng = ReplicaEngine(base, 3, lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True),
                            lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=0.05, total_steps=12, replicas=rep, model=m,
                                                                  ensemble_lr_spread_ratio=0.2, model_sync_interval=4),
                            mode=mode, stacked_optimizer=stacked)
        out = []
        for t in range(8):
            skip = t == 2
            out.append(eng.step((xs[t], ys[t]), lambda m, b: F.mse_loss(m[2](m[1](m[0](b[0]))) if skip else m(b[0]),
                                                                         b[1]), stacked=True))
        return eng, torch.stack(out)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (gave, lg), (ref, lr) = run(True), run(False)
    assert gave.optimizer_path.startswith("per-replica: parameters '3.weight', '3.bias' got no gradient at step 3")
    assert len({m[0].weight.grad.data_ptr() for m in gave.models}) == 3
    torch.testing.assert_close(lg, lr, rtol=1e-5, atol=1e-6)
    for a, b in zip(gave.models, ref.models):
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
