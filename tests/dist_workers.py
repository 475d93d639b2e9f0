"""Worker functions for the spawned gloo tests (importable by the child processes)."""

from __future__ import annotations

import contextlib
import copy
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import OneCycleLR

import hdet


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 6, generator=g)
    return x, x[:, :1] * 2 - x[:, 1:2] + 0.1 * torch.randn(8, 1, generator=g)


def train_steps(model, o, s, rank: int, steps: range) -> None:
    """The plain loop on ``batch(rank, t)`` for each step t: forward, MSE, backward, ``o.step()``, ``s.step(loss)``."""
    for t in steps:
        x, y = batch(rank, t)
        loss = nn.functional.mse_loss(model(x), y)
        o.zero_grad()
        loss.backward()
        o.step()
        s.step(loss)


def gather_flat(tensors) -> list[torch.Tensor]:
    flat = torch.cat([t.detach().reshape(-1).double() for t in tensors])
    out = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(out, flat)
    return out


def float_buffers(m: nn.Module) -> list[torch.Tensor]:
    return [b for b in m.buffers() if b.is_floating_point()]


class Probe:
    """The fit controller's probe: MSE on a batch that every replica draws alike (the k-th call's)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, model):
        x, y = batch(0, 100_000 + self.calls)
        self.calls += 1
        return nn.functional.mse_loss(model(x), y)


def train(rank, world, *, steps=40, alpha=0.0, T=10, auto=False, warm=10, use_hdet=True, seed_model=0,
          uneven_rng=False, check_syncs=False, save_at=None, ckpt_dir=None, resume_from=None, opt="adam",
          loss_scale=0.05, controller="paper", contiguous=False, local=False, explore_wd=False, fused=False,
          load_rank=None, sched_first=False):
    """DDP training of make_model() on rank-specific batches; returns a dict of observations.
    ``contiguous``: parameters laid out in one flat buffer (hdet.contiguous_parameters_); ``local``: DDP's
    no_sync() on every step (no gradient all-reduce between converge steps); ``explore_wd``: Adam's weight
    decay explored too (hdet.WeightDecay); ``fused``: fused Adam (the 'skip' guard); ``resume_from``: a
    folder, or one folder per rank; ``load_rank``: every rank loads this rank's checkpoint; ``sched_first``: the
    scheduler's state loaded before the optimizer's. ``stepped``: each optimizer step's LR and weight decay."""
    model = make_model(seed_model)
    if contiguous:
        hdet.contiguous_parameters_(model)
    ddp = DDP(model, broadcast_buffers=False)
    kw = dict(weight_decay=0.01) if explore_wd else {}
    if opt == "dadapt":  # D-Adaptation: hdet's multiplier on its step (hdet.step_scale)
        import dadaptation

        o = dadaptation.DAdaptAdam(ddp.parameters(), lr=1.0, decouple=True, weight_decay=0.01)
    else:
        o = torch.optim.Adam(ddp.parameters(), lr=0.01, fused=fused or None, **kw) if opt == "adam" else \
            torch.optim.AdamW(ddp.parameters(), lr=0.01, **kw) if opt == "adamw" else \
            torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    if use_hdet:
        s = hdet.OneCycleAutoLR(o, max_lr=0.02, total_steps=steps, ensemble_lr_spread_ratio=alpha,
                                model_sync_interval=T, enable_auto_lr=auto, auto_lr_warmup_steps=warm,
                                loss_scale=loss_scale, rank=rank, world_size=world, model=ddp, seed=3,
                                controller=controller, probe=Probe() if controller == "fit" else None,
                                explore=[hdet.WeightDecay(o, alpha=0.5)] if explore_wd else ())
    else:
        s = OneCycleLR(o, max_lr=0.02, total_steps=steps)
    start = 0
    if resume_from is not None:
        folder = resume_from[rank] if isinstance(resume_from, (list, tuple)) else resume_from
        ck = torch.load(os.path.join(folder, f"rank{rank if load_rank is None else load_rank}.pt"),
                        weights_only=True)
        model.load_state_dict(ck["model"])
        if sched_first:
            s.load_state_dict(ck["sched"])
        o.load_state_dict(ck["opt"])
        if not sched_first:
            s.load_state_dict(ck["sched"])
        start = ck["step"]
    obs = {"lrs": [s.get_last_lr()[0]], "equal_after_sync": [], "differ_before_sync": [],
           "mults_after_control": [], "rng_untouched": True, "nbt": None,
           "wd": [o.param_groups[0].get("weight_decay")], "wd_hdet": [s.hyperparameters if use_hdet else None],
           "stepped": []}
    o.register_step_post_hook(lambda opt, *_: obs["stepped"].append((opt.param_groups[0]["lr"],
                                                                     opt.param_groups[0].get("weight_decay"))))
    for t in range(start + 1, steps + 1):
        x, y = batch(rank, t)
        with ddp.no_sync() if local else contextlib.nullcontext():
            loss = nn.functional.mse_loss(ddp(x), y)
            o.zero_grad()
            loss.backward()
        o.step()
        if uneven_rng and rank == 1:
            torch.rand(3)  # this rank consumes the global RNG more than the others
        if use_hdet and check_syncs and s.ensemble.is_sync_step(t):
            before = gather_flat(list(model.parameters()) + float_buffers(model))
            obs["differ_before_sync"].append(any(not torch.equal(before[0], b) for b in before[1:]))
        rng = torch.get_rng_state()
        s.step(loss) if use_hdet else s.step()
        obs["rng_untouched"] &= torch.equal(rng, torch.get_rng_state())
        obs["lrs"].append(s.get_last_lr()[0])
        obs["wd"].append(o.param_groups[0].get("weight_decay"))
        obs["wd_hdet"].append(s.hyperparameters if use_hdet else None)
        if use_hdet and check_syncs and s.ensemble.is_sync_step(t):
            after = gather_flat(list(model.parameters()) + float_buffers(model))
            obs["equal_after_sync"].append(all(torch.equal(after[0], a) for a in after[1:]))
            if auto and t >= warm and t % T == 0:
                m = torch.tensor([s.ensemble.multiplier(0)], dtype=torch.float64)  # (the deal: after the close too)
                ms = [torch.empty_like(m) for _ in range(world)]
                dist.all_gather(ms, m)
                obs["mults_after_control"].append([float(v) for v in ms])
        if save_at is not None and t == save_at:
            torch.save({"model": model.state_dict(), "opt": o.state_dict(), "sched": s.state_dict(), "step": t},
                       os.path.join(ckpt_dir, f"rank{rank}.pt"))
            return {"saved": t}
    obs["params"] = [p.detach().clone() for p in model.parameters()]
    obs["buffers"] = {k: b.detach().clone() for k, b in model.named_buffers()}
    obs["runs"] = len(hdet.flat.contiguous_runs(list(model.parameters())))
    return obs


def alpha_zero_vs_plain_ddp(rank, world):
    a = train(rank, world, alpha=0.0, T=7, use_hdet=True)
    b = train(rank, world, use_hdet=False)
    return {"equal_params": all(torch.equal(p, q) for p, q in zip(a["params"], b["params"])),
            "equal_lrs": a["lrs"] == b["lrs"], "lrs": a["lrs"]}


def bn_and_int_buffers(rank, world):
    """Integer buffers stay per replica; float BatchNorm statistics are averaged."""
    model = make_model()
    ddp = DDP(model, broadcast_buffers=False)
    o = torch.optim.SGD(ddp.parameters(), lr=0.01)
    s = hdet.OneCycleAutoLR(o, max_lr=0.01, total_steps=5, ensemble_lr_spread_ratio=0.1, model_sync_interval=5,
                            model=ddp)
    extra = rank  # rank r runs r extra forwards in train mode: its num_batches_tracked differs
    for t in range(1, 6):
        for _ in range(1 + (extra if t == 1 else 0)):
            x, y = batch(rank, t)
            loss = nn.functional.mse_loss(ddp(x), y)
        o.zero_grad()
        loss.backward()
        o.step()
        s.step(loss)
    bn = model[1]
    stats = gather_flat([bn.running_mean, bn.running_var])
    return {"nbt": int(bn.num_batches_tracked), "stats_equal": all(torch.equal(stats[0], x) for x in stats[1:])}


def layout_mismatch(rank, world):
    model = make_model()
    params = list(model.parameters())
    if rank == 1:
        params = params + [nn.Parameter(torch.zeros(3))]  # this rank's optimizer holds one more tensor
    o = torch.optim.SGD(params, lr=0.01)
    s = hdet.OneCycleAutoLR(o, max_lr=0.01, total_steps=10, model_sync_interval=2)
    o.step()
    s.step(1.0)
    o.step()
    s.step(1.0)  # first sync: must raise on every rank, not hang


def non_finite_weights(rank, world):
    model = make_model()
    o = torch.optim.SGD(model.parameters(), lr=0.01)
    s = hdet.OneCycleAutoLR(o, max_lr=0.01, total_steps=10, model_sync_interval=2, model=model,
                            on_nonfinite="raise")
    o.step()
    s.step(1.0)
    if rank == 1:
        with torch.no_grad():
            model[0].weight[0, 0] = float("nan")
    o.step()
    try:
        s.step(1.0)
    except hdet.NonFiniteReplicaError as e:
        finite = all(torch.isfinite(p).all() for p in model.parameters())
        return {"error": "NonFiniteReplicaError", "msg": str(e), "finite_after": bool(finite)}
    return {"error": None}


def missing_loss_on_one_rank(rank, world):
    model = make_model()
    o = torch.optim.SGD(model.parameters(), lr=0.01)
    s = hdet.OneCycleAutoLR(o, max_lr=0.01, total_steps=10, model_sync_interval=2, controller="paper", enable_auto_lr=True,
                            auto_lr_warmup_steps=2)
    for _ in range(2):
        o.step()
        s.step(None if rank == 1 else 1.0)


def empty_windows(rank, world, losses):
    """Paper controller, one replica a rank at LRs 0.05 / 0.10 / 0.15 (alpha 0.5): rank r's window is ``losses[r]``
    at both steps, None for a window that measured nothing (observe(..., counted=False) at every step). Returns the
    control sync's Eq. 4-7 record."""
    import warnings
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    o = torch.optim.SGD(model.parameters(), lr=0.1)
    s = hdet.HDETLR(o, None, total_steps=4, model=model, model_sync_interval=2, enable_auto_lr=True,
                    controller="paper", ensemble_lr_spread_ratio=0.5, guard_gradients=False, auto_lr_warmup_steps=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            o.step()
            if losses[rank] is None:
                s.observe(torch.tensor(0.0), False)
            else:
                s.observe(torch.tensor(losses[rank]))
            s.step()
    c = s.last_sync.controller[0]
    return {"values": c.values, "losses": c.losses, "weights": c.weights, "h_tilde": c.h_tilde, "h_bar": c.h_bar,
            "delta": c.delta, "new_base": c.new_base}


def unfrozen_under_ddp(rank, world, unfreeze_at, mode="late"):
    """A frozen first layer (in the optimizer, requires_grad=False when DDP is built) unfrozen before step
    ``unfreeze_at`` (None: never), HDETLR at T 2 over 6 steps. Returns hdet's warnings and whether the first layer's
    weights differed across the ranks right before the converge step after the unfreezing. ``mode``: "late" (as said);
    "rebuild" (unfrozen right after the converge step before ``unfreeze_at``, DDP built again and given to
    ``attach_model``, as the warning advises); "built_trainable" (DDP with find_unused_parameters=True built over the
    layer trainable, frozen before HDETLR is built: DDP all-reduces it once unfrozen); "early" (unfrozen after HDETLR
    was built, before step 1); "between" (unfrozen after DDP was built, before HDETLR was)."""
    import warnings
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1))
    if mode == "built_trainable":
        model = DDP(net, find_unused_parameters=True)
        net[0].requires_grad_(False)
    else:
        net[0].requires_grad_(False)
        model = DDP(net)
    o = torch.optim.SGD(net.parameters(), lr=0.05)
    if mode == "between":
        net[0].requires_grad_(True)
    s = hdet.HDETLR(o, None, total_steps=6, model=model, model_sync_interval=2, ensemble_lr_spread_ratio=0.0)
    if mode == "early":
        net[0].requires_grad_(True)
    apart = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in range(1, 7):
            if t == unfreeze_at and mode in ("late", "built_trainable"):
                net[0].requires_grad_(True)
            x, y = batch(rank, t)
            loss = nn.functional.mse_loss(model(x), y)
            o.zero_grad()
            loss.backward()
            o.step()
            if unfreeze_at is not None and t == unfreeze_at + (unfreeze_at % 2):  # (the sync step: T 2)
                w = gather_flat([net[0].weight])
                apart = not torch.equal(w[0], w[1])
            s.step(loss)
            if mode == "rebuild" and t + 1 == unfreeze_at:  # (right after a converge step: t is even)
                net[0].requires_grad_(True)
                model = DDP(net)
                s.attach_model(model)
    return {"warnings": [str(w.message) for w in caught if "hdet" in str(w.message)], "apart": apart}


