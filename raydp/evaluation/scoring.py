"""Log-likelihoods of text endings under a causal LM, batched (the attacks' one primitive).

An *ending* is the part of a text the attacks score: the tokens from a character offset on (a secret
after ``secret_id=``) or the last part of the tokens (RLDP Eq. 37's "true ending"). Texts are tokenised
the way training tokenises them (:class:`raydp.model.batches.TokenizedSplit`: the tokenizer's defaults,
truncated to ``max_length``), so a score is of the sequence the model was trained on. A token that
straddles the offset counts as part of the ending. Two further primitives share a prefix: scoring many
candidate endings after one context (:func:`candidate_logprobs`, for exposure) and sampling
continuations of one prompt (:func:`sample_continuations`, for extraction); both run the prefix once and
reuse its key/value cache for the whole batch.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper


@dataclass(frozen=True)
class EndingScores:
    """Per text: the summed and mean log-probability of its ending and its number of ending tokens.
    ``valid`` is False where the split failed (no prompt token or no ending token left after truncation,
    RLDP Eq. 37: such texts are discarded)."""

    sum_logp: np.ndarray
    n_tokens: np.ndarray
    valid: np.ndarray

    @property
    def mean_logp(self) -> np.ndarray:
        return np.where(self.valid, self.sum_logp / np.maximum(self.n_tokens, 1), np.nan)


@contextmanager
def base_model(model):
    """The model with its LoRA adapters disabled: the public pre-trained network (PEFT ``disable_adapter``)."""
    with model.disable_adapter():
        yield model


def _encode(tokenizer, texts: list[str], max_length: int | None):
    enc = tokenizer(texts, truncation=False, return_offsets_mapping=True)
    ids = [x if max_length is None else x[:max_length] for x in enc["input_ids"]]
    offsets = [o[: len(x)] for o, x in zip(enc["offset_mapping"], ids)]
    return ids, offsets


def ending_starts(tokenizer, texts: list[str], *, char_offsets=None, fraction: float | None = None,
                  max_length: int | None = None) -> tuple[list[list[int]], np.ndarray]:
    """(token ids per text, index of each text's first ending token; -1 where the split fails).

    ``char_offsets``: the ending is every token that ends after that character (a straddling token
    counts). ``fraction``: the ending is the tokens from ``max(1, floor(fraction * L))`` on (L tokens).
    """
    ids, offsets = _encode(tokenizer, texts, max_length)
    starts = np.full(len(texts), -1, dtype=np.int64)
    for i, (seq, off) in enumerate(zip(ids, offsets)):
        if char_offsets is not None:
            c = int(char_offsets[i])
            k = next((t for t, (_, end) in enumerate(off) if end > c), len(seq))
        else:
            k = max(1, int(np.floor(fraction * len(seq))))
        if 1 <= k < len(seq):
            starts[i] = k
    return ids, starts


@torch.no_grad()
def ending_logprobs(model, token_ids: list[list[int]], starts: np.ndarray, device, pad_token_id: int,
                    batch_size: int = 32) -> EndingScores:
    """Sum over each text's ending tokens t >= start of log p(x_t | x_<t) (RLDP Eq. 37's numerator)."""
    n = len(token_ids)
    sums, counts = np.zeros(n), np.zeros(n, dtype=np.int64)
    valid = starts >= 1
    order = [i for i in np.argsort([len(s) for s in token_ids], kind="stable") if valid[i]]  # less padding
    was_training = model.training
    model.eval()
    try:
        for b in range(0, len(order), batch_size):
            rows = order[b:b + batch_size]
            length = max(len(token_ids[i]) for i in rows)
            ids = torch.full((len(rows), length), pad_token_id, dtype=torch.long)
            scored = torch.zeros((len(rows), length - 1), dtype=torch.bool)
            mask = torch.zeros((len(rows), length), dtype=torch.long)
            for r, i in enumerate(rows):
                seq = token_ids[i]
                ids[r, :len(seq)] = torch.tensor(seq)
                mask[r, :len(seq)] = 1
                scored[r, starts[i] - 1:len(seq) - 1] = True  # position t-1 predicts token t
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits[:, :-1].float()
            logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None].to(device))[..., 0].cpu()
            logp = torch.where(scored, logp, torch.zeros_like(logp))
            for r, i in enumerate(rows):
                sums[i] = float(logp[r].sum())
                counts[i] = int(scored[r].sum())
    finally:
        model.train(was_training)
    return EndingScores(sums, counts, valid)


def _with_cache(model, cache) -> dict:
    """The keyword that hands a key/value cache to ``model``'s forward: ``cache`` since transformers 5.x
    renamed it (``past_key_values`` is deprecated there), ``past_key_values`` before."""
    import inspect

    forward = getattr(model, "forward", model)
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        params = {}
    if "cache" not in params and hasattr(model, "get_base_model"):  # a PEFT wrapper: the base model's signature
        params = inspect.signature(model.get_base_model().forward).parameters
    return {"cache" if "cache" in params else "past_key_values": cache}


def _cache_of(out):
    """The key/value cache of a forward's output (``cache``, or ``past_key_values`` before transformers 5.x)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def _prefix_cache(model, prefix: list[int], device):
    out = model(input_ids=torch.tensor([prefix], device=device), use_cache=True)
    return _cache_of(out), out.logits[0, -1].float()


def _repeat(cache, n: int):
    cache = copy.deepcopy(cache)
    cache.batch_repeat_interleave(n)
    return cache


