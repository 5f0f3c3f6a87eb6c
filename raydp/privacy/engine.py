"""The DP step: per-sample gradients, clipping, correctly calibrated noise, ledger, guard (RLDP Sec. 2.3).

:class:`DPStep` is the gradient computation of every DP strategy (it plugs into
:class:`raydp.runner.Trainer`); a strategy only describes the mechanism
(:mod:`raydp.privacy.mechanism`). Per step, in order (the stages of :meth:`DPStep.compute`, like
Opacus's ``DPOptimizer.pre_step``):

1. ``prepare``: the strategy's dials; sigma is the plan's sigma_t for a fixed schedule, or the strategy's
   proposal for adaptive sigma, which the Renyi filter's guard may raise (E4, E13);
2. ``per_sample_gradients``: one contribution per privacy unit (a patient, E11: its records' gradients
   summed) from the gradient source: per-sample gradients of the LoRA pairs (one hook per matrix; off the CPU
   each record in a pass of its own, so that no record changes another's: ``clipping.isolates_records``; the
   strategy's transform, if any, is applied), or, for a ghost-clipping source
   (:mod:`raydp.privacy.ghost`), the contributions' norms only; a unit with a non-finite loss or
   gradient contributes zero;
3. ``clip``: pairwise (Eq. 4-5) or flat group norms, the scaling rule (default min(1, C/(norm+1e-6))),
   whose bound ``scale * norm <= C`` is checked, and the sum over the Poisson sample of units (a ghost
   source sums by a second backward pass weighted by the factors);
4. ``declare``: the step's releases (the gradient, plus the strategy's declared statistics on the same
   sample): together one Gaussian mechanism of multiplier sigma_eff (E1, E3) that the guard must admit;
5. ``add_noise``: Gaussian noise with per-group std s_g from the allocation, so that the gradient's true
   multiplier sigma_eff = (sum_g C_g^2 / s_g^2)^(-1/2) equals the sigma charged (E1), drawn from a
   secret generator (OS entropy, E12);
6. ``set_gradient``: the inverse transform and normalisation by the expected number of units q*N,
   never the actual one (E5);
7. ``record``: the ledger row (q, sigma_eff, clip vector, allocation; add/remove-one of a unit, E6).

After the optimiser update the strategy observes the release (:class:`~raydp.privacy.mechanism.StepRelease`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch

from raydp.privacy.clipping import (
    PairLayout,
    PerSampleGradientComputer,
    PerSampleGrads,
    combine_units,
    group_norms,
    pair_norms,
    pair_noise_stds,
    zero_nonfinite,
)
from raydp.privacy.guard import BudgetExhausted
from raydp.privacy.ledger import PrivacyLedger, Release, allocate_noise, combine_sigma_eff, gradient_release
from raydp.privacy.mechanism import (
    CLIP,
    SCALING_TOLERANCE,
    DeclaredRelease,
    Dials,
    SampleView,
    StepRelease,
    flatten_pairs,
    release_precisions,
)
from raydp.privacy.randomness import PrivateRandomness
from raydp.privacy.schedule import SigmaSchedule

#: The noise added is for sigma / (1 - margin): slightly more than the sigma charged (float32 noise).
NOISE_ROUNDING_MARGIN = 1e-6


def transform_rows(transform, flat: torch.Tensor) -> torch.Tensor:
    """A strategy's transform of the per-sample gradients, one contribution at a time: a transform that mixes
    coordinates (GeoClip's basis) is a matrix product whose kernels would follow the batch's size, so one unit would
    change the others' transformed gradients (on this CPU by up to 9e-8 relative at B >= 2: ERRATA E17)."""
    if flat.shape[0] <= 1:
        return transform.forward(flat)
    return torch.cat([transform.forward(row) for row in flat.split(1)])


@dataclass
class _Prepared:
    step: int
    dials: Dials  # sigma filled in
    clamped: bool


class DPStep:
    """Gradient computation of a DP run; owns the per-sample machinery, the noise RNG and the ledger.

    ``strategy``: anything with the :class:`raydp.strategies.base.Strategy` interface (``dials``,
    ``releases``, ``schedule``, ``observe``...; the privacy package does not import strategies).
    ``guard``: a :class:`~raydp.privacy.guard.BudgetGuard` (fixed schedules) or a
    :class:`~raydp.privacy.filter.FilterGuard` (adaptive sigma). ``sigma_0``: the plan's scale (default:
    the strategy context's). ``randomness``: the run's secret seeds (default: fresh OS entropy, ERRATA
    E12); only the noise seed is used here (the noise, and the slots of a slotted GPU pass). ``gradients``: the
    per-sample gradient source (default: one hook per LoRA matrix,
    :class:`~raydp.privacy.clipping.PerSampleGradientComputer`)."""

    def __init__(
        self,
        model: torch.nn.Module,
        pairs,
        strategy,
        ledger: PrivacyLedger,
        guard,
        q: float,
        expected_batch_size: float,
        planned_steps: int,
        device: torch.device,
        randomness: PrivateRandomness | None = None,
        sigma_0: float | None = None,
        gradients=None,
    ):
        self.pairs = pairs
        self.strategy = strategy
        self.ledger = ledger
        self.guard = guard
        self.q = q
        self.expected_batch_size = float(expected_batch_size)
        self.planned_steps = planned_steps
        self.device = device
        self.name = f"dp:{strategy.name}"
        self.private = True
        self.per_sample = gradients if gradients is not None else PerSampleGradientComputer(model, pairs)
        self.layout = getattr(self.per_sample, "layout", None) or PairLayout.of(
            [p.a for p in pairs], [p.b for p in pairs], batched=False)
        self._constants: dict[tuple, torch.Tensor] = {}  # small host values on the device, by value (no copy per step)
        self.randomness = randomness if randomness is not None else PrivateRandomness.fresh()
        self.noise = self.randomness.noise(device)
        bind_slots = getattr(self.per_sample, "draw_slots_from", None)
        if bind_slots is not None:  # a slotted GPU pass draws its records' slots from the run's secret randomness
            bind_slots(self.randomness.slot_rng())
        self.adaptive = bool(strategy.adaptive_sigma)
        self.schedule: SigmaSchedule = strategy.schedule()
        if self.adaptive and not self.schedule.is_constant:
            raise ValueError("an adaptive-sigma strategy plans a constant schedule (the Renyi filter's budget)")
        self.sigma_0 = float(sigma_0 if sigma_0 is not None else strategy.context.sigma_0)
        self._releases: tuple[DeclaredRelease, ...] | None = None
        self._prepared: _Prepared | None = None
        self._last_proposal: tuple[float, float, bool] | None = None
        self._pending: StepRelease | None = None
        self._before_update: torch.Tensor | None = None
        self.clamp_events: list[dict] = []
        self._last_clip: tuple[float, ...] | None = None  # the previous step's clips (for clip_changes)
        self._clip_change: tuple[float, ...] = ()

    @property
    def releases(self) -> tuple[DeclaredRelease, ...]:
        """The strategy's declared releases, read at the first step (public parameters such as histogram
        bins are placed by then) and fixed for the run; their noise must be the one sigma_0 was
        calibrated with (the guard's sigma map)."""
        if self._releases is None:
            releases = tuple(self.strategy.releases())
            relative, absolute = release_precisions(releases)
            smap = self.guard.sigma_map
            if smap.fn is None and (not math.isclose(relative, smap.relative_precision, rel_tol=1e-12, abs_tol=0)
                                    or not math.isclose(absolute, smap.extra_precision, rel_tol=1e-12, abs_tol=0)):
                raise ValueError("the strategy's declared releases are not the ones sigma_0 was calibrated for")
            self._releases = releases
        return self._releases

    def public_probe(self, batch) -> tuple[np.ndarray, np.ndarray]:
        """Per-sample pair norms and losses of a batch of PUBLIC records (no release, nothing charged)."""
        if getattr(self.per_sample, "ghost", False):
            grads = self.per_sample.contributions(batch)
            norms = grads.pair_norms()
            grads.row_losses = None  # no second pass
        else:
            grads = self._per_sample(batch)
            norms = pair_norms(grads)
        return norms.detach().cpu().numpy(), grads.losses.detach().cpu().numpy()

    # -- 1. the step's mechanism ---------------------------------------------------------------------
    def planned_sigma(self, step: int) -> float:
        """sigma_t of the plan: sigma_0 times the schedule's multiplier (:mod:`raydp.privacy.schedule`)."""
        return self.sigma_0 * self.schedule.multiplier(step, self.q)

    def _guarded(self, proposed: float) -> tuple[float, bool]:
        """Adaptive sigma: the proposal if the filter's plan stays within budget, else its minimum. The
        guard is consulted when the proposal changes: the sigma chosen for an equal earlier proposal
        still keeps the spent curve plus the remaining steps under the budget."""
        if self._last_proposal is not None and self._last_proposal[0] == proposed:
            return self._last_proposal[1], self._last_proposal[2]
        remaining = self.planned_steps - len(self.ledger)
        sigma, clamped = self.guard.clamp(proposed, self.ledger, remaining)
        self._last_proposal = (proposed, sigma, clamped)
        return sigma, clamped

    def prepare(self, step: int) -> _Prepared:
        """The dials of ``step`` with sigma decided; raises BudgetExhausted when no step may run."""
        if self._prepared is not None and self._prepared.step == step:
            return self._prepared
        if step >= self.planned_steps:  # sigma_0 and the guard's plan cover exactly the planned steps
            raise BudgetExhausted(
                f"the {self.planned_steps} planned steps are done; the budget was calibrated for them",
                spent=self.guard.spent(self.ledger), epsilon_target=self.guard.epsilon_target,
                steps_done=step, remaining_steps=0)
        proposal = self.strategy.dials(step)
        planned = self.planned_sigma(step)
        if self.adaptive:
            if proposal.sigma is None:
                raise ValueError(f"strategy {self.strategy.name!r} has adaptive sigma but proposed none")
            sigma, clamped = self._guarded(float(proposal.sigma))
        else:  # a fixed schedule: the ledger is the planned composition (ERRATA E13)
            if proposal.sigma is not None and proposal.sigma > planned * (1 + 1e-9):
                raise ValueError(f"strategy {self.strategy.name!r} proposed sigma={proposal.sigma:g} above its "
                                 f"fixed plan ({planned:g}); a strategy that chooses sigma declares adaptive_sigma")
            sigma, clamped = planned, proposal.sigma is not None and proposal.sigma < planned * (1 - 1e-9)
        if clamped:
            self.clamp_events.append({"step": step, "proposed": proposal.sigma, "sigma": sigma})
        dials = replace(proposal, clip=tuple(float(c) for c in proposal.clip), sigma=sigma)
        mode = self.strategy.clip_mode
        if mode == "flat" and len(dials.clip) != 1:
            raise ValueError(f"flat clipping takes one clip radius, got {len(dials.clip)}")
        if mode == "pairwise" and len(dials.clip) != len(self.pairs):
            raise ValueError(f"pairwise clipping takes {len(self.pairs)} radii, got {len(dials.clip)}")
        self._prepared = _Prepared(step, dials, clamped)
        return self._prepared

    def stop_reason(self, step: int) -> str | None:
        """Why training must stop before ``step`` (planned steps done, budget exhausted), or None."""
        try:
            self.prepare(step)
        except BudgetExhausted as stop:
            return str(stop)
        return None

    # -- the step ----------------------------------------------------------------------------------
    def compute(self, model: torch.nn.Module, batch) -> dict:
        step = len(self.ledger)
        prepared = self.prepare(step)  # 1
        dials, mode = prepared.dials, self.strategy.clip_mode
        grads = self.per_sample_gradients(batch, dials)  # 2
        norms = grads.pair_norms()
        groups = group_norms(norms, mode)
        clipped = self.clip(grads, groups, dials, mode)  # 3
        charged_stds = allocate_noise(dials.sigma, dials.clip, self.strategy.allocation)  # E1, once per step
        releases = self.declare(dials, charged_stds)  # 4
        self.guard.admit(self.ledger, self.q, combine_sigma_eff(releases))
        noisy = self.add_noise(clipped, charged_stds, mode)  # 5
        gradient = self.set_gradient(noisy, dials)  # 6
        sample = SampleView(norms, groups, grads.losses, dials)
        statistics, statistics_std = self.release_statistics(sample, releases[1:])
        sigma_eff = self.ledger.record(self.q, releases, clip=dials.clip, allocation=self.strategy.allocation)  # 7
        noisy_pair_norms = self.layout.segment_norms(noisy.double())
        values = torch.cat([noisy_pair_norms, gradient.double().norm().reshape(1)]).cpu().numpy()  # the step's one sync
        noisy_norms, grad_norm = values[:-1], values[-1]
        noisy_a, noisy_b = self.layout.split(noisy, batched=False)
        self._pending = StepRelease(step, dials, sigma_eff, prepared.clamped, noisy_a, noisy_b, noisy_norms,
                                    noisy_gradient=gradient, statistics=statistics,
                                    statistics_noise_std=statistics_std)
        if self.strategy.raw_statistics:  # unprivatized, labelled (ERRATA E3)
            self._pending.raw_pair_norms = norms.detach().cpu().numpy()
            self._pending.raw_losses = grads.losses.detach().cpu().numpy()
        self._before_update = self._parameters_flat() if self.strategy.observes_update else None
        self._prepared = None
        self._clip_change = () if self._last_clip is None else tuple(
            new / old for new, old in zip(dials.clip, self._last_clip))
        self._last_clip = tuple(dials.clip)
        # Only post-processing of the release is reported: no raw loss, no actual batch size (E3, E5).
        return {
            "sigma": dials.sigma,
            "sigma_eff": sigma_eff,
            "clamped": prepared.clamped,
            "clip_mean": float(np.mean(dials.clip)),
            "noisy_grad_norm": float(grad_norm),
        }

    # -- 2. per-sample gradients ---------------------------------------------------------------------
    def per_sample_gradients(self, batch, dials: Dials):
        """One contribution per privacy unit, zero for a non-finite one, in the transform's coordinates:
        :class:`PerSampleGrads`, or a ghost source's :class:`~raydp.privacy.ghost.GhostContributions`
        (norms now, the clipped sum later)."""
        if batch.size > 0 and getattr(self.per_sample, "ghost", False):
            if dials.transform is not None:
                raise ValueError(f"strategy {self.strategy.name!r} transforms per-sample gradients; ghost "
                                 "clipping never forms them")
            return self.per_sample.contributions(batch)
        if batch.size > 0:
            grads = self._per_sample(batch)
            n_units = batch.n_units if batch.unit_index is not None else None
            grads = zero_nonfinite(grads)
            if batch.unit_index is not None:  # a unit's sum of finite records can still overflow
                grads = zero_nonfinite(combine_units(grads, batch.unit_index, n_units))
        else:  # an empty Poisson sample still releases noise
            dtype = self.pairs[0].a.dtype if self.pairs else torch.float32
            grads = PerSampleGrads(torch.zeros((0, self.layout.dim), dtype=dtype, device=self.device), self.layout,
                                   torch.zeros(0, device=self.device))
        if dials.transform is not None:  # a finite gradient may overflow in T: zero it again after T
            grads = zero_nonfinite(PerSampleGrads(transform_rows(dials.transform, grads.flat), grads.layout,
                                                  grads.losses))
        return grads

    def _per_sample(self, batch) -> PerSampleGrads:
        """The gradient source on a batch; a classification batch's labels go with it (a source for a
        task without labels keeps its two-argument ``compute``)."""
        labels = getattr(batch, "labels", None)
        if labels is None:
            return self.per_sample.compute(batch.input_ids, batch.attention_mask)
        return self.per_sample.compute(batch.input_ids, batch.attention_mask, labels)

    # -- 3. clipping ---------------------------------------------------------------------------------
    def clip(self, grads: PerSampleGrads, groups: torch.Tensor, dials: Dials, mode: str) -> torch.Tensor:
        """Scale each unit's group to norm <= C and sum (flattened, ``[D]``). A strategy's own scaling rule has
        its bound checked (a device sync); the standard rule (Eq. 5) meets it by construction."""
        clips = self._on_device(tuple(dials.clip), groups.dtype)
        scaling = dials.scaling if dials.scaling is not None else CLIP
        factors = scaling.factors(groups, clips)
        if factors.shape != groups.shape:
            raise ValueError(f"scaling rule {scaling.name!r} must give factors of shape {tuple(groups.shape)}")
        factors = factors.to(groups.dtype)  # the cap below and the threshold are in the norms' dtype
        zero = torch.zeros((), dtype=factors.dtype, device=factors.device)
        tiny = torch.finfo(factors.dtype).tiny
        finite = torch.isfinite(groups)  # a norm beyond the float range: that unit contributes nothing
        # A factor below the smallest normal number has lost its relative precision (a finite norm near the top of
        # the float range): C / norm may round up by far more than the margin, so such a unit contributes nothing
        # (negative factors are kept for the check: a rule that gives one is broken).
        factors = torch.where(finite & ((factors >= tiny) | (factors < 0)), factors, zero)
        if scaling is not CLIP:
            scaled = factors * torch.where(finite, groups, zero)
            broken = ~torch.isfinite(scaled) | (factors < 0) | (scaled > clips.unsqueeze(0) * (1 + SCALING_TOLERANCE))
            if bool(broken.any()):  # one device sync
                raise ValueError(f"scaling rule {scaling.name!r} broke its bound 0 <= scale, scale * norm <= C; the "
                                 "sensitivity would exceed the clip")
        # Within the tolerance is still not within C: cap every factor at C / norm, so the sensitivity is C
        # up to float32 rounding (~1e-7, covered by the noise margin). This cap alone bounds every contribution.
        factors = torch.where(groups > 0, torch.minimum(factors, clips.unsqueeze(0) / groups), factors)
        factors = torch.where(factors >= tiny, factors, zero)  # the cap C / norm may itself be subnormal
        return grads.clipped_sums(factors, mode)

    def _on_device(self, values: tuple[float, ...], dtype: torch.dtype) -> torch.Tensor:
        """A small tuple of public floats as a device tensor, copied once per distinct value (a fixed clip vector
        costs no host-to-device copy per step)."""
        key = (values, dtype)
        if key not in self._constants:
            if len(self._constants) > 64:
                self._constants.clear()
            self._constants[key] = torch.tensor(values, dtype=dtype, device=self.device)
        return self._constants[key]

    # -- 4. the step's releases ------------------------------------------------------------------------
    def declare(self, dials: Dials, charged_stds) -> list[Release]:
        """The gradient release (normalised: sensitivity 1, std sigma_eff) and the declared statistics."""
        releases = [gradient_release(dials.clip, charged_stds, sigma=dials.sigma)]  # exactly sigma: one value a plan
        for declared in self.releases:  # on the same sample (ERRATA E3)
            sensitivity = declared.sensitivity(len(self.pairs))
            releases.append(Release(declared.name, sensitivity, declared.noise.std(dials.sigma, sensitivity)))
        return releases

    # -- 5. noise ----------------------------------------------------------------------------------------
    def add_noise(self, clipped: torch.Tensor, charged_stds, mode: str) -> torch.Tensor:
        """Gaussian noise on the flattened clipped sum, each pair's entries with its std (one draw of D values); the
        noisy sum is returned in the parameters' dtype.

        Noise is drawn in float32 (relative rounding ~6e-8): add noise for a sigma a hair above the one
        the guard approved and the ledger charges, so the charge never exceeds the noise added."""
        stds = pair_noise_stds(charged_stds / (1.0 - NOISE_ROUNDING_MARGIN), len(self.pairs), mode)
        per_pair = self._on_device(tuple(stds), torch.float64)
        per_column = per_pair[self.layout.pair_of_column(clipped.device)]
        noise = self.noise.randn(clipped.shape).to(clipped.device)
        noisy = clipped.double() + per_column * noise.double()  # the sum is float64 (clipped_sums): added there
        return noisy.to(self.pairs[0].a.dtype if self.pairs else torch.float32)  # rounding the release: post-processing

    def release_statistics(self, sample: SampleView, releases: list[Release]):
        statistics, stds = {}, {}
        for declared, release in zip(self.releases, releases):
            value = declared.value(sample)
            noise = self.noise.randn(value.shape, dtype=value.dtype).to(value.device)
            statistics[declared.name] = (value + noise * release.noise_std / (1.0 - NOISE_ROUNDING_MARGIN)).cpu().numpy()
            stds[declared.name] = release.noise_std
        return statistics, stds

    # -- 6. the gradient -------------------------------------------------------------------------------
    def set_gradient(self, noisy: torch.Tensor, dials: Dials) -> torch.Tensor:
        """Mean gradient over the EXPECTED number of units (E5), in the original coordinates; returns it
        flattened (post-processing of the release)."""
        if dials.transform is not None:
            flat = dials.transform.inverse_mean(noisy, self.expected_batch_size)
        else:
            flat = noisy / self.expected_batch_size
        grad_a, grad_b = self.layout.split(flat, batched=False)
        for pair, ga, gb in zip(self.pairs, grad_a, grad_b):
            pair.a.grad = ga.to(pair.a.dtype)
            pair.b.grad = gb.to(pair.b.dtype)
        return flat.detach()

    def clip_changes(self) -> list[tuple[torch.Tensor, float]]:
        """(parameter, k) for each LoRA parameter whose clip group's radius changed by the factor k from the
        previous step to this one (a flat clip: every parameter); the loop may rescale the parameter's
        optimizer moments by it (:class:`raydp.runner.loop.Trainer`, ``rescale_moments``). Public: the clips
        are the strategy's choices."""
        if not self._clip_change:
            return []
        factors = self._clip_change * len(self.pairs) if len(self._clip_change) == 1 else self._clip_change
        return [(t, k) for pair, k in zip(self.pairs, factors) if k != 1.0 for t in (pair.a, pair.b)]

    # -- checkpoints and controller hooks ----------------------------------------------------------
    def wants_checkpoint(self, step: int) -> bool:
        return self.strategy.wants_decision(step)

    def between_steps(self, step: int) -> None:
        self.strategy.between_steps(step)

    def state_dict(self) -> dict:
        # No RNG state: a resumed run draws fresh secret randomness (ERRATA E12, raydp.privacy.randomness).
        return {"ledger": self.ledger.to_arrow(), "clamp_events": list(self.clamp_events),
                "strategy": self.strategy.state_dict(), "randomness_source": self.randomness.source,
                "last_clip": self._last_clip}

    def load_state_dict(self, state: dict) -> None:
        """Restore a checkpoint into a fresh run: the ledger gets exactly the checkpoint's rows."""
        if len(self.ledger):
            raise ValueError("restore a DP step before its first step, into an empty ledger")
        self.ledger.extend_from_arrow(state["ledger"])
        if not self.adaptive:  # a fixed schedule resumes only its own plan (a changed config would mix plans)
            planned = [self.guard.sigma_map(self.planned_sigma(t)) for t in range(len(self.ledger))]
            if len(self.ledger) > self.planned_steps or not np.allclose(self.ledger.sigma_eff, planned, rtol=1e-9) \
                    or not np.allclose(self.ledger.q, self.q, rtol=1e-12):
                raise ValueError("the checkpoint's ledger is not a prefix of this run's plan (q, sigma_t): resume "
                                 "with the configuration that produced it")
        self.clamp_events = list(state["clamp_events"])
        self._last_clip = state.get("last_clip")
        self.strategy.load_state_dict(state["strategy"])
        self._prepared = None

    def after_update(self, model: torch.nn.Module) -> None:
        """Hand the release (now with the parameter update) to the strategy."""
        if self._pending is None:
            return
        if self._before_update is not None:  # only for a strategy that reads it (a copy of every LoRA parameter)
            change_a, change_b = self.layout.split(self._parameters_flat() - self._before_update, batched=False)
            self._pending.update = [t for pair in zip(change_a, change_b) for t in pair]
        self.strategy.observe(self._pending, self.ledger)
        self._pending, self._before_update = None, None

    def _parameters_flat(self) -> torch.Tensor:
        """The LoRA parameters as one flat copy (A_0, B_0, A_1, ...)."""
        return flatten_pairs([p.a.detach() for p in self.pairs], [p.b.detach() for p in self.pairs], batched=False)
