"""Ghost clipping: each unit's gradient norm without its per-sample gradient (Li, Tramer, Liang & Hashimoto
2022, "Large language models can be strong differentially private learners", Sec. 4; Lee & Kifer 2021;
DualTune-GhostDP Sec. 2, 4.2), then the clipped sum from the same pass's tensors, without a second backward
pass (the book-keeping of Bu, Wang, Zha & Karypis 2023, "Differentially private optimization on large model at
small cost", ICML).

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
* **The clipped sum.** Our DP step owns the clip (its scaling rule and the sensitivity check), so once it has
  chosen the per-unit factors f_u, the source forms ``sum_u f_u g_u = sum_{i,t} f_{u(i)} g_{i,t} a_{i,t}^T`` per
  LoRA weight from the activations and output gradients the norm sampler saw (:func:`weighted_outer_sum`),
  in float64: the very tensors whose norm was taken, so each unit's summed contribution is the one clipped.
* **Rounding.** The norm is computed in float64 and scaled up by :data:`NORM_MARGIN` (1e-5). The sum used to
  come from a second float32 backward pass (``sum_i f_{u(i)} loss_i`` through the kept graph), whose
  accumulation over every unit's padded positions rounds differently when a unit is added: S(D + u) - S(D)
  was off u's own clipped gradient (computed alone) by 4.95e-6 C at 64 units and 1.92e-5 C at 256 (review;
  6.99e-6 and 2.27e-5 re-measured here, embedded model), beyond the margins (NORM_MARGIN 1e-5, the step's
  noise margin 1e-6) from ~100 units on. Summed in float64: 1.70e-7 C and 1.62e-7 C, flat in the unit count:
  u's own gradient alone versus in the batch (float32 kernels); the other units' part of the difference is
  1.4e-14 C and 4.9e-14 C (Casacuberta et al. 2022 on floating-point sensitivity). Padded to its longest
  record, a batch that u widened rounded the other units' float32 tensors differently (1.2e-6 C at 64 units and
  2.7e-6 C at 256 when u widened it from 62 to 100 positions, growing with the unit count); a DP run pads every
  batch to one public width instead (:func:`raydp.runner.run.dp_batch_width`), so u changes no other unit's
  shapes.
* **Non-finite records.** A unit whose loss or norm is not finite contributes zero (as in
  :func:`raydp.privacy.clipping.zero_nonfinite`): its rows, which may hold a NaN, are left out of the sum.

The model must be float32: a bf16 model's former second pass was measured up to 4e-4 off, and its tensors'
rounding (2^-8 relative) would move with the padded width as the float32 ones do above (not measured), so such
a model is refused (per-sample clipping works). Only flat clipping (one radius over every LoRA gradient) is
implemented. Cost on CPU (embedded model, one thread, CPU time per step): 0.20 s against the second pass's
0.26 s at 64 units, 0.99 s against 1.31 s at 256, peak memory 30-80 MiB lower (no graph kept). Opacus's docs: ``opacus.grad_sample.GradSampleModuleFastGradientClipping``; its
hooks refuse tied parameters under ghost clipping.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
from opacus.grad_sample import GradSampleModuleFastGradientClipping
from opacus.grad_sample.linear import compute_linear_norm_sample

from raydp.model.adapters import AdapterPair
from raydp.model.loss import per_sequence_nll
from raydp.privacy.clipping import isolates_records, refuse_compiled
from raydp.privacy.mechanism import flatten_pairs


#: Ghost norms are scaled up by this much before clipping: an upper bound, with room, on the float64
#: rounding of the norm (T x T Gram products) and of the clipped sum (module docstring; ~1e-14 C measured), and
#: the slack that absorbs the padded width's effect on the other units' float32 tensors at the sizes measured.
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
        self.captured: dict[torch.nn.Parameter, tuple[torch.Tensor, torch.Tensor]] = {}
        # An instance-level table: the class's NORM_SAMPLERS stays Opacus's own for every other module.
        self.NORM_SAMPLERS = {**type(self).NORM_SAMPLERS, torch.nn.Linear: self._unit_linear_norm}

    def _unit_linear_norm(self, layer, activations, backprops):
        # the float32 tensors the norm is computed from are the ones the clipped sum is computed from
        self.captured[layer.weight] = (activations[0].detach(), backprops.detach())
        # float64: in float32 the T x T Gram products carry ~1e-5 relative error (8e-6 measured on the
        # embedded model at T = 357), above what the step's noise margin covers
        activations, backprops = [activations[0].double()], backprops.double()
        if self.unit_index is not None:
            activations = [group_rows_by_unit(activations[0], self.unit_index, self.n_units)]
            backprops = group_rows_by_unit(backprops, self.unit_index, self.n_units)
        return compute_linear_norm_sample(layer, activations, backprops)


@dataclass
class GhostContributions:
    """One step's per-unit contributions, known by their norms; :meth:`clipped_sums` forms the clipped sum
    from the first pass's activations and output gradients once the step has chosen the clip factors."""

    norms: torch.Tensor  # [units, n_pairs]: the joint norm of (g_A_i, g_B_i) per unit (Eq. 4)
    losses: torch.Tensor  # [units]: mean of the unit's records' losses; 0 for a non-finite unit
    finite: torch.Tensor  # [units] bool
    source: GhostClippingComputer = field(repr=False)
    batch: object = field(repr=False)
    # per LoRA weight, the first pass's (activations, output gradients) of its layer, [rows, T, d] each
    captured: dict | None = field(default=None, repr=False)

    @property
    def batch_size(self) -> int:
        return int(self.losses.shape[0])

    def pair_norms(self) -> torch.Tensor:
        return self.norms

    def clipped_sums(self, factors: torch.Tensor, mode: str) -> torch.Tensor:
        """sum_u f_u g_u, flattened pair by pair (``[D]``, float64, as :func:`raydp.privacy.clipping.clipped_sums`),
        without any per-sample gradient; flat clipping only."""
        if mode != "flat":
            raise ValueError("ghost clipping clips flat (one radius over all LoRA gradients); "
                             f"clip mode {mode!r} needs per-sample gradients")
        weights = torch.where(self.finite, factors[:, 0].double(), torch.zeros_like(self.losses, dtype=torch.float64))
        try:
            return flatten_pairs(*self.source.weighted_sum(self, weights), batched=False)
        finally:
            self.captured = None  # free the first pass's tensors


