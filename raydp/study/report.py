"""``raydp report STUDY``: the RLDP paper's Table 2 and Table 3 analogues from a study's results.

Table 2: final perplexity per model x epsilon, RLDP (its best SAC cell, mean over seeds) against
the best baseline (the DP strategy with the lowest mean final perplexity), and the relative change;
RLDP driven by a frozen transferred policy in its own column (transfer studies).
Table 3: RLDP's steps-to-target (Sec. 4.2) in % of its steps, mean over seeds (the same cell).
The perplexity is the study's selection split (ERRATA E15): the public validation split by default; the
private eval split (not a DP release) when the study selects on it, and the report then says so.
Then the tuning-aware epsilon of each dataset (ERRATA E7/E14), with its labels and warnings.

A ``selection: private-dp`` study has no results table: it is shown by its released cells
(:func:`raydp.study.private_selection.format_selection`), and composed with other studies on the same dataset by its
own figure, the RDP composition of its cells' end-to-end curves (:func:`_combined_privacy`).

Verdicts (:func:`verdicts`, issue 12): per model x epsilon, RLDP's best arm against the best baseline arm,
both chosen after the fact by mean final perplexity, and Welch's t-test over their seeds (two-sided, 5%):
RLDP *wins* or *loses* when the difference is significant, and *ties* otherwise. Choosing the best
baseline after seeing the results favours the baselines; choosing RLDP's best cell favours RLDP. Where an arm has
one seed there is no test: verdicts, challenges and the sd-based gates say so (:data:`NO_TEST`).

Every table starts with the study's compact table per (model, epsilon) (:mod:`raydp.study.outcome`); the Table 2 and
3 analogues and the verdicts print only where the study has RLDP trials, a learned controller's challenge only where
it ran. ``raydp study`` prints :func:`format_study` (the compact table, attacks, gates, research tables and the
tuning-aware epsilon, at most 160 characters a line) and records its figures with :func:`record_outcome`;
``raydp report`` prints :func:`format_report` (every table).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

from raydp.data.identity import frame_ids as dataset_ids
from raydp.errors import ConfigError
from raydp.study.arms import arms
from raydp.study.outcome import (attack_lines, format_outcome, header_line, outcome_cells, outcome_record,
                                 privacy_lines, short_names, trial_counts, wrap)
from raydp.study.results import BASELINE_EXCLUDED, CHALLENGERS, CONTROLLERS, NONPRIVATE_ARMS


def is_private_selection(study_dir: str | Path) -> bool:
    """Whether ``study_dir`` is a finished ``selection: private-dp`` study (its summary says so; it has no
    ``results.parquet``: it releases one trial per cell and no table of every trial)."""
    study_dir = Path(study_dir)
    if (study_dir / "results.parquet").exists():
        return False
    try:
        return json.loads((study_dir / "study_summary.json").read_text()).get("selection") == "private-dp"
    except (OSError, ValueError, AttributeError):
        return False


def load_results(study_dir: str | Path) -> tuple[pd.DataFrame, dict]:
    study_dir = Path(study_dir)
    path = study_dir / "results.parquet"
    if not path.exists():
        raise ConfigError(f"{study_dir} has no results.parquet (is it a finished study directory?)")
    summary_path = study_dir / "study_summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return pd.read_parquet(path), summary


def _final_column(results: pd.DataFrame, summary: dict | None = None) -> str:
    """The final column of the study's metric (the value-token NLL where every run reports it, else perplexity;
    :func:`raydp.study.results.study_metric`) on its selection split (E15): public unless the study used the
    private one."""
    from raydp.study.results import METRIC_COLUMNS, study_metric

    selection = (summary or {}).get("selection") or {}
    split = selection.get("split")
    if split is None and "selection_split" in results and len(results):
        split = results["selection_split"].iloc[0]
    metric = selection.get("metric") or study_metric(results)
    columns = METRIC_COLUMNS.get(metric, METRIC_COLUMNS["perplexity"])
    if split == "public" and columns["public"][0] in results:
        return columns["public"][0]
    return columns["private"][0]


def column_split(column: str) -> str:
    """'public' or 'private': the split a results column is on."""
    return "public" if "_public_" in column else "private"


def metric_label(column: str) -> str:
    """What a results column measures, in words (with its unit)."""
    return "value-token NLL (nats/record)" if column.endswith("value_nll") else "perplexity"


def split_label(column: str) -> str:
    return "public validation" if column_split(column) == "public" else "private eval (unprotected, E15)"


def arm_keys(results: pd.DataFrame) -> pd.Series:
    """A trial's arm for comparisons: its strategy, plus its settings_grid variant (``[clip=0.03]``)
    (:func:`raydp.study.arms.arms` without the SAC cell)."""
    return arms(results, cell=False)


def cell_arm_keys(results: pd.DataFrame) -> pd.Series:
    """:func:`arm_keys`, with a controller trial's SAC cell and ``(frozen policy)`` for a frozen policy's trials."""
    return arms(results, cell=True)


VERDICT_ALPHA = 0.05
#: what a verdict, decision or gate says where an arm has one seed: no spread, so no test (never NaN, never p=1)
NO_TEST = "1 seed: no test"
BASELINES_EXCLUDED = BASELINE_EXCLUDED  # not DP baselines at an epsilon: the challengers and non-private


def verdicts(results: pd.DataFrame, column: str = "final_public_perplexity") -> pd.DataFrame:
    """Per model x epsilon: RLDP's best arm (SAC cell and variant; frozen-policy trials are an arm too)
    against the best baseline arm (lowest mean), with seed spread and Welch's t-test (module docstring)."""
    from scipy import stats

    if column not in results or "epsilon_target" not in results:  # no trial finished
        return pd.DataFrame()

    data = results.dropna(subset=["epsilon_target", column]).copy()
    data["_arm"] = cell_arm_keys(data)
    rows = []
    for (model, eps), group in data.groupby(["model", "epsilon_target"]):
        rldp, base = group[group["strategy"].isin(CONTROLLERS)], group[~group["strategy"].isin(BASELINES_EXCLUDED)]
        if rldp.empty or base.empty:
            continue
        r_arm = rldp.groupby("_arm")[column].mean().idxmin()
        b_arm = base.groupby("_arm")[column].mean().idxmin()
        r, b = rldp[rldp["_arm"] == r_arm][column].to_numpy(), base[base["_arm"] == b_arm][column].to_numpy()
        diff = float(r.mean() - b.mean())
        p = None
        if len(r) >= 2 and len(b) >= 2:
            p = float(stats.ttest_ind(r, b, equal_var=False).pvalue)
            if p != p:  # both arms without spread: any difference is certain
                p = 0.0 if diff != 0 else 1.0
        verdict = (NO_TEST if p is None else
                   "wins" if p < VERDICT_ALPHA and diff < 0 else "loses" if p < VERDICT_ALPHA and diff > 0 else "ties")
        rows.append({"model": model, "epsilon": eps, "rldp_arm": r_arm, "rldp_mean": float(r.mean()),
                     "rldp_sd": float(r.std(ddof=1)) if len(r) > 1 else float("nan"), "best_baseline": b_arm,
                     "baseline_mean": float(b.mean()), "baseline_sd": float(b.std(ddof=1)) if len(b) > 1 else
                     float("nan"), "seeds": f"{len(r)}/{len(b)}", "change_pct": 100.0 * diff / float(b.mean()),
                     "p_value": p, "verdict": verdict})
    return pd.DataFrame(rows)


