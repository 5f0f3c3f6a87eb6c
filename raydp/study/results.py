"""Study results: one Parquet row per trial, steps-to-target (RLDP Sec. 4.2), tuning-aware epsilon (E7/E14).

``results.parquet`` columns (one row per trial, read from its run directory by :mod:`raydp.study.trial_rows`):

=========================  ==========================================================================
trial, status              the trial's name (strategy_model_eps_seed[_SAC cell]) and its status:
                           TERMINATED, ERROR, INTERRUPTED (the study was stopped; --resume) or NOT_RUN
model, strategy, epsilon_target, seed, t_rl, b_sac, k    the varied settings (SAC cell: rldp only)
frozen_policy              an RLDP trial driven by a frozen policy: a transfer study's stage 2, or rldp.frozen
variant, grid, search, tuned   the trial's settings_grid / Optuna / tuned_from values as ``clip=0.03`` (variant)
                           and each as JSON (grid: older rows without it get it back from variant)
                           (these columns and the ones above: :meth:`raydp.study.trial.Trial.row`)
config                     the trial's full TrainConfig as JSON
initial/final/best_eval_perplexity     perplexity on the PRIVATE held-out eval split at step 0, at the
                           end, and the best: not a DP release, no accountant covers it (ERRATA E15)
initial/final/best_public_perplexity   the same on the PUBLIC validation split (NaN for runs written
                           before it existed): what selection uses by default (E15)
steps, planned_steps       steps run and planned (ceil(epochs / q), E10)
steps_to_target            first eval step at which the trial's selection perplexity is <= the best
                           baseline's final one (same model, epsilon and seed), divided by its planned
                           steps; NaN if never reached (Sec. 4.2; baselines = the non-RLDP DP trials)
epsilon_pld/prv/rdp/gdp/edgeworth  final epsilon from the trial's full ledger per accountant (GDP, Edgeworth:
                           approximations, ERRATA E2/E9)
enforcing_accountant, within_budget, verdict   the enforcing accountant and its verdict
privacy_mode, privacy_label   'strict' / 'paper' (+ the E3 label) for RLDP trials
privacy_labels             every label of the run's epsilon ('; '-joined; E3 paper mode, E12 void
                           epsilon...), None if it has none
dataset_id                 the dataset's identity: a keyed hash only its owner can compute
                           (:mod:`raydp.data.identity`; E14)
rdp_curve_source           'renyi_filter' (the run was enforced by a Renyi filter: its budget curve is its
                           guarantee) or 'ledger' (the RDP curve of its ledger)
trial_seconds, wall_seconds   the trial's run time as Tune saw it, and the run's own wall time
phase1_data, phase1_steps, phase1_public_perplexity   a non-private phase 1 (DualTune-GhostDP: 'public' or
                           'redacted'), its steps and the public perplexity after it
detector_canary_recall, detector_field_recall   a redacted phase 1's secret detector: recall on the run's
                           canaries (private records: not a DP release) and on sensitive fields (public records)
run_dir                    the trial's outputs (train/eval metrics, ledger, control trace, adapters)
mia_*, canary_*, exposure_*, audit_*   the trial's attacks and epsilon audit (``evaluation.json``, when
                           the study's ``evaluate:`` asked or ``raydp eval`` ran; computed from private
                           records, not a DP release: never used for selection, ERRATA E15);
                           ``evaluation_error`` where that evaluation failed (the trained trial stands)
=========================  ==========================================================================

Tuning-aware epsilon (ERRATA E7, E14). Every run that touched a private dataset spends the budget of the
people in it, whatever its target epsilon: every trial of the study (errored ones from their last
checkpoint), transfer stage-1 policy-training trials and transfer stages, trials sharing one policy, and
the runs that trained a saved policy a trial starts from (its manifest's provenance, when it names the
same dataset). The study therefore reports ONE figure per dataset identity (the dataset's keyed
``dataset_id``, :mod:`raydp.data.identity`): the RDP composition of all those runs' curves (Mironov 2017, Prop. 1: RDP at order
alpha adds up under adaptive composition), converted to (epsilon, delta) at the study's delta. Each run's
curve is, on the orders :data:`raydp.privacy.accounting.rdp.DEFAULT_ORDERS`:

* an adaptive run enforced by a Renyi filter (its summary's ``privacy.filter`` holds ``orders`` and
  ``budget_rdp``): the filter's budget curve B(alpha). Feldman & Zrnic 2021 (Thm. 3.1, "individual privacy
  filters"/Renyi filter): a run whose realized per-step RDP curves are stopped before their sum exceeds
  B(alpha) is (alpha, B(alpha))-RDP at each order, under fully adaptive choices (ERRATA E13);
* otherwise the RDP curve of its ledger, recomputed with :func:`raydp.privacy.accounting.rdp.rdp_vector`
  (the sum over steps of the Poisson-subsampled Gaussian's RDP, Mironov et al. 2019);
* a saved policy's training run: the ``rdp_orders``/``rdp_curve`` of its provenance entry.

A curve given on other orders is mapped onto the grid conservatively (:func:`curve_on_orders`: Renyi
divergence is non-decreasing in its order, van Erven & Harremoes 2014, Thm. 3). The composition holds
for a fixed grid, Optuna's adaptive choices and a shared policy alike. Beside it: the largest single trial's
epsilon and Papernot & Steinke's repeat-and-select figure (2022; dp_accounting's RDP for a Poisson(K)
number of runs of the worst trial's mechanism), which would hold only if the number of trials were random
that way and settings were drawn independently. The figure lists the labels of every composed run (paper
mode, void epsilon...), the trials that errored before any checkpoint ("unknown spend": not in the figure,
never silently dropped), non-private trials on the same data, and saved policies whose provenance is
unknown. Identity is the keyed content hash: two different datasets of the same people (e.g. two sizes of
one CSV) are not recognised as such. Skipped when the study says its data is public.

Selection (ERRATA E15): with the study's ``selection: public`` (default), Optuna, Tune's selection metric,
steps-to-target and the report's tables use the public validation split; ``selection: private`` uses the
private eval split, and results, summary and report say "selection used the private eval split:
unprotected (E15)" (also when public figures are missing from the runs).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from dp_accounting.rdp import rdp_privacy_accountant as rdp

from raydp.control.modes import resolve_values, unprotected
from raydp.control.store import load_manifest, policy_privacy_mode, provenance_of, resolve_policy
from raydp.data.identity import identity_of, manifest_id
from raydp.errors import ConfigError
from raydp.privacy.accounting.rdp import DEFAULT_ORDERS, ledger_rdp_curve, rdp_epsilon
from raydp.privacy.ledger import PrivacyLedger
from raydp.run_directory import RunDirectory
from raydp.runner.local_setup import ledger_local_plan
from raydp.strategies.base import PAPER_MODE_LABEL
from raydp.strategies.registry import is_private
# the strategy groups a study compares (defined beside the arm label; imported from here by the report and page)
from raydp.study.arms import BASELINE_EXCLUDED, CHALLENGERS, CONTROLLERS, NONPRIVATE_ARMS, arms  # noqa: F401
from raydp.study.trial import Trial, tune_trial
# a trial's row (the trainable imports trial_labels from here)
from raydp.study.trial_rows import _trial_row, read_run_summary, trial_labels

#: the metrics a study selects and reports on (lower is better), by split: (results.parquet final column,
#: eval_metrics.parquet column). ``value_nll``, the value-token NLL in nats per record (raydp.evaluation.perplexity),
#: is the benchmark's primary metric wherever the runs report it; ``perplexity`` otherwise (runs written before it,
#: a classification task, a split without value spans).
METRIC_COLUMNS = {
    "value_nll": {"public": ("final_public_value_nll", "public_value_nll"),
                  "private": ("final_eval_value_nll", "value_nll")},
    "perplexity": {"public": ("final_public_perplexity", "public_perplexity"),
                   "private": ("final_eval_perplexity", "perplexity")},
}
METRIC_LABELS = {"value_nll": "value-token NLL (nats/record)", "perplexity": "perplexity"}
SELECTION_COLUMNS = METRIC_COLUMNS["perplexity"]  # (the columns of perplexity, for runs written before value NLL)


def study_metric(table: pd.DataFrame) -> str:
    """``'value_nll'`` when every finished trial reports the value-token NLL on both splits, else ``'perplexity'``."""
    columns = [c for pair in METRIC_COLUMNS["value_nll"].values() for c in pair[:1]]
    if "final_eval_perplexity" not in table or not all(c in table for c in columns):
        return "perplexity"
    finished = table["final_eval_perplexity"].notna()
    return "value_nll" if finished.any() and table.loc[finished, columns].notna().all().all() else "perplexity"
SELECTION_PUBLIC_NOTE = "selection used the public validation split (E15)"
SELECTION_PRIVATE_NOTE = "selection used the private eval split: unprotected (E15)"
SELECTION_NONE_NOTE = ("selection: none: nothing was chosen on any split; each cell releases its one DP arm's first "
                       "seed, fixed before the study ran (the recipe alone: nothing charged beyond the runs)")
SELECTION_FALLBACK_NOTE = ("selection asked for the public validation split but the runs report none: "
                           "selection used the private eval split: unprotected (E15)")
PAPER_POLICY_LABEL = ("a policy trained in paper mode drove a run: its controller saw unprivatized statistics "
                      "(E3/E14); epsilon covers the gradient releases only")


def would_release(table: pd.DataFrame, column: str) -> pd.DataFrame:
    """The trial a study would release, one row per (model, epsilon) cell: of the cell's DP arms (never the non-private
    one; an arm as :func:`raydp.study.arms.arms` labels it, SAC cell and frozen policy included) the arm with the
    lowest mean of ``column`` over its seeds, and of that arm's seeds the trial with the lowest ``column`` (lower is
    better; a tie goes to the first arm by label, then the first trial by name). Finished trials only.

    ``column`` is the study's final selection metric on PUBLIC validation (:data:`METRIC_COLUMNS`, ``[metric]
    ['public'][0]``): the private eval split never selects what is released (no accountant covers it, E15), and a
    private column is refused. Columns: model, epsilon, arm, trial, seed, value (the trial's ``column``), arm_mean,
    seeds (the arm's finished seeds)."""
    out_columns = ["model", "epsilon", "arm", "trial", "seed", "value", "arm_mean", "seeds"]
    if "_public_" not in column:
        raise ValueError(f"{column} is not a public validation column: only public validation selects a release (E15)")
    if column not in table or "epsilon_target" not in table:
        return pd.DataFrame(columns=out_columns)
    done = table[table[column].notna() & table["epsilon_target"].notna()
                 & ~table["strategy"].isin(NONPRIVATE_ARMS)]
    if "status" in done:
        done = done[done["status"] == "TERMINATED"]
    done = done.assign(_arm=arms(done, cell=True)).sort_values(["_arm", "trial"], kind="stable")
    rows = []
    for (model, eps), cell in done.groupby(["model", "epsilon_target"], sort=True):
        means = cell.groupby("_arm", sort=True)[column].mean()
        arm = means.idxmin()
        seeds = cell[cell["_arm"] == arm]
        best = seeds.loc[seeds[column].idxmin()]
        rows.append({"model": model, "epsilon": float(eps), "arm": arm, "trial": best["trial"],
                     "seed": int(best["seed"]) if "seed" in best and pd.notna(best["seed"]) else None,
                     "value": float(best[column]), "arm_mean": float(means.min()), "seeds": int(len(seeds))})
    return pd.DataFrame(rows, columns=out_columns)


def fixed_release(table: pd.DataFrame, column: str) -> pd.DataFrame:
    """The trial a ``selection: none`` study releases, one row per (model, epsilon) cell: its one DP arm's trial at
    the lowest seed the study planned, a choice fixed before any trial ran, and released only if that trial finished
    (a cell whose planned trial did not finish releases nothing: taking the next seed would let whether a trial
    finished, which may depend on the private data, choose). Nothing measured chooses; ``column`` is only shown.
    Columns as :func:`would_release`'s."""
    out_columns = ["model", "epsilon", "arm", "trial", "seed", "value", "arm_mean", "seeds"]
    if "epsilon_target" not in table or "seed" not in table:
        return pd.DataFrame(columns=out_columns)
    planned = table[table["epsilon_target"].notna() & ~table["strategy"].isin(NONPRIVATE_ARMS)]
    planned = planned.assign(_arm=arms(planned, cell=True))
    rows = []
    for (model, eps), cell in planned.groupby(["model", "epsilon_target"], sort=True):
        if cell["_arm"].nunique() != 1:
            continue  # a study file that gives one DP arm has one here (StudyConfig refuses more)
        first = cell.sort_values(["seed", "trial"], kind="stable").iloc[0]
        if "status" in cell and first["status"] != "TERMINATED":
            continue
        if "status" in cell:
            cell = cell[cell["status"] == "TERMINATED"]
        value = first.get(column)
        rows.append({"model": model, "epsilon": float(eps), "arm": first["_arm"], "trial": first["trial"],
                     "seed": int(first["seed"]), "value": None if value is None or pd.isna(value) else float(value),
                     "arm_mean": float(cell[column].mean()) if column in cell else None, "seeds": int(len(cell))})
    return pd.DataFrame(rows, columns=out_columns)


def search_best(table: pd.DataFrame, split: str, metric: str) -> list[dict]:
    """Per search cell (strategy, model, epsilon): the finished Optuna trial with the lowest final selection
    metric on ``split``, its sampled values and how many trials the cell finished (what a deciding study
    copies into its strategy_settings and base)."""
    column = METRIC_COLUMNS[metric][split][0]
    done = table[table["search"].notna() & (table["status"] == "TERMINATED")]
    if column not in done:
        return []
    out = []
    for (strategy, model, eps), cell in done.groupby(["strategy", "model", "epsilon_target"], sort=True,
                                                     dropna=False):  # a non-private cell: no epsilon
        cell = cell[cell[column].notna()]
        if cell.empty:
            continue
        best = cell.loc[cell[column].idxmin()]
        out.append({"strategy": strategy, "model": model, "epsilon": None if pd.isna(eps) else float(eps),
                    "trials": int(len(cell)),
                    "best": json.loads(best["search"]), column: float(best[column]), "trial": best["trial"]})
    return out


# -- selection ------------------------------------------------------------------------------------
def selection_value(private: float | None, public: float | None, selection: str) -> tuple[float | None, str]:
    """The figure that selects (ERRATA E15) and the split it came from: the public one unless the study selects
    on the private split or the run has no public figure (then: 'private', labelled). ``selection: none`` chooses
    nothing, and its Tune metric (shown, and Tune's best result, which nothing releases) is the public one too."""
    if selection in ("public", "none") and public is not None and not _isnan(public):
        return float(public), "public"
    return (None if private is None else float(private)), "private"


def _isnan(x) -> bool:
    return isinstance(x, float) and math.isnan(x)


def selection_split(table: pd.DataFrame, selection: str) -> tuple[str, str]:
    """(split used, note) for the study's tables: 'public' when every finished trial has a public final
    perplexity, else 'private' (ERRATA E15: labelled, never silent)."""
    if selection == "private":
        return "private", SELECTION_PRIVATE_NOTE
    if selection == "none":  # the public figures are shown, and select nothing
        return "public", SELECTION_NONE_NOTE
    if "final_eval_perplexity" not in table:
        return "public", SELECTION_PUBLIC_NOTE
    finished = table["final_eval_perplexity"].notna()
    public = table["final_public_perplexity"] if "final_public_perplexity" in table else None
    if not finished.any() or (public is not None and public[finished].notna().all()):
        return "public", SELECTION_PUBLIC_NOTE
    return "private", SELECTION_FALLBACK_NOTE


def steps_to_target(table: pd.DataFrame, selection: str = "private", metric: str | None = None) -> pd.Series:
    """Sec. 4.2: first eval step reaching the best baseline's final figure, over total steps, on the ``selection``
    split ('public' or 'private') of ``metric`` (:data:`METRIC_COLUMNS`; default :func:`study_metric`)."""
    final_col, eval_col = METRIC_COLUMNS[metric or study_metric(table)][selection]
    out = pd.Series(np.nan, index=table.index)
    if final_col not in table:
        return out
    for (model, eps, seed), group in table.groupby(["model", "epsilon_target", "seed"], dropna=True):
        baselines = group[~group["strategy"].isin(BASELINE_EXCLUDED)][final_col].dropna()
        if baselines.empty:
            continue
        target = float(baselines.min())
        for idx, row in group.iterrows():
            path = RunDirectory(row["run_dir"]).eval_metrics
            if not path.exists() or not row.get("steps"):
                continue
            evals = pd.read_parquet(path)
            if eval_col not in evals:
                continue
            hit = evals[(evals["step"] > 0) & (evals[eval_col] <= target)]
            if len(hit):
                total = row.get("planned_steps") or row["steps"]  # planned: a run stopped early is not flattered
                out[idx] = float(hit["step"].iloc[0]) / float(total)
    return out


# -- RDP curves on one order grid ------------------------------------------------------------------
ORDERS = np.asarray(DEFAULT_ORDERS, dtype=np.float64)


def curve_on_orders(orders: Sequence[float], curve: Sequence[float],
                    target: Sequence[float] = DEFAULT_ORDERS) -> np.ndarray:
    """An RDP curve given at ``orders``, as an upper bound at every ``target`` order.

    Renyi divergence is non-decreasing in its order (van Erven & Harremoes 2014, Thm. 3), so a mechanism
    that is (alpha', eps')-RDP is (alpha, eps')-RDP for every alpha <= alpha': the bound at alpha is the
    smallest given value at an order >= alpha, and infinity above the largest given order. A curve
    given on the target orders comes back unchanged (or lower, where a larger order's value is smaller)."""
    orders = np.asarray(orders, dtype=np.float64)
    curve = np.asarray(curve, dtype=np.float64)
    if orders.shape != curve.shape or orders.ndim != 1:
        raise ValueError("an RDP curve needs one value per order")
    sort = np.argsort(orders)
    orders, curve = orders[sort], curve[sort]
    curve = np.where(np.isnan(curve), np.inf, curve)
    suffix_min = np.minimum.accumulate(curve[::-1])[::-1]  # min over orders >= orders[i]
    out = np.full(len(target), np.inf)
    for i, alpha in enumerate(np.asarray(target, dtype=np.float64)):
        j = int(np.searchsorted(orders, alpha * (1 - 1e-12), side="left"))
        if j < len(orders):
            out[i] = suffix_min[j]
    return out


def _filter_curve(filt) -> np.ndarray | None:
    if isinstance(filt, dict) and filt.get("orders") is not None and filt.get("budget_rdp") is not None:
        return curve_on_orders(filt["orders"], filt["budget_rdp"])
    return None


def run_rdp_curve(summary: dict | None, ledger: PrivacyLedger | None) -> tuple[np.ndarray | None, str]:
    """A run's RDP curve on :data:`ORDERS` and where it comes from: the Renyi filter's budget curve when
    the run was enforced by one (``summary['privacy']['filter']``, else the ledger's ``filter`` metadata;
    Feldman & Zrnic 2021: the filter's budget B(alpha) is the run's guarantee under fully adaptive
    composition, ERRATA E13), else its ledger's RDP curve."""
    if ledger is not None and ledger.metadata.get("local_plan"):  # forward-pass local DP (labels included)
        return ledger_curve(ledger), "local"
    curve = _filter_curve(((summary or {}).get("privacy") or {}).get("filter"))
    if curve is None and ledger is not None:
        curve = _filter_curve(ledger.metadata.get("filter"))
    if curve is not None:
        return curve, "renyi_filter"
    if ledger is not None:
        return ledger_rdp_curve(ledger), "ledger"
    return None, "unknown"


def ledger_curve(ledger: PrivacyLedger) -> np.ndarray:
    """The RDP curve of what a ledger charged: its rows, or for a local-DP ledger its plan's releases
    (its randomized-response labels are not rows: :func:`raydp.runner.local_setup.ledger_local_plan`)."""
    plan = ledger_local_plan(ledger.metadata, ledger.sigma_eff)
    if plan is not None:
        return plan.rdp_curve(ORDERS)
    return ledger_rdp_curve(ledger)


def tuning_aware_epsilon(curves: list, delta: float) -> dict:
    """The epsilon of releasing the best of K runs on the same data: the RDP composition of all K curves
    (Mironov 2017, Prop. 1; the guarantee for a fixed grid, adaptive search or a shared policy), with the
    repeat-and-select figure beside it (Papernot & Steinke 2022; valid only when the number of trials is
    Poisson(K) and settings are drawn independently). ``curves``: RDP curves on :data:`ORDERS` (or
    ledgers, whose curves are computed)."""
    curves = np.stack([ledger_rdp_curve(c) if isinstance(c, PrivacyLedger) else np.asarray(c, float) for c in curves])
    k = len(curves)
    worst = curves.max(axis=0)
    finite = np.isfinite(worst)
    eps_select = math.inf
    if finite.any():
        selected = rdp._compute_rdp_repeat_and_select(ORDERS[finite], worst[finite], k, math.inf)
        eps_select = rdp_epsilon(np.asarray(selected), ORDERS[finite], delta)
    eps_compose = rdp_epsilon(curves.sum(axis=0), ORDERS, delta)
    eps_single = max(rdp_epsilon(c, ORDERS, delta) for c in curves)
    return {"trials": k, "max_single_trial_epsilon_rdp": float(eps_single),
            "tuning_aware_epsilon": float(eps_compose), "composition_epsilon_rdp": float(eps_compose),
            "repeat_and_select_epsilon_rdp": float(eps_select),
            "note": "tuning_aware_epsilon is the composition of all K trials, which holds for this study's "
                    "fixed or adaptive selection; repeat_and_select (Papernot & Steinke 2022) would hold only "
                    "if the number of trials were Poisson(K) with settings drawn independently"}


def compose_dataset(sha: str, runs: list[dict], delta: float, *, unknown_spend: Sequence[dict] = (),
                    nonprivate: Sequence[str] = (), warnings: Sequence[str] = ()) -> dict:
    """The tuning-aware figure of one dataset (ERRATA E7/E14): the RDP composition of every run on it,
    whatever its target epsilon (Mironov 2017, Prop. 1, for runs one after another; trials that run side
    by side, e.g. sharing a policy, compose the same way by concurrent composition of RDP, Lyu 2022).
    The privacy units of the runs are stated; record-level runs composed with patient-level ones make
    the figure a bound per record only (a patient with k records gets group privacy in k, ERRATA E11).

    ``runs``: one dict per run, ``{"name", "kind" ('trial' | 'errored_trial' | 'policy_training_run'),
    "curve_source" ('ledger' | 'checkpoint_ledger' | 'renyi_filter' | 'policy_provenance'),
    "curve" (RDP on :data:`ORDERS`), "epsilon_target", "labels" (list of str)}``. The repeat-and-select
    figure is over the study's own trials (kind 'trial'/'errored_trial'), labelled as such."""
    figure: dict = {"dataset_id": sha, "runs": len(runs), "delta": float(delta),
                    "orders": "raydp.privacy.accounting.rdp.DEFAULT_ORDERS"}
    trials = [r for r in runs if r["kind"] != "policy_training_run"]
    if runs:
        figure["tuning_aware_epsilon"] = figure["composition_epsilon_rdp"] = float(
            rdp_epsilon(np.sum([r["curve"] for r in runs], axis=0), ORDERS, delta))
    else:
        figure["tuning_aware_epsilon"] = figure["composition_epsilon_rdp"] = None
    if trials:
        selected = tuning_aware_epsilon([r["curve"] for r in trials], delta)
        figure.update(trials=len(trials), max_single_trial_epsilon_rdp=selected["max_single_trial_epsilon_rdp"],
                      trials_composition_epsilon_rdp=selected["composition_epsilon_rdp"],
                      repeat_and_select_epsilon_rdp=selected["repeat_and_select_epsilon_rdp"])
    else:
        figure.update(trials=0, max_single_trial_epsilon_rdp=None, repeat_and_select_epsilon_rdp=None)
    figure["target_epsilons"] = sorted({float(r["epsilon_target"]) for r in runs
                                        if r.get("epsilon_target") is not None})
    figure["composed"] = [{"name": r["name"], "kind": r["kind"], "curve": r["curve_source"],
                           "epsilon_target": r.get("epsilon_target"),
                           "epsilon_rdp": float(rdp_epsilon(r["curve"], ORDERS, delta))} for r in runs]
    figure["labels"] = list(dict.fromkeys(label for r in runs for label in r.get("labels") or []))
    units = sorted({r.get("privacy_unit") or "unknown" for r in runs})
    figure["privacy_units"] = units
    if len(units) > 1:
        warnings = [*warnings, f"runs of different privacy units ({', '.join(units)}) are composed: the figure "
                    "bounds the smallest unit only; a patient with k records gets group privacy in k (E11)"]
    relations = sorted({r.get("neighbouring_relation") for r in runs if r.get("neighbouring_relation")})
    figure["neighbouring_relations"] = relations
    if len(relations) > 1:
        warnings = [*warnings, f"runs under different neighbouring relations ({'; '.join(relations)}) are composed: "
                    "a local (replace-one) run gives no add/remove bound, and an add/remove run bounds replace-one "
                    "only by group privacy (two steps); the sum is a guarantee under neither relation as it stands"]
    figure["unknown_spend"] = list(unknown_spend)
    figure["nonprivate_trials"] = list(nonprivate)
    figure["warnings"] = list(warnings)
    if unknown_spend:
        figure["warnings"].append(
            f"unknown spend: {len(unknown_spend)} trial(s) started on this dataset and errored before any "
            "checkpoint; their spend is NOT in tuning_aware_epsilon: " + ", ".join(u["trial"] for u in unknown_spend))
    if nonprivate:
        figure["warnings"].append(
            "non-private trial(s) trained on this dataset: anything derived from them (models, metrics) has no "
            "DP guarantee; the figure covers the DP runs only: " + ", ".join(nonprivate))
    figure["note"] = ("tuning_aware_epsilon composes every run on this dataset (all target epsilons, errored "
                      "trials from their checkpoint, transfer stages, the training runs of saved policies the "
                      "trials started from); repeat_and_select (Papernot & Steinke 2022) would hold only if the "
                      "number of trials were Poisson(K) with settings drawn independently")
    return figure


# -- the study ------------------------------------------------------------------------------------
def _arrow_ledger_metadata(table) -> dict:
    """The file-level metadata a ledger table carries (filter, labels, unit...; see ``PrivacyLedger.to_arrow``)."""
    raw = (table.schema.metadata or {}).get(b"raydp.privacy_ledger")
    return json.loads(raw) if raw else {}


def _checkpoint_spend(result) -> dict | None:
    """What a trial that never finished spent, from its latest Tune checkpoint: its ledger, the Renyi
    filter's budget curve if the ledger's metadata records one (an adaptive run: that budget, not the
    realized sum, is its guarantee, E13), and its labels."""
    checkpoint = getattr(result, "checkpoint", None)
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as d:
        path = Path(d) / "state.pt"
        if not path.exists():
            return None
        gradient = torch.load(path, weights_only=False)["trainer"]["gradient"]
    table = gradient.get("ledger")
    if table is None:
        return None
    meta = _arrow_ledger_metadata(table)
    ledger = PrivacyLedger()
    ledger.extend_from_arrow(table)
    return {"ledger": ledger, "filter": meta.get("filter") or gradient.get("filter"),
            "labels": [str(label) for label in meta.get("labels") or []],
            "privacy_unit": meta.get("privacy_unit"), "neighbouring_relation": meta.get("neighbouring_relation")}


def _checkpoint_ledger(result) -> PrivacyLedger | None:
    spend = _checkpoint_spend(result)
    return None if spend is None else spend["ledger"]


def trial_delta(study) -> float:
    return float(study.base.get("delta", 1e-5))


def dataset_identity(dataset_dir: str | Path | None) -> str | None:
    """A built dataset's identity: its manifest's keyed ``dataset_id`` (ERRATA E14; :mod:`raydp.data.identity`),
    else (a manifest without a content hash) its path."""
    if dataset_dir is None:
        return None
    path = Path(dataset_dir) / "manifest.json"
    if not path.exists():
        return None
    return manifest_id(json.loads(path.read_text())) or f"unhashed:{Path(dataset_dir).resolve()}"


def _paper_rldp(study, trial: Trial) -> bool:
    """Whether a controller trial ran in paper mode (the study's settings, or the trial's settings_grid variant)."""
    return resolve_values(trial.controller_settings(study)).raw_statistics


def _trial_policy(study, trial: Trial) -> tuple[str | None, Path | None, str | None]:
    """(name, resolved path, problem) of the saved policy an RLDP trial starts from (its ``policy`` setting),
    if any. A frozen transfer trial's policy is its stage-1 trial's, which the study composes itself."""
    if trial.strategy not in CONTROLLERS:
        return None, None, None
    rldp = trial.controller_settings(study)
    name = trial.policy_path or rldp.get("policy")  # resolved by the driver (frozen: the source trial's)
    if not name:
        return None, None, None
    try:
        return name, resolve_policy(name, rldp.get("policy_dir", "policies")).resolve(), None
    except ConfigError as exc:
        return name, None, str(exc)


def _policy_runs(study, trial: Trial, study_dir: Path, sha: str | None,
                 seen: set) -> tuple[list[dict], list[str], list[str]]:
    """(runs to compose, labels for the trial, warnings) for the saved policy a trial starts from: the
    training runs in its manifest's provenance that name the trial's dataset (ERRATA E14), each once per
    study (``seen``: entry ids already composed)."""
    name, path, problem = _trial_policy(study, trial)
    if name is None:
        return [], [], []
    if path is None:
        return [], [], [f"trial {trial.name} started from policy {name}, which cannot be read ({problem}): "
                        "the spend of the runs that trained it is unknown"]
    manifest = load_manifest(path)
    labels = [PAPER_POLICY_LABEL] if unprotected(policy_privacy_mode(manifest)) else []
    if path == study_dir or study_dir in path.parents:  # trained by a trial of this study: composed as a trial
        return [], labels, []
    runs, warnings = [], []
    for entry in provenance_of(manifest):
        if entry.get("dataset_id") is None or entry.get("rdp_curve") is None:
            warnings.append(f"policy {name} has a training run of unknown dataset or RDP curve "
                            f"({'legacy manifest' if entry.get('legacy') else 'incomplete provenance'}): "
                            "if it trained on this dataset, its spend is not in the figure")
            continue
        if entry["dataset_id"] != sha:
            if not entry.get("public_data"):  # another private dataset: not composed, but said (E14)
                warnings.append(f"policy {name} was also trained on another private dataset "
                                f"({entry['dataset_id']}): not composed here; if it holds the same "
                                "people (e.g. the same records identified another way), their spend adds")
            continue
        key = entry.get("entry_id") or json.dumps(entry, sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        runs.append({"name": f"policy {name}: training run {str(entry.get('entry_id', '?'))[:12]}",
                     "kind": "policy_training_run", "curve_source": "policy_provenance",
                     "curve": curve_on_orders(entry["rdp_orders"], entry["rdp_curve"]),
                     "epsilon_target": entry.get("epsilon"), "privacy_unit": entry.get("privacy_unit"),
                     "labels": [str(label) for label in entry.get("labels") or []]
                     + ([PAPER_MODE_LABEL] if unprotected(entry.get("privacy_mode")) else [])})
    return runs, labels, warnings


def study_privacy(study, study_dir: Path, table: pd.DataFrame, unfinished: dict[str, dict],
                  dataset_sha: str | None, specs: dict[str, Trial] | None = None) -> dict:
    """The tuning-aware figure of every dataset the study's runs touched (see the module docstring):
    ``{dataset_id: compose_dataset(...)}``. ``unfinished``: trial name -> its checkpoint's spend
    (:func:`_checkpoint_spend`); ``specs``: trial name -> its :class:`~raydp.study.trial.Trial` (its saved policy;
    a row without one is read back from the table, :meth:`~raydp.study.trial.Trial.from_row`)."""
    delta = trial_delta(study)
    study_dir = Path(study_dir).resolve()
    specs = specs or {}
    per: dict[str, dict] = {}
    for _, row in table.iterrows():
        if row["status"] == "NOT_RUN":
            continue
        run_dir = Path(row["run_dir"])
        summary = read_run_summary(run_dir)
        sha = identity_of(summary or {}) or dataset_sha or "unknown dataset"
        b = per.setdefault(sha, {"runs": [], "unknown": [], "nonprivate": [], "warnings": [], "seen": set()})
        if not is_private(row["strategy"]):
            b["nonprivate"].append(row["trial"])
            continue
        labels = trial_labels(summary)
        trial = specs.get(row["trial"]) or Trial.from_row(row)
        if summary is None and _paper_rldp(study, trial):
            labels = [PAPER_MODE_LABEL]
        policy_runs, policy_labels, warnings = _policy_runs(study, trial, study_dir, sha, b["seen"])
        b["warnings"].extend(warnings)
        labels = list(dict.fromkeys(labels + policy_labels))
        kind = {"ERROR": "errored_trial", "INTERRUPTED": "interrupted_trial"}.get(row["status"], "trial")
        privacy = (summary or {}).get("privacy") or {}
        unit, relation = privacy.get("privacy_unit"), privacy.get("neighbouring_relation")
        ledger_path = RunDirectory(run_dir).ledger
        if ledger_path.exists():
            curve, source = run_rdp_curve(summary, PrivacyLedger.load(ledger_path))
        elif row["trial"] in unfinished:  # errored or interrupted trials spent budget too (last checkpoint)
            spend = unfinished[row["trial"]]
            labels = list(dict.fromkeys(labels + spend.get("labels", [])))
            unit = unit or spend.get("privacy_unit")  # no summary: the checkpointed ledger's own metadata
            relation = relation or spend.get("neighbouring_relation")
            curve = _filter_curve(spend.get("filter"))
            source = "renyi_filter" if curve is not None else "checkpoint_ledger"
            if curve is None:
                curve = ledger_curve(spend["ledger"])
        else:
            curve, source = None, "unknown"
        if curve is None:
            b["unknown"].append({"trial": row["trial"], "status": row["status"],
                                 "reason": {"ERROR": "errored before any checkpoint",
                                            "INTERRUPTED": "stopped before any checkpoint"}.get(
                                     row["status"], "no ledger in its run directory"), "labels": labels})
        else:
            target = row.get("epsilon_target")
            b["runs"].append({"name": row["trial"], "kind": kind, "curve_source": source, "curve": curve,
                              "epsilon_target": None if _isnan(target) else target, "labels": labels,
                              "privacy_unit": unit, "neighbouring_relation": relation})
        b["runs"].extend(policy_runs)
    return {sha: compose_dataset(sha, b["runs"], delta, unknown_spend=b["unknown"], nonprivate=b["nonprivate"],
                                 warnings=list(dict.fromkeys(b["warnings"])))
            for sha, b in per.items()}


def trial_status(result, metrics: dict, run_dir: Path) -> str:
    """ERROR (Tune's error), TERMINATED (its final report, ``done``, or its run directory's summary),
    INTERRUPTED (it reported or checkpointed, then the study was stopped: ``raydp study --resume``
    finishes it), or NOT_RUN."""
    if result.error:
        return "ERROR"
    if metrics.get("done") or RunDirectory(run_dir).summary.exists():
        return "TERMINATED"
    if _reported(metrics) or getattr(result, "checkpoint", None) is not None:
        return "INTERRUPTED"
    return "NOT_RUN"


def _reported(metrics: dict) -> bool:
    """Whether the trial reported anything: every report of :func:`raydp.study.runner.run_trial` carries
    ``step``; Tune fills a never-started trial's metrics with its ``trial_id`` only."""
    return "step" in metrics or bool(metrics.get("done"))


def collect_results(study, study_dir: Path, trials: list[Trial], grid, dataset_dir: str | Path | None = None,
                    evaluation_errors: dict[str, str] | None = None) -> pd.DataFrame:
    """Write ``results.parquet`` and return the table; ``table.attrs`` carries the tuning-aware epsilon
    of each dataset (``tuning_aware_epsilon``: {dataset_id: figure}, ERRATA E7/E14) and the
    selection split (``selection``, E15). ``dataset_dir``: the study's built dataset (default
    ``study_dir/dataset``), whose id identifies runs whose summary names no dataset. ``evaluation_errors``: the
    error line of each trial whose attack after the trials failed (:mod:`raydp.study.attack_phase`)."""
    statuses, unfinished = {}, {}
    trials = list(trials)
    selection = getattr(study, "selection", "public")
    for result in grid:
        metrics = result.metrics or {}
        config = result.config or {}
        trial = tune_trial(config)  # a grid trial's own spec
        if trial is None:  # an Optuna-sampled trial
            if not _reported(metrics) and result.error is None and getattr(result, "checkpoint", None) is None:
                continue  # never started (a stopped study's pending trial): its own spec stays NOT_RUN
            failed = Path(str(result.path)).name  # it failed before its final report: named by its Tune directory
            if metrics.get("trial_spec"):
                trial = Trial.from_dict(json.loads(metrics["trial_spec"]))
            elif config.get("search_cell"):  # a search_space trial that failed before its final report
                cell = Trial.from_dict(config["search_cell"])
                trial = cell.derive(search=dict(config.get("search") or {}), name=f"{cell.strategy}_optuna-{failed}")
            else:  # an Optuna-sampled SAC cell that failed before its final report
                trial = Trial.plan(study, model=study.models[0], epsilon=study.epsilons[0], seed=study.seeds[0],
                                   strategy=study.controller_strategy,
                                   **{k: config.get(k) for k in ("t_rl", "b_sac", "k")},
                                   name=f"{study.controller_strategy}_optuna-{failed}")
            trials.append(trial)
        status = trial_status(result, metrics, study_dir / "trials" / trial.name)
        statuses[trial.name] = (status, metrics)
        if status in ("ERROR", "INTERRUPTED"):  # it spent budget: its last checkpoint says how much
            spend = _checkpoint_spend(result)
            if spend is not None:
                unfinished[trial.name] = spend
    rows = []
    for trial in trials:
        status, metrics = statuses.get(trial.name, ("NOT_RUN", {}))
        if trial.name in (evaluation_errors or {}):  # its attack after the trials failed (the trial stands)
            metrics = {**metrics, "evaluation_error": evaluation_errors[trial.name]}
        rows.append(_trial_row(trial, study_dir / "trials" / trial.name, status, metrics))
    table = pd.DataFrame(rows)
    split, note = selection_split(table, selection)
    metric = study_metric(table)
    if "final_eval_perplexity" in table:
        table["steps_to_target"] = steps_to_target(table, split, metric)
    table["selection_split"] = split
    table["selection_metric"] = metric
    table.to_parquet(study_dir / "results.parquet", index=False)
    attrs = {"selection": {"requested": selection, "split": split, "note": note, "metric": metric}}
    if "search" in table and table["search"].notna().any():
        attrs["search_best"] = search_best(table, split, metric)
    if study.private_data:
        sha = dataset_identity(dataset_dir if dataset_dir is not None else Path(study_dir) / "dataset")
        attrs["tuning_aware_epsilon"] = study_privacy(study, study_dir, table, unfinished, sha,
                                                      {t.name: t for t in trials})
    else:
        attrs["tuning_aware_epsilon"] = "not applicable: the study declares its data public"
    table.attrs = attrs
    return table
