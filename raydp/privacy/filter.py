"""Renyi filter: the budget guard for strategies that choose sigma adaptively (ERRATA E13).

When a strategy chooses the noise multiplier of step t from earlier releases (RLDP, adaptive
baselines), composing the realized per-step mechanisms with PLD, PRV or a post-hoc RDP sum is not a
proven bound: those composition theorems fix the mechanisms (or their privacy parameters) in advance.
A *privacy filter* is valid under fully adaptive composition.

Theorem used (Renyi filter; Feldman & Zrnic 2021, "Individual Privacy Accounting via a Renyi Filter",
Thm. 3.1; Lecuyer 2021, "Practical Privacy Filters and Odometers with Renyi DP", Sec. 3): fix an order
alpha and a budget B before the interaction. Let the t-th mechanism be chosen adaptively, with its Renyi
DP rho_t(alpha) known before it runs, and run it only while sum_{s<=t} rho_s(alpha) <= B. Then the whole
interaction is (alpha, B)-RDP. The constraint here holds at every order alpha of a fixed set
simultaneously, for a budget *curve* B(alpha) fixed before training, so the interaction is
(alpha, B(alpha))-RDP for every alpha at once, and any RDP -> (epsilon, delta) conversion applies; the one
used is Balle et al. 2020, Thm. 21 (Opacus's ``get_privacy_spent``), minimised over the orders. Because
B is fixed before training, so is that epsilon: it is what an adaptive run reports, not a post-hoc
composition of its ledger.

Budget curve: B(alpha) = T * rho(q, sigma_eff_0, alpha) * (1 + 1e-9), the RDP curve of the planned
constant schedule (T planned steps at the calibrated sigma_0; the 1e-9 absorbs float rounding of sums),
where rho is the RDP of one Poisson-subsampled Gaussian step (Mironov, Talwar & Zhang 2019, via Opacus's
``compute_rdp``). sigma_0 is calibrated so that the conversion of B is at most the target epsilon
(:func:`raydp.privacy.calibration.calibrate_sigma` with the RDP accountant). A controller may then spend
less noise at some steps only by adding more at others, at every order.

Per step, rho_t is computed for the step's sigma_eff (every release of the step combined, ERRATA E1/E3):
exactly, per distinct value (cached), never on a grid. The guard (:class:`FilterGuard`) clamps a proposed
sigma to the smallest one for which the spent curve plus the remaining planned steps at that sigma stay
under B at every order (ERRATA E4), and :meth:`FilterGuard.admit` refuses any step that would cross B
(the filter's halting rule, checked right before the release).

:class:`PopulationFilter` is the same filter over every step of a population of runs (PBT members,
including the steps an exploit discards), split into one equal share per member so that who is refused
never depends on the order concurrent members' requests arrive; a member's guard asks it through
``population_admit``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from raydp.errors import ConfigError
from raydp.privacy.accounting.base import check_delta, check_epsilon, check_q
from raydp.privacy.accounting.rdp import DEFAULT_ORDERS, rdp_curve, rdp_epsilon, rdp_vector
from raydp.privacy.calibration import SIGMA_CAP, SigmaEffMap, min_feasible_sigma
from raydp.privacy.guard import BudgetExhausted, FinalCheck, GuardStatus

__all__ = ["FILTER_NAME", "FilterGuard", "PopulationFilter", "RenyiFilter"]

FILTER_NAME = "renyi-filter"
BUDGET_SLACK = 1e-9
_NUDGE = 1e-9
GUARD_RATIO = 1.002


class RenyiFilter:
    """A budget curve ``budget[k]`` at ``orders[k]`` fixed before training, and its (epsilon, delta)."""

    def __init__(self, orders: Sequence[float], budget: Sequence[float], delta: float) -> None:
        self.orders = tuple(float(a) for a in orders)
        self.budget = np.asarray(budget, dtype=np.float64)
        self.delta = check_delta(delta)
        if self.budget.shape != (len(self.orders),) or not np.all(self.budget >= 0):
            raise ConfigError("a Renyi filter needs a non-negative budget at every order")
        self.budget.setflags(write=False)

    @classmethod
    def for_plan(cls, q: float, sigma_eff: float, steps: int, delta: float,
                 orders: Sequence[float] = DEFAULT_ORDERS) -> RenyiFilter:
        """The budget curve of ``steps`` Poisson-subsampled Gaussian steps at (q, sigma_eff)."""
        curve = int(steps) * rdp_vector(check_q(q), float(sigma_eff), orders)
        return cls(orders, curve * (1.0 + BUDGET_SLACK), delta)

    def epsilon(self) -> float:
        """The filter's guarantee: epsilon at ``delta`` of (alpha, B(alpha))-RDP, best order."""
        return rdp_epsilon(self.budget, self.orders, self.delta)

    def step_curve(self, q: float, sigma_eff: float, count: int = 1) -> np.ndarray:
        if math.isinf(sigma_eff) or count == 0:
            return np.zeros(len(self.orders))
        if sigma_eff <= 0.0:
            return np.full(len(self.orders), math.inf)
        return count * rdp_vector(q, sigma_eff, self.orders)

    def fits(self, spent: np.ndarray, q: float, sigma_eff: float, count: int) -> bool:
        return bool(np.all(spent + self.step_curve(q, sigma_eff, count) <= self.budget))

    def load(self, spent: np.ndarray, q: float, sigma_eff: float, count: int) -> float:
        """max over orders of (spent + count steps at sigma_eff) / budget: <= 1 iff they fit."""
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = (spent + self.step_curve(q, sigma_eff, count)) / self.budget
        ratio = np.where(self.budget > 0, ratio, np.where(spent > 0, math.inf, 0.0))
        return float(np.max(ratio))

    def describe(self) -> dict:
        return {"name": FILTER_NAME, "orders": list(self.orders), "budget_rdp": self.budget.tolist(),
                "delta": self.delta, "epsilon": self.epsilon(),
                "theorem": "Renyi filter (Feldman & Zrnic 2021, Thm. 3.1; Lecuyer 2021) at every order; "
                           "RDP -> (epsilon, delta) by Balle et al. 2020, Thm. 21"}


