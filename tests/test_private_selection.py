"""Accountant of private hyperparameter selection (raydp.privacy.accounting.selection), checked against
computations written here: Papernot & Steinke (ICLR 2022, arXiv:2110.03620v2) Thms. 2 and 6 coded from the
paper, scipy's distributions, and the exact output distribution of repeat-and-select over randomized response.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import RdpAccountant, compute_epsilon
from scipy import stats
from scipy.optimize import brentq
from scipy.special import logsumexp

from raydp.errors import ConfigError
from raydp.privacy.accounting.rdp import DEFAULT_ORDERS, rdp_epsilon, rdp_vector
from raydp.privacy.accounting.selection import (SelectionDistribution, calibrate_sigma, calibrate_trial_parameter,
                                                expected_trials, selection_epsilon, selection_rdp)

ORDERS = np.asarray(DEFAULT_ORDERS)
DELTA = 1e-5
SD = SelectionDistribution


# ---- independent reference computations -------------------------------------------------------------

def tnb_mean(eta: float, gamma: float) -> float:
    """E[K] of the truncated negative binomial (Papernot & Steinke, Def. 1 and the mean stated after it)."""
    if eta == 0:
        return (1 - gamma) / (gamma * math.log(1 / gamma))
    return eta * (1 - gamma) / (gamma * (1 - gamma ** eta))


def tnb_gamma(eta: float, mean: float) -> float:
    return brentq(lambda g: tnb_mean(eta, g) - mean, 1e-12, 1 - 1e-12, xtol=1e-300, rtol=1e-14)


def k_pmf(dist: SelectionDistribution, tail: float = 1e-12) -> np.ndarray:
    """P[K = k] for k = 0 .. k_max (tail mass beyond k_max < ``tail``), from scipy's distributions."""
    if dist.kind == "poisson":
        law, scale = stats.poisson(dist.mean), 1.0
    else:
        eta, gamma = dist.shape, tnb_gamma(dist.shape, dist.mean)
        if eta == 0:
            law, scale = stats.logser(1 - gamma), 1.0
        else:  # NB(eta, gamma) (failures before eta successes) conditioned on K >= 1
            law, scale = stats.nbinom(eta, gamma), 1 / (1 - gamma ** eta)
    k_max = 1
    while law.sf(k_max) * scale >= tail:
        k_max *= 2
    ks = np.arange(k_max + 1)
    pmf = law.pmf(ks) * scale
    if dist.kind != "poisson":
        pmf[0] = 0.0
    return pmf


def rdp_to_log_delta(alpha: float, rdp: float, eps: float) -> float:
    """log delta of an (alpha, rdp)-RDP mechanism at eps: Canonne, Kamath & Steinke 2020 Prop. 12 for
    alpha > 1.01, and delta <= TV <= sqrt(1 - exp(-KL)) <= sqrt(1 - exp(-rdp)) (Bretagnolle-Huber)."""
    log_delta = 0.5 * math.log1p(-math.exp(-rdp)) if rdp > 0 else -math.inf
    if alpha > 1.01:
        log_delta = min(log_delta, (alpha - 1) * (rdp - eps + math.log1p(-1 / alpha)) - math.log(alpha))
    return log_delta


def theorem2(orders: np.ndarray, eps: np.ndarray, eta: float, mean: float) -> tuple[np.ndarray, np.ndarray]:
    """Thm. 2: eps'(l) = eps(l) + (1+eta)(1 - 1/lh) eps(lh) + (1+eta) log(1/gamma)/lh + log E[K]/(l-1),
    minimised over lh in ``orders``. Returns (raw bound, bound made monotone: min over orders >= l)."""
    gamma = tnb_gamma(eta, mean)
    best_hat = min((1 + eta) * (1 - 1 / lh) * e + (1 + eta) * math.log(1 / gamma) / lh for lh, e in zip(orders, eps))
    raw = np.array([e + best_hat + math.log(mean) / (lam - 1) for lam, e in zip(orders, eps)])
    return raw, np.array([raw[orders >= lam].min() for lam in orders])


def theorem6(orders: np.ndarray, eps: np.ndarray, mu: float) -> np.ndarray:
    """Thm. 6: eps'(l) = eps(l) + mu delta_hat + log(mu)/(l-1), delta_hat the trial's delta at
    eps_hat = log(1 + 1/(l-1)) (the largest eps_hat the theorem allows), from the whole RDP curve."""
    out = []
    for lam, e in zip(orders, eps):
        eps_hat = math.log1p(1 / (lam - 1))
        delta_hat = min(1.0, math.exp(min(rdp_to_log_delta(a, r, eps_hat) for a, r in zip(orders, eps))))
        out.append(e + mu * delta_hat + math.log(mu) / (lam - 1))
    return np.array(out)


