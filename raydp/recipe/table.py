"""The recipe table: training settings searched on PUBLIC data, per (model, strategy, epsilon), shipped as data.

``recipes.json`` (beside this module, in the wheel) holds the table: a format version, the table's own version, and
entries. An entry names a model and a strategy exactly, the compute tier it was searched at ("default": today's
records processed per run, 3 epochs of the train split; "3x": three times them), the train-set size it was searched at, its points (an epsilon and the settings the
search chose there; a non-private strategy has one point without an epsilon) and its provenance: the study file
that searched it, the public dataset ids it ran on, the commit, the criterion, which settings were searched and
which were not (those keep the values they had in the search, today's defaults).

:func:`resolve` gives a run's recipe from public config values only (model, strategy, epsilon): it reads this
package's table and nothing else, never a dataset, so using a recipe is post-processing of public data and costs no
privacy budget. Between two points an epsilon is interpolated in log epsilon: log-linear for the continuous settings
(``lr``, ``clip``), linear for ``lr_end`` and ``weight_decay`` (they may be 0), the nearer point's value for the
categorical and integer ones (``batch_size``, ``epochs``, ``warmup_steps``, ``lr_decay``; a tie takes the smaller
epsilon's). Outside the searched range the nearest point's settings are taken, and the resolved record says the
epsilon was clamped. A run asks for a tier (``TrainConfig.compute``); where the table has no entry at that tier for the
(model, strategy) but one at the default tier, the default entry's settings are taken with its epochs multiplied by the
tier's factor, and the record says the tier was not searched for that strategy.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from raydp.errors import ConfigError
from raydp.settings import StrictModel, validate_config

#: the table shipped in the package
RECIPES_FILE = Path(__file__).resolve().with_name("recipes.json")
#: the ``format`` a table file declares, and the format versions this code reads
TABLE_FORMAT = "raydp-recipes"
FORMAT_VERSIONS = (1,)

#: the TrainConfig fields a recipe may fill, in the order a record lists them
RECIPE_FIELDS = ("batch_size", "epochs", "lr", "lr_decay", "lr_end", "warmup_steps", "weight_decay", "clip")
#: interpolated log-linearly in log epsilon (positive by their constraints)
LOG_LINEAR = ("lr", "clip")
#: interpolated linearly in log epsilon (0 allowed)
LINEAR = ("lr_end", "weight_decay")
#: the settings whose value is the nearer point's
NEAREST = ("batch_size", "epochs", "warmup_steps", "lr_decay")

RECIPE_CHOICES = ("auto", "none")
#: compute tiers: records processed per run, as a multiple of the default tier's (3 epochs of the train split)
TIER_FACTORS = {"default": 1, "3x": 3}
COMPUTE_TIERS = tuple(TIER_FACTORS)


class RecipeSettings(StrictModel):
    """The run settings of one point (None: the recipe leaves the field to its default); the constraints are
    TrainConfig's (tests/test_recipe.py validates every point as a TrainConfig)."""

    batch_size: int | None = Field(None, gt=0)
    epochs: float | None = Field(None, gt=0)
    lr: float | None = Field(None, gt=0)
    lr_decay: Literal["constant", "linear", "cosine"] | None = None
    lr_end: float | None = Field(None, ge=0, le=1)
    warmup_steps: int | None = Field(None, ge=0)
    weight_decay: float | None = Field(None, ge=0)
    clip: float | None = Field(None, gt=0)


class RecipePoint(StrictModel):
    """The settings a search chose at one epsilon (None: a non-private strategy's one point)."""

    epsilon: float | None = Field(None, gt=0)
    settings: RecipeSettings
    public_value_nll: float | None = Field(None, description="the chosen trial's final public validation "
                                           "value-token NLL, nats per record")
    trial: str | None = Field(None, description="the chosen trial of the search")
    # a point whose values come from another search than its entry's says so (None: the entry's provenance)
    source: str | None = Field(None, description="the study file and commit this point's values come from")
    searched: list[str] | None = Field(None, description="the settings that search varied at this point")


class Provenance(StrictModel):
    """Where an entry's numbers come from."""

    study_file: str  # the pre-registered study that searched it (a path in the repository)
    tuning_record: str | None = None  # its committed record (trials/tuned/...)
    dataset_ids: list[str]  # the public datasets it ran on (every one public:...)
    commit: str  # the commit the search ran at
    criterion: str
    trials_per_point: int = Field(gt=0)
    searched: list[str]  # the settings the search varied
    not_searched: dict[str, str]  # setting: why its value is what it is
    note: str | None = None
    # where the choice between candidates read DP runs on data other than the public population (a benchmark's
    # synthetic private records): what, and the composed epsilon on that data. Never a user's data.
    selected_on: str | None = None

    @model_validator(mode="after")
    def _public(self):
        if not self.dataset_ids or any(not i.startswith("public:") for i in self.dataset_ids):
            raise ValueError("a recipe is searched on public data only: every dataset id is public:...")
        unknown = sorted((set(self.searched) | set(self.not_searched)) - set(RECIPE_FIELDS))
        if unknown:
            raise ValueError(f"not a recipe setting: {unknown[0]}")
        return self


