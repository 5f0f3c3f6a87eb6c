"""PRV accountant: Opacus's numerical composition of privacy random variables (Gopi et al. 2021).

Opacus's ``PRVAccountant.get_epsilon`` returns the **upper bound** ``eps_upper`` of
``DiscretePRV.compute_epsilon(delta, delta_error, eps_error)`` (the estimate evaluated at
``delta - delta_error`` plus ``eps_error``), not the point estimate; this module returns the same upper
bound. It uses Opacus's own pieces (``PoissonSubsampledGaussianPRV``, ``TruncatedPrivacyRandomVariable``,
``discretize``, ``compose_heterogeneous``, ``DiscretePRV.compute_epsilon``) and Opacus's rule for a safe
domain (``compute_safe_domain_size``: half-width L from RDP at ``delta_error/4`` and
``delta_error/(8 T)``, plus 3; mesh ``eps_error / sqrt(T log(12/delta_error) / 2)``), with two changes
that only make it faster or safer:

* the RDP values come from the shared cache of :mod:`raydp.privacy.accounting.rdp` instead of being
  recomputed per PRV, and the domain size is rounded UP to an FFT-friendly length (a larger domain and
  a finer mesh than the minimum are both allowed by the error analysis);
* the incremental composition (used by the guard) keeps the composed discrete PRV of the ledger on a
  fixed domain with headroom, and rebuilds it when the needed half-width or mesh would be violated.

``eps_error`` (which the upper bound adds in full) defaults to 0.3% of the RDP epsilon of the same steps
(an upper bound, so about 0.4% of the result), clipped to [1e-3, 0.1]; the mesh, hence the cost, scales
with it. Opacus's default is a fixed 0.01. ``delta_error = delta / 1000`` as in Opacus.
"""

from __future__ import annotations

import math
import warnings
from collections import OrderedDict

import numpy as np
from opacus.accountants.analysis.prv import (
    DiscretePRV,
    Domain,
    PoissonSubsampledGaussianPRV,
    TruncatedPrivacyRandomVariable,
    compose_heterogeneous,
    discretize,
)
from scipy.fft import next_fast_len
from scipy.signal import fftconvolve

from raydp.privacy.accounting.base import Accountant, Composition
from raydp.privacy.accounting.grid import DEFAULT_GRID, Grid, StepHistogram
from raydp.privacy.accounting.rdp import OPACUS_ORDERS, RDPAccountant, rdp_epsilon, rdp_vector

__all__ = ["PRVAccountant", "auto_eps_error"]

MAX_DOMAIN_SIZE = 8_000_000
RELATIVE_EPS_ERROR = 3e-3


def auto_eps_error(epsilon_estimate: float) -> float:
    """PRV ``eps_error`` for an epsilon estimate: 0.3% of it, clipped to [1e-3, 0.1]."""
    if not math.isfinite(epsilon_estimate):
        return 0.1
    return float(min(0.1, max(1e-3, RELATIVE_EPS_ERROR * epsilon_estimate)))


def _v(q: float, s: float) -> np.ndarray:
    return rdp_vector(q, s, OPACUS_ORDERS)


def _needed_domain(groups, eps_error: float, delta_error: float) -> tuple[float, float, int]:
    """(half-width L, mesh, total steps) by Opacus's safe-domain rule for these groups."""
    total = sum(c for _, _, c in groups)
    rdp_total = sum(c * _v(q, s) for q, s, c in groups)
    l_max = rdp_epsilon(rdp_total, OPACUS_ORDERS, delta_error / 4)
    for q, s, _ in groups:
        l_max = max(l_max, rdp_epsilon(_v(q, s), OPACUS_ORDERS, delta_error / (8 * total)))
    half_width = max(l_max, eps_error) + 3.0
    mesh = eps_error / math.sqrt(total * math.log(12 / delta_error) / 2)
    return half_width, mesh, total


def _make_domain(half_width: float, mesh: float) -> Domain | None:
    """Domain on [-L, L] or wider, grid point at 0, mesh ``mesh``, FFT-friendly even size."""
    if not math.isfinite(half_width):
        return None
    h = math.ceil(half_width / mesh)
    size = next_fast_len(2 * h + 2)
    while size % 2:
        size = next_fast_len(size + 1)
    if size > MAX_DOMAIN_SIZE:
        return None
    h = size // 2 - 1
    return Domain(t_min=-h * mesh, t_max=(size - 1 - h) * mesh, size=size)


