"""The controller's reward: RLDP Eq. 17-20.

Between two decisions the utility changes by du = u_t - u_{t-1} and the ledger by
deps = eps_t - eps_{t-1} (Eq. 17); the reward is the log of the utility gained per unit of privacy
spent, bounded below::

    r_t = max(-R_max, log(1 + max(du / (deps + 1e-6), -0.999)))      (Eq. 18-20)

Its signal is weak: u is the noisy DP loss-sum release and deps is small, a signal-to-noise ratio
near 0.01 per decision. ``reward: public-validation`` (raydp's) is the change of a potential instead,
``r_t = Phi_t - Phi_{t-1}`` with Phi = minus the value-token NLL per record on PUBLIC validation records under the
current model: potential-based shaping (Ng, Harada & Russell 1999) whose episode sum telescopes to the run's
improvement on public validation, the selection metric; public data under the DP model, so it costs no budget.
"""

from __future__ import annotations

import math

RATIO_FLOOR = -0.999
EPS_STABILISER = 1e-6
DEFAULT_R_MAX = 5.0


def reward(utility: float, previous_utility: float, epsilon: float, previous_epsilon: float,
           r_max: float = DEFAULT_R_MAX) -> float:
    """Eq. 20. ``r_max`` > 0 is the lower bound's magnitude (configurable, Alg. 1 line 31)."""
    if not r_max > 0:
        raise ValueError(f"R_max must be > 0, got {r_max}")
    ratio = (utility - previous_utility) / (epsilon - previous_epsilon + EPS_STABILISER)  # Eq. 17-18
    return max(-r_max, math.log1p(max(ratio, RATIO_FLOOR)))  # Eq. 19-20


def potential_reward(potential: float, previous_potential: float) -> float:
    """``Phi_t - Phi_{t-1}`` (the module docstring's public-validation reward)."""
    if not (math.isfinite(potential) and math.isfinite(previous_potential)):
        raise ValueError(f"a potential must be finite, got {potential}, {previous_potential}")
    return float(potential - previous_potential)
