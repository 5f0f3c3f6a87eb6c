"""The controller's state (RLDP Sec. 2.4) and its layout for the policy networks.

Statistics (per decision interval):

* per pair i: quartiles q_.25, q_.50, q_.75 of the per-sample joint norms nu_i (Eq. 4);
* pooled over pairs and samples: dispersion Var(nu), skewness, excess kurtosis, and the Fisher
  moments F_mu = E[nu^2], F_var = Var[nu^2] (nu_i^2 is the squared norm of pair i's per-sample gradient);
* the batch loss l_t and the utility u_t = -log PPL_t = -(mean per-sequence NLL);
* the ledger's epsilon_t (relative to epsilon_max), the current sigma (relative to sigma_0), and C_i.

In strict mode (ERRATA E3) they are post-processing of Gaussian releases: the per-pair norm histogram
(:class:`~raydp.privacy.statistics.NormHistogram`, summed over the interval; bins whose count is below
twice the summed noise std are zeroed, then quantiles interpolate the CDF in log space and moments use
bin centres) and the clipped loss sum divided by the expected number of samples (E5). In paper mode they
are the exact statistics of the last micro-batch (:func:`summarise_raw`).

Normalisation ("for the network"): norms enter as log10 relative to a public reference norm (the median
per-sample norm of public records under the initial model), scaled to O(1); every feature is clipped to
[-10, 10].

Layouts (versioned, :data:`LAYOUT_VERSION`): ``paper`` is the flat vector of Eq. 22 for a fixed number
of adapters n: ``[F features of adapter 1..n | G globals]`` with an n+1 action; ``shared`` pads to
``n_max`` adapters: ``[F features x n_max | G globals | mask x n_max]`` with an n_max+1 action (the
last entry is always the noise action).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from raydp.control.modes import ARCHITECTURES, fixed_pairs
from raydp.errors import ConfigError

LAYOUT_VERSION = "rldp-obs-v1"
ADAPTER_FEATURES = ("log_q25", "log_q50", "log_q75", "log_clip", "relative_depth")
GLOBAL_FEATURES = ("utility", "epsilon_ratio", "log_dispersion", "loss", "log_fisher_mean", "log_fisher_var",
                   "skewness", "excess_kurtosis", "log_sigma_ratio", "progress")
FEATURE_CLIP = 10.0


@dataclass(frozen=True)
class IntervalStatistics:
    quartiles: np.ndarray  # [n_pairs, 3] norms (linear scale); nan where a pair has no data
    dispersion: float
    skewness: float
    excess_kurtosis: float
    fisher_mean: float
    fisher_var: float
    mean_loss: float


def _moments(values: np.ndarray, weights: np.ndarray) -> tuple[float, float, float, float, float]:
    """(var, skew, excess kurtosis, E[v^2], Var[v^2]) of a weighted sample (weights >= 0)."""
    w = weights.sum()
    if w <= 0:
        return (math.nan,) * 5
    p = weights / w
    mean = float((p * values).sum())
    centred = values - mean
    var = float((p * centred**2).sum())
    sd = math.sqrt(var) if var > 0 else 0.0
    skew = float((p * centred**3).sum()) / sd**3 if sd > 0 else 0.0
    kurt = float((p * centred**4).sum()) / sd**4 - 3.0 if sd > 0 else 0.0
    sq = values**2
    f_mu = float((p * sq).sum())
    f_var = float((p * (sq - f_mu) ** 2).sum())
    return var, skew, kurt, f_mu, f_var


def histogram_quantiles(counts: np.ndarray, edges: np.ndarray, probs=(0.25, 0.5, 0.75)) -> np.ndarray:
    """Quantiles (linear norm scale) of one pair's histogram over log10 ``edges`` (CDF interpolated in
    log space); nan when the histogram is empty."""
    total = counts.sum()
    if total <= 0:
        return np.full(len(probs), math.nan)
    cdf = np.concatenate([[0.0], np.cumsum(counts) / total])
    out = []
    for p in probs:
        k = int(np.searchsorted(cdf, p, side="left"))
        k = min(max(k, 1), len(edges) - 1)
        lo, hi = cdf[k - 1], cdf[k]
        frac = 0.5 if hi <= lo else (p - lo) / (hi - lo)
        out.append(10.0 ** (edges[k - 1] + frac * (edges[k] - edges[k - 1])))
    return np.array(out)


def denoise_counts(counts: np.ndarray, noise_std: float, threshold: float = 2.0) -> np.ndarray:
    """Post-processing of noisy counts: bins below ``threshold`` x their noise std become 0."""
    return np.where(counts >= threshold * noise_std, counts, 0.0)


def summarise_histogram(counts: np.ndarray, edges: np.ndarray, noise_std: float, loss_sum: float,
                        expected_samples: float) -> IntervalStatistics:
    """Statistics from the interval's summed noisy histograms ``[n_pairs, n_bins]`` (strict mode)."""
    clean = denoise_counts(np.asarray(counts, dtype=np.float64), noise_std)
    quartiles = np.stack([histogram_quantiles(row, edges) for row in clean])
    centres = 10.0 ** (0.5 * (edges[:-1] + edges[1:]))
    pooled = clean.sum(axis=0)
    var, skew, kurt, f_mu, f_var = _moments(centres, pooled)
    mean_loss = float(loss_sum) / expected_samples if expected_samples > 0 else math.nan
    return IntervalStatistics(quartiles, var, skew, kurt, f_mu, f_var, max(mean_loss, 0.0))