def averaging_collectives(rank, world, n_tensors, numel, cap_mb, layout="separate", exclude=()):
    """Count all_reduce calls of one converge step over ``n_tensors`` tensors. ``layout``: "separate"
    tensors, "contiguous" (views of one flat buffer) or "mixed" (the first half views, then separate
    tensors, then a float64 one). Replicas in ``exclude`` hold NaNs and must get the others' mean."""
    torch.manual_seed(rank)
    tensors = [torch.randn(numel) for _ in range(n_tensors)]
    if layout != "separate":
        k = n_tensors if layout == "contiguous" else n_tensors // 2
        flat = torch.cat(tensors[:k])
        tensors[:k] = [flat[i * numel:(i + 1) * numel] for i in range(k)]
        if layout == "mixed":
            tensors.append(torch.randn(numel, dtype=torch.float64))
    expected = [t.clone() for t in tensors]
    for e in expected:
        if rank in exclude:
            e.zero_()
        dist.all_reduce(e)
        e.div_(world - len(exclude))
    if rank in exclude:
        for t in tensors:
            t.fill_(float("nan"))
    ptrs = [t.data_ptr() for t in tensors]
    calls = []
    real = dist.all_reduce

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    dist.all_reduce = counting
    try:
        hdet.ProcessGroupReplicas(bucket_cap_mb=cap_mb).average_(tensors, exclude=exclude)
    finally:
        dist.all_reduce = real
    close = all(torch.allclose(t, e, rtol=1e-6, atol=1e-7) for t, e in zip(tensors, expected))
    return {"calls": len(calls), "close": close, "same_storage": ptrs == [t.data_ptr() for t in tensors]}


def engine_run(world, *, steps=30, alpha=0.3, T=10, auto=False, warm=10, opt="adam", mode="loop", controller="paper",
               local=False):
    """The same training as ``train`` (BatchNorm, rank-specific batches) in the one-process engine."""
    from hdet.engine import ReplicaEngine

    model = make_model(0)
    eng = ReplicaEngine(
        model, world,
        (lambda m: torch.optim.Adam(m.parameters(), lr=0.01)) if opt == "adam" else (
            lambda m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)),
        lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=0.02, total_steps=steps, ensemble_lr_spread_ratio=alpha,
                                              model_sync_interval=T, enable_auto_lr=auto, auto_lr_warmup_steps=warm,
                                              loss_scale=0.05, model=m, seed=3, replicas=rep, controller=controller,
                                              probe=Probe() if controller == "fit" else None),
        mode=mode, share_gradients=not local)
    assert eng.mode == mode
    lrs = [[s.get_last_lr()[0] for s in eng.schedulers]]
    for t in range(1, steps + 1):
        eng.step([batch(r, t) for r in range(world)], lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]))
        lrs.append([s.get_last_lr()[0] for s in eng.schedulers])
    return {"params": [[p.detach().clone() for p in m.parameters()] for m in eng.models],
            "buffers": [{k: b.detach().clone() for k, b in m.named_buffers()} for m in eng.models], "lrs": lrs}


def explore_hypers(rank, world, steps=30):
    """DDP with weight decay (log), beta2 (additive) and a clipping norm (log) explored next to the LR."""
    model = make_model(0)
    ddp = DDP(model, broadcast_buffers=False)
    o = torch.optim.AdamW(ddp.parameters(), lr=0.01, weight_decay=0.05)
    clip = hdet.GradClip(1.0, alpha=1.0)
    s = hdet.OneCycleAutoLR(o, max_lr=0.02, total_steps=steps, ensemble_lr_spread_ratio=0.2, model_sync_interval=5,
                            controller="paper", enable_auto_lr=True, auto_lr_warmup_steps=10, loss_scale=0.05, model=ddp, seed=3,
                            cycle_momentum=False, explore=[hdet.WeightDecay(o, alpha=1.0), hdet.AdamBeta(o, 1), clip])
    seen = []
    for t in range(1, steps + 1):
        x, y = batch(rank, t)
        loss = nn.functional.mse_loss(ddp(x), y)
        o.zero_grad()
        loss.backward()
        clip.clip_(ddp.parameters())
        o.step()
        g = o.param_groups[0]
        mine = torch.tensor([g["lr"], g["weight_decay"], g["betas"][1], clip.max_norm], dtype=torch.float64)
        out = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(out, mine)
        seen.append(torch.stack(out).tolist())
        s.step(loss)
    return {"seen": seen, "params": gather_flat(model.parameters()), "floats": all(
        type(g["weight_decay"]) is float and all(type(b) is float for b in g["betas"]) for g in o.param_groups),
        "names": s.last_sync.names, "ctrl": [c.delta for c in s.last_sync.controller]}


def fault_injection(rank, world, *, fault="weights", bad_rank=2, at=7, steps=20, T=5, guard=True, fused=False,
                    clip=False, on_runaway="ignore", norm_type=2.0, sgd=False):
    """DDP + Adam (``fused``: torch's fused Adam) + auto-LR; at step ``at`` replica ``bad_rank`` (-1: every
    replica) gets a NaN weight (mid-window), a NaN loss, or a NaN born in one element of its first weight matrix's own
    gradient, off its first row (``"matrix_grad"``: a tensor hook, before DDP's all-reduce; loss and activations finite:
    what the "skip" guard's sentinels miss). Records, after every step, whether each rank's weights are finite
    and whether they changed, and after every sync whether the replicas are equal. ``clip``: clip through
    ``scheduler.clip_grad_norm_`` (max norm 1e6: no healthy gradient is changed) and count the guard's own
    passes over the gradients; ``norm_type``: its norm. ``sgd``: SGD with momentum 0.9 instead of Adam."""
    import warnings

    import hdet.guard

    own_pass, passes = hdet.guard._nonfinite, []
    hdet.guard._nonfinite = lambda grads, out: passes.append(len(grads)) or own_pass(grads, out)

    model = make_model(0)
    ddp = DDP(model, broadcast_buffers=False)
    o = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9, fused=fused or None) if sgd else \
        torch.optim.Adam(ddp.parameters(), lr=0.01, fused=fused or None)
    s = hdet.OneCycleAutoLR(o, max_lr=0.02, total_steps=steps, ensemble_lr_spread_ratio=0.2, model_sync_interval=T,
                            controller="paper", enable_auto_lr=True, auto_lr_warmup_steps=T, loss_scale=0.05, model=ddp, seed=3,
                            guard_gradients=guard, on_runaway=on_runaway)
    finite, equal, recovered, caught, changed, nonfinite, records = [], [], [], [], [], [], []
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for t in range(1, steps + 1):
                before = torch.cat([p.detach().flatten() for p in model.parameters()])
                if fault == "weights" and t == at and bad_rank in (rank, -1):
                    with torch.no_grad():
                        model[0].weight[0, 0] = float("nan")
                x, y = batch(rank, t)
                loss = nn.functional.mse_loss(ddp(x), y)
                if fault == "loss" and t == at and rank == bad_rank:
                    loss = loss * float("nan")
                o.zero_grad()
                hook = None
                if fault in ("matrix_grad", "matrix_grad_inf") and t == at and bad_rank in (rank, -1):
                    bad = float("nan") if fault == "matrix_grad" else float("inf")
                    hook = model[0].weight.register_hook(lambda g: g.index_put((torch.tensor(3), torch.tensor(2)),
                                                                               torch.tensor(bad)))
                loss.backward()
                if hook is not None:
                    hook.remove()
                if clip:
                    s.clip_grad_norm_(1e6, norm_type=norm_type)
                o.step()
                changed.append(not torch.equal(before, torch.cat([p.detach().flatten() for p in model.parameters()])))
                last = s.last_sync
                s.step(loss)
                if s.last_sync is not last:
                    records.append((t, s.last_sync.went_back_to, s.last_sync.lr_scale))
                finite.append(bool(all(torch.isfinite(p).all() for p in model.parameters())
                                   and all(torch.isfinite(v).all() for st in o.state.values() for v in st.values())))
                if s.is_sync_step(t):
                    flat = gather_flat(list(model.parameters()) + float_buffers(model))
                    equal.append(all(torch.equal(flat[0], f) for f in flat[1:]))
                    recovered.append(list(s.last_sync.recovered))
                    nonfinite.append(list(s.last_sync.nonfinite_losses))
            caught = [str(x.message) for x in w if "non-finite" in str(x.message)]
    except hdet.NonFiniteReplicaError as e:
        return {"error": "NonFiniteReplicaError", "msg": str(e), "finite": finite}
    return {"error": None, "finite": finite, "equal": equal, "recovered": recovered, "warnings": caught,
            "nonfinite_losses": nonfinite, "records": records,
            "guard": s.gradient_guard, "losses_at_recovery": s.ensemble.controllers[0].updates, "changed": changed,
            "skipped": None if s.skip_guard is None else float(s.skip_guard.skipped),
            "steps": [int(st["step"]) for st in o.state.values() if "step" in st][:1], "own_passes": len(passes),
            "params": [p.detach().clone() for p in model.parameters()]}


def _timeout_entry(rank, world, out_dir, skip_rank, timeout_s):
    """Own spawn entry: a short process-group timeout; replica ``skip_rank`` never reaches the sync."""
    import time
    from datetime import timedelta

    torch.set_num_threads(1)
    from helpers import file_init_method

    dist.init_process_group("gloo", init_method=file_init_method(out_dir), rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    model = make_model()
    o = torch.optim.SGD(model.parameters(), lr=0.01)
    s = hdet.OneCycleAutoLR(o, max_lr=0.01, total_steps=10, model_sync_interval=2, model=model)
    res = {"error": None}
    o.step()
    if rank == skip_rank:
        time.sleep(timeout_s * 3)  # never arrives at the sync of step 2
    else:
        t0 = time.perf_counter()
        try:
            o.step()
            s.step(1.0)
            s.step(1.0)  # step 2: a sync step
        except hdet.ReplicaSyncError as e:
            res = {"error": "ReplicaSyncError", "msg": str(e), "seconds": time.perf_counter() - t0}
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    os._exit(0)  # no teardown: the group is broken


def soak(rank, world, *, steps=2500, T=10, seed=0):
    """Many small steps with random faults, decided identically on every rank by a shared generator:
    a NaN loss or a NaN weight on one replica, a skipped optimizer step (all replicas, as AMP does), a
    save/load round trip (sometimes into a freshly built scheduler). Checks invariants after every sync."""
    import io
    import math
    import warnings

    warnings.filterwarnings("ignore", message="hdet: at sync step")  # each recovery warns; expected here
    warnings.filterwarnings("ignore", message="hdet: this optimizer already had")  # (each rebuild closes one)
    model = make_model(0)
    ddp = DDP(model, broadcast_buffers=False)
    o = torch.optim.Adam(ddp.parameters(), lr=0.01)
    kw = dict(max_lr=0.02, total_steps=steps, ensemble_lr_spread_ratio=0.3, model_sync_interval=T,
              controller="paper", enable_auto_lr=True, auto_lr_warmup_steps=100, loss_scale=0.05, model=ddp, seed=3)
    s = hdet.OneCycleAutoLR(o, **kw)
    g = torch.Generator().manual_seed(seed)  # the same fault plan on every rank
    rho = sorted(s.ensemble.rho)
    lo, hi = 0.02 / 25 / 1e4 * 0.7 * (1 - 1e-9), 0.2 * 1.3 * (1 + 1e-9)
    counts = {"nan_loss": 0, "nan_weight": 0, "skip": 0, "save_load": 0, "rebuild": 0, "syncs": 0, "recovered": 0,
              "counted_losses": 0}
    for t in range(1, steps + 1):
        u, victim = torch.rand(1, generator=g).item(), int(torch.randint(world, (1,), generator=g))
        fault = ("nan_loss" if u < 0.01 else "nan_weight" if u < 0.015 else "skip" if u < 0.03
                 else "save_load" if u < 0.05 else None)
        if fault == "nan_weight" and rank == victim:
            with torch.no_grad():
                model[3].weight.view(-1)[0] = float("nan")
        x, y = batch(rank, t)
        loss = nn.functional.mse_loss(ddp(x), y)
        if fault == "nan_loss" and rank == victim:
            loss = loss * float("nan")
        o.zero_grad()
        loss.backward()
        if fault != "skip":
            o.step()
        s.step(loss)
        if fault:
            counts[fault] += 1
        lr = s.get_last_lr()[0]
        assert math.isfinite(lr) and lo <= lr <= hi, (t, lr)
        if s.is_sync_step(t):
            counts["syncs"] += 1
            counts["recovered"] += len(s.last_sync.recovered)
            counts["counted_losses"] += sum(s.last_sync.nonfinite_losses)
            flat = gather_flat(list(model.parameters()) + float_buffers(model))
            assert all(torch.equal(flat[0], f) for f in flat[1:]), f"replicas differ after the sync at {t}"
            assert all(torch.isfinite(f).all() for f in flat), f"non-finite weights after the sync at {t}"
            m = torch.tensor([s.ensemble.multiplier(0)], dtype=torch.float64)  # (the deal: after the close too)
            ms = [torch.empty_like(m) for _ in range(world)]
            dist.all_gather(ms, m)
            assert sorted(x.item() for x in ms) == rho, f"multipliers not a permutation of rho at {t}"
        if fault == "save_load":
            buf = io.BytesIO()
            torch.save({"opt": o.state_dict(), "sched": s.state_dict()}, buf)
            buf.seek(0)
            ck = torch.load(buf, weights_only=True)
            o.load_state_dict(ck["opt"])
            if victim % 2:  # a freshly built scheduler: it closes the one before and takes over its DDP hook guard
                s = hdet.OneCycleAutoLR(o, **kw)
                assert s.gradient_guard == "hook"
                counts["rebuild"] += 1
            s.load_state_dict(ck["sched"])
    return counts


def accumulate(rank, world, *, micro=3, steps=12, T=4):
    """The same data as one batch of 8 * micro per step, or as ``micro`` micro-batches with DDP's no_sync
    on all but the last: HDET counts optimizer steps, so both runs match."""
    out = {}
    for mode in ("one_batch", "accumulate"):
        torch.manual_seed(0)  # no BatchNorm here: its batch statistics differ between 24 and 3 x 8 samples
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))
        ddp = DDP(model, broadcast_buffers=False)
        o = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        s = hdet.OneCycleAutoLR(o, max_lr=0.02, total_steps=steps, ensemble_lr_spread_ratio=0.3,
                                model_sync_interval=T, controller="paper", enable_auto_lr=True, auto_lr_warmup_steps=T,
                                loss_scale=0.05, model=ddp, seed=3)
        for t in range(1, steps + 1):
            parts = [batch(rank, t * 10 + i) for i in range(micro)]
            o.zero_grad()
            if mode == "one_batch":
                x = torch.cat([p[0] for p in parts])
                y = torch.cat([p[1] for p in parts])
                loss = nn.functional.mse_loss(ddp(x), y)
                loss.backward()
            else:
                total = 0.0
                for i, (x, y) in enumerate(parts):
                    ctx = ddp.no_sync() if i < micro - 1 else torch.enable_grad()
                    with ctx:
                        part = nn.functional.mse_loss(ddp(x), y) / micro
                        part.backward()
                    total = total + part.detach()
                loss = total
            o.step()
            s.step(loss)  # once per optimizer step, with the step's loss
        out[mode] = {"params": [p.detach().clone() for p in model.parameters()], "lr": s.get_last_lr(),
                     "updates": s.ensemble.controllers[0].updates}
    return out


