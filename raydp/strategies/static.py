"""Static DP-SGD on the LoRA parameters: fixed clip and a sigma calibrated once (RLDP Sec. 3.1 baselines).

``static`` is the paper's "Vanilla DP-SGD"/"static" baseline: one clip radius C = 1.0 over the
concatenation of all LoRA gradients (flat clipping) and the noise multiplier sigma_0 calibrated so the
enforcing accountant lands on the target epsilon. Only LoRA parameters are trainable, so the paper's
"DP-LoRA" baseline is the same mechanism, registered as ``dp-lora``. (It differs from the federated
DP-LoRA of Liu et al., where clients clip and noise LoRA updates before a server aggregates them;
here one trainer applies central DP-SGD to the LoRA adapters.)

``static-pairwise`` keeps pairwise clipping (Eq. 4-5) with a fixed radius per pair (the paper's
initial c_i = 0.1) and proportional noise; it is what RLDP does before its controller acts.
"""

from __future__ import annotations

from raydp.strategies.base import Dials, Strategy


class ConstantDials(Strategy):
    """Fixed clip radius for every clip group and constant sigma_0."""

    default_clip: float = 1.0

    def __init__(self, clip: float | None = None):
        clip = self.default_clip if clip is None else float(clip)
        if not clip > 0:
            raise ValueError("clip must be > 0")
        self.clip = clip

    def dials(self, step: int) -> Dials:
        groups = 1 if self.clip_mode == "flat" else self.context.n_pairs
        return Dials(clip=(self.clip,) * groups, sigma=self.context.sigma_0)


class StaticStrategy(ConstantDials):
    """Flat clip C = 1.0 over all LoRA parameters, constant sigma_0."""

    name = "static"
    clip_mode = "flat"
    allocation = "flat"
    default_clip = 1.0


class DPLoRAStrategy(StaticStrategy):
    """The paper's DP-LoRA baseline: identical to ``static`` because only LoRA is trainable."""

    name = "dp-lora"


class StaticPairwiseStrategy(ConstantDials):
    """Pairwise clipping with C_i = 0.1 per pair and constant sigma_0 (proportional noise)."""

    name = "static-pairwise"
    clip_mode = "pairwise"
    allocation = "proportional"
    default_clip = 0.1
