"""What a strategy may choose at a DP step, described as data the DP step carries out.

A strategy never runs the step. Before each step it describes the step's mechanism (:class:`Dials`):

* ``clip``: a radius per clip group (one per LoRA pair for pairwise clipping, one for flat clipping);
* ``sigma``: the gradient's true noise multiplier (ERRATA E1), or None to use the plan's (a strategy with
  a fixed schedule does not choose sigma; see :mod:`raydp.privacy.schedule`);
* ``scaling``: optionally, how a sample's gradient is scaled from its group norm instead of
  ``min(1, C / (norm + 1e-6))`` (automatic clipping, PSAC). The DP step checks ``scale * norm <= C``
  for every sample and group, so a scaling rule can change utility but never the sensitivity;
* ``transform``: optionally, an invertible affine map of the per-sample gradient applied before the
  norms and inverted after the noise (AdaClip's centring and scaling, GeoClip's basis). The release is
  the noisy clipped sum in the transformed coordinates; the inverse is post-processing of it.

Once per run a strategy declares its extra releases (:class:`DeclaredRelease`): Gaussian releases of
statistics of the same Poisson sample (a norm histogram, a count of unclipped samples, a clipped loss),
each with its sensitivity and its noise, a multiple of sigma or a fixed noise multiplier. The planner
(sigma_0 calibration), the guard and the step all read that one declaration: a step's releases compose
as one Gaussian mechanism (ERRATA E1, E3), 1/sigma_eff^2 = sum_j (sensitivity_j / noise_std_j)^2.

After the update the strategy observes :class:`StepRelease`: only post-processing of the releases.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from raydp.errors import ConfigError

#: Eq. 5's stabiliser in min(1, C / (norm + 1e-6)).
CLIP_EPS = 1e-6
#: a scaling rule may exceed its bound by this relative float error at most
SCALING_TOLERANCE = 1e-5


class ScalingRule(ABC):
    """Per-sample scale factors from group norms ``[batch, groups]`` and clips ``[groups]``; the result
    must satisfy ``factor * norm <= clip`` (checked by the DP step)."""

    name: str = "scaling"

    @abstractmethod
    def factors(self, norms: torch.Tensor, clips: torch.Tensor) -> torch.Tensor: ...


class ClipToRadius(ScalingRule):
    """Standard clipping (Abadi et al. 2016; RLDP Eq. 5): lambda = min(1, C / (norm + 1e-6))."""

    name = "clip"

    def factors(self, norms: torch.Tensor, clips: torch.Tensor) -> torch.Tensor:
        return torch.clamp(clips.unsqueeze(0) / (norms + CLIP_EPS), max=1.0)


CLIP = ClipToRadius()


class GradientTransform(ABC):
    """An invertible affine map ``T`` of the flattened per-sample gradient ``[batch, D]``.

    The step clips and noises ``T(g_b)``, releases ``S = sum_b clip(T(g_b)) + noise`` and sets the
    gradient to ``inverse_mean(S, B)``, an estimate of the mean of g over the expected batch size B
    (never the actual, private one: ERRATA E5). ``T`` must be fixed before the step from public values
    or earlier releases (it is then part of the mechanism, not data-dependent)."""

    name: str = "transform"

    @abstractmethod
    def forward(self, flat: torch.Tensor) -> torch.Tensor:
        """``[batch, D] -> [batch, D]``."""

    @abstractmethod
    def inverse_mean(self, noisy_sum: torch.Tensor, expected_batch_size: float) -> torch.Tensor:
        """``[D] -> [D]``: the mean gradient in the original coordinates, from the noisy transformed sum."""


@dataclass(frozen=True)
class Dials:
    """The mechanism of one step (see the module docstring). ``sigma`` is the true noise multiplier of
    the gradient release: the noise allocation makes the mechanism's sigma_eff equal to it (E1)."""

    clip: tuple[float, ...]
    sigma: float | None = None
    scaling: ScalingRule | None = None
    transform: GradientTransform | None = None


