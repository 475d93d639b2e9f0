"""Reliability (issue 17): resumes and checkpoints that never lie, guards that never poison or stall healthy
replicas. Each test reproduces a user's set-up: DDP under spawned gloo processes, or the one-process engine."""

from __future__ import annotations

import math
import os
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hdet
from hdet.engine import ReplicaEngine
from hdet.guard import all_finite, finite_allreduce_hook
from helpers import ScriptedReplicas, check_ok, file_init_method, roundtrip, run_gloo


def _train_kw(rank, world, kw):
    from dist_workers import train

    return train(rank, world, **kw)


# ------------------------------------------------------------ 1. explored values reach the optimizer after a resume
def test_explored_weight_decay_and_betas_follow_a_reloaded_optimizer():
    """optimizer.load_state_dict() replaces the param-group dicts; WeightDecay/AdamBeta must write into the
    new ones, so what hdet reports is what the optimizer uses."""
    torch.manual_seed(0)
    m = nn.Linear(4, 2)
    o = torch.optim.Adam(m.parameters(), lr=0.1, weight_decay=0.01)
    wd, b2 = hdet.WeightDecay(o, alpha=0.5), hdet.AdamBeta(o, index=1, alpha=0.01)
    s = hdet.HDETLR(o, None, total_steps=20, replicas=ScriptedReplicas(3, 4), explore=[wd, b2],
                    model_sync_interval=5)
    o.load_state_dict(roundtrip(o.state_dict()))  # what a resume does: new param-group dicts
    s.load_state_dict(roundtrip(s.state_dict()))
    g = o.param_groups[0]
    assert g["weight_decay"] == s.hyperparameters[wd.name] != 0.01  # replica 3's own, not the saved base
    assert g["betas"][1] == s.hyperparameters[b2.name]
    o.step()
    s.step(1.0)
    assert o.param_groups[0]["weight_decay"] == s.hyperparameters[wd.name]


@pytest.mark.distributed
def test_ddp_resume_with_explored_weight_decay_is_bitwise(tmp_path):
    """2 gloo ranks, Adam, weight decay explored, paper controller on: resume at 23 (mid-window) equals the
    uninterrupted run bit for bit, and the optimizer's weight decay equals hdet's reported value each step."""
    kw = dict(steps=40, alpha=0.3, T=10, auto=True, warm=10, loss_scale=0.01, explore_wd=True)
    full = check_ok(run_gloo(_train_kw, 2, kw))
    check_ok(run_gloo(_train_kw, 2, dict(kw, save_at=23, ckpt_dir=str(tmp_path))))
    resumed = check_ok(run_gloo(_train_kw, 2, dict(kw, resume_from=str(tmp_path))))
    for a, b in zip(full, resumed):
        assert all(torch.equal(p, q) for p, q in zip(a["params"], b["params"]))
        assert a["wd"][24:] == b["wd"][1:] and a["lrs"][24:] == b["lrs"][1:]
        for wd, seen in zip(b["wd"], b["wd_hdet"]):
            assert [wd] == list(seen.values())
    assert full[0]["wd"] != full[1]["wd"]  # the two replicas explore different weight decays


# ------------------------------------------------------------ 2. replicas at different steps
@pytest.mark.distributed
def test_replicas_resumed_from_different_steps_are_an_error(tmp_path):
    """Rank 1 resumes from an older checkpoint (step 10) than rank 0 (step 20): the next converge step raises
    ReplicaMismatchError on both ranks, naming the steps, instead of averaging mismatched replicas."""
    kw = dict(steps=40, alpha=0.3, T=10)
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir(), new.mkdir()
    check_ok(run_gloo(_train_kw, 2, dict(kw, save_at=10, ckpt_dir=str(old))))
    check_ok(run_gloo(_train_kw, 2, dict(kw, save_at=20, ckpt_dir=str(new))))
    res = run_gloo(_train_kw, 2, dict(kw, resume_from=[str(new), str(old)]))
    for r in res:
        assert r["error"] == "ReplicaMismatchError", r
        assert "optimizer steps per replica [30, 20]" in r["msg"]


FINGERPRINTS = r"settings fingerprints \(the HDET options, explored hyperparameters and schedules\) per replica \[\d+, \d+\]\."


@pytest.mark.parametrize("differ, match", [("total_steps", r"total_steps per replica \[20, 21\]"),
                                           ("alpha", FINGERPRINTS), ("wd_alpha", FINGERPRINTS),
                                           ("wd_base", FINGERPRINTS), ("explored", FINGERPRINTS),
                                           ("max_lr", FINGERPRINTS), ("wd_schedule", FINGERPRINTS)])
def test_replicas_with_different_settings_are_an_error_in_the_engine(differ, match):
    """One replica built with another total_steps or spread (in the engine, where nothing else would notice), or
    exploring another weight-decay spread, base or list of hyperparameters (those ran to the end silently, each
    replica reporting its own spread, and different lists even drew the LR permutations apart), or with another
    max_lr or weight-decay schedule (an audit: those ran on silently too, the records showing replica 0's)."""
    def make_sched(o, rep, m):
        r = rep.rank
        if differ == "wd_base":
            o.param_groups[0]["weight_decay"] = 0.01 * (1 + r)
        sched = (lambda t, r=r: 0.01 * (1 + r)) if differ == "wd_schedule" else None
        explore = [hdet.WeightDecay(o, alpha=0.5 + 0.5 * r * (differ == "wd_alpha"), schedule=sched)]
        if differ == "explored" and r:
            explore.append(hdet.GradClip(1.0))
        return hdet.OneCycleAutoLR(o, max_lr=0.1 * (1 + r * (differ == "max_lr")),
                                   total_steps=20 + r * (differ == "total_steps"), model_sync_interval=2,
                                   replicas=rep, model=m, ensemble_lr_spread_ratio=0.1 * r * (differ == "alpha"),
                                   explore=explore)

    eng = ReplicaEngine(nn.Linear(3, 1), 2, lambda m: torch.optim.SGD(m.parameters(), lr=0.1, weight_decay=0.01),
                        make_sched, mode="loop")
    batch = [(torch.randn(4, 3), torch.randn(4, 1))] * 2
    eng.step(batch, lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]))
    with pytest.raises(hdet.ReplicaMismatchError, match=match):
        eng.step(batch, lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]))


def test_bases_a_rank_computes_in_its_last_bits_apart_are_not_a_mismatch():
    """A max_lr each rank computes from the same numbers (an LR sweep's pick through LAPACK) can differ in its last
    bits: the fingerprint takes the scheduled bases to 6 significant digits, so that is no error (a CI run of
    `hdet train --lr-sweep` under torchrun stopped at its first sync before), while another max_lr is."""
    def make_sched(o, rep, m):
        return hdet.OneCycleAutoLR(o, max_lr=0.1 * (1 + 4e-16 * rep.rank), total_steps=20, model_sync_interval=2,
                                   replicas=rep, model=m, ensemble_lr_spread_ratio=0.1)

    eng = ReplicaEngine(nn.Linear(3, 1), 2, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), make_sched, mode="loop")
    batch = [(torch.randn(4, 3), torch.randn(4, 1))] * 2
    seen = set()
    for _ in range(4):
        eng.step(batch, lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]))
        seen.add(eng.schedulers[0].ensemble.slots.scheduled[0] != eng.schedulers[1].ensemble.slots.scheduled[0])
    assert True in seen  # (the bases did differ, in their last bits)


def test_an_explored_base_survives_an_optimizer_loaded_before_the_scheduler_is_built():
    """The documented order "load the optimizer first, then the scheduler", with the scheduler built after the
    optimizer's load: the explored weight decay's base was read from the loaded optimizer (this replica's spread
    value, x2 here), so the spread compounded (0.2 instead of 0.1 for replica 1) and replicas' bases disagreed."""
    def build(opt_state=None, sched_state=None):
        torch.manual_seed(0)
        m = nn.Linear(3, 1)
        o = torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.05)
        if opt_state is not None:
            o.load_state_dict(opt_state)
        s = hdet.HDETLR(o, None, total_steps=40, replicas=ScriptedReplicas(1, 2), model_sync_interval=100,
                        ensemble_lr_spread_ratio=0.2, explore=[hdet.WeightDecay(o, alpha=1.0)])
        if sched_state is not None:
            s.load_state_dict(sched_state)
        return m, o, s

    def steps(m, o, s, n):
        wds = []
        for _ in range(n):
            m(torch.ones(2, 3)).sum().backward()
            o.step()
            o.zero_grad()
            s.step()
            wds.append(o.param_groups[0]["weight_decay"])
        return wds

    m, o, s = build()
    steps(m, o, s, 3)
    saved = roundtrip({"model": m.state_dict(), "opt": o.state_dict(), "sched": s.state_dict()})
    own = o.param_groups[0]["weight_decay"]
    assert own == pytest.approx(0.1) or own == pytest.approx(0.025)  # replica 1 of 2: the base x2 or /2
    full = steps(m, o, s, 3)
    m2, o2, s2 = build(saved["opt"], saved["sched"])
    m2.load_state_dict(saved["model"])
    assert steps(m2, o2, s2, 3) == full == [pytest.approx(own)] * 3
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), m2.parameters()))
    assert s2.ensemble.hypers[0].initial == pytest.approx(0.05)
    old = roundtrip(saved["sched"])
    del old["hdet"]["hyper_bases"]  # a checkpoint from before the bases were saved
    with pytest.warns(UserWarning, match="predates saved explored bases.*build the scheduler, then load"):
        build(saved["opt"], old)


# ------------------------------------------------------------ 3. the hook guard and fp16
def test_the_hook_guard_checks_elements_not_an_overflowing_fp16_sum():
    big = torch.full((100,), 60000.0, dtype=torch.float16)  # every element finite, the fp16 sum is inf
    assert not torch.isfinite(big.sum()) and bool(all_finite(big))
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        x = torch.ones(10, dtype=dtype)
        assert bool(all_finite(x))
        for bad in (float("nan"), float("inf"), -float("inf")):
            y = x.clone()
            y[3] = bad
            assert not bool(all_finite(y))
    huge = torch.full((4,), 1e308, dtype=torch.float64)  # float64: element by element
    assert bool(all_finite(huge))


class _Bucket:
    def __init__(self, t):
        self.t = t

    def buffer(self):
        return self.t


def _hook_fp16(rank, world):
    buf = torch.full((100,), 600.0 * (rank + 1), dtype=torch.float16)  # the bucket's fp16 sum overflows
    out = finite_allreduce_hook(None, _Bucket(buf)).wait()
    bad = torch.ones(4, dtype=torch.float16) * (float("nan") if rank == 1 else 1.0)
    out_bad = finite_allreduce_hook(None, _Bucket(bad)).wait()
    return {"healthy": out.float().tolist(), "bad": out_bad.float().tolist()}


@pytest.mark.distributed
def test_hook_guard_keeps_healthy_fp16_gradients_under_gloo():
    res = check_ok(run_gloo(_hook_fp16, 2))
    for r in res:
        assert r["healthy"] == [900.0] * 100  # (600 + 1200) / 2: not zeroed
        assert r["bad"] == [0.5] * 4  # rank 1's NaN contribution counts as 0


def _scaler_ddp(rank, world):
    """Plain DDP + OneCycleLR and hdet at alpha 0 (the hook guard: a non-fused AdamW) under fp16 autocast with
    torch.amp.GradScaler, as torch's AMP recipe writes it, for three ways to overflow."""
    from dist_workers import fp16_scaled_backward

    out = {}
    for mode, steps in (("scale overflows from the start", 24), ("scale grows until it overflows", 40),
                        ("one rank overflows", 24)):
        for use_hdet in (False, True):
            torch.manual_seed(0)
            net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
            model = DDP(net)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            grow = mode.startswith("scale grows")
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** (30 if mode.endswith("start") else 10),
                                          growth_interval=2 if grow else 1000)
            sched = (hdet.OneCycleAutoLR(opt, max_lr=1e-2, total_steps=steps, model_sync_interval=6, model=model)
                     if use_hdet else torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=steps))
            scales, guard = [], getattr(sched, "gradient_guard", None)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for step in range(1, steps + 1):
                    loss = fp16_scaled_backward(model, opt, scaler, rank, step,  # fp16 overflow in rank 1's
                                                overflow=mode == "one rank overflows" and rank == 1  # backward only
                                                and step in (5, 6, 7))
                    scaler.step(opt)
                    scaler.update()
                    sched.step(loss.detach()) if use_hdet else sched.step()  # every step, as torch's recipe
                    scales.append(scaler.get_scale())
            out[mode, use_hdet] = {"params": [p.detach().clone() for p in net.parameters()], "scales": scales,
                                   "guard": guard, "hdet_warnings": [str(w.message) for w in caught
                                                                     if "no optimizer.step()" in str(w.message)]}
    return out


