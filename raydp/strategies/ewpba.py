"""EWPBA as a DP-SGD noise schedule (EW-FT, Sec. 5.2, Algorithms 1-3): strategy ``ewpba``.

EW-FT's epoch-weighted privacy budget allocation spends less budget in the first half of training
(larger noise: "rapid exploration") and more in the second half (smaller noise: "precision
adjustment"), with the step distance S setting how much faster the noise falls in stage 1 than in
stage 2 (Eq. 9-10). The list depends only on public parameters (epsilon, delta, q, the number of
epochs, S), so it is a plan fixed before training: the mechanisms are fixed in advance and the
ledger's PLD/PRV composition is a theorem (ERRATA E13), with no filter.

What this strategy chooses is only that schedule; the mechanism is ``static``'s (one flat clip over all
LoRA gradients, default C = 1.0 as in the paper's Sec. 6.1) and the DP step is the shared one. EWPBA's
own search (:func:`raydp.privacy.ewpba.ewpba`, Algorithm 1 with the PRV/PLD composition of Alg. 3) gives
the *shape* of the list; the project's calibration then solves the scale sigma_0 with the run's
enforcing accountant (the one the guard and the final check use), so the enforced epsilon never exceeds
the target. Both figures are in the run's summary (``strategy.ewpba``).
"""

from __future__ import annotations

import math

from pydantic import Field

from raydp.errors import ConfigError
from raydp.privacy.schedule import SigmaSchedule
from raydp.strategies.base import PlanRequest
from raydp.strategies.static import StaticSettings, StaticStrategy


class EWPBASettings(StaticSettings):
    step_distance: int = Field(2, ge=1, description="S of Eq. 9-10: stage 1's per-epoch noise step is S times "
                                                   "stage 2's (the paper's best, Table 5: 2)")


class EWPBAStrategy(StaticStrategy):
    """Flat clipping (C = 1.0) with the epoch-wise noise multipliers of EWPBA (Algorithm 1)."""

    name = "ewpba"
    settings_model = EWPBASettings
    default_clip = 1.0

    def __init__(self, settings=None, clip: float | None = None):
        super().__init__(settings if settings is not None else EWPBASettings(clip=clip))
        self._schedule: SigmaSchedule | None = None
        self._result = None

    def plan(self, request: PlanRequest) -> None:
        from raydp.privacy.ewpba import ewpba

        steps_per_epoch = max(1, math.ceil(1.0 / request.q - 1e-9))
        epochs = max(1, math.ceil(request.planned_steps / steps_per_epoch - 1e-9))
        self._result = ewpba(request.epsilon, request.delta, request.q, epochs=epochs,
                             steps_per_epoch=steps_per_epoch, step_distance=self.settings.step_distance,
                             accountant=request.accountant)
        self._schedule = SigmaSchedule(per_epoch=self._result.multipliers())

    def schedule(self) -> SigmaSchedule:
        if self._schedule is None:
            raise ConfigError("strategy 'ewpba' builds its schedule from the run's plan: call plan() first")
        return self._schedule

    def schedule_key(self) -> object:
        return ("ewpba", self.settings.step_distance)

    def describe(self) -> dict:
        if self._schedule is None:  # not planned yet: only the settings are known
            return {"name": self.name, "settings": self.settings.model_dump()}
        out = super().describe()
        if self._result is not None:
            out["ewpba"] = self._result.describe()
        return out
