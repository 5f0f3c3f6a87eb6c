"""DP step against independent computations: a naive per-example loop and the noise allocation."""

import math

import numpy as np
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from raydp.model.loading import LoraSettings, apply_lora
from raydp.model.adapters import discover_adapter_pairs
from raydp.model.batches import Batch
from raydp.model.loss import per_sequence_nll
from raydp.privacy import BudgetGuard, PrivacyLedger
from raydp.privacy.clipping import (
    PerSampleGradientComputer,
    PerSampleGrads,
    clip_factors,
    clipped_sums,
    group_norms,
    pair_norms,
)
from raydp.privacy.engine import DPStep
from raydp.privacy.randomness import PrivateRandomness
from raydp.runner.sampling import PoissonSampler
from raydp.strategies.base import Dials, Strategy, StrategyContext


def tiny_lora_model(seed=0, n_layer=3):
    torch.manual_seed(seed)
    return _with_lora(GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=32, n_embd=16, n_layer=n_layer, n_head=2,
                                                 embd_pdrop=0, attn_pdrop=0, resid_pdrop=0)), "gpt2")


def _with_lora(base, model_type):
    model = apply_lora(base, model_type, LoraSettings(r=4, alpha=8, dropout=0.0))
    pairs = discover_adapter_pairs(model)
    with torch.no_grad():  # B starts at zero in LoRA; make both A and B gradients non-trivial
        for pair in pairs:
            pair.b.normal_(0, 0.5)
    model.train()
    return model, pairs


def padded_batch(seed=1, lengths=(9, 5, 12, 3, 7)):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(1, 50, (n,), generator=g)
        mask[row, :n] = 1
    return ids, mask


def naive_clipped_sums(model, pairs, ids, mask, clips, mode):
    """One example at a time, unpadded, with autograd: the textbook per-example clipping."""
    sums_a = [torch.zeros_like(p.a) for p in pairs]
    sums_b = [torch.zeros_like(p.b) for p in pairs]
    norms = []
    for row in range(ids.shape[0]):
        n = int(mask[row].sum())
        model.zero_grad()
        logits = model(input_ids=ids[row : row + 1, :n], attention_mask=mask[row : row + 1, :n]).logits
        per_sequence_nll(logits, ids[row : row + 1, :n], mask[row : row + 1, :n]).sum().backward()
        ga = [p.a.grad.detach().clone() for p in pairs]
        gb = [p.b.grad.detach().clone() for p in pairs]
        pair_norm = [math.sqrt(float(a.pow(2).sum() + b.pow(2).sum())) for a, b in zip(ga, gb)]
        norms.append(pair_norm)
        if mode == "flat":
            total = math.sqrt(sum(x * x for x in pair_norm))
            factors = [min(1.0, clips[0] / (total + 1e-6))] * len(pairs)
        else:
            factors = [min(1.0, c / (x + 1e-6)) for c, x in zip(clips, pair_norm)]
        for i in range(len(pairs)):
            sums_a[i] += factors[i] * ga[i]
            sums_b[i] += factors[i] * gb[i]
    model.zero_grad()
    return sums_a, sums_b, np.array(norms)


@pytest.mark.parametrize("mode, clips", [("pairwise", [0.05, 0.2, 1e3]), ("flat", [0.1])])
def test_clipped_sums_equal_naive_per_example_loop(mode, clips):
    model, pairs = tiny_lora_model()
    ids, mask = padded_batch()
    expected_a, expected_b, expected_norms = naive_clipped_sums(model, pairs, ids, mask, clips, mode)
    computer = PerSampleGradientComputer(model, pairs)
    grads = computer.compute(ids, mask)
    norms = pair_norms(grads)
    assert torch.allclose(norms, torch.tensor(expected_norms, dtype=norms.dtype), atol=1e-6, rtol=1e-5)
    factors = clip_factors(group_norms(norms, mode), torch.tensor(clips))
    sums_a, sums_b = grads.layout.split(clipped_sums(grads, factors, mode), batched=False)
    for got, want in zip(sums_a + sums_b, expected_a + expected_b):
        assert (got - want).abs().max().item() <= 1e-6
    if mode == "pairwise":  # the first pair is clipped, the last (huge radius) is not
        assert (factors[:, 0] < 1).all() and (factors[:, 2] == 1).all()


