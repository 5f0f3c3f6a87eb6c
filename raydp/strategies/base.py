"""The strategy interface: what sets the privacy dials of each DP step.

Before a step a strategy gives the dials (a clip radius per clip group and the noise multiplier sigma);
the budget guard may raise sigma; the DP step clips, noises, records the ledger and updates; after the
update the strategy receives what the step released. Everything a strategy observes through
:meth:`Strategy.observe` is post-processing of the DP release (the noisy per-pair sums, their norms,
the update) or the ledger, so a strategy that only uses it spends no extra privacy (ERRATA E3).
RLDP and the adaptive baselines are strategies; none of them copies the step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(frozen=True)
class Dials:
    """Privacy dials of one step: ``clip`` per clip group (n_pairs for pairwise, 1 for flat) and ``sigma``.

    ``sigma`` is the true noise multiplier of the gradient release: the noise allocation makes the
    mechanism's sigma_eff equal to it (ERRATA E1).
    """

    clip: tuple[float, ...]
    sigma: float


@dataclass(frozen=True)
class StrategyContext:
    """What a strategy knows when a run starts (nothing here is computed from private records)."""

    n_pairs: int
    pair_depths: tuple[float, ...]
    q: float
    planned_steps: int
    sigma_0: float
    epsilon_target: float
    delta: float


@dataclass
class StepRelease:
    """What one DP step released, and nothing else: post-processing of the Gaussian mechanism's output."""

    step: int
    dials: Dials  # the dials actually used (after the guard)
    sigma_eff: float  # as charged to the ledger
    clamped: bool
    noisy_sum_a: list[torch.Tensor]
    noisy_sum_b: list[torch.Tensor]
    noisy_pair_norms: np.ndarray  # ||(noisy sum A_i, noisy sum B_i)||, one per pair
    update: list[torch.Tensor] = field(default_factory=list)  # parameter change of each trainable tensor


class Strategy(ABC):
    """Sets the dials before each DP step and observes the release after it."""

    #: registry name, e.g. "static"
    name: str = "strategy"
    #: "pairwise" (a clip per LoRA pair, Eq. 4-5) or "flat" (one clip over all LoRA parameters)
    clip_mode: str = "pairwise"
    #: noise allocation across clip groups: "proportional", "uniform" (pairwise) or "flat"
    allocation: str = "proportional"

    def setup(self, context: StrategyContext) -> None:
        self.context = context

    @abstractmethod
    def dials(self, step: int) -> Dials:
        """The dials proposed for ``step`` (0-based). The guard may raise ``sigma``."""

    def observe(self, release: StepRelease, ledger) -> None:
        """Called after each update with what the step released and the ledger."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def describe(self) -> dict:
        return {"name": self.name, "clip_mode": self.clip_mode, "allocation": self.allocation}
