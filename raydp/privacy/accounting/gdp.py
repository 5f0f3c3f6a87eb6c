"""GDP/CLT accountant (Dong, Roth & Su 2022; Bu et al. 2020), for comparison with the paper only.

RLDP Eq. 7 has a typo (ERRATA E2): the CLT parameter of T Poisson-subsampled Gaussian steps is

    mu = sqrt( sum_t q_t^2 (exp(1 / sigma_t^2) - 1) )

(so q * sqrt(T (exp(1/sigma^2) - 1)) for constant q and sigma; the paper wrote exp(1/sigma) and put the
square root in the wrong place), and epsilon at delta solves the mu-GDP duality

    delta(eps) = Phi(-eps/mu + mu/2) - exp(eps) Phi(-eps/mu - mu/2).

The CLT is an asymptotic approximation that can UNDER-estimate epsilon (ERRATA E2, E9):
``is_upper_bound = False``; the calibration and the budget guard refuse it.
"""

from __future__ import annotations

import math

from scipy import optimize, special

from raydp.privacy.accounting.base import Accountant, Composition

__all__ = ["GDPAccountant", "gdp_delta", "gdp_epsilon", "gdp_mu"]


def _mu2_term(q: float, sigma: float) -> float:
    x = 1.0 / (sigma * sigma)
    if x > 700.0:
        return math.inf
    return q * q * math.expm1(x)


def gdp_mu(groups) -> float:
    """mu of the CLT for (q, sigma, count) groups: sqrt(sum count * q^2 (e^{1/sigma^2} - 1))."""
    total = 0.0
    for q, s, c in groups:
        total += c * _mu2_term(q, s)
    return math.sqrt(total)


def gdp_delta(eps: float, mu: float) -> float:
    """delta(eps) of mu-GDP, computed in log space so large eps does not overflow."""
    a = special.log_ndtr(-eps / mu + mu / 2.0)
    b = eps + special.log_ndtr(-eps / mu - mu / 2.0)
    if b >= a:
        return 0.0
    return math.exp(a) * -math.expm1(b - a)


def gdp_epsilon(mu: float, delta: float) -> float:
    """Smallest eps >= 0 with delta(eps) <= delta for mu-GDP."""
    if mu == 0.0:
        return 0.0
    if math.isinf(mu):
        return math.inf
    if gdp_delta(0.0, mu) <= delta:
        return 0.0
    hi = max(1.0, mu * mu)
    while gdp_delta(hi, mu) > delta:
        hi *= 2.0
        if hi > 1e8:
            return math.inf
    return float(optimize.brentq(lambda e: gdp_delta(e, mu) - delta, 0.0, hi, xtol=1e-12, rtol=1e-12))


class GDPAccountant(Accountant):
    """CLT approximation of Poisson-subsampled Gaussian steps; exact per step, no grid needed."""

    name = "gdp"
    is_upper_bound = False

    def __init__(self) -> None:
        super().__init__(grid=None)

    def _epsilon_groups(self, groups, delta: float) -> float:
        return gdp_epsilon(gdp_mu(groups), delta)

    def composition(self) -> GDPComposition:
        return GDPComposition(self)


class GDPComposition(Composition):
    """Running sum of q^2 (e^{1/sigma^2} - 1)."""

    def __init__(self, accountant: GDPAccountant) -> None:
        super().__init__(accountant)
        self.mu2 = 0.0

    def _add_counts(self, counts) -> None:
        for (q, s), c in counts.items():
            self.mu2 += c * _mu2_term(q, s)

    def _epsilon(self, delta: float) -> float:
        return gdp_epsilon(math.sqrt(self.mu2), delta)

    def _epsilon_with(self, q, sigma, count, delta) -> float:
        return gdp_epsilon(math.sqrt(self.mu2 + count * _mu2_term(q, sigma)), delta)
