"""Privacy of private hyperparameter selection: repeat a DP run a random number K of times, each run with
hyperparameters drawn independently from a fixed distribution, and release only the best run's output.

Papernot & Steinke, "Hyperparameter Tuning with Renyi Differential Privacy" (ICLR 2022,
arXiv:2110.03620v2): Theorem 2 bounds the RDP of the procedure when K is truncated negative binomial
(eta, gamma) (geometric: eta = 1, logarithmic: eta = 0), Theorem 6 when K is Poisson(mu). Both are
computed by dp_accounting's ``RepeatAndSelectDpEvent(event, mean, shape)`` (shape = inf: Poisson), whose
RDP accountant calls ``_compute_rdp_repeat_and_select``; the public event only wraps dp_accounting's own
events, so an arbitrary per-trial RDP curve (a ledger's, :mod:`raydp.privacy.accounting.rdp`) goes
through that private helper (named at the import below). The per-trial curve must bound every trial
whatever its hyperparameters: pass the pointwise maximum of the candidates' curves.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
# Private helpers of dp_accounting 0.6.0 (rdp/rdp_privacy_accountant.py), used only in this module:
# ``_compute_rdp_repeat_and_select`` (Thms. 2 and 6; what RdpAccountant applies to RepeatAndSelectDpEvent)
# and ``_gamma_truncated_negative_binomial`` (the mean -> gamma map it uses, a conservative bisection).
from dp_accounting.rdp import rdp_privacy_accountant as _rdp_accountant

from raydp.errors import ConfigError
from raydp.privacy.accounting.base import check_delta, check_epsilon, check_q
from raydp.privacy.accounting.rdp import DEFAULT_ORDERS, rdp_epsilon, rdp_vector

__all__ = ["SelectionDistribution", "calibrate_sigma", "calibrate_trial_parameter", "expected_trials",
           "selection_epsilon", "selection_rdp"]

POISSON = "poisson"
TNB = "truncated-negative-binomial"
SIGMA_RANGE = (1e-2, 1e4)  # calibrate_sigma's search interval (the upper end is calibration.SIGMA_CAP)


@dataclass(frozen=True)
class SelectionDistribution:
    """The distribution of the number of runs K: ``poisson`` (mean mu) or ``truncated-negative-binomial``
    (mean and shape eta; Papernot & Steinke Def. 1: P[K=k] = (1-gamma)^k / (gamma^-eta - 1) *
    prod_{l<k} (l+eta)/(l+1), k >= 1, gamma fixed by the mean).

    The paper allows eta in (-1, 0) and any mu > 0; dp_accounting 0.6.0 implements eta >= 0 and mean >= 1
    only, so those are rejected. A truncated negative binomial needs mean > 1 (mean 1 is K = 1).
    """

    kind: str
    mean: float
    shape: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in (POISSON, TNB):
            raise ConfigError(f"selection distribution must be {POISSON!r} or {TNB!r}, got {self.kind!r}")
        if self.kind == POISSON:
            if self.shape is not None:
                raise ConfigError(f"a Poisson number of trials has no shape, got shape={self.shape}")
            if not (1.0 <= self.mean < math.inf):
                raise ConfigError(f"Poisson mean number of trials must be finite and >= 1, got {self.mean}")
            return
        if self.shape is None or not (-1.0 < self.shape < math.inf):
            raise ConfigError(f"truncated negative binomial shape must be finite and > -1, got {self.shape}")
        if self.shape < 0:
            raise ConfigError(f"shape {self.shape} in (-1, 0) is not supported by dp_accounting 0.6.0 (needs >= 0)")
        if not (1.0 < self.mean < math.inf):
            raise ConfigError(f"truncated negative binomial mean must be finite and > 1, got {self.mean}")

    @classmethod
    def poisson(cls, mean: float) -> SelectionDistribution:
        return cls(POISSON, float(mean))

    @classmethod
    def truncated_negative_binomial(cls, mean: float, shape: float) -> SelectionDistribution:
        return cls(TNB, float(mean), float(shape))

    @classmethod
    def geometric(cls, mean: float) -> SelectionDistribution:
        """P[K=k] = gamma (1-gamma)^(k-1), gamma = 1/mean (eta = 1)."""
        return cls(TNB, float(mean), 1.0)

    @classmethod
    def logarithmic(cls, mean: float) -> SelectionDistribution:
        """P[K=k] = (1-gamma)^k / (k log(1/gamma)) (eta = 0)."""
        return cls(TNB, float(mean), 0.0)

    @property
    def dp_accounting_shape(self) -> float:
        """The ``shape`` of dp_accounting's ``RepeatAndSelectDpEvent``: inf for Poisson, else eta."""
        return math.inf if self.shape is None else self.shape

    @property
    def gamma(self) -> float:
        """The truncated negative binomial's gamma for this mean, as dp_accounting's accountant computes it."""
        if self.shape is None:
            raise ConfigError("a Poisson number of trials has no gamma")
        return _rdp_accountant._gamma_truncated_negative_binomial(self.shape, self.mean)

    def pmf(self, k: int) -> float:
        """P[K = k] (Papernot & Steinke Def. 1 for the truncated negative binomial; Poisson otherwise)."""
        if self.shape is None:
            return math.exp(k * math.log(self.mean) - self.mean - math.lgamma(k + 1)) if k >= 0 else 0.0
        if k < 1:
            return 0.0
        eta, gamma = self.shape, self.gamma
        log_inv_gamma = -math.log(gamma)
        norm = 1.0 / log_inv_gamma if eta == 0 else eta / math.expm1(eta * log_inv_gamma)
        return norm * math.exp(k * math.log1p(-gamma) + math.lgamma(k + eta) - math.lgamma(1 + eta)
                               - math.lgamma(k + 1))

    def sample(self, rng: np.random.Generator, size: int | None = None) -> int | np.ndarray:
        """Draw K from the caller's (secret) generator. Poisson may give K = 0: Thm. 6 then runs nothing and
        releases nothing (a fixed empty output); redrawing until K >= 1 would be a zero-truncated Poisson,
        which Thm. 6 does not cover. Truncated negative binomial: K >= 1, by inversion of the CDF."""
        if self.shape is None:
            draws = rng.poisson(self.mean, size)
            return int(draws) if size is None else draws
        u = np.atleast_1d(rng.random(size))
        k = np.ones(u.shape, dtype=np.int64)
        eta, gamma = self.shape, self.gamma
        j, p = 1, self.pmf(1)
        cdf, active = p, u > p
        while active.any() and p > 0.0:  # P[K=j+1] / P[K=j] = (1-gamma)(j+eta)/(j+1)
            p *= (1.0 - gamma) * (j + eta) / (j + 1)
            j += 1
            cdf += p
            k[active] = j
            active &= u > cdf
        return int(k[0]) if size is None else k