def local_mode(rank, world, *, steps=10, T=5):
    """No gradient all-reduce at all (DDP's no_sync every step): replicas truly diverge between converge
    steps and are equal after each."""
    model = make_model(0)
    ddp = DDP(model, broadcast_buffers=False)
    o = torch.optim.Adam(ddp.parameters(), lr=0.01)
    s = hdet.OneCycleAutoLR(o, max_lr=0.02, total_steps=steps, ensemble_lr_spread_ratio=0.2, model_sync_interval=T,
                            model=ddp, seed=3)
    before, after = [], []
    for t in range(1, steps + 1):
        x, y = batch(rank, t)
        with ddp.no_sync():
            loss = nn.functional.mse_loss(ddp(x), y)
            o.zero_grad()
            loss.backward()
        o.step()
        flat = gather_flat(model.parameters())
        before.append(not torch.equal(flat[0], flat[1]))
        s.step(loss)
        if s.is_sync_step(t):
            flat = gather_flat(model.parameters())
            after.append(torch.equal(flat[0], flat[1]))
    return {"differ_every_step": before, "equal_after_sync": after}


def compiled(rank, world, *, steps=10, T=5):
    """A torch.compile'd DDP model: the compiled forward sees the averaged weights after a converge step
    (its output equals the eager module's on the same input)."""
    model = make_model(0)
    ddp = DDP(model, broadcast_buffers=False)
    fast = torch.compile(ddp)
    o = torch.optim.SGD(ddp.parameters(), lr=0.01)
    s = hdet.OneCycleAutoLR(o, max_lr=0.02, total_steps=steps, ensemble_lr_spread_ratio=0.3, model_sync_interval=T,
                            model=ddp, seed=3)
    agree = []
    for t in range(1, steps + 1):
        train_steps(fast, o, s, rank, range(t, t + 1))
        if s.is_sync_step(t):
            model.eval()
            probe = torch.ones(4, 6)
            with torch.no_grad():
                agree.append(bool(torch.allclose(fast(probe), model(probe), atol=1e-6)))
            model.train()
    return {"agree": agree, "params": gather_flat(model.parameters())}


def hsdp(rank, world, *, mesh_shape=(2, 2), steps=10, T=5, bn=False):
    """FSDP2 through a (replicate, shard) DeviceMesh: HDET replicas are the replicate dimension. ``bn``: a BatchNorm
    layer, whose statistics each rank keeps whole (returned after each converge step)."""
    from torch.distributed.device_mesh import init_device_mesh
    from helpers import fully_shard

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), *([nn.BatchNorm1d(16)] if bn else []), nn.ReLU(), nn.Linear(16, 1))
    fully_shard(model, mesh=mesh)
    o = torch.optim.Adam(model.parameters(), lr=0.01)
    s = hdet.OneCycleAutoLR(o, max_lr=0.02, total_steps=steps, ensemble_lr_spread_ratio=0.3, model_sync_interval=T,
                            controller="paper", enable_auto_lr=True, auto_lr_warmup_steps=T, loss_scale=0.05, model=model, seed=3,
                            device_mesh=mesh)
    lrs, full_after, buffers_after = [], [], []
    for t in range(1, steps + 1):
        train_steps(model, o, s, rank, range(t, t + 1))
        lrs.append(s.get_last_lr()[0])
        if s.is_sync_step(t):
            full_after.append(torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()]))
            buffers_after.append([b.detach().clone() for b in model.buffers() if b.is_floating_point()])
    logger = hdet.SyncLogger(s, None)  # telemetry: replica 0's first rank writes, not every shard of replica 0
    return {"lrs": lrs, "full_after": full_after, "buffers_after": buffers_after, "replica": s.rank, "N": s.world_size,
            "bases": s.base_lrs_now, "updates": s.ensemble.controllers[0].updates, "logs": logger.active}


def hsdp_fit(rank, world, *, mesh_shape=(2, 2), steps=16, T=4, checkpoint_at=None, ckpt=None, load_rank=None,
             warm=None, broken_probe=False):
    """The fit controller (the default) over a (replicate, shard) mesh. Replica r's batch at step t is ``batch(2r, t)``
    and ``batch(2r + 1, t)``: on a (2, 2) mesh each shard rank takes one (FSDP2 averages their gradients, and the
    sync sums their losses), on (2, 1) the replica's one rank takes both, so both runs see the same losses and
    gradients. ``checkpoint_at``: save every rank's scheduler and model state at that step into ``ckpt`` (a folder),
    start afresh from it and run to the end (each rank loads its own; ``load_rank``: every rank loads that rank's
    scheduler state, as the Hugging Face Trainer does, and its own model and optimizer state). ``warm``: the
    controller's first sync (T by default); ``broken_probe``: after the load, the probe returns every row's loss
    (not a scalar)."""
    import warnings

    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from helpers import fully_shard

    R, S = mesh_shape
    replica, shard = divmod(rank, S)
    xp, yp = batch(0, 100_000)  # the probe's batch, the same on every rank (and after a resume)

    def build():
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))
        fully_shard(model, mesh=mesh)
        o = torch.optim.Adam(model.parameters(), lr=0.01)
        s = hdet.OneCycleAutoLR(o, max_lr=0.02, total_steps=steps, ensemble_lr_spread_ratio=0.3,
                                model_sync_interval=T, enable_auto_lr=True, auto_lr_warmup_steps=warm or T,
                                model=model, probe=probe, seed=3, device_mesh=mesh)
        return model, o, s

    def probe(m):
        out = nn.functional.mse_loss(m(xp), yp, reduction="none" if broken[0] else "mean")
        return out

    broken = [False]

    model, o, s = build()
    lrs, full_after, probes, expected = [], [], [], []
    window: list[torch.Tensor] = []  # this replica's full weights after each step of the window, summed (by hand)
    n = 0
    load_warnings: list[str] = []
    t = 1
    while t <= steps:
        parts = [batch(2 * replica + k, t) for k in range(2)]
        x, y = parts[shard] if S == 2 else (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
        loss = nn.functional.mse_loss(model(x), y)
        o.zero_grad()
        loss.backward()
        o.step()
        full = [p.full_tensor().detach().clone() for p in model.parameters()]
        window, n = ([w + f for w, f in zip(window, full)] if window else full), n + 1
        s.step(loss)
        lrs.append(s.get_last_lr()[0])
        if s.is_sync_step(t):
            full_after.append(torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()]))
            rec = s.last_sync
            if rec is not None and rec.controller:
                probes.append([float(x) for x in rec.controller[0].losses])
                plain = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))  # the probe by hand, at the mean
                with torch.no_grad():
                    for p, w in zip(plain.parameters(), window):
                        p.copy_(w / n)
                    expected.append(float(nn.functional.mse_loss(plain(xp), yp)))
            window, n = [], 0
        if t == checkpoint_at:
            model_sd, opt_sd = get_state_dict(model, o)
            torch.save({"model": model_sd, "opt": opt_sd}, os.path.join(ckpt, f"rank{rank}.pt"))
            torch.save(s.state_dict(), os.path.join(ckpt, f"sched{rank}.pt"))
            dist.barrier()
            model, o, s = build()
            loaded = torch.load(os.path.join(ckpt, f"rank{rank}.pt"), weights_only=False)
            set_state_dict(model, o, model_state_dict=loaded["model"], optim_state_dict=loaded["opt"])
            sched = torch.load(os.path.join(ckpt, f"sched{rank if load_rank is None else load_rank}.pt"),
                               weights_only=True)  # (hdet's state: plain data)
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                s.load_state_dict(sched)
            load_warnings = [str(w.message) for w in said if "hdet" in str(w.message)]
            broken[0] = broken_probe
        t += 1
    return {"lrs": lrs, "full_after": full_after, "replica": s.rank, "N": s.world_size, "bases": s.base_lrs_now,
            "updates": s.ensemble.controllers[0].updates, "probes": probes, "expected": expected,
            "load_warnings": load_warnings}


def one_d_mesh(rank, world, *, name="shard", dadapt=False, shard=True):
    """A plain 1-D FSDP2 mesh passed as device_mesh: the error (or, named 'replicate' with whole replicas, the number
    of replicas). ``dadapt``: D-Adaptation Adam instead of AdamW; ``shard``: fully_shard the model over the mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from helpers import fully_shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=(name,))
    model = nn.Linear(4, 2)
    if shard:
        fully_shard(model, mesh=mesh)
    if dadapt:
        import dadaptation

        o = dadaptation.DAdaptAdam(model.parameters(), lr=1.0, decouple=True)
    else:
        o = torch.optim.AdamW(model.parameters(), lr=0.01)
    try:
        s = hdet.OneCycleAutoLR(o, max_lr=0.02, total_steps=10, ensemble_lr_spread_ratio=0.5, model_sync_interval=5,
                                model=model, device_mesh=mesh)
    except ValueError as e:
        return {"error": str(e)}
    return {"error": None, "N": s.world_size}


def swapped_mesh(rank, world):
    """A 2-D mesh whose dimensions are named the other way round, ('shard', 'replicate'): fully_shard replicates along
    the first dimension whatever its name, so the 'replicate' dimension holds shards. The scheduler's error."""
    from torch.distributed.device_mesh import init_device_mesh
    from helpers import fully_shard

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("shard", "replicate"))
    model = nn.Linear(4, 2)
    fully_shard(model, mesh=mesh)
    o = torch.optim.AdamW(model.parameters(), lr=0.01)
    try:
        hdet.OneCycleAutoLR(o, max_lr=0.02, total_steps=10, ensemble_lr_spread_ratio=0.5, model_sync_interval=5,
                            model=model, device_mesh=mesh)
    except ValueError as e:
        return {"error": str(e)}
    return {"error": None}


