"""Batch samplers: which training records make up each step's batch.

The non-private sampler checkpoints its random state (``state_dict``/``load_state_dict``) so a resumed
run draws the same batches; the Poisson sampler of DP runs checkpoints nothing (its randomness is secret,
ERRATA E12) and a resumed run draws on with fresh randomness. The non-private loop uses shuffled fixed-size batches; DP accounting with Poisson
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
    """Poisson subsampling of privacy units: each unit joins a step's sample independently with rate ``q``.

    This is the sampling the Poisson-subsampled accountants assume (ERRATA E5); sample sizes vary and
    may be 0. ``units`` gives the privacy unit of every record (ERRATA E11: the patient); a sampled unit
    brings all of its records, which the DP step combines into one contribution. Without ``units`` every
    record is its own unit. Gradient sums are normalised by :attr:`expected_batch_size` = q * N_units,
    never by the actual (private) sample size.

    ``rng`` must be secret (ERRATA E12): by default a generator seeded from OS entropy; a DP run passes
    :meth:`raydp.privacy.randomness.PrivateRandomness.sampling_rng`.
    """

    def __init__(self, n_records: int, q: float, rng: np.random.Generator | None = None, units=None,
                 n_public: int | None = None):
        """``n_public``: the unit count the normaliser uses when it differs from the units present (audit
        canaries held out by their coin count in it: :attr:`raydp.runner.privacy_setup.PrivacyUnits.public_count`)."""
        if n_records <= 0:
            raise ValueError("n_records must be positive")
        if not 0.0 < q <= 1.0:
            raise ValueError(f"sampling rate q must be in (0, 1], got {q}")
        self.n_records = n_records
        self.q = float(q)
        if rng is None:
            from raydp.privacy.randomness import PrivateRandomness

            rng = PrivateRandomness.fresh().sampling_rng()
        self._rng = rng
        self._members: list[np.ndarray] | None = None
        self.n_units = n_records
        if units is not None:
            units = np.asarray(units)
            if units.shape != (n_records,):
                raise ValueError(f"units must give one unit per record ({n_records}), got shape {units.shape}")
            _, inverse = np.unique(units, return_inverse=True)
            order = np.argsort(inverse, kind="stable")
            bounds = np.flatnonzero(np.diff(inverse[order])) + 1
            self._members = np.split(order, bounds)
            self.n_units = len(self._members)
        self.n_public = self.n_units if n_public is None else int(n_public)

    @property
    def steps_per_epoch(self) -> float:
        return 1.0 / self.q

    @property
    def expected_batch_size(self) -> float:
        """q * N_units: the expected number of units per step (public given N_units; N_units counts the
        held-back audit canaries, so it does not depend on their coins)."""
        return self.q * self.n_public

    def next_indices(self) -> list[int]:
        chosen = np.flatnonzero(self._rng.random(self.n_units) < self.q)
        if self._members is None:
            return chosen.tolist()
        return np.concatenate([self._members[u] for u in chosen]).tolist() if chosen.size else []

    def state_dict(self) -> dict:
        """Nothing: the generator's state would let anyone holding a checkpoint rewind it to every past
        sample (ERRATA E12). Each Poisson step is independent, so a resumed run simply draws on with
        fresh secret randomness."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
