"""RLDP's warm-up, decision interval, reward and action decoding with a fake policy client (no Ray).

Every expected value is computed here from the paper's formulas (Alg. 1 lines 13-38, Eq. 10-20), not by
calling the functions under test.
"""

import math

import numpy as np
import pytest
import torch

from raydp.strategies.rldp_settings import RLDPSettings
from raydp.control.features import ObservationLayout
from raydp.privacy.mechanism import Dials, StepRelease
from raydp.strategies.base import StrategyContext
from raydp.strategies.rldp import RLDPStrategy

N_PAIRS, BINS, EXPECTED_B, SIGMA_0, EPS_MAX = 2, 6, 10.0, 1.0, 2.0


class FakeClient:
    """The policy client's interface: records what RLDP sends, answers a fixed action."""

    def __init__(self, action):
        self.layout = ObservationLayout("shared", 4)
        self.action = np.asarray(action, dtype=np.float64)
        self.calls: list[tuple[np.ndarray, float | None]] = []
        self.latencies: list[float] = []
        self.weights_seen: list[int] = []
        self.service = None

    def decide(self, obs, reward):
        self.calls.append((np.asarray(obs), reward))
        self.latencies.append(0.001)
        return self.action

    def end(self):
        pass


def make_rldp(action, spent, t_warm=2, t_rl=3, r_max=5.0, probe=((1.0, 1.0),), **rldp):
    settings = RLDPSettings(t_warm=t_warm, t_rl=t_rl, r_max=r_max, histogram_bins=BINS, histogram_decades=6.0,
                          initial_clip=0.1, clip_floor=1e-3, **{"action_decoding": "paper", **rldp})
    client = FakeClient(action)
    strategy = RLDPStrategy(settings, client=client)
    strategy.setup(StrategyContext(N_PAIRS, (0.0, 1.0), q=0.1, planned_steps=100, sigma_0=SIGMA_0,
                                   epsilon_target=EPS_MAX, delta=1e-5, expected_batch_size=EXPECTED_B,
                                   privacy_spent=lambda: spent[0]))
    # public probe: median norm 1.0 -> bins span log10 in [-3, 3], one decade per bin
    strategy.calibrate_public(np.array(probe, dtype=float), np.ones(len(probe)))
    return strategy, client


def release(step, counts, loss_sum, sigma=SIGMA_0, noise_std=1.0):
    zeros = [torch.zeros(2)] * N_PAIRS
    return StepRelease(step, Dials(clip=(0.1,) * N_PAIRS, sigma=sigma), sigma, False, zeros, zeros,
                       np.zeros(N_PAIRS), statistics={"norm_histogram": np.asarray(counts, dtype=float),
                                                      "loss_sum": np.array([loss_sum])},
                       statistics_noise_std={"norm_histogram": noise_std, "loss_sum": 1.0})


def test_public_probe_places_the_bins_and_the_loss_bound():
    strategy, _ = make_rldp([0.0] * 5, [0.0])
    assert strategy.histogram.edges == pytest.approx(np.linspace(-3, 3, BINS + 1))
    assert strategy.loss_release.loss_clip == pytest.approx(2.0)  # 2 x the largest public loss
    assert [r.name for r in strategy.releases()] == ["norm_histogram", "loss_sum"]


def test_warm_up_sets_each_clip_to_the_median_of_the_denoised_histogram():
    strategy, _ = make_rldp([0.0] * 5, [0.0], t_warm=2)
    # pair 0: all mass in bin 3 = [1, 10); pair 1: in bin 1 = [0.01, 0.1). Noise std 1 per step.
    counts = np.zeros((N_PAIRS, BINS))
    counts[0, 3] = 10.0
    counts[1, 1] = 10.0
    counts[1, 4] = 0.5  # below 2 x the summed noise std: zeroed before the quantile
    strategy.observe(release(0, counts, 5.0), ledger=None)
    assert strategy.dials(1).clip == (0.1, 0.1)  # strict: nothing is set from one step's noisy histogram
    strategy.observe(release(1, counts, 5.0), ledger=None)
    # median of a single-bin CDF: halfway through the bin in log10 space
    expected = [10 ** (0 + 0.5), 10 ** (-2 + 0.5)]
    assert np.asarray(strategy.clips) == pytest.approx(expected)
    assert strategy.dials(2).clip == pytest.approx(tuple(expected))


