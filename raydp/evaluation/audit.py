"""Empirical privacy auditing: statistically valid LOWER bounds on epsilon from audit-canary scores.

Setting. The auditor inserts ``m`` audit canaries into the training set, each one included by an
independent fair coin, trains once with the (epsilon, delta)-DP mechanism, and scores every canary
(higher score = "looks included"). From ``(scores, included)`` this module computes two lower bounds
on the epsilon of the training mechanism, at a given ``delta`` and ``confidence``, to report beside the
claimed epsilon. Each holds with probability >= ``confidence`` if the mechanism really is
(epsilon, delta)-DP; a bound above the claimed epsilon is evidence the claim (or its implementation)
is wrong. A bound well below the claim proves nothing: these are lower bounds, not estimates.

1. :func:`epsilon_one_run`: Steinke, Nasr, Jagielski 2023, "Privacy Auditing with One (1) Training
   Run" (NeurIPS 2023, arXiv:2305.08846). The auditor plays the guessing game of their Algorithm 1:
   it guesses "included" for the ``k_plus`` highest scores and "excluded" for the ``k_minus`` lowest,
   abstains on the rest, and counts ``v`` correct guesses out of ``r = k_plus + k_minus``. Their
   Theorem 5.2 bounds the tail of ``v`` under any (epsilon, delta)-DP mechanism; the bound returned is
   the largest epsilon whose p-value is still <= 1 - confidence. This is the bound with a theorem for a
   single training run.

   Choice of ``(k_plus, k_minus)``: a small grid fixed in advance from ``m`` alone (never from the
   labels or the scores), with a Bonferroni correction: every grid entry is tested at level
   ``(1 - confidence) / G`` where ``G`` is the number of distinct entries, and the largest bound over
   the grid is reported (valid by the union bound). The grid (:func:`one_run_guess_grid`) is, with
   ``k = max(1, floor(m * f / 100))`` for ``f`` in ``(1, 2, 5, 10, 20, 40)`` (percent of ``m``):
   ``(k, 0)`` (one-sided: only "included" guesses, best when only some included canaries are
   memorised) and ``(k, k)`` (symmetric: both tails, best when the score distributions are shifted
   copies), duplicates removed, in that order. For m = 1000 that is k in {10, 20, 50, 100, 200, 400},
   r from 10 to 800, G = 12.

2. :func:`epsilon_clopper_pearson`: the conventional hypothesis-testing estimator (Jagielski et al.
   2020; Nasr et al. 2021, arXiv:2101.04535; the test characterisation of DP of Kairouz, Oh,
   Viswanath 2015, Thm 2.1): for a threshold t, TPR = fraction of included canaries with score > t and
   FPR = fraction of excluded ones with score > t; any (eps, delta)-DP mechanism has
   TPR <= e^eps FPR + delta and TNR <= e^eps FNR + delta, so with one-sided Clopper-Pearson bounds
   TPR >= TPR_lower and FPR <= FPR_upper (each at level (1 - confidence)/2, split further below),
   eps >= log((TPR_lower - delta) / FPR_upper) and eps >= log((TNR_lower - delta) / FNR_upper), where
   TNR_lower = 1 - FPR_upper and FNR_upper = 1 - TPR_lower (the same two confidence events serve both
   directions, so the reverse direction needs no extra correction).

   Threshold search: Bonferroni over all ``m + 1`` cut positions of the sorted scores (every threshold
   that can change a count), i.e. each one-sided interval at level ``(1 - confidence) / (2 (m + 1))``;
   the count ``m + 1`` is fixed by ``m`` and not by the data. (The thresholds are the observed scores;
   this is still valid because the intervals depend on t only through the counts, and for each count
   value c the event "some threshold with count c violates its interval" is contained in the event
   that one fixed, population-quantile threshold does, so at most ``n_in + n_out = m`` events need
   covering.)

   Caveat: in a one-run audit the canaries are not independent training runs: they share one model,
   so the TPR/FPR counts are not independent Bernoulli trials of one mechanism run and the
   Clopper-Pearson bound has no theorem behind it here. It is the conventional estimator applied
   across canaries, reported for comparison; the one-run bound is the one that is valid for a single
   run. :func:`audit_scores` reports both.

Ties. Neither estimator lets ties in the scores leak the labels. The one-run auditor never splits a
group of equal scores: if a tie group straddles the ``k_plus`` (or ``k_minus``) cut it abstains on the
whole group. Abstaining keeps the bound valid with ``r = k_plus + k_minus``: replacing each abstention
by an independent fair-coin guess gives an auditor with exactly ``r`` guesses (a post-processing of the
same output, so Theorem 5.2 applies to it) whose number correct is >= ``v``, the number correct
among the guesses actually made; hence P[v >= x] is at most the Theorem 5.2 tail at x. The rule
uses the score values only, never the labels or the order in which canaries are listed.
Clopper-Pearson thresholds are cut positions between distinct score values, which never split ties.

``m`` in the delta term of Theorem 5.2 is the total number of canaries (not ``r``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.optimize
import scipy.special
import scipy.stats

from raydp.errors import ConfigError

__all__ = [
    "AuditResult",
    "audit_scores",
    "epsilon_clopper_pearson",
    "epsilon_one_run",
    "one_run_guess_grid",
    "one_run_p_value",
]

#: Guess counts per side, in percent of m (see the module docstring).
ONE_RUN_GUESS_PERCENTS: tuple[int, ...] = (1, 2, 5, 10, 20, 40)


@dataclass(frozen=True)
class AuditResult:
    m: int                          # canaries scored
    n_included: int
    delta: float
    confidence: float
    epsilon_one_run: float          # Steinke et al. 2023 lower bound (0.0 when nothing can be claimed)
    one_run_guesses: int            # r = k_plus + k_minus of the grid entry reported
    one_run_correct: int            # v
    epsilon_clopper_pearson: float  # lower bound (0.0 when nothing can be claimed)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: plain ``int`` and ``float`` values."""
        return {
            "m": int(self.m),
            "n_included": int(self.n_included),
            "delta": float(self.delta),
            "confidence": float(self.confidence),
            "epsilon_one_run": float(self.epsilon_one_run),
            "one_run_guesses": int(self.one_run_guesses),
            "one_run_correct": int(self.one_run_correct),
            "epsilon_clopper_pearson": float(self.epsilon_clopper_pearson),
        }


