"""Tests of the accountants and the calibration against Opacus, dp_accounting and closed forms computed
here, independently of raydp's code."""

from __future__ import annotations

import math

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from opacus.accountants import PRVAccountant as OpacusPRV
from opacus.accountants import RDPAccountant as OpacusRDP
from opacus.accountants.analysis import rdp as opacus_rdp
from scipy import optimize
from scipy.stats import norm

from raydp.errors import ConfigError
from raydp.privacy import (
    GDPAccountant,
    Grid,
    PLDAccountant,
    PRVAccountant,
    PrivacyLedger,
    RDPAccountant,
    SigmaEffMap,
    calibrate_sigma,
    get_accountant,
    planned_steps,
)
from raydp.privacy.accounting import LedgerTracker
from raydp.privacy.accounting.rdp import DEFAULT_ORDERS

DELTA = 1e-5
CASES = [(0.01, 1.0, 1000), (1 / 1200, 0.6, 3600), (0.05, 2.0, 300), (0.2, 4.0, 50)]


def _dp_pld(groups, vdi=1e-4):
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=vdi)
    for q, s, c in groups:
        acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(s)), c)
    return acc.get_epsilon(DELTA)


def _gdp_closed_form(q, sigma, steps, delta):
    mu = q * math.sqrt(steps * (math.exp(sigma**-2) - 1))  # RLDP Eq. 7, typo fixed (ERRATA E2)

    def f(eps):
        return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2) - delta

    return optimize.brentq(f, 0, 100, xtol=1e-13)


# -- constant sigma: agreement with the libraries used directly -------------------------------------------


@pytest.mark.parametrize("q,sigma,steps", CASES)
def test_constant_sigma_matches_libraries(q, sigma, steps):
    led = PrivacyLedger()
    for _ in range(steps):
        led.record_gaussian(q, sigma)

    o = OpacusRDP()
    o.history = [(sigma, q, steps)]
    eps_o = o.get_epsilon(DELTA)
    ours = RDPAccountant().epsilon(led, DELTA)
    assert ours <= eps_o * (1 + 1e-12)  # more orders can only tighten
    assert ours == pytest.approx(eps_o, rel=0.02)

    p = OpacusPRV()
    p.history = [(sigma, q, steps)]
    assert PRVAccountant().epsilon(led, DELTA) == pytest.approx(p.get_epsilon(DELTA), rel=0.02)

    eps_pld = _dp_pld([(q, sigma, steps)])
    ours_pld = PLDAccountant().epsilon(led, DELTA)
    assert ours_pld == pytest.approx(eps_pld, rel=0.01)
    assert ours_pld >= eps_pld * (1 - 1e-4)  # pessimistic at a coarser interval: not below

    assert GDPAccountant().epsilon(led, DELTA) == pytest.approx(_gdp_closed_form(q, sigma, steps, DELTA),
                                                                rel=1e-6)


def test_upper_bound_flags_and_registry():
    assert [get_accountant(n).is_upper_bound for n in ("rdp", "prv", "pld", "gdp")] == [True, True, True, False]
    with pytest.raises(ConfigError):
        get_accountant("moments")


@pytest.mark.parametrize("delta", [0.0, -1e-5, 1.0, 2.0])
def test_bad_delta(delta):
    for name in ("rdp", "pld", "prv", "gdp"):
        with pytest.raises(ConfigError):
            get_accountant(name).epsilon([(0.1, 1.0, 10)], delta)


def test_bad_steps():
    with pytest.raises(ConfigError):
        RDPAccountant().epsilon([(0.0 - 1e-9, 1.0)], DELTA)
    with pytest.raises(ConfigError):
        RDPAccountant().epsilon([(1.1, 1.0)], DELTA)
    with pytest.raises(ConfigError):
        RDPAccountant().epsilon([(0.1, -1.0)], DELTA)
    assert RDPAccountant().epsilon([(0.1, math.inf, 100)], DELTA) == 0.0
    assert RDPAccountant().epsilon([(0.1, 0.0, 1)], DELTA) == math.inf


# -- heterogeneous composition ----------------------------------------------------------------------------


def _random_steps(n, seed, lo=0.8, hi=2.0, q=0.02):
    rng = np.random.default_rng(seed)
    return [(q, float(s)) for s in np.exp(rng.uniform(math.log(lo), math.log(hi), n))]


def test_heterogeneous_pld_equals_naive_per_step_composition():
    steps = _random_steps(50, seed=1, lo=1.5, hi=4.0, q=0.1)
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=5e-4)
    for q, s in steps:  # naive: one event per step
        acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(s)))
    naive = acc.get_epsilon(DELTA)
    ours = PLDAccountant().epsilon(steps, DELTA)
    assert ours == pytest.approx(naive, rel=0.02)
    assert ours >= naive * (1 - 1e-3)


ORDERS = [1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 48.0, 64.0, 128.0]


