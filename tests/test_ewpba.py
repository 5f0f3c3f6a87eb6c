"""EWPBA (EW-FT Alg. 1/3): the list of Eq. 9-10 against hand computations, and the searched schedule's
epsilon against dp_accounting called directly (not through raydp's accountants)."""

import json
import math

import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant

from raydp.errors import ConfigError
from raydp.privacy.ewpba import EWPBAResult, ewpba, ewpba_list
from raydp.privacy.schedule import SigmaSchedule

DELTA, Q, STEPS = 1e-5, 16 / 1440, 90  # 90 steps per epoch, ~1/q


def dp_accounting_epsilon(sigmas, q=Q, steps_per_epoch=STEPS, delta=DELTA):
    """Independent ComposePRV' (Alg. 3): epoch e composes steps_per_epoch Poisson-subsampled Gaussian
    steps at (q, sigma_e), add/remove-one, with dp_accounting's pessimistic PLD (an upper bound)."""
    acc = pld_privacy_accountant.PLDAccountant(
        pld_privacy_accountant.NeighborRel.ADD_OR_REMOVE_ONE, value_discretization_interval=5e-4)
    acc.compose(dp_event.ComposedDpEvent([
        dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(s)),
                                     steps_per_epoch)
        for s in sigmas]))
    return acc.get_epsilon(delta)


# -- lines 16-26 and 34, Eq. 9-10, by hand ------------------------------------------------------------

@pytest.mark.parametrize("sigma_beg, sigma_fir, epochs, step_distance, expected", [
    # E=3, S=2 (the paper's default E): Add_num = 4*(2-1)/((3-1)*(2+1)) = 2/3; E/2-1 = 0.5, so epochs 1, 2
    # both add S*Add_num = 4/3: [1, 7/3, 11/3], reversed.
    (2.0, 1.0, 3, 2, [11 / 3, 7 / 3, 1.0]),
    # E=3, S=1: Add_num = 4*(1.5-0.5)/(2*2) = 1, every step adds S*Add_num = 1: [0.5, 1.5, 2.5], reversed.
    (1.5, 0.5, 3, 1, [2.5, 1.5, 0.5]),
    # E=4, S=2: Add_num = 4*1/(3*3) = 4/9; E/2-1 = 1 and no epoch_num in 1..3 is < 1, so all add 8/9:
    # [1, 17/9, 25/9, 33/9], reversed.
    (2.0, 1.0, 4, 2, [33 / 9, 25 / 9, 17 / 9, 1.0]),
    # E=6, S=2: Add_num = 4*1/(5*3) = 4/15; E/2-1 = 2: epoch_num 1 adds 4/15 (-> 19/15), 2..5 add 8/15:
    # [1, 19/15, 27/15, 35/15, 43/15, 51/15], reversed.
    (2.0, 1.0, 6, 2, [3.4, 43 / 15, 35 / 15, 1.8, 19 / 15, 1.0]),
    # E=2 (E/2-1 = 0): Add_num = 4*1/(1*3) = 4/3, the one step adds S*Add_num = 8/3: [1, 11/3], reversed.
    (2.0, 1.0, 2, 2, [11 / 3, 1.0]),
    # E=1: no stages, just sigma_fir.
    (2.0, 1.0, 1, 2, [1.0]),
    # sigma_fir = sigma_beg: Add_num = 0, a constant list.
    (1.3, 1.3, 3, 2, [1.3, 1.3, 1.3]),
])
def test_the_list_follows_eq_9_and_10(sigma_beg, sigma_fir, epochs, step_distance, expected):
    got = ewpba_list(sigma_beg, sigma_fir, epochs, step_distance)
    assert isinstance(got, tuple)
    assert got == pytest.approx(expected, rel=1e-12)


# -- Algorithm 1 end to end -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def eps2() -> EWPBAResult:
    return ewpba(2.0, DELTA, Q, epochs=3, steps_per_epoch=STEPS)


def test_the_schedule_meets_the_budget_by_an_independent_accountant(eps2):
    assert eps2.accountant == "pld" and eps2.epsilon_prime == 1.0  # eps' = eps - 1 at eps = 2 (line 1)
    assert len(eps2.sigmas) == 3
    assert list(eps2.sigmas) == sorted(eps2.sigmas, reverse=True)  # largest noise first (line 34)
    assert eps2.sigmas[0] > eps2.sigmas[-1]
    # the list is Eq. 9-10 around sigma_beg, and add_num is Eq. 9 at its sigma_fir
    assert eps2.sigmas == pytest.approx(ewpba_list(eps2.sigma_beg, eps2.sigmas[-1], 3, 2), rel=1e-12)
    assert eps2.add_num == pytest.approx(4 * (eps2.sigma_beg - eps2.sigmas[-1]) / (2 * 3), rel=1e-12)
    # within the paper's tolerance below the target, never above it (correction 2)
    assert 2.0 - 1e-4 <= eps2.epsilon <= 2.0
    independent = dp_accounting_epsilon(eps2.sigmas)
    assert independent <= 2.0 * (1 + 1e-3)
    assert independent >= 2.0 * 0.98
    # sigma_beg is the constant sigma for eps' = 1 (Alg. 1 line 12)
    assert dp_accounting_epsilon([eps2.sigma_beg] * 3) == pytest.approx(1.0, rel=2e-3)


