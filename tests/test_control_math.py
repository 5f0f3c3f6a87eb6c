"""RLDP's decoding (Eq. 10-15), reward (Eq. 17-20) and state post-processing, on fixed inputs."""

import math

import numpy as np
import pytest

from raydp.control.decoding import decode_action
from raydp.control.features import ObservationLayout, histogram_quantiles, summarise_histogram, summarise_raw
from raydp.control.reward import reward
from raydp.errors import ConfigError


def test_decoding_reproduces_eq_10_to_15_on_fixed_inputs():
    # a = (log 0.5, 0.3, -2.0 | 0.7), sigma_t = 1.2, sigma_0 = 1.0, eps_t = 0.5 of eps_max = 2.
    out = decode_action([math.log(0.5), 0.3, -2.0, 0.7], sigma_t=1.2, sigma_0=1.0, epsilon_t=0.5, epsilon_max=2.0)
    # Eq. 10, by hand: min(e^a, 1)
    assert out.clip == pytest.approx((0.5, 1.0, 0.1353352832366127), rel=1e-12)
    # Eq. 11-15, by hand
    step = 0.1 * (1 - 0.5 / 2.0)  # 0.075
    dlog = 0.6043677771171636 * step  # tanh(0.7) = 0.60436...
    log_prop = math.log(1.2) + dlog  # inside [log 0.5, log 2]
    log_next = 0.8 * math.log(1.2) + 0.2 * log_prop
    assert out.step_size == pytest.approx(step, rel=1e-12)
    assert out.sigma_proposed == pytest.approx(math.exp(log_prop), rel=1e-12)
    assert out.sigma == pytest.approx(math.exp(log_next), rel=1e-12)


def test_decoding_clamps_sigma_to_half_and_twice_sigma_0_before_momentum():
    # sigma_t already at 2 sigma_0 and a push up: the proposal is clamped to 2 sigma_0 (Eq. 13)
    up = decode_action([0.0, 50.0], sigma_t=2.0, sigma_0=1.0, epsilon_t=0.0, epsilon_max=1.0)
    assert up.sigma_proposed == pytest.approx(2.0) and up.sigma == pytest.approx(2.0)
    down = decode_action([0.0, -50.0], sigma_t=0.5, sigma_0=1.0, epsilon_t=0.0, epsilon_max=1.0)
    assert down.sigma_proposed == pytest.approx(0.5) and down.sigma == pytest.approx(0.5)
    # an exhausted ledger freezes sigma (step_t = 0)
    frozen = decode_action([0.0, 3.0], sigma_t=0.9, sigma_0=1.0, epsilon_t=1.0, epsilon_max=1.0)
    assert frozen.sigma == pytest.approx(0.9) and frozen.step_size == 0.0


def test_decoding_floors_clip_far_in_the_tail():
    assert decode_action([-30.0, 0.0], 1.0, 1.0, 0.0, 1.0).clip == (1e-3,)


@pytest.mark.parametrize("du, deps, r_max, expected", [
    (0.02, 0.1, 5.0, math.log(1 + 0.02 / (0.1 + 1e-6))),  # ordinary gain per epsilon
    (-0.5, 0.1, 5.0, max(-5.0, math.log(1 - 0.999))),  # ratio floored at -0.999: log(0.001) = -6.9 -> -R_max
    (-0.5, 0.1, 10.0, math.log(1 - 0.999)),  # a larger R_max leaves log(0.001)
    (0.0, 0.0, 5.0, 0.0),
    (1e-3, 0.0, 5.0, math.log(1 + 1e-3 / 1e-6)),  # no privacy spent: the 1e-6 stabiliser
])
def test_reward_reproduces_eq_20(du, deps, r_max, expected):
    assert reward(-1.0 + du, -1.0, 0.3 + deps, 0.3, r_max) == pytest.approx(expected, rel=1e-12)