class SearchedAt(StrictModel):
    """The train-set size the entry was searched at (the lookup reads no data, so a run's size is not checked)."""

    train_records: tuple[int, int]  # (smallest, largest) train split of the searched datasets
    train_units: tuple[int, int] | None = None  # the same in privacy units (patients): q = batch_size / units
    data: str  # the searched data, in words


class RecipeEntry(StrictModel):
    model: str
    strategy: str
    compute_tier: Literal["default", "3x"] = "default"
    searched_at: SearchedAt
    points: list[RecipePoint] = Field(min_length=1)
    provenance: Provenance

    @property
    def key(self) -> str:
        return f"{self.model}/{self.strategy}/{self.compute_tier}"

    @model_validator(mode="after")
    def _points(self):
        epsilons = [p.epsilon for p in self.points]
        if None in epsilons:
            if len(epsilons) != 1:
                raise ValueError("a point without an epsilon (a non-private strategy's) must be the entry's only one")
        elif epsilons != sorted(set(epsilons)):
            raise ValueError("an entry's points are in increasing epsilon, each once")
        names = {tuple(sorted(k for k, v in p.settings.model_dump().items() if v is not None)) for p in self.points}
        if len(names) != 1:
            raise ValueError("every point of an entry sets the same settings")
        set_here = set(next(iter(names)))
        if any(p.searched is not None and not set(p.searched) <= set_here for p in self.points):
            raise ValueError("a point's searched settings must be settings the entry sets")
        said = set(self.provenance.searched) | set(self.provenance.not_searched)
        if set_here != said:
            raise ValueError(f"provenance must say, for each setting the entry sets ({', '.join(sorted(set_here))}), "
                             "whether it was searched")
        return self


class RecipeTable(StrictModel):
    format: Literal["raydp-recipes"]
    format_version: int
    version: str  # the table's own version (v0, v1, ...): a recorded run names it
    note: str | None = None
    entries: list[RecipeEntry]

    @model_validator(mode="after")
    def _unique(self):
        if self.format_version not in FORMAT_VERSIONS:
            raise ValueError(f"format_version {self.format_version} is not one this raydp reads "
                             f"({', '.join(map(str, FORMAT_VERSIONS))})")
        keys = [e.key for e in self.entries]
        if len(keys) != len(set(keys)):
            raise ValueError("two entries for one (model, strategy, compute tier)")
        return self


@functools.cache
def load_table(path: Path) -> RecipeTable:
    """The recipe table in ``path``, validated (ConfigError naming the file otherwise); read once per path."""
    try:
        values = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"recipe table {path} is not readable JSON: {exc}") from None
    try:
        return validate_config(RecipeTable, values)
    except ConfigError as exc:
        raise ConfigError(f"recipe table {path}: {exc}") from None


def shipped_table() -> RecipeTable:
    """The table shipped in the package (:data:`RECIPES_FILE`)."""
    return load_table(RECIPES_FILE)


@dataclass(frozen=True)
class Resolved:
    """A run's recipe: the entry, where its epsilon fell, and the settings."""

    table_version: str
    entry: RecipeEntry
    epsilon: float | None
    how: str  # "at epsilon 2", "between epsilon 0.5 and 2 (log-epsilon interpolation)", "clamped: ..."
    clamped: bool
    settings: dict  # field: value, only the fields the entry sets
    tier: str = "default"  # the compute tier the run asked for
    tier_note: str | None = None  # set where the tier's settings were scaled from the default tier's entry
    points: tuple = ()  # the entry's points the settings came from (one, or two when interpolated)

    def record(self, filled: dict) -> dict:
        """What a run records (config.json ``recipe_applied``, the summary's ``recipe``): the entry, how the
        epsilon was placed, and the fields the recipe ``filled`` (those the run left unset) with their values."""
        provenance = self.entry.provenance
        default_source = f"{provenance.study_file} on {', '.join(provenance.dataset_ids)} at {provenance.commit}"
        points = self.points or tuple(self.entry.points)
        sources = list(dict.fromkeys(p.source or default_source for p in points))
        # a setting counts as searched only where every point it came from searched it
        searched = set.intersection(*(set(p.searched if p.searched is not None else provenance.searched)
                                      for p in points))
        return {"entry": self.entry.key, "table": f"{TABLE_FORMAT} {self.table_version}",
                "compute_tier": self.tier, "epsilon": self.epsilon, "how": self.how,
                "clamped": self.clamped, **({"tier_note": self.tier_note} if self.tier_note else {}),
                "filled": {k: filled[k] for k in RECIPE_FIELDS if k in filled},
                "searched": [k for k in RECIPE_FIELDS if k in filled and k in searched],
                "not_searched": [k for k in RECIPE_FIELDS if k in filled and k not in searched],
                "source": "; ".join(sources),
                **({"selected_on": provenance.selected_on} if provenance.selected_on else {}),
                "searched_at_train_records": list(self.entry.searched_at.train_records)}


