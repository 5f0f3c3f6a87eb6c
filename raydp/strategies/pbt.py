"""A member of a Population Based Training population over (clip, sigma) (Jaderberg et al. 2017, "Population
Based Training of Neural Networks"; run by Ray Tune's ``PopulationBasedTraining``, :mod:`raydp.study.runner`).

A member trains with flat clipping (one radius C over all LoRA gradients, like ``static``) and proposes
sigma = sigma_scale * sigma_0 at every step, where sigma_0 is the plan's calibrated multiplier. PBT's
*exploit* copies a better member's checkpoint (weights, optimizer, ledger) into a worse one and its
*explore* perturbs (clip, sigma_scale); the member then goes on from the copied state with the new
settings. Nothing here looks at data: the settings come from PBT, whose choices are post-processing of
the public validation perplexity of DP-trained models (ERRATA E15: selection on public data).

Privacy (ERRATA E1-E5, E13, E7/E14).

* sigma is chosen from earlier results (PBT picks sigma_scale after comparing members), so the run is
  enforced by a Renyi filter whose budget curve B is fixed before training (``adaptive_sigma``; Feldman &
  Zrnic 2021, Thm. 3.1): the guard raises a proposed sigma that would make the member's trajectory (the
  inherited prefix of its ledger plus its own steps, plus the rest of the plan) overspend B, and refuses a
  step that would cross it. The clip only rescales the sensitivity, which the flat noise allocation keeps
  at sigma_eff = sigma (E1). No extra release.
* Steps a member ran and then discarded by an exploit were still run on the private data. In a study the
  whole population is one adaptive interaction with a population Renyi filter of budget M * B
  (:class:`raydp.privacy.filter.PopulationFilter`, held by :mod:`raydp.study.population`), split before
  training into one share B per member: every step of a member is admitted only if every step that member
  has run (discarded ones included) plus the step stays under its share, so the population stays under
  M * B and who is refused never depends on the order concurrent members' requests arrive (Feldman &
  Zrnic 2021, Thm. 3.1, over the population's steps in (sync interval, member, step) order). M * B is the
  composition of the members' budget curves that the study reports as its tuning-aware epsilon.
* A member's model depends on the whole population (exploit copies weights chosen by comparing all
  members), so the guarantee of any member's model is the population's epsilon, not B's (see
  :data:`POPULATION_NOTE`).
"""

from __future__ import annotations

from pydantic import Field

from raydp.privacy.mechanism import Dials
from raydp.settings import StrictModel
from raydp.strategies.base import Strategy

POPULATION_NOTE = ("a PBT member's model depends on the whole population (exploit copies weights chosen by "
                   "comparing members): its guarantee is the population's epsilon (the study's tuning-aware "
                   "figure), not the member's own filter budget")


class PBTSettings(StrictModel):
    """A member's hyperparameters: what PBT explores (Ray Tune mutates them between evaluations)."""

    clip: float = Field(1.0, gt=0, description="the flat clip radius C over all LoRA gradients")
    sigma_scale: float = Field(1.0, gt=0, description="sigma proposed at every step, as a multiple of the "
                               "calibrated sigma_0 (the Renyi filter's guard raises it if it would overspend)")


class PBTStrategy(Strategy):
    """Flat clip C and sigma = sigma_scale * sigma_0, both set by PBT (Renyi filter, ERRATA E13)."""

    name = "pbt"
    clip_mode = "flat"
    allocation = "flat"
    adaptive_sigma = True
    settings_model = PBTSettings

    def __init__(self, settings: PBTSettings | None = None):
        self.settings = settings if settings is not None else PBTSettings()
        self.clip = float(self.settings.clip)
        self.sigma_scale = float(self.settings.sigma_scale)

    def dials(self, step: int) -> Dials:
        return Dials(clip=(self.clip,), sigma=self.context.sigma_0 * self.sigma_scale)

    # An exploited member restores its donor's checkpoint but keeps ITS OWN (new, explored) settings: the
    # strategy carries no state across checkpoints, so nothing of the donor's settings comes back.
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def describe(self) -> dict:
        return {**super().describe(), "clip": self.clip, "sigma_scale": self.sigma_scale,
                "population_note": POPULATION_NOTE}
