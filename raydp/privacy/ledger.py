"""Per-step privacy ledger of Poisson-subsampled Gaussian mechanisms.

Neighbouring relation: **add/remove-one** (ERRATA E6). Two datasets are neighbours when one is the other
plus one record. Every sensitivity in the ledger is an L2 sensitivity under that relation: a clipped
per-sample contribution of norm <= C has sensitivity C (not the 2C of replace-one, RLDP Appendix B),
which is the relation the Poisson-subsampled accountants assume.

One ledger row per training step t:

* ``q``: the Poisson sampling rate of the step (a step whose batch came out empty is still a step at q:
  the mechanism ran, on an empty sample);
* ``releases``: every Gaussian release computed from that step's sample, each with a name
  (``"gradient"``, ``"norm_histogram"``, ``"loss"``...), its L2 sensitivity and its noise std;
* ``sigma_eff``: the noise multiplier of the step as ONE Gaussian mechanism. Releases on the same sample
  compose as one Gaussian mechanism (ERRATA E1/E3)::

      1 / sigma_eff^2 = sum_j (sensitivity_j / noise_std_j)^2

  A release with noise std = inf (or sensitivity 0) contributes nothing; a step with no private release
  at all has ``sigma_eff = inf`` and costs nothing (accountants skip it; it still counts as a step). A
  release with std 0 and sensitivity > 0 makes ``sigma_eff = 0``: not private, epsilon = inf.
* metadata: the per-pair clip vector and the noise allocation name ('proportional', 'uniform', 'flat').

The gradient release of per-pair clipping (RLDP Eq. 6) with clips C_i and per-pair noise stds s_i is
one Gaussian mechanism with sensitivity 1 and noise multiplier ``(sum_i C_i^2 / s_i^2) ** -0.5``
(ERRATA E1; rescale pair i by 1/C_i): :func:`gradient_sigma_eff`, :func:`gradient_release`.
:func:`allocate_noise` gives the per-pair stds that keep a target sigma true.

Appending is O(1) amortised (column lists); :meth:`PrivacyLedger.save` writes one Parquet file (one row
per step, file-level metadata with the neighbouring relation, delta, epsilon target and enforcing
accountant) and :meth:`PrivacyLedger.load` reads it back.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raydp.errors import ConfigError, DataError
from raydp.files import atomic_replace
from raydp.privacy.accounting.grid import StepHistogram
from raydp.run_directory import LEDGER

__all__ = [
    "ALLOCATIONS",
    "LEDGER_FILENAME",
    "NEIGHBOURING_RELATION",
    "PrivacyLedger",
    "Release",
    "StepRecord",
    "allocate_noise",
    "combine_sigma_eff",
    "gradient_release",
    "gradient_sigma_eff",
]

NEIGHBOURING_RELATION = "add_remove_one"
#: a forward-pass local-DP ledger (raydp.privacy.forward): one row per epoch, q = 1, replace-one per unit
LOCAL_RELATION = "replace_one_local"
NEIGHBOURING_RELATIONS = (NEIGHBOURING_RELATION, LOCAL_RELATION)
ALLOCATIONS = ("proportional", "uniform", "flat")
LEDGER_FILENAME = LEDGER  # a run's ledger file (raydp.run_directory names it; importable here for callers)
FORMAT_VERSION = 1
_META_KEY = b"raydp.privacy_ledger"


@dataclass(frozen=True, slots=True)
class Release:
    """One Gaussian release on a step's sample: ``value + N(0, noise_std^2)``, L2 ``sensitivity``
    under add/remove-one."""

    name: str
    sensitivity: float
    noise_std: float

    def __post_init__(self) -> None:
        s, n = float(self.sensitivity), float(self.noise_std)
        if not (math.isfinite(s) and s >= 0.0):
            raise ConfigError(f"release {self.name!r}: sensitivity must be finite and >= 0, got {self.sensitivity}")
        if math.isnan(n) or n < 0.0:
            raise ConfigError(f"release {self.name!r}: noise std must be >= 0 (inf allowed), got {self.noise_std}")
        object.__setattr__(self, "sensitivity", s)
        object.__setattr__(self, "noise_std", n)

    @property
    def precision(self) -> float:
        """(sensitivity / noise_std)^2: 0 for a release that reveals nothing, inf for a noiseless one."""
        if self.sensitivity == 0.0 or math.isinf(self.noise_std):
            return 0.0
        if self.noise_std == 0.0:
            return math.inf
        return (self.sensitivity / self.noise_std) ** 2


def combine_sigma_eff(releases: Iterable[Release]) -> float:
    """sigma_eff of releases on one sample: (sum_j (sens_j / std_j)^2) ** -0.5 (inf if none private)."""
    total = math.fsum(r.precision for r in releases)
    if total == 0.0:
        return math.inf
    if math.isinf(total):
        return 0.0
    return 1.0 / math.sqrt(total)


def _clip_array(clips: Sequence[float]) -> np.ndarray:
    c = np.asarray(clips, dtype=np.float64).ravel()
    if c.size == 0 or not np.all(np.isfinite(c)) or np.any(c <= 0):
        raise ConfigError("clip norms must be a non-empty list of finite values > 0")
    return c


def gradient_sigma_eff(clips: Sequence[float], noise_stds: Sequence[float]) -> float:
    """Noise multiplier of per-pair clipped gradients (ERRATA E1): ``(sum_i C_i^2 / s_i^2) ** -0.5``.

    Pair i is clipped to norm C_i and gets N(0, s_i^2) noise per coordinate; rescaling pair i by 1/C_i
    makes the whole per-sample contribution of sensitivity 1 with noise std s_i / C_i on pair i.
    """
    c = _clip_array(clips)
    s = np.asarray(noise_stds, dtype=np.float64).ravel()
    if s.shape != c.shape:
        raise ConfigError(f"{c.size} clip norms but {s.size} noise stds")
    if np.any(np.isnan(s)) or np.any(s < 0):
        raise ConfigError("noise stds must be >= 0")
    with np.errstate(divide="ignore"):
        total = math.fsum((c * c / (s * s)).tolist())
    if total == 0.0:
        return math.inf
    if math.isinf(total):
        return 0.0
    return 1.0 / math.sqrt(total)


def gradient_release(clips: Sequence[float], noise_stds: Sequence[float], name: str = "gradient",
                     sigma: float | None = None) -> Release:
    """The gradient release in normalised form: sensitivity 1, noise std = :func:`gradient_sigma_eff`; or, with
    ``sigma`` (the multiplier the stds were allocated for, :func:`allocate_noise`), exactly ``sigma`` when the stds
    are shown to give at least it in exact arithmetic (:func:`multiplier_at_least`). Every step of a plan then
    charges one identical value, whatever its clips: rounding-level variants of sigma_eff would each be a rare value
    that the accountants' grid charges up to 0.5% less noise (:mod:`raydp.privacy.accounting.grid`), which took a
    16-step run whose clips changed every step to epsilon 2.0046 on a target of 2."""
    if sigma is not None and multiplier_at_least(clips, noise_stds, sigma):
        return Release(name, 1.0, float(sigma))
    return Release(name, 1.0, gradient_sigma_eff(clips, noise_stds))


def multiplier_at_least(clips: Sequence[float], noise_stds: Sequence[float], sigma: float) -> bool:
    """Whether the per-pair stds give the gradient release a noise multiplier of at least ``sigma``, decided in exact
    rational arithmetic on the float64 values: ``sum_i C_i^2 / s_i^2 <= 1 / sigma^2`` (ERRATA E1's multiplier)."""
    c = _clip_array(clips)
    s = np.asarray(noise_stds, dtype=np.float64).ravel()
    if s.shape != c.shape or not np.all(np.isfinite(s) & (s > 0)) or not (sigma > 0 and math.isfinite(sigma)):
        return False
    return _exactly_at_least(tuple(c.tolist()), tuple(s.tolist()), float(sigma))


@functools.lru_cache(maxsize=8)  # a DP step asks twice for the same values: allocate_noise, then gradient_release
def _exactly_at_least(clips: tuple[float, ...], stds: tuple[float, ...], sigma: float) -> bool:
    total = sum((Fraction(ci) / Fraction(si)) ** 2 for ci, si in zip(clips, stds))
    return total * Fraction(sigma) ** 2 <= 1


def allocate_noise(sigma: float, clips: Sequence[float], allocation: str = "proportional") -> np.ndarray:
    """Per-pair noise stds s_i that make the gradient release's true noise multiplier exactly ``sigma``.

    * ``'proportional'``: s_i = sigma * sqrt(n) * C_i (noise proportional to each pair's clip);
    * ``'uniform'``: s_i = sigma * ||C||_2 for every pair (Opacus per-layer style);
    * ``'flat'``: flat (whole-gradient) clipping, a single clip C: s = sigma * C. Only valid with one
      clip; RLDP Eq. 6's per-pair s_i = sigma * C_i with n > 1 pairs has true multiplier sigma/sqrt(n)
      (ERRATA E1) and is not offered.

    In each case the true multiplier of the result is sigma up to float rounding, and at least sigma: where
    rounding would leave it a few ulps short (exact check, :func:`multiplier_at_least`), the stds are raised by a
    few ulps, so that the step can be charged exactly sigma (:func:`gradient_release`).
    """
    sigma = float(sigma)
    if not (sigma > 0.0):
        raise ConfigError(f"sigma must be > 0, got {sigma}")
    c = _clip_array(clips)
    if allocation == "proportional":
        stds = sigma * math.sqrt(c.size) * c
    elif allocation == "uniform":
        stds = np.full_like(c, sigma * float(np.linalg.norm(c)))
    elif allocation == "flat":
        if c.size != 1:
            raise ConfigError("allocation 'flat' is whole-gradient clipping with one clip norm; "
                              f"got {c.size} (use 'proportional' or 'uniform' for per-pair clips)")
        stds = sigma * c
    else:
        raise ConfigError(f"unknown noise allocation {allocation!r}; choose one of {', '.join(ALLOCATIONS)}")
    for _ in range(16):
        if multiplier_at_least(c, stds, sigma):
            return stds
        stds = stds * (1.0 + 4 * np.finfo(np.float64).eps)
    raise ConfigError(f"could not allocate noise of multiplier {sigma} to clips {c.tolist()}")


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One ledger row."""

    step: int
    q: float
    sigma_eff: float
    releases: tuple[Release, ...]
    clip: tuple[float, ...] | None
    allocation: str | None


def _check_q(q: float) -> float:
    q = float(q)
    if not (0.0 < q <= 1.0):
        raise ConfigError(f"sampling rate q must be in (0, 1], got {q}")
    return q


def _opt_float(x, name: str, check) -> float | None:
    if x is None:
        return None
    x = float(x)
    if not check(x):
        raise ConfigError(f"{name} out of range: {x}")
    return x


class PrivacyLedger:
    """Append-only per-step ledger (see the module docstring for the semantics of a row).

    Parameters are file-level metadata, persisted with the ledger: ``delta`` and ``epsilon_target`` of
    the run's budget, ``accountant`` (the name of the accountant that enforces it), and any extra
    JSON-able ``metadata``.
    """

    def __init__(self, *, delta: float | None = None, epsilon_target: float | None = None,
                 accountant: str | None = None, metadata: Mapping | None = None) -> None:
        self._steps: list[int] = []
        self._q: list[float] = []
        self._sigma: list[float] = []
        self._releases: list[tuple[Release, ...]] = []
        self._clip: list[tuple[float, ...] | None] = []
        self._alloc: list[str | None] = []
        self.metadata: dict = {}
        md = dict(metadata or {})
        for key, value in (("delta", delta), ("epsilon_target", epsilon_target), ("accountant", accountant)):
            if value is not None or key not in md:
                md[key] = value
        self.update_metadata(**md)

    # -- metadata ----------------------------------------------------------------------------------
    def update_metadata(self, **kwargs) -> None:
        """Set file-level metadata (None values are kept as they were unless the key is new)."""
        if "delta" in kwargs:
            kwargs["delta"] = _opt_float(kwargs["delta"], "delta", lambda d: 0.0 < d < 1.0)
        if "epsilon_target" in kwargs:
            kwargs["epsilon_target"] = _opt_float(kwargs["epsilon_target"], "epsilon_target",
                                                  lambda e: 0.0 < e < math.inf)
        for k, v in kwargs.items():
            if v is not None or k not in self.metadata:
                self.metadata[k] = v
        if self.metadata.get("neighbouring_relation") is None:  # a local-DP ledger states replace-one
            self.metadata["neighbouring_relation"] = NEIGHBOURING_RELATION

    @property
    def delta(self) -> float | None:
        return self.metadata.get("delta")

    @property
    def epsilon_target(self) -> float | None:
        return self.metadata.get("epsilon_target")

    @property
    def accountant(self) -> str | None:
        return self.metadata.get("accountant")

    # -- recording ---------------------------------------------------------------------------------
    def record(self, q: float, releases: Iterable[Release], *, clip: Sequence[float] | None = None,
               allocation: str | None = None, step: int | None = None) -> float:
        """Append one step; returns its sigma_eff. ``step`` defaults to the previous step + 1 (0 first)."""
        q = _check_q(q)
        rel = tuple(releases)
        for r in rel:
            if not isinstance(r, Release):
                raise ConfigError(f"a release must be a Release, got {type(r).__name__}")
        if step is None:
            step = self._steps[-1] + 1 if self._steps else 0
        else:
            step = int(step)
            if self._steps and step <= self._steps[-1]:
                raise ConfigError(f"ledger steps must increase: {step} after {self._steps[-1]}")
        if allocation is not None and allocation not in ALLOCATIONS:
            raise ConfigError(f"unknown noise allocation {allocation!r}; choose one of {', '.join(ALLOCATIONS)}")
        clip_t = None if clip is None else tuple(float(c) for c in clip)
        sigma_eff = combine_sigma_eff(rel)
        self._steps.append(step)
        self._q.append(q)
        self._sigma.append(sigma_eff)
        self._releases.append(rel)
        self._clip.append(clip_t)
        self._alloc.append(allocation)
        return sigma_eff

    def record_gaussian(self, q: float, sigma: float, *, name: str = "gradient",
                        clip: Sequence[float] | None = None, allocation: str | None = None,
                        step: int | None = None) -> float:
        """Append a step with one release of sensitivity 1 and noise std ``sigma`` (a noise multiplier)."""
        return self.record(q, [Release(name, 1.0, sigma)], clip=clip, allocation=allocation, step=step)

    # -- reading -----------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._q)

    def __getitem__(self, i: int) -> StepRecord:
        return StepRecord(self._steps[i], self._q[i], self._sigma[i], self._releases[i], self._clip[i],
                          self._alloc[i])

    def __iter__(self) -> Iterator[StepRecord]:
        for i in range(len(self)):
            yield self[i]

    def arrays(self, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(q, sigma_eff) of steps ``start:`` as float arrays (what the accountants read)."""
        return (np.asarray(self._q[start:], dtype=np.float64),
                np.asarray(self._sigma[start:], dtype=np.float64))

    @property
    def q(self) -> np.ndarray:
        return self.arrays()[0]

    @property
    def sigma_eff(self) -> np.ndarray:
        return self.arrays()[1]

    @property
    def steps(self) -> np.ndarray:
        return np.asarray(self._steps, dtype=np.int64)

    def to_histogram(self):
        """The ledger's (q, sigma_eff) counts (:class:`~raydp.privacy.accounting.grid.StepHistogram`)."""
        h = StepHistogram()
        h.add_arrays(*self.arrays())
        return h

    # -- persistence -------------------------------------------------------------------------------
    _RELEASE_TYPE = pa.struct([("name", pa.string()), ("sensitivity", pa.float64()),
                               ("noise_std", pa.float64())])
    SCHEMA = pa.schema([
        ("step", pa.int64()),
        ("q", pa.float64()),
        ("sigma_eff", pa.float64()),
        ("clip", pa.list_(pa.float64())),
        ("allocation", pa.string()),
        ("releases", pa.list_(_RELEASE_TYPE)),
    ])

    def to_arrow(self) -> pa.Table:
        releases = [[{"name": r.name, "sensitivity": r.sensitivity, "noise_std": r.noise_std} for r in rel]
                    for rel in self._releases]
        table = pa.Table.from_arrays([
            pa.array(self._steps, pa.int64()),
            pa.array(self._q, pa.float64()),
            pa.array(self._sigma, pa.float64()),
            pa.array([None if c is None else list(c) for c in self._clip], pa.list_(pa.float64())),
            pa.array(self._alloc, pa.string()),
            pa.array(releases, pa.list_(self._RELEASE_TYPE)),
        ], schema=self.SCHEMA)
        meta = dict(self.metadata)
        meta.update(format_version=FORMAT_VERSION, num_steps=len(self),
                    sigma_eff="1/sigma_eff^2 = sum_j (sensitivity_j / noise_std_j)^2 over the step's releases")
        kv = {_META_KEY: json.dumps(meta, sort_keys=True).encode()}
        for key in ("neighbouring_relation", "delta", "epsilon_target", "accountant"):
            kv[key.encode()] = json.dumps(meta.get(key)).encode()
        return table.replace_schema_metadata(kv)

    def save(self, path: str | os.PathLike) -> Path:
        """Write the ledger as Parquet. ``path`` is a file whose name contains 'ledger', or a directory
        (the file is then ``<dir>/privacy_ledger.parquet``). Written atomically and owner-only
        (:func:`raydp.files.atomic_replace`: a unique temporary name, fsync, rename), so two writers never share a
        temporary file and a crash leaves the previous ledger whole."""
        path = Path(path)
        if path.is_dir():
            path = path / LEDGER_FILENAME
        if "ledger" not in path.name:
            raise ConfigError(f"a ledger file name must contain 'ledger', got {path.name!r}")
        table = self.to_arrow()
        return atomic_replace(path, lambda tmp: pq.write_table(table, tmp))

    @classmethod
    def load(cls, path: str | os.PathLike) -> PrivacyLedger:
        """Read a ledger written by :meth:`save`; each row's sigma_eff is checked against its releases."""
        path = Path(path)
        if path.is_dir():
            path = path / LEDGER_FILENAME
        try:
            table = pq.read_table(path)
        except (OSError, pa.ArrowInvalid) as e:
            raise DataError(f"cannot read privacy ledger {path}: {e}") from None
        missing = [c for c in cls.SCHEMA.names if c not in table.column_names]
        if missing:
            raise DataError(f"{path}: not a privacy ledger (missing columns {', '.join(missing)})")
        kv = table.schema.metadata or {}
        meta = json.loads(kv[_META_KEY]) if _META_KEY in kv else {}
        if meta.get("neighbouring_relation", NEIGHBOURING_RELATION) not in NEIGHBOURING_RELATIONS:
            raise DataError(f"{path}: neighbouring relation {meta.get('neighbouring_relation')!r}, "
                            f"expected one of {', '.join(NEIGHBOURING_RELATIONS)}")
        for k in ("format_version", "num_steps", "sigma_eff"):
            meta.pop(k, None)
        ledger = cls(**{k: meta.pop(k, None) for k in ("delta", "epsilon_target", "accountant")},
                     metadata=meta)
        ledger.extend_from_arrow(table, source=str(path))
        return ledger

    def extend_from_arrow(self, table: pa.Table, source: str = "ledger table") -> None:
        """Append the rows of a table written by :meth:`to_arrow` (a checkpoint, a saved ledger); each
        row's sigma_eff is checked against its releases."""
        cols = table.to_pydict()
        for step, q, sigma, clip, alloc, rel in zip(cols["step"], cols["q"], cols["sigma_eff"], cols["clip"],
                                                    cols["allocation"], cols["releases"]):
            releases = [Release(r["name"], r["sensitivity"], r["noise_std"]) for r in rel]
            got = self.record(q, releases, clip=clip, allocation=alloc, step=step)
            if not (got == sigma or math.isclose(got, sigma, rel_tol=1e-12)):
                raise DataError(f"{source}: step {step} has sigma_eff {sigma} but its releases give {got}")
