"""Tokenised splits and batch collation."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    """A padded batch of training sequences (right padding). ``size`` may be 0 under Poisson sampling."""

    indices: list[int]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor

    @property
    def size(self) -> int:
        return len(self.indices)


class TokenizedSplit:
    """The texts of one split, tokenised once (truncated to ``max_length`` tokens)."""

    def __init__(self, texts: list[str], tokenizer, max_length: int):
        encoded = tokenizer(texts, truncation=False)["input_ids"]
        self.n_truncated = sum(len(ids) > max_length for ids in encoded)
        self.sequences = [ids[:max_length] for ids in encoded]
        self.pad_token_id = tokenizer.pad_token_id
        self.max_length = max_length

    def __len__(self) -> int:
        return len(self.sequences)

    def collate(self, indices: list[int], device: torch.device) -> Batch:
        length = max((len(self.sequences[i]) for i in indices), default=1)
        input_ids = torch.full((len(indices), length), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(indices), length), dtype=torch.long)
        for row, i in enumerate(indices):
            seq = self.sequences[i]
            input_ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            attention_mask[row, : len(seq)] = 1
        return Batch(list(indices), input_ids.to(device), attention_mask.to(device))

    def mean_length(self) -> float:
        return sum(map(len, self.sequences)) / max(len(self.sequences), 1)
