"""Ghost clipping against an independent computation: the naive per-example loop (one unit at a time,
unpadded, plain autograd), and against Opacus's per-sample hooks on the same batch."""

import math

import numpy as np
import pytest
import torch

from raydp.model.batches import Batch
from raydp.model.loss import per_sequence_nll
from raydp.privacy import BudgetGuard, PrivacyLedger
from raydp.privacy.clipping import PairLayout, PerSampleGradientComputer, combine_units, pair_norms
from raydp.privacy.engine import DPStep
from raydp.privacy.ghost import NORM_MARGIN, GhostClippingComputer, group_rows_by_unit
from raydp.privacy.randomness import PrivateRandomness
from raydp.strategies.base import Dials, Strategy, StrategyContext
from tests.test_dp_engine import padded_batch, tiny_lora_model


def layout_of(pairs):
    return PairLayout.of([p.a for p in pairs], [p.b for p in pairs], batched=False)


def naive_unit_clipped_sum(model, pairs, ids, mask, units, clip):
    """Per unit: the sum of its records' gradients (each record alone, unpadded), its norm, the factor
    min(1, C / (norm + 1e-6)) and the weighted sum: textbook user-level clipping (McMahan et al. 2018)."""
    n_units = max(units) + 1
    sums = [torch.zeros_like(t) for p in pairs for t in (p.a, p.b)]
    norms = []
    for u in range(n_units):
        unit = [torch.zeros_like(t) for p in pairs for t in (p.a, p.b)]
        for row in [r for r, x in enumerate(units) if x == u]:
            n = int(mask[row].sum())
            model.zero_grad()
            logits = model(input_ids=ids[row:row + 1, :n], attention_mask=mask[row:row + 1, :n]).logits
            per_sequence_nll(logits, ids[row:row + 1, :n], mask[row:row + 1, :n]).sum().backward()
            for acc, t in zip(unit, [t for p in pairs for t in (p.a, p.b)]):
                acc += t.grad
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in unit))
        norms.append(norm)
        factor = min(1.0, clip / (norm + 1e-6))
        for acc, g in zip(sums, unit):
            acc += factor * g
    model.zero_grad()
    return sums, np.array(norms)


@pytest.mark.parametrize("units", [[0, 1, 2, 3, 4], [0, 1, 0, 2, 1]])
def test_ghost_norms_and_clipped_sum_equal_the_naive_loop(units):
    model, pairs = tiny_lora_model()
    ids, mask = padded_batch()
    clip = 0.5
    want, want_norms = naive_unit_clipped_sum(model, pairs, ids, mask, units, clip)
    ghost = GhostClippingComputer(model, pairs)
    batch = Batch(list(range(5)), ids, mask, unit_index=torch.tensor(units))
    contributions = ghost.contributions(batch)
    flat = contributions.pair_norms().double().pow(2).sum(1).sqrt().numpy()
    assert np.allclose(flat / (1 + NORM_MARGIN), want_norms, rtol=1e-6, atol=1e-8)
    assert (flat >= want_norms).all()  # an upper bound of the norm
    assert (flat > clip).any() and (flat < clip).any() or len(set(units)) < 5  # some units are clipped
    norms = torch.tensor(want_norms).unsqueeze(1)  # clip with the naive norms: the sums must then agree exactly
    factors = torch.clamp(clip / (norms + 1e-6), max=1.0)
    sums_a, sums_b = layout_of(pairs).split(contributions.clipped_sums(factors, "flat"), batched=False)
    got = [t for pair in zip(sums_a, sums_b) for t in pair]
    for g, w in zip(got, want):
        assert (g - w).abs().max().item() <= 1e-6 * max(1.0, w.abs().max().item())
    assert all(p.a.grad is None and p.b.grad is None for p in pairs)  # nothing left behind for the optimiser


def test_ghost_pair_norms_equal_opacus_per_sample_hooks_on_the_same_batch():
    model, pairs = tiny_lora_model(seed=3)
    ids, mask = padded_batch(seed=4)
    units = torch.tensor([0, 0, 1, 2, 2])
    per_sample = combine_units(PerSampleGradientComputer(model, pairs).compute(ids, mask), units)
    model2, pairs2 = tiny_lora_model(seed=3)  # a second copy: Opacus refuses two hook sets on one model
    ghost = GhostClippingComputer(model2, pairs2).contributions(Batch(list(range(5)), ids, mask, unit_index=units))
    assert torch.allclose(ghost.pair_norms().double() / (1 + NORM_MARGIN), pair_norms(per_sample).double(),
                          rtol=1e-6, atol=1e-8)
    assert torch.allclose(ghost.losses, per_sample.losses, rtol=1e-6)


