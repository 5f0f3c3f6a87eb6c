"""The private training records and their Poisson batches as a ``transformers.Trainer`` receives them under
raydp's DP step (:mod:`raydp.integrations.transformers`): the records as raydp's :class:`TokenizedSplit`, a batch
sampler over the run's secret Poisson sampler, and the dataset whose length the Trainer reads (the released number
of privacy units).
"""

from __future__ import annotations

import torch

from raydp.errors import ConfigError
from raydp.model.batches import TokenizedSplit

#: the one key of the inputs the Trainer receives: an opaque :class:`raydp.model.batches.Batch`
BATCH_KEY = "raydp_poisson_batch"


class _Pretokenized:
    """A tokenizer stand-in for :class:`TokenizedSplit` over sequences that are already token ids."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, sequences, truncation: bool = False):
        return {"input_ids": sequences}


def _sequence(item, index: int) -> list[int]:
    """The token ids of one tokenised record (``input_ids``, padding removed by ``attention_mask``)."""
    if not hasattr(item, "keys") or "input_ids" not in item:
        raise ConfigError(f"train_dataset record {index} has no 'input_ids' (pass texts, or tokenised records)")
    ids = item["input_ids"]
    ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    mask = item.get("attention_mask") if hasattr(item, "get") else None
    if mask is not None:
        mask = mask.tolist() if hasattr(mask, "tolist") else list(mask)
        ids = [t for t, m in zip(ids, mask) if m]
    return [int(t) for t in ids]


def training_split(dataset, tokenizer, max_length: int, units=None, text_column: str = "text") -> TokenizedSplit:
    """The private training records as raydp's :class:`TokenizedSplit`: texts (tokenised here), records
    with a ``text_column``, or tokenised records (``input_ids``, optional ``attention_mask``)."""
    n = len(dataset)
    if n == 0:
        raise ConfigError("train_dataset is empty")
    first = dataset[0]
    if isinstance(first, str) or (hasattr(first, "keys") and "input_ids" not in first and text_column in first):
        if tokenizer is None:
            raise ConfigError("train_dataset holds texts: pass the tokenizer")
        texts = [dataset[i] if isinstance(first, str) else dataset[i][text_column] for i in range(n)]
        return TokenizedSplit(texts, tokenizer, max_length, units=units)
    pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    if pad is None:
        raise ConfigError("the tokenizer has no pad_token_id (set tokenizer.pad_token = tokenizer.eos_token)")
    sequences = [_sequence(dataset[i], i) for i in range(n)]
    return TokenizedSplit(sequences, _Pretokenized(pad), max_length, units=units)


class PoissonBatches:
    """A torch batch sampler over raydp's :class:`~raydp.runner.sampling.PoissonSampler`: every batch is an
    independent Poisson sample of privacy units (its records' indices; possibly empty), drawn from the run's
    secret randomness (ERRATA E5, E11, E12). ``len`` (one epoch) is round(1/q) samples."""

    def __init__(self, sampler, steps_per_epoch: int):
        self.sampler = sampler
        self.steps_per_epoch = int(steps_per_epoch)

    def __iter__(self):
        for _ in range(self.steps_per_epoch):
            yield self.sampler.next_indices()

    def __len__(self) -> int:
        return self.steps_per_epoch


class _Indices(torch.utils.data.Dataset):
    """The train dataloader's dataset: item ``i`` is record index ``i``, drawn by the batch sampler (the DataLoader
    takes its length from the batch sampler, not from this dataset). Its length is what the Trainer reads of it
    (transformers 5.24's ``Trainer.num_examples``: ``Num examples`` in its INFO log): ``n`` is a released count,
    the number of privacy units N, never the number of records (private when a unit has several)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i
