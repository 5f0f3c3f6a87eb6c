"""From a raw SAC action to the privacy dials: RLDP Eq. 10-15.

The action is ``a_t = (a_1..a_n, a_{n+1})`` in R^{n+1}, drawn from the actor's unsquashed Gaussian
(Eq. 24); a_{1:n} are log-clip proposals, a_{n+1} a log-noise proposal:

* Eq. 10: ``C_i = min(exp(a_i), 1.0)``;
* Eq. 11: ``delta_sigma = tanh(a_{n+1})``, ``step_t = delta_max (1 - eps_t / eps_max)``, delta_max = 0.1;
* Eq. 12: ``dlog_sigma = delta_sigma * step_t``;
* Eq. 13: ``log sigma_prop = clamp(log sigma_t + dlog_sigma, log(0.5 sigma_0), log(2 sigma_0))``;
* Eq. 14: ``log sigma_{t+1} = beta log sigma_t + (1 - beta) log sigma_prop``, beta = 0.8;
* Eq. 15: ``sigma_{t+1} = exp(log sigma_{t+1})``.

``relative`` decoding (raydp's; ``settings.action_decoding: relative``) replaces Eq. 10 only:
``C_i = r_i * exp(clamp(a_i, log RELATIVE_BOUNDS))``, where r_i is pair i's public reference scale (the
median per-sample norm of pair i on PUBLIC records under the initial model, measured by the public
probe). A zero action then means "clip at the public reference" rather than Eq. 10's "C_i = 1", and
the same action means the same thing on a model whose gradients are ten times smaller. The multiplier
is bounded to [1e-3, 10] (a Gaussian action far in its tail must not clip to nothing or not at all).
Eq. 11-15 (sigma) are unchanged.

``relative-capped`` (raydp's) is relative decoding with the multiplier bounded to [1e-3, 1]: a clip
never exceeds the pair's public reference norm. Why: with proportional noise the noise on pair i grows with
C_i (std sigma sqrt(n) C_i, ERRATA E1) while its signal stops growing once C_i passes the per-sample norms,
so a clip far above them only adds noise. The frontier measured what the wider bound allows: a policy
that sat on its bounds put a clip above 1 (10 r_i) on 31-63 of a run's 93 controlled steps, and the best
hand-set clips (0.01) lie below every public reference (0.016-0.16).

``residual`` (raydp's) decodes the clips as a correction of a learned clip schedule
(:mod:`raydp.strategies.clipschedule`): ``C_i(t) = S_i(t) * exp(rho * a_i)`` with ``a_i`` in [-1, 1] from a
tanh-squashed actor (:class:`raydp.control.modules.MaskedSquashedGaussian`) and ``rho`` = ``residual_range``. The
zero action is the schedule, which the actor starts on; the bound holds by construction, so exploration cannot put
clips on a bound the way an unsquashed Gaussian with log std up to 2 did (45-85% of decided clips). The factor
applies from the decision until the next one; the schedule moves with every step. The noise action is unused
(noise_control: false).

Two additions, both documented: ``clip_floor`` (default 1e-3) keeps C_i away from 0 when an action
is far out in the Gaussian's tail (Eq. 10 alone allows C_i -> 0, which clips every gradient to
nothing), and step_t is floored at 0 (the ledger may sit a hair above eps_max under another
accountant). The sigma decoded here is only a proposal: the budget guard (ERRATA E4) may raise it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

DELTA_MAX = 0.1
SIGMA_MOMENTUM = 0.8
SIGMA_BOUNDS = (0.5, 2.0)  # multiples of sigma_0 (Eq. 13)
CLIP_MAX = 1.0
CLIP_FLOOR = 1e-3
RELATIVE_BOUNDS = (1e-3, 10.0)  # multiplier of the public reference scale (relative decoding)
CAPPED_BOUNDS = (1e-3, 1.0)  # relative-capped: never above the public reference
MULTIPLIER_BOUNDS = {"relative": RELATIVE_BOUNDS, "relative-capped": CAPPED_BOUNDS}


@dataclass(frozen=True)
class DecodedAction:
    clip: tuple[float, ...]
    sigma: float
    sigma_proposed: float  # Eq. 13, before momentum
    step_size: float  # Eq. 11


def decode_clips(a_clip, clip_floor: float = CLIP_FLOOR) -> np.ndarray:
    """Eq. 10: C_i = min(exp(a_i), 1.0), floored at ``clip_floor``."""
    a = np.asarray(a_clip, dtype=np.float64)
    return np.clip(np.exp(np.minimum(a, 0.0)), clip_floor, CLIP_MAX)


def decode_clips_relative(a_clip, reference, clip_floor: float = CLIP_FLOOR,
                          bounds: tuple[float, float] = RELATIVE_BOUNDS) -> np.ndarray:
    """Relative decoding: C_i = r_i * exp(a_i), the multiplier exp(a_i) bounded to ``bounds``
    (RELATIVE_BOUNDS; CAPPED_BOUNDS for relative-capped), the result floored at ``clip_floor``;
    ``reference`` holds r_i > 0 (one per pair)."""
    a = np.asarray(a_clip, dtype=np.float64)
    r = np.asarray(reference, dtype=np.float64)
    if r.shape != a.shape or not np.all(np.isfinite(r) & (r > 0)):
        raise ValueError(f"relative decoding needs one positive reference scale per clip action, got {r}")
    lo, hi = (math.log(b) for b in bounds)
    return np.maximum(r * np.exp(np.clip(a, lo, hi)), clip_floor)


def decode_residual(a_clip, residual_range: float) -> np.ndarray:
    """Residual decoding's factor per pair, ``exp(residual_range * a_i)`` with ``a_i`` clamped to [-1, 1] (a
    squashed action is already there; the clamp guards a policy that is not)."""
    a = np.clip(np.asarray(a_clip, dtype=np.float64), -1.0, 1.0)
    if not np.all(np.isfinite(a)) or not residual_range > 0:
        raise ValueError(f"residual decoding needs finite actions and residual_range > 0, got {a}, {residual_range}")
    return np.exp(residual_range * a)


def decode_sigma(a_sigma: float, sigma_t: float, sigma_0: float, epsilon_t: float, epsilon_max: float,
                 delta_max: float = DELTA_MAX, momentum: float = SIGMA_MOMENTUM) -> tuple[float, float, float]:
    """Eq. 11-15: (sigma_{t+1}, sigma_prop, step_t) from the noise action and the ledger's epsilon."""
    if not (sigma_t > 0 and sigma_0 > 0 and epsilon_max > 0):
        raise ValueError("sigma_t, sigma_0 and epsilon_max must be > 0")
    step = delta_max * max(0.0, 1.0 - epsilon_t / epsilon_max)  # Eq. 11
    dlog = math.tanh(float(a_sigma)) * step  # Eq. 11-12
    lo, hi = math.log(SIGMA_BOUNDS[0] * sigma_0), math.log(SIGMA_BOUNDS[1] * sigma_0)
    log_prop = min(max(math.log(sigma_t) + dlog, lo), hi)  # Eq. 13
    log_next = momentum * math.log(sigma_t) + (1.0 - momentum) * log_prop  # Eq. 14
    return math.exp(log_next), math.exp(log_prop), step  # Eq. 15


def decode_action(action, sigma_t: float, sigma_0: float, epsilon_t: float, epsilon_max: float,
                  clip_floor: float = CLIP_FLOOR, reference=None,
                  bounds: tuple[float, float] = RELATIVE_BOUNDS) -> DecodedAction:
    """The full Eq. 10-15 map for an action of length n + 1 (the last entry is the noise action);
    with ``reference`` (one public scale per pair), the clips are decoded relatively, the multiplier within
    ``bounds`` (module docstring)."""
    a = np.asarray(action, dtype=np.float64).ravel()
    if a.size < 2 or not np.all(np.isfinite(a)):
        raise ValueError(f"an action needs n >= 1 finite clip entries and one noise entry, got {a}")
    clips = decode_clips(a[:-1], clip_floor) if reference is None else \
        decode_clips_relative(a[:-1], reference, clip_floor, bounds)
    sigma, prop, step = decode_sigma(a[-1], sigma_t, sigma_0, epsilon_t, epsilon_max)
    return DecodedAction(clip=tuple(float(c) for c in clips), sigma=sigma, sigma_proposed=prop, step_size=step)
