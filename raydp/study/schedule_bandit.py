"""An episode-level contextual bandit over a strategy's public choices: one decision per run.

RLDP decides the dials every few steps from a noisy reward; this controller decides them once, before the run, from
the run's context, and learns only from whole public episodes:

- **context**: the run's target epsilon, as ``log epsilon`` (a study's other fields, the model, batch size and
  so the sampling rate and steps, are the same in every run it learns from, so they carry nothing and are not
  features);
- **arm**: one point of a strategy's ``search_space`` (for ``clip-schedule``: the clip at the start and end, the
  depth tilt, moment rescaling, the learning rate and its decay);
- **loss**: the run's final value-token NLL on the PUBLIC validation split (lower is better). Episodes are
  public: nothing here is computed from private records.

The model is a Gaussian process over [context, arm] in the unit cube, fitted to the losses capped at Tukey's fence
and standardised (:func:`standard_scores`: a diverged run must not set the scale), Matern 5/2 with one length scale per
coordinate and a noise term, its hyperparameters fitted by maximising the log marginal likelihood (Rasmussen and
Williams, *Gaussian Processes for Machine Learning*, 2006: eq. 4.17 for the kernel, eq. 2.23-2.26 for the
posterior, eq. 2.30 for the marginal likelihood). Exploration is Thompson sampling (Russo, Van Roy, Kazerouni,
Osband and Wen, *A Tutorial on Thompson Sampling*, 2018): one joint posterior draw
over a set of candidate arms at the run's context, and the arm that draw ranks best. The decision for a run is
the candidate with the lowest posterior mean (no exploration). Candidates are a seeded uniform draw from the
space (public randomness), plus the arms already tried.

Everything here is numpy and scipy; the Tune searcher that feeds it trials is :mod:`raydp.study.bandit`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy.linalg import cho_factor, cho_solve
from scipy.optimize import minimize
from scipy.spatial.distance import cdist

#: the format of a saved bandit (``bandit.json``)
BANDIT_FORMAT = 1
#: the candidate set of a decision (learning draws are numbered from 0)
DECISION_DRAW = 2 ** 31
#: the longest length scale, in units of a value's range: longer ones would let the fit call a searched value irrelevant
#: on a few dozen episodes and decide it at random (on tests/test_bandit.py's surface, a cap of 20 decided arms
#: ranked in the best 17% of the space, a cap of 2 or 4 in the best 1%)
MAX_LENGTH = 4.0


@dataclass(frozen=True)
class Dimension:
    """One searched value: a range (``low``, ``high``, ``log``) or a list of ``choices`` (as a study's
    ``search_space``)."""

    low: float | None = None
    high: float | None = None
    log: bool = False
    choices: tuple | None = None

    def encode(self, value) -> list[float]:
        if self.choices is not None:
            return [1.0 if value == c else 0.0 for c in self.choices]
        lo, hi, v = (math.log(self.low), math.log(self.high), math.log(value)) if self.log else \
            (self.low, self.high, float(value))
        return [(v - lo) / (hi - lo)]

    def draw(self, rng: np.random.Generator):
        if self.choices is not None:
            return self.choices[int(rng.integers(len(self.choices)))]
        u = float(rng.random())
        if self.log:
            return float(math.exp(math.log(self.low) + u * (math.log(self.high) - math.log(self.low))))
        return float(self.low + u * (self.high - self.low))

    def to_dict(self) -> dict:
        return {"choices": list(self.choices)} if self.choices is not None else \
            {"low": self.low, "high": self.high, "log": self.log}

    @classmethod
    def from_dict(cls, d: dict) -> "Dimension":
        if d.get("choices") is not None:
            return cls(choices=tuple(d["choices"]))
        return cls(low=float(d["low"]), high=float(d["high"]), log=bool(d.get("log", False)))


def standard_scores(y: np.ndarray) -> tuple[np.ndarray, float, float]:
    """The losses the GP fits, and the affine map back (loss = mean + sd * score, for a loss below the cap):
    capped at Tukey's upper fence, Q3 + 1.5 IQR (Tukey, *Exploratory Data Analysis*, 1977), then standardised. A
    GP on raw losses is wrecked by one diverged run: a 209-nat episode among 67-71 ones (trials/bandit-search.yaml)
    set the scale, and the bandit decided an epsilon-8 learning rate whose episodes had all ended near 69.5.
    Capped, a diverged run counts as bad, not as the scale; the bulk keeps its magnitudes (ranks alone, a Gaussian
    copula, decided worse on tests/test_bandit.py's surface: 3.7% of the space better on average against 1.9%)."""
    y = np.asarray(y, dtype=float)
    if len(y) < 2:
        return np.zeros(len(y)), float(y.mean()) if len(y) else 0.0, 1.0
    q1, q3 = np.percentile(y, [25, 75])
    y = np.minimum(y, q3 + 1.5 * (q3 - q1))
    mean, sd = float(y.mean()), float(y.std(ddof=1))
    sd = sd if sd > 0 else 1.0
    return (y - mean) / sd, mean, sd


@dataclass
class Observation:
    epsilon: float
    values: dict
    loss: float


def _matern52(a: np.ndarray, b: np.ndarray, lengths: np.ndarray, signal: float) -> np.ndarray:
    """Matern 5/2 with ARD length scales (Rasmussen and Williams 2006, eq. 4.17)."""
    s5 = math.sqrt(5.0) * cdist(a / lengths, b / lengths)
    return signal * (1.0 + s5 + s5 * s5 / 3.0) * np.exp(-s5)


@dataclass
class ScheduleBandit:
    """A Gaussian-process contextual bandit: :meth:`suggest` (Thompson sampling) while learning,
    :meth:`decide` (posterior mean) for a run."""

    space: dict[str, Dimension]
    epsilon_range: tuple[float, float]
    seed: int = 0
    candidates: int = 1024
    observations: list[Observation] = field(default_factory=list)
    _fitted: tuple | None = field(default=None, repr=False, compare=False)

    # -- encoding ---------------------------------------------------------------------------------
    def _context(self, epsilon: float) -> float:
        lo, hi = (math.log(e) for e in self.epsilon_range)
        return 0.5 if hi == lo else (math.log(epsilon) - lo) / (hi - lo)

    def _x(self, epsilon: float, values: dict) -> list[float]:
        return [self._context(epsilon)] + [c for name, dim in self.space.items() for c in dim.encode(values[name])]

    def random_values(self, rng: np.random.Generator) -> dict:
        return {name: dim.draw(rng) for name, dim in self.space.items()}

    def random_draw(self, draw: int) -> dict:
        """Values drawn uniformly from the space, seeded by ``draw`` (a learning run's number: public)."""
        return self.random_values(np.random.default_rng([self.seed, draw]))

    def observe(self, epsilon: float, values: dict, loss: float) -> None:
        if not math.isfinite(loss):
            raise ValueError(f"a bandit loss must be finite, got {loss}")
        missing = sorted(set(self.space) - set(values))
        if missing:
            raise ValueError(f"an observed arm lacks {missing[0]!r} of the bandit's space")
        self.observations.append(Observation(float(epsilon), {k: values[k] for k in self.space}, float(loss)))

    # -- the Gaussian process -----------------------------------------------------------------------
    def _fit(self):
        """Hyperparameters by maximising the log marginal likelihood (R&W 2006, eq. 2.30) on standardised losses;
        returns what the posterior needs. Deterministic for given observations (and kept until the next one)."""
        key = tuple((o.epsilon, tuple(sorted(o.values.items(), key=lambda kv: kv[0])), o.loss)
                    for o in self.observations)
        if self._fitted is None or self._fitted[0] != key:
            self._fitted = (key, self._fit_now())
        return self._fitted[1]

    def _fit_now(self):
        x = np.array([self._x(o.epsilon, o.values) for o in self.observations])
        y = np.array([o.loss for o in self.observations])
        z, mean, sd = standard_scores(y)
        d = x.shape[1]

        def unpack(theta):
            return np.exp(theta[:d]), float(np.exp(theta[d])), float(np.exp(theta[d + 1]))

        def nlml(theta):  # R&W eq. 2.30, without its constant
            lengths, signal, noise = unpack(theta)
            k = _matern52(x, x, lengths, signal) + (noise + 1e-8) * np.eye(len(x))
            try:
                chol = cho_factor(k, lower=True)
            except np.linalg.LinAlgError:
                return 1e10
            return 0.5 * float(z @ cho_solve(chol, z)) + float(np.log(np.diag(chol[0])).sum())

        start = np.r_[np.full(d, math.log(0.5)), 0.0, math.log(0.1)]
        bounds = [(math.log(0.05), math.log(MAX_LENGTH))] * d + [(math.log(0.05), math.log(20.0)),
                                                           (math.log(1e-4), math.log(2.0))]
        theta = minimize(nlml, start, method="L-BFGS-B", bounds=bounds).x
        lengths, signal, noise = unpack(theta)
        chol = cho_factor(_matern52(x, x, lengths, signal) + (noise + 1e-8) * np.eye(len(x)), lower=True)
        return x, chol, cho_solve(chol, z), lengths, signal, (mean, sd)

    def _candidates(self, draw: int) -> list[dict]:
        rng = np.random.default_rng([self.seed, draw])
        tried = [o.values for o in self.observations]
        return tried + [self.random_values(rng) for _ in range(self.candidates)]

    def _posterior(self, epsilon: float, arms: list[dict]) -> tuple[np.ndarray, np.ndarray]:
        x, chol, alpha, lengths, signal, _ = self._fit()
        xs = np.array([self._x(epsilon, v) for v in arms])
        ks = _matern52(xs, x, lengths, signal)
        mu = ks @ alpha  # R&W eq. 2.23 (2.25 for one point)
        cov = _matern52(xs, xs, lengths, signal) - ks @ cho_solve(chol, ks.T)  # R&W eq. 2.24
        return mu, cov

    def suggest(self, epsilon: float, draw: int) -> dict:
        """Thompson sampling: the candidate that one joint posterior draw at ``epsilon`` ranks best (random
        values before any observation). ``draw`` seeds the candidates and the draw (public randomness)."""
        if not self.observations:
            return self.random_draw(draw)
        arms = self._candidates(draw)
        mu, cov = self._posterior(epsilon, arms)
        cov = 0.5 * (cov + cov.T)
        jitter = 1e-8 * max(float(np.mean(np.diag(cov))), 1e-12)
        for _ in range(12):  # jitter grows until the factor exists (candidates may be nearly collinear)
            try:
                chol = np.linalg.cholesky(cov + jitter * np.eye(len(arms)))
                break
            except np.linalg.LinAlgError:
                jitter *= 10.0
        else:
            raise ValueError("the bandit's posterior covariance has no Cholesky factor (not finite?)")
        sample = mu + chol @ np.random.default_rng([self.seed, draw, 1]).standard_normal(len(arms))
        return dict(arms[int(np.argmin(sample))])

    def decide(self, epsilon: float) -> dict:
        """The run's values: the candidate (or tried arm) with the lowest posterior mean loss at ``epsilon``."""
        if not self.observations:
            raise ValueError("the bandit has no observations to decide from")
        arms = self._candidates(DECISION_DRAW)
        mu, _ = self._posterior(epsilon, arms)
        return dict(arms[int(np.argmin(mu))])

    def predict(self, epsilon: float, values: dict) -> tuple[float, float, float]:
        """The loss of ``values`` at ``epsilon``: the posterior mean and mean -/+ one sd, in nats (the
        standardisation undone; a figure above Tukey's cap means "at least as bad as the cap")."""
        mu, cov = self._posterior(epsilon, [values])
        sd = math.sqrt(max(float(cov[0, 0]), 0.0))
        mean, scale = self._fit()[-1]
        m = float(mu[0])
        return mean + scale * m, mean + scale * (m - sd), mean + scale * (m + sd)

    def length_scales(self) -> dict[str, float]:
        """The fitted length scales, in units of each value's range (log epsilon's for ``epsilon``); one at
        :data:`MAX_LENGTH` means the episodes showed no effect of that value (for ``epsilon``: the contexts were
        pooled)."""
        lengths = self._fit()[3]
        names = ["epsilon"] + [name if dim.choices is None else f"{name}={c}"
                               for name, dim in self.space.items() for c in (dim.choices or [None])]
        return {n: round(float(v), 4) for n, v in zip(names, lengths)}

    # -- saving -----------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"format": BANDIT_FORMAT, "seed": self.seed, "candidates": self.candidates,
                "epsilon_range": list(self.epsilon_range),
                "space": {name: dim.to_dict() for name, dim in self.space.items()},
                "observations": [{"epsilon": o.epsilon, "values": o.values, "loss": o.loss}
                                 for o in self.observations]}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, d: dict) -> "ScheduleBandit":
        if d.get("format") != BANDIT_FORMAT:
            raise ValueError(f"a bandit of format {d.get('format')!r}: this raydp reads format {BANDIT_FORMAT}")
        bandit = cls(space={k: Dimension.from_dict(v) for k, v in d["space"].items()},
                     epsilon_range=tuple(d["epsilon_range"]), seed=int(d["seed"]), candidates=int(d["candidates"]))
        for o in d["observations"]:
            bandit.observe(o["epsilon"], o["values"], o["loss"])
        return bandit

    @classmethod
    def load(cls, path: str | Path) -> "ScheduleBandit":
        return cls.from_dict(json.loads(Path(path).read_text()))