# ----------------------------------------------------------------------------------------- input


def _is_real(x: Any) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def _validate(scores: Any, included: Any, delta: Any, confidence: Any) -> tuple[np.ndarray, np.ndarray]:
    try:
        s = np.asarray(scores, dtype=np.float64)
    except (TypeError, ValueError):
        raise ConfigError("audit scores must be a 1-D array of finite numbers") from None
    inc = np.asarray(included)
    if s.ndim != 1 or inc.ndim != 1:
        raise ConfigError(f"audit scores and inclusion bits must be 1-D, got shapes {s.shape}, {inc.shape}")
    if s.shape != inc.shape:
        raise ConfigError(f"audit scores ({s.size}) and inclusion bits ({inc.size}) differ in length")
    if not np.all(np.isfinite(s)):
        raise ConfigError("audit scores must be finite (found NaN or inf)")
    if inc.dtype != np.bool_:
        if inc.size and not (np.issubdtype(inc.dtype, np.number) and np.all((inc == 0) | (inc == 1))):
            raise ConfigError("inclusion bits must be booleans (or 0/1)")
        inc = inc.astype(bool)
    n_in = int(inc.sum())
    if n_in == 0 or n_in == inc.size:
        raise ConfigError(
            f"an audit needs both included and excluded canaries, got {n_in} included of {inc.size}"
        )
    if not _is_real(delta) or not 0 <= delta < 1:
        raise ConfigError(f"audit delta must be in [0, 1), got {delta!r}")
    if not _is_real(confidence) or not 0 < confidence < 1:
        raise ConfigError(f"audit confidence must be in (0, 1), got {confidence!r}")
    return s, inc


# ------------------------------------------------------------------------------------ one-run


