"""RDP accountant: Opacus's analysis of the Poisson-subsampled Gaussian (Mironov et al. 2019).

Per (q, sigma) the RDP curve over the orders comes from :func:`opacus.accountants.analysis.rdp.compute_rdp`
(cached per value: it costs 15-60 ms for the default orders); RDP composes by adding the curves, so a
composition keeps a running sum (a vector over the orders) and its epsilon is O(orders) at any time.
The conversion to (epsilon, delta) is Opacus's ``get_privacy_spent`` (Balle et al. 2020, Thm. 21).

Orders: Opacus's defaults (1.1 ... 10.9 by 0.1, 12 ... 63) plus larger ones up to 512 for small
epsilons (the optimum moves to large orders when the noise is large).
"""

from __future__ import annotations

import math
import warnings
from collections import Counter, OrderedDict
from collections.abc import Sequence

import numpy as np
from opacus.accountants import RDPAccountant as _OpacusRDP
from opacus.accountants.analysis import rdp as _rdp

from raydp.privacy.accounting.base import Accountant, Composition
from raydp.privacy.accounting.grid import DEFAULT_GRID, Grid

__all__ = ["DEFAULT_ORDERS", "OPACUS_ORDERS", "RDPAccountant", "ledger_rdp_curve", "rdp_curve", "rdp_epsilon", "rdp_vector"]

OPACUS_ORDERS: tuple[float, ...] = tuple(float(a) for a in _OpacusRDP.DEFAULT_ALPHAS)
DEFAULT_ORDERS: tuple[float, ...] = OPACUS_ORDERS + (64.0, 80.0, 96.0, 128.0, 192.0, 256.0, 512.0)

_CACHE_SIZE = 50_000
_cache: OrderedDict[tuple[float, float, tuple[float, ...]], np.ndarray] = OrderedDict()


def rdp_vector(q: float, sigma: float, orders: Sequence[float] = DEFAULT_ORDERS) -> np.ndarray:
    """RDP of ONE Poisson-subsampled Gaussian step at every order (Opacus ``compute_rdp``), cached.

    The vector for Opacus's default orders is a prefix of the one for :data:`DEFAULT_ORDERS` and is
    served from the same cache entry.
    """
    orders = tuple(float(a) for a in orders)
    n_opacus = len(OPACUS_ORDERS)
    if orders == OPACUS_ORDERS:
        return rdp_vector(q, sigma, DEFAULT_ORDERS)[:n_opacus]
    key = (float(q), float(sigma), orders)
    v = _cache.get(key)
    if v is not None:
        _cache.move_to_end(key)
        return v
    v = np.asarray(_rdp.compute_rdp(q=float(q), noise_multiplier=float(sigma), steps=1, orders=list(orders)),
                   dtype=np.float64)
    v.setflags(write=False)
    _cache[key] = v
    if len(_cache) > _CACHE_SIZE:
        _cache.popitem(last=False)
    return v


def rdp_epsilon(rdp: np.ndarray, orders: Sequence[float], delta: float) -> float:
    """Opacus's RDP -> (epsilon, delta) conversion; inf when every order is infinite."""
    rdp = np.asarray(rdp, dtype=np.float64)
    if not np.any(np.isfinite(rdp)):
        return math.inf
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "optimal order is the largest alpha" etc.
        eps, _ = _rdp.get_privacy_spent(orders=list(orders), rdp=rdp, delta=delta)
    eps = float(eps)
    return max(eps, 0.0) if not math.isnan(eps) else math.inf


class RDPAccountant(Accountant):
    """Upper bound via Renyi DP of the Poisson-subsampled Gaussian, summed over heterogeneous steps."""

    name = "rdp"
    is_upper_bound = True

    def __init__(self, grid: Grid | None = DEFAULT_GRID, orders: Sequence[float] = DEFAULT_ORDERS) -> None:
        super().__init__(grid)
        self.orders = tuple(float(a) for a in orders)

    def rdp_of_groups(self, groups: list[tuple[float, float, int]]) -> np.ndarray:
        total = np.zeros(len(self.orders))
        for q, s, c in groups:
            total += c * rdp_vector(q, s, self.orders)
        return total

    def _epsilon_groups(self, groups: list[tuple[float, float, int]], delta: float) -> float:
        return rdp_epsilon(self.rdp_of_groups(groups), self.orders, delta)

    def composition(self) -> RDPComposition:
        return RDPComposition(self)