@pytest.mark.distributed
def test_the_hook_guard_leaves_fp16_overflows_to_the_grad_scaler():
    """With a non-fused optimizer the guard is the DDP hook, which zeroes a non-finite contribution: under fp16's
    GradScaler that hid every overflow from the scaler, which then never skipped a step nor lowered its scale (it
    grew without bound), and the optimizer stepped on zeros, silently (an audit found it, Lightning's "16-mixed"
    included). Now the run is plain DDP's bit for bit, scale for scale, and hdet does not warn about the skipped
    steps the scheduler was stepped after."""
    res = check_ok(run_gloo(_scaler_ddp, 2))
    for rank in res:
        for mode in ("scale overflows from the start", "scale grows until it overflows", "one rank overflows"):
            plain, ours = rank[mode, False], rank[mode, True]
            assert ours["guard"] == "hook"
            assert any(b < a for a, b in zip(plain["scales"], plain["scales"][1:])), mode  # the scaler skipped
            assert ours["scales"] == plain["scales"], mode
            for a, b in zip(ours["params"], plain["params"]):
                assert torch.equal(a, b), mode
            assert ours["hdet_warnings"] == [], mode


def _fp16_ddp(fused, init_scale=2.0 ** 10, T=20, growth_interval=2000):
    """A small DDP model under fp16 with a GradScaler and HDET (60 steps): (net, model, opt, scaler, sched)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    model = DDP(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    sched = hdet.OneCycleAutoLR(opt, max_lr=1e-2, total_steps=60, model_sync_interval=T, model=model,
                                ensemble_lr_spread_ratio=0.2)
    return net, model, opt, scaler, sched


def _fp16_steps(parts, rank, steps, nan_at=25):
    """Torch's AMP recipe over ``steps``; rank 1's weight turns NaN at step ``nan_at``. Returns per step the scale and
    whether net[2] moved."""
    net, model, opt, scaler, sched = parts
    scales, moved = [], []
    for step in steps:
        if step == nan_at and rank == 1:
            with torch.no_grad():
                net[0].weight[0, 0] = float("nan")
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(16, 8, generator=g)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), x[:, :1] * 2 - x[:, 1:2])
        opt.zero_grad()
        before = net[2].weight.detach().clone()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step(loss.detach())
        scales.append(scaler.get_scale())
        moved.append(not torch.equal(before, net[2].weight))
    return scales, moved


def _scaler_nan_replica(rank, world, fused):
    """fp16 with a GradScaler, T = 20: rank 1's weight turns NaN at step 25 (after the healthy sync at 20)."""
    parts = _fp16_ddp(fused)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the recovery's own warnings
        scales, moved = _fp16_steps(parts, rank, range(1, 61))
    return {"scales": scales, "moved": moved, "guard": parts[4].gradient_guard,
            "finite": all(torch.isfinite(p).all() for p in parts[0].parameters())}


@pytest.mark.distributed
@pytest.mark.parametrize("fused", [False, True], ids=["hook", "skip"])
def test_a_reset_replica_takes_the_grad_scaler_back_to_a_healthy_scale(fused):
    """A NaN weight on one replica makes every step overflow until hdet resets it; the scaler halves its scale at
    each skipped step (1024 -> 2 -> 0.06 here), and, growing 2x per 2000 clean steps, fp16 training would then barely
    move again. With the reset the scale goes back to the last healthy sync's (1024 at step 20)."""
    res = check_ok(run_gloo(_scaler_nan_replica, 2, fused))
    for out in res:
        assert out["guard"] == ("skip-all" if fused else "hook")
        at20, s = out["scales"][19], out["scales"]
        assert min(s[25:39]) < at20 / 100  # the stall really collapsed it
        assert s[39] == at20 and out["finite"] and all(out["moved"][40:])


def _scaler_stall(rank, world, opts):
    """fp16 with a GradScaler, T = 100, 60 steps: rank 1's weight turns NaN at step ``nan_at`` (None: never)."""
    parts = _fp16_ddp(opts["fused"], opts["init_scale"], T=100, growth_interval=opts.get("growth_interval", 2000))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scales, moved = _fp16_steps(parts, rank, range(1, 61), opts["nan_at"])
    return {"scales": scales, "moved": moved, "guard": parts[4].gradient_guard,
            "warnings": [str(w.message) for w in caught if str(w.message).startswith("hdet:")],
            "finite": all(torch.isfinite(p).all() for p in parts[0].parameters())}


@pytest.mark.distributed
@pytest.mark.parametrize("fused", [False, True], ids=["hook", "skip"])
def test_a_nan_replica_under_a_grad_scaler_is_reset_early(fused):
    """T = 100, rank 1's weight NaN at step 25: every step overflows on every replica and the scaler skips them all.
    The "skip" guard's counter (a fused optimizer) ended that stall early; the hook guard's (a non-fused one) had
    none, and every replica stood still until the converge step at 100 (the scale at 1e-14 by then). Now the hook
    guard counts the steps the scaler skipped: at the 10th in a row (step 34) the NaN replica is reset and the scale
    goes back to the last healthy one; the skip guard's lagged read does it at step 50."""
    res = check_ok(run_gloo(_scaler_stall, 2, {"fused": fused, "init_scale": 2.0 ** 10, "nan_at": 25}))
    at = 50 if fused else 34
    for out in res:
        assert out["guard"] == ("skip-all" if fused else "hook")
        assert any(f"early recovery at step {at} replica(s) [1]" in w for w in out["warnings"]), out["warnings"]
        assert not any(out["moved"][24:at - 1]) and all(out["moved"][at:])  # (at `at`, the reset moves rank 1)
        assert min(out["scales"][24:at - 1]) < out["scales"][23] / 100  # the stall collapsed the scale
        assert out["scales"][at - 1] == out["scales"][23] and out["finite"]  # back to step 24's


@pytest.mark.distributed
@pytest.mark.parametrize("fused", [False, True], ids=["hook", "skip"])
def test_a_grad_scalers_first_skipped_steps_are_not_a_stall(fused):
    """A GradScaler that starts at 2^30 skips the first ~20 steps while it lowers its scale to fit fp16: its normal
    work, with every replica's weights the initial ones. The skip guard's early recovery took it for a stall and
    warned that the loss or gradients were non-finite "for another reason"; neither watch counts steps before the
    first one taken now."""
    res = check_ok(run_gloo(_scaler_stall, 2, {"fused": fused, "init_scale": 2.0 ** 30, "nan_at": None}))
    for out in res:
        first = out["moved"].index(True)
        assert first >= 12, first  # the scaler skipped a stretch longer than a watch's
        assert out["moved"][first:].count(False) <= 2 and out["finite"]  # (a last overflow or two as the scale grows)
        assert out["warnings"] == [], out["warnings"]


@pytest.mark.distributed
@pytest.mark.parametrize("fused", [False, True], ids=["hook", "skip"])
def test_a_stall_before_any_kept_scale_still_takes_the_grad_scaler_back(fused):
    """A NaN weight at step 3, before any healthy sync and before the watches' first stretch of taken steps: the
    reset put nothing back and the scale stayed collapsed (an audit: 16384 -> 16 under the hook guard, -> 1.2e-4
    under "skip-all", growing back 2x per 2000 steps). Now the watches keep the scale of every step taken, and the
    reset goes back to step 2's."""
    res = check_ok(run_gloo(_scaler_stall, 2, {"fused": fused, "init_scale": 2.0 ** 10, "nan_at": 3}))
    for out in res:
        s, moved = out["scales"], out["moved"]
        assert moved[:2] == [True, True] and not any(moved[2:10])  # steps 1-2 taken, then the stall
        back = moved.index(True, 2)  # the reset (an early recovery) moves rank 1 at step back + 1
        assert min(s[2:back]) < s[1] / 100  # the stall collapsed the scale
        assert s[back] == s[1] and out["finite"] and all(moved[back + 1:])


@pytest.mark.distributed
@pytest.mark.parametrize("fused", [False, True], ids=["hook", "skip"])
def test_a_reset_takes_the_scale_of_the_last_step_taken_even_as_it_grows(fused):
    """A scale that grows at every step (growth_interval=1) and a NaN weight at step 26: the reset goes back to step
    25's scale, the last step taken. The skip guard's lagged read kept, after the per-step one, the scale of the copy
    taken a poll earlier: step 20's, 2^5 lower (a review)."""
    res = check_ok(run_gloo(_scaler_stall, 2, {"fused": fused, "init_scale": 2.0 ** -20, "nan_at": 26,
                                               "growth_interval": 1}))
    for out in res:
        s, moved = out["scales"], out["moved"]
        last = max(i for i in range(25) if moved[i])  # the last step taken (fp16 overflows now and then: skipped)
        assert s[last] > s[19] * 2  # it grew after step 20's
        back = next(i for i in range(26, 60) if s[i] > s[i - 1] * 4)  # the reset puts a scale back
        assert s[back] == s[last] and out["finite"], (back, s[back], last, s[last])


