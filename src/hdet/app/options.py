"""The options of one ``hdet train`` run: :class:`RunConfig` (each field declared once, with its flag's
help), its checks, and the device choice."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..controller import CONTROLLERS
from ..engine import MODES
from ..sweep import MIN_STEPS
from .tasks import gpt_heads

__all__ = ["RunConfig", "RunError", "resolve_device", "check", "resolve", "default_warmup", "sweep_steps",
           "after_sweep", "OPTIMIZERS", "EXPLORE", "MAX_CTX"]

OPTIMIZERS = ("adamw", "dadapt-adam", "prodigy", "schedulefree-adamw", "mechanic-adamw")
EXPLORE = ("lr-groups", "weight-decay", "dropout", "grad-clip")


class RunError(ValueError):
    """A run cannot start with what was given (the CLI prints it as one line)."""


def _cli(help: str, flag: str | None = None, **argparse_kw: Any) -> dict[str, Any]:
    """A RunConfig field's command-line flag: its help text (and, where the default does not fit, its flag
    name and argparse keywords). ``hdet.app.cli`` builds every flag from these."""
    return {"cli": {"help": help, "flag": flag, "kw": argparse_kw}}


@dataclass
class RunConfig:
    """One training run of the ``hdet`` command: every field with ``_cli`` metadata is a flag of ``hdet train``."""

    task: str = field(default="bytes", metadata=_cli("bytes (stdlib byte-level GPT) or fashion (Fashion-MNIST CNN)"))
    data: str | None = field(default=None, metadata=_cli(
        "Fashion-MNIST folder (default /usr/share/datasets/fashion-mnist)"))
    replicas: int | None = field(default=None, metadata=_cli("N in one process (default 4); under torchrun: the "
                                                             "world size"))
    steps: int = field(default=400, metadata=_cli("optimizer steps of the run"))
    batch: int = field(default=16, metadata=_cli("examples per replica per step"))
    alpha: float | None = field(default=None, metadata=_cli(
        "LR spread ratio (Eq. 1); 0 = plain data parallel (default 0.2, and 0 with --lr-sweep: after a sweep the "
        "spread gained nothing on the small tasks and cost about 2%% at 128M, docs/auto-lr.md)"))
    T: int = field(default=25, metadata=_cli("sync interval: average weights every T steps"))
    auto_lr: bool = field(default=False, metadata=_cli("run the auto-LR controller"))
    controller: str = field(default="fit", metadata=_cli(
        "auto-LR controller: fit (hdet's, the default: probe loss at each replica's mean iterate, multiplicative "
        "correction of the schedule) or paper (Eqs. 4-8)"))
    probe_batches: int = field(default=4, metadata=_cli("fit controller: batches per probe"))
    tie_lr_groups: bool | None = field(default=None, metadata=_cli(
        "one LR multiplier per replica for all param groups (default: on with the fit controller, as measured, and "
        "with dadapt-adam and prodigy, which take one LR for all groups; otherwise one multiplier per group, as in "
        "the paper)"))
    local: bool = field(default=False, metadata=_cli(
        "average gradients every step (DDP); --no-grad-sync is the local mode: replicas share no gradients and "
        "average their weights at converge steps, every T steps (under torchrun the logged loss is still averaged "
        "over the ranks at each logged step)", flag="--grad-sync", invert=True))
    on_runaway: str = field(default="recover", metadata=_cli(
        "recover: a replica whose finite window loss runs away is reset like a non-finite one and the LR schedule "
        "is cut (also when the ensemble's loss rises); ignore: the paper's HDET"))
    lr_cut: float = field(default=0.7, metadata=_cli(
        "with --on-runaway recover: the LR schedule's cut at such an event, for the rest of the run (the k-th event's "
        "is FRAC ** k)", metavar="FRAC"))
    lr_cut_after: int = field(default=1, metadata=_cli(
        "with --on-runaway recover: the first N such events go back without cutting the LR (a spike is often its "
        "batches', and the data moves on past them); the k-th after them cuts by --lr-cut ** k (1: measured on the "
        "GPT recipe's 21 event runs, 0.57%% better than 0 on average: docs/reliability.md)", metavar="N"))
    judge_steps: int = field(default=25, metadata=_cli(
        "with --on-runaway recover: runaways and rises are judged over at least N steps (windows of a shorter --T "
        "pooled: 5-step windows set the rule off on their noise; 1: every window alone)", metavar="N"))
    range_test: bool = field(default=False, metadata=_cli(
        "an LR range test during OneCycle's warm-up: --max-lr is a first guess; the LR ramps from 1/25 of the "
        "schedule past it until the loss's progress collapses or it turns unstable, then every replica goes back to "
        "the ramp's state at the new peak, the last good LR / --range-backoff (measured: docs/auto-lr.md)"))
    lr_sweep: float = field(default=0.0, metadata=_cli(
        "an LR sweep first: N independent runs of FRAC x --steps steps, one per replica on its own batches, at LRs "
        "about 1/32x-32x around --max-lr / sqrt(max(N, 8)) (and up to 3 rounds of runs beyond them where the best is near an "
        "end: each costs a run's steps more, a round of them under torchrun), judged by their training loss over their "
        "last tenth (hdet.lr_sweep); then the run at sqrt(max(N, 8)) x the pick (--lr-sweep-factor; see --lr-sweep-then; "
        "measured with 0.2: "
        "docs/auto-lr.md)",
        metavar="FRAC"))
    lr_sweep_points: int | None = field(default=None, metadata=_cli(
        "with --lr-sweep: the grid's LRs (default one a replica; more run N at a time, each round a sweep run's time "
        "more: 8 with 2 replicas gives LRs 2.7x apart instead of 1024x)", metavar="K"))
    lr_sweep_factor: float | None = field(default=None, metadata=_cli(
        "with --lr-sweep: the run's peak LR over the sweep's pick (default sqrt(max(N, 8)): a sweep run's batch is 1/N "
        "of the run's, Adam's best LR grows about as the square root of the batch, and short runs pick low: measured "
        "best on the two small tasks at N = 8 and at N = 2, and at 128M on 2 GPUs: docs/auto-lr.md)", metavar="F"))
    lr_sweep_then: str = field(default="restart", metadata=_cli(
        "with --lr-sweep: restart (the run trains all --steps from the initial weights: the sweep's steps come on "
        "top) or continue (the rest of --steps from the best sweep run's weights: no extra steps but the sweep's rounds "
        "beyond its first, and measured 0.5-2%% worse on the GPT, 0.3-0.5 point on Fashion-MNIST)",
        choices=("restart", "continue")))
    range_backoff: float = field(default=2.0, metadata=_cli(
        "range test: the peak LR is the LR of the last window that made progress over this"))
    pct_start: float = field(default=0.3, metadata=_cli(
        "OneCycle's warm-up, a fraction of the run's steps (also each LR sweep run's, of its own)"))
    warmup: int | None = field(default=None, metadata=_cli(
        "auto-LR warmup steps, and the range test's length (default: OneCycle's warm-up, --pct-start of the run, "
        "rounded down to a multiple of --T, for the fit controller and the range test; half the run for the paper's)"))
    max_lr: float | None = field(default=None, metadata=_cli(
        "OneCycle's peak learning rate (default 3e-3; with --optimizer dadapt-adam, prodigy or mechanic-adamw 1, their documented "
        "use: it multiplies their own estimate of the step size)"))
    weight_decay: float = field(default=0.01, metadata=_cli("AdamW's decoupled weight decay (none on the norm layers; biases are decayed)"))
    dropout: float = field(default=0.0, metadata=_cli("dropout probability of the model"))
    warm_init: bool = field(default=False, metadata=_cli("Eq. 10 noise"))
    init_from: str | None = field(default=None, metadata=_cli("start from this model.pt"))
    ctx: int = field(default=64, metadata=_cli("bytes task: context length"))
    width: int = field(default=128, metadata=_cli(
        "model width: the bytes GPT's channels; the fashion CNN's first convolution has width // 4 channels (at least 8), "
        "its second twice that"))
    layers: int = field(default=2, metadata=_cli("bytes task: transformer layers"))
    device: str = field(default="auto", metadata=_cli("auto, cpu, cuda or cuda:N"))
    mode: str = field(default="auto", metadata=_cli(
        "engine: auto (vmap, loop if it cannot), vmap, loop or merged (the replicas' batches as one batch through the "
        "model's standard layers, faster on a GPU; vmap where the model cannot: docs/engine.md)"))
    compile: bool = field(default=False, metadata=_cli(
        "engine: run the vmapped model through torch.compile (on a GPU 1.6-2.7x faster for the small GPTs of docs/engine.md; runs "
        "eagerly, with a warning, where compile fails)"))
    cuda_graph: bool = field(default=False, metadata=_cli(
        "engine on a GPU (not --mode loop, not --compile): replay the replicas' forward and backward from a CUDA graph "
        "(docs/engine.md)"))
    seed: int = field(default=0, metadata=_cli("seed of the model, the data and the permutations"))
    out: str = field(default="runs/latest", metadata=_cli("output folder"))
    eval_every: int | None = field(default=None, metadata=_cli("validate every ~N steps, at syncs (default: T)"))
    tensorboard: bool = field(default=False, metadata=_cli("also write TensorBoard events to OUT/tb",
                                                           action="store_true"))
    progress: bool = field(default=True, metadata=_cli("no progress bar (default: a progress bar on the terminal)",
                                                          flag="--no-progress", action="store_false"))
    checkpoint_every: int | None = field(default=None, metadata=_cli(
        "save a checkpoint every N steps, OUT/checkpoint.pt (under torchrun checkpoint-rank<r>.pt), for --resume "
        "(default: every tenth of the run; 0: never)"))
    resume: bool = field(default=False, metadata=_cli(
        "continue the run in --out from its last checkpoint, with the same options: it goes on as the uninterrupted "
        "run would (on the CPU bit for bit)", action="store_true"))
    explore: tuple[str, ...] = field(default=(), metadata=_cli(
        "also explore, comma-separated: lr-groups (per-group LRs, always on when alpha > 0), weight-decay (per "
        "group, x2../2), dropout (+-0.05), grad-clip (norm x2../2)", comma=True))
    clip: float = field(default=1.0, metadata=_cli("base gradient-clipping norm for --explore grad-clip"))
    optimizer: str = field(default="adamw", metadata=_cli(
        "adamw, or a learning-rate-free peer to compare with (pip install -e '.[bench]' in the clone): dadapt-adam, prodigy (at "
        "--max-lr 1, OneCycle shape; under a spread the multiplier scales their step), schedulefree-adamw "
        "(constant LR after its own warm-up; needs --alpha 0; no stability guard), mechanic-adamw (Mechanic's tuner over AdamW at --max-lr 1, "
        "OneCycle shape; needs --alpha 0)"))
    prodigy_safeguard: bool = field(default=False, metadata=_cli(
        "prodigy: safeguard_warmup=True, prodigyopt's advice under a warm-up (off by default: with OneCycle's warm-up "
        "its step came out 4-13x below the grid's best LR and it ended worse on both evidence tasks, docs/auto-lr.md)"))
    eq8: str = "decay"
    nu: float = 0.01  # Eq. 10's noise scale with --warm-init
    log_every: int | None = None  # steps between records; None: steps // 100, between 1 and 10 (a short run's warm-up shows)
    eval_batches: int = 8
    data_bytes: int = 4_000_000
    label: str | None = None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise RunError(f"Expected --device auto, cpu, cuda or cuda:N, but got {name!r}") from None
    if dev.type not in ("cpu", "cuda"):  # (meta, mps, xpu: a traceback, after the earlier run was cleared: an audit)
        raise RunError(f"Expected --device auto, cpu, cuda or cuda:N, but got {name!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RunError(f"Expected a CUDA device for --device {name}, but torch sees none")
    return dev


def check(cfg: RunConfig) -> None:
    for name in ("steps", "batch", "ctx", "width", "layers", "T", "log_every", "eval_batches", "probe_batches"):
        v = getattr(cfg, name)
        if name == "log_every" and v is None:
            continue
        if not isinstance(v, int) or v < 1:
            raise RunError(f"Expected --{name.replace('_', '-')} to be a positive integer, but got {v!r}")
    if cfg.eval_every is not None and (not isinstance(cfg.eval_every, int) or cfg.eval_every < 1):
        raise RunError(f"Expected --eval-every to be a positive integer, but got {cfg.eval_every!r}")
    if not (cfg.weight_decay >= 0 and math.isfinite(cfg.weight_decay)):
        raise RunError(f"Expected --weight-decay >= 0, but got {cfg.weight_decay}")
    if cfg.ctx > MAX_CTX:
        raise RunError(f"Expected --ctx at most {MAX_CTX} (the embedded tasks' models are small; attention memory "
                       f"grows with ctx squared), but got {cfg.ctx}")
    if cfg.replicas is not None and cfg.replicas < 1:
        raise RunError(f"Expected --replicas to be at least 1, but got {cfg.replicas}")
    if cfg.alpha is not None and not 0 <= cfg.alpha < 1:
        raise RunError(f"Expected --alpha in [0, 1), but got {cfg.alpha}")
    if cfg.max_lr is not None and not (cfg.max_lr > 0 and math.isfinite(cfg.max_lr)):
        raise RunError(f"Expected --max-lr > 0, but got {cfg.max_lr}")
    if not 0 <= cfg.dropout < 1:
        raise RunError(f"Expected --dropout in [0, 1), but got {cfg.dropout}")
    if cfg.controller not in CONTROLLERS:
        raise RunError(f"Expected --controller {' or '.join(CONTROLLERS)}, but got {cfg.controller!r}")
    if cfg.on_runaway not in ("ignore", "recover"):
        raise RunError(f"Expected --on-runaway ignore or recover, but got {cfg.on_runaway!r}")
    if not 0 < cfg.lr_cut <= 1:
        raise RunError(f"Expected --lr-cut in (0, 1] (the LR schedule's factor at a recovery), but got {cfg.lr_cut}")
    if cfg.lr_cut_after < 0:
        raise RunError(f"Expected --lr-cut-after >= 0 (events that cut nothing), but got {cfg.lr_cut_after}")
    if cfg.judge_steps < 1:
        raise RunError(f"Expected --judge-steps >= 1 (steps of windows judged together), but got {cfg.judge_steps}")
    if not (cfg.range_backoff >= 1 and math.isfinite(cfg.range_backoff)):
        raise RunError(f"Expected --range-backoff >= 1, but got {cfg.range_backoff}")
    if not (0 < cfg.pct_start < 1):
        raise RunError(f"Expected --pct-start in (0, 1) (OneCycle's warm-up, a fraction of --steps), but got "
                       f"{cfg.pct_start}")
    if not (0 <= cfg.lr_sweep < 1):
        raise RunError(f"Expected --lr-sweep in [0, 1) (the fraction of --steps the sweep takes), but got "
                       f"{cfg.lr_sweep}")
    if cfg.lr_sweep_then not in ("restart", "continue"):
        raise RunError(f"Expected --lr-sweep-then restart or continue, but got {cfg.lr_sweep_then!r}")
    if cfg.lr_sweep_factor is not None and not (math.isfinite(cfg.lr_sweep_factor) and cfg.lr_sweep_factor > 0):
        raise RunError(f"Expected --lr-sweep-factor to be a positive finite number (the run's peak over the sweep's "
                       f"pick), but got {cfg.lr_sweep_factor}")
    if cfg.lr_sweep_points is not None and cfg.lr_sweep_points < 2:
        raise RunError(f"Expected --lr-sweep-points to be at least 2 (the grid's LRs), but got {cfg.lr_sweep_points}")
    if cfg.lr_sweep and not MIN_STEPS <= sweep_steps(cfg) <= cfg.steps - (cfg.T if cfg.lr_sweep_then == "continue"
                                                                        else 0):
        raise RunError(f"Expected --lr-sweep to give the sweep at least {MIN_STEPS} steps" + (
                       f" and leave the run after it at least --T {cfg.T} steps" if cfg.lr_sweep_then == "continue"
                       else "") + f", but --lr-sweep {cfg.lr_sweep} of --steps {cfg.steps} is {sweep_steps(cfg)}")
    run_steps = after_sweep(cfg).steps
    for what, n in (("the run's", run_steps), ("the sweep's", sweep_steps(cfg))):
        if cfg.optimizer != "schedulefree-adamw" and cfg.pct_start * n == 1:  # (torch divides by its length - 1)
            raise RunError(f"Expected --pct-start x {what} steps ({n}) to be other than one step (OneCycleLR cannot "
                           f"build a warm-up of exactly one step), but got --pct-start {cfg.pct_start}")
    if cfg.lr_sweep and (cfg.optimizer != "adamw" or cfg.range_test or cfg.replicas == 1):
        why = (f"--optimizer {cfg.optimizer} (it sets its own step size)" if cfg.optimizer != "adamw" else
               "--range-test (both choose the peak LR)" if cfg.range_test else "--replicas 1 (nothing to compare)")
        raise RunError(f"Expected --lr-sweep with --optimizer adamw, without --range-test and with 2 or more "
                       f"replicas, but got {why}")
    if cfg.range_test and cfg.optimizer != "adamw":
        raise RunError(f"Expected --optimizer adamw with --range-test (it scales the learning rate; the peers set "
                       f"their own step size), but got {cfg.optimizer}")
    if cfg.mode not in MODES:
        raise RunError(f"Expected --mode auto, vmap, loop or merged, but got {cfg.mode!r}")
    if cfg.mode == "merged" and cfg.compile:
        raise RunError("Expected --compile with --mode auto or vmap (--mode merged runs eagerly)")
    if cfg.cuda_graph and "dropout" in cfg.explore:
        raise RunError("Expected --cuda-graph without --explore dropout (an explored dropout lives in the modules and "
                       "needs the engine's loop, which runs no graph)")
    if cfg.cuda_graph and (cfg.mode == "loop" or cfg.compile):
        raise RunError(f"Expected --cuda-graph with --mode auto, vmap or merged and without --compile, but got --mode "
                       f"{cfg.mode}" + (" --compile" if cfg.compile else ""))
    bad = [e for e in cfg.explore if e not in EXPLORE]
    if bad:
        raise RunError(f"Expected --explore items from {', '.join(EXPLORE)}, but got {', '.join(bad)}")
    if "lr-groups" in cfg.explore and spread(cfg) == 0:
        raise RunError("Expected --alpha > 0 with --explore lr-groups (the groups' LRs are explored through the LR "
                       "spread), but got --alpha 0" + (" (its default with --lr-sweep)" if cfg.alpha is None else ""))
    if cfg.checkpoint_every is not None and (isinstance(cfg.checkpoint_every, bool) or
                                             not isinstance(cfg.checkpoint_every, int) or cfg.checkpoint_every < 0):
        raise RunError(f"Expected --checkpoint-every to be a whole number >= 0, but got {cfg.checkpoint_every!r}")
    if cfg.optimizer not in OPTIMIZERS:
        raise RunError(f"Expected --optimizer in {', '.join(OPTIMIZERS)}, but got {cfg.optimizer!r}")
    if isinstance(cfg.seed, bool) or not isinstance(cfg.seed, int) or not 0 <= cfg.seed < 2 ** 32:
        raise RunError(f"Expected --seed in [0, 2**32), but got {cfg.seed!r}")
    if not (cfg.clip > 0 and math.isfinite(cfg.clip)):
        raise RunError(f"Expected --clip > 0, but got {cfg.clip}")
    if cfg.optimizer == "schedulefree-adamw" and spread(cfg) > 0:
        raise RunError(f"Expected --alpha 0 with --optimizer schedulefree-adamw (Schedule-Free: its LR also sets its "
                       f"averaging weights, so a spread breaks them), but got --alpha {spread(cfg)}")
    if cfg.optimizer == "schedulefree-adamw" and cfg.explore:  # (taken, and did nothing: an audit)
        raise RunError(f"Expected no --explore with --optimizer schedulefree-adamw (hdet refuses a spread over "
                       f"Schedule-Free: its averaging weights), but got --explore {','.join(cfg.explore)}")
    if cfg.optimizer == "mechanic-adamw" and cfg.local:
        raise RunError("Expected --grad-sync with --optimizer mechanic-adamw (Mechanic's scale learns from each "
                       "replica's gradients: in local mode the replicas' scales drift apart), but got --no-grad-sync")
    if cfg.optimizer == "mechanic-adamw" and (cfg.resume or cfg.checkpoint_every):
        raise RunError("Expected --checkpoint-every 0 and no --resume with --optimizer mechanic-adamw (mechanic-pytorch "
                       "keys its state by the parameter objects themselves, so a reloaded optimizer fails at its next "
                       "step): its runs are not checkpointed")
    if cfg.optimizer == "mechanic-adamw" and spread(cfg) > 0:
        raise RunError(f"Expected --alpha 0 with --optimizer mechanic-adamw (Mechanic sets the weights from its start "
                       f"point and a scaled running sum, so a spread does not scale a replica's step), but got "
                       f"--alpha {spread(cfg)}")
    heads = gpt_heads(cfg.width)
    if cfg.task == "bytes" and cfg.width % heads:
        raise RunError(f"Expected --width divisible by the GPT's number of heads (width // 32 = {heads} for --width "
                       f"{cfg.width}), e.g. {heads * 32} or {(heads + 1) * 32}")
    if cfg.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise RunError("Expected the tensorboard package for --tensorboard (pip install tensorboard), but it is not "
                       "installed")
    if cfg.init_from is not None and not cfg.resume and not Path(cfg.init_from).is_file():  # (resumed: unread)
        raise RunError(f"Expected --init-from to name a model.pt file, but {cfg.init_from} does not exist")


def unused(cfg: RunConfig, world: int | None = None) -> list[str]:
    """Flags given that this run does not use (said as a warning: the run is still what was asked otherwise).
    ``world``: the world size under torchrun (each rank one replica), None in the one-process engine."""
    out = []
    default = RunConfig()
    if world is not None:
        out += [f"--{name} under torchrun (the one-process engine's: each rank is one replica)"
                for name in ("mode", "compile", "cuda_graph") if getattr(cfg, name) != getattr(default, name)]
    if cfg.warmup is not None and not (cfg.auto_lr or cfg.range_test):
        out.append("--warmup without --auto-lr or --range-test")
    if cfg.tie_lr_groups is not None and not cfg.auto_lr:
        out.append("--tie-lr-groups/--no-tie-lr-groups without --auto-lr (replicas keep their position in every group)")
    if cfg.lr_sweep_then != default.lr_sweep_then and not cfg.lr_sweep:
        out.append("--lr-sweep-then without --lr-sweep")
    if cfg.lr_sweep_points is not None and not cfg.lr_sweep:
        out.append("--lr-sweep-points without --lr-sweep")
    if cfg.lr_sweep_factor is not None and not cfg.lr_sweep:
        out.append("--lr-sweep-factor without --lr-sweep")
    if cfg.prodigy_safeguard and cfg.optimizer != "prodigy":
        out.append(f"--prodigy-safeguard with --optimizer {cfg.optimizer}")
    if cfg.data is not None and cfg.task != "fashion":
        out.append(f"--data with --task {cfg.task} (its data is the standard library's own files)")
    if cfg.clip != default.clip and "grad-clip" not in cfg.explore:
        out.append("--clip without --explore grad-clip")
    for name in ("controller", "probe_batches"):
        if getattr(cfg, name) != getattr(default, name) and not cfg.auto_lr:
            out.append(f"--{name.replace('_', '-')} without --auto-lr")
    if cfg.probe_batches != default.probe_batches and cfg.auto_lr and cfg.controller != "fit":
        out.append(f"--probe-batches with --controller {cfg.controller} (the fit controller's probe)")
    if cfg.optimizer == "schedulefree-adamw":
        out += [f"--{name.replace('_', '-')} with --optimizer schedulefree-adamw (its runs have no stability guard)"
                for name in ("on_runaway", "lr_cut", "lr_cut_after", "judge_steps")
                if getattr(cfg, name) != getattr(default, name)]
        out += [f"--{name.replace('_', '-')} with --optimizer schedulefree-adamw (no schedule and no controller: its "
                "own warm-up, then a constant LR)" for name in ("pct_start", "auto_lr", "warmup", "tie_lr_groups")
                if getattr(cfg, name) != getattr(default, name)]
    elif cfg.on_runaway != "recover":
        out += [f"--{name.replace('_', '-')} with --on-runaway {cfg.on_runaway}"
                for name in ("lr_cut", "lr_cut_after", "judge_steps")  # (the range test turns the guard on)
                if getattr(cfg, name) != getattr(default, name) and not cfg.range_test]
    if cfg.range_backoff != default.range_backoff and not cfg.range_test:
        out.append("--range-backoff without --range-test")
    for name in ("ctx", "layers"):
        if getattr(cfg, name) != getattr(default, name) and cfg.task == "fashion":
            out.append(f"--{name} with --task fashion (a CNN)")
    one = cfg.replicas == 1 if world is None else world == 1
    if one and (spread(cfg) > 0 or cfg.explore):  # (one replica: every multiplier 1, every explored value its base)
        out += [f"--{what} with {'--replicas 1' if world is None else 'one process (world size 1)'} (one replica "
                "takes the base value: nothing to spread)" for what in (["alpha"] if cfg.alpha else []) +
                (["explore"] if cfg.explore else [])]
    if cfg.auto_lr and (spread(cfg) == 0 or one) and cfg.controller != "paper":  # (the paper's still decays the
        # base by Eq. 8: not "no effect", an audit; the scheduler says it)
        why = ("--alpha 0" + (" (its default with --lr-sweep: pass --alpha 0.2 for a spread)" if cfg.alpha is None
                              else "") if spread(cfg) == 0 else
               "--replicas 1" if world is None else "one process (world size 1)")
        out.append(f"--auto-lr with {why} (the controller compares the replicas' spread: there is none)")
    return out


MAX_CTX = 4096
DEFAULT_ALPHA = 0.2
DEFAULT_MAX_LR = {"adamw": 3e-3, "dadapt-adam": 1.0, "prodigy": 1.0, "schedulefree-adamw": 3e-3, "mechanic-adamw": 1.0}


def default_warmup(steps: int, T: int, one_cycle: bool, pct_start: float) -> int:
    """``--warmup`` left out: the end of OneCycle's warm-up (``pct_start`` of the steps, ``--pct-start``) rounded down
    to a multiple of T for the fit controller and the range test (``one_cycle``); half the run for the paper's."""
    return int(pct_start * steps) // T * T if one_cycle else steps // 2


