"""A canary's exposure from the scores of random candidates (Carlini et al. 2019, "The Secret Sharer"), two ways.

* **rank** (Sec. 4.2): exposure = -log2 of the estimated share of the format's strings at least as likely as the
  canary, ``-log2((1 + #{candidates >= canary}) / (K + 1))`` from K uniform candidates: at most log2(K + 1) bits
  measurable, and K forward passes per canary buy it.
* **extrapolate** (Sec. 4.3, "exposure by extrapolation"): the candidates' negative log-probabilities (the
  log-perplexity of a secret, up to the unit) are fitted by a skew-normal distribution (maximum likelihood), and
  exposure = -log2 F(canary's), F the fitted CDF, evaluated as a log-CDF so that a far tail does not underflow;
  capped at the format's size in bits (the canary is one of the format's strings, so its rank is at least 1). Its
  interval is a nonparametric bootstrap over the candidates: ``resamples`` multinomial resamples of the
  candidates, each refitted (Newton's method on the weighted log-likelihood, all resamples at once, from the full
  fit), percentile interval. When the canaries share their candidates (they do: one public draw), the resamples
  are the same candidate indices for every canary, so the mean's and the max's intervals come from the same
  replicates. The interval is the candidates' sampling error only: it assumes the skew-normal shape, which
  ``bench/bench_exposure.py`` checks against a 100,000-candidate rank on trained runs (there the shape's error,
  0.1-0.2 bits, was often larger than the interval: docs/privacy.md, exposure).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import special, stats

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)
_MAX_SHAPE = 50.0  # |a| beyond this is a half-normal for every purpose here; keeps Newton's steps finite


def rank_exposure(canary: float, candidates: np.ndarray) -> float:
    """Sec. 4.2's estimate from log-probabilities (higher = likelier): ``-log2((1 + #{c >= canary}) / (K + 1))``."""
    at_least = int(np.sum(np.asarray(candidates) >= canary))
    return -math.log2((1 + at_least) / (len(candidates) + 1))


def skewnorm_exposure(value: float | np.ndarray, params: np.ndarray, cap: float = math.inf) -> np.ndarray:
    """-log2 of the skew-normal CDF at ``value`` (a negative log-probability) for each row (a, loc, scale) of
    ``params``, capped at ``cap`` bits (a log-CDF of -inf gives the cap)."""
    params = np.atleast_2d(params)
    logcdf = stats.skewnorm.logcdf(value, params[:, 0], loc=params[:, 1], scale=params[:, 2])
    return np.minimum(-np.asarray(logcdf) / math.log(2), cap)


def _loglik_and_derivatives(x: np.ndarray, weights: np.ndarray, theta: np.ndarray, order: int = 2):
    """The weighted mean log-likelihood of each row of ``weights`` (B, N) at its theta (B, 3) = (a, loc,
    log scale), with its gradient (B, 3) and Hessian (B, 3, 3) when ``order`` asks (constant terms dropped)."""
    a, loc, s = theta[:, :1], theta[:, 1:2], theta[:, 2:3]
    inv = np.exp(-s)
    z = (x[None, :] - loc) * inv
    u = a * z
    log_cdf = special.log_ndtr(u)
    total = weights.sum(axis=1)
    ll = ((-s - z * z / 2 + log_cdf) * weights).sum(axis=1) / total
    if order == 0:
        return ll, None, None
    r = np.exp(-u * u / 2 - _LOG_SQRT_2PI - log_cdf)  # phi(u) / Phi(u)
    g_z = -z + a * r  # d l / d z
    grad = np.stack([(r * z * weights).sum(1), (-g_z * inv * weights).sum(1),
                     ((-1 - g_z * z) * weights).sum(1)], axis=1) / total[:, None]
    dr = -r * (u + r)  # d r / d u
    h_az = r + a * z * dr
    dg = -1 + a * a * dr  # d g_z / d z
    h = np.empty((len(theta), 3, 3))
    h[:, 0, 0] = (dr * z * z * weights).sum(1)
    h[:, 0, 1] = h[:, 1, 0] = (-h_az * inv * weights).sum(1)
    h[:, 0, 2] = h[:, 2, 0] = (-h_az * z * weights).sum(1)
    h[:, 1, 1] = (dg * inv * inv * weights).sum(1)
    h[:, 1, 2] = h[:, 2, 1] = ((dg * z + g_z) * inv * weights).sum(1)
    h[:, 2, 2] = ((dg * z * z + g_z * z) * weights).sum(1)
    return ll, grad, h / total[:, None, None]


