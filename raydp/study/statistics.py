"""The statistics of a study's results: its trials read back, the comparisons and tests the tables print.

A study's ``results.parquet`` and ``study_summary.json`` are read by :func:`load_results` (a ``selection:
private-dp`` study has no results table: :func:`is_private_selection`), and several studies' trials combined by
:func:`combine_studies` (a later study's arm replaces an earlier study's same arm; one dataset only). The metric is
the study's selection split (ERRATA E15): the public validation split by default; the private eval split (not a DP
release) when the study selects on it (:func:`_final_column`).

* the RLDP paper's Table 2 and Table 3 analogues (:func:`table2`, :func:`table3`): final perplexity per model x
  epsilon, RLDP (its best SAC cell, mean over seeds) against the best baseline (the DP strategy with the lowest mean
  final perplexity), and RLDP's steps-to-target (Sec. 4.2) in % of its steps, a frozen transferred policy in its own
  column;
* verdicts (:func:`verdicts`): per model x epsilon, RLDP's best arm against the best baseline arm, both chosen after
  the fact by mean final perplexity, and Welch's t-test over their seeds (two-sided, 5%): RLDP *wins* or *loses*
  when the difference is significant, and *ties* otherwise. Choosing the best baseline after seeing the results
  favours the baselines; choosing RLDP's best cell favours RLDP;
* a learned controller's challenge (:func:`challenge`, :func:`challenge_success`): Welch over seeds, Holm over the
  cells;
* the DP gap (:func:`headroom`) and the benchmark's gates (:func:`gates`, docs/benchmark.md);
* classification accuracy (:func:`accuracy_table`).

Where an arm has one seed there is no test: verdicts, challenges and the sd-based gates say so (:data:`NO_TEST`).
The terminal's text tables built from these are :mod:`raydp.study.tables`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

from raydp.data.identity import frame_ids as dataset_ids
from raydp.errors import ConfigError
from raydp.run_directory import RunDirectory
from raydp.study.arms import arms
from raydp.study.results import BASELINE_EXCLUDED, CONTROLLERS, NONPRIVATE_ARMS


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


#: a challenger's success criterion in one cell: significantly better after Holm's correction, by at
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
    path = RunDirectory(str(run_dir)).eval_metrics
    if not path.exists():
        return float("nan")
    evals = pd.read_parquet(path)
    if eval_column not in evals:
        return float("nan")
    hit = evals[(evals["step"] > 0) & (evals[eval_column] <= target)]
    return float(hit["step"].iloc[0]) / float(total) if len(hit) and total else float("nan")


def challenge(results: pd.DataFrame, column: str, challenger: str) -> pd.DataFrame:
    """The per-cell verdicts of a learned controller (``challenger``: a strategy of
    :data:`raydp.study.results.CHALLENGERS`) against the best tuned baseline: per model and epsilon, the
    challenger's arm and the baseline arm with the lowest mean on PUBLIC validation (what may select), then on
    each split the means, sds and Welch's t-test over seeds, the private split's p-values Holm-corrected over the
    model's cells; the baseline's gap to non-private and the challenger's share of it; the steps (in % of planned)
    the challenger's seeds take to reach the baseline's mean final private value. ``decision``: *better* (Holm
    p < 0.05, at least 0.5% and 20% of the gap), *worse* (Holm p < 0.05 the other way) or *not shown*, on the
    private eval split (reference only: nothing is selected on it, E15)."""
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
    """The challenge's criterion over a model's cells: better in at least 2 of 3 and worse in none."""
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
    """The DP gap: per model, epsilon and arm, the final metric's mean and sd over seeds on both splits,
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


#: the benchmark's gates: headroom on the primary metric, and a public selection metric that agrees
GATE_HEADROOM_PCT, GATE_HEADROOM_SD, GATE_EPSILON_SD, GATE_SPEARMAN = 3.0, 10.0, 5.0, 0.8


def gates(results: pd.DataFrame, column: str, reference: str = "static-pairwise") -> list[str]:
    """The benchmark's gates as 'PASS: ...' / 'FAIL: ...' lines, per model: on the private eval split's
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
