"""Per-sequence language-model loss.

Privacy needs the loss of each sequence to depend on that sequence alone. The Hugging Face
``labels=`` loss averages over every non-padding token of the *batch*, so a sample's weight depends on
the lengths of the other samples in the batch; we never use it. Instead each sequence's loss is the
mean next-token NLL over its own non-padding tokens, and a batch loss is a mean (or, under DP, a sum
divided by the expected batch size) over sequences.
"""

from __future__ import annotations

import torch


def token_nll(logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """Next-token NLL of every position and the mask of positions that count.

    Returns ``(nll, mask)``, both of shape ``[batch, seq_len - 1]``: position ``t`` scores the
    prediction of token ``t + 1`` and counts only when that token is not padding.
    """
    # cross-entropy as its two parts, the log-softmax over the whole (contiguous) logits and a gather of the shifted
    # targets: F.cross_entropy of the shifted slice copies it first (slower). The same kernels on the same rows:
    # the NLL and its gradient have cross_entropy's values (tests/test_throughput.py; a masked position's zero
    # gradient may now be +0.0 where it was -0.0). The last position's row, which predicts nothing, gets a zero
    # gradient (NaN if its logits hold an infinity, as a padded position's always did; it stays in that record)
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    targets = input_ids[:, 1:]
    mask = attention_mask[:, 1:].to(log_probs.dtype)
    nll = -log_probs[:, :-1].gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return nll * mask, mask


def per_sequence_nll(
    logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """Mean next-token NLL of each sequence over its own non-padding tokens, shape ``[batch]``."""
    nll, mask = token_nll(logits, input_ids, attention_mask)
    return nll.sum(dim=1) / mask.sum(dim=1).clamp_min(1.0)
