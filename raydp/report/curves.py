"""The page's curves over training: utility (RLDP paper Fig. 1-4 analogues), the dials each strategy turned with
the privacy spent (Fig. 5-8), and the privacy-utility frontier."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from raydp.report import figures
from raydp.report.load import Report, _best_rldp_cell, _controller_cells, _groups
from raydp.report.markup import _eps, _missing, _section, figure, how, num, para

MAX_DIALS = 24


def utility(r: Report, colours: dict[str, str]) -> str:
    res = r.results
    ylabel = f"{'public validation' if r.public else 'private eval'} {r.metric}"
    panels, notes = [], []
    nonprivate = res[res["epsilon_target"].isna()]
    only_nonprivate = nonprivate.shape[0] == res.shape[0]
    rldp_notes = []
    for model, eps, group in _groups(res):
        if _missing(eps) and not only_nonprivate:
            continue  # non-private trials are drawn as a dashed reference in their model's panels
        panel = figures.Panel(f"{model} · ε = {_eps(eps)}")
        best, n_cells = _best_rldp_cell(group, r.column)
        if best is not None:
            rldp_notes.append(f"ε={_eps(eps)}: best cell {best.partition(' ')[2]}"
                              + (f" of {n_cells}" if n_cells > 1 else ""))
        for arm in dict.fromkeys(group["arm"]):
            rows = group[group["arm"] == arm]
            is_rldp = bool(_controller_cells(rows).all())
            strategy = str(rows["strategy"].iloc[0])
            if is_rldp and arm != best:
                s = _series(r, rows, f"{strategy} other SAC cells (thin, mean over seeds)", colours[strategy],
                            band=False)
                if s is not None:
                    s.thin = True
                    panel.series.append(s)
                continue
            label = f"{strategy} (best cell {arm.partition(' ')[2]})" if is_rldp and n_cells > 1 else arm
            s = _series(r, rows, label, colours.get(arm, colours.get(strategy, "#333333")))
            if s is not None:
                panel.series.append(s)
        if not _missing(eps):
            for arm in dict.fromkeys(nonprivate[nonprivate["model"] == model]["arm"]):
                rows = nonprivate[(nonprivate["model"] == model) & (nonprivate["arm"] == arm)]
                s = _series(r, rows, "non-private (reference)", colours[str(rows["strategy"].iloc[0])], band=False)
                if s is not None:
                    s.dashed = True
                    panel.series.append(s)
        if panel.series:
            panels.append(panel)
        else:
            notes.append(f"{model} ε={_eps(eps)}: no trial has eval_metrics.parquet with {r.eval_column}")
    body = [how(f"lower is better. Each line is one strategy's {ylabel} over training steps, the mean over "
                "seeds; the shaded band spans the minimum to the maximum over seeds (no band: one seed). "
                "One panel per model and target epsilon (RLDP paper Fig. 1-4).")]
    if panels:
        rldp_text = ("RLDP: its best SAC cell (lowest mean final selection perplexity, as in Table 2) in bold with "
                     "its band; other cells, if any, as thin lines (" + "; ".join(rldp_notes) + ")."
                     if rldp_notes else "No RLDP trials.")
        body.append(figure("fig-utility", figures.utility_figure(panels, ylabel, "fig-utility"),
                           f"{ylabel.capitalize()} vs step, mean over seeds with min-max band. {rldp_text}"))
    else:
        body.append(para("no utility curves: no trial has an eval_metrics.parquet with the selection split's "
                         "perplexity", "missing"))
    body += [para(n, "missing") for n in notes]
    return _section("sec-utility", "Utility over training", "\n".join(body))


def _series(r: Report, rows: pd.DataFrame, label: str, colour: str, band: bool = True):
    curves = []
    for _, row in rows.iterrows():
        evals = r.evals(row)
        if evals is None or r.eval_column not in evals or "step" not in evals:
            continue
        curves.append(evals.groupby("step")[r.eval_column].last().rename(str(row["trial"])))
    if not curves:
        return None
    frame = pd.concat(curves, axis=1).sort_index()
    frame = frame.dropna(how="all")
    steps = frame.index.to_numpy(dtype=float)
    mean = frame.mean(axis=1).to_numpy()
    multi = frame.shape[1] > 1
    return figures.Series(label, steps, mean,
                          frame.min(axis=1).to_numpy() if band and multi else None,
                          frame.max(axis=1).to_numpy() if band and multi else None, colour)


def dials(r: Report) -> str:
    res = r.results
    chosen = []
    for model, eps, group in _groups(res):
        if _missing(eps):
            continue
        best, _ = _best_rldp_cell(group, r.column)
        for arm in dict.fromkeys(group["arm"]):
            rows = group[group["arm"] == arm]
            if bool(_controller_cells(rows).all()) and arm != best:
                continue  # RLDP: its best SAC cell only
            rows = rows.sort_values("seed", kind="stable") if "seed" in rows else rows
            row = next((row for _, row in rows.iterrows() if r.ledger(row) is not None), None)
            if row is not None:
                chosen.append((model, eps, arm, row))
    body = [how("the dials the strategy turned, for the first seed of each (model, epsilon, strategy): left, the "
                "clip radius of each LoRA adapter pair (one line per pair; log scale when the radii span a "
                "factor of 10 or more; one line for a flat clip); right, the effective noise multiplier sigma_eff "
                "charged by the privacy ledger (RLDP paper Fig. 5-8). Steps count from 1, as in the utility "
                "curves. Ticks at the bottom of the right panel mark the RLDP controller's decisions. RLDP: its "
                "best SAC cell only.")]
    if not chosen:
        body.append(para("no dials: no DP trial has a privacy_ledger.parquet" +
                         (" (non-private trials have none)" if res["epsilon_target"].isna().any() else ""),
                         "missing"))
    for i, (model, eps, arm, row) in enumerate(chosen[:MAX_DIALS], start=1):
        ledger = r.ledger(row).sort_values("step")
        clips = _clip_matrix(ledger["clip"]) if "clip" in ledger else np.full((len(ledger), 1), np.nan)
        trace = r.trace(row)
        decisions = None
        if trace is not None and "decision" in trace and "step" in trace:
            decisions = trace.loc[trace["decision"].fillna(False).astype(bool), "step"].to_numpy()
        seed = "?" if _missing(row.get("seed")) else int(row["seed"])
        title = f"{model} ε={_eps(eps)} · {arm} · seed {seed}"
        fid = f"fig-dials-{i}"
        # the ledger's step i is the (i+1)-th step: drawn at i+1, the step count of evaluations and the trace
        spent = _epsilon_over_steps(ledger, row)
        svg = figures.dials_figure(title, ledger["step"].to_numpy(float) + 1, clips,
                                   ledger["sigma_eff"].to_numpy(float) if "sigma_eff" in ledger
                                   else np.full(len(ledger), np.nan), decisions, fid, epsilon=spent)
        clip_span = (f"clip range {num(np.nanmin(clips), 4)} to {num(np.nanmax(clips), 4)}; "
                     if np.isfinite(clips).any() else "no gradient clip (a local mechanism); ")
        span = (f"{clip_span}sigma_eff {num(ledger['sigma_eff'].min(), 4)} to {num(ledger['sigma_eff'].max(), 4)}"
                if "sigma_eff" in ledger and len(ledger) else "")
        spent_note = (f"; privacy spent over steps: the RDP upper bound, {num(spent[1][-1], 3)} at the end (the "
                      f"enforcing accountant's figure, {num(row.get('epsilon'), 3)}, is tighter: privacy table)"
                      if spent is not None else "")
        body.append(figure(fid, svg, f"{title} (trial {row['trial']}): {clips.shape[1]} clip radius(es) per step "
                                     f"over {len(ledger)} ledger steps; {span}{spent_note}."))
    if len(chosen) > MAX_DIALS:
        body.append(para(f"{len(chosen) - MAX_DIALS} more dial figures omitted (at most {MAX_DIALS} are drawn).",
                         "missing"))
    return _section("sec-dials", "Dials over steps: clip radii and noise", "\n".join(body))


#: points at which the dials figure's privacy-spent curve is computed
EPSILON_POINTS = 40


def _epsilon_over_steps(ledger: pd.DataFrame, row) -> tuple[np.ndarray, np.ndarray] | None:
    """The epsilon the ledger's first k steps spend, at up to :data:`EPSILON_POINTS` values of k
    (:func:`raydp.privacy.accounting.rdp.epsilon_over_steps`, the RDP bound) at the trial's delta. The enforcing
    accountant's (tighter, PLD) final figure is in the privacy table."""
    from raydp.privacy.accounting.rdp import epsilon_over_steps

    delta = row.get("delta")
    if _missing(delta):
        config = json.loads(row["config"]) if isinstance(row.get("config"), str) else {}
        delta = config.get("delta")
    if _missing(delta) or not {"q", "sigma_eff"} <= set(ledger) or not len(ledger):
        return None
    return epsilon_over_steps(ledger["q"], ledger["sigma_eff"], float(delta), EPSILON_POINTS)


