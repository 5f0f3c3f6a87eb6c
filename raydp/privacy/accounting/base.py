"""The accountant interface: a mechanism description (the ledger) goes in, epsilon comes out.

Every accountant here accounts the same mechanism: a sequence of Poisson-subsampled Gaussian steps,
step t with sampling rate q_t and noise multiplier sigma_t (the step's ``sigma_eff``, every release of
the step combined; ERRATA E1/E3), under the add/remove-one neighbouring relation (E6). Each step may
have a different (q, sigma): composition is heterogeneous.

Two ways to use an accountant:

* ``accountant.epsilon(steps, delta)``: one fresh computation over a whole ledger (or a
  :class:`~raydp.privacy.accounting.grid.StepHistogram`, or an iterable of ``(q, sigma[, count])``).
* ``accountant.composition()``: an incremental :class:`Composition` that steps are added to as they
  happen, which answers ``epsilon(delta)`` and the what-if ``epsilon_with(q, sigma, count, delta)``
  ("the steps so far plus ``count`` more at (q, sigma)") cheaply; :class:`LedgerTracker` keeps one in
  sync with an append-only ledger. The budget guard is built on it.

``is_upper_bound`` says whether the number is a guaranteed upper bound on the true epsilon (RDP, PRV's
upper bound, pessimistic PLD) or an approximation (GDP/CLT, ERRATA E2/E9). Only upper bounds may
calibrate or enforce a budget.
"""

from __future__ import annotations

import abc
import math
from typing import ClassVar

import numpy as np

from raydp.errors import ConfigError
from raydp.privacy.accounting.grid import DEFAULT_GRID, Grid, StepHistogram, as_histogram

__all__ = ["Accountant", "Composition", "LedgerTracker", "check_delta", "check_epsilon", "check_q"]


def check_delta(delta: float) -> float:
    delta = float(delta)
    if not (0.0 < delta < 1.0):
        raise ConfigError(f"delta must be in (0, 1), got {delta}")
    return delta


def check_epsilon(epsilon: float) -> float:
    epsilon = float(epsilon)
    if not (epsilon > 0.0 and math.isfinite(epsilon)):
        raise ConfigError(f"epsilon must be > 0 and finite, got {epsilon}")
    return epsilon


def check_q(q: float) -> float:
    q = float(q)
    if not (0.0 < q <= 1.0):
        raise ConfigError(f"sampling rate q must be in (0, 1], got {q}")
    return q


class Accountant(abc.ABC):
    """Abstract accountant of heterogeneous Poisson-subsampled Gaussian compositions.

    Subclasses implement :meth:`_epsilon_groups` (epsilon of a list of (q, sigma, count) groups, every
    sigma finite and > 0) and may override :meth:`composition` with an incremental implementation.
    """

    name: ClassVar[str]
    is_upper_bound: ClassVar[bool]

    def __init__(self, grid: Grid | None = DEFAULT_GRID) -> None:
        self.grid = grid

    def __repr__(self) -> str:
        return f"{type(self).__name__}(grid={self.grid!r})"

    # -- fresh computation -------------------------------------------------------------------------
    def epsilon(self, steps: object, delta: float) -> float:
        """Epsilon at ``delta`` of every step in ``steps`` (a ledger, a histogram, or (q, sigma[, n]))."""
        delta = check_delta(delta)
        hist = as_histogram(steps)
        if hist.nonprivate_steps:
            return math.inf
        groups = hist.groups(self.grid)
        if not groups:
            return 0.0
        return float(self._epsilon_groups(groups, delta))

    @abc.abstractmethod
    def _epsilon_groups(self, groups: list[tuple[float, float, int]], delta: float) -> float:
        """Epsilon of the composition of ``count`` steps at (q, sigma) for every group."""

    # -- incremental -------------------------------------------------------------------------------
    def composition(self) -> Composition:
        """A fresh incremental composition (default: recomputes from a histogram on every query)."""
        return HistogramComposition(self)

    def for_target(self, epsilon_target: float) -> Accountant:
        """This accountant with its numerical settings fixed for enforcing ``epsilon_target`` (so the
        guard, the calibration and the final check discretise identically). Default: itself."""
        return self

    def describe(self) -> dict:
        """JSON-able description for reports and the ledger's metadata."""
        return {"accountant": self.name, "is_upper_bound": self.is_upper_bound,
                "grid": None if self.grid is None else {
                    "sigma_ratio": self.grid.sigma_ratio, "q_ratio": self.grid.q_ratio,
                    "exact_min_count": self.grid.exact_min_count}}