def test_strict_warm_up_keeps_the_initial_clip_of_a_pair_whose_histogram_is_mostly_noise():
    """Expected samples over the warm-up: 2 steps x 10. Pair 0's surviving mass (20) is real; pair 1's one
    surviving bin (6 per step, above 2 x the summed noise std 2.83 but under half of 20) is what noise
    looks like, so pair 1 keeps C_0 = 0.1 instead of a clip at the spike (10^2.5)."""
    strategy, _ = make_rldp([0.0] * 5, [0.0], t_warm=2)
    counts = np.zeros((N_PAIRS, BINS))
    counts[0, 3] = 10.0
    counts[1, 5] = 4.0
    for t in range(2):
        strategy.observe(release(t, counts, 5.0), ledger=None)
    assert strategy.dials(2).clip == pytest.approx((10 ** 0.5, 0.1))


def test_paper_warm_up_follows_the_exact_norms_at_every_step():
    """Alg. 1 line 14 as written: the median of every exact norm seen so far, after each warm-up step."""
    strategy, _ = make_rldp([0.0] * 5, [0.0], t_warm=3, privacy_mode="paper")
    norms = [np.array([[0.2, 0.02], [0.4, 0.04]]), np.array([[0.6, 0.06], [0.8, 0.08]])]
    for t, n in enumerate(norms):
        r = release(t, np.zeros((N_PAIRS, BINS)), 0.0)
        r.raw_pair_norms, r.raw_losses = n, np.ones(2)
        strategy.observe(r, ledger=None)
        seen = np.concatenate(norms[: t + 1])
        assert strategy.dials(t + 1).clip == pytest.approx(tuple(np.median(seen, axis=0)))


def test_decisions_come_after_the_warm_up_every_t_rl_steps():
    strategy, client = make_rldp([0.0] * 5, [0.0], t_warm=4, t_rl=3)
    assert [t for t in range(1, 16) if strategy.wants_decision(t)] == [6, 9, 12, 15]
    no_client = RLDPStrategy(RLDPSettings(t_warm=4, t_rl=3))
    assert not any(no_client.wants_decision(t) for t in range(20))


def test_reward_and_decoded_action_follow_eq_10_to_20():
    action = [math.log(0.3), 0.5, 0.0, 0.0, 0.7]  # shared layout: 4 clip slots (2 used) + the noise action
    spent = [0.0]
    strategy, client = make_rldp(action, spent, t_warm=0, t_rl=2, r_max=5.0)
    counts = np.zeros((N_PAIRS, BINS))
    counts[:, 3] = 10.0
    # interval 1 (steps 1-2): loss sums 30 and 20 -> mean loss 50 / (E[B] * 2) = 2.5
    for t, loss in ((0, 30.0), (1, 20.0)):
        strategy.observe(release(t, counts, loss), ledger=None)
    spent[0] = 0.4
    strategy.between_steps(2)
    obs1, r1 = client.calls[-1]
    assert r1 is None  # no previous decision yet
    # Eq. 10: C_i = min(exp(a_i), 1); Eq. 11-15 for sigma with beta = 0.8, delta_max = 0.1
    step = 0.1 * (1 - 0.4 / EPS_MAX)
    log_prop = min(max(math.log(SIGMA_0) + math.tanh(0.7) * step, math.log(0.5)), math.log(2.0))
    sigma_1 = math.exp(0.8 * math.log(SIGMA_0) + 0.2 * log_prop)
    assert strategy.dials(2).clip == pytest.approx((0.3, 1.0))
    assert strategy.dials(2).sigma == pytest.approx(sigma_1)
    # interval 2 (steps 3-4): mean loss 20 / (E[B] * 2) = 1.0, epsilon 0.4 -> 0.9
    for t, loss in ((2, 12.0), (3, 8.0)):
        strategy.observe(release(t, counts, loss, sigma=sigma_1), ledger=None)
    spent[0] = 0.9
    strategy.between_steps(4)
    _, r2 = client.calls[-1]
    du, deps = (-1.0) - (-2.5), 0.9 - 0.4
    assert r2 == pytest.approx(max(-5.0, math.log(1 + max(du / (deps + 1e-6), -0.999))))  # Eq. 17-20
    assert len(client.calls) == 2 and [d["step"] for d in strategy.decisions] == [2, 4]
    # the same step is never decided twice (a resumed run re-enters between_steps)
    strategy.between_steps(4)
    assert len(client.calls) == 2