def sweep_steps(cfg: RunConfig) -> int:
    """The LR sweep's steps (``--lr-sweep`` of ``--steps``, rounded)."""
    return round(cfg.lr_sweep * cfg.steps)


def after_sweep(cfg: RunConfig) -> RunConfig:
    """The run after ``--lr-sweep``'s sweep: all ``--steps`` (``--lr-sweep-then restart``), or the rest of them
    (``continue``: from the sweep's best run's weights, with fresh optimizer state and OneCycle's warm-up,
    ``--pct-start`` of them, again; one that ends where the whole run's would, 0.125 of them at --lr-sweep 0.2, ended
    the GPT 0.4-0.7% worse: docs/auto-lr.md); ``cfg`` itself without a sweep."""
    swept = sweep_steps(cfg) if cfg.lr_sweep_then == "continue" else 0
    return dataclasses.replace(cfg, steps=cfg.steps - swept) if swept else cfg


def default_alpha(lr_sweep: float) -> float:
    """``--alpha`` left out: HDET's spread, 0.2 (the best of 0.1, 0.2 and 0.5 on the evidence suite's tasks), but 0 after
    an LR sweep (``--lr-sweep``): there the run after the sweep ended the GPT +0.10% (standard error 0.16%, 48 runs
    seed for seed) and Fashion-MNIST 0.06 point better without it, the stability guard alone kept the GPT from breaking
    as the spread had (0 of 16 seeds), and at 128M the spread costs about 2% (docs/auto-lr.md)."""
    return 0.0 if lr_sweep else DEFAULT_ALPHA


def spread(cfg: RunConfig) -> float:
    """The run's LR spread ratio: ``--alpha``, or its default (:func:`default_alpha`)."""
    return default_alpha(cfg.lr_sweep) if cfg.alpha is None else cfg.alpha


def resolve(cfg: RunConfig) -> RunConfig:
    """``cfg`` with its defaults that depend on other options filled in (``--alpha`` by ``--lr-sweep``, ``--max-lr``
    by ``--optimizer``; no checkpoints with Mechanic, whose state does not reload; no stability guard with
    Schedule-Free, whose runs have none: its records say so)."""
    if cfg.alpha is None:
        cfg = dataclasses.replace(cfg, alpha=spread(cfg))
    if cfg.max_lr is None:
        cfg = dataclasses.replace(cfg, max_lr=DEFAULT_MAX_LR[cfg.optimizer])
    if cfg.optimizer == "schedulefree-adamw" and cfg.on_runaway != "ignore":
        cfg = dataclasses.replace(cfg, on_runaway="ignore")
    if cfg.checkpoint_every is None and cfg.optimizer == "mechanic-adamw":
        cfg = dataclasses.replace(cfg, checkpoint_every=0)
    return cfg