#: issue 29's success criterion for a challenger in one cell: significantly better after Holm's correction, by at
#: least this share of the baseline's value and of the baseline's gap to non-private
CHALLENGE_MIN_PCT, CHALLENGE_MIN_GAP_SHARE = 0.5, 0.2


def _holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values (Holm 1979): the k-th smallest of m is multiplied by (m - k + 1),
    made monotone, capped at 1."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    adjusted, running = [1.0] * len(p_values), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def _welch(a, b) -> float:
    from scipy import stats

    if len(a) < 2 or len(b) < 2:
        return float("nan")
    p = float(stats.ttest_ind(a, b, equal_var=False).pvalue)
    return p if p == p else (0.0 if a.mean() != b.mean() else 1.0)  # no spread in either arm: the difference is sure


def _first_step_reaching(run_dir, eval_column: str, target: float, total) -> float:
    """The first evaluated step (> 0) whose ``eval_column`` is <= ``target``, over ``total`` steps (NaN: never)."""
    path = Path(str(run_dir)) / "eval_metrics.parquet"
    if not path.exists():
        return float("nan")
    evals = pd.read_parquet(path)
    if eval_column not in evals:
        return float("nan")
    hit = evals[(evals["step"] > 0) & (evals[eval_column] <= target)]
    return float(hit["step"].iloc[0]) / float(total) if len(hit) and total else float("nan")


def challenge(results: pd.DataFrame, column: str, challenger: str) -> pd.DataFrame:
    """Issue 29's per-cell verdicts of a learned controller (``challenger``: a strategy of :data:`CHALLENGERS`)
    against the best tuned baseline: per model and epsilon, the challenger's arm and the baseline arm with the
    lowest mean on PUBLIC validation (what may select), then on each split the means, sds and Welch's t-test
    over seeds, the private split's p-values Holm-corrected over the model's cells; the baseline's gap to
    non-private and the challenger's share of it; the steps (in % of planned) the challenger's seeds take to
    reach the baseline's mean final private value. ``decision``: *better* (Holm p < 0.05, at least 0.5% and 20%
    of the gap), *worse* (Holm p < 0.05 the other way) or *not shown*, on the private eval split (reference
    only: nothing is selected on it, E15)."""
    done = _cells(results, column)
    if done.empty or not (done["strategy"] == challenger).any():
        return pd.DataFrame()
    private_col, public_col = column.replace("_public_", "_eval_"), column.replace("_eval_", "_public_")
    eval_col = "value_nll" if column.endswith("value_nll") else "perplexity"
    rows = []
    for model, group in done.groupby("model"):
        nonprivate = group[group["strategy"].isin(NONPRIVATE_ARMS)]
        for eps, cell in group[~group["strategy"].isin(NONPRIVATE_ARMS)].groupby("_eps"):
            ch = cell[cell["strategy"] == challenger]
            base = cell[~cell["strategy"].isin(BASELINES_EXCLUDED)]
            if ch.empty or base.empty:
                continue
            ch_arm = ch.groupby("_arm")[public_col].mean().idxmin()
            b_arm = base.groupby("_arm")[public_col].mean().idxmin()
            c, b = ch[ch["_arm"] == ch_arm], base[base["_arm"] == b_arm]
            row = {"model": model, "epsilon": eps, "challenger": ch_arm, "baseline": b_arm, "seeds": f"{len(c)}/{len(b)}"}
            for short, col in (("private", private_col), ("public", public_col)):
                cm, bm = float(c[col].mean()), float(b[col].mean())
                row.update({f"{short}_challenger": cm, f"{short}_challenger_sd": float(c[col].std(ddof=1)),
                            f"{short}_baseline": bm, f"{short}_baseline_sd": float(b[col].std(ddof=1)),
                            f"{short}_change_pct": 100.0 * (cm - bm) / bm, f"{short}_p": _welch(c[col], b[col])})
            np_mean = float(nonprivate[private_col].mean()) if len(nonprivate) else float("nan")
            gap = row["private_baseline"] - np_mean
            row.update(nonprivate=np_mean, gap=gap, gap_share=(row["private_baseline"] - row["private_challenger"]) / gap
                       if gap == gap and gap > 0 else float("nan"))
            total = c["planned_steps"] if "planned_steps" in c else c["steps"]
            reached = [_first_step_reaching(d, eval_col, row["private_baseline"], t) for d, t in zip(c["run_dir"], total)]
            row.update(steps_to_target_pct=100.0 * float(pd.Series(reached).mean()) if any(r == r for r in reached)
                       else float("nan"), seeds_reaching_target=f"{sum(r == r for r in reached)}/{len(reached)}")
            rows.append(row)
    table = pd.DataFrame(rows)
    if table.empty:
        return table
    table["private_p_holm"] = float("nan")
    for model, idx in table.groupby("model").groups.items():  # Holm over the cells that have a test (>= 2 seeds)
        tested = [i for i in idx if table.loc[i, "private_p"] == table.loc[i, "private_p"]]
        if tested:
            table.loc[tested, "private_p_holm"] = _holm(table.loc[tested, "private_p"].tolist())
    better = ((table["private_p_holm"] < VERDICT_ALPHA) & (table["private_change_pct"] <= -CHALLENGE_MIN_PCT)
              & (table["gap_share"] >= CHALLENGE_MIN_GAP_SHARE))
    worse = (table["private_p_holm"] < VERDICT_ALPHA) & (table["private_change_pct"] > 0)
    table["decision"] = [NO_TEST if p != p else "better" if b else "worse" if w else "not shown"
                         for p, b, w in zip(table["private_p"], better, worse)]
    return table


