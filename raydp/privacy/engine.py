"""The DP step: per-sample gradients, clipping, correctly calibrated noise, ledger, guard (RLDP Sec. 2.3).

:class:`DPStep` is the gradient computation of every DP strategy (it plugs into
:class:`raydp.runner.Trainer`). Per step, in order:

1. the strategy proposes the dials (clip per group, sigma); the budget guard may raise sigma (E4);
2. per-sample gradients of the LoRA pairs (Opacus ``GradSampleModule``, hooks); a sample with a
   non-finite loss or gradient contributes zero; the records of one privacy unit (a patient, E11) are
   summed into one contribution;
3. pairwise (Eq. 4-5) or flat clipping and the sum over the Poisson sample of units;
4. the step's releases are declared (the gradient, plus the strategy's own statistics,
   :mod:`raydp.privacy.statistics`, on the same sample with noise scaled by sigma): together one
   Gaussian mechanism of multiplier sigma_eff (E1, E3), which the guard must admit (the Renyi filter's
   halting rule for adaptive sigma, E13);
5. Gaussian noise with per-group std s_g from the allocation, so that the gradient's true multiplier
   sigma_eff = (sum_g C_g^2 / s_g^2)^(-1/2) equals the sigma charged (E1), drawn from a secret
   generator (OS entropy, E12);
6. normalisation by the expected number of units q*N, never the actual one (E5);
7. the ledger records the step (q, sigma_eff, clip vector, allocation; add/remove-one of a unit, E6).

After the optimiser update the strategy observes the release (noisy sums, their norms, the update).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from raydp.privacy.clipping import (
    PerSampleGradientComputer,
    clip_factors,
    clipped_sums,
    combine_units,
    group_norms,
    pair_noise_stds,
    pair_norms,
    zero_nonfinite,
)
from raydp.privacy.guard import BudgetExhausted, BudgetGuard
from raydp.privacy.ledger import PrivacyLedger, Release, allocate_noise, combine_sigma_eff, gradient_release
from raydp.privacy.randomness import PrivateRandomness
from raydp.strategies.base import Dials, StepRelease, Strategy


#: The noise added is for sigma / (1 - margin): slightly more than the sigma charged (float32 noise).
NOISE_ROUNDING_MARGIN = 1e-6


class DPStep:
    """Gradient computation of a DP run; owns the per-sample machinery, the noise RNG and the ledger."""

    def __init__(
        self,
        model: torch.nn.Module,
        pairs,
        strategy: Strategy,
        ledger: PrivacyLedger,
        guard: BudgetGuard,
        q: float,
        expected_batch_size: float,
        planned_steps: int,
        device: torch.device,
        randomness: PrivateRandomness | None = None,
    ):
        """``guard``: a :class:`BudgetGuard` (fixed schedules) or a
        :class:`~raydp.privacy.filter.FilterGuard` (adaptive sigma). ``randomness``: the run's secret
        seeds (default: fresh OS entropy, ERRATA E12); only the noise seed is used here."""
        self.pairs = pairs
        self.strategy = strategy
        self.ledger = ledger
        self.guard = guard
        self.q = q
        self.expected_batch_size = float(expected_batch_size)
        self.planned_steps = planned_steps
        self.device = device
        self.name = f"dp:{strategy.name}"
        self.per_sample = PerSampleGradientComputer(model, pairs)
        self.randomness = randomness if randomness is not None else PrivateRandomness.fresh()
        self.noise = self.randomness.noise(device)
        self._last_guarded: tuple[float, float, bool] | None = None
        self._pending: StepRelease | None = None
        self._before_update: list[torch.Tensor] = []
        self.clamp_events: list[dict] = []
        self._statistics: tuple | None = None

    @property
    def statistics(self) -> tuple:
        """The strategy's per-step releases; fixed at the first step (the guard's sigma map assumes them)."""
        if self._statistics is None:
            self._statistics = tuple(self.strategy.private_statistics())
            declared = sorted(self.strategy.release_noise_multipliers())
            if sorted(s.noise_multiplier for s in self._statistics) != declared:
                raise ValueError("the strategy's statistics do not match the noise multipliers it declared "
                                 "for calibration")
        return self._statistics

    def public_probe(self, batch) -> tuple[np.ndarray, np.ndarray]:
        """Per-sample pair norms and losses of a batch of PUBLIC records (no release, nothing charged)."""
        grads = self.per_sample.compute(batch.input_ids, batch.attention_mask)
        return pair_norms(grads).detach().cpu().numpy(), grads.losses.detach().cpu().numpy()

    # -- budget guard ------------------------------------------------------------------------------
    def guarded_sigma(self, proposed: float) -> tuple[float, bool]:
        """The sigma to use: the proposal if the plan stays within budget, else the guard's minimum.

        The guard is consulted only when the proposal changes: the sigma chosen for an earlier, equal
        proposal and used at every step since still keeps ledger + remaining steps within budget.
        """
        if self._last_guarded is not None and self._last_guarded[0] == proposed:
            return self._last_guarded[1], self._last_guarded[2]
        remaining = self.planned_steps - len(self.ledger)
        sigma, clamped = self.guard.clamp(proposed, self.ledger, remaining)
        if clamped:
            self.clamp_events.append({"step": len(self.ledger), "proposed": proposed, "sigma": sigma})
        self._last_guarded = (proposed, sigma, clamped)
        return sigma, clamped

    # -- the step ----------------------------------------------------------------------------------
    def compute(self, model: torch.nn.Module, batch) -> dict:
        step = len(self.ledger)
        if step >= self.planned_steps:  # sigma_0 and the guard's plan cover exactly the planned steps
            raise BudgetExhausted(
                f"the {self.planned_steps} planned steps are done; the budget was calibrated for them",
                spent=self.guard.spent(self.ledger), epsilon_target=self.guard.epsilon_target,
                steps_done=step, remaining_steps=0,
            )
        proposal = self.strategy.dials(step)
        sigma, clamped = self.guarded_sigma(proposal.sigma)
        dials = Dials(clip=tuple(float(c) for c in proposal.clip), sigma=sigma)
        mode = self.strategy.clip_mode
        if mode == "flat" and len(dials.clip) != 1:
            raise ValueError(f"flat clipping takes one clip radius, got {len(dials.clip)}")
        if mode == "pairwise" and len(dials.clip) != len(self.pairs):
            raise ValueError(f"pairwise clipping takes {len(self.pairs)} radii, got {len(dials.clip)}")
        clips = torch.tensor(dials.clip, dtype=torch.float32, device=self.device)

        if batch.size > 0:
            grads = self.per_sample.compute(batch.input_ids, batch.attention_mask)
            grads = zero_nonfinite(combine_units(zero_nonfinite(grads), batch.unit_index))
            norms, losses = pair_norms(grads), grads.losses
            factors = clip_factors(group_norms(norms, mode), clips)
            sums_a, sums_b = clipped_sums(grads, factors, mode)
        else:  # an empty Poisson sample still releases noise
            norms = torch.zeros(0, len(self.pairs), device=self.device)
            losses = torch.zeros(0, device=self.device)
            sums_a = [torch.zeros_like(p.a) for p in self.pairs]
            sums_b = [torch.zeros_like(p.b) for p in self.pairs]

        # The step's releases, declared before any noise is drawn: the guard must admit them (E13).
        charged_stds = allocate_noise(sigma, dials.clip, self.strategy.allocation)
        releases = [gradient_release(dials.clip, charged_stds)]
        for stat in self.statistics:  # the strategy's own releases, on the same sample (ERRATA E3)
            sensitivity = stat.sensitivity(len(self.pairs))
            releases.append(Release(stat.name, sensitivity, stat.noise_multiplier * sigma * sensitivity))
        self.guard.admit(self.ledger, self.q, combine_sigma_eff(releases))

        # Noise is drawn in float32 (relative rounding ~6e-8): add noise for a sigma a hair above the
        # one the guard approved and the ledger charges, so the charge never exceeds the noise added.
        stds = pair_noise_stds(charged_stds / (1.0 - NOISE_ROUNDING_MARGIN), len(self.pairs), mode)
        noisy_a = [s + std * self.noise.randn(s.shape) for s, std in zip(sums_a, stds)]
        noisy_b = [s + std * self.noise.randn(s.shape) for s, std in zip(sums_b, stds)]
        for pair, ga, gb in zip(self.pairs, noisy_a, noisy_b):
            pair.a.grad = (ga / self.expected_batch_size).to(pair.a.dtype)
            pair.b.grad = (gb / self.expected_batch_size).to(pair.b.dtype)
        statistics, statistics_std = {}, {}
        for stat, release in zip(self.statistics, releases[1:]):
            value = stat.raw(norms, losses)
            noise = self.noise.randn(value.shape, dtype=value.dtype).to(value.device)
            statistics[stat.name] = (value + noise * release.noise_std / (1.0 - NOISE_ROUNDING_MARGIN)).cpu().numpy()
            statistics_std[stat.name] = release.noise_std
        sigma_eff = self.ledger.record(self.q, releases, clip=dials.clip, allocation=self.strategy.allocation)
        noisy_norms = np.array([math.sqrt(float(a.pow(2).sum() + b.pow(2).sum())) for a, b in zip(noisy_a, noisy_b)])
        self._pending = StepRelease(step, dials, sigma_eff, clamped, noisy_a, noisy_b, noisy_norms,
                                    statistics=statistics, statistics_noise_std=statistics_std)
        if self.strategy.privacy_mode == "paper":  # unprivatized, labelled (ERRATA E3)
            self._pending.raw_pair_norms = norms.detach().cpu().numpy()
            self._pending.raw_losses = losses.detach().cpu().numpy()
        self._before_update = [t.detach().clone() for p in self.pairs for t in (p.a, p.b)]
        # Only post-processing of the release is reported: no raw loss, no actual batch size (E3, E5).
        return {
            "sigma": sigma,
            "sigma_eff": sigma_eff,
            "clamped": clamped,
            "clip_mean": float(np.mean(dials.clip)),
            "noisy_grad_norm": float(np.linalg.norm(noisy_norms)) / self.expected_batch_size,
        }

    # -- checkpoints and controller hooks ----------------------------------------------------------
    def wants_checkpoint(self, step: int) -> bool:
        return self.strategy.wants_decision(step)

    def between_steps(self, step: int) -> None:
        self.strategy.between_steps(step)

    def state_dict(self) -> dict:
        # No RNG state: a resumed run draws fresh secret randomness (ERRATA E12, raydp.privacy.randomness).
        return {"ledger": self.ledger.to_arrow(), "clamp_events": list(self.clamp_events),
                "strategy": self.strategy.state_dict(), "randomness_source": self.randomness.source}

    def load_state_dict(self, state: dict) -> None:
        """Restore a checkpoint into a fresh run: the ledger gets exactly the checkpoint's rows."""
        if len(self.ledger):
            raise ValueError("restore a DP step before its first step, into an empty ledger")
        self.ledger.extend_from_arrow(state["ledger"])
        self.clamp_events = list(state["clamp_events"])
        self.strategy.load_state_dict(state["strategy"])

    def after_update(self, model: torch.nn.Module) -> None:
        """Hand the release (now with the parameter update) to the strategy."""
        if self._pending is None:
            return
        after = [t.detach() for p in self.pairs for t in (p.a, p.b)]
        self._pending.update = [new - old for new, old in zip(after, self._before_update)]
        self.strategy.observe(self._pending, self.ledger)
        self._pending, self._before_update = None, []
