"""Tests of the budget guard (ERRATA E4): whatever sigmas a strategy proposes, the run never ends above
epsilon_target when measured by an accountant used directly here (Opacus / dp_accounting)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from opacus.accountants.analysis import rdp as opacus_rdp

from raydp.errors import ConfigError, RaydpError
from raydp.privacy import (
    BudgetExhausted,
    BudgetGuard,
    PrivacyLedger,
    RDPAccountant,
    Release,
    SigmaEffMap,
    calibrate_sigma,
)

DELTA = 1e-5
ORDERS = [1.5, 2.0, 3.0, 5.0, 8.0, 12.0, 20.0, 32.0, 64.0]


def independent_rdp(ledger: PrivacyLedger, orders=ORDERS) -> float:
    """Opacus RDP, step by step, on the ledger's exact (q, sigma_eff)."""
    rdp = np.zeros(len(orders))
    cache = {}
    for q, s in zip(*ledger.arrays()):
        if math.isinf(s):
            continue
        key = (float(q), float(s))
        if key not in cache:
            cache[key] = np.asarray(opacus_rdp.compute_rdp(q=key[0], noise_multiplier=key[1], steps=1,
                                                           orders=orders))
        rdp += cache[key]
    if not rdp.any():
        return 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "optimal order is the largest alpha"
        return float(opacus_rdp.get_privacy_spent(orders=orders, rdp=rdp, delta=DELTA)[0])


def independent_pld(ledger: PrivacyLedger, extra=(), vdi=5e-4) -> float:
    """dp_accounting PLD on the ledger's exact (q, sigma_eff), equal consecutive steps merged."""
    runs: list[list] = []
    for q, s in list(zip(*ledger.arrays())) + list(extra):
        if math.isinf(s):
            continue
        if runs and runs[-1][0] == (q, s):
            runs[-1][1] += 1
        else:
            runs.append([(q, s), 1])
    if not runs:
        return 0.0
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=vdi)
    acc.compose(dp_event.ComposedDpEvent([
        dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(float(q), dp_event.GaussianDpEvent(float(s))), n)
        for (q, s), n in runs]))
    return acc.get_epsilon(DELTA)


def _proposal(rng, sigma0):
    u = rng.uniform()
    if u < 0.05:
        return 0.0
    if u < 0.1:
        return math.inf
    if u < 0.2:
        return float(10.0 ** rng.uniform(-6, -2))  # tiny
    if u < 0.3:
        return float(10.0 ** rng.uniform(2, 6))  # huge
    return float(sigma0 * math.exp(rng.uniform(math.log(0.3), math.log(3.0))))


def _run(guard: BudgetGuard, rng, sigma0: float, steps: int, q: float, every=(1, 8)) -> PrivacyLedger:
    ledger = PrivacyLedger(delta=guard.delta, epsilon_target=guard.epsilon_target)
    try:
        while len(ledger) < steps:
            sigma, _ = guard.clamp(_proposal(rng, sigma0), ledger)
            for _ in range(min(int(rng.integers(*every)), steps - len(ledger))):
                ledger.record_gaussian(q, sigma)
    except BudgetExhausted:
        pass
    return ledger


# Random runs: the fast tier draws a third of them (its worst run still uses over 90% of its budget); the slow tier
# draws them all.
@pytest.mark.parametrize("runs", [300, pytest.param(1000, marks=pytest.mark.slow)])
def test_random_proposals_never_overspend_rdp_guard(runs):
    rng = np.random.default_rng(2024)
    worst = 0.0
    for trial in range(runs):
        eps = float(rng.uniform(0.3, 6.0))
        q = float(rng.choice([0.01, 0.05, 0.2, 1.0]))
        steps = int(rng.integers(3, 30))
        acc = RDPAccountant(orders=ORDERS)
        guard = BudgetGuard(acc, epsilon_target=eps, delta=DELTA, planned_steps=steps, q=q)
        ledger = _run(guard, rng, sigma0=float(10.0 ** rng.uniform(-0.5, 1.0)), steps=steps, q=q)
        measured = independent_rdp(ledger)
        assert measured <= eps * (1 + 1e-9), (trial, eps, measured)
        worst = max(worst, measured / eps)
    assert worst > 0.9  # the guard lets runs use their budget


@pytest.mark.parametrize("runs", [8, pytest.param(24, marks=pytest.mark.slow)])
def test_random_proposals_never_overspend_pld_guard(runs):
    rng = np.random.default_rng(7)
    used = []
    for trial in range(runs):
        eps = float(rng.uniform(0.5, 4.0))
        q = float(rng.choice([0.1, 0.25]))
        steps = int(rng.integers(12, 36))
        guard = BudgetGuard("pld", epsilon_target=eps, delta=DELTA, planned_steps=steps, q=q)
        ledger = _run(guard, rng, sigma0=1.5, steps=steps, q=q, every=(3, 10))
        measured = independent_pld(ledger)
        assert measured <= eps, (trial, eps, measured)
        if trial % 4 == 0:
            check = guard.final_check(ledger)
            assert check.within_budget and check.epsilon >= measured * (1 - 2e-3)
        used.append(measured / eps)
    assert max(used) > 0.95