def _llama_lora_model(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return _with_lora(LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32,
                                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                   max_position_embeddings=32)), "llama")


@pytest.mark.parametrize("build", [tiny_lora_model, _llama_lora_model], ids=["gpt2", "llama"])
def test_per_sample_gradients_equal_opacus_grad_sample_module(build):
    """Our one-hook-per-matrix gradients against Opacus's GradSampleModule (an independent implementation of the
    linear rule), on a padded batch, GPT-2 (fused c_attn, Conv1D base) and Llama (q_proj and v_proj of two sizes)."""
    import warnings

    from opacus import GradSampleModule

    ids, mask = padded_batch()
    model, pairs = build()
    ours = PerSampleGradientComputer(model, pairs).compute(ids, mask)
    assert all(p.a.grad is None and p.b.grad is None for p in pairs)  # only the per-sample gradients are kept
    reference_model, reference_pairs = build()
    module = GradSampleModule(reference_model, batch_first=True, loss_reduction="sum")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        per_sequence_nll(module(input_ids=ids, attention_mask=mask).logits, ids, mask).sum().backward()
    for got_a, got_b, pair in zip(ours.a, ours.b, reference_pairs):
        assert got_a.shape == pair.a.grad_sample.shape and got_b.shape == pair.b.grad_sample.shape
        assert torch.allclose(got_a, pair.a.grad_sample, atol=1e-6, rtol=1e-5)
        assert torch.allclose(got_b, pair.b.grad_sample, atol=1e-6, rtol=1e-5)
        assert got_b.abs().sum() > 0 and got_a.abs().sum() > 0
    if build is _llama_lora_model:
        assert len({p.b.shape for p in pairs}) == 2  # q_proj and v_proj (grouped-query attention) differ


def test_per_sample_hooks_act_only_inside_compute():
    model, pairs = tiny_lora_model()
    ids, mask = padded_batch()
    computer = PerSampleGradientComputer(model, pairs)
    per_sequence_nll(model(input_ids=ids, attention_mask=mask).logits, ids, mask).sum().backward()
    summed = [p.a.grad.clone() for p in pairs]  # an ordinary backward elsewhere: ordinary gradients, no state kept
    model.zero_grad(set_to_none=True)
    grads = computer.compute(ids, mask)
    for total, per_sample in zip(summed, grads.a):
        assert torch.allclose(per_sample.sum(0), total, atol=1e-6)
    computer.remove()
    assert not any(m._forward_hooks for m in model.modules())


class FixedDials(Strategy):
    """Test strategy: fixed, distinct per-pair clips and a fixed sigma."""

    name = "fixed"

    def __init__(self, clips, sigma, allocation):
        self.clips, self.sigma, self.allocation = tuple(clips), sigma, allocation

    def dials(self, step):
        return Dials(self.clips, self.sigma)


@pytest.mark.parametrize("allocation", ["proportional", "uniform"])
def test_noise_std_per_pair_matches_allocation(allocation):
    model, pairs = tiny_lora_model(n_layer=3)
    clips, sigma = [0.05, 0.2, 0.8], 1.3
    n = len(pairs)
    strategy = FixedDials(clips, sigma, allocation)
    strategy.setup(StrategyContext(n, (0.0, 0.5, 1.0), q=0.5, planned_steps=400, sigma_0=sigma,
                                   epsilon_target=1e6, delta=1e-5))
    ledger = PrivacyLedger(delta=1e-5, epsilon_target=1e6)
    guard = BudgetGuard("rdp", epsilon_target=1e6, delta=1e-5, planned_steps=400, q=0.5)
    expected_batch = 2.5
    ids, mask = padded_batch()
    want_a, want_b, _ = naive_clipped_sums(model, pairs, ids, mask, clips, "pairwise")
    step = DPStep(model, pairs, strategy, ledger, guard, q=0.5, expected_batch_size=expected_batch,
                  planned_steps=400, randomness=PrivateRandomness.unsafe_from_seed(7), device=torch.device("cpu"))
    residuals = [[] for _ in range(n)]
    for _ in range(40):
        step.compute(model, Batch(list(range(ids.shape[0])), ids, mask))
        for i, pair in enumerate(pairs):
            # grad * E[B] - clipped sum is the noise alone: checks sum, normalisation and noise together.
            noise = torch.cat([(pair.a.grad * expected_batch - want_a[i]).flatten(),
                               (pair.b.grad * expected_batch - want_b[i]).flatten()])
            residuals[i].append(noise)
    c = np.array(clips)
    expected_std = sigma * math.sqrt(n) * c if allocation == "proportional" else np.full(n, sigma * np.linalg.norm(c))
    for i in range(n):
        sample = torch.cat(residuals[i]).double()
        assert abs(sample.mean().item()) < 4 * expected_std[i] / math.sqrt(sample.numel())
        assert sample.std().item() == pytest.approx(expected_std[i], rel=0.03)
    # The ledger charged exactly sigma (E1): sigma_eff = (sum C_i^2 / s_i^2)^-1/2, computed directly.
    direct = sum(ci * ci / (si * si) for ci, si in zip(c, expected_std)) ** -0.5
    assert direct == pytest.approx(sigma, rel=1e-12)
    assert np.allclose(ledger.sigma_eff, direct, rtol=1e-5) and len(ledger) == 40
    assert (ledger.sigma_eff <= direct * (1 + 1e-9)).all()  # never credits more noise than was added