def challenge_success(table: pd.DataFrame) -> str:
    """Issue 29's criterion over a model's cells: better in at least 2 of 3 and worse in none."""
    n_better, n_worse = int((table["decision"] == "better").sum()), int((table["decision"] == "worse").sum())
    untested = int((table["decision"] == NO_TEST).sum())
    if untested == len(table):
        return f"NOT JUDGED: one seed in every cell ({NO_TEST}); the criterion needs a test per cell"
    ok = n_better >= 2 and n_worse == 0
    return (f"{'SUCCESS' if ok else 'NOT MET'}: better in {n_better} of {len(table)} cells, worse in {n_worse}"
            + (f", {untested} with 1 seed (no test)" if untested else "")
            + f" (needs better in >= 2, by >= {CHALLENGE_MIN_PCT:g}% and >= {100 * CHALLENGE_MIN_GAP_SHARE:g}% of the "
            "baseline's gap to non-private, Holm-corrected Welch p < 0.05, and worse in none)")


def _cells(results: pd.DataFrame, column: str) -> pd.DataFrame:
    """Finished trials with a value in ``column`` and both splits' columns, keyed by model, epsilon (NaN for the
    non-private arm, whose epsilon is infinite) and arm (:func:`cell_arm_keys`)."""
    private_col = column.replace("_public_", "_eval_")
    public_col = column.replace("_eval_", "_public_")
    need = [c for c in (private_col, public_col) if c in results]
    if column not in results or not need:
        return pd.DataFrame()
    done = results.dropna(subset=need).copy()
    done["_arm"] = cell_arm_keys(done)
    done["_eps"] = done["epsilon_target"].where(~done["strategy"].isin(NONPRIVATE_ARMS), float("inf"))
    return done


def headroom(results: pd.DataFrame, column: str) -> pd.DataFrame:
    """The DP gap (issue 27): per model, epsilon and arm, the final metric's mean and sd over seeds on both splits,
    each arm's share of the non-private arm's gain over the untrained model (``recovered``: 1 = as good as
    non-private, 0 = no better than not training), and its distance from non-private in pooled seed standard
    deviations, sqrt((sd_arm^2 + sd_np^2) / 2). Empty without a non-private arm."""
    done = _cells(results, column)
    if done.empty or not done["strategy"].isin(NONPRIVATE_ARMS).any():
        return pd.DataFrame()
    rows = []
    for model, group in done.groupby("model"):
        nonprivate = group[group["strategy"].isin(NONPRIVATE_ARMS)]
        for split in ("public", "private"):
            final = column.replace("_eval_", "_public_") if split == "public" else column.replace("_public_", "_eval_")
            initial = final.replace("final_", "initial_")
            if initial in group:
                group[f"_init_{split}"] = group[initial].mean()
        for (eps, arm), g in group.groupby(["_eps", "_arm"]):
            row = {"model": model, "epsilon": eps, "arm": arm, "seeds": len(g)}
            for split, short in (("public", "public"), ("private", "eval")):
                final = column.replace("_eval_", "_public_") if split == "public" else column.replace("_public_", "_eval_")
                mean, sd = float(g[final].mean()), float(g[final].std(ddof=1)) if len(g) > 1 else float("nan")
                np_mean = float(nonprivate[final].mean())
                np_sd = float(nonprivate[final].std(ddof=1)) if len(nonprivate) > 1 else float("nan")
                init = group[f"_init_{split}"].iloc[0] if f"_init_{split}" in group else float("nan")
                pooled = ((sd ** 2 + np_sd ** 2) / 2) ** 0.5
                row.update({f"{short}_mean": mean, f"{short}_sd": sd,
                            f"{short}_recovered": (init - mean) / (init - np_mean) if init != np_mean else float("nan"),
                            f"{short}_sd_from_nonprivate": (mean - np_mean) / pooled if pooled > 0 else float("nan")})
            rows.append(row)
    return pd.DataFrame(rows).sort_values(["model", "epsilon", "public_mean"]).reset_index(drop=True)


#: the benchmark's gates (issue 27): headroom on the primary metric, and a public selection metric that agrees
GATE_HEADROOM_PCT, GATE_HEADROOM_SD, GATE_EPSILON_SD, GATE_SPEARMAN = 3.0, 10.0, 5.0, 0.8


