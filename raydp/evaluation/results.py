"""The evaluation's settings (:mod:`raydp.evaluation.settings`) and its output format (``evaluation.json``): light, so that studies and results
can read them without loading models (:mod:`raydp.evaluation.evaluate` runs the attacks)."""

from __future__ import annotations

from raydp.evaluation.registry import ATTACKS
from raydp.evaluation.settings import EvalConfig  # noqa: F401  (re-exported: studies import it here)
from raydp.run_directory import EVALUATION

EVALUATION_FILE = EVALUATION  # the name studies and results import from here
EVALUATION_FORMAT = 1
LABEL = ("attack and audit metrics are computed from private records (train, attack split, canaries): not a DP "
         "release, not covered by any accountant; for the data owner only, never for selection (ERRATA E15)")


def summary_line(result: dict) -> str:
    """One line: the headline numbers of an evaluation (each registered attack's that ran)."""
    parts = [spec.summary(result[spec.key]) for spec in ATTACKS if result.get(spec.key)]
    return "; ".join(parts) or "nothing evaluated"


def flat_metrics(result: dict) -> dict:
    """The headline numbers as flat columns (study results; Tune's final report)."""
    out: dict = {}
    for spec in ATTACKS:
        if result.get(spec.key):
            out.update(spec.flat(result[spec.key]))
    out["eval_seconds"] = (result.get("seconds") or {}).get("total")
    return out
