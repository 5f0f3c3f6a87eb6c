"""Tests of the local-DP accounting of EW-FT / DP-Forward (raydp.privacy.local; ERRATA E8, E11, E12).

Every number is checked against a computation made here independently of the module: numerical
integration of the Gaussian privacy loss, dp_accounting's own PLD accountant, the exact hockey-stick
divergence of a Gaussian composed with randomized response (a finite sum), and empirical frequencies."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from scipy import integrate, optimize
from scipy.stats import norm

from raydp.errors import ConfigError
from raydp.privacy.local import (
    LABELS_UNPROTECTED,
    LocalPlan,
    calibrate_local_scale,
    paper_epsilon,
    randomized_response,
    randomized_response_probabilities,
)

DELTA = 1e-5
SIGMAS = (1.2, 1.0, 0.8)


def mu_of(sigmas, k=1):
    return math.sqrt(k * sum(1.0 / s**2 for s in sigmas))


def delta_by_integration(eps: float, mu: float) -> float:
    """delta(eps) = E_P[(1 - e^{eps - L})_+], L ~ N(mu^2/2, mu^2): the privacy loss of N(0,1) vs N(mu,1)."""
    m, s = mu * mu / 2.0, mu
    z0 = (eps - m) / s
    f = lambda z: -math.expm1(eps - (m + s * z)) * norm.pdf(z)  # noqa: E731
    total = 0.0
    for a, b in [(z0, z0 + 1.0), (z0 + 1.0, z0 + 5.0), (z0 + 5.0, z0 + 40.0)]:
        total += integrate.quad(f, a, b, epsabs=0.0, epsrel=1e-11, limit=200)[0]
    return total


def delta_closed(eps: float, mu: float) -> float:
    """Gaussian hockey stick for any real eps (may be negative), written out here (Balle & Wang Thm 8)."""
    return norm.cdf(-eps / mu + mu / 2.0) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2.0)


def eps_gauss_with_rr(mu: float, eps_l: float, k: int, releases: int, delta: float) -> float:
    """Exact epsilon of (mu-Gaussian) x (releases x k-RR) from the finite sum over RR outcomes:
    H_{e^eps}(P_G x P_R || Q_G x Q_R) = sum_o P_R(o) H_{e^{eps - L_R(o)}}(P_G || Q_G)."""
    e = math.exp(eps_l)
    pk, po = e / (e + k - 1), 1.0 / (e + k - 1)
    outcomes = []  # (probability under P, loss) per release: keep (+eps_l), the other input (-eps_l), rest (0)
    for combo in itertools.product(range(3), repeat=releases):
        p, loss = 1.0, 0.0
        for c in combo:
            p *= (pk, po, (k - 2) * po)[c]
            loss += (eps_l, -eps_l, 0.0)[c]
        if p > 0:
            outcomes.append((p, loss))
    f = lambda x: sum(p * delta_closed(x - loss, mu) for p, loss in outcomes) - delta  # noqa: E731
    return optimize.brentq(f, 0.0, 100.0, xtol=1e-12)


# ---------------------------------------------------------------------------------------------- Gaussian

@pytest.mark.parametrize("sigmas,delta", [(SIGMAS, 1e-5), ((3.0,), 1e-5), ((0.5, 0.7), 1e-3), ((5.0,) * 4, 1e-6)])
def test_gaussian_epsilon_matches_integrated_privacy_loss(sigmas, delta):
    plan = LocalPlan(sigmas)
    mu = mu_of(sigmas)
    assert plan.gaussian_mu() == pytest.approx(mu, rel=1e-12)
    eps = plan.epsilon(delta)
    assert eps > 0
    assert delta_by_integration(eps, mu) == pytest.approx(delta, rel=1e-3)
    # smallest such eps: a little less leaks more than delta
    assert delta_by_integration(eps * 0.99, mu) > delta * 1.001
    # composition is one Gaussian with the combined multiplier (Dong, Roth & Su Cor. 3.3)
    assert LocalPlan((1.0 / mu,)).epsilon(delta) == pytest.approx(eps, rel=1e-9)
    assert plan.labels() == [LABELS_UNPROTECTED]


def test_gaussian_epsilon_agrees_with_dp_accounting_pld():
    for sigmas, k in [(SIGMAS, 1), ((2.0, 1.5), 3), ((4.0,) * 5, 2)]:
        acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-3)
        # GaussianDpEvent(s) under ADD_OR_REMOVE_ONE without sampling: sensitivity 1, std s (mu = 1/s)
        acc.compose(dp_event.ComposedDpEvent([dp_event.GaussianDpEvent(s) for s in sigmas]), k)
        ref = acc.get_epsilon(DELTA)
        assert LocalPlan(sigmas, records_per_unit=k).epsilon(DELTA) == pytest.approx(ref, rel=1e-2)


def test_records_per_unit_multiplies_mu_by_sqrt_k():
    for k in (1, 2, 5):
        plan = LocalPlan(SIGMAS, records_per_unit=k)
        explicit = LocalPlan(SIGMAS * k)  # the same releases, listed k times
        assert plan.gaussian_mu() == pytest.approx(math.sqrt(k) * mu_of(SIGMAS), rel=1e-12)
        assert plan.epsilon(DELTA) == pytest.approx(explicit.epsilon(DELTA), rel=1e-9)
        assert delta_by_integration(plan.epsilon(DELTA), math.sqrt(k) * mu_of(SIGMAS)) == pytest.approx(DELTA, rel=1e-3)
    assert LocalPlan(SIGMAS, records_per_unit=4).epsilon(DELTA) > LocalPlan(SIGMAS).epsilon(DELTA)


def test_epsilon_after_is_the_ledger_view():
    plan = LocalPlan(SIGMAS)
    assert plan.epsilon_after(0, DELTA) == 0.0
    spent = [plan.epsilon_after(n, DELTA) for n in range(1, 4)]
    assert spent == sorted(spent) and spent[-1] == pytest.approx(plan.epsilon(DELTA), rel=1e-12)
    assert spent[0] == pytest.approx(LocalPlan(SIGMAS[:1]).epsilon(DELTA), rel=1e-12)
    labelled = LocalPlan(SIGMAS, epsilon_label=1.0)
    assert labelled.epsilon_after(0, DELTA) == 0.0
    assert labelled.epsilon_after(1, DELTA) > spent[0]  # the label release comes with the first epoch
    with pytest.raises(ConfigError):
        plan.epsilon_after(4, DELTA)


# ---------------------------------------------------------------------------------------------- labels

@pytest.mark.parametrize("eps_l,k", [(1.0, 2), (0.5, 5), (3.0, 2), (2.0, 10)])
def test_labels_compose_with_gaussian_exactly_and_within_bounds(eps_l, k):
    plan = LocalPlan(SIGMAS, epsilon_label=eps_l, n_classes=k)
    eps = plan.epsilon(DELTA)
    eps_g = LocalPlan(SIGMAS).epsilon(DELTA)
    pk, po = math.exp(eps_l) / (math.exp(eps_l) + k - 1), 1 / (math.exp(eps_l) + k - 1)
    eps_rr = math.log((pk - DELTA) / po)  # RR alone at delta: delta(eps) = p_keep - e^eps p_other
    assert eps >= max(eps_g, eps_rr) - 1e-9
    assert eps <= eps_g + eps_l + 1e-9  # basic composition, delta unchanged
    assert eps == pytest.approx(eps_gauss_with_rr(mu_of(SIGMAS), eps_l, k, 1, DELTA), rel=1e-3)
    assert plan.labels() == []


def test_labels_with_several_records_per_unit():
    plan = LocalPlan(SIGMAS, records_per_unit=2, epsilon_label=0.7, n_classes=3)
    ref = eps_gauss_with_rr(mu_of(SIGMAS, 2), 0.7, 3, 2, DELTA)
    assert plan.epsilon(DELTA) == pytest.approx(ref, rel=1e-3)
    assert plan.epsilon(DELTA) <= LocalPlan(SIGMAS, records_per_unit=2).epsilon(DELTA) + 2 * 0.7 + 1e-9


def test_labels_dominate_when_the_gaussian_is_negligible():
    eps_l = 1.0
    plan = LocalPlan((1e5,), epsilon_label=eps_l)
    e = math.e
    assert plan.epsilon(DELTA) == pytest.approx(math.log((e / (e + 1) - DELTA) * (e + 1)), abs=2e-3)
    assert plan.epsilon(DELTA) == pytest.approx(eps_l, abs=2e-3)


def test_describe_is_json_and_says_what_it_covers():
    d = LocalPlan(SIGMAS, records_per_unit=3).describe(DELTA)
    json.dumps(d)
    assert d["labels"] == [LABELS_UNPROTECTED] and d["label_mechanism"] is None
    assert d["sigmas"] == list(SIGMAS) and d["records_per_unit"] == 3
    assert "E8" in d["amplification"] and "3 records" in d["unit"]
    assert d["epsilon"] == pytest.approx(LocalPlan(SIGMAS * 3).epsilon(DELTA))
    d = LocalPlan(SIGMAS, epsilon_label=1.0, n_classes=4).describe(DELTA)
    json.dumps(d)
    assert d["labels"] == [] and d["label_mechanism"]["n_classes"] == 4 and d["epsilon_is"] == "upper bound"


# ---------------------------------------------------------------------------------------------- calibration

@pytest.mark.parametrize("target,k,eps_l", [(1.0, 1, None), (8.0, 1, None), (4.0, 3, None), (8.0, 2, 1.0)])
def test_calibration_lands_just_below_target(target, k, eps_l):
    mult = (1.2, 1.0, 0.8)
    plan = calibrate_local_scale(mult, target, DELTA, records_per_unit=k, epsilon_label=eps_l)
    scale = plan.sigmas[0] / mult[0]
    assert plan.sigmas == pytest.approx(tuple(scale * m for m in mult), rel=1e-12)
    assert plan.records_per_unit == k and plan.epsilon_label == eps_l
    eps = plan.epsilon(DELTA)
    assert 0.995 * target <= eps <= target
    if eps_l is None:  # independent check of the guarantee
        assert delta_by_integration(target, mu_of(plan.sigmas, k)) <= DELTA * (1 + 1e-3)
    # smallest to 0.1%: a 0.2% smaller scale overshoots
    smaller = LocalPlan(tuple(s / 1.002 for s in plan.sigmas), k, eps_l)
    assert smaller.epsilon(DELTA) > target


def test_calibration_refuses_impossible_targets():
    with pytest.raises(ConfigError):
        calibrate_local_scale((1.0,), 1.0, DELTA, epsilon_label=1.0)
    with pytest.raises(ConfigError):
        calibrate_local_scale((1.0,), 1.0, DELTA, epsilon_label=2.0)
    with pytest.raises(ConfigError):
        calibrate_local_scale((1.0,), 2.0, DELTA, records_per_unit=3, epsilon_label=0.7)
    with pytest.raises(ConfigError):
        calibrate_local_scale((1.0, 0.0), 2.0, DELTA)
    with pytest.raises(ConfigError):
        calibrate_local_scale((1.0,), -1.0, DELTA)


# ---------------------------------------------------------------------------------------------- RR

def test_randomized_response_probabilities():
    for eps, k in [(0.1, 2), (1.0, 4), (5.0, 10), (800.0, 3)]:
        pk, po = randomized_response_probabilities(eps, k)
        assert pk + (k - 1) * po == pytest.approx(1.0)
        if eps < 700:
            assert pk / po == pytest.approx(math.exp(eps))
            assert pk == pytest.approx(math.exp(eps) / (math.exp(eps) + k - 1))
    assert randomized_response_probabilities(800.0, 3)[0] == 1.0


def test_randomized_response_empirical_torch():
    n, k, eps = 200_000, 4, 1.0
    pk, po = randomized_response_probabilities(eps, k)
    labels = torch.arange(n) % k
    g = torch.Generator().manual_seed(12345)  # test-only fixed seed
    out = randomized_response(labels, eps, k, g)
    assert isinstance(out, torch.Tensor) and out.dtype == labels.dtype and out.shape == labels.shape
    assert int(out.min()) >= 0 and int(out.max()) < k
    keep = (out == labels).double().mean().item()
    assert abs(keep - pk) < 4 * math.sqrt(pk * (1 - pk) / n)
    changed = out != labels
    m = int(changed.sum())
    offsets = ((out - labels) % k)[changed]
    for j in range(1, k):  # uniform over the k-1 other classes
        frac = (offsets == j).double().mean().item()
        assert abs(frac - 1 / (k - 1)) < 4 * math.sqrt((1 / (k - 1)) * (1 - 1 / (k - 1)) / m)
    for c in range(k):  # each output class: P(out = c | in = y) = po for y != c
        sel = (labels != c)
        frac = (out[sel] == c).double().mean().item()
        assert abs(frac - po) < 4 * math.sqrt(po * (1 - po) / int(sel.sum()))


def test_randomized_response_numpy_and_errors():
    labels = np.arange(50_000) % 3
    out = randomized_response(labels, 2.0, 3, np.random.default_rng(7))
    assert isinstance(out, np.ndarray) and out.dtype == labels.dtype
    assert out.min() >= 0 and out.max() < 3
    pk, _ = randomized_response_probabilities(2.0, 3)
    assert abs((out == labels).mean() - pk) < 4 * math.sqrt(pk * (1 - pk) / labels.size)
    with pytest.raises(ConfigError):
        randomized_response(labels, 2.0, 3, None)
    with pytest.raises(ConfigError):
        randomized_response(np.array([0, 3]), 2.0, 3, np.random.default_rng(0))
    with pytest.raises(ConfigError):
        randomized_response(np.array([0.0, 1.0]), 2.0, 3, np.random.default_rng(0))


# ---------------------------------------------------------------------------------------------- E8 gap

def test_paper_figure_is_far_below_the_local_guarantee():
    local = LocalPlan(SIGMAS).epsilon(DELTA)
    paper = paper_epsilon(SIGMAS, 16 / 1440, 90, DELTA)
    assert paper < local / 3
    paper_q01 = paper_epsilon(SIGMAS, 0.01, 90, DELTA)
    assert paper_q01 < local / 3
    # dp_accounting directly, for the same subsampled composition
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-3)
    acc.compose(dp_event.ComposedDpEvent([
        dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(0.01, dp_event.GaussianDpEvent(s)), 90)
        for s in SIGMAS]))
    assert paper_q01 == pytest.approx(acc.get_epsilon(DELTA), rel=3e-2)


# ---------------------------------------------------------------------------------------------- validation

@pytest.mark.parametrize("kwargs", [
    {"sigmas": ()}, {"sigmas": (1.0, 0.0)}, {"sigmas": (float("inf"),)}, {"sigmas": (float("nan"),)},
    {"sigmas": (1.0,), "records_per_unit": 0}, {"sigmas": (1.0,), "records_per_unit": 1.5},
    {"sigmas": (1.0,), "n_classes": 1}, {"sigmas": (1.0,), "epsilon_label": 0.0},
    {"sigmas": (1.0,), "epsilon_label": float("inf")},
])
def test_invalid_plans(kwargs):
    with pytest.raises(ConfigError):
        LocalPlan(**kwargs)


def test_invalid_delta_and_paper_args():
    for d in (0.0, 1.0, -1e-5):
        with pytest.raises(ConfigError):
            LocalPlan(SIGMAS).epsilon(d)
    with pytest.raises(ConfigError):
        paper_epsilon(SIGMAS, 0.0, 90, DELTA)
    with pytest.raises(ConfigError):
        paper_epsilon(SIGMAS, 0.01, 0, DELTA)
    with pytest.raises(ConfigError):
        paper_epsilon(SIGMAS, 0.01, 90, DELTA, accountant="nope")
