"""Accuracy of a prompt classifier on a held-out split (EW-FT Sec. 6 reports accuracy).

The result has the fields every evaluation has (``perplexity``, ``nll_per_token``, ``utility``,
``n_tokens``) so the loop, the studies and the reports read it like a perplexity: ``perplexity`` is the
label perplexity exp(mean cross-entropy) and ``nll_per_token`` the mean cross-entropy per example; and
``accuracy``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from raydp.model.batches import TokenizedSplit
from raydp.evaluation.perplexity import evaluation_mode
from raydp.model.classifier import class_logits


@dataclass(frozen=True)
class ClassificationResult:
    perplexity: float
    nll_per_token: float
    n_tokens: int  # examples (one prediction each)
    n_sequences: int
    accuracy: float

    @property
    def utility(self) -> float:
        return -self.nll_per_token


@torch.no_grad()
def evaluate_classification(model: torch.nn.Module, split: TokenizedSplit, device: torch.device,
                            class_ids: tuple[int, ...], batch_size: int = 32,
                            max_sequences: int | None = None, position: int = -1) -> ClassificationResult:
    """Label perplexity and accuracy of ``model`` on the first ``max_sequences`` examples of ``split``."""
    if split.labels is None:
        raise ValueError("a classification evaluation needs a split with labels")
    n = len(split) if max_sequences is None else min(len(split), max_sequences)
    total_nll, correct = 0.0, 0
    with evaluation_mode(model):
        for start in range(0, n, batch_size):
            batch = split.collate(list(range(start, min(start + batch_size, n))), device)
            logits = class_logits(model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits,
                                  class_ids, position)
            total_nll += float(torch.nn.functional.cross_entropy(logits, batch.labels, reduction="sum"))
            correct += int((logits.argmax(dim=1) == batch.labels).sum())
    nll = total_nll / max(n, 1)
    return ClassificationResult(math.exp(nll), nll, n, n, correct / max(n, 1))