def gates(results: pd.DataFrame, column: str, reference: str = "static-pairwise") -> list[str]:
    """The benchmark's gates as 'PASS: ...' / 'FAIL: ...' lines (issue 27), per model: on the private eval split's
    metric, non-private vs the ``reference`` arm (else the best DP baseline) at the smallest epsilon differ by at
    least 3% and 10 pooled seed sds, and the reference at the smallest vs the largest epsilon by 5 sds; on the cell
    means of every (arm, epsilon), non-private included, public validation ranks like the private split (Spearman
    >= 0.8), and non-private beats every DP arm on public validation."""
    from scipy import stats

    done = _cells(results, column)
    if done.empty or not done["strategy"].isin(NONPRIVATE_ARMS).any():
        return []
    private_col, public_col = column.replace("_public_", "_eval_"), column.replace("_eval_", "_public_")
    out = []
    for model, group in done.groupby("model"):
        dp = group[~group["strategy"].isin(BASELINES_EXCLUDED)]
        if dp.empty:
            continue
        eps = sorted(e for e in dp["_eps"].unique())
        ref = dp[dp["strategy"] == reference]
        name = reference
        if ref.empty:
            name = dp[dp["_eps"] == eps[0]].groupby("_arm")[public_col].mean().idxmin()
            ref = dp[dp["_arm"] == name]
        nonprivate = group[group["strategy"].isin(NONPRIVATE_ARMS)][private_col]
        low, high = ref[ref["_eps"] == eps[0]][private_col], ref[ref["_eps"] == eps[-1]][private_col]

        def pooled(a, b):
            return float((((a.std(ddof=1) if len(a) > 1 else float("nan")) ** 2
                           + (b.std(ddof=1) if len(b) > 1 else float("nan")) ** 2) / 2) ** 0.5)

        def verdict(ok: bool, sds: float) -> str:  # one seed in an arm: no sd, so the gate cannot be judged
            return f"N/A ({NO_TEST})" if math.isnan(sds) else ("PASS" if ok else "FAIL")

        def apart(sds: float) -> str:
            return "" if math.isnan(sds) else f"{sds:.1f} pooled sd"

        gap = float(low.mean() - nonprivate.mean())
        pct, sds = 100 * gap / float(low.mean()), gap / pooled(low, nonprivate)
        ok = pct >= GATE_HEADROOM_PCT and sds >= GATE_HEADROOM_SD
        out.append(f"{verdict(ok, sds)}: {model}: non-private vs {name} at epsilon {eps[0]:g} (private eval): "
                   f"{gap:.3f} nats/record apart, {pct:.1f}%" + (f" and {apart(sds)}" if apart(sds) else "")
                   + f" (needs >= {GATE_HEADROOM_PCT:g}% and >= {GATE_HEADROOM_SD:g} sd)")
        if len(eps) > 1:
            d = float(low.mean() - high.mean())
            sds = d / pooled(low, high)
            out.append(f"{verdict(sds >= GATE_EPSILON_SD, sds)}: {model}: {name} at epsilon {eps[0]:g} vs "
                       f"{eps[-1]:g} (private eval): {d:.3f} nats/record apart" + (f", {apart(sds)}" if apart(sds)
                                                                                   else "")
                       + f" (needs >= {GATE_EPSILON_SD:g} sd)")
        means = group.groupby(["_arm", "_eps"])[[public_col, private_col]].mean()
        if len(means) > 2:
            rho = float(stats.spearmanr(means[public_col], means[private_col]).statistic)
            # Spearman's rho on a few cells takes exact values (4 cells, one swap: 0.8) that scipy returns a rounding
            # short
            out.append(f"{'PASS' if rho >= GATE_SPEARMAN - 1e-9 else 'FAIL'}: {model}: public validation ranks the "
                       f"{len(means)} (arm, epsilon) cells like the private split: Spearman {rho:.3f} (needs >= "
                       f"{GATE_SPEARMAN:g})")
        else:  # two cells rank alike or not: no rank correlation to judge
            out.append(f"N/A ({len(means)} cells: no rank test): {model}: public validation ranks the (arm, epsilon) "
                       f"cells like the private split (needs >= 3 cells and Spearman >= {GATE_SPEARMAN:g})")
        np_public = float(group[group["strategy"].isin(NONPRIVATE_ARMS)][public_col].mean())
        best_dp = group[~group["strategy"].isin(NONPRIVATE_ARMS)].groupby(["_arm", "_eps"])[public_col].mean().min()
        out.append(f"{'PASS' if np_public < best_dp else 'FAIL'}: {model}: non-private beats every DP arm on public "
                   f"validation ({np_public:.3f} against the best DP cell's {best_dp:.3f})")
    return out


def table2(results: pd.DataFrame, column: str = "final_public_perplexity") -> pd.DataFrame:
    if column not in results or "epsilon_target" not in results:  # no trial finished
        return pd.DataFrame()
    private = results.dropna(subset=["epsilon_target", column]).copy()
    private["_arm"] = arm_keys(private)
    rows = []
    for (model, eps), group in private.groupby(["model", "epsilon_target"]):
        frozen = group["frozen_policy"].fillna(False).astype(bool) if "frozen_policy" in group else False
        rldp = group[group["strategy"].isin(CONTROLLERS) & ~frozen]
        base = group[~group["strategy"].isin(BASELINES_EXCLUDED)]  # a non-private run is no baseline at an epsilon
        row = {"model": model, "epsilon": eps}
        if group["strategy"].isin(CONTROLLERS).any() and getattr(frozen, "any", lambda: False)():
            row["rldp_frozen_final"] = float(group[frozen][column].mean())
        if len(rldp):
            cells = rldp.groupby(["t_rl", "b_sac", "k", "_arm"])[column].mean()
            t_rl, b_sac, k, arm = cells.idxmin()
            variant = arm.partition(" ")[2].strip()  # after the strategy's name
            row.update(rldp_final=float(cells.min()), rldp_cell=f"T_RL={int(t_rl)} B_SAC={int(b_sac)} K={int(k)}"
                       + (f" {variant}" if variant else ""))
        if len(base):
            means = base.groupby("_arm")[column].mean()
            row.update(best_baseline=means.idxmin(), baseline_final=float(means.min()))
        if "rldp_final" in row and "baseline_final" in row:
            row["change_pct"] = 100.0 * (row["rldp_final"] - row["baseline_final"]) / row["baseline_final"]
        rows.append(row)
    return pd.DataFrame(rows)


