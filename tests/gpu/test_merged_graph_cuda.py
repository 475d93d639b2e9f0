"""The engine's merged step in a CUDA graph (`ReplicaEngine(..., mode="merged", cuda_graph=True)`), against the same
engine run eagerly (run on the GPU machine: `python -m pytest tests/gpu`)."""

import pytest
import torch
import torch.nn.functional as F

import hdet
from hdet.app.tasks import ByteGPT
from hdet.engine import ReplicaEngine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _lm(m, b):
    logits = m(b[..., :-1])
    return F.cross_entropy(logits.reshape(-1, 256), b[..., 1:].reshape(-1))


def _engine(graph, dropout=0.0, max_lr=1e-3, steps=12):
    torch.manual_seed(0)
    model = ByteGPT(32, 64, 2, 2, dropout=dropout).cuda()
    return ReplicaEngine(model, 4, lambda m: torch.optim.AdamW(m.parameters(), lr=max_lr, fused=True),
                         lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=max_lr, total_steps=steps,
                                                               ensemble_lr_spread_ratio=0.3, model_sync_interval=4,
                                                               replicas=rep, model=m),
                         mode="merged", cuda_graph=graph)


def test_the_graphed_merged_step_computes_what_the_eager_one_does():
    """12 steps, 3 syncs, a batch size changed at step 9 (a second graph) and an eval-mode step at 11 (a third):
    losses, weights and learning rates as the eager merged engine's."""
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device="cuda").manual_seed(1)
    data = [torch.randint(0, 256, (4, 8 if t < 8 else 5, 33), device="cuda", generator=g) for t in range(12)]
    out = {}
    for graph in (False, True):
        eng = _engine(graph)
        losses = []
        for t in range(12):
            for m in eng.models:
                m.train(t != 10)
            losses.append(eng.step(data[t], _lm, stacked=True))
        out[graph] = (eng, torch.stack(losses))
    (eager, le), (graphed, lg) = out[False], out[True]
    assert graphed.mode == "merged" and len([e for e in graphed._graphs.entries.values() if e[0] is not None]) == 3
    torch.testing.assert_close(lg, le, rtol=1e-5, atol=1e-5)
    for a, b in zip(eager.models[1].parameters(), graphed.models[1].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)  # (Adam: the key bias's rounding noise, see
    assert [s.get_last_lr() for s in eager.schedulers] == [s.get_last_lr() for s in graphed.schedulers]  # engine.md)


def test_each_replay_draws_new_dropout_masks_and_returns_the_callers_own_losses():
    eng = _engine(True, dropout=0.5, max_lr=1e-12)
    g = torch.Generator(device="cuda").manual_seed(2)
    b = torch.randint(0, 256, (4, 8, 33), device="cuda", generator=g)
    same = b[:1].expand(4, 8, 33).contiguous()
    first = [eng.step(same, _lm, stacked=True) for _ in range(4)]
    assert all(len(set(x.tolist())) == 4 for x in first)  # each replica its own masks
    assert len({tuple(x.tolist()) for x in first[1:]}) == 3  # and new ones at every replay (weights barely move)
    kept = first[2].clone()
    eng.step(same, _lm, stacked=True)
    assert torch.equal(first[2], kept)  # a later replay does not write over what step() returned


def test_the_callers_batches_are_never_written_into():
    """The graph copies each batch into tensors of its own; it captured on a copy, not on the caller's first batch
    (a dataset kept on the GPU and sliced per step had its first batch overwritten by every later one)."""
    g = torch.Generator(device="cuda").manual_seed(3)
    data = torch.randint(0, 256, (6, 4, 8, 33), device="cuda", generator=g)
    kept = data.clone()
    eng = _engine(True, steps=6)
    for t in range(6):
        eng.step(data[t], _lm, stacked=True)
    assert torch.equal(data, kept)


def _scaled(m, b, scale=1.0):
    return _lm(m, b) * scale


def test_loss_functions_that_differ_only_in_what_they_close_over_get_their_own_graphs():
    """partial(f, scale=2) after partial(f, scale=1): the same code, another computation (it replayed the first)."""
    import functools
    g = torch.Generator(device="cuda").manual_seed(4)
    data = torch.randint(0, 256, (6, 4, 8, 33), device="cuda", generator=g)
    out = {}
    for graph in (False, True):
        eng = _engine(graph, steps=6)
        out[graph] = torch.stack([eng.step(data[t], functools.partial(_scaled, scale=1.0 + (t >= 3)), stacked=True)
                                  for t in range(6)])
    torch.testing.assert_close(out[True], out[False], rtol=1e-5, atol=1e-5)
    assert out[True][3:].mean() > 1.8 * out[True][:3].mean()


