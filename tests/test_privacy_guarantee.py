"""The reported epsilon is a guarantee: secret randomness (E12), patient-level DP (E11), non-finite
samples, the Renyi filter for adaptive sigma (E13), and the order of checkpoints and observers.

Every check is against an independent computation: a naive per-patient autograd loop, dp_accounting's
RDP accountant, or a second run."""

import math

import numpy as np
import pytest
import torch
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant as dpa_rdp

from raydp.model.batches import Batch
from raydp.model.loss import per_sequence_nll
from raydp.privacy import BudgetExhausted, BudgetGuard, PrivacyLedger, calibrate_sigma
from raydp.privacy.clipping import (
    PerSampleGradientComputer,
    clip_factors,
    clipped_sums,
    combine_units,
    group_norms,
    pair_norms,
    zero_nonfinite,
)
from raydp.privacy.engine import DPStep
from raydp.privacy.filter import FilterGuard, RenyiFilter
from raydp.privacy.randomness import VOID_LABEL, PrivateRandomness
from raydp.runner.sampling import PoissonSampler
from raydp.strategies.base import Dials, Strategy, StrategyContext
from tests.test_dp_engine import FixedDials, padded_batch, tiny_lora_model

CPU = torch.device("cpu")


# -- E12: secret randomness ------------------------------------------------------------------------

def test_fresh_randomness_differs_and_hides_its_seeds():
    a, b = PrivateRandomness.fresh(), PrivateRandomness.fresh()
    assert a.sampling_entropy != b.sampling_entropy and a.noise_seed != b.noise_seed
    assert str(a.sampling_entropy) not in repr(a) and str(a.noise_seed) not in repr(a)
    assert a.is_secret and a.label is None
    unsafe = PrivateRandomness.unsafe_from_seed(0)
    assert unsafe == PrivateRandomness.unsafe_from_seed(0) and not unsafe.is_secret and unsafe.label == VOID_LABEL


def test_noise_uses_every_bit_of_its_seed():
    """torch's CPU generator keeps only the low 32 bits of a seed (recoverable by search from one release):
    seeds that differ only above bit 32, or above bit 64, must give different noise."""
    from raydp.privacy.randomness import GaussianNoise

    low = 0x1234_5678
    draws = [GaussianNoise(seed).randn((16,)) for seed in (low, low + (7 << 32), low + (7 << 64))]
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
    assert torch.equal(GaussianNoise(low).randn((16,)), draws[0])  # a seed still determines its draws


def test_checkpoints_hold_no_sampling_or_noise_state():
    """A checkpoint holding a generator's state lets its holder rewind to every past batch and noise;
    a resumed run draws fresh secret randomness instead."""
    sampler = PoissonSampler(100, 0.1)
    assert sampler.state_dict() == {}
    model, pairs = tiny_lora_model()
    strategy = FixedDials([0.1] * len(pairs), 1.0, "proportional")
    strategy.setup(StrategyContext(len(pairs), (0.0, 0.5, 1.0), q=0.5, planned_steps=10, sigma_0=1.0,
                                   epsilon_target=1e6, delta=1e-5))
    step = DPStep(model, pairs, strategy, PrivacyLedger(delta=1e-5),
                  BudgetGuard("rdp", epsilon_target=1e6, delta=1e-5, planned_steps=10, q=0.5), q=0.5,
                  expected_batch_size=2.5, planned_steps=10, device=CPU)
    state = step.state_dict()
    assert set(state) == {"ledger", "clamp_events", "strategy", "randomness_source", "last_clip"}  # last_clip: public