def _clip_matrix(column: pd.Series) -> np.ndarray:
    values = [np.atleast_1d(np.asarray(v, dtype=float)) if v is not None else np.array([np.nan]) for v in column]
    width = max((len(v) for v in values), default=1)
    out = np.full((len(values), width), np.nan)
    for i, v in enumerate(values):
        out[i, : len(v)] = v
    return out


def _frontier(r: Report) -> list[str]:
    """The privacy-utility frontier figure (per model with two or more target epsilons): per arm, the final
    selection-split metric against epsilon, mean ± sd over seeds; non-private as a line."""
    res, out = r.results, []
    if r.column not in res or "epsilon_target" not in res:
        return out
    for model, group in res.dropna(subset=[r.column]).groupby("model"):
        dp = group[group["epsilon_target"].notna()]
        if dp["epsilon_target"].nunique() < 2:
            continue
        series = []
        for arm, g in dp.groupby("arm", sort=False):
            cells = g.groupby("epsilon_target")[r.column].agg(["mean", "std"]).sort_index()
            series.append((arm, cells.index.to_numpy(float), cells["mean"].to_numpy(float), cells["std"].to_numpy(float)))
        nonprivate = group[group["epsilon_target"].isna()][r.column]
        np_line = (float(nonprivate.mean()), float(nonprivate.std(ddof=1)) if len(nonprivate) > 1 else float("nan")) \
            if len(nonprivate) else None
        fid = f"fig-frontier-{len(out) + 1}"
        out.append(figure(fid, figures.frontier_figure(series, np_line, f"final {r.split_name} {r.metric}", fid),
                          f"{model}: the privacy-utility frontier, final {r.split_name} {r.metric} per arm against the "
                          f"target epsilon (mean ± sd over seeds; {len(series)} arms)" +
                          ("; dashed: non-private (band: ± sd)." if np_line else ".")))
    return out
