"""The engine's routing of torch.nn.functional (hdet.patching): a user's own wrapper of F.linear / F.conv2d / SDPA
keeps being called in vmap mode as in loop mode, odd shapes and dtypes go to torch's own call, and engines stepping
in several threads leave torch's functions in place once done."""

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import vmap

import hdet
from hdet import attention, autocast, linear
from hdet.engine import ReplicaEngine

N = 3


def _engine(model, mode, steps=10):
    return ReplicaEngine(model, N, lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                         lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=0.1, total_steps=steps, replicas=rep, model=m,
                                                               ensemble_lr_spread_ratio=0.2), mode=mode)


TORCH = {"linear": torch._C._nn.linear, "conv2d": F.conv2d,
         "scaled_dot_product_attention": torch._C._nn.scaled_dot_product_attention}


def test_a_users_wrapper_of_f_keeps_being_called(monkeypatch):
    """A FLOP counter or LoRA-style wrapper put in F before the step: vmap mode calls it, and computes what the loop
    computes with it (it was bypassed: hdet's routing held torch's functions)."""
    calls = {"linear": 0, "conv2d": 0}

    def wrap(name):
        orig = getattr(F, name)

        def wrapped(*a, **k):
            calls[name] += 1
            return orig(*a, **k) * 0.5
        return wrapped
    for name in calls:
        monkeypatch.setattr(F, name, wrap(name))
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(8, 1))
    x = torch.randn(N, 4, 1, 4, 4)
    losses = {}
    for mode in ("loop", "vmap"):
        for k in calls:
            calls[k] = 0
        torch.manual_seed(0)
        losses[mode] = _engine(model, mode).step((x,), lambda m, b: m(b[0]).pow(2).mean(), stacked=True)
        assert calls == ({"linear": N, "conv2d": N} if mode == "loop" else {"linear": 1, "conv2d": 1})
    torch.testing.assert_close(losses["vmap"], losses["loop"])


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
    out = []
    for route in (False, True):
        leaves = [None if t is None else t.clone().requires_grad_() for t in args]
        with linear.routed() if route else torch.enable_grad():
            y = vmap(lambda *a: F.linear(*a), in_dims=in_dims)(*leaves)
        y.abs().pow(2).sum().backward()
        out.append((y.detach(), [None if t is None else t.grad for t in leaves]))
    torch.testing.assert_close(out[1][0], out[0][0])
    for a, r in zip(out[1][1], out[0][1]):
        if r is not None:
            torch.testing.assert_close(a, r)


def test_engines_in_threads_leave_torchs_functions():
    """Two engines stepping at once in two threads: F holds torch's functions again when both are done (each engine
    put back what it found, which could be the other's routing)."""
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(8, 1))
    engines = [_engine(model, "vmap", steps=30) for _ in range(2)]
    x = torch.randn(N, 4, 1, 4, 4)
    errors = []

    def run(eng):
        try:
            for _ in range(30):
                eng.step((x,), lambda m, b: m(b[0]).pow(2).mean(), stacked=True)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=run, args=(e,)) for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for name, fn in TORCH.items():
        assert getattr(F, name) is fn, name


def test_nested_routing_restores_in_order():
    with attention.routed(), autocast.routed(), linear.routed():
        with autocast.routed(), linear.routed():  # nested entries share the outer one's
            inner = F.linear
        assert F.linear is inner and F.linear is not torch._C._nn.linear
        with pytest.raises(RuntimeError):
            with linear.routed():
                raise RuntimeError("the step failed")
        assert F.linear is inner
    for name, fn in TORCH.items():
        assert getattr(F, name) is fn, name