def test_samplers_and_noise_of_identical_setups_differ():
    """Two runs with the same config draw different batches and different noise (no shared seed)."""
    first = [PoissonSampler(5000, 0.01).next_indices() for _ in range(2)]
    assert first[0] != first[1]
    grads = []
    for _ in range(2):
        model, pairs = tiny_lora_model()
        strategy = FixedDials([0.1] * len(pairs), 1.0, "proportional")
        strategy.setup(StrategyContext(len(pairs), (0.0, 0.5, 1.0), q=0.5, planned_steps=10, sigma_0=1.0,
                                       epsilon_target=1e6, delta=1e-5))
        guard = BudgetGuard("rdp", epsilon_target=1e6, delta=1e-5, planned_steps=10, q=0.5)
        step = DPStep(model, pairs, strategy, PrivacyLedger(delta=1e-5), guard, q=0.5, expected_batch_size=2.5,
                      planned_steps=10, device=CPU)  # default randomness: OS entropy
        ids, mask = padded_batch()
        step.compute(model, Batch(list(range(5)), ids, mask))
        grads.append(torch.cat([p.a.grad.flatten() for p in pairs]))
    assert not torch.allclose(grads[0], grads[1])


# -- E11: one contribution per patient -------------------------------------------------------------

def naive_patient_sums(model, pairs, ids, mask, units, clips):
    """Per patient: autograd of the summed losses of its records (= the sum of their gradients), then
    pairwise clipping; the textbook user-level DP-SGD contribution (McMahan et al. 2018)."""
    sums = [torch.zeros_like(t) for p in pairs for t in (p.a, p.b)]
    for unit in sorted(set(units)):
        model.zero_grad()
        total = 0
        for row in [r for r, u in enumerate(units) if u == unit]:
            n = int(mask[row].sum())
            logits = model(input_ids=ids[row:row + 1, :n], attention_mask=mask[row:row + 1, :n]).logits
            total = total + per_sequence_nll(logits, ids[row:row + 1, :n], mask[row:row + 1, :n]).sum()
        total.backward()
        for i, pair in enumerate(pairs):
            norm = math.sqrt(float(pair.a.grad.pow(2).sum() + pair.b.grad.pow(2).sum()))
            f = min(1.0, clips[i] / (norm + 1e-6))
            sums[2 * i] += f * pair.a.grad
            sums[2 * i + 1] += f * pair.b.grad
    model.zero_grad()
    return sums


def test_patient_contributions_equal_naive_per_patient_loop():
    model, pairs = tiny_lora_model()
    ids, mask = padded_batch(lengths=(9, 5, 12, 3, 7, 6))
    units = [0, 1, 0, 2, 1, 0]  # patient 0 has three encounters
    clips = [0.05, 0.2, 1e3]
    want = naive_patient_sums(model, pairs, ids, mask, units, clips)
    grads = combine_units(PerSampleGradientComputer(model, pairs).compute(ids, mask), torch.tensor(units))
    assert grads.batch_size == 3
    factors = clip_factors(group_norms(pair_norms(grads), "pairwise"), torch.tensor(clips))
    sums_a, sums_b = grads.layout.split(clipped_sums(grads, factors, "pairwise"), batched=False)
    got = [t for pair in zip(sums_a, sums_b) for t in pair]
    for g, w in zip(got, want):
        assert (g - w).abs().max().item() <= 1e-6


def test_patient_sampler_takes_whole_patients_at_rate_q():
    units = np.repeat(np.arange(400), np.random.default_rng(0).integers(1, 5, 400))  # 1-4 encounters each
    np.random.default_rng(1).shuffle(units)
    sampler = PoissonSampler(len(units), 0.05, rng=np.random.default_rng(2), units=units)
    assert sampler.n_units == 400 and sampler.expected_batch_size == pytest.approx(20.0)
    seen = np.zeros(400)
    for _ in range(2000):
        idx = sampler.next_indices()
        chosen = np.unique(units[idx])
        assert sum(np.sum(units == u) for u in chosen) == len(idx)  # every encounter of a sampled patient
        seen[chosen] += 1
    assert seen.mean() / 2000 == pytest.approx(0.05, rel=0.03)  # q per patient, whatever its encounters
    heavy = np.bincount(units) == 4
    assert seen[heavy].mean() / 2000 == pytest.approx(0.05, rel=0.1)


