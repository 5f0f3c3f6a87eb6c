"""Study results: one Parquet row per trial, steps-to-target (RLDP Sec. 4.2), tuning-aware epsilon (E7).

``results.parquet`` columns (one row per trial):

=========================  ==========================================================================
trial, status              the trial's name (strategy_model_eps_seed[_SAC cell]) and Tune's status
model, strategy, epsilon_target, seed, t_rl, b_sac, k    the varied settings (SAC cell: rldp only)
frozen_policy              an RLDP trial driven by a frozen, transferred policy (transfer studies)
config                     the trial's full TrainConfig as JSON
initial/final/best_eval_perplexity   held-out perplexity at step 0, at the end, and the best
steps, planned_steps       steps run and planned (ceil(epochs / q), E10)
steps_to_target            first eval step at which the trial's eval perplexity is <= the best
                           baseline's final perplexity (same model, epsilon and seed), divided by its
                           steps; NaN if never reached (Sec. 4.2; baselines = the non-RLDP DP trials)
epsilon_pld/prv/rdp/gdp    final epsilon from the trial's full ledger per accountant (GDP: approximation)
enforcing_accountant, within_budget, verdict   the enforcing accountant and its verdict
privacy_mode, privacy_label   'strict' / 'paper' (+ the E3 label) for RLDP trials
trial_seconds, wall_seconds   the trial's run time as Tune saw it, and the run's own wall time
run_dir                    the trial's outputs (train/eval metrics, ledger, control trace, adapters)
=========================  ==========================================================================

Tuning-aware epsilon (ERRATA E7): releasing the best of the K trials that share a target epsilon costs
more than one trial. ``study_summary.json`` reports, per target epsilon, ``tuning_aware_epsilon``: the
RDP composition of all K trials' ledgers (errored trials included, from their last checkpoint), which
holds for this study's fixed grid, Optuna's adaptive choices and a shared policy alike; beside it the
largest per-trial epsilon and Papernot & Steinke's repeat-and-select figure (dp_accounting's RDP for a
Poisson(K) number of runs of the worst trial's mechanism), which would hold only if the number of
trials were random that way and settings were drawn independently. Skipped when the study says its
data is public. Held-out evaluation perplexity is computed on private held-out records and is not a DP
release: the controller never sees it (strict mode), but Tune's table, Optuna's choices and
steps-to-target use it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from raydp.privacy.ledger import LEDGER_FILENAME, PrivacyLedger

BASELINE_EXCLUDED = ("rldp", "nonprivate")


def _trial_row(trial: dict, run_dir: Path, status: str, result: dict) -> dict:
    row = {"trial": trial["name"], "status": status, "model": trial["model"], "strategy": trial["strategy"],
           "epsilon_target": trial.get("epsilon"), "seed": trial["seed"], "t_rl": trial.get("t_rl"),
           "b_sac": trial.get("b_sac"), "k": trial.get("k"), "frozen_policy": bool(trial.get("frozen_from")),
           "run_dir": str(run_dir),
           "trial_seconds": result.get("trial_seconds")}
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        return row
    s = json.loads(summary_path.read_text())
    privacy = s.get("privacy") or {}
    eps = privacy.get("epsilon_by_accountant") or {}
    row.update({
        "config": (run_dir / "config.json").read_text() if (run_dir / "config.json").exists() else None,
        "initial_eval_perplexity": s["initial_eval_perplexity"], "final_eval_perplexity": s["final_eval_perplexity"],
        "best_eval_perplexity": s["best_eval_perplexity"], "steps": s["steps"],
        "planned_steps": privacy.get("planned_steps", s["steps"]),
        **{f"epsilon_{a}": eps.get(a) for a in ("pld", "prv", "rdp", "gdp")},
        "enforcing_accountant": privacy.get("enforcing_accountant"), "within_budget": privacy.get("within_budget"),
        "verdict": privacy.get("verdict"), "privacy_mode": privacy.get("privacy_mode"),
        "privacy_label": privacy.get("privacy_label"), "wall_seconds": s["wall_seconds"],
    })
    return row


def steps_to_target(table: pd.DataFrame) -> pd.Series:
    """Sec. 4.2: first eval step reaching the best baseline's final perplexity, over total steps."""
    out = pd.Series(np.nan, index=table.index)
    for (model, eps, seed), group in table.groupby(["model", "epsilon_target", "seed"], dropna=True):
        baselines = group[~group["strategy"].isin(BASELINE_EXCLUDED)]["final_eval_perplexity"].dropna()
        if baselines.empty:
            continue
        target = float(baselines.min())
        for idx, row in group.iterrows():
            path = Path(row["run_dir"]) / "eval_metrics.parquet"
            if not path.exists() or not row.get("steps"):
                continue
            evals = pd.read_parquet(path)
            hit = evals[(evals["step"] > 0) & (evals["perplexity"] <= target)]
            if len(hit):
                total = row.get("planned_steps") or row["steps"]  # planned: a run stopped early is not flattered
                out[idx] = float(hit["step"].iloc[0]) / float(total)
    return out