def expected_trials(distribution: SelectionDistribution) -> float:
    """E[K], the expected number of runs."""
    return distribution.mean


def selection_rdp(trial_rdp: Sequence[float], orders: Sequence[float],
                  distribution: SelectionDistribution) -> np.ndarray:
    """RDP curve of repeat-and-select at ``orders`` from one trial's RDP curve at the same orders (> 1).

    Truncated negative binomial (Thm. 2): eps'(l) = eps(l) + (1+eta) min_lh [(1 - 1/lh) eps(lh)
    + log(1/gamma)/lh] + log(E[K])/(l-1), lh over ``orders``, then the minimum over orders >= l (RDP is
    non-decreasing in the order). Poisson (Thm. 6): eps'(l) = eps(l) + mu delta_hat + log(mu)/(l-1),
    delta_hat the trial's delta at eps_hat = log(1 + 1/(l-1)) (dp_accounting's ``compute_delta``).
    Both are non-decreasing in the trial curve.
    """
    orders_arr = np.asarray(orders, dtype=np.float64)
    rdp = np.asarray(trial_rdp, dtype=np.float64)
    if orders_arr.shape != rdp.shape or orders_arr.ndim != 1:
        raise ValueError(f"trial_rdp and orders must be 1-d of one length, got {rdp.shape} and {orders_arr.shape}")
    if not np.all(orders_arr > 1.0) or np.isnan(rdp).any() or (rdp < 0).any():
        raise ValueError("orders must be > 1 and the trial's RDP >= 0")
    return np.asarray(_rdp_accountant._compute_rdp_repeat_and_select(
        orders_arr, rdp, distribution.mean, distribution.dp_accounting_shape), dtype=np.float64)


