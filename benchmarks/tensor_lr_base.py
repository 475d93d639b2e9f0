"""A torch step-function scheduler as HDETLR's base over device tensor LRs: its LRs read back every step (before) or
its closed form on the host (now), side by side in one process, against plain training with the same scheduler.

One ByteGPT of ``engine_throughput.py``'s sizes, fused AdamW with ``lr=torch.tensor(...)`` on the GPU (what a
capturable or compiled optimizer step keeps), and as the base ``CosineAnnealingLR`` or ``MultiStepLR``: three
models interleaved in ``--rounds`` rounds of ``--steps`` steps (the median is reported): plain (torch's scheduler
stepped alone), HDET as it is, and HDET with every step-function base read back from the device as before
(``hdet.schedulers._CLOSED_FORM`` emptied while that model steps). Each is also run for 10 steps under
``torch.cuda.set_sync_debug_mode("error")``, off HDET's sync steps (T = 100), to say whether a step syncs with
the host.
Writes JSON with the command, machine and versions.

    python benchmarks/tensor_lr_base.py --out benchmarks/results/gpu_h200/tensor_lr_base/cosine.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

import hdet
import hdet.schedulers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_throughput import SIZES, lm_loss, time_steps  # noqa: E402  (same folder)
from hdet.app.tasks import ByteGPT  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="small", choices=list(SIZES))
    p.add_argument("--base", default="cosine", choices=["cosine", "multistep"])
    p.add_argument("--batch", type=int, default=None, help="sequences a step (the size's B by default)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--device", default="cuda", help="cuda (cpu: a smoke test, no sync check)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    dev = torch.device(a.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    size = SIZES[a.size]
    B, ctx = a.batch or size["B"], size["ctx"]
    total = (a.steps + 10) * a.rounds + 40
    data = torch.randint(0, 256, (B, ctx + 1), device=dev, generator=torch.Generator(device=dev).manual_seed(0))

    def base(opt):
        if a.base == "cosine":
            return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total, eta_min=1e-5)
        return torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[total // 2, 3 * total // 4], gamma=0.3)

    def build(hdet_on: bool):
        torch.manual_seed(0)
        model = ByteGPT(ctx, size["d"], size["layers"], size["heads"]).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3, device=dev), fused=True)
        sched = (hdet.HDETLR(opt, base(opt), total_steps=total, ensemble_lr_spread_ratio=0.2,
                             model_sync_interval=100, model=model) if hdet_on else base(opt))

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            lm_loss(model, data).backward()
            opt.step()
            sched.step()
        return step

    def reading_back(step):  # the code before: every step-function base's LRs read back from the device
        def run() -> None:
            saved, hdet.schedulers._CLOSED_FORM = hdet.schedulers._CLOSED_FORM, ()
            try:
                step()
            finally:
                hdet.schedulers._CLOSED_FORM = saved
        return run

    steps = {"plain": build(False), "hdet": build(True), "hdet, LRs read back (before)": reading_back(build(True))}
    syncs = {}
    for k, f in (steps.items() if dev.type == "cuda" else ()):
        f()  # (the first step: checks that read once)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(10):
                f()
            syncs[k] = False
        except RuntimeError:
            syncs[k] = True
        finally:
            torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize()
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(a.rounds):
        for k, f in steps.items():
            times[k].append(time_steps(f, 3, a.steps, dev))
    med = {k: statistics.median(v) for k, v in times.items()}
    rec = {"command": "python " + " ".join(sys.argv), "python": platform.python_version(), "torch": torch.__version__,
           "hdet": hdet.__version__,
           "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "size": a.size, "batch": B,
           "base": a.base, "host_sync_in_a_step": syncs, "seconds_per_step_median": med,
           "seconds_per_step_all": times, "ratio_to_plain": {k: v / med["plain"] for k, v in med.items()}}
    print(json.dumps({k: rec[k] for k in ("device", "size", "base", "host_sync_in_a_step", "ratio_to_plain")}))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