def partitioned(rank, world, *, kind="fsdp1", steps=4, T=2):
    """What an FSDP1 or ZeroRedundancyOptimizer user writes: the scheduler's error, or (none) whether the run
    averaged shards of different parameters (``kind``: "fsdp1", "fsdp1-orig" (use_orig_params=True),
    "fsdp1-no-model" (no model=), "zero"; "zero-alpha0": ZeRO without a spread, allowed; refused without a spread:
    "zero-recover" (on_runaway="recover"), "zero-range" (lr_range_test), "zero-warm" (hdet.warm_init_ after building
    the scheduler, as its docs say: refused at the first step) and "zero-warm-before" (before: at construction))."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.optim import ZeroRedundancyOptimizer

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    if kind.startswith("fsdp1"):
        model = FSDP(net, device_id=torch.device("cpu"), use_orig_params=kind == "fsdp1-orig")
        o = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        model = DDP(net)
        o = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    extra = {"zero-recover": {"on_runaway": "recover"}, "zero-range": {"lr_range_test": True, "auto_lr_warmup_steps": 2}
             }.get(kind, {})
    alpha0 = kind.startswith("zero-") and kind != "zero"
    try:
        if kind == "zero-warm-before":
            hdet.warm_init_(net)
        s = hdet.HDETLR(o, None, total_steps=steps, ensemble_lr_spread_ratio=0.0 if alpha0 else 0.5,
                        model_sync_interval=T, model=None if kind == "fsdp1-no-model" else model, **extra)
        if kind == "zero-warm":
            hdet.warm_init_(net)
        g = torch.Generator().manual_seed(rank)
        for _ in range(steps):
            loss = (model(torch.randn(8, 4, generator=g)) ** 2).mean()
            o.zero_grad()
            loss.backward()
            o.step()
            s.step(loss)
    except ValueError as e:
        return {"error": str(e)}
    return {"error": None, "params": gather_flat([p.detach() for p in net.parameters()])}


def hsdp_guard(rank, world, *, fault="loss", steps=10, T=5, at=3):
    """FSDP2 on a (2, 2) mesh with torch's fused AdamW, so "auto" installs the "skip-all" guard. At step ``at``
    rank 1 (a shard of replica 0) gets a NaN loss, or rank 3 a NaN in its own gradient shard after the
    reductions (no other rank sees it): of a bias ("shard", under guard_gradients="skip": a sentinel) or of a
    weight matrix ("shard-matrix", under "auto"), or rank 1 a NaN in its weight shard ("weight"). Records,
    per step, whether this rank's shards changed."""
    from torch.distributed.device_mesh import init_device_mesh
    from helpers import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))
    fully_shard(model, mesh=mesh)
    o = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    s = hdet.OneCycleAutoLR(o, max_lr=0.02, total_steps=steps, ensemble_lr_spread_ratio=0.3, model_sync_interval=T,
                            controller="paper", model=model, seed=3, device_mesh=mesh,
                            guard_gradients="skip" if fault == "shard" else "auto")
    changed, finite, recovered, nonfinite = [], [], [], []
    for t in range(1, steps + 1):
        before = torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()])
        if fault == "weight" and t == at and rank == 1:  # a NaN in one shard of replica 0's weights
            with torch.no_grad():
                next(iter(model.parameters())).to_local().view(-1)[0] = float("nan")
        x, y = batch(rank, t)
        loss = nn.functional.mse_loss(model(x), y)
        if fault == "loss" and t == at and rank == 1:
            loss = loss * float("nan")
        o.zero_grad()
        loss.backward()
        if fault in ("shard", "shard-matrix") and t == at and rank == 3:
            with torch.no_grad():
                p = model[0].bias if fault == "shard" else model[0].weight
                p.grad.to_local().view(-1)[0] = float("nan")
        o.step()
        after = torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()])
        changed.append(not torch.equal(before, after))
        s.step(loss)
        finite.append(bool(torch.isfinite(after).all()))
        if s.is_sync_step(t):
            recovered.append(list(s.last_sync.recovered))
            nonfinite.append(list(s.last_sync.nonfinite_losses))
    mine = torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()])
    peers = [torch.empty_like(mine) for _ in range(2)]  # the same shards of both replicas
    dist.all_gather(peers, mine, group=mesh.get_group("replicate"))
    import io  # the scheduler's state under HSDP: plain data, weights_only, the live guard kept

    buf = io.BytesIO()
    torch.save(s.state_dict(), buf)
    buf.seek(0)
    guard = s.skip_guard
    s.load_state_dict(torch.load(buf, weights_only=True))
    return {"guard": s.gradient_guard, "changed": changed, "finite": finite, "recovered": recovered,
            "nonfinite_losses": nonfinite, "skipped": float(s.skip_guard.skipped),
            "replicas_equal": torch.equal(peers[0], peers[1]), "guard_kept": s.skip_guard is guard}


def distance_estimator(rank, world, *, kind="dadapt", steps=30, T=10, alpha=0.5):
    """DDP with D-Adaptation Adam or Prodigy under a spread (issue 15, item 4): every rank's LR is the base and
    its multiplier scales the step; records per step whether the estimates agree across ranks."""
    import dadaptation
    import prodigyopt

    model = make_model(0)
    ddp = DDP(model, broadcast_buffers=False)
    o = (dadaptation.DAdaptAdam(ddp.parameters(), lr=1.0, decouple=True) if kind == "dadapt"
         else prodigyopt.Prodigy(ddp.parameters(), lr=1.0, decouple=True))
    s = hdet.OneCycleAutoLR(o, max_lr=1.0, total_steps=steps, ensemble_lr_spread_ratio=alpha, model_sync_interval=T,
                            model=ddp)
    same_d, same_lr, equal_after, differ_before, losses = [], [], [], [], []
    for t in range(1, steps + 1):
        x, y = batch(rank, t)
        loss = nn.functional.mse_loss(ddp(x), y)
        o.zero_grad()
        loss.backward()
        o.step()
        flat = gather_flat(model.parameters())
        if t % T == 0:
            differ_before.append(not torch.equal(flat[0], flat[1]))
        s.step(loss)
        ds = gather_flat([torch.tensor([o.param_groups[0]["d"], o.param_groups[0]["lr"]], dtype=torch.float64)])
        same_d.append(all(float(v[0]) == float(ds[0][0]) for v in ds))
        same_lr.append(all(float(v[1]) == float(ds[0][1]) for v in ds))
        if t % T == 0:
            flat = gather_flat(model.parameters())
            equal_after.append(torch.equal(flat[0], flat[1]))
        losses.append(float(loss))
    return {"same_d": same_d, "same_lr": same_lr, "equal_after": equal_after, "differ_before": differ_before,
            "d": o.param_groups[0]["d"], "mults": s.ensemble.step_scale.multipliers, "losses": losses}


def local_recovery(rank, world, poison_at=7, steps=10):
    """Local mode on gloo (no gradient averaging: each rank's Adam moments are its own), T = 5, the engine's
    set-up in ``tests/test_reliability.py::_local_adam``; rank 1's weight is NaN from step ``poison_at``.
    Returns this rank's first ``exp_avg_sq`` after the last step and the sync's recovered replicas."""
    import warnings

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    o = torch.optim.Adam(model.parameters(), lr=0.05)
    s = hdet.HDETLR(o, None, total_steps=steps, model_sync_interval=5, model=model, ensemble_lr_spread_ratio=0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for t in range(1, steps + 1):
            if t == poison_at and rank == 1:
                with torch.no_grad():
                    model[0].weight[0, 0] = float("nan")
            x = torch.randn(world, 8, 3, generator=torch.Generator().manual_seed(t))[rank]
            loss = nn.functional.mse_loss(model(x), x[..., :1].sin())
            o.zero_grad()
            loss.backward()
            o.step()
            s.step(loss)
    return {"exp_avg_sq": o.state[o.param_groups[0]["params"][0]]["exp_avg_sq"].clone(),
            "recovered": list(s.last_sync.recovered)}


def hsdp_one_file_resume(rank, world, *, stop=7, T=5):
    """FSDP2 on a (2, 2) mesh; at step ``stop`` (mid-window) rank 0's scheduler state is loaded on every rank (one
    file for all): returns the warnings the load raised here."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from helpers import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))
    fully_shard(model, mesh=mesh)
    o = torch.optim.Adam(model.parameters(), lr=0.01)
    s = hdet.OneCycleAutoLR(o, max_lr=0.02, total_steps=20, ensemble_lr_spread_ratio=0.3, model_sync_interval=T,
                            model=model, device_mesh=mesh)
    train_steps(model, o, s, rank, range(1, stop + 1))
    box = [s.state_dict() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        s.load_state_dict(box[0])
    return {"warned": [str(w.message) for w in seen if "middle of a window" in str(w.message)]}


def local_skip_guard_nan(rank, world, poison_at=3, steps=40, T=40):
    """Local mode (DDP's no_sync() every step) with a fused Adam, so the default "skip-all" guard: rank 1's weight is NaN
    from step ``poison_at``. Returns the syncs' recovered replicas, the guard's kind, whether every weight is finite
    at the end, the weights, and the warnings seen."""
    import warnings

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    ddp = DDP(model)
    o = torch.optim.Adam(ddp.parameters(), lr=0.01, fused=True)
    s = hdet.OneCycleAutoLR(o, max_lr=0.05, total_steps=steps, ensemble_lr_spread_ratio=0.2, model_sync_interval=T,
                            model=ddp)
    recovered = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for t in range(1, steps + 1):
            if t == poison_at and rank == 1:
                with torch.no_grad():
                    model[0].weight[0, 0] = float("nan")
            x = torch.randn(world, 8, 3, generator=torch.Generator().manual_seed(t))[rank]
            with ddp.no_sync():
                loss = nn.functional.mse_loss(ddp(x), x[..., :1].sin())
                o.zero_grad()
                loss.backward()
            o.step()
            s.step(loss)
            if s.is_sync_step(t):
                recovered.append((t, list(s.last_sync.recovered)))
    return {"recovered": recovered, "guard": s.gradient_guard, "skipped": float(s.skip_guard.skipped),
            "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
            "weights": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
            "warnings": [str(w.message) for w in seen]}


def scaler_resume(rank, world, *, total=50, T=10, nan_at=22, ckpt=20):
    """DDP + fused AdamW + ``torch.amp.GradScaler("cpu")`` + on_runaway="recover": rank 0's weight NaN after step
    ``nan_at``, so every step overflows and the scaler halves its scale until the sync at step 30 resets the replica
    and puts the scale back to the last healthy sync's. The whole run, and one resumed from a checkpoint (model,
    optimizer, scheduler, scaler) at sync step ``ckpt``: their scales and weights after every step."""
    import io

    def build():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
        ddp = DDP(net)
        opt = torch.optim.AdamW(ddp.parameters(), lr=0.003, fused=True)
        sched = hdet.OneCycleAutoLR(opt, max_lr=0.003, total_steps=total, ensemble_lr_spread_ratio=0.2,
                                    model_sync_interval=T, model=ddp, on_runaway="recover")
        return net, ddp, opt, sched, torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)

    def run(parts, t):
        net, ddp, opt, sched, scaler = parts
        x, y = batch(rank, t)
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step(loss)
        if t == nan_at and rank == 0:
            with torch.no_grad():
                net[0].weight[0, 0] = float("nan")
        return scaler.get_scale(), torch.cat([p.detach().reshape(-1).clone() for p in net.parameters()])

    whole, saved = build(), None
    out = {"whole": [], "resumed": []}
    for t in range(1, total + 1):
        out["whole"].append(run(whole, t))
        if t == ckpt:
            buf = io.BytesIO()
            torch.save({"model": whole[0].state_dict(), "opt": whole[2].state_dict(), "sched": whole[3].state_dict(),
                        "scaler": whole[4].state_dict()}, buf)
            saved = buf.getvalue()
    resumed = build()
    state = torch.load(io.BytesIO(saved), weights_only=True)
    resumed[0].load_state_dict(state["model"])
    resumed[2].load_state_dict(state["opt"])
    resumed[3].load_state_dict(state["sched"])
    resumed[4].load_state_dict(state["scaler"])
    for t in range(ckpt + 1, total + 1):
        out["resumed"].append(run(resumed, t))
    out["kept"] = state["sched"].get("loss_scale_kept")
    out["recovered"] = resumed[3].last_sync.step if resumed[3].last_sync is not None else None
    return out


def hsdp_warm_init(rank, world, *, mesh_shape=(2, 2), nu=0.05, seed=7, scope="model", names=("replicate", "shard")):
    """``hdet.warm_init_`` on an FSDP2 model over a (replicate, shard) mesh: the full weights before and after, the std
    it returned, and the noise an unsharded copy of the model gets from ``warm_init_(copy, rank=replica)``."""
    from torch.distributed.device_mesh import init_device_mesh
    from helpers import fully_shard

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 3))
    plain = copy.deepcopy(model)
    fully_shard(model, mesh=mesh)
    before = torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()])
    std = hdet.warm_init_(model, nu=nu, seed=seed, scope=scope)
    after = torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()])
    replica = mesh.get_local_rank(0)
    plain_std = hdet.warm_init_(plain, rank=replica, nu=nu, seed=seed, scope=scope)
    return {"before": before, "after": after, "std": std, "replica": replica, "plain_std": plain_std,
            "plain_after": torch.cat([p.detach().reshape(-1) for p in plain.parameters()])}


def half_averaging(rank, world, *, dtype=torch.float16, contiguous=False, device="cpu"):
    """A half-precision model under DDP with HDET (SGD: the "hook" guard): its BatchNorm's running_var set per rank to
    values whose fp16 sum overflows, one step of per-rank fp16 gradients of 4e4 (also an fp16 overflow when summed),
    then a converge step. Returns the averaged gradient, each rank's running_var before and the mean after."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 1, bias=False)).to(device, dtype)
    if contiguous:
        hdet.contiguous_parameters_(net)
    model = DDP(net, broadcast_buffers=False)
    o = torch.optim.SGD(model.parameters(), lr=1e-12)
    s = hdet.OneCycleAutoLR(o, max_lr=1e-12, total_steps=2, ensemble_lr_spread_ratio=0.2, model_sync_interval=1,
                            model=model)
    model.eval()  # (the statistics as set below)
    net[0].running_var.copy_(torch.tensor([38240.0, 38976.0, 1.0, 3.0]) if rank == 0 else
                             torch.tensor([38976.0, 38240.0, 2.0, 1.0]))
    before = net[0].running_var.clone()
    loss = model(torch.full((1, 4), 4e4, dtype=dtype, device=device)).sum() * 0 + (net[1].weight * 4e4).sum()
    o.zero_grad()
    loss.backward()
    grad = net[1].weight.grad.clone()
    o.step()
    s.step(loss.detach())
    return {"grad": grad, "before": before, "after": net[0].running_var.clone(), "guard": s.gradient_guard}


def average_into(rank, world):
    """A recovery's average (``exclude=into=[the last rank]``, its tensors NaN): the others keep their own tensors, the
    last gets their mean. A tensor of at least one bucket, small ones sharing one, a bf16 one."""
    torch.manual_seed(rank)
    tensors = [torch.randn(4096), torch.randn(8), torch.randn(8), torch.randn(8).bfloat16()]
    bad = world - 1
    mine = [t.clone() for t in tensors]
    others = [t.double() for t in tensors]
    for t in others:
        if rank == bad:
            t.zero_()
        dist.all_reduce(t)
        t.div_(world - 1)
    if rank == bad:
        for t in tensors:
            t.fill_(float("nan"))
    hdet.ProcessGroupReplicas(bucket_cap_mb=0.001).average_(tensors, exclude=[bad], into=[bad])
    if rank == bad:
        return {"ok": all(torch.allclose(t.double(), e, rtol=1e-2, atol=1e-2) if t.dtype == torch.bfloat16 else
                          torch.allclose(t.double(), e, rtol=1e-6, atol=1e-7) for t, e in zip(tensors, others))}
    return {"ok": all(torch.equal(t, m) for t, m in zip(tensors, mine))}


def two_optimizers(rank, world, *, fused=(False, False), nan_at=3, steps=6):
    """One DDP model, its two layers in two optimizers, each with its own OneCycleAutoLR (``fused``: each optimizer's
    AdamW flag). Rank 1's loss is NaN at step ``nan_at``. Returns each scheduler's guard, hdet's warnings and whether
    the weights stayed finite."""
    import warnings

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    model = DDP(net)
    opts = [torch.optim.AdamW(net[i].parameters(), lr=0.01, fused=f) for i, f in zip((0, 2), fused)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scheds = [hdet.OneCycleAutoLR(o, max_lr=0.01, total_steps=steps, ensemble_lr_spread_ratio=0.2,
                                      model_sync_interval=steps, model=model) for o in opts]
        for t in range(1, steps + 1):
            x, y = batch(rank, t)
            loss = nn.functional.mse_loss(model(x[:, :4]), y[:, :1])
            if rank == 1 and t == nan_at:
                loss = loss * float("nan")
            for o in opts:
                o.zero_grad()
            loss.backward()
            for o, s in zip(opts, scheds):
                o.step()
                s.step(loss.detach())
    return {"guards": [s.gradient_guard for s in scheds], "finite": all(torch.isfinite(p).all() for p in net.parameters()),
            "warnings": [str(w.message) for w in caught if str(w.message).startswith("hdet: ") and "guard" in str(w.message)]}


def hsdp_finish(rank, world):
    """FSDP2 on a (2, 2) mesh, T = 5 of 20 steps, left after step 7: ``finish()`` averages the two replicas (their
    full weights equal afterwards, apart before)."""
    from torch.distributed.device_mesh import init_device_mesh
    from helpers import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))
    fully_shard(model, mesh=mesh)
    o = torch.optim.AdamW(model.parameters(), lr=0.01)
    s = hdet.OneCycleAutoLR(o, max_lr=0.02, total_steps=20, ensemble_lr_spread_ratio=0.3, model_sync_interval=5,
                            model=model, device_mesh=mesh)
    train_steps(model, o, s, rank, range(1, 8))

    def full():
        return torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()])  # (a collective on the shards)

    before = full()
    rec = s.finish()
    after = full()
    group = mesh.get_group("replicate")
    b, a = [torch.empty_like(before) for _ in range(2)], [torch.empty_like(after) for _ in range(2)]
    dist.all_gather(b, before, group=group)
    dist.all_gather(a, after, group=group)
    return {"apart": not torch.equal(b[0], b[1]), "equal": torch.equal(a[0], a[1]),
            "mean": torch.allclose(after, (b[0] + b[1]) / 2, atol=1e-6), "step": None if rec is None else rec.step}


