"""Attacks after the trials: what a study with ``evaluate:`` attacks under ``attack: released`` (the default).

Attacking every trial (membership inference, canary extraction, exposure and the one-run epsilon audit) costs more
than a third of an attacked trial, and most trials are never released. So by default a study trains all of its
trials first, then attacks, on the driver, the trial it would release in each (model, epsilon) cell, the one trial
the project defines as such (:func:`raydp.study.results.would_release`: the DP arm with the best mean public
selection metric over seeds, its best seed; under ``selection: none`` :func:`~raydp.study.results.fixed_release`),
plus every trial of the strategies the study file names in ``attack_strategies`` (e.g. ``nonprivate``, the leakage of
a model trained without DP). ``attack: all`` keeps attacking every trial as it finishes, inside its Tune trial, for
studies that compare the leakage of every arm.

Each attacked trial's audit is Bonferroni-corrected over every trial of the study (``audits_in_family``: the trials
it planned, fixed before any trained), not over the attacked ones: which trials are attacked depends on the trained
models through the public metric, and a union bound over a subset chosen that way holds only at the size of the set
it was chosen from. A resumed study attacks only the chosen trials without an ``evaluation.json``. What the attacks compute comes from private records:
for the data owner, not a DP release, and it chooses nothing (ERRATA E15); choosing which trials to attack reads the
public selection metric only.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pandas as pd

from raydp.run_directory import RunDirectory
from raydp.study.results import METRIC_COLUMNS, fixed_release, study_metric, would_release


def released_trials(study, table: pd.DataFrame) -> list[str]:
    """The trials ``attack: released`` attacks, in the table's order: each cell's released trial (none under
    ``selection: private``, which marks no release), then every finished trial of ``attack_strategies``."""
    if "trial" not in table or table.empty:
        return []
    column = METRIC_COLUMNS[study_metric(table)]["public"][0]
    if study.selection == "none":
        released = fixed_release(table, column)
    elif study.selection == "public" and column in table:
        released = would_release(table, column)
    else:
        released = pd.DataFrame(columns=["trial"])
    chosen = set(released["trial"])
    if study.attack_strategies and "strategy" in table:
        finished = table["status"] == "TERMINATED" if "status" in table else True
        chosen |= set(table.loc[table["strategy"].isin(study.attack_strategies) & finished, "trial"])
    return [name for name in table["trial"] if name in chosen]


def attack_released(study, study_dir: Path, table: pd.DataFrame, progress: bool) -> tuple[list[str], dict[str, str]]:
    """Attack and audit :func:`released_trials` (each one's ``evaluation.json`` in its run directory); returns the
    trials attacked and the error line of each whose evaluation failed (a failed attack fails no trial)."""
    from raydp.evaluation.evaluate import evaluate_run  # lazy: loads torch

    chosen = released_trials(study, table)
    errors: dict[str, str] = {}
    for name in chosen:
        run = RunDirectory(Path(study_dir) / "trials" / name)
        if run.evaluation.exists():  # a resumed study: attacked when it first ran
            continue
        if progress:
            print(f"raydp: attacking {name} (membership, extraction, exposure, audit)", file=sys.stderr, flush=True)
        try:
            device = (run.read_config() or {}).get("device", "auto")
            evaluate_run(run.root, study.evaluate.model_copy(update={"device": device}), progress=False,
                         audits_in_family=max(len(table), len(chosen)))
        except Exception as exc:  # noqa: BLE001 - recorded in the results, not raised
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            errors[name] = f"{type(exc).__name__}: {first}"
            logging.getLogger(__name__).warning("trial %s: evaluation failed: %s", name, first)
    return chosen, errors
