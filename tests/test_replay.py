"""Export the schedule an HDET run discovered and replay it in a plain single-replica run."""

import copy
import io
import json
import math

import pytest
import torch

import hdet
from helpers import ScriptedReplicas


def _opt(wd=0.01):
    p = torch.nn.Parameter(torch.zeros(2))
    return torch.optim.AdamW([p], lr=0.01, weight_decay=wd)


def _hdet_run(steps=40, stop=None):
    opt = _opt()
    sched = hdet.OneCycleAutoLR(opt, max_lr=0.05, total_steps=steps, ensemble_lr_spread_ratio=0.2,
                                model_sync_interval=5, controller="paper", enable_auto_lr=True, auto_lr_warmup_steps=10, loss_scale=0.05,
                                replicas=ScriptedReplicas(1, 4, lambda: [1.0, 1.2, 0.8, 1.1]),
                                explore=[hdet.WeightDecay(opt, alpha=1.0)]).record_schedule()
    seen = [(sched.base_lrs_now[0], sched.ensemble.current_bases[1])]
    for t in range(stop or steps):
        opt.step()
        sched.step(torch.tensor(1.0))
        seen.append((sched.base_lrs_now[0], sched.ensemble.current_bases[1]))
    return opt, sched, seen


def test_replay_plays_back_the_discovered_bases():
    _, sched, seen = _hdet_run()
    schedule = json.loads(json.dumps(sched.discovered_schedule()))  # plain data
    assert schedule["names"] == ["lr/0", "weight_decay/0"] and len(schedule["bases"]) == 41
    assert sched.ensemble.controllers[0].updates == 7  # the controller moved the base: not just OneCycle
    opt = _opt(wd=0.5)
    wd = hdet.WeightDecay(opt)
    replay = hdet.ReplayLR(opt, schedule, explore=[wd])
    got = [(opt.param_groups[0]["lr"], opt.param_groups[0]["weight_decay"])]
    for _ in range(40):
        opt.step()
        replay.step()
        got.append((opt.param_groups[0]["lr"], opt.param_groups[0]["weight_decay"]))
    assert got == seen  # the mean over replicas, step by step, for the LR and the weight decay
    with pytest.raises(ValueError, match="at most 40 steps"):
        replay.step()


def test_record_survives_a_resume_and_bad_input_is_refused():
    opt, sched, _ = _hdet_run(stop=17)
    buf = io.BytesIO()
    torch.save(sched.state_dict(), buf)
    buf.seek(0)
    opt2 = _opt()
    s2 = hdet.OneCycleAutoLR(opt2, max_lr=0.05, total_steps=40, ensemble_lr_spread_ratio=0.2, model_sync_interval=5,
                             controller="paper", enable_auto_lr=True, auto_lr_warmup_steps=10, loss_scale=0.05,
                             replicas=ScriptedReplicas(1, 4, lambda: [1.0, 1.2, 0.8, 1.1]),
                             explore=[hdet.WeightDecay(opt2, alpha=1.0)])
    s2.load_state_dict(torch.load(buf, weights_only=True))
    for _ in range(23):
        opt2.step()
        s2.step(torch.tensor(1.0))
    _, full, _ = _hdet_run()
    assert s2.discovered_schedule() == full.discovered_schedule()
    with pytest.raises(ValueError, match="record_schedule"):
        hdet.OneCycleAutoLR(_opt(), max_lr=0.1, total_steps=5).discovered_schedule()
    two_groups = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))]},
                                  {"params": [torch.nn.Parameter(torch.zeros(1))]}], lr=0.1)
    with pytest.raises(ValueError, match=r"recorded ones \[.lr/0.\] .* its groups are \[.lr/0., .lr/1.\]"):
        hdet.ReplayLR(two_groups, full.discovered_schedule())
    with pytest.raises(ValueError, match="were not recorded"):
        hdet.ReplayLR(_opt(), full.discovered_schedule(), explore=[hdet.AdamBeta(_opt(), 1)])
    with pytest.raises(ValueError, match="discovered_schedule"):
        hdet.ReplayLR(_opt(), {"bases": []})


