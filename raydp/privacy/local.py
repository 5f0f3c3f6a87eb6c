"""Accounting of forward-pass local DP on hidden embeddings (EW-FT, DP-Forward), ERRATA E8/E11/E12.

The mechanism (EW-FT Sec. 5.3, Eq. 11): each training record's hidden embedding (after a chosen block,
optionally through an autoencoder to dimension d) is normalised/clipped to Frobenius norm C, so that any
two inputs are at distance <= 2C (replace-one sensitivity: in local DP any two inputs of one user are
neighbours), and gets Gaussian noise of std ``sigma_e * 2C`` in epoch e. ``sigma_e`` is therefore the
noise multiplier relative to the sensitivity, and one release is a Gaussian mechanism with
``mu_e = sensitivity / std = 1 / sigma_e``. The labels may be released once per record per run by
k-ary randomized response (pure ``epsilon_label``-DP), reused every epoch (post-processing), or not at
all protected (``epsilon_label=None``; the accounting then carries a label saying so).

No amplification by subsampling (ERRATA E8): the party receiving the noisy embeddings knows whose they
are. One record's cost is the composition of its per-epoch releases and its label release; a unit
(patient) with at most ``k_max`` records (a public cap enforced by the data pipeline, ERRATA E11) costs
``k_max`` times that, composed.

Accounting.

* Gaussian part, exact: a composition of Gaussian mechanisms with ``mu_i = 1/sigma_i`` is exactly a
  Gaussian mechanism with ``mu = sqrt(sum_i mu_i^2)`` (Dong, Roth & Su 2019/2022, "Gaussian
  Differential Privacy", Corollary 3.3; an identity, not the CLT). Its exact (eps, delta) curve is that
  of the analytic Gaussian mechanism (Balle & Wang 2018, "Improving the Gaussian mechanism", Thm 8;
  equivalently GDP Cor. 2.13):

      delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2),

  inverted with ``brentq`` in log space (``log_ndtr``).
* With labels: the composed Gaussian and ``k_max`` k-ary randomized responses are composed with
  ``dp_accounting``'s pessimistic privacy loss distributions (Meiser & Mohammadi 2018; Koskela et al.
  2020; Doroshenko et al. 2022, "Connect the dots"): an upper bound. It is capped by basic composition
  (Dwork & Roth 2014, Thm 3.16): ``eps_gauss(delta) + k_max * epsilon_label`` at the same delta, also
  an upper bound; the reported epsilon is the smaller of the two.

k-ary randomized response (Warner 1965; Kairouz, Oh & Viswanath 2014/2016): keep the true label with
probability ``e^eps / (e^eps + k - 1)``, else output each other class with probability
``1 / (e^eps + k - 1)``: pure ``eps``-DP under replace-one. In dp_accounting's parametrisation
(``from_randomized_response``: with probability ``p`` output a uniformly random bucket out of all k,
the true one included) this is ``p = k / (e^eps + k - 1)``.

:func:`paper_epsilon` is the paper's figure (Poisson subsampling at ``q = B/|D|``): NOT a guarantee for
the local mechanism (ERRATA E8), reported beside ours for comparison only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from scipy import optimize, special

from raydp.errors import ConfigError

__all__ = [
    "LABELS_UNPROTECTED",
    "PAPER_FIGURE_LABEL",
    "LocalPlan",
    "calibrate_local_scale",
    "gaussian_delta",
    "gaussian_epsilon",
    "paper_epsilon",
    "randomized_response",
    "randomized_response_probabilities",
]

LABELS_UNPROTECTED = ("labels unprotected: epsilon covers the hidden-embedding releases only; the class "
                      "labels are released without differential privacy")
PAPER_FIGURE_LABEL = ("paper figure: Poisson-subsampled accounting at q = B/|D|; NOT a guarantee for the "
                      "local mechanism, whose receiver knows whose embeddings it gets (ERRATA E8)")

CITATIONS = {
    "mechanism": "EW-FT Sec. 5.3 Eq. 11 (normalise/clip to C, sensitivity 2C, Gaussian noise)",
    "composition": "Dong, Roth & Su, Gaussian Differential Privacy (2019/2022), Corollary 3.3",
    "gaussian_curve": "Balle & Wang, Improving the Gaussian Mechanism (ICML 2018), Theorem 8",
    "randomized_response": "Kairouz, Oh & Viswanath, Extremal Mechanisms for Local DP (2014/2016): k-ary RR",
    "label_composition": "dp_accounting pessimistic PLD (Meiser & Mohammadi 2018; Doroshenko et al. 2022), "
                         "capped by basic composition (Dwork & Roth 2014, Thm 3.16)",
    "no_amplification": "ERRATA E8",
    "unit": "ERRATA E11",
}

# PLD discretisation for the label composition: interval relative to the expected epsilon.
_RELATIVE_INTERVAL = 1e-4
_MIN_INTERVAL = 1e-5
_MAX_INTERVAL = 1e-3
# Calibration precision on the scale: hi/lo <= 1 + 1e-3 (0.1%).
_SCALE_RTOL = 1e-3


# --------------------------------------------------------------------------------------------------
# validation

def _check_delta(delta: float) -> float:
    try:
        delta = float(delta)
    except (TypeError, ValueError):
        raise ConfigError(f"delta must be a number in (0, 1), got {delta!r}") from None
    if not (0.0 < delta < 1.0):
        raise ConfigError(f"delta must be in (0, 1), got {delta}")
    return delta


def _check_epsilon(epsilon: float, name: str = "epsilon") -> float:
    try:
        epsilon = float(epsilon)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be a number > 0, got {epsilon!r}") from None
    if not (epsilon > 0.0 and math.isfinite(epsilon)):
        raise ConfigError(f"{name} must be > 0 and finite, got {epsilon}")
    return epsilon


def _check_int(value, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if int(value) < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value}")
    return int(value)


def _check_positive_list(values, name: str) -> tuple[float, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray)):
        raise ConfigError(f"{name} must be a non-empty sequence of numbers > 0, got {values!r}")
    out = []
    for v in values:
        try:
            f = float(v)
        except (TypeError, ValueError):
            raise ConfigError(f"{name} must contain numbers > 0, got {v!r}") from None
        if not (f > 0.0 and math.isfinite(f)):
            raise ConfigError(f"{name} must contain finite numbers > 0, got {v}")
        out.append(f)
    if not out:
        raise ConfigError(f"{name} must not be empty")
    return tuple(out)


# --------------------------------------------------------------------------------------------------
# the Gaussian part: exact

def gaussian_delta(epsilon: float, mu: float) -> float:
    """delta(eps) of a Gaussian mechanism with sensitivity/std = mu (Balle & Wang 2018, Thm 8):
    Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2), computed as e^a (1 - e^(b - a)) with a, b the logs
    of the two terms (``log_ndtr``), so large eps neither overflows nor cancels catastrophically."""
    if mu <= 0.0:
        return 0.0
    a = float(special.log_ndtr(-epsilon / mu + mu / 2.0))
    b = epsilon + float(special.log_ndtr(-epsilon / mu - mu / 2.0))
    if b >= a:
        return 0.0
    return math.exp(a) * -math.expm1(b - a)


def gaussian_epsilon(mu: float, delta: float) -> float:
    """Smallest eps >= 0 with ``gaussian_delta(eps, mu) <= delta``: exact (eps, delta) of a mu-Gaussian
    mechanism (delta(eps) is decreasing in eps; solved with brentq)."""
    delta = _check_delta(delta)
    if mu <= 0.0:
        return 0.0
    if math.isinf(mu):
        return math.inf
    if gaussian_delta(0.0, mu) <= delta:
        return 0.0
    hi = max(1.0, mu * mu / 2.0 + 10.0 * mu)
    while gaussian_delta(hi, mu) > delta:
        hi *= 2.0
        if hi > 1e12:
            return math.inf
    return float(optimize.brentq(lambda e: gaussian_delta(e, mu) - delta, 0.0, hi, xtol=1e-13, rtol=1e-13))


def _gaussian_mu_for(epsilon: float, delta: float) -> float:
    """The mu at which a mu-Gaussian mechanism is exactly (epsilon, delta)-DP (delta(eps; mu) increases
    with mu from 0 to 1)."""
    f = lambda log_mu: gaussian_delta(epsilon, math.exp(log_mu)) - delta  # noqa: E731
    lo, hi = -2.0, 2.0
    while f(lo) > 0.0:
        lo -= 2.0
        if lo < -60.0:
            raise ConfigError(f"cannot reach epsilon {epsilon} at delta {delta} with a Gaussian mechanism")
    while f(hi) < 0.0:
        hi += 2.0
        if hi > 20.0:
            raise ConfigError(f"epsilon {epsilon} at delta {delta} needs no noise at all")
    return math.exp(optimize.brentq(f, lo, hi, xtol=1e-13, rtol=1e-13))


# --------------------------------------------------------------------------------------------------
# randomized response

def randomized_response_probabilities(epsilon_label: float, n_classes: int) -> tuple[float, float]:
    """(p_keep, p_each_other) of k-ary randomized response with parameter epsilon_label (Kairouz et al.):
    p_keep = e^eps / (e^eps + k - 1), p_each_other = 1 / (e^eps + k - 1); their ratio is e^eps."""
    eps = _check_epsilon(epsilon_label, "epsilon_label")
    k = _check_int(n_classes, "n_classes", 2)
    # divide through by e^eps for large eps: p_keep = 1 / (1 + (k-1) e^-eps)
    t = math.exp(-eps)
    p_keep = 1.0 / (1.0 + (k - 1) * t)
    p_other = t / (1.0 + (k - 1) * t)
    return p_keep, p_other


def _rr_noise_parameter(epsilon_label: float, n_classes: int) -> float:
    """dp_accounting's ``noise_parameter`` p (probability of a uniform bucket over all k, the true one
    included): 1 - p + p/k = p_keep and p/k = p_other, so p = k * p_other = k / (e^eps + k - 1)."""
    return n_classes * randomized_response_probabilities(epsilon_label, n_classes)[1]


def randomized_response(labels, epsilon_label: float, n_classes: int, generator):
    """k-ary randomized response on integer ``labels`` (a torch tensor or a numpy array; the same type
    comes back): each label is kept with probability p_keep, else replaced by a class drawn uniformly
    from the k - 1 others.

    ``generator`` must be secret randomness (ERRATA E12): a ``torch.Generator`` (on the labels' device)
    or a ``numpy.random.Generator`` seeded from OS entropy. Note that torch's CPU generator keeps only
    32 bits of its seed; prefer a numpy PCG64 generator with a 128-bit seed on CPU
    (:class:`raydp.privacy.randomness.PrivateRandomness`). Draw once per record per run and reuse the
    result every epoch (post-processing); drawing again would spend epsilon_label again."""
    p_keep, _ = randomized_response_probabilities(epsilon_label, n_classes)
    k = int(n_classes)
    if generator is None:
        raise ConfigError("randomized_response needs a secret generator (ERRATA E12), got None")
    is_torch = isinstance(labels, torch.Tensor)
    if not is_torch and not isinstance(labels, np.ndarray):
        raise ConfigError(f"labels must be a torch tensor or a numpy array, got {type(labels).__name__}")
    if is_torch:
        if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
            raise ConfigError(f"labels must be integer class indices, got dtype {labels.dtype}")
        bad = labels.numel() > 0 and bool(((labels < 0) | (labels >= k)).any())
    else:
        if not np.issubdtype(labels.dtype, np.integer):
            raise ConfigError(f"labels must be integer class indices, got dtype {labels.dtype}")
        bad = labels.size > 0 and bool(((labels < 0) | (labels >= k)).any())
    if bad:
        raise ConfigError(f"labels must be in [0, {k}), got values outside it")

    shape = tuple(labels.shape)
    if isinstance(generator, torch.Generator):
        device = labels.device if is_torch else torch.device("cpu")
        u = torch.rand(shape, generator=generator, device=device, dtype=torch.float64)
        shift = torch.randint(1, k, shape, generator=generator, device=device)
        if is_torch:
            lab = labels.to(torch.int64)
            out = torch.where(u < p_keep, lab, (lab + shift) % k)
            return out.to(labels.dtype)
        u, shift = u.numpy(), shift.numpy()
    elif isinstance(generator, np.random.Generator):
        u = generator.random(shape)
        shift = generator.integers(1, k, size=shape)
        if is_torch:
            u = torch.from_numpy(np.asarray(u)).to(labels.device)
            shift = torch.from_numpy(np.asarray(shift)).to(labels.device)
            lab = labels.to(torch.int64)
            out = torch.where(u < p_keep, lab, (lab + shift) % k)
            return out.to(labels.dtype)
    else:
        raise ConfigError(f"generator must be a torch.Generator or numpy.random.Generator, "
                          f"got {type(generator).__name__}")
    lab = labels.astype(np.int64)
    out = np.where(u < p_keep, lab, (lab + shift) % k)
    return out.astype(labels.dtype)


# --------------------------------------------------------------------------------------------------
# composition with labels (dp_accounting PLD, pessimistic)

def _label_composed_epsilon(mu: float, epsilon_label: float, n_classes: int, releases: int,
                            delta: float) -> float:
    """Upper bound on epsilon of (mu-Gaussian) o (``releases`` x k-RR at epsilon_label), at delta."""
    from dp_accounting.pld import privacy_loss_distribution as pldlib

    NeighborRel = pldlib.NeighborRel  # noqa: N806  (dp_accounting.NeighboringRelation)

    eps_gauss = gaussian_epsilon(mu, delta)
    basic = eps_gauss + releases * epsilon_label  # Dwork & Roth Thm 3.16: (eps_G, delta) + (k eps_L, 0)
    interval = min(_MAX_INTERVAL, max(_MIN_INTERVAL, _RELATIVE_INTERVAL * basic))
    rr = pldlib.from_randomized_response(
        noise_parameter=_rr_noise_parameter(epsilon_label, n_classes), num_buckets=n_classes,
        pessimistic_estimate=True, value_discretization_interval=interval,
        neighboring_relation=NeighborRel.REPLACE_ONE)
    if releases > 1:
        rr = rr.self_compose(releases)
    if mu > 0.0:
        # The composed Gaussian (Dong, Roth & Su Cor. 3.3): N(0, 1/mu^2) vs N(1, 1/mu^2), i.e. outputs at
        # distance 1 = our replace-one sensitivity 2C in units of 2C. dp_accounting's `sensitivity`
        # under its REPLACE_ONE relation is a half-distance (it shifts the two neighbours by
        # +sensitivity and -sensitivity: twice the sensitivity apart, privacy_loss_mechanism.py), so
        # passing REPLACE_ONE with sensitivity 1 would charge mu 2x too large. Without subsampling,
        # ADD_OR_REMOVE_ONE (its default) with sensitivity 1 is exactly the pair at distance 1.
        gauss = pldlib.from_gaussian_mechanism(
            standard_deviation=1.0 / mu, sensitivity=1.0, pessimistic_estimate=True,
            value_discretization_interval=interval, sampling_prob=1.0,
            neighboring_relation=NeighborRel.ADD_OR_REMOVE_ONE)
        pld = gauss.compose(rr)
    else:
        pld = rr
    return float(min(pld.get_epsilon_for_delta(delta), basic))


# --------------------------------------------------------------------------------------------------
# the plan

@dataclass(frozen=True)
class LocalPlan:
    """A local-DP mechanism fixed before training (public parameters only).

    ``sigmas[e]``: noise multiplier of epoch e relative to the replace-one sensitivity 2C (noise std
    ``sigmas[e] * 2C``); ``records_per_unit``: k_max, the public cap on records per unit (ERRATA E11);
    ``epsilon_label``: k-ary randomized response on the labels, once per record per run (``None``: the
    labels are not protected, and :meth:`labels` says so); ``n_classes``: k."""

    sigmas: tuple[float, ...]
    records_per_unit: int = 1
    epsilon_label: float | None = None
    n_classes: int = 2

    def __post_init__(self) -> None:
        object.__setattr__(self, "sigmas", _check_positive_list(self.sigmas, "sigmas"))
        object.__setattr__(self, "records_per_unit", _check_int(self.records_per_unit, "records_per_unit", 1))
        object.__setattr__(self, "n_classes", _check_int(self.n_classes, "n_classes", 2))
        if self.epsilon_label is not None:
            object.__setattr__(self, "epsilon_label", _check_epsilon(self.epsilon_label, "epsilon_label"))

    # -- accounting --------------------------------------------------------------------------------
    def _mu(self, epochs: int) -> float:
        # Dong, Roth & Su Cor. 3.3: mu = sqrt(sum of mu_i^2), mu_i = 1/sigma_i; k_max records per unit
        return math.sqrt(self.records_per_unit * sum(1.0 / (s * s) for s in self.sigmas[:epochs]))

    def gaussian_mu(self) -> float:
        """mu of the composed Gaussian part per unit: sqrt(k_max * sum_e 1/sigma_e^2)."""
        return self._mu(len(self.sigmas))

    def _epsilon(self, epochs: int, delta: float) -> float:
        delta = _check_delta(delta)
        if epochs == 0:
            return 0.0  # nothing released yet (the label release happens with the first epoch)
        mu = self._mu(epochs)
        if self.epsilon_label is None:
            return gaussian_epsilon(mu, delta)
        return _label_composed_epsilon(mu, self.epsilon_label, self.n_classes, self.records_per_unit, delta)

    def epsilon(self, delta: float) -> float:
        """Epsilon per unit at delta: exact without labels (analytic Gaussian), an upper bound with them
        (pessimistic PLD, capped by basic composition). Labels unprotected: see :meth:`labels`."""
        return self._epsilon(len(self.sigmas), delta)

    def epsilon_after(self, epochs_done: int, delta: float) -> float:
        """What has been spent per unit after ``epochs_done`` epochs: the first ``epochs_done`` Gaussian
        releases, plus the label release once ``epochs_done >= 1``; 0 before training."""
        n = _check_int(epochs_done, "epochs_done", 0)
        if n > len(self.sigmas):
            raise ConfigError(f"epochs_done must be <= {len(self.sigmas)} (the planned epochs), got {n}")
        return self._epsilon(n, delta)

    def rdp_curve(self, orders, epochs_done: int | None = None) -> np.ndarray:
        """Renyi DP per unit at ``orders`` after ``epochs_done`` epochs (default all): what a study composes
        across trials (ERRATA E7/E14). Gaussian part exact: alpha * mu^2 / 2 (Mironov 2017, Prop. 7, with
        mu^2 = k_max sum_e 1/sigma_e^2); each of the k_max label releases, pure epsilon_L-DP, costs at most
        min(epsilon_L, alpha * epsilon_L^2 / 2) (pure DP bounds every Renyi divergence; epsilon-DP implies
        epsilon^2/2-zCDP, Bun & Steinke 2016, Prop. 1.4)."""
        n = len(self.sigmas) if epochs_done is None else _check_int(epochs_done, "epochs_done", 0)
        alpha = np.asarray(orders, dtype=np.float64)
        curve = alpha * self._mu(min(n, len(self.sigmas))) ** 2 / 2.0 if n else np.zeros_like(alpha)
        if n and self.epsilon_label is not None:
            e = self.epsilon_label
            curve = curve + self.records_per_unit * np.minimum(e, alpha * e * e / 2.0)
        return curve

    def gaussian_epsilon(self, delta: float) -> float:
        """Epsilon of the embedding releases alone (exact)."""
        return gaussian_epsilon(self.gaussian_mu(), delta)

    def is_exact(self) -> bool:
        """True when :meth:`epsilon` is the exact value (no labels), False when it is an upper bound."""
        return self.epsilon_label is None

    # -- reporting ---------------------------------------------------------------------------------
    def unit(self) -> str:
        if self.records_per_unit == 1:
            return "one record (a person with several records gets group privacy only, ERRATA E11)"
        return (f"one unit (patient) with at most {self.records_per_unit} records, a public cap enforced by "
                f"the data pipeline (ERRATA E11)")

    def labels(self) -> list[str]:
        """Caveats every epsilon of this plan must carry."""
        out = []
        if self.epsilon_label is None:
            out.append(LABELS_UNPROTECTED)
        return out

    def describe(self, delta: float) -> dict:
        """JSON-able description for reports and ledgers."""
        delta = _check_delta(delta)
        label_mech = None
        if self.epsilon_label is not None:
            p_keep, p_other = randomized_response_probabilities(self.epsilon_label, self.n_classes)
            label_mech = {"mechanism": "k-ary randomized response, once per record per run",
                          "epsilon_label": self.epsilon_label, "n_classes": self.n_classes,
                          "p_keep": p_keep, "p_each_other": p_other,
                          "releases_per_unit": self.records_per_unit}
        return {
            "mechanism": "local Gaussian on normalised/clipped hidden embeddings (EW-FT / DP-Forward)",
            "neighbouring_relation": "replace-one: any two inputs of one unit (local DP), sensitivity 2C",
            "noise_std": "sigma_e * 2C in epoch e",
            "amplification": "none: the receiver knows whose embeddings it gets (ERRATA E8)",
            "unit": self.unit(),
            "records_per_unit": self.records_per_unit,
            "sigmas": list(self.sigmas),
            "epochs": len(self.sigmas),
            "gaussian_mu": self.gaussian_mu(),
            "delta": delta,
            "epsilon": self.epsilon(delta),
            "epsilon_embeddings_only": self.gaussian_epsilon(delta),
            "epsilon_is": "exact" if self.is_exact() else "upper bound",
            "label_mechanism": label_mech,
            "labels": self.labels(),
            "citations": dict(CITATIONS),
        }


# --------------------------------------------------------------------------------------------------
# calibration

def calibrate_local_scale(multipliers, epsilon: float, delta: float, records_per_unit: int = 1,
                          epsilon_label: float | None = None, n_classes: int = 2) -> LocalPlan:
    """Smallest scale s (to 0.1%, never above the target) such that ``sigmas = s * multipliers`` meets
    ``epsilon`` at ``delta`` per unit. ConfigError if impossible: the label releases alone cost
    ``records_per_unit * epsilon_label`` (pure DP); when that is >= epsilon we refuse (conservatively:
    RR's exact epsilon at delta is slightly less, but the noise needed would be unbounded in practice).

    The epsilon depends on the scale only through mu = mu_1 / s (mu_1 the mu at s = 1), decreasing in s.
    Without labels, s is the exact inverse (then nudged up until the plan's epsilon <= target). With
    labels, bisection between the scale that gives the Gaussian part the whole target (infeasible or
    exact) and the scale that gives it target - k_max * epsilon_label (feasible by basic composition)."""
    mult = _check_positive_list(multipliers, "multipliers")
    epsilon = _check_epsilon(epsilon)
    delta = _check_delta(delta)
    k = _check_int(records_per_unit, "records_per_unit", 1)
    n_classes = _check_int(n_classes, "n_classes", 2)
    if epsilon_label is not None:
        epsilon_label = _check_epsilon(epsilon_label, "epsilon_label")
        if k * epsilon_label >= epsilon:
            raise ConfigError(f"the label releases alone cost records_per_unit * epsilon_label = "
                              f"{k * epsilon_label:g} >= epsilon {epsilon:g}: no noise scale can meet it")

    mu1 = math.sqrt(k * sum(1.0 / (m * m) for m in mult))

    def plan(s: float) -> LocalPlan:
        return LocalPlan(tuple(s * m for m in mult), k, epsilon_label, n_classes)

    def ok(s: float) -> bool:
        return plan(s).epsilon(delta) <= epsilon

    if epsilon_label is None:
        hi = mu1 / _gaussian_mu_for(epsilon, delta)
        while not ok(hi):  # floating-point round-off only: a few ulps
            hi *= 1.0 + 1e-9
        return plan(hi)

    lo = mu1 / _gaussian_mu_for(epsilon, delta)                       # eps >= eps_G = target
    hi = mu1 / _gaussian_mu_for(epsilon - k * epsilon_label, delta)   # eps <= eps_G + k eps_L = target
    if not ok(hi):  # cannot happen (the cap is basic composition); guard against round-off
        hi *= 1.0 + 1e-6
        if not ok(hi):
            raise ConfigError(f"cannot calibrate the local noise to epsilon {epsilon:g} at delta {delta:g}")
    while hi / lo > 1.0 + _SCALE_RTOL:
        mid = math.sqrt(lo * hi)
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return plan(hi)


# --------------------------------------------------------------------------------------------------
# the paper's figure

def paper_epsilon(sigmas, q: float, steps_per_epoch: int, delta: float, accountant: str = "pld") -> float:
    """The paper's figure: epoch e as ``steps_per_epoch`` Poisson-subsampled Gaussian steps at rate q and
    multiplier sigma_e, composed by a raydp accountant. NOT a guarantee for the local mechanism
    (ERRATA E8): report it only beside :meth:`LocalPlan.epsilon`, with :data:`PAPER_FIGURE_LABEL`."""
    from raydp.privacy.accounting import get_accountant

    sig = _check_positive_list(sigmas, "sigmas")
    try:
        q = float(q)
    except (TypeError, ValueError):
        raise ConfigError(f"sampling rate q must be a number in (0, 1], got {q!r}") from None
    if not (0.0 < q <= 1.0):
        raise ConfigError(f"sampling rate q must be in (0, 1], got {q}")
    n = _check_int(steps_per_epoch, "steps_per_epoch", 1)
    delta = _check_delta(delta)
    return float(get_accountant(accountant).epsilon([(q, s, n) for s in sig], delta))
