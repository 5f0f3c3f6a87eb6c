"""Compression of a ledger's steps into few (q, sigma, count) groups, without loosening the bound.

Composing a different sigma at every step is slow in the libraries (a Poisson-subsampled Gaussian
PLD or PRV must be built and convolved per distinct (q, sigma)). Composition is commutative, so steps
with equal (q, sigma) can be composed as one group with its count (``SelfComposedDpEvent``, Opacus
history entries with ``num_steps``). What remains is to make values *equal* when they are merely close:

* a (q, sigma) value that occurs at least ``exact_min_count`` times in the ledger is composed exactly;
* any rarer value is moved onto a geometric grid: sigma is rounded **down** (the accountant is charged
  less noise than was added) and q is rounded **up** (a larger sampling rate), both of which can only
  increase the privacy loss of a Poisson-subsampled Gaussian step. The grid is
  ``sigma_k = sigma_ratio ** k`` and ``q_k = min(1, q_ratio ** k)`` for integer k.

So the number of groups is at most ``steps / exact_min_count`` exact groups plus
``log(sigma_max / sigma_min) / log(sigma_ratio)`` grid bins, and the reported epsilon is never below the
exact per-step composition. Defaults: ``sigma_ratio = 1.005`` (a rounded step is charged at most 0.5%
less noise), ``q_ratio = 1.001``, ``exact_min_count = 16``. The effect on epsilon is at most
``log(1.005) * d(log eps)/d(log sigma)`` when every step is rounded (the elasticity is 1.5 to 5 in DP-SGD
regimes, largest for small q and sigma), about half of that on average. Measured (bench): a 3,600-step
ledger whose sigma changes every step, log-uniform in [0.5, 2] x sigma_0 at q = 1/1200, 278 groups
instead of 3,600 distinct values, epsilon +0.80% over exact per-step PLD; when sigma changes at most every
16 steps nothing is rounded (error 0).

The rule is monotone in the safe direction: a value's count only grows, so a step charged on the grid
today can only be charged its exact (larger) sigma later, never less. Incremental compositions (the
guard's cache) apply the same rule per batch of new steps, which is at least as conservative as the
rule on the whole ledger.

Free and non-private steps: a step with sigma = inf (nothing private released) or q = 0 costs nothing
and is counted in ``free_steps`` only; a step with sigma = 0 and q > 0 released something without noise
and makes epsilon infinite (``nonprivate_steps``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from raydp.errors import ConfigError

__all__ = ["DEFAULT_GRID", "Grid", "StepHistogram", "as_histogram"]


@dataclass(frozen=True)
class Grid:
    """Geometric grid for rare (q, sigma) values; see the module docstring.

    sigma_ratio: ratio of consecutive sigma grid values (sigma is rounded down onto the grid).
    q_ratio: ratio of consecutive q grid values (q is rounded up onto the grid, capped at 1).
    exact_min_count: a (q, sigma) value that occurs at least this many times is composed exactly.
    """

    sigma_ratio: float = 1.005
    q_ratio: float = 1.001
    exact_min_count: int = 16

    def __post_init__(self) -> None:
        if not (self.sigma_ratio > 1.0 and math.isfinite(self.sigma_ratio)):
            raise ConfigError(f"grid sigma_ratio must be > 1, got {self.sigma_ratio}")
        if not (self.q_ratio > 1.0 and math.isfinite(self.q_ratio)):
            raise ConfigError(f"grid q_ratio must be > 1, got {self.q_ratio}")
        if int(self.exact_min_count) < 1:
            raise ConfigError(f"grid exact_min_count must be >= 1, got {self.exact_min_count}")

    # Grid values are always computed as exp(k * log(ratio)) so that index k maps to one float.
    def sigma_value(self, k: int) -> float:
        return math.exp(k * math.log(self.sigma_ratio))

    def q_value(self, k: int) -> float:
        return min(1.0, math.exp(k * math.log(self.q_ratio)))

    def sigma_index(self, sigma: float) -> int:
        """Largest k with sigma_value(k) <= sigma (sigma finite and > 0)."""
        k = math.floor(math.log(sigma) / math.log(self.sigma_ratio))
        while self.sigma_value(k) > sigma:
            k -= 1
        while self.sigma_value(k + 1) <= sigma:
            k += 1
        return k

    def q_index(self, q: float) -> int:
        """Smallest k with q_value(k) >= q (0 < q <= 1)."""
        k = math.ceil(math.log(q) / math.log(self.q_ratio))
        while self.q_value(k) < q:
            k += 1
        while k > 0 and self.q_value(k - 1) >= q:
            k -= 1
        return k

    def sigma_floor(self, sigma: float) -> float:
        """sigma rounded down onto the grid (inf stays inf, 0 stays 0)."""
        if sigma == 0.0 or math.isinf(sigma):
            return sigma
        return self.sigma_value(self.sigma_index(sigma))

    def sigma_ceil(self, sigma: float) -> float:
        """Smallest grid value >= sigma."""
        if sigma == 0.0 or math.isinf(sigma):
            return sigma
        v = self.sigma_floor(sigma)
        return v if v == sigma else self.sigma_value(self.sigma_index(sigma) + 1)

    def q_ceil(self, q: float) -> float:
        """q rounded up onto the grid, capped at 1."""
        if q >= 1.0:
            return 1.0
        return self.q_value(self.q_index(q))

    def charge(self, q: float, sigma: float, count: int) -> tuple[float, float]:
        """The (q, sigma) an accountant is charged for ``count`` steps at exactly (q, sigma)."""
        if count >= self.exact_min_count:
            return q, sigma
        return self.q_ceil(q), self.sigma_floor(sigma)


DEFAULT_GRID = Grid()


def _check_step(q: float, sigma: float, count: int) -> None:
    if not (0.0 <= q <= 1.0):
        raise ConfigError(f"sampling rate q must be in (0, 1], got {q}")
    if math.isnan(sigma) or sigma < 0.0:
        raise ConfigError(f"noise multiplier must be >= 0 (inf allowed), got {sigma}")
    if count < 0:
        raise ConfigError(f"step count must be >= 0, got {count}")


class StepHistogram:
    """Counts of steps per exact (q, sigma_eff) value: the sufficient statistic of a ledger for every
    accountant of Poisson-subsampled Gaussian steps (composition is commutative).

    ``groups(grid)`` applies the grid rule and returns the (q, sigma, count) groups to compose.
    """

    __slots__ = ("counts", "free_steps", "nonprivate_steps", "_groups_cache")

    def __init__(self) -> None:
        self.counts: dict[tuple[float, float], int] = {}
        self.free_steps = 0
        self.nonprivate_steps = 0
        self._groups_cache: tuple[Grid | None, list[tuple[float, float, int]]] | None = None

    @property
    def total_steps(self) -> int:
        return sum(self.counts.values()) + self.free_steps + self.nonprivate_steps

    @property
    def private_steps(self) -> int:
        return sum(self.counts.values())

    def copy(self) -> StepHistogram:
        h = StepHistogram()
        h.counts = dict(self.counts)
        h.free_steps = self.free_steps
        h.nonprivate_steps = self.nonprivate_steps
        return h

    def add(self, q: float, sigma: float, count: int = 1) -> None:
        q, sigma, count = float(q), float(sigma), int(count)
        _check_step(q, sigma, count)
        if count == 0:
            return
        self._groups_cache = None
        if q == 0.0 or math.isinf(sigma):
            self.free_steps += count
        elif sigma == 0.0:
            self.nonprivate_steps += count
        else:
            key = (q, sigma)
            self.counts[key] = self.counts.get(key, 0) + count

    def add_arrays(self, q: np.ndarray, sigma: np.ndarray) -> None:
        """Add one step per element (vectorised grouping of equal pairs)."""
        q = np.asarray(q, dtype=np.float64)
        sigma = np.asarray(sigma, dtype=np.float64)
        if q.shape != sigma.shape:
            raise ConfigError("q and sigma arrays must have the same length")
        if q.size == 0:
            return
        pairs, counts = np.unique(np.stack([q, sigma], axis=1), axis=0, return_counts=True)
        for (qq, ss), c in zip(pairs.tolist(), counts.tolist()):
            self.add(qq, ss, c)

    def groups(self, grid: Grid | None) -> list[tuple[float, float, int]]:
        """(q, sigma, count) groups with the grid rule applied (``grid=None``: exact values only)."""
        if self._groups_cache is not None and self._groups_cache[0] == grid:
            return self._groups_cache[1]
        if grid is None:
            out = [(q, s, c) for (q, s), c in self.counts.items()]
        else:
            merged: dict[tuple[float, float], int] = {}
            for (q, s), c in self.counts.items():
                key = grid.charge(q, s, c)
                merged[key] = merged.get(key, 0) + c
            out = list(merged.items())
            out = [(q, s, c) for (q, s), c in out]
        out.sort()
        self._groups_cache = (grid, out)
        return out

    def __iter__(self) -> Iterator[tuple[float, float, int]]:
        return iter(self.groups(None))


def as_histogram(steps: object) -> StepHistogram:
    """Accept a :class:`~raydp.privacy.ledger.PrivacyLedger`, a :class:`StepHistogram`, or an iterable
    of ``(q, sigma)`` pairs / ``(q, sigma, count)`` triples."""
    if isinstance(steps, StepHistogram):
        return steps
    to_hist = getattr(steps, "to_histogram", None)
    if callable(to_hist):
        return to_hist()
    if not isinstance(steps, Iterable):
        raise ConfigError(f"cannot account {type(steps).__name__}: expected a ledger or (q, sigma[, count]) items")
    h = StepHistogram()
    for item in steps:
        t = tuple(item)
        if len(t) == 2:
            h.add(t[0], t[1], 1)
        elif len(t) == 3:
            h.add(t[0], t[1], int(t[2]))
        else:
            raise ConfigError(f"a step must be (q, sigma) or (q, sigma, count), got {t!r}")
    return h
