"""hdet.cross_entropy: F.cross_entropy's common form as one call for the engine's vmapped replicas."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hdet
from hdet import cross_entropy
from hdet.engine import ReplicaEngine

N, B, C = 4, 6, 5


def _both(fn, *tensors):
    """``vmap(fn)`` over ``tensors`` with and without the routing: (losses, gradients) of each."""
    out = []
    for route in (False, True):
        leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]
        with cross_entropy.routed() if route else torch.enable_grad():
            losses = torch.func.vmap(fn, randomness="different")(*leaves)
        losses.sum().backward()
        out.append((losses.detach(), [t.grad for t in leaves if t.is_floating_point()]))
    return out


@pytest.mark.parametrize("kw", [{}, {"ignore_index": 2}, {"label_smoothing": 0.1},
                                {"ignore_index": 0, "label_smoothing": 0.2}])
def test_the_common_form_matches_torchs_vmapped_call(kw):
    torch.manual_seed(0)
    x, y = torch.randn(N, B, C), torch.randint(0, C, (N, B))
    y[1] = kw.get("ignore_index", -100) if "ignore_index" in kw else y[1]  # replica 1: every row ignored (NaN)
    (plain, gp), (routed, gr) = _both(lambda a, b: F.cross_entropy(a, b, **kw), x, y)
    torch.testing.assert_close(routed, plain, equal_nan=True, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(gr[0], gp[0], equal_nan=True, rtol=1e-6, atol=1e-7)
    if "ignore_index" in kw:
        assert torch.isnan(routed[1]) and torch.isnan(plain[1])


def test_a_shared_target_and_the_module_form_are_routed_too():
    torch.manual_seed(1)
    x, y = torch.randn(N, B, C), torch.randint(0, C, (B,))
    (plain, _), (routed, _) = _both(lambda a: F.cross_entropy(a, y), x)
    torch.testing.assert_close(routed, plain, rtol=1e-6, atol=1e-7)
    loss = nn.CrossEntropyLoss(label_smoothing=0.05)
    (plain, _), (routed, _) = _both(lambda a: loss(a, y), x)
    torch.testing.assert_close(routed, plain, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("case", ["weight", "sum", "probabilities", "spatial", "one_row"])
def test_other_forms_are_torchs_own_call(case):
    """Class weights, another reduction, probability targets, extra axes, an unbatched row: the function F held is
    called as it was (the routing does not take them), the same values as torch's."""
    torch.manual_seed(2)
    calls = []

    def held(*a, **k):
        calls.append(a[0].shape)
        return cross_entropy._TORCH_CROSS_ENTROPY(*a, **k)
    cross_entropy._TORCH_CROSS_ENTROPY, torchs = held, cross_entropy._TORCH_CROSS_ENTROPY  # (held: torch's, counted)
    try:
        wrapped = cross_entropy.replicas_cross_entropy(held)
    finally:
        cross_entropy._TORCH_CROSS_ENTROPY = torchs
    w, probs = torch.rand(C), torch.rand(N, B, C).softmax(-1)
    x, y = torch.randn(N, B, C), torch.randint(0, C, (N, B))
    forms = {"weight": (lambda f: lambda a, b, p: f(a, b, w)),
             "sum": (lambda f: lambda a, b, p: f(a, b, reduction="sum")),
             "probabilities": (lambda f: lambda a, b, p: f(a, p)),
             "spatial": (lambda f: lambda a, b, p: f(a.view(2, 3, C).transpose(1, 2), b.view(2, 3))),
             "one_row": (lambda f: lambda a, b, p: f(a[0], b[0]))}[case]
    got = torch.func.vmap(forms(wrapped))(x, y, probs)
    want = torch.func.vmap(forms(F.cross_entropy))(x, y, probs)
    torch.testing.assert_close(got, want)
    assert calls and all(shape[0] != N * B for shape in calls)  # the held function, on each replica's rows (not all of them)


def test_the_engine_routes_its_loss_and_matches_the_loop():
    """A classifier under the engine (vmap and merged) against the loop over replica copies: the same losses and
    weights to float32's rounding, with ignore_index and label smoothing in the loss."""
    def run(mode):
        torch.manual_seed(0)
        eng = ReplicaEngine(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, C)), N,
                            lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
                            lambda o, rep, m: hdet.HDETLR(o, None, total_steps=6, replicas=rep, model=m,
                                                          ensemble_lr_spread_ratio=0.3, model_sync_interval=3),
                            mode=mode)
        g = torch.Generator().manual_seed(5)
        losses = []
        for _ in range(6):
            x, y = torch.randn(N, B, 8, generator=g), torch.randint(0, C, (N, B), generator=g)
            losses.append(eng.step((x, y), lambda m, b: F.cross_entropy(m(b[0]), b[1], ignore_index=1,
                                                                        label_smoothing=0.1), stacked=True))
        return torch.stack(losses), [p.detach().clone() for p in eng.models[0].parameters()], eng.mode
    loop, merged, vmapped = run("loop"), run("merged"), run("vmap")
    assert merged[2] == "merged" and vmapped[2] == "vmap"
    for other in (merged, vmapped):
        torch.testing.assert_close(other[0], loop[0], rtol=2e-5, atol=2e-6)
        for a, b in zip(other[1], loop[1]):
            torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6)


def test_a_users_wrapper_and_other_target_dtypes_are_left_to_torch():
    """A wrapper of F.cross_entropy put there by a user or a library (its own signature, defaults and extra terms)
    was called with torch's eight arguments, and once over every replica's rows (a z-loss then mixed the replicas);
    int32 and bool targets, which torch's vmapped call takes, crashed the routed call; a uint8 target equal to
    ignore_index's wrap (-100 as 156) was left out of the count (a review). None of them is routed now."""
    torch.manual_seed(3)
    x = torch.randn(N, B, C)

    before = F.cross_entropy

    def zloss(input, target, **kw):  # a user's wrapper with its own signature and an extra term
        return before(input, target, **kw) + 1e-2 * input.pow(2).mean()
    y = torch.randint(0, C, (N, B))
    F.cross_entropy = zloss
    try:
        with cross_entropy.routed():
            assert F.cross_entropy is zloss
            got = torch.func.vmap(lambda a, b: F.cross_entropy(a, b))(x, y)
    finally:
        F.cross_entropy = before
    want = torch.stack([zloss(x[r], y[r]) for r in range(N)])
    torch.testing.assert_close(got, want)
    for dtype in (torch.int32, torch.bool):
        yt = y.to(dtype) if dtype is not torch.bool else (y > 2)
        (plain, _), (routed, _) = _both(lambda a, b: F.cross_entropy(a, b), x, yt)
        torch.testing.assert_close(routed, plain)