def _scaler_stall_resumed(rank, world, fused):
    """fp16 with a GradScaler, T = 100: rank 1's weight turns NaN at step 25; every rank checkpoints at step 26 (in the
    stall) and a new process state resumes from it for steps 27-60."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = _fp16_ddp(fused, T=100)
        _fp16_steps(first, rank, range(1, 27))
        saved = roundtrip({"model": first[0].state_dict(), "opt": first[2].state_dict(),
                           "scaler": first[3].state_dict(), "sched": first[4].state_dict()})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = _fp16_ddp(fused, T=100)
        again[0].load_state_dict(saved["model"])
        again[2].load_state_dict(saved["opt"])
        again[3].load_state_dict(saved["scaler"])
        again[4].load_state_dict(saved["sched"])
        _fp16_steps(again, rank, range(27, 61))
    return {"warnings": [str(w.message) for w in caught if str(w.message).startswith("hdet:")],
            "finite": all(torch.isfinite(p).all() for p in again[0].parameters())}


@pytest.mark.distributed
@pytest.mark.parametrize("fused", [False, True], ids=["hook", "skip"])
def test_a_run_resumed_in_a_stall_is_reset_early_too(fused):
    """The watches count a stall only after a step was taken in this process (a GradScaler's first skips are its own
    work), so a run resumed from a checkpoint taken in a stall stood still until the converge step (here: never, T =
    100 > 60 steps). A resumed run has taken steps, and the checkpoint holds the watches' counts: the NaN replica is
    reset at the step the run that was never stopped resets it (test_a_nan_replica_under_a_grad_scaler_is_reset_early:
    34 under the hook guard, 50 under the skip guard; before the counts were saved, the hook guard's came at 37)."""
    res = check_ok(run_gloo(_scaler_stall_resumed, 2, fused))
    at = 50 if fused else 34
    for out in res:
        assert any(f"early recovery at step {at} replica(s) [1]" in w for w in out["warnings"]), out["warnings"]
        assert out["finite"]


def _compiled_ddp_nan(rank, world, fused):
    """torch.compile(DDP(net)), as torch's DDP tutorial writes it; rank 1's loss is NaN at step 5 (T = 10)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    model = torch.compile(DDP(net), backend="eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    sched = hdet.OneCycleAutoLR(opt, max_lr=1e-2, total_steps=12, model_sync_interval=10, model=model,
                                ensemble_lr_spread_ratio=0.2)
    local, finite = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the sync's note of rank 1's NaN loss
        for t in range(1, 13):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * t + rank))
            if t == 3:
                with model.no_sync():
                    loss = model(x).pow(2).mean()
            else:
                loss = model(x).pow(2).mean()
            local.append(sched._guard.local)
            if t == 5 and rank == 1:
                loss = loss * float("nan")
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step(loss.detach())
            finite.append(all(bool(torch.isfinite(p).all()) for p in net.parameters()))
    return {"guard": sched.gradient_guard, "finite": finite, "local": local}


@pytest.mark.distributed
@pytest.mark.parametrize("fused", [False, True], ids=["hook", "skip"])
def test_a_compiled_ddp_model_gets_the_gradient_guard(fused):
    """``model=torch.compile(DDP(net))``: hdet looked for a DistributedDataParallel module, found torch.compile's
    wrapper, and installed no guard, silently; one replica's NaN loss then reached every replica's weights through
    DDP's average (and the sync raised NonFiniteReplicaError, every replica bad). The guard now goes on the DDP
    module inside, and its local-mode note (ddp.no_sync()) sees the compiled forward."""
    res = check_ok(run_gloo(_compiled_ddp_nan, 2, fused))
    for out in res:
        assert out["guard"] == ("skip-all" if fused else "hook")
        assert all(out["finite"]) and out["local"] == [t == 3 for t in range(1, 13)]


# ------------------------------------------------------------ 4-5. buffers with Inf, complex parameters
class _BN(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.bn = nn.BatchNorm1d(4)
        self.register_buffer("mask", torch.tensor([0.0, -math.inf]))  # persistent, -inf by design

    def forward(self, x):
        return self.bn(self.lin(x)).sum(1, keepdim=True) + self.mask.clamp(min=-1).sum()


def _engine_bn(N=3, T=4, steps=8, poison=None):
    def make_sched(o, rep, m):
        return hdet.OneCycleAutoLR(o, max_lr=0.05, total_steps=steps, model_sync_interval=T, replicas=rep, model=m,
                                   ensemble_lr_spread_ratio=0.2)

    torch.manual_seed(0)
    eng = ReplicaEngine(_BN(), N, lambda m: torch.optim.Adam(m.parameters(), lr=0.01), make_sched, mode="loop")
    g = torch.Generator().manual_seed(1)
    records = []
    for t in range(1, steps + 1):
        batches = [(torch.randn(8, 3, generator=g), torch.randn(8, 1, generator=g)) for _ in range(N)]
        if poison is not None and t == poison[0]:
            with torch.no_grad():
                poison[1](eng.models[1])
        eng.step(batches, lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]))
        if eng.schedulers[0].is_sync_step(t):
            records.append(eng.schedulers[0].last_sync)
    return eng, records


def test_inf_in_one_replicas_batchnorm_variance_is_recovered_not_averaged():
    def poison(m):
        m.bn.running_var[0] = math.inf

    with pytest.warns(UserWarning, match=r"replica\(s\) \[1\] had non-finite weights or buffers"):
        eng, records = _engine_bn(poison=(2, poison))
    assert records[0].recovered == [1] and records[1].recovered == []
    for m in eng.models:
        assert torch.isfinite(m.bn.running_var).all()
        assert torch.equal(m.bn.running_var, eng.models[0].bn.running_var)
        assert m.mask[1] == -math.inf  # the same -inf on every replica is no fault


def test_plus_inf_in_a_buffer_is_a_fault_even_when_every_replica_has_it():
    """+Inf is no mask value: with one replica (nothing to compare with) it is still seen."""
    torch.manual_seed(0)
    m = _BN()
    o = torch.optim.SGD(m.parameters(), lr=0.01)
    s = hdet.OneCycleAutoLR(o, max_lr=0.01, total_steps=4, model_sync_interval=2, model=m)
    with torch.no_grad():
        m.bn.running_var[1] = math.inf
    o.step()
    s.step(1.0)
    o.step()
    with pytest.raises(hdet.NonFiniteReplicaError, match=r"non-finite weights on replica\(s\) \[0\]"):
        s.step(1.0)


def test_a_persistent_inf_mask_alone_is_not_a_fault():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eng, records = _engine_bn()
    assert [r.recovered for r in records] == [[], []]


class _Complex(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(4, dtype=torch.complex64))

    def forward(self, x):
        return (x * self.w).abs().sum()


def _complex(rank, world, nan):
    model = _Complex()
    o = torch.optim.Adam(model.parameters(), lr=0.05)
    s = hdet.OneCycleAutoLR(o, max_lr=0.05, total_steps=6, model_sync_interval=3, ensemble_lr_spread_ratio=0.5,
                            model=model)
    out = {}
    for t in range(1, 7):
        g = torch.Generator().manual_seed(10 * t + rank)
        x = torch.randn(4, dtype=torch.complex64, generator=g)
        loss = model(x)
        o.zero_grad()
        loss.backward()
        for p in model.parameters():  # DDP's average of the (complex) gradient
            dist.all_reduce(p.grad)
            p.grad /= world
        o.step()
        if nan and t == 3 and rank == 1:  # after the step: the sync at 3 finds it
            with torch.no_grad():
                model.w[0] = complex(float("nan"), 0.0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            s.step(loss)
        if t == 2:
            out["differ"] = _gathered(model.w)
        if t == 3:
            out["after"] = _gathered(model.w)
            out["recovered"] = s.last_sync.recovered
    return out


def _gathered(w):
    x = torch.view_as_real(w.detach()).reshape(-1).double()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    return [p.tolist() for p in parts]


@pytest.mark.distributed
@pytest.mark.parametrize("nan", [False, True])
def test_complex_parameters_are_averaged_and_their_nans_seen(nan):
    res = check_ok(run_gloo(_complex, 2, nan))
    for r in res:
        assert r["differ"][0] != r["differ"][1]  # the spread moved the replicas apart
        assert r["after"][0] == r["after"][1] and all(math.isfinite(v) for v in r["after"][0])
        assert r["recovered"] == ([1] if nan else [])


def test_fit_controller_refuses_complex_parameters():
    m = _Complex()
    o = torch.optim.Adam(m.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="does not support complex parameters"):
        hdet.OneCycleAutoLR(o, max_lr=0.1, total_steps=10, model=m, enable_auto_lr=True, auto_lr_warmup_steps=0,
                            model_sync_interval=5, probe=lambda mod: torch.tensor(0.0))


# ------------------------------------------------------------ 6. rank 0's state on every rank
@pytest.mark.distributed
def test_rank0_state_loaded_on_every_rank_gives_each_its_own_lr(tmp_path):
    """Saved at the sync step 20, rank 0's checkpoint loaded on both ranks: each rank's LR right after the
    load is its own (not rank 0's), and the run ends bitwise as the uninterrupted one."""
    kw = dict(steps=40, alpha=0.3, T=10, auto=True, warm=10, loss_scale=0.01)
    full = check_ok(run_gloo(_train_kw, 2, kw))
    check_ok(run_gloo(_train_kw, 2, dict(kw, save_at=20, ckpt_dir=str(tmp_path))))
    resumed = check_ok(run_gloo(_train_kw, 2, dict(kw, resume_from=str(tmp_path), load_rank=0)))
    for a, b in zip(full, resumed):
        assert b["lrs"][0] == a["lrs"][20]  # this replica's own LR for step 21
        assert a["lrs"][20:] == b["lrs"]
        assert all(torch.equal(p, q) for p, q in zip(a["params"], b["params"]))
    assert full[0]["lrs"][20] != full[1]["lrs"][20]


def _ddp_step(ddp, o, s, x, y, nan=False):
    """One DDP training step (a NaN loss if ``nan``), the scheduler's warnings silenced."""
    loss = nn.functional.mse_loss(ddp(x), y) * (float("nan") if nan else 1.0)
    o.zero_grad()
    loss.backward()
    o.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s.step(loss)


# ------------------------------------------------------------ 7. plain-data checkpoints
def _fused_ddp_state(rank, world):
    """The README's recommended set-up (DDP, fused AdamW: the skip guard) with a FitController template:
    the state is plain data, loads with weights_only=True, and the live guard stays the live one."""
    from dist_workers import Probe, batch, make_model

    model = make_model(0)
    ddp = DDP(model, broadcast_buffers=False)
    o = torch.optim.AdamW(ddp.parameters(), lr=0.01, fused=True)
    s = hdet.OneCycleAutoLR(o, max_lr=0.02, total_steps=20, ensemble_lr_spread_ratio=0.3, model_sync_interval=5,
                            enable_auto_lr=True, auto_lr_warmup_steps=5, model=ddp, probe=Probe(),
                            controller=hdet.FitController(kappa=0.3), explore=[hdet.WeightDecay(o)])
    s.record_schedule()
    for t in range(1, 8):
        _ddp_step(ddp, o, s, *batch(rank, t), nan=t == 3)
    guard = s.skip_guard
    state = roundtrip(s.state_dict())
    s2 = hdet.OneCycleAutoLR(o, max_lr=0.02, total_steps=20, ensemble_lr_spread_ratio=0.3, model_sync_interval=5,
                             enable_auto_lr=True, auto_lr_warmup_steps=5, model=ddp, probe=Probe(),
                             controller=hdet.FitController(kappa=0.3), explore=[hdet.WeightDecay(o)])
    s.load_state_dict(state)
    return {"keys": sorted(state), "guard_kept": s.skip_guard is guard, "skipped": float(guard.skipped),
            "lr": s.get_last_lr(), "lr_fresh_load": (s2.load_state_dict(state), s2.get_last_lr())[1],
            "template": s.ensemble.config.controller.kappa}


@pytest.mark.distributed
def test_recommended_setup_state_loads_with_weights_only():
    res = check_ok(run_gloo(_fused_ddp_state, 2))
    for r in res:
        assert "skip_guard" not in r["keys"] and "_fit_template" not in r["keys"] and "gradient_guard" not in r["keys"]
        assert r["guard_kept"] and r["skipped"] == 1.0 and r["template"] == 0.3
        assert r["lr"] == r["lr_fresh_load"]


@pytest.mark.parametrize("setup", ["onecycle", "hdetlr-step", "hdetlr-callable", "engine", "config", "fit-template"])
def test_every_readme_setup_saves_plain_data(setup):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.1), nn.Linear(4, 1))
    o = torch.optim.AdamW(m.parameters(), lr=0.1)
    explore = [hdet.WeightDecay(o), hdet.Dropout(m), hdet.GradClip(1.0)]
    if setup == "onecycle":
        s = hdet.OneCycleAutoLR(o, max_lr=0.1, total_steps=20, ensemble_lr_spread_ratio=0.2, model=m,
                                explore=explore, enable_auto_lr=True, auto_lr_warmup_steps=5, model_sync_interval=5,
                                controller="paper").record_schedule()
    elif setup == "hdetlr-step":
        s = hdet.HDETLR(o, torch.optim.lr_scheduler.StepLR(o, 5), total_steps=20, model=m, explore=explore)
    elif setup == "hdetlr-callable":
        s = hdet.HDETLR(o, lambda t: 0.1 / (1 + t), total_steps=20, model=m, explore=explore)
    elif setup == "config":
        cfg = hdet.HDETConfig(ensemble_lr_spread_ratio=0.2, model_sync_interval=5, enable_auto_lr=True,
                              controller="paper")
        s = hdet.HDETLR(o, torch.optim.lr_scheduler.CosineAnnealingLR(o, 20), total_steps=20, config=cfg, model=m)
    elif setup == "fit-template":
        s = hdet.OneCycleAutoLR(o, max_lr=0.1, total_steps=20, model=m, enable_auto_lr=True, auto_lr_warmup_steps=5,
                                model_sync_interval=2, controller=hdet.FitController(kappa=0.3),
                                probe=lambda mod: mod(torch.ones(4, 3)).pow(2).mean())
    else:
        eng = ReplicaEngine(m, 2, lambda mod: torch.optim.AdamW(mod.parameters(), lr=0.1),
                            lambda opt, rep, mod: hdet.OneCycleAutoLR(opt, max_lr=0.1, total_steps=20, replicas=rep,
                                                                      model=mod, model_sync_interval=3))
        for _ in range(4):
            eng.step([torch.randn(2, 3)] * 2, lambda mod, x: mod(x).pow(2).mean())
        eng.load_state_dict(roundtrip(eng.state_dict()))
        return
    for _ in range(8):
        o.step()
        s.step(torch.tensor(1.0))
    state = roundtrip(s.state_dict())  # weights_only=True
    s.load_state_dict(state)
    if setup == "fit-template":
        assert s.ensemble.config.controller.kappa == 0.3 and s.ensemble.controllers[0].kappa == 0.3


# ------------------------------------------------------------ 8. state checks: validate first, then assign
def _fresh(kind="onecycle", base=None):
    torch.manual_seed(0)
    m = nn.Linear(3, 1)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    if kind == "onecycle":
        return hdet.OneCycleAutoLR(o, max_lr=0.1, total_steps=20, model=m, replicas=ScriptedReplicas(1, 2),
                                   ensemble_lr_spread_ratio=0.2, model_sync_interval=5)
    sched = None if base is None else base(o)
    return hdet.HDETLR(o, sched, total_steps=20, model=m, replicas=ScriptedReplicas(1, 2),
                       ensemble_lr_spread_ratio=0.2, model_sync_interval=5)


