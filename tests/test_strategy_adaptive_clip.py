"""Adaptive-clipping baselines (issue 10): each update / scaling rule against a hand computation of the
paper's formula, and the real DP step charging their declared releases."""

import copy
import io
import math

import numpy as np
import pytest
import torch

from raydp.model.batches import Batch
from raydp.privacy import BudgetGuard, PrivacyLedger
from raydp.privacy.clipping import group_norms, pair_norms
from raydp.privacy.engine import DPStep
from raydp.privacy.mechanism import Dials, SampleView, StepRelease
from raydp.privacy.randomness import PrivateRandomness
from raydp.privacy.statistics import UnclippedCount, releases_sigma_map
from raydp.strategies import make_strategy, strategy_class
from raydp.strategies.autoclip import AutoClipStrategy, AutoSScaling
from raydp.strategies.base import StrategyContext
from raydp.strategies.dcsgd import (
    DCSGDExpectedErrorStrategy,
    DCSGDPercentileStrategy,
    GroupNormHistogram,
)
from raydp.strategies.psac import PSACScaling
from raydp.strategies.quantile import CentredUnclippedCount, QuantileClipStrategy
from tests.test_dp_engine import padded_batch, tiny_lora_model

NORMS = np.array([0.0, 1e-12, 1e-6, 0.004, 0.01, 0.0416, 0.3, 1.0, 7.5, 123.4, 1e7])


def context(expected_batch_size=16.0, tensor_sizes=(400, 600), sigma_0=1.0, n_pairs=2, q=0.01):
    return StrategyContext(n_pairs, tuple(np.linspace(0, 1, n_pairs)), q=q, planned_steps=100, sigma_0=sigma_0,
                           epsilon_target=1e6, delta=1e-5, expected_batch_size=expected_batch_size,
                           tensor_sizes=tuple(tensor_sizes))


def fake_release(step, clip, statistics, sigma=1.0):
    return StepRelease(step, Dials(clip=(clip,), sigma=sigma), sigma_eff=sigma, clamped=False, noisy_sum_a=[],
                       noisy_sum_b=[], noisy_pair_norms=np.zeros(0),
                       statistics={k: np.asarray(v, dtype=np.float64) for k, v in statistics.items()})


# -- scaling rules ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("clip", [0.7, 1e-3, 50.0])
def test_auto_s_factors_match_the_paper_and_keep_the_bound(clip):
    gamma = 0.01
    norms = torch.tensor(NORMS, dtype=torch.float32).unsqueeze(1)
    got = AutoSScaling(gamma).factors(norms, torch.tensor([clip], dtype=torch.float32)).double().numpy()[:, 0]
    want = clip / (NORMS + gamma)  # Bu et al. 2023, Alg. 1 line 4 (times R = C)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert np.isfinite(got).all() and (got >= 0).all()
    assert (got * NORMS <= clip * (1 + 1e-6)).all()  # the DP step's bound
    assert got[0] * NORMS[0] == 0.0 and got[0] == pytest.approx(clip / gamma, rel=1e-6)  # a zero gradient
    assert got[-1] * NORMS[-1] == pytest.approx(clip, rel=1e-6)  # a huge gradient is normalised to C


@pytest.mark.parametrize("clip, r", [(1.0, 0.1), (0.3, 0.01), (5.0, 1.0)])
def test_psac_factors_match_the_paper_and_keep_the_bound(clip, r):
    norms = torch.tensor(NORMS, dtype=torch.float64).unsqueeze(1)
    got = PSACScaling(r).factors(norms, torch.tensor([clip], dtype=torch.float64)).numpy()[:, 0]
    want = clip / (NORMS + r / (NORMS + r))  # Xia et al. 2023, Algorithm 1
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert (got * NORMS <= clip * (1 + 1e-12)).all() and got[0] * NORMS[0] == 0.0
    assert got[0] == pytest.approx(clip)  # weight 1 at a zero norm: no blow-up of tiny gradients
    # non-monotonic weight (r < 1): it rises to its peak at sqrt(r) - r, then falls
    if r < 1:
        peak = math.sqrt(r) - r
        w = lambda x: 1.0 / (x + r / (x + r))  # noqa: E731
        x = torch.tensor([[peak / 2], [peak], [2 * peak + 0.5]], dtype=torch.float64)
        f = PSACScaling(r).factors(x, torch.tensor([1.0], dtype=torch.float64)).numpy()[:, 0]
        np.testing.assert_allclose(f, [w(peak / 2), w(peak), w(2 * peak + 0.5)], rtol=1e-12)
        assert f[1] > f[0] > 1.0 - 1e-12 and f[1] > f[2]


