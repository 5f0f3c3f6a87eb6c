"""EWPBA: epoch-weighted privacy budget allocation (EW-FT, Algorithm 1 with ComposePRV' of Algorithm 3).

EWPBA turns a budget (epsilon, delta) into one noise multiplier per epoch, largest first: early epochs
("rapid exploration") get more noise, late epochs ("precision adjustment") less. It has two parts.

Part 1 (Alg. 1 lines 1-12). Bisect a constant sigma in [0.2, 50] (line 2) so that the whole run at that
sigma (``epochs * steps_per_epoch`` Poisson-subsampled Gaussian steps at rate q; ComposePRV, Alg. 2)
costs a stricter budget eps' < eps. The result is the "beginning noise factor" sigma_beg (line 12): it
is larger than the uniform sigma for eps, which is what makes the list below non-uniform.

Part 2 (lines 13-33). Bisect sigma_fir in (0, sigma_beg) (line 13). For each candidate build the list
(lines 16-26, Eq. 9-10, :func:`ewpba_list`)::

    Add_num = 4 * (sigma_beg - sigma_fir) / ((E - 1) * (S + 1))            # Eq. 9, line 16
    list = [sigma_fir]; for epoch_num = 1 .. E-1:                           # lines 17-26
        sigma_new += Add_num      if epoch_num < E/2 - 1                      # Eq. 10, line 21
        sigma_new += S * Add_num  otherwise                                   # Eq. 10, line 23
    reverse(list)                                                           # line 34

and compose it (ComposePRV', Alg. 3: epoch e composes its Com_i = Com/E steps at (q, sigma_e), here
``steps_per_epoch`` steps; the caller passes steps_per_epoch, typically ceil(1/q), instead of the paper's
Com = (|D|/B) * E). If the list's epsilon exceeds eps, sigma_fir is too small (line 29), else too large
(line 31).

Why the bisection of part 2 is well posed. Every element is affine in sigma_fir,
``sigma_e = c_e * sigma_beg + (1 - c_e) * sigma_fir`` with c_e >= 0, and some c_e > 1 (the first epoch's
element *decreases* as sigma_fir grows), so epsilon is not monotone in sigma_fir. But the cost of a
Gaussian step is close to convex in sigma_fir (1/sigma_e^2 of an affine function is convex), it equals
eps(sigma_beg) <= eps' < eps at sigma_fir = sigma_beg and tends to infinity as sigma_fir -> 0 (the last
epoch's noise vanishes), so the level eps is crossed once and bisection finds that crossing.

Corrections to the paper (each is needed for the algorithm to be usable or safe):

1. Line 1 sets eps' = eps - 1, which is <= 0 for eps <= 1 (this project runs eps = 0.5): part 1 would have
   no solution. Here eps' = eps - 1 when eps > 2, else eps / 2. Any eps' < eps serves the purpose stated
   in the paper's text (a sigma_beg larger than the uniform sigma for eps, so the list does not collapse
   onto a uniform one); eps / 2 keeps eps' > 0 and coincides with eps - 1 at eps = 2.
2. Lines 3 and 14 stop when |eps_est - eps| < 1e-4, which can stop on the side ABOVE the budget. Here
   both bisections keep a bracket [lo, hi] with eps(lo) > target >= eps(hi) and stop when
   target - tolerance <= eps(hi) <= target; the larger-sigma end ``hi`` is returned (line 12's sigma_beg
   and the final sigma_fir), so the returned list never exceeds the budget under the accountant used.
   A search that cannot get there (eps' needs sigma > 50, the bracket collapses, ``max_iterations`` is
   reached) raises :class:`~raydp.errors.ConfigError`, as do invalid inputs.
3. E = 1 (Eq. 9 divides by E - 1): there are no two stages; the list is the uniform sigma for eps (part 1
   run at eps itself), sigma_beg is that sigma, eps' = eps and Add_num = 0. E = 2: E/2 - 1 = 0, so
   every step of Eq. 10 adds S * Add_num; that is the paper's formula and is kept.

Accounting. The list depends only on public parameters (eps, delta, q, E, S, steps_per_epoch), so it is
a schedule fixed before training: composing its mechanisms with PLD or PRV is a theorem (mechanisms
chosen in advance; ERRATA E13, no privacy filter needed). The accountant must be an upper bound of this
repo. The paper uses PRV (ComposePRV, Alg. 2-3; ``accountant="prv"`` here, Opacus's PRV upper bound),
but the default is ``"pld"`` (dp_accounting's pessimistic PLD, also an upper bound): it is the project's
enforcing accountant, and it is faster here (measured at eps=2, delta=1e-5, q=16/1440, E=3, 90 steps
per epoch, on a busy 2-core machine: ~0.1 s per constant-sigma and ~0.3 s per 3-epoch composition for
both, 35-37 calls; the whole search takes ~4 s with PLD and 5-7.5 s with PRV, whose single-step
discretisation is slower; PRV's ``eps_upper`` also adds its ``eps_error``, 0.4% of the target, in full,
so its sigmas come out ~0.5% larger). The accountant is built with ``grid=None`` (exact sigmas, no rounding onto
the sigma grid) and its discretisation fixed from the target (``for_target``), so every candidate is
charged the same way. EWPBA fixes the *shape* of the schedule; the project re-calibrates its
scale with the accountant that enforces the budget, using :meth:`EWPBAResult.multipliers` as
``SigmaSchedule(per_epoch=...)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from raydp.errors import ConfigError
from raydp.privacy.accounting import ACCOUNTANTS, Accountant, get_accountant
from raydp.privacy.accounting.base import check_delta, check_epsilon, check_q

__all__ = ["EWPBAResult", "epsilon_prime", "ewpba", "ewpba_list"]

SIGMA_START, SIGMA_END = 0.2, 50.0  # Alg. 1 line 2: part 1's bracket


@dataclass(frozen=True)
class EWPBAResult:
    """The output of :func:`ewpba`: one noise multiplier per epoch, epoch 1 first."""

    sigmas: tuple[float, ...]  # per epoch, epoch 1 first (largest first, after line 34's reversal)
    sigma_beg: float  # line 12: the constant sigma at the stricter budget eps'
    epsilon_prime: float  # eps' of part 1 (correction 1)
    epsilon: float  # epsilon of ``sigmas`` under the accountant used (<= the target)
    add_num: float  # Eq. 9 at the final sigma_fir
    accountant: str

    def multipliers(self) -> tuple[float, ...]:
        """The shape: ``sigmas`` divided by the last (smallest) one, for ``SigmaSchedule(per_epoch=...)``."""
        last = self.sigmas[-1]
        return tuple(s / last for s in self.sigmas[:-1]) + (1.0,)

    def describe(self) -> dict:
        return {"sigmas": list(self.sigmas), "multipliers": list(self.multipliers()),
                "sigma_beg": self.sigma_beg, "epsilon_prime": self.epsilon_prime,
                "epsilon": self.epsilon, "add_num": self.add_num, "accountant": self.accountant}


def epsilon_prime(epsilon: float) -> float:
    """The stricter budget of part 1: line 1's eps - 1 when eps > 2, else eps / 2 (correction 1)."""
    return epsilon - 1.0 if epsilon > 2.0 else epsilon / 2.0


