"""The stability guard's judgment of a short pool (T 5 under judge_steps 25), on simulated runs with no instability.

A falling loss, 4 replicas, every 5-step window shifted by shared noise (sd 4%: windows move together more than their
steps' spread says, as on the 128M GPT) and each step by its own (sd 2%); ``StabilityGuard`` driven directly with the
gathered columns a sync would give it. Counts (1) go-backs at the run's last sync when it ends on a full pool (1000
steps), one window after one (1005) or two (1010), and (2) with ``finish()`` at step 503 mid-run (a 3-step partial
pool, training going on to 1000): how often that pool becomes the best sync, and how many runs go back after it.
Every go-back here is a false alarm. Writes JSON with the command, the hdet commit it ran against and the counts.

    python benchmarks/guard_short_pool.py --out benchmarks/results/cpu/guard_short_pool.json
    PYTHONPATH=/path/to/an/older/checkout/src python benchmarks/guard_short_pool.py --out old.json   # another version
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch

import hdet
from hdet.config import HDETConfig
from hdet.stability import StabilityGuard


def run(seed: int, total: int, finish_at: int | None = None, N: int = 4, T: int = 5, win_sd: float = 0.04,
        step_sd: float = 0.02) -> tuple[list[int], bool | None]:
    """One simulated run: the steps where it went back, and whether finish()'s pool became the best sync."""
    rnd = random.Random(seed)
    g = StabilityGuard(HDETConfig(on_runaway="recover", model_sync_interval=T, judge_steps=25))
    kept = [torch.zeros(3)]
    backs, kept_there, shift = [], None, 0.0
    S, Q, C = [0.0] * N, [0.0] * N, [0.0] * N
    for t in range(1, total + 1):
        if (t - 1) % T == 0:
            shift = rnd.gauss(0, win_sd)
        base = 2.0 * math.exp(-t / 300) + 1.0
        for r in range(N):
            x = base * (1 + shift + rnd.gauss(0, step_sd))
            S[r], Q[r], C[r] = S[r] + x, Q[r] + x * x, C[r] + 1
            if t == 1 and r == 0:
                first = x
        if t == 1:
            g.keep_start(1, kept, torch.tensor(True), (torch.tensor(first), torch.tensor(1.0)))
        if t % T == 0 or t == total or t == finish_at:
            sl = g.start_loss()
            col = SimpleNamespace(loss_sum=S, loss_sq=Q, loss_n=C, nonfinite=[0] * N,
                                  start_sum=[float(sl[0])] * N, start_n=[float(sl[1])] * N)
            losses = [s / c for s, c in zip(S, C)]
            try:
                runaway, rising = g.judge(losses, [], col, pool=True, last=t == total or t % T != 0)
            except TypeError:  # (a version before judge(last=)): its last sync judged only a full pool
                runaway, rising = g.judge(losses, [], col, pool=True)
            back = g.after_average(t, losses, runaway, rising, kept, col)
            if t == finish_at:
                kept_there = g.best_step == t
            if back:
                backs.append(t)
            S, Q, C = [0.0] * N, [0.0] * N, [0.0] * N
    return backs, kept_there


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    warnings.simplefilter("ignore")
    last = {}
    for total in (1000, 1005, 1010):
        last[str(total)] = sum(total in run(seed, total)[0] for seed in range(a.runs))
    K = a.runs
    plain = [run(seed, 1000)[0] for seed in range(K)]
    finished = [run(seed, 1000, 503) for seed in range(K)]
    src = Path(hdet.__file__).resolve().parent
    commit = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    rec = {"command": "python " + " ".join(sys.argv), "python": platform.python_version(), "torch": torch.__version__,
           "hdet_source": str(src), "hdet_commit": commit, "runs": K,
           "last_sync_go_backs_by_total_steps": last,
           "finish_at_503": {"pool_kept_as_best": sum(bool(k) for _, k in finished),
                             "runs_going_back_after_503": sum(any(t > 503 for t in b) for b, _ in finished),
                             "the_same_runs_without_finish": sum(any(t > 503 for t in b) for b in plain)}}
    print(json.dumps({k: rec[k] for k in ("hdet_commit", "last_sync_go_backs_by_total_steps", "finish_at_503")}))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