def test_scaling_rules_pass_the_engine_clip_stage_and_give_the_hand_clipped_sum():
    ids, mask = padded_batch()
    for strategy in (make_strategy("auto-clip", {"clip": 0.05}), make_strategy("psac", {"clip": 0.05, "r": 0.1})):
        model, pairs = tiny_lora_model(n_layer=2)
        strategy.setup(context(expected_batch_size=2.5, tensor_sizes=[t.numel() for p in pairs for t in (p.a, p.b)]))
        guard = BudgetGuard("rdp", epsilon_target=1e6, delta=1e-5, planned_steps=10, q=0.5)
        step = DPStep(model, pairs, strategy, PrivacyLedger(delta=1e-5, epsilon_target=1e6), guard, q=0.5,
                      expected_batch_size=2.5, planned_steps=10, randomness=PrivateRandomness.unsafe_from_seed(1),
                      device=torch.device("cpu"), sigma_0=1.0)
        dials = step.prepare(0).dials
        grads = step.per_sample_gradients(Batch(list(range(ids.shape[0])), ids, mask), dials)
        norms = group_norms(pair_norms(grads), "flat")[:, 0].double().numpy()
        sums_a, sums_b = step.layout.split(step.clip(grads, group_norms(pair_norms(grads), "flat"), dials, "flat"),
                                           batched=False)
        if strategy.name == "auto-clip":
            factor = 0.05 / (norms + 0.01)
        else:
            factor = 0.05 / (norms + 0.1 / (norms + 0.1))
        for i in range(len(pairs)):
            want_a = np.einsum("b,b...->...", factor, grads.a[i].double().numpy())
            want_b = np.einsum("b,b...->...", factor, grads.b[i].double().numpy())
            np.testing.assert_allclose(sums_a[i].double().numpy(), want_a, rtol=1e-4, atol=1e-7)
            np.testing.assert_allclose(sums_b[i].double().numpy(), want_b, rtol=1e-4, atol=1e-7)


def test_scaling_strategy_end_to_end_charges_sigma_only():
    model, pairs = tiny_lora_model(n_layer=2)
    strategy = make_strategy("auto-clip")
    assert isinstance(strategy, AutoClipStrategy) and strategy.releases() == ()
    assert not strategy.adaptive_sigma and strategy.clip_mode == "flat" and strategy.allocation == "flat"
    ledger, _ = run_dp_steps(model, pairs, strategy, sigma=1.3, steps=3)
    assert np.allclose(ledger.sigma_eff, 1.3, rtol=1e-12) and len(ledger) == 3
    assert strategy.describe()["settings"] == {"clip": 1.0, "gamma": 0.01}


# -- quantile-adaptive clipping ----------------------------------------------------------------------------
def test_centred_count_release_value_and_sensitivity():
    count = CentredUnclippedCount(groups=1, absolute_noise=1.6)
    assert isinstance(count, UnclippedCount) and count.sensitivity(7) == 0.5
    assert count.noise.std(sigma=3.0, sensitivity=0.5) == pytest.approx(0.8)  # sigma_b = z * 1/2, whatever sigma
    norms = torch.tensor([[0.05], [0.2], [0.1], [3.0], [0.0]])
    view = SampleView(norms, norms, torch.zeros(5), Dials(clip=(0.1,)))
    # indicators 1[norm <= C] = 1, 0, 1, 0, 1 -> centred sum 3 - 5/2
    assert count.value(view).tolist() == [0.5]
    # adding or removing one unit moves it by exactly 1/2
    for extra in (0.01, 10.0):
        more = torch.cat([norms, torch.tensor([[extra]])])
        bigger = count.value(SampleView(more, more, torch.zeros(6), Dials(clip=(0.1,))))
        assert abs(bigger.item() - 0.5) == 0.5


