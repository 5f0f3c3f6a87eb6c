"""A causal LM as a classifier: the class words' logits at the prompt's last position.

The classification head is the (tied) language-model head restricted to the first token of each class
word (" changed" / " not" for ``change``; :mod:`raydp.data.tasks`), read at the last position of a
fixed-length, left-filled prompt (:class:`raydp.model.batches.TokenizedSplit`). Nothing new is trained
besides the LoRA adapters, so every DP strategy (per-sample LoRA gradients) applies unchanged, and the
per-example loss depends on that example alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from raydp.errors import ConfigError


def class_token_ids(tokenizer, classes: tuple[str, ...], leading_space: bool = True) -> tuple[int, ...]:
    """The first token of " word" (``leading_space``; else of "word", after a prompt that ends in the space) for
    each class word; they must differ."""
    ids = tuple(int(tokenizer(f" {word}" if leading_space else word, add_special_tokens=False)["input_ids"][0])
                for word in classes)
    if len(set(ids)) != len(ids):
        raise ConfigError(f"the class words {classes} share a first token under this tokenizer")
    return ids


def class_logits(logits: torch.Tensor, class_ids: tuple[int, ...], position: int = -1) -> torch.Tensor:
    """``[batch, n_classes]``: the class tokens' logits at ``position`` (the prompt's last token for a
    causal LM; the mask token, before the closing special token, for an encoder)."""
    return logits[:, position, list(class_ids)].float()


def per_example_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, class_ids: tuple[int, ...],
                              position: int = -1) -> torch.Tensor:
    """Cross-entropy of each example over the classes, shape ``[batch]``."""
    return F.cross_entropy(class_logits(logits, class_ids, position), labels, reduction="none")
