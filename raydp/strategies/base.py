"""The strategy interface: what a DP strategy chooses, and nothing else.

A strategy differs from another only in its choices; none of them copies the step
(:class:`raydp.privacy.engine.DPStep` runs it). It chooses:

* per step, the mechanism (:class:`~raydp.privacy.mechanism.Dials`): clip per group, optionally a
  per-sample scaling rule and an invertible transform, and, only if ``adaptive_sigma``, sigma;
* once, its extra releases (:meth:`Strategy.releases`) and its sigma schedule (:meth:`Strategy.schedule`),
  which calibration solves for before the model loads;
* after each update, what to remember of the release (:meth:`Strategy.observe`): post-processing of the
  DP releases (the noisy sums, the noisy gradient, the update, the declared statistics) or the ledger, so
  a strategy that only uses it spends no extra privacy (ERRATA E3).

Strategies are registered by name with a pydantic settings model (:mod:`raydp.strategies.registry`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from raydp.control.modes import PAPER_MODE_LABEL, recorded_privacy_mode  # noqa: F401  (PAPER_MODE_LABEL re-exported)
from raydp.privacy.mechanism import DeclaredRelease, Dials, StepRelease
from raydp.privacy.schedule import CONSTANT, SigmaSchedule
from raydp.strategies.rldp_settings import PUBLIC_PROBE_RECORDS


@dataclass(frozen=True)
class PlanRequest:
    """The public parameters of a run's privacy plan, given to :meth:`Strategy.plan` before calibration
    (nothing here is computed from private records: the number of units is treated as public)."""

    epsilon: float
    delta: float
    q: float
    planned_steps: int
    accountant: str


@dataclass(frozen=True)
class WarmStart:
    """A NON-private fine-tuning phase the runner runs before the DP phase (DualTune-GhostDP phase 1,
    :mod:`raydp.runner.phases`). ``data``: ``"public"`` (the public corpus: the guarantee covers the whole
    run) or ``"redacted"`` (the private training records after a secret detector: NOT covered by any
    epsilon, ERRATA E16; the run carries :meth:`Strategy.labels`)."""

    data: str
    epochs: float
    lr: float | None = None  # None: the run's lr
    records: int | None = None  # public: how many public records (None: raydp.runner.phases.PUBLIC_PHASE_ONE_RECORDS)
    detector: str = "high_context"  # redacted: the detector's level (raydp.data.redaction)
    detector_pipeline: str | None = None  # redacted: an installed spaCy pipeline (None: rules only)


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
    #: sizes of the trainable LoRA tensors, pair by pair (A_0, B_0, A_1, ...): the flattened gradient's layout
    tensor_sizes: tuple[int, ...] = ()
    #: minus the value-token NLL per record of PUBLIC validation records under the model as it is now (post-processing
    #: of the DP releases that trained it, on public data: free, and the same whatever the timing); None where the
    #: run has no value-spanned public validation
    public_utility: Callable[[], float] | None = field(default=None, compare=False)


class Strategy(ABC):
    """Sets the dials before each DP step and observes the release after it."""

    #: registry name, e.g. "static"
    name: str = "strategy"
    #: "pairwise" (a clip per LoRA pair, Eq. 4-5) or "flat" (one clip over all LoRA parameters)
    clip_mode: str = "pairwise"
    #: noise allocation across clip groups: "proportional", "uniform" (pairwise) or "flat"
    allocation: str = "proportional"
    #: False: observes only DP releases (default, "strict"); True: also the raw statistics of RLDP Sec. 2.4,
    #: which no accountant covers (ERRATA E3, RLDP's "paper" privacy mode: raydp.control.modes); such runs
    #: carry :data:`PAPER_MODE_LABEL`
    raw_statistics: bool = False
    #: whether :meth:`calibrate_public` must be called with a public probe before the first step
    needs_public_probe: bool = False
    #: how many public records that probe holds (RLDP: its ``public_probe_records`` setting)
    public_probe_records: int = PUBLIC_PROBE_RECORDS
    #: how many public validation records ``context.public_utility`` scores (None: the strategy never asks)
    public_utility_records: int | None = None
    #: whether sigma is chosen during training from earlier releases. Such runs are enforced and
    #: reported with a Renyi filter, valid under fully adaptive composition (ERRATA E13,
    #: :mod:`raydp.privacy.filter`); fixed schedules keep PLD/PRV/RDP accounting of the ledger. Choosing
    #: only the clip radii needs no filter: the noise allocation keeps sigma_eff = sigma (E1).
    adaptive_sigma: bool = False
    #: the pydantic model of the strategy's settings (:mod:`raydp.strategies.registry`); its constructor
    #: takes an instance as its first argument
    settings_model: type | None = None
    #: where the DP step's per-unit contributions come from: ``"per_sample"`` (LoRA hooks, per-sample
    #: gradients) or ``"ghost"`` (ghost clipping, norms only; flat clipping, :mod:`raydp.privacy.ghost`)
    gradient_source: str = "per_sample"
    #: whether :meth:`observe` reads ``release.update`` (the parameter change): the DP step then copies every LoRA
    #: parameter before the optimizer step (a cost per step no built-in strategy needs)
    observes_update: bool = False

    @property
    def privacy_mode(self) -> str:
        """The recorded privacy mode ('strict' or 'paper'; summaries, decisions)."""
        return recorded_privacy_mode(self.raw_statistics)

    def setup(self, context: StrategyContext) -> None:
        self.context = context

    @abstractmethod
    def dials(self, step: int) -> Dials:
        """The mechanism of ``step`` (0-based). ``sigma=None`` takes the plan's sigma; only a strategy
        with ``adaptive_sigma`` may propose another (the Renyi filter's guard may raise it)."""

    def releases(self) -> tuple[DeclaredRelease, ...]:
        """The strategy's own Gaussian releases per step (:mod:`raydp.privacy.statistics`), charged to the
        ledger with the gradient. Declared once: their noise must be known when the strategy is built
        (sigma_0 is calibrated with it before the model loads); public parameters such as histogram bins
        may be placed later (:meth:`calibrate_public`)."""
        return ()

    def warm_start(self) -> WarmStart | None:
        """A non-private phase to run before the DP phase (None: none)."""
        return None

    def labels(self) -> tuple[str, ...]:
        """Caveats the strategy's design puts on the run's epsilon (carried by every artifact stating it)."""
        return (PAPER_MODE_LABEL,) if self.raw_statistics else ()

    def plan(self, request: PlanRequest) -> None:
        """Called once before calibration with the run's public plan parameters; a strategy whose
        schedule depends on them (EWPBA: the budget, q and the number of epochs) builds it here."""

    def schedule(self) -> SigmaSchedule:
        """The sigma schedule fixed before training (calibration solves for its scale sigma_0)."""
        return CONSTANT

    def schedule_key(self) -> object:
        """What the schedule depends on besides the plan's parameters (runs whose plan keys are equal
        calibrate the same sigma_0; :func:`raydp.runner.privacy_setup.plan_key`)."""
        return self.schedule()

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
               "privacy_mode": self.privacy_mode, "schedule": self.schedule().describe(),
               "gradient_source": self.gradient_source,
               "releases": [{"name": r.name, "noise": {k: v for k, v in vars(r.noise).items() if v is not None}}
                            for r in self.releases()]}
        if self.raw_statistics:
            out["privacy_label"] = PAPER_MODE_LABEL
        return out