def accuracy_table(results: pd.DataFrame) -> pd.DataFrame:
    """A classification study's final accuracy per model x epsilon x arm: mean and sd over seeds, on public
    validation and (unprotected, E15) on the private eval split."""
    if "final_public_accuracy" not in results:
        return pd.DataFrame()
    done = results.dropna(subset=["final_public_accuracy"]).copy()
    done["arm"] = arm_keys(done)
    done["epsilon_target"] = done["epsilon_target"].fillna(float("inf"))  # nonprivate: no target
    rows = []
    for (model, eps, arm), g in done.groupby(["model", "epsilon_target", "arm"]):
        rows.append({"model": model, "epsilon": eps, "arm": arm, "seeds": len(g),
                     "public_accuracy": g["final_public_accuracy"].mean(),
                     "public_sd": g["final_public_accuracy"].std(ddof=1) if len(g) > 1 else float("nan"),
                     "eval_accuracy": g["final_eval_accuracy"].mean(),
                     "eval_sd": g["final_eval_accuracy"].std(ddof=1) if len(g) > 1 else float("nan")})
    return pd.DataFrame(rows)


def table3(results: pd.DataFrame, column: str = "final_public_perplexity") -> pd.DataFrame:
    if column not in results:  # no trial finished
        return pd.DataFrame()
    frozen = results["frozen_policy"].fillna(False).astype(bool) if "frozen_policy" in results else False
    rldp = results[results["strategy"].isin(CONTROLLERS) & ~frozen].dropna(subset=[column])
    rows = []
    for (model, eps), group in rldp.groupby(["model", "epsilon_target"]):
        cells = group.groupby(["t_rl", "b_sac", "k"])
        best = cells[column].mean().idxmin()
        chosen = cells.get_group(best)
        reached = chosen["steps_to_target"].notna()
        rows.append({"model": model, "epsilon": eps,
                     "steps_to_target_pct": 100.0 * float(chosen["steps_to_target"].mean()) if reached.any() else None,
                     "seeds_reaching_target": f"{int(reached.sum())}/{len(chosen)}"})
    return pd.DataFrame(rows)


def _comparison_arm(results: pd.DataFrame) -> pd.Series:
    """What identifies one arm of one cell across studies: model, epsilon and :func:`cell_arm_keys`."""
    return pd.Series([f"{m} | eps {e:g} | {a}" for m, e, a in zip(results["model"], results["epsilon_target"].fillna(
        float("inf")), cell_arm_keys(results))], index=results.index, dtype=object)


def combine_studies(study_dirs: list[str | Path]) -> tuple[pd.DataFrame, dict, list[str]]:
    """The trials of several studies as one results table, for comparing an arm rerun in a later study (after
    a fix, say) with the arms of an earlier one: where an arm (:func:`_comparison_arm`) appears in more than
    one study, the LAST study's trials replace the earlier ones'. Steps-to-target is recomputed over the
    combined table. Refused (one-line ConfigError) when the studies select on different splits or their
    finished trials ran on different datasets: a verdict across datasets compares nothing. Returns
    (results, a summary with the common selection, notes)."""
    from raydp.study.results import steps_to_target

    loaded = [(Path(d), *load_results(d)) for d in study_dirs]
    columns = {_final_column(r, s) for _, r, s in loaded}
    if len(columns) > 1:
        raise ConfigError("these studies select on different splits or metrics (public validation and private "
                          "eval; value-token NLL and perplexity): their figures do not compare")
    _one_dataset([_study_datasets(r, s) for _, r, s in loaded])
    notes, frames = [], []
    for path, results, summary in loaded:
        results = results.copy()
        results["study"] = summary.get("study", path.name)
        results["_comparison_arm"] = _comparison_arm(results)
        if frames:
            replaced = sorted(set(results["_comparison_arm"]) & set(pd.concat(frames)["_comparison_arm"]))
            if replaced:
                notes.append(f"{len(replaced)} arm(s) of the earlier stud{'y' if len(frames) == 1 else 'ies'} "
                             f"replaced by {results['study'].iloc[0]}'s: " + "; ".join(replaced))
            frames = [f[~f["_comparison_arm"].isin(replaced)] for f in frames]
        frames.append(results)
    combined = pd.concat(frames, ignore_index=True).drop(columns="_comparison_arm")
    column = columns.pop()
    selection = column_split(column)
    metric = "value_nll" if column.endswith("value_nll") else "perplexity"
    if "run_dir" in combined:
        combined["steps_to_target"] = steps_to_target(combined, selection, metric)
    first = loaded[0][2].get("selection") or {}
    return combined, {"selection": {"split": selection, "note": first.get("note"), "metric": metric}}, notes


def _study_datasets(results: pd.DataFrame | None, summary: dict) -> set[str]:
    """The datasets a study's runs touched: its trials' ids, and its tuning-aware figures' (trials may lack a hash; a
    private-dp study has only its figure)."""
    found = set(dataset_ids(results).dropna()) if results is not None else set()
    tuning = summary.get("tuning_aware_epsilon")
    if isinstance(tuning, dict) and tuning and isinstance(next(iter(tuning.values())), dict) and \
            ("runs" in next(iter(tuning.values())) or summary.get("selection") == "private-dp"):
        found |= set(tuning) - {"unknown dataset"}
    return found


def _one_dataset(datasets: list[set[str]]) -> None:
    """Refuse (one line) studies whose runs touched different datasets: nothing to compare or compose."""
    if len(set().union(*datasets)) > 1:
        raise ConfigError("these studies' trials ran on different datasets ("
                          + ", ".join(sorted(set().union(*datasets))) + "): nothing to compare")


