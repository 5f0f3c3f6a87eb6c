"""The page's curves over training: utility (RLDP paper Fig. 1-4 analogues), the dials each strategy turned with
the privacy spent (Fig. 5-8), and the privacy-utility frontier."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from raydp.report import figures
from raydp.privacy.accounting.grid import StepHistogram
from raydp.report.load import Report, _best_rldp_cell, _controller_cells, _dig, _groups
from raydp.report.markup import _eps, _missing, _section, figure, how, num, para
from raydp.errors import ConfigError
from raydp.strategies.registry import get_spec
from raydp.study.results import CONTROLLERS

MAX_DIALS = 24


def utility(r: Report, colours: dict[str, str]) -> str:
    res = r.results
    ylabel = f"{r.split_label} {r.metric}"
    panels, notes = [], []
    nonprivate = res[res["epsilon_target"].isna()]
    only_nonprivate = nonprivate.shape[0] == res.shape[0]
    rldp_notes, frozen = [], []  # the controller's trained cells (best per panel) and its frozen-policy arms drawn
    for model, eps, group in _groups(res):
        if _missing(eps) and not only_nonprivate:
            continue  # non-private trials are drawn as a dashed reference in their model's panels
        panel = figures.Panel(f"{model} · ε = {_eps(eps)}")
        best, n_cells = _best_rldp_cell(group, r.column)
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
            short = r.short(arm)
            label = f"{strategy} (best cell {short.partition(' ')[2]})" if is_rldp and n_cells > 1 else short
            s = _series(r, rows, label, colours.get(arm, colours.get(strategy, "#333333")))
            if s is not None:
                panel.series.append(s)
                if is_rldp:
                    rldp_notes.append(f"ε={_eps(eps)}: best cell {short.partition(' ')[2]}"
                                      + (f" of {n_cells}" if n_cells > 1 else ""))
                elif strategy in CONTROLLERS:
                    frozen.append(short)
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
        body.append(figure("fig-utility", figures.utility_figure(panels, ylabel, "fig-utility"),
                           f"{ylabel[:1].upper()}{ylabel[1:]} vs step, mean over seeds with min-max band. "
                           + _rldp_caption(rldp_notes, frozen) + _legend_caption(r)))
    else:
        body.append(para("no utility curves: no trial has an eval_metrics.parquet with the selection split's "
                         "perplexity", "missing"))
    body += [para(n, "missing") for n in notes]
    return _section("sec-utility", "Utility over training", "\n".join(body))


def _rldp_caption(trained: list[str], frozen: list[str]) -> str:
    """What the utility figure draws of the controller (RLDP), from the series it drew."""
    parts = []
    if trained:
        parts.append("RLDP trained during the run: its best SAC cell (lowest mean final selection perplexity, as in "
                     "Table 2) in bold with its band; other cells, if any, as thin lines (" + "; ".join(trained) + ").")
    if frozen:
        names = ", ".join(dict.fromkeys(frozen))
        parts.append(f"RLDP driven by a frozen policy (trained before the run, nothing learned on this data): {names}, "
                     "drawn like any arm.")
    return " ".join(parts) or "No RLDP trials."


def _legend_caption(r: Report) -> str:
    """Where the settings are that the legend's short arm names leave out (none: nothing to say)."""
    if all(r.short(arm) == arm for arm in r.results["arm"]):
        return ""
    return " Legend: short arm names; each arm's settings are in the arms table (Overview)."


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
                "factor of 10 or more; one line for a flat clip), as the privacy ledger charged it: an absolute "
                "radius, whatever the strategy's settings are relative to (the caption says); middle, the effective "
                "noise multiplier sigma_eff charged by the ledger (RLDP paper Fig. 5-8); right, the privacy spent "
                "by the steps so far as the run's enforcing accountant counts it, beside the target. Steps count "
                "from 1, as in the utility curves. Ticks at the bottom of the middle panel mark the RLDP "
                "controller's decisions. RLDP: its best SAC cell only.")]
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
        title = f"{model} ε={_eps(eps)} · {r.short(arm)} · seed {seed}"  # the full label: in the caption
        fid = f"fig-dials-{i}"
        # the ledger's step i is the (i+1)-th step: drawn at i+1, the step count of evaluations and the trace
        spent, spent_note = _privacy_spent(r, ledger, row)
        svg = figures.dials_figure(title, ledger["step"].to_numpy(float) + 1, clips,
                                   ledger["sigma_eff"].to_numpy(float) if "sigma_eff" in ledger
                                   else np.full(len(ledger), np.nan), decisions, fid, spent=spent)
        clip_span = (f"clip radii (absolute) {num(np.nanmin(clips), 4)} to {num(np.nanmax(clips), 4)}; "
                     if np.isfinite(clips).any() else "no gradient clip (a local mechanism); ")
        span = (f"{clip_span}sigma_eff {num(ledger['sigma_eff'].min(), 4)} to {num(ledger['sigma_eff'].max(), 4)}"
                if "sigma_eff" in ledger and len(ledger) else "")
        clip_note = _clip_note(r.run_summary(row))
        body.append(figure(fid, svg, f"{model} ε={_eps(eps)} · {arm} · seed {seed} (trial {row['trial']}): "
                                     f"{clips.shape[1]} clip radius(es) per step over {len(ledger)} ledger steps; "
                                     f"{span}{spent_note}." + (f" {clip_note}" if clip_note else "")))
    if len(chosen) > MAX_DIALS:
        body.append(para(f"{len(chosen) - MAX_DIALS} more dial figures omitted (at most {MAX_DIALS} are drawn).",
                         "missing"))
    return _section("sec-dials", "Dials over steps: clip radii and noise", "\n".join(body))


