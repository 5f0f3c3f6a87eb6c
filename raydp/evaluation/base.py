"""What an attack is to the rest of raydp: an :class:`AttackSpec` (what it runs, its headline line, its flat
columns, its report table), registered in :mod:`raydp.evaluation.registry`. A spec's module stays light (no torch
at import): studies, results and reports read specs without loading a model; ``run`` imports what it needs."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from raydp.data import load_canaries, load_split


@dataclass
class AttackContext:
    """What :func:`raydp.evaluation.evaluate.evaluate_run` hands every attack: the trained model and its run."""

    run_dir: Any
    config: Any  # the run's TrainConfig
    summary: dict  # the run's summary.json
    dataset: Any  # the run's dataset directory
    settings: Any  # EvalConfig
    loaded: Any  # the loaded model (model, tokenizer, device, max_positions)
    rng: Any  # the attacks' own numpy generator (public: it picks records to score, not a privacy parameter)
    confidence: float  # the audit's confidence after the family's Bonferroni correction
    result: dict  # evaluation.json so far (``claimed``, earlier attacks' results); an attack may add notes to it
    say: Callable[[str], None] = print

    @property
    def max_length(self):
        return self.summary.get("max_length")

    @cached_property
    def train(self):
        """The run's train split (read once for every attack)."""
        return load_split(self.dataset, "train")

    @cached_property
    def canaries(self):
        """The run's secret canaries (read once for every attack)."""
        return load_canaries(self.dataset)


@dataclass(frozen=True)
class Column:
    """One column of an attack's report table: mean ± std over seeds of the value at ``path`` in
    evaluation.json (``span``: min-max of the value instead, for a setting that may differ between trials)."""

    header: str
    path: tuple[str, ...]
    digits: int = 3
    span: bool = False


@dataclass(frozen=True)
class AttackTable:
    """The report's table of one or more attacks (``keys``: a trial is a row when any of them ran)."""

    id: str
    keys: tuple[str, ...]
    columns: tuple[Column, ...]
    caption: Callable[[list[dict]], str]  # from the evaluations shown
    missing: str  # the line shown when no evaluation ran these attacks


@dataclass(frozen=True)
class AttackSpec:
    """One attack. ``key``: its entry in evaluation.json (None when it did not run); ``run(ctx)``: the attack,
    returning that entry or None; ``summary(entry)``: its part of the one-line headline; ``flat(entry)``: its
    columns in a study's results table; ``line(row)``: its part of a trial's line in a study's terminal output, read
    from those columns in the trial's results row (None where the trial has none); ``table``: its table on the report
    page (None: shown elsewhere)."""

    key: str
    run: Callable[[AttackContext], dict | None]
    summary: Callable[[dict], str]
    flat: Callable[[dict], dict]
    line: Callable[[Mapping], str | None]
    table: AttackTable | None = None
    extra: dict = field(default_factory=dict)


def present(value) -> bool:
    """Whether a results-table cell holds a value (not None, NaN or pandas' NA): a row of a trial that was not
    attacked, or an older study's, has the attack's columns empty."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return False
    try:
        return not bool(value != value)  # pandas.NA compares to NA, whose truth value raises
    except TypeError:
        return False