def test_quantile_settings_fix_the_count_noise_before_calibration():
    s = strategy_class("quantile").settings_model()
    assert (s.clip, s.target_quantile, s.learning_rate, s.count_noise) == (0.1, 0.5, 0.2, 0.05)
    strategy = make_strategy("quantile", {"batch_size": 64})
    (count,) = strategy.releases()
    # sigma_b = m / 20 = 3.2, sensitivity 1/2 -> z = 6.4
    assert count.noise.absolute == pytest.approx(6.4) and count.noise.relative is None
    with pytest.warns(UserWarning, match="batch_size"):
        strategy.setup(context(expected_batch_size=32.0))


@pytest.mark.parametrize("released", [-3.7, 0.0, 2.25, 40.0, -40.0])
def test_quantile_geometric_update_uses_the_expected_batch_size(released):
    m, c0, eta, gamma = 16.0, 0.1, 0.2, 0.5
    strategy = make_strategy("quantile")
    strategy.setup(context(expected_batch_size=m))
    assert strategy.dials(0).clip == (c0,)
    strategy.observe(fake_release(0, c0, {"centred_unclipped_count": [released]}), None)
    b = (released + m / 2) / m  # the noisy count of unclipped units over the EXPECTED batch size
    assert strategy.clip == pytest.approx(c0 * np.exp(-eta * (b - gamma)), rel=1e-12)
    assert strategy.trace[-1]["unclipped_fraction"] == pytest.approx(b)


def test_quantile_guards_nonfinite_and_extreme_counts():
    strategy = make_strategy("quantile", {"clip_min": 0.01, "clip_max": 2.0})
    strategy.setup(context())
    for bad in (np.nan, np.inf, -np.inf):
        strategy.observe(fake_release(0, strategy.clip, {"centred_unclipped_count": [bad]}), None)
        assert strategy.clip == 0.1
    strategy.observe(fake_release(1, strategy.clip, {"centred_unclipped_count": [-1e300]}), None)
    assert strategy.clip == 2.0  # far too few unclipped: grows, but stays within clip_max
    strategy.observe(fake_release(2, strategy.clip, {"centred_unclipped_count": [1e300]}), None)
    assert strategy.clip == 0.01


# -- DC-SGD ------------------------------------------------------------------------------------------------
def test_group_norm_histogram_counts_each_unit_once():
    hist = GroupNormHistogram(-2.0, 2.0, 4, noise_multiplier=6.0)
    assert hist.sensitivity(12) == 1.0 and hist.noise.absolute == 6.0
    norms = torch.tensor([[0.0], [0.05], [0.5], [0.9], [5.0], [1e9]])
    counts = hist.value(SampleView(norms, norms, torch.zeros(6), Dials(clip=(1.0,))))
    assert counts.shape == (1, 4) and counts.tolist() == [[2.0, 2.0, 1.0, 1.0]]
    np.testing.assert_allclose(hist.representatives, 10 ** np.array([-1.5, -0.5, 0.5, 1.5]))


def hand_percentile(hist, reps, p):
    h = np.where(np.isfinite(hist), hist, 0.0)  # the noisy counts as released (authors' code)
    cumulative, total = 0.0, h.sum()
    for k, count in enumerate(h):
        cumulative += count
        if cumulative >= p * total:
            return reps[k]
    return reps[-1]


