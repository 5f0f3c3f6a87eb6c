"""Tokenised splits and batch collation (beside the tokenizer: evaluation and training both read them)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Batch:
    """A padded batch of training sequences (right padding). ``size`` may be 0 under Poisson sampling."""

    indices: list[int]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    #: privacy unit of each row as 0..n_units-1 (ERRATA E11), or None when every row is its own unit
    unit_index: torch.Tensor | None = None
    #: class of each row (a classification task), or None (language modelling)
    labels: torch.Tensor | None = None
    #: 1 at the tokens that overlap a field value's characters (the value-token metric), or None
    value_mask: torch.Tensor | None = None
    #: the number of units, known on the host when collated (None: read from ``unit_index``, a device sync)
    units_count: int | None = None

    @property
    def size(self) -> int:
        return len(self.indices)

    @property
    def n_units(self) -> int:
        """Privacy units in the batch (the DP step sums one clipped contribution per unit)."""
        if self.unit_index is None:
            return self.size
        if self.units_count is None:
            self.units_count = int(self.unit_index.max()) + 1 if self.size else 0
        return self.units_count


class TokenizedSplit:
    """The texts of one split, tokenised once (truncated to ``max_length`` tokens).

    ``fixed_length`` (classification prompts): every sequence is exactly ``max_length`` tokens, its LAST
    ``max_length`` tokens left-filled with the pad token, and every position counts (attention mask of
    ones), so the prompt's last token is always the last position and no sequence length is visible in
    the mask (the forward local mechanism releases the whole fixed-size hidden state; EW-FT Sec. 5.3)."""

    def __init__(self, texts: list[str], tokenizer, max_length: int, units=None, labels=None,
                 fixed_length: bool = False, spans=None):
        """``units``: the privacy unit (patient) of every text, for unit-level DP (ERRATA E11);
        ``labels``: the class of every text (a classification task); ``spans``: the character spans of the field
        values of every text (:func:`raydp.data.verbalise.verbalise_spans`), which mark the value tokens: a token
        is one when its characters overlap a value's (a fast tokenizer's offsets; none for a slow tokenizer)."""
        with_offsets = spans is not None and getattr(tokenizer, "is_fast", False) and not fixed_length
        tokenized = (tokenizer(texts, truncation=False, return_offsets_mapping=True) if with_offsets
                     else tokenizer(texts, truncation=False))
        encoded = tokenized["input_ids"]
        self.value_masks = None
        if with_offsets:
            if len(spans) != len(texts):
                raise ValueError(f"spans must give the value spans of every text ({len(texts)}), got {len(spans)}")
            self.value_masks = [value_token_mask(offsets, text_spans)[:max_length]
                                for offsets, text_spans in zip(tokenized["offset_mapping"], spans)]
        self.units = None if units is None else np.asarray(units)
        if self.units is not None and self.units.shape != (len(texts),):
            raise ValueError(f"units must give one unit per text ({len(texts)}), got shape {self.units.shape}")
        self.labels = None if labels is None else np.asarray(labels, dtype=np.int64)
        if self.labels is not None and self.labels.shape != (len(texts),):
            raise ValueError(f"labels must give one label per text ({len(texts)}), got shape {self.labels.shape}")
        self.fixed_length = bool(fixed_length)
        self.pad_token_id = tokenizer.pad_token_id
        if self.fixed_length:
            self.sequences = [[self.pad_token_id] * (max_length - len(ids)) + ids[-max_length:] for ids in encoded]
        else:
            self.sequences = [ids[:max_length] for ids in encoded]
        self.max_length = max_length

    def __len__(self) -> int:
        return len(self.sequences)

    def collate(self, indices: list[int], device: torch.device, width: int | None = None) -> Batch:
        """The batch of ``indices``, padded to the longest of them, or to ``width`` (a DP run's fixed batch width:
        :func:`raydp.runner.run.dp_batch_width`)."""
        length = max((len(self.sequences[i]) for i in indices), default=1)
        if width is not None:
            if length > width:
                raise ValueError(f"a sequence of {length} tokens does not fit the batch width {width}")
            length = width
        input_ids = torch.full((len(indices), length), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(indices), length), dtype=torch.long)
        for row, i in enumerate(indices):
            seq = self.sequences[i]
            input_ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            attention_mask[row, : len(seq)] = 1
        unit_index, units_count = None, None
        if self.units is not None:
            distinct, inverse = np.unique(self.units[np.asarray(indices, dtype=np.int64)], return_inverse=True)
            unit_index = torch.as_tensor(inverse.reshape(-1), dtype=torch.long, device=device)
            units_count = len(distinct)
        if self.fixed_length:
            attention_mask.fill_(1)  # the left fill is content, not padding (no length in the mask)
        labels = None
        if self.labels is not None:
            labels = torch.as_tensor(self.labels[np.asarray(indices, dtype=np.int64)], dtype=torch.long,
                                     device=device).reshape(-1)
        value_mask = None
        if self.value_masks is not None:
            value_mask = torch.zeros((len(indices), length), dtype=torch.bool)
            for row, i in enumerate(indices):
                value_mask[row, : len(self.value_masks[i])] = torch.from_numpy(self.value_masks[i])
            value_mask = value_mask.to(device)
        return Batch(list(indices), input_ids.to(device), attention_mask.to(device), unit_index, labels, value_mask,
                     units_count)


def value_token_mask(offsets, spans) -> np.ndarray:
    """True for each token whose characters ``[a, b)`` overlap some value span ``[s, e)`` (a < e and s < b)."""
    if spans is None or not len(spans) or not len(offsets):
        return np.zeros(len(offsets), dtype=bool)
    starts = np.array([a for a, _ in offsets], dtype=np.int64)[:, None]
    ends = np.array([b for _, b in offsets], dtype=np.int64)[:, None]
    s = np.array([a for a, _ in spans], dtype=np.int64)[None, :]
    e = np.array([b for _, b in spans], dtype=np.int64)[None, :]
    return ((starts < e) & (s < ends)).any(axis=1)
