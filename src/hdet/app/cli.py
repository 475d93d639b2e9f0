"""``hdet``: train on an embedded default task, plot runs, compare the paper's ablations.

    hdet train                               # 4 replicas in one process, byte-level GPT on the stdlib
    torchrun --nproc-per-node 2 -m hdet train  # the same under real DDP (gloo on CPU, NCCL on GPUs)
    hdet plot runs/latest                    # loss.png and lr.png
    hdet compare                             # the paper's six ablations (Table 1), with plots
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, NoReturn

from .run import RunConfig, RunError

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not usage + error
        self.exit(2, f"hdet: error: {message} (see {self.prog} --help)\n")


COMPARE_SETS = ("max_lr", "auto_lr", "warm_init", "init_from", "optimizer")  # compare sets these per configuration


def _train_args(p: argparse.ArgumentParser, steps: int, out: str, compare: bool = False) -> None:
    """The run's options; ``compare``: without those that ``hdet compare`` sets per configuration itself."""
    d = RunConfig()
    add = p.add_argument

    def only_train(*args: Any, **kw: Any) -> None:
        if not compare:
            add(*args, **kw)

    p.add_argument("--task", default=d.task, help="bytes (stdlib byte-level GPT) or fashion (Fashion-MNIST CNN)")
    p.add_argument("--data", default=None, help="Fashion-MNIST folder (default /usr/share/datasets/fashion-mnist)")
    p.add_argument("--replicas", type=int, default=None, help="N in one process (default 4); under torchrun: "
                   "the world size")
    p.add_argument("--steps", type=int, default=steps, help="optimizer steps of the run")
    p.add_argument("--batch", type=int, default=d.batch, help="examples per replica per step")
    p.add_argument("--alpha", type=float, default=d.alpha, help="LR spread ratio (Eq. 1); 0 = plain data parallel")
    p.add_argument("--T", type=int, default=d.T, help="sync interval: average weights every T steps")
    only_train("--auto-lr", action=argparse.BooleanOptionalAction, default=False, help="run the auto-LR controller")
    p.add_argument("--controller", default=d.controller, help="auto-LR controller: fit (hdet's, the default: "
                   "probe loss at each replica's mean iterate, multiplicative correction of the schedule) or paper "
                   "(Eqs. 4-8)")
    p.add_argument("--probe-batches", type=int, default=d.probe_batches, help="fit controller: batches per probe")
    p.add_argument("--tie-lr-groups", action=argparse.BooleanOptionalAction, default=d.tie_lr_groups,
                   help="one LR multiplier per replica for all param groups (default: on with the fit controller, "
                   "as measured; otherwise one multiplier per group, as in the paper)")
    p.add_argument("--grad-sync", action=argparse.BooleanOptionalAction, default=True, help="average gradients every "
                   "step (DDP); --no-grad-sync is the local mode: replicas meet only at converge steps, every T steps")
    p.add_argument("--warmup", type=int, default=None, help="auto-LR warmup steps (default: the end of OneCycle's warm-up, "
                   "30%% of the run, for the fit controller; half the run for the paper's)")
    only_train("--max-lr", type=float, default=d.max_lr, help="OneCycle's peak learning rate")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW's decoupled weight decay "
                   "(none on norms and biases)")
    p.add_argument("--dropout", type=float, default=d.dropout, help="dropout probability of the model")
    only_train("--warm-init", action=argparse.BooleanOptionalAction, default=False, help="Eq. 10 noise")
    only_train("--init-from", default=None, help="start from this model.pt")
    p.add_argument("--ctx", type=int, default=d.ctx, help="bytes task: context length")
    p.add_argument("--width", type=int, default=d.width, help="model width")
    p.add_argument("--layers", type=int, default=d.layers, help="bytes task: transformer layers")
    p.add_argument("--device", default=d.device, help="auto, cpu, cuda or cuda:N")
    p.add_argument("--mode", default=d.mode, help="engine: auto (vmap, loop if it cannot), vmap or loop")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the model, the data and the permutations")
    p.add_argument("--out", default=out, help="output folder")
    p.add_argument("--eval-every", type=int, default=None, help="validate every ~N steps (at syncs; default T)")
    p.add_argument("--tensorboard", action="store_true", help="also write TensorBoard events to OUT/tb")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument("--explore", default="", help="also explore, comma-separated: lr-groups (per-group LRs, always on "
                   "when alpha > 0), weight-decay (per group, x2../2), dropout (+-0.05), grad-clip (norm x2../2)")
    p.add_argument("--clip", type=float, default=1.0, help="base gradient-clipping norm for --explore grad-clip")
    only_train("--optimizer", default=d.optimizer, help="adamw, or a learning-rate-free peer to compare with "
                   "(pip install 'hdet[bench]'): dadapt-adam, prodigy (at --max-lr 1, OneCycle shape), "
                   "schedulefree-adamw (constant LR after its own warm-up); peers need --alpha 0")