def _snapshot(s):
    st = s.state_dict()
    return repr({k: v for k, v in st.items() if k != "hdet"}), repr(st["hdet"]), [g["lr"] for g in s.optimizer.param_groups]


def test_foreign_states_are_refused():
    one = _fresh("onecycle")
    for _ in range(3):
        one.optimizer.step()
        one.step(1.0)
    h = _fresh("hdetlr")
    with pytest.raises(ValueError, match="Expected a HDETLR state_dict, but got one saved by OneCycleAutoLR"):
        h.load_state_dict(one.state_dict())
    with pytest.raises(ValueError, match="Expected a OneCycleAutoLR state_dict, but got one saved by HDETLR"):
        one.load_state_dict(h.state_dict())
    cos = _fresh("hdetlr", lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 10))
    step = _fresh("hdetlr", lambda o: torch.optim.lr_scheduler.StepLR(o, 5))
    with pytest.raises(ValueError, match="Expected the state of a StepLR base, but the state holds a CosineAnnealingLR's"):
        step.load_state_dict(cos.state_dict())
    legacy = cos.state_dict()
    del legacy["base_scheduler"]  # a state from before the field: the keys still tell
    with pytest.raises(ValueError, match=r"StepLR base, but its keys differ: missing \['gamma', 'step_size'\], "
                                         r"unexpected \['T_max', 'eta_min'\]"):
        step.load_state_dict(legacy)
    same = step.state_dict()
    same["base"]["_a_private_key_of_another_torch"] = 1  # private keys vary between torch versions: fine
    step.load_state_dict(same)
    with pytest.raises(ValueError, match="without a base scheduler"):
        h.load_state_dict(cos.state_dict())


@pytest.mark.parametrize("corrupt, match", [
    (lambda st: st["hdet"].__setitem__("rho", [-5.0, 1.0]), r"Eq. 1's multipliers for 2 replicas"),
    (lambda st: st["hdet"]["config"].__setitem__("future_option", 1), r"also has \['future_option'\]: it was saved by a newer"),
    (lambda st: st["hdet"].__setitem__("version", 99), "saved by a newer hdet"),
    (lambda st: st["hdet"]["config"].__setitem__("alpha", "x"), "alpha"),
    (lambda st: st["hdet"].__setitem__("dealer", {"seed": 0}), "a corrupted state_dict"),
    (lambda st: st["hdet"].__setitem__("dealer", {"seed": 0, "generator": torch.zeros(3)}), "a corrupted state_dict"),
    (lambda st: st["hdet"].__setitem__("controllers", [{"kind": "fit"}]), "a corrupted state_dict"),
    (lambda st: st["hdet"].__setitem__("loss_count", -1), "loss_count"),
    (lambda st: st["hdet"].__setitem__("rank", 5), r"rank in \[0, 2\)"),
    (lambda st: st.__setitem__("last_epoch", "3"), "last_epoch"),
    (lambda st: st.__setitem__("_last_lr", [0.1, 0.2]), "one value per param group"),
])
def test_bad_states_raise_value_error_and_change_nothing(corrupt, match):
    s = _fresh()
    for _ in range(7):
        s.optimizer.step()
        s.step(1.0)
    good = s.state_dict()
    st = roundtrip(good)
    corrupt(st)
    other = _fresh()
    before = _snapshot(other)
    with pytest.raises(ValueError, match=match):
        other.load_state_dict(st)
    assert _snapshot(other) == before  # nothing half-written
    other.load_state_dict(roundtrip(good))  # and the good state still loads
    assert other.get_last_lr() == s.get_last_lr()


def test_a_state_saved_before_the_version_field_still_loads():
    s = _fresh()
    for _ in range(7):
        s.optimizer.step()
        s.step(torch.tensor(2.0))
    st = roundtrip(s.state_dict())
    for key in ("version", "scheduler", "loss_n"):  # what the previous format lacked
        st["hdet"].pop(key)
    st["skip_guard"] = None  # ... and held
    other = _fresh()
    other.load_state_dict(st)
    assert other.get_last_lr() == s.get_last_lr() and other.ensemble.window.count == 2
    assert float(other.ensemble.window.finite) == 2.0 and "skip_guard" not in other.state_dict()


# ------------------------------------------------------------ 9-10. faults: skipped steps, stalls
def _fused_fault(rank, world, kw):
    from dist_workers import fault_injection

    return fault_injection(rank, world, **kw)


@pytest.mark.distributed
@pytest.mark.parametrize("norm_type, fault", [(0, "matrix_grad"), (-float("inf"), "matrix_grad_inf"),
                                              (2.0, "matrix_grad")])
def test_a_clip_norm_that_stays_finite_over_a_nan_is_not_taken_as_the_guards_verdict(norm_type, fault):
    """sched.clip_grad_norm_(max_norm, norm_type=0) (torch's count of the non-zero elements) or -inf (the smallest
    magnitude) is finite with a NaN or Inf gradient: handed to the skip guard, it let the step run, and the NaN
    reached both replicas (NonFiniteReplicaError at the sync; an audit). The guard now reads the gradients itself
    for p <= 0, and skips the step as with p = 2."""
    kw = dict(fault=fault, bad_rank=1, at=2, steps=8, T=4, fused=True, clip=True, norm_type=norm_type)
    for r in check_ok(run_gloo(_fused_fault, 2, kw)):
        assert r["error"] is None, r
        assert r["skipped"] == 1.0 and all(r["finite"]) and r["changed"][1] is False, r
        assert r["own_passes"] == (8 if norm_type <= 0 else 0), r


def test_clip_grad_norm_arguments_are_checked():
    """torch takes max_norm=-1 (every gradient turned around: gradient ascent) and nan (every gradient NaN), and
    fails on None or "fro" with a bare float() error; each is now a clear error, before anything is clipped."""
    import hdet

    p = torch.nn.Parameter(torch.ones(3))
    s = hdet.OneCycleAutoLR(torch.optim.SGD([p], lr=0.1), max_lr=0.1, total_steps=4)
    p.grad = torch.ones(3)
    for bad, said in [({"max_norm": -1.0}, "max_norm as a number >= 0"), ({"max_norm": float("nan")}, "max_norm"),
                      ({"max_norm": None}, "max_norm"), ({"max_norm": "1"}, "max_norm"), ({"max_norm": True}, "max_norm"),
                      ({"max_norm": 1.0, "norm_type": "fro"}, "norm_type"), ({"max_norm": 1.0, "norm_type": None}, "norm_type"),
                      ({"max_norm": 1.0, "foreach": "yes"}, "foreach"), ({"max_norm": torch.ones(2)}, "0-d")]:
        with pytest.raises(ValueError, match=said):
            s.clip_grad_norm_(**bad)
        assert torch.equal(p.grad, torch.ones(3))
    assert float(s.clip_grad_norm_(float("inf"), norm_type="inf")) == 1.0  # torch's spellings still work
    assert float(s.clip_grad_norm_(torch.tensor(0.5))) == pytest.approx(3 ** 0.5)
    assert torch.allclose(p.grad, torch.full((3,), 0.5 / 3 ** 0.5), atol=1e-6)


@pytest.mark.distributed
def test_fused_sgd_whose_first_step_the_guard_skips_goes_on_as_if_the_step_was_not_taken():
    """torch's fused SGD makes its momentum buffers with empty_like at the first step and fills them only when it
    steps: a first step skipped by the guard (a NaN loss on one rank) left them uninitialised memory, and the next
    step moved the weights by it (up to 1e34 away from a hand simulation; an audit). The guard now drops buffers a
    skipped step made, and the run equals one in which that step was simply not taken, bit for bit."""
    for r in check_ok(run_gloo(_fused_sgd_first_skip, 2)):
        assert r["skipped"] == 1.0 and r["equal"] and r["max_abs"] < 10, r


def _fused_sgd_first_skip(rank, world):
    from dist_workers import fused_sgd_first_step_skipped

    return fused_sgd_first_step_skipped(rank, world)


@pytest.mark.distributed
def test_one_nan_loss_per_rank_in_a_window_is_counted_not_fatal():
    """Skip guard, 2 ranks: rank 0 has a NaN loss at step 2, rank 1 at step 3 (the same window): both steps
    are skipped everywhere, the weights stay finite, and the sync counts the faults instead of stopping."""
    res = check_ok(run_gloo(_two_nan_losses, 2))
    for r in res:
        assert r["error"] is None, r
        assert r["nonfinite_losses"] == [[1, 1], [0, 0]] and r["recovered"] == [[], []]
        assert r["skipped"] == 2.0 and r["finite"]


def _two_nan_losses(rank, world):
    from dist_workers import batch, make_model

    model = make_model(0)
    ddp = DDP(model, broadcast_buffers=False)
    o = torch.optim.Adam(ddp.parameters(), lr=0.01, fused=True)
    s = hdet.OneCycleAutoLR(o, max_lr=0.02, total_steps=10, ensemble_lr_spread_ratio=0.2, model_sync_interval=5,
                            model=ddp, enable_auto_lr=True, auto_lr_warmup_steps=5, controller="paper")
    nonfinite, recovered = [], []
    try:
        for t in range(1, 11):
            _ddp_step(ddp, o, s, *batch(rank, t), nan=t == 2 + rank)
            if s.is_sync_step(t):
                nonfinite.append(s.last_sync.nonfinite_losses)
                recovered.append(s.last_sync.recovered)
    except hdet.NonFiniteReplicaError as e:
        return {"error": str(e)}
    return {"error": None, "nonfinite_losses": nonfinite, "recovered": recovered,
            "skipped": float(s.skip_guard.skipped), "finite": all(torch.isfinite(p).all() for p in model.parameters())}


@pytest.mark.distributed
def test_a_nan_weight_under_the_skip_guard_stalls_the_replicas_for_a_bounded_stretch():
    """Skip guard, T = 100: a NaN weight on replica 2 at step 7 would freeze every replica until step 100.
    The skip counter, read 10 steps late (no host sync), shows steps 11-20 all skipped at step 30, when
    replica 2 is reset early; every replica trains again, finite and equal after the reset."""
    res = check_ok(run_gloo(_fused_fault, 4, {"fault": "weights", "fused": True, "T": 100, "steps": 120,
                                               "at": 7}))
    for r, out in enumerate(res):
        assert out["error"] is None and out["guard"] == "skip-all"
        frozen = [t for t, c in enumerate(out["changed"], 1) if not c]
        if r != 2:  # (replica 2's own NaN never compares equal to itself)
            assert frozen == list(range(7, 31)), frozen  # NaN in step 7's forward .. the recovery after step 30
        assert out["skipped"] == 24 and all(out["changed"][30:])
        assert all(out["finite"][30:])
        assert any("early recovery at step 30 replica(s) [2]" in w for w in out["warnings"])


def _stall_resumed(rank, world, opts):
    """Skip guard under on_runaway="recover", T = 60: rank 1's weight turns NaN at step 22 and every replica skips
    every step from then. The uninterrupted run, and a run checkpointed after step ``stop`` and resumed in new
    objects (as a new process would): their weights after step 70 and the step each reset rank 1."""
    from dist_workers import batch, make_model

    stop = opts["stop"]

    def build(attach=True):
        model = make_model(0)
        ddp = DDP(model, broadcast_buffers=False)
        o = torch.optim.AdamW(ddp.parameters(), lr=0.01, fused=True)
        s = hdet.OneCycleAutoLR(o, max_lr=0.01, total_steps=70, ensemble_lr_spread_ratio=0.2, model_sync_interval=60,
                                model=ddp if attach else None, on_runaway="recover")
        return model, ddp, o, s

    syncs = {}

    def run(parts, steps, reset):
        model, ddp, o, s = parts
        for t in steps:
            if rank == 1 and t == 22:
                with torch.no_grad():
                    model[3].weight[0, 0] = float("nan")
            _ddp_step(ddp, o, s, *batch(rank, t))
            if rank == 1 and t > 22 and not reset and all(torch.isfinite(p).all() for p in model.parameters()):
                reset.append(t)
            if s.last_sync is not None and s.last_sync.step == t:
                syncs.setdefault(id(s), []).append((t, s.last_sync.recovered_early))

    whole, reset_whole = build(), []
    run(whole, range(1, 71), reset_whole)
    first, reset_resumed = build(), []
    run(first, range(1, stop + 1), reset_resumed)
    saved = roundtrip({"model": first[0].state_dict(), "opt": first[2].state_dict(), "sched": first[3].state_dict()})
    again = build(attach=not opts["late"])
    again[0].load_state_dict(saved["model"])
    again[2].load_state_dict(saved["opt"])
    again[3].load_state_dict(saved["sched"])
    if opts["late"]:  # a framework that attaches the model after the load (attach_model): the counts wait for it,
        assert again[3].state_dict()["guard"] == saved["sched"]["guard"]  # and a state taken meanwhile keeps them
        again[3].attach_model(again[1])
    run(again, range(stop + 1, 71), reset_resumed)
    diff = max(float((a - b).abs().max()) for a, b in zip(whole[0].state_dict().values(), again[0].state_dict().values()))
    early = [syncs[id(whole[3])], syncs[id(again[3])]]
    return {"reset": (reset_whole, reset_resumed), "diff": diff, "guard": whole[3].gradient_guard, "early": early}