def summarise_raw(pair_norms: np.ndarray, losses: np.ndarray) -> IntervalStatistics:
    """Exact statistics of one micro-batch (paper mode: NOT private, ERRATA E3)."""
    norms = np.asarray(pair_norms, dtype=np.float64)
    if norms.shape[0] == 0:
        n = norms.shape[1]
        return IntervalStatistics(np.full((n, 3), math.nan), *(math.nan,) * 5, math.nan)
    quartiles = np.quantile(norms, [0.25, 0.5, 0.75], axis=0).T
    flat = norms.ravel()
    var, skew, kurt, f_mu, f_var = _moments(flat, np.ones_like(flat))
    return IntervalStatistics(quartiles, var, skew, kurt, f_mu, f_var, float(np.mean(losses)))


def _log10_rel(x: float, ref: float, scale: float) -> float:
    if not (x > 0 and math.isfinite(x)):
        return 0.0
    return (math.log10(x) - ref) / scale


@dataclass(frozen=True)
class ControllerView:
    """Everything the state is built from at a decision (all public or post-processing)."""

    stats: IntervalStatistics
    clips: tuple[float, ...]
    depths: tuple[float, ...]
    reference_norm: float  # public
    epsilon_ratio: float
    sigma_ratio: float
    progress: float


def adapter_features(view: ControllerView) -> np.ndarray:
    """[n_pairs, F]: log10 quartiles relative to the reference norm (/2), log10 C_i, relative depth."""
    ref = math.log10(view.reference_norm)
    rows = []
    for q, c, d in zip(view.stats.quartiles, view.clips, view.depths):
        rows.append([_log10_rel(float(v), ref, 2.0) for v in q] + [math.log10(c), d])
    return np.clip(np.array(rows, dtype=np.float64), -FEATURE_CLIP, FEATURE_CLIP)


def global_features(view: ControllerView) -> np.ndarray:
    s, ref = view.stats, math.log10(view.reference_norm)
    loss = s.mean_loss if math.isfinite(s.mean_loss) else 0.0
    g = [
        -loss,  # u_t = -log PPL_t (Eq. 9)
        view.epsilon_ratio,
        _log10_rel(s.dispersion, 2 * ref, 4.0),
        loss,
        _log10_rel(s.fisher_mean, 2 * ref, 4.0),
        _log10_rel(s.fisher_var, 4 * ref, 8.0),
        (s.skewness if math.isfinite(s.skewness) else 0.0) / 10.0,
        (s.excess_kurtosis if math.isfinite(s.excess_kurtosis) else 0.0) / 10.0,
        math.log(view.sigma_ratio),
        view.progress,
    ]
    return np.clip(np.array(g, dtype=np.float64), -FEATURE_CLIP, FEATURE_CLIP)


@dataclass(frozen=True)
class ObservationLayout:
    """How features are packed for a policy: ``paper`` (n_slots = n adapters) or ``shared`` (n_max)."""

    architecture: str
    n_slots: int
    version: str = LAYOUT_VERSION
    f_adapter: int = len(ADAPTER_FEATURES)
    g_global: int = len(GLOBAL_FEATURES)

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(f"unknown policy architecture {self.architecture!r}; choose one of {ARCHITECTURES}")
        if self.n_slots < 1:
            raise ConfigError(f"a policy needs >= 1 adapter slot, got {self.n_slots}")

    @property
    def obs_dim(self) -> int:
        extra = 0 if self.fixed_pairs else self.n_slots
        return self.n_slots * self.f_adapter + self.g_global + extra

    @property
    def act_dim(self) -> int:
        return self.n_slots + 1

    @property
    def fixed_pairs(self) -> bool:
        """The policy controls exactly ``n_slots`` pairs (the paper's Eq. 22-27), not a padded, masked set."""
        return fixed_pairs(self.architecture)

    def check_adapters(self, n_pairs: int) -> None:
        if self.fixed_pairs and n_pairs != self.n_slots:
            raise ConfigError(f"this policy ('paper' architecture) controls exactly {self.n_slots} adapter pairs; "
                              f"the model has {n_pairs}. Use a 'shared' policy to transfer across model sizes")
        if n_pairs > self.n_slots:
            raise ConfigError(f"the model has {n_pairs} adapter pairs; this policy handles at most {self.n_slots}")

    def pack(self, adapters: np.ndarray, globals_: np.ndarray) -> np.ndarray:
        n = adapters.shape[0]
        self.check_adapters(n)
        per = np.zeros((self.n_slots, self.f_adapter))
        per[:n] = adapters
        parts = [per.ravel(), globals_]
        if not self.fixed_pairs:
            mask = np.zeros(self.n_slots)
            mask[:n] = 1.0
            parts.append(mask)
        return np.concatenate(parts).astype(np.float32)

    def split_action(self, action: np.ndarray, n_pairs: int) -> np.ndarray:
        """The run's n + 1 action entries (its adapters' clip actions, then the noise action)."""
        a = np.asarray(action, dtype=np.float64).ravel()
        if a.size != self.act_dim:
            raise ValueError(f"expected an action of length {self.act_dim}, got {a.size}")
        return np.concatenate([a[:n_pairs], a[-1:]])

    def as_dict(self) -> dict:
        return asdict(self)
