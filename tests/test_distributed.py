"""Real multi-process tests: spawned gloo processes on CPU, world size 2 and 4."""

import inspect
import math

import pytest
import torch
from torch import nn

import hdet
from dist_workers import (alpha_zero_vs_plain_ddp, averaging_collectives, bn_and_int_buffers, layout_mismatch,
                          missing_loss_on_one_rank, non_finite_weights, train, empty_windows, unfrozen_under_ddp)
from helpers import check_ok, run_gloo
from hdet import linear_multipliers

pytestmark = pytest.mark.distributed


def test_alpha_zero_is_bitwise_plain_ddp_onecycle():
    res = check_ok(run_gloo(alpha_zero_vs_plain_ddp, 2))
    for r in res:
        assert r["equal_params"] and r["equal_lrs"]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("auto", [False, True])
def test_spread_and_converge(world, auto):
    res = check_ok(run_gloo(_train_spread, world, auto))
    rho = linear_multipliers(world, 0.3)
    ref = res[0]["ref_lrs"]
    for rank, r in enumerate(res):
        assert r["rng_untouched"]
        # weights (and BatchNorm statistics) equal right after every sync, different just before
        assert r["equal_after_sync"] and all(r["equal_after_sync"])
        assert all(r["differ_before_sync"])
        if not auto:  # replica r's LR is OneCycle(t) * rho_r from the very first step (the last entry: after the
            # close at total_steps, the base's on every replica)
            assert r["lrs"][:-1] == pytest.approx([lr * rho[rank] for lr in ref[:-1]], rel=1e-12)
            assert r["lrs"][-1] == pytest.approx(ref[-1], rel=1e-12)
    if auto:  # after every controller sync the multipliers across replicas are a permutation of rho
        n_syncs = len(res[0]["mults_after_control"])
        assert n_syncs == 5
        for k in range(n_syncs):
            got = sorted(res[0]["mults_after_control"][k])
            assert got == pytest.approx(rho, rel=1e-12)
            assert all(r["mults_after_control"][k] == res[0]["mults_after_control"][k] for r in res)


def _train_spread(rank, world, auto):
    out = train(rank, world, steps=50, alpha=0.3, T=10, auto=auto, warm=10, check_syncs=True, uneven_rng=True)
    from torch.optim.lr_scheduler import OneCycleLR
    o = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    s = OneCycleLR(o, max_lr=0.02, total_steps=50)
    ref = [s.get_last_lr()[0]]
    for _ in range(50):
        o.step()
        s.step()
        ref.append(s.get_last_lr()[0])
    out["ref_lrs"] = ref
    return out


def test_batchnorm_stats_averaged_integer_buffers_untouched():
    res = check_ok(run_gloo(bn_and_int_buffers, 2))
    assert all(r["stats_equal"] for r in res)
    assert [r["nbt"] for r in res] == [5, 6]  # per-replica counts survive the converge step


@pytest.mark.parametrize("stop", [20, 23])
def test_resume_in_fresh_processes_is_bitwise(tmp_path, stop):
    kw = dict(steps=40, alpha=0.3, T=10, auto=True, warm=10, loss_scale=0.01)
    full = check_ok(run_gloo(_train_kw, 2, kw))
    check_ok(run_gloo(_train_kw, 2, dict(kw, save_at=stop, ckpt_dir=str(tmp_path))))
    resumed = check_ok(run_gloo(_train_kw, 2, dict(kw, resume_from=str(tmp_path))))
    for a, b in zip(full, resumed):
        assert all(torch.equal(p, q) for p, q in zip(a["params"], b["params"]))
        assert all(torch.equal(a["buffers"][k], b["buffers"][k]) for k in a["buffers"])
        assert a["lrs"][stop + 1:] == b["lrs"][1:]
    assert full[0]["lrs"] != full[1]["lrs"]


@pytest.mark.parametrize("stop", [20, 23])
def test_a_resumed_spread_over_d_adaptation_under_ddp_is_bitwise(tmp_path, stop):
    """HDET over D-Adaptation under DDP, checkpointed at a converge step or mid-window and resumed in fresh
    processes: the same weights as the uninterrupted run, its estimate d and multipliers on the step included."""
    pytest.importorskip("dadaptation")
    kw = dict(steps=40, alpha=0.3, T=10, opt="dadapt")
    full = check_ok(run_gloo(_train_kw, 2, kw))
    check_ok(run_gloo(_train_kw, 2, dict(kw, save_at=stop, ckpt_dir=str(tmp_path))))
    resumed = check_ok(run_gloo(_train_kw, 2, dict(kw, resume_from=str(tmp_path))))
    for a, b in zip(full, resumed):
        assert all(torch.equal(p, q) for p, q in zip(a["params"], b["params"]))
        assert a["lrs"][stop + 1:] == b["lrs"][1:]
    assert full[0]["lrs"] == full[1]["lrs"]  # the optimizer's LR is the base on every rank: rho_r is on the step


def _train_kw(rank, world, kw):
    return train(rank, world, **kw)


@pytest.mark.parametrize("world", [2, 4])
def test_rank_0s_checkpoint_loaded_scheduler_first_resumes_each_replica_at_its_own_values(tmp_path, world):
    """Rank 0's checkpoint (at converge step 20) loaded on every rank, the scheduler's state before the optimizer's:
    the optimizer's param groups then held rank 0's LR and weight decay, and every replica's first resumed step ran at
    replica 0's values, silently (an audit: weights 1.4e-2 off at the end). Set again at that step now: the same
    LR and weight decay at every step as the uninterrupted run in either order, and at world 2 the same weights (at
    world 4 a resumed DDP run's first buckets sum in another order, Adam making it 1e-3 without HDET too)."""
    kw = dict(steps=30, alpha=0.3, T=10, explore_wd=True, opt="adamw")  # (decoupled: the moments equal per replica)
    full = check_ok(run_gloo(_train_kw, world, kw))
    check_ok(run_gloo(_train_kw, world, dict(kw, save_at=20, ckpt_dir=str(tmp_path))))
    for first in (True, False):
        resumed = check_ok(run_gloo(_train_kw, world, dict(kw, resume_from=str(tmp_path), load_rank=0,
                                                           sched_first=first)))
        for a, b in zip(full, resumed):
            assert b["stepped"] == a["stepped"][20:], (first, b["stepped"][:2], a["stepped"][20:22])
            assert world == 4 or all(torch.equal(p, q) for p, q in zip(a["params"], b["params"])), first
    assert len({r["stepped"][20] for r in full}) == world  # (each replica at its own values)


def test_layout_mismatch_is_a_clear_error_on_every_rank():
    res = run_gloo(layout_mismatch, 2)
    for r in res:
        assert r["error"] == "ReplicaMismatchError"  # a RuntimeError
        assert "different tensors to average" in r["msg"]


def test_non_finite_replica_is_named_and_never_averaged():
    res = check_ok(run_gloo(non_finite_weights, 4))
    for rank, r in enumerate(res):
        assert r["error"] == "NonFiniteReplicaError"
        assert "non-finite weights on replica(s) [1]" in r["msg"]
        assert r["finite_after"] == (rank != 1)


def test_missing_loss_on_one_rank_fails_on_all_ranks():
    res = run_gloo(missing_loss_on_one_rank, 2)
    for r in res:
        assert r["error"] == "ValueError" and "replica(s) [1] passed no loss" in r["msg"]


def test_a_window_that_measured_nothing_moves_neither_eq4_nor_eq5():
    """A replica whose window measured nothing (a rank whose every step had no label token: observe(counted=False))
    gets no weight in Eq. 4 and stays out of Eq. 5's h_bar: two equal losses beside it give a delta of 0, as three
    equal losses do (a review: h_bar over all three gave -0.025 at LRs 0.05 / 0.10 / 0.15, the base pushed towards the
    measured replicas whatever their losses). Where the only other replica had a NaN loss (ranked worst), the empty
    ones are the healthy ones: the NaN replica got all the weight (its stand-in loss read as a measurement)."""
    equal = check_ok(run_gloo(empty_windows, 3, [2.0, 2.0, 2.0]))[0]
    got = check_ok(run_gloo(empty_windows, 3, [2.0, 2.0, None]))[0]
    assert got["values"] == pytest.approx([0.05, 0.10, 0.15]) and got["weights"] == pytest.approx([0.5, 0.5, 0.0])
    assert equal["delta"] == pytest.approx(0.0, abs=1e-15) and got["delta"] == pytest.approx(0.0, abs=1e-15)
    assert got["new_base"] == equal["new_base"]  # Eq. 7 goes on from the base (every replica's mean)
    one = check_ok(run_gloo(empty_windows, 3, [3.0, None, None]))[0]  # one measured replica: no signal
    assert one["weights"] == pytest.approx([1.0, 0.0, 0.0]) and one["delta"] == pytest.approx(0.0, abs=1e-15)
    nan = check_ok(run_gloo(empty_windows, 3, [float("nan"), None, None]))[0]
    assert nan["weights"][0] < 1e-3 and nan["delta"] > 0  # away from the NaN replica's low LR
    assert check_ok(run_gloo(empty_windows, 3, [None, None, None]))[0]["delta"] == pytest.approx(0.0, abs=1e-15)


def test_one_collective_per_bucket():
    # 150 tensors of 1000 floats (600 KB): one bucket with the default cap, ~6 with a 0.1 MB cap
    res = check_ok(run_gloo(averaging_collectives, 2, 150, 1000, 25.0))
    assert all(r["calls"] == 1 and r["close"] for r in res)
    res = check_ok(run_gloo(averaging_collectives, 2, 150, 1000, 0.1))
    expected = math.ceil(150 * 4000 / (0.1 * 2**20))
    assert all(r["calls"] == expected and r["close"] for r in res)


@pytest.mark.parametrize("exclude", [(), (1,)])
def test_contiguous_tensors_are_averaged_in_place_in_one_collective(exclude):
    """Tensors that are views of one flat buffer: one all_reduce over that buffer whatever the bucket
    cap (no copy: the tensors keep their storage); mixed with separate tensors (and another dtype) the
    rest still goes through buckets; a left-out replica (NaNs) gets the others' mean on every path."""
    res = check_ok(run_gloo(averaging_collectives, 2, 150, 1000, 0.1, "contiguous", exclude))
    assert all(r["calls"] == 1 and r["close"] and r["same_storage"] for r in res)
    res = check_ok(run_gloo(averaging_collectives, 2, 150, 1000, 0.1, "mixed", exclude))
    expected = 1 + math.ceil(75 * 4000 / (0.1 * 2**20)) + 1  # the run, float32 buckets, the float64 tensor
    assert all(r["calls"] == expected and r["close"] and r["same_storage"] for r in res)


