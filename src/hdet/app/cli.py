"""``hdet``: train on an embedded default task, plot runs, compare the paper's ablations.

    hdet train                               # 4 replicas in one process, byte-level GPT on the stdlib
    torchrun --nproc-per-node 2 -m hdet train  # the same under real DDP (gloo on CPU, NCCL on GPUs)
    hdet plot runs/latest                    # loss.png and lr.png
    hdet compare                             # the paper's six ablations (Table 1), with plots
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, NoReturn

from . import stop
from .options import RunConfig, RunError, check, unused

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not usage + error
        self.exit(2, f"hdet: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:
        """argparse's, but an unknown option of a command points at that command's help (``hdet train --help``, where
        the options are), not at ``hdet --help``."""
        a, extra = self.parse_known_args(args, namespace)
        if extra:
            commands = next((x.choices for x in self._actions if isinstance(x, argparse._SubParsersAction)), {})
            commands.get(getattr(a, "cmd", None), self).error(f"unrecognized arguments: {' '.join(extra)}")
        return a


COMPARE_SETS = ("max_lr", "auto_lr", "warm_init", "init_from", "optimizer", "prodigy_safeguard",  # compare sets these
                "range_test", "range_backoff",  # (the range test is not one of the paper's configurations)
                "resume", "checkpoint_every",  # (a comparison starts afresh and cannot resume: its runs write no checkpoints)
                "lr_sweep", "lr_sweep_then", "lr_sweep_points", "lr_sweep_factor")  # (compare's rows are the paper's configurations over its own LR grid)


class _Inverted(argparse.BooleanOptionalAction):
    """``--grad-sync`` / ``--no-grad-sync`` into a field that means the opposite (``local``)."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, bool(option_string and option_string.startswith("--no-")))


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows every default in the flag's own terms: a help text that states its default keeps only that one
    (BooleanOptionalAction appends the field's raw value too), and ``--grad-sync``'s is the flag, not ``local``'s."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        raw = " (default: %(default)s)"
        if text.endswith(raw):  # added by BooleanOptionalAction
            text = text[: -len(raw)]
        if isinstance(action, _Inverted):
            return text + f" (default: {action.option_strings[1] if action.default else action.option_strings[0]})"
        if "(default" in text:
            return text
        return super()._get_help_string(argparse.Action(action.option_strings, action.dest, default=action.default,
                                                        help=text, nargs=action.nargs))


def _train_args(p: argparse.ArgumentParser, steps: int, out: str, compare: bool = False) -> None:
    """A flag for every RunConfig field with command-line metadata (:func:`hdet.app.options._cli`); ``compare``:
    without those that ``hdet compare`` sets per configuration itself."""
    for f in dataclasses.fields(RunConfig):
        cli = f.metadata.get("cli")
        if cli is None or (compare and f.name in COMPARE_SETS):
            continue
        kw = dict(cli["kw"])
        # hdet compare reproduces the paper's table: its HDET rows are the paper's (no stability guard)
        default = {"steps": steps, "out": out, **({"on_runaway": "ignore"} if compare else {})}.get(f.name, f.default)
        flag = cli["flag"] or "--" + f.name.replace("_", "-")
        if kw.pop("invert", False):
            kw.update(action=_Inverted, default=default)
        elif kw.pop("comma", False):
            kw.update(type=lambda s: tuple(x.strip() for x in s.split(",") if x.strip()), default=default)
        elif "action" in kw:
            kw.update(default=default)
        elif f.type in ("bool", "bool | None"):
            kw.update(action=argparse.BooleanOptionalAction, default=default)
        else:
            kw.update(type=_TYPES[f.type.split(" |")[0]], default=default)
        p.add_argument(flag, dest=f.name, help=cli["help"], **kw)


_TYPES = {"int": int, "float": float, "str": str}


def _config(a: argparse.Namespace) -> RunConfig:
    return RunConfig(**{f.name: getattr(a, f.name) for f in dataclasses.fields(RunConfig) if hasattr(a, f.name)})


def _cmd_train(a: argparse.Namespace, argv: list[str]) -> int:
    from .run import train

    cfg = _config(a)
    check(cfg)  # a bad value is an error before any warning (train checks it again)
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ  # (as train() decides it)
    world = int(os.environ["WORLD_SIZE"]) if torchrun and os.environ["WORLD_SIZE"].isdigit() else None
    for what in unused(cfg, world) if os.environ.get("RANK", "0") == "0" else ():
        print(f"hdet: warning: {what} has no effect", file=sys.stderr)
    with contextlib.ExitStack() as held:  # (the folder held until the plots are written: a second run cleared it
        return _trained(a, train(cfg, argv=argv, held=held))  # while this one wrote them; a review)


def _trained(a: argparse.Namespace, s: dict[str, Any]) -> int:
    """What ``hdet train`` says once its run is done (rank 0: the summary and plots)."""
    from .plot import plot_dir

    if s.get("config") is None:  # not rank 0
        return 0
    resumed = f" (resumed from step {s['resumed_from']})" if "resumed_from" in s else ""
    msg = (f"{s['mode']}: {s['steps_done']} steps x {s['replicas']} replicas{resumed} in {s['train_seconds']:.1f}s "
           f"({s['steps_per_second']:.1f} steps/s); ")
    if s["crashed"]:
        print(msg + f"crashed at {s['crashed']}")
        return 1
    final = s.get("final_metrics") or {}
    full, acc = final.get("val_loss_full"), final.get("test_accuracy")
    held_out = "validation" if acc is None else "test"  # (Fashion-MNIST has no validation split: its t10k test set)
    print(msg + f"train loss {s['final_train_loss']:.4f}, {held_out} loss {s['final_val_loss']:.4f} (the fixed "
          f"{held_out} batches" + (f"; {full:.4f} over {final.get('val_tokens')} held-out tokens" if full is not None
                                   else "") + (f"; test accuracy {acc:.2f}% over the whole test set" if acc is not None
                                               else "") + f") -> {a.out}")
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


def _held_out(final: dict[str, Any]) -> tuple[float | None, float | None]:
    """A row's loss on the whole held-out split and (Fashion-MNIST) its accuracy, from its summary's final metrics."""
    return final.get("val_loss_full", final.get("test_loss")), final.get("test_accuracy")


def _cmd_compare(a: argparse.Namespace, argv: list[str]) -> int:
    from .compare import compare

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # (its pre-training row is one replica: it said --replicas)
        raise RunError("Expected `hdet compare` in one process (its rows run in the one-process engine, the "
                       f"pre-training on one replica), but it runs under torchrun (world size {os.environ['WORLD_SIZE']}); "
                       "run it without torchrun (--replicas sets the rows' replicas)")
    if not 0 < a.lr_low < a.lr_high:
        raise RunError(f"Expected 0 < --lr-low < --lr-high, but got {a.lr_low} and {a.lr_high}")
    if a.pretrain_steps < 1:
        raise RunError(f"Expected --pretrain-steps >= 1, but got {a.pretrain_steps}")
    cfg = _config(a)
    with contextlib.ExitStack() as held:  # (its --out held until the table and plots are written)
        return _compared(a, compare(cfg, a.lr_low, a.lr_high, a.pretrain_steps, held=held))


def _compared(a: argparse.Namespace, result: dict[str, Any]) -> int:
    """What ``hdet compare`` says once its rows are done: the table, then the plots."""
    from .plot import plot_dir

    held = [_held_out(r.get("final_metrics") or {}) for r in result["runs"]]  # (loss, accuracy or None)
    best = min((k for k, h in enumerate(held) if h[0] is not None and math.isfinite(h[0])), key=lambda k: held[k][0],
               default=None)
    rows = [(r["config"] + (" *" if k == best else ""), r["description"], f"{r['lr']:g}",
             (f"{r['final_train_loss']:.4f}" if r["final_train_loss"] is not None else "-")
             + (" †" if r["crashed"] else ""),
             f"{r['final_val_loss']:.4f}" if r["final_val_loss"] is not None else "-",
             (f"{h[0]:.4f}" if h[0] is not None else "-") + (f" ({h[1]:.2f}%)" if h[1] is not None else ""),
             f"{r['train_seconds']:.0f}")
            for k, (r, h) in enumerate(zip(result["runs"], held))]
    cols = ("Config", "Description", "LR", "Train loss", "Fixed batches", "Held-out", "Time (s)")
    title = f"Table 1 layout, our numbers: {result['title']}"
    notes = [*result["notes"], "† crashed (non-finite loss or weights); * the best held-out loss."]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text without rich
        print(title)
        for row in [cols, *rows]:
            print("  ".join(f"{c:<38}" if k == 1 else f"{c:<20}" if k == 0 else f"{c:>10}" for k, c in enumerate(row)))
        print("\n".join(f"  {n}" for n in notes))
    else:
        t = Table(title=title)
        for col in cols:
            t.add_column(col, justify="left" if col in ("Config", "Description") else "right")
        for row in rows:
            t.add_row(*row)
        con = Console(width=None if sys.stdout.isatty() else 120)
        con.print(t)
        for n in notes:
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
    fmt = dict(formatter_class=_Help)  # --help shows every default
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


def entry() -> None:
    """The ``hdet`` command and ``python -m hdet``: :func:`main`, then, under torchrun, an exit without C++
    destructors (the run's files are written and closed by then): torch's gloo can abort a process at interpreter
    exit after a finished run (pytorch/pytorch#179291), which torchrun then reports as the run's failure."""
    rc = main()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    sys.exit(rc)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    # SIGTERM stops a one-process run as Ctrl-C does (a scheduler's kill). Not under torchrun: it stops the other
    # workers with SIGTERM when one fails, and a Python handler runs only once a blocked collective returns (the rank
    # would wait there for torchrun's SIGKILL instead of ending at once)
    handle = threading.current_thread() is threading.main_thread() and "WORLD_SIZE" not in os.environ
    if handle:
        stop.requested = False  # (a SIGTERM of an earlier main() in this process: it stopped every later run, an audit)
    before = signal.signal(signal.SIGTERM, stop.on_sigterm) if handle else None
    try:
        return _run(a, argv)
    finally:
        if handle:
            signal.signal(signal.SIGTERM, before if before is not None else signal.SIG_DFL)


def _run(a: argparse.Namespace, argv: list[str]) -> int:
    from .tasks import TaskError

    try:
        return {"train": _cmd_train, "plot": _cmd_plot, "compare": _cmd_compare}[a.cmd](a, argv)
    except BrokenPipeError:  # `hdet ... | head`: the reader left; say nothing more (as a tool killed by SIGPIPE)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes stdout
        return 141
    except (RunError, TaskError, ValueError, OSError) as e:  # OSError: missing files, permissions, a full disk
        msg = f"{e.strerror}: {e.filename}" if isinstance(e, OSError) and e.strerror and e.filename else str(e)
        print(f"hdet: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        saved = a.cmd == "train" and any(p for g in ("checkpoint*.pt", "sweep*.pt") for p in Path(a.out).glob(g))
        print(("hdet: terminated" if isinstance(e, stop.Terminated) else "hdet: interrupted") +
              ("; the same command with --resume goes on from its last checkpoint" if saved else ""), file=sys.stderr)
        return 143 if isinstance(e, stop.Terminated) else 130


if __name__ == "__main__":
    sys.exit(main())
