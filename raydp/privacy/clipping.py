"""Per-sample gradients of the LoRA pairs, pairwise (or flat) clipping and noising (RLDP Eq. 3-6).

Per-sample gradients come from Opacus's ``GradSampleModule`` in hooks mode: PEFT's LoRA ``A`` and
``B`` are plain ``nn.Linear`` layers, for which Opacus computes exact per-sample gradients; frozen
weights get none. Everything after that is ours, because the noise calibration must follow the clip
vector at every step (ERRATA E1: Opacus's per-layer optimizer fixes ||C||_2 at construction).

Clip groups: ``pairwise`` clips each pair ``(A_i, B_i)`` jointly to its own radius C_i (Eq. 4-5);
``flat`` clips the concatenation of all LoRA gradients to one radius C (vanilla DP-SGD on LoRA).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from opacus import GradSampleModule

from raydp.model.adapters import AdapterPair
from raydp.model.loss import per_sequence_nll
from raydp.privacy.mechanism import CLIP, CLIP_EPS  # noqa: F401  (CLIP_EPS: Eq. 5's stabiliser)

CLIP_MODES = ("pairwise", "flat")


@dataclass
class PerSampleGrads:
    """Per-sample gradients of every pair: ``a[i]`` has shape ``[batch, *A_i.shape]``, likewise ``b[i]``."""

    a: list[torch.Tensor]
    b: list[torch.Tensor]
    losses: torch.Tensor  # per-sequence losses, [batch]

    @property
    def batch_size(self) -> int:
        return int(self.losses.shape[0])

    def pair_norms(self) -> torch.Tensor:
        return pair_norms(self)

    def clipped_sums(self, factors: torch.Tensor, mode: str) -> tuple[list, list]:
        return clipped_sums(self, factors, mode)


class PerSampleGradientComputer:
    """Wraps a PEFT model in Opacus's ``GradSampleModule`` (hooks) and returns per-sample LoRA gradients."""

    def __init__(self, model: torch.nn.Module, pairs: list[AdapterPair], loss=per_sequence_nll):
        """``loss(logits, input_ids, attention_mask[, labels]) -> [batch]``: the task's per-sample loss
        (language modelling's per-sequence NLL by default; a classification task passes its own, which
        also takes the batch's labels)."""
        self.pairs = pairs
        self.loss = loss
        self.module = GradSampleModule(model, batch_first=True, loss_reduction="sum")
        self._params = [t for pair in pairs for t in (pair.a, pair.b)]
        self._hooked = [m for m in self.module.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]

    def compute(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                labels: torch.Tensor | None = None) -> PerSampleGrads:
        """Forward, backward of the summed per-sequence losses, then collect and reset ``grad_sample``."""
        self._reset()  # a gradient-enabled forward through the model elsewhere may have left state
        logits = self.module(input_ids=input_ids, attention_mask=attention_mask).logits
        losses = (self.loss(logits, input_ids, attention_mask) if labels is None
                  else self.loss(logits, input_ids, attention_mask, labels))
        with warnings.catch_warnings():  # Opacus's hooks on LoRA layers whose inputs need no grad
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            losses.sum().backward()
        a, b = [], []
        for pair in self.pairs:
            a.append(pair.a.grad_sample)
            b.append(pair.b.grad_sample)
        self._reset()
        return PerSampleGrads(a, b, losses.detach())

    def _reset(self) -> None:
        for p in self._params:
            p.grad_sample = None
            p.grad = None
        for module in self._hooked:
            if getattr(module, "activations", None):
                module.activations = []


def zero_nonfinite(grads: PerSampleGrads) -> PerSampleGrads:
    """A sample whose loss or gradient has a non-finite entry contributes zero (loss 0, gradient 0).

    Otherwise one NaN turns the whole noisy release into NaN, which reveals that the sample was drawn:
    a release no accountant bounds. Zeroing keeps the contribution's norm (0) within every clip."""
    finite = torch.isfinite(grads.losses)
    for ga, gb in zip(grads.a, grads.b):
        finite &= torch.isfinite(ga.flatten(1)).all(1) & torch.isfinite(gb.flatten(1)).all(1)
    if bool(finite.all()):
        return grads

    def keep(t: torch.Tensor) -> torch.Tensor:
        mask = finite.view(-1, *([1] * (t.dim() - 1)))
        return torch.where(mask, t, torch.zeros((), dtype=t.dtype, device=t.device))

    return PerSampleGrads([keep(g) for g in grads.a], [keep(g) for g in grads.b], keep(grads.losses))


def combine_units(grads: PerSampleGrads, unit_index: torch.Tensor | None) -> PerSampleGrads:
    """One contribution per privacy unit (ERRATA E11; user-level DP-SGD, McMahan et al. 2018): the
    gradients of a unit's records are summed (then clipped as one sample), and its loss is the mean of
    its records' losses (so a loss clipped to L still has sensitivity L). ``unit_index`` maps rows to
    units 0..k-1; None means every row is its own unit."""
    if unit_index is None:
        return grads
    n_units = int(unit_index.max()) + 1 if unit_index.numel() else 0

    def summed(t: torch.Tensor) -> torch.Tensor:
        out = torch.zeros((n_units, *t.shape[1:]), dtype=t.dtype, device=t.device)
        return out.index_add_(0, unit_index, t)

    counts = torch.bincount(unit_index, minlength=n_units).to(grads.losses.dtype)
    return PerSampleGrads([summed(g) for g in grads.a], [summed(g) for g in grads.b],
                          summed(grads.losses) / counts.clamp_min(1))


def pair_norms(grads: PerSampleGrads) -> torch.Tensor:
    """Joint L2 norm of (g_A_i, g_B_i) per sample and pair, shape ``[batch, n_pairs]`` (Eq. 4)."""
    squared = [
        ga.flatten(1).pow(2).sum(1) + gb.flatten(1).pow(2).sum(1) for ga, gb in zip(grads.a, grads.b)
    ]
    return torch.stack(squared, dim=1).sqrt()


def group_norms(norms: torch.Tensor, mode: str) -> torch.Tensor:
    """Norms of the clip groups: the pair norms (pairwise) or the whole-gradient norm ``[batch, 1]`` (flat)."""
    if mode == "pairwise":
        return norms
    if mode == "flat":
        return norms.pow(2).sum(dim=1, keepdim=True).sqrt()
    raise ValueError(f"unknown clip mode {mode!r}")


def clip_factors(norms: torch.Tensor, clips: torch.Tensor) -> torch.Tensor:
    """lambda = min(1, C / (norm + 1e-6)) per sample and group (Eq. 5)."""
    return CLIP.factors(norms, clips)


def clipped_sums(grads: PerSampleGrads, factors: torch.Tensor, mode: str) -> tuple[list, list]:
    """Sum over the batch of the clipped per-sample gradients of each pair (Eq. 5, before noise)."""
    sums_a, sums_b = [], []
    for i, (ga, gb) in enumerate(zip(grads.a, grads.b)):
        f = factors[:, i if mode == "pairwise" else 0].to(ga.dtype)
        sums_a.append(torch.einsum("b,b...->...", f, ga))
        sums_b.append(torch.einsum("b,b...->...", f, gb))
    return sums_a, sums_b


def pair_noise_stds(group_stds, n_pairs: int, mode: str) -> list[float]:
    """Per-pair noise std: a pair's own group std (pairwise) or the single flat std for every pair."""
    return [float(s) for s in group_stds] if mode == "pairwise" else [float(group_stds[0])] * n_pairs