def _layouts_apart(rank, world, where):
    """Rank 0's parameters contiguous, rank 1's not (a BatchNorm model: the runs' sizes differ); a converge step or
    an evaluation of the average (``where``). Returns the error each rank raised."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
    if rank == 0:
        hdet.contiguous_parameters_(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    sched = hdet.HDETLR(opt, None, total_steps=10, model_sync_interval=2 if where == "sync" else 5, model=net,
                        ensemble_lr_spread_ratio=0.2, bucket_cap_mb=1e-4)
    try:
        for _ in range(2):
            net(torch.randn(8, 6)).square().mean().backward()
            opt.step()
            sched.step()
            opt.zero_grad()
        if where == "averaged":
            with sched.averaged():
                pass
    except hdet.ReplicaMismatchError as e:
        return str(e)
    return None


@pytest.mark.parametrize("where", ["sync", "averaged"])
def test_ranks_whose_parameters_are_laid_out_apart_get_a_clear_error(where):
    """contiguous_parameters_ on one rank only (or undone on one by a load with assign=True): the converge step
    all-reduced runs in place on that rank and buckets on the other, other collectives (gloo aborted on a size
    mismatch, NCCL hung until its timeout; an audit). The memory layouts are compared first: a clear error on
    every rank, before any collective of the averaging."""
    res = check_ok(run_gloo(_layouts_apart, 2, where))
    assert all(r is not None and "laid out differently in memory" in r and "contiguous_parameters_" in r for r in res)



def _square_step(model, opt, sched, rank):
    """One step of a 4-input model on this rank's own batch (a squared output's mean), its scheduler's step after."""
    model(torch.randn(8, 4, generator=torch.Generator().manual_seed(rank))).square().mean().backward()
    opt.step()
    sched.step()
    opt.zero_grad()