def _config(a: argparse.Namespace) -> RunConfig:
    d = RunConfig()
    for name in COMPARE_SETS:  # absent from compare's parser
        if not hasattr(a, name):
            setattr(a, name, getattr(d, name))
    return RunConfig(task=a.task, data=a.data, replicas=a.replicas, steps=a.steps, batch=a.batch, alpha=a.alpha,
                     T=a.T, auto_lr=a.auto_lr, warmup=a.warmup, controller=a.controller,
                     probe_batches=a.probe_batches, tie_lr_groups=a.tie_lr_groups, local=not a.grad_sync, max_lr=a.max_lr, weight_decay=a.weight_decay,
                     dropout=a.dropout, warm_init=a.warm_init, init_from=a.init_from, ctx=a.ctx, width=a.width,
                     layers=a.layers, device=a.device, mode=a.mode, seed=a.seed, out=a.out,
                     eval_every=a.eval_every, tensorboard=a.tensorboard, progress=a.progress,
                     explore=tuple(x.strip() for x in a.explore.split(",") if x.strip()), clip=a.clip,
                     optimizer=a.optimizer)


def _cmd_train(a: argparse.Namespace, argv: list[str]) -> int:
    from .plot import plot_dir
    from .run import train

    s = train(_config(a), argv=argv)
    if s.get("config") is None:  # not rank 0
        return 0
    msg = (f"{s['mode']}: {s['steps_done']} steps x {s['replicas']} replicas in {s['train_seconds']:.1f}s "
           f"({s['steps_per_second']:.1f} steps/s); ")
    if s["crashed"]:
        print(msg + f"crashed at {s['crashed']}")
        return 1
    print(msg + f"train loss {s['final_train_loss']:.4f}, validation loss {s['final_val_loss']:.4f} -> {a.out}")
    try:
        paths = plot_dir(a.out)
        print("plots: " + ", ".join(str(p) for p in paths))
    except ImportError:
        print("plots skipped: matplotlib is not installed (pip install matplotlib)")
    return 0


def _cmd_plot(a: argparse.Namespace, argv: list[str]) -> int:
    from .plot import plot_dir, plot_runs

    if a.out is not None and len(a.run_dirs) > 1:  # one folder: the runs overlaid, nothing overwritten
        paths = plot_runs(a.run_dirs, a.out)
    else:
        paths = [p for d in a.run_dirs for p in plot_dir(d, a.out)]
    for p in paths:
        print(p)
    return 0


def _cmd_compare(a: argparse.Namespace, argv: list[str]) -> int:
    from .compare import compare
    from .plot import plot_dir

    if not 0 < a.lr_low < a.lr_high:
        raise RunError(f"Expected 0 < --lr-low < --lr-high, but got {a.lr_low} and {a.lr_high}")
    if a.pretrain_steps < 1:
        raise RunError(f"Expected --pretrain-steps >= 1, but got {a.pretrain_steps}")
    cfg = _config(a)
    result = compare(cfg, a.lr_low, a.lr_high, a.pretrain_steps)
    rows = [(r["config"], r["description"], f"{r['lr']:g}",
             (f"{r['final_train_loss']:.4f}" if r["final_train_loss"] is not None else "-")
             + (" †" if r["crashed"] else ""),
             f"{r['final_val_loss']:.4f}" if r["final_val_loss"] is not None else "-", f"{r['train_seconds']:.0f}")
            for r in result["runs"]]
    cols = ("Config", "Description", "LR", "Train loss", "Val loss", "Time (s)")
    title = f"Table 1 layout, our numbers: {result['title']}"
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text without rich
        print(title)
        for row in [cols, *rows]:
            print("  ".join(f"{c:<38}" if k == 1 else f"{c:<20}" if k == 0 else f"{c:>10}" for k, c in enumerate(row)))
        lines = [*result["notes"], "† crashed (non-finite loss or weights)."]
        print("\n".join(f"  {n}" for n in lines))
    else:
        t = Table(title=title)
        for col in cols:
            t.add_column(col, justify="left" if col in ("Config", "Description") else "right")
        for row in rows:
            t.add_row(*row)
        con = Console(width=None if sys.stdout.isatty() else 120)
        con.print(t)
        for n in [*result["notes"], "† crashed (non-finite loss or weights)."]:
            con.print(f"  {n}")
    for p in plot_dir(a.out):
        print(p)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    p = _Parser(prog="hdet", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"hdet {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser, metavar="{train,plot,compare}",
                           title="commands")
    fmt = dict(formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # --help shows every default
    t = sub.add_parser("train", help="train on an embedded task (no download)", **fmt)
    _train_args(t, steps=RunConfig().steps, out="runs/latest")
    pl = sub.add_parser("plot", help="loss.png and lr.png for run folders", **fmt)
    pl.add_argument("run_dirs", nargs="+", help="run folders written by hdet train")
    pl.add_argument("--out", default=None, help="write the PNGs here, several runs overlaid in one loss.png "
                    "(default: into each run folder)")
    c = sub.add_parser("compare", help="the paper's six ablation configurations (Table 1)", **fmt)
    _train_args(c, steps=200, out="runs/compare", compare=True)
    c.add_argument("--lr-low", type=float, default=1e-3, help="Baseline-Low's max LR")
    c.add_argument("--lr-high", type=float, default=9e-3, help="everyone else's max LR (the paper: 9x low)")
    c.add_argument("--pretrain-steps", type=int, default=100, help="pre-training for the warm-init checkpoint")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    from .tasks import TaskError

    try:
        return {"train": _cmd_train, "plot": _cmd_plot, "compare": _cmd_compare}[a.cmd](a, argv)
    except (RunError, TaskError, ValueError, OSError) as e:  # OSError: missing files, permissions, a full disk
        msg = f"{e.strerror}: {e.filename}" if isinstance(e, OSError) and e.strerror and e.filename else str(e)
        print(f"hdet: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hdet: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
