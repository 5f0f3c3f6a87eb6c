"""The attacks' metrics and scoring against independent computations (naive loops, unbatched forwards)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from raydp.evaluation import attacks
from raydp.evaluation.scoring import candidate_logprobs, ending_logprobs, ending_starts, sample_continuations


def naive_auc(pos, neg) -> float:  # RLDP Eq. 39, literally
    total = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return total / (len(pos) * len(neg))


def test_auc_counts_ties_half_like_eq_39():
    rng = np.random.default_rng(0)
    pos, neg = rng.integers(0, 5, 40).astype(float), rng.integers(0, 5, 30).astype(float)  # many ties
    assert attacks.roc_auc(pos, neg) == pytest.approx(naive_auc(pos, neg), abs=1e-12)
    assert attacks.roc_auc([1.0, 1.0], [1.0]) == 0.5
    assert attacks.roc_auc([2.0], [1.0]) == 1.0 and attacks.roc_auc([0.0], [1.0]) == 0.0


def test_tpr_at_fpr_is_the_best_threshold_within_the_fpr():
    rng = np.random.default_rng(1)
    pos, neg = rng.normal(1, 1, 300), rng.normal(0, 1, 1000)
    for fpr in (0.001, 0.01, 0.1):
        best = 0.0  # brute force over every threshold "score > t"
        for t in np.concatenate([pos, neg, [np.inf, -np.inf]]):
            if np.mean(neg > t) <= fpr:
                best = max(best, np.mean(pos > t))
        assert attacks.tpr_at_fpr(pos, neg, fpr) == pytest.approx(best)
    # separable scores: every member above every non-member
    assert attacks.tpr_at_fpr([5.0, 6.0], [0.0, 1.0], 0.001) == 1.0


def naive_jaccard(valid, canaries, n):
    """RLDP Eq. 29-35 with the joint vocabulary and binary indicator vectors."""
    grams = lambda s: {s[i:i + n] for i in range(len(s) - n + 1)}
    vocab = sorted(set().union(*[grams(s) for s in valid + canaries]))
    vec = lambda s: np.array([g in grams(s) for g in vocab], dtype=float)
    values = []
    for c in valid:
        for k in canaries:
            x, y = vec(c), vec(k)
            inter = float(x @ y)
            union = float((x + y).sum() - inter)
            values.append(inter / union if union else 0.0)
    values = np.array(values)
    return values.mean(), math.sqrt(((values - values.mean()) ** 2).mean())  # Eq. 35


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_jaccard_matches_the_indicator_vector_definition(n):
    valid = ["AB12", "O119XP9N56", "Z", "ABABAB", "9"]
    canaries = ["O119XP9N56", "QWERTY1234", "AB12CD34EF"]
    mean, std = attacks.jaccard_statistics(valid, canaries, n)
    ref_mean, ref_std = naive_jaccard(valid, canaries, n)
    assert mean == pytest.approx(ref_mean) and std == pytest.approx(ref_std)


def test_secret_like_keeps_the_secret_field_only():
    assert attacks.secret_like("O119XP9N56. the patient") == "O119XP9N56"
    assert attacks.secret_like("AB12") == "AB12"
    assert attacks.secret_like(" AB12") is None  # a leading space: not a secret
    assert attacks.secret_like("ab12") is None and attacks.secret_like("") is None
    assert attacks.secret_like("ABCDEFGHIJK") is None  # 11 characters


@pytest.fixture(scope="module")
def embedded():
    from raydp.model import disable_dropout, load_model
    from raydp.model.loading import LoraSettings

    torch.manual_seed(0)  # LoRA's A matrices are drawn from the global generator: fix them for this module
    # adapters on every linear layer: the capacity the constructed memorisation case below needs (the clause
    # tokenizer leaves a 2-layer, 32-wide model little room with adapters on attention alone)
    loaded = load_model("embedded-tiny", device="cpu", progress=False,
                        lora=LoraSettings(target_modules=("c_attn", "c_proj", "c_fc")))
    disable_dropout(loaded.model)
    with torch.no_grad():  # move the adapters off zero so target and base differ
        generator = torch.Generator().manual_seed(0)
        for name, p in loaded.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=generator)
    loaded.model.eval()
    return loaded


def naive_ending_logp(model, tokenizer, text: str, start_char: int) -> float:
    """One text, no batching, no padding: sum of log p of the tokens ending after start_char."""
    enc = tokenizer(text, return_offsets_mapping=True)
    ids = torch.tensor([enc["input_ids"]])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
    return sum(float(logp[t - 1, ids[0, t]]) for t, (_, end) in enumerate(enc["offset_mapping"])
               if t >= 1 and end > start_char)


def test_batched_ending_scores_match_unbatched_forwards(embedded):
    from raydp.data import public_corpus

    texts = public_corpus(5, seed=3, progress=False)
    texts = [texts[0][:200], texts[1], texts[2][:90] + " secret_id=AB12CD34EF.", texts[3][:400], texts[4][:120]]
    starts_char = [100, 700, len(texts[2]) - 11, 50, 70]  # each after the first token (the preamble clause)
    ids, starts = ending_starts(embedded.tokenizer, texts, char_offsets=starts_char)
    got = ending_logprobs(embedded.model, ids, starts, torch.device("cpu"), embedded.tokenizer.pad_token_id,
                          batch_size=2)
    for i, text in enumerate(texts):
        assert got.sum_logp[i] == pytest.approx(naive_ending_logp(embedded.model, embedded.tokenizer, text,
                                                                   starts_char[i]), rel=1e-4, abs=1e-3)
    # the prefix-cached candidate scorer agrees with whole-text scoring
    context = texts[2][:-11]
    cands = ["AB12CD34EF.", "ZZZZZZZZZZ.", "0123456789.", "Q."]
    cached = candidate_logprobs(embedded.model, embedded.tokenizer, context, cands, torch.device("cpu"), batch_size=3)
    for c, value in zip(cands, cached):
        assert value == pytest.approx(naive_ending_logp(embedded.model, embedded.tokenizer, context + c,
                                                        len(context)), rel=1e-4, abs=1e-3)


def test_a_split_that_leaves_no_prompt_or_no_ending_is_discarded(embedded):
    ids, starts = ending_starts(embedded.tokenizer, ["a", "the patient stayed"], fraction=0.5)
    assert starts[0] == -1 and starts[1] >= 1


def test_top_k_1_sampling_is_the_greedy_continuation(embedded):
    model, tok = embedded.model, embedded.tokenizer
    prompt = "race is Caucasian. gender is"
    got = sample_continuations(model, tok, prompt, 3, torch.device("cpu"), generator=torch.Generator().manual_seed(0),
                               max_new_tokens=6, top_k=1, batch_size=2)
    ids = tok(prompt)["input_ids"]
    with torch.no_grad():  # naive greedy decoding, no cache
        for _ in range(6):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    assert got == [tok.decode(ids[-6:])] * 3


def test_membership_and_exposure_on_a_model_that_memorised_its_members(embedded):
    """Constructed case with a known answer: members are texts the model was fitted to, so their endings
    are likelier (AUC near 1, the calibrated attack too) and their secrets have near-maximal exposure."""
    from raydp.data import public_corpus

    model, tok = embedded.model, embedded.tokenizer
    rng = np.random.default_rng(5)  # short records, each ending in its own random secret
    secrets = ["".join(rng.choice(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"), 10)) for _ in range(16)]
    texts = [". ".join(t.split(". ")[:8]) + f". secret_id={s}." for t, s in zip(public_corpus(16, seed=11, progress=False),
                                                                          secrets)]
    members, nonmembers = texts[:8], texts[8:]
    trainable = [p for p in model.parameters() if p.requires_grad]
    state = [p.detach().clone() for p in trainable]
    opt = torch.optim.Adam(trainable, lr=1e-2)
    enc = tok(members, return_tensors="pt", padding=True)
    model.train()
    for _ in range(300):
        out = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                    labels=enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100))
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    model.eval()
    try:
        result = attacks.membership_inference(model, tok, members, nonmembers, torch.device("cpu"))
        contexts = [t[:-11] for t in texts]  # each text ends with its secret and '.'
        seen = attacks.exposure(model, tok, contexts[:3], secrets[:3], torch.device("cpu"), candidates=255)
        unseen = attacks.exposure(model, tok, contexts[8:16], secrets[8:16], torch.device("cpu"), candidates=255)
    finally:
        with torch.no_grad():
            for p, s in zip(trainable, state):
                p.copy_(s)
    assert result["n_members"] == result["n_nonmembers"] == 8
    assert result["loss"]["auc"] > 0.9 and result["calibrated"]["auc"] > 0.9
    assert result["base_model"]["auc"] < result["loss"]["auc"]  # the null: the base model never saw them
    assert result["loss"]["member_mean_logp"] > result["loss"]["nonmember_mean_logp"]
    assert result["loss"]["member_mean_ppl"] < result["loss"]["nonmember_mean_ppl"]
    # a memorised secret ranks in the top 1/16 of 256 strings of its format (>= 4 of the 8 bits 255
    # candidates can measure; measured 6.4-8.0 here); secrets the model never saw rank among random ones: a uniform
    # rank's exposure has mean 1.44 bits and sd 1.44 (log2 of a uniform), so the mean of 8 is below 3.0 (3 sd) unless
    # they do not rank at random (a rounding change of the model moved it from 1.9 to 2.03: 2.0 was under 1 sd)
    assert seen["max_measurable_bits"] == 8.0
    assert min(seen["per_canary"]) >= 4.0 and unseen["mean"] < 3.0, (seen, unseen)