@dataclass(frozen=True)
class ReleaseNoise:
    """The noise of a declared release, per unit of its sensitivity: ``relative`` k gives std = k * sigma *
    sensitivity (a fixed share of the step); ``absolute`` z gives std = z * sensitivity whatever sigma is."""

    relative: float | None = None
    absolute: float | None = None

    def __post_init__(self) -> None:
        if (self.relative is None) == (self.absolute is None):
            raise ConfigError("a release's noise is either relative to sigma or absolute, exactly one")
        value = self.relative if self.relative is not None else self.absolute
        if not (value > 0 and math.isfinite(value)):
            raise ConfigError(f"a release's noise multiplier must be finite and > 0, got {value}")

    def std(self, sigma: float, sensitivity: float) -> float:
        return (self.relative * sigma if self.relative is not None else self.absolute) * sensitivity


@dataclass(frozen=True)
class SampleView:
    """What a declared release may read of the step's sample: per-unit pair norms ``[batch, n_pairs]``,
    group norms ``[batch, groups]`` (both in the transformed coordinates when there is a transform),
    per-unit losses ``[batch]`` and the step's dials (after the guard)."""

    pair_norms: torch.Tensor
    group_norms: torch.Tensor
    losses: torch.Tensor
    dials: Dials


class DeclaredRelease(ABC):
    """A Gaussian release of a statistic of the step's sample, charged with the gradient (ERRATA E3).

    ``value`` must change by at most ``sensitivity(n_pairs)`` in L2 when one privacy unit is added or
    removed (add/remove-one, E6); the noise is :attr:`noise`. Bins, thresholds and bounds may come from
    public data, from earlier releases, or from this step's dials; never from the private sample."""

    name: str
    noise: ReleaseNoise

    @abstractmethod
    def sensitivity(self, n_pairs: int) -> float: ...

    @abstractmethod
    def value(self, sample: SampleView) -> torch.Tensor: ...


def release_precisions(releases: Sequence[DeclaredRelease]) -> tuple[float, float]:
    """(relative, absolute) precision of the releases: the step's 1/sigma_eff^2 = (1 + relative) /
    sigma^2 + absolute (:class:`~raydp.privacy.calibration.SigmaEffMap`)."""
    relative = math.fsum(1.0 / r.noise.relative ** 2 for r in releases if r.noise.relative is not None)
    absolute = math.fsum(1.0 / r.noise.absolute ** 2 for r in releases if r.noise.absolute is not None)
    return relative, absolute


@dataclass
class StepRelease:
    """What one DP step released, and nothing else: post-processing of the Gaussian mechanisms' output."""

    step: int
    dials: Dials  # the dials actually used (after the guard; sigma filled in)
    sigma_eff: float  # as charged to the ledger
    clamped: bool
    noisy_sum_a: list[torch.Tensor]  # the released noisy clipped sums (transformed coordinates if any)
    noisy_sum_b: list[torch.Tensor]
    noisy_pair_norms: np.ndarray  # ||(noisy sum A_i, noisy sum B_i)||, one per pair
    #: the gradient set on the parameters (original coordinates, divided by the expected batch size),
    #: flattened pair by pair (A_0, B_0, A_1, B_1, ...)
    noisy_gradient: torch.Tensor | None = None
    #: parameter change of each trainable tensor; filled only for a strategy with ``observes_update``
    update: list[torch.Tensor] = field(default_factory=list)
    #: the declared releases, noisy, by name
    statistics: dict[str, np.ndarray] = field(default_factory=dict)
    #: the noise std each statistic was released with (public: it follows from sigma)
    statistics_noise_std: dict[str, float] = field(default_factory=dict)
    #: paper mode only (ERRATA E3): the UNPRIVATIZED per-sample pair norms [batch, n] and losses [batch]
    raw_pair_norms: np.ndarray | None = None
    raw_losses: np.ndarray | None = None


def flatten_pairs(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], batched: bool) -> torch.Tensor:
    """Concatenate pair tensors A_0, B_0, A_1, B_1, ... into ``[batch, D]`` (batched) or ``[D]``."""
    parts = []
    for ta, tb in zip(a, b):
        parts += [ta.flatten(1), tb.flatten(1)] if batched else [ta.flatten(), tb.flatten()]
    return torch.cat(parts, dim=1 if batched else 0)

