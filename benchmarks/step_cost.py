"""Host time that HDET adds to one non-sync training step, against OneCycleLR (CPU, one process).

Off sync steps HDET's ``sched.step(loss)`` launches no collective, so its whole cost there is host work
(and a few tiny device ops on the loss). This times, per call, on parameters too small for kernels to
matter (148 tensors, as the 124M GPT of ``ddp_overhead.py``, 16 floats each):

* ``OneCycleLR.step()`` (what plain DDP runs),
* ``hdet.OneCycleAutoLR.step(loss)`` off sync steps (auto-LR off, and on with the fit controller
  between its probes, which adds one foreach add of the parameters per step),
* the "skip" gradient guard's step hooks (``hdet.guard.SkipNonFiniteStep``), without the optimizer step.

A sync step's own cost (collectives, one host read) is in ``ddp_overhead.py`` (converge step).

    python benchmarks/step_cost.py --out benchmarks/results/cpu/step_cost.json
"""

import argparse
import json
import platform
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import hdet  # noqa: E402
from hdet.guard import SkipNonFiniteStep  # noqa: E402


def per_call_us(fn, n: int) -> float:
    for _ in range(20):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return 1e6 * (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=148)
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Detected call of")  # no optimizer steps here
    warnings.filterwarnings("ignore", message="hdet: scheduler.step() was called with no optimizer.step()")
    total = a.calls + 100
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(16)) for _ in range(a.tensors)])
    loss = torch.tensor(1.0)

    def opt():
        return torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    plain = torch.optim.lr_scheduler.OneCycleLR(opt(), max_lr=1e-3, total_steps=total)
    # T beyond the run: every timed call is a non-sync step
    hd = hdet.OneCycleAutoLR(opt(), max_lr=1e-3, total_steps=total, ensemble_lr_spread_ratio=0.2,
                             model_sync_interval=total)
    fit = hdet.OneCycleAutoLR(opt(), max_lr=1e-3, total_steps=total, ensemble_lr_spread_ratio=0.2,
                              model_sync_interval=total, enable_auto_lr=True, auto_lr_warmup_steps=1,
                              model=model, probe=lambda m: torch.zeros(()))
    o = opt()
    guard = SkipNonFiniteStep(o)
    for p in model.parameters():
        p.grad = torch.zeros(16)
    us = {
        "OneCycleLR.step()": per_call_us(plain.step, a.calls),
        "OneCycleAutoLR.step(loss), auto-LR off": per_call_us(lambda: hd.step(loss), a.calls),
        "OneCycleAutoLR.step(loss), fit controller": per_call_us(lambda: fit.step(loss), a.calls),
        "skip guard hooks (pre + post)": per_call_us(lambda: (guard._pre(o, (), {}), guard._post(o, (), {})), a.calls),
    }
    out = {"command": "python benchmarks/step_cost.py " + " ".join(sys.argv[1:]), "python": platform.python_version(),
           "torch": torch.__version__, "cpu": platform.processor() or platform.machine(), "threads": 1,
           "tensors": a.tensors, "calls": a.calls, "us_per_call": us,
           "hdet_minus_onecycle_us": {k: v - us["OneCycleLR.step()"] for k, v in us.items()
                                      if k.startswith("OneCycleAutoLR")}}
    print(json.dumps(out, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