def test_empty_poisson_batch_releases_noise_and_counts_a_step():
    model, pairs = tiny_lora_model(n_layer=2)
    strategy = FixedDials([1.0], 2.0, "flat")
    strategy.clip_mode = "flat"
    strategy.setup(StrategyContext(len(pairs), (0.0, 1.0), q=0.01, planned_steps=10, sigma_0=2.0,
                                   epsilon_target=1e6, delta=1e-5))
    ledger = PrivacyLedger(delta=1e-5, epsilon_target=1e6)
    guard = BudgetGuard("rdp", epsilon_target=1e6, delta=1e-5, planned_steps=10, q=0.01)
    step = DPStep(model, pairs, strategy, ledger, guard, q=0.01, expected_batch_size=1.0, planned_steps=10,
                  randomness=PrivateRandomness.unsafe_from_seed(3), device=torch.device("cpu"))
    empty = Batch([], torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, 1, dtype=torch.long))
    metrics = step.compute(model, empty)
    assert len(ledger) == 1 and ledger.q[0] == 0.01
    assert all(p.a.grad is not None and p.a.grad.abs().sum() > 0 for p in pairs)
    assert "loss" not in metrics and "batch_size" not in metrics  # nothing unprivatized is reported


def test_poisson_sampler_is_poisson():
    sampler = PoissonSampler(1000, 0.02, rng=np.random.default_rng(0))
    sizes = [len(sampler.next_indices()) for _ in range(3000)]
    assert np.mean(sizes) == pytest.approx(20, rel=0.03)
    assert np.var(sizes) == pytest.approx(1000 * 0.02 * 0.98, rel=0.1)  # binomial, not fixed-size
    assert sampler.expected_batch_size == 20 and sampler.steps_per_epoch == 50
    tiny = PoissonSampler(10, 0.01, rng=np.random.default_rng(1))
    assert sum(len(tiny.next_indices()) == 0 for _ in range(200)) > 150  # empty batches happen


class GreedyLowSigma(Strategy):
    """Proposes a sigma far below sigma_0 from step 3 on: the guard must raise it."""

    name = "greedy"
    clip_mode = "flat"
    allocation = "flat"

    def dials(self, step):
        return Dials((1.0,), self.context.sigma_0 * (0.2 if step >= 3 else 1.0))