def test_autocast_is_captured_and_computes_as_eager():
    g = torch.Generator(device="cuda").manual_seed(5)
    data = torch.randint(0, 256, (5, 4, 8, 33), device="cuda", generator=g)
    out = {}
    for graph in (False, True):
        eng = _engine(graph, steps=5)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out[graph] = torch.stack([eng.step(data[t], _lm, stacked=True) for t in range(5)])
        if graph:
            assert any(e[0] is not None for e in eng._graphs.entries.values())
    torch.testing.assert_close(out[True], out[False], rtol=2e-2, atol=2e-2)


def test_a_thread_pinning_host_memory_during_the_capture_breaks_neither():
    """A DataLoader with pin_memory=True pins host memory in a thread of its own: a capture in the default (global)
    mode fails on it and leaves that thread's next allocation failing; hdet captures in thread_local mode."""
    import threading
    free = getattr(torch._C, "_host_emptyCache", None)
    if free is None:
        pytest.skip("this torch cannot empty its pinned-memory cache (the thread would reuse one block)")
    stop, errors = threading.Event(), []

    def pin():  # a fresh cudaHostAlloc and cudaFreeHost each time (the cache emptied), as a loader's pinning can make
        try:
            while not stop.is_set():
                torch.empty(1 << 16, pin_memory=True)  # (freed at once, into the cache)
                free()
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    t = threading.Thread(target=pin)
    t.start()
    try:
        g = torch.Generator(device="cuda").manual_seed(6)
        data = torch.randint(0, 256, (3, 4, 8, 33), device="cuda", generator=g)
        eng = _engine(True, steps=3)
        for s in range(3):
            eng.step(data[s], _lm, stacked=True)
    finally:
        stop.set()
        t.join()
    assert not errors and any(e[0] is not None for e in eng._graphs.entries.values())


def _cnn_engine(graph, mode):
    from hdet.app.tasks import SmallCNN
    torch.manual_seed(0)
    model = SmallCNN(width=8).cuda()
    return ReplicaEngine(model, 4, lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, fused=True),
                         lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=0.05, total_steps=8,
                                                               ensemble_lr_spread_ratio=0.3, model_sync_interval=4,
                                                               replicas=rep, model=m),
                         mode=mode, cuda_graph=graph)


def _ce(m, b):
    return F.cross_entropy(m(b[0]), b[1])


@pytest.mark.parametrize("mode", ["vmap", "auto"])
def test_the_graphed_vmapped_step_computes_what_the_eager_one_does_batchnorm_included(mode):
    """The Fashion-MNIST CNN (BatchNorm: buffers updated in place, which the capture's three warm-up runs would have
    moved too), vmapped: losses, weights and running statistics as eager vmap's over 8 steps, 2 syncs."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    g = torch.Generator(device="cuda").manual_seed(7)
    data = [(torch.randn(4, 8, 1, 28, 28, device="cuda", generator=g),
             torch.randint(0, 10, (4, 8), device="cuda", generator=g)) for _ in range(8)]
    out = {}
    for graph in (False, True):
        eng = _cnn_engine(graph, mode)
        out[graph] = (eng, torch.stack([eng.step(data[t], _ce, stacked=True) for t in range(8)]))
    (eager, le), (graphed, lg) = out[False], out[True]
    assert graphed.mode == "vmap" and any(e[0] is not None for e in graphed._vgraphs.entries.values())
    torch.testing.assert_close(lg, le, rtol=1e-5, atol=1e-5)
    for a, b in zip(eager.models[2].state_dict().values(), graphed.models[2].state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    torch.backends.cudnn.allow_tf32 = True


def test_the_graphed_vmapped_gpt_computes_what_the_eager_one_does():
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device="cuda").manual_seed(8)
    data = torch.randint(0, 256, (8, 4, 8, 33), device="cuda", generator=g)
    out = {}
    for graph in (False, True):
        torch.manual_seed(0)
        model = ByteGPT(32, 64, 2, 2).cuda()
        eng = ReplicaEngine(model, 4, lambda m: torch.optim.SGD(m.parameters(), lr=0.05, fused=True),
                            lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=0.05, total_steps=8,
                                                                  ensemble_lr_spread_ratio=0.3, model_sync_interval=4,
                                                                  replicas=rep, model=m), mode="vmap", cuda_graph=graph)
        out[graph] = (eng, torch.stack([eng.step(data[t], _lm, stacked=True) for t in range(8)]))
    (eager, le), (graphed, lg) = out[False], out[True]
    assert any(e[0] is not None for e in graphed._vgraphs.entries.values())
    torch.testing.assert_close(lg, le, rtol=1e-5, atol=1e-5)
    for a, b in zip(eager.models[1].parameters(), graphed.models[1].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


class _Syncing(torch.nn.Module):
    """Dropout, then a host sync in the forward (legal eagerly, refused while a CUDA graph is captured)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 1)
        self.drop = torch.nn.Dropout(0.3)

    def forward(self, x):
        h = self.drop(x)
        torch.cuda.synchronize()
        return self.lin(h)