def test_min_sigma_is_tight_and_safe():
    q, eps, planned = 0.02, 2.0, 400
    guard = BudgetGuard("pld", epsilon_target=eps, delta=DELTA, planned_steps=planned, q=q)
    ledger = PrivacyLedger()
    for i in range(150):
        ledger.record_gaussian(q, 1.4 if i < 100 else 0.9)
    m = guard.min_sigma(ledger)
    rest = [(q, m)] * (planned - len(ledger))
    assert independent_pld(ledger, rest) <= eps
    below = [(q, m / 1.01)] * (planned - len(ledger))
    assert independent_pld(ledger, below) > eps  # within 1% of the smallest
    s, clamped = guard.clamp(m * 1.3, ledger)
    assert (s, clamped) == (m * 1.3, False)
    s, clamped = guard.clamp(m * 0.7, ledger)
    assert clamped and m * 0.999 <= s <= m * 1.01
    assert guard.min_sigma(ledger, remaining_steps=0) == 0.0


def test_guard_with_extra_releases():
    # each step also releases a noisy norm histogram (sensitivity 1/2, std 3): sigma_eff < sigma
    q, eps, planned = 0.05, 3.0, 120
    smap = SigmaEffMap.from_releases(fixed=[Release("norm_histogram", 0.5, 3.0)])
    acc = RDPAccountant(orders=ORDERS)
    guard = BudgetGuard(acc, epsilon_target=eps, delta=DELTA, planned_steps=planned, q=q, sigma_eff=smap)
    ledger = PrivacyLedger()
    rng = np.random.default_rng(1)
    while len(ledger) < planned:
        sigma, _ = guard.clamp(float(rng.uniform(0.3, 3.0)), ledger)
        for _ in range(10):
            ledger.record(q, [Release("gradient", 1.0, sigma), Release("norm_histogram", 0.5, 3.0)])
    assert independent_rdp(ledger) <= eps * (1 + 1e-9)
    # releases that alone exceed the budget: no gradient sigma can help
    greedy = SigmaEffMap(extra_precision=4.0)
    g2 = BudgetGuard(acc, epsilon_target=0.5, delta=DELTA, planned_steps=1000, q=0.5, sigma_eff=greedy)
    with pytest.raises(BudgetExhausted):
        g2.min_sigma(PrivacyLedger())


def test_exhausted_budget_stops_cleanly():
    q = 0.1
    guard = BudgetGuard("rdp", epsilon_target=1.0, delta=DELTA, planned_steps=100, q=q)
    ledger = PrivacyLedger()
    for _ in range(50):
        ledger.record_gaussian(q, 0.5)  # overspent without the guard
    with pytest.raises(BudgetExhausted) as info:
        guard.clamp(1.0, ledger)
    assert isinstance(info.value, RaydpError) and "\n" not in str(info.value)
    assert info.value.steps_done == 50 and info.value.spent > 1.0
    st = guard.status(ledger)
    assert st.exhausted and st.min_sigma is None
    assert not guard.final_check(ledger).within_budget
    # nearly spent: even sigma = cap cannot cover 10**7 more steps at q = 1
    g2 = BudgetGuard("rdp", epsilon_target=1.0, delta=DELTA, planned_steps=10**7, q=1.0, sigma_cap=10.0)
    with pytest.raises(BudgetExhausted):
        g2.min_sigma(PrivacyLedger())


def test_guard_refuses_gdp_and_bad_input():
    with pytest.raises(ConfigError):
        BudgetGuard("gdp", epsilon_target=1.0, delta=DELTA, planned_steps=10, q=0.1)
    for kw in (dict(epsilon_target=0.0), dict(delta=0.0), dict(delta=1.0), dict(q=0.0), dict(q=1.2),
               dict(planned_steps=0), dict(sigma_cap=-1.0)):
        args = dict(epsilon_target=1.0, delta=DELTA, planned_steps=10, q=0.1)
        args.update(kw)
        with pytest.raises(ConfigError):
            BudgetGuard("pld", **args)
    guard = BudgetGuard("rdp", epsilon_target=1.0, delta=DELTA, planned_steps=10, q=0.1)
    with pytest.raises(ConfigError):
        guard.clamp(float("nan"), PrivacyLedger())
    with pytest.raises(ConfigError):
        guard.min_sigma(PrivacyLedger(), remaining_steps=-1)


@pytest.mark.parametrize("name", ["pld", "prv"])
def test_realistic_guarded_run_stays_within_budget(name):
    """A 3,600-step plan with sigma proposals every 112 steps (guard timing: bench/bench_accounting.py)."""
    q, eps, planned = 1 / 1200, 2.0, 3600
    sigma0 = calibrate_sigma(eps, DELTA, q, planned, name).sigma
    guard = BudgetGuard(name, epsilon_target=eps, delta=DELTA, planned_steps=planned, q=q, sigma_hint=sigma0)
    ledger = PrivacyLedger()
    rng = np.random.default_rng(3)
    for block in range(8):
        sigma, _ = guard.clamp(sigma0 * float(rng.uniform(0.5, 2.0)), ledger)
        for _ in range(112):
            ledger.record_gaussian(q, sigma)
    assert guard.final_check(ledger).within_budget