def _newton(x: np.ndarray, weights: np.ndarray, theta: np.ndarray, iterations: int = 20, tol: float = 1e-6):
    """Maximise each row's weighted log-likelihood from ``theta`` (B, 3): Newton steps on the Hessian shifted to
    be negative definite (near a = 0 the skew-normal's information is singular, Azzalini 1985, and the plain
    Newton step is unbounded there), halved until the likelihood does not fall; stops when every row's gradient
    is below ``tol`` or after ``iterations``."""
    theta = theta.copy()
    ll, grad, hess = _loglik_and_derivatives(x, weights, theta)
    eye = np.eye(3)
    for _ in range(iterations):
        active = np.abs(grad).max(axis=1) > tol
        if not active.any():
            break
        top = np.linalg.eigvalsh(hess)[:, -1]
        shift = np.maximum(top + 1e-3 * np.abs(np.trace(hess, axis1=1, axis2=2)) / 3, 0.0)
        step = -np.linalg.solve(hess - shift[:, None, None] * eye, grad[..., None])[..., 0]
        step[~active] = 0.0
        rows, t = np.flatnonzero(active), 1.0
        for _ in range(20):  # the rows whose step has not been taken yet
            trial = theta[rows] + t * step[rows]
            trial[:, 0] = np.clip(trial[:, 0], -_MAX_SHAPE, _MAX_SHAPE)
            got = _loglik_and_derivatives(x, weights[rows], trial)
            ok = got[0] >= ll[rows] - 1e-12
            taken = rows[ok]
            theta[taken] = trial[ok]
            for mine, theirs in zip((ll, grad, hess), got):
                mine[taken] = theirs[ok]
            rows, t = rows[~ok], t / 2
            if not len(rows):
                break
        grad[rows] = 0.0  # no step raised these rows' likelihood: they are at their maximum to rounding
    return theta


def fit_skewnorm(x: np.ndarray) -> np.ndarray:
    """The skew-normal's maximum-likelihood (a, loc, scale) for the sample ``x``: scipy's fit, polished by
    Newton's method on the exact likelihood (kept only where it is at least as likely)."""
    x = np.asarray(x, float)
    a, loc, scale = stats.skewnorm.fit(x)
    start = np.array([[a, loc, math.log(scale)]])
    ones = np.ones((1, len(x)))
    theta = _newton(x, ones, start)
    if _loglik_and_derivatives(x, ones, theta, 0)[0][0] < _loglik_and_derivatives(x, ones, start, 0)[0][0]:
        theta = start
    return np.array([theta[0, 0], theta[0, 1], math.exp(theta[0, 2])])


@dataclass(frozen=True)
class Extrapolated:
    """Per canary: the estimate (bits), its interval, the fitted (a, loc, scale); and the bootstrap's replicates
    (resamples x canaries) from which the mean's and the max's intervals come."""

    estimate: np.ndarray
    low: np.ndarray
    high: np.ndarray
    params: np.ndarray
    replicates: np.ndarray


def extrapolated_exposure(canaries: np.ndarray, candidates: np.ndarray, *, rng: np.random.Generator,
                          resamples: int = 200, confidence: float = 0.95, cap: float = math.inf) -> Extrapolated:
    """Sec. 4.3's exposure of each canary from its candidates' scores. ``canaries`` (C,): each canary's negative
    log-probability; ``candidates`` (C, K): the same K candidate strings' negative log-probabilities after each
    canary's context. The bootstrap resamples candidate indices, the same ones for every canary."""
    canaries = np.asarray(canaries, float)
    candidates = np.asarray(candidates, float)
    n_canary, k = candidates.shape
    weights = rng.multinomial(k, np.full(k, 1.0 / k), size=resamples).astype(float) if resamples else None
    estimate, params = np.empty(n_canary), np.empty((n_canary, 3))
    replicates = np.empty((resamples, n_canary))
    for c in range(n_canary):
        params[c] = fit_skewnorm(candidates[c])
        estimate[c] = skewnorm_exposure(canaries[c], params[c], cap)[0]
        if resamples:
            start = np.tile([params[c, 0], params[c, 1], math.log(params[c, 2])], (resamples, 1))
            theta = _newton(candidates[c], weights, start)
            theta[:, 2] = np.exp(theta[:, 2])
            replicates[:, c] = skewnorm_exposure(canaries[c], theta, cap)
    tail = (1 - confidence) / 2 * 100
    if resamples:
        low, high = np.percentile(replicates, [tail, 100 - tail], axis=0)
    else:
        low = high = np.full(n_canary, np.nan)
    return Extrapolated(estimate, low, high, params, replicates)


def interval(replicates: np.ndarray, confidence: float = 0.95) -> tuple[float, float]:
    """The percentile interval of a statistic's bootstrap replicates."""
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(replicates, [tail, 100 - tail])
    return float(low), float(high)