@pytest.mark.distributed
@pytest.mark.parametrize("late,stop", [(False, 45), (True, 45), (False, 55)], ids=["model", "attach_model", "after"])
def test_a_run_resumed_in_a_skip_guard_stall_is_reset_where_the_whole_run_is(late, stop):
    """The stall watch's counts (the guard's skip counter, the lagged copy and its last read) are in the checkpoint:
    resumed at step 45, in a stall since step 22, rank 1 is reset at step 50 as in the run that was never stopped,
    and the weights end the same bit for bit. Before, the resumed watch started counting again and the reset came at
    the sync at step 60 (final weights 0.07 apart). The same when the model is attached after the load. The sync at
    step 60 says rank 1 was reset early (recovered_early, kept in the checkpoint: also resumed at step 55, between the
    early recovery and the sync); before, no record named it, and its warning blamed a skipped step or a bad batch."""
    res = check_ok(run_gloo(_stall_resumed, 2, {"stop": stop, "late": late}))
    for out in res:
        assert out["guard"] == "skip"
        if out["reset"][0]:  # (rank 1 records where it was reset)
            assert out["reset"] == ([50], [50]), out["reset"]  # (resumed at 55: found by the first part)
        assert out["diff"] == 0.0, out["diff"]
        assert out["early"] == [[(60, [1]), (70, [])], [(60, [1]), (70, [])]], out["early"]


@pytest.mark.distributed
def test_every_replica_nan_between_syncs_goes_back_at_the_early_recovery():
    """Skip guard, T = 30, on_runaway="recover": every replica's weight turns NaN at step 31. The early recovery
    (after the stretch of skipped steps, at step 50) found every replica bad and raised NonFiniteReplicaError,
    where a sync would have gone back to the best one: the outcome hung on T. Now it goes back to step 30 there,
    cuts the LR and says so in a sync record; training goes on, finite."""
    res = check_ok(run_gloo(_fused_fault, 2, {"fault": "weights", "fused": True, "T": 30, "steps": 60, "at": 31,
                                               "bad_rank": -1, "on_runaway": "recover"}))
    for out in res:
        assert out["error"] is None and out["guard"] == "skip"
        assert (50, 30, 0.7) in out["records"], out["records"]
        assert all(out["finite"][49:]) and all(out["changed"][50:])
        assert not any("finite weights" in w and "[0, 1]" in w and "step 50" in w for w in out["warnings"])
        assert any("at an early recovery at step 50 every replica had non-finite weights" in w for w in out["warnings"])
        at60 = [w for w in out["warnings"] if "at sync step 60" in w and "non-finite training losses" in w]
        assert at60 and all("reset at early recoveries (steps [50, 50];" in w for w in at60), at60  # not "a step
        # the gradient guard skipped": the window still holds the NaN losses of before the go-back


@pytest.mark.distributed
@pytest.mark.parametrize("on_runaway", ["ignore", "recover"])
def test_a_nan_born_in_a_matrix_gradient_is_never_silent(on_runaway):
    """What the sentinels miss: a NaN born in one element of one replica's weight-matrix gradient, off its first row
    (finite loss and activations) at step 31, all-reduced into every replica's gradient. The default guard is
    "skip-all" there (on_runaway="ignore"), which skips that step. Under on_runaway="recover" it is "skip" (biases,
    norm weights and the matrices' first rows), which steps it into
    every replica; every next loss is then NaN, its gradient reaches the sentinels, the steps are skipped, and the
    next sync (step 60; the early recovery's stretch of skipped steps, from step 32, is one short at step 50) finds
    every replica bad and goes back to the best sync (step 30) with the LR cut: finite again, never silently
    wrong."""
    res = check_ok(run_gloo(_fused_fault, 2, {"fault": "matrix_grad", "fused": True, "T": 30, "steps": 60, "at": 31,
                                               "bad_rank": 1, "on_runaway": on_runaway, "guard": "auto"}))
    for out in res:
        assert out["error"] is None and out["guard"] == ("skip" if on_runaway == "recover" else "skip-all")
        assert all(out["finite"][:30]) and out["finite"][59], out["finite"]
        if on_runaway == "ignore":
            assert [t for t, c in enumerate(out["changed"], 1) if not c] == [31] and all(out["finite"])
            assert not [r for r in out["records"] if r[1] is not None] and out["skipped"] == 1
        else:
            assert not any(out["finite"][30:59])  # step 31 stepped the NaN into every replica
            assert out["skipped"] == 29  # steps 32-60: every loss NaN, and the sentinels saw it
            assert [r for r in out["records"] if r[1] is not None] == [(60, 30, 0.7)], out["records"]


@pytest.mark.distributed
@pytest.mark.parametrize("at", [1, 2])
def test_a_collapse_before_the_first_sync_goes_back_to_step_1_only_from_a_healthy_start(at):
    """The same NaN born in a matrix gradient, under recover, before the first sync (T = 30). At step 2 every rank
    goes back to its own state after step 1 (before 2026-11-30: NonFiniteReplicaError, no best sync to go back to),
    at the early recovery, and the run ends finite. At step 1 that state is itself NaN on every rank: it is dropped on
    both (their health rides in the sync vector) and the run stops with NonFiniteReplicaError as before (going back to
    it went on at every sync to the end of the run: a review)."""
    res = run_gloo(_fused_fault, 2, {"fault": "matrix_grad", "fused": True, "T": 30, "steps": 60, "at": at,
                                     "bad_rank": 1, "on_runaway": "recover", "guard": "auto"})
    for out in res:
        if at == 1:
            assert out["error"] == "NonFiniteReplicaError" and "every replica" in out["msg"], out
            continue
        assert out["error"] is None and out["finite"][0] and out["finite"][-1], out
        back = [r for r in out["records"] if r[1] is not None]
        assert back and back[0][1] == 1 and back[0][2] == pytest.approx(0.7), out["records"]
    if at == 2:
        assert torch.equal(torch.cat([p.flatten() for p in res[0]["params"]]),
                           torch.cat([p.flatten() for p in res[1]["params"]]))


def _local_start_fit(rank, world, skipped):
    """Local mode (no DDP, no shared gradient): rank 0's first ``skipped`` steps overflow under a GradScaler, so its
    non-fused Adam makes no moments then (its kept start: the weights only) where rank 1's does; every weight NaN after
    step 5's optimizer step, before its sync."""
    import warnings

    torch.manual_seed(0)
    m = nn.Linear(3, 1)
    o = torch.optim.Adam(m.parameters(), lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = hdet.HDETLR(o, None, total_steps=40, model=m, ensemble_lr_spread_ratio=0.2, model_sync_interval=5,
                        on_runaway="recover")
        scaler = torch.amp.GradScaler("cpu")
        x = torch.randn(8, 3)
        try:
            for t in range(1, 11):
                o.zero_grad()
                loss = m(x).pow(2).mean() * (float("inf") if (t <= skipped and rank == 0) else 1.0)
                scaler.scale(loss).backward()
                scaler.step(o)
                scaler.update()
                if t == 5:
                    with torch.no_grad():
                        m.weight.fill_(float("nan"))
                s.step(loss.detach())
                if t == 5:
                    back = s.last_sync.went_back_to
        except hdet.NonFiniteReplicaError as e:
            return {"error": "NonFiniteReplicaError", "msg": str(e), "step": t}
    return {"error": None, "step": t, "went_back_to": back, "finite": bool(torch.isfinite(m.weight).all())}


@pytest.mark.distributed
@pytest.mark.parametrize("skipped", [1, 4])
def test_ranks_whose_kept_starts_differ_in_layout_decide_the_same(skipped):
    """Whether the kept start still fits the optimizer's state was judged by each rank alone: rank 0's (no moments)
    was dropped and it raised at the collapse, while rank 1 went back to its start and waited in the average, until
    the process group's timeout (a review). The fit rides in the sync vector now. Rank 0's first step skipped: it keeps
    its start again at step 2 (2026-11-30), and both go back at the collapse, each to its own start. Its first four
    skipped (no chance left before the sync to keep it again): its start never fits, and both raise."""
    res = run_gloo(_local_start_fit, 2, skipped)
    if skipped == 1:
        assert [r["error"] for r in res] == [None, None], res
        assert [r["went_back_to"] for r in res] == [2, 1] and all(r["finite"] and r["step"] == 10 for r in res), res
    else:
        assert [r.get("error") for r in res] == ["NonFiniteReplicaError"] * 2, res
        assert [r["step"] for r in res] == [5, 5] and all("every replica" in r["msg"] for r in res), res


def _ddp_scaler_start(rank, world):
    """DDP, a non-fused Adam and a GradScaler whose first scale overflows the first step's gradients (on every rank:
    they are all-reduced), under recover; every weight NaN after step 5's optimizer step, before its sync."""
    import warnings

    torch.manual_seed(0)
    m = nn.Linear(3, 1)
    ddp = DDP(m)
    o = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = hdet.HDETLR(o, None, total_steps=40, model=ddp, ensemble_lr_spread_ratio=0.2, model_sync_interval=5,
                        on_runaway="recover")
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 124)  # x 20 (each gradient): inf at step 1 only
        x = torch.ones(2, 3)
        kept = []
        for t in range(1, 11):
            o.zero_grad()
            loss = 10 * ddp(x).sum()
            scaler.scale(loss).backward()
            scaler.step(o)
            scaler.update()
            if t == 5:
                with torch.no_grad():
                    m.weight.fill_(float("nan"))
                at2 = kept[-1]
            s.step(loss.detach())
            if t == 2:
                kept.append([p.detach().clone() for p in m.parameters()])
            if t == 5:
                back = s.last_sync.went_back_to
                same = all(torch.equal(p, k) for p, k in zip(m.parameters(), at2))
    return {"went_back_to": back, "at_step_2": same, "finite": bool(torch.isfinite(m.weight).all())}


@pytest.mark.distributed
def test_a_ddp_run_whose_grad_scaler_skipped_its_first_step_goes_back_to_step_2_at_a_collapse():
    """As a user writes it: DDP, torch's default (non-fused) Adam and a GradScaler whose first step overflows. The start
    kept after step 1 had no moments and was dropped at the first sync (a collapse then raised); it is kept again at
    step 2 on every rank, and a collapse before the first sync goes back there (2026-11-30)."""
    res = check_ok(run_gloo(_ddp_scaler_start, 2))
    for r in res:
        assert r["went_back_to"] == 2 and r["at_step_2"] and r["finite"], res


def _scaler_resume(rank, world):
    from dist_workers import scaler_resume

    return scaler_resume(rank, world)


@pytest.mark.distributed
def test_a_resumed_run_puts_the_grad_scalers_scale_back_as_the_whole_run_does():
    """An audit: the scale hdet puts back when it resets a replica (the last healthy sync's) was not in the
    scheduler's state, so a run resumed at step 20 left the scaler's scale collapsed after the reset at step 30
    (4 against the whole run's 1024; under fp16 the gradients then underflow). It is saved now (loss_scale_kept),
    and the resumed run follows the whole run: the same scale and weights at every step."""
    res = check_ok(run_gloo(_scaler_resume, 2))
    for out in res:
        assert out["kept"] == 1024.0
        whole, resumed = out["whole"][20:], out["resumed"]
        assert [s for s, _ in whole] == [s for s, _ in resumed]
        assert whole[7][0] < 1024.0 and whole[9][0] == 1024.0  # collapsed at step 28, put back by the sync at 30
        for (_, a), (_, b) in zip(whole[10:], resumed[10:]):  # (NaN in rank 0's weights before the reset)
            assert torch.equal(a, b)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), "1024", True])