def test_heterogeneous_rdp_equals_naive_sum_of_compute_rdp():
    steps = _random_steps(150, seed=2, lo=0.5, hi=3.0, q=0.05)
    rdp = sum(opacus_rdp.compute_rdp(q=q, noise_multiplier=s, steps=1, orders=ORDERS) for q, s in steps)
    naive = opacus_rdp.get_privacy_spent(orders=ORDERS, rdp=rdp, delta=DELTA)[0]
    assert RDPAccountant(grid=None, orders=ORDERS).epsilon(steps, DELTA) == pytest.approx(naive, rel=1e-10)
    grid = RDPAccountant(orders=ORDERS).epsilon(steps, DELTA)
    assert naive <= grid <= naive * 1.02


def test_heterogeneous_prv_matches_opacus():
    rng = np.random.default_rng(4)
    groups = [(0.01, float(s), 100) for s in rng.uniform(0.8, 1.5, 6)]
    p = OpacusPRV()
    p.history = [(s, q, c) for q, s, c in groups]
    assert PRVAccountant().epsilon(groups, DELTA) == pytest.approx(p.get_epsilon(DELTA), rel=0.02)


def test_grid_is_conservative():
    rdp_exact, rdp_grid = RDPAccountant(grid=None, orders=ORDERS), RDPAccountant(orders=ORDERS)
    rng = np.random.default_rng(5)
    for trial in range(25):
        n = int(rng.integers(1, 40))
        q = float(rng.choice([1e-3, 0.01, 0.1, 1.0]))
        steps = [(q * float(rng.uniform(0.9, 1.0)), float(s)) for s in np.exp(rng.uniform(-1.0, 1.5, n))]
        assert rdp_grid.epsilon(steps, DELTA) >= rdp_exact.epsilon(steps, DELTA) * (1 - 1e-12)
    steps = _random_steps(40, seed=6, lo=1.5, hi=4.0, q=0.1)
    vdi = 1e-3  # same discretisation for both, so only the grid differs
    exact = PLDAccountant(grid=None, value_discretization_interval=vdi).epsilon(steps, DELTA)
    grid = PLDAccountant(value_discretization_interval=vdi).epsilon(steps, DELTA)
    assert exact <= grid <= exact * 1.02


def test_grid_rounding():
    g = Grid(sigma_ratio=1.005, q_ratio=1.001)
    rng = np.random.default_rng(7)
    for s in np.exp(rng.uniform(-8, 8, 2000)):
        f = g.sigma_floor(float(s))
        assert f <= s < f * 1.005 * (1 + 1e-12)
        assert g.sigma_floor(f) == f  # grid values are fixed points
    for q in rng.uniform(1e-6, 1.0, 2000):
        c = g.q_ceil(float(q))
        assert q <= c <= 1.0 and c < q * 1.001 * (1 + 1e-12)
    assert g.q_ceil(1.0) == 1.0
    assert g.charge(0.01, 1.2345, 10_000) == (0.01, 1.2345)  # frequent values stay exact


@pytest.mark.parametrize("name", ["rdp", "pld", "prv", "gdp"])
def test_incremental_composition_matches_fresh(name):
    acc = get_accountant(name).for_target(2.0)
    rng = np.random.default_rng(8)
    led = PrivacyLedger()
    tracker = LedgerTracker(acc)
    for block in range(6):
        s = float(rng.uniform(0.8, 1.6))
        for _ in range(int(rng.integers(5, 40))):
            led.record_gaussian(0.01, s)
        tracker.sync(led)
    fresh = acc.epsilon(led, DELTA)
    inc = tracker.epsilon(led, DELTA)
    # batches are never charged less than the whole ledger would be (grid rule per batch)
    assert inc == pytest.approx(fresh, rel=0.01)
    assert inc >= fresh * (1 - 2e-3)
    what_if = tracker.composition.epsilon_with(0.01, 1.1, 200, DELTA)
    ext = [(0.01, s) for s in led.sigma_eff] + [(0.01, 1.1)] * 200
    assert what_if == pytest.approx(acc.epsilon(ext, DELTA), rel=0.01)
    if name == "rdp":
        assert inc == pytest.approx(fresh, rel=1e-10)


# -- calibration -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("eps,q,steps", [(1.0, 0.01, 1000), (8.0, 1 / 1200, 3600), (0.5, 0.05, 200),
                                         (3.0, 0.004, 2500)])
def test_calibration_lands_just_below_target(eps, q, steps):
    res = calibrate_sigma(eps, DELTA, q, steps, "pld")
    assert eps * 0.99 <= res.epsilon <= eps
    # independent: dp_accounting directly at the returned sigma
    direct = _dp_pld([(q, res.sigma, steps)])
    assert direct <= eps * (1 + 1e-3)
    assert direct >= eps * 0.98
    # and against Opacus's own calibration with its PRV accountant (a different upper bound)
    res_rdp = calibrate_sigma(eps, DELTA, q, steps, "rdp")
    o = OpacusRDP()
    o.history = [(res_rdp.sigma, q, steps)]
    assert eps * 0.99 <= res_rdp.epsilon <= eps
    assert o.get_epsilon(DELTA, alphas=list(DEFAULT_ORDERS)) <= eps * (1 + 1e-12)


