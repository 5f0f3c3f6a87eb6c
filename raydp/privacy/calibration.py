"""Calibration of the initial noise multiplier sigma_0 (RLDP Alg. 1 line 1) and the planned step count.

``calibrate_sigma(epsilon_target, delta, q, steps)`` finds the smallest sigma_0 (to 0.1%) such that an
upper-bounding accountant charges at most ``epsilon_target`` at ``delta`` for ``steps`` Poisson-sampled
steps at rate ``q``; the result's epsilon lies within 1% below the target (in practice within 0.3%),
never above it. The accountant is the one that will enforce the budget, with its discretisation fixed
from the target (``Accountant.for_target``), so the guard and the final check charge the same sigma_0
the same way. (With fewer steps than the grid's ``exact_min_count`` the steps are charged on the sigma
grid, a step function, and the result may land up to ~2% below the target.)

Extra releases. A step may release more than the gradient (a noisy norm histogram, a noisy loss; ERRATA
E3). They compose with the gradient release as one Gaussian mechanism, so what is calibrated is the map
from the controller's gradient sigma to the step's ``sigma_eff`` (:class:`SigmaEffMap`)::

    1 / sigma_eff^2 = (1 + relative_precision) / sigma^2 + extra_precision

``extra_precision`` = sum (sensitivity/std)^2 of releases with a FIXED noise std, ``relative_precision``
= sum (sensitivity/std_per_unit_sigma)^2 of releases whose std scales with sigma (std = k * sigma). Any
non-decreasing callable sigma -> sigma_eff is accepted as well (wrapped by :class:`SigmaEffMap`).

Planned steps (ERRATA E10): ``planned_steps(epochs, q) = ceil(epochs / q)``; with Poisson sampling at
rate q = B/N one epoch is 1/q steps in expectation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from fractions import Fraction

from raydp.errors import ConfigError
from raydp.privacy.accounting import Accountant, get_accountant
from raydp.privacy.accounting.base import check_delta, check_epsilon, check_q
from raydp.privacy.ledger import Release
from raydp.privacy.schedule import SigmaSchedule

__all__ = ["SIGMA_CAP", "CalibrationResult", "SigmaEffMap", "calibrate_sigma", "min_feasible_sigma",
           "planned_steps"]

SIGMA_CAP = 1e4
SEARCH_RATIO = 1.001


def planned_steps(epochs: float, q: float | None = None, *, dataset_size: int | None = None,
                  batch_size: float | None = None) -> int:
    """Number of steps of ``epochs`` epochs at Poisson rate q (or q = batch_size / dataset_size):
    ``ceil(epochs / q)`` (ERRATA E10), computed in exact arithmetic."""
    if not (epochs > 0 and math.isfinite(epochs)):
        raise ConfigError(f"epochs must be > 0, got {epochs}")
    if q is None:
        if dataset_size is None or batch_size is None:
            raise ConfigError("planned_steps needs q, or dataset_size and batch_size")
        if not (dataset_size > 0 and 0 < batch_size <= dataset_size):
            raise ConfigError(f"need 0 < batch_size <= dataset_size, got {batch_size} and {dataset_size}")
        rate = Fraction(batch_size).limit_denominator(10**9) / Fraction(int(dataset_size))
    else:
        check_q(q)
        rate = Fraction(q).limit_denominator(10**12)
    return max(1, math.ceil(Fraction(epochs).limit_denominator(10**9) / rate))


class SigmaEffMap:
    """sigma (gradient noise multiplier) -> the step's sigma_eff, non-decreasing.

    ``SigmaEffMap(extra_precision=X, relative_precision=Y)``: 1/sigma_eff^2 = (1+Y)/sigma^2 + X.
    ``SigmaEffMap(fn=callable)``: any non-decreasing map (inverted by bisection).
    """

    def __init__(self, extra_precision: float = 0.0, relative_precision: float = 0.0,
                 fn: Callable[[float], float] | None = None) -> None:
        self.extra_precision = float(extra_precision)
        self.relative_precision = float(relative_precision)
        if not (self.extra_precision >= 0 and math.isfinite(self.extra_precision)):
            raise ConfigError(f"extra precision must be finite and >= 0, got {extra_precision}")
        if not (self.relative_precision >= 0 and math.isfinite(self.relative_precision)):
            raise ConfigError(f"relative precision must be finite and >= 0, got {relative_precision}")
        if fn is not None and (self.extra_precision or self.relative_precision):
            raise ConfigError("give either a sigma -> sigma_eff function or extra/relative precisions, not both")
        self.fn = fn

    @classmethod
    def from_releases(cls, fixed: Iterable[Release] = (), scaled: Iterable[Release] = ()) -> SigmaEffMap:
        """Extra releases per step: ``fixed`` with their own noise std; ``scaled`` whose ``noise_std`` is
        per unit of sigma (their actual std is noise_std * sigma)."""
        return cls(extra_precision=math.fsum(r.precision for r in fixed),
                   relative_precision=math.fsum(r.precision for r in scaled))

    @classmethod
    def coerce(cls, m: SigmaEffMap | Callable[[float], float] | None) -> SigmaEffMap:
        if m is None:
            return cls()
        if isinstance(m, SigmaEffMap):
            return m
        if callable(m):
            return cls(fn=m)
        raise ConfigError(f"sigma_eff must be a SigmaEffMap or a callable, got {type(m).__name__}")

    @property
    def is_identity(self) -> bool:
        return self.fn is None and self.extra_precision == 0.0 and self.relative_precision == 0.0

    def __call__(self, sigma: float) -> float:
        sigma = float(sigma)
        if self.fn is not None:
            return float(self.fn(sigma))
        if sigma == 0.0:
            return 0.0
        prec = (1.0 + self.relative_precision) / (sigma * sigma) + self.extra_precision
        return math.inf if prec == 0.0 else 1.0 / math.sqrt(prec)

    def inverse(self, sigma_eff: float, cap: float = math.inf) -> float:
        """Smallest sigma with self(sigma) >= sigma_eff (inf if none up to ``cap``)."""
        if sigma_eff <= 0.0:
            return 0.0
        if self.fn is None:
            rest = 1.0 / (sigma_eff * sigma_eff) - self.extra_precision
            if rest <= 0.0:
                return math.inf
            sigma = math.sqrt((1.0 + self.relative_precision) / rest)
            while self(sigma) < sigma_eff:
                sigma = math.nextafter(sigma, math.inf)
            return sigma if sigma <= cap else math.inf
        hi = max(sigma_eff, 1e-6)
        while self(hi) < sigma_eff:
            hi *= 2.0
            if hi > cap:
                return math.inf
        lo = 0.0
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            if mid in (lo, hi):
                break
            if self(mid) >= sigma_eff:
                hi = mid
            else:
                lo = mid
        return hi

    def describe(self) -> dict:
        if self.fn is not None:
            return {"sigma_eff": getattr(self.fn, "__name__", "callable")}
        return {"extra_precision": self.extra_precision, "relative_precision": self.relative_precision}


def min_feasible_sigma(eps_fn: Callable[[float], float], target: float, *, start: float = 1.0,
                       s_max: float = SIGMA_CAP, s_min: float = 1e-3, ratio: float = SEARCH_RATIO,
                       rtol: float = 0.0, max_evals: int = 60) -> tuple[float, float, int] | None:
    """Smallest s = ratio**k in [s_min, s_max] with eps_fn(s) <= target, for non-increasing eps_fn.

    Returns (s, eps_fn(s), evaluations), or None if even s_max is infeasible; if s_min is feasible, s_min
    (rounded up onto the grid) is returned. The search stops at a feasible s whose neighbour below on
    the grid is infeasible, or as soon as a feasible s has eps_fn(s) >= target * (1 - rtol). Secant
    steps on log(eps) against k, safeguarded by bisection; typically 2 to 6 evaluations. Every returned
    s was evaluated feasible.
    """
    lr = math.log(ratio)
    k_max = math.floor(math.log(s_max) / lr + 1e-9)
    k_min = min(math.ceil(math.log(s_min) / lr - 1e-9), k_max)
    lt = math.log(target)
    big = max(1, round(math.log(2.0) / lr))  # one doubling of s
    cache: dict[int, float] = {}

    def ev(k: int) -> float:
        if k not in cache:
            cache[k] = float(eps_fn(math.exp(k * lr)))
        return cache[k]

    def logy(e: float) -> float:
        return math.log(e) if 0.0 < e < math.inf else (math.inf if e > 0 else -math.inf)

    k = min(max(round(math.log(max(start, 1e-300)) / lr), k_min), k_max)
    lo: int | None = None  # largest index known infeasible
    hi: int | None = None  # smallest index known feasible
    slope = -1.5 * lr  # guess of d log(eps) / dk (elasticity 1.5) until two points are known
    last: tuple[int, float] | None = None
    # 1. bracket
    while lo is None or hi is None:
        if len(cache) >= max_evals:
            break
        e = ev(k)
        y = logy(e)
        if e <= target:
            hi = k
            if e >= target * (1.0 - rtol) and rtol > 0:
                return math.exp(hi * lr), e, len(cache)
        else:
            lo = k
        if last is not None and math.isfinite(y) and math.isfinite(last[1]) and (y - last[1]) / (k - last[0]) < 0:
            slope = (y - last[1]) / (k - last[0])
        if math.isfinite(y):
            last = (k, y)
        if lo is not None and hi is not None:
            break
        step = (lt - y) / slope if math.isfinite(y) else None
        if hi is None:  # go up
            if k >= k_max:
                return None
            step = big if step is None else min(big, max(1, math.ceil(step * 1.05)))
            k = min(k + step, k_max)
        else:  # go down
            if k <= k_min:
                return math.exp(hi * lr), ev(hi), len(cache)
            step = -big if step is None else max(-big, min(-1, math.floor(step * 1.05)))
            k = max(k + step, k_min)
    if hi is None:
        return None
    if lo is None:
        return math.exp(hi * lr), ev(hi), len(cache)
    # 2. shrink the bracket [lo, hi] to adjacent indices
    same_side, last_side = 0, None
    while hi - lo > 1 and len(cache) < max_evals:
        ylo, yhi = logy(ev(lo)), logy(ev(hi))
        if same_side < 2 and math.isfinite(ylo) and math.isfinite(yhi) and ylo > yhi:
            k = math.ceil(lo + (ylo - lt) / (ylo - yhi) * (hi - lo) - 1e-9)
        else:
            k = (lo + hi) // 2
        k = min(max(k, lo + 1), hi - 1)
        e = ev(k)
        side = e <= target
        if side:
            hi = k
            if e >= target * (1.0 - rtol) and rtol > 0:
                break
        else:
            lo = k
        same_side = same_side + 1 if side == last_side else 0
        last_side = side
    return math.exp(hi * lr), ev(hi), len(cache)


@dataclass(frozen=True)
class CalibrationResult:
    """sigma: the controller's sigma_0; sigma_eff: the per-step noise multiplier it gives; epsilon: what
    the accountant charges for ``steps`` steps at (q, sigma_eff)."""

    sigma: float
    sigma_eff: float
    epsilon: float
    epsilon_target: float
    delta: float
    q: float
    steps: int
    accountant: str
    evaluations: int

    def as_dict(self) -> dict:
        return asdict(self)


def calibrate_sigma(epsilon_target: float, delta: float, q: float, steps: int,
                    accountant: str | Accountant = "pld", *,
                    sigma_eff: SigmaEffMap | Callable[[float], float] | None = None,
                    sigma_cap: float = SIGMA_CAP, allow_approximation: bool = False,
                    schedule: SigmaSchedule | None = None) -> CalibrationResult:
    """Smallest sigma_0 whose ``steps`` steps at rate q cost at most ``epsilon_target`` at ``delta``.

    ``schedule``: step t runs at sigma_0 * m(t) (:class:`~raydp.privacy.schedule.SigmaSchedule`; default
    constant); the whole planned schedule is composed (dp_accounting's ``calibrate_dp_mechanism`` does the
    same for a parameterised event). The accountant must be an upper bound (``rdp``, ``prv``, ``pld``);
    ``allow_approximation=True`` admits GDP or Edgeworth for reproducing a paper's numbers only. Raises ConfigError
    for a bad request or a target that no sigma up to ``sigma_cap`` reaches.
    """
    epsilon_target = check_epsilon(epsilon_target)
    delta = check_delta(delta)
    q = check_q(q)
    if int(steps) != steps or steps <= 0:
        raise ConfigError(f"steps must be a positive integer, got {steps}")
    steps = int(steps)
    acc = get_accountant(accountant)
    if not acc.is_upper_bound and not allow_approximation:
        raise ConfigError(f"accountant {acc.name!r} is an approximation, not an upper bound; "
                          "calibrate with 'pld', 'prv' or 'rdp'")
    acc = acc.for_target(epsilon_target)
    smap = SigmaEffMap.coerce(sigma_eff)
    if schedule is not None and not schedule.is_constant:
        return _calibrate_schedule(epsilon_target, delta, q, steps, acc, smap, schedule, sigma_cap)
    s_max = smap(sigma_cap)

    def eps_of(s: float) -> float:
        return acc.epsilon([(q, s, steps)], delta)

    found = min_feasible_sigma(eps_of, epsilon_target, start=min(1.0, s_max), s_max=s_max, rtol=0.003)
    if found is None:
        raise ConfigError(f"epsilon={epsilon_target} at delta={delta} is unreachable with {steps} steps at "
                          f"q={q}, even at sigma={sigma_cap:g}")
    s, eps, n = found
    sigma = smap.inverse(s, cap=sigma_cap)
    if not math.isfinite(sigma):
        raise ConfigError(f"epsilon={epsilon_target} is unreachable: the extra releases alone exceed it")
    return CalibrationResult(sigma=sigma, sigma_eff=smap(sigma), epsilon=eps, epsilon_target=epsilon_target,
                             delta=delta, q=q, steps=steps, accountant=acc.name, evaluations=n)


def _calibrate_schedule(epsilon_target: float, delta: float, q: float, steps: int, acc: Accountant,
                        smap: SigmaEffMap, schedule: SigmaSchedule, sigma_cap: float) -> CalibrationResult:
    """The scale sigma_0 of a non-constant schedule: each segment of m steps at sigma_0 * m_k is composed
    (epsilon is non-increasing in sigma_0 because every step's sigma_eff is)."""
    segments = schedule.segments(steps, q)
    top = max(m for m, _ in segments)

    def eps_of(sigma: float) -> float:
        return acc.epsilon([(q, smap(sigma * m), n) for m, n in segments], delta)

    found = min_feasible_sigma(eps_of, epsilon_target, start=1.0, s_max=sigma_cap / top, rtol=0.003)
    if found is None:
        raise ConfigError(f"epsilon={epsilon_target} at delta={delta} is unreachable with {steps} steps at "
                          f"q={q} on this schedule, even at sigma={sigma_cap:g}")
    sigma, eps, n = found
    return CalibrationResult(sigma=sigma, sigma_eff=smap(sigma), epsilon=eps, epsilon_target=epsilon_target,
                             delta=delta, q=q, steps=steps, accountant=acc.name, evaluations=n)