class PopulationFilter:
    """A Renyi filter over a whole population of runs on the same private data (PBT, :mod:`raydp.study.population`).

    Population Based Training runs M members side by side; an exploit discards a member's own steps and
    copies another member's state, but the discarded steps were still run on the private data. Fix the
    population budget curve B_pop(alpha) = M * B(alpha) before training, B the member plan's budget
    (:meth:`RenyiFilter.for_plan`), and split it, also before training, into M equal *shares* of B, one per
    member. A member's step is admitted only while the RDP curve of every step that member has run (its own
    steps an exploit discarded included; a prefix it inherited from a donor is the donor's and charged to the
    donor's share) plus the step stays under its share at every order. The shares sum to B_pop, so the
    population's spent curve never exceeds B_pop, whatever was discarded or copied.

    Why shares and not one common pool: a member's admission depends only on that member's own requests, never
    on how its requests interleave in wall-clock time with the other members' (which follows their step times,
    hence their private Poisson batch sizes). With a common pool the population could be asked for more than
    B_pop after an exploit (a member's own filter restarts from the donor's ledger while its discarded steps
    stay charged) and first-come-first-served then decided WHICH member was refused by timing, and the refusal
    is released (the member's steps, ``stopped_early``, ``steps_refused``). The price: a member cannot use
    budget another member leaves unspent.

    Theorem used: the Renyi filter (Feldman & Zrnic 2021, Thm. 3.1; Lecuyer 2021) applied to the population's
    steps in a canonical order fixed before training: sync interval by sync interval (PBT is synchronous,
    :class:`raydp.study.config.PBTStudySettings`), member by member in index order, each member's steps in its
    own order. Members interact only at sync points (PBT's exploit/explore, post-processing of earlier
    releases), and a member's admission depends only on its own earlier requests, so every step's mechanism
    (q, sigma_eff) AND whether it is admitted (the halting rule) are functions of releases earlier in that
    order; within an interval the members' steps are independent given the releases at its sync point, so
    running them concurrently changes nothing in the releases' joint distribution. The realized RDP sum is at
    most the sum of the shares, B_pop, always; so the population is (alpha, B_pop(alpha))-RDP at every order.

    M * B is also the composition of the M members' budget curves, which the study reports as its
    tuning-aware epsilon (:mod:`raydp.study.results`), so that figure is the population's guarantee.

    Plain Python (numpy): a charge is exact per (q, sigma_eff) value, like :class:`RenyiFilter`. Steps are
    charged when admitted, before they run: a step that is admitted and then never runs (a member stopped
    in between) is over-counted, never under-counted."""

    def __init__(self, orders: Sequence[float], budget: Sequence[float], delta: float, members: int = 1,
                 share: Sequence[float] | None = None) -> None:
        self.filter = RenyiFilter(orders, budget, delta)
        self.orders = self.filter.orders
        self.budget = self.filter.budget
        self.delta = self.filter.delta
        if int(members) != members or members <= 0:
            raise ConfigError(f"a population needs a positive number of members, got {members}")
        self.members = int(members)
        #: every member's share of B_pop (the same for all, fixed before training): members * share <= B_pop
        self.share = RenyiFilter(orders, self.budget / self.members if share is None else share, delta)
        if not np.all(self.members * self.share.budget <= self.budget * (1.0 + 1e-12)):
            raise ConfigError("the members' shares add up to more than the population's budget")
        self.spent_by: dict[str, np.ndarray] = {}  # member -> the RDP curve of every step it has run
        self.admitted: dict[str, int] = {}
        self.refused: dict[str, int] = {}

    @classmethod
    def for_members(cls, member: RenyiFilter, members: int) -> PopulationFilter:
        """B_pop = ``members`` * the member filter's budget curve (every member has the same plan), and each
        member's share is that budget curve."""
        return cls(member.orders, int(members) * member.budget, member.delta, members=members, share=member.budget)

    @property
    def spent(self) -> np.ndarray:
        """The population's spent curve: the sum of the members' (in name order, so no arrival order shows)."""
        total = np.zeros(len(self.orders))
        for name in sorted(self.spent_by):
            total = total + self.spent_by[name]
        return total

    def epsilon(self) -> float:
        """The population's guarantee: epsilon at ``delta`` of (alpha, B_pop(alpha))-RDP, best order."""
        return self.filter.epsilon()

    def _spent_of(self, member: str) -> np.ndarray:
        spent = self.spent_by.get(member)
        if spent is None:
            if len(self.spent_by) >= self.members:
                raise ValueError(f"member {member!r} would be member {len(self.spent_by) + 1} of a population of "
                                 f"{self.members}: it has no share")
            spent = self.spent_by[member] = np.zeros(len(self.orders))
        return spent

    def fits(self, q: float, sigma_eff: float, member: str = "member") -> bool:
        """Whether one more step of ``member`` at (q, sigma_eff) stays under its share (its own steps only)."""
        return self.share.fits(self._spent_of(member), float(q), float(sigma_eff), 1)

    def charge(self, q: float, sigma_eff: float, member: str = "member") -> None:
        """Add one step at (q, sigma_eff) to ``member``'s spent curve (unchecked: :meth:`admit` checks first)."""
        self.spent_by[member] = self._spent_of(member) + self.filter.step_curve(float(q), float(sigma_eff))
        self.admitted[member] = self.admitted.get(member, 0) + 1

    def admit(self, q: float, sigma_eff: float, member: str = "member") -> bool:
        """The filter's halting rule: charge one step and return True iff it fits under the member's share
        (whatever the other members have asked, and in whatever order)."""
        if not self.fits(q, sigma_eff, member):
            self.refused[member] = self.refused.get(member, 0) + 1
            return False
        self.charge(q, sigma_eff, member)
        return True

    def within_budget(self) -> bool:
        return bool(np.all(self.spent <= self.budget)
                    and all(np.all(spent <= self.share.budget) for spent in self.spent_by.values()))

    def describe(self) -> dict:
        return {"name": "population-renyi-filter", "members": self.members, "orders": list(self.orders),
                "budget_rdp": self.budget.tolist(), "share_rdp": self.share.budget.tolist(),
                "spent_rdp": self.spent.tolist(),
                "spent_rdp_by_member": {k: self.spent_by[k].tolist() for k in sorted(self.spent_by)},
                "delta": self.delta, "epsilon": self.epsilon(), "within_budget": self.within_budget(),
                "steps_admitted": dict(sorted(self.admitted.items())),
                "steps_refused": dict(sorted(self.refused.items())),
                "admission": "each member within its own equal share of the budget (fixed before training), so "
                             "who is refused does not depend on the order the members' requests arrive",
                "theorem": "Renyi filter over the population's steps in a canonical order (sync interval, member "
                           "index, step) (Feldman & Zrnic 2021, Thm. 3.1; Lecuyer 2021), budget = members x the "
                           "member plan's budget curve, one equal share per member; RDP -> (epsilon, delta) by "
                           "Balle et al. 2020, Thm. 21"}


