"""DualTune-GhostDP (seed 003, Sec. 4): a non-private phase 1, then DP-SGD with ghost clipping.

What the strategy chooses, and nothing else (the runner runs both phases with the shared loop):

* **Phase 1** (:class:`~raydp.strategies.base.WarmStart`, run by :mod:`raydp.runner.phases`): ordinary
  fine-tuning for ``phase1_epochs`` on
  - ``phase1: public`` (the default, the sound variant of ERRATA E16): ``phase1_records`` records of the public
    corpus (default :data:`~raydp.runner.phases.PUBLIC_PHASE_ONE_RECORDS`, a public constant: a size taken from
    the private data would make phase 1 a non-DP function of it), so the run's epsilon covers everything it
    trained on; or
  - ``phase1: redacted`` (the paper's): the private training records after the secret detector
    (:mod:`raydp.data.redaction`, Sec. 4.2). The paper says this phase "does not consume any privacy
    budget"; it does: a detector is a deterministic function of the records, and what it misses (and
    everything it keeps) reaches the model with no guarantee (E16). Such runs carry
    :data:`REDACTED_LABEL`; their epsilon covers phase 2 only.
* **Phase 2**: static DP-SGD on the original records, one flat clip radius ``clip`` over all LoRA
  gradients (Li et al. 2022's setting), constant sigma calibrated and enforced by the run's upper-bound
  accountant (PLD by default). ``clipping: ghost`` (default) computes each unit's norm by ghost clipping
  (:mod:`raydp.privacy.ghost`); ``clipping: per_sample`` is the paper's Experiment 2 (standard clipping).
* **Accounting**: the paper enforces with the Edgeworth accountant (Sec. 4.3). Edgeworth is an
  approximation (ERRATA E9): every DP summary reports it beside the enforcing upper bound
  (:mod:`raydp.privacy.accounting.edgeworth`), with the sigma it would have chosen; it enforces nothing.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from raydp.data.redaction import E16_LABEL  # the label only: spaCy is imported when a detector is built
from raydp.errors import ConfigError
from raydp.settings import StrictModel
from raydp.strategies.base import PlanRequest, WarmStart
from raydp.strategies.static import ConstantDials

#: the label of a run whose phase 1 trained on redacted private records (ERRATA E16)
REDACTED_LABEL = E16_LABEL


class DualTuneSettings(StrictModel):
    clip: float | None = Field(None, gt=0, description="phase 2's flat clip radius C (default 1.0)")
    phase1: Literal["public", "redacted"] = Field(
        "public", description="phase 1's data: the public corpus (covered by the guarantee) or the private "
                              "training records after the secret detector (not covered; labelled, ERRATA E16)")
    phase1_epochs: float = Field(1.0, ge=0, description="epochs of non-private phase-1 fine-tuning (0: none)")
    phase1_lr: float | None = Field(None, gt=0, description="phase 1's learning rate (default: the run's lr)")
    phase1_records: int | None = Field(None, ge=1, description=(
        "public phase 1: public records to train on (default 5000, raydp.runner.phases.PUBLIC_PHASE_ONE_RECORDS: "
        "a public constant, never the private record count)"))
    detector: Literal["base", "high_context"] = Field(
        "high_context", description="redacted phase 1: the secret detector's level (raydp.data.redaction)")
    detector_pipeline: str | None = Field(None, description="redacted phase 1: an installed spaCy pipeline (name "
                                                           "or path) whose tags the detector also redacts")
    clipping: Literal["ghost", "per_sample"] = Field(
        "ghost", description="phase 2's per-unit norms: ghost clipping or per-sample gradients (paper Exp. 2)")


class DualTuneStrategy(ConstantDials):
    """Phase 1 as configured, then flat-clip DP-SGD with ghost clipping at constant sigma_0."""

    name = "dualtune"
    clip_mode = "flat"
    allocation = "flat"
    default_clip = 1.0
    settings_model = DualTuneSettings

    @property
    def gradient_source(self) -> str:
        return "ghost" if self.settings.clipping == "ghost" else "per_sample"

    def warm_start(self) -> WarmStart | None:
        s = self.settings
        if s.phase1_epochs == 0:
            return None
        return WarmStart(data=s.phase1, epochs=s.phase1_epochs, lr=s.phase1_lr, records=s.phase1_records,
                         detector=s.detector, detector_pipeline=s.detector_pipeline)

    def plan(self, request: PlanRequest) -> None:
        """What the paper's calibration would have done (Sec. 4.3: sigma from the Edgeworth accountant), for
        the report only: the run's sigma comes from the enforcing upper bound (ERRATA E9)."""
        from raydp.privacy.accounting import get_accountant
        from raydp.privacy.calibration import calibrate_sigma

        try:
            sigma = calibrate_sigma(request.epsilon, request.delta, request.q, request.planned_steps, "edgeworth",
                                    allow_approximation=True).sigma
        except ConfigError as error:
            self.paper_calibration = {"accountant": "edgeworth", "sigma": None, "note": str(error)}
            return
        spent = get_accountant("pld").epsilon([(request.q, sigma, request.planned_steps)], request.delta)
        self.paper_calibration = {
            "accountant": "edgeworth", "sigma": sigma, "epsilon_pld_at_that_sigma": spent,
            "note": "the noise multiplier the paper's Edgeworth calibration gives for this plan; NOT used: the run "
                    "is calibrated and enforced by an upper-bound accountant (ERRATA E9). epsilon_pld_at_that_sigma "
                    "is what it would really have spent"}

    def describe(self) -> dict:
        out = super().describe()
        if getattr(self, "paper_calibration", None) is not None:
            out["paper_calibration"] = self.paper_calibration
        if self.labels():
            out["privacy_label"] = "; ".join(self.labels())
        return out

    def labels(self) -> tuple[str, ...]:
        redacted = self.settings.phase1 == "redacted" and self.settings.phase1_epochs > 0
        return (*super().labels(), *((REDACTED_LABEL,) if redacted else ()))
