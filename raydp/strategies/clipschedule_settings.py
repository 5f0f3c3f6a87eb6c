"""The learned clip schedule's settings (:mod:`raydp.strategies.clipschedule`), importable without the strategy: RLDP's
residual decoding (:mod:`raydp.strategies.rldp_settings`) takes a schedule too, and settings modules import pydantic
only (the CLI builds its flags from them without loading numpy or torch)."""

from __future__ import annotations

from pydantic import Field

from raydp.settings import StrictModel


class ClipScheduleSettings(StrictModel):
    clip: float = Field(1.0, gt=0, description="the clip at the first step: a multiple of the pair's public median "
                                               "norm r_i (relative) or an absolute radius")
    clip_end: float | None = Field(None, gt=0, description="the clip at the last planned step (default: clip; "
                                                           "geometric interpolation in between)")
    depth_tilt: float = Field(0.0, ge=-5, le=5, description="log-ratio of the last pair's clip to the first's")
    relative: bool = Field(True, description="clips are multiples of each pair's median public gradient norm")