def _fmt(epsilon: float) -> str:
    return f"{epsilon:g}"


def _interpolate(low: RecipePoint, high: RecipePoint, epsilon: float) -> dict:
    t = (math.log(epsilon) - math.log(low.epsilon)) / (math.log(high.epsilon) - math.log(low.epsilon))
    a, b = low.settings.model_dump(exclude_none=True), high.settings.model_dump(exclude_none=True)
    out = {}
    for key in a:
        if key in LOG_LINEAR:
            out[key] = float(math.exp((1 - t) * math.log(a[key]) + t * math.log(b[key])))
        elif key in LINEAR:
            out[key] = float((1 - t) * a[key] + t * b[key])
        else:  # NEAREST: the nearer point in log epsilon, a tie the smaller epsilon's
            out[key] = a[key] if t <= 0.5 + 1e-9 else b[key]  # log rounding: epsilon 4 between 2 and 8 is a tie
    return out


def find_entry(table: RecipeTable, model: str, strategy: str, tier: str = "default") -> RecipeEntry | None:
    return next((e for e in table.entries if (e.model, e.strategy, e.compute_tier) == (model, strategy, tier)), None)


def resolve(model: str, strategy: str, epsilon: float | None, table: RecipeTable | None = None,
            tier: str = "default") -> Resolved | None:
    """The recipe of a run of ``strategy`` on ``model`` at ``epsilon`` (None for a non-private run) and compute
    ``tier``, from public config values only; None where the table has no entry for the exact (model, strategy), or
    a DP entry is asked without an epsilon. A tier without its own entry takes the default tier's, its epochs scaled
    by :data:`TIER_FACTORS` (recorded in ``tier_note``)."""
    if tier not in TIER_FACTORS:
        raise ConfigError(f"compute tier {tier!r} is not one of {', '.join(COMPUTE_TIERS)}")
    table = shipped_table() if table is None else table
    entry = find_entry(table, model, strategy, tier)
    note = None
    if entry is None and tier != "default":
        entry = find_entry(table, model, strategy)
        note = (f"the {tier} tier was not searched for {strategy}: the default tier's settings with its epochs x"
                f"{TIER_FACTORS[tier]}")
    if entry is None:
        return None
    found = _resolve_entry(table, entry, epsilon)
    if found is None:
        return None
    if note is not None and "epochs" in found.settings:
        found = replace(found, settings={**found.settings, "epochs": found.settings["epochs"] * TIER_FACTORS[tier]})
    return replace(found, tier=tier, tier_note=note)


def _resolve_entry(table: RecipeTable, entry: RecipeEntry, epsilon: float | None) -> Resolved | None:
    points = entry.points
    if points[0].epsilon is None:  # a non-private entry: its one point
        return Resolved(table.version, entry, None, "non-private (no epsilon)", False,
                        points[0].settings.model_dump(exclude_none=True), points=(points[0],))
    if epsilon is None:
        return None
    lowest, highest = points[0].epsilon, points[-1].epsilon
    searched = f"the searched range [{_fmt(lowest)}, {_fmt(highest)}]"
    if epsilon < lowest or epsilon > highest:
        point = points[0] if epsilon < lowest else points[-1]
        side = "below" if epsilon < lowest else "above"
        return Resolved(table.version, entry, epsilon, f"clamped: epsilon {_fmt(epsilon)} is {side} {searched}, so "
                        f"the settings of epsilon {_fmt(point.epsilon)}", True,
                        point.settings.model_dump(exclude_none=True), points=(point,))
    for point in points:
        if math.isclose(point.epsilon, epsilon, rel_tol=1e-12):
            return Resolved(table.version, entry, epsilon, f"at epsilon {_fmt(point.epsilon)}", False,
                            point.settings.model_dump(exclude_none=True), points=(point,))
    low, high = next((a, b) for a, b in zip(points, points[1:]) if a.epsilon < epsilon < b.epsilon)
    return Resolved(table.version, entry, epsilon, f"between epsilon {_fmt(low.epsilon)} and {_fmt(high.epsilon)} "
                    "(log-epsilon interpolation)", False, _interpolate(low, high, epsilon), points=(low, high))


def recipe_line(record: dict | None) -> str:
    """A run's recipe in one line: the entry, the table, the compute tier, where the epsilon fell, what it filled."""
    if not record:
        return "none (every recipe setting given, or recipe: none: today's defaults)"
    filled = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in record["filled"].items())
    tier = f"{record.get('compute_tier', 'default')} tier" + (f" ({record['tier_note']})" if record.get("tier_note") else "")
    chosen = "; chosen on DP runs of a benchmark's synthetic records" if record.get("selected_on") else ""
    return (f"{record['entry']} ({record['table']}, {tier}, {record['how']}; searched on public data{chosen}, "
            f"no budget on your data): {filled}")