def test_trainer_with_guard_clamps_and_stops_at_the_plan(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    from raydp.data import public_corpus
    from raydp.privacy import calibrate_sigma
    from raydp.model.batches import TokenizedSplit
    from raydp.runner.loop import OptimizerSettings, Trainer

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=512, n_embd=16, n_layer=2, n_head=2))
    model = apply_lora(base, "gpt2", LoraSettings(r=4, alpha=8, dropout=0.0))
    pairs = discover_adapter_pairs(model)
    texts = public_corpus(60, seed=3, progress=False)
    train, evaluation = TokenizedSplit(texts[:50], tokenizer, 512), TokenizedSplit(texts[50:], tokenizer, 512)
    q, planned, eps, delta = 0.1, 12, 3.0, 1e-5
    sigma_0 = calibrate_sigma(eps, delta, q, planned, "pld").sigma
    strategy = GreedyLowSigma()
    strategy.setup(StrategyContext(len(pairs), (0.0, 1.0), q, planned, sigma_0, eps, delta))
    ledger = PrivacyLedger(delta=delta, epsilon_target=eps)
    guard = BudgetGuard("pld", epsilon_target=eps, delta=delta, planned_steps=planned, q=q, sigma_hint=sigma_0)
    sampler = PoissonSampler(len(train), q, rng=np.random.default_rng(0))
    step = DPStep(model, pairs, strategy, ledger, guard, q=q, expected_batch_size=sampler.expected_batch_size,
                  planned_steps=planned, randomness=PrivateRandomness.unsafe_from_seed(1), device=torch.device("cpu"))
    trainer = Trainer(model, train, evaluation, sampler, step, torch.device("cpu"),
                      OptimizerSettings(warmup_steps=0), eval_every=100, progress=False)
    trainer.run(planned + 5)  # asks for more steps than the budget was planned for
    assert len(ledger) == planned and trainer.step_count == planned
    assert trainer.stopped_early and "planned" in trainer.stopped_early
    assert step.clamp_events and step.clamp_events[0]["step"] == 3
    assert all(e["sigma"] > e["proposed"] for e in step.clamp_events)
    # Independent check of the whole ledger with dp_accounting.
    from dp_accounting import dp_event
    from dp_accounting.pld import PLDAccountant

    accountant = PLDAccountant()
    for qq, s in zip(ledger.q, ledger.sigma_eff):
        accountant.compose(dp_event.PoissonSampledDpEvent(float(qq), dp_event.GaussianDpEvent(float(s))))
    assert accountant.get_epsilon(delta) <= eps
    assert trainer.history.eval_rows[-1]["step"] == planned


class _Overflowing:
    """A transform whose output overflows for the first sample only (as (g - a) / b with a tiny b can)."""

    name = "overflowing"

    def forward(self, flat):
        out = flat.clone()
        out[0] = flat[0] * 1e38 * 1e38  # inf in float32
        return out

    def inverse_mean(self, noisy_sum, expected_batch_size):
        return noisy_sum / expected_batch_size


class _SlightlyOver:
    """A scaling rule that exceeds its bound by a relative 5e-6, inside the engine's tolerance."""

    name = "slightly-over"

    def factors(self, norms, clips):
        return clips.unsqueeze(0) / norms.clamp_min(1e-12) * (1 + 5e-6)


class WithMechanism(Strategy):
    name = "with-mechanism"
    clip_mode = "flat"
    allocation = "flat"

    def __init__(self, **mechanism):
        self.mechanism = mechanism

    def dials(self, step):
        return Dials((0.5,), **self.mechanism)


def _flat_step(strategy, seed=3):
    model, pairs = tiny_lora_model(n_layer=2)
    strategy.setup(StrategyContext(len(pairs), (0.0, 1.0), q=0.5, planned_steps=10, sigma_0=1.0,
                                   epsilon_target=1e6, delta=1e-5))
    guard = BudgetGuard("rdp", epsilon_target=1e6, delta=1e-5, planned_steps=10, q=0.5)
    step = DPStep(model, pairs, strategy, PrivacyLedger(delta=1e-5), guard, q=0.5, expected_batch_size=2.5,
                  planned_steps=10, randomness=PrivateRandomness.unsafe_from_seed(seed), device=torch.device("cpu"))
    return model, pairs, step


def test_a_sample_that_overflows_in_the_transform_contributes_zero_not_nan():
    ids, mask = padded_batch()
    model, pairs, step = _flat_step(WithMechanism(transform=_Overflowing()))
    grads = step.per_sample_gradients(Batch(list(range(ids.shape[0])), ids, mask), step.prepare(0).dials)
    assert all(torch.isfinite(g).all() for g in grads.a + grads.b)
    assert all(float(g[0].abs().sum()) == 0.0 for g in grads.a + grads.b)  # the overflowing unit is zeroed
    step.compute(model, Batch(list(range(ids.shape[0])), ids, mask))
    assert all(torch.isfinite(p.a.grad).all() and torch.isfinite(p.b.grad).all() for p in pairs)