@pytest.mark.parametrize("p", [0.05, 0.3, 0.5, 0.95])
def test_dcsgd_p_chooses_the_percentile_bin(p):
    strategy = make_strategy("dc-sgd-p", {"log10_low": -2.0, "log10_high": 2.0, "n_bins": 4, "percentile": p})
    assert isinstance(strategy, DCSGDPercentileStrategy)
    strategy.setup(context())
    noisy = [1.0, -2.0, 5.0, 4.0]  # noisy total 8, accumulated 1, -1, 4, 8
    strategy.observe(fake_release(0, 1.0, {"group_norm_histogram": [noisy]}), None)
    reps = 10 ** np.array([-1.5, -0.5, 0.5, 1.5])
    assert strategy.clip == pytest.approx(hand_percentile(np.array(noisy), reps, p))
    expected_bin = {0.05: 0, 0.3: 2, 0.5: 2, 0.95: 3}[p]  # p * 8 = 0.4, 2.4, 4, 7.6
    assert strategy.clip == pytest.approx(reps[expected_bin])


def test_dcsgd_p_keeps_the_clip_without_mass_and_pools_steps():
    strategy = make_strategy("dc-sgd-p", {"log10_low": -2.0, "log10_high": 2.0, "n_bins": 4, "pool_steps": 2,
                                          "clip": 0.7})
    strategy.setup(context())
    strategy.observe(fake_release(0, 0.7, {"group_norm_histogram": [[-1.0, -3.0, np.nan, 2.5]]}), None)
    assert strategy.clip == 0.7  # a noisy total <= 0 (nan read as 0): keep C
    strategy.observe(fake_release(1, 0.7, {"group_norm_histogram": [[2.0, 4.0, 2.0, 0.5]]}), None)
    # pooled sum [1, 1, 2, 3], total 7: 30% = 2.1 is reached in bin 2
    assert strategy.clip == pytest.approx(10 ** 0.5)
    strategy.observe(fake_release(2, strategy.clip, {"group_norm_histogram": [[0.0, 0.0, 6.0, 1.0]]}), None)
    # the window is the last two: [2, 4, 8, 1.5], total 15.5: 30% = 4.65 is reached in bin 1
    assert strategy.clip == pytest.approx(10 ** -0.5)


def hand_expected_error_clip(hist, reps, current, sigma, d, m, rounds=32, k=1):
    """DC-SGD-E written out: minimise sigma^2 C^2 d / m^2 + sum_j h_j (v_j - C)_+^2 / (k m) on the grid
    {C/10, ..., 2C}; search again around an edge minimiser."""
    h = np.where(np.isfinite(hist), hist, 0.0)  # the noisy counts as released (authors' code)
    for _ in range(rounds):
        grid = [current * i / 10 for i in range(1, 21)]
        errors = []
        for c in grid:
            bias = sum(hj * max(v - c, 0.0) ** 2 for hj, v in zip(h, reps)) / (k * m)
            errors.append(sigma ** 2 * c ** 2 * d / m ** 2 + bias)
        best = int(np.argmin(errors))
        if best not in (0, 19):
            return grid[best]
        current = grid[best]
    return current


@pytest.mark.parametrize("d, sigma, m", [(50, 0.8, 64.0), (1000, 1.0, 16.0), (3, 0.5, 256.0)])
def test_dcsgd_e_minimises_noise_variance_plus_clipping_bias(d, sigma, m):
    strategy = make_strategy("dc-sgd-e", {"log10_low": -2.0, "log10_high": 2.0, "n_bins": 8, "clip": 1.0})
    assert isinstance(strategy, DCSGDExpectedErrorStrategy)
    strategy.setup(context(expected_batch_size=m, tensor_sizes=(d,)))
    noisy = np.array([0.5, 3.0, 10.0, -1.0, 20.0, 6.0, 2.0, 0.3])
    strategy.observe(fake_release(0, 1.0, {"group_norm_histogram": [noisy]}, sigma=sigma), None)
    reps = 10 ** ((np.linspace(-2, 2, 9)[:-1] + np.linspace(-2, 2, 9)[1:]) / 2)
    want = hand_expected_error_clip(noisy, reps, 1.0, sigma, d, m)
    assert strategy.clip == pytest.approx(want, rel=1e-12)
    # the choice is a (grid) minimum of the objective: neighbours on the grid are not better
    def objective(c):
        return sigma ** 2 * c ** 2 * d / m ** 2 + np.sum(noisy * np.maximum(reps - c, 0) ** 2) / m
    assert objective(strategy.clip) <= min(objective(strategy.clip * 0.9), objective(strategy.clip * 1.1)) + 1e-12


