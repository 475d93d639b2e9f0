import pytest
import torch

from hdet import Dealer, linear_multipliers


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("alpha", [0.0, 1 / 9, 0.5, 0.99])
def test_eq1_mean_one_and_bounds(n, alpha):
    rho = linear_multipliers(n, alpha)
    assert len(rho) == n
    assert sum(rho) / n == pytest.approx(1.0, abs=1e-12)
    assert all(1 - alpha - 1e-12 <= r <= 1 + alpha + 1e-12 for r in rho)
    if n > 1:
        assert rho[0] == pytest.approx(1 - alpha) and rho[-1] == pytest.approx(1 + alpha)
        assert rho == sorted(rho)


def test_eq1_single_replica_is_one():
    assert linear_multipliers(1, 0.5) == [1.0]


def test_eq1_paper_setting():
    # alpha = 1/9, N = 8 around 0.0009 spans 0.0008 .. 0.001 (paper section 4.1)
    rho = linear_multipliers(8, 1 / 9)
    assert 0.0009 * rho[0] == pytest.approx(0.0008) and 0.0009 * rho[-1] == pytest.approx(0.001)


@pytest.mark.parametrize("alpha", [-0.1, 1.0, 1.5, float("nan"), "0.1", True])
def test_alpha_out_of_range(alpha):
    with pytest.raises(ValueError, match=r"0 <= ensemble_lr_spread_ratio \(alpha\) < 1, but got"):
        linear_multipliers(4, alpha)


def test_dealer_same_seed_same_permutations_and_global_rng_untouched():
    state = torch.get_rng_state()
    a, b = Dealer(7), Dealer(7)
    torch.rand(5)  # the caller consumes the global RNG unevenly: the dealers must not care
    state_after_caller = torch.get_rng_state()
    perms_a = [a.permutation(8) for _ in range(20)]
    perms_b = [b.permutation(8) for _ in range(20)]
    assert perms_a == perms_b
    assert all(sorted(p) == list(range(8)) for p in perms_a)
    assert len({tuple(p) for p in perms_a}) > 10
    assert torch.equal(torch.get_rng_state(), state_after_caller)
    assert not torch.equal(state, state_after_caller)


def test_dealer_state_roundtrip():
    a = Dealer(3)
    a.permutation(5)
    saved = a.state_dict()
    expected = [a.permutation(5) for _ in range(5)]
    b = Dealer(99)
    b.load_state_dict(saved)
    assert [b.permutation(5) for _ in range(5)] == expected