def test_a_bad_kept_loss_scale_in_a_state_is_refused_before_anything_is_set(bad):
    o = torch.optim.AdamW([nn.Parameter(torch.zeros(2))], lr=0.1)
    s = hdet.HDETLR(o, None, total_steps=10, replicas=ScriptedReplicas(0, 2), model_sync_interval=5)
    state = s.state_dict()
    assert state["loss_scale_kept"] is None  # no GradScaler seen
    fresh = hdet.HDETLR(o, None, total_steps=10, replicas=ScriptedReplicas(0, 2), model_sync_interval=5)
    with pytest.raises(ValueError, match=r"Expected the state's loss_scale_kept as a finite scale > 0 or None"):
        fresh.load_state_dict({**state, "loss_scale_kept": bad})
    fresh.load_state_dict({**state, "loss_scale_kept": 512.0})
    assert fresh._loss_scale.kept_value() == 512.0


@pytest.mark.parametrize("bad", [{"kind": "skip"}, {"kind": "other"}, [1, 2],
                                 {"kind": "hook", "hook_taken": -1, "taken": None, "missed": 0},
                                 {"kind": "skip", "skipped": float("nan"), "checked": 3, "pending": None, "seen": None,
                                  "taken": False},
                                 {"kind": "skip", "skipped": 1.0, "checked": 3, "pending": [1.0, 2], "seen": None,
                                  "taken": False},
                                 {"kind": "skip", "skipped": 1.5, "checked": 3, "pending": None, "seen": None,
                                  "taken": False},
                                 {"kind": "skip", "skipped": 4.0, "checked": 3, "pending": None, "seen": None,
                                  "taken": True},
                                 {"kind": "skip", "skipped": 2.0, "checked": 3, "pending": [2.0, 4, None], "seen": 1.0,
                                  "taken": True}])
def test_bad_guard_counts_in_a_state_are_refused_before_anything_is_set(bad):
    """The stall watch's counts travel in the scheduler's state ("guard"): checked with the rest; None (no watch, or a
    state saved before them) loads."""
    o = torch.optim.AdamW([nn.Parameter(torch.zeros(2))], lr=0.1)
    s = hdet.HDETLR(o, None, total_steps=10, replicas=ScriptedReplicas(0, 2), model_sync_interval=5)
    state = s.state_dict()
    assert state["guard"] is None  # no guard installed (no DDP model)
    fresh = hdet.HDETLR(o, None, total_steps=10, replicas=ScriptedReplicas(0, 2), model_sync_interval=5)
    with pytest.raises(ValueError, match=r"Expected the state's gradient guard counts"):
        fresh.load_state_dict({**state, "guard": bad})
    assert fresh._guard._loaded is None
    fresh.load_state_dict({k: v for k, v in state.items() if k != "guard"})
    fresh.load_state_dict({**state, "guard": {"kind": "hook", "hook_taken": 3, "taken": 3, "missed": 1}})
    assert fresh._guard._loaded["missed"] == 1  # kept until a watch is installed
    good = {"kind": "skip", "skipped": 2.0, "checked": 5, "pending": [1.0, 4, None], "seen": 1.0, "taken": True}
    fresh.load_state_dict({**state, "guard": good})
    assert fresh.state_dict()["guard"] == good


@pytest.mark.parametrize("bad", [[[5, 10]], [[0, 10], [0, 12]], [[0, True]], [[0, 0]], "x"])
def test_bad_early_recoveries_in_a_state_are_refused(bad):
    o = torch.optim.AdamW([nn.Parameter(torch.zeros(2))], lr=0.1)
    s = hdet.HDETLR(o, None, total_steps=10, replicas=ScriptedReplicas(0, 2), model_sync_interval=5)
    state = s.state_dict()
    assert state["hdet"]["early_recovered"] == []
    with pytest.raises(ValueError, match=r"early_recovered as \[\[replica, step\], \.\.\.\]"):
        s.load_state_dict({**state, "hdet": {**state["hdet"], "early_recovered": bad}})
    s.load_state_dict({**state, "hdet": {**state["hdet"], "early_recovered": [[1, 3]]}})
    assert s.ensemble.early_recovered == {1: 3}


# ------------------------------------------------------------ 11. errors that say what happened
def test_an_error_in_the_users_probe_is_the_users_error():
    class Boom(RuntimeError):
        pass

    def probe(model):
        raise Boom("my probe broke")

    for mode in ("process", "engine"):
        torch.manual_seed(0)
        m = nn.Linear(3, 1)
        mk = lambda o, rep, mod: hdet.OneCycleAutoLR(o, max_lr=0.1, total_steps=10, model_sync_interval=2,  # noqa: E731
                                                     enable_auto_lr=True, auto_lr_warmup_steps=0, model=mod,
                                                     probe=probe, replicas=rep)
        with pytest.raises(Boom, match="my probe broke"):
            if mode == "process":
                o = torch.optim.SGD(m.parameters(), lr=0.1)
                s = mk(o, None, m)
                for _ in range(2):
                    o.step()
                    s.step(1.0)
            else:
                eng = ReplicaEngine(m, 2, lambda mod: torch.optim.SGD(mod.parameters(), lr=0.1), mk, mode="loop")
                for _ in range(2):
                    eng.step([torch.randn(2, 3)] * 2, lambda mod, x: mod(x).pow(2).mean())


def _dies_while_averaging(rank, world, out_dir):
    from datetime import timedelta

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=file_init_method(out_dir), rank=rank, world_size=world,
                            timeout=timedelta(seconds=20))
    m = nn.Linear(200, 200)
    o = torch.optim.SGD(m.parameters(), lr=0.01)
    s = hdet.OneCycleAutoLR(o, max_lr=0.01, total_steps=10, model_sync_interval=2, model=m, bucket_cap_mb=0.01)
    if rank == 1:
        s.ensemble.replicas._average = lambda *a: os._exit(0)  # dies after the all_gather, before averaging
    res = {"error": None}
    try:
        for _ in range(2):
            o.step()
            s.step(1.0)
    except hdet.ReplicaSyncError as e:
        res = {"error": "ReplicaSyncError", "msg": str(e)}
        try:  # a checkpoint of the half-stepped scheduler (and partly averaged weights) would resume silently wrong
            s.state_dict()
            res["save"] = "saved"
        except RuntimeError as e2:
            res["save"] = str(e2)
    except Exception as e:  # noqa: BLE001 - the test wants to see what came out
        res = {"error": type(e).__name__, "msg": str(e)}
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    os._exit(0)


@pytest.mark.distributed
def test_a_rank_dying_during_averaging_is_a_replica_sync_error(tmp_path):
    mp.spawn(_dies_while_averaging, args=(2, str(tmp_path)), nprocs=2, join=True)
    res = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert res["error"] == "ReplicaSyncError", res
    assert "failed while averaging" in res["msg"] and "optimizer step 2" in res["msg"]
    assert "Expected a scheduler whose last converge step finished" in res["save"], res["save"]


def test_numpy_scalars_are_numbers():
    m = nn.Linear(3, 1)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    s = hdet.OneCycleAutoLR(o, max_lr=np.float32(0.1), total_steps=np.int64(10), model_sync_interval=np.int64(5),
                            ensemble_lr_spread_ratio=np.float64(0.2), seed=np.int32(3), model=m,
                            replicas=ScriptedReplicas(0, 2))
    for _ in range(5):
        o.step()
        s.step(np.float32(1.5))
    assert s.last_sync.losses == [1.5, 1.5]
    assert type(s.ensemble.config.model_sync_interval) is int and type(s.ensemble.config.ensemble_lr_spread_ratio) is float
    h = hdet.HDETLR(o, None, total_steps=np.int64(10), average_optimizer_state=np.bool_(True),
                    enable_auto_lr=np.bool_(False), replicas=ScriptedReplicas(0, 2), model_sync_interval=5)
    assert h.total_steps == 10 and type(h.total_steps) is int
    assert h.ensemble.config.average_optimizer_state is True
    for _ in range(5):
        o.step()
        h.step(1.0)
    assert h.last_sync.step == 5  # the settings fingerprint is plain data
    with pytest.raises(ValueError, match="Expected average_optimizer_state to be a bool, but got 'yes'"):
        hdet.HDETLR(o, None, total_steps=10, average_optimizer_state="yes")


# ------------------------------------------------------------ 12. the engine's own state
def _engine(N=3, steps=20, stop=None, state=None, until=None, mode="vmap"):
    def make_sched(o, rep, m):
        return hdet.OneCycleAutoLR(o, max_lr=0.05, total_steps=steps, model_sync_interval=4, replicas=rep, model=m,
                                   ensemble_lr_spread_ratio=0.3, enable_auto_lr=True, auto_lr_warmup_steps=4,
                                   controller="paper", explore=[hdet.WeightDecay(o, alpha=0.5)])

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))
    eng = ReplicaEngine(model, N, lambda m: torch.optim.AdamW(m.parameters(), lr=0.05, weight_decay=0.01),
                        make_sched, mode=mode)
    start = 0
    if state is not None:
        eng.load_state_dict(state)
        start = eng.steps_taken
    for t in range(start + 1, steps + 1):
        if until is not None and t > until:
            return eng
        g = torch.Generator().manual_seed(t)
        x = torch.randn(N, 8, 3, generator=g)
        eng.step((x, x[..., :1].sin()), lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), stacked=True)
        if t == stop:
            return roundtrip(eng.state_dict())
    return eng


@pytest.mark.parametrize("stop", [8, 10])
def test_engine_state_dict_resumes_bit_for_bit(stop):
    full = _engine()
    resumed = _engine(state=_engine(stop=stop))
    assert resumed.steps_taken == full.steps_taken == 20
    for k in full.stacked_params:
        assert torch.equal(full.stacked_params[k], resumed.stacked_params[k])
    for k in full.stacked_buffers:
        assert torch.equal(full.stacked_buffers[k], resumed.stacked_buffers[k])
    for a, b in zip(full.schedulers, resumed.schedulers):
        assert a.get_last_lr() == b.get_last_lr() and a.hyperparameters == b.hyperparameters
    assert all(s.closed for s in full.schedulers)  # (closed at total_steps: every replica at the base's LR)
    assert len({s.get_last_lr()[0] for s in full.schedulers}) == 1


def test_a_vmap_engines_state_resumes_in_a_loop_engine():
    """An audit: a vmap engine's state (with its stacked parameters' memory order, 'layout') was refused by a loop
    engine of the same model as "a corrupted or foreign state" (the other way round loaded). The order is the vmap
    engine's own business: the loop engine loads each replica's state and continues as the vmap run does."""
    full = _engine()
    resumed = _engine(state=_engine(stop=10), mode="loop")
    assert resumed.mode == "loop" and resumed.steps_taken == 20
    for m_full, m_res in zip(full.models, resumed.models):
        for a, b in zip(m_full.state_dict().values(), m_res.state_dict().values()):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)  # (the bias ahead of BatchNorm: rounding noise
            # that Adam scales to steps of 1e-5 between the modes)
    for a, b in zip(full.schedulers, resumed.schedulers):
        assert a.get_last_lr() == pytest.approx(b.get_last_lr()) and a.hyperparameters == pytest.approx(b.hyperparameters)


def test_engine_with_gradient_layout_resumes_bit_for_bit():
    """With gradient_layout=True a fresh engine stores its parameters row-major until its first backward; a state
    loaded into it keeps the saved engine's memory order, so its first step rounds as the uninterrupted run's (a
    conv bias ahead of BatchNorm, whose gradient is rounding noise that Adam scales to a full step, moved 1.2e-3
    after one step before)."""
    def engine():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(144, 3))
        return ReplicaEngine(model, 2, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
                             lambda o, rep, m: hdet.HDETLR(o, None, total_steps=40, model_sync_interval=10, replicas=rep,
                                                           model=m, ensemble_lr_spread_ratio=0.3),
                             mode="vmap", gradient_layout=True)

    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(2, 8, 1, 8, 8, generator=g), torch.randint(0, 3, (2, 8), generator=g)) for _ in range(20)]
    def loss(m, b):
        return nn.functional.cross_entropy(m(b[0]), b[1])
    full, resumed = engine(), engine()
    for t in range(15):
        full.step(data[t], loss, stacked=True)
    resumed.load_state_dict(roundtrip(full.state_dict()))
    for t in range(15, 20):
        full.step(data[t], loss, stacked=True)
        resumed.step(data[t], loss, stacked=True)
    for k in full.stacked_params:
        assert torch.equal(full.stacked_params[k], resumed.stacked_params[k]), k
        assert full.stacked_params[k].stride() == resumed.stacked_params[k].stride(), k