class RDPComposition(Composition):
    """Running RDP sum. It applies the grid rule on the *cumulative* count of each exact value, exactly
    like a fresh computation: when a value reaches ``exact_min_count`` its grid charge is subtracted and
    its exact charge added (RDP is additive), so this always equals ``accountant.epsilon(ledger)``."""

    accountant: RDPAccountant

    def __init__(self, accountant: RDPAccountant) -> None:
        super().__init__(accountant)
        self.orders = accountant.orders
        self.rdp = np.zeros(len(self.orders))
        self.counts: dict[tuple[float, float], int] = {}

    def _vec(self, q: float, s: float) -> np.ndarray:
        return rdp_vector(q, s, self.orders)

    def _add_counts(self, counts: dict[tuple[float, float], int]) -> None:
        for (q, s), c in counts.items():
            old = self.counts.get((q, s), 0)
            new = old + c
            self.counts[(q, s)] = new
            ch_new = self.charge(q, s, new)
            if old == 0:
                self.rdp += new * self._vec(*ch_new)
                continue
            ch_old = self.charge(q, s, old)
            if ch_old == ch_new:
                self.rdp += c * self._vec(*ch_new)
            else:
                self.rdp += new * self._vec(*ch_new) - old * self._vec(*ch_old)
        if np.isnan(self.rdp).any():  # inf - inf at some order: recompute the sum from scratch
            self.rdp = np.zeros(len(self.orders))
            for (q, s), c in self.counts.items():
                self.rdp += c * self._vec(*self.charge(q, s, c))

    def _epsilon(self, delta: float) -> float:
        if not self.counts:
            return 0.0
        return rdp_epsilon(self.rdp, self.orders, delta)

    def rdp_with(self, q: float, sigma: float, count: int) -> np.ndarray:
        return self.rdp + count * self._vec(*self.charge(q, sigma, count))

    def _epsilon_with(self, q: float, sigma: float, count: int, delta: float) -> float:
        return rdp_epsilon(self.rdp_with(q, sigma, count), self.orders, delta)


def rdp_curve(q: Sequence[float], sigma: Sequence[float], orders: Sequence[float] = DEFAULT_ORDERS) -> np.ndarray:
    """The RDP curve of steps with sampling rates ``q`` and noise multipliers ``sigma``: the sum over the
    steps of the Poisson-subsampled Gaussian's RDP at each order (RDP composition, Mironov 2017, Prop. 1;
    per-step RDP from Mironov et al. 2019 via :func:`rdp_vector`, once per distinct value). Steps with no
    private release (sigma = inf, or q = 0) cost nothing; sigma = 0 gives an infinite curve."""
    total = np.zeros(len(orders))
    for (qv, sv), count in Counter(zip(np.asarray(q, float).tolist(), np.asarray(sigma, float).tolist())).items():
        if math.isinf(sv) or qv == 0.0:
            continue
        total = total + count * rdp_vector(qv, sv, orders)
    return total


def epsilon_over_steps(q: Sequence[float], sigma: Sequence[float], delta: float, points: int = 40,
                       orders: Sequence[float] = DEFAULT_ORDERS) -> tuple[np.ndarray, np.ndarray]:
    """The epsilon that the first k steps spend, at up to ``points`` values of k spread over the run (the last
    step included): the RDP upper bound of their composition (:func:`rdp_curve`), converted at ``delta``
    (:func:`rdp_epsilon`). Returns (k, epsilon). An enforcing PLD accountant's final figure is tighter."""
    q, sigma = np.asarray(q, float), np.asarray(sigma, float)
    if not len(q):
        return np.zeros(0), np.zeros(0)
    cache: dict[tuple[float, float], np.ndarray] = {}
    total, marks = np.zeros(len(orders)), set(np.linspace(0, len(q) - 1, points).astype(int).tolist())
    steps, spent = [], []
    for i, (qv, sv) in enumerate(zip(q.tolist(), sigma.tolist())):
        if not (math.isinf(sv) or qv == 0.0):
            if (qv, sv) not in cache:
                cache[(qv, sv)] = rdp_vector(qv, sv, orders)
            total = total + cache[(qv, sv)]
        if i in marks:
            steps.append(i + 1)
            spent.append(rdp_epsilon(total, orders, float(delta)))
    return np.asarray(steps, float), np.asarray(spent, float)


def ledger_rdp_curve(ledger, orders: Sequence[float] = DEFAULT_ORDERS) -> np.ndarray:
    """The RDP curve of every step of a ledger (:func:`rdp_curve`)."""
    return rdp_curve(*ledger.arrays(), orders)