def test_a_scaling_rule_within_tolerance_is_still_capped_at_the_clip():
    ids, mask = padded_batch()
    model, pairs, step = _flat_step(WithMechanism(scaling=_SlightlyOver()))
    dials = step.prepare(0).dials
    grads = step.per_sample_gradients(Batch(list(range(ids.shape[0])), ids, mask), dials)
    groups = group_norms(pair_norms(grads), "flat")
    step.clip(grads, groups, dials, "flat")
    # one sample at a time: each clipped contribution's norm, recomputed in float64, is <= C (1 + 1e-6)
    for row in range(ids.shape[0]):
        one = type(grads)(grads.flat[row:row + 1], grads.layout, grads.losses[row:row + 1])
        a, b = grads.layout.split(step.clip(one, group_norms(pair_norms(one), "flat"), dials, "flat"), batched=False)
        norm = math.sqrt(sum(float(t.double().pow(2).sum()) for t in a + b))
        assert norm <= 0.5 * (1 + 1e-6)


def test_a_fixed_schedule_refuses_to_resume_a_ledger_from_another_plan():
    ids, mask = padded_batch()
    model, pairs, step = _flat_step(WithMechanism())
    for _ in range(3):
        step.compute(model, Batch(list(range(ids.shape[0])), ids, mask))
    state = step.state_dict()
    strategy = WithMechanism()
    model, pairs, other = _flat_step(strategy)
    other.sigma_0 = 1.2  # the same config recalibrated differently (e.g. epochs changed before --resume)
    with pytest.raises(ValueError, match="not a prefix of this run's plan"):
        other.load_state_dict(state)
    model, pairs, same = _flat_step(WithMechanism())
    same.load_state_dict(state)
    assert len(same.ledger) == 3


# -- review of the grouped DP step (issue 28): float-range edges of the clip bound ------------------------------

class _PairwiseWith(Strategy):
    name = "pairwise-with"
    clip_mode = "pairwise"
    allocation = "proportional"

    def __init__(self, clip, **mechanism):
        self.clip, self.mechanism = clip, mechanism

    def dials(self, step):
        return Dials((self.clip,) * self.context.n_pairs, **self.mechanism)


def _pairwise_step(strategy):
    model, pairs = tiny_lora_model(n_layer=2)
    strategy.setup(StrategyContext(len(pairs), (0.0, 1.0), q=0.5, planned_steps=10, sigma_0=1.0,
                                   epsilon_target=1e6, delta=1e-5))
    guard = BudgetGuard("rdp", epsilon_target=1e6, delta=1e-5, planned_steps=10, q=0.5)
    return pairs, DPStep(model, pairs, strategy, PrivacyLedger(delta=1e-5), guard, q=0.5, expected_batch_size=2.5,
                         planned_steps=10, randomness=PrivateRandomness.unsafe_from_seed(3), device=torch.device("cpu"))


def _contribution_norms(step, grads, dials):
    """Each unit's clipped contribution alone, per pair, in float64 (the sum of a batch of one)."""
    out = []
    for row in range(grads.batch_size):
        one = PerSampleGrads(grads.flat[row:row + 1], grads.layout, grads.losses[row:row + 1])
        out.append(grads.layout.segment_norms(step.clip(one, pair_norms(one), dials, "pairwise").double()))
    return torch.stack(out)


@pytest.mark.parametrize("clip", [1.0, 1e-2, 1e-5, 2.2e-7])
def test_a_huge_finite_gradient_is_still_clipped_to_its_radius(clip):
    """Found in review: with norms summed in float64, a gradient near the top of the float32 range has a finite
    norm, and C / norm falls among float32's subnormal numbers, where rounding is coarse (up to 2x at C = 2e-7). Such
    a unit now contributes nothing; every contribution stays within C (1 + 1e-6)."""
    pairs, step = _pairwise_step(_PairwiseWith(clip))
    layout = step.layout
    g = torch.Generator().manual_seed(0)
    flat = torch.randn(4, layout.dim, generator=g) * 1e37
    flat[:, 0] = 3.3e38  # finite in float32; its square is not
    flat[3] = torch.randn(layout.dim, generator=g) * 1e-3  # an ordinary unit beside them
    grads = PerSampleGrads(flat, layout, torch.zeros(4))
    norms = _contribution_norms(step, grads, step.prepare(0).dials)
    assert (norms <= clip * (1 + 1e-6)).all()
    assert (norms[3] > 0).all()  # the ordinary unit still counts


