"""Privacy-audit estimators (raydp.evaluation.audit), checked against independent computations.

Nothing here compares the module with itself: p-values against scipy's binomial tail and a direct
transcription of Steinke et al. 2023 Thm 5.2, bounds against brentq roots and closed forms, full
results against constants computed with jax_privacy 2.0.0's auditing.py, and validity by simulation.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy.optimize import brentq
from scipy.special import expit, logit
from scipy.stats import binom

from raydp.errors import ConfigError
from raydp.evaluation.audit import (
    AuditResult,
    audit_scores,
    epsilon_clopper_pearson,
    epsilon_one_run,
    one_run_p_value,
)

ALPHA = 0.05  # 1 - confidence (default confidence 0.95)


def grid_size(m: int) -> int:
    """Number of (k_plus, k_minus) entries in the documented grid: k = max(1, m*p//100) for
    p in (1, 2, 5, 10, 20, 40), once one-sided (k, 0) and once symmetric (k, k), deduplicated."""
    ks = {max(1, m * p // 100) for p in (1, 2, 5, 10, 20, 40)}
    return len(ks) + sum(1 for k in ks if 2 * k <= m)


def make_scores(seed: int, m: int, shift: float) -> tuple[np.ndarray, np.ndarray]:
    """Fair-coin inclusion, N(0,1) scores shifted by ``shift`` for included canaries."""
    rng = np.random.default_rng(seed)
    included = rng.random(m) < 0.5
    return rng.normal(size=m) + shift * included, included


def theorem_5_2_p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """Steinke-Nasr-Jagielski 2023 Thm 5.2 written out with the max over all i in 1..m."""
    q = np.exp(eps) / (1 + np.exp(eps))

    def f(x):  # P[Binomial(r, q) >= x]
        return binom.sf(np.asarray(x) - 1, r, q)

    i = np.arange(1, m + 1)
    return min(1.0, float(f(v) + 2 * m * delta * np.max((f(v - i) - f(v)) / i)))


# ------------------------------------------------------------------------------ p-value, root


@pytest.mark.parametrize("m,r,v,eps", [(1000, 100, 89, 1.3), (200, 160, 98, 0.0), (500, 37, 30, 2.2),
                                       (50, 10, 10, 0.7), (10, 4, 0, 1.0)])
def test_pure_dp_p_value_is_the_binomial_tail(m, r, v, eps):
    assert one_run_p_value(m, r, v, eps, 0.0) == pytest.approx(binom.sf(v - 1, r, np.exp(eps) / (1 + np.exp(eps))),
                                                               rel=1e-12, abs=1e-300)


@pytest.mark.parametrize("m,r,v,eps,delta", [(1000, 100, 89, 1.25, 1e-5), (1000, 800, 800, 4.8, 1e-5),
                                             (200, 160, 98, 0.02, 1e-5), (300, 60, 40, 0.5, 1e-3)])
def test_approximate_dp_p_value_is_theorem_5_2(m, r, v, eps, delta):
    assert one_run_p_value(m, r, v, eps, delta) == pytest.approx(theorem_5_2_p_value(m, r, v, eps, delta), rel=1e-9)


def test_one_run_bound_is_the_root_of_the_bonferroni_corrected_tail():
    scores, included = make_scores(12345, 1000, 1.0)
    significance = ALPHA / grid_size(1000)  # 0.05 / 12
    eps, r, v = epsilon_one_run(scores, included, delta=0.0)
    root = brentq(lambda e: binom.sf(v - 1, r, expit(e)) - significance, 0.0, 20.0, xtol=1e-12)
    assert eps == pytest.approx(root, abs=1e-8)
    # delta > 0: root of the transcribed Theorem 5.2 tail.
    eps_d, r_d, v_d = epsilon_one_run(scores, included, delta=1e-5)
    root_d = brentq(lambda e: theorem_5_2_p_value(1000, r_d, v_d, e, 1e-5) - significance, 0.0, 20.0, xtol=1e-12)
    assert eps_d == pytest.approx(root_d, abs=1e-8)
    assert eps_d < eps


# --------------------------------------------------------------------------- jax_privacy reference

# Computed with jax_privacy 2.0.0 (jax_privacy/auditing.py, loaded with importlib.util.
# spec_from_file_location; needs numpy, scipy, dp_accounting 0.6.0), on make_scores(seed, m, shift):
#   one-run: for every (k_plus, k_minus) of our grid, r = k_plus + k_minus and v = correct guesses of
#     the k_plus highest / k_minus lowest scores (no ties in these inputs), then
#     auditing._epsilon_one_run(0.0, m, r, v, 0.05 / G, delta); the max over the grid, and its (r, v).
#     For one-sided entries with delta > 0 this was cross-checked to equal the public
#     CanaryScoreAuditor(s[inc], s[~inc]).epsilon_one_run(0.05 / G, delta,
#     threshold_strategy=Explicit(k_plus-th highest score)) exactly. (jax's public method cannot do
#     k_minus > 0, rejects delta = 0, and its default Bonferroni divides by the number of ROC-frontier
#     thresholds, which depends on the data; so we match the configuration, not the default: its
#     default gives 1.2949 for the first case at delta 1e-5.)
#   Clopper-Pearson: max over t in unique(scores) + [inf] of
#     CanaryScoreAuditor(s[inc], s[~inc]).epsilon_clopper_pearson(0.05 / (m + 1), delta,
#     one_sided=False, threshold_strategy=Explicit(t)), i.e. every cut position, each one-sided
#     interval at 0.05 / (2 (m + 1)) as in our Bonferroni. (Its default, Bonferroni over frontier
#     thresholds only, gives 1.0058 for the first case: less conservative, data-dependent count.)
# Tolerance: the one-run bounds solve the same equation, jax's brentq with xtol=1e-6 (ours 1e-10), so
# abs 1e-5 (observed <= 3e-8); Clopper-Pearson is the same closed form (beta.ppf), rel 1e-9 (observed
# 3e-16).
JAX_REFERENCE = [
    # seed, m, shift, delta, eps_one_run, (r, v), eps_clopper_pearson
    (12345, 1000, 1.0, 0.0, 1.2815066321925324, (100, 89), 0.7363696710877143),
    (12345, 1000, 1.0, 1e-5, 1.2542397371209473, (100, 89), 0.736312286255915),
    (7, 500, 2.0, 0.0, 2.876420363188191, (100, 100), 1.6241895925603087),
    (7, 500, 2.0, 1e-5, 2.8183881706452665, (100, 100), 1.6241680269616923),
    (99, 200, 0.5, 0.0, 0.021956390044180193, (160, 98), 0.0),
    (99, 200, 0.5, 1e-5, 0.020049129834575248, (160, 98), 0.0),
    (2024, 1000, 0.0, 0.0, 0.0, None, 0.0),
    (2024, 1000, 0.0, 1e-5, 0.0, None, 0.0),
]


@pytest.mark.parametrize("seed,m,shift,delta,eps_one,rv,eps_cp", JAX_REFERENCE)
def test_matches_jax_privacy_reference(seed, m, shift, delta, eps_one, rv, eps_cp):
    scores, included = make_scores(seed, m, shift)
    result = audit_scores(scores, included, delta=delta)
    assert result.epsilon_one_run == pytest.approx(eps_one, abs=1e-5)
    if rv is not None:
        assert (result.one_run_guesses, result.one_run_correct) == rv
    assert result.epsilon_clopper_pearson == pytest.approx(eps_cp, rel=1e-9, abs=1e-12)
    assert (result.m, result.n_included, result.delta, result.confidence) == (m, int(included.sum()), delta, 0.95)


# ------------------------------------------------------------------------------------ validity


def test_bounds_are_valid_for_an_exactly_eps_dp_mechanism():
    """Randomized response with eps = 1 (each canary's score is its bit flipped w.p. 1/(1+e), plus
    1e-6 noise to order equal bits): the bound exceeds the true eps in at most ~5% of runs. Allowed:
    21 of 200 = binom.ppf(0.999, 200, 0.05), so a valid 5%-level bound fails this with prob < 0.002.
    (Observed: one-run 3/200, Clopper-Pearson 0/200; mean one-run bound ~0.80.)"""
    eps_true, m, reps = 1.0, 1000, 200
    one_run, cp = [], []
    for seed in range(reps):
        rng = np.random.default_rng(seed)
        included = rng.random(m) < 0.5
        flipped = rng.random(m) < 1 / (1 + np.exp(eps_true))
        scores = (included ^ flipped).astype(float) + 1e-6 * rng.standard_normal(m)
        one_run.append(epsilon_one_run(scores, included, delta=0.0)[0])
        cp.append(epsilon_clopper_pearson(scores, included, delta=0.0))
    allowed = binom.ppf(0.999, reps, ALPHA)
    assert allowed == 21
    assert np.sum(np.array(one_run) > eps_true) <= allowed
    assert np.sum(np.array(cp) > eps_true) <= allowed
    # ...and the bounds are not vacuous: they sit below, but near, the true eps.
    assert 0.6 < np.mean(one_run) < eps_true
    assert 0.4 < np.mean(cp) < eps_true


# --------------------------------------------------------------------------------------- power


def test_perfect_separation_m1000_gives_the_all_correct_bound():
    """Best grid entry: symmetric k = 400 per side, r = 800, all correct, tested at 0.05/12, so
    eps = logit((0.05/12)^(1/800)) = 4.97996 (well above 2)."""
    rng = np.random.default_rng(1)
    included = rng.random(1000) < 0.5
    scores = 10.0 * included + rng.random(1000)
    eps, r, v = epsilon_one_run(scores, included, delta=0.0)
    assert (r, v) == (800, 800)
    expected = logit((ALPHA / grid_size(1000)) ** (1 / 800))
    assert expected == pytest.approx(4.97996, abs=1e-5)
    assert eps == pytest.approx(expected, abs=1e-8)
    # Clopper-Pearson at the separating cut, each interval at a = 0.05/(2*1001): TPR_lower = a^(1/n_in),
    # FPR_upper = 1 - a^(1/n_out) (and the mirror); 3.8568 here.
    a = ALPHA / (2 * 1001)
    n_in, n_out = int(included.sum()), int((~included).sum())
    cp_expected = max(np.log(a ** (1 / n_in) / (1 - a ** (1 / n_out))),
                      np.log(a ** (1 / n_out) / (1 - a ** (1 / n_in))))
    assert epsilon_clopper_pearson(scores, included, delta=0.0) == pytest.approx(cp_expected, rel=1e-9)
    assert cp_expected > 3.8


def test_perfect_separation_m200_is_the_value_of_r_correct_guesses():
    """m = 200: grid k in {2, 4, 10, 20, 40, 80}, G = 12, best entry r = 160 all correct (97 included):
    eps = logit((0.05/12)^(1/160)) = 3.35678."""
    rng = np.random.default_rng(2)
    included = rng.random(200) < 0.5
    scores = 10.0 * included + rng.random(200)
    eps, r, v = epsilon_one_run(scores, included, delta=0.0)
    assert grid_size(200) == 12
    assert (r, v) == (160, 160)
    expected = logit((ALPHA / 12) ** (1 / 160))
    assert expected == pytest.approx(3.35678, abs=1e-5)
    assert eps == pytest.approx(expected, abs=1e-8)


def test_broken_mechanism_is_caught_and_random_scores_claim_nothing():
    rng = np.random.default_rng(3)
    included = rng.random(1000) < 0.5
    # "Noise turned off": the score is the inclusion bit plus small noise. Claimed eps 1.
    broken = audit_scores(included + 0.1 * rng.standard_normal(1000), included, delta=1e-5)
    assert broken.epsilon_one_run > 4.0
    assert broken.epsilon_clopper_pearson > 3.0
    # Scores independent of inclusion: nothing (or next to nothing) can be claimed.
    for seed in range(5):
        noise = np.random.default_rng(100 + seed).standard_normal(1000)
        random = audit_scores(noise, included, delta=1e-5)
        assert random.epsilon_one_run < 0.3
        assert random.epsilon_clopper_pearson < 0.3


# ---------------------------------------------------------------------------------------- ties


def test_ties_cannot_leak_the_labels():
    # All scores equal, included canaries listed last: a "stable order by index" tie-break would put
    # exactly the included canaries on top and claim a huge epsilon. Tie groups are abstained on.
    m = 400
    included = np.arange(m) >= m // 2
    result = audit_scores(np.zeros(m), included, delta=0.0)
    assert result.epsilon_one_run == 0.0 and result.one_run_correct == 0
    assert result.epsilon_clopper_pearson == 0.0
    # Coarse (heavily tied) scores: permuting the canaries (scores and labels together) changes nothing.
    rng = np.random.default_rng(4)
    included = rng.random(m) < 0.5
    scores = np.round(included + rng.standard_normal(m), 0)
    base = audit_scores(scores, included, delta=1e-5)
    assert base.epsilon_one_run > 0
    for seed in range(3):
        perm = np.random.default_rng(10 + seed).permutation(m)
        assert audit_scores(scores[perm], included[perm], delta=1e-5) == base


# ----------------------------------------------------------------------------------- plumbing


def test_result_is_json_ready():
    scores, included = make_scores(7, 500, 2.0)
    result = audit_scores(scores, included, delta=1e-5, confidence=0.9)
    assert isinstance(result, AuditResult)
    d = result.as_dict()
    assert set(d) == {"m", "n_included", "delta", "confidence", "epsilon_one_run", "one_run_guesses",
                      "one_run_correct", "epsilon_clopper_pearson"}
    assert all(type(x) in (int, float) for x in d.values())
    assert json.loads(json.dumps(d)) == d
    # Lower confidence, larger (less conservative) bounds.
    assert result.epsilon_one_run > audit_scores(scores, included, delta=1e-5).epsilon_one_run


GOOD_S, GOOD_I = np.array([0.1, 0.5, 0.9, 0.3]), np.array([False, True, True, False])


@pytest.mark.parametrize("scores,included,kwargs", [
    (GOOD_S[:3], GOOD_I, {}),                                  # lengths differ
    (np.array([0.1, np.nan, 0.9, 0.3]), GOOD_I, {}),           # NaN score
    (np.array([0.1, np.inf, 0.9, 0.3]), GOOD_I, {}),           # inf score
    (GOOD_S, np.ones(4, bool), {}),                            # no excluded canary
    (GOOD_S, np.zeros(4, bool), {}),                           # no included canary
    (np.array([]), np.array([], bool), {}),                    # empty
    (GOOD_S.reshape(2, 2), GOOD_I.reshape(2, 2), {}),          # not 1-D
    (GOOD_S, np.array([0, 2, 1, 0]), {}),                      # not bits
    (GOOD_S, GOOD_I, {"delta": -1e-5}),
    (GOOD_S, GOOD_I, {"delta": 1.0}),
    (GOOD_S, GOOD_I, {"delta": float("nan")}),
    (GOOD_S, GOOD_I, {"confidence": 0.0}),
    (GOOD_S, GOOD_I, {"confidence": 1.0}),
    (GOOD_S, GOOD_I, {"confidence": 1.5}),
])
@pytest.mark.parametrize("fn", [epsilon_one_run, epsilon_clopper_pearson, audit_scores])
def test_bad_input_raises_config_error(fn, scores, included, kwargs):
    kwargs = {"delta": 1e-5, **kwargs}
    with pytest.raises(ConfigError) as info:
        fn(scores, included, **kwargs)
    assert "\n" not in str(info.value)


def test_small_valid_input_works():
    eps, r, v = epsilon_one_run(GOOD_S, GOOD_I, delta=0.0)
    assert eps == 0.0 and 0 <= v <= r <= 4
    assert epsilon_clopper_pearson([0.1, 0.5, 0.9, 0.3], [0, 1, 1, 0], delta=0.0) == 0.0