def test_group_rows_by_unit_places_each_units_rows_side_by_side():
    t = torch.arange(5 * 2 * 1, dtype=torch.float32).reshape(5, 2, 1) + 1
    out = group_rows_by_unit(t, torch.tensor([1, 0, 1, 2, 1]), 3)
    assert out.shape == (3, 6, 1)
    assert out[0, :, 0].tolist() == [3, 4, 0, 0, 0, 0]
    assert out[1, :, 0].tolist() == [1, 2, 5, 6, 9, 10]
    assert out[2, :, 0].tolist() == [7, 8, 0, 0, 0, 0]


class _Flat(Strategy):
    name = "flat-test"
    clip_mode = "flat"
    allocation = "flat"

    def dials(self, step):
        return Dials((0.3,))


def _step(model, pairs, gradients):
    strategy = _Flat()
    strategy.setup(StrategyContext(len(pairs), tuple(p.relative_depth for p in pairs), q=0.5, planned_steps=4,
                                   sigma_0=1.0, epsilon_target=1e6, delta=1e-5))
    guard = BudgetGuard("rdp", epsilon_target=1e6, delta=1e-5, planned_steps=4, q=0.5)
    return DPStep(model, pairs, strategy, PrivacyLedger(delta=1e-5), guard, q=0.5, expected_batch_size=2.5,
                  planned_steps=4, randomness=PrivateRandomness.unsafe_from_seed(11), device=torch.device("cpu"),
                  gradients=gradients)


def test_a_dp_step_with_ghost_clipping_releases_what_per_sample_clipping_releases():
    """Same batch, same secret noise seed: the two sources give the same noisy gradient."""
    ids, mask = padded_batch(seed=6)
    batch = Batch(list(range(5)), ids, mask, unit_index=torch.tensor([0, 1, 1, 2, 3]))
    model_a, pairs_a = tiny_lora_model(seed=5)
    model_b, pairs_b = tiny_lora_model(seed=5)
    per_sample = _step(model_a, pairs_a, None)
    ghost = _step(model_b, pairs_b, GhostClippingComputer(model_b, pairs_b))
    out_a, out_b = per_sample.compute(model_a, batch), ghost.compute(model_b, batch)
    assert out_a["sigma_eff"] == out_b["sigma_eff"]
    for pa, pb in zip(pairs_a, pairs_b):  # equal up to the ghost norms' 1e-5 margin on the clipped units
        assert torch.allclose(pa.a.grad, pb.a.grad, atol=2e-6) and torch.allclose(pa.b.grad, pb.b.grad, atol=2e-6)
    assert len(ghost.ledger) == 1


def test_ghost_clipping_refuses_pairwise_clipping_and_zeroes_a_non_finite_unit():
    model, pairs = tiny_lora_model(seed=2)
    ids, mask = padded_batch(seed=2)
    ghost = GhostClippingComputer(model, pairs)
    contributions = ghost.contributions(Batch(list(range(5)), ids, mask))
    with pytest.raises(ValueError, match="flat"):
        contributions.clipped_sums(torch.ones(5, len(pairs)), "pairwise")
    # a non-finite loss in unit 1: norms and loss 0 there, and the clipped sum is that of the others
    poisoned = lambda logits, i, m: per_sequence_nll(logits, i, m) * torch.tensor([1, float("nan"), 1, 1, 1])[:len(i)] \
        if len(i) == 5 else per_sequence_nll(logits, i, m)
    model2, pairs2 = tiny_lora_model(seed=2)
    bad = GhostClippingComputer(model2, pairs2, loss=poisoned).contributions(Batch(list(range(5)), ids, mask))
    assert not bool(bad.finite[1]) and bool(bad.finite[[0, 2, 3, 4]].all())
    assert float(bad.pair_norms()[1].abs().sum()) == 0.0 and float(bad.losses[1]) == 0.0
    sums_a, sums_b = layout_of(pairs2).split(bad.clipped_sums(torch.ones(5, 1), "flat"), batched=False)
    assert all(torch.isfinite(t).all() for t in sums_a + sums_b)
    keep = torch.tensor([0, 2, 3, 4])
    model3, pairs3 = tiny_lora_model(seed=2)
    ref = GhostClippingComputer(model3, pairs3).contributions(Batch([0, 1, 2, 3], ids[keep], mask[keep]))
    ref_a, ref_b = layout_of(pairs3).split(ref.clipped_sums(torch.ones(4, 1), "flat"), batched=False)
    for g, w in zip(sums_a + sums_b, ref_a + ref_b):
        assert torch.allclose(g, w, atol=1e-6)