def _clip_basis(summary: dict | None) -> str | None:
    """The arms table's one-line version of :func:`_clip_note`: what the arm's clip settings are relative to."""
    note = _clip_note(summary)
    if note is None:
        return None
    if note.startswith("Its clips are relative"):
        return "relative: the policy sets C_i = r_i · e^(a_i), r_i each pair's median public gradient norm"
    if note.startswith("Its schedule's settings are absolute"):
        return "absolute radii (the schedule's), scaled by the policy"
    return ("relative: clip and clip_end multiply r_i, each pair's median public gradient norm"
            + ("; the policy scales each clip" if note.startswith("Its schedule's") else ""))


def _relative_clips(name) -> bool:
    """Whether the strategy ``name`` declares relative clip settings (its registry capability)."""
    try:
        return bool(name) and get_spec(str(name)).relative_clips
    except ConfigError:  # a strategy this raydp does not know (a study written by another version)
        return False


def _clip_note(summary: dict | None) -> str | None:
    """What a strategy's clip settings are relative to, from the run's summary.json (the strategy's resolved settings
    and the public reference norms it measured): the ledger, and so the dials figure, holds absolute radii, while a
    relative strategy's settings multiply each pair's median per-sample gradient norm on PUBLIC records, r_i
    (:mod:`raydp.strategies.clipschedule`; RLDP's relative and residual action decodings,
    :mod:`raydp.strategies.rldp_settings`). None for a strategy whose settings are absolute radii."""
    if not isinstance(summary, dict):
        return None
    strategy = _dig(summary, "privacy", "strategy") or {}
    controller = summary.get("controller") if isinstance(summary.get("controller"), dict) else {}
    name = strategy.get("name") or summary.get("strategy")
    decoding = strategy.get("action_decoding") or controller.get("action_decoding")
    norms = strategy.get("public_reference_norms") or controller.get("pair_reference")
    r_i = (" (r_i here: " + ", ".join(f"{float(x):.4g}" for x in norms[:8]) + (", …" if len(norms) > 8 else "") + ")"
           if norms else "")
    median = "r_i, each adapter pair's median per-sample gradient norm on public records"
    if _relative_clips(name) and (strategy.get("settings") or {}).get("relative", True):
        return (f"Its settings are relative: clip and clip_end multiply {median}{r_i}; the radius of pair i at step t "
                "of T is r_i · clip^(1−t/T) · clip_end^(t/T) · e^(depth_tilt (d_i − 1/2)), d_i its depth in [0, 1], "
                "so the radii plotted are not the settings in the arm's label.")
    if decoding == "residual":
        schedule = controller.get("schedule") or {}
        relative = schedule.get("relative", True)
        return (("Its schedule's settings are relative: clip and clip_end multiply " + median + r_i if relative else
                 "Its schedule's settings are absolute radii")
                + "; the policy moves each pair's scheduled clip by a factor within "
                f"e^±{controller.get('residual_range', '?')}.")
    if decoding in ("relative", "relative-capped"):
        return f"Its clips are relative: the policy's action a_i sets C_i = r_i · e^(a_i), with {median}{r_i}."
    return None


