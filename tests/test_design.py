"""The redesign (issue 18): one list of options, one scheduler, public observe(), the engine driving its
syncs, the CLI built from RunConfig, and checkpoints of the previous format still loading."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

import hdet
from hdet.app.cli import build_parser
from hdet.app.options import RunConfig
from hdet.config import OPTIONS
from hdet.engine import ReplicaEngine

DATA = Path(__file__).parent / "data"


def _model_opt():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.1), nn.Linear(4, 1))
    return m, torch.optim.AdamW(m.parameters(), lr=0.1)


def test_options_are_one_list_for_both_schedulers():
    m, o = _model_opt()
    cfg = hdet.HDETConfig(ensemble_lr_spread_ratio=0.3, model_sync_interval=7)
    s = hdet.HDETLR(o, None, total_steps=20, config=cfg, model_sync_interval=5)  # a keyword wins over config
    assert s.ensemble.config.ensemble_lr_spread_ratio == 0.3 and s.ensemble.config.model_sync_interval == 5
    assert cfg.model_sync_interval == 7  # the caller's config is not changed
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['alpha'\]; the HDET options are"):
        hdet.HDETLR(o, None, total_steps=20, alpha=0.2)
    with pytest.raises(TypeError, match="unexpected keyword"):
        hdet.OneCycleAutoLR(o, max_lr=0.1, total_steps=20, sync_interval=5)
    # the reference's default S_warm for OneCycleAutoLR, hdet's for HDETLR: stated, not drifted
    assert hdet.OneCycleAutoLR(o, max_lr=0.1, total_steps=20).ensemble.config.auto_lr_warmup_steps == 100_000
    assert hdet.HDETLR(o, None, total_steps=20).ensemble.config.auto_lr_warmup_steps == 0
    assert set(OPTIONS) == {f.name for f in dataclasses.fields(hdet.HDETConfig)}
    with pytest.raises(ValueError, match=r"Expected 0 <= momentum_of_lr \(beta\) < 1, but got 2"):
        hdet.HDETConfig(momentum_of_lr=2)


def test_observe_is_step_with_a_loss():
    states = []
    for feed in ("step", "observe"):
        m, o = _model_opt()
        s = hdet.HDETLR(o, lambda t: 0.1, total_steps=12, model=m, model_sync_interval=4, enable_auto_lr=True,
                        controller="paper")
        for t in range(12):
            o.step()
            if feed == "step":
                s.step(torch.tensor(1.0 + t))
            else:
                s.observe(torch.tensor(1.0 + t))
                s.step()
        states.append((s.last_sync.losses, s.ensemble.controllers[0].v))
    assert states[0] == states[1] and states[0][0] == [(9 + 10 + 11 + 12) / 4]


def test_engine_views_never_communicate_and_the_engine_drives_the_sync():
    m, _ = _model_opt()
    eng = ReplicaEngine(m, 3, lambda mod: torch.optim.SGD(mod.parameters(), lr=0.1),
                        lambda opt, rep, mod: hdet.HDETLR(opt, None, total_steps=6, replicas=rep, model=mod,
                                                          ensemble_lr_spread_ratio=0.5, model_sync_interval=3),
                        mode="loop")
    view = eng.schedulers[1].ensemble.replicas
    with pytest.raises(RuntimeError, match="run by its ReplicaEngine"):
        view.gather(torch.zeros(3))
    for _ in range(3):
        eng.step([torch.randn(2, 3) for _ in range(3)], lambda mod, x: mod(x).pow(2).mean())
    w = [torch.cat([p.detach().flatten() for p in mm.parameters()]) for mm in eng.models]
    assert torch.equal(w[0], w[1]) and torch.equal(w[0], w[2])  # averaged at step 3
    assert all(s.last_sync is not None and s.last_sync.step == 3 for s in eng.schedulers)


@pytest.mark.parametrize("kind", ["onecycle", "hdetlr"])
def test_a_state_of_the_previous_format_loads_and_continues_exactly(kind):
    """States saved by hdet at a811e77 (format version 2: the config's short names, the paper controller's base
    apart, OneCycleLR's fields flat in OneCycleAutoLR's state), with the LRs that code then gave: loaded here
    with weights_only=True, the run continues with the same LRs and weight decays."""
    saved = torch.load(DATA / "states_v2.pt", weights_only=True)[kind]
    assert saved["state"]["hdet"]["version"] == 2
    m, o = _model_opt()
    if kind == "onecycle":
        s = hdet.OneCycleAutoLR(o, max_lr=0.1, total_steps=30, ensemble_lr_spread_ratio=0.2, model=m,
                                explore=[hdet.WeightDecay(o)], enable_auto_lr=True, auto_lr_warmup_steps=5,
                                model_sync_interval=5, controller="paper")
    else:
        s = hdet.HDETLR(o, torch.optim.lr_scheduler.StepLR(o, 5, gamma=0.5), total_steps=30, model=m,
                        ensemble_lr_spread_ratio=0.2, model_sync_interval=4)
    s.load_state_dict(saved["state"])
    got = []
    for L in (0.4, 0.38, 0.37, 0.36, 0.35, 0.3, 0.31, 0.29):
        o.step()
        s.step(torch.tensor(L))
        got.append([g["lr"] for g in o.param_groups] + [g["weight_decay"] for g in o.param_groups])
    assert sum(got, []) == pytest.approx(sum(saved["lrs_after"], []), rel=1e-12, abs=0)
    if kind == "onecycle":
        assert s.ensemble.controllers[0] is not None and s.ensemble.controllers[0].value is not None
        again = torch.load(__import__("io").BytesIO(_save(s.state_dict())), weights_only=True)
        assert again["hdet"]["version"] == 3 and "base" in again


def _save(state):
    import io

    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def test_every_run_option_is_one_field_and_one_flag():
    p = build_parser()
    train = next(a for a in p._subparsers._group_actions[0].choices.values() if a.prog.endswith("train"))
    dests = {a.dest for a in train._actions} - {"help"}
    flagged = {f.name for f in dataclasses.fields(RunConfig) if "cli" in f.metadata}
    assert dests == flagged
    a = p.parse_args(["train", "--no-grad-sync", "--explore", "dropout, weight-decay", "--no-progress", "--T", "7"])
    from hdet.app.cli import _config

    cfg = _config(a)
    assert cfg.local is True and cfg.explore == ("dropout", "weight-decay") and cfg.progress is False and cfg.T == 7
    assert _config(p.parse_args(["train"])) == RunConfig()


def test_warnings_point_past_hdet_torch_and_contextlib_but_not_past_the_users_or_the_clis_lines(tmp_path):
    """hdet.caller: hdet's and torch's files and contextlib are skipped; hdet's CLI, a relative name (a notebook's
    cell, exec'd code) and anything else is the user's. A frame with a relative name was made absolute against the
    working directory, so with that directory deleted a warning raised FileNotFoundError (a review); it names the
    cell now."""
    import contextlib
    import os
    import subprocess
    import sys

    import hdet.caller as caller

    here = os.path.dirname(os.path.abspath(hdet.__file__))
    assert caller._internal(os.path.join(here, "engine.py")) and caller._internal(os.path.abspath(contextlib.__file__))
    assert caller._internal(os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "optim", "optimizer.py"))
    assert not caller._internal(os.path.join(here, "app", "runs.py"))
    assert not caller._internal("<string>") and not caller._internal(os.path.abspath(__file__))
    code = ("import os, shutil, sys, tempfile, warnings, torch, hdet\n"
            "d = tempfile.mkdtemp(); os.chdir(d); shutil.rmtree(d)\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    exec(compile('hdet.warm_init_(torch.nn.Linear(2, 2))', '<notebook cell>', 'exec'))\n"
            "print([(x.filename, x.lineno) for x in w if 'warm_init_' in str(x.message)])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[('<notebook cell>', 1)]", out.stdout
