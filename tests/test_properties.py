"""Property-based tests (hypothesis): every input is either refused with a ValueError or accepted with
finite, positive, bounded values forever."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hdet
from helpers import ScriptedReplicas

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def scheduler_args(draw):
    """Half the examples draw every argument from its valid range (so auto-LR runs), half from ranges
    that include invalid values."""
    N = draw(st.integers(1, 8))
    total = draw(st.integers(1, 120))
    if draw(st.booleans()):
        args = dict(
            ensemble_lr_spread_ratio=draw(st.floats(0.0, 0.999)),
            model_sync_interval=draw(st.integers(1, total)),
            controller="paper", enable_auto_lr=draw(st.booleans()),
            auto_lr_warmup_steps=draw(st.integers(0, total - 1)) if total > 1 else 0,
            loss_scale=draw(st.floats(1e-4, 5.0)),
            lr_of_lr=draw(st.floats(0.0, 3.0)),
            momentum_of_lr=draw(st.floats(0.0, 0.999)),
        )
    else:
        args = dict(
            ensemble_lr_spread_ratio=draw(st.floats(-0.5, 1.5)),
            model_sync_interval=draw(st.integers(-1, 40)),
            controller="paper", enable_auto_lr=draw(st.booleans()),
            auto_lr_warmup_steps=draw(st.integers(-5, 130)),
            loss_scale=draw(st.floats(-1.0, 5.0)),
            lr_of_lr=draw(st.floats(-1.0, 3.0)),
            momentum_of_lr=draw(st.floats(-0.5, 1.5)),
        )
    return dict(N=N, rank=draw(st.integers(0, N - 1)), max_lr=draw(st.floats(1e-6, 10.0)), total_steps=total,
                losses=draw(st.lists(st.lists(st.floats(0.0, 1e6), min_size=N, max_size=N), min_size=1,
                                     max_size=6)), **args)


@SETTINGS
@given(scheduler_args())
def test_scheduler_accepts_with_bounded_lrs_or_refuses(args):
    N, rank, losses = args.pop("N"), args.pop("rank"), args.pop("losses")
    feed = iter(losses * 1000)
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1)
    try:
        s = hdet.OneCycleAutoLR(opt, **args, replicas=ScriptedReplicas(rank, N, lambda: next(feed)))
    except ValueError:
        return  # refused, with a message (tested elsewhere)
    alpha, max_lr = args["ensemble_lr_spread_ratio"], args["max_lr"]
    min_lr = max_lr / 25.0 / 1e4  # OneCycleLR's floor with its default div factors
    hi = 10 * max_lr * (1 + alpha) * (1 + 1e-9)  # auto_lr_bounds default: (min_lr, 10 max_lr), times rho
    lo = min_lr * (1 - alpha) * (1 - 1e-9)
    for _ in range(args["total_steps"]):
        opt.step()
        s.step(torch.tensor(1.0))
        lr = s.get_last_lr()[0]
        assert math.isfinite(lr) and lo <= lr <= hi and lr > 0, (lr, lo, hi)
        assert type(opt.param_groups[0]["lr"]) is float
    with pytest.raises(ValueError, match="at most total_steps"):
        opt.step()
        s.step(torch.tensor(1.0))


@SETTINGS
@given(kind=st.sampled_from(["linear", "log", "additive", "cubic"]), alpha=st.floats(-1.0, 3.0),
       lo=st.floats(-2.0, 2.0), width=st.floats(-1.0, 3.0), base=st.floats(-3.0, 3.0), N=st.integers(1, 9),
       shift=st.floats(-5.0, 5.0))
def test_spread_values_stay_in_bounds_or_refuse(kind, alpha, lo, width, base, N, shift):
    box = {"v": base}
    try:
        spread = hdet.Spread(kind, alpha, (lo, lo + width))
        h = hdet.Setter("x", lambda: box["v"], lambda v: box.__setitem__("v", v), spread)
    except ValueError:
        return
    for b in (h.initial, h.initial + shift):  # the initial base and one a controller might propose
        b = spread.clamp(b)
        vals = [spread.apply(b, o) for o in spread.offsets(N)]
        assert all(math.isfinite(v) and spread.bounds[0] <= v <= spread.bounds[1] for v in vals)
        x = spread.from_ctrl(spread.to_ctrl(b) + shift)
        assert spread.bounds[0] <= x <= spread.bounds[1]
