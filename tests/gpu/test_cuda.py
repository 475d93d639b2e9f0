"""GPU checks (run on the GPU machine: `python -m pytest tests/gpu` or `python tests/gpu/test_cuda.py`)."""

import pytest
import torch
from torch import nn

import hdet

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _step_without_host_sync(model, opt, sched, x, y, allow):
    """One training step (MSE), under torch.cuda.set_sync_debug_mode("error") unless ``allow``: a host sync raises."""
    torch.cuda.set_sync_debug_mode(0 if allow else "error")
    try:
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step(loss)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_no_host_sync_off_sync_steps():
    """torch.cuda.set_sync_debug_mode('error') raises on any host-device sync: it is on for every
    step except the sync steps."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 1)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    sched = hdet.OneCycleAutoLR(opt, max_lr=1e-3, total_steps=60, ensemble_lr_spread_ratio=0.2,
                                model_sync_interval=10, controller="paper", enable_auto_lr=True, auto_lr_warmup_steps=10, model=model)
    x = torch.randn(32, 64, device=dev)
    y = torch.randn(32, 1, device=dev)
    checked = 0
    for t in range(1, 61):
        sync_step = sched.ensemble.is_sync_step(t)
        _step_without_host_sync(model, opt, sched, x, y, allow=sync_step)
        checked += not sync_step
        assert isinstance(opt.param_groups[0]["lr"], float)
    assert checked == 54 and sched.ensemble.controllers[0].updates == 6


@pytest.mark.parametrize("base", ["none", "callable", "onecycle", "lambda", "cosine", "multistep"])
@pytest.mark.parametrize("kw", [dict(capturable=True), dict(fused=True)])
def test_tensor_lrs_on_the_device_give_no_host_sync_and_no_lr_written_warning(kw, base):
    """A tensor LR on the GPU (capturable or fused AdamW): the check that an LR was written beside the scheduler
    (session 43) tells hdet's own writes by the tensor's in-place version, with no host read off sync steps, and says
    nothing in a loop that leaves the LRs alone; one written by hand is said once. OneCycleAutoLR's OneCycleLR gives
    its closed form on the host (its LRs were read back from the device tensors every step, a host sync, found by the
    first version of this test); a LambdaLR (Hugging Face's schedules) its lambdas times its base LRs, read once
    (session 44); torch's step-function schedulers (cosine, multistep here) their closed form over the base LRs read
    once (session 52); another torch scheduler as the base still reads them (docs/cost.md)."""
    import warnings

    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1)).to(dev)
    opt = torch.optim.AdamW([{"params": model[0].parameters(), "lr": torch.tensor(1e-3, device=dev)},
                             {"params": model[2].parameters(), "lr": torch.tensor(1e-3, device=dev)}], **kw)
    if base == "onecycle":
        sched = hdet.OneCycleAutoLR(opt, max_lr=1e-3, total_steps=40, ensemble_lr_spread_ratio=0.2,
                                    model_sync_interval=10, model=model, enable_auto_lr=False)
        ref_opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
        ref = torch.optim.lr_scheduler.OneCycleLR(ref_opt, max_lr=1e-3, total_steps=40)  # (one replica: rho = 1)
    elif base == "lambda":
        sched = hdet.HDETLR(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1 - t / 50), total_steps=40,
                            ensemble_lr_spread_ratio=0.2, model_sync_interval=10, model=model)
        ref_opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
        ref = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda t: 1 - t / 50)
    elif base in ("cosine", "multistep"):
        def make(o):
            if base == "cosine":
                return torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=40, eta_min=1e-5)
            return torch.optim.lr_scheduler.MultiStepLR(o, milestones=[7, 20], gamma=0.3)
        sched = hdet.HDETLR(opt, make(opt), total_steps=40, ensemble_lr_spread_ratio=0.2, model_sync_interval=10,
                            model=model)
        ref_opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
        ref = make(ref_opt)
    else:
        sched = hdet.HDETLR(opt, None if base == "none" else (lambda t: 1e-3 * (1 - t / 50)), total_steps=40,
                            ensemble_lr_spread_ratio=0.2, model_sync_interval=10, model=model)
    x, y = torch.randn(32, 64, device=dev), torch.randn(32, 1, device=dev)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in range(1, 41):
            sync_step = sched.ensemble.is_sync_step(t)
            if t == 30:
                opt.param_groups[1]["lr"].fill_(5e-4)  # (by hand: said at this step's scheduler.step())
            _step_without_host_sync(model, opt, sched, x, y, allow=sync_step or t <= 2)
            if t == 29:
                assert not [w for w in caught if "LR was written" in str(w.message)], [str(w.message) for w in caught]
            if base != "none" and base != "callable" and t < 30:  # (the LRs given on the host: torch's, step by step)
                ref_opt.step()
                ref.step()
                assert [float(g["lr"]) for g in opt.param_groups] == pytest.approx([ref.get_last_lr()[0]] * 2,
                                                                                    rel=1e-6)
    said = [str(w.message) for w in caught if "LR was written" in str(w.message)]
    assert len(said) == 1 and said[0].startswith("hdet: param group 1's LR was written")


def test_sync_debug_mode_catches_a_host_sync():
    """The check above can fail: an .item() under the same mode raises."""
    x = torch.ones(2, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):
            x.sum().item()
    finally:
        torch.cuda.set_sync_debug_mode(0)


if __name__ == "__main__":
    test_no_host_sync_off_sync_steps()
    test_sync_debug_mode_catches_a_host_sync()
    print("2 passed, 0 failed")


def test_under_fp16_and_grad_scaler_the_guard_takes_the_scalers_verdict_without_a_sync():
    """fp16 autocast, torch.amp.GradScaler and a fused AdamW on CUDA: the skip guard makes no pass over the gradients
    of its own (the scaler has checked every one) and adds no host sync; an overflowing step is skipped by both and
    counted once; the scaler lowers its scale as usual."""
    import hdet.guard as guard_mod

    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    guard = guard_mod.SkipNonFiniteStep(opt)
    reads = []
    real = guard_mod._nonfinite
    guard_mod._nonfinite = lambda grads, out: reads.append(len(grads)) or real(grads, out)
    try:
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 10)
        x, y = torch.randn(32, 64, device=dev), torch.randn(32, 1, device=dev)
        for t in range(1, 21):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            if t == 10:
                model[0].weight.grad[0, 0] = float("inf")  # an overflow
            before = model[0].weight.detach().clone()
            torch.cuda.set_sync_debug_mode("error")
            try:
                scaler.step(opt)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            scaler.update()
            assert torch.equal(model[0].weight, before) == (t == 10), t
    finally:
        guard_mod._nonfinite = real
    assert reads == [] and float(guard.skipped) == 1.0 and scaler.get_scale() == 2.0 ** 9


def test_the_kept_loss_scale_loaded_from_a_checkpoint_is_kept_without_a_host_sync():
    """A resumed run's kept GradScaler scale comes back as a float: keeping the next taken step's scale made it a
    tensor from host memory, a host sync at an ordinary step (a review, on an H200). Now a fill on the device."""
    from hdet.loss_scale import LossScale

    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 10)
    scaler.scale(torch.ones((), device="cuda"))  # (the scaler makes its scale tensor on first use)
    kept = LossScale()
    kept.scaler = scaler
    kept.set_kept(512.0)
    torch.cuda.set_sync_debug_mode("error")
    try:
        kept.step_taken(torch.ones((), device="cuda"))  # a skipped step: the loaded value stays
        kept.step_taken(torch.zeros((), device="cuda"))  # a taken one: its scale
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert kept.kept_value() == 2.0 ** 10


@pytest.mark.parametrize("closure", [False, True])
def test_a_compiled_fused_step_on_cuda_is_guarded_as_an_eager_one(closure):
    """torch.compile(opt.step) (inductor) over CUDA's fused AdamW with a tensor LR, the skip guard on: its hooks run
    eagerly around the compiled step (before, the compiled step dropped found_inf: a NaN gradient was stepped; session
    46's audit, on CPU), and so does its check after a closure (``step(closure)``, Lightning's form: session 46's
    review, on CPU). The NaN step is skipped, Adam's count stays, and the weights match the eager run's."""
    from hdet.guard import SkipNonFiniteStep

    runs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        net = nn.Linear(64, 32, device="cuda")
        opt = torch.optim.AdamW(net.parameters(), lr=torch.tensor(1e-2, device="cuda"), fused=True)
        guard = SkipNonFiniteStep(opt)
        step = torch.compile(opt.step) if compiled else opt.step
        g = torch.Generator(device="cuda").manual_seed(1)
        for t in range(6):
            x = torch.randn(16, 64, device="cuda", generator=g)

            def backward(x=x, t=t):
                loss = net(x).square().mean()
                if t == 3:
                    loss = loss * float("nan")
                opt.zero_grad()
                loss.backward()
                return loss
            if closure:
                step(backward)
            else:
                backward()
                step()
        assert float(guard.skipped) == 1.0 and float(opt.state[net.weight]["step"]) == 5.0
        runs.append([p.detach().clone() for p in net.parameters()])
    assert all(torch.isfinite(w).all() for w in runs[1])
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
