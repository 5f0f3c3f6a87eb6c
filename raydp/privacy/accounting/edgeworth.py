"""Edgeworth accountant (Wang, Gao, Zhang, Shen & Su 2022), as used by EW-Tune and DualTune-GhostDP.

An APPROXIMATION, never an upper bound (ERRATA E9): ``is_upper_bound = False``. The project reports the
Edgeworth estimate beside the enforcing upper-bound accountant (``pld``, ``prv`` or ``rdp``); the budget
guard and the calibration refuse it, exactly as they refuse ``gdp``.
``calibrate_sigma(..., "edgeworth", allow_approximation=True)`` (:mod:`raydp.privacy.calibration`) gives the noise multiplier the Edgeworth accountant would have chosen
("the sigma the paper would have used", :mod:`raydp.strategies.dualtune`) for reports; it calibrates
nothing.

Reference: H. Wang, S. Gao, H. Zhang, M. Shen, W. J. Su, "Analytical composition of differential
privacy via the Edgeworth accountant", arXiv:2206.04236 (2022); EW-Tune: R. Behnia et al., ICDMW 2022.
The paper's text was not available offline, so the equations below are numbered (1)-(7) in THIS
docstring and every formula in the code cites that number. Each is named after the construct of the
paper it implements, and was checked against the authors' public reference code (``LogLikelihoodPair.
approx_delta_from_eps_edgeworth`` and ``DistributionSequence._approx_Fn_edgeworth``: second order
expansion, same Hermite terms and signs) and, in ``tests/test_edgeworth.py``, against independent
computations (closed-form GDP, an FFT privacy-loss distribution, dp_accounting's PLD).

Mechanism (ERRATA E6, add/remove-one, sensitivity 1): a step is a Poisson-subsampled Gaussian with
sampling rate q and noise multiplier sigma. In units of sigma (z = x / sigma, mu = 1 / sigma) the
neighbouring output distributions are P = N(0, 1) and Q = (1 - q) N(0, 1) + q N(mu, 1).

(1) Privacy-loss log-likelihood ratio (PLLR) of one step, the paper's PLLR of the pair (P, Q)::

        L(z) = log Q(z) / P(z) = log(1 - q + q exp(mu z - mu^2 / 2))
             = log1p(q expm1(t)) = logaddexp(log(1 - q), log q + t),   t = mu z - mu^2 / 2.

(2) Cumulants of one step, kappa_k^P and kappa_k^Q (k = 1..4), the k-th cumulants of L(Z) for Z ~ P and
    Z ~ Q, from the central moments m_k = E[(L - E L)^k]::

        kappa_1 = E L,  kappa_2 = m_2,  kappa_3 = m_3,  kappa_4 = m_4 - 3 m_2^2.

    The expectations are integrals against a Gaussian weight, computed by the trapezoidal rule on a
    uniform z grid (exponentially convergent for this analytic integrand: L has its nearest complex
    singularity at Im z = pi / mu, so a spacing h <= 0.25 / mu gives errors ~ exp(-2 pi^2 / (mu h)) <
    1e-30), once per distinct (q, sigma) and cached. For q = 1 they are exact: L = mu z - mu^2 / 2 is
    Gaussian, kappa^P = (-mu^2/2, mu^2, 0, 0), kappa^Q = (+mu^2/2, mu^2, 0, 0).

(3) Composition: the PLLR of the composed mechanism is the sum of the independent per-step PLLRs, so its
    cumulants are the sums of the per-step cumulants (heterogeneous composition: a (q, sigma, count)
    group contributes count times its step's cumulants)::

        K_k^P = sum_t kappa_k^P(q_t, sigma_t),   K_k^Q = sum_t kappa_k^Q(q_t, sigma_t).

(4) Edgeworth expansion of degree 2 (the paper's "Edgeworth approximation", Hall 1992) of the CDF of the
    sum S with cumulants K, standardised x = (s - K_1) / sqrt(K_2)::

        F(s) ~ Phi(x) - phi(x) [ g1/6 He_2(x) + g2/24 He_3(x) + g1^2/72 He_5(x) ],
        g1 = K_3 / K_2^{3/2},  g2 = K_4 / K_2^2,
        He_2 = x^2 - 1,  He_3 = x^3 - 3x,  He_5 = x^5 - 10 x^3 + 15 x,

    so the tail is Pr[S > s] ~ Phi(-x) + phi(x) [ ... ], clamped to [0, 1] (the expansion is not a
    distribution function: it can leave [0, 1] and need not be monotone).

(5) (epsilon, delta) from the PLLR (the f-DP / hockey-stick duality the paper uses: Dong, Roth & Su
    2022)::

        delta_{Q||P}(eps) = Pr_Q[S > eps] - e^eps Pr_P[S > eps],

    each tail from its own expansion (4) with the cumulants (3) under Q and under P.

(6) Add/remove-one needs both directions: the swapped pair (Q, P) has PLLR -L, whose cumulants are
    (-1)^k kappa_k, so delta_{P||Q}(eps) = Pr_P[-S > eps] - e^eps Pr_Q[-S > eps], and

        delta_EW(eps) = max(delta_{Q||P}(eps), delta_{P||Q}(eps)).

    (The reference code and EW-Tune compose the pair (N(0,1), mixture) only, i.e. delta_{Q||P}; taking
    the max can only increase epsilon.)

(7) epsilon(delta): since (4) need not be monotone, delta_EW(eps) is evaluated on a grid of eps from 0 to
    eps_max = max over the two directions of K_1 + x_max sqrt(K_2) (for the first distribution of the
    pair), x_max = sqrt(40^2 + 2 log(1 + C)), C = |g1|/6 + |g2|/24 + g1^2/72: past eps_max both
    Phi(-x) and C phi(x) x^5 are below 1e-300, so delta_EW(eps) <= Pr_first[S > eps] < delta there.
    The grid spacing is <= 1% of the smaller standard deviation sqrt(K_2) and <= 0.01 (at most 20,000
    points); epsilon is the root (Brent) in the cell after the LAST grid point with delta_EW > delta,
    i.e. the smallest eps >= 0 past which delta_EW stays <= delta, to the grid's resolution (a bump
    above delta narrower than one cell could be missed). 0 if delta_EW <= delta on the whole grid.

Accuracy at delta = 1e-5 (measured against dp_accounting's PLD and an FFT privacy-loss distribution,
tests/test_edgeworth.py): exact for q = 1 (the composition is mu-GDP, relative error ~1e-14). At q = 0.01
with 1000 steps, sigma 0.8 / 0.9 / 1.0 / 1.1 / 1.2: +0.7% / +4.6% / +5.7% / +5.0% / +3.7% (over); with
10,000 steps +3.8% to +0.6%. With few steps or a tiny q it UNDER-estimates: 10 steps at q = 0.01, sigma
1: -39%; 3600 steps at q = 1/1200, sigma 0.6: -37%. The expansion is accurate in the bulk of the loss
distribution; delta = 1e-5 sits 4 or more standard deviations out, where its relative error grows.
Never used to enforce anything.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from scipy import optimize, special

from raydp.errors import ConfigError
from raydp.privacy.accounting.base import Accountant, Composition, check_delta, check_epsilon, check_q
from raydp.privacy.accounting.grid import Grid

__all__ = [
    "EdgeworthAccountant",
    "composed_cumulants",
    "edgeworth_delta",
    "edgeworth_epsilon",
    "edgeworth_sf",
    "step_cumulants",
]

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)
_Z_TAIL = 14.0          # integrate z over [-14, mu + 14]: Gaussian mass outside < 1e-43
_X_MAX = 40.0           # eps_max = K_1 + x_max sqrt(K_2), x_max >= 40 where phi(x) underflows (7)
_MAX_SCAN = 20_000      # most grid points of the scan (7)
_ODD = np.array([-1.0, 1.0, -1.0, 1.0])  # (-1)^k, k = 1..4: cumulants of -L (6)


# -- one step ------------------------------------------------------------------------------------------
def _privacy_loss(z: np.ndarray, q: float, mu: float) -> np.ndarray:
    """L(z) = log(1 - q + q exp(mu z - mu^2/2)), Eq. (1), accurate for small and large t."""
    t = mu * z - 0.5 * mu * mu
    small = np.log1p(q * np.expm1(np.minimum(t, 30.0)))
    large = np.logaddexp(math.log1p(-q), math.log(q) + t)
    return np.where(t < 30.0, small, large)


def _cumulants_from_weights(loss: np.ndarray, w: np.ndarray) -> tuple[float, float, float, float]:
    """kappa_1..kappa_4 of a discrete measure (loss values, weights summing to ~1), Eq. (2)."""
    w = w / w.sum()
    k1 = float(np.dot(w, loss))
    d = loss - k1
    d2 = d * d
    m2 = float(np.dot(w, d2))
    m3 = float(np.dot(w, d2 * d))
    m4 = float(np.dot(w, d2 * d2))
    return (k1, m2, m3, m4 - 3.0 * m2 * m2)


@lru_cache(maxsize=8192)
def step_cumulants(q: float, sigma: float) -> tuple[tuple[float, float, float, float],
                                                    tuple[float, float, float, float]]:
    """Cumulants (kappa_1..kappa_4) of one step's PLLR L (1) under P and under Q, Eq. (2).

    Returns ``(kappa_P, kappa_Q)``. Computed once per distinct (q, sigma) (cached); exact for q = 1.
    """
    q, sigma = float(q), float(sigma)
    check_q(q)
    if not (sigma > 0.0 and math.isfinite(sigma)):
        raise ConfigError(f"sigma must be > 0 and finite, got {sigma}")
    mu = 1.0 / sigma
    if q == 1.0:  # L = mu z - mu^2/2 is Gaussian under both: Eq. (2), q = 1
        return (-0.5 * mu * mu, mu * mu, 0.0, 0.0), (0.5 * mu * mu, mu * mu, 0.0, 0.0)
    h = min(0.05, 0.25 / mu)  # trapezoid spacing, Eq. (2)
    z = np.arange(-_Z_TAIL, mu + _Z_TAIL + h, h)
    loss = _privacy_loss(z, q, mu)
    phi0 = np.exp(-0.5 * z * z)                 # P density (unnormalised; weights are renormalised)
    phi1 = np.exp(-0.5 * (z - mu) ** 2)         # the shifted component of Q
    kp = _cumulants_from_weights(loss, phi0)
    kq = _cumulants_from_weights(loss, (1.0 - q) * phi0 + q * phi1)
    return kp, kq


def composed_cumulants(groups) -> tuple[np.ndarray, np.ndarray]:
    """(K^P, K^Q), each an array of K_1..K_4, of (q, sigma, count) groups, Eq. (3)."""
    kp = np.zeros(4)
    kq = np.zeros(4)
    for q, s, c in groups:
        a, b = step_cumulants(float(q), float(s))
        kp += int(c) * np.asarray(a)
        kq += int(c) * np.asarray(b)
    return kp, kq


# -- the expansion ---------------------------------------------------------------------------------------
def _tail_parts(s: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """log Phi(-x) and the relative correction 1 + phi(x) P(x) / Phi(-x) of the tail (4), so that
    Pr[S > s] ~ exp(log Phi(-x)) * rel (kept apart so e^eps times the tail never overflows)."""
    sd = math.sqrt(k[1])
    x = (s - k[0]) / sd
    g1 = k[2] / sd ** 3
    g2 = k[3] / sd ** 4
    x2 = x * x
    he2 = x2 - 1.0
    he3 = x * (x2 - 3.0)
    he5 = x * (x2 * x2 - 10.0 * x2 + 15.0)
    poly = g1 / 6.0 * he2 + g2 / 24.0 * he3 + g1 * g1 / 72.0 * he5       # Eq. (4)
    log_gauss = special.log_ndtr(-x)
    ratio = np.exp(-0.5 * x2 - _LOG_SQRT_2PI - log_gauss)                 # phi(x) / Phi(-x)
    return log_gauss, 1.0 + poly * ratio


def edgeworth_sf(s, cumulants) -> np.ndarray:
    """Edgeworth approximation (4) of Pr[S > s] for a sum S with cumulants K_1..K_4, clamped to [0, 1]."""
    log_gauss, rel = _tail_parts(np.asarray(s, dtype=float), np.asarray(cumulants, dtype=float))
    with np.errstate(over="ignore", invalid="ignore"):
        return np.clip(np.exp(log_gauss) * rel, 0.0, 1.0)


def _delta_direction(eps: np.ndarray, k_first: np.ndarray, k_second: np.ndarray) -> np.ndarray:
    """Pr_first[S > eps] - e^eps Pr_second[S > eps], each tail from (4) clamped to [0, 1], Eq. (5)."""
    first = edgeworth_sf(eps, k_first)
    log_gauss, rel = _tail_parts(eps, k_second)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        tail = np.exp(log_gauss) * rel
        scaled = np.exp(eps + log_gauss + np.log(np.maximum(rel, 0.0)))   # e^eps * tail, tail in [0, 1)
        scaled = np.where(tail >= 1.0, np.exp(eps), scaled)               # clamped at 1
    return first - scaled


def _delta_from_cumulants(eps, kp: np.ndarray, kq: np.ndarray) -> np.ndarray:
    """delta_EW(eps) = max over the two directions, Eqs. (5)-(6)."""
    eps = np.asarray(eps, dtype=float)
    remove = _delta_direction(eps, kq, kp)                  # pair (Q, P), PLLR S
    add = _delta_direction(eps, kp * _ODD, kq * _ODD)       # pair (P, Q), PLLR -S: (-1)^k K_k
    return np.maximum(remove, add)


def edgeworth_delta(eps, groups):
    """delta_EW(eps) of (q, sigma, count) groups, Eqs. (3)-(6); a float for a scalar eps, else an array."""
    kp, kq = composed_cumulants(groups)
    if kp[1] <= 0.0:
        out = np.zeros_like(np.asarray(eps, dtype=float))
    else:
        out = _delta_from_cumulants(eps, kp, kq)
    return float(out) if np.ndim(out) == 0 else out


def _epsilon_from_cumulants(kp: np.ndarray, kq: np.ndarray, delta: float) -> float:
    """Smallest eps >= 0 past which delta_EW(eps) stays <= delta (on the scan grid), Eq. (7)."""
    if not (kp[1] > 0.0 and kq[1] > 0.0):
        return 0.0
    sd = min(math.sqrt(kp[1]), math.sqrt(kq[1]))
    # Beyond eps_max both directions' first tails are < 1e-300, so delta_EW < delta there.
    coeff = max(abs(k[2]) / k[1] ** 1.5 / 6.0 + abs(k[3]) / k[1] ** 2 / 24.0 + k[2] ** 2 / k[1] ** 3 / 72.0
                for k in (kp, kq))
    x_max = math.sqrt(_X_MAX ** 2 + 2.0 * math.log1p(coeff))
    eps_max = max(kq[0] + x_max * math.sqrt(kq[1]), -kp[0] + x_max * math.sqrt(kp[1]))
    if eps_max <= 0.0:
        return 0.0
    n = int(min(_MAX_SCAN, math.ceil(eps_max / min(0.01 * sd, 0.01)))) + 1
    grid = np.linspace(0.0, eps_max, n + 1)
    above = np.flatnonzero(_delta_from_cumulants(grid, kp, kq) > delta)
    if above.size == 0:
        return 0.0
    i = int(above[-1])
    if i == n:
        return math.inf
    return float(optimize.brentq(lambda e: float(_delta_from_cumulants(e, kp, kq)) - delta,
                                 grid[i], grid[i + 1], xtol=1e-13, rtol=1e-13))


def edgeworth_epsilon(groups, delta: float) -> float:
    """Edgeworth epsilon at ``delta`` of (q, sigma, count) groups, Eqs. (3)-(7). An approximation."""
    delta = check_delta(delta)
    kp, kq = composed_cumulants(groups)
    return _epsilon_from_cumulants(kp, kq, delta)


class EdgeworthAccountant(Accountant):
    """Edgeworth approximation (second order) of heterogeneous Poisson-subsampled Gaussian compositions.

    Not an upper bound (ERRATA E9): reported beside the enforcing accountant, never enforces. Composes
    every step exactly (default ``grid=None``, like ``gdp``): cumulants add, and each distinct (q, sigma)
    costs one cached integration (Eq. (2)).
    """

    name = "edgeworth"
    is_upper_bound = False

    def __init__(self, grid: Grid | None = None) -> None:
        super().__init__(grid=grid)

    def _epsilon_groups(self, groups, delta: float) -> float:
        kp, kq = composed_cumulants(groups)
        return _epsilon_from_cumulants(kp, kq, delta)

    def composition(self) -> Composition:
        if self.grid is not None:  # the grid's rule depends on whole-ledger counts: recompute
            return super().composition()
        return EdgeworthComposition(self)

    def describe(self) -> dict:
        d = super().describe()
        d["approximation"] = "Edgeworth expansion of degree 2 (Wang et al. 2022); ERRATA E9"
        return d


class EdgeworthComposition(Composition):
    """Running sums of the per-step cumulants under P and Q, Eq. (3); queries cost one scan (7)."""

    def __init__(self, accountant: EdgeworthAccountant) -> None:
        super().__init__(accountant)
        self.kp = np.zeros(4)
        self.kq = np.zeros(4)

    def _add_counts(self, counts) -> None:
        kp, kq = composed_cumulants((q, s, c) for (q, s), c in counts.items())
        self.kp += kp
        self.kq += kq

    def _epsilon(self, delta: float) -> float:
        return _epsilon_from_cumulants(self.kp, self.kq, delta)

    def _epsilon_with(self, q, sigma, count, delta) -> float:
        kp, kq = composed_cumulants([(q, sigma, count)])
        return _epsilon_from_cumulants(self.kp + kp, self.kq + kq, delta)
