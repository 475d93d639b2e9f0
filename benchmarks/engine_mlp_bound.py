"""How fast N stacked MLP replicas can train on this machine without the engine: the bound for issue 19's CPU target.

The MLP of ``engine_mlp.py`` (784-W-W-10, N = 8 replicas of B examples, AdamW with shared gradients and a
per-replica LR), written by hand on stacked ``[N, out, in]`` weights, against one model at N x the batch (AdamW +
OneCycleLR), interleaved over ``--repeats`` rounds (the 25th percentile of each is reported: this 2-core VM's
speed moves by 2x within minutes):

- ``autograd``: one ``baddbmm`` a layer, ``torch.autograd.grad`` (each replica's weight gradient), the mean over
  the replicas, one copy of Adam's moments (foreach), each replica's decay and update;
- ``autograd, dW as W``: the same through ``hdet.linear``'s batched linear function on the plain stacked tensors
  (its backward gives each replica's weight gradient as ``dy^T @ x``, in the weight's layout; autograd's own
  ``baddbmm`` backward gives ``x^T @ dy``, the transpose);
- ``manual``: the same forward, a hand-written backward whose weight gradient is the replicas' mean in one ``mm``
  over all N * B rows (no [N, out, in] gradient), the same optimizer;
- the engine through the public API (``ReplicaEngine``, vmap, the stacked AdamW step).

    python benchmarks/engine_mlp_bound.py --out benchmarks/results/cpu/engine_mlp_bound.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import hdet
from hdet.engine import ReplicaEngine
from hdet.linear import _BatchedLinear

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_mlp import baseline  # noqa: E402  (same folder)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=32, help="examples per replica")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--steps", type=int, default=10, help="timed steps a round")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    N, B, W = a.replicas, a.batch, a.width
    torch.manual_seed(0)
    x, y = torch.randn(N, B, 784), torch.randint(0, 10, (N, B))
    shapes = [(W, 784), (W, W), (10, W)]

    def stacked():
        ws = [(torch.randn(N, o, i) * 0.05).requires_grad_() for o, i in shapes]
        bs = [torch.zeros(N, o, requires_grad=True) for o, _ in shapes]
        return ws + bs

    lr = torch.linspace(0.8, 1.2, N) * 1e-3  # alpha 0.2 around 1e-3

    def adamw(params, moments, grads):
        m, v = moments
        with torch.no_grad():
            torch._foreach_lerp_(m, grads, 0.1)
            torch._foreach_mul_(v, 0.999)
            torch._foreach_addcmul_(v, grads, grads, 0.001)
            u = torch._foreach_div(m, torch._foreach_add(torch._foreach_sqrt(v), 1e-8))
            for q, d in zip(params, u):
                col = lr.view(-1, *[1] * (q.dim() - 1))
                q.mul_(1 - col * 0.01).addcmul_(d.unsqueeze(0), col, value=-1)

    def forward(params):
        ws, bs = params[:3], params[3:]
        h, hs, pre = x, [x], []
        for k, (w, b) in enumerate(zip(ws, bs)):
            z = torch.baddbmm(b.unsqueeze(1), h, w.transpose(1, 2))
            pre.append(z)
            h = z.relu() if k < 2 else z
            hs.append(h)
        return h, hs, pre

    pa = stacked()
    ma = ([torch.zeros(t.shape[1:]) for t in pa], [torch.zeros(t.shape[1:]) for t in pa])

    def autograd_step():
        out, _, _ = forward(pa)
        loss = F.cross_entropy(out.reshape(-1, 10), y.reshape(-1), reduction="none").view(N, B).mean(1).sum()
        grads = torch.autograd.grad(loss, pa)
        adamw(pa, ma, [g.mean(0) for g in grads])

    pl = stacked()
    ml = ([torch.zeros(t.shape[1:]) for t in pl], [torch.zeros(t.shape[1:]) for t in pl])

    def layout_step():
        h = x
        for k in range(3):
            h = _BatchedLinear.apply(h, pl[k], pl[3 + k])
            h = h.relu() if k < 2 else h
        loss = F.cross_entropy(h.reshape(-1, 10), y.reshape(-1), reduction="none").view(N, B).mean(1).sum()
        grads = torch.autograd.grad(loss, pl)
        adamw(pl, ml, [g.mean(0) for g in grads])

    pm = [t.detach() for t in stacked()]
    mm = ([torch.zeros(t.shape[1:]) for t in pm], [torch.zeros(t.shape[1:]) for t in pm])

    def manual_step():
        out, hs, pre = forward(pm)
        p_ = out.reshape(-1, 10).softmax(-1)
        p_[torch.arange(N * B), y.reshape(-1)] -= 1
        dz = (p_ / B).view(N, B, 10)
        gw, gb = [None] * 3, [None] * 3
        for k in (2, 1, 0):  # the replicas' mean weight gradient: one mm over all N * B rows
            gw[k] = torch.mm(dz.reshape(-1, dz.shape[-1]).t(), hs[k].reshape(-1, hs[k].shape[-1])).div_(N)
            gb[k] = dz.sum((0, 1)).div_(N)
            if k > 0:
                dz = torch.bmm(dz, pm[k]).mul_(pre[k - 1] > 0)
        adamw(pm, mm, gw + gb)

    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(784, W), nn.ReLU(), nn.Linear(W, W), nn.ReLU(), nn.Linear(W, 10))

    total = (a.steps + 3) * a.repeats + 10
    base_step, _ = baseline(mlp, x, y, total)

    eng = ReplicaEngine(mlp(), N, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
                        lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=1e-3, total_steps=total,
                                                              ensemble_lr_spread_ratio=0.2, model_sync_interval=25,
                                                              replicas=rep, model=m), mode="vmap")

    def engine_step():
        eng.step((x, y), lambda m, b: F.cross_entropy(m(b[0]), b[1]), stacked=True)

    steps = {"baseline": base_step, "autograd": autograd_step, "autograd, dW as W": layout_step,
             "manual": manual_step, "engine": engine_step}
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(a.repeats):
        for k, f in steps.items():
            for _ in range(3):
                f()
            t0 = time.perf_counter()
            for _ in range(a.steps):
                f()
            times[k].append((time.perf_counter() - t0) / a.steps)
    q = {k: sorted(v)[len(v) // 4] for k, v in times.items()}
    rec = {"command": "python " + " ".join(sys.argv), "python": platform.python_version(), "torch": torch.__version__,
           "hdet": hdet.__version__, "device": f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} threads)",
           "N": N, "width": W, "batch_per_replica": B, "seconds_per_step_p25": q,
           "ratio_to_baseline": {k: q["baseline"] / q[k] for k in steps if k != "baseline"},
           "seconds_per_step_all": times}
    print(json.dumps({k: rec[k] for k in ("device", "ratio_to_baseline")}))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
