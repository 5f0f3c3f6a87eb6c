"""The extrapolated exposure (raydp.evaluation.exposure_fit) against independent computations: the true CDF of a known
skew-normal, the rank among many candidates, and today's rank formula through ``attacks.exposure``. No training."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from raydp.evaluation import exposure_fit

SHAPE, LOC, SCALE = 3.0, 40.0, 5.0  # about what 10-character secrets' NLLs (nats) look like after a record


def _true_bits(x: float, a=SHAPE, loc=LOC, scale=SCALE) -> float:
    return -stats.skewnorm.logcdf(x, a, loc=loc, scale=scale) / math.log(2)


def test_the_likelihood_derivatives_are_the_finite_differences():
    rng = np.random.default_rng(0)
    x = stats.skewnorm.rvs(SHAPE, loc=LOC, scale=SCALE, size=300, random_state=rng)
    weights = rng.multinomial(300, np.full(300, 1 / 300), size=4).astype(float)
    theta = np.array([[2.0, 39.0, 1.5], [0.5, 41.0, 1.7], [-1.0, 40.0, 1.4], [6.0, 38.0, 1.6]])
    _, grad, hess = exposure_fit._loglik_and_derivatives(x, weights, theta)
    eps = 1e-6
    for j in range(3):
        d = np.zeros(3)
        d[j] = eps
        up, g_up, _ = exposure_fit._loglik_and_derivatives(x, weights, theta + d)
        down, g_down, _ = exposure_fit._loglik_and_derivatives(x, weights, theta - d)
        np.testing.assert_allclose((up - down) / (2 * eps), grad[:, j], atol=1e-6)
        np.testing.assert_allclose((g_up - g_down) / (2 * eps), hess[:, :, j], atol=1e-6)


def test_the_fit_is_at_least_as_likely_as_scipys():
    x = stats.skewnorm.rvs(SHAPE, loc=LOC, scale=SCALE, size=1000, random_state=np.random.default_rng(1))
    ours = exposure_fit.fit_skewnorm(x)
    theirs = stats.skewnorm.fit(x)
    assert stats.skewnorm.logpdf(x, *ours).sum() >= stats.skewnorm.logpdf(x, *theirs).sum() - 1e-9
    np.testing.assert_allclose(ours, theirs, rtol=1e-3)


def test_a_known_skew_normal_exposure_is_recovered_and_its_interval_covers_it():
    """50 draws of 1,000 candidates from a known skew-normal; the point where the true CDF is 2^-8 (8 bits, where
    1,000 candidates would rank it among the top 4). The fit's error there has sd about 0.5 bits and a bias of
    about +0.2 (measured over 3 x 50 draws): each estimate is within 2 bits of the truth, their mean within 0.35,
    and the 95% interval covers 8 bits in at least 42 of 50 (measured 41-46 with 100 resamples over three seeds,
    92-94 of 100 with 200; this seed's draws give 45). An interval that ignored the fit's error, or a biased fit,
    fails this."""
    point = stats.skewnorm.ppf(2.0 ** -8, SHAPE, loc=LOC, scale=SCALE)
    assert _true_bits(point) == pytest.approx(8.0)
    rng = np.random.default_rng(2)
    estimates, covered = [], 0
    for _ in range(50):
        candidates = stats.skewnorm.rvs(SHAPE, loc=LOC, scale=SCALE, size=1000, random_state=rng)
        fit = exposure_fit.extrapolated_exposure(np.array([point]), candidates[None, :], rng=rng, resamples=100)
        estimates.append(fit.estimate[0])
        covered += fit.low[0] <= 8.0 <= fit.high[0]
        assert fit.low[0] <= fit.estimate[0] <= fit.high[0]
    errors = np.abs(np.asarray(estimates) - 8.0)
    assert errors.max() < 2.0 and abs(np.mean(estimates) - 8.0) < 0.35, estimates
    assert covered >= 42, covered


def test_the_extrapolation_agrees_with_the_rank_among_many_candidates():
    """Candidates whose NLL is a sum of per-character NLLs (10 characters, each a gamma: skewed, and not a
    skew-normal), 200,000 of them: the rank there resolves 1-6 bits to about 0.05 bits. The extrapolation from the
    first 1,000 lands within 0.3 bits of it at every level (measured: 0.01-0.10)."""
    rng = np.random.default_rng(3)
    pool = rng.gamma(2.0, 2.0, size=(200_000, 10)).sum(axis=1)
    logp = -pool
    points = [np.quantile(pool, 2.0 ** -bits) for bits in (1, 2, 3, 4, 5, 6)]
    fit = exposure_fit.extrapolated_exposure(np.array(points), np.tile(pool[:1000], (len(points), 1)), rng=rng,
                                             resamples=0)
    for point, estimate in zip(points, fit.estimate):
        reference = exposure_fit.rank_exposure(-point, logp)
        assert abs(estimate - reference) < 0.3, (reference, estimate)
    assert np.isnan(fit.low).all()  # no resamples, no interval


def test_a_far_tail_does_not_underflow_and_is_capped_at_the_format():
    params = np.array([SHAPE, LOC, SCALE])
    deep = exposure_fit.skewnorm_exposure(LOC - 8 * SCALE, params)[0]
    assert 300 < deep < math.inf  # the CDF itself is about 2^-470: a log-CDF keeps it
    assert exposure_fit.skewnorm_exposure(LOC - 40 * SCALE, params, cap=51.7)[0] == 51.7


def test_rank_reproduces_the_rank_formula_through_the_attack(monkeypatch):
    """``method="rank"`` computes what exposure always computed: the same candidate draws (seeded), the same
    formula, bit for bit; ``extrapolate`` scores the same candidates and reports an interval around each estimate."""
    from raydp.data.canaries import random_secrets
    from raydp.evaluation import attacks

    def scores(model, tokenizer, context, texts, device, batch_size):  # a deterministic stand-in for the model
        return np.array([-float(sum((ord(ch) * (i + 3)) % 17 for i, ch in enumerate(context[-3:] + t)))
                         for t in texts])

    monkeypatch.setattr(attacks, "candidate_logprobs", scores)
    secrets = ["AAAAAAAAAA", "Z0Z0Z0Z0Z0", "QWERTY1234"]
    contexts = ["rec one secret_id=", "rec two secret_id=", "rec three secret_id="]
    got = attacks.exposure(None, None, contexts, secrets, None, candidates=500, seed=7, method="rank")
    pool = random_secrets(np.random.default_rng(np.random.SeedSequence([7, 0x45585053])), 500, exclude=set(secrets))
    expected = []
    for context, secret in zip(contexts, secrets):
        own = scores(None, None, context, [secret + "."], None, 0)[0]
        others = scores(None, None, context, [c + "." for c in pool], None, 0)
        expected.append(-math.log2((1 + int(np.sum(others >= own))) / 501))
    assert got["per_canary"] == expected
    assert got["mean"] == float(np.mean(expected)) and got["max"] == max(expected)
    assert got["max_measurable_bits"] == math.log2(501) and got["method"] == "rank"

    extra = attacks.exposure(None, None, contexts, secrets, None, candidates=500, seed=7, method="extrapolate",
                             resamples=50)
    assert extra["method"] == "extrapolate" and len(extra["per_canary"]) == len(extra["interval"]) == 3
    for estimate, (low, high) in zip(extra["per_canary"], extra["interval"]):
        assert 0 <= low <= estimate <= high <= extra["space_bits"]
    assert extra["max"] == max(extra["per_canary"])
    assert extra["max_interval"][0] <= extra["max"] <= extra["max_interval"][1]
    again = attacks.exposure(None, None, contexts, secrets, None, candidates=500, seed=7, method="extrapolate",
                             resamples=50)
    assert again == extra  # the candidates and the resamples are seeded (public randomness)

    from raydp.evaluation.exposure import flat, summary

    assert flat(got) == {"exposure_mean": got["mean"], "exposure_max": got["max"], "exposure_method": "rank",
                         "exposure_max_low": None, "exposure_max_high": None}
    assert flat(extra)["exposure_max_low"] == extra["max_interval"][0] and "extrapolated" in summary(extra)
    assert summary(got) == f"exposure mean {got['mean']:.2f} / max {got['max']:.2f} bits"
