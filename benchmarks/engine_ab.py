"""The engine before and after a change, side by side in one process (issue 19): step times interleaved.

Separate processes on a shared GPU host differ by up to 1.6x in the same baseline (measured: a compiled
baseline at 12.6 and 21.5 ms a step in two calls), so this script loads the previous code as a second package
(``--old``: a folder holding the previous ``hdet`` package, e.g. ``git archive <rev> src | tar -x -C
data/old``, then ``--old data/old/src``) and times the baseline (one model at N x the batch), the engine from
the previous code and the engine from this one, in ``--rounds`` rounds of ``--steps`` steps each, alternating;
medians are reported. Tasks: the MLP of ``engine_mlp.py`` and the GPTs of ``engine_throughput.py``.
Writes JSON with the command, machine and versions.

    python benchmarks/engine_ab.py --old data/old/src --task mlp --out benchmarks/results/cpu/engine_ab_mlp.json
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import platform
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import hdet

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_throughput import SIZES, lm_loss, time_steps  # noqa: E402  (same folder)


def load_old(folder: str):
    """The ``hdet`` package in ``folder`` as a second package, ``hdet_old`` (its imports are relative)."""
    init = Path(folder) / "hdet" / "__init__.py"
    spec = importlib.util.spec_from_file_location("hdet_old", init, submodule_search_locations=[str(init.parent)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["hdet_old"] = mod
    spec.loader.exec_module(mod)
    return mod, importlib.import_module("hdet_old.engine")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", required=True, help="folder holding the previous hdet package")
    p.add_argument("--task", default="mlp", choices=["mlp", *SIZES])
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--batch", type=int, default=32, help="the MLP's examples a replica")
    p.add_argument("--compile", action="store_true", help="the engines with compile=True, the baseline compiled")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tf32", type=int, default=1, help="1: TF32 matmuls on a GPU (engine_throughput.py's setting)")
    p.add_argument("--mode", default="vmap", choices=["vmap", "merged"], help="both engines' mode")
    p.add_argument("--autocast", default="none", choices=["none", "bf16"],
                   help="bf16: every step (the baseline's and both engines') under torch.autocast(bfloat16)")
    p.add_argument("--baseline-one-thread", action="store_true",
                   help="also time the baseline under torch.autograd.set_multithreading_enabled(False)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    dev, N = torch.device(a.device), a.replicas
    if dev.type == "cuda" and a.tf32:  # as engine_throughput.py runs
        torch.backends.cuda.matmul.allow_tf32 = True
    old_hdet, old_engine = load_old(a.old)
    total = (a.steps + 10) * a.rounds * 3 + 100
    if a.task == "mlp":
        B = a.batch

        def model() -> nn.Module:
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                                 nn.Linear(256, 10)).to(dev)
        x, y = torch.randn(N, B, 784, device=dev), torch.randint(0, 10, (N, B), device=dev)
        batch, single = (x, y), (x.reshape(N * B, 784), y.reshape(N * B))

        def loss(m, b):
            return F.cross_entropy(m(b[0]), b[1])
    else:
        from hdet.app.tasks import ByteGPT
        s = SIZES[a.task]
        B = s["B"]

        def model() -> nn.Module:
            torch.manual_seed(0)
            return ByteGPT(s["ctx"], s["d"], s["layers"], s["heads"]).to(dev)
        data = torch.randint(0, 256, (N, B, s["ctx"] + 1), device=dev)
        batch, single, loss = data, data.reshape(N * B, -1), lm_loss
    base = model()
    opt = torch.optim.AdamW(base.parameters(), lr=1e-3, fused=dev.type == "cuda")
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=total)
    fwd = torch.compile(base) if a.compile else base

    def base_step():
        opt.zero_grad(set_to_none=True)
        (F.cross_entropy(fwd(single[0]), single[1]) if a.task == "mlp" else lm_loss(fwd, single)).backward()
        opt.step()
        sched.step()

    def engine(pkg, eng_mod):
        return eng_mod.ReplicaEngine(
            model(), N, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, fused=dev.type == "cuda"),
            lambda o, rep, m: pkg.OneCycleAutoLR(o, max_lr=1e-3, total_steps=total, ensemble_lr_spread_ratio=0.2,
                                                 model_sync_interval=25, replicas=rep, model=m),
            mode=a.mode, compile=a.compile)
    engines = {"old": engine(old_hdet, old_engine), "new": engine(hdet, importlib.import_module("hdet.engine"))}
    modes = {k: e.mode for k, e in engines.items()}
    steps = {"baseline": base_step, **{k: (lambda e=e: e.step(batch, loss, stacked=True)) for k, e in engines.items()}}
    if a.baseline_one_thread:  # the one model with its backward on the calling thread too (as hdet's engine runs its)
        steps["baseline_one_thread"] = lambda: _one_thread(base_step)
    if a.autocast == "bf16":
        steps = {k: (lambda f=f: _bf16(dev, f)) for k, f in steps.items()}
    times: dict[str, list[float]] = {k: [] for k in steps}
    for k, f in steps.items():  # warm-up (compilation)
        time_steps(f, 5, 1, dev)
    for _ in range(a.rounds):
        for k, f in steps.items():
            times[k].append(time_steps(f, 2, a.steps, dev))
    med = {k: statistics.median(v) for k, v in times.items()}
    rec = {"command": "python " + " ".join(sys.argv), "python": platform.python_version(), "torch": torch.__version__,
           "hdet": hdet.__version__, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else
           f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} threads)", "task": a.task, "N": N,
           **({"batch_per_replica": B} if a.task == "mlp" else {}),
           "compile": a.compile, "mode": a.mode, "autocast": a.autocast, "tf32": torch.backends.cuda.matmul.allow_tf32,
           "seconds_per_step_median": med, "seconds_per_step_all": times,
           "ratio_to_baseline": {k: med["baseline"] / med[k] for k in engines},
           **({"ratio_to_baseline_one_thread": {k: med["baseline_one_thread"] / med[k] for k in engines}}
              if a.baseline_one_thread else {}), "new_over_old": med["old"] / med["new"],
           "optimizer_path": {k: e.optimizer_path for k, e in engines.items()},
           "engine_mode": {k: (modes[k], e.mode) for k, e in engines.items()}}  # (at the start, at the end: a fallback)
    print(json.dumps({k: rec[k] for k in ("task", "compile", "mode", "autocast", "ratio_to_baseline",
                                          "ratio_to_baseline_one_thread", "new_over_old") if k in rec}))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rec, indent=1))


def _one_thread(step) -> None:
    with torch.autograd.set_multithreading_enabled(False):
        step()


def _bf16(dev: torch.device, step) -> None:
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        step()


if __name__ == "__main__":
    main()
