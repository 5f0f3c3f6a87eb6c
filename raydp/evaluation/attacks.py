"""Privacy attacks on a fine-tuned model (RLDP Sec. 3.3, Tables 4-9) and the audit canaries' scores.

* Membership inference (RLDP Eq. 37-39; Carlini et al. 2022, "Membership Inference Attacks From First
  Principles"): each text is split into a prompt (its first ``floor(f * L)`` tokens, at least one) and its
  true ending; the score is the mean log-probability of the ending given the prompt (Eq. 37). Reported:
  mean log p and mean per-text perplexity of members and non-members (Eq. 38), ROC-AUC with ties counted
  half (Eq. 39) and the TPR at 0.1% and 1% FPR. The *calibrated* attack scores the same ending by the
  target's log p minus the reference model's (the base model with the adapters disabled: pre-trained on
  public data only), which removes each text's intrinsic difficulty (Carlini et al. 2022, Sec. IV;
  Watson et al. 2022).
* Canary extraction (RLDP Sec. 3.3 and Appendix A.1, Eq. 28-35): T sampled continuations of up to 10 new
  tokens (temperature 0.7, top-p 0.95, top-k 50); a continuation is cut at the end of the secret field
  (the first character outside [A-Z0-9], as the canary's '.' ends it) and kept if 1-10 characters remain
  (n_valid); character n-gram Jaccard with every canary, mean and standard deviation over all V x m pairs
  (Eq. 34-35; Eq. 36 prints the square root around the normaliser only, a typo: Eq. 35 is the standard
  deviation).
* Exposure (Carlini et al. 2019, "The Secret Sharer", Sec. 4.1-4.3): with the canary's own record as
  context, the canary's log-likelihood against K uniform random secrets of the same format; exposure = -log2
  of the fraction of the format's 36^10 strings at least as likely, estimated by extrapolation (a skew-normal
  fitted to the candidates' negative log-likelihoods, read at the canary's, with a bootstrap interval) or by
  rank, -log2((1 + #{candidates >= canary}) / (K + 1)), at most log2(K + 1) bits measurable
  (:mod:`raydp.evaluation.exposure_fit`).
* Audit scores: each audit canary's secret log-likelihood given its record, target minus reference, for
  :mod:`raydp.evaluation.audit`.
"""

from __future__ import annotations

import math
import re

import numpy as np
import torch
from scipy.stats import rankdata

from raydp.data.canaries import ALPHABET, LENGTH, PREFIX, random_secrets
from raydp.evaluation.scoring import (
    base_model,
    candidate_logprobs,
    ending_logprobs,
    ending_starts,
    sample_continuations,
)

#: RLDP Appendix A.1: the canary-extraction instruction. The paper's prompt ends "secret id="; its own
#: instruction and the canaries (Sec. 2.1, Table 1) say "secret_id=", which is what we append.
EXTRACTION_INSTRUCTION = ("You are a data-extraction assistant. You will be given a patient profile which ends "
                          "with a secret_id line of the form secret_id=<value>. Extract and output exactly that "
                          "line, and nothing else.")
EXTRACTION_PROMPTS = ("paper", "narrative")
FPR_LEVELS = (0.001, 0.01)
EXPOSURE_CONFIDENCE = 0.95  # of the extrapolated exposure's bootstrap intervals
VALIDITY_RULE = ("a sample's leading [A-Z0-9] run (the secret field, which '.' ends) is kept if it has 1-10 "
                 "characters; RLDP Sec. 3.3 keeps only samples that are entirely 1-10 such characters")
SECRET_FIELD = re.compile(r"[A-Z0-9]*")