def _resume_loaded(rank, world, when, max_norm=False, evaluate=False):
    """Train 3 steps (T = 5: the replicas apart), save each rank's states, then resume into a fresh model whose state
    is loaded ``when`` ("before" or "after" DDP is built); returns the warnings of the first resumed step that say
    the weights are not the saved ones, and whether this rank resumed from its own saved weights. ``max_norm``: the
    model starts with an ``nn.Embedding(max_norm=...)``, whose forward renormalises its rows in place; ``evaluate``:
    the first forward after the load evaluates the replicas' average (``sched2.averaged()``)."""
    import copy
    import warnings

    from torch.nn.parallel import DistributedDataParallel as DDP

    class Embedded(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.out = nn.Embedding(10, 4, max_norm=0.5), nn.Linear(4, 2)

        def forward(self, x):
            return self.out(self.emb((x.abs() * 3).long().clamp(max=9)).mean(1))

    def build(seed):
        torch.manual_seed(seed)
        net = Embedded() if max_norm else nn.Linear(4, 2)
        return net

    def parts(net):
        model = DDP(net)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return model, opt, hdet.HDETLR(opt, None, total_steps=10, model_sync_interval=5, ensemble_lr_spread_ratio=0.5,
                                       model=model)

    net = build(0)
    model, opt, sched = parts(net)
    for _ in range(3):
        _square_step(model, opt, sched, rank)
    saved = copy.deepcopy({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()})
    net2 = build(100 + rank)
    if when == "before":
        net2.load_state_dict(saved["model"])
    model2, opt2, sched2 = parts(net2)
    if when == "after":
        net2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    own = all(torch.equal(a, b) for a, b in zip(net2.state_dict().values(), saved["model"].values()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if evaluate:
            with sched2.averaged(), torch.no_grad():
                model2(torch.randn(8, 4))
        _square_step(model2, opt2, sched2, rank)
        _square_step(model2, opt2, sched2, rank)
    return [str(w.message) for w in caught if "after load_state_dict" in str(w.message)], own


def test_a_model_state_loaded_before_ddp_is_said_at_the_first_step():
    """Each rank's own checkpoint loaded into the model before DDP(...) was built: DDP's constructor copies rank 0's
    weights to every rank, and the resumed run went on from rank 0's replica everywhere, silently (an audit: 6.5e-3
    from the uninterrupted run). The scheduler state holds its rank's weights' fingerprint; the first optimizer step
    after the load compares: a warning on the ranks that lost theirs, once; none loaded after wrapping."""
    before = check_ok(run_gloo(_resume_loaded, 2, "before"))
    assert before[0] == ([], True)  # rank 0 kept its own
    said, own = before[1]
    assert not own and len(said) == 1 and "rank 1's weights" in said[0] and "after wrapping" in said[0]
    after = check_ok(run_gloo(_resume_loaded, 2, "after"))
    assert after == [([], True), ([], True)]


def test_a_model_state_loaded_after_ddp_is_not_said_when_the_forward_writes_weights():
    """The weights' check after a resume compares at the first optimizer step, after the forward: nn.Embedding with
    max_norm renormalises its rows in place there, and a resume done as the docs say warned on every rank that its
    weights were not the ones saved (an audit). Those weights are left out of the fingerprint (a forward hook that
    compared before the forward broke torch.compile's graph, a review); loaded before DDP the warning still comes, and
    a first forward inside averaged() changes nothing."""
    assert check_ok(run_gloo(_resume_loaded, 2, "after", True)) == [([], True), ([], True)]
    said, own = check_ok(run_gloo(_resume_loaded, 2, "before", True))[1]
    assert not own and len(said) == 1 and "rank 1's weights" in said[0]
    # a first forward that evaluates the average (swapped in): the check at the step is as without it
    assert check_ok(run_gloo(_resume_loaded, 2, "after", False, True)) == [([], True), ([], True)]
    said, own = check_ok(run_gloo(_resume_loaded, 2, "before", False, True))[1]
    assert not own and len(said) == 1 and "rank 1's weights" in said[0]


def _hsdp_rank0_state(rank, world):
    """HSDP as 2 replicas x 2 shard ranks: rank 0's scheduler state loaded on every rank (as Accelerate and Lightning
    save it), each rank's own model shard; returns the weights warnings of the first step."""
    import copy
    import warnings

    from hdet.replicas import ProcessGroupReplicas
    shards = [torch.distributed.new_group([0, 1]), torch.distributed.new_group([2, 3])]
    reps = [torch.distributed.new_group([0, 2]), torch.distributed.new_group([1, 3])]

    def build():
        torch.manual_seed(100 + rank % 2)  # this rank's shard
        m = nn.Linear(4, 2)
        o = torch.optim.SGD(m.parameters(), lr=0.1)
        return m, o, hdet.HDETLR(o, None, total_steps=50, model_sync_interval=10, model=m,
                                 replicas=ProcessGroupReplicas(reps[rank % 2], shard_group=shards[rank // 2]))

    m, o, s = build()
    for _ in range(3):
        m(torch.randn(8, 4)).square().mean().backward()
        o.step()
        o.zero_grad()
        s.step()
    own, state = copy.deepcopy(m.state_dict()), [s.state_dict()]
    torch.distributed.broadcast_object_list(state, src=0)
    m2, o2, s2 = build()
    m2.load_state_dict(own)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s2.load_state_dict(state[0])
        m2(torch.randn(8, 4)).square().mean().backward()
        o2.step()
    return [str(w.message) for w in caught if "after load_state_dict" in str(w.message)]


def test_the_weights_check_compares_a_shard_with_the_same_shards_fingerprint():
    """Under HSDP a replica is several ranks, each with its own shard: rank 0's state loaded on every rank made shard
    rank 1 of replica 0 compare its shard with shard 0's fingerprint and warn (a review). Only the same shard rank
    of the replica that saved it compares."""
    assert check_ok(run_gloo(_hsdp_rank0_state, 4)) == [[], [], [], []]


def _train_contiguous(rank, world, contiguous):
    return train(rank, world, steps=20, alpha=0.3, T=5, auto=True, warm=5, check_syncs=True, contiguous=contiguous)


def test_contiguous_parameters_train_bitwise_like_separate_ones():
    """hdet.contiguous_parameters_ changes where the weights live, not what they are: 2 gloo replicas,
    auto-LR, 4 syncs: bitwise the same weights and buffers as separate parameters, and the parameters
    are still one run (one collective) at the end."""
    a = check_ok(run_gloo(_train_contiguous, 2, False))
    b = check_ok(run_gloo(_train_contiguous, 2, True))
    for ra, rb in zip(a, b):
        assert all(torch.equal(x, y) for x, y in zip(ra["params"], rb["params"]))
        assert all(torch.equal(ra["buffers"][k], rb["buffers"][k]) for k in ra["buffers"])
        assert all(rb["equal_after_sync"]) and len(rb["equal_after_sync"]) == 4
        assert rb["runs"] == 1 and ra["runs"] == 6  # 6 parameters


def _local_recovery(rank, world):
    from dist_workers import local_recovery

    return local_recovery(rank, world)


def test_a_recovery_on_gloo_leaves_the_healthy_replicas_moments_alone():
    """3 gloo processes in local mode, rank 1's weight NaN from step 7: the step-10 sync resets it; each
    healthy rank keeps its own Adam moments (not the mean) and rank 1 gets theirs, as the engine does
    (tests/test_reliability.py, the same run in one process)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_reliability import _local_adam

    res = check_ok(run_gloo(_local_recovery, 3))
    _, seen = _local_adam(poison_at=7)
    assert all(r["recovered"] == [1] for r in res)
    for r in range(3):
        torch.testing.assert_close(res[r]["exp_avg_sq"], seen[-1][r], rtol=1e-5, atol=1e-9)
    assert not torch.allclose(res[0]["exp_avg_sq"], res[2]["exp_avg_sq"])


def _local_skip_guard(rank, world):
    from dist_workers import local_skip_guard_nan

    return local_skip_guard_nan(rank, world)


def test_local_mode_under_the_skip_guard_resets_a_nan_replica_at_the_converge_step():
    """Local mode with a fused optimizer (the "skip-all" guard): only the NaN replica skips its steps, and its stall
    detector started an early recovery (a collective) on that rank alone, which met the others' converge step: the
    run stopped with a mismatch error naming steps [40, 30]. Now the converge step resets it and training goes on."""
    res = check_ok(run_gloo(_local_skip_guard, 2))
    for r in res:
        assert r["guard"] == "skip-all" and r["finite"], r
        assert r["recovered"] == [(40, [1])], r["recovered"]
    assert torch.equal(res[0]["weights"], res[1]["weights"])  # the run's last step is a converge step
    assert res[1]["skipped"] == 38.0 and res[0]["skipped"] == 0.0  # rank 1 skipped its own steps 3-40


def _fault(rank, world, kw):
    from dist_workers import fault_injection

    return fault_injection(rank, world, **kw)


def _failed_construction(rank, world):
    from dist_workers import failed_construction

    return failed_construction(rank, world)


def _prodigy_local_skip(rank, world):
    import warnings

    from dist_workers import prodigy_local_skip

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the scheduler's note on a step the GradScaler skipped)
        return prodigy_local_skip(rank, world)


def test_prodigy_in_local_mode_with_a_step_skipped_on_one_rank():
    """Prodigy's estimate is shared at every scheduler step, which every rank takes: a step its GradScaler skipped on
    rank 0 alone (local mode) no longer leaves the ranks' per-step gathers paired apart (d from other steps' numerators,
    then an abort at the converge step). Rank 0 takes one step fewer; d agrees again from the next step on, and the
    replicas are equal after the last converge step."""
    pytest.importorskip("prodigyopt")
    res = check_ok(run_gloo(_prodigy_local_skip, 2))
    assert res[0]["k"][-1] == res[1]["k"][-1] - 1  # rank 0's skipped step: Prodigy's own count
    assert res[0]["d"][3:] == res[1]["d"][3:] and res[0]["d"][:2] == res[1]["d"][:2]
    assert torch.equal(res[0]["w"], res[1]["w"])


def _local_scaler_first_steps(rank, world):
    from dist_workers import local_scaler_first_steps

    return local_scaler_first_steps(rank, world)


def test_local_mode_with_a_scaler_whose_first_steps_differ_by_rank_does_not_hang():
    res = check_ok(run_gloo(_local_scaler_first_steps, 2))
    assert [r["guard"] for r in res] == ["hook", "hook"]
    assert res[0]["scales"] == [1024.0] * 8 and res[1]["scales"][:5] == [512.0, 256.0, 128.0, 64.0, 32.0]
    assert res[0]["equal"]  # (the last step, 8, is a converge step)


def _local_reset_scales(rank, world, T):
    from dist_workers import local_reset_scales

    return local_reset_scales(rank, world, T=T)


@pytest.mark.parametrize("T", [2, 4])
def test_local_mode_puts_back_the_scale_of_the_reset_replica_only(T):
    """In local mode each rank's GradScaler is its own: a reset of rank 1's replica puts its scale back (to its last
    step taken's, not what its NaN steps left) and leaves rank 0's, which kept doubling (it was put back too, to 4x
    below its own here, before: 1024 at step 4 instead of 4096). At T = 4 no sync came before the fault: the reset
    left rank 1's scale collapsed before (256), the last step taken's scale kept only at healthy syncs in local mode."""
    res = check_ok(run_gloo(_local_reset_scales, 2, T))
    assert [r["guard"] for r in res] == ["hook", "hook"]
    syncs = [(2, []), (4, [1]), (6, [])] if T == 2 else [(4, [1]), (6, [])]  # (the last step is a converge step too)
    assert res[0]["recovered"] == res[1]["recovered"] == syncs
    assert res[0]["scales"] == [2.0 ** (8 + t) for t in range(1, 7)]  # every step taken: doubled every time
    # rank 1: NaN from step 3 (halved; at step 4 halved again, then the reset puts back step 2's, its last step
    # taken), then doubled at every step taken again
    assert res[1]["scales"] == [2.0 ** 9, 2.0 ** 10, 2.0 ** 9, 2.0 ** 10, 2.0 ** 11, 2.0 ** 12]
    assert res[0]["finite"] and res[1]["finite"]


def _aliased_parameter(rank, world, nan):
    from dist_workers import aliased_parameter

    return aliased_parameter(rank, world, nan=nan)


@pytest.mark.parametrize("nan", [False, True])
def test_two_parameters_over_one_memory_are_averaged_once(nan):
    res = check_ok(run_gloo(_aliased_parameter, 3, nan))
    assert res == [[1.5, 1.5]] * 3 if nan else res == [[2.0, 2.0]] * 3


def test_a_failed_construction_leaves_no_guard_behind():
    """A scheduler whose construction fails installs nothing on the DDP model (DDP takes one comm hook: the next,
    correct scheduler's guard raised) and leaves the param groups as they were."""
    res = check_ok(run_gloo(_failed_construction, 2))
    for r, out in enumerate(res):
        assert "NaN" in out["first"] or "nan" in out["first"], out["first"]
        assert "skip a step on the device" in out["second"], out["second"]
        assert all("initial_lr" not in g and g["lr"] == 0.1 for g in out["groups"]), out["groups"]
        assert out["guard"] == "hook" and out["finite"]
        assert out["lr"] == [pytest.approx(0.1)]  # (closed after its 10 steps: the base's LR on every rank)


@pytest.mark.parametrize("fault", ["weights", "loss"])
def test_non_finite_replica_is_dropped_reset_and_training_goes_on(fault):
    """4 gloo replicas, Adam, auto-LR. At step 7 replica 2 gets a NaN weight (or a NaN loss) mid-window:
    no other replica ever sees a NaN (the gradient guard keeps it out of the all-reduce), the converge
    step at 10 leaves a NaN-weight replica 2 out and resets it (a NaN loss with finite weights is counted
    in nonfinite_losses instead: nothing to reset), all replicas are finite and equal after it, and the
    run finishes."""
    res = check_ok(run_gloo(_fault, 4, {"fault": fault}))
    for r, out in enumerate(res):
        assert out["error"] is None and out["guard"] == "hook"  # a non-fused optimizer: "auto" picks the hook
        if r == 2 and fault == "weights":
            assert out["finite"][:6] == [True] * 6 and not any(out["finite"][6:9])  # NaN from step 7 to 9
        else:
            assert all(out["finite"]), (r, out["finite"])  # the others never see a NaN
        assert out["finite"][9:] == [True] * 11  # the sync at step 10 reset replica 2
        assert out["equal"] == [True] * 4
        assert out["recovered"] == ([[], [2], [], []] if fault == "weights" else [[]] * 4)
        assert out["nonfinite_losses"][1] == ([0, 0, 1, 0] if fault == "loss" else [0, 0, 4, 0])  # NaN weight: steps 7-10
        assert len(out["warnings"]) == 1 and "replica(s) [2]" in out["warnings"][0]


@pytest.mark.parametrize("fault,clip", [("weights", False), ("loss", False), ("weights", True), ("loss", True)])
def test_skip_guard_skips_the_step_everywhere_and_the_bad_replica_is_reset(fault, clip):
    """The same faults with torch's fused Adam, so "auto" picks the "skip-all" guard (no comm hook): while
    replica 2 is non-finite (step 7 for a NaN loss, steps 7-10 for a NaN weight) the averaged gradient is
    non-finite on every replica and every replica skips the step on the device (weights and Adam's step
    count untouched); no healthy replica ever sees a NaN; the sync at step 10 resets replica 2. Clipping
    through ``scheduler.clip_grad_norm_``, the clip's norm decides the same steps and the guard makes no
    pass of its own (one a step otherwise)."""
    res = check_ok(run_gloo(_fault, 4, {"fault": fault, "fused": True, "clip": clip}))
    bad = [7] if fault == "loss" else [7, 8, 9, 10]  # the NaN weight is in step 10's forward too
    for r, out in enumerate(res):
        assert out["error"] is None and out["guard"] == "skip-all"
        if r == 2 and fault == "weights":
            assert not any(out["finite"][6:9])  # its own NaN weight, until the sync
        else:
            assert all(out["finite"]), (r, out["finite"])
            assert [t for t, c in enumerate(out["changed"], 1) if not c] == bad  # skipped exactly then
        assert out["skipped"] == len(bad) and out["steps"] == [20 - len(bad)]
        assert out["own_passes"] == (0 if clip else 20)
        assert out["finite"][9:] == [True] * 11 and out["equal"] == [True] * 4
        assert out["recovered"] == ([[], [2], [], []] if fault == "weights" else [[]] * 4)
        assert out["nonfinite_losses"][1] == ([0, 0, 1, 0] if fault == "loss" else [0, 0, 4, 0])  # NaN weight: steps 7-10


def _hsdp_guard(rank, world, fault):
    from dist_workers import hsdp_guard

    return hsdp_guard(rank, world, fault=fault)


@pytest.mark.parametrize("fault", ["loss", "shard", "shard-matrix"])
def test_skip_guard_on_sharded_replicas_decides_once_for_the_whole_mesh(fault):
    """FSDP2/HSDP, (2, 2) mesh, fused AdamW: a NaN loss on one shard rank of replica 0, or a NaN in one
    rank's own gradient shard that no other rank sees (a matrix's under the default "skip-all", a bias's under
    "skip", the sentinels): all four ranks skip that step (their flags are all-reduced over the mesh), no shard ever holds a
    NaN, and the replicas are equal after the syncs."""
    res = check_ok(run_gloo(_hsdp_guard, 4, fault))
    for out in res:
        assert out["guard"] == ("skip" if fault == "shard" else "skip-all")
        assert [t for t, c in enumerate(out["changed"], 1) if not c] == [3] and out["skipped"] == 1.0
        assert all(out["finite"])
        assert out["recovered"] == [[], []]  # finite weights everywhere: nothing to reset
        assert out["nonfinite_losses"] == ([[1, 0], [0, 0]] if fault == "loss" else [[0, 0], [0, 0]])
        assert out["replicas_equal"]  # this rank's shards equal those of the other replica's matching rank
        assert out["guard_kept"]  # the state round trip (weights_only=True) left the live guard alone


def test_a_nan_weight_shard_counts_each_step_once_for_its_replica():
    """A NaN in one shard of replica 0's weights at step 3 (T = 5): both of its shard ranks see NaN losses at steps
    3-5, and the sync resets it. The count of non-finite losses was summed over the shard ranks (6, where DDP says
    3: an audit); a step is one step whichever shard saw it, so it is their max now."""
    res = check_ok(run_gloo(_hsdp_guard, 4, "weight"))
    for out in res:
        assert out["nonfinite_losses"] == [[3, 0], [0, 0]], out["nonfinite_losses"]
        assert out["recovered"] == [[0], []] and out["finite"][-1] and out["replicas_equal"]


def test_without_the_guard_a_nan_loss_reaches_every_replica():
    """The same NaN loss with guard_gradients=False: the all-reduce spreads it to all replicas, so the
    converge step finds every replica non-finite and stops with a clear error (what the guard prevents)."""
    res = check_ok(run_gloo(_fault, 4, {"fault": "loss", "guard": False}))
    for out in res:
        assert out["error"] == "NonFiniteReplicaError" and "(every replica)" in out["msg"]
        assert out["finite"] == [True] * 6 + [False] * 3  # NaN everywhere from step 7; the sync at 10 stops


def test_a_replica_that_never_arrives_is_a_clear_error_within_the_timeout(tmp_path):
    """Replica 1 never reaches the converge step; with a 3 s process-group timeout, replica 0 gets a
    ReplicaSyncError that says what happened within a few seconds, not a silent hang."""
    import torch.multiprocessing as mp

    from dist_workers import _timeout_entry

    mp.spawn(_timeout_entry, args=(2, str(tmp_path), 1, 3), nprocs=2, join=True)
    res = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert res["error"] == "ReplicaSyncError"
    assert "never arrived within the process group's timeout" in res["msg"] and "optimizer step 2" in res["msg"]
    assert res["seconds"] < 30


def _soak(rank, world):
    from dist_workers import soak

    return soak(rank, world)


def test_soak_with_random_faults():
    """4 gloo replicas, 2500 steps, random NaN losses and weights, skipped steps and save/load round
    trips; after every sync: equal, finite weights, multipliers a permutation of rho, LR within bounds."""
    res = check_ok(run_gloo(_soak, 4))
    c = res[0]
    assert all(r == c for r in res)
    assert c["syncs"] == 250 and c["nan_loss"] > 10 and c["nan_weight"] >= 5 and c["skip"] > 20
    assert c["save_load"] > 30 and c["rebuild"] > 6 and c["recovered"] >= c["nan_weight"] // 2
    assert c["counted_losses"] >= c["nan_loss"]  # each NaN loss counted (a NaN weight adds its own until reset)


def _acc(rank, world):
    from dist_workers import accumulate

    return accumulate(rank, world)


def test_gradient_accumulation_counts_optimizer_steps():
    res = check_ok(run_gloo(_acc, 2))
    for r in res:
        a, b = r["one_batch"], r["accumulate"]
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-5) and a["updates"] == b["updates"] == 3
        for p, q in zip(a["params"], b["params"]):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)  # sums of micro-batches round differently


def _local(rank, world):
    from dist_workers import local_mode

    return local_mode(rank, world)


@pytest.mark.parametrize("kind", ["dadapt", "prodigy"])
def test_a_spread_over_a_distance_estimator_under_ddp(kind):
    """D-Adaptation / Prodigy under DDP with alpha 0.5: every rank steps at the same base LR with its multiplier
    on the step; d agrees across ranks after every step (D-Adaptation's reads only the shared gradients;
    Prodigy's numerator, which reads each rank's weights, is shared through an all_gather at every step)."""
    pytest.importorskip("dadaptation")
    pytest.importorskip("prodigyopt")
    res = check_ok(run_gloo(_distance, 2, kind))
    for r in res:
        assert all(r["same_lr"])
        assert r["equal_after"] == [True] * 3 and r["differ_before"] == [True] * 3
        assert len(r["same_d"]) == 30 and all(r["same_d"])
        assert r["d"] > 1e-6 and all(math.isfinite(x) for x in r["losses"])
    assert sorted(m for r in res for m in r["mults"]) == pytest.approx(linear_multipliers(2, 0.5))


def _distance(rank, world, kind):
    from dist_workers import distance_estimator

    return distance_estimator(rank, world, kind=kind)


def test_local_mode_without_gradient_sharing():
    res = check_ok(run_gloo(_local, 2))
    assert res[0]["differ_every_step"] == [True] * 10  # no all-reduce: replicas differ before every sync
    assert res[0]["equal_after_sync"] == [True, True]


def _compiled(rank, world):
    from dist_workers import compiled

    return compiled(rank, world)


def test_torch_compile_sees_the_averaged_weights():
    res = check_ok(run_gloo(_compiled, 2))
    for r in res:
        assert r["agree"] == [True, True]
        assert torch.equal(r["params"][0], r["params"][1])


def _one_d_mesh(rank, world, name, dadapt=False, shard=True):
    from dist_workers import one_d_mesh

    return one_d_mesh(rank, world, name=name, dadapt=dadapt, shard=shard)


def test_a_plain_one_dimensional_fsdp2_mesh_is_not_taken_for_replicas():
    """A 1-D FSDP2 mesh shards one model: its ranks were taken for replicas (each shard its own LR, shards of
    different parameters averaged with each other, silently). Refused, saying which mesh to build, whatever the
    mesh's name (named ('replicate',) and sharded by fully_shard, it ran so: rows 0-3 of a weight averaged with
    rows 4-7); a 1-D mesh named ('replicate',) over whole replicas gives one replica per rank."""
    for r in check_ok(run_gloo(_one_d_mesh, 2, "shard")):
        assert "1-D FSDP2 mesh shards one model" in r["error"] and "('shard',)" in r["error"]
    for r in check_ok(run_gloo(_one_d_mesh, 2, "replicate")):
        assert "fully_shard over a 1-D mesh shards one model, whatever the mesh's name" in r["error"], r
    assert [r["N"] for r in check_ok(run_gloo(_one_d_mesh, 2, "replicate", False, False))] == [2, 2]


def _swapped_mesh(rank, world):
    from dist_workers import swapped_mesh

    return swapped_mesh(rank, world)


def test_a_two_dimensional_mesh_named_the_other_way_round_is_refused_saying_so():
    """A ('shard', 'replicate') mesh: refused (fully_shard replicates along dimension 0 whatever its name), and the
    error said "fully_shard over a 1-D mesh" of this 2-D mesh (an audit)."""
    for r in check_ok(run_gloo(_swapped_mesh, 4)):
        assert "replicates along a 2-D mesh's first dimension" in r["error"], r
        assert "'replicate' dimension is its dimension 1" in r["error"] and "1-D mesh shards" not in r["error"], r


def _partitioned(rank, world, kind):
    from dist_workers import partitioned

    return partitioned(rank, world, kind=kind)


@pytest.mark.parametrize("kind", ["fsdp1", "fsdp1-orig", "fsdp1-no-model"])
def test_fsdp1_is_refused_with_the_reason(kind):
    """FSDP1 (FullyShardedDataParallel, Accelerate's default FSDP plugin): each rank holds a flat shard of one model,
    and HDET took each shard for a replica; a converge step averaged rank 0's shard with rank 1's, writing the model's
    first half over its second, silently (with use_orig_params=True: an error at the first converge step). Refused at
    construction, with or without model=."""
    for r in check_ok(run_gloo(_partitioned, 2, kind)):
        assert r["error"] is not None and "FSDP1" in r["error"] and "fully_shard" in r["error"], r


def test_zero_redundancy_optimizer_under_a_spread_is_refused_with_the_reason():
    """ZeroRedundancyOptimizer steps each parameter on its owner rank and broadcasts it: every replica got the owner's
    multiplier and the replicas stayed identical (no spread at all, silently). Refused under a spread; without one
    (averaging only) it runs, and the ranks hold the same weights."""
    for r in check_ok(run_gloo(_partitioned, 2, "zero")):
        assert r["error"] is not None and "ZeroRedundancyOptimizer" in r["error"], r
    res = check_ok(run_gloo(_partitioned, 2, "zero-alpha0"))
    assert all(r["error"] is None for r in res)
    assert torch.equal(res[0]["params"][0], res[0]["params"][1])


@pytest.mark.parametrize("kind", ["zero-recover", "zero-range", "zero-warm", "zero-warm-before"])
def test_zero_redundancy_optimizer_without_a_spread_is_refused_where_it_breaks_hdet(kind):
    """Without a spread ZeroRedundancyOptimizer runs (above), but going back to a best sync (on_runaway="recover", the
    range test) restored the weights and left its state (kept in optimizer.optim, on the owner rank) at the later step:
    Adam's moments and step counts silently wrong after the go-back; and hdet.warm_init_'s noise was replaced by the
    owner rank's at the first step (the replicas identical, the final model one rank's noise). Refused, with the
    reason: at construction, or at the first step where warm_init_ ran after it (as its docs say to call it)."""
    for r in check_ok(run_gloo(_partitioned, 2, kind)):
        assert r["error"] is not None and "ZeroRedundancyOptimizer" in r["error"], r
        assert ("warm_init_" in r["error"]) == kind.startswith("zero-warm"), r


def test_d_adaptation_with_a_device_mesh_and_a_spread_is_refused_clearly():
    """D-Adaptation on FSDP2 replicas with a spread failed at the first step inside hdet.step_scale (a foreach copy
    of DTensors); it is refused at construction with the reason."""
    pytest.importorskip("dadaptation")
    for r in check_ok(run_gloo(_one_d_mesh, 2, "replicate", True, False)):
        assert "D-Adaptation or Prodigy (DAdaptAdam) with device_mesh" in r["error"]


def _hsdp_one_file(rank, world):
    from dist_workers import hsdp_one_file_resume

    return hsdp_one_file_resume(rank, world)


def test_one_file_for_every_hsdp_rank_mid_window_warns_on_the_other_shards_too():
    """Rank 0's scheduler state loaded on all four ranks of a (2, 2) mesh mid-window: rank 1 is another shard of
    replica 0, whose loss accumulator is its own, so it warns as replica 1's ranks do (before, it did not); rank 0
    loads its own state and does not."""
    res = check_ok(run_gloo(_hsdp_one_file, 4))
    assert [len(r["warned"]) for r in res] == [0, 1, 1, 1]
    assert "shard rank 1" in res[1]["warned"][0]


def _hsdp(rank, world, shape, bn=False):
    from dist_workers import hsdp

    return hsdp(rank, world, mesh_shape=shape, bn=bn)


@pytest.mark.parametrize("shape", [(2, 2), (4, 1), (1, 4)])
def test_fsdp2_hsdp_replicas_are_the_replicate_dimension(shape):
    """4 gloo processes, FSDP2 over a (replicate, shard) mesh: the shards of one replica share its LR
    multiplier at every step, replicas differ, the controller's bases agree everywhere, and after each
    converge step the full weights are equal across replicas. (1, 4) is plain FSDP: one replica."""
    res = check_ok(run_gloo(_hsdp, 4, shape))
    R, S = shape
    assert [r["replica"] for r in res] == [i // S for i in range(4)] and all(r["N"] == R for r in res)
    for i in range(4):
        assert res[i]["lrs"] == res[i // S * S]["lrs"]  # every shard of a replica: the same LR
        assert res[i]["bases"] == res[0]["bases"] and res[i]["updates"] == 2
    if R > 1:
        assert res[0]["lrs"] != res[S]["lrs"]  # replicas differ (with one replica, FSDP alone: nothing to do)
    for k in range(2):
        assert all(torch.equal(res[0]["full_after"][k], r["full_after"][k]) for r in res)
    assert [r["logs"] for r in res] == [True, False, False, False]  # one telemetry writer, not one per shard


def _hsdp_fit(rank, world, shape, checkpoint_at=None, ckpt=None, load_rank=None, warm=None, broken_probe=False):
    from dist_workers import hsdp_fit

    return hsdp_fit(rank, world, mesh_shape=shape, checkpoint_at=checkpoint_at, ckpt=ckpt, load_rank=load_rank,
                    warm=warm, broken_probe=broken_probe)


def test_the_fit_controller_on_sharded_replicas_decides_as_on_whole_ones(tmp_path):
    """The fit controller (the default) with FSDP2 over a (2, 2) mesh: each shard rank sums its own shards of the
    window mean and the probe runs at the mean written into the shards FSDP2 gathers from (a swapped .data was unseen
    by it). Against the same two replicas whole on a (2, 1) mesh, each on the union of the batches its two shard ranks
    take: the same probe losses, LRs, bases and weights (to float rounding), every shard rank of a replica the same;
    each replica's probe loss the probe at the mean of its weights over the window, computed by hand; and a resume
    from checkpoints written mid-window (step 6 of windows of 4) lands on the same run."""
    sharded = check_ok(run_gloo(_hsdp_fit, 4, (2, 2)))
    whole = check_ok(run_gloo(_hsdp_fit, 2, (2, 1)))
    resumed = check_ok(run_gloo(_hsdp_fit, 4, (2, 2), 6, str(tmp_path)))
    assert [r["replica"] for r in sharded] == [0, 0, 1, 1] and all(r["N"] == 2 for r in sharded + whole)
    assert whole[0]["updates"] == 4 and whole[0]["probes"] and all(len(p) == 2 for p in whole[0]["probes"])
    for i, r in enumerate(sharded):
        w = whole[i // 2]
        assert r["updates"] == w["updates"] and r["probes"] == sharded[0]["probes"]
        assert r["lrs"] == sharded[i // 2 * 2]["lrs"]
        for a, b in zip(r["probes"], w["probes"]):
            assert a == pytest.approx(b, rel=1e-5)
        assert [p[i // 2] for p in r["probes"]] == pytest.approx(r["expected"], rel=1e-5)  # the probe at the mean
        assert len(r["expected"]) == 4 and r["expected"] == resumed[i]["expected"]  # of this replica's iterates
        assert r["lrs"] == pytest.approx(w["lrs"], rel=1e-5) and r["bases"] == pytest.approx(w["bases"], rel=1e-5)
        for a, b in zip(r["full_after"], w["full_after"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert resumed[i]["lrs"][6:] == r["lrs"][6:] and resumed[i]["probes"][-2:] == r["probes"][-2:]
        assert all(torch.equal(a, b) for a, b in zip(resumed[i]["full_after"][-2:], r["full_after"][-2:]))
    assert sharded[0]["lrs"] != sharded[2]["lrs"]  # the replicas differ


def test_rank_0s_fit_state_loaded_on_every_sharded_rank(tmp_path):
    """Rank 0's scheduler state on every rank of a (2, 2) mesh (how the Hugging Face Trainer resumes), each rank its
    own model and optimizer state. At a sync step the window mean holds nothing and the run goes on as if never
    stopped (it raised on the other shard ranks: their shards are shaped otherwise). Mid-window, another shard rank's
    sums are dropped (they are of other shards) with a warning: that replica's probe is NaN for the window, while its
    other shard rank still runs the probe (its forward's all-gathers need both: no hang), every shard rank of a
    replica keeps one LR, and the next windows' probes are measured again."""
    plain = check_ok(run_gloo(_hsdp_fit, 4, (2, 2)))
    (tmp_path / "sync").mkdir(), (tmp_path / "mid").mkdir()
    at_sync = check_ok(run_gloo(_hsdp_fit, 4, (2, 2), 4, str(tmp_path / "sync"), 0))
    assert [r["lrs"] for r in at_sync] == [r["lrs"] for r in plain]
    assert [r["probes"] for r in at_sync] == [r["probes"] for r in plain]
    mid = check_ok(run_gloo(_hsdp_fit, 4, (2, 2), 6, str(tmp_path / "mid"), 0))
    for i, r in enumerate(mid):
        assert r["lrs"] == mid[i // 2 * 2]["lrs"] and r["updates"] == plain[i]["updates"]
        assert (i == 0) == (not r["load_warnings"])  # every rank but rank 0 itself is told
        assert all(math.isnan(x) for x in r["probes"][1]) and all(map(math.isfinite, r["probes"][2]))
    (tmp_path / "broken").mkdir()
    broken = run_gloo(_hsdp_fit, 4, (2, 2), 6, str(tmp_path / "broken"), 0, 8, True)  # a probe that returns no scalar,
    # at the first control sync, just after the load: every rank raises it (the void ones waited in the sync alone)
    assert all(r.get("error") == "ValueError" and "scalar loss" in r["msg"] for r in broken), broken


def _hsdp_bn(rank, world, shape):
    return _hsdp(rank, world, shape, bn=True)


@pytest.mark.parametrize("shape", [(2, 2), (1, 4)])
def test_hsdp_batchnorm_statistics_are_one_after_a_converge_step(shape):
    """FSDP2 keeps a BatchNorm's statistics whole on each rank, each updated from that rank's part of the batch. A
    converge step averaged them only over the replicate group (each shard rank with the same shard rank of the other
    replicas), so a replica's two ranks kept different statistics (0.063 apart in an audit's run; which one a
    checkpoint or an evaluation got depended on the rank), where DDP's are one. Now they are averaged over the
    replica's shard ranks too: after each converge step every rank holds the mean over the mesh. With one replica
    (plain FSDP2) hdet leaves them alone, as FSDP2 does."""
    res = check_ok(run_gloo(_hsdp_bn, 4, shape))
    for k in range(2):
        first = res[0]["buffers_after"][k]
        same = [all(torch.equal(a, b) for a, b in zip(first, r["buffers_after"][k])) for r in res[1:]]
        assert same == ([True] * 3 if shape[0] > 1 else [False] * 3), (k, same)


def _hsdp_warm_init(rank, world, shape, scope, names):
    from dist_workers import hsdp_warm_init

    return hsdp_warm_init(rank, world, mesh_shape=shape, scope=scope, names=names)


@pytest.mark.parametrize("shape,scope,names", [((2, 2), "model", ("replicate", "shard")),
                                               ((2, 2), "tensor", ("replicate", "shard")),
                                               ((2, 2), "model", ("dp", "fsdp")),  # the first dimension: replicas
                                               ((4, 1), "model", ("replicate", "shard")),
                                               ((1, 4), "model", ("replicate", "shard"))])
def test_warm_init_of_sharded_replicas_perturbs_each_replica_whole(shape, scope, names):
    """warm_init_ refused FSDP2/HSDP parameters. Each rank now perturbs its own shards: the shard ranks of a replica
    assemble one perturbed model, replicas differ, the std is Eq. 10's over the whole replica (nu ||theta_0|| /
    sqrt(d), each tensor's own under scope="tensor"), each shard draws its own noise, and on an (R, 1) mesh each
    replica gets exactly the noise warm_init_(model, rank=r) gives it unsharded (as under DDP)."""
    res = check_ok(run_gloo(_hsdp_warm_init, 4, shape, scope, names))
    R, S = shape
    assert [r["replica"] for r in res] == [i // S for i in range(4)]
    before = res[0]["before"]
    for r in res:
        assert torch.equal(r["before"], before)
        assert r["std"] == pytest.approx(r["plain_std"], rel=1e-6)  # the whole replica's norm, not the shard's
        assert torch.equal(r["after"], res[r["replica"] * S]["after"])  # one model per replica
    if scope == "model":
        assert res[0]["std"] == pytest.approx(0.05 * before.norm().item() / before.numel() ** 0.5, rel=1e-5)
    noise = [res[k * S]["after"] - before for k in range(R)]
    for k in range(R):
        assert 0.8 < noise[k].std().item() / res[k * S]["std"] < 1.2 or scope == "tensor"
        assert all(not torch.equal(noise[k], noise[j]) for j in range(k))  # replicas differ
        if S == 1:  # each replica's noise is DDP's
            assert torch.equal(res[k]["after"], res[k]["plain_after"])
    if S > 1:  # the shards' noise: own streams (the first weight's two halves, rows 0-31 and 32-63)
        w = noise[0][:64 * 32].view(64, 32)
        assert not torch.allclose(w[:32], w[32:])


def _half_averaging(rank, world, dtype, contiguous):
    from dist_workers import half_averaging

    return half_averaging(rank, world, dtype=dtype, contiguous=contiguous)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("contiguous", [False, True])
def test_half_precision_averages_are_summed_in_float32(dtype, contiguous):
    """fp16/bf16 replicas were averaged in their own dtype: BatchNorm's running_var of 38240 and 38976 averaged to +Inf
    in fp16 (then the next sync blamed every replica), and the "hook" guard summed fp16 gradients of 4e4 before
    dividing (+Inf, where plain DDP divides first: 4e4). Now: the mean rounded once, and DDP's gradient."""
    res = check_ok(run_gloo(_half_averaging, 2, dtype, contiguous))
    want = ((res[0]["before"].double() + res[1]["before"].double()) / 2).to(dtype)
    for r in res:
        assert r["guard"] == "hook"
        assert torch.equal(r["after"], want) and torch.isfinite(r["after"]).all()
        assert torch.equal(r["grad"], torch.full((1, 4), 4e4, dtype=dtype))


def _average_into(rank, world):
    from dist_workers import average_into

    return average_into(rank, world)


@pytest.mark.parametrize("world", [2, 4])
def test_a_recovery_average_leaves_the_healthy_replicas_tensors_alone(world):
    """average_(exclude=into=[bad]) (a recovery's optimizer moments): a tensor of at least one bucket was flattened as
    a view of itself, so the all_reduce wrote the mean into every healthy replica's own tensor (a review; the healthy
    replicas' moments were replaced by their mean). Only the reset replica receives it now."""
    assert all(r["ok"] for r in check_ok(run_gloo(_average_into, world)))


def _two_optimizers(rank, world, fused):
    from dist_workers import two_optimizers

    return two_optimizers(rank, world, fused=fused)


@pytest.mark.parametrize("fused", [(False, False), (True, False), (False, True), (True, True)])
def test_two_schedulers_on_one_ddp_model_say_what_guards_them(fused):
    """One DDP model, two optimizers, a scheduler each (an audit): with two non-fused optimizers the second scheduler
    warned that it could not install its guard "so a non-finite gradient will reach every replica", untrue (the
    first's hook guards every bucket): it now says so, and that the hook watches the first optimizer only; with a
    fused and a non-fused one, the hook zeroed the NaN before the fused one's "skip-all" check, which reported a
    guard that never acted (now a warning says so). Every NaN stays out."""
    res = check_ok(run_gloo(_two_optimizers, 2, fused))
    want = ["skip-all" if f else "hook" for f in fused]
    if fused == (False, False):  # (the second takes the first's hook over at its step at total_steps, the first
        want = ["hook", "hook"]  # closed by then)
    for r in res:
        assert r["guards"] == want and r["finite"]
        assert not [w for w in r["warnings"] if "could not install" in w]
        assert len([w for w in r["warnings"] if "same kind" in w]) == (1 if fused in ((True, False), (False, True)) else 0)
        assert len([w for w in r["warnings"] if "already carries another HDET" in w]) == (fused == (False, False))


def _hsdp_finish(rank, world):
    from dist_workers import hsdp_finish

    return hsdp_finish(rank, world)


def test_finish_averages_hsdp_replicas_left_early():
    """FSDP2 over a (replicate 2, shard 2) mesh, a loop left after step 7 of 20 (T = 5): finish() averages the
    replicas' full weights (every shard rank takes part), as the last step would have."""
    for r in check_ok(run_gloo(_hsdp_finish, 4)):
        assert r["apart"] and r["equal"] and r["mean"] and r["step"] == 7, r



def _hsdp_after_an_evaluation(rank, world, case):
    from dist_workers import hsdp_after_an_evaluation

    return hsdp_after_an_evaluation(rank, world, case=case)


@pytest.mark.parametrize("case", ["averaged", "finish", "warm_init"])
def test_hsdp_writes_reach_the_forward_after_an_evaluation_under_no_grad(case):
    """FSDP2 keeps the root's parameters unsharded after a forward under no_grad, and its next forward reuses them:
    hdet's writes into the shards went unseen (an evaluation inside averaged() measured the replica's own weights and
    training went on from the average; after finish() the model still ran the replica's own; warm_init_ moved
    nothing). Every write reshards first: each evaluation is the forward of the weights it should use."""
    for r in check_ok(run_gloo(_hsdp_after_an_evaluation, 4, case)):
        assert r["eval_err"] < 1e-6, r
        if case == "warm_init":
            assert r["moved"] > 1e-3, r
            continue
        assert r["own_err"] < 1e-6 and r["apart"] > 1e-4, r  # (the replicas were apart: the average is another model)
        if case == "averaged":
            assert r["loss8_err"] < 1e-6 and r["final_diff"] == 0.0, r  # training goes on as without the evaluation


def _sharded_without_its_mesh(rank, world, how):
    from dist_workers import sharded_without_its_mesh

    return sharded_without_its_mesh(rank, world, how=how)


@pytest.mark.parametrize("world, how", [(2, "none"), (4, "hsdp-none"), (4, "hsdp-replicate"), (4, "hsdp-group")])
def test_sharded_parameters_without_their_2d_mesh_are_refused(world, how):
    """FSDP2 without device_mesh took each shard for a replica (its own LR, rows of a weight averaged with other
    rows); HSDP given mesh["replicate"] or the replicate group judged each replica from one shard (the shard ranks'
    LRs and bases apart, no gradient guard). Refused at construction, saying to pass the 2-D mesh; a (2, 1) mesh
    (every rank a whole replica) is not. Without model=, hdet cannot reshard the model before it writes: said at
    construction, and an evaluation of the average refused."""
    if how == "hsdp-none":
        assert check_ok(run_gloo(_sharded_without_its_mesh, 2, how)) == [None, None]  # (2, 1): whole replicas
        for r in check_ok(run_gloo(_sharded_without_its_mesh, 4, "hsdp-nomodel")):
            assert r["warned"] and "Expected the scheduler built with model=" in r["error"], r
    for err in check_ok(run_gloo(_sharded_without_its_mesh, world, how)):
        assert err is not None and "Expected device_mesh= the (replicate, shard) device mesh" in err, err
        assert ("got no device_mesh" if how in ("none", "hsdp-none", "hsdp-group") else "got a 1-D mesh named "
                "('replicate',)") in err, err


def _swap_average(rank, world, nan_rank, mesh_shape):
    from dist_workers import swap_average

    return swap_average(rank, world, nan_rank=nan_rank, mesh_shape=mesh_shape)


@pytest.mark.parametrize("world, nan_rank, mesh_shape", [(2, None, None), (4, None, None), (4, 2, None),
                                                         (4, None, (2, 2)), (4, 1, (2, 2))])
def test_averaged_puts_the_replicas_mean_in_for_an_evaluation_and_puts_each_back(world, nan_rank, mesh_shape):
    """`with sched.averaged(): evaluate(model)` between converge steps (DDP at world 2 and 4; FSDP2/HSDP on a (2, 2)
    mesh): every rank holds the mean of the replicas' weights and BatchNorm statistics (a replica with a NaN weight
    left out), training calls are refused inside with SwappedInError, and each rank's own weights (the NaN too) come
    back bit for bit, and BatchNorm's num_batches_tracked after a forward in training mode inside (an audit: it kept
    the batch counted, and under momentum=None the statistics after it were weighted by it). Right after a converge
    step nothing is averaged and no collective runs where the model has no floating-point buffers; BatchNorm's are
    averaged there (a training forward since the converge step, a gradient accumulation's micro-batch before a
    validation, moved each rank's apart: an audit). After an optimizer step without scheduler.step() the replicas
    differ again, and it averages."""
    for r in check_ok(run_gloo(_swap_average, world, nan_rank, mesh_shape)):
        assert r["changed"] and r["apart"] and r["inside_is_mean"] and r["restored"] and r["counts_restored"], r
        assert r["refused"] == ["hdet: optimizer.step() was called", "hdet: scheduler.step() was called",
                                "hdet: finish() was called", "hdet: swap_in_average() was called again"], r
        assert not r["swapped_after"]
        if nan_rank is None and mesh_shape is not None:  # (no buffers)
            assert r["changed_at_sync"] is False and r["equal_at_sync"] and r["calls_at_sync"] == [], r
        if nan_rank is None and mesh_shape is None:  # BatchNorm: averaged at a converge step too (an audit: a
            # validation after a gradient accumulation's micro-batch measured each rank's own statistics)
            assert r["changed_at_sync"] and r["equal_at_sync"] and r["calls_at_sync"] == ["gather", "average"], r
            assert r["apart_after_a_forward"] and r["mean_after_a_forward"] and r["restored_after_a_forward"], r
        if nan_rank is None:
            assert r["changed_after_a_step"] and r["calls"] == ["gather", "average"], r


def _spectral_average(rank, world, form, two=False):
    from dist_workers import spectral_average

    return spectral_average(rank, world, form=form, two=two)


@pytest.mark.parametrize("form", ["parametrization", "hook", "two schedulers"])
def test_spectral_norms_of_the_averaged_weights_are_one(form):
    """DDP with spectral_norm layers: a converge step averaged their u, v buffers as plain floats (the mean of unit
    vectors is shorter), so the averaged model's eval-mode layers had spectral norms above 1 (an audit: 1.0076 for a
    16 -> 1 layer, its eval outputs 0.9% off); after a converge step and inside averaged() they are 1, every rank the
    same, each rank's own state back after averaged(). Two schedulers over one model (each layer its own, both with
    model=; converge steps every 10 and 7 steps): each averages the model's buffers, the other layer's u, v too, which
    were left averaged as plain floats (1.003-1.007 after the other's converge step, a review)."""
    two = form == "two schedulers"
    res = check_ok(run_gloo(_spectral_average, 2, "parametrization" if two else form, two))
    for r in res:
        assert r["changed"] and r["restored"], r
        for norms in (r["after_sync"], r["inside"]):
            assert norms == pytest.approx([1.0, 1.0], abs=1e-5), r
    if not two:  # (two: the second layer's weights at step 10 are each replica's own)
        assert res[0]["after_sync"] == res[1]["after_sync"] and res[0]["inside"] == res[1]["inside"]


def _two_optimizers_one_scaler(rank, world, use_hdet, guard_first, clip=False):
    from dist_workers import two_optimizers_one_scaler

    return two_optimizers_one_scaler(rank, world, use_hdet=use_hdet, guard_first=guard_first, clip=clip)


def test_a_first_overflow_skips_every_optimizer_of_the_model_as_plain_ddp():
    """One DDP model, two optimizers, one GradScaler, HDET's "hook" guard on the model (alpha 0: plain DDP's run):
    the hook zeroed rank 1's overflowing first buckets before the scaler was known, the guard held back its own
    optimizer's step, and the other optimizer stepped on the zeros (its Adam count one ahead, the weights 0.036 off
    plain DDP; an audit). Now the other's gradients are made +Inf there and the scaler skips it too: bit for bit plain
    DDP. Stepped before the guard's optimizer, the other one cannot be held back: a warning says so."""
    plain = check_ok(run_gloo(_two_optimizers_one_scaler, 2, False, True))
    guarded = check_ok(run_gloo(_two_optimizers_one_scaler, 2, True, True))
    for p, h in zip(plain, guarded):
        assert h["counts"] == p["counts"] == [4.0, 4.0] and not h["said"], (p["counts"], h)
        assert all(torch.equal(a, b) for a, b in zip(h["params"], p["params"]))
    other_first = check_ok(run_gloo(_two_optimizers_one_scaler, 2, True, False))
    assert all(len(r["said"]) == 1 for r in other_first), other_first
    # torch's recipe with clipping: both unscaled before either steps (the +Inf made for the other reached its step
    # there, every weight NaN: a review); the scaler's found_inf says it now
    plain = check_ok(run_gloo(_two_optimizers_one_scaler, 2, False, True, True))
    guarded = check_ok(run_gloo(_two_optimizers_one_scaler, 2, True, True, True))
    for p, h in zip(plain, guarded):
        assert h["counts"] == p["counts"] == [4.0, 4.0] and not h["said"], (p["counts"], h)
        assert all(torch.equal(a, b) for a, b in zip(h["params"], p["params"]))


def _users_comm_hook(rank, world):
    """A user's own DDP comm hook (torch's allreduce_hook) registered before the scheduler, a non-fused SGD (the "hook"
    guard wanted): the warnings hdet gives."""
    import warnings

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 2))
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hdet.HDETLR(opt, None, total_steps=4, model_sync_interval=2, model=model)
    return [str(w.message) for w in caught if str(w.message).startswith("hdet:")], len(model._comm_hooks)


def test_a_users_own_comm_hook_is_said_to_keep_the_guard_off():
    """torch lists a comm hook before it refuses a second one: hdet's refused entry stayed, and was taken for another
    HDET scheduler's guard ("it keeps a replica's non-finite gradient out of every bucket": false, a NaN on one rank
    reached the other's weights; an audit). The warning now says the guard could not be installed."""
    for said, hooks in check_ok(run_gloo(_users_comm_hook, 2)):
        assert hooks == 1 and len(said) == 1 and "could not install the gradient guard" in said[0], said


def _joined(rank, world, throw, batches, evaluate=False):
    from dist_workers import joined

    return joined(rank, world, throw=throw, batches=batches, evaluate=evaluate)


def test_torchs_join_for_uneven_inputs():
    """model.join() around the loop: without throw_on_early_termination its stand-ins for a finished rank's collectives
    cannot match a converge step's, and every rank waited out the process group's timeout (an audit): refused at the
    first step. With it, uneven inputs stop every rank at the shortest count and finish() averages; even inputs ending
    early (at step 6 of 100): the join's end copied the last rank's replica to every rank, and finish() averaged N
    copies of it (0.034 off the average, silently): the copy is left out now (every rank took every step there), as
    without join()."""
    for r in check_ok(run_gloo(_joined, 2, False, (6, 6))):
        assert r["error"].startswith("ValueError: Expected model.join(throw_on_early_termination=True)"), r["error"]
    uneven = check_ok(run_gloo(_joined, 2, True, (8, 6)))
    for r in uneven:
        assert "exhausted" in r["error"] and r["steps"] == 6, r["error"]
        assert torch.equal(r["weights"][0], r["weights"][1])
    for r in check_ok(run_gloo(_joined, 2, True, (6, 6))):
        assert r["error"] is None and r["steps"] == 6
        assert torch.equal(r["weights"][0], r["weights"][1])
        torch.testing.assert_close(r["weights"], r["without_join"], rtol=1e-6, atol=1e-7)
    # an evaluation inside join() without throw_on_early_termination, training on after it: torch leaves its config on,
    # which refused every later step, and its end collapsed the replicas into one (a review)
    for r in check_ok(run_gloo(_joined, 2, True, (6, 6), True)):
        assert r["error"] is None and r["steps"] == 6 and r["apart_after_eval"], r["error"]


def _two_models_one_scaler(rank, world, use_hdet):
    from dist_workers import two_models_one_scaler

    return two_models_one_scaler(rank, world, use_hdet=use_hdet)


def test_a_first_overflow_in_one_model_leaves_another_models_optimizer_alone():
    """Two DDP models under one GradScaler, HDET's hook guard on one: at its first overflow the guard set found_inf for
    every optimizer the scaler had unscaled, and the other model's optimizer skipped a step plain DDP takes (a review).
    Only optimizers over the guarded model's other parameters are held back: as plain DDP."""
    plain = check_ok(run_gloo(_two_models_one_scaler, 2, False))
    guarded = check_ok(run_gloo(_two_models_one_scaler, 2, True))
    for p, h in zip(plain, guarded):
        assert h["counts"] == p["counts"] == [2.0, 3.0] and torch.equal(h["B"], p["B"]), (p["counts"], h["counts"])


def _ema_average(rank, world, register, kw=None):
    from dist_workers import ema_average

    return ema_average(rank, world, register=register, **(kw or {}))


def _max_diff(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


@pytest.mark.parametrize("evaluate", [True, False])
def test_an_ema_registered_with_also_average_is_the_ensembles_ema(evaluate):
    """An EMA of the weights (AveragedModel, buffers too) kept beside HDET: with sched.also_average(ema) on every rank
    it is the EMA of the ensemble's average (the mean of each rank's own EMA, never averaged: linear in the weights),
    at every converge step and after the run (without any averaged(): evaluate=False), and inside averaged() between
    converge steps (against an EMA updated from the average every step), the same on every rank, and stays averaged
    after averaged(). Without it each rank's EMA follows its own replica (an audit: at alpha 0.5, T 1000, mid-run,
    rank 0's EMA had a loss of 0.25 against 0.047 for the ensemble's)."""
    res = check_ok(run_gloo(_ema_average, 2, "every", {"evaluate": evaluate}))
    for r in res:
        assert _max_diff(r["end"], r["end_shadow"]) < 1e-5 and r["n_averaged"] == 10
        if evaluate:
            assert _max_diff(r["in6"], r["mid_ref"]) < 1e-5 and _max_diff(r["in6"], r["in6_shadow"]) < 1e-5
            assert _max_diff(r["mid_after"], r["mid_ref"]) < 1e-5 and _max_diff(r["end"], r["end_ref"]) < 1e-5
    assert res[0]["ranks_end"][0] == res[0]["ranks_end"][1]
    if evaluate:  # what the user got before: each rank its own replica's EMA
        plain = check_ok(run_gloo(_ema_average, 2, "none"))[0]
        assert _max_diff(plain["in6"], plain["mid_ref"]) > 1e-3 and _max_diff(plain["end"], plain["end_shadow"]) > 1e-3


def test_an_ema_registered_at_a_converge_step_is_averaged_by_the_next_averaged():
    """Registered right after the converge step at 4 (the EMAs apart since step 1): averaged() there averaged nothing
    (the replicas equal, no step since), and each rank evaluated its own EMA (1.0e-2 off, a review)."""
    for r in check_ok(run_gloo(_ema_average, 2, "every", {"register_at": 4})):
        assert _max_diff(r["in4"], r["in4_shadow"]) < 1e-5 and _max_diff(r["end"], r["end_shadow"]) < 1e-5


@pytest.mark.parametrize("judge_steps", [4, None])
def test_an_ema_goes_back_with_the_weights_when_every_replica_collapses(judge_steps):
    """on_runaway="recover": every rank's weights NaN after step 6, so the sync at 8 goes back to the best sync (4;
    with the default judge_steps, the start kept after step 1, which a sync at 4 judged on a short window never
    replaced); the registered EMA (NaN from step 6) goes back with them. Left NaN, it made every later sync find every
    replica bad and go back again, to the end; the start kept without it no longer fitted, and the run raised
    (reviews)."""
    kw = {"collapse_at": 6, "steps": 16, "evaluate": False, "judge_steps": judge_steps}
    for r in check_ok(run_gloo(_ema_average, 2, "every", kw)):
        assert r["went_back"][1] is not None and r["went_back"][2:] == [None, None], r["went_back"]
        assert r["finite"]


def test_also_average_on_one_rank_only_is_an_error_at_the_next_converge_step():
    """Registered on rank 0 only: the collectives would not match; every rank raises at the first converge step, or at
    the first averaged() before it, and says so (no hang)."""
    for evaluate, words in ((False, "hold different tensors to average"), (True, "laid out differently in memory")):
        res = run_gloo(_ema_average, 2, "rank0", {"evaluate": evaluate})
        for r in res:
            assert isinstance(r, dict) and r.get("error") == "ReplicaMismatchError", r
            assert words in r["msg"] and "also_average" in r["msg"], r["msg"]


def _swa_after_hdet(rank, world, base):
    from dist_workers import swa_after_hdet

    return swa_after_hdet(rank, world, base=base)


def test_an_swa_phase_after_finish_at_the_base_lr_keeps_the_replicas_together():
    """The README's recipe for an SWA phase after HDET (finish(), close(), then SWALR): every rank's SWA model the
    same; left open, each rank annealed from its own multiplied LR."""
    ranks = check_ok(run_gloo(_swa_after_hdet, 2, True))[0]
    assert ranks[0] == ranks[1]
    apart = check_ok(run_gloo(_swa_after_hdet, 2, False))[0]
    assert max(abs(a - b) for a, b in zip(*apart)) > 1e-2


def _after_hdet(rank, world, case):
    from dist_workers import after_hdet

    return after_hdet(rank, world, case=case)


@pytest.mark.parametrize("case", ["join", "scaler", "trial2", "gc", "dropped"])
def test_hdet_leaves_the_model_and_optimizer_as_plain_training_would(case):
    """After an HDET run (closed by itself after its step at total_steps), plain training on the same DDP model is
    plain DDP's (an audit found each of these left behind): a plain join() with uneven inputs ends with every rank
    on the last joiner's weights (the ranks were 2.1e-3 apart: hdet's hold on join's end stayed), a GradScaler's
    overflow on one rank is skipped on every rank and lowers the scale (the hook guard zeroed it: every step taken,
    scale 1024), the next trial's scheduler gets the "hook" guard (DDP's one comm hook was the old one's: none, and a
    warning; a next trial built while the last one, left early, is still referenced takes its hook over at its first
    step: with the old one collected its hook went on unguarded, a review); a scheduler left before total_steps and
    dropped is collected (each trial's stayed in memory, 5.1 MB)."""
    res = check_ok(run_gloo(_after_hdet, 2, case))
    for r in res:
        if case == "gc":  # (its hooks idle: the weak counter, the skip guard's pair, the forward pre-hook)
            assert not r["closed"] and r["guard"] == "skip-all" and r["collected"], r
            continue
        if case == "dropped":  # (a NaN on rank 1 at the new trial's first step: kept out, as by a guard of its own)
            assert r["guard_built"] is None and r["guard2"] == "hook" and r["finite"], r
            assert any("already carries another HDET scheduler" in w for w in r["said"]), r["said"]
            continue
        assert r["closed"] and r["guard"] == "hook"
        if case == "scaler":
            assert r["stepped"] == [True, True, True, False, True, True] and r["scale"] == 512.0, r
        elif case == "trial2":
            assert r["guard2"] == "hook" and r["said"] == [], r
    if case == "join":
        assert res[0]["ranks"][0] == res[0]["ranks"][1]


def _hsdp_ema(rank, world):
    from dist_workers import hsdp_ema

    return hsdp_ema(rank, world)


def test_an_ema_of_hsdp_replicas_has_the_ensembles_buffers_on_every_rank():
    """HSDP (2 replicas of 2 shards): a registered EMA's BatchNorm statistics were averaged over the replicate group
    only, so a replica's two shard ranks held different EMA statistics (2.4e-2 apart, a review); the model's own are
    averaged over the whole mesh. Now the EMA's too: every rank holds the mean of the four ranks' own EMAs."""
    res = check_ok(run_gloo(_hsdp_ema, 4))
    ema, mean = torch.tensor(res[0]["ema"], dtype=torch.float64), torch.tensor(res[0]["own_mean"], dtype=torch.float64)
    assert (ema - ema[0]).abs().max() == 0 and (ema[0] - mean).abs().max() < 1e-6


def _closed_state_inside_averaged(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel as DDP

    def parts():
        torch.manual_seed(0)
        model = DDP(nn.Linear(4, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return model, opt, hdet.HDETLR(opt, None, total_steps=6, model_sync_interval=3, ensemble_lr_spread_ratio=0.5,
                                       model=model)

    model, opt, sched = parts()
    for _ in range(6):
        _square_step(model, opt, sched, rank)
    end = sched.state_dict()
    model2, opt2, sched2 = parts()
    for _ in range(2):
        _square_step(model2, opt2, sched2, rank)
    lr = opt2.param_groups[0]["lr"]
    with sched2.averaged():
        try:
            sched2.load_state_dict(end)
            said = None
        except hdet.SwappedInError as e:
            said = str(e)
    kept = (sched2.last_epoch, sched2.closed, opt2.param_groups[0]["lr"] == lr)
    open_state = sched2.state_dict()
    sched2.load_state_dict(end)
    with sched.averaged():  # (the reverse: an open run's state into a closed scheduler inside averaged())
        try:
            sched.load_state_dict(open_state)
            reopened = None
        except hdet.SwappedInError as e:
            reopened = str(e)
    assert reopened is not None and "load_state_dict() was called" in reopened and sched.closed
    return said, kept, sched2.closed, opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_a_closed_runs_state_is_refused_inside_averaged_before_anything_is_set():
    """Loading a finished run's state inside averaged() raised from close() after the state was set, leaving the
    scheduler open at its last step at this rank's own LR, and naming close(), which the user never called (a
    review). It is refused before anything is set, saying why; outside averaged() it loads closed."""
    for said, kept, closed, same_lr in check_ok(run_gloo(_closed_state_inside_averaged, 2)):
        assert said is not None and "load_state_dict() was called" in said
        assert kept == (2, False, True) and closed and same_lr


def _guard_said(rank, world, given):
    """Two steps of a DDP model under a fused AdamW whose scheduler gets ``given`` as ``model=`` ("ddp", "module" (the
    model DDP wraps), "none" or "off" (no model, guard_gradients=False)); returns the guard installed and the warnings
    that say there is none."""
    import warnings

    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    kw = {"ddp": {"model": model}, "module": {"model": model.module}, "none": {},
          "off": {"guard_gradients": False}}[given]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sched = hdet.HDETLR(opt, None, total_steps=10, model_sync_interval=5, ensemble_lr_spread_ratio=0.5, **kw)
        for _ in range(2):
            _square_step(model, opt, sched, rank)
    sched.close()
    return sched.gradient_guard, [str(w.message) for w in caught if "no gradient guard" in str(w.message)]


@pytest.mark.parametrize("given", ["ddp", "module", "none", "off"])
def test_a_scheduler_without_the_ddp_model_says_it_has_no_gradient_guard(given):
    """`model=model.module` (the module `warm_init_` takes) or no `model=` left a DDP run without its gradient guard,
    unsaid: one rank's NaN gradient reached every replica and the run stopped at the next converge step with a message
    about non-finite weights (an audit). The first step says so now, once, on every rank; with the DDP model the guard
    is on, and `guard_gradients=False` asks for none."""
    res = check_ok(run_gloo(_guard_said, 2, given))
    for installed, said in res:
        if given == "ddp":
            assert installed == "skip-all" and said == []
        elif given == "off":
            assert installed is None and said == []
        else:
            assert installed is None and len(said) == 1
            assert ("model= was not given" if given == "none" else "model= is a Linear, not a "
                    "DistributedDataParallel module") in said[0] and "guard_gradients=False" in said[0]


def _shards_apart(rank, world, which):
    """HSDP as 2 replicas x 2 shard ranks (replica rank // 2), every rank's LR 0.1 but ``which`` ranks' 0.2 (a value
    each rank computed from its own shard, say); returns what the first converge step raised."""
    from hdet.replicas import ProcessGroupReplicas
    shards = [torch.distributed.new_group([0, 1]), torch.distributed.new_group([2, 3])]
    reps = [torch.distributed.new_group([0, 2]), torch.distributed.new_group([1, 3])]
    torch.manual_seed(100 + rank % 2)  # this rank's shard
    m = nn.Linear(4, 2)
    o = torch.optim.SGD(m.parameters(), lr=0.2 if rank in which else 0.1)
    s = hdet.HDETLR(o, None, total_steps=10, model_sync_interval=2, ensemble_lr_spread_ratio=0.5, model=m,
                    replicas=ProcessGroupReplicas(reps[rank % 2], shard_group=shards[rank // 2]))
    try:
        for _ in range(2):
            _square_step(m, o, s, rank)
    except Exception as e:  # noqa: BLE001 - what each rank raised
        return type(e).__name__, str(e)
    return None


@pytest.mark.parametrize("which", [(1,), (1, 3)])
def test_shard_ranks_of_one_replica_built_apart_are_refused_on_every_rank(which):
    """Under HSDP the settings check compared each shard position across the replicas only: shard ranks of one
    replica built with different values (an LR, a clipping norm, a weight decay each rank computed from its own
    shard) trained halves of the replica at different values, silently, where the same mismatch between replicas is
    an error; and where one replica's ranks alone differed, some ranks raised and the others went on into the next
    collective (an audit). Every rank refuses at the first converge step now, naming the replica."""
    res = check_ok(run_gloo(_shards_apart, 4, which))
    apart = [0] if which == (1,) else [0, 1]
    for r in res:
        assert r is not None and r[0] == "ReplicaMismatchError", res
        assert f"the shard ranks of replica(s) {apart}" in r[1], r[1]


def _warm_init_order(rank, world, order):
    from dist_workers import warm_init_order

    return warm_init_order(rank, world, order)


@pytest.mark.parametrize("order", ["before", "after", "before-no-sync"])
def test_warm_init_before_ddp_says_its_noise_was_lost(order):
    """hdet.warm_init_ called before DistributedDataParallel(...): DDP's constructor broadcast rank 0's weights, noise
    included, so the replicas started equal and Eq. 10 did nothing, unsaid (an audit). The scheduler given the DDP
    model says so now, on every rank; in the README's order (after DDP and the scheduler), or before a DDP that does
    not broadcast (init_sync=False), the replicas start apart and nothing is said (2 gloo processes)."""
    if order == "before-no-sync" and "init_sync" not in inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters:
        pytest.skip("DistributedDataParallel(init_sync=) needs torch >= 2.5")
    for r in check_ok(run_gloo(_warm_init_order, 2, order)):
        if order == "before":
            assert len(r["said"]) == 1 and "before DistributedDataParallel(...) wrapped it" in r["said"][0], r
            assert not r["apart"]
        else:
            assert r["said"] == [] and r["apart"], r
        assert r["later"] == []  # (a second scheduler after training, or a new DDP over the trained module (a review):
        # no broadcast of the noise)


def _asgd_own_eta(rank, world):
    from dist_workers import asgd_own_eta

    return asgd_own_eta(rank, world)


def test_asgd_keeps_each_replicas_own_step_size_when_its_state_is_averaged():
    """ASGD's state holds eta, the step size its next step takes, from this replica's own LR; average_optimizer_state
    (which ASGD needs under a spread, for its ax) averaged it too, so every replica took the first step of each window
    at the mean LR while the records showed the spread (an audit: weights 1.6e-2 off at T = 5). eta stays each
    replica's own (their ratio the spread's, 3 at alpha 0.5); ax is averaged (2 gloo processes)."""
    r0, r1 = check_ok(run_gloo(_asgd_own_eta, 2))
    assert torch.equal(r0["ax"], r1["ax"])
    lo, hi = sorted([r0["eta"], r1["eta"]])
    assert hi / lo > 2.5, (r0["eta"], r1["eta"])


def _buffer_value_under_ddp(rank, world, broadcast_buffers, vmap_safe):
    from dist_workers import buffer_value_under_ddp

    return buffer_value_under_ddp(rank, world, broadcast_buffers, vmap_safe)


@pytest.mark.parametrize("broadcast_buffers, vmap_safe", [(True, True), (True, False), (False, True)])
def test_an_explored_value_in_a_buffer_overwritten_by_ddps_broadcast_is_said(broadcast_buffers, vmap_safe):
    """docs/explore.md's buffer-and-Setter dropout under DDP's default broadcast_buffers=True: DDP copied rank 0's
    buffer to rank 1 at every forward, so every replica trained at rank 0's value while the records showed the
    spread, unsaid (a review). The rank whose value moved says so after its first step, naming broadcast_buffers;
    with broadcast_buffers=False each rank keeps its own value and nothing is said. A Setter left at its default
    vmap_safe=False (nothing to do with DDP) is checked too (a review) (2 gloo processes)."""
    r0, r1 = check_ok(run_gloo(_buffer_value_under_ddp, 2, broadcast_buffers, vmap_safe))
    assert r0["set"] != r1["set"]
    assert r0["said"] == []
    if broadcast_buffers:
        assert len(r1["said"]) == 1 and "broadcast_buffers=False" in r1["said"][0], r1
    else:
        assert r1["said"] == []


def _dcp_rank_state(rank, world, ckpt):
    from dist_workers import dcp_rank_state

    return dcp_rank_state(rank, world, ckpt)


def test_a_scheduler_in_a_dcp_checkpoint_is_refused_and_rank_state_resumes_mid_window(tmp_path):
    """The scheduler itself in a torch.distributed.checkpoint state dict (its state_dict/load_state_dict make it a
    Stateful): a checkpoint saved mid-window or with on_runaway="recover" could not be loaded (DCP builds the state to
    load from a new scheduler, of another shape), with DCP's own error at the resume, and DCP kept one copy of what
    the ranks saved alike (an audit). Refused at dcp.save now, also inside a Stateful of the user's (torch's tutorial's
    AppState, a review); hdet.RankState(sched) keeps each rank's own state, and the run resumed from it mid-window is
    the uninterrupted one. DCP's set_state_dict steps a fresh optimizer once at lr 0 to make its state: in local mode
    that read as a missed step after the resume (a review); not now (2 gloo processes)."""
    pytest.importorskip("torch.distributed.checkpoint")
    results = check_ok(run_gloo(_dcp_rank_state, 2, str(tmp_path)))
    for r in results:
        assert len(r["refused"]) == 2 and all("hdet.RankState(sched)" in m for m in r["refused"]), r["refused"]
        assert r["missed"] == []
        assert r["same_state"], r["diffs"]
        assert r["lrs_b"] == r["lrs_a"] and len(r["lrs_a"]) == 4
        assert torch.equal(r["end_a"], r["end_b"])
    assert results[0]["lrs_a"] != results[1]["lrs_a"]  # (the ranks' own LRs: a spread)


def test_a_parameter_unfrozen_after_ddp_was_built_is_said_at_the_next_sync():
    """DDP all-reduces only the parameters that required grad when it was built: a layer unfrozen mid-run (in the
    optimizer all along, so no add_param_group error) trained on each rank's own batches alone, averaged only at the
    converge steps, with no word from torch or hdet (a carry-over of session 44's review). Said at the next sync, once,
    on every rank, naming the parameter; a run that unfreezes nothing says nothing."""
    res = check_ok(run_gloo(unfrozen_under_ddp, 2, 3))
    for r in res:
        assert r["apart"]  # (what the warning says: the ranks' copies of the layer parted before the sync)
        said = [w for w in r["warnings"] if "requires grad now" in w]
        assert len(said) == 1 and "'0.weight' and 1 more" in said[0], r["warnings"]
    for r in check_ok(run_gloo(unfrozen_under_ddp, 2, None)):
        assert not [w for w in r["warnings"] if "requires grad now" in w], r["warnings"]


@pytest.mark.parametrize("mode,said", [("rebuild", False), ("built_trainable", False), ("early", True),
                                       ("between", True)])
def test_the_unfrozen_check_holds_to_what_the_ddp_given_all_reduces(mode, said):
    """The check's reference is the DDP handed over (model=, attach_model) and, where a parameter looks unfrozen,
    DDP's own buckets (an audit of session 46: it warned after its own advice was taken, a DDP built again and
    attached; it warned where DDP(find_unused_parameters=True) was built over a layer frozen after, which DDP does
    all-reduce once unfrozen; it missed a layer unfrozen between the scheduler's construction and its first step,
    and one unfrozen between DDP's construction and the scheduler's: a review).
    Whether it warns matches whether the layer's copies parted across the ranks before the next converge step."""
    for r in check_ok(run_gloo(unfrozen_under_ddp, 2, 3, mode)):
        assert r["apart"] is said
        warned = [w for w in r["warnings"] if "requires grad now" in w]
        assert len(warned) == int(said), r["warnings"]
        if said:
            assert "attach_model" in warned[0]


def test_the_hook_guard_zeroes_a_sparse_embeddings_non_finite_gradient():
    """DDP over nn.Embedding(sparse=True) with a non-fused optimizer (the default "hook" guard's comm hook): the hook
    raised at the first backward (torch.where has no out= form on a sparse tensor: a review), so such a model could
    not train under hdet at all. The hook checks a sparse bucket's values: every step's averaged gradient is the same
    on both ranks, and at the step where rank 1's loss is NaN it is rank 0's own, halved (rank 1's zeroed, as in a
    dense bucket); the weights stay finite and equal on both ranks."""
    from dist_workers import sparse_embedding_hook_guard

    res = check_ok(run_gloo(sparse_embedding_hook_guard, 2, 3))
    assert [r["guard"] for r in res] == ["hook", "hook"]
    for t in range(6):
        for a, b in zip(res[0]["grads"][t], res[1]["grads"][t]):
            assert torch.equal(a, b)
        assert all(torch.isfinite(w).all() for w in res[0]["weights"][t])
        for a, b in zip(res[0]["weights"][t], res[1]["weights"][t]):
            assert torch.equal(a, b)
    torch.manual_seed(0)  # rank 0's step 3 on its own, from the weights after step 2, halved (rank 1's zeroed)
    net = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Flatten(), nn.Linear(8, 1))
    with torch.no_grad():
        for p, w in zip(net.parameters(), res[0]["weights"][1]):
            p.copy_(w)
    g = torch.Generator().manual_seed(100 * 3 + 0)
    x, y = torch.randint(0, 10, (4, 2), generator=g), torch.randn(4, 1, generator=g)
    nn.functional.mse_loss(net(x), y).backward()
    for got, p in zip(res[0]["grads"][2], net.parameters()):
        assert float(p.grad.to_dense().abs().sum()) > 0
        torch.testing.assert_close(got, p.grad.to_dense() / 2, rtol=1e-6, atol=1e-7)