class _SpentCurve:
    """The exact RDP sum of a ledger's steps, kept in sync with the append-only ledger."""

    def __init__(self, orders: tuple[float, ...]) -> None:
        self.orders = orders
        self.curve = np.zeros(len(orders))
        self._ledger = None
        self._consumed = 0

    def sync(self, ledger) -> np.ndarray:
        if self._ledger is not ledger or len(ledger) < self._consumed:
            self._ledger, self._consumed, self.curve = ledger, 0, np.zeros(len(self.orders))
        if len(ledger) > self._consumed:
            self.curve = self.curve + rdp_curve(*ledger.arrays(self._consumed), self.orders)
            self._consumed = len(ledger)
        return self.curve


class FilterGuard:
    """Budget guard of an adaptive-sigma run: a :class:`RenyiFilter` plus the planner of E4.

    Same interface as :class:`~raydp.privacy.guard.BudgetGuard` (``clamp``, ``min_sigma``, ``spent``,
    ``status``, ``final_check``, ``admit``), so the DP step does not care which guard it has."""

    name = FILTER_NAME

    def __init__(self, filter: RenyiFilter, *, epsilon_target: float, planned_steps: int, q: float,
                 sigma_eff: SigmaEffMap | None = None, sigma_cap: float = SIGMA_CAP,
                 sigma_hint: float | None = None,
                 population_admit: Callable[[float, float], bool] | None = None) -> None:
        self.filter = filter
        #: PBT: the population filter's admission (:class:`PopulationFilter`), asked after this run's own
        #: filter admits a step; it charges the step when it returns True
        self.population_admit = population_admit
        self.epsilon_target = check_epsilon(epsilon_target)
        self.delta = filter.delta
        self.q = check_q(q)
        if int(planned_steps) != planned_steps or planned_steps <= 0:
            raise ConfigError(f"planned_steps must be a positive integer, got {planned_steps}")
        self.planned_steps = int(planned_steps)
        self.sigma_map = SigmaEffMap.coerce(sigma_eff)
        self.sigma_cap = float(sigma_cap)
        if filter.epsilon() > self.epsilon_target:
            raise ConfigError(f"the filter's budget curve converts to epsilon={filter.epsilon():.4f}, above the "
                              f"target {self.epsilon_target:g}")
        self._spent = _SpentCurve(filter.orders)
        self._hint = None if sigma_hint is None else float(self.sigma_map(sigma_hint))

    @classmethod
    def for_plan(cls, *, epsilon_target: float, delta: float, planned_steps: int, q: float, sigma_0: float,
                 sigma_eff: SigmaEffMap | None = None, **kwargs) -> FilterGuard:
        smap = SigmaEffMap.coerce(sigma_eff)
        flt = RenyiFilter.for_plan(q, smap(sigma_0), planned_steps, delta)
        return cls(flt, epsilon_target=epsilon_target, planned_steps=planned_steps, q=q, sigma_eff=smap,
                   sigma_hint=sigma_0, **kwargs)

    # -- what has been spent -------------------------------------------------------------------------
    def spent_curve(self, ledger) -> np.ndarray:
        return self._spent.sync(ledger)

    def spent(self, ledger) -> float:
        """Epsilon of the steps so far as RDP (a progress figure for controllers; the guarantee is the
        filter's epsilon, fixed before training)."""
        curve = self.spent_curve(ledger)
        return 0.0 if not np.any(curve) else rdp_epsilon(curve, self.filter.orders, self.delta)

    def _remaining(self, ledger, remaining_steps: int | None) -> int:
        if remaining_steps is None:
            return max(self.planned_steps - len(ledger), 0)
        return int(remaining_steps)

    def _exhausted(self, ledger, remaining: int, why: str) -> BudgetExhausted:
        spent = self.spent(ledger)
        return BudgetExhausted(
            f"privacy budget exhausted after {len(ledger)} steps: {why} (Renyi filter, guarantee "
            f"epsilon={self.filter.epsilon():.4f} of {self.epsilon_target:g} at delta={self.delta:g}, "
            f"{remaining} planned steps left); stopping",
            spent=spent, epsilon_target=self.epsilon_target, steps_done=len(ledger), remaining_steps=remaining)

    # -- the planner (ERRATA E4) -----------------------------------------------------------------------
    def _sigma_for(self, s_eff: float) -> float:
        sigma = self.sigma_map.inverse(s_eff, cap=self.sigma_cap)
        return sigma * (1.0 + _NUDGE) if math.isfinite(sigma) else sigma

    def min_sigma(self, ledger, remaining_steps: int | None = None) -> float:
        """Smallest sigma such that the spent curve plus ``remaining_steps`` steps at it fit the budget."""
        remaining = self._remaining(ledger, remaining_steps)
        spent = self.spent_curve(ledger)
        if np.any(spent > self.filter.budget):
            raise self._exhausted(ledger, remaining, "the spent curve is above the filter's budget")
        if remaining == 0:
            return 0.0
        s_max = self.sigma_map(self.sigma_cap)
        found = min_feasible_sigma(lambda s: self.filter.load(spent, self.q, s, remaining), 1.0,
                                   start=self._hint or 1.0, s_max=s_max, ratio=GUARD_RATIO, rtol=0.003)
        if found is None:
            raise self._exhausted(ledger, remaining, f"no sigma up to {self.sigma_cap:g} keeps the remaining "
                                                     "steps under the filter's budget")
        self._hint = found[0]
        return self._sigma_for(found[0])

    def clamp(self, proposed_sigma: float, ledger, remaining_steps: int | None = None) -> tuple[float, bool]:
        proposed = float(proposed_sigma)
        if math.isnan(proposed) or proposed < 0.0:
            raise ConfigError(f"proposed sigma must be >= 0, got {proposed_sigma}")
        remaining = self._remaining(ledger, remaining_steps)
        spent = self.spent_curve(ledger)
        if np.any(spent > self.filter.budget):
            raise self._exhausted(ledger, remaining, "the spent curve is above the filter's budget")
        if remaining == 0 or (proposed > 0 and self.filter.fits(spent, self.q, self.sigma_map(proposed), remaining)):
            return proposed, False
        sigma = self.min_sigma(ledger, remaining)
        return (proposed, False) if sigma <= proposed else (sigma, True)

    def admit(self, ledger, q: float, sigma_eff: float) -> None:
        """The filter's halting rule: raise BudgetExhausted unless one more step at (q, sigma_eff) fits (and,
        in a PBT population, the population filter admits it too)."""
        if not self.filter.fits(self.spent_curve(ledger), q, sigma_eff, 1):
            raise self._exhausted(ledger, self._remaining(ledger, None),
                                  f"a step at sigma_eff={sigma_eff:.4g} would cross the filter's budget")
        if self.population_admit is not None and not self.population_admit(q, sigma_eff):
            raise self._exhausted(ledger, self._remaining(ledger, None),
                                  f"the population's Renyi filter refused a step at sigma_eff={sigma_eff:.4g}")

    def status(self, ledger, remaining_steps: int | None = None) -> GuardStatus:
        remaining = self._remaining(ledger, remaining_steps)
        try:
            s, exhausted = self.min_sigma(ledger, remaining), False
        except BudgetExhausted:
            s, exhausted = None, True
        return GuardStatus(spent=self.spent(ledger), epsilon_target=self.epsilon_target, steps_done=len(ledger),
                           remaining_steps=remaining, min_sigma=s, exhausted=exhausted)

    def final_check(self, ledger) -> FinalCheck:
        """The filter's guarantee (fixed before training), valid iff the spent curve stayed under the budget."""
        spent = self.spent_curve(ledger)
        eps = self.filter.epsilon() if np.all(spent <= self.filter.budget) else math.inf
        return FinalCheck(epsilon=eps, epsilon_target=self.epsilon_target, delta=self.delta, accountant=FILTER_NAME,
                          steps=len(ledger), within_budget=eps <= self.epsilon_target)