def test_collate_indexes_units_densely(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    from raydp.model.batches import TokenizedSplit

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    split = TokenizedSplit(["a b", "c", "d e f", "g"], tokenizer, 16, units=[70, 12, 70, 99])
    batch = split.collate([0, 2, 3], CPU)
    assert batch.unit_index.tolist() == [0, 0, 1] and batch.n_units == 2


# -- non-finite samples ----------------------------------------------------------------------------

def test_non_finite_sample_contributes_zero():
    """A sample with a NaN gradient gives exactly the release of the batch without it (same noise)."""
    ids, mask = padded_batch()
    outputs = []
    for poison in (False, True):
        model, pairs = tiny_lora_model()  # the same weights twice (seeded)
        strategy = FixedDials([0.1] * len(pairs), 1.0, "proportional")
        strategy.setup(StrategyContext(len(pairs), (0.0, 0.5, 1.0), q=0.5, planned_steps=10, sigma_0=1.0,
                                       epsilon_target=1e6, delta=1e-5))
        guard = BudgetGuard("rdp", epsilon_target=1e6, delta=1e-5, planned_steps=10, q=0.5)
        step = DPStep(model, pairs, strategy, PrivacyLedger(delta=1e-5), guard, q=0.5, expected_batch_size=2.5,
                      planned_steps=10, device=CPU, randomness=PrivateRandomness.unsafe_from_seed(11))
        if poison:
            real = step.per_sample.compute

            def poisoned(input_ids, attention_mask):
                grads = real(input_ids, attention_mask)
                grads.a[0][4] = float("nan")  # the extra (last) sample
                grads.losses[4] = float("inf")
                return grads

            step.per_sample.compute = poisoned
            step.compute(model, Batch(list(range(5)), ids, mask))
        else:
            step.compute(model, Batch(list(range(4)), ids[:4], mask[:4]))
        outputs.append(torch.cat([t.grad.flatten() for p in pairs for t in (p.a, p.b)]))
    assert torch.isfinite(outputs[1]).all()
    assert torch.allclose(outputs[0], outputs[1], atol=1e-6)


def test_zero_nonfinite_leaves_finite_batches_alone():
    model, pairs = tiny_lora_model()
    ids, mask = padded_batch()
    grads = PerSampleGradientComputer(model, pairs).compute(ids, mask)
    kept = zero_nonfinite(grads)  # applied unconditionally (no device sync): finite rows pass through unchanged
    assert torch.equal(kept.flat, grads.flat) and torch.equal(kept.losses, grads.losses)


# -- E13: the Renyi filter -------------------------------------------------------------------------

def _dpa_curve(orders, q, sigma, count=1):
    acc = dpa_rdp.RdpAccountant(list(orders))
    acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), count)
    return np.asarray(acc._rdp)


def _integrated_rdp(q, sigma, alpha):
    """RDP of one Poisson-subsampled Gaussian step by direct numerical integration of Mironov et al. 2019,
    Sec. 3: A_alpha = E_{z ~ N(0, s^2)} [(1 - q + q exp((2z - 1) / (2 s^2)))^alpha], RDP = log A / (alpha - 1)."""
    from scipy import integrate, stats

    def integrand(z):
        return stats.norm.pdf(z, scale=sigma) * (1 - q + q * math.exp((2 * z - 1) / (2 * sigma ** 2))) ** alpha

    lo, hi = -30 * sigma, alpha + 30 * sigma
    value, _ = integrate.quad(integrand, lo, hi, points=[0.5, alpha / 2, alpha], limit=500, epsabs=0, epsrel=1e-11)
    return math.log(value) / (alpha - 1)


def test_filter_budget_and_epsilon_match_independent_computations():
    q, steps, delta = 0.02, 300, 1e-5
    sigma = calibrate_sigma(2.0, delta, q, steps, "rdp").sigma
    flt = RenyiFilter.for_plan(q, sigma, steps, delta)
    per_step = flt.budget / steps
    for alpha in (1.5, 2.0, 3.5, 8.0, 12.0):
        k = flt.orders.index(alpha)
        assert per_step[k] == pytest.approx(_integrated_rdp(q, sigma, alpha), rel=1e-6)
    # dp_accounting agrees at integer orders; at fractional ones it sums absolute values of the series
    # (a looser upper bound), so it is never below ours.
    dpa = _dpa_curve(flt.orders, q, sigma, steps)
    integer = np.array([float(a).is_integer() for a in flt.orders])
    assert np.allclose(flt.budget[integer], dpa[integer], rtol=1e-6)
    assert np.all(flt.budget[~integer] <= dpa[~integer] * (1 + 1e-9))
    acc = dpa_rdp.RdpAccountant(list(flt.orders))
    acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps)
    assert flt.epsilon() == pytest.approx(acc.get_epsilon(delta), rel=0.03)
    assert flt.epsilon() <= 2.0


