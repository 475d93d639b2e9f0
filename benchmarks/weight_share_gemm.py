"""The weight gradient of N stacked linear layers two ways, interleaved (``hdet.linear.SHARE_MAX_ROWS``).

For a layer ``[out, in]`` with R rows a replica: the replicas' share of their summed gradient as one ``mm`` over all
N x R rows (``dy^T @ x``, what ``hdet.linear.sharing`` computes), against N gradients from one ``bmm`` and their sum
over the replicas (what the engine computes and reduces without it). Medians over ``--rounds`` interleaved rounds.
Writes JSON with the command, machine and versions.

    python benchmarks/weight_share_gemm.py --out benchmarks/results/cpu/weight_shares/gemm.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_throughput import time_steps  # noqa: E402  (same folder)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--layers", default="256x784,256x256,10x256", help="out x in, comma-separated")
    p.add_argument("--rows", default="32,128,256,512", help="rows a replica")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    N, out = a.replicas, []
    for layer in a.layers.split(","):
        O, I = map(int, layer.split("x"))
        for R in map(int, a.rows.split(",")):
            x, dy, d = torch.randn(N, R, I), torch.randn(N, R, O), torch.empty(O, I)
            xf, dyf = x.reshape(-1, I), dy.reshape(-1, O)
            fs = {"share_mm": lambda: torch.mm(dyf.t(), xf).div_(N),
                  "bmm_and_sum": lambda: torch.sum(torch.bmm(dy.transpose(1, 2), x), 0, out=d)}
            times: dict[str, list[float]] = {k: [] for k in fs}
            for r in range(a.rounds):
                for k in (list(fs) if r % 2 else list(fs)[::-1]):
                    times[k].append(time_steps(fs[k], 2, a.steps, torch.device("cpu")))
            med = {k: statistics.median(v) for k, v in times.items()}
            out.append({"out": O, "in": I, "rows_per_replica": R, "seconds_median": med,
                        "share_speedup": med["bmm_and_sum"] / med["share_mm"]})
            print(f"{O}x{I} R={R}: share {out[-1]['share_speedup']:.3f}x")
    rec = {"command": "python " + " ".join(sys.argv), "python": platform.python_version(), "torch": torch.__version__,
           "device": f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} threads)", "N": N, "results": out}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