def dpsgd_curve(q: float, sigma: float, steps: int) -> np.ndarray:
    return steps * rdp_vector(q, sigma, ORDERS)


# ---- Theorems 2 and 6 -------------------------------------------------------------------------------

CURVES = {"gaussian": ORDERS / (2 * 4.0 ** 2), "dpsgd": dpsgd_curve(0.01, 1.2, 500)}


@pytest.mark.parametrize("curve", sorted(CURVES))
@pytest.mark.parametrize("eta,mean", [(0.0, 3.0), (0.5, 10.0), (1.0, 10.0), (2.0, 50.0), (5.0, 1.5), (1.0, 1000.0)])
def test_truncated_negative_binomial_matches_theorem2(curve, eta, mean):
    trial = CURVES[curve]
    raw, monotone = theorem2(ORDERS, trial, eta, mean)
    got = selection_rdp(trial, ORDERS, SD.truncated_negative_binomial(mean, eta))
    np.testing.assert_allclose(got, monotone, rtol=1e-7)
    assert np.all(got <= raw * (1 + 1e-7)) and np.all(got >= trial)  # gamma: 1e-9 relative, conservative


@pytest.mark.parametrize("curve", sorted(CURVES))
@pytest.mark.parametrize("mu", [1.0, 10.0, 100.0])
def test_poisson_matches_theorem6(curve, mu):
    trial = CURVES[curve]
    np.testing.assert_allclose(selection_rdp(trial, ORDERS, SD.poisson(mu)), theorem6(ORDERS, trial, mu), rtol=1e-9)


@pytest.mark.parametrize("dist", [SD.geometric(10), SD.logarithmic(10), SD.poisson(10),
                                  SD.truncated_negative_binomial(20, 3.0)])
def test_private_helper_agrees_with_public_repeat_and_select_event(dist):
    """The private helper fed dp_accounting's own per-trial curve gives what the public event gives."""
    q, sigma, steps = 0.02, 1.1, 300
    trial_event = dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)),
                                               steps)
    orders = list(DEFAULT_ORDERS)
    public = RdpAccountant(orders).compose(dp_event.RepeatAndSelectDpEvent(trial_event, dist.mean,
                                                                            dist.dp_accounting_shape))
    trial_eps = RdpAccountant(orders).compose(trial_event).get_epsilon(DELTA)
    ours = compute_epsilon(orders, selection_rdp(dpsgd_curve(q, sigma, steps), ORDERS, dist), DELTA)[0]
    assert ours == pytest.approx(public.get_epsilon(DELTA), rel=1e-4)
    assert ours > trial_eps


# ---- brute force: repeat-and-select over randomized response ---------------------------------------

RR_P = (0.6, 0.75)  # hyperparameter h: the randomized-response parameter, uniform over these
TIES = 3  # public tie-break, uniform over {0, 1, 2}


def rr_rdp(p: float, orders: np.ndarray) -> np.ndarray:
    """Exact RDP of randomized response on one bit: D_a(Bern(p) || Bern(1-p)) (symmetric in the inputs)."""
    return np.logaddexp(orders * math.log(p) + (1 - orders) * math.log(1 - p),
                        orders * math.log(1 - p) + (1 - orders) * math.log(p)) / (orders - 1)


def run_pmf(bit: int) -> np.ndarray:
    """One run's output (score y = RR_h(bit), then h, then tie-break), ordered by index
    y * (H * TIES) + h * TIES + j: the best run is the one with the largest index."""
    out = np.zeros((2, len(RR_P), TIES))
    for h, p in enumerate(RR_P):
        out[bit, h, :] = p / (len(RR_P) * TIES)
        out[1 - bit, h, :] = (1 - p) / (len(RR_P) * TIES)
    return out.ravel()


def selection_pmf(bit: int, pk: np.ndarray) -> np.ndarray:
    """Exact law of the released output, [nothing released (K = 0), best index 0, 1, ...]:
    P[best = t] = sum_k P[K=k] (F(t)^k - F(t-)^k)."""
    f = np.cumsum(run_pmf(bit))
    f_prev = f - run_pmf(bit)
    ks = np.arange(len(pk))[:, None]
    return np.concatenate([[pk[0]], (pk[:, None] * (f[None, :] ** ks - f_prev[None, :] ** ks)).sum(axis=0)])


def renyi(p: np.ndarray, q: np.ndarray, alpha: float) -> float:
    mask = (p > 0) | (q > 0)
    return float(logsumexp(alpha * np.log(p[mask]) + (1 - alpha) * np.log(q[mask]))) / (alpha - 1)


