"""The engine's routing of torch.nn.functional (hdet.patching): a user's own wrapper of F.linear / F.conv2d / SDPA
keeps being called in vmap mode as in loop mode, and engines stepping
in several threads leave torch's functions in place once done."""

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

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