def test_dcsgd_e_searches_beyond_the_first_grid_and_respects_bounds():
    # huge d: the noise term wins, the minimiser lies far below C/10 -> repeated search, stopped by clip_min
    strategy = make_strategy("dc-sgd-e", {"log10_low": -2.0, "log10_high": 2.0, "n_bins": 4, "clip": 1.0,
                                          "clip_min": 1e-3})
    strategy.setup(context(expected_batch_size=16.0, tensor_sizes=(10**9,)))
    strategy.observe(fake_release(0, 1.0, {"group_norm_histogram": [[1.0, 2.0, 3.0, 4.0]]}), None)
    assert strategy.clip == pytest.approx(1e-3)
    # tiny d, heavy top bin: the minimiser lies above 2C -> the grid moves up
    strategy = make_strategy("dc-sgd-e", {"log10_low": -2.0, "log10_high": 2.0, "n_bins": 4, "clip": 0.1})
    strategy.setup(context(expected_batch_size=16.0, tensor_sizes=(1,)))
    hist = np.array([0.0, 0.0, 0.0, 50.0])
    strategy.observe(fake_release(0, 0.1, {"group_norm_histogram": [hist]}, sigma=1.0), None)
    reps = 10 ** np.array([-1.5, -0.5, 0.5, 1.5])
    assert strategy.clip > 0.2
    assert strategy.clip == pytest.approx(hand_expected_error_clip(hist, reps, 0.1, 1.0, 1, 16.0))


# -- resume ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, stat", [("quantile", "centred_unclipped_count"),
                                        ("dc-sgd-p", "group_norm_histogram"),
                                        ("dc-sgd-e", "group_norm_histogram")])
def test_resume_continues_identically(name, stat):
    rng = np.random.default_rng(5)
    settings = {"pool_steps": 3} if name.startswith("dc") else {}
    width = 1 if name == "quantile" else 20
    releases = [rng.normal(2.0, 3.0, size=(1, width)) for _ in range(6)]

    def feed(strategy, chunk, start):
        for i, value in enumerate(chunk):
            strategy.observe(fake_release(start + i, strategy.clip, {stat: value[0] if width == 1 else value}), None)

    straight = make_strategy(name, settings)
    straight.setup(context())
    feed(straight, releases, 0)
    first = make_strategy(name, settings)
    first.setup(context())
    feed(first, releases[:3], 0)
    buffer = io.BytesIO()
    torch.save(copy.deepcopy(first.state_dict()), buffer)  # what a checkpoint holds
    buffer.seek(0)
    resumed = make_strategy(name, settings)
    resumed.setup(context())
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    feed(resumed, releases[3:], 3)
    assert resumed.clip == straight.clip and resumed.trace == straight.trace
    assert resumed.dials(6) == straight.dials(6)


# -- end to end with the real DP step ----------------------------------------------------------------------
def run_dp_steps(model, pairs, strategy, sigma, steps, expected_batch_size=2.5, q=0.5):
    strategy.setup(context(expected_batch_size=expected_batch_size, q=q, sigma_0=sigma, n_pairs=len(pairs),
                           tensor_sizes=[t.numel() for p in pairs for t in (p.a, p.b)]))
    ledger = PrivacyLedger(delta=1e-5, epsilon_target=1e6)
    guard = BudgetGuard("rdp", epsilon_target=1e6, delta=1e-5, planned_steps=100, q=q,
                        sigma_eff=releases_sigma_map(strategy.releases()))
    step = DPStep(model, pairs, strategy, ledger, guard, q=q, expected_batch_size=expected_batch_size,
                  planned_steps=100, randomness=PrivateRandomness.unsafe_from_seed(11), device=torch.device("cpu"),
                  sigma_0=sigma)
    ids, mask = padded_batch()
    seen = []
    observe = strategy.observe

    def spy(release, ledger_):
        seen.append(release)
        observe(release, ledger_)

    strategy.observe = spy
    for _ in range(steps):
        step.compute(model, Batch(list(range(ids.shape[0])), ids, mask))
        step.after_update(model)
    return ledger, seen


