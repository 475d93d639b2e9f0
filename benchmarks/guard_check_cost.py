"""The device time of the "skip" gradient guard's check, by kernel, on a 124M GPT's real gradients.

    python benchmarks/guard_check_cost.py --out guard_check.json         # one GPU
    python benchmarks/guard_check_cost.py --tiny                         # CPU smoke test

Step-time ratios cannot resolve a 0.2% cost (``benchmarks/ddp_overhead.py``), and CUDA events around a
loop of checks measure host time when the loop is host-bound. Here ``torch.profiler`` sums the device
time of the kernels each candidate check launches (``--calls`` calls, per call), next to the model's own
forward + backward + fused AdamW step (same profiler, one step), so each check's share of a step is a
ratio of device times measured side by side. Candidates: GradScaler's read-and-write check
(``_amp_foreach_non_finite_check_and_unscale_``, scale 1), the max-abs norms (``_foreach_norm(inf)``),
the 2-norm of all gradients (``torch.nn.utils.get_total_norm``: what a clipping user computes anyway), the
guard's pre-hook as shipped, and the pre-hook with a handed-over norm (``HDETLR.clip_grad_norm_``).
Also the shipped check's verdicts on this device with NaN, +Inf and -Inf planted at several places, and
on the scalars a handed-over norm can be.
"""

import argparse
import json
import platform
import sys
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from hdet.app.tasks import ByteGPT
from hdet.guard import SkipNonFiniteStep, _nonfinite, _nonfinite_scalar


def kernels(fn, calls: int, cuda: bool) -> dict:
    """Device time (us) and kernel launches per call of ``fn``, from the profiler; host time per call."""
    fn()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        if cuda:
            torch.cuda.synchronize()
    host = (time.perf_counter() - t0) / calls
    us, n, names = 0.0, 0, {}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", 0.0) if cuda else e.self_cpu_time_total
        if t and (not cuda or e.device_type.name == "CUDA"):
            us += t
            n += e.count
            names[e.key[:160]] = round(t / calls, 2)
    return {"device_us_per_call" if cuda else "cpu_us_per_call": us / calls, "kernels_per_call": n / calls,
            "host_us_per_call_profiled": 1e6 * host, "by_kernel_us": dict(sorted(names.items(), key=lambda x: -x[1])[:6])}


def verdicts(grads: list[torch.Tensor], flag: torch.Tensor) -> dict:
    """The shipped check with NaN/+Inf/-Inf planted in the first, middle and last element of the largest
    gradient and of the first and last ones (each restored after), a clean pass, and the handed-over
    norm's test on NaN, +-Inf, 0, a huge finite value and a normal one."""
    out = {}
    big = max(range(len(grads)), key=lambda i: grads[i].numel())
    for name, i, pos in (("first", 0, 0), ("largest_first", big, 0), ("largest_middle", big, grads[big].numel() // 2 + 7),
                         ("largest_last", big, grads[big].numel() - 1), ("last", len(grads) - 1, -1)):
        flat = grads[i].view(-1)
        keep = flat[pos].item()
        for bad in (float("nan"), float("inf"), -float("inf")):
            flat[pos] = bad
            out[f"{name}_{bad}"] = bool(_nonfinite(grads, flag))
        flat[pos] = keep
    out["clean"] = bool(_nonfinite(grads, flag))
    for v in (float("nan"), float("inf"), -float("inf"), 0.0, 3e38, 1.5):
        out[f"norm_{v}"] = bool(_nonfinite_scalar(torch.tensor(v, device=flag.device), flag))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    cuda = torch.cuda.is_available() and not a.tiny
    dev = torch.device("cuda" if cuda else "cpu")
    vocab, ctx, d, layers, heads = (256, 32, 64, 2, 2) if a.tiny else (50304, 1024, 768, 12, 12)
    torch.manual_seed(0)
    model = ByteGPT(ctx, d, layers, heads, vocab=vocab).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1, fused=True)
    data = torch.randint(0, vocab, (a.batch, ctx + 1), device=dev)

    def train_step() -> None:
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            logits = model(data[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), data[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=False)  # the same gradient tensors every step
        loss.backward()
        opt.step()

    train_step()
    grads = [q.grad for q in model.parameters()]
    found, one = torch.zeros((), device=dev), torch.ones((), device=dev)
    guard = SkipNonFiniteStep(opt)
    norm = torch.nn.utils.get_total_norm(grads)

    def pre_hook() -> None:
        guard._pre(opt, (), {})
        guard._post(opt, (), {})

    def handed_over() -> None:
        guard.use_norm(norm, grads)
        pre_hook()

    out = {"command": "python benchmarks/guard_check_cost.py " + " ".join(sys.argv[1:]),
           "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
           "torch": torch.__version__, "python": platform.python_version(),
           "params": sum(q.numel() for q in model.parameters()),
           "gradient_mb": sum(g.numel() * g.element_size() for g in grads) / 2**20, "tensors": len(grads),
           "train_step": kernels(train_step, 5, cuda)}
    guard.remove()  # the step above: no guard; below, the pre-hook is called directly
    guard = SkipNonFiniteStep(opt)
    out["checks"] = {
        "amp_read_write": kernels(lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one), a.calls, cuda),
        "foreach_norm_inf": kernels(lambda: _nonfinite(grads, found), a.calls, cuda),
        "total_2norm": kernels(lambda: torch.isfinite(torch.nn.utils.get_total_norm(grads)), a.calls, cuda),
        "clip_grad_norm_": kernels(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9), a.calls, cuda),
        "guard_pre_hook_as_shipped": kernels(pre_hook, a.calls, cuda),
        "guard_pre_hook_handed_over_norm": kernels(handed_over, a.calls, cuda)}
    out["verdicts_true_means_nonfinite"] = verdicts(grads, found)
    key = "device_us_per_call" if cuda else "cpu_us_per_call"
    step = out["train_step"][key]
    out["fraction_of_train_step"] = {k: v[key] / step for k, v in out["checks"].items()}
    print(json.dumps(out), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
