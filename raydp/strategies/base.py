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
from collections.abc import Callable
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
    expected_batch_size: float = 0.0  # q * N_train (public given N_train; E5)
    #: epsilon of the ledger so far under the enforcing accountant (post-processing of the ledger)
    privacy_spent: Callable[[], float] | None = field(default=None, compare=False)


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
    #: the strategy's own Gaussian releases (:meth:`Strategy.private_statistics`), noisy, by name
    statistics: dict[str, np.ndarray] = field(default_factory=dict)
    #: the noise std each statistic was released with (public: it follows from sigma)
    statistics_noise_std: dict[str, float] = field(default_factory=dict)
    #: paper mode only (ERRATA E3): the UNPRIVATIZED per-sample pair norms [batch, n] and losses [batch]
    raw_pair_norms: np.ndarray | None = None
    raw_losses: np.ndarray | None = None


PAPER_MODE_LABEL = ("epsilon covers the gradient releases only; the controller observed unprivatized "
                    "statistics")


class Strategy(ABC):
    """Sets the dials before each DP step and observes the release after it."""

    #: registry name, e.g. "static"
    name: str = "strategy"
    #: "pairwise" (a clip per LoRA pair, Eq. 4-5) or "flat" (one clip over all LoRA parameters)
    clip_mode: str = "pairwise"
    #: noise allocation across clip groups: "proportional", "uniform" (pairwise) or "flat"
    allocation: str = "proportional"
    #: "strict": observes only DP releases (default); "paper": also the raw statistics of RLDP Sec. 2.4,
    #: which no accountant covers (ERRATA E3); such runs carry :data:`PAPER_MODE_LABEL`
    privacy_mode: str = "strict"
    #: whether :meth:`calibrate_public` must be called with a public probe before the first step
    needs_public_probe: bool = False
    #: whether sigma is chosen during training from earlier releases. Such runs are enforced and
    #: reported with a Renyi filter, valid under fully adaptive composition (ERRATA E13,
    #: :mod:`raydp.privacy.filter`); fixed schedules keep PLD/PRV/RDP accounting of the ledger. Choosing
    #: only the clip radii needs no filter: the noise allocation keeps sigma_eff = sigma (E1).
    adaptive_sigma: bool = False

    def setup(self, context: StrategyContext) -> None:
        self.context = context

    @abstractmethod
    def dials(self, step: int) -> Dials:
        """The dials proposed for ``step`` (0-based). The guard may raise ``sigma``."""

    def release_noise_multipliers(self) -> tuple[float, ...]:
        """Noise multipliers k of the strategy's own releases (known before the model is loaded, so that
        sigma_0 can be calibrated with them: 1/sigma_eff^2 = (1 + sum 1/k^2) / sigma^2)."""
        return ()

    def private_statistics(self) -> tuple:
        """The strategy's Gaussian releases per step (:mod:`raydp.privacy.statistics`), charged to the ledger."""
        return ()

    def calibrate_public(self, pair_norms: np.ndarray, losses: np.ndarray) -> None:
        """Receives per-sample pair norms and losses of PUBLIC records under the initial model."""

    def observe(self, release: StepRelease, ledger) -> None:
        """Called after each update with what the step released and the ledger."""

    def wants_decision(self, step: int) -> bool:
        """Whether :meth:`between_steps` will consult a controller after ``step`` (the loop checkpoints
        first, so whatever a controller sees is in a durable ledger)."""
        return False

    def between_steps(self, step: int) -> None:
        """Called after step ``step`` is complete (and checkpointed if :meth:`wants_decision`)."""

    def finish(self, output_dir) -> dict:
        """Called once after training, with the run's output directory; returns a summary to report."""
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def describe(self) -> dict:
        out = {"name": self.name, "clip_mode": self.clip_mode, "allocation": self.allocation,
               "privacy_mode": self.privacy_mode}
        if self.privacy_mode == "paper":
            out["privacy_label"] = PAPER_MODE_LABEL
        return out