def test_sync_logger_writes_jsonl_tensorboard_and_callback(tmp_path):
    got = []
    opt = _opt()
    sched = hdet.OneCycleAutoLR(opt, max_lr=0.05, total_steps=20, ensemble_lr_spread_ratio=0.2,
                                model_sync_interval=5, controller="paper", enable_auto_lr=True, auto_lr_warmup_steps=10,
                                replicas=ScriptedReplicas(0, 4, lambda: [1.0, 1.2, 0.8, 1.1]))
    log = hdet.SyncLogger(sched, tmp_path / "syncs.jsonl", tensorboard_dir=tmp_path / "tb", callback=got.append)
    quiet = hdet.SyncLogger(hdet.OneCycleAutoLR(_opt(), max_lr=0.05, total_steps=20, model_sync_interval=5,
                                                replicas=ScriptedReplicas(1, 4)), tmp_path / "other.jsonl")
    for _ in range(20):
        opt.step()
        sched.step(torch.tensor(1.0))
    log.close()
    lines = [json.loads(x) for x in (tmp_path / "syncs.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [5, 10, 15, 20] and lines == got
    assert "controller" in lines[1] and len(lines[1]["controller"][0]["weights"]) == 4
    assert list((tmp_path / "tb").iterdir())
    assert not quiet.active and not (tmp_path / "other.jsonl").exists()  # replica 1 writes nothing


def test_sync_logger_writes_strict_json_with_a_non_finite_loss(tmp_path):
    """A replica's NaN window loss is null in syncs.jsonl (Python's NaN token is not JSON: jq and JavaScript refuse
    the file); the callback still gets the float."""
    got = []
    opt = _opt()
    sched = hdet.OneCycleAutoLR(opt, max_lr=0.05, total_steps=10, ensemble_lr_spread_ratio=0.2, model_sync_interval=5,
                                replicas=ScriptedReplicas(0, 4, lambda: [1.0, float("nan"), 0.8, 1.1]))
    log = hdet.SyncLogger(sched, tmp_path / "syncs.jsonl", callback=got.append)
    for _ in range(10):
        opt.step()
        sched.step(torch.tensor(1.0))
    log.close()

    def refuse(token):
        raise ValueError(f"not JSON: {token}")

    lines = [json.loads(x, parse_constant=refuse) for x in (tmp_path / "syncs.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [5, 10] and lines[0]["losses"][1] is None
    assert lines[0]["losses"][0] == 1.0 and math.isnan(got[0]["losses"][1])


def test_in_an_engine_under_a_process_group_only_replica_0s_logger_writes(tmp_path):
    """A one-process engine in a process that has a process group (world 1): the logger chose its writer by the
    global rank, so every replica's logger wrote, each sync once per replica and every one into the same file (an
    audit); only replica 0's writes now."""
    import torch.distributed as dist
    from torch import nn

    from hdet.engine import ReplicaEngine

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        eng = ReplicaEngine(nn.Linear(3, 1), 2, lambda m: torch.optim.SGD(m.parameters(), lr=0.01),
                            lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=0.01, total_steps=10, model=m, replicas=rep,
                                                                  ensemble_lr_spread_ratio=0.2, model_sync_interval=5),
                            mode="loop")
        got = []
        logs = [hdet.SyncLogger(s, tmp_path / "syncs.jsonl", callback=lambda d, r=r: got.append((r, d["step"])))
                for r, s in enumerate(eng.schedulers)]
        for _ in range(10):
            eng.step([torch.ones(4, 3)] * 2, lambda m, b: m(b).pow(2).mean())
        for log in logs:
            log.close()
    finally:
        dist.destroy_process_group()
    assert [log.active for log in logs] == [True, False] and got == [(0, 5), (0, 10)]
    assert [json.loads(x)["step"] for x in (tmp_path / "syncs.jsonl").read_text().splitlines()] == [5, 10]


def test_the_paper_controllers_record_gives_a_log_slots_base_in_its_own_units(tmp_path):
    """SyncLogger wrote the paper controller's internal log(value) as the base of a log-spread slot (weight decay
    -3.1 for 0.045) beside the record's natural bases."""
    import json
    import warnings

    from torch import nn

    from hdet.engine import ReplicaEngine

    def make(o, rep, m):
        return hdet.HDETLR(o, None, 20, ensemble_lr_spread_ratio=0.2, model_sync_interval=5, replicas=rep, model=m,
                           enable_auto_lr=True, controller="paper", auto_lr_warmup_steps=5, final_lr=1e-3,
                           explore=[hdet.WeightDecay(o), hdet.GradClip(1.0)])
    eng = ReplicaEngine(nn.Linear(4, 1), 2, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.05),
                        make, mode="loop")
    log = hdet.SyncLogger(eng.schedulers[0], tmp_path / "syncs.jsonl")
    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(10):
            x = torch.randn(2, 8, 4, generator=g)
            eng.step([(x[r], x[r].sum(1, keepdim=True)) for r in range(2)],
                     lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]))
    log.close()
    rec = [json.loads(line) for line in (tmp_path / "syncs.jsonl").read_text().splitlines()][-1]
    assert rec["controller"] and all(c["kind"] == "paper" for c in rec["controller"])
    for j, c in enumerate(rec["controller"]):
        assert c["base"] == pytest.approx(rec["bases"][j]) and c["base"] > 0, rec["names"][j]