def test_first_epoch_is_noisier_and_last_less_noisy_than_the_uniform_sigma(eps2):
    # eps is decreasing in a constant sigma, so "sigma > uniform sigma" <=> "constant sigma costs < eps"
    assert dp_accounting_epsilon([eps2.sigmas[0]] * 3) < 2.0
    assert dp_accounting_epsilon([eps2.sigmas[-1]] * 3) > 2.0


def test_multipliers_are_a_sigma_schedule_shape(eps2):
    m = eps2.multipliers()
    assert isinstance(m, tuple) and m[-1] == 1.0
    assert m == pytest.approx([s / eps2.sigmas[-1] for s in eps2.sigmas], rel=1e-12)
    assert SigmaSchedule(per_epoch=m).per_epoch == m
    d = eps2.describe()
    assert d["sigmas"] == list(eps2.sigmas) and d["accountant"] == "pld"
    json.dumps(d)


def test_epsilon_below_one_uses_half_the_budget_for_part_1():
    # The paper's eps' = eps - 1 would be negative at eps = 0.5 (correction 1).
    q, steps = 0.05, 20  # a smaller problem than the module's, to keep the test fast
    res = ewpba(0.5, DELTA, q, epochs=3, steps_per_epoch=steps, tolerance=1e-3)
    assert res.epsilon_prime == 0.25
    assert 0.5 - 1e-3 <= res.epsilon <= 0.5
    assert list(res.sigmas) == sorted(res.sigmas, reverse=True) and res.sigmas[0] > res.sigmas[-1]
    assert 0.5 * 0.98 <= dp_accounting_epsilon(res.sigmas, q, steps) <= 0.5 * (1 + 1e-3)


def test_one_epoch_is_the_uniform_calibration():
    q, steps = 0.05, 20
    res = ewpba(1.0, DELTA, q, epochs=1, steps_per_epoch=steps, tolerance=5e-3)
    (sigma,) = res.sigmas
    assert res.sigma_beg == sigma and res.add_num == 0.0 and res.epsilon_prime == 1.0
    assert res.multipliers() == (1.0,)
    # the smallest constant sigma for eps = 1, to the tolerance, by dp_accounting
    assert 1.0 * 0.98 <= dp_accounting_epsilon([sigma], q, steps) <= 1.0 * (1 + 1e-3)
    assert dp_accounting_epsilon([sigma * 0.98], q, steps) > 1.0


# -- errors --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [
    dict(epochs=0), dict(epochs=2.5), dict(step_distance=0), dict(q=0.0), dict(q=1.5),
    dict(steps_per_epoch=0), dict(epsilon=0.0), dict(epsilon=-1.0), dict(epsilon=math.inf),
    dict(delta=0.0), dict(delta=1.0), dict(accountant="gdp"), dict(accountant="nope"),
    dict(tolerance=0.0), dict(max_iterations=0),
])
def test_bad_inputs_raise_config_error(kwargs):
    args = dict(epsilon=2.0, delta=DELTA, q=Q, epochs=3, steps_per_epoch=STEPS) | kwargs
    with pytest.raises(ConfigError) as err:
        ewpba(**args)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("args", [(2.0, 2.5, 3, 2), (2.0, 0.0, 3, 2), (2.0, 1.0, 0, 2), (2.0, 1.0, 3, 0)])
def test_bad_list_inputs_raise_config_error(args):
    with pytest.raises(ConfigError):
        ewpba_list(*args)


def test_an_unreachable_budget_raises_config_error():
    # 300 full-batch steps at sigma 50 (line 2's largest sigma) cost far more than 1e-3.
    with pytest.raises(ConfigError, match="unreachable") as err:
        ewpba(1e-3, DELTA, 1.0, epochs=3, steps_per_epoch=100)
    assert "\n" not in str(err.value)


def test_too_few_iterations_raise_config_error():
    with pytest.raises(ConfigError, match="iterations"):
        ewpba(1.0, DELTA, 0.05, epochs=2, steps_per_epoch=20, max_iterations=3)
