"""An open-loop clip schedule: per-pair clips fixed before training, learned on public data.

The clip of LoRA pair i at step t (of T planned steps) is

    C_i(t) = r_i * clip^(1 - t/T) * clip_end^(t/T) * exp(depth_tilt * (d_i - 1/2))

with r_i pair i's median per-sample gradient norm on a PUBLIC probe under the initial model (``relative``;
1 otherwise), d_i in [0, 1] the pair's depth (0: first block, 1: last) and a geometric interpolation from
``clip`` to ``clip_end``. Noise is proportional to each clip, so the gradient release's true noise multiplier
is the plan's sigma at every step (ERRATA E1). Nothing is read from private records after the run starts, so
the clips are part of the algorithm fixed in advance: the sigma schedule is the constant plan and PLD accounts
the ledger (no filter). With ``relative: false``, ``clip_end`` unset and ``depth_tilt: 0`` it is exactly
``static-pairwise``.

Its settings, with the learning rate's peak and decay (``lr``, ``lr_decay``, ``lr_end``), are meant to be
searched on PUBLIC episodes (a study with ``search: optuna`` and a ``search_space``, :mod:`raydp.study`), per
epsilon and sampling rate; the chosen values then run on private data.
"""

from __future__ import annotations

import math

import numpy as np
from raydp.errors import ConfigError
from raydp.privacy.mechanism import Dials
from raydp.strategies.base import Strategy
from raydp.strategies.clipschedule_settings import ClipScheduleSettings


def base_clips(settings: ClipScheduleSettings, reference, depths, n_pairs: int) -> np.ndarray:
    """r_i * exp(depth_tilt * (d_i - 1/2)) for every pair (r_i = 1 unless ``settings.relative``)."""
    reference = np.asarray(reference, dtype=np.float64) if settings.relative else np.ones(n_pairs)
    depths = np.asarray(depths, dtype=np.float64) if depths else np.zeros(n_pairs)
    return reference * np.exp(settings.depth_tilt * (depths - 0.5))


def multiplier(settings: ClipScheduleSettings, step: int, planned_steps: int) -> float:
    """clip^(1 - u) * clip_end^u at u = step / (T - 1), the fraction of the planned steps done."""
    start = settings.clip
    end = settings.clip_end if settings.clip_end is not None else start
    u = min(1.0, step / max(1, planned_steps - 1))
    return math.exp((1 - u) * math.log(start) + u * math.log(end))


def scheduled_clips(settings: ClipScheduleSettings, reference, context, step: int) -> np.ndarray:
    """Every pair's clip C_i(t) at ``step`` (the module docstring's formula)."""
    return base_clips(settings, reference, context.pair_depths, context.n_pairs) * multiplier(
        settings, step, context.planned_steps)


class ClipScheduleStrategy(Strategy):
    """Per-pair clips that follow a schedule fixed before training; proportional noise, constant sigma_0."""

    name = "clip-schedule"
    clip_mode = "pairwise"
    allocation = "proportional"
    settings_model = ClipScheduleSettings

    def __init__(self, settings=None):
        self.settings = settings if settings is not None else ClipScheduleSettings()
        self.needs_public_probe = bool(self.settings.relative)
        self.reference: np.ndarray | None = None  # r_i

    def calibrate_public(self, pair_norms: np.ndarray, losses: np.ndarray) -> None:
        """r_i: pair i's median non-zero per-sample norm on PUBLIC records (the pooled median for a pair
        with none); no privacy cost."""
        norms = np.asarray(pair_norms, dtype=np.float64)
        positive = norms[norms > 0]
        if positive.size == 0:
            raise ConfigError("the public probe gave no gradient norms; cannot scale the clips (relative: true)")
        pooled = float(np.median(positive))
        self.reference = np.array([float(np.median(col[col > 0])) if np.any(col > 0) else pooled for col in norms.T])

    def base_clips(self) -> np.ndarray:
        """r_i * exp(depth_tilt * (d_i - 1/2)) for every pair."""
        if self.settings.relative and self.reference is None:
            raise ConfigError("clip-schedule (relative: true) needs the public probe before its first step")
        return base_clips(self.settings, self.reference, self.context.pair_depths, self.context.n_pairs)

    def multiplier(self, step: int) -> float:
        return multiplier(self.settings, step, self.context.planned_steps)

    def dials(self, step: int) -> Dials:
        clips = self.base_clips() * self.multiplier(step)
        return Dials(clip=tuple(float(c) for c in clips))

    def state_dict(self) -> dict:
        return {"reference": None if self.reference is None else self.reference.tolist()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("reference") is not None:
            self.reference = np.asarray(state["reference"], dtype=np.float64)

    def describe(self) -> dict:
        out = super().describe()
        out["settings"] = self.settings.model_dump()
        if self.reference is not None:
            out["public_reference_norms"] = [float(r) for r in self.reference]
        return out