def test_a_signed_explored_value_replays():
    """A Setter explored around a negative base (an additive spread: HDET takes it) is recorded and replayed with
    the LRs; before, ReplayLR refused every record with a value below 0. An LR below 0 is still refused."""
    box = {"shift": -0.5}
    opt = _opt()
    shift = hdet.Setter("shift", lambda: box["shift"], lambda v: box.__setitem__("shift", v),
                        hdet.Spread("additive", 0.1, (-1.0, 1.0)))
    sched = hdet.OneCycleAutoLR(opt, max_lr=0.05, total_steps=10, ensemble_lr_spread_ratio=0.2, model_sync_interval=5,
                                replicas=ScriptedReplicas(1, 4, lambda: [1.0, 1.2, 0.8, 1.1]),
                                explore=[shift]).record_schedule()
    for _ in range(10):
        opt.step()
        sched.step(torch.tensor(1.0))
    schedule = sched.discovered_schedule()
    assert schedule["names"] == ["lr/0", "shift"] and all(row[1] == pytest.approx(-0.5) for row in schedule["bases"])
    box2 = {"shift": 0.0}
    opt2 = _opt()
    replay = hdet.ReplayLR(opt2, schedule, explore=[hdet.Setter("shift", lambda: box2["shift"],
                                                                lambda v: box2.__setitem__("shift", v),
                                                                hdet.Spread("additive", 0.1, (-1.0, 1.0)))])
    assert box2["shift"] == pytest.approx(-0.5) and opt2.param_groups[0]["lr"] == schedule["bases"][0][0]
    opt2.step()
    replay.step()
    assert box2["shift"] == schedule["bases"][1][1]
    bad = {"names": schedule["names"], "bases": [[-1e-3, 0.0], [1e-3, 0.0]]}  # (the last row is never used)
    with pytest.raises(ValueError, match=r"LRs >= 0.*step 0 holds \[-0.001, 0.0\]"):
        hdet.ReplayLR(_opt(), bad)


def test_a_state_dict_taken_in_memory_does_not_change_with_the_scheduler():
    """The state holds copies: its record (and everything else) stays as it was when taken while the run goes on,
    and a state loaded back is not changed by the steps after the load (before, the record was the scheduler's own
    list: a state taken at step 5 held 11 rows 5 steps later)."""
    opt, sched, _ = _hdet_run(stop=5)
    sd = sched.state_dict()
    frozen = copy.deepcopy(sd)
    for _ in range(5):
        opt.step()
        sched.step(torch.tensor(1.0))
    _same(sd, frozen)
    sched.load_state_dict(sd)
    assert len(sched.discovered_schedule()["bases"]) == 6
    for _ in range(3):
        opt.step()
        sched.step(torch.tensor(1.0))
    _same(sd, frozen)


def _same(a, b):
    assert type(a) is type(b)
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert a == b or (a != a and b != b)


def test_the_documented_momentum_recipe_replays_the_lrs_with_onecycles_momentum():
    """docs/telemetry.md: a OneCycleLR for the momentum cycle, the replay built after it and stepped last: every
    step's LR is the record's and beta1 is OneCycle's."""
    _, sched, seen = _hdet_run()
    schedule = sched.discovered_schedule()
    opt = _opt()
    cycle = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=41)
    ref = _opt()
    ref_cycle = torch.optim.lr_scheduler.OneCycleLR(ref, max_lr=0.05, total_steps=41)
    replay = hdet.ReplayLR(opt, schedule)
    for t in range(41):
        assert opt.param_groups[0]["lr"] == seen[t][0]
        assert opt.param_groups[0]["betas"] == ref.param_groups[0]["betas"]
        if t < 40:
            for o, s in ((opt, cycle), (ref, ref_cycle)):
                o.step()
                s.step()
            replay.step()
    assert ref.param_groups[0]["betas"][0] != _opt().param_groups[0]["betas"][0]  # the cycle moved beta1


