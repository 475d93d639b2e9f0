"""The paper's six ablation configurations (section 4.1, Table 1) on one task, at a small size.

Warm init (Eq. 10) needs a pre-trained checkpoint: a short pre-training phase (one replica, the low LR,
its own data stream) makes one, and the warm rows start from it. They therefore have seen
``pretrain_steps`` more batches than the cold rows, as in the paper.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path
from typing import Any, Callable

from .options import RunError, check, spread
from .run import RunConfig, _lock_out, check_out, train

__all__ = ["ABLATIONS", "compare"]

# name, Table 1's description, overrides (alpha=None: the spread given to `hdet compare`)
ABLATIONS: list[tuple[str, str, dict[str, Any]]] = [
    ("Baseline-Low", "Standard DDP, alpha=0", {"alpha": 0.0, "lr": "low"}),
    ("Baseline-High", "Standard DDP, alpha=0", {"alpha": 0.0, "lr": "high"}),
    ("Warm-Init", "Perturbed init, alpha=0, no averaging", {"alpha": 0.0, "lr": "high", "warm": True,
                                                            "no_avg": True}),
    ("HDET w/o auto-LR", "LR spread + warm init, no auto-LR", {"lr": "high", "warm": True}),
    ("HDET w/o warm init", "LR spread + auto-LR, cold start", {"lr": "high", "auto": True}),
    ("HDET (full)", "LR spread + warm init + auto-LR", {"lr": "high", "warm": True, "auto": True}),
]


def compare(base: RunConfig, lr_low: float, lr_high: float, pretrain_steps: int,
            say: Callable[[str], None] = print, held: contextlib.ExitStack | None = None) -> dict[str, Any]:
    """Run the six configurations into ``base.out``/<n>-<name>; write ``compare.json``; return it. ``base.out`` is
    held (:func:`hdet.app.run._lock_out`) until it returns, or until ``held`` closes where one is given."""
    out = Path(base.out)
    check(base)  # as hdet train checks them (the alpha-0 rows drop lr-groups, so theirs would pass where it fails)
    unspread = tuple(e for e in base.explore if e != "lr-groups")  # what rows at alpha 0 explore
    base = dataclasses.replace(base, alpha=spread(base), checkpoint_every=0, resume=False)  # (nothing resumes a
    # comparison's rows; the spread as the rows run it, recorded in compare.json)
    pre = dataclasses.replace(base, replicas=1, alpha=0.0, auto_lr=False, warm_init=False, init_from=None,
                              explore=unspread,
                              steps=pretrain_steps, max_lr=lr_low, seed=base.seed + 1, out=str(out / "pretrain"),
                              label="pretrain")
    train(pre, dry_run=True)
    rows = []
    for i, (name, desc, o) in enumerate(ABLATIONS, 1):
        lr = lr_low if o["lr"] == "low" else lr_high
        folder = f"{i}-{name.lower().replace(' ', '-').replace('/', '').replace('(', '').replace(')', '')}"
        alpha = o.get("alpha", spread(base))
        cfg = dataclasses.replace(
            base, alpha=alpha, max_lr=lr, auto_lr=o.get("auto", False),
            explore=base.explore if alpha > 0 else unspread,
            warm_init=o.get("warm", False), init_from=str(out / "pretrain" / "model.pt") if o.get("warm") else None,
            T=base.steps if o.get("no_avg") else base.T, out=str(out / folder), label=name)
        train(dataclasses.replace(cfg, init_from=None), dry_run=True)  # every row's options checked (the warm
        # rows' checkpoint is made by the pre-training below) before anything trains or is removed
        rows.append((i, name, desc, lr, folder, cfg))
    check_out(out)
    with contextlib.ExitStack() as own:  # (the comparison's hold on ``out`` itself; each row holds its own folder)
        busy = _lock_out(out, own if held is None else held)
        if busy:
            raise RunError(f"Expected --out to be a folder no other comparison writes to, but {busy} ({out}): wait "
                           "for it to end, or pass another --out")
        return _compare(out, base, pre, rows, pretrain_steps, lr_low, lr_high, say)


def _compare(out: Path, base: RunConfig, pre: RunConfig, rows: list, pretrain_steps: int, lr_low: float,
             lr_high: float, say: Callable[[str], None]) -> dict[str, Any]:
    (out / "compare.json").unlink(missing_ok=True)  # an earlier comparison's table goes with its first row
    say(f"Warm init needs a checkpoint: pre-training one replica for {pretrain_steps} steps at LR {lr_low:g} "
        f"-> {pre.out}/model.pt (the warm rows start from it).")
    train(pre, argv=["(compare pretrain)"])
    runs = []
    for i, name, desc, lr, folder, cfg in rows:
        say(f"[{i}/6] {name}: {desc}, LR {lr:g}")
        s = train(cfg, argv=["(compare)", name])
        runs.append({"config": name, "description": desc, "lr": lr, "folder": folder, "alpha": cfg.alpha,
                     "T": cfg.T, "auto_lr": cfg.auto_lr, "warm_init": cfg.warm_init,
                     "final_train_loss": s["final_train_loss"], "final_val_loss": s["final_val_loss"],
                     "final_metrics": s.get("final_metrics") or {},
                     "crashed": s["crashed"], "train_seconds": s["train_seconds"], "mode": s["mode"]})
    result = {"title": f"{base.task}: {base.replicas or 4} replicas, {base.steps} steps, LR high/low = "
                       f"{lr_high / lr_low:.3g}x",
              "pretrain_steps": pretrain_steps, "lr_low": lr_low, "lr_high": lr_high,
              "config": dataclasses.asdict(base), "runs": runs,
              "notes": ["Warm-Init averages only after the last step (T = steps): hdet always averages there.",
                        "Train loss: the mean training loss over the log records of the last 10% of steps (a "
                        "record averages the steps since the one before); fixed batches: the final averaged model on "
                        "the run's fixed held-out batches (Fashion-MNIST: 8 x 32 test images); held-out: on the whole "
                        "held-out split (the GPT: 2048 windows of the held-out files; Fashion-MNIST: the 10000 test "
                        "images, and their accuracy); best: the row of the lowest held-out loss.",
                        f"Warm rows start from a checkpoint pre-trained {pretrain_steps} steps."]}
    (out / "compare.json").write_text(json.dumps(result, indent=1))
    return result
