"""``raydp report STUDY``: the RLDP paper's Table 2 and Table 3 analogues from a study's results.

Table 2: final eval perplexity per model x epsilon, RLDP (its best SAC cell, mean over seeds) against
the best baseline (the DP strategy with the lowest mean final perplexity), and the relative change;
RLDP driven by a frozen transferred policy in its own column (transfer studies).
Table 3: RLDP's steps-to-target (Sec. 4.2) in % of its steps, mean over seeds (the same cell).
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from raydp.errors import ConfigError


def load_results(study_dir: str | Path) -> tuple[pd.DataFrame, dict]:
    study_dir = Path(study_dir)
    path = study_dir / "results.parquet"
    if not path.exists():
        raise ConfigError(f"{study_dir} has no results.parquet (is it a finished study directory?)")
    summary_path = study_dir / "study_summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return pd.read_parquet(path), summary


def table2(results: pd.DataFrame) -> pd.DataFrame:
    private = results.dropna(subset=["epsilon_target", "final_eval_perplexity"])
    rows = []
    for (model, eps), group in private.groupby(["model", "epsilon_target"]):
        frozen = group["frozen_policy"].fillna(False).astype(bool) if "frozen_policy" in group else False
        rldp = group[(group["strategy"] == "rldp") & ~frozen]
        base = group[group["strategy"] != "rldp"]
        row = {"model": model, "epsilon": eps}
        if (group["strategy"] == "rldp").any() and getattr(frozen, "any", lambda: False)():
            row["rldp_frozen_ppl"] = float(group[frozen]["final_eval_perplexity"].mean())
        if len(rldp):
            cells = rldp.groupby(["t_rl", "b_sac", "k"])["final_eval_perplexity"].mean()
            row.update(rldp_ppl=float(cells.min()), rldp_cell="T_RL={} B_SAC={} K={}".format(*map(int, cells.idxmin())))
        if len(base):
            means = base.groupby("strategy")["final_eval_perplexity"].mean()
            row.update(best_baseline=means.idxmin(), baseline_ppl=float(means.min()))
        if "rldp_ppl" in row and "baseline_ppl" in row:
            row["change_pct"] = 100.0 * (row["rldp_ppl"] - row["baseline_ppl"]) / row["baseline_ppl"]
        rows.append(row)
    return pd.DataFrame(rows)


def table3(results: pd.DataFrame) -> pd.DataFrame:
    frozen = results["frozen_policy"].fillna(False).astype(bool) if "frozen_policy" in results else False
    rldp = results[(results["strategy"] == "rldp") & ~frozen].dropna(subset=["final_eval_perplexity"])
    rows = []
    for (model, eps), group in rldp.groupby(["model", "epsilon_target"]):
        cells = group.groupby(["t_rl", "b_sac", "k"])
        best = cells["final_eval_perplexity"].mean().idxmin()
        chosen = cells.get_group(best)
        reached = chosen["steps_to_target"].notna()
        rows.append({"model": model, "epsilon": eps,
                     "steps_to_target_pct": 100.0 * float(chosen["steps_to_target"].mean()) if reached.any() else None,
                     "seeds_reaching_target": f"{int(reached.sum())}/{len(chosen)}"})
    return pd.DataFrame(rows)


def format_report(study_dir: str | Path) -> str:
    results, summary = load_results(study_dir)
    lines = [f"study {summary.get('study', Path(study_dir).name)}: {len(results)} trials "
             f"({int((results['status'] == 'TERMINATED').sum())} finished)"]
    if "privacy_label" in results and results["privacy_label"].notna().any():
        lines.append(f"NOTE: paper-mode trials: {results['privacy_label'].dropna().iloc[0]}")
    t2 = table2(results)
    lines.append("\nTable 2 analogue: final eval perplexity (mean over seeds)")
    lines.append(t2.to_string(index=False, float_format=lambda x: f"{x:.4f}") if len(t2) else "  (no DP trials)")
    t3 = table3(results)
    lines.append("\nTable 3 analogue: RLDP steps to reach the best baseline's final perplexity (% of its steps)")
    lines.append(t3.to_string(index=False, float_format=lambda x: f"{x:.1f}") if len(t3) else "  (no RLDP trials)")
    tuning = summary.get("tuning_aware_epsilon")
    if isinstance(tuning, dict) and tuning:
        lines.append("\nTuning-aware epsilon (ERRATA E7; RDP upper bounds): releasing the best of K trials")
        for eps, t in tuning.items():
            lines.append(f"  target {eps}: K={t['trials']}, tuning-aware (composition) {t['tuning_aware_epsilon']:.3f}; "
                         f"single trial <= {t['max_single_trial_epsilon_rdp']:.3f}; repeat-and-select "
                         f"{t['repeat_and_select_epsilon_rdp']:.3f} (only if K were Poisson)")
    elif tuning:
        lines.append(f"\nTuning-aware epsilon: {tuning}")
    verdicts = results["within_budget"].dropna() if "within_budget" in results else pd.Series(dtype=bool)
    if len(verdicts):
        lines.append(f"\nper-trial budgets: {int(verdicts.sum())}/{len(verdicts)} within (enforcing accountant)")
    return "\n".join(lines)