class Composition(abc.ABC):
    """Incremental composition of one accountant; ``add`` is cheap, queries compose lazily."""

    def __init__(self, accountant: Accountant) -> None:
        self.accountant = accountant
        self.grid = accountant.grid
        self.num_steps = 0
        self.nonprivate = False

    def charge(self, q: float, sigma: float, count: int) -> tuple[float, float]:
        """The (q, sigma) charged for a new group of ``count`` steps at (q, sigma)."""
        return (q, sigma) if self.grid is None else self.grid.charge(q, sigma, count)

    def add(self, q: float, sigma: float, count: int = 1) -> None:
        h = StepHistogram()
        h.add(q, sigma, count)
        self.add_histogram(h)

    def add_arrays(self, q: np.ndarray, sigma: np.ndarray) -> None:
        h = StepHistogram()
        h.add_arrays(q, sigma)
        self.add_histogram(h)

    def add_histogram(self, hist: StepHistogram) -> None:
        self.num_steps += hist.total_steps
        if hist.nonprivate_steps:
            self.nonprivate = True
        if hist.counts:
            self._add_counts(hist.counts)

    @abc.abstractmethod
    def _add_counts(self, counts: dict[tuple[float, float], int]) -> None:
        """Add exact (q, sigma) -> count entries (sigma finite > 0, q > 0)."""

    def epsilon(self, delta: float) -> float:
        delta = check_delta(delta)
        if self.nonprivate:
            return math.inf
        return float(self._epsilon(delta))

    def epsilon_with(self, q: float, sigma: float, count: int, delta: float) -> float:
        """Epsilon of what was added plus ``count`` more steps at (q, sigma); nothing is mutated."""
        delta = check_delta(delta)
        q, sigma, count = float(q), float(sigma), int(count)
        if self.nonprivate or (sigma == 0.0 and q > 0.0 and count > 0):
            return math.inf
        if count == 0 or q == 0.0 or math.isinf(sigma):
            return self.epsilon(delta)
        return float(self._epsilon_with(q, sigma, count, delta))

    @abc.abstractmethod
    def _epsilon(self, delta: float) -> float: ...

    @abc.abstractmethod
    def _epsilon_with(self, q: float, sigma: float, count: int, delta: float) -> float: ...


class HistogramComposition(Composition):
    """Generic composition: keeps a histogram and recomputes with the accountant on every query."""

    def __init__(self, accountant: Accountant) -> None:
        super().__init__(accountant)
        self.hist = StepHistogram()

    def _add_counts(self, counts: dict[tuple[float, float], int]) -> None:
        for (q, s), c in counts.items():
            self.hist.add(q, s, c)

    def _epsilon(self, delta: float) -> float:
        return self.accountant.epsilon(self.hist, delta)

    def _epsilon_with(self, q: float, sigma: float, count: int, delta: float) -> float:
        groups = list(self.hist.groups(self.grid))
        qc, sc = self.charge(q, sigma, count)
        groups.append((qc, sc, count))
        return self.accountant._epsilon_groups(groups, delta)


class LedgerTracker:
    """Keeps a :class:`Composition` in sync with an append-only ledger: each sync adds only the steps
    recorded since the previous one (amortised O(1) per step); a different or shortened ledger is
    re-read from the start."""

    def __init__(self, accountant: Accountant) -> None:
        self.accountant = accountant
        self._ledger = None
        self._consumed = 0
        self.composition = accountant.composition()

    def sync(self, ledger) -> Composition:
        if self._ledger is not ledger or len(ledger) < self._consumed:
            self._ledger = ledger
            self._consumed = 0
            self.composition = self.accountant.composition()
        n = len(ledger)
        if n > self._consumed:
            q, sigma = ledger.arrays(self._consumed)
            self.composition.add_arrays(q, sigma)
            self._consumed = n
        return self.composition

    def epsilon(self, ledger, delta: float) -> float:
        return self.sync(ledger).epsilon(delta)