def test_histogram_post_processing_matches_numpy_on_noise_free_counts():
    rng = np.random.default_rng(0)
    norms = 10 ** rng.normal(-1.0, 0.4, size=(4000, 2))
    edges = np.linspace(-4, 2, 241)  # fine bins: histogram quantiles ~ exact quantiles
    counts = np.stack([np.histogram(np.log10(norms[:, i]), bins=edges)[0] for i in range(2)]).astype(float)
    q = np.stack([histogram_quantiles(row, edges) for row in counts])
    assert np.allclose(q, np.quantile(norms, [0.25, 0.5, 0.75], axis=0).T, rtol=0.03)
    hist = summarise_histogram(counts, edges, noise_std=0.0, loss_sum=0.0, expected_samples=1.0)
    exact = summarise_raw(norms, np.zeros(4000))
    assert hist.fisher_mean == pytest.approx(exact.fisher_mean, rel=0.03)
    assert hist.dispersion == pytest.approx(exact.dispersion, rel=0.05)
    assert hist.skewness == pytest.approx(exact.skewness, rel=0.1)


def test_noisy_empty_bins_are_zeroed_before_quantiles():
    edges = np.linspace(-3, 3, 7)
    counts = np.array([[55.0, -40.0, 500.0, 700.0, 45.0, 50.0]])  # noise of std 30 on empty bins
    stats = summarise_histogram(counts, edges, 30.0, 0.0, 1.0)
    assert 10**-1 < stats.quartiles[0, 0] < stats.quartiles[0, 2] < 10**1  # inside the two populated bins
    raw = summarise_histogram(counts, edges, 0.0, 0.0, 1.0)  # without the threshold the noise shifts them
    assert raw.quartiles[0, 0] < stats.quartiles[0, 0]


def test_layouts_pack_and_split():
    shared = ObservationLayout("shared", 6)
    obs = shared.pack(np.ones((3, 5)), np.zeros(10))
    assert obs.shape == (shared.obs_dim,) == (6 * 5 + 10 + 6,)
    assert list(obs[-6:]) == [1, 1, 1, 0, 0, 0]
    action = np.arange(7.0)
    assert list(shared.split_action(action, 3)) == [0.0, 1.0, 2.0, 6.0]
    paper = ObservationLayout("paper", 4)
    with pytest.raises(ConfigError, match="exactly 4 adapter pairs"):
        paper.pack(np.ones((3, 5)), np.zeros(10))
    with pytest.raises(ConfigError, match="at most 6"):
        shared.pack(np.ones((7, 5)), np.zeros(10))


def test_relative_clip_decoding_is_the_reference_times_a_bounded_multiplier():
    from raydp.control.decoding import RELATIVE_BOUNDS, decode_action, decode_clips_relative

    ref = np.array([0.05, 2.0, 0.3])
    np.testing.assert_allclose(decode_clips_relative([0.0, 0.0, 0.0], ref), ref)  # zero action: the reference
    np.testing.assert_allclose(decode_clips_relative([math.log(2.0), -math.log(4.0), 0.5], ref),
                               [0.1, 0.5, 0.3 * math.exp(0.5)])
    np.testing.assert_allclose(decode_clips_relative([50.0, -50.0, 0.0], ref),  # far tails: the bounds
                               [0.05 * RELATIVE_BOUNDS[1], 2.0 * RELATIVE_BOUNDS[0], 0.3])
    assert decode_clips_relative([-50.0], [0.01], clip_floor=1e-3)[0] == 1e-3  # 1e-5 floored
    with pytest.raises(ValueError, match="positive reference"):
        decode_clips_relative([0.0, 0.0], [0.1, 0.0])
    decoded = decode_action([0.0, 0.0, 0.0, 0.2], 1.0, 1.0, 0.0, 2.0, reference=ref)
    np.testing.assert_allclose(decoded.clip, ref)
    # relative-capped: the multiplier in [1e-3, 1], so never above the reference
    capped = decode_action([50.0, math.log(0.5), -50.0, 0.2], 1.0, 1.0, 0.0, 2.0, reference=ref, bounds=(1e-3, 1.0))
    np.testing.assert_allclose(capped.clip, [0.05, 1.0, 1e-3])  # 0.3 x 1e-3 floored at 1e-3
    assert decoded.sigma == pytest.approx(decode_action([0.0, 0.0, 0.0, 0.2], 1.0, 1.0, 0.0, 2.0).sigma)