def test_calibration_with_extra_releases():
    # a noisy norm histogram (sensitivity 1/2, std 4) on every step: X = 1/64
    smap = SigmaEffMap(extra_precision=(0.5 / 4.0) ** 2)
    res = calibrate_sigma(2.0, DELTA, 0.01, 800, "rdp", sigma_eff=smap)
    assert res.sigma_eff == pytest.approx((res.sigma**-2 + 1 / 64) ** -0.5, rel=1e-12)
    plain = calibrate_sigma(2.0, DELTA, 0.01, 800, "rdp")
    assert res.sigma > plain.sigma  # the gradient must carry more noise
    assert res.sigma_eff == pytest.approx(plain.sigma_eff, rel=3e-3)
    o = OpacusRDP()
    o.history = [(res.sigma_eff, 0.01, 800)]
    assert 0.99 * 2.0 <= o.get_epsilon(DELTA, alphas=list(DEFAULT_ORDERS)) <= 2.0
    fn = calibrate_sigma(2.0, DELTA, 0.01, 800, "rdp", sigma_eff=lambda s: (s**-2 + 1 / 64) ** -0.5)
    assert fn.sigma == pytest.approx(res.sigma, rel=2e-3)


@pytest.mark.parametrize("kwargs", [
    dict(epsilon_target=0.0), dict(epsilon_target=-1.0), dict(delta=0.0), dict(delta=1.0),
    dict(q=0.0), dict(q=1.5), dict(steps=0), dict(steps=-3),
    dict(epsilon_target=0.01, q=1.0, steps=1_000_000),  # unreachable even at sigma = 1e4
])
def test_impossible_calibration_is_config_error(kwargs):
    args = dict(epsilon_target=1.0, delta=DELTA, q=0.01, steps=100, accountant="rdp")
    args.update(kwargs)
    with pytest.raises(ConfigError):
        calibrate_sigma(**args)


def test_calibration_refuses_gdp_unless_asked():
    with pytest.raises(ConfigError):
        calibrate_sigma(2.0, DELTA, 0.01, 500, "gdp")
    res = calibrate_sigma(2.0, DELTA, 0.01, 500, "gdp", allow_approximation=True)
    assert 1.98 <= _gdp_closed_form(0.01, res.sigma, 500, DELTA) <= 2.0


def test_planned_steps():
    assert planned_steps(3, 16 / 19_200) == 3600
    assert planned_steps(3, dataset_size=19_200, batch_size=16) == 3600
    assert planned_steps(1, 0.3) == 4
    assert planned_steps(2, dataset_size=10, batch_size=10) == 2
    for bad in (dict(epochs=0, q=0.1), dict(epochs=1, q=0.0), dict(epochs=1, q=2.0), dict(epochs=1)):
        with pytest.raises(ConfigError):
            planned_steps(**bad)


def _gaussian_epsilon(sensitivity: float, std: float, delta: float) -> float:
    """The exact epsilon of one Gaussian mechanism (Balle & Wang 2018, Thm 8): the root in epsilon of
    Phi(D/(2s) - eps s/D) - e^eps Phi(-D/(2s) - eps s/D) = delta."""
    def excess(eps):
        a, b = sensitivity / (2 * std), eps * std / sensitivity
        return norm.cdf(a - b) - math.exp(eps) * norm.cdf(-a - b) - delta
    return optimize.brentq(excess, 0.0, 100.0)


@pytest.mark.parametrize("sigma", [1.5, 3.0])
def test_replace_one_epsilon_doubles_the_sensitivity_of_an_unsampled_step(sigma):
    """Issue 26 (N public): replace-one neighbours move the sum by up to 2C; with q = 1 that is a Gaussian of
    sensitivity 2, whose exact epsilon the analytic formula gives (an independent computation)."""
    from raydp.privacy.accounting.pld import replace_one_epsilon

    exact = _gaussian_epsilon(2.0, sigma, 1e-5)
    got = replace_one_epsilon([(1.0, sigma, 1)], 1e-5)
    assert exact <= got <= exact * 1.01  # a pessimistic PLD: an upper bound, tight
    assert got > PLDAccountant().epsilon([(1.0, sigma, 1)], 1e-5)


def test_replace_one_epsilon_of_a_subsampled_run_lies_between_add_remove_and_group_privacy():
    from raydp.privacy.accounting.pld import replace_one_epsilon

    steps, delta = [(0.02, 1.0, 300)], 1e-5
    add_remove = PLDAccountant().epsilon(steps, delta)
    got = replace_one_epsilon(steps, delta)
    assert add_remove < got < 2 * add_remove  # at the same delta; group privacy needs (1 + e^eps) delta too
