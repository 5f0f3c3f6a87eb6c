"""Ghost clipping: each unit's gradient norm without its per-sample gradient, then the clipped sum by a
second backward pass (Li, Tramer, Liang & Hashimoto 2022, "Large language models can be strong
differentially private learners", Sec. 4; Lee & Kifer 2021; DualTune-GhostDP Sec. 2, 4.2).

For a linear layer with input activations ``a_t`` and output gradients ``g_t`` at positions t of one
sequence, the gradient is ``sum_t g_t a_t^T`` and its squared Frobenius norm is

    || sum_t g_t a_t^T ||^2 = sum_{t,s} (a_t . a_s)(g_t . g_s)            (Li et al. 2022, Eq. 4)

which needs two T x T Gram matrices, never the d_out x d_in gradient. Opacus's
``GradSampleModuleFastGradientClipping`` (``use_ghost_clipping=True``) computes it in its backward hooks
for every trainable ``nn.Linear`` (PEFT's LoRA ``A`` and ``B`` are ``nn.Linear``); we use its hooks and
its norm sampler as they are and own three things Opacus does not do for us:

* **Privacy units (ERRATA E11).** A patient's contribution is the SUM of its records' gradients. The sum
  of the records' per-position terms is the gradient of one long sequence made of the unit's records, so
  the norm sampler is given, per unit, its records' activations and output gradients concatenated along
  the position axis (zero-padded: a zero position adds nothing to either Gram matrix). The norm is
  exact, not a bound.
* **The clipped sum.** Opacus's ``DPLossFastGradientClipping`` reweights the loss by its own clip
  coefficient; our DP step owns the clip (its scaling rule and the sensitivity check), so the source
  takes the step's per-unit factors f_u and back-propagates ``sum_i f_{u(i)} loss_i`` through the graph
  kept from the first pass, which leaves ``sum_u f_u g_u`` in ``.grad`` (the gradient is linear in the
  loss weights). Hooks are off for that pass.
* **Rounding.** The norm is computed in float64 and scaled up by :data:`NORM_MARGIN` (1e-5), so the
  clip factor bounds what the float32 second pass actually sums (the per-sample path clips the very
  tensors it sums and needs no margin).
* **Non-finite records.** A unit whose loss or norm is not finite contributes zero (as in
  :func:`raydp.privacy.clipping.zero_nonfinite`); its NaN may sit in the kept graph, so the second pass
  then runs a fresh forward over the finite records only.

The model must be float32: the margin covers float32 rounding, and a bf16 model's second pass was
measured up to 4e-4 off (a reviewer's check), so such a model is refused (per-sample clipping works).
Only flat clipping (one radius over every LoRA gradient) is possible: a per-pair radius would need a
different loss weight per pair in one backward pass. Opacus's docs: ``opacus.grad_sample.
GradSampleModuleFastGradientClipping``; its hooks refuse tied parameters under ghost clipping.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
from opacus.grad_sample import GradSampleModuleFastGradientClipping
from opacus.grad_sample.linear import compute_linear_norm_sample

from raydp.model.adapters import AdapterPair
from raydp.model.loss import per_sequence_nll
from raydp.privacy.mechanism import flatten_pairs


#: Ghost norms are scaled up by this much before clipping. The norm is computed (in float64) from the
#: first pass's activations and output gradients, but the clipped sum comes from a second float32 backward
#: pass whose rounding the per-sample path does not have (released norm / float64 ghost norm - 1: at most
#: 5e-8 measured over 8 units at T = 357 on the embedded model); a 1e-5 upper bound keeps it within C.
NORM_MARGIN = 1e-5


def group_rows_by_unit(t: torch.Tensor, unit_index: torch.Tensor, n_units: int) -> torch.Tensor:
    """``[rows, T, ...]`` -> ``[units, m*T, ...]``: each unit's rows side by side along the position
    axis (m = the most rows of one unit), zero-padded where a unit has fewer rows."""
    rows = t.shape[0]
    counts = torch.bincount(unit_index, minlength=n_units)
    m = int(counts.max()) if rows else 1
    order = torch.argsort(unit_index, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    position = torch.empty_like(unit_index)
    position[order] = torch.arange(rows, device=unit_index.device) - starts[unit_index[order]]
    out = t.new_zeros((n_units, m, *t.shape[1:]))
    out[unit_index, position] = t
    return out.reshape(n_units, m * t.shape[1], *t.shape[2:])


class _UnitGhostModule(GradSampleModuleFastGradientClipping):
    """Opacus's ghost-clipping module whose linear norm sampler sees one sample per privacy unit."""

    def __init__(self, model: torch.nn.Module):
        super().__init__(model, batch_first=True, loss_reduction="sum", max_grad_norm=1.0,
                         use_ghost_clipping=True, strict=True)
        self.unit_index: torch.Tensor | None = None
        self.n_units = 0
        # An instance-level table: the class's NORM_SAMPLERS stays Opacus's own for every other module.
        self.NORM_SAMPLERS = {**type(self).NORM_SAMPLERS, torch.nn.Linear: self._unit_linear_norm}

    def _unit_linear_norm(self, layer, activations, backprops):
        # float64: in float32 the T x T Gram products carry ~1e-5 relative error (8e-6 measured on the
        # embedded model at T = 357), above what the step's noise margin covers
        activations, backprops = [activations[0].double()], backprops.double()
        if self.unit_index is not None:
            activations = [group_rows_by_unit(activations[0], self.unit_index, self.n_units)]
            backprops = group_rows_by_unit(backprops, self.unit_index, self.n_units)
        return compute_linear_norm_sample(layer, activations, backprops)


