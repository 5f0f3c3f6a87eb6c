"""A trial's row of ``results.parquet``, read from its run directory.

The row holds the trial's identity (:meth:`raydp.study.trial.Trial.row`) and what its run wrote: the run's
``summary.json`` (perplexity and the value-token NLL on both splits, steps, every accountant's epsilon and the
labels of the run's epsilon, the dataset's identity, a non-private phase 1), its ``config.json`` as written, and
the attacks and audit of its ``evaluation.json`` (not a DP release: never selected on, ERRATA E15). The columns
are listed in :mod:`raydp.study.results`, which writes the table; every file is named by
:class:`raydp.run_directory.RunDirectory`.
"""

from __future__ import annotations

import json
from pathlib import Path

from raydp.data.identity import identity_of
from raydp.data.public_records import SYNTHETIC_PUBLIC
from raydp.evaluation.results import flat_metrics
from raydp.privacy.accounting import REPORTED_ACCOUNTANTS
from raydp.run_directory import RunDirectory
from raydp.study.trial import Trial


def trial_labels(summary: dict | None) -> list[str]:
    """The labels of a run's epsilon (ERRATA E3, E12...): its summary's ``privacy.labels`` plus the
    paper-mode ``privacy.privacy_label`` (summaries written before ``labels`` existed have only that)."""
    privacy = (summary or {}).get("privacy") or {}
    labels = [str(label) for label in (privacy.get("labels") or [])]
    if privacy.get("privacy_label"):
        labels.append(str(privacy["privacy_label"]))
    return list(dict.fromkeys(labels))


def read_run_summary(run_dir: str | Path) -> dict | None:
    """A run's ``summary.json`` as written, or None where the run wrote none (it did not finish)."""
    run = RunDirectory(run_dir)
    return run.read_summary().raw if run.summary.exists() else None


def _trial_row(trial: Trial, run_dir: Path, status: str, result: dict, s: dict | None = None) -> dict:
    """One results row: the trial's identity (:meth:`raydp.study.trial.Trial.row`), then what its run produced."""
    identity = trial.row()
    row = {"trial": identity.pop("trial"), "status": status, **identity, "run_dir": str(run_dir),
           "trial_seconds": result.get("trial_seconds")}
    if result.get("evaluation_error"):  # the study's `evaluate:` failed after training (the trial stands)
        row["evaluation_error"] = result["evaluation_error"]
    s = s if s is not None else read_run_summary(run_dir)
    if s is None:
        return row
    run = RunDirectory(run_dir)
    privacy = s.get("privacy") or {}
    eps = privacy.get("epsilon_by_accountant") or {}
    labels = trial_labels(s)
    row.update({
        "config": run.config.read_text() if run.config.exists() else None,
        "initial_eval_perplexity": s["initial_eval_perplexity"], "final_eval_perplexity": s["final_eval_perplexity"],
        "best_eval_perplexity": s["best_eval_perplexity"],
        **{f"{w}_public_perplexity": _float_or_nan(s.get(f"{w}_public_perplexity"))
           for w in ("initial", "final", "best")},
        **{f"{w}_{split}_value_nll": s[f"{w}_{split}_value_nll"]  # the primary metric (nats per record)
           for w in ("initial", "final", "best") for split in ("eval", "public") if f"{w}_{split}_value_nll" in s},
        "steps": s["steps"],
        "planned_steps": privacy.get("planned_steps", s["steps"]),
        **{f"epsilon_{a}": eps.get(a) for a in REPORTED_ACCOUNTANTS},
        "enforcing_accountant": privacy.get("enforcing_accountant"), "within_budget": privacy.get("within_budget"),
        "verdict": privacy.get("verdict"), "privacy_mode": privacy.get("privacy_mode"),
        "privacy_label": privacy.get("privacy_label"), "privacy_labels": "; ".join(labels) or None,
        "epsilon": privacy.get("epsilon"), "guarantee": privacy.get("guarantee"),
        "privacy_unit": privacy.get("privacy_unit"),
        "dataset_id": identity_of(s),
        "rdp_curve_source": ("local" if privacy.get("guarantee") == "local" else "renyi_filter"
                             if privacy.get("filter") is not None else "ledger")
        if privacy.get("epsilon") is not None else None,
        "wall_seconds": s["wall_seconds"],
        "public_validation": public_records_name(s.get("public_validation")),
        **{k: s[k] for k in ("final_eval_accuracy", "final_public_accuracy", "best_public_accuracy") if k in s},
        **_phase_one_columns(s.get("phase_one")),
    })
    evaluation = run.evaluation  # attacks and audit (not a DP release, E15): never selected on
    if evaluation.exists():
        row.update(flat_metrics(json.loads(evaluation.read_text())))
    return row


def _phase_one_columns(phase: dict | None) -> dict:
    """A non-private phase 1 (DualTune-GhostDP): its data, steps and the secret detector's recall."""
    if not phase or "data" not in phase:
        return {}
    canary = phase.get("canary_recall_private") or {}
    fields = (phase.get("field_recall_public") or {}).get("overall") or {}
    return {"phase1_data": phase["data"], "phase1_steps": phase.get("steps"),
            "phase1_public_perplexity": phase.get("public_perplexity_after"),
            "detector_canary_recall": canary.get("recall"), "detector_field_recall": fields.get("recall")}


def public_records_name(value: str | None) -> str | None:
    """What a trial validated and selected on, as its results row names it: raydp's synthetic public population, or
    the file name (not the path) of the user's public records."""
    if value is None or value == SYNTHETIC_PUBLIC:
        return value
    return Path(value).name


def _float_or_nan(x) -> float:
    return float("nan") if x is None else float(x)