def test_a_custom_scaling_rule_with_an_overflowing_norm_gives_zero_not_an_error():
    """A norm beyond float32's range is inf: a rule that maps it to 0 must not fail the step on 0 * inf (which
    sample was drawn would decide whether the run crashes)."""
    class _Auto:
        name = "auto"

        def factors(self, norms, clips):
            return clips.unsqueeze(0) / (norms + 0.01)

    pairs, step = _pairwise_step(_PairwiseWith(0.5, scaling=_Auto()))
    flat = torch.full((2, step.layout.dim), 1e-3)
    flat[0, :] = 3e38  # its norm, finite in float64, is beyond float32: inf once cast
    grads = PerSampleGrads(flat, step.layout, torch.zeros(2))
    norms = _contribution_norms(step, grads, step.prepare(0).dials)
    assert float(norms[0].abs().sum()) == 0.0 and (norms[1] > 0).all() and (norms <= 0.5 * (1 + 1e-6)).all()


class _AutoS:
    """AUTO-S's shape (C / (norm + gamma)), optionally in float64."""

    name = "auto-s-like"

    def __init__(self, dtype=None):
        self.dtype = dtype

    def factors(self, norms, clips):
        out = clips.unsqueeze(0) / (norms + 0.01)
        return out if self.dtype is None else out.to(self.dtype)


@pytest.mark.parametrize("dtype", [None, torch.float64], ids=["float32", "float64"])
def test_a_custom_rule_on_huge_finite_gradients_neither_crashes_nor_exceeds_the_radius(dtype):
    """Second review: a custom rule's C / norm for a norm near the top of float32's range is subnormal and rounds
    past the check's tolerance, so the step raised depending on which units were drawn; and a rule giving float64
    factors escaped the float32 threshold. Such units contribute nothing; the others stay within C (1 + 1e-6)."""
    clip = 1e-5
    pairs, step = _pairwise_step(_PairwiseWith(clip, scaling=_AutoS(dtype)))
    g = torch.Generator().manual_seed(2)
    flat = torch.randn(6, step.layout.dim, generator=g) * torch.logspace(35, 37, 6).unsqueeze(1)
    flat[:, 0] = 3.3e38
    flat[5] = torch.randn(step.layout.dim, generator=g) * 1e-3
    grads = PerSampleGrads(flat, step.layout, torch.zeros(6))
    norms = _contribution_norms(step, grads, step.prepare(0).dials)
    assert (norms <= clip * (1 + 1e-6)).all() and (norms[5] > 0).all()


def test_adding_one_unit_moves_the_clipped_sum_by_at_most_its_radius():
    """Found in review: a float32 sum over the batch rounds differently with one more unit, by ~4e-6 C over 4,096
    units (more than the noise margin covers). The sum is float64: the neighbouring sums differ by the unit's clipped
    contribution to within ~1e-12."""
    pairs, step = _pairwise_step(_PairwiseWith(1.0))
    g = torch.Generator().manual_seed(1)
    flat = torch.randn(4097, step.layout.dim, generator=g)
    dials = step.prepare(0).dials
    with_unit = PerSampleGrads(flat, step.layout, torch.zeros(4097))
    without = PerSampleGrads(flat[1:], step.layout, torch.zeros(4096))
    difference = step.clip(with_unit, pair_norms(with_unit), dials, "pairwise") - \
        step.clip(without, pair_norms(without), dials, "pairwise")
    assert (step.layout.segment_norms(difference) <= 1.0 + 1e-9).all()


