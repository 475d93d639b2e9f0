"""hdet.autocast: the engine's vmapped linear and conv layers compute in the autocast dtype, as each replica's
layer does alone (torch's vmapped F.linear with a bias, and its convolutions, ran in float32 under autocast)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import vmap

import hdet
from hdet import autocast
from hdet.engine import ReplicaEngine

N = 3
BF16 = torch.bfloat16


def _args(name):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    d = int(name[-2]) if name.startswith("conv") else 0
    if name == "linear":
        return r(N, 4, 5), r(N, 6, 5), r(N, 6)
    spatial = (6,) * d
    if name.startswith("conv_transpose"):
        return r(N, 2, 3, *spatial), r(N, 3, 4, *(3,) * d), r(N, 4)
    return r(N, 2, 3, *spatial), r(N, 4, 3, *(3,) * d), r(N, 4)


@pytest.mark.parametrize("name", autocast.CAST)
def test_vmapped_layers_cast_as_one_replica(name):
    fn = lambda *a: getattr(F, name)(*a)  # noqa: E731 - looked up at call time, as nn modules do
    args = _args(name)
    with torch.autocast("cpu", dtype=BF16):
        one = torch.stack([fn(*[t[r] for t in args]) for r in range(N)])
        with autocast.routed():
            vm = vmap(fn)(*args)
            shared = vmap(lambda x: fn(x, args[1][0], args[2][0]))(args[0])  # one weight and bias for all
    assert one.dtype == vm.dtype == shared.dtype == BF16
    torch.testing.assert_close(vm.float(), one.float(), rtol=2e-2, atol=2e-2 * one.abs().max().item())
    torch.testing.assert_close(shared[0].float(), one[0].float(), rtol=2e-2, atol=2e-2 * one.abs().max().item())


def test_outside_vmap_or_autocast_they_are_torch():
    x, w, b = _args("linear")
    with autocast.routed():
        assert torch.equal(F.linear(x[0], w[0], b[0]), torch._C._nn.linear(x[0], w[0], b[0]))
        out = vmap(lambda *a: F.linear(*a))(x, w, b)  # autocast off: float32, torch's batching rule
    assert out.dtype == torch.float32 and F.linear is torch._C._nn.linear
    xs, ws, bs = _args("conv2d")
    with torch.autocast("cpu", dtype=BF16), autocast.routed():
        y = vmap(lambda a, c, d: F.conv2d(a, c, bias=d, padding=1))(xs, ws, bs)  # keywords pass through
    assert y.dtype == BF16 and y.shape == (N, 2, 4, 6, 6)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 6 * 6, 5)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def _sgd_engine(model, mode):
    return ReplicaEngine(model, N, lambda m: torch.optim.SGD(m.parameters(), lr=0.05),
                         lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=0.05, total_steps=4, replicas=rep,
                                                               ensemble_lr_spread_ratio=0.2, model=m), mode=mode)


@pytest.mark.parametrize("where", ["around the step", "inside loss_fn"])
def test_engine_under_autocast_computes_as_its_loop(where):
    """A user's bf16 autocast, around the engine's step or inside the loss function: the vmapped replicas' conv and
    linear layers run in bfloat16, as the loop's do, and the first step's losses agree to bf16 precision."""
    seen = {}
    ctx = lambda: torch.autocast("cpu", dtype=BF16)  # noqa: E731

    def loss_fn(m, batch):
        with ctx() if where == "inside loss_fn" else torch.enable_grad():
            h = m.conv(batch[0])
            out = m(batch[0])
        seen.setdefault(mode, set()).update({h.dtype, out.dtype})
        return F.cross_entropy(out.float(), batch[1])

    torch.manual_seed(0)
    model = _Net()
    x, y = torch.randn(N, 8, 1, 6, 6), torch.randint(0, 5, (N, 8))
    losses = {}
    for mode in ("loop", "vmap"):
        eng = _sgd_engine(model, mode)
        with ctx() if where == "around the step" else torch.enable_grad():
            losses[mode] = torch.stack([eng.step((x, y), loss_fn, stacked=True) for _ in range(2)])
        assert eng.mode == mode
    assert seen == {"loop": {BF16}, "vmap": {BF16}}
    torch.testing.assert_close(losses["vmap"][0], losses["loop"][0], rtol=1e-2, atol=1e-2)


def _torch_args(name):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    if name == "addmm":
        return r(N, 6), r(N, 4, 5), r(N, 5, 6)
    if name == "baddbmm":
        return r(N, 2, 4, 6), r(N, 2, 4, 5), r(N, 2, 5, 6)
    return r(N, 4, 6), r(N, 2, 4, 5), r(N, 2, 5, 6)  # addbmm


@pytest.mark.parametrize("name", autocast.CAST_TORCH)
def test_vmapped_torch_matmuls_cast_as_one_replica(name):
    """torch.addmm / baddbmm / addbmm (HF GPT-2's Conv1D calls torch.addmm) lose autocast under vmap as F.linear
    does: routed, they compute in the autocast dtype, keywords included, as one replica's call does."""
    fn = lambda *a, **k: getattr(torch, name)(*a, **k)  # noqa: E731 - looked up at call time
    args = _torch_args(name)
    with torch.autocast("cpu", dtype=BF16):
        one = torch.stack([fn(*[t[r] for t in args], beta=0.5) for r in range(N)])
        unrouted = vmap(lambda a, b, c: fn(a, b, c, beta=0.5))(*args)
        with autocast.routed():
            vm = vmap(lambda a, b, c: fn(a, b, c, beta=0.5))(*args)
            kw = vmap(lambda a, b, c: fn(input=a, **{"mat1" if name == "addmm" else "batch1": b},
                                         **{"mat2" if name == "addmm" else "batch2": c}, beta=0.5))(*args)
    assert unrouted.dtype == torch.float32  # the case (torch 2.13, CPU); if torch fixes it, routing is a no-op
    assert one.dtype == vm.dtype == kw.dtype == BF16
    assert getattr(torch, name) is getattr(torch._C._VariableFunctions, name)  # put back
    torch.testing.assert_close(vm.float(), one.float(), rtol=2e-2, atol=2e-2 * one.abs().max().item())
    torch.testing.assert_close(kw, vm)


class _Conv1D(nn.Module):
    """Hugging Face GPT-2's Conv1D: ``torch.addmm(bias, x, weight)``, the weight stored [in, out]."""

    def __init__(self, nx, nf):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.1)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        size = x.size()[:-1] + (self.weight.shape[1],)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size)