def _read_summary(study_dir: str | Path) -> dict:
    path = Path(study_dir) / "study_summary.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _format_selection(study_dir: str | Path) -> str:
    from raydp.study.selection_release import format_selection

    return format_selection(Path(study_dir))


def _format_selection_privacy(summary: dict) -> list[str]:
    """A private-dp study's own privacy lines: what releasing all of its cells costs."""
    from raydp.study.selection_release import all_cells_line

    total = summary.get("all_cells")
    if not total:
        return ["  private selection: its summary does not state the composition of its cells (written before raydp "
                "did): releasing several cells costs more than any one cell's end-to-end epsilon"]
    return [f"  private selection (selection: private-dp): {all_cells_line(total)}"]


def _combined_privacy(study_dirs: list[str | Path]) -> list[str]:
    """Each study's own privacy section, every line of it (labels, warnings, unknown spend, PBT, per-trial
    budgets over all its trials, replaced arms included), then for each dataset the basic composition of the
    studies' tuning-aware figures (Dwork & Roth 2014, Thm. 3.16: epsilons add, deltas add; every run counts).
    A private-dp study's figure is the RDP composition of its cells' end-to-end curves (Mironov 2017, Prop. 1;
    :func:`raydp.study.private_selection.study_figure`), every cell counted whatever it released.
    The total is "unknown" when a study has no figure, a figure lacks its epsilon or delta, or a study
    reports spend it could not compose."""
    per: dict[str, list[tuple[str, dict]]] = {}
    lines, without = [], []
    for d in study_dirs:
        if is_private_selection(d):
            summary = _read_summary(d)
            name = summary.get("study", Path(d).name)
            lines.append(f"\nstudy {name}:")
            lines.extend(_format_selection_privacy(summary))
        else:
            results, summary = load_results(d)
            name = summary.get("study", Path(d).name)
            lines.append(f"\nstudy {name}:")
            lines.extend(line.lstrip("\n") for line in _format_privacy(results, summary))
        tuning = summary.get("tuning_aware_epsilon")
        if isinstance(tuning, dict) and tuning:
            for sha, t in tuning.items():
                per.setdefault(sha, []).append((name, t))
        elif tuning is None:
            without.append(name)
            lines.append(f"  {name}: no tuning-aware figure recorded (no study_summary.json or an unfinished study)")
    if len(study_dirs) > 1:
        lines.append("\nAll studies together (basic composition per dataset):")
    for sha, figures in per.items():
        eps = [t.get("tuning_aware_epsilon") for _, t in figures]
        deltas = [t.get("delta") for _, t in figures]
        reasons = [f"{n} has no epsilon for it" for (n, _), e in zip(figures, eps) if e is None]
        reasons += [f"{n} records no delta" for (n, _), x in zip(figures, deltas) if x is None]
        reasons += [f"{n} has unknown spend" for n, t in figures if t.get("unknown_spend")]
        reasons += [f"{n} has no figure" for n in without]
        total = "unknown: " + "; ".join(reasons) if reasons else f"<= {sum(eps):.3f} at delta {sum(deltas):g}"
        lines.append(f"  dataset {sha[:16]} over {len(figures)} of {len(study_dirs)} studies (every run, replaced "
                     f"arms included): {total}")
        units = sorted({u for _, t in figures for u in (t.get("privacy_units") or ["unknown"])})
        if len(units) > 1:
            lines.append(f"    WARNING: studies of different privacy units ({', '.join(units)}) are composed: the "
                         "figure bounds the smallest unit only; a patient with k records gets group privacy in k (E11)")
        relations = sorted({r for _, t in figures for r in (t.get("neighbouring_relations") or [])})
        if len(relations) > 1:
            lines.append(f"    WARNING: studies under different neighbouring relations ({'; '.join(relations)}) are "
                         "composed: the sum is a guarantee under neither as it stands")
    return lines


def format_report(study_dir: str | Path, *more: str | Path) -> str:
    """The study's tables (module docstring); with ``more`` study directories, the tables of their combined
    trials (:func:`combine_studies`: a later study's arm replaces an earlier study's same arm). A private-dp study
    is shown by its released cells (it has no table of trials) and its spend composes with the others'."""
    if more:
        dirs = [study_dir, *more]
        selections = [d for d in dirs if is_private_selection(d)]
        grids = [d for d in dirs if d not in selections]
        _one_dataset([_study_datasets(None, _read_summary(d)) for d in selections]
                     + [_study_datasets(*load_results(d)) for d in grids])
        lines = []
        if grids:
            results, summary, notes = combine_studies(grids)
            names = ", ".join(dict.fromkeys(results["study"]))
            lines = [f"studies {names} combined: {len(results)} trials "
                     f"({int((results['status'] == 'TERMINATED').sum())} finished)"]
            lines += [f"NOTE: {n}" for n in notes]
            lines += _format_tables(results, summary)
        for d in selections:
            lines += ["", _format_selection(d)]
        return "\n".join(lines + ["\nPrivacy, study by study (ERRATA E7/E14)"] + _combined_privacy(dirs))
    if is_private_selection(study_dir):
        return _format_selection(study_dir)
    results, summary = load_results(study_dir)
    lines = [header_line(summary.get("study", Path(study_dir).name), trial_counts(results, summary))]
    return "\n".join(lines + _format_tables(results, summary) + _format_privacy(results, summary))


def format_study(study_dir: str | Path) -> str:
    """What ``raydp study`` prints when a study ends (not a private-dp one: it prints its released cells): whether
    it finished, the compact table per (model, epsilon) with the trial it would release, the attack and audit lines,
    the gates where it has a non-private arm, the research tables where it has a learned controller, and the
    tuning-aware epsilon; every line at most :data:`raydp.study.outcome.WIDTH` characters. ``raydp report`` prints
    every table."""
    results, summary = load_results(study_dir)
    lines = [header_line(summary.get("study", Path(study_dir).name), trial_counts(results, summary))]
    lines += _format_tables(results, summary, brief=True) + privacy_lines(results, summary)
    return "\n".join(out for line in "\n".join(lines).split("\n") for out in wrap(line))


