"""What a private selection (:mod:`raydp.study.private_selection`) releases and what that costs: the released
files' notes (PRIVACY.txt), the released run summary's allowlist, the study's composed guarantee over its cells
(:func:`compose_cells`) and its summary, and the terminal's table of released cells."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from raydp.errors import ConfigError
from raydp.privacy.accounting.rdp import DEFAULT_ORDERS, rdp_epsilon
from raydp.privacy.ledger import NEIGHBOURING_RELATION

if TYPE_CHECKING:  # the plans' type only: private_selection imports this module
    from raydp.study.private_selection import CellPlan

#: the released trials' private eval figures (for the data owner; private)
OWNER_REPORT = Path("work") / "owner-report.json"
RELEASED_CELL_NOTE = """A run selected privately (raydp study, selection: private-dp). Everything in this directory is
releasable: adapter/ (the trained adapters), config.json, privacy_ledger.parquet (the run's training releases),
summary.json (no timings, no private eval figures) and selection.json (its drawn settings, its DP score and the
guarantee). The guarantee of the release is privacy.end_to_end in summary.json (also in selection.json), which
covers the selection among a secret number of trials; privacy.epsilon is the run's training alone.
`raydp eval` on this directory writes its evaluation (attacks on private records: private) to the study's
work/evaluations/, never here.
"""


def released_cell_note(plan: CellPlan, total: dict) -> str:
    """A released cell's PRIVACY.txt: what is in it, what this cell costs and what releasing every cell costs."""
    return (RELEASED_CELL_NOTE
            + f"This cell alone costs (epsilon, delta) = ({plan.end_to_end_epsilon:.4g}, {plan.delta:g}). Releasing "
              f"all of released/ (the study's {total['cells']} cell(s), this one included) costs (epsilon, delta) = "
              f"({total['epsilon']:.4g}, {total['delta']:g}): the RDP composition of every cell's end-to-end "
              "curve, those that released nothing (K = 0) counted too (selection.json, all_cells).\n")


PRIVATE_SELECTION_NOTE = """What in this study directory is private (selection: private-dp, ERRATA E11-E15):
- dataset/  the private splits: never release.
- work/     the mechanism's secret state (the number of trials of each cell and their settings), every trial's
            run directory, score and Tune state, and what `raydp eval` measured on the released cells
            (work/evaluations/): keep private. Releasing any of it voids the end-to-end epsilon.
Releasable: released/ (per cell: the selected trial's adapter/, summary.json without timings, config.json,
privacy_ledger.parquet, PRIVACY.txt, and selection.json with its settings, its DP score and the end-to-end
guarantee), study.json and study_summary.json. The private eval split's figures of the released trials (not a DP
release, ERRATA E15) are in work/owner-report.json, for the data owner.
Not in any file here but still telling how many trials ran: the study's run time; the released files' and folders'
change times (ctime) and birth times (btime, where the filesystem keeps one: `stat` shows it as Birth): their
modification and access times are set to the study's start, but they were created and stamped at its end, after
every trial. Copy them with cp, rsync or Python's tarfile (the copies are born and changed when copied), not with
tar --format=posix, which keeps ctime, and do not hand over the filesystem or a snapshot of it; and Ray's temporary
folder (its logs and Tune's staged copy name every trial): owner-only and removed when the study's process ends
where raydp started Ray; on a joined cluster, its nodes' folders (/tmp/ray by default): keep them private too.
"""


def study_privacy_note(total: dict) -> str:
    """The study directory's PRIVACY.txt: :data:`PRIVATE_SELECTION_NOTE` and what releasing every cell costs."""
    return PRIVATE_SELECTION_NOTE + f"The guarantee (study_summary.json, all_cells): {all_cells_line(total)}.\n"


def cell_key(model: str, epsilon: float, seed: int) -> str:
    return f"{model}_eps{epsilon:g}_seed{seed}"


#: what the study's total covers, in every file that states it
ALL_CELLS_NOTE = ("releasing all of released/ costs this (epsilon, delta): the RDP composition of every cell's "
                  "end-to-end curve, every cell of the study counted, those that released nothing (K = 0) too (a "
                  "cell's guarantee is its mechanism's, whose output includes releasing nothing, fixed before K was "
                  "drawn); the same curves were charged to the dataset's lifetime budget, if it has one. One cell "
                  "alone costs its own end_to_end_epsilon")


def compose_cells(plans: dict[str, CellPlan]) -> dict:
    """What releasing every cell of the study costs, together: the cells' end-to-end RDP curves added order by order
    (Mironov 2017, "Renyi Differential Privacy", Prop. 1: RDP composes by adding curves, also when a mechanism is
    chosen after seeing the others' outputs; every cell runs on the study's one dataset), converted to (epsilon,
    delta) at the study's delta as each cell's is (:func:`~raydp.privacy.accounting.rdp.rdp_epsilon`: Balle et al.
    2020, Thm. 21). Each cell's curve is its repeat-and-select curve, which does not depend on its K, so the total is
    fixed before any K is drawn and counts every cell, one whose K was 0 included: Thm. 6's guarantee is for the
    mechanism whose output includes releasing nothing; dropping the cells that released nothing would condition
    the others on K >= 1, a zero-truncated law the theorem does not cover."""
    if not plans:
        raise ConfigError("a private selection needs at least one cell")
    deltas = {plan.delta for plan in plans.values()}
    if len(deltas) != 1:
        raise ConfigError(f"the study's cells have different deltas ({sorted(deltas)}): their composition is stated "
                          "at one delta")
    delta = deltas.pop()
    total = np.sum([plan.end_to_end_curve for plan in plans.values()], axis=0)
    cells = [plan.end_to_end_epsilon for plan in plans.values()]
    return {"epsilon": rdp_epsilon(total, DEFAULT_ORDERS, delta), "delta": delta, "cells": len(plans),
            "smallest_cell_epsilon": min(cells), "largest_cell_epsilon": max(cells),
            "composition": "RDP: the cells' end-to-end curves added at every order (Mironov 2017, Prop. 1), "
                           "converted at delta (Balle et al. 2020, Thm. 21)",
            "note": ALL_CELLS_NOTE}


def study_figure(plans: dict[str, CellPlan], dataset_id: str) -> dict:
    """The study's spend on its dataset in the shape of a grid study's tuning-aware figure
    (:func:`raydp.study.results.compose_dataset`'s keys that ``raydp report`` composes across studies): the same
    total as :func:`compose_cells`, each cell a composed run (by its end-to-end curve); no count of trials (K is
    secret) and no repeat-and-select figure over the cells (they are not trials of one selection)."""
    total = compose_cells(plans)
    delta = total["delta"]
    units = sorted({plan.privacy_unit for plan in plans.values()})
    return {"dataset_id": dataset_id, "selection": "private-dp", "cells": len(plans), "delta": delta,
            "tuning_aware_epsilon": total["epsilon"], "composition_epsilon_rdp": total["epsilon"],
            "largest_cell_epsilon": total["largest_cell_epsilon"],
            "target_epsilons": sorted({plan.epsilon for plan in plans.values()}),
            "composed": [{"name": key, "kind": "private_selection_cell", "curve": "end_to_end",
                          "epsilon_target": plan.epsilon, "epsilon_rdp": plan.end_to_end_epsilon}
                         for key, plan in plans.items()],
            "labels": [], "privacy_units": units, "neighbouring_relations": [NEIGHBOURING_RELATION],
            "unknown_spend": [], "warnings": [],
            "orders": "raydp.privacy.accounting.rdp.DEFAULT_ORDERS",
            "note": "tuning_aware_epsilon composes every cell of this private selection by its end-to-end curve "
                    "(the selection among its secret number of trials included), whatever it released"}


def _epsilons(low: float, high: float) -> str:
    return f"{low:.4g}" if f"{low:.4g}" == f"{high:.4g}" else f"{low:.4g} to {high:.4g}"


def all_cells_line(total: dict) -> str:
    """One sentence: what releasing every cell costs, and one cell alone (PRIVACY.txt, the terminal)."""
    return (f"releasing all of released/ costs (epsilon, delta) = ({total['epsilon']:.4g}, {total['delta']:g}), "
            f"the RDP composition of the study's {total['cells']} cell(s), those that released nothing (K = 0) "
            f"counted too; one cell alone costs its own end-to-end epsilon "
            f"({_epsilons(total['smallest_cell_epsilon'], total['largest_cell_epsilon'])} at delta "
            f"{total['delta']:g})")


def selection_summary(name: str, released: list[dict], plans: dict[str, CellPlan], dataset_id: str) -> dict:
    """A private-dp study's ``study_summary.json``: each cell's description (``released``, from :func:`_release`),
    what releasing all of them costs (:func:`compose_cells`) and the same as the dataset's figure that ``raydp
    report`` composes with other studies on it (:func:`study_figure`)."""
    return {"study": name, "selection": "private-dp", "released": released, "all_cells": compose_cells(plans),
            "tuning_aware_epsilon": {dataset_id: study_figure(plans, dataset_id)},
            "note": "each cell released its best trial only; the number of trials, the other trials and every "
                    "timing are private (work/)"}


#: the run-summary fields a released trial keeps (an allowlist: the privacy block, what the model and data are, the
#: steps, the PUBLIC validation's figures); not the private eval split's figures, timings, phase_one or controller
RELEASED_SUMMARY_KEYS = (
    "raydp_version", "model", "model_source", "model_type", "device", "n_adapter_pairs", "adapter_pairs", "strategy",
    "privacy", "dropout", "stopped_early", "data_source", "dataset_id", "data_note", "public_eval_records",
    "max_length", "steps", "steps_per_epoch", "initial_public_perplexity", "final_public_perplexity",
    "best_public_perplexity", "initial_public_value_nll", "final_public_value_nll", "best_public_value_nll",
    "final_public_nll_per_record", "task", "public_validation", "public_validation_note")


def released_summary(run_summary: dict, plan: CellPlan, theorem: str) -> dict:
    """A selected run's summary as released: the allowlisted fields only (no timing: they follow the private batch
    sizes and K; no figure of the private eval split: not a DP release, it stays in ``work/`` for the data owner),
    with the end-to-end guarantee that applies to it."""
    out = {k: run_summary[k] for k in RELEASED_SUMMARY_KEYS if k in run_summary}
    out["privacy"] = {**(run_summary.get("privacy") or {}), "end_to_end": {
        "epsilon": plan.end_to_end_epsilon, "delta": plan.delta, "theorem": theorem,
        "note": "this run was selected privately among a secret number of trials: the released result's "
                "guarantee is this end-to-end epsilon, not the run's own (privacy.epsilon: its training alone)"}}
    return out


def format_selection(study_dir: Path) -> str:
    """The released cells as a table for the terminal (``raydp study`` / ``raydp report``), with what composing
    E[K] (rounded up) trials would have cost beside the end-to-end epsilon. The released trials' private eval
    figures are not printed (terminal logs travel): they are in ``work/owner-report.json``, for the data owner."""
    summary = json.loads((Path(study_dir) / "study_summary.json").read_text())
    total = summary.get("all_cells")
    lines = [f"study {summary['study']}: private selection (selection: private-dp); each cell released its best "
             "trial only",
             f"all cells: {all_cells_line(total)}" if total else
             "all cells: this study's summary does not state their composition (written before raydp did): releasing "
             "several cells costs more than any one cell's end-to-end epsilon",
             f"{'cell':<26} {'trial eps':>9} {'end-to-end':>10} {'composed':>8} {'basic':>6} {'DP score':>10} "
             f"{'public NLL':>10}  settings"]
    for e in summary["released"]:
        cell = cell_key(e["model"], e["epsilon"], e["seed"])
        other = e.get("for_comparison") or {}
        head = (f"{cell:<26} {e['trial_epsilon']:>9.4g} {e['end_to_end_epsilon']:>10.4g} "
                f"{other.get('rdp_composition_epsilon', float('nan')):>8.3g} "
                f"{other.get('basic_composition_epsilon', float('nan')):>6.3g}")
        if not e.get("released"):
            lines.append(f"{head} {'-':>10} {'-':>10}  nothing released (K = 0)")
            continue
        settings = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in e["settings"].items())
        public = e.get("final_public_value_nll")
        lines.append(f"{head} {e['score']:>10.1f} {(f'{public:.3f}' if public is not None else '-'):>10}  {settings}")
    if summary["released"]:
        first = summary["released"][0]
        lines.append(f"composed / basic: RDP and basic composition of {first['for_comparison']['trials']} trials "
                     "(E[K] rounded up), what releasing every trial would cost; the DP score (private validation "
                     "split, a noisy sum over its patients) chose each trial; public NLL: the released trial's public "
                     f"validation value-token NLL; its private eval figures, for the data owner only: "
                     f"{OWNER_REPORT}; {first['theorem']}")
    return "\n".join(lines)