def _rdp_curve(ledger: PrivacyLedger, orders) -> np.ndarray:
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    acc = rdp.RdpAccountant(list(orders))
    for (q, sigma), count in pd.Series(list(zip(ledger.q.tolist(), ledger.sigma_eff.tolist()))).value_counts().items():
        if math.isinf(sigma):
            continue
        acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), int(count))
    return np.asarray(acc._rdp)


def tuning_aware_epsilon(ledgers: list[PrivacyLedger], delta: float) -> dict:
    """The epsilon of releasing the best of K trials: the composition of all K ledgers (the guarantee
    for a fixed grid, adaptive search or a shared policy), with the repeat-and-select figure beside it
    (valid only when the number of trials is Poisson(K) and settings are drawn independently)."""
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    orders = np.concatenate([np.linspace(1.01, 8, 50), np.arange(8, 64, 0.5), np.arange(64, 512, 4)])
    curves = np.stack([_rdp_curve(led, orders) for led in ledgers])
    k = len(ledgers)
    worst = curves.max(axis=0)
    selected = rdp._compute_rdp_repeat_and_select(orders, worst, k, math.inf)
    eps_select = rdp.compute_epsilon(orders, selected, delta)[0]
    eps_compose = rdp.compute_epsilon(orders, curves.sum(axis=0), delta)[0]
    eps_single = max(rdp.compute_epsilon(orders, c, delta)[0] for c in curves)
    return {"trials": k, "max_single_trial_epsilon_rdp": float(eps_single),
            "tuning_aware_epsilon": float(eps_compose), "composition_epsilon_rdp": float(eps_compose),
            "repeat_and_select_epsilon_rdp": float(eps_select),
            "note": "tuning_aware_epsilon is the composition of all K trials, which holds for this study's "
                    "fixed or adaptive selection; repeat_and_select (Papernot & Steinke 2022) would hold only "
                    "if the number of trials were Poisson(K) with settings drawn independently"}


def _checkpoint_ledger(result) -> PrivacyLedger | None:
    """The ledger of a trial that never finished, from its latest Tune checkpoint (what it spent)."""
    import torch

    checkpoint = getattr(result, "checkpoint", None)
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as d:
        path = Path(d) / "state.pt"
        if not path.exists():
            return None
        table = torch.load(path, weights_only=False)["trainer"]["gradient"].get("ledger")
    if table is None:
        return None
    ledger = PrivacyLedger()
    ledger.extend_from_arrow(table)
    return ledger


def trial_delta(study) -> float:
    return float(study.base.get("delta", 1e-5))


def collect_results(study, study_dir: Path, trials: list[dict], grid) -> pd.DataFrame:
    """Write ``results.parquet`` and return the table (``table.attrs`` carries the tuning-aware epsilons)."""
    statuses, unfinished_ledgers = {}, {}
    trials = list(trials)
    for result in grid:
        metrics = result.metrics or {}
        config = result.config or {}
        trial = (config.get("trial_specs") or {}).get(config.get("trial_name"))
        if trial is None:  # an Optuna-sampled trial
            if metrics.get("trial_spec"):
                trial = json.loads(metrics["trial_spec"])
            else:  # it failed before its final report
                trial = {"model": study.models[0], "epsilon": study.epsilons[0], "seed": study.seeds[0],
                         "strategy": "rldp", **{k: config.get(k) for k in ("t_rl", "b_sac", "k")},
                         "name": f"rldp_optuna-{Path(str(result.path)).name}"}
            trials.append(trial)
        statuses[trial["name"]] = ("ERROR" if result.error else "TERMINATED", metrics)
        if result.error:
            ledger = _checkpoint_ledger(result)
            if ledger is not None:
                unfinished_ledgers[trial["name"]] = ledger
    rows = []
    for trial in trials:
        status, metrics = statuses.get(trial["name"], ("NOT_RUN", {}))
        rows.append(_trial_row(trial, study_dir / "trials" / trial["name"], status, metrics))
    table = pd.DataFrame(rows)
    if "final_eval_perplexity" in table:
        table["steps_to_target"] = steps_to_target(table)
    table.to_parquet(study_dir / "results.parquet", index=False)
    tuning = {}
    if study.private_data and "epsilon_target" in table:
        delta = None
        for eps, group in table.dropna(subset=["epsilon_target"]).groupby("epsilon_target"):
            ledgers = []
            for name, run_dir in zip(group["trial"], group["run_dir"]):
                if (Path(run_dir) / LEDGER_FILENAME).exists():
                    ledgers.append(PrivacyLedger.load(Path(run_dir) / LEDGER_FILENAME))
                    delta = ledgers[-1].delta
                elif name in unfinished_ledgers:  # errored trials spent budget too
                    ledgers.append(unfinished_ledgers[name])
            if ledgers:
                tuning[f"{eps:g}"] = tuning_aware_epsilon(ledgers, delta or trial_delta(study))
    table.attrs = {"tuning_aware_epsilon": tuning} if study.private_data else {
        "tuning_aware_epsilon": "not applicable: the study declares its data public"}
    return table