def _single(q: float, sigma: float, domain: Domain):
    prv = PoissonSubsampledGaussianPRV(sample_rate=q, noise_multiplier=sigma)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return discretize(TruncatedPrivacyRandomVariable(prv, domain.t_min, domain.t_max), domain)


def _compose_two(left: DiscretePRV, right: DiscretePRV) -> DiscretePRV:
    """Opacus's pairwise composition on a common domain ('same'-size convolution; the domain shift of the
    right operand carries over), without the needless FFT round trip of ``compose_heterogeneous``."""
    return DiscretePRV(pmf=fftconvolve(left.pmf, right.pmf, mode="same"),
                       domain=left.domain.shift_right(right.domain.shifts))


def _eps_upper(dprv, delta: float, delta_error: float, eps_error: float) -> float:
    try:
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            _, _, eps_upper = dprv.compute_epsilon(delta, delta_error, eps_error)
    except RuntimeError:  # delta reached below the domain's lowest loss: epsilon is ~0
        return eps_error
    return max(float(eps_upper), 0.0)


class PRVAccountant(Accountant):
    """Upper bound by Opacus's PRV composition (``eps_upper``)."""

    name = "prv"
    is_upper_bound = True

    def __init__(self, grid: Grid | None = DEFAULT_GRID, eps_error: float | None = None) -> None:
        super().__init__(grid)
        if eps_error is not None and not eps_error > 0:
            raise ValueError("eps_error must be > 0")
        self.eps_error = eps_error

    def __repr__(self) -> str:
        return f"PRVAccountant(grid={self.grid!r}, eps_error={self.eps_error})"

    def for_target(self, epsilon_target: float) -> PRVAccountant:
        """Fixed ``eps_error`` = 0.4% of the target (the RDP estimate is about 1.3x the result)."""
        if self.eps_error is not None:
            return self
        return PRVAccountant(self.grid, auto_eps_error(1.3 * epsilon_target))

    def describe(self) -> dict:
        d = super().describe()
        d["eps_error"] = self.eps_error
        return d

    def _errors(self, groups, delta: float) -> tuple[float, float]:
        eps_error = self.eps_error
        if eps_error is None:
            rdp = sum(c * _v(q, s) for q, s, c in groups)
            eps_error = auto_eps_error(rdp_epsilon(rdp, OPACUS_ORDERS, delta))
        return eps_error, delta / 1000

    def _epsilon_groups(self, groups, delta: float) -> float:
        eps_error, delta_error = self._errors(groups, delta)
        half_width, mesh, _ = _needed_domain(groups, eps_error, delta_error)
        domain = _make_domain(half_width, mesh)
        if domain is None:
            warnings.warn("sigma too small for a PRV domain of manageable size; accounting with RDP instead",
                          RuntimeWarning, stacklevel=3)
            return RDPAccountant(grid=None)._epsilon_groups(groups, delta)
        dprvs = [_single(q, s, domain) for q, s, _ in groups]
        composed = compose_heterogeneous(dprvs, [int(c) for _, _, c in groups])
        return _eps_upper(composed, delta, delta_error, eps_error)

    def composition(self) -> PRVComposition:
        return PRVComposition(self)


