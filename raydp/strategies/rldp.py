"""RLDP: a SAC hyper-policy sets a clip radius per LoRA pair and the noise multiplier online.

RLDP Alg. 1, corrected by ERRATA E1 (true sigma with proportional per-pair noise), E3 (the controller's
view) and E4 (budget guard, applied by the DP step to every proposed sigma):

* steps 1..T_warm: C_i is set to the median per-sample norm of pair i (Alg. 1 line 14; floored at
  ``clip_floor``); the first decision's window starts after. paper mode does this at every warm-up step
  from the exact norms seen so far, as Alg. 1 does. strict mode (raydp's correction) does it ONCE, at
  step T_warm, from the DP norm histogram summed over the whole warm-up, and only for a pair whose
  denoised histogram still holds at least half the warm-up's expected samples (otherwise C_i stays at
  ``initial_clip``): one step's histogram holds ~B samples under noise of std ``histogram_noise`` x sigma x
  sqrt(n_pairs) per bin, so its median is the position of a noise spike. Measured before this correction (CPU
  frontier, epsilon 0.5, seed 0): a clip of 19.4 at step 5 where the public reference norm was 0.057, 44-50
  different clip vectors over the 50 warm-up steps;
* at every step t > T_warm with t mod T_RL == 0 (lines 16-38): the state s_t is assembled
  (:mod:`raydp.control.features`), the reward of the previous action (Eq. 17-20) and s_t go to the
  policy through the broker, which returns a_t; a_t is decoded by Eq. 10-15
  (:mod:`raydp.control.decoding`; ``action_decoding: relative`` decodes the clips relative to each
  pair's public reference norm instead of Eq. 10). The policy service trains on the transition (K updates of B_SAC).

strict mode: every step releases a noisy per-pair histogram of log per-sample norms and a noisy sum of
clipped per-sequence losses, charged with the gradient (:mod:`raydp.privacy.statistics`); the state is
post-processing of their sums over the interval. paper mode: the exact statistics of the last
micro-batch (labelled; the epsilon does not cover them).

The actions are post-processing of the DP releases plus public randomness only: the policy's decisions
are deterministic given the run's releases and public seeds (the restored policy, the SAC seed and the
run's seed). Both transports make a decision wait until the policy has trained on every transition the run
reported before it, and explore with the run's own public-seeded generator
(:mod:`raydp.control.broker`, :mod:`raydp.control.rllink`): how fast the learner trains depends on timing,
and timing depends on the private batch sizes, so no action may depend on it. For the same reason no timing
reaches the run's files: ``controller_decisions.parquet`` and the summary hold no round-trip latency and no
weight version (the clients keep those in memory, for benchmarks).
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raydp.control.decoding import RELATIVE_BOUNDS, decode_action, decode_residual
from raydp.control.features import (
    ControllerView,
    IntervalStatistics,
    ObservationLayout,
    adapter_features,
    denoise_counts,
    global_features,
    histogram_quantiles,
    summarise_histogram,
    summarise_raw,
)
from raydp.control.reward import potential_reward, reward as rldp_reward
from raydp.errors import ConfigError
from raydp.privacy.statistics import ClippedLossSum, NormHistogram
from raydp.privacy.mechanism import Dials, StepRelease
from raydp.run_directory import CONTROL_TRACE, CONTROLLER_DECISIONS
from raydp.strategies.base import Strategy, StrategyContext
from raydp.strategies.clipschedule import scheduled_clips
from raydp.strategies.rldp_settings import RLDPSettings

TRACE_FILE = CONTROL_TRACE  # the run's files this strategy writes (raydp.run_directory names them)
DECISIONS_FILE = CONTROLLER_DECISIONS


class _Interval:
    """Running sums of the strict-mode releases over a window of steps."""

    def __init__(self, n_pairs: int, n_bins: int):
        self.counts = np.zeros((n_pairs, n_bins))
        self.count_var = 0.0
        self.loss_sum = 0.0
        self.steps = 0

    def add(self, release: StepRelease) -> None:
        self.counts += release.statistics["norm_histogram"]
        self.count_var += release.statistics_noise_std["norm_histogram"] ** 2
        self.loss_sum += float(release.statistics["loss_sum"][0])
        self.steps += 1


class RLDPStrategy(Strategy):
    """The RLDP controller as a strategy of the shared DP step (see the module docstring)."""

    name = "rldp"
    clip_mode = "pairwise"
    allocation = "proportional"
    needs_public_probe = True
    adaptive_sigma = True  # Eq. 13-14: sigma follows the policy's actions (Renyi filter, ERRATA E13)
    settings_model = RLDPSettings  # TrainConfig.settings (raydp.strategies.rldp_settings)

    def __init__(self, settings, client=None):
        self.settings = settings
        # noise_control off: the policy sets the clips only and sigma stays on the plan (sigma_0). With the
        # proportional noise allocation every step is then a subsampled Gaussian of multiplier sigma_0 in
        # units of its clip, whatever clips the policy chose from earlier releases: each step's privacy loss
        # distribution is fixed in advance, so adaptive composition of dominating pairs (Zhu, Dong and Wang
        # 2022, Thm 10; Dong, Roth and Su 2019, Thm 3.2 for f-DP; the argument Andrew et al. 2021 use for
        # adaptive clipping) lets the ledger's PLD account the run with no Renyi filter (ERRATA E1/E13).
        # The declared statistics keep fixed sensitivities (sqrt(n) and the public loss bound) and noise
        # relative to sigma_0, so they do not depend on the chosen clips either.
        self.adaptive_sigma = bool(settings.noise_control)
        self.modes = settings.modes  # privacy mode, decoding, architecture, read once (raydp.control.modes)
        self.raw_statistics = self.modes.raw_statistics
        self.public_probe_records = settings.public_probe_records
        # public-validation reward: the run scores this many public records at each decision (raydp.runner.run)
        self.public_utility_records = settings.reward_records if settings.reward == "public-validation" else None
        self.client = client
        self.histogram = NormHistogram(None, None, settings.histogram_bins, settings.histogram_noise)
        self.loss_release = ClippedLossSum(None, settings.loss_noise)
        self.reference_norm = 1.0
        self.pair_reference: np.ndarray | None = None  # r_i: median public per-sample norm of pair i
        self.trace: list[dict] = []
        self.decisions: list[dict] = []
        self._previous: tuple[float, float] | None = None  # (u, eps) at the last decision

    # -- setup -------------------------------------------------------------------------------------
    def releases(self) -> tuple:
        """strict: the per-pair norm histogram and the clipped loss sum, declared here with their noise;
        their bins and bound are placed from public records (:meth:`calibrate_public`). paper: none."""
        return () if self.raw_statistics else (self.histogram, self.loss_release)

    def setup(self, context: StrategyContext) -> None:
        super().setup(context)
        self.clips = np.full(context.n_pairs, self.settings.initial_clip)
        self.residual = np.ones(context.n_pairs)  # residual decoding: each pair's factor on the schedule
        self.sigma = context.sigma_0
        if self.client is not None:
            self.client.layout.check_adapters(context.n_pairs)
        n_bins = self.settings.histogram_bins
        self._interval = _Interval(context.n_pairs, n_bins)
        self._warm = _Interval(context.n_pairs, n_bins)
        self._warm_raw: list[np.ndarray] = []
        self._last_raw: tuple[np.ndarray, np.ndarray] | None = None

    def calibrate_public(self, pair_norms: np.ndarray, losses: np.ndarray) -> None:
        """Histogram bins and loss bound from PUBLIC records under the initial model (no privacy cost):
        bins span ``histogram_decades`` centred on the median public norm; the loss bound is twice the
        largest public per-sequence loss."""
        positive = pair_norms[pair_norms > 0]
        if positive.size == 0 or losses.size == 0:
            raise ConfigError("the public probe gave no gradient norms; cannot place the histogram bins")
        self.reference_norm = float(np.median(positive))
        # r_i for relative decoding: pair i's median public norm (the pooled median for a pair with none)
        self.pair_reference = np.array([float(np.median(col[col > 0])) if np.any(col > 0) else self.reference_norm
                                        for col in np.asarray(pair_norms, dtype=np.float64).T])
        centre, half = math.log10(self.reference_norm), self.settings.histogram_decades / 2
        self.histogram = self.histogram.placed(centre - half, centre + half)
        loss_clip = math.ceil(20 * float(np.max(losses))) / 10  # 2 x max, rounded up to 0.1
        self.loss_release = self.loss_release.placed(loss_clip)

    # -- per step ----------------------------------------------------------------------------------
    def dials(self, step: int) -> Dials:
        sigma = float(self.sigma) if self.adaptive_sigma else None  # None: the plan's sigma (noise_control off)
        if self.modes.residual:  # the schedule at this step times the last decision's factors
            schedule = self.settings.schedule
            if schedule.relative and self.pair_reference is None:
                raise ConfigError("residual decoding on a relative schedule needs the public probe's per-pair norms")
            self.clips = np.maximum(scheduled_clips(schedule, self.pair_reference, self.context, step) * self.residual,
                                    self.settings.clip_floor)
        return Dials(clip=tuple(float(c) for c in self.clips), sigma=sigma)

    def observe(self, release: StepRelease, ledger) -> None:
        t = release.step + 1
        if release.dials.sigma is not None:
            self.sigma = release.dials.sigma  # the sigma in force (after the guard) is sigma_t of Eq. 13-14
        if not self.raw_statistics:
            self._interval.add(release)
            if t <= self.settings.t_warm:
                self._warm.add(release)
        else:
            self._last_raw = (release.raw_pair_norms, release.raw_losses)
            if t <= self.settings.t_warm:
                self._warm_raw.append(release.raw_pair_norms)
        if t <= self.settings.t_warm and (self.raw_statistics or t == self.settings.t_warm) \
                and not self.modes.residual:  # residual decoding: the schedule sets the clips from the first step
            self._warm_up_clips()
        if t == self.settings.t_warm:  # the first decision's window starts after the warm-up
            self._interval = _Interval(self.context.n_pairs, self.settings.histogram_bins)
        self.trace.append({"step": t, "sigma": float(release.dials.sigma),
                           "sigma_eff": release.sigma_eff, "clamped": release.clamped,
                           "decision": self.wants_decision(t), "clip": [float(c) for c in release.dials.clip]})

    def wants_decision(self, step: int) -> bool:
        """Alg. 1 line 17: t > T_warm and t mod T_RL = 0."""
        return self.client is not None and step > self.settings.t_warm and step % self.settings.t_rl == 0

    def between_steps(self, step: int) -> None:
        if self.wants_decision(step) and (not self.decisions or self.decisions[-1]["step"] != step):
            self._decide(step)

    def _warm_up_clips(self) -> None:
        """Alg. 1 line 14: C_i <- median per-sample norm of pair i (pairs without data keep C_i). strict: from
        the warm-up's summed DP histogram, for pairs whose denoised mass is at least half the expected
        samples (post-processing of the charged releases; see the module docstring)."""
        if not self.raw_statistics:
            counts = denoise_counts(self._warm.counts, math.sqrt(self._warm.count_var))
            medians = np.array([histogram_quantiles(row, self.histogram.edges, (0.5,))[0] for row in counts])
            expected = self.context.expected_batch_size * self._warm.steps
            medians = np.where(counts.sum(axis=1) >= 0.5 * expected, medians, math.nan)
        else:
            medians = np.median(np.concatenate(self._warm_raw, axis=0), axis=0) if self._warm_raw else \
                np.full(len(self.clips), math.nan)
        ok = np.isfinite(medians) & (medians > 0)
        self.clips = np.where(ok, np.maximum(np.where(ok, medians, 1.0), self.settings.clip_floor), self.clips)

    def _statistics(self) -> IntervalStatistics:
        if not self.raw_statistics:
            iv = self._interval
            return summarise_histogram(iv.counts, self.histogram.edges, math.sqrt(iv.count_var), iv.loss_sum,
                                       self.context.expected_batch_size * iv.steps)
        norms, losses = self._last_raw
        return summarise_raw(norms, losses)

    def _decide(self, t: int) -> None:
        ctx = self.context
        stats = self._statistics()
        eps_t = ctx.privacy_spent() if ctx.privacy_spent is not None else 0.0
        view = ControllerView(stats=stats, clips=tuple(self.clips), depths=ctx.pair_depths,
                              reference_norm=self.reference_norm, epsilon_ratio=eps_t / ctx.epsilon_target,
                              sigma_ratio=self.sigma / ctx.sigma_0, progress=t / ctx.planned_steps)
        layout: ObservationLayout = self.client.layout
        obs = layout.pack(adapter_features(view), global_features(view))
        if self.public_utility_records:  # potential-based on public validation (raydp.control.reward)
            if ctx.public_utility is None:
                raise ConfigError("reward: public-validation needs the run's public validation records")
            utility = float(ctx.public_utility())
            r = None if self._previous is None else potential_reward(utility, self._previous[0])
        else:  # Eq. 17-20 on the DP loss release
            utility = -stats.mean_loss if math.isfinite(stats.mean_loss) else 0.0
            r = None
            if self._previous is not None:
                r = rldp_reward(utility, self._previous[0], eps_t, self._previous[1], self.settings.r_max)
        action = layout.split_action(self.client.decide(obs, r), ctx.n_pairs)
        if self.modes.residual:  # the clips' factors on the schedule; sigma stays on the plan (noise_control off)
            self.residual = decode_residual(action[:-1], self.settings.residual_range)
            decoded = {"sigma_proposed": None, "step_size": None, "residual": [float(f) for f in self.residual],
                       "clip_next": [float(c) for c in self.dials(t).clip]}
        else:
            bounds = self.modes.clip_bounds  # None: Eq. 10 (paper)
            if bounds is not None and (self.pair_reference is None or len(self.pair_reference) != ctx.n_pairs):
                raise ConfigError("relative action decoding needs the public probe's per-pair norms")
            full = decode_action(action, self.sigma, ctx.sigma_0, eps_t, ctx.epsilon_target, self.settings.clip_floor,
                                 reference=None if bounds is None else self.pair_reference,
                                 bounds=bounds or RELATIVE_BOUNDS)
            self.clips = np.array(full.clip)
            if self.adaptive_sigma:  # noise_control off: the noise action is ignored, sigma stays on the plan
                self.sigma = full.sigma
            decoded = {"sigma_proposed": full.sigma_proposed, "step_size": full.step_size,
                       "clip_next": list(full.clip)}
        self._previous = (utility, eps_t)
        self.decisions.append({"step": t, "epsilon": eps_t, "utility": utility, "reward": r,
                               "action": [float(a) for a in action], "sigma_next": float(self.sigma),
                               **decoded, "privacy_mode": self.privacy_mode, "privacy_label": self.modes.label})
        self._interval = _Interval(ctx.n_pairs, self.settings.histogram_bins)

    # -- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return copy.deepcopy({"clips": self.clips.copy(), "residual": self.residual.copy(), "sigma": self.sigma, "interval": vars(self._interval).copy(),
                "warm": vars(self._warm).copy(), "warm_raw": list(self._warm_raw), "last_raw": self._last_raw,
                "previous": self._previous, "trace": list(self.trace), "decisions": list(self.decisions),
                "reference_norm": self.reference_norm,
                "pair_reference": self.pair_reference, "histogram": self.histogram, "loss_release": self.loss_release})

    def load_state_dict(self, state: dict) -> None:
        self.clips, self.sigma = np.array(state["clips"]), float(state["sigma"])
        self.residual = np.array(state.get("residual", np.ones(len(self.clips))))
        for name in ("interval", "warm"):
            getattr(self, f"_{name}").__dict__.update(state[name])
        self._warm_raw, self._last_raw = list(state["warm_raw"]), state["last_raw"]
        self._previous = state["previous"]
        self.trace, self.decisions = list(state["trace"]), list(state["decisions"])
        self.reference_norm = state["reference_norm"]
        self.pair_reference = state.get("pair_reference")
        self.histogram, self.loss_release = state["histogram"], state["loss_release"]

    # -- end of run --------------------------------------------------------------------------------
    def finish(self, output_dir: Path) -> dict:
        """Write the clip/noise trace and the decisions; leave the broker; return a summary."""
        if self.client is not None:
            self.client.end()
        n = self.context.n_pairs
        trace = {"step": [r["step"] for r in self.trace], "sigma": [r["sigma"] for r in self.trace],
                 "sigma_eff": [r["sigma_eff"] for r in self.trace], "clamped": [r["clamped"] for r in self.trace],
                 "decision": [r["decision"] for r in self.trace]}
        for i in range(n):
            trace[f"clip_{i}"] = [r["clip"][i] for r in self.trace]
        pq.write_table(pa.table(trace), output_dir / TRACE_FILE)
        if self.decisions:
            pq.write_table(pa.Table.from_pylist(self.decisions), output_dir / DECISIONS_FILE)
        rewards = [d["reward"] for d in self.decisions if d["reward"] is not None]
        return {  # no timing (latencies, weight versions): it depends on the private batch sizes
            "decisions": len(self.decisions),
            "transitions": len(rewards),
            "mean_reward": float(np.mean(rewards)) if rewards else None,
            "final_sigma": float(self.sigma),
            "final_clip": [float(c) for c in self.clips],
            "histogram_log10_range": [self.histogram.log10_low, self.histogram.log10_high],
            "loss_clip": self.loss_release.loss_clip,
            "action_decoding": self.settings.action_decoding,
            **({"schedule": self.settings.schedule.model_dump(), "residual_range": self.settings.residual_range,
                "final_residual": [float(f) for f in self.residual]} if self.modes.residual else {}),
            "pair_reference": None if self.pair_reference is None else [float(r) for r in self.pair_reference],
        }

    def describe(self) -> dict:
        out = super().describe()
        s = self.settings
        out.update({"t_warm": s.t_warm, "t_rl": s.t_rl, "b_sac": s.b_sac, "k": s.k, "r_max": s.r_max,
                    "architecture": s.architecture, "action_decoding": s.action_decoding,
                    "noise_control": s.noise_control, "policy": s.policy, "frozen": s.frozen, "reward": s.reward,
                    "strict_releases": [] if self.raw_statistics else
                    [{"name": "norm_histogram", "noise_multiplier": s.histogram_noise},
                     {"name": "loss_sum", "noise_multiplier": s.loss_noise}]})
        return out