def study_outcome(results: pd.DataFrame, summary: dict) -> tuple[str, list[dict], dict[str, str]]:
    """(selection column, :func:`raydp.study.outcome.outcome_cells`, short arm names) of a study's results."""
    column = _final_column(results, summary)
    cells = outcome_cells(results, column)
    labels = [r["arm"] for c in cells for r in c["arms"]] + [c["nonprivate"]["arm"] for c in cells
                                                                 if c.get("nonprivate")]
    if "strategy" in results:  # arms of no cell (an unfinished one) keep a name too, numbered after
        labels += list(cell_arm_keys(results))
    return column, cells, short_names(labels)


def record_outcome(study_dir: str | Path) -> dict:
    """Add to ``study_summary.json`` what :func:`format_study` prints in its table (rounded as printed), the trial
    each (model, epsilon) cell would release (:func:`raydp.study.results.would_release`) and the trial counts
    (``partial`` for a stopped study): :func:`raydp.study.outcome.outcome_record`. Returns what it added."""
    from raydp.files import atomic_write  # lazy: only a finished study writes

    results, summary = load_results(study_dir)
    column, cells, names = study_outcome(results, summary)
    record = outcome_record(cells, column, names, trial_counts(results, summary))
    atomic_write(Path(study_dir) / "study_summary.json", json.dumps({**summary, **record}, indent=2, default=str))
    return record


def _has_controller(results: pd.DataFrame) -> bool:
    return "strategy" in results and bool(results["strategy"].isin(CONTROLLERS).any())