def swap_average(rank, world, *, nan_rank=None, mesh_shape=None):
    """Seven steps of 20 (T = 5), then ``with s.averaged():`` between converge steps: every rank's model holds the
    replicas' mean (of the finite ones), training calls are refused inside, and each rank's own weights come back
    exactly, BatchNorm's ``num_batches_tracked`` too after a forward in training mode inside; at converge step 10
    nothing is averaged (no collective) in a model without floating-point buffers, and the BatchNorm model's are (a
    training forward may have moved them since), then after a training forward; after an optimizer step without
    ``s.step()`` it is again. ``mesh_shape``: FSDP2/HSDP replicas on a ("replicate", "shard") mesh, without BatchNorm."""
    if mesh_shape is not None:
        from torch.distributed.device_mesh import init_device_mesh
        from helpers import fully_shard

        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))
        fully_shard(model, mesh=mesh)
        group, replica = mesh.get_group("replicate"), mesh.get_coordinate()[0]
        extra = {"device_mesh": mesh}
    else:
        model, group, replica, extra = DDP(make_model()), None, rank, {}
    o = torch.optim.AdamW(model.parameters(), lr=0.01)
    s = hdet.OneCycleAutoLR(o, max_lr=0.02, total_steps=20, ensemble_lr_spread_ratio=0.3, model_sync_interval=5,
                            model=model, **extra)
    train_steps(model, o, s, rank, range(1, 8))

    def flat():  # this replica's whole weights and float buffers (FSDP2: a collective over the shard ranks)
        ts = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()] + float_buffers(model)
        return torch.cat([t.detach().reshape(-1) for t in ts]).clone()

    if nan_rank is not None and replica == nan_rank:
        with torch.no_grad():
            next(model.parameters()).to_local().fill_(float("nan")) if mesh_shape else \
                next(model.parameters()).fill_(float("nan"))
    own = flat()
    every = [torch.empty_like(own) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, own, group=group)
    healthy = [e.double() for k, e in enumerate(every) if k != nan_rank]
    mean = sum(healthy) / len(healthy)
    refused = []
    counts = [b.clone() for name, b in model.named_buffers() if name.endswith("num_batches_tracked")]
    with s.averaged() as changed:
        inside = flat()
        for call in (o.step, s.step, s.finish, s.swap_in_average):
            try:
                call()
            except hdet.SwappedInError as e:
                refused.append(str(e).split(" while ")[0])
        if mesh_shape is None:  # a forward in training mode inside (BatchNorm counts a batch and moves its stats)
            with torch.no_grad():
                model(batch(rank, 99)[0])
    after = flat()
    out = {"changed": changed, "inside_is_mean": torch.allclose(inside.double(), mean, rtol=1e-6, atol=1e-7),
           "apart": not all(torch.equal(every[0], e) for e in every[1:]),
           "restored": torch.equal(torch.nan_to_num(after, 7.0), torch.nan_to_num(own, 7.0)),
           "refused": refused, "swapped_after": s.average_swapped_in,
           "counts_restored": all(torch.equal(b, c) for b, c in zip(
               [b for name, b in model.named_buffers() if name.endswith("num_batches_tracked")], counts))}
    if nan_rank is not None:
        return out
    train_steps(model, o, s, rank, range(8, 11))  # 10: a converge step
    calls = []
    gather, average = s.ensemble.replicas.gather, s.ensemble.replicas.average_
    s.ensemble.replicas.gather = lambda *a, **k: calls.append("gather") or gather(*a, **k)
    s.ensemble.replicas.average_ = lambda *a, **k: calls.append("average") or average(*a, **k)
    at_sync = flat()
    with s.averaged() as out["changed_at_sync"]:
        out["equal_at_sync"] = torch.equal(flat(), at_sync)
    out["calls_at_sync"] = list(calls)
    if mesh_shape is None:  # a training forward since the converge step (a gradient accumulation's micro-batch
        with model.no_sync():  # before a validation): each rank's BatchNorm statistics moved on their own
            nn.functional.mse_loss(*(lambda x, y: (model(x), y))(*batch(rank, 12))).backward()
        own = flat()
        every = [torch.empty_like(own) for _ in range(dist.get_world_size(group))]
        dist.all_gather(every, own, group=group)
        with s.averaged():
            out["mean_after_a_forward"] = torch.allclose(flat().double(), sum(e.double() for e in every) / len(every),
                                                         rtol=1e-6, atol=1e-7)
            out["apart_after_a_forward"] = not all(torch.equal(every[0], e) for e in every[1:])
        out["restored_after_a_forward"] = torch.equal(flat(), own)
        o.zero_grad()
    calls.clear()
    x, y = batch(rank, 11)
    o.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    o.step()  # (no s.step(): the replicas moved apart since the converge step)
    with s.averaged() as out["changed_after_a_step"]:
        pass
    out["calls"] = calls
    return out


def fused_sgd_first_step_skipped(rank, world, *, steps=8, T=4):
    """Fused SGD with momentum under the skip guard, rank 1's loss NaN at step 1 (the first step skipped everywhere),
    against the same run with no fault in which step 1 is simply not taken (``optimizer.step()`` not called)."""
    import warnings

    def run(skip_by_guard):
        model = make_model(0)
        ddp = DDP(model, broadcast_buffers=False)
        o = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9, fused=True)
        s = hdet.OneCycleAutoLR(o, max_lr=0.05, total_steps=steps, ensemble_lr_spread_ratio=0.2,
                                model_sync_interval=T, model=ddp, guard_gradients="skip-all" if skip_by_guard else False)
        for t in range(1, steps + 1):
            x, y = batch(rank, t)
            loss = nn.functional.mse_loss(ddp(x), y)
            if t == 1 and rank == 1 and skip_by_guard:
                loss = loss * float("nan")
            o.zero_grad()
            loss.backward()
            if t > 1 or skip_by_guard:
                o.step()
            s.step(loss if t > 1 else None)
        return [p.detach().clone() for p in model.parameters()], (float(s.skip_guard.skipped) if skip_by_guard else 0.0)

    empty_like = torch.empty_like  # uninitialised memory, made to hold garbage every time (the test must not pass
    torch.empty_like = lambda x, *a, **k: empty_like(x, *a, **k).fill_(3e30)  # by a lucky zero page)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            guarded, skipped = run(True)
            taken_out, _ = run(False)
    finally:
        torch.empty_like = empty_like
    return {"skipped": skipped, "equal": all(torch.equal(a, b) for a, b in zip(guarded, taken_out)),
            "max_abs": max(float(p.abs().max()) for p in guarded)}


def lightning_callback_two_schedulers(rank, world):
    """HDETCallback's validation and checkpoint hooks (called as Lightning calls them) with two HDET schedulers over one
    DDP module with BatchNorm (two optimizers, each its own part of the weights): each scheduler keeps the module's
    buffers aside, so they must be put back in reverse order."""
    from types import SimpleNamespace

    from hdet.integrations.lightning import HDETCallback

    model = make_model(0)
    ddp = DDP(model, broadcast_buffers=False)
    params = list(model.parameters())
    opts = [torch.optim.AdamW(params[:2], lr=0.01), torch.optim.AdamW(params[2:], lr=0.01)]
    scheds = [hdet.OneCycleAutoLR(o, max_lr=0.02, total_steps=20, ensemble_lr_spread_ratio=0.3, model_sync_interval=5,
                                  model=ddp) for o in opts]
    for t in range(1, 8):
        x, y = batch(rank, t)
        loss = nn.functional.mse_loss(ddp(x), y)
        for o in opts:
            o.zero_grad()
        loss.backward()
        for o, s in zip(opts, scheds):
            o.step()
            s.step(loss)
    trainer = SimpleNamespace(lr_scheduler_configs=[SimpleNamespace(scheduler=s) for s in scheds],
                              sanity_checking=False, state=SimpleNamespace(fn="fit"))

    def flat():
        return torch.cat([t.detach().reshape(-1) for t in [*model.parameters(), *float_buffers(model)]]).clone()

    own = flat()
    every = [torch.empty_like(own) for _ in range(world)]
    dist.all_gather(every, own)
    mean = torch.stack(every).double().mean(0)
    cb = HDETCallback()
    cb.on_validation_start(trainer, model)
    inside = flat()
    cb.on_validation_end(trainer, model)
    after_validation = flat()
    ckpt = {"state_dict": {k: v for k, v in model.state_dict().items()}}
    cb.on_save_checkpoint(trainer, model, ckpt)
    names = [k for k, _ in model.named_parameters()] + [k for k, b in model.named_buffers() if b.is_floating_point()]
    saved = torch.cat([ckpt["state_dict"][k].reshape(-1) for k in names])  # (flat()'s order)
    return {"inside": torch.allclose(inside.double(), mean, rtol=1e-6, atol=1e-7),
            "saved": torch.allclose(saved.double(), mean, rtol=1e-6, atol=1e-7),
            "restored": torch.equal(after_validation, own) and torch.equal(flat(), own),
            "apart": not torch.equal(every[0], every[1])}