def test_a_replayed_hyperparameter_outside_its_bounds_is_refused():
    """The >= 0 rule holds for LRs, and each replayed hyperparameter's values must lie within its own bounds: a
    negative weight decay in a record is refused (a signed Setter is not: test_a_signed_explored_value_replays)."""
    _, sched, _ = _hdet_run()
    schedule = sched.discovered_schedule()
    bad = {"names": schedule["names"], "bases": [list(r) for r in schedule["bases"]]}
    bad["bases"][3][1] = -0.5
    opt = _opt()
    with pytest.raises(ValueError, match=r"within its bounds\), but step 3 holds"):
        hdet.ReplayLR(opt, bad, explore=[hdet.WeightDecay(opt)])
    assert opt.param_groups[0]["weight_decay"] == 0.01


def _logged_engine(N=4, T=5, steps=20):
    from torch import nn

    from hdet.engine import ReplicaEngine

    torch.manual_seed(0)
    return ReplicaEngine(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)), N,
                         lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
                         lambda o, rep, m: hdet.OneCycleAutoLR(o, max_lr=1e-2, total_steps=steps, model=m, replicas=rep,
                                                               ensemble_lr_spread_ratio=0.5, model_sync_interval=T))


def _logged_step(eng, t, N=4):
    from torch import nn

    g = torch.Generator().manual_seed(t)
    x = torch.randn(N, 16, 8, generator=g)
    return eng.step([(x[r], x[r].sum(1, keepdim=True)) for r in range(N)],
                    lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]))