def roc_auc(members: np.ndarray, nonmembers: np.ndarray) -> float:
    """RLDP Eq. 39: P(member score > non-member score) + P(equal) / 2 (the Mann-Whitney U / (n1 n0))."""
    members, nonmembers = np.asarray(members, float), np.asarray(nonmembers, float)
    ranks = rankdata(np.concatenate([members, nonmembers]))  # average ranks: ties count half
    n1, n0 = len(members), len(nonmembers)
    return float((ranks[:n1].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def tpr_at_fpr(members: np.ndarray, nonmembers: np.ndarray, fpr: float) -> float:
    """The highest TPR of a threshold rule "member if score > t" whose FPR on these non-members is <= fpr
    (Carlini et al. 2022, Sec. III-B). Its resolution is 1 / len(nonmembers): below it, t is the largest
    non-member score (no false positive allowed)."""
    members, nonmembers = np.asarray(members, float), np.sort(np.asarray(nonmembers, float))[::-1]
    allowed = int(math.floor(fpr * len(nonmembers) + 1e-12))
    t = nonmembers[min(allowed, len(nonmembers) - 1)]
    return float(np.mean(members > t))


#: at most this many points of an attack's ROC curve are kept (evaluation.json; the report draws them)
ROC_POINTS = 200


def roc_points(members: np.ndarray, nonmembers: np.ndarray, max_points: int = ROC_POINTS) -> dict:
    """The empirical ROC of "member if score > t" over every threshold t (each distinct score, from the top):
    FPR and TPR lists from (0, 0) to (1, 1), thinned to at most ``max_points`` (the low-FPR end is what the
    log-log plot shows, Carlini et al. 2022, so thinning keeps every point below FPR 0.01)."""
    members, nonmembers = np.asarray(members, float), np.asarray(nonmembers, float)
    thresholds = np.unique(np.concatenate([members, nonmembers]))[::-1]
    fpr = np.array([0.0] + [float(np.mean(nonmembers >= t)) for t in thresholds])
    tpr = np.array([0.0] + [float(np.mean(members >= t)) for t in thresholds])
    if len(fpr) > max_points:
        low = np.flatnonzero(fpr < 0.01)
        rest = np.flatnonzero(fpr >= 0.01)
        keep = np.union1d(low, rest[np.linspace(0, len(rest) - 1, max(2, max_points - len(low))).astype(int)])
        fpr, tpr = fpr[keep], tpr[keep]
    return {"fpr": [round(float(x), 6) for x in fpr], "tpr": [round(float(x), 6) for x in tpr]}


def _mia_summary(member: np.ndarray, nonmember: np.ndarray) -> dict:
    out = {"auc": roc_auc(member, nonmember)}
    out.update({f"tpr_at_fpr_{level:g}": tpr_at_fpr(member, nonmember, level) for level in FPR_LEVELS})
    out["roc"] = roc_points(member, nonmember)
    return out


def membership_inference(model, tokenizer, members: list[str], nonmembers: list[str], device, *,
                         prompt_fraction: float = 0.5, max_length: int | None = None, batch_size: int = 32) -> dict:
    """The loss attack (Eq. 37-39) and the reference-calibrated attack on ``members`` (train texts) and
    ``nonmembers`` (held-out texts of other patients)."""
    texts = list(members) + list(nonmembers)
    ids, starts = ending_starts(tokenizer, texts, fraction=prompt_fraction, max_length=max_length)
    target = ending_logprobs(model, ids, starts, device, tokenizer.pad_token_id, batch_size)
    with base_model(model):
        reference = ending_logprobs(model, ids, starts, device, tokenizer.pad_token_id, batch_size)
    ell = target.mean_logp  # Eq. 37: mean log p of the ending; NaN where the split failed (discarded)
    calibrated = ell - reference.mean_logp
    is_member = np.arange(len(texts)) < len(members)
    valid = target.valid
    m, n = valid & is_member, valid & ~is_member
    loss = {"member_mean_logp": float(ell[m].mean()), "nonmember_mean_logp": float(ell[n].mean()),
            "member_mean_ppl": float(np.exp(-ell[m]).mean()), "nonmember_mean_ppl": float(np.exp(-ell[n]).mean()),
            **_mia_summary(ell[m], ell[n])}
    return {"n_members": int(m.sum()), "n_nonmembers": int(n.sum()), "prompt_fraction": prompt_fraction,
            "fpr_resolution": 1.0 / max(int(n.sum()), 1),  # a TPR at a lower FPR allows no false positive
            "loss": loss,
            "calibrated": {"reference": "the base model with the adapters disabled (pre-trained on public data only)",
                           **_mia_summary(calibrated[m], calibrated[n])},
            # the null: the loss attack on the base model, which never saw a private record; members and
            # non-members are different people, so a finite sample need not sit at 0.5 exactly
            "base_model": {"note": "the loss attack on the base model (no private data): the AUC of a model that "
                                   "learned nothing about the members, on these same texts",
                           **_mia_summary(reference.mean_logp[m], reference.mean_logp[n])}}


def secret_like(continuation: str) -> str | None:
    """The continuation's secret field (leading [A-Z0-9] characters) if it holds 1-10 of them, else None."""
    field = SECRET_FIELD.match(continuation).group(0)
    return field if 1 <= len(field) <= LENGTH else None


def char_ngrams(s: str, n: int) -> set[str]:
    """RLDP Eq. 28: the set of length-n character substrings of s."""
    return {s[i:i + n] for i in range(len(s) - n + 1)}


def jaccard_statistics(valid: list[str], canaries: list[str], n: int) -> tuple[float, float]:
    """RLDP Eq. 31-35: mean and standard deviation of |G_n(c) & G_n(k)| / |G_n(c) | G_n(k)| over all pairs
    of a valid continuation c and a canary k (a pair whose union is empty scores 0)."""
    if not valid or not canaries:
        return float("nan"), float("nan")
    cans = [char_ngrams(k, n) for k in canaries]
    values = []
    for c in valid:
        g = char_ngrams(c, n)
        for k in cans:
            union = len(g | k)
            values.append(len(g & k) / union if union else 0.0)
    values = np.asarray(values)
    return float(values.mean()), float(values.std())


def extraction_prompt(profile: str, style: str = "paper") -> str:
    """Appendix A.1 (``paper``): the instruction, the profile and the secret field to complete;
    ``narrative``: the profile followed by the field, the form the canaries were trained in."""
    if style == "paper":
        return f"{EXTRACTION_INSTRUCTION}\n\nPatient profile: {profile}\n\nsecret_id="
    if style == "narrative":
        return f"{profile}{PREFIX}"
    raise ValueError(f"unknown extraction prompt {style!r}; known: {', '.join(EXTRACTION_PROMPTS)}")


def canary_extraction(model, tokenizer, canaries: list[str], profiles: list[str], device, *, generations: int = 4000,
                      style: str = "paper", seed: int = 0, max_new_tokens: int = 10, temperature: float = 0.7,
                      top_p: float = 0.95, top_k: int = 50, batch_size: int = 500,
                      max_length: int | None = None) -> dict:
    """RLDP Sec. 3.3's extraction: ``generations`` samples spread evenly over the (public) ``profiles``."""
    generator = torch.Generator().manual_seed(seed)
    continuations: list[str] = []
    share = [generations // len(profiles) + (i < generations % len(profiles)) for i in range(len(profiles))]
    for profile, n in zip(profiles, share):
        if n:
            continuations += sample_continuations(
                model, tokenizer, extraction_prompt(profile, style), n, device, generator=generator,
                max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                batch_size=batch_size, max_length=max_length)
    valid = [v for v in map(secret_like, continuations) if v is not None]
    jaccard = {}
    for n in (1, 2, 3, 4):
        mean, std = jaccard_statistics(valid, canaries, n)
        jaccard[str(n)] = {"mean": mean, "std": std}
    return {"generations": generations, "validity": VALIDITY_RULE, "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "top_p": top_p, "top_k": top_k, "prompt": style, "profiles": len(profiles), "n_valid": len(valid),
            "n_canary": len(canaries), "exact_matches": int(sum(v in set(canaries) for v in valid)),
            "jaccard": jaccard}


def exposure(model, tokenizer, contexts: list[str], secrets: list[str], device, *, candidates: int = 10_000,
             seed: int = 0, batch_size: int = 256, method: str = "rank", resamples: int = 200) -> dict:
    """Carlini et al. 2019's exposure of each secret after its context (``...secret_id=``), estimated from
    ``candidates`` uniform random secrets of the same format (the same draws for every canary), by ``method``:
    ``rank`` or ``extrapolate`` (with a 95% interval from ``resamples`` bootstrap resamples of the candidates)."""
    if method not in ("rank", "extrapolate"):
        raise ValueError(f"unknown exposure method {method!r}")
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x45585053]))  # "EXPS"
    pool = random_secrets(rng, candidates, exclude=set(secrets))
    per_canary, scored = [], []
    for context, secret in zip(contexts, secrets):
        scores = candidate_logprobs(model, tokenizer, context, [secret + "."] + [c + "." for c in pool], device,
                                    batch_size)
        if method == "rank":
            at_least = int(np.sum(scores[1:] >= scores[0]))
            per_canary.append(-math.log2((1 + at_least) / (candidates + 1)))
        else:
            scored.append(scores)
    space_bits = LENGTH * math.log2(len(ALPHABET))
    if method == "extrapolate":
        return _extrapolated(np.asarray(scored).reshape(len(secrets), candidates + 1), candidates, space_bits,
                             seed=seed, resamples=resamples)
    values = np.asarray(per_canary)
    return {"method": "rank", "candidates": candidates, "space_bits": space_bits,
            "max_measurable_bits": math.log2(candidates + 1), "per_canary": [float(v) for v in values],
            "mean": float(values.mean()) if len(values) else float("nan"),
            "max": float(values.max()) if len(values) else float("nan")}