def hsdp_after_an_evaluation(rank, world, *, case="averaged"):
    """FSDP2 on a (2, 2) mesh (the root one FSDP group: it stays unsharded after a forward under no_grad), 7 steps of
    20 (T = 5), then this replica's evaluation under no_grad, then: ``averaged`` - an evaluation inside
    ``s.averaged()`` and training on to step 20 (with the same run without the evaluations beside it); ``finish`` -
    ``s.finish()`` and an evaluation; ``warm_init`` - ``hdet.warm_init_(model)`` (before any step). Each evaluation is
    compared with a plain forward of the full weights it should use."""
    from torch.distributed.device_mesh import init_device_mesh
    from helpers import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))
        fully_shard(model, mesh=mesh)
        o = torch.optim.AdamW(model.parameters(), lr=0.01)
        s = hdet.OneCycleAutoLR(o, max_lr=0.02, total_steps=20, ensemble_lr_spread_ratio=0.3, model_sync_interval=5,
                                model=model, device_mesh=mesh, guard_gradients=False)
        return model, o, s

    def full(model):  # this replica's whole weights (a collective over its shard ranks), from the sharded DTensors
        # the optimizer holds (model.parameters() are the root's unsharded copies while they are in)
        return torch.cat([p.full_tensor().detach().reshape(-1) for g in opt_of[model].param_groups for p in g["params"]])

    def plain(flat, x):  # the forward of those weights without FSDP
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))
        torch.nn.utils.vector_to_parameters(flat, m.parameters())
        with torch.no_grad():
            return m(x)

    x = batch(0, 999)[0]
    opt_of = {}
    model, o, s = build()
    opt_of[model] = o

    def evaluate():
        with torch.no_grad():
            return model(x)

    out = {}
    if case == "warm_init":
        evaluate()
        before = full(model)
        hdet.warm_init_(model, nu=0.05, seed=3)
        out["moved"] = float((full(model) - before).abs().max())
        out["eval_err"] = float((evaluate() - plain(full(model), x)).abs().max())
        return out
    train_steps(model, o, s, rank, range(1, 8))
    own = full(model)
    out["own_err"] = float((evaluate() - plain(own, x)).abs().max())
    if case == "finish":
        s.finish()
        avg = full(model)
        out["apart"] = float((avg - own).abs().max())
        out["eval_err"] = float((evaluate() - plain(avg, x)).abs().max())
        return out
    with s.averaged():
        avg = full(model)
        out["eval_err"] = float((evaluate() - plain(avg, x)).abs().max())
    out["apart"] = float((avg - own).abs().max())
    xt, yt = batch(rank, 8)
    out["loss8_err"] = float((nn.functional.mse_loss(model(xt), yt).detach()
                              - nn.functional.mse_loss(plain(own, xt), yt)).abs())
    o.zero_grad()  # (the forward above made no graph to step from: train from step 8 as usual)
    train_steps(model, o, s, rank, range(8, 21))
    with_eval = full(model)
    model, o, s = build()
    opt_of[model] = o
    train_steps(model, o, s, rank, range(1, 21))
    out["final_diff"] = float((with_eval - full(model)).abs().max())
    return out


def sharded_without_its_mesh(rank, world, *, how="none"):
    """FSDP2-sharded parameters with a scheduler that is not given the 2-D mesh: ``none`` (plain FSDP2 over every
    rank, no device_mesh), ``hsdp-none`` (HSDP on (2, 2), no device_mesh), ``hsdp-replicate`` (device_mesh=
    mesh["replicate"]), ``hsdp-group`` (process_group= the replicate group). The error, or None."""
    from torch.distributed.device_mesh import init_device_mesh
    from helpers import fully_shard

    if how == "none":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    else:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))
    fully_shard(model, mesh=mesh)
    o = torch.optim.AdamW(model.parameters(), lr=0.01)
    extra = {"hsdp-replicate": {"device_mesh": mesh["replicate"] if how == "hsdp-replicate" else None},
             "hsdp-group": {"process_group": mesh.get_group("replicate") if how == "hsdp-group" else None},
             "hsdp-nomodel": {"device_mesh": mesh if how == "hsdp-nomodel" else None}}.get(how, {})
    import warnings

    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            s = hdet.OneCycleAutoLR(o, max_lr=0.02, total_steps=10, ensemble_lr_spread_ratio=0.3, model_sync_interval=5,
                                    model=None if how == "hsdp-nomodel" else model, **extra)
    except ValueError as e:
        return str(e)
    if how != "hsdp-nomodel":
        return None
    try:  # (without the model hdet cannot reshard it: an evaluation of the average would see the replica's own)
        s.swap_in_average()
    except ValueError as e:
        return {"warned": [str(w.message) for w in said if "without model=" in str(w.message)], "error": str(e)}
    return {"warned": [], "error": None}


def failed_construction(rank, world):
    """A scheduler whose construction fails (its base gives a NaN LR at step 0, which LRScheduler.__init__ meets) on a DDP model, then a good one on the
    same model and optimizer: the guard and the LRs are the good one's. The first left DDP's one comm hook behind
    (the second then raised "can only be called once") and the groups' ``initial_lr``."""
    model = DDP(make_model())
    o = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    try:
        hdet.HDETLR(o, lambda t: float("nan") if t == 0 else 0.1, total_steps=10, model=model, ensemble_lr_spread_ratio=0.3)
    except ValueError as e:
        first = str(e)
    groups_after_failure = [{k: v for k, v in g.items() if k != "params"} for g in o.param_groups]
    try:  # the guard's install fails (a "skip" guard needs a fused optimizer), after LRScheduler's init set this
        # replica's LR: the groups as they were (a retry read this rank's base * rho_r as its base; a review)
        hdet.HDETLR(o, None, total_steps=10, model=model, ensemble_lr_spread_ratio=0.3, guard_gradients="skip")
    except ValueError as e:
        second = str(e)
    groups_after_failure += [{k: v for k, v in g.items() if k != "params"} for g in o.param_groups]
    s = hdet.HDETLR(o, None, total_steps=10, model=model, ensemble_lr_spread_ratio=0.3, model_sync_interval=5)
    train_steps(model, o, s, rank, range(10))
    return {"first": first, "second": second, "groups": groups_after_failure, "guard": s.gradient_guard,
            "lr": s.get_last_lr(), "finite": all(bool(p.isfinite().all()) for p in model.parameters())}


def prodigy_local_skip(rank, world, *, skip=True, steps=12, T=5):
    """Prodigy in local mode (DDP no_sync every step) under a GradScaler, alpha 0.5: at step 3 rank 0's gradient
    overflows, so its scaler skips its optimizer step while rank 1 steps. Prodigy's estimate is shared at every
    scheduler step: one all_gather a step on every rank (from the optimizer's post-hook, rank 0's skipped step made
    none, its later gathers paired with rank 1's of the step before, then the converge step's met a Prodigy gather:
    gloo aborted). Returns d per step and this rank's weights at the end."""
    import prodigyopt

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    ddp = DDP(model)
    o = prodigyopt.Prodigy(ddp.parameters(), lr=1.0)
    s = hdet.HDETLR(o, None, total_steps=steps, ensemble_lr_spread_ratio=0.5, model_sync_interval=T, model=ddp)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    ds, ks = [], []
    for t in range(1, steps + 1):
        x, y = batch(rank, t)
        with ddp.no_sync():
            loss = nn.functional.mse_loss(ddp(x), y)
            o.zero_grad()
            scaler.scale(loss).backward()
        if skip and rank == 0 and t == 3:
            model[0].bias.grad[0] = float("inf")  # an overflow on this replica only
        scaler.step(o)
        scaler.update()
        s.step(loss)
        ds.append(float(o.param_groups[0]["d"]))
        ks.append(int(o.param_groups[0]["k"]))
    return {"d": ds, "k": ks, "w": torch.cat([p.detach().reshape(-1) for p in model.parameters()])}


def aliased_parameter(rank, world, *, cap_mb=0.5, nan=False):
    """Two Parameters over one memory (``out.weight = nn.Parameter(emb.weight)``, a tied head torch takes without a
    word), 1 MiB, above ``bucket_cap_mb``: rank r holds r + 1 (the last one NaN with ``nan``). Its converge step
    averaged it twice in place, a wrong mean (1.89 or 1.56 for 2.0; 1.25 for 1.5: a review); it is averaged once now."""
    torch.manual_seed(0)
    emb = nn.Embedding(1024, 256)
    out = nn.Linear(256, 1024, bias=False)
    out.weight = nn.Parameter(emb.weight)
    model = nn.ModuleList([emb, out])
    o = torch.optim.SGD(model.parameters(), lr=0.0)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = hdet.OneCycleAutoLR(o, max_lr=1e-9, total_steps=4, model_sync_interval=1, model=model, seed=1,
                                bucket_cap_mb=cap_mb)
        with torch.no_grad():
            emb.weight.fill_(float(rank + 1))
            if nan and rank == world - 1:
                emb.weight[5, 5] = float("nan")
        o.step()
        s.step(1.0)
    return [emb.weight[0, 0].item(), emb.weight[5, 5].item()]


def fp16_scaled_backward(model, opt, scaler, rank, t, overflow=False):
    """The GradScaler workers' step ``t`` up to the backward: this rank's batch (x1e5 where ``overflow``: fp16 overflows
    in its backward), the loss under fp16 autocast, the scaled backward. Returns the loss."""
    g = torch.Generator().manual_seed(1000 * t + rank)
    x = torch.randn(16, 8, generator=g)
    y = x[:, :1] * 2 - x[:, 1:2]
    if overflow:
        x = x * 1e5
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    return loss