def selection_epsilon(trial_rdp: Sequence[float], orders: Sequence[float], distribution: SelectionDistribution,
                      delta: float) -> float:
    """(epsilon, delta) of repeat-and-select: :func:`selection_rdp` converted by the project's
    :func:`~raydp.privacy.accounting.rdp.rdp_epsilon` (Opacus; Balle et al. 2020, Thm. 21)."""
    return rdp_epsilon(selection_rdp(trial_rdp, orders, distribution), orders, check_delta(delta))


def calibrate_trial_parameter(target_epsilon: float, delta: float, distribution: SelectionDistribution,
                              trial_rdp_of: Callable[[float], np.ndarray], low: float, high: float,
                              orders: Sequence[float] = DEFAULT_ORDERS, rtol: float = 1e-4) -> float:
    """Least s in [low, high] (0 < low < high; to a factor 1 + rtol, rounded up) whose repeat-and-select
    epsilon at ``delta`` is <= ``target_epsilon``, by bisection on log s.

    ``trial_rdp_of(s)``: the worst trial's RDP curve at ``orders``, pointwise non-increasing in s (s is
    noise, e.g. a noise multiplier). Then the selection epsilon is non-increasing in s (Thms. 2 and 6 and
    the conversion are non-decreasing in the curve), so the feasible s form an interval [s*, high].
    Returns ``low`` when it is feasible; raises ConfigError when ``high`` is not.
    """
    target_epsilon, delta = check_epsilon(target_epsilon), check_delta(delta)
    if not (0.0 < low < high < math.inf and rtol > 0.0):
        raise ConfigError(f"need 0 < low < high < inf and rtol > 0, got low={low}, high={high}, rtol={rtol}")

    def feasible(s: float) -> bool:
        return selection_epsilon(trial_rdp_of(s), orders, distribution, delta) <= target_epsilon

    if not feasible(high):
        raise ConfigError(f"epsilon={target_epsilon} at delta={delta} is unreachable for {distribution.kind} "
                          f"selection with mean {distribution.mean} trials, even at parameter {high:g}")
    if feasible(low):
        return low
    while high > low * (1.0 + rtol):
        mid = math.sqrt(low * high)
        low, high = (low, mid) if feasible(mid) else (mid, high)
    return high


def calibrate_sigma(target_epsilon: float, delta: float, distribution: SelectionDistribution, q: float,
                    steps: int, orders: Sequence[float] = DEFAULT_ORDERS, rtol: float = 1e-4) -> float:
    """Least noise multiplier sigma in :data:`SIGMA_RANGE` such that repeat-and-select over trials of
    ``steps`` Poisson-subsampled Gaussian steps at rate q (each trial's RDP: ``steps * rdp_vector(q, sigma)``,
    Mironov et al. 2019) costs at most ``target_epsilon`` at ``delta`` (:func:`calibrate_trial_parameter`)."""
    q = check_q(q)
    if int(steps) != steps or steps <= 0:
        raise ConfigError(f"steps must be a positive integer, got {steps}")
    return calibrate_trial_parameter(target_epsilon, delta, distribution,
                                     lambda sigma: int(steps) * rdp_vector(q, sigma, orders),
                                     *SIGMA_RANGE, orders=orders, rtol=rtol)