class PRVComposition(Composition):
    """Composed discrete PRV of the steps so far on a fixed domain (with headroom), extended lazily.

    New steps wait in ``pending`` and are composed on the next query, grouped per batch with the grid
    rule. The domain is rebuilt (and every committed group re-discretised) when the ledger needs a
    wider domain or a finer mesh than the current one. A what-if query (``epsilon_with``) whose candidate
    alone needs a wider domain than the ledger's returns inf once the ledger has more than 8 groups
    (rebuilding would cost seconds; inf is a valid, conservative answer for the guard's search).
    Without a fixed ``eps_error`` on the accountant, 0.01.
    """

    _HEADROOM_L = 1.25  # half-width headroom when (re)building the domain
    _HEADROOM_MESH = 1.25  # mesh headroom (room for ~1.5x more steps)
    _CHEAP_REBUILD = 8  # a what-if query may rebuild the domain while the ledger has <= 8 groups
    _CACHE = 16

    def __init__(self, accountant: PRVAccountant) -> None:
        super().__init__(accountant)
        self.eps_error = accountant.eps_error or 1e-2
        self.hist = StepHistogram()
        self.committed: list[tuple[float, float, int]] = []  # charged groups in self.dprv
        self.pending: dict[tuple[float, float], int] = {}
        self.domain: Domain | None = None
        self._domain_key: tuple[float, float, float] | None = None  # (half_width, mesh, delta_error)
        self.dprv = None
        self._singles: OrderedDict[tuple[float, float], object] = OrderedDict()

    def _add_counts(self, counts) -> None:
        for (q, s), c in counts.items():
            self.hist.add(q, s, c)
            self.pending[(q, s)] = self.pending.get((q, s), 0) + c

    def _pending_groups(self) -> list[tuple[float, float, int]]:
        merged: dict[tuple[float, float], int] = {}
        for (q, s), c in self.pending.items():
            key = self.charge(q, s, c)
            merged[key] = merged.get(key, 0) + c
        return [(q, s, c) for (q, s), c in sorted(merged.items())]

    def _single(self, q: float, s: float):
        key = (q, s)
        d = self._singles.get(key)
        if d is None:
            d = _single(q, s, self.domain)
            self._singles[key] = d
            if len(self._singles) > self._CACHE:
                self._singles.popitem(last=False)
        else:
            self._singles.move_to_end(key)
        return d

    def _fits(self, groups, delta_error: float) -> tuple[bool, float, float]:
        half_width, mesh, _ = _needed_domain(groups, self.eps_error, delta_error)
        key = self._domain_key
        ok = (key is not None and key[2] == delta_error and half_width <= key[0] and mesh >= key[1])
        return ok, half_width, mesh

    def _rebuild(self, half_width: float, mesh: float, delta_error: float) -> bool:
        """New domain with headroom; every committed group is re-discretised and re-composed."""
        half_width *= self._HEADROOM_L
        mesh /= self._HEADROOM_MESH
        domain = _make_domain(half_width, mesh)
        if domain is None:
            return False
        self.domain, self._domain_key = domain, (half_width, mesh, delta_error)
        self._singles.clear()
        self.dprv = None
        if self.committed:
            self.dprv = compose_heterogeneous([self._single(q, s) for q, s, _ in self.committed],
                                              [c for _, _, c in self.committed])
        return True

    def _flush(self, delta_error: float) -> bool:
        new = self._pending_groups()
        groups = self.committed + new
        if not groups:
            return True
        ok, half_width, mesh = self._fits(groups, delta_error)
        if not ok and not self._rebuild(half_width, mesh, delta_error):
            return False
        for q, s, c in new:
            d = compose_heterogeneous([self._single(q, s)], [c])
            self.dprv = d if self.dprv is None else _compose_two(self.dprv, d)
            self.committed.append((q, s, c))
        self.pending.clear()
        return True

    def _fallback(self, delta: float, extra=()) -> float:
        warnings.warn("sigma too small for a PRV domain of manageable size; accounting with RDP instead",
                      RuntimeWarning, stacklevel=4)
        groups = list(self.hist.groups(self.grid)) + list(extra)
        return RDPAccountant(grid=None)._epsilon_groups(groups, delta)

    def _epsilon(self, delta: float) -> float:
        if not self.hist.counts:
            return 0.0
        delta_error = delta / 1000
        if not self._flush(delta_error):
            return self._fallback(delta)
        return _eps_upper(self.dprv, delta, delta_error, self.eps_error)

    def _epsilon_with(self, q, sigma, count, delta) -> float:
        delta_error = delta / 1000
        qc, sc = self.charge(q, sigma, count)
        extra = [(qc, sc, count)]
        if not self._flush(delta_error):
            return self._fallback(delta, extra)
        ok, half_width, mesh = self._fits(self.committed + extra, delta_error)
        if not ok:
            if len(self.committed) > self._CHEAP_REBUILD and mesh >= self._domain_key[1]:
                # Only the half-width is short: the candidate has a much larger epsilon than anything
                # composed so far. Rather than re-discretising the whole ledger for it, report inf (a
                # valid upper bound; the guard then looks at larger sigmas).
                return math.inf
            if not self._rebuild(half_width, mesh, delta_error):
                return self._fallback(delta, extra)
        composed = compose_heterogeneous([self._single(qc, sc)], [count])
        if self.dprv is not None:
            composed = _compose_two(self.dprv, composed)
        return _eps_upper(composed, delta, delta_error, self.eps_error)