def add_num(sigma_beg: float, sigma_fir: float, epochs: int, step_distance: int) -> float:
    """Eq. 9 (line 16): Add_num = 4 (sigma_beg - sigma_fir) / ((E - 1)(S + 1)); 0 when E = 1."""
    if epochs == 1:
        return 0.0
    return 4.0 * (sigma_beg - sigma_fir) / ((epochs - 1) * (step_distance + 1))


def ewpba_list(sigma_beg: float, sigma_fir: float, epochs: int, step_distance: int) -> tuple[float, ...]:
    """Lines 16-26 and 34 of Algorithm 1 for one sigma_fir: the list, epoch 1 first."""
    _check_shape(epochs, step_distance)
    if not (0.0 < sigma_fir <= sigma_beg and math.isfinite(sigma_beg)):
        raise ConfigError(f"need 0 < sigma_fir <= sigma_beg < inf, got sigma_fir={sigma_fir}, "
                          f"sigma_beg={sigma_beg}")
    add = add_num(sigma_beg, sigma_fir, epochs, step_distance)  # Eq. 9, line 16
    sigma_list = [sigma_fir]  # line 17
    sigma_new = sigma_fir  # line 18
    for epoch_num in range(1, epochs):  # line 19
        if epoch_num < epochs / 2 - 1:  # Eq. 10, line 20
            sigma_new = sigma_new + add  # line 21
        else:
            sigma_new = sigma_new + step_distance * add  # line 23
        sigma_list.append(sigma_new)  # line 25
    return tuple(reversed(sigma_list))  # line 34


def _check_shape(epochs: int, step_distance: int) -> None:
    if int(epochs) != epochs or epochs < 1:
        raise ConfigError(f"epochs must be an integer >= 1, got {epochs}")
    if int(step_distance) != step_distance or step_distance < 1:
        raise ConfigError(f"step_distance must be an integer >= 1, got {step_distance}")