def test_a_converge_step_that_fails_any_way_leaves_no_checkpoint_to_write(monkeypatch):
    """Not only a failed collective: any exception out of a converge step (an out-of-memory while averaging, Ctrl-C,
    a custom transport's error) leaves the schedulers half-stepped and maybe the weights partly averaged, so
    state_dict() refuses; a load of a good state clears that."""
    import hdet.engine

    good = _engine(steps=20, stop=8)  # a whole state at step 8
    for error in (torch.OutOfMemoryError("while averaging"), KeyboardInterrupt(), RuntimeError("transport")):
        eng = _engine(steps=20, state=good, until=8)

        def failing(*a, error=error, **k):
            raise error

        monkeypatch.setattr(hdet.engine, "average_local", failing)
        g = torch.Generator().manual_seed(0)
        with pytest.raises(type(error)):
            for _ in range(4):  # the converge step after step 12
                x = torch.randn(3, 8, 3, generator=g)
                eng.step((x, x[..., :1].sin()), lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), stacked=True)
        monkeypatch.undo()
        with pytest.raises(RuntimeError, match=f"optimizer step 12 did not finish \\({type(error).__name__}\\)"):
            eng.state_dict()
        eng.load_state_dict(good)
        eng.state_dict()  # a good state loaded: saving works again


def test_engine_state_checks():
    eng = _engine(steps=8)
    st = eng.state_dict()
    with pytest.raises(ValueError, match="Expected a state of 2 replicas, but got one of 3"):
        _engine(N=2, steps=8, state=st)
    with pytest.raises(ValueError, match="Expected a ReplicaEngine state_dict"):
        eng.load_state_dict({"model": 1})


def test_replay_writes_explored_weight_decay_into_a_reloaded_optimizer():
    """ReplayLR after a resume: the optimizer's reloaded param groups get the recorded weight decay."""
    p = nn.Parameter(torch.zeros(2))
    o = torch.optim.AdamW([p], lr=0.01, weight_decay=0.01)
    s = hdet.OneCycleAutoLR(o, max_lr=0.05, total_steps=10, ensemble_lr_spread_ratio=0.2, model_sync_interval=5,
                            replicas=ScriptedReplicas(1, 4), explore=[hdet.WeightDecay(o, alpha=1.0)],
                            controller="paper", enable_auto_lr=True, auto_lr_warmup_steps=5).record_schedule()
    for _ in range(10):
        o.step()
        s.step(1.0)
    schedule = s.discovered_schedule()
    q = nn.Parameter(torch.zeros(2))
    o2 = torch.optim.AdamW([q], lr=0.01, weight_decay=0.5)
    replay = hdet.ReplayLR(o2, schedule, explore=[hdet.WeightDecay(o2)])
    for _ in range(3):
        o2.step()
        replay.step()
    o2.load_state_dict(roundtrip(o2.state_dict()))
    replay.load_state_dict(roundtrip(replay.state_dict()))
    o2.step()
    replay.step()
    assert o2.param_groups[0]["weight_decay"] == schedule["bases"][4][1]


def test_engine_load_that_fails_changes_nothing():
    """Replica 1's scheduler state is bad: replica 0 must not be loaded either (checked first, then set)."""
    st = _engine(steps=8, stop=3)
    target = _engine(steps=8)
    before = {k: v.clone() for k, v in target.stacked_params.items()}
    bad = roundtrip(st)
    bad["replicas"][1]["scheduler"]["last_epoch"] = "x"
    with pytest.raises(ValueError, match="last_epoch"):
        target.load_state_dict(bad)
    bad = roundtrip(st)
    bad["replicas"][2]["scheduler"]["last_epoch"] = 2
    with pytest.raises(ValueError, match="at the same step"):
        target.load_state_dict(bad)
    assert all(torch.equal(before[k], target.stacked_params[k]) for k in before)
    assert {s.last_epoch for s in target.schedulers} == {8}
    target.load_state_dict(st)
    assert target.steps_taken == 3


def test_a_loss_tensor_reused_in_place_is_observed_per_step():
    """The window keeps each step's value (a copy), not a reference to a buffer the loop overwrites."""
    m = nn.Linear(2, 1)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    s = hdet.OneCycleAutoLR(o, max_lr=0.1, total_steps=4, model_sync_interval=2, model=m)
    buf = torch.zeros(())
    for v in (1.0, 3.0):
        buf.fill_(v)
        o.step()
        s.step(buf)
    assert s.last_sync.losses == [2.0]


def test_the_settings_fingerprint_follows_a_changed_setting():
    """The fingerprint is cached between syncs; a setting changed in place (one replica's config edited by
    hand) must still change it, or replicas built differently would average silently."""
    from hdet import HDETConfig

    c = HDETConfig(ensemble_lr_spread_ratio=0.2, model_sync_interval=10)
    first = c.fingerprint()
    assert c.fingerprint() == first == HDETConfig(ensemble_lr_spread_ratio=0.2, model_sync_interval=10).fingerprint()
    c.model_sync_interval = 20
    assert c.fingerprint() != first
    c.model_sync_interval = 10
    assert c.fingerprint() == first
    fit = HDETConfig(controller=hdet.FitController())
    before = fit.fingerprint()
    fit.controller.kappa *= 2  # a mutable template, edited in place
    assert fit.fingerprint() != before


def _local_adam(poison_at=None, steps=10, N=3):
    """Local mode (no gradient sharing: each replica's Adam moments are its own), T = 5; replica 1's weight
    is NaN from step ``poison_at``. Returns every replica's ``exp_avg_sq`` after each step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    eng = ReplicaEngine(model, N, lambda m: torch.optim.Adam(m.parameters(), lr=0.05),
                        lambda o, rep, m: hdet.HDETLR(o, None, total_steps=steps, model_sync_interval=5, replicas=rep,
                                                      model=m, ensemble_lr_spread_ratio=0.3),
                        mode="vmap", share_gradients=False)
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the recovery's warning
        for t in range(1, steps + 1):
            if t == poison_at:
                with torch.no_grad():
                    eng.models[1][0].weight[0, 0] = float("nan")
            x = torch.randn(N, 8, 3, generator=torch.Generator().manual_seed(t))
            eng.step((x, x[..., :1].sin()), lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), stacked=True)
            seen.append([o.state[o.param_groups[0]["params"][0]]["exp_avg_sq"].clone() for o in eng.optimizers])
    return eng, seen


def test_a_recovery_gives_the_reset_replica_the_healthy_mean_and_leaves_the_healthy_moments_alone():
    """Replica 1 turns NaN at step 7; the sync at step 10 resets it: its moments become replicas 0 and 2's
    mean, while theirs stay what they were (before: every replica's were overwritten by the mean, although
    average_optimizer_state is off); they equal a clean run's, whose replicas never met replica 1's."""
    eng, seen = _local_adam(poison_at=7)
    _, clean = _local_adam()
    assert eng.schedulers[0].last_sync.recovered == [1]
    assert torch.equal(seen[-1][0], clean[-1][0]) and torch.equal(seen[-1][2], clean[-1][2])
    assert not torch.equal(seen[-1][0], seen[-1][2])  # their own, not a mean
    torch.testing.assert_close(seen[-1][1], (clean[-1][0] + clean[-1][2]) / 2)


def _momentum_resume(make_sched, optimizer_first, before):
    """A small Adam run under ``make_sched(opt)`` (a scheduler whose base cycles beta1), saved after ``before`` steps
    and resumed by loading the optimizer before (or after) building the scheduler: the (beta1, lr) of each of the next
    5 steps, uninterrupted and resumed, and whether the weights ended equal."""
    def build(opt_state=None, sched_state=None, model_state=None):
        torch.manual_seed(0)
        m = nn.Linear(3, 1)
        if model_state is not None:
            m.load_state_dict(model_state)
        o = torch.optim.Adam(m.parameters(), lr=0.1)
        if opt_state is not None and optimizer_first:
            o.load_state_dict(opt_state)  # first: what the base's constructor then overwrites
        s = make_sched(o)
        if opt_state is not None and not optimizer_first:
            o.load_state_dict(opt_state)
        if sched_state is not None:
            s.load_state_dict(sched_state)
        return m, o, s

    def steps(m, o, s, n):
        seen = []
        for k in range(n):
            seen.append((o.param_groups[0]["betas"][0], o.param_groups[0]["lr"]))
            (m(torch.full((2, 3), 1.0 + k)) ** 2).sum().backward()
            o.step()
            o.zero_grad()
            s.step(1.0)
        return seen

    m, o, s = build()
    steps(m, o, s, before)
    saved = roundtrip({"model": m.state_dict(), "opt": o.state_dict(), "sched": s.state_dict()})
    full = steps(m, o, s, 5)
    m2, o2, s2 = build(saved["opt"], saved["sched"], saved["model"])
    resumed = steps(m2, o2, s2, 5)
    return full, resumed, all(torch.equal(p, q) for p, q in zip(m.parameters(), m2.parameters()))


@pytest.mark.parametrize("optimizer_first", [True, False])
def test_onecycles_cycled_momentum_resumes_whatever_the_order_of_the_loads(optimizer_first):
    """OneCycleAutoLR cycles Adam's beta1: a resume that loads the optimizer before building the scheduler (whose
    OneCycleLR constructor sets beta1 to max_momentum) trains the first resumed step with the momentum of that step,
    as the uninterrupted run does, bit for bit (it took max_momentum, 0.95)."""
    full, resumed, equal = _momentum_resume(
        lambda o: hdet.OneCycleAutoLR(o, max_lr=0.1, total_steps=20, replicas=ScriptedReplicas(1, 2),
                                      model_sync_interval=4, ensemble_lr_spread_ratio=0.2), optimizer_first, 6)
    assert resumed == full and equal
    assert full[0][0] != 0.95  # the case: the cycled beta1 of step 7 is not max_momentum


@pytest.mark.parametrize("wrap", ["sequential", "chained"])
def test_a_wrapped_momentum_cycle_resumes_when_the_optimizer_is_loaded_first(wrap):
    """HDETLR over SequentialLR([LinearLR, OneCycleLR]) or ChainedScheduler([CyclicLR]), resumed by loading the
    optimizer before building them: their constructors set beta1 to max_momentum, and the resume took it for the first
    step (0.95 / 0.9 where the uninterrupted run used 0.850 / 0.817: an audit), since only a bare OneCycleLR or CyclicLR
    base had its cycle set again. Now the resumed run is the uninterrupted one, bit for bit."""
    L = torch.optim.lr_scheduler

    def make(o):
        base = (L.SequentialLR(o, [L.LinearLR(o, 0.5, total_iters=4), L.OneCycleLR(o, 0.1, total_steps=20)],
                               milestones=[4]) if wrap == "sequential" else
                L.ChainedScheduler([L.CyclicLR(o, 0.01, 0.1, step_size_up=6, base_momentum=0.8, max_momentum=0.9)]))
        return hdet.HDETLR(o, base, 20, replicas=ScriptedReplicas(1, 2), model_sync_interval=4,
                           ensemble_lr_spread_ratio=0.2)

    full, resumed, equal = _momentum_resume(make, True, 9)
    assert resumed == full and equal
    assert full[0][0] not in (0.9, 0.95)  # the case: the cycled beta1 of step 10 is not max_momentum


def test_a_loaded_kept_scale_resets_the_growth_count_as_a_kept_tensor_does():
    """A review: the kept scale loaded from a checkpoint (a float until the next healthy sync) put the scale back
    but left the scaler's growth count, which a kept tensor resets: the resumed run's scale grew earlier."""
    from hdet.loss_scale import LossScale

    for kept in (512.0, torch.tensor(512.0)):
        ls = LossScale()
        ls.scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        ls.scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
        ls.scaler._growth_tracker.fill_(7)
        if isinstance(kept, float):
            ls.set_kept(kept)
        else:
            ls.keep(kept)
        ls.after_sync(recovered=True, healthy=False)
        assert float(ls.scaler._scale) == 512.0 and int(ls.scaler._growth_tracker) == 0


def _left_early(rank, world, stop):
    """Plain DDP + HDET (T = 5, 20 steps) whose loop is left after step ``stop``; then finish(), twice."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    model = DDP(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = hdet.OneCycleAutoLR(opt, max_lr=1e-2, total_steps=20, model_sync_interval=5, model=model,
                                ensemble_lr_spread_ratio=0.3)
    for step in range(1, stop + 1):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(8, 4, generator=g)
        loss = nn.functional.mse_loss(model(x), x[:, :1])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step(loss.detach())
    before = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    gathered = [torch.empty_like(before) for _ in range(world)]
    dist.all_gather(gathered, before)
    first, again = sched.finish(), sched.finish()
    after = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    gathered_after = [torch.empty_like(after) for _ in range(world)]
    dist.all_gather(gathered_after, after)
    return {"apart": not torch.equal(gathered[0], gathered[1]), "equal": torch.equal(*gathered_after),
            "mean": torch.allclose(after, sum(gathered) / world, atol=1e-6), "first": None if first is None else first.step,
            "again": again}