@pytest.mark.parametrize("seed", range(6))
def test_random_adaptive_sigma_sequences_never_cross_the_filter(seed):
    """A controller that proposes arbitrary sigmas (often far below sigma_0) and changes them at random
    times: the realized per-order RDP sum, recomputed with dp_accounting, stays under the budget curve
    fixed before training, and the reported epsilon is the filter's."""
    rng = np.random.default_rng(seed)
    q, steps, delta, eps = float(rng.uniform(0.005, 0.1)), int(rng.integers(20, 200)), 1e-5, float(rng.uniform(0.5, 8))
    sigma_0 = calibrate_sigma(eps, delta, q, steps, "rdp").sigma
    guard = FilterGuard.for_plan(epsilon_target=eps, delta=delta, planned_steps=steps, q=q, sigma_0=sigma_0)
    ledger = PrivacyLedger(delta=delta)
    proposal = sigma_0
    for t in range(steps):
        if rng.random() < 0.2:
            proposal = sigma_0 * float(rng.choice([0.3, 0.6, 0.9, 1.0, 1.5, 3.0]))
        try:
            sigma, _ = guard.clamp(proposal, ledger, steps - t)
            guard.admit(ledger, q, sigma)
        except BudgetExhausted:
            break
        ledger.record_gaussian(q, sigma)
    orders, budget = guard.filter.orders, guard.filter.budget
    values, counts = np.unique(ledger.sigma_eff, return_counts=True)
    # Integer orders: dp_accounting; two fractional ones: direct numerical integration (dp_accounting's
    # fractional-order values are a looser bound, see above).
    integer = np.array([float(a).is_integer() for a in orders])
    realized = sum(c * _dpa_curve(orders, q, float(s)) for s, c in zip(values, counts))
    assert np.all(realized[integer] <= budget[integer] * (1 + 1e-6))
    for alpha in (1.5, 2.5):
        spent = sum(c * _integrated_rdp(q, float(s), alpha) for s, c in zip(values, counts))
        assert spent <= budget[orders.index(alpha)] * (1 + 1e-6)
    final = guard.final_check(ledger)
    assert final.within_budget and final.epsilon == guard.filter.epsilon() <= eps
    assert len(ledger) == steps  # the planner keeps the run going to its planned end


def test_filter_refuses_a_step_that_would_cross_its_budget():
    q, steps, delta = 0.05, 10, 1e-5
    sigma_0 = calibrate_sigma(1.0, delta, q, steps, "rdp").sigma
    guard = FilterGuard.for_plan(epsilon_target=1.0, delta=delta, planned_steps=steps, q=q, sigma_0=sigma_0)
    ledger = PrivacyLedger(delta=delta)
    for _ in range(steps):
        guard.admit(ledger, q, sigma_0)
        ledger.record_gaussian(q, sigma_0)
    with pytest.raises(BudgetExhausted):
        guard.admit(ledger, q, sigma_0)  # an 11th step at sigma_0 exceeds B at every order
    with pytest.raises(BudgetExhausted):
        guard.clamp(sigma_0, ledger, 1)


def test_adaptive_plans_are_calibrated_through_the_filter():
    from raydp.config import TrainConfig
    from raydp.runner.privacy_setup import plan_private_run
    from raydp.strategies.static import StaticPairwiseStrategy

    class AdaptivePairwise(StaticPairwiseStrategy):
        adaptive_sigma = True

    config = TrainConfig(strategy="static-pairwise", epsilon=2.0)
    fixed = plan_private_run(config, 800, StaticPairwiseStrategy())
    adaptive = plan_private_run(config, 800, AdaptivePairwise())
    assert (fixed.accountant, fixed.adaptive) == ("pld", False)
    assert (adaptive.accountant, adaptive.adaptive) == ("rdp", True)
    assert adaptive.sigma_0 > fixed.sigma_0  # the cost of a guarantee valid under adaptive choice
    flt = RenyiFilter.for_plan(adaptive.q, adaptive.sigma_0, adaptive.planned_steps, config.delta)
    assert 0.98 * 2.0 <= flt.epsilon() <= 2.0