def test_ghost_clipping_refuses_a_model_that_is_not_float32():
    """Its norm margin covers float32 rounding; a bf16 model's second pass is off by more (E1)."""
    model, pairs = tiny_lora_model(seed=1)
    model.to(torch.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        GhostClippingComputer(model, pairs)


def _embedded_with_lora():
    from raydp.model import load_model
    from raydp.model.adapters import discover_adapter_pairs

    loaded = load_model("embedded", device="cpu", progress=False)
    pairs = discover_adapter_pairs(loaded.model)
    torch.manual_seed(0)
    with torch.no_grad():  # LoRA's B starts at zero: make every gradient non-trivial
        for pair in pairs:
            pair.b.normal_(0, 0.05)
    loaded.model.train()
    for module in loaded.model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return loaded, pairs


def test_one_unit_added_moves_the_ghost_clipped_sum_by_its_own_contribution_alone(tmp_path):
    """The DP sensitivity of the clipped sum at 256 units, on the embedded model: S(D + u) - S(D) against u's
    clipped gradient computed alone (Opacus's per-sample hooks, unit u alone). The former float32 second backward
    pass summed all units' positions in float32, and the sum's rounding moved with u: 2.1e-5 C here, beyond
    NORM_MARGIN's 1e-5. Summed in float64 from the first pass's tensors it is 1.5e-7 C: u's own gradient alone
    versus in the batch (float32 kernels), which the other units do not move."""
    from raydp.config import DataConfig
    from raydp.data import load_texts, resolve_dataset
    from raydp.model.batches import TokenizedSplit
    from raydp.privacy.mechanism import CLIP

    torch.set_num_threads(1)
    dataset = resolve_dataset(DataConfig(n_records=600), tmp_path / "d", progress=False)
    loaded, pairs = _embedded_with_lora()
    loaded2, pairs2 = _embedded_with_lora()  # Opacus refuses two hook sets on one model
    loaded2.model.load_state_dict(loaded.model.state_dict())  # the same LoRA A (drawn at load)
    split = TokenizedSplit(load_texts(dataset, "train"), loaded.tokenizer, 128)
    lengths = [len(s) for s in split.sequences]
    base = list(range(256))
    # u no longer than the batch's longest: the padded width, and so every other unit's float32 tensors, stay
    u = next(i for i in range(256, len(lengths)) if lengths[i] <= max(lengths[:256]))
    ghost = GhostClippingComputer(loaded.model, pairs)
    contributions = []
    for rows in (base, base + [u]):
        b = split.collate(rows, "cpu")
        contributions.append(ghost.contributions(Batch(list(rows), b.input_ids, b.attention_mask)))
    clip = torch.tensor([float(contributions[0].norms.norm(dim=1).min()) / 2])  # every unit clipped
    sums = []
    for c in contributions:
        norms = c.norms.double().pow(2).sum(1, keepdim=True).sqrt().float()
        factors = torch.minimum(CLIP.factors(norms, clip), clip / norms)
        sums.append(c.clipped_sums(factors, "flat").double())
    alone = split.collate([u], "cpu")
    g_u = PerSampleGradientComputer(loaded2.model, pairs2).compute(alone.input_ids, alone.attention_mask)
    c_u = factors[-1].double() * g_u.flat[0].double()
    leak = float((sums[1] - sums[0] - c_u).norm() / clip)
    assert leak < 1e-6, leak
    assert float((sums[1] - sums[0]).norm() / clip) <= 1.0  # within C: the norms' margin covers the rest