#: points at which the dials figure's privacy-spent curves are computed
EPSILON_POINTS = 40
#: points of the enforcing accountant's curve when it composes privacy loss distributions (PLD, PRV: the costly part
#: of the page)
COMPOSED_POINTS = 24


def _delta(row, summary: dict | None = None):
    """The trial's delta: its row's, its config's (a study's row) or its summary.json's (a single run's)."""
    delta = row.get("delta")
    if _missing(delta):
        config = json.loads(row["config"]) if isinstance(row.get("config"), str) else {}
        delta = config.get("delta")
    if _missing(delta):
        delta = _dig(summary, "privacy", "delta")
    return None if _missing(delta) else float(delta)


def _epsilon_over_steps(ledger: pd.DataFrame, row) -> tuple[np.ndarray, np.ndarray] | None:
    """The epsilon the ledger's first k steps spend, at up to :data:`EPSILON_POINTS` values of k
    (:func:`raydp.privacy.accounting.rdp.epsilon_over_steps`, the RDP bound) at the trial's delta. An enforcing PLD
    or PRV accountant's figure is tighter (:func:`_enforced_over_steps`)."""
    from raydp.privacy.accounting.rdp import epsilon_over_steps

    delta = _delta(row)
    if delta is None or not {"q", "sigma_eff"} <= set(ledger) or not len(ledger):
        return None
    return epsilon_over_steps(ledger["q"], ledger["sigma_eff"], delta, EPSILON_POINTS)