def test_a_lora_input_without_the_batch_dimension_is_refused():
    """Found in review: an adapter also applied to a tensor shared by the batch ([1, ...], a learned prefix) would
    have its gradient broadcast into every row, so each row's "per-sample" gradient would carry the others'."""
    from types import SimpleNamespace

    from peft import LoraConfig, get_peft_model

    class Prefixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(50, 8)
            self.proj = torch.nn.Linear(8, 8)
            self.head = torch.nn.Linear(8, 50)
            self.prefix = torch.nn.Parameter(torch.randn(1, 2, 8), requires_grad=False)

        def forward(self, input_ids, attention_mask=None):
            x = self.proj(self.embed(input_ids)) + self.proj(self.prefix).sum(1, keepdim=True)
            return SimpleNamespace(logits=self.head(x))

    torch.manual_seed(0)
    model = get_peft_model(Prefixed(), LoraConfig(r=2, target_modules=["proj"]))
    pairs = discover_adapter_pairs(model)
    ids, mask = padded_batch()
    with pytest.raises(ValueError, match="carry the batch dimension"):
        PerSampleGradientComputer(model, pairs).compute(ids, mask)


class _SeesUpdates(FixedDials):
    observes_update = True

    def observe(self, release, ledger):
        self.seen = release


@pytest.mark.parametrize("observes", [True, False])
def test_a_strategy_sees_the_parameter_change_only_when_it_asks(observes):
    """``release.update`` is the optimizer's change of each LoRA tensor, measured here around the step; a strategy
    that does not declare ``observes_update`` gets none (the DP step then copies no parameters)."""
    model, pairs = tiny_lora_model(n_layer=2)
    strategy = _SeesUpdates([0.1, 0.3], 1.0, "proportional")
    strategy.observes_update = observes
    strategy.setup(StrategyContext(len(pairs), (0.0, 1.0), q=0.5, planned_steps=10, sigma_0=1.0,
                                   epsilon_target=1e6, delta=1e-5))
    step = DPStep(model, pairs, strategy, PrivacyLedger(delta=1e-5, epsilon_target=1e6),
                  BudgetGuard("rdp", epsilon_target=1e6, delta=1e-5, planned_steps=10, q=0.5), q=0.5,
                  expected_batch_size=2.5, planned_steps=10, randomness=PrivateRandomness.unsafe_from_seed(1),
                  device=torch.device("cpu"))
    optimizer = torch.optim.SGD([t for p in pairs for t in (p.a, p.b)], lr=0.5)
    ids, mask = padded_batch()
    step.compute(model, Batch(list(range(ids.shape[0])), ids, mask))
    before = [t.detach().clone() for p in pairs for t in (p.a, p.b)]
    grads = [t.grad.clone() for p in pairs for t in (p.a, p.b)]
    optimizer.step()
    step.after_update(model)
    if not observes:
        assert strategy.seen.update == []
        return
    assert len(strategy.seen.update) == 2 * len(pairs)
    for change, old, grad, t in zip(strategy.seen.update, before, grads, [t for p in pairs for t in (p.a, p.b)]):
        assert change.shape == t.shape
        assert torch.allclose(change, t.detach() - old) and torch.allclose(change, -0.5 * grad, atol=1e-7)


def test_layout_split_views_match_slicing_in_flattened_order():
    from raydp.privacy.clipping import PairLayout

    shapes = (((4, 16), (16, 4)), ((4, 16), (48, 4)), ((2, 3), (5, 2)))
    layout = PairLayout(shapes)
    flat = torch.arange(3 * layout.dim, dtype=torch.float32).reshape(3, layout.dim)
    a, b = layout.split(flat, batched=True)
    a1, b1 = layout.split(flat[1], batched=False)
    at = 0
    for i, (sa, sb) in enumerate(shapes):
        for got, got1, shape in ((a[i], a1[i], sa), (b[i], b1[i], sb)):
            n = int(np.prod(shape))
            assert torch.equal(got, flat[:, at:at + n].reshape(3, *shape)) and torch.equal(got1, got[1])
            assert got.data_ptr() == flat[:, at:].data_ptr()  # a view, no copy
            at += n
    assert at == layout.dim


