"""The engine's batched linear layers on a GPU: hdet's ``autograd.Function`` (dW in the weight's layout, a Python
backward) against torch's own ``baddbmm`` with autograd's backward (``hdet.linear.NATIVE_MAX``), side by side.

For each size of ``engine_throughput.py``'s GPT and each engine mode: one model at N x the batch (the baseline), the
engine with the Function and the engine with torch's ``baddbmm``, built once each, timed in ``--rounds`` rounds of
``--steps`` steps, the three in a rotating order each round (the host's speed drifts within a call). Reports each
one's median seconds a step, the ratios to the baseline, and the per-round ratio native / Function.
Writes JSON with the command, machine and versions.

    python benchmarks/engine_native_linear.py --sizes tiny,small --out $OUT/native_linear.json
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
import hdet.linear
from hdet.engine import ReplicaEngine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_throughput import SIZES, ByteGPT, lm_loss, time_steps  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="tiny,small")
    p.add_argument("--modes", default="merged")
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--native-max", type=float, default=hdet.linear.NATIVE_MAX,
                   help="hdet.linear.NATIVE_MAX for the native engine (default: the library's)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True  # (as engine_throughput.py)
    N, results, default = a.replicas, [], hdet.linear.NATIVE_MAX
    for name in a.sizes.split(","):
        size = SIZES[name]
        ctx, B = size["ctx"], size["B"]
        g = torch.Generator(device=dev).manual_seed(0)
        data = torch.randint(0, 256, (N * B * 4, ctx + 1), device=dev, generator=g)
        total = len(a.modes.split(",")) * (a.rounds + 1) * (a.steps + 5) + 10  # (the baseline steps in every mode)

        def model():
            torch.manual_seed(0)
            return ByteGPT(ctx, size["d"], size["layers"], size["heads"]).to(dev)

        base = model()
        opt = torch.optim.AdamW(base.parameters(), lr=1e-3, fused=True)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=total)
        i = [0]

        def base_step():
            b = data[(i[0] % 4) * N * B: (i[0] % 4 + 1) * N * B]
            i[0] += 1
            loss = lm_loss(base, b)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()

        for mode in a.modes.split(","):
            steps, limits = {"baseline": base_step}, {}
            for key, limit in (("function", 0), ("native", a.native_max)):
                hdet.linear.NATIVE_MAX = limit
                eng = ReplicaEngine(model(), N, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True),
                                    lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=1e-3, total_steps=total,
                                                                          ensemble_lr_spread_ratio=0.2,
                                                                          model_sync_interval=25, replicas=rep,
                                                                          model=m), mode=mode)
                j = [0]

                def step(eng=eng, j=j):
                    b = data[(j[0] % 4) * N * B: (j[0] % 4 + 1) * N * B].view(N, B, ctx + 1)
                    j[0] += 1
                    eng.step(b, lm_loss, stacked=True)

                steps[key], limits[key] = step, limit
            times: dict[str, list[float]] = {k: [] for k in steps}
            order = list(steps)
            for r in range(a.rounds):
                for k in order[r % 3:] + order[: r % 3]:
                    hdet.linear.NATIVE_MAX = limits.get(k, 0)
                    times[k].append(time_steps(steps[k], 3, a.steps, dev))
            hdet.linear.NATIVE_MAX = default
            med = {k: statistics.median(v) for k, v in times.items()}
            results.append({"size": name, "mode": mode, "N": N, "batch_per_replica": B,
                            "median_seconds_per_step": med, "all_seconds_per_step": times,
                            "ratio_to_baseline": {k: med["baseline"] / med[k] for k in ("function", "native")},
                            "native_speedup_per_round": [f / n for f, n in zip(times["function"], times["native"])]})
            print(name, mode, {k: round(v * 1e3, 2) for k, v in med.items()},
                  "native/function speed-up per round:", [round(x, 3) for x in results[-1]["native_speedup_per_round"]])
    rec = {"command": "python " + " ".join(sys.argv), "native_max": a.native_max, "python": platform.python_version(), "torch": torch.__version__,
           "device": torch.cuda.get_device_name(dev), "tf32": True, "results": results}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
