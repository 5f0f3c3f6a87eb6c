"""Held-out likelihood of a split: token-level perplexity (RLDP Sec. 3.3) and the value-token NLL per record.

PPL = exp(total next-token NLL / number of predicted tokens) over the whole split, padding excluded.
The utility the controller uses is u = -log PPL.

The primary metric of the benchmark is the **value-token NLL** in nats per record: the summed next-token NLL of
the tokens that overlap a field value's characters (the verbaliser's spans, phrases included; the template
around them excluded), divided by the number of records. Template tokens are nearly free once learned and
dilute every per-token figure three- to four-fold; nats per record compare across tokenizers, per-token figures
do not. ``nll_per_record`` is the same sum over every predicted token (the whole narrative but its first token).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from raydp.model.batches import TokenizedSplit
from raydp.model.loss import token_nll


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    nll_per_token: float
    n_tokens: int
    n_sequences: int
    #: summed NLL of every predicted token, per record (nats)
    nll_per_record: float = float("nan")
    #: summed NLL of the value tokens, per record (nats); None when the split has no value spans
    value_nll_per_record: float | None = None

    @property
    def utility(self) -> float:
        return -self.nll_per_token


@contextmanager
def evaluation_mode(model: torch.nn.Module):
    """``model`` in eval mode for the block, back to its previous mode after (also on error)."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def length_sorted_batches(split: TokenizedSplit, n: int, batch_size: int) -> list[list[int]]:
    """The first ``n`` sequences of ``split`` in batches of similar length (a stable sort by length): less padding
    than batches in split order (about 20% less evaluation time on the embedded default's narratives; docs/throughput.md).
    Every figure is a sum over sequences, so only the order of the additions changes."""
    order = sorted(range(n), key=lambda i: len(split.sequences[i]))
    return [order[start:start + batch_size] for start in range(0, n, batch_size)]


@torch.no_grad()
def evaluate_perplexity(
    model: torch.nn.Module, split: TokenizedSplit, device: torch.device, batch_size: int = 32,
    max_sequences: int | None = None,
) -> PerplexityResult:
    """Perplexity of ``model`` on the first ``max_sequences`` sequences of ``split`` (all by default)."""
    n = len(split) if max_sequences is None else min(len(split), max_sequences)
    total_nll, total_tokens, value_nll = 0.0, 0, 0.0
    with evaluation_mode(model):
        for indices in length_sorted_batches(split, n, batch_size):
            batch = split.collate(indices, device)
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
            nll, mask = token_nll(logits, batch.input_ids, batch.attention_mask)
            total_nll += float(nll.sum())
            total_tokens += int(mask.sum())
            if batch.value_mask is not None:  # position t predicts token t + 1
                value_nll += float((nll * batch.value_mask[:, 1:]).sum())
    nll_per_token = total_nll / max(total_tokens, 1)
    return PerplexityResult(math.exp(nll_per_token), nll_per_token, total_tokens, n, total_nll / max(n, 1),
                            value_nll / max(n, 1) if split.value_masks is not None else None)


@torch.no_grad()
def value_nll_per_sequence(model: torch.nn.Module, split: TokenizedSplit, device: torch.device,
                           batch_size: int = 32, whole_text: bool = False) -> np.ndarray:
    """Each sequence's summed value-token NLL (nats), in split order: the per-record terms whose mean is
    :attr:`PerplexityResult.value_nll_per_record` (a private score bounds each one: :mod:`raydp.study.
    private_selection`). ``whole_text``: every token's NLL instead (nats per text, for free text, which has no value
    spans): the per-text terms whose mean is :attr:`PerplexityResult.nll_per_record`."""
    if split.value_masks is None and not whole_text:
        raise ValueError("the split has no value spans: the value-token NLL needs them")
    out = np.zeros(len(split), dtype=np.float64)
    with evaluation_mode(model):
        for indices in length_sorted_batches(split, len(split), batch_size):
            batch = split.collate(indices, device)
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
            nll, _ = token_nll(logits, batch.input_ids, batch.attention_mask)
            mask = batch.attention_mask[:, 1:] if whole_text else batch.value_mask[:, 1:]
            out[indices] = (nll * mask).sum(dim=1).double().cpu().numpy()
    return out