def test_a_resumed_loggers_append_drops_what_the_run_wrote_past_its_checkpoint(tmp_path):
    """SyncLogger(append=True), as its docstring says for a resumed run: the syncs the run wrote after the checkpoint
    it resumed from were written again, twice in the file and in TensorBoard ([5, 10, 15, 20, 15, 20], an audit). At
    its first sync the records of that step and after are dropped (a line torn by a kill too), and TensorBoard purges
    them: each sync once, the resumed values."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    eng, state = _logged_engine(), None
    log = hdet.SyncLogger(eng.schedulers[0], tmp_path / "syncs.jsonl", tensorboard_dir=tmp_path / "tb")
    for t in range(1, 21):
        _logged_step(eng, t)
        if t == 12:
            state = copy.deepcopy(eng.state_dict())
    log.close()
    with (tmp_path / "syncs.jsonl").open("a") as f:
        f.write('{"step": 2')  # (a kill mid-write)
    eng = _logged_engine()
    eng.load_state_dict(state)
    log = hdet.SyncLogger(eng.schedulers[0], tmp_path / "syncs.jsonl", tensorboard_dir=tmp_path / "tb", append=True)
    for t in range(13, 21):
        _logged_step(eng, t)
    log.close()
    recs = [json.loads(x) for x in (tmp_path / "syncs.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [5, 10, 15, 20]
    ea = EventAccumulator(str(tmp_path / "tb"))
    ea.Reload()
    tb = [(e.step, e.value) for e in ea.Scalars("hdet/window_loss/replica0")]
    assert [s for s, _ in tb] == [5, 10, 15, 20]
    assert [v for _, v in tb] == pytest.approx([r["losses"][0] for r in recs], rel=1e-6)


def test_a_logger_that_raises_stops_the_run_after_a_complete_step(tmp_path):
    """A callback that raises (a tracker's network error) raised inside the converge step: the schedulers were left
    half-stepped, and no checkpoint could be written after it. The error is raised once the step is complete: the
    state saves, and the run resumed from it ends as the run that never failed; the other hooks still ran."""
    def flaky(rec):
        if rec["step"] == 10:
            raise ConnectionError("tracker unreachable")

    def run(callback, stop_at_error):
        eng, got = _logged_engine(), []
        hdet.SyncLogger(eng.schedulers[0], None, callback=callback)
        hdet.SyncLogger(eng.schedulers[0], None, callback=lambda d: got.append(d["step"]))
        for t in range(1, 21):
            try:
                _logged_step(eng, t)
            except ConnectionError:
                assert stop_at_error and t == 10
                assert [s.last_epoch for s in eng.schedulers] == [10] * 4
                again = _logged_engine()
                again.load_state_dict(copy.deepcopy(eng.state_dict()))  # (refused before: "half-stepped")
                eng = again
        return eng, got

    failed, got = run(flaky, True)
    whole, _ = run(lambda d: None, False)
    assert got == [5, 10]  # (the second logger heard step 10 though the first raised; the resumed engine has none)
    for a, b in zip(failed.models, whole.models):
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.equal(p, q)
    eng = _logged_engine(N=2)
    hdet.SyncLogger(eng.schedulers[0], None, callback=lambda d: flaky({"step": d["step"] + 3}))  # (raises at step 7)
    for t in range(1, 8):
        _logged_step(eng, t, N=2)
    with pytest.raises(ConnectionError):
        eng.finish()  # (a run that ends early: its converge step at 7)
    eng.state_dict()


def _one_group(value=0.1):
    return torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=value)


def test_a_recorded_zero_weight_decay_and_a_linear_onecycles_last_row_replay():
    """A log spread keeps 0 at 0 (a weight decay warmed up from 0, or decayed to it), and the last row is set after
    the last step, never used (torch's linear OneCycleLR goes below 0 there, and so did the run that recorded it):
    both were refused, so such runs could not be replayed (an audit)."""
    o = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=0.1, weight_decay=0.01)
    wd = hdet.WeightDecay(o)
    replay = hdet.ReplayLR(o, {"names": ["lr/0", wd.name], "bases": [[0.1, 0.0], [0.2, 0.01], [0.3, 0.0]]},
                           explore=[wd])
    assert o.param_groups[0]["weight_decay"] == 0.0 and replay.get_last_lr() == [0.1]
    hdet.ReplayLR(_one_group(), {"names": ["lr/0"], "bases": [[0.1], [0.2], [-0.007]]})  # the last row
    with pytest.raises(ValueError, match="step 1 holds"):
        hdet.ReplayLR(_one_group(), {"names": ["lr/0"], "bases": [[0.1], [-0.2], [0.1]]})


def test_replays_state_sets_the_steps_lrs_on_a_fresh_optimizer_and_refuses_another_schedulers():
    """A weights-only checkpoint and the replay's state: the LRs of the step it stopped at, set at the load (the fresh
    optimizer went on at its own first LR for a step); another scheduler's state, an HDETLR's, is refused (it was taken,
    and failed later with a misleading step count; an audit)."""
    schedule = {"names": ["lr/0"], "bases": [[0.01 * (t + 1)] for t in range(6)]}
    o = _one_group()
    r = hdet.ReplayLR(o, schedule)
    for _ in range(3):
        o.step()
        r.step()
    fresh = _one_group(0.5)
    r2 = hdet.ReplayLR(fresh, schedule)
    r2.load_state_dict(copy.deepcopy(r.state_dict()))
    assert fresh.param_groups[0]["lr"] == o.param_groups[0]["lr"] == pytest.approx(0.04)
    assert r2.get_last_lr() == r.get_last_lr()
    other = hdet.HDETLR(_one_group(), None, 5, replicas=ScriptedReplicas(0, 4))
    with pytest.raises(ValueError, match="Expected a state_dict\\(\\) of a ReplayLR of this schedule"):
        r2.load_state_dict(other.state_dict())


def test_a_state_taken_inside_averaged_resumes_the_replicas_own_values():
    """HDETTrainer saves inside averaged(), where the explored values are held at their bases: the state kept those
    as this replica's, and its resumed next step ran at the bases (an audit). It keeps the replica's own now."""
    def build():
        torch.manual_seed(0)
        crit = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
        o = torch.optim.AdamW(torch.nn.Linear(3, 1).parameters(), lr=0.01, weight_decay=0.02)
        s = hdet.HDETLR(o, None, 20, ensemble_lr_spread_ratio=0.2, model_sync_interval=5, replicas=ScriptedReplicas(0, 4),
                        explore=[hdet.WeightDecay(o), hdet.LabelSmoothing(crit)])
        return o, s, crit

    def values(o, crit):
        return o.param_groups[0]["weight_decay"], crit.label_smoothing, o.param_groups[0]["lr"]
    o, s, crit = build()
    for _ in range(10):
        o.step()
        s.step(torch.tensor(1.0))
    own = values(o, crit)
    with s.averaged():
        assert values(o, crit)[:2] != own[:2]  # the bases, meanwhile
        state, opt_state = copy.deepcopy(s.state_dict()), copy.deepcopy(o.state_dict())
    o2, s2, crit2 = build()
    o2.load_state_dict(opt_state)
    s2.load_state_dict(state)
    assert values(o2, crit2) == pytest.approx(own)