def _enforced_over_steps(ledger: pd.DataFrame, accountant: str, epsilon_target, delta: float,
                         points: int = COMPOSED_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """The epsilon of the ledger's first k steps at up to ``points`` values of k (the last step included), as the
    run's enforcing accountant (``pld``, ``prv`` or ``rdp``) counts it: the accountant with the numerical settings the
    run's budget guard fixed for its target (:meth:`raydp.privacy.accounting.Accountant.for_target`), composing the
    steps incrementally as the guard did during the run (:meth:`raydp.privacy.accounting.Composition.add_arrays`);
    the last point is the guard's final check, a fresh composition of the whole ledger: the run's enforced epsilon
    (summary.json, the privacy table)."""
    from raydp.privacy.accounting import get_accountant

    acc = get_accountant(accountant)
    if not _missing(epsilon_target):
        acc = acc.for_target(float(epsilon_target))
    q, sigma = ledger["q"].to_numpy(float), ledger["sigma_eff"].to_numpy(float)
    composition, done, steps, spent = acc.composition(), 0, [], []
    marks = sorted(set(np.linspace(0, len(q) - 1, points).astype(int).tolist()))
    for k in marks[:-1]:
        composition.add_arrays(q[done:k + 1], sigma[done:k + 1])
        done = k + 1
        steps.append(k + 1)
        spent.append(composition.epsilon(delta))
    whole = StepHistogram()
    whole.add_arrays(q, sigma)
    steps.append(len(q))
    spent.append(acc.epsilon(whole, delta))
    return np.asarray(steps, float), np.asarray(spent, float)


def _privacy_spent(r: Report, ledger: pd.DataFrame, row) -> tuple[figures.Spent | None, str]:
    """The dials figure's privacy-spent panel and its caption note: the run's enforcing accountant's epsilon over
    steps (PLD, PRV or RDP: :func:`_enforced_over_steps`; a Renyi filter: the RDP the steps so far spent at the
    filter's orders, against the guarantee the filter fixed before training), and beside a PLD or PRV curve the RDP
    upper bound of the same ledger (dashed, looser). A local mechanism (one ledger row per epoch) gets no panel."""
    from raydp.privacy.accounting.rdp import epsilon_over_steps
    from raydp.privacy.filter import FILTER_NAME

    delta = _delta(row, r.run_summary(row))
    if delta is None or not {"q", "sigma_eff"} <= set(ledger) or not len(ledger):
        return None, ""
    privacy = _dig(r.run_summary(row), "privacy") or {}
    name = row.get("enforcing_accountant")
    name = str(privacy.get("enforcing_accountant") if _missing(name) else name)
    target = row.get("epsilon_target")
    target = None if _missing(target) else float(target)
    rdp = _epsilon_over_steps(ledger, {"delta": delta})
    if name in ("pld", "prv", "rdp"):
        steps, spent = _enforced_over_steps(ledger, name, target, delta)
        label = f"{name.upper()}, the enforcing accountant"
        bound = rdp if name != "rdp" else None
        note = (f"; privacy spent over steps: the enforcing accountant's ({name.upper()}) epsilon, {num(spent[-1], 3)} "
                "at the end, the run's guarantee (privacy table)"
                + (f"; dashed: the RDP upper bound of the same ledger, {num(bound[1][-1], 3)}, looser and enforcing "
                   "nothing" if bound is not None else ""))
        return figures.Spent(steps, spent, label, bound=bound, target=target), note
    if name == FILTER_NAME:
        orders = _dig(privacy, "filter", "orders")
        q, sigma = ledger["q"], ledger["sigma_eff"]
        steps, spent = (epsilon_over_steps(q, sigma, delta, EPSILON_POINTS, orders) if orders
                        else epsilon_over_steps(q, sigma, delta, EPSILON_POINTS))
        guarantee = _dig(privacy, "filter", "epsilon")
        guarantee = row.get("epsilon") if guarantee is None else guarantee
        guarantee = None if _missing(guarantee) else float(guarantee)
        note = (f"; privacy spent over steps: the RDP the steps so far spent at the Renyi filter's orders, "
                f"{num(spent[-1], 3)} at the end; the run's guarantee is the filter's epsilon, {num(guarantee, 3)}, "
                "fixed before training (dotted)")
        return figures.Spent(steps, spent, "RDP spent (Renyi filter, enforcing)", target=target,
                             guarantee=guarantee), note
    if name == "local":
        return None, "; privacy spent: not drawn (a local mechanism, accounted per epoch: privacy table)"
    if rdp is None:
        return None, ""
    note = (f"; privacy spent over steps: the RDP upper bound of the ledger, {num(rdp[1][-1], 3)} at the end (the run "
            "names no enforcing accountant; its figure, if any: privacy table)")
    return figures.Spent(rdp[0], rdp[1], "RDP upper bound", target=target), note


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
            series.append((r.short(arm), cells.index.to_numpy(float), cells["mean"].to_numpy(float),
                           cells["std"].to_numpy(float)))
        nonprivate = group[group["epsilon_target"].isna()][r.column]
        np_line = (float(nonprivate.mean()), float(nonprivate.std(ddof=1)) if len(nonprivate) > 1 else float("nan")) \
            if len(nonprivate) else None
        fid = f"fig-frontier-{len(out) + 1}"
        out.append(figure(fid, figures.frontier_figure(series, np_line, f"final {r.split_name} {r.metric}", fid),
                          f"{model}: the privacy-utility frontier, final {r.split_name} {r.metric} per arm against the "
                          f"target epsilon (mean ± sd over seeds; {len(series)} arms)" +
                          ("; dashed: non-private (band: ± sd)." if np_line else ".")))
    return out