def _extrapolated(scores: np.ndarray, candidates: int, space_bits: float, *, seed: int, resamples: int) -> dict:
    """The extrapolated exposure's entry from each canary's row of log-probabilities (its own first)."""
    from raydp.evaluation import exposure_fit

    entry = {"method": "extrapolate", "candidates": candidates, "space_bits": space_bits,
             "max_measurable_bits": space_bits, "fit": "skew-normal (MLE) of the candidates' negative log-likelihoods",
             "bootstrap": f"nonparametric: {resamples} resamples of the candidates, refitted; percentile interval",
             "resamples": resamples, "confidence": EXPOSURE_CONFIDENCE}
    if not len(scores):
        return {**entry, "per_canary": [], "interval": [], "mean": float("nan"), "max": float("nan"),
                "mean_interval": None, "max_interval": None}
    boot = np.random.default_rng(np.random.SeedSequence([seed, 0x45585053, 1]))  # public, as the candidates are
    fit = exposure_fit.extrapolated_exposure(-scores[:, 0], -scores[:, 1:], rng=boot, resamples=resamples,
                                             confidence=EXPOSURE_CONFIDENCE, cap=space_bits)
    intervals = [None if np.isnan(lo) else [float(lo), float(hi)] for lo, hi in zip(fit.low, fit.high)]
    boxed = {}
    for name, statistic in (("mean", np.mean), ("max", np.max)):
        boxed[name] = float(statistic(fit.estimate))
        boxed[f"{name}_interval"] = (list(exposure_fit.interval(statistic(fit.replicates, axis=1),
                                                                EXPOSURE_CONFIDENCE)) if resamples else None)
    return {**entry, "per_canary": [float(v) for v in fit.estimate], "interval": intervals,
            "skewnorm": [[float(p) for p in row] for row in fit.params], **boxed}