#: Elements of one chunk of the clipped sum's float64 copies (bounds their memory).
SUM_CHUNK_ELEMENTS = 1 << 24


def weighted_outer_sum(activations: torch.Tensor, backprops: torch.Tensor, row_weights: torch.Tensor) -> torch.Tensor:
    """sum_{i,t} w_i g_{i,t} a_{i,t}^T in float64: the weight gradient of ``sum_i w_i loss_i`` of a linear layer
    (``[d_out, d_in]``), from its input activations ``a`` ``[rows, T, d_in]`` and output gradients ``g``
    ``[rows, T, d_out]`` of ``sum_i loss_i``. A row of weight 0 is skipped (its tensors may hold a NaN)."""
    rows = activations.shape[0]
    a = activations.reshape(rows, -1, activations.shape[-1])
    g = backprops.reshape(rows, -1, backprops.shape[-1])
    out = torch.zeros(g.shape[-1], a.shape[-1], dtype=torch.float64, device=a.device)
    keep = torch.nonzero(row_weights != 0).flatten()
    step = max(1, SUM_CHUNK_ELEMENTS // max(1, a.shape[1] * max(a.shape[-1], g.shape[-1])))
    for chunk in keep.split(step):
        a_c = a[chunk].double().flatten(0, 1)
        g_c = (g[chunk].double() * row_weights[chunk].double()[:, None, None]).flatten(0, 1)
        out += g_c.T @ a_c
    return out


class GhostClippingComputer:
    """Gradient source of the DP step that never materialises per-sample gradients (module docstring)."""

    ghost = True

    def __init__(self, model: torch.nn.Module, pairs: list[AdapterPair], loss=per_sequence_nll):
        devices = sorted({p.device.type for p in model.parameters()})
        if any(isolates_records(d) for d in devices):  # bench/bench_row_independence.py, docs/privacy.md
            raise ValueError(f"ghost clipping computes a batch in one pass, and on {'/'.join(devices)} one record "
                             "changes the other records' contributions (kernels chosen by the batch's shape); off "
                             "the CPU use per-sample clipping, which computes each record alone")
        low = sorted({str(p.dtype) for p in model.parameters() if p.dtype != torch.float32})
        if low:  # measured with the former float32 second pass: 4e-4 off in bf16 (module docstring)
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
        """The one pass: forward, backward of the summed losses with the hooks on (per-unit norms; each LoRA
        layer's activations and output gradients kept for the clipped sum)."""
        refuse_compiled(self.module)
        self._reset()
        rows = batch.input_ids.shape[0]
        unit_index = batch.unit_index
        if unit_index is None:
            unit_index = torch.arange(rows, device=batch.input_ids.device)
        n_units = int(unit_index.max()) + 1
        # one record per unit (the default): Opacus's per-row norms are the units' norms as they are
        self.module.unit_index, self.module.n_units = (unit_index if n_units < rows else None), n_units
        self.module.captured = {}
        self.module.enable_hooks()
        try:
            losses = self._losses(self.module, batch.input_ids, batch.attention_mask, getattr(batch, "labels", None))
            with warnings.catch_warnings():  # Opacus's hooks on LoRA layers whose inputs need no grad
                warnings.filterwarnings("ignore", message="Full backward hook is firing")
                losses.sum().backward()
            captured = self.module.captured
        finally:
            self.module.unit_index = None
            self.module.captured = {}
        squared = [p._norm_sample.double().pow(2) for p in self._params]
        norms = torch.stack([squared[2 * i] + squared[2 * i + 1] for i in range(len(self.pairs))], dim=1).sqrt()
        norms = norms * (1.0 + NORM_MARGIN)  # an upper bound on the norm of what the clipped sum sums
        counts = torch.bincount(unit_index, minlength=n_units).to(losses.dtype)
        unit_losses = torch.zeros(n_units, dtype=losses.dtype, device=losses.device)
        unit_losses = unit_losses.index_add_(0, unit_index, losses.detach()) / counts.clamp_min(1)
        norms = norms.to(torch.float32)  # a finite float64 norm beyond float32's range is not finite here
        finite = torch.isfinite(unit_losses) & torch.isfinite(norms).all(dim=1)
        self._reset()
        return GhostContributions(
            norms=torch.where(finite.unsqueeze(1), norms, torch.zeros_like(norms)),
            losses=torch.where(finite, unit_losses, torch.zeros_like(unit_losses)),
            finite=finite, source=self, batch=(batch, unit_index), captured=captured)

    def weighted_sum(self, contributions: GhostContributions, weights: torch.Tensor):
        """sum_u f_u g_u per LoRA weight, in float64, from the first pass's tensors (:func:`weighted_outer_sum`);
        returns the per-pair sums (A and B lists)."""
        if contributions.captured is None:
            raise RuntimeError("these contributions' clipped sum was already taken")
        _, unit_index = contributions.batch
        row_weights = weights.double()[unit_index]

        def summed(param):
            if param not in contributions.captured:  # a LoRA layer the forward did not reach
                return torch.zeros_like(param, dtype=torch.float64)
            return weighted_outer_sum(*contributions.captured[param], row_weights).reshape(param.shape)

        return [summed(p.a) for p in self.pairs], [summed(p.b) for p in self.pairs]

    def _reset(self) -> None:
        for p in self._params:
            p.grad = None
            p._norm_sample = None
            if hasattr(p, "_forward_counter"):
                p._forward_counter = 0
        for module in self._hooked:
            if getattr(module, "activations", None):
                module.activations = []
            if hasattr(module, "max_batch_len"):
                del module.max_batch_len