def local_scaler_first_steps(rank, world, *, overflow_steps=5, T=4, steps=8):
    """Local mode (no_sync every step), the "hook" guard (non-fused AdamW), a GradScaler under fp16 autocast: rank 1
    overflows at steps 1..overflow_steps, so its first step taken comes after the converge step at T. The guard's
    one-time agreement at each rank's first step taken paired the ranks' different steps: rank 0 waited there while
    rank 1 waited in the converge step (a hang; an audit). Returns the guard, each step's scale and whether the
    ranks' weights are equal at the end."""
    import warnings

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    model = DDP(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    sched = hdet.OneCycleAutoLR(opt, max_lr=1e-2, total_steps=steps, model_sync_interval=T, model=model,
                                ensemble_lr_spread_ratio=0.2)
    scales = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for t in range(1, steps + 1):
            with model.no_sync():
                loss = fp16_scaled_backward(model, opt, scaler, rank, t, overflow=rank == 1 and t <= overflow_steps)
            scaler.step(opt)
            scaler.update()
            sched.step(loss.detach())
            scales.append(scaler.get_scale())
    flat = gather_flat(net.parameters())  # (every rank's weights)
    return {"guard": sched.gradient_guard, "scales": scales, "equal": all(torch.equal(flat[0], f) for f in flat[1:])}


def local_reset_scales(rank, world, *, T=2, steps=6, nan_at=3):
    """Local mode (no_sync every step), the "hook" guard, a GradScaler whose scale doubles at every step taken
    (growth_interval 1): at step ``nan_at`` rank 1's weights turn NaN (its steps are skipped, its scale halves each time),
    and the converge step at 2T resets it. Returns each step's scale and the last sync's reset replicas."""
    import warnings

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    model = DDP(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1)
    sched = hdet.OneCycleAutoLR(opt, max_lr=1e-3, total_steps=steps, model_sync_interval=T, model=model,
                                ensemble_lr_spread_ratio=0.2)
    scales, recovered = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for t in range(1, steps + 1):
            if t == nan_at and rank == 1:
                with torch.no_grad():
                    net[0].weight[0, 0] = float("nan")
            with model.no_sync():
                loss = fp16_scaled_backward(model, opt, scaler, rank, t)
            scaler.step(opt)
            scaler.update()
            sched.step(loss.detach())
            scales.append(scaler.get_scale())
            if sched.last_sync is not None and sched.last_sync.step == t:
                recovered.append((t, list(sched.last_sync.recovered)))
    return {"guard": sched.gradient_guard, "scales": scales, "recovered": recovered,
            "finite": bool(all(torch.isfinite(p).all() for p in net.parameters()))}


def spectral_norms(net) -> list[float]:
    """The spectral norm of layers 0 and 2's weights as their eval-mode forward computes it (from the stored u, v)."""
    net.eval()
    with torch.no_grad():
        net(torch.zeros(1, 6))  # (the hook form sets .weight in its forward)
        out = [float(torch.linalg.matrix_norm(net[i].weight, ord=2)) for i in (0, 2)]
    net.train()
    return out


def spectral_average(rank, world, *, form="parametrization", two=False):
    """DDP with spectral_norm layers (``form``: torch.nn.utils.parametrizations' or the older hook), alpha 0.5, T = 10:
    each layer's spectral norm as its eval-mode forward computes it (from u, v) after the converge step at 10 and inside
    ``averaged()`` at 15, and whether this rank's own state came back after it. ``two``: each layer its own optimizer
    and scheduler (both with ``model=``; the second layer's converge steps every 7 steps), the swap inside both."""
    from torch.nn.utils.parametrizations import spectral_norm

    torch.manual_seed(0)
    sn = spectral_norm if form == "parametrization" else nn.utils.spectral_norm
    net = nn.Sequential(sn(nn.Linear(6, 16)), nn.Tanh(), sn(nn.Linear(16, 1)))
    model = DDP(net)
    opts = [torch.optim.Adam(net[0].parameters(), lr=0.05), torch.optim.Adam(net[2].parameters(), lr=0.05)] if two \
        else [torch.optim.Adam(model.parameters(), lr=0.05)]
    scheds = [hdet.OneCycleAutoLR(o, max_lr=0.05, total_steps=20, ensemble_lr_spread_ratio=0.5,
                                  model_sync_interval=10 if k == 0 else 7, model=model) for k, o in enumerate(opts)]

    g = torch.Generator().manual_seed(rank)
    out = {}
    for t in range(1, 16):
        x = torch.randn(32, 6, generator=g)
        loss = nn.functional.mse_loss(model(x), (3 * x[:, :1]).sin() * (1 + rank))
        for o in opts:
            o.zero_grad()
        loss.backward()
        for o in opts:
            o.step()
        for s in scheds:
            s.step(loss)
        if t == 10:
            out["after_sync"] = spectral_norms(net)
    own = {k: v.clone() for k, v in net.state_dict().items()}
    with contextlib.ExitStack() as swaps:
        out["changed"] = all(swaps.enter_context(s.averaged()) for s in scheds)
        out["inside"] = spectral_norms(net)
    out["restored"] = all(torch.equal(v, own[k]) for k, v in net.state_dict().items())
    return out


def two_optimizers_one_scaler(rank, world, *, use_hdet=True, guard_first=True, steps=5, clip=False):
    """One DDP model, two non-fused AdamW (body, head), one torch.amp.GradScaler (fp16 autocast, torch's
    multi-optimizer AMP recipe); with ``use_hdet`` an HDETLR at alpha 0 over the body's optimizer (its "hook" guard on
    the model). Rank 1's first backward overflows: the scaler must skip both optimizers' step 1, as plain DDP does.
    ``guard_first``: the body's optimizer (the guard's) is stepped first; ``clip``: torch's recipe with clipping (both
    unscaled, the gradients clipped, then both stepped). Returns the weights, Adam's step counts and hdet's
    warnings."""
    import warnings

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    ddp = DDP(m)
    opts = [torch.optim.AdamW(m[0].parameters(), lr=1e-2), torch.optim.AdamW(m[2].parameters(), lr=1e-2)]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    sched = hdet.HDETLR(opts[0], None, steps, ensemble_lr_spread_ratio=0.0, model_sync_interval=3,
                        model=ddp) if use_hdet else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in range(1, steps + 1):
            g = torch.Generator().manual_seed(100 * rank + t)
            x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(ddp(x).float(), y)
            if t == 1 and rank == 1:
                loss = loss * 1e30  # an overflow on one replica
            for o in opts:
                o.zero_grad()
            scaler.scale(loss).backward()
            if clip:
                for o in opts:
                    scaler.unscale_(o)
                nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            for o in (opts if guard_first else opts[::-1]):
                scaler.step(o)
            scaler.update()
            if sched is not None:
                sched.step(loss.detach())
    counts = [float(next(iter(o.state.values()))["step"]) for o in opts]
    assert all(torch.isfinite(p).all() for p in m.parameters())
    return {"params": [p.detach().clone() for p in m.parameters()], "counts": counts,
            "said": [str(w.message) for w in caught if str(w.message).startswith("hdet: another optimizer")]}


def joined(rank, world, *, throw=True, batches=(6, 6), T=4, evaluate=False):
    """The loop inside torch's ``model.join()`` (uneven inputs), ``batches[rank]`` steps on this rank, of 100, then
    ``sched.finish()``: the error inside (if any) and the weights after, with the same run's weights without join()
    (even batches). ``evaluate``: the loop outside join(), with an evaluation inside ``model.join()`` (without
    throw_on_early_termination) after step 3: whether the replicas still differ after it."""
    def run(use_join):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
        model = DDP(net)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        sched = hdet.OneCycleAutoLR(opt, max_lr=0.05, total_steps=100, ensemble_lr_spread_ratio=0.3,
                                    model_sync_interval=T, model=model)
        error = None
        try:
            with model.join(throw_on_early_termination=throw) if use_join else contextlib.nullcontext():
                for t in range(1, batches[rank] + 1):
                    train_steps(model, opt, sched, rank, range(t, t + 1))
                    if evaluate and t == 3:
                        with model.join(), torch.no_grad():
                            model(batch(rank, t)[0])
                        mine = gather_flat([p.detach() for p in net.parameters()])
                        out["apart_after_eval"] = not torch.equal(mine[0], mine[1])
        except (RuntimeError, ValueError) as e:
            error = f"{type(e).__name__}: {e}"
        if error is None or "exhausted" in error:
            sched.finish()
        return error, gather_flat([p.detach() for p in net.parameters()]), sched.last_epoch
    out = {}
    error, weights, steps = run(not evaluate)
    out.update({"error": error, "weights": weights, "steps": steps})
    if len(set(batches)) == 1 and throw:
        out["without_join"] = run(False)[1]
    return out


def two_models_one_scaler(rank, world, *, use_hdet=True):
    """Two DDP models (A with an HDETLR and its "hook" guard, B with its own plain AdamW), one GradScaler, torch's
    recipe with clipping (both unscaled and clipped, then stepped). Rank 1's first backward overflows in A only: plain
    DDP skips A's step 1 and steps B. Adam's step counts after 3 steps and B's weights."""
    torch.manual_seed(0)
    a, b = nn.Linear(6, 4), nn.Linear(6, 4)
    A, B = DDP(a), DDP(b)
    oa, ob = torch.optim.AdamW(a.parameters(), lr=1e-2), torch.optim.AdamW(b.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    sched = hdet.HDETLR(oa, None, 3, ensemble_lr_spread_ratio=0.0, model_sync_interval=3, model=A) if use_hdet else None
    for t in range(1, 4):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(100 * rank + t))
        with torch.autocast("cpu", dtype=torch.float16):
            ya, yb = A(x), B(x)
        if t == 1 and rank == 1:
            ya.register_hook(lambda gr: gr * float("inf"))
        loss = ya.float().pow(2).mean() + yb.float().pow(2).mean()
        oa.zero_grad()
        ob.zero_grad()
        scaler.scale(loss).backward()
        scaler.unscale_(oa)
        scaler.unscale_(ob)
        nn.utils.clip_grad_norm_(a.parameters(), 1.0)
        nn.utils.clip_grad_norm_(b.parameters(), 1.0)
        scaler.step(oa)
        scaler.step(ob)
        scaler.update()
        if sched is not None:
            sched.step(loss.detach())
    counts = [float(next(iter(o.state.values()))["step"]) for o in (oa, ob)]
    return {"counts": counts, "B": b.weight.detach().clone()}


def ema_average(rank, world, *, register="every", T=4, steps=10, alpha=0.5, evaluate=True, register_at=0,
                collapse_at=None, judge_steps=None):
    """The README's DDP loop with an EMA of the weights (``torch.optim.swa_utils.AveragedModel``, buffers too) updated
    after every step; as references, an EMA updated from the ensemble's average (inside ``averaged()``, with
    ``evaluate``) and each rank's own EMA never averaged (``shadow``: by linearity the ranks' mean is the ensemble's
    EMA). ``register``: which ranks call ``sched.also_average(ema)`` ("every", "none", "rank0"), before the first step
    or after step ``register_at``; ``collapse_at``: every rank's weights NaN after that step (``on_runaway="recover"`` goes back to its best sync,
    or, with the default ``judge_steps`` (longer than T), to the start it kept after step 1)."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    net = make_model(0)
    model = DDP(net)
    o = torch.optim.AdamW(model.parameters(), lr=3e-2)
    s = hdet.OneCycleAutoLR(o, max_lr=3e-2, total_steps=steps, ensemble_lr_spread_ratio=alpha, model_sync_interval=T,
                            model=model, **({"on_runaway": "recover"} if collapse_at else {}),
                            **({"judge_steps": judge_steps} if judge_steps else {}))
    ema, ref, shadow = (AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.8), use_buffers=True) for _ in range(3))
    state = lambda m: [t.detach().clone() for t in [*m.parameters(), *m.buffers()] if t.is_floating_point()]  # noqa: E731
    mean = lambda ts: [g.reshape(t.shape) for g, t in zip(torch.stack(gather_flat(ts)).mean(0).split(  # noqa: E731
        [t.numel() for t in ts]), ts)]
    out = {"went_back": []}
    registers = register == "every" or (register == "rank0" and rank == 0)
    if registers and not register_at:
        assert s.also_average(ema) is s
    for t in range(steps):
        train_steps(model, o, s, rank, range(t, t + 1))
        if t + 1 == collapse_at:
            with torch.no_grad():
                net[0].weight.fill_(float("nan"))
        ema.update_parameters(net)
        shadow.update_parameters(net)
        if s.last_sync is not None and s.last_sync.step == t + 1:
            out["went_back"].append(s.last_sync.went_back_to)
        if registers and register_at and t + 1 == register_at:  # (after its step and its EMA's update)
            s.also_average(ema)
        if not evaluate:
            continue
        with s.averaged():
            ref.update_parameters(net)
            if t + 1 in (6, register_at):  # mid-window, and right after a late registration
                out[f"in{t + 1}"] = state(ema)
                out[f"in{t + 1}_shadow"] = mean(state(shadow)) if not collapse_at else None
        if t + 1 == 6:
            out["mid_ref"] = state(ref)
            out["mid_after"] = state(ema)  # (left averaged)
    out["end"], out["end_shadow"] = state(ema), (mean(state(shadow)) if not collapse_at else None)
    out["end_ref"] = state(ref) if evaluate else None
    out["ranks_end"] = [x.tolist() for x in gather_flat(out["end"])]
    out["n_averaged"] = int(ema.n_averaged)
    out["finite"] = all(bool(torch.isfinite(x).all()) for x in out["end"])
    return out


def swa_after_hdet(rank, world, *, base=True):
    """The README's SWA phase after HDET: ``sched.finish()`` at step 12 of 20, then ``sched.close()`` (``base``: each
    group's LR at the base on every rank), then ``SWALR`` and an ``AveragedModel`` for the last 8 steps. Returns every
    rank's SWA weights."""
    net = make_model(0)
    model = DDP(net)
    o = torch.optim.AdamW(model.parameters(), lr=3e-2)
    s = hdet.OneCycleAutoLR(o, max_lr=3e-2, total_steps=20, ensemble_lr_spread_ratio=0.5, model_sync_interval=5,
                            model=model)
    train_steps(model, o, s, rank, range(12))
    s.finish()
    if base:
        s.close()
    swa = torch.optim.swa_utils.AveragedModel(net)
    swa_sched = torch.optim.swa_utils.SWALR(o, swa_lr=1e-3, anneal_epochs=5)
    for t in range(12, 20):
        x, y = batch(rank, t)
        loss = nn.functional.mse_loss(model(x), y)
        o.zero_grad()
        loss.backward()
        o.step()
        swa.update_parameters(net)
        swa_sched.step()
    return [x.tolist() for x in gather_flat(list(swa.parameters()))]


def after_hdet(rank, world, *, case="join"):
    """Plain training on the same DDP model after an HDET run of 10 steps (T 5, a non-fused AdamW: the "hook" guard;
    ``case="gc"``: a fused one, left at step 7 and dropped). Returns what each case checks."""
    import gc
    import warnings
    import weakref

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))
    ddp = DDP(net)
    fused = case == "gc"
    o = torch.optim.AdamW(ddp.parameters(), lr=1e-2, fused=fused or None)
    s = hdet.OneCycleAutoLR(o, max_lr=1e-2, total_steps=10, ensemble_lr_spread_ratio=0.5, model_sync_interval=5,
                            model=ddp)
    train_steps(ddp, o, s, rank, range(7 if fused or case == "dropped" else 10))
    out = {"closed": s.closed, "guard": s.gradient_guard}
    if case == "gc":
        ref = weakref.ref(s)
        del s
        gc.collect()
        out["collected"] = ref() is None
        out["hooks"] = [len(o._optimizer_step_pre_hooks), len(o._optimizer_step_post_hooks),
                        len(ddp._forward_pre_hooks)]
        return out
    if case == "join":  # uneven inputs: rank 0 runs out first; torch copies the last joiner's model to every rank
        plain = torch.optim.SGD(ddp.parameters(), lr=0.1)
        with ddp.join():
            for t in range(3 + 3 * rank):
                x, y = batch(rank, 100 + t)
                plain.zero_grad()
                nn.functional.mse_loss(ddp(x), y).backward()
                plain.step()
        out["ranks"] = [x.tolist() for x in gather_flat(list(net.parameters()))]
        o2 = torch.optim.AdamW(ddp.parameters(), lr=1e-3)  # the next scheduler on the model is not refused for
        s2 = hdet.OneCycleAutoLR(o2, max_lr=1e-3, total_steps=4, model=ddp)  # that plain join (a review)
        train_steps(ddp, o2, s2, rank, range(30, 34))
    elif case == "scaler":  # a fine-tune under a GradScaler: rank 1's loss overflows at step 3
        plain = torch.optim.SGD(ddp.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        out["stepped"] = []
        for t in range(6):
            x, y = batch(rank, 100 + t)
            loss = nn.functional.mse_loss(ddp(x), y) * (float("inf") if t == 3 and rank == 1 else 1.0)
            plain.zero_grad()
            scaler.scale(loss).backward()
            before = net[0].weight.detach().clone()
            scaler.step(plain)
            scaler.update()
            out["stepped"].append(not torch.equal(before, net[0].weight))
        out["scale"] = float(scaler.get_scale())
    elif case == "dropped":  # a trial left early (finish(), no close()); the next one built while it is still
        # referenced gets no guard, then takes the hook over at its first step, once the last one is dropped
        s.finish()
        o2 = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            s = hdet.OneCycleAutoLR(o2, max_lr=1e-3, total_steps=6, ensemble_lr_spread_ratio=0.2,
                                    model_sync_interval=3, model=ddp)  # (the last one dropped here)
        out["guard_built"], out["said"] = s.gradient_guard, [str(w.message)[:60] for w in said]
        for t in range(40, 46):
            x, y = batch(rank, t)
            loss = nn.functional.mse_loss(ddp(x), y) * (float("nan") if t == 40 and rank == 1 else 1.0)
            o2.zero_grad()
            loss.backward()
            o2.step()
            s.step(loss)
        out["guard2"] = s.gradient_guard
        out["finite"] = all(bool(torch.isfinite(p).all()) for p in net.parameters())
    elif case == "trial2":  # the next trial of a search on the same DDP model
        o2 = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            s2 = hdet.OneCycleAutoLR(o2, max_lr=1e-3, total_steps=6, ensemble_lr_spread_ratio=0.2,
                                     model_sync_interval=3, model=ddp)
            train_steps(ddp, o2, s2, rank, range(20, 26))
        out["guard2"] = s2.gradient_guard
        out["said"] = [str(w.message) for w in said if "hdet" in str(w.message)]
    return out


def hsdp_ema(rank, world):
    """HSDP (2, 2) mesh with BatchNorm and an EMA of the weights and buffers (a copy made before sharding, sharded on
    the same mesh: AveragedModel cannot deepcopy an FSDP2 module; decay 0.8, updated by hand on the local shards)
    registered with also_average, and each rank's own EMA never averaged. Returns every rank's EMA buffers and the
    mean of the own ones."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from helpers import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
    ema, own = copy.deepcopy(model), copy.deepcopy(model)
    for m in (model, ema, own):
        fully_shard(m, mesh=mesh)
    o = torch.optim.Adam(model.parameters(), lr=0.01)
    s = hdet.OneCycleAutoLR(o, max_lr=0.02, total_steps=8, ensemble_lr_spread_ratio=0.3, model_sync_interval=4,
                            model=model, seed=3, device_mesh=mesh)
    s.also_average(ema)
    local = lambda m: [t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
                       for t in [*m.parameters(), *[b for b in m.buffers() if b.is_floating_point()]]]
    for t in range(1, 9):
        train_steps(model, o, s, rank, range(t, t + 1))
        with torch.no_grad():
            for e in (ema, own):
                for a, b in zip(local(e), local(model)):
                    a.lerp_(b, 0.2)
    bufs = lambda m: torch.cat([b.reshape(-1) for b in m.buffers() if b.is_floating_point()])  # noqa: E731
    return {"ema": [x.tolist() for x in gather_flat([bufs(ema)])],
            "own_mean": torch.stack(gather_flat([bufs(own)])).mean(0).tolist()}


def warm_init_order(rank, world, order):
    """warm_init_ before DDP(...) (its broadcast copies rank 0's noise to every rank), after DDP and the scheduler (the
    README's order), or before DDP built with init_sync=False (no broadcast): what the scheduler says, and whether the
    replicas start apart. A second scheduler on the same DDP model after training says nothing."""
    import warnings

    torch.manual_seed(0)
    net = nn.Linear(4, 3)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    if order in ("before", "before-no-sync"):
        hdet.warm_init_(net)
    ddp = DDP(net, **({"init_sync": False} if order == "before-no-sync" else {}))  # (init_sync: torch >= 2.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sched = hdet.HDETLR(opt, None, total_steps=4, model=ddp, model_sync_interval=2)
    if order == "after":
        hdet.warm_init_(ddp.module)
    said = [str(w.message) for w in caught if "warm_init_" in str(w.message)]
    w = net.weight.detach().clone()
    others = [torch.zeros_like(w) for _ in range(world)]
    dist.all_gather(others, w)
    apart = any(not torch.equal(others[0], o) for o in others[1:])
    for _ in range(4):
        opt.zero_grad()
        ddp(torch.randn(8, 4)).square().mean().backward()
        opt.step()
        sched.step(1.0)
    with warnings.catch_warnings(record=True) as later:
        warnings.simplefilter("always")
        hdet.HDETLR(opt, None, total_steps=4, model=ddp, model_sync_interval=2)
        ddp2 = DDP(net)  # (a second stage: a new DDP over the trained module, as unfreezing needs)
        hdet.HDETLR(torch.optim.SGD(net.parameters(), lr=0.1), None, total_steps=4, model=ddp2, model_sync_interval=2)
    return {"said": said, "apart": apart, "later": [str(w.message) for w in later if "warm_init_" in str(w.message)]}


def asgd_own_eta(rank, world):
    """ASGD under a spread with average_optimizer_state=True, T = 5: each rank's eta (the step size of its next step,
    from its own LR) and the averaged ax right after the converge step at step 5, and the LR each rank set there."""
    torch.manual_seed(0)
    net = nn.Linear(4, 3)
    ddp = DDP(net)
    opt = torch.optim.ASGD(net.parameters(), lr=0.05, lambd=0.1, t0=0)
    sched = hdet.HDETLR(opt, None, total_steps=8, model=ddp, model_sync_interval=5, ensemble_lr_spread_ratio=0.5,
                        average_optimizer_state=True)
    g = torch.Generator().manual_seed(1)
    for step in range(1, 6):
        opt.zero_grad()
        ddp(torch.randn(8, 4, generator=g)).square().mean().backward()
        opt.step()
        sched.step(1.0)
    state = opt.state[net.weight]
    return {"eta": float(state["eta"]), "ax": state["ax"].clone(), "lr_used": sched.last_sync.values[0]
            if hasattr(sched, "last_sync") and sched.last_sync is not None else None}


class _BufferDropout(nn.Module):
    """docs/explore.md's dropout whose p is a buffer (one compiled graph for every value)."""

    def __init__(self, p):
        super().__init__()
        self.register_buffer("p", torch.tensor(p))

    def forward(self, x):
        return x * (torch.rand_like(x) >= self.p) / (1 - self.p) if self.training else x


def buffer_value_under_ddp(rank, world, broadcast_buffers, vmap_safe=True):
    """An explored value kept in a buffer (Setter(..., vmap_safe=True)), under DDP with or without
    broadcast_buffers: what the scheduler says after the first step, and the value the forward saw."""
    import warnings

    torch.manual_seed(0)
    drop = _BufferDropout(0.1)
    net = nn.Sequential(nn.Linear(4, 8), drop, nn.Linear(8, 1))
    ddp = DDP(net, broadcast_buffers=broadcast_buffers)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    explored = hdet.Setter("dropout", lambda: float(drop.p), lambda v: drop.p.fill_(v),
                           hdet.Spread("additive", 0.05, (0.0, 0.999)), vmap_safe=vmap_safe)
    sched = hdet.HDETLR(opt, None, total_steps=4, model=ddp, model_sync_interval=2, explore=[explored])
    set_for_step = float(drop.p)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            opt.zero_grad()
            ddp(torch.randn(16, 4)).square().mean().backward()
            opt.step()
            sched.step(1.0)
    return {"set": set_for_step, "said": [str(w.message) for w in caught if "explored 'dropout'" in str(w.message)]}


def dcp_rank_state(rank, world, ckpt):
    """A DDP run (alpha 0.5, T 4, the paper controller, on_runaway="recover") checkpointed with
    torch.distributed.checkpoint mid-window (step 6): the scheduler itself is refused by dcp.save; wrapped in
    hdet.RankState, each rank's state loads into a new scheduler as it was saved, and the resumed run's LRs and weights
    are the uninterrupted run's."""
    import warnings

    import torch.distributed.checkpoint as dcp

    def build():
        torch.manual_seed(0)
        net = nn.Linear(4, 3)
        ddp = DDP(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        sched = hdet.HDETLR(opt, None, total_steps=10, model=ddp, model_sync_interval=4, ensemble_lr_spread_ratio=0.5,
                            enable_auto_lr=True, controller="paper", auto_lr_warmup_steps=0, on_runaway="recover")
        return net, ddp, opt, sched

    def train(ddp, opt, sched, steps, lrs):
        for t in steps:
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(100 * t + rank))
            opt.zero_grad()
            loss = ddp(x).square().mean()
            loss.backward()
            opt.step()
            sched.step(loss)
            lrs.append(opt.param_groups[0]["lr"])

    net, ddp, opt, sched = build()
    lrs_a: list[float] = []
    train(ddp, opt, sched, range(1, 7), lrs_a)
    class AppState:  # torch's DCP tutorial's Stateful, with the scheduler's state among its own
        def state_dict(self):
            return {"model": net.state_dict(), "sched": sched.state_dict()}

        def load_state_dict(self, state):
            pass

    refused = []
    for name, state in (("direct", {"sched": sched}), ("app", {"app": AppState()})):
        try:
            dcp.save(state, checkpoint_id=os.path.join(ckpt, name))
        except ValueError as e:
            refused.append(str(e))
    dcp.save({"sched": hdet.RankState(sched)}, checkpoint_id=os.path.join(ckpt, "wrapped"))
    # (the model and optimizer per rank: mid-window DCP keeps one replica's copy of a replicated tensor, docs/sharded.md)
    torch.save({"model": net.state_dict(), "opt": opt.state_dict()}, os.path.join(ckpt, f"rank{rank}.pt"))
    saved = copy.deepcopy(sched.state_dict())
    train(ddp, opt, sched, range(7, 11), lrs_a)
    end_a = net.weight.detach().clone()

    net2, ddp2, opt2, sched2 = build()
    own = torch.load(os.path.join(ckpt, f"rank{rank}.pt"))
    net2.load_state_dict(own["model"])
    opt2.load_state_dict(own["opt"])
    dcp.load({"sched": hdet.RankState(sched2)}, checkpoint_id=os.path.join(ckpt, "wrapped"))
    loaded = sched2.state_dict()
    lrs_b: list[float] = []
    train(ddp2, opt2, sched2, range(7, 11), lrs_b)
    # local mode (ddp.no_sync()) resumed into a fresh optimizer that DCP's set_state_dict stepped once at lr 0 to
    # make its state (torch's _init_optim_state): not a missed step of the resumed run's (a review)
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    net3, ddp3, opt3, sched3 = build()
    _init_optim_state(opt3)
    sched3.load_state_dict(copy.deepcopy(saved))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(rank))
        for _ in range(2):
            opt3.zero_grad()
            with ddp3.no_sync():
                loss = ddp3(x).square().mean()
                loss.backward()
            opt3.step()
            sched3.step(loss)
    missed = [str(w.message) for w in caught if "optimizer.step() ran" in str(w.message)]
    diffs: list[str] = []
    return {"refused": refused, "missed": missed, "same_state": _same(saved, loaded, "", diffs), "diffs": diffs, "lrs_a": lrs_a[6:], "lrs_b": lrs_b,
            "end_a": end_a, "end_b": net2.weight.detach().clone()}