def one_run_p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """Upper bound on P[>= v of r guesses correct] under any (eps, delta)-DP mechanism (m canaries).

    Steinke, Nasr, Jagielski 2023, Theorem 5.2: with f(v) = P[Binomial(r, e^eps/(1+e^eps)) >= v],
    P[W >= v] <= f(v) + 2 m delta max_{i=1..v} (f(v-i) - f(v)) / i. For delta = 0 this is
    Theorem 3.1: W is stochastically dominated by Binomial(r, e^eps/(1+e^eps)). The max over i > v
    need not be taken: there f(v-i) = 1 and (1 - f(v))/i is largest at i = v. The numerator
    f(v-i) - f(v) = P[v-i <= Binomial < v] is summed from the pmf, as in the paper's own code.
    """
    if v <= 0:
        return 1.0
    q = float(scipy.special.expit(eps))  # e^eps / (1 + e^eps), accuracy of eps-DP randomized response
    beta = float(scipy.stats.binom.sf(v - 1, r, q))  # f(v) = P[Binomial(r, q) >= v]
    if delta == 0:
        return min(beta, 1.0)
    i = np.arange(1, v + 1)
    window = np.cumsum(scipy.stats.binom.pmf(v - i, r, q))  # P[v-i <= Binomial(r, q) <= v-1]
    alpha = float(np.max(window / i))
    return min(beta + alpha * delta * 2 * m, 1.0)


def _one_run_bound(m: int, r: int, v: int, significance: float, delta: float) -> float:
    """Largest eps >= 0 with one_run_p_value(eps) <= significance (0.0 if even eps = 0 is not rejected).

    The p-value is nondecreasing in eps (it is for delta = 0; for delta > 0 checked numerically over
    m <= 3000 and delta in [1e-8, 0.03]), so this is the smallest eps the test cannot reject, found as
    in the paper (bracket by doubling, then solve).
    """
    def objective(eps: float) -> float:  # > 0 while the (eps, delta) claim is rejected
        return significance - one_run_p_value(m, r, v, eps, delta)

    if objective(0.0) <= 0:
        return 0.0
    lo, hi = 0.0, 1.0
    while objective(hi) > 0:  # expit saturates at 1.0 by eps ~ 40, where p = 1 > significance
        lo, hi = hi, 2.0 * hi
    return float(scipy.optimize.brentq(objective, lo, hi, xtol=1e-10, rtol=1e-12))