# -- the loop: checkpoints before observers, decisions durable before use --------------------------

class DecidingStrategy(Strategy):
    name = "deciding"
    clip_mode = "flat"
    allocation = "flat"

    def __init__(self, events):
        self.events = events

    def dials(self, step):
        return Dials((1.0,), self.context.sigma_0)

    def wants_decision(self, step):
        return step % 3 == 0

    def between_steps(self, step):
        if self.wants_decision(step):
            self.events.append(("decide", step))


def test_evaluations_and_decisions_follow_their_checkpoints(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    from raydp.data import public_corpus
    from raydp.model.batches import TokenizedSplit
    from raydp.runner.loop import OptimizerSettings, Trainer

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    model, pairs = tiny_lora_model(n_layer=2)
    model.resize_token_embeddings(len(tokenizer))
    texts = public_corpus(40, seed=5, progress=False)
    train = TokenizedSplit(texts[:30], tokenizer, 32)
    evaluation, public = TokenizedSplit(texts[30:35], tokenizer, 32), TokenizedSplit(texts[35:], tokenizer, 32)
    events = []
    strategy = DecidingStrategy(events)
    strategy.setup(StrategyContext(len(pairs), (0.0, 1.0), 0.2, 7, 1.0, 1e6, 1e-5))
    guard = BudgetGuard("rdp", epsilon_target=1e6, delta=1e-5, planned_steps=7, q=0.2)
    step = DPStep(model, pairs, strategy, PrivacyLedger(delta=1e-5), guard, q=0.2, expected_batch_size=6.0,
                  planned_steps=7, device=CPU)
    trainer = Trainer(model, train, evaluation, PoissonSampler(30, 0.2), step, CPU, OptimizerSettings(warmup_steps=0),
                      eval_every=2, progress=False, public_evaluation=public,
                      on_evaluation=lambda s, row: events.append(("eval", s, row["public_perplexity"] > 1)),
                      on_checkpoint=lambda t: events.append(("checkpoint", t.step_count)))
    trainer.run(7)
    for i, event in enumerate(events):
        if event[0] == "eval" and event[1] > 0:
            assert ("checkpoint", event[1]) in events[:i]  # the evaluation is durable before anyone sees it
            assert event[2]
        if event[0] == "decide":
            before = [e for e in events[:i] if e[0] == "checkpoint"]
            assert before[-1] == ("checkpoint", event[1])  # its observation was durable before it decided
            assert events[i + 1] == ("checkpoint", event[1])  # its action is durable before a step uses it
    assert [e for e in events if e[0] == "decide"] == [("decide", 3), ("decide", 6)]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_dp_runs_switch_off_every_dropout(kind):
    """Dropout draws from the public-seeded global generator on private batches (E12): after
    disable_dropout two forward passes in train mode agree exactly, with module dropout (GPT-2, LoRA)
    and functional attention dropout (Llama's float ``attention_dropout``) alike."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from raydp.model.loading import LoraSettings, apply_lora, disable_dropout

    torch.manual_seed(0)
    if kind == "gpt2":
        base = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=32, n_embd=16, n_layer=2, n_head=2,
                                          attn_pdrop=0.5, resid_pdrop=0.5, embd_pdrop=0.5))
    else:
        base = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                            num_attention_heads=2, num_key_value_heads=2, attention_dropout=0.5))
    model = apply_lora(base, kind, LoraSettings(r=4, alpha=8, dropout=0.5))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.5)
    model.train()
    ids = torch.randint(1, 50, (2, 12), generator=torch.Generator().manual_seed(1))

    def outputs():
        return [model(input_ids=ids).logits.detach() for _ in range(2)]

    first, second = outputs()
    assert not torch.equal(first, second)  # dropout is really on before
    assert disable_dropout(model) > 0
    first, second = outputs()
    assert torch.equal(first, second)
