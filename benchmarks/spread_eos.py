"""What HDET's spread does to the shared gradient: N replicas on one device, HDET's DDP semantics written out by hand.

Issue 15's 128M GPT ends 1-3% above plain DDP under HDET's spread (alpha 0.2), the machinery alone costs nothing
(``benchmarks/results/gpu_h200/world1_machinery/``), and a shorter window (T 5) was no cheaper on 4 x H200. One hypothesis: at
the tuned LR training sits at the edge of stability, the replica at 1 + alpha is past it, its weights oscillate along
the sharpest directions between syncs, and its large local gradient enters everyone's all-reduced gradient (and
Adam's second moment); its first runs ruled that out (the all-reduced norm is plain's or below:
``benchmarks/results/gpu_h200/spread_eos/``). This script measures it, without torch.distributed: N copies of the model of
``benchmarks/gpt_multi_gpu.py`` (same init, same data streams as the ranks of a world-N run), each step every
replica's gradient on its own batch (its *local* norm logged), their mean clipped to 1.0 and given to every
replica's fused AdamW at its own LR (OneCycleLR at ``max_lr * rho_r``), the weights averaged every T steps (the Adam
moments are the same on every replica: the same gradients). Multipliers 1,1 is plain DDP over 2 ranks.

    python benchmarks/gpt_multi_gpu.py --prepare --cache /tmp/corpus
    python benchmarks/spread_eos.py --cache /tmp/corpus --multipliers 0.8,1.2 --T 25 --out a.json
    python benchmarks/spread_eos.py --report FOLDER     # the tables of every run in FOLDER (markdown)

Writes JSON: the command, config, versions, the final held-out loss of the averaged weights, and per step: every
replica's loss and local gradient norm, the mean gradient's norm.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpt_multi_gpu import VOCAB, evaluate, load  # noqa: E402

import hdet  # noqa: E402
from hdet.app.tasks import ByteGPT, param_groups  # noqa: E402


PHASES = ((0, 100), (100, 300), (300, 500), (500, 700), (700, 1000))  # 0-based steps: warm-up to step 300, then decay


def report(folder: Path) -> str:
    """Per run: the final held-out loss and, per phase of the run, the mean local gradient norm of the lowest- and
    the highest-multiplier replica and of their mean gradient; then, for steps 300-600, the same by the step's place
    in its window (k steps after a converge step)."""
    runs = {f.stem: json.loads(f.read_text()) for f in sorted(folder.glob("*.json")) if f.stem != "corpus"}
    runs = {k: r for k, r in runs.items() if "local_grad_norms" in r}
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    head = "| run | multipliers | T | seed | held-out loss | " + " | ".join(
        f"steps {a + 1}-{b}: low / high / mean" for a, b in PHASES) + " |"
    lines = [head, "|" + "---|" * (5 + len(PHASES))]
    for k, r in runs.items():
        L, M, arg = r["local_grad_norms"], r["mean_grad_norm"], r["args"]
        rho = [float(x) for x in arg["multipliers"].split(",")]
        lo, hi = rho.index(min(rho)), rho.index(max(rho))
        cells = [f"{mean([l[lo] for l in L[a:b]]):.2f} / {mean([l[hi] for l in L[a:b]]):.2f} / {mean(M[a:b]):.2f}"
                 for a, b in PHASES if b <= len(L)]
        lines.append(f"| {k} | {arg['multipliers']} | {arg['T']} | {arg['seed']} | {r['final_val_loss']:.4f} | "
                     + " | ".join(cells) + " |")
    lines += ["", "Steps 301-600 by the step's place in its window (k = 1: the first step after a converge step): local "
              "gradient norm of the lowest / highest multiplier's replica, and the highest's loss minus the lowest's", ""]
    for k, r in runs.items():
        rho = [float(x) for x in r["args"]["multipliers"].split(",")]
        T, lo, hi = r["args"]["T"], rho.index(min(rho)), rho.index(max(rho))
        if lo == hi:
            continue
        by: dict[int, list[tuple[float, float, float]]] = {}
        for s in range(300, min(600, len(r["losses"]))):
            L, X = r["local_grad_norms"][s], r["losses"][s]
            by.setdefault(s % T + 1, []).append((L[lo], L[hi], X[hi] - X[lo]))
        lines.append(f"* {k}: " + ", ".join(
            f"k {j}: {mean([v[0] for v in by[j]]):.2f} / {mean([v[1] for v in by[j]]):.2f} ({mean([v[2] for v in by[j]]):+.3f})"
            for j in sorted(by) if j in (1, 2, 3, 5, 10, 15, 25)))
    return "\n".join(lines)


def main() -> None:
    if "--report" in sys.argv:
        print(report(Path(sys.argv[sys.argv.index("--report") + 1])))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", default="/tmp/hdet_corpus")
    p.add_argument("--tiny", action="store_true", help="a small model (a CPU check of the script)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--global-batch", type=int, default=32, help="sequences per step, all replicas")
    p.add_argument("--max-lr", type=float, default=7.5e-4)
    p.add_argument("--multipliers", default="0.8,1.2", help="rho_r, one a replica (1,1: plain DDP over 2 ranks)")
    p.add_argument("--T", type=int, default=25)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-windows", type=int, default=256)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    ctx, width, layers, heads = (32, 32, 2, 2) if a.tiny else (1024, 768, 18, 12)
    rho = [float(x) for x in a.multipliers.split(",")]
    N = len(rho)
    cuda = torch.cuda.is_available() and not a.tiny
    dev = torch.device("cuda" if cuda else "cpu")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    train_data, val_data = load(Path(a.cache), dev)
    torch.manual_seed(a.seed)
    nets = [ByteGPT(ctx, width, layers, heads).to(dev)]
    nets += [copy.deepcopy(nets[0]) for _ in range(N - 1)]
    opts = [torch.optim.AdamW(param_groups(n, lambda s: "norm" if "ln" in s or "norm" in s else "weights", 0.1),
                              lr=a.max_lr, betas=(0.9, 0.95), fused=cuda) for n in nets]
    scheds = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=a.max_lr * r, total_steps=a.steps) for o, r in zip(opts, rho)]
    params = [list(n.parameters()) for n in nets]
    batch = a.global_batch // N
    gens = [torch.Generator(device=dev).manual_seed(1000 * a.seed + r) for r in range(N)]  # rank r's batches
    offsets = torch.arange(ctx + 1, device=dev)
    losses = torch.zeros(a.steps, N, device=dev)
    local = torch.zeros(a.steps, N, device=dev)
    mean_norm = torch.zeros(a.steps, device=dev)
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for step in range(a.steps):
        for r, net in enumerate(nets):
            i = torch.randint(0, train_data.numel() - ctx - 1, (batch, 1), device=dev, generator=gens[r])
            x = train_data[i + offsets].long()
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
                logits = net(x[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), x[:, 1:].reshape(-1))
            opts[r].zero_grad(set_to_none=True)
            loss.backward()
            losses[step, r] = loss.detach()
            local[step, r] = torch.linalg.vector_norm(torch.stack(torch._foreach_norm([q.grad for q in params[r]])))
        mean = [torch.stack([params[r][k].grad for r in range(N)]).mean(0) for k in range(len(params[0]))]
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(mean)))  # DDP's all-reduce, then the clip
        mean_norm[step] = norm
        torch._foreach_mul_(mean, torch.clamp(a.clip / (norm + 1e-6), max=1.0))
        for r in range(N):
            torch._foreach_copy_([q.grad for q in params[r]], mean)
            opts[r].step()
            scheds[r].step()
        if (step + 1) % a.T == 0 or step + 1 == a.steps:  # the converge step (Eq. 3)
            with torch.no_grad():
                for k in range(len(params[0])):
                    avg = torch.stack([params[r][k] for r in range(N)]).mean(0)
                    for r in range(N):
                        params[r][k].copy_(avg)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    same_moments = max(float((opts[r].state[q]["exp_avg"] - opts[0].state[q0]["exp_avg"]).abs().max())
                       for r in range(1, N) for q, q0 in zip(params[r], params[0])) if N > 1 else 0.0
    final = evaluate(nets[0], val_data, ctx, a.eval_windows, 32, 0, 1)
    rec = {"command": "python " + " ".join(sys.argv), "args": vars(a), "python": platform.python_version(),
           "torch": torch.__version__, "hdet": hdet.__version__,
           "device": torch.cuda.get_device_name() if cuda else "cpu", "seconds": seconds,
           "corpus": json.loads((Path(a.cache) / "meta.json").read_text()),
           "final_val_loss": final, "max_moment_difference": same_moments,
           "losses": losses.tolist(), "local_grad_norms": local.tolist(), "mean_grad_norm": mean_norm.tolist()}
    print(json.dumps({"final_val_loss": final, "seconds": seconds, "max_moment_difference": same_moments}))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rec))


if __name__ == "__main__":
    main()
