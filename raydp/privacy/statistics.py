"""Gaussian releases of training statistics for a controller (ERRATA E3, strict mode).

A controller that reads per-sample gradient norms or the batch loss of the private sample leaks what no
accountant counted. In strict mode every statistic it needs comes from a Gaussian release on the
step's Poisson sample, charged to the ledger with the gradient release of the same step:

* :class:`NormHistogram`: for each LoRA pair, a histogram of log10 per-sample joint norms (Eq. 4) over
  fixed bins. Adding or removing one record changes one bin of every pair's histogram by 1, so the L2
  sensitivity over all pairs is sqrt(n_pairs).
* :class:`ClippedLossSum`: the sum over the sample of min(per-sequence loss, L); sensitivity L.

Each release's noise std scales with the step's sigma: ``std = k * sigma * sensitivity`` with the
statistic's ``noise_multiplier`` k, so it costs a fixed share of the step: the step's combined
multiplier is ``1/sigma_eff^2 = (1 + sum_j 1/k_j^2) / sigma^2`` (:func:`statistics_sigma_map`), and
sigma_0 is calibrated through that map so the run still lands on its target epsilon.
Bins and the loss bound must not depend on private data (they are set from public data or by hand).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from raydp.errors import ConfigError
from raydp.privacy.calibration import SigmaEffMap
from raydp.privacy.ledger import Release


class PrivateStatistic(Protocol):
    """A statistic of the step's sample released with Gaussian noise of std noise_multiplier*sigma*sensitivity."""

    name: str
    noise_multiplier: float

    def sensitivity(self, n_pairs: int) -> float: ...

    def raw(self, pair_norms: torch.Tensor, losses: torch.Tensor) -> torch.Tensor:
        """The exact value from per-sample pair norms ``[batch, n_pairs]`` and losses ``[batch]``."""


def _check_multiplier(k: float, name: str) -> float:
    k = float(k)
    if not (k > 0 and math.isfinite(k)):
        raise ConfigError(f"{name}: noise multiplier must be finite and > 0, got {k}")
    return k


@dataclass(frozen=True)
class NormHistogram:
    """Per-pair counts of samples whose log10 joint norm falls in each of ``n_bins`` equal bins on
    [log10_low, log10_high]; norms outside go to the end bins (a zero norm to the first)."""

    log10_low: float
    log10_high: float
    n_bins: int = 24
    noise_multiplier: float = 4.0
    name: str = "norm_histogram"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.log10_low) and math.isfinite(self.log10_high) and self.log10_low < self.log10_high):
            raise ConfigError(f"histogram range must satisfy low < high, got {self.log10_low}, {self.log10_high}")
        if int(self.n_bins) != self.n_bins or self.n_bins < 2:
            raise ConfigError(f"histogram needs >= 2 bins, got {self.n_bins}")
        _check_multiplier(self.noise_multiplier, self.name)

    @property
    def edges(self) -> np.ndarray:
        """log10 bin edges, length n_bins + 1."""
        return np.linspace(self.log10_low, self.log10_high, self.n_bins + 1)

    def sensitivity(self, n_pairs: int) -> float:
        return math.sqrt(n_pairs)

    def bin_index(self, pair_norms: torch.Tensor) -> torch.Tensor:
        inner = torch.tensor(self.edges[1:-1], dtype=torch.float64, device=pair_norms.device)
        logs = torch.log10(pair_norms.double().clamp_min(1e-300))
        return torch.bucketize(logs, inner, right=True)

    def raw(self, pair_norms: torch.Tensor, losses: torch.Tensor) -> torch.Tensor:
        n_pairs = pair_norms.shape[1]
        counts = torch.zeros(n_pairs, self.n_bins, dtype=torch.float64, device=pair_norms.device)
        if pair_norms.shape[0]:
            idx = self.bin_index(pair_norms)  # [batch, n_pairs]
            counts.scatter_add_(1, idx.T.contiguous(), torch.ones_like(idx.T, dtype=torch.float64))
        return counts


@dataclass(frozen=True)
class ClippedLossSum:
    """sum_b min(loss_b, loss_clip) over the sample (per-sequence mean NLL, non-negative)."""

    loss_clip: float
    noise_multiplier: float = 4.0
    name: str = "loss_sum"

    def __post_init__(self) -> None:
        if not (self.loss_clip > 0 and math.isfinite(self.loss_clip)):
            raise ConfigError(f"loss clip must be finite and > 0, got {self.loss_clip}")
        _check_multiplier(self.noise_multiplier, self.name)

    def sensitivity(self, n_pairs: int) -> float:
        return float(self.loss_clip)

    def raw(self, pair_norms: torch.Tensor, losses: torch.Tensor) -> torch.Tensor:
        return losses.double().clamp(0.0, self.loss_clip).sum().reshape(1)


def release_per_unit_sigma(stat: PrivateStatistic, n_pairs: int) -> Release:
    """The statistic's release with its noise std per unit of sigma (k * sensitivity)."""
    sens = stat.sensitivity(n_pairs)
    return Release(stat.name, sens, stat.noise_multiplier * sens)


def statistics_sigma_map(stats, n_pairs: int) -> SigmaEffMap:
    """sigma -> sigma_eff of a step that releases the gradient at sigma plus ``stats``."""
    return SigmaEffMap.from_releases(scaled=[release_per_unit_sigma(s, n_pairs) for s in stats])