def one_run_guess_grid(m: int) -> list[tuple[int, int]]:
    """The fixed (k_plus, k_minus) grid searched (with Bonferroni) for ``m`` canaries; see module doc."""
    grid: list[tuple[int, int]] = []
    for shape in ("one-sided", "symmetric"):
        for pct in ONE_RUN_GUESS_PERCENTS:
            k = max(1, m * pct // 100)
            entry = (k, 0) if shape == "one-sided" else (k, k)
            if sum(entry) <= m and entry not in grid:
                grid.append(entry)
    return grid


def _one_run_correct(scores: np.ndarray, included: np.ndarray, k_plus: int, k_minus: int) -> int:
    """Correct guesses of the Algorithm 1 auditor; tie groups straddling a cut are abstained on."""
    ordered = np.sort(scores)
    m = scores.size
    at_least = m - np.searchsorted(ordered, scores, side="left")  # canaries scoring >= this one
    at_most = np.searchsorted(ordered, scores, side="right")  # canaries scoring <= this one
    guess_in = at_least <= k_plus  # whole tie group fits among the k_plus highest
    guess_out = at_most <= k_minus  # disjoint from guess_in when k_plus + k_minus <= m
    return int(np.sum(guess_in & included) + np.sum(guess_out & ~included))


def _epsilon_one_run(
    scores: np.ndarray, included: np.ndarray, delta: float, confidence: float
) -> tuple[float, int, int]:
    m = scores.size
    grid = one_run_guess_grid(m)
    significance = (1.0 - confidence) / len(grid)  # Bonferroni across the grid
    entries = [(kp + km, _one_run_correct(scores, included, kp, km)) for kp, km in grid]
    p_at_zero = [one_run_p_value(m, r, v, 0.0, delta) for r, v in entries]
    best = int(np.argmin(p_at_zero))  # reported (r, v) when no entry gives a positive bound
    best_eps = 0.0
    for j, (r, v) in enumerate(entries):
        # An entry can only beat best_eps if it still rejects there (cheap check first).
        if one_run_p_value(m, r, v, best_eps, delta) > significance:
            continue
        eps = _one_run_bound(m, r, v, significance, delta)
        if eps > best_eps:
            best_eps, best = eps, j
    r, v = entries[best]
    return best_eps, r, v


def epsilon_one_run(scores, included, *, delta: float, confidence: float = 0.95) -> tuple[float, int, int]:
    """(eps lower bound, guesses, correct): the Steinke-Nasr-Jagielski 2023 one-run bound (Thm 5.2).

    Valid for a single training run with each canary included by an independent fair coin. The
    largest bound over the fixed (k_plus, k_minus) grid of :func:`one_run_guess_grid`, each entry
    tested at level (1 - confidence) / G (Bonferroni); ``guesses`` and ``correct`` are r and v of the
    entry reported (if no entry gives a positive bound: the one with the smallest p-value at eps = 0).
    Ties are never split (see module docstring). Raises ConfigError on bad input.
    """
    s, inc = _validate(scores, included, delta, confidence)
    return _epsilon_one_run(s, inc, float(delta), float(confidence))


# --------------------------------------------------------------------------- Clopper-Pearson


def _cp_upper(k: np.ndarray, n: int, significance: float) -> np.ndarray:
    """One-sided Clopper-Pearson (1934) upper bound p_u with P[Binomial(n, p_u) <= k] = significance."""
    k = np.asarray(k)
    return np.where(k < n, scipy.stats.beta.ppf(1.0 - significance, k + 1, np.maximum(n - k, 1)), 1.0)


def _epsilon_clopper_pearson(
    scores: np.ndarray, included: np.ndarray, delta: float, confidence: float
) -> float:
    m = scores.size
    n_in = int(included.sum())
    n_out = m - n_in
    # Cut positions: "positive" = score > t, for t = -inf and every distinct score (the last one makes
    # nothing positive). Bonferroni over the m + 1 possible cuts and over the two intervals.
    level = (1.0 - confidence) / (2 * (m + 1))
    cuts = np.unique(scores)
    fn = np.concatenate(([0], np.searchsorted(np.sort(scores[included]), cuts, side="right")))
    tn = np.concatenate(([0], np.searchsorted(np.sort(scores[~included]), cuts, side="right")))
    tpr_lower = 1.0 - _cp_upper(fn, n_in, level)  # TPR >= TPR_lower  <=>  FNR <= 1 - TPR_lower
    fpr_upper = _cp_upper(n_out - tn, n_out, level)  # FPR <= FPR_upper
    tnr_lower = 1.0 - fpr_upper
    fnr_upper = 1.0 - tpr_lower

    def best(good_lower: np.ndarray, bad_upper: np.ndarray) -> float:
        # (eps, delta)-DP: P[test says in | in] <= e^eps P[test says in | out] + delta (Kairouz et al.
        # 2015, Thm 2.1), so eps >= log((good - delta) / bad) wherever good > delta.
        ok = (good_lower > delta) & (bad_upper > 0)
        if not np.any(ok):
            return 0.0
        return float(np.max(np.log(good_lower[ok] - delta) - np.log(bad_upper[ok])))

    return max(0.0, best(tpr_lower, fpr_upper), best(tnr_lower, fnr_upper))


def epsilon_clopper_pearson(scores, included, *, delta: float, confidence: float = 0.95) -> float:
    """Clopper-Pearson lower bound on eps, maximised over all thresholds with a Bonferroni correction.

    eps >= log((TPR_lower - delta) / FPR_upper) and the mirror log((TNR_lower - delta) / FNR_upper),
    each one-sided interval at level (1 - confidence) / (2 (m + 1)) (Bonferroni over the m + 1 cut
    positions and the two intervals); 0.0 when nothing can be claimed.

    In a one-run audit the canaries are not independent training runs (they share one trained model),
    so this is the conventional multi-run estimator applied across canaries, with no theorem for a
    single run; the one-run bound (:func:`epsilon_one_run`) is the one with a theorem. Report both.
    Raises ConfigError on bad input.
    """
    s, inc = _validate(scores, included, delta, confidence)
    return _epsilon_clopper_pearson(s, inc, float(delta), float(confidence))


# --------------------------------------------------------------------------------------- both


def audit_scores(scores, included, *, delta: float, confidence: float = 0.95) -> AuditResult:
    """Both lower bounds for one set of canary scores; see the module docstring."""
    s, inc = _validate(scores, included, delta, confidence)
    eps_one, r, v = _epsilon_one_run(s, inc, float(delta), float(confidence))
    eps_cp = _epsilon_clopper_pearson(s, inc, float(delta), float(confidence))
    return AuditResult(
        m=int(s.size),
        n_included=int(inc.sum()),
        delta=float(delta),
        confidence=float(confidence),
        epsilon_one_run=float(eps_one),
        one_run_guesses=int(r),
        one_run_correct=int(v),
        epsilon_clopper_pearson=float(eps_cp),
    )