def test_reward_is_bounded_below_by_r_max():
    strategy, client = make_rldp([0.0] * 5, [0.0], t_warm=0, t_rl=1, r_max=0.5)
    counts = np.zeros((N_PAIRS, BINS))
    counts[:, 3] = 10.0
    strategy.observe(release(0, counts, 1.0), ledger=None)
    strategy.between_steps(1)
    strategy.observe(release(1, counts, 100.0), ledger=None)  # utility collapses
    strategy.between_steps(2)
    assert client.calls[-1][1] == pytest.approx(-0.5)


def test_relative_decoding_scales_each_pairs_public_median():
    # public probe: pair 0's norms 0.1, 0.2, 0.4 (median 0.2); pair 1's 1, 3, 2 (median 2)
    probe = ((0.1, 1.0), (0.2, 3.0), (0.4, 2.0))
    strategy, client = make_rldp([0.0, math.log(0.1), 0.0, 0.0, 0.7], [0.0], t_warm=0, t_rl=1, probe=probe,
                                 action_decoding="relative")
    counts = np.zeros((N_PAIRS, BINS))
    counts[:, 3] = 10.0
    strategy.observe(release(0, counts, 1.0), ledger=None)
    strategy.between_steps(1)
    assert strategy.dials(1).clip == pytest.approx((0.2 * 1.0, 2.0 * 0.1))  # C_i = r_i * e^{a_i}
    assert strategy.decisions[-1]["clip_next"] == pytest.approx([0.2, 0.2])


@pytest.mark.parametrize("decoding, expected", [("relative", (0.2 * 10.0, 2.0 * 0.5)),  # multiplier up to 10
                                                ("relative-capped", (0.2 * 1.0, 2.0 * 0.5))])  # never above r_i
def test_relative_capped_decoding_never_clips_above_the_public_median(decoding, expected):
    probe = ((0.1, 1.0), (0.2, 3.0), (0.4, 2.0))  # medians r = (0.2, 2)
    strategy, _ = make_rldp([40.0, math.log(0.5), 0.0, 0.0, 0.0], [0.0], t_warm=0, t_rl=1, probe=probe,
                            action_decoding=decoding)
    counts = np.zeros((N_PAIRS, BINS))
    counts[:, 3] = 10.0
    strategy.observe(release(0, counts, 1.0), ledger=None)
    strategy.between_steps(1)
    assert strategy.dials(1).clip == pytest.approx(expected)


def test_clip_only_control_keeps_sigma_on_the_plan():
    """noise_control off: the noise action is ignored and no sigma is proposed (the engine uses the plan's),
    so the run is a fixed-schedule run (no Renyi filter)."""
    strategy, client = make_rldp([math.log(0.3), 0.0, 0.0, 0.0, 3.0], [0.0], t_warm=0, t_rl=1, noise_control=False)
    assert strategy.adaptive_sigma is False and RLDPStrategy.adaptive_sigma is True
    counts = np.zeros((N_PAIRS, BINS))
    counts[:, 3] = 10.0
    strategy.observe(release(0, counts, 1.0), ledger=None)
    strategy.between_steps(1)
    dials = strategy.dials(1)
    assert dials.sigma is None and dials.clip == pytest.approx((0.3, 1.0))
    assert strategy.decisions[-1]["sigma_next"] == SIGMA_0


def test_no_timing_reaches_the_decisions_file_or_the_summary(tmp_path):
    """Timing depends on the private batch sizes: the client's in-memory latencies and weight versions never
    reach controller_decisions.parquet or the strategy's summary (both releasable)."""
    import pandas as pd

    from raydp.strategies.rldp import DECISIONS_FILE

    strategy, client = make_rldp([0.0] * 5, [0.0], t_warm=0, t_rl=1)
    counts = np.zeros((N_PAIRS, BINS))
    counts[:, 3] = 10.0
    for t in range(3):
        strategy.observe(release(t, counts, 1.0), ledger=None)
        strategy.between_steps(t + 1)
    client.weights_seen = [0, 1, 2]
    summary = strategy.finish(tmp_path)
    decisions = pd.read_parquet(tmp_path / DECISIONS_FILE)
    assert len(decisions) == summary["decisions"] == 3 and summary["transitions"] == 2
    assert not {"latency_s", "weights_seq"} & set(decisions.columns)
    assert not {"action_latency_ms_median", "weights_versions_seen"} & set(summary)
    assert not any("latenc" in key or "seconds" in key or "weights_vers" in key for key in summary)