@pytest.mark.parametrize("shapes, period", [
    ((((4, 16), (16, 4)),) * 3, 1),  # one size
    ((((4, 16), (16, 4)), ((4, 16), (8, 4))) * 2, 2),  # alternating, as Llama's q_proj / v_proj
    ((((2, 3), (5, 2)), ((4, 16), (16, 4)), ((1, 7), (7, 1))), 3),  # no repeat
])
def test_segment_norms_equal_each_pairs_own_norm(shapes, period):
    from raydp.privacy.clipping import PairLayout

    layout = PairLayout(shapes)
    flat = torch.randn(5, layout.dim, generator=torch.Generator().manual_seed(0)) * torch.logspace(-6, 3, layout.dim)
    got = layout.segment_norms(flat)
    at, want = 0, []
    for size in layout.sizes:
        want.append(torch.linalg.vector_norm(flat[:, at:at + size].double(), dim=1))
        at += size
    want = torch.stack(want, 1)
    assert got.shape == (5, len(shapes)) and got.dtype == flat.dtype
    assert torch.allclose(got.double(), want, rtol=1e-6, atol=0)
    assert torch.allclose(layout.segment_norms(flat[2]).double(), want[2], rtol=1e-6, atol=0)  # a [D] vector
    assert layout.segment_norms(flat[:0]).shape == (0, len(shapes))  # an empty batch
    assert layout.period == period
    assert PairLayout(()).segment_norms(torch.zeros(3, 0)).shape == (3, 0)  # no pairs: no norms


def _index_add_norms(layout, flat):
    """The pair norms as they were computed before issue 28's change: float64 squares added column by column into
    their pair's output (``index_add_``)."""
    squares = flat.detach().double().pow(2)
    columns = layout.pair_of_column(flat.device)
    out = torch.zeros((*squares.shape[:-1], layout.n_pairs), dtype=torch.float64)
    return out.index_add_(squares.dim() - 1, columns, squares).sqrt().to(flat.dtype)


def test_pair_norms_by_views_keep_a_run_bit_identical(monkeypatch):
    """A golden run: five DP steps under fixed randomness give bit-identical LoRA parameters with the pair norms
    summed as reductions over views and as the former ``index_add_``."""
    from raydp.privacy.clipping import PairLayout

    def run():
        model, pairs = tiny_lora_model(n_layer=3)
        strategy = FixedDials([0.05, 0.2, 0.8], 1.1, "proportional")
        strategy.setup(StrategyContext(len(pairs), (0.0, 0.5, 1.0), q=0.5, planned_steps=10, sigma_0=1.1,
                                       epsilon_target=1e6, delta=1e-5))
        step = DPStep(model, pairs, strategy, PrivacyLedger(delta=1e-5, epsilon_target=1e6),
                      BudgetGuard("rdp", epsilon_target=1e6, delta=1e-5, planned_steps=10, q=0.5), q=0.5,
                      expected_batch_size=2.5, planned_steps=10, randomness=PrivateRandomness.unsafe_from_seed(5),
                      device=torch.device("cpu"))
        optimizer = torch.optim.AdamW([t for p in pairs for t in (p.a, p.b)], lr=1e-2)
        for seed in range(5):
            ids, mask = padded_batch(seed=seed)
            step.compute(model, Batch(list(range(ids.shape[0])), ids, mask))
            optimizer.step()
            step.after_update(model)
        return [t.detach().clone() for p in pairs for t in (p.a, p.b)]

    now = run()
    monkeypatch.setattr(PairLayout, "segment_norms", _index_add_norms)
    before = run()
    assert all(torch.equal(a, b) for a, b in zip(now, before))


def test_the_step_draws_the_slots_of_a_slotted_pass_from_the_runs_secret_randomness():
    """A slotted GPU pass puts each record in a slot drawn at random (raydp.privacy.clipping.RecordGraph); the DP
    step hands its per-sample source the run's own stream for them (replayed with an unsafe fixed seed; fresh and
    apart from the noise's stream: tests/test_record_isolation.py)."""
    a = _pairwise_step(_PairwiseWith(0.1))[1]
    b = _pairwise_step(_PairwiseWith(0.1))[1]
    draws = [step.per_sample._draw_slots(64, 8) for step in (a, b)]
    assert a.per_sample._slot_rng is not None and (draws[0] == draws[1]).all()  # unsafe seed 3 in both
    expected = PrivateRandomness.unsafe_from_seed(3).slot_rng().integers(0, 8, size=64)
    assert (draws[0] == expected).all()