def _same(a, b, path="", diffs=None) -> bool:
    """Two nested states equal, tensors by value (NaN where both are); ``diffs`` collects the paths that differ."""
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return False
        same = [_same(a[k], b[k], f"{path}.{k}", diffs) for k in a]
        if diffs is not None:
            diffs += [f"{path}.{k}" for k, ok in zip(a, same) if ok is False and not isinstance(a[k], (dict, list))]
        return all(same)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a.nan_to_num(), b.nan_to_num())
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    return a == b


def sparse_embedding_hook_guard(rank, world, nan_at=3, steps=6):
    """DDP over a sparse ``nn.Embedding`` and a linear head, SGD (no fused: the "hook" guard), HDETLR at alpha 0 and
    T 3. Rank 1's loss is NaN at step ``nan_at``. Returns the guard, the weights after each step and each step's
    gradients as DDP averaged them (densified), for a check against a hand-run average of the finite ones."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Flatten(), nn.Linear(8, 1))
    model = DDP(net)
    o = torch.optim.SGD(net.parameters(), lr=0.1)
    s = hdet.HDETLR(o, None, total_steps=steps, model=model, model_sync_interval=3, ensemble_lr_spread_ratio=0.0)
    out = {"guard": s.gradient_guard, "weights": [], "grads": []}
    for t in range(1, steps + 1):
        g = torch.Generator().manual_seed(100 * t + rank)
        x, y = torch.randint(0, 10, (4, 2), generator=g), torch.randn(4, 1, generator=g)
        loss = nn.functional.mse_loss(model(x), y) * (float("nan") if (rank == 1 and t == nan_at) else 1.0)
        o.zero_grad()
        loss.backward()
        out["grads"].append([p.grad.to_dense().clone() for p in net.parameters()])
        o.step()
        s.step(loss)
        out["weights"].append([p.detach().clone() for p in net.parameters()])
    return out