def _format_tables(results: pd.DataFrame, summary: dict, brief: bool = False) -> list[str]:
    """The tables after the header: notes and labels, the compact table per (model, epsilon) with its attack lines,
    the DP gap (not ``brief``) and the gates, and the research tables where the study has the arms they compare:
    Table 2 and 3 analogues and the verdicts with RLDP trials, each learned controller's challenge where it ran.
    ``brief`` (``raydp study``) names arms by their short names (footnoted with their settings)."""
    lines = []
    if "privacy_label" in results and results["privacy_label"].notna().any():
        lines.append(f"NOTE: paper-mode trials: {results['privacy_label'].dropna().iloc[0]}")
    if "privacy_labels" in results and results["privacy_labels"].notna().any():
        for label in dict.fromkeys(l for ls in results["privacy_labels"].dropna() for l in ls.split("; ")):
            lines.append(f"LABEL: {label}")
    column, cells, names = study_outcome(results, summary)
    selection = summary.get("selection") or {}
    note = selection.get("note") or ("selection used the public validation split (E15)" if column_split(column) ==
                                     "public" else "selection used the private eval split: unprotected (E15)")
    lines.append(f"NOTE: {note}")
    lines += format_outcome(cells, column, names)
    lines += attack_lines(results, names)
    split = f"{split_label(column)} {metric_label(column)}"
    named = names if brief else {}
    head = headroom(results, column)
    if len(head):
        if not brief:
            lines.append(f"\nThe DP gap: final {metric_label(column)}, mean ± sd over seeds, on both splits (public "
                         "validation selects; the private eval split is unprotected, E15, and shown for reference). "
                         "'recovered' is the share of the non-private run's gain over the untrained model; 'sd from "
                         "non-private' is the difference in pooled seed standard deviations")
            lines.append(head.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
        gate_lines = gates(results, column)
        if brief and gate_lines:
            lines.append("\nThe benchmark's gates (docs/benchmark.md):")
        lines.extend(f"  gate: {g}" for g in gate_lines)
    if _has_controller(results):
        t2 = table2(results, column)
        lines.append(f"\nTable 2 analogue: final {split} (mean over seeds)")
        if len(t2) and "best_baseline" in t2:
            t2["best_baseline"] = [named.get(a, a) if isinstance(a, str) else a for a in t2["best_baseline"]]
        lines.append(t2.to_string(index=False, float_format=lambda x: f"{x:.4f}") if len(t2) else "  (no DP trials)")
        lines.extend(_format_verdicts(verdicts(results, column), split, named, brief))
    for challenger in CHALLENGERS:
        lines.extend(_format_challenge(challenge(results, column, challenger), challenger, named, brief))
    if _has_controller(results):
        t3 = table3(results, column)
        lines.append(f"\nTable 3 analogue: RLDP steps to reach the best baseline's final {split} "
                     "(% of its steps)")
        if not (~results["strategy"].isin(BASELINES_EXCLUDED)).any():
            lines.append("  (no DP baseline in this study: no target to reach)")
        else:
            lines.append(t3.to_string(index=False, float_format=lambda x: f"{x:.1f}") if len(t3)
                         else "  (no RLDP trial that learns online; a frozen policy's are in Table 2)")
    acc = accuracy_table(results)
    if len(acc):
        lines.append("\nClassification accuracy (final; mean and sd over seeds; eval: private split, unprotected, E15)")
        lines.append(acc.to_string(index=False, float_format=lambda x: f"{x:.4f}"))
    return lines


def _pm(mean: float, sd: float, fmt: str = ".4f") -> str:
    """``mean ± sd``, or the mean alone where there is no sd (one seed)."""
    return f"{mean:{fmt}}" + ("" if sd != sd else f" ± {sd:{fmt}}")


def _format_verdicts(v: pd.DataFrame, split: str, names: dict[str, str], brief: bool = False) -> list[str]:
    if v.empty:
        return []
    lines = [f"\nRLDP against the best baseline: final {split}, mean ± sd over seeds; Welch's t-test at "
             f"{VERDICT_ALPHA:g} (wins/ties/loses). Both arms are chosen after the fact, the baseline as the best of all "
             "baseline arms (which favours the baselines); 'ties' means no significant difference over these seeds, "
             "not equality"] if not brief else [
        f"\nRLDP against the best baseline (both chosen after the fact; Welch's t-test over seeds at {VERDICT_ALPHA:g}; "
        "'ties': no significant difference)"]
    for rec in v.to_dict("records"):
        verdict = rec["verdict"].upper() if rec["verdict"] in ("wins", "ties", "loses") else rec["verdict"]
        p = "" if rec["p_value"] is None else f", p={rec['p_value']:.3g}"
        lines.append(f"  {rec['model']} eps {rec['epsilon']:g}: RLDP {verdict} ({names.get(rec['rldp_arm'], rec['rldp_arm'])} "
                     f"{_pm(rec['rldp_mean'], rec['rldp_sd'])} vs {names.get(rec['best_baseline'], rec['best_baseline'])} "
                     f"{_pm(rec['baseline_mean'], rec['baseline_sd'])}; {rec['change_pct']:+.2f}%{p}, seeds {rec['seeds']})")
    return lines


def _format_challenge(table: pd.DataFrame, challenger: str, names: dict[str, str] | None = None,
                      brief: bool = False) -> list[str]:
    if table.empty:
        return []
    names = names or {}
    lines = [f"\n{challenger} against the best tuned baseline: both arms chosen on PUBLIC validation; the "
             "decision is on the private eval split (reference only, E15), Welch over seeds, Holm over the cells; "
             "gap: the baseline's distance from non-private; steps: % of planned steps to reach the baseline's final "
             "private mean"] if not brief else [
        f"\n{challenger} against the best tuned baseline (both chosen on public validation; decided on the private "
        "eval split, E15: Welch over seeds, Holm over cells)"]
    for model, group in table.groupby("model"):
        for r in group.to_dict("records"):
            holm = "" if r["private_p_holm"] != r["private_p_holm"] else f", Holm p={r['private_p_holm']:.3g}"
            p = "" if r["public_p"] != r["public_p"] else f", p={r['public_p']:.3g}"
            gap = (f"; {r['gap_share']:.0%} of the gap {r['gap']:.3f} to non-private {r['nonprivate']:.3f}"
                   if r["gap_share"] == r["gap_share"] else "")
            steps = ("never" if r["steps_to_target_pct"] != r["steps_to_target_pct"]
                     else f"{r['steps_to_target_pct']:.0f}%")
            lines.append(f"  {model} eps {r['epsilon']:g}: {r['decision'].upper() if r['decision'] != NO_TEST else NO_TEST}: "
                         f"{names.get(r['challenger'], r['challenger'])} vs {names.get(r['baseline'], r['baseline'])} "
                         f"(seeds {r['seeds']})")
            lines.append(f"    private {_pm(r['private_challenger'], r['private_challenger_sd'], '.3f')} vs "
                         f"{_pm(r['private_baseline'], r['private_baseline_sd'], '.3f')} ({r['private_change_pct']:+.2f}%"
                         f"{holm}){gap}")
            lines.append(f"    public {_pm(r['public_challenger'], r['public_challenger_sd'], '.3f')} vs "
                         f"{_pm(r['public_baseline'], r['public_baseline_sd'], '.3f')} ({r['public_change_pct']:+.2f}%{p}); "
                         f"steps to target {steps} ({r['seeds_reaching_target']} seeds)")
        lines.append(f"  {model}: {challenge_success(group)}")
    return lines


def _format_privacy(results: pd.DataFrame, summary: dict) -> list[str]:
    lines = []
    tuning = summary.get("tuning_aware_epsilon")
    if isinstance(tuning, dict) and tuning:
        lines.append("\nTuning-aware epsilon (ERRATA E7/E14; RDP upper bounds): every run on the same private "
                     "dataset composes, whatever its target epsilon")
        for sha, t in tuning.items():
            lines.extend(_format_figure(sha, t))
    elif tuning:
        lines.append(f"\nTuning-aware epsilon: {tuning}")
    pbt = summary.get("pbt_population")  # a PBT study: the population filter's guarantee (raydp.study.population)
    if pbt:
        lines.append(f"\nPBT population: {pbt['members']} members, {pbt['exploits']} exploits; population epsilon "
                     f"{pbt['population_epsilon']:.3f} at delta {pbt['delta']:g} (Renyi filter over every member's "
                     f"steps, discarded ones included: {'within' if pbt['within_budget'] else 'OVER'} its budget)")
    within = results["within_budget"].dropna() if "within_budget" in results else pd.Series(dtype=bool)
    if len(within):
        lines.append(f"\nper-trial budgets: {int(within.sum())}/{len(within)} within (enforcing accountant)")
    return lines


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _format_figure(sha: str, t: dict) -> list[str]:
    if "runs" not in t:  # a summary written before per-dataset figures (keyed by target epsilon)
        return [f"  target {sha}: K={t['trials']}, tuning-aware (composition) {t['tuning_aware_epsilon']:.3f}; "
                f"single trial <= {t['max_single_trial_epsilon_rdp']:.3f}; repeat-and-select "
                f"{t['repeat_and_select_epsilon_rdp']:.3f} (only if K were Poisson)"]
    targets = ", ".join(f"{e:g}" for e in t.get("target_epsilons") or []) or "none"
    lines = [f"  dataset {sha[:16]}: {t['runs']} runs ({t['trials']} trials; targets {targets}), "
             f"tuning-aware (composition) {_fmt(t['tuning_aware_epsilon'])} at delta {t['delta']:g}; "
             f"single trial <= {_fmt(t['max_single_trial_epsilon_rdp'])}; repeat-and-select "
             f"{_fmt(t['repeat_and_select_epsilon_rdp'])} (only if K were Poisson)"]
    lines += [f"    LABEL: {label}" for label in t.get("labels") or []]
    lines += [f"    WARNING: {w}" for w in t.get("warnings") or []]
    return lines