@pytest.mark.distributed
def test_finish_averages_the_replicas_of_a_run_left_early():
    """A loop left after step 7 of 20 (T = 5: early stopping, a time limit): each rank's model was its own replica.
    ``sched.finish()`` runs the converge step the end of the run would have (the replicas' mean), once; after step
    10, a converge step, it does nothing."""
    for out in check_ok(run_gloo(_left_early, 2, 7)):
        assert out["apart"] and out["equal"] and out["mean"] and out["first"] == 7 and out["again"] is None
    for out in check_ok(run_gloo(_left_early, 2, 10)):
        assert not out["apart"] and out["equal"] and out["first"] is None and out["again"] is None


def _local_reset_worker(rank, world):
    """Local mode (DDP's no_sync at every step), fused Adam (the "skip-all" guard); rank 1's weight NaN from step 3,
    so its guard skips steps 3-8 and its Adam count stays at 2; the sync at 8 resets it. Alpha 0 and, from then on,
    the same batch on both ranks: the two replicas are one state and must stay equal."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    ddp = DDP(net)
    opt = torch.optim.Adam(ddp.parameters(), lr=0.01, fused=True)
    sched = hdet.OneCycleAutoLR(opt, max_lr=0.02, total_steps=12, ensemble_lr_spread_ratio=0.0, model_sync_interval=8,
                                model=ddp)
    out = []
    for t in range(1, 12):
        if t == 3 and rank == 1:
            with torch.no_grad():
                net[0].weight[0, 0] = float("nan")
        g = torch.Generator().manual_seed(100 * (rank if t <= 8 else 0) + t)
        x = torch.randn(8, 6, generator=g)
        with ddp.no_sync():
            loss = nn.functional.mse_loss(ddp(x), x[:, :1])
            opt.zero_grad()
            loss.backward()
        opt.step()
        sched.step(loss)
        w = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
        ws = [torch.empty_like(w) for _ in range(world)]
        dist.all_gather(ws, w)
        out.append((t, float((ws[0] - ws[1]).abs().max()), float(opt.state[net[0].weight]["step"])))
    return {"out": out, "recovered": sched.last_sync.recovered if sched.last_sync else None}


@pytest.mark.distributed
def test_local_mode_a_reset_replica_takes_the_healthy_step_count_with_their_moments():
    """A replica reset at a converge step got the healthy replicas' weights and moments but kept its own Adam step
    count (2 against 8: its guard had skipped six steps on its own), so its bias correction no longer matched the
    moments and the two replicas parted by 3e-3 within three steps (an audit): it takes their count too."""
    res = check_ok(run_gloo(_local_reset_worker, 2))
    for t, diff, step in res[1]["out"]:
        if t >= 8:
            assert diff == 0.0 and step == t, (t, diff, step)
    assert [s for t, _, s in res[1]["out"] if t == 7] == [2.0]  # (the skipped steps, before the reset)


def _resumed_into(base, explore, state=None, steps=7, lambda_lr=False, total=100):
    """An HDETLR (one replica, alpha 0.3) over ``base`` (``lambda_lr``: a LambdaLR over it), with ``explore(opt)``;
    ``state``: loaded (its warnings returned), else ``steps`` steps taken and its state returned."""
    torch.manual_seed(0)
    m = nn.Linear(3, 1)
    o = torch.optim.AdamW(m.parameters(), lr=0.05, weight_decay=0.01)
    base = torch.optim.lr_scheduler.LambdaLR(o, base) if lambda_lr else base
    s = hdet.HDETLR(o, base, total_steps=total, model_sync_interval=5, ensemble_lr_spread_ratio=0.3, explore=explore(o))
    if state is None:
        for _ in range(steps):
            o.step()
            s.step(1.0)
        return roundtrip(s.state_dict())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s.load_state_dict(state)
    return [str(w.message) for w in caught if "hdet" in str(w.message)], s


def test_a_state_loaded_into_a_scheduler_built_with_another_schedule_or_spread_says_so():
    """A callable base schedule 10x higher resumed at 10x the LR, and an explored weight decay's alpha 0.5 -> 0.9 (or
    a schedule= given at load) moved its values at the next deal, silently (an audit). Said now; the same build says
    nothing."""
    def wd(alpha=0.5, schedule=None):
        return lambda o: [hdet.WeightDecay(o, alpha=alpha, schedule=schedule)]

    state = _resumed_into(lambda t: 0.05 * (1 - t / 100), wd())
    said, s = _resumed_into(lambda t: 0.05 * (1 - t / 100), wd(), state)
    assert said == []
    said, s = _resumed_into(lambda t: 0.5 * (1 - t / 100), wd(), state)
    assert len(said) == 1 and "schedule gave lr/0 0.0465 at step 7, and this scheduler's gives 0.465" in said[0], said
    assert s.ensemble.load_warnings == said  # (HDETTrainer raises them again after the Trainer's load)
    said, _ = _resumed_into(lambda t: 0.05 * (1 - t / 100), wd(alpha=0.9), state)
    assert len(said) == 1 and "explored spreads differ" in said[0] and "0.5" in said[0] and "0.9" in said[0], said
    assert "next step uses the saved values, and the steps after it this scheduler's spreads" in said[0]  # (it said
    # "from its next sync on", where the next step's values were already the new spread's: an audit)
    said, _ = _resumed_into(lambda t: 0.05 * (1 - t / 100), wd(schedule=lambda t: 0.1), state)
    assert any("schedule gave weight_decay/0 0.01" in m for m in said) and any("explored spreads" in m for m in said)
    # a schedule rebuilt otherwise that agrees at the saved step (a linear decay as a cosine one crossing it there,
    # or another end): said from the saved state's probe of the schedule over the run (an audit: unsaid before)
    said, _ = _resumed_into(lambda t: 0.05 * (1 - 7 / 100) * (1 + math.cos(math.pi * t / 100)) /
                            (1 + math.cos(math.pi * 7 / 100)), wd(), state)
    assert len(said) == 1 and "base schedule gave [0.05] at step 0" in said[0], said
    said, _ = _resumed_into(lambda t: 0.05 * (1 - t / 100) if t < 50 else 0.0, wd(), state)
    assert len(said) == 1 and "[0.0125] at step 75" in said[0] and "gives [0.0]" in said[0], said
    state = _resumed_into(lambda t: 1 - t / 100, wd(), lambda_lr=True)
    said, _ = _resumed_into(lambda t: 1 - t / 100, wd(), state, lambda_lr=True)
    assert said == []
    said, _ = _resumed_into(lambda t: 1 - t / 200 - 7 / 200, wd(), state, lambda_lr=True)
    assert len(said) == 1 and "base schedule gave [0.05] at step 0" in said[0], said
    # a run resumed into another length (then set_total_steps, or the HF Trainer's resume) follows a schedule of that
    # length: only the length is said (the probe said the schedule differed: a review)
    def wsd(total):
        return lambda t: 0.05 if t < 0.8 * total else 0.05 * (total - t) / (0.2 * total)
    state = _resumed_into(wsd(100), wd())
    said, s = _resumed_into(wsd(200), wd(), state, total=200)
    assert len(said) == 1 and "total_steps 100 (built with 200)" in said[0], said


@pytest.mark.parametrize("max_lr, warned", [(0.01, False), (0.1, True)])
def test_a_one_cycle_state_loaded_with_another_max_lr_says_so(max_lr, warned):
    """OneCycleLR's loaded state gives back the saved LR, so the check above saw nothing when max_lr changed, and the
    run resumed at 10x the LR (a review); its base_lrs (max_lr / div_factor) are compared too."""
    def build(peak):
        torch.manual_seed(0)
        o = torch.optim.AdamW(nn.Linear(3, 1).parameters(), lr=peak)
        return o, hdet.OneCycleAutoLR(o, max_lr=peak, total_steps=100, model_sync_interval=5,
                                      ensemble_lr_spread_ratio=0.3)

    o, s = build(0.01)
    for _ in range(12):
        o.step()
        s.step(1.0)
    state = roundtrip(s.state_dict())
    _, s2 = build(max_lr)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s2.load_state_dict(state)
    said = [str(w.message) for w in caught if "schedule gave" in str(w.message)]
    assert bool(said) == warned and (not said or "OneCycleLR's base_lrs[0] 0.0004" in said[0]), said
    if warned:
        assert "or load the saved optimizer state after this" in said[0]


def test_a_one_cycle_state_loaded_after_its_optimizer_with_another_max_lr_resumes_the_saved_run_unsaid():
    """OneCycleLR reads max_lr and initial_lr from the param groups: the saved optimizer state loaded first gives them
    back, and the run resumes exactly, but the check compared the base_lrs it was built with and said it would not
    (an audit): the groups' are compared now."""
    def build(peak):
        torch.manual_seed(0)
        m = nn.Linear(3, 1)
        o = torch.optim.AdamW(m.parameters(), lr=peak)
        return m, o, hdet.OneCycleAutoLR(o, max_lr=peak, total_steps=30, model_sync_interval=5,
                                         ensemble_lr_spread_ratio=0.3)

    def steps(m, o, s, n):
        lrs = []
        for t in range(n):
            o.zero_grad()
            m(torch.full((4, 3), 0.1 * t)).pow(2).mean().backward()
            o.step()
            s.step(1.0)
            lrs.append(o.param_groups[0]["lr"])
        return lrs

    m, o, s = build(0.01)
    steps(m, o, s, 12)
    saved = roundtrip({"m": m.state_dict(), "o": o.state_dict(), "s": s.state_dict()})
    full = steps(m, o, s, 10)
    m2, o2, s2 = build(0.02)
    m2.load_state_dict(saved["m"])
    o2.load_state_dict(saved["o"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s2.load_state_dict(saved["s"])
    assert not [w for w in caught if "schedule gave" in str(w.message)]
    assert steps(m2, o2, s2, 10) == full and torch.equal(m2.weight, m.weight)


def _scaled_run(stop=None, state=None, steps=25, nan_at=12):
    """One replica (OneCycleAutoLR, on_runaway="recover", T = 5) under a GradScaler on the CPU, no gradient guard; a
    NaN weight at step ``nan_at``: every step skipped (the scale halving) until the sync at 15 goes back. Returns
    the state at ``stop``, or the scale after every step (the scaler dropped on return: one in the process)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1))
    o = torch.optim.AdamW(m.parameters(), lr=0.01)
    s = hdet.OneCycleAutoLR(o, max_lr=0.02, total_steps=steps, model_sync_interval=5, model=m, on_runaway="recover")
    sc = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    start = 0
    if state is not None:
        m.load_state_dict(state["m"]), o.load_state_dict(state["o"]), sc.load_state_dict(state["sc"])
        s.load_state_dict(state["s"])
        start = s.last_epoch
    scales = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for t in range(start + 1, steps + 1):
            x = torch.randn(16, 3, generator=torch.Generator().manual_seed(t))
            if t == nan_at:
                with torch.no_grad():
                    m[0].weight[0, 0] = float("nan")
            loss = nn.functional.mse_loss(m(x), x[:, :1].sin())
            o.zero_grad()
            sc.scale(loss).backward()
            sc.step(o)
            sc.update()
            s.step(loss)
            scales.append(sc.get_scale())
            if t == stop:
                return roundtrip({"m": m.state_dict(), "o": o.state_dict(), "sc": sc.state_dict(), "s": s.state_dict()})
    return scales


@pytest.mark.parametrize("stop", [11, 13])
def test_a_run_resumed_inside_a_scaler_stall_puts_the_scale_back_as_the_whole_run_does(stop):
    """Resumed just before or inside the stall a NaN weight makes (every step skipped by the GradScaler), no optimizer
    step showed hdet the scaler, so the go-back at 15 left its collapsed scale (16x below the whole run's to the end:
    an audit). The scaler is found when that reset needs it now, and the resumed run's scales are the whole run's."""
    import gc

    whole = _scaled_run()
    gc.collect()
    assert whole[10:15] == [8192.0, 4096.0, 2048.0, 1024.0, 8192.0]  # halved in the stall, put back at the sync at 15
    resumed = _scaled_run(state=_scaled_run(stop=stop))
    assert resumed == whole[stop:]