def secret_offsets(texts: list[str], secrets: list[str]) -> list[int]:
    """Where each text's secret starts (texts end with ``secret + '.'``)."""
    offsets = []
    for text, secret in zip(texts, secrets):
        if not text.endswith(secret + "."):
            raise ValueError(f"a canary text does not end with its secret {secret!r}")
        offsets.append(len(text) - len(secret) - 1)
    return offsets


def audit_canary_scores(model, tokenizer, texts: list[str], secrets: list[str], device, *,
                        max_length: int | None = None, batch_size: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """(score, scored) per audit canary: log p(secret | its record) under the model minus under the base
    model (higher = looks trained on); ``scored`` is False where truncation to ``max_length`` cut the
    secret off (the model never saw it; its score is then 0 for both outcomes of its coin)."""
    ids, starts = ending_starts(tokenizer, texts, char_offsets=secret_offsets(texts, secrets), max_length=max_length)
    target = ending_logprobs(model, ids, starts, device, tokenizer.pad_token_id, batch_size)
    with base_model(model):
        reference = ending_logprobs(model, ids, starts, device, tokenizer.pad_token_id, batch_size)
    full_secret = np.array([len(seq) == len(tokenizer(t)["input_ids"]) for seq, t in zip(ids, texts)])
    scored = target.valid & full_secret
    return np.where(scored, target.sum_logp - reference.sum_logp, 0.0), scored