class _Ema(torch.nn.Module):
    """A buffer the forward reassigns in train mode only (eval-mode steps first, then train mode)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 1)
        self.register_buffer("mu", torch.zeros(6))

    def forward(self, x):
        if self.training:
            self.mu = 0.9 * self.mu + 0.1 * x.mean(0)
        return self.lin(x - self.mu)


def _small(model, mode, graph):
    return ReplicaEngine(model, 4, lambda m: torch.optim.SGD(m.parameters(), lr=0.05),
                         lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=0.05, total_steps=8,
                                                               ensemble_lr_spread_ratio=0.3, model_sync_interval=4,
                                                               replicas=rep, model=m), mode=mode, cuda_graph=graph)


def _mse(m, b):
    return F.mse_loss(m(b[0]), b[1])


@pytest.mark.parametrize("mode", ["vmap", "merged"])
def test_a_capture_that_fails_leaves_the_eager_step_working(mode):
    """A host sync in the forward fails the capture after dropout drew its mask in capture mode: the engine says so and
    runs eagerly, and the eager step's own dropout works (a failed capture can leave the random generator in capture
    mode, "Offset increment outside graph capture")."""
    g = torch.Generator(device="cuda").manual_seed(9)
    data = [(torch.randn(4, 8, 6, device="cuda", generator=g), torch.randn(4, 8, 1, device="cuda", generator=g))
            for _ in range(6)]
    torch.manual_seed(0)
    eng = _small(_Syncing().cuda(), mode, True)
    with pytest.warns(UserWarning, match="cannot be captured in a CUDA graph"):  # (merged captures at its first
        eng.step(data[0], _mse, stacked=True)  # step, after the check; vmapped at its second)
        eng.step(data[1], _mse, stacked=True)
    losses = [eng.step(data[t], _mse, stacked=True) for t in range(2, 6)]
    assert all(bool(torch.isfinite(x).all()) for x in losses)
    torch.rand(3, device="cuda")  # the generator works eagerly


def test_a_buffer_the_forward_reassigns_only_in_train_mode_is_kept_as_eager_keeps_it():
    g = torch.Generator(device="cuda").manual_seed(10)
    data = [(torch.randn(4, 8, 6, device="cuda", generator=g), torch.randn(4, 8, 1, device="cuda", generator=g))
            for _ in range(6)]
    out = {}
    for graph in (False, True):
        torch.manual_seed(0)
        eng = _small(_Ema().cuda(), "vmap", graph)
        losses = []
        for t in range(6):
            for m in eng.models:
                m.train(t >= 2)
            if graph and t == 2:
                with pytest.warns(UserWarning, match=r"reassigns the buffers \['mu'\]"):
                    losses.append(eng.step(data[t], _mse, stacked=True))
            else:
                losses.append(eng.step(data[t], _mse, stacked=True))
        out[graph] = (eng, torch.stack(losses))
    (eager, le), (graphed, lg) = out[False], out[True]
    torch.testing.assert_close(lg, le, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(graphed.stacked_buffers["mu"], eager.stacked_buffers["mu"], rtol=1e-5, atol=1e-6)
    assert bool(eager.stacked_buffers["mu"].abs().sum() > 0)