BRUTE = [SD.geometric(5), SD.logarithmic(5), SD.truncated_negative_binomial(5, 2.0), SD.poisson(5),
         SD.geometric(30), SD.poisson(30)]


@pytest.mark.parametrize("dist", BRUTE, ids=lambda d: f"{d.kind}-{d.shape}-{d.mean:g}")
def test_exact_renyi_divergence_of_repeat_and_select_is_bounded(dist):
    trial = np.max([rr_rdp(p, ORDERS) for p in RR_P], axis=0)  # worst hyperparameter
    bound = selection_rdp(trial, ORDERS, dist)
    pk = k_pmf(dist)
    law0, law1 = selection_pmf(0, pk), selection_pmf(1, pk)
    assert law0.sum() == pytest.approx(1, abs=1e-11) and law1.sum() == pytest.approx(1, abs=1e-11)
    for alpha in (1.5, 2.0, 3.0, 5.0, 10.0, 16.0, 32.0, 64.0):
        i = int(np.flatnonzero(np.isclose(ORDERS, alpha))[0])
        exact = max(renyi(law0, law1, alpha), renyi(law1, law0, alpha))
        assert exact <= bound[i] + 1e-9, (alpha, exact, bound[i])
        assert exact >= trial[i] / 4  # the procedure does leak: the enumeration is not degenerate
    if dist.kind != "poisson":  # pure DP, Corollary 3: (2 + eta) eps0
        eps0 = max(math.log(p / (1 - p)) for p in RR_P)
        assert np.max(np.abs(np.log(law0[1:] / law1[1:]))) <= (2 + dist.shape) * eps0


@pytest.mark.parametrize("dist", [SD.geometric(5), SD.poisson(5)], ids=lambda d: d.kind)
def test_monte_carlo_privacy_loss_within_bound(dist):
    rng = np.random.default_rng(20220425)
    n, n_out = 200_000, 2 * len(RR_P) * TIES
    eps = selection_epsilon(np.max([rr_rdp(p, ORDERS) for p in RR_P], axis=0), ORDERS, dist, DELTA)
    pk = k_pmf(dist)
    freq = []
    for bit in (0, 1):
        k = dist.sample(rng, n)
        runs = rng.choice(n_out, size=int(k.sum()), p=run_pmf(bit))
        best = np.full(n, -1)
        np.maximum.at(best, np.repeat(np.arange(n), k), runs)
        counts = np.bincount(best + 1, minlength=n_out + 1)
        exact = selection_pmf(bit, pk)
        assert np.all(np.abs(counts / n - exact) <= 5 * np.sqrt(exact * (1 - exact) / n) + 1e-4)
        freq.append(counts / n)
    f0, f1 = freq
    seen = (f0 * n >= 100) & (f1 * n >= 100)
    assert seen.sum() >= 6
    assert np.max(np.abs(np.log(f0[seen] / f1[seen]))) <= eps
    for a, b in ((f0, f1), (f1, f0)):
        assert np.maximum(a - math.exp(eps) * b, 0).sum() <= DELTA + 1e-3


# ---- the distribution -------------------------------------------------------------------------------

def test_named_constructors_map_to_dp_accounting_shapes():
    assert SD.geometric(10).dp_accounting_shape == 1 and SD.geometric(10).kind == "truncated-negative-binomial"
    assert SD.logarithmic(10).dp_accounting_shape == 0
    assert SD.poisson(10).dp_accounting_shape == math.inf
    assert SD.truncated_negative_binomial(10, 2.5).dp_accounting_shape == 2.5
    assert SD.geometric(10).gamma == pytest.approx(0.1, rel=1e-12)
    for eta in (0.0, 0.5, 1.0, 4.0):
        assert SD.truncated_negative_binomial(7, eta).gamma == pytest.approx(tnb_gamma(eta, 7), rel=1e-8)
    assert expected_trials(SD.logarithmic(12.5)) == 12.5


@pytest.mark.parametrize("dist", [SD.geometric(4), SD.logarithmic(4), SD.truncated_negative_binomial(4, 0.5),
                                  SD.truncated_negative_binomial(4, 3.0), SD.poisson(1.5)],
                         ids=lambda d: f"{d.kind}-{d.shape}")
def test_pmf_and_sampler_match_scipy(dist):
    ref = k_pmf(dist)
    ours = np.array([dist.pmf(k) for k in range(len(ref))])
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-15)
    assert sum(dist.pmf(k) for k in range(2000)) == pytest.approx(1, abs=1e-9)
    rng = np.random.default_rng(7)
    n = 100_000
    draws = dist.sample(rng, n)
    assert draws.min() >= (0 if dist.kind == "poisson" else 1)
    counts = np.bincount(draws, minlength=len(ref))[:len(ref)]
    assert np.all(np.abs(counts / n - ref) <= 5 * np.sqrt(ref * (1 - ref) / n) + 1e-4)
    assert draws.mean() == pytest.approx(dist.mean, rel=0.03)
    assert isinstance(dist.sample(rng), int)
    if dist.kind == "poisson":
        assert (draws == 0).mean() == pytest.approx(math.exp(-1.5), abs=0.01)  # K = 0: nothing released