def _bisect(eps_of: Callable[[float], float], lo: float, hi: float, eps_hi: float, target: float,
            tolerance: float, max_iterations: int, what: str) -> tuple[float, float, int]:
    """Lines 3-11 / 14-33 with correction 2. Invariant: eps(lo) > target >= eps(hi) = eps_hi (lo may be an
    open end). Returns (hi, eps(hi), iterations) once target - tolerance <= eps(hi) <= target."""
    iterations = 0
    while not (target - tolerance <= eps_hi <= target):
        if iterations >= max_iterations:
            raise ConfigError(f"EWPBA {what}: no sigma within {tolerance} below epsilon {target} after "
                              f"{max_iterations} iterations (bracket [{lo}, {hi}])")
        mid = (lo + hi) / 2  # line 4 / line 15
        if not lo < mid < hi or hi - lo <= 1e-12 * hi:
            raise ConfigError(f"EWPBA {what}: the bisection collapsed at sigma {hi} (epsilon {eps_hi}) "
                              f"without reaching {target} - {tolerance}; the accountant is not monotone "
                              f"here, or the target needs sigma below {lo}")
        eps_mid = eps_of(mid)  # line 5 / line 27
        if eps_mid > target:  # line 6 / line 28
            lo = mid  # line 7 / line 29
        else:
            hi, eps_hi = mid, eps_mid  # line 9 / line 31
        iterations += 1
    return hi, eps_hi, iterations


def ewpba(epsilon: float, delta: float, q: float, epochs: int, steps_per_epoch: int,
          step_distance: int = 2, accountant: str | Accountant = "pld", tolerance: float = 1e-4,
          max_iterations: int = 200) -> EWPBAResult:
    """Algorithm 1: part 1 (lines 1-12) bisects a constant sigma for eps'; part 2 (lines 13-33) bisects
    sigma_fir in (0, sigma_beg) so the list's composed epsilon (Alg. 3: epoch e composes steps_per_epoch
    steps at (q, sigma_e)) meets epsilon.

    ``accountant``: a name (an exact, ``grid=None`` instance fixed for the target is built) or an
    :class:`Accountant` instance (used as given). It must be an upper bound.
    """
    epsilon, delta, q = check_epsilon(epsilon), check_delta(delta), check_q(q)
    _check_shape(epochs, step_distance)
    if int(steps_per_epoch) != steps_per_epoch or steps_per_epoch < 1:
        raise ConfigError(f"steps_per_epoch must be an integer >= 1, got {steps_per_epoch}")
    if not (tolerance > 0 and math.isfinite(tolerance)):
        raise ConfigError(f"tolerance must be > 0, got {tolerance}")
    if int(max_iterations) != max_iterations or max_iterations < 1:
        raise ConfigError(f"max_iterations must be an integer >= 1, got {max_iterations}")
    epochs, steps_per_epoch, step_distance = int(epochs), int(steps_per_epoch), int(step_distance)
    if not isinstance(accountant, Accountant):
        cls = ACCOUNTANTS.get(str(accountant).lower())
        if cls is None or not cls.is_upper_bound:
            raise ConfigError(f"EWPBA needs an upper-bound accountant (rdp, prv, pld), got {accountant!r}")
        accountant = get_accountant(cls.name, grid=None).for_target(epsilon)  # exact sigmas, fixed mesh
    acc = accountant
    if not acc.is_upper_bound:
        raise ConfigError(f"EWPBA needs an upper-bound accountant; {acc.name!r} is an approximation")

    def eps_of_list(sigmas: tuple[float, ...]) -> float:
        """ComposePRV' (Alg. 3): epoch e composes Com_i = steps_per_epoch steps at (q, sigma_e)."""
        return acc.epsilon([(q, s, steps_per_epoch) for s in sigmas], delta)

    # Part 1, lines 1-12: a constant sigma for eps' (ComposePRV, Alg. 2, is eps_of_list of a constant list).
    eps_p = epsilon if epochs == 1 else epsilon_prime(epsilon)  # line 1 (corrections 1 and 3)
    eps_end = eps_of_list((SIGMA_END,) * epochs)
    if eps_end > eps_p:
        raise ConfigError(f"EWPBA: epsilon {eps_p} is unreachable with sigma <= {SIGMA_END} (Alg. 1 line 2): "
                          f"{epochs * steps_per_epoch} steps at q={q} cost {eps_end:.4g} at sigma {SIGMA_END}")
    sigma_beg, eps_beg, _ = _bisect(lambda s: eps_of_list((s,) * epochs), SIGMA_START, SIGMA_END, eps_end,
                                    eps_p, tolerance, max_iterations, "part 1 (sigma_beg)")  # line 12
    if epochs == 1:  # correction 3: the uniform sigma for eps, no second part
        return EWPBAResult((sigma_beg,), sigma_beg, eps_p, eps_beg, 0.0, acc.name)

    # Part 2, lines 13-33: sigma_fir in (0, sigma_beg); at sigma_beg the list is constant, eps_beg <= eps'.
    sigma_fir, eps_fir, _ = _bisect(
        lambda s: eps_of_list(ewpba_list(sigma_beg, s, epochs, step_distance)), 0.0, sigma_beg, eps_beg,
        epsilon, tolerance, max_iterations, "part 2 (sigma_fir)")
    sigmas = ewpba_list(sigma_beg, sigma_fir, epochs, step_distance)  # lines 16-26 and 34
    return EWPBAResult(sigmas, sigma_beg, eps_p, eps_fir,
                       add_num(sigma_beg, sigma_fir, epochs, step_distance), acc.name)
