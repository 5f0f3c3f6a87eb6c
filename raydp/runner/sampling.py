"""Batch samplers: which training records make up each step's batch.

Samplers own their random state (``state_dict``/``load_state_dict``) so a resumed run draws the same
batches. The non-private loop uses shuffled fixed-size batches; DP accounting with Poisson
subsampling needs real Poisson sampling (ERRATA E5), which the DP engine adds as another sampler.
"""

from __future__ import annotations

import math

import numpy as np


class ShuffledBatchSampler:
    """Fixed-size batches from a fresh permutation each epoch (the last batch of an epoch may be short)."""

    def __init__(self, n_records: int, batch_size: int, seed: int):
        if n_records <= 0 or batch_size <= 0:
            raise ValueError("n_records and batch_size must be positive")
        self.n_records = n_records
        self.batch_size = min(batch_size, n_records)
        self._rng = np.random.default_rng(seed)
        self._order: np.ndarray = np.empty(0, dtype=np.int64)
        self._cursor = 0

    @property
    def steps_per_epoch(self) -> float:
        return float(math.ceil(self.n_records / self.batch_size))

    @property
    def expected_batch_size(self) -> float:
        return float(self.batch_size)

    def next_indices(self) -> list[int]:
        if self._cursor >= len(self._order):
            self._order = self._rng.permutation(self.n_records)
            self._cursor = 0
        chunk = self._order[self._cursor : self._cursor + self.batch_size]
        self._cursor += len(chunk)
        return chunk.tolist()

    def state_dict(self) -> dict:
        return {"rng": self._rng.bit_generator.state, "order": self._order.tolist(), "cursor": self._cursor}

    def load_state_dict(self, state: dict) -> None:
        self._rng.bit_generator.state = state["rng"]
        self._order = np.asarray(state["order"], dtype=np.int64)
        self._cursor = int(state["cursor"])


class PoissonSampler:
    """Poisson subsampling: each record joins a step's batch independently with probability ``q``.

    This is the sampling the Poisson-subsampled accountants assume (ERRATA E5); batch sizes vary and
    may be 0. Gradient sums are normalised by :attr:`expected_batch_size` = q * N, never by the
    actual (private) batch size.
    """

    def __init__(self, n_records: int, q: float, seed: int):
        if n_records <= 0:
            raise ValueError("n_records must be positive")
        if not 0.0 < q <= 1.0:
            raise ValueError(f"sampling rate q must be in (0, 1], got {q}")
        self.n_records = n_records
        self.q = float(q)
        self._rng = np.random.default_rng(seed)

    @classmethod
    def for_batch_size(cls, n_records: int, batch_size: int, seed: int) -> "PoissonSampler":
        """q = B / N (RLDP Sec. 3.1)."""
        return cls(n_records, min(1.0, batch_size / n_records), seed)

    @property
    def steps_per_epoch(self) -> float:
        return 1.0 / self.q

    @property
    def expected_batch_size(self) -> float:
        return self.q * self.n_records

    def next_indices(self) -> list[int]:
        return np.flatnonzero(self._rng.random(self.n_records) < self.q).tolist()

    def state_dict(self) -> dict:
        return {"rng": self._rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        self._rng.bit_generator.state = state["rng"]