def test_engine_with_torch_addmm_under_autocast_computes_as_its_loop():
    seen = {}

    def loss_fn(m, batch):
        out = m(batch[0])
        seen.setdefault(mode, set()).add(out.dtype)
        return F.cross_entropy(out.float().flatten(0, 1), batch[1].flatten())

    torch.manual_seed(0)
    model = nn.Sequential(_Conv1D(5, 7), nn.GELU(), _Conv1D(7, 4))
    x, y = torch.randn(N, 2, 3, 5), torch.randint(0, 4, (N, 2, 3))
    losses = {}
    for mode in ("loop", "vmap"):
        eng = _sgd_engine(model, mode)
        with torch.autocast("cpu", dtype=BF16):
            losses[mode] = torch.stack([eng.step((x, y), loss_fn, stacked=True) for _ in range(2)])
        assert eng.mode == mode
    assert seen == {"loop": {BF16}, "vmap": {BF16}}
    torch.testing.assert_close(losses["vmap"][0], losses["loop"][0], rtol=1e-2, atol=1e-2)


def test_a_users_wrapper_keeps_autocast_for_its_own_ops():
    """A LoRA-style wrapper of F.linear adds its own float32 matmuls: routed, it gets its inputs cast and runs with
    autocast still on (only torch's own function runs with autocast off once cast), so its matmuls cast too."""
    g = torch.Generator().manual_seed(0)
    A, B = torch.randn(5, 2, generator=g), torch.randn(2, 6, generator=g)
    torch_linear = F.linear

    def lora(x, w, b=None):
        return torch_linear(x, w, b) + (x @ A) @ B

    x, w, b = _args("linear")
    F.linear = lora
    try:
        with torch.autocast("cpu", dtype=BF16):
            one = torch.stack([lora(x[r], w[r], b[r]) for r in range(N)])
            with autocast.routed():
                vm = vmap(lambda *a: F.linear(*a))(x, w, b)
    finally:
        F.linear = torch_linear
    assert one.dtype == vm.dtype == BF16
    torch.testing.assert_close(vm.float(), one.float(), rtol=2e-2, atol=2e-2 * one.abs().max().item())