@dataclass
class GhostContributions:
    """One step's per-unit contributions, known by their norms only; :meth:`clipped_sums` runs the
    second backward pass once the step has chosen the clip factors."""

    norms: torch.Tensor  # [units, n_pairs]: the joint norm of (g_A_i, g_B_i) per unit (Eq. 4)
    losses: torch.Tensor  # [units]: mean of the unit's records' losses; 0 for a non-finite unit
    finite: torch.Tensor  # [units] bool
    source: GhostClippingComputer = field(repr=False)
    batch: object = field(repr=False)
    row_losses: torch.Tensor | None = field(default=None, repr=False)  # with the kept graph

    @property
    def batch_size(self) -> int:
        return int(self.losses.shape[0])

    def pair_norms(self) -> torch.Tensor:
        return self.norms

    def clipped_sums(self, factors: torch.Tensor, mode: str) -> torch.Tensor:
        """sum_u f_u g_u, flattened pair by pair (``[D]``, as :func:`raydp.privacy.clipping.clipped_sums`), without any
        per-sample gradient; flat clipping only."""
        if mode != "flat":
            raise ValueError("ghost clipping clips flat (one radius over all LoRA gradients); "
                             f"clip mode {mode!r} needs per-sample gradients")
        weights = torch.where(self.finite, factors[:, 0].to(self.losses.dtype), torch.zeros_like(self.losses))
        try:
            return flatten_pairs(*self.source.weighted_sum(self, weights), batched=False)
        finally:
            self.row_losses = None  # free the kept graph