def _candidate_tokens(tokenizer, context: str, candidates: list[str], overlap: int = 8):
    """``ending_starts`` of every ``context + candidate`` without tokenising the long context once per
    candidate: the context's tokens up to ``overlap`` before its end are kept, and only the rest of it plus
    the candidate is tokenised. Checked on the first candidate against whole-text tokenisation; where a
    tokenizer merges across that cut, every text is tokenised whole instead."""
    enc = tokenizer(context, return_offsets_mapping=True)
    cut = max(0, len(enc["input_ids"]) - overlap)
    if cut == 0:
        return ending_starts(tokenizer, [context + c for c in candidates], char_offsets=[len(context)] * len(candidates))
    c0, head = enc["offset_mapping"][cut][0], enc["input_ids"][:cut]
    tail_ids, tail_starts = ending_starts(tokenizer, [context[c0:] + c for c in candidates],
                                         char_offsets=[len(context) - c0] * len(candidates))
    whole = tokenizer(context + candidates[0])["input_ids"]
    if whole != head + tail_ids[0]:
        return ending_starts(tokenizer, [context + c for c in candidates], char_offsets=[len(context)] * len(candidates))
    return [head + t for t in tail_ids], np.where(tail_starts >= 0, tail_starts + cut, -1)


@torch.no_grad()
def candidate_logprobs(model, tokenizer, context: str, candidates: list[str], device,
                       batch_size: int = 256) -> np.ndarray:
    """log p(candidate | context) for each candidate string appended to ``context``: the summed
    log-probability of the tokens that end after ``len(context)`` characters. The context's common token
    prefix runs once; its cache serves every batch (right padding needs no mask under causal attention)."""
    ids, starts = _candidate_tokens(tokenizer, context, candidates)
    if (starts < 1).any():
        raise ValueError("a candidate has no token after the context")
    k = int(starts.min())  # tokens before k are the context's and the same in every text (checked)
    prefix = ids[0][:k]
    if any(seq[:k] != prefix for seq in ids):
        raise ValueError("the context tokenises differently before different candidates")
    cache, last_logits = _prefix_cache(model, prefix, device)
    last_logp = torch.log_softmax(last_logits, dim=-1)
    out = np.zeros(len(ids))
    size = min(batch_size, len(ids))
    cache = _repeat(cache, size)  # once; cropped back to the prefix after every batch
    was_training = model.training
    model.eval()
    try:
        for b in range(0, len(ids), size):
            real = list(range(b, min(b + size, len(ids))))
            rows = real + [real[-1]] * (size - len(real))  # a short last batch is filled up, then dropped
            tails = [ids[i][k:] for i in rows]
            length = max(len(t) for t in tails)
            tail = torch.full((len(rows), length), tokenizer.pad_token_id, dtype=torch.long)
            scored = torch.zeros((len(rows), length), dtype=torch.bool)
            for r, i in enumerate(rows):
                tail[r, :len(tails[r])] = torch.tensor(tails[r])
                scored[r, starts[i] - k:len(tails[r])] = True
            # all ones: right padding only follows the real tokens, which causal attention never lets them see
            mask = torch.ones((len(rows), k + length), dtype=torch.long, device=device)
            logits = model(input_ids=tail.to(device), attention_mask=mask, **_with_cache(model, cache)).logits.float()
            cache.crop(-length)  # drop this batch's tail: back to the k prefix tokens
            logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, tail[:, 1:, None].to(device))[..., 0].cpu()
            first = last_logp.cpu()[tail[:, 0]]  # token k is predicted by the prefix's last position
            per_token = torch.cat([first[:, None], logp], dim=1)
            sums = torch.where(scored, per_token, torch.zeros_like(per_token)).sum(dim=1).numpy()
            out[real] = sums[:len(real)]
    finally:
        model.train(was_training)
    return out


@torch.no_grad()
def sample_continuations(model, tokenizer, prompt: str, n: int, device, *, generator: torch.Generator,
                         max_new_tokens: int = 10, temperature: float = 0.7, top_p: float = 0.95,
                         top_k: int = 50, batch_size: int = 500, max_length: int | None = None) -> list[str]:
    """``n`` sampled continuations of ``prompt`` (RLDP Sec. 3.3: temperature 0.7, nucleus 0.95, top-k 50;
    transformers' logits warpers in that order, as ``generate`` applies them), decoded to text. The prompt
    is truncated from the left to leave room for the new tokens within ``max_length`` positions."""
    ids = tokenizer(prompt, truncation=False)["input_ids"]
    if max_length is not None:
        ids = ids[-(max_length - max_new_tokens):]
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k),
                                   TopPLogitsWarper(top_p)])
    was_training = model.training
    model.eval()
    texts: list[str] = []
    try:
        cache, last_logits = _prefix_cache(model, ids, device)
        for b in range(0, n, batch_size):
            rows = min(batch_size, n - b)
            past = _repeat(cache, rows)
            logits = last_logits.expand(rows, -1)
            generated = torch.empty((rows, 0), dtype=torch.long, device=device)
            for _ in range(max_new_tokens):
                scores = warpers(generated, logits)
                probs = torch.softmax(scores, dim=-1)
                token = torch.multinomial(probs.cpu(), 1, generator=generator).to(device)
                generated = torch.cat([generated, token], dim=1)
                out = model(input_ids=token, use_cache=True, **_with_cache(model, past))
                past, logits = _cache_of(out), out.logits[:, -1].float()
            texts.extend(tokenizer.batch_decode(generated.cpu().tolist()))
    finally:
        model.train(was_training)
    return texts