def test_quantile_end_to_end_charges_the_count_and_follows_its_rule():
    model, pairs = tiny_lora_model(n_layer=2)
    m, sigma = 2.5, 1.2
    strategy = QuantileClipStrategy(strategy_class("quantile").settings_model(batch_size=m, clip=0.05))
    ledger, seen = run_dp_steps(model, pairs, strategy, sigma=sigma, steps=4, expected_batch_size=m)
    z = 2 * 0.05 * m  # sigma_b = m/20 over sensitivity 1/2
    by_hand = (1 / sigma**2 + 1 / z**2) ** -0.5
    assert np.allclose(ledger.sigma_eff, by_hand, rtol=1e-9) and len(ledger) == 4
    release = {r.name: r for r in ledger[0].releases}["centred_unclipped_count"]
    assert release.sensitivity == 0.5 and release.noise_std == pytest.approx(z * 0.5)
    clip = 0.05
    for i, r in enumerate(seen):
        assert r.dials.clip == (pytest.approx(clip),) and ledger[i].clip[0] == pytest.approx(clip)
        value = float(r.statistics["centred_unclipped_count"][0])
        assert r.statistics_noise_std["centred_unclipped_count"] == pytest.approx(0.5 * z)
        clip = clip * math.exp(-0.2 * (value / m + 0.5 - 0.5))
        assert strategy.trace[i]["next_clip"] == pytest.approx(clip, rel=1e-12)


@pytest.mark.parametrize("name", ["dc-sgd-p", "dc-sgd-e"])
def test_dcsgd_end_to_end_charges_the_histogram_and_follows_its_rule(name):
    model, pairs = tiny_lora_model(n_layer=2)
    sigma, m = 0.9, 2.5
    strategy = make_strategy(name, {"clip": 0.5, "log10_low": -4.0, "log10_high": 2.0, "n_bins": 12})
    ledger, seen = run_dp_steps(model, pairs, strategy, sigma=sigma, steps=3, expected_batch_size=m)
    by_hand = (1 / sigma**2 + 1 / 6.0**2) ** -0.5  # sigma_H = 6, sensitivity 1
    assert np.allclose(ledger.sigma_eff, by_hand, rtol=1e-9) and len(ledger) == 3
    hist_row = {r.name: r for r in ledger[0].releases}["group_norm_histogram"]
    assert hist_row.sensitivity == 1.0 and hist_row.noise_std == pytest.approx(6.0)
    assert seen[0].statistics_noise_std["group_norm_histogram"] == pytest.approx(6.0)
    d = sum(t.numel() for p in pairs for t in (p.a, p.b))
    reps = 10 ** ((np.linspace(-4, 2, 13)[:-1] + np.linspace(-4, 2, 13)[1:]) / 2)
    clip = 0.5
    for i, r in enumerate(seen):
        noisy = r.statistics["group_norm_histogram"]
        assert noisy.shape == (1, 12) and ledger[i].clip[0] == pytest.approx(clip)
        if name == "dc-sgd-p":
            clip = hand_percentile(noisy[0], reps, 0.3) if noisy[0].sum() > 0 else clip
        else:
            clip = hand_expected_error_clip(noisy[0], reps, clip, sigma, d, m)
        clip = min(max(clip, 1e-4), 1e4)
        assert strategy.trace[i]["next_clip"] == pytest.approx(clip, rel=1e-12)
        assert math.isfinite(strategy.clip) and strategy.clip > 0