class GhostClippingComputer:
    """Gradient source of the DP step that never materialises per-sample gradients (module docstring)."""

    ghost = True

    def __init__(self, model: torch.nn.Module, pairs: list[AdapterPair], loss=per_sequence_nll):
        low = sorted({str(p.dtype) for p in model.parameters() if p.dtype != torch.float32})
        if low:  # the second pass's rounding in bf16/fp16 layers is not linear in the weights (4e-4 measured)
            raise ValueError(f"ghost clipping needs a float32 model ({', '.join(low)} parameters found): its "
                             "margin (NORM_MARGIN) covers float32 rounding only; use per-sample clipping")
        self.pairs = pairs
        self.loss = loss
        self.module = _UnitGhostModule(model)
        self._params = [t for pair in pairs for t in (pair.a, pair.b)]
        self._hooked = [m for m in self.module.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]

    def _losses(self, module, input_ids, attention_mask, labels):
        logits = module(input_ids=input_ids, attention_mask=attention_mask).logits
        return (self.loss(logits, input_ids, attention_mask) if labels is None
                else self.loss(logits, input_ids, attention_mask, labels))

    def contributions(self, batch) -> GhostContributions:
        """First pass: forward, backward of the summed losses with the hooks on (per-unit norms)."""
        self._reset()
        rows = batch.input_ids.shape[0]
        unit_index = batch.unit_index
        if unit_index is None:
            unit_index = torch.arange(rows, device=batch.input_ids.device)
        n_units = int(unit_index.max()) + 1
        # one record per unit (the default): Opacus's per-row norms are the units' norms as they are
        self.module.unit_index, self.module.n_units = (unit_index if n_units < rows else None), n_units
        self.module.enable_hooks()
        try:
            losses = self._losses(self.module, batch.input_ids, batch.attention_mask, getattr(batch, "labels", None))
            with warnings.catch_warnings():  # Opacus's hooks on LoRA layers whose inputs need no grad
                warnings.filterwarnings("ignore", message="Full backward hook is firing")
                losses.sum().backward(retain_graph=True)
        finally:
            self.module.unit_index = None
        squared = [p._norm_sample.double().pow(2) for p in self._params]
        norms = torch.stack([squared[2 * i] + squared[2 * i + 1] for i in range(len(self.pairs))], dim=1).sqrt()
        norms = norms * (1.0 + NORM_MARGIN)  # an upper bound on the norm of what the second pass sums
        counts = torch.bincount(unit_index, minlength=n_units).to(losses.dtype)
        unit_losses = torch.zeros(n_units, dtype=losses.dtype, device=losses.device)
        unit_losses = unit_losses.index_add_(0, unit_index, losses.detach()) / counts.clamp_min(1)
        norms = norms.to(torch.float32)  # a finite float64 norm beyond float32's range is not finite here
        finite = torch.isfinite(unit_losses) & torch.isfinite(norms).all(dim=1)
        self._reset(keep_graph=True)
        return GhostContributions(
            norms=torch.where(finite.unsqueeze(1), norms, torch.zeros_like(norms)),
            losses=torch.where(finite, unit_losses, torch.zeros_like(unit_losses)),
            finite=finite, source=self, batch=(batch, unit_index), row_losses=losses)

    def weighted_sum(self, contributions: GhostContributions, weights: torch.Tensor):
        """Second pass: back-propagate sum_i f_{u(i)} loss_i; returns the per-pair sums (A and B lists)."""
        batch, unit_index = contributions.batch
        row_weights = weights[unit_index].to(contributions.row_losses.dtype)
        self.module.disable_hooks()
        try:
            with warnings.catch_warnings():  # the backward hooks are registered (though disabled) on LoRA layers
                warnings.filterwarnings("ignore", message="Full backward hook is firing")
                self._second_pass(contributions, batch, unit_index, row_weights)
        finally:
            self.module.enable_hooks()
        sums_a = [p.a.grad.detach().clone() if p.a.grad is not None else torch.zeros_like(p.a) for p in self.pairs]
        sums_b = [p.b.grad.detach().clone() if p.b.grad is not None else torch.zeros_like(p.b) for p in self.pairs]
        self._reset()
        return sums_a, sums_b

    def _second_pass(self, contributions: GhostContributions, batch, unit_index, row_weights) -> None:
        if bool(contributions.finite.all()):
            (contributions.row_losses * row_weights).sum().backward()
            return
        contributions.row_losses = None  # a NaN may sit in the kept graph: a fresh forward, finite records only
        keep = contributions.finite[unit_index]
        if bool(keep.any()):
            labels = getattr(batch, "labels", None)
            losses = self._losses(self.module, batch.input_ids[keep], batch.attention_mask[keep],
                                  None if labels is None else labels[keep])
            (losses * row_weights[keep]).sum().backward()

    def _reset(self, keep_graph: bool = False) -> None:
        for p in self._params:
            p.grad = None
            if not keep_graph:
                p._norm_sample = None
            if hasattr(p, "_forward_counter"):
                p._forward_counter = 0
        for module in self._hooked:
            if getattr(module, "activations", None):
                module.activations = []
            if hasattr(module, "max_batch_len"):
                del module.max_batch_len