@pytest.mark.parametrize("make", [
    lambda: SD("binomial", 5.0), lambda: SD.poisson(0.5), lambda: SD.poisson(math.inf), lambda: SD("poisson", 5, 1.0),
    lambda: SD.geometric(1.0), lambda: SD.geometric(0.5), lambda: SD.logarithmic(math.nan),
    lambda: SD.truncated_negative_binomial(5, -1.0), lambda: SD.truncated_negative_binomial(5, -3.0),
    lambda: SD.truncated_negative_binomial(5, math.inf), lambda: SD.truncated_negative_binomial(5, math.nan),
    lambda: SD.truncated_negative_binomial(5, -0.5), lambda: SD("truncated-negative-binomial", 5.0)])
def test_bad_distribution_raises_config_error(make):
    with pytest.raises(ConfigError) as err:
        make()
    assert "\n" not in str(err.value)


# ---- calibration ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dist", [SD.geometric(10), SD.poisson(10)], ids=lambda d: d.kind)
def test_calibrate_sigma_is_the_least_feasible_sigma(dist):
    q, steps, target = 0.01, 1000, 1.0

    def independent_eps(sigma: float) -> float:
        trial = dpsgd_curve(q, sigma, steps)
        curve = theorem6(ORDERS, trial, dist.mean) if dist.kind == "poisson" else \
            theorem2(ORDERS, trial, dist.shape, dist.mean)[1]
        return rdp_epsilon(curve, ORDERS, DELTA)

    sigma = calibrate_sigma(target, DELTA, dist, q, steps)
    assert independent_eps(sigma) <= target
    assert independent_eps(sigma * (1 - 1e-3)) > target
    assert rdp_epsilon(dpsgd_curve(q, sigma, steps), ORDERS, DELTA) < target / 2  # one trial costs much less


def test_calibrate_trial_parameter_gaussian_family():
    dist = SD.logarithmic(20)

    def excess(s: float) -> float:
        return rdp_epsilon(theorem2(ORDERS, ORDERS / (2 * s * s), 0.0, 20)[1], ORDERS, DELTA) - 2.0

    s_ref = brentq(excess, 0.5, 100, xtol=1e-12)
    s = calibrate_trial_parameter(2.0, DELTA, dist, lambda s: ORDERS / (2 * s * s), 0.5, 100, rtol=1e-5)
    assert s_ref * (1 - 1e-9) <= s <= s_ref * (1 + 2e-5)
    assert calibrate_trial_parameter(1e3, DELTA, dist, lambda s: ORDERS / (2 * s * s), 0.5, 100) == 0.5


@pytest.mark.parametrize("dist", [SD.geometric(10), SD.poisson(10)], ids=lambda d: d.kind)
def test_unreachable_target_raises_config_error(dist):
    # log(E[K]) / (l - 1) and (1+eta) log(1/gamma) / lh do not vanish with the noise: a floor above 0.005
    with pytest.raises(ConfigError, match="unreachable"):
        calibrate_sigma(0.005, DELTA, dist, 0.01, 1000)
    with pytest.raises(ConfigError):
        calibrate_trial_parameter(1.0, DELTA, dist, lambda s: ORDERS / s, 2.0, 1.0)


# ---- ordering against one trial and against composing E[K] trials ----------------------------------

@pytest.mark.parametrize("dist", [SD.geometric(10), SD.logarithmic(10), SD.poisson(10)], ids=lambda d: d.kind)
@pytest.mark.parametrize("sigma", [0.8, 1.5, 4.0])
def test_selection_between_one_trial_and_composing_expected_trials(dist, sigma):
    """True for these parameters (per-trial eps ~0.3 .. 3.7 at q = 0.01, 1000 steps), not in general: the
    selection bound has a floor (log E[K] / (l-1), log(1/gamma) / lh), so at sigma = 128 (per-trial eps 0.0099)
    geometric(10) gives 0.027 > 0.024 for composing 10 trials."""
    trial = dpsgd_curve(0.01, sigma, 1000)
    one = rdp_epsilon(trial, ORDERS, DELTA)
    composed = rdp_epsilon(expected_trials(dist) * trial, ORDERS, DELTA)
    assert one < selection_epsilon(trial, ORDERS, dist, DELTA) < composed
