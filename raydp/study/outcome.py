"""What a study found, compactly: one table per (model, epsilon), the attacks, the composed epsilon.

Per cell, one row per DP arm: its final selection metric (mean over seeds with its sd, or "1 seed"), the owner's
private eval figure (no accountant covers it: not a DP release, E15), its share of the non-private arm's gain over
the untrained model on the selection split (:func:`raydp.study.statistics.headroom`'s ``recovered``; docs/benchmark.md),
the largest epsilon its trials spent, and a mark on the trial the study would release
(:func:`raydp.study.results.would_release`); below them the non-private arm and the untrained model as references.
An arm is named by its strategy, with a footnote number where it has settings (a settings_grid or tuned_from
variant, a controller's SAC cell): the footnote holds its full label. Then one line of attack and audit figures per
attacked trial, and the study's tuning-aware epsilon.

The table's figures go into ``study_summary.json`` (:func:`outcome_record`) rounded as they are printed, so every
number of the table can be found there; the attack and audit figures do not (they are private: PRIVACY.txt).
"""

from __future__ import annotations

import math
import textwrap

import pandas as pd

from raydp.data.public_records import SYNTHETIC_PUBLIC
from raydp.evaluation.base import present
from raydp.evaluation.registry import ATTACKS
from raydp.study.arms import NONPRIVATE_ARMS, arms
from raydp.study.results import fixed_release, would_release

#: the widest line the study's output prints (wider ones are wrapped)
WIDTH = 160


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(float(x))


def metric_decimals(column: str) -> int:
    """Decimals a metric is printed (and recorded) with: the value-token NLL (tens of nats) at 2, perplexity at 3."""
    return 2 if column.endswith("value_nll") else 3


def _round(x, decimals: int):
    return round(float(x), decimals) if _is_number(x) else None


def wrap(line: str, indent: str = "    ", width: int = WIDTH) -> list[str]:
    """``line`` as lines of at most ``width`` characters, continuation lines indented by ``indent`` more than the
    first (a leading newline stays in front of the first)."""
    if len(line) <= width:
        return [line]
    text = line.lstrip("\n")
    lead = text[:len(text) - len(text.lstrip(" "))]
    out = textwrap.wrap(text.strip(), width=width, initial_indent=lead, subsequent_indent=lead + indent,
                        break_long_words=True, break_on_hyphens=False)
    out[0] = line[:len(line) - len(text)] + out[0]
    return out


def short_names(labels) -> dict[str, str]:
    """Each arm label's short name: its strategy, plus a footnote number ``[n]`` (numbered in the order given) where
    the label holds more than the strategy (its settings, SAC cell or frozen policy)."""
    names, n = {}, 0
    for label in labels:
        if label in names:
            continue
        strategy = label.split(" ", 1)[0]
        if label == strategy:
            names[label] = label
        else:
            n += 1
            names[label] = f"{strategy} [{n}]"
    return names


def outcome_cells(results: pd.DataFrame, column: str, selection: str = "public") -> list[dict]:
    """The compact table's cells (module docstring), figures rounded as printed. ``column``: the study's final
    selection column (public validation unless the study selects on the private eval split); ``selection``: the
    study file's (``none``: the trial released is :func:`raydp.study.results.fixed_release`'s)."""
    if column not in results or "strategy" not in results:
        return []
    decimals = metric_decimals(column)
    public_col, private_col = column.replace("_eval_", "_public_"), column.replace("_public_", "_eval_")
    split = "public" if column == public_col else "private"
    done = results[results[column].notna()]
    if "status" in done:
        done = done[done["status"] == "TERMINATED"]
    if done.empty:
        return []
    done = done.assign(_arm=arms(done, cell=True))
    released = fixed_release(results, column) if selection == "none" else \
        would_release(done, public_col) if split == "public" and public_col in done else pd.DataFrame()
    cells = []
    for model, group in done.groupby("model", sort=True):
        nonprivate = group[group["strategy"].isin(NONPRIVATE_ARMS)]
        initial = {s: group[c.replace("final_", "initial_")].mean() if c.replace("final_", "initial_") in group
                   else float("nan") for s, c in (("public", public_col), ("private", private_col))}
        np_mean = {s: nonprivate[c].mean() if c in nonprivate and len(nonprivate) else float("nan")
                   for s, c in (("public", public_col), ("private", private_col))}

        def share(value: float):  # (untrained - arm) / (untrained - non-private) on the selection split
            gain = initial[split] - np_mean[split]
            return _round(100.0 * (initial[split] - value) / gain, 0) if _is_number(gain) and gain != 0 \
                and _is_number(value) else None

        def figures(g: pd.DataFrame) -> dict:
            sel = g[column]
            searched = "search" in g and g["search"].notna().any()  # a search's candidates: one seed, many settings
            row = {"seeds": int(len(g)), **({"searched": True} if searched else {}),
                   split: _round(sel.mean(), decimals), f"{split}_sd": _round(sel.std(ddof=1), decimals) if len(g) > 1 else None}
            other, other_col = ("private", private_col) if split == "public" else ("public", public_col)
            row[other] = _round(g[other_col].mean(), decimals) if other_col in g else None
            row["gain_share_pct"] = share(float(sel.mean()))
            return row

        dp = group[~group["strategy"].isin(NONPRIVATE_ARMS) & group["epsilon_target"].notna()]
        epsilons = sorted(dp["epsilon_target"].unique()) or [None]
        for eps in epsilons:
            cell = dp[dp["epsilon_target"] == eps] if eps is not None else dp.iloc[0:0]
            mark = released[(released["model"] == model) & (released["epsilon"] == eps)] if len(released) else \
                released
            release = mark.iloc[0].to_dict() if len(mark) else None
            rows = []
            for arm, g in cell.groupby("_arm", sort=True):
                spent = g["epsilon"].max() if "epsilon" in g else float("nan")
                rows.append({"arm": arm, "strategy": g["strategy"].iloc[0], **figures(g),
                             "epsilon_spent": _round(spent, 2),
                             "would_release": bool(release is not None and release["arm"] == arm),
                             "trials": sorted(g["trial"])})
            rows.sort(key=lambda r: (r[split] is None, r[split] if r[split] is not None else 0.0, r["arm"]))
            out = {"model": model, "epsilon": None if eps is None else float(eps), "arms": rows,
                   "would_release": None if release is None else
                   {"trial": release["trial"], "arm": release["arm"], "seed": release["seed"]},
                   **({"fixed_release": True} if selection == "none" else {})}
            if len(nonprivate):
                out["nonprivate"] = {"arm": arms(nonprivate.iloc[:1], cell=True).iloc[0], **figures(nonprivate)}
            if _is_number(initial[split]):
                out["untrained"] = {split: _round(initial[split], decimals),
                                    ("private" if split == "public" else "public"):
                                        _round(initial["private" if split == "public" else "public"], decimals),
                                    "gain_share_pct": 0.0 if out.get("nonprivate") else None}
            cells.append(out)
    return cells


def _seeds(n: int, searched: bool = False) -> str:
    """How many trials a row's mean is over: seeds, or a search's candidates (settings sampled at one seed)."""
    if searched:
        return f"{n} searched trial{'s' if n != 1 else ''}"
    return "1 seed" if n == 1 else f"{n} seeds"


def _num(x, decimals: int) -> str:
    return "" if x is None else f"{x:.{decimals}f}"


def format_outcome(cells: list[dict], column: str, names: dict[str, str]) -> list[str]:
    """The compact tables of :func:`outcome_cells` (``names``: arm label -> short name, :func:`short_names`)."""
    if not cells:
        return ["  (no finished trial)"]
    decimals = metric_decimals(column)
    split = "public" if "_public_" in column else "private"
    metric = "value-token NLL (nats/record)" if column.endswith("value_nll") else "perplexity"
    head_sel = "public validation (selects)" if split == "public" else "private eval (not DP; selects)"
    head_other = "private eval (not DP)" if split == "public" else "public validation"
    other = "private" if split == "public" else "public"
    lines = []
    for cell in cells:
        eps = "non-private only" if cell["epsilon"] is None else f"epsilon {cell['epsilon']:g}"
        lines.append(f"\n{cell['model']}, {eps}: final {metric}, lower is better; mean over seeds")
        with_share = any(r.get("gain_share_pct") is not None for r in cell["arms"] + [cell.get("nonprivate") or {}])
        table = []
        for r in cell["arms"]:
            n = _seeds(r["seeds"], r.get("searched", False))
            sel = _num(r[split], decimals) + (f" ± {_num(r[f'{split}_sd'], decimals)} ({n})"
                                              if r[f"{split}_sd"] is not None else f" ({n})")
            table.append(["*" if r["would_release"] else "", names.get(r["arm"], r["arm"]), sel,
                          _num(r[other], decimals), _pct(r.get("gain_share_pct")), _num(r["epsilon_spent"], 2)])
        np_row = cell.get("nonprivate")
        if np_row:
            sel = _num(np_row[split], decimals) + (f" ± {_num(np_row[f'{split}_sd'], decimals)}"
                                                   if np_row[f"{split}_sd"] is not None else "")
            table.append(["", names.get(np_row["arm"], np_row["arm"]),
                          f"{sel} ({_seeds(np_row['seeds'], np_row.get('searched', False))})",
                          _num(np_row[other], decimals), _pct(np_row.get("gain_share_pct")), "not DP"])
        untrained = cell.get("untrained")
        if untrained:
            table.append(["", "untrained (step 0)", _num(untrained[split], decimals), _num(untrained[other], decimals),
                          _pct(untrained.get("gain_share_pct")), ""])
        header = ["", "arm", head_sel, head_other, "share of non-private gain", "epsilon spent"]
        keep = [i for i in range(len(header)) if i != 4 or with_share]
        widths = [max(len(row[i]) for row in table + [header]) for i in range(len(header))]
        for row in [header] + table:
            lines.append("  " + "  ".join(row[i].ljust(widths[i]) if i < keep[-1] else row[i]
                                          for i in keep).rstrip())
        if cell["would_release"] and cell.get("fixed_release"):
            lines.extend(wrap(f"  * the trial this study would release: {cell['would_release']['trial']} (selection: "
                              "none: the one DP arm's first seed, fixed before it ran)"))
        elif cell["would_release"]:
            lines.extend(wrap(f"  * the trial this study would release: {cell['would_release']['trial']} (of the DP "
                              "arm with the best mean on public validation, its best seed)"))
        elif cell["arms"] and split == "private":
            lines.append("  no trial is marked for release: this study selects on the private eval split (E15)")
        if with_share:
            lines.append(f"  share of non-private gain: (untrained - arm) / (untrained - non-private), on "
                         f"{'public validation' if split == 'public' else 'the private eval split'}")
    used = {label: name for label, name in names.items() if name != label}
    notes = [f"  {name.split(' ', 1)[1]} {label}" for label, name in used.items()
             if any(r["arm"] == label for c in cells for r in c["arms"])]
    for note in notes:
        lines.extend(wrap(note, indent="      "))
    return lines


def _pct(x) -> str:
    return "" if x is None else f"{x:.0f}%"


def public_records_lines(results: pd.DataFrame, column: str) -> list[str]:
    """A line naming the user's public records where the study's trials validated and selected on them (nothing
    where they used raydp's synthetic public population, the default)."""
    if "_public_" not in column or "public_validation" not in results:
        return []
    names = [n for n in results["public_validation"].dropna().unique() if n != SYNTHETIC_PUBLIC]
    return [f"NOTE: public validation records: yours ({', '.join(map(str, names))}), not raydp's synthetic ones"] \
        if names else []


def attack_lines(results: pd.DataFrame, names: dict[str, str], attacked_rule: dict | None = None) -> list[str]:
    """One line per attacked trial, each registered attack's part of it (``AttackSpec.line``: membership inference
    AUC, canaries extracted, exposure, the one-run audit's epsilon lower bound beside the epsilon the trial spent),
    or the evaluation's error, after a line saying which trials were attacked (``attacked_rule``: the study
    summary's ``attacked``). Computed on the private records: for the data owner, not a DP release (E15)."""
    records = results.to_dict("records")
    parts = [[part for spec in ATTACKS if (part := spec.line(r)) is not None] for r in records]
    attacked = [bool(p) or present(r.get("evaluation_error")) for r, p in zip(records, parts)]
    if not any(attacked):
        return []
    rows = results.assign(_parts=parts)[attacked]
    rows = rows.assign(_arm=arms(rows, cell=True))
    lines = ["\nAttacks and audit (on the private records: for the data owner, not a DP release, E15)"]
    if attacked_rule and attacked_rule.get("rule") == "released":
        also = attacked_rule.get("strategies") or []
        lines.extend(wrap("  attacked: the trial this study would release in each cell" +
                          (f", and every {', '.join(also)} trial" if also else "") +
                          " (attack: released; attack: all attacks every trial)"))
    elif attacked_rule and attacked_rule.get("rule") == "all":
        lines.append("  attacked: every trial (attack: all)")
    for r in rows.sort_values(["model", "epsilon_target", "_arm", "seed"], na_position="last").to_dict("records"):
        eps = "" if not _is_number(r.get("epsilon_target")) else f" eps {r['epsilon_target']:g}"
        head = f"  {names.get(r['_arm'], r['_arm'])}{eps} seed {r.get('seed')}"
        if present(r.get("evaluation_error")) and not r["_parts"]:
            lines.extend(wrap(f"{head}: evaluation failed: {r['evaluation_error']}"))
            continue
        lines.extend(wrap(f"{head}: " + "; ".join(r["_parts"])))
    return lines


def privacy_lines(results: pd.DataFrame, summary: dict) -> list[str]:
    """The study's tuning-aware epsilon (ERRATA E7/E14) in a few lines: per dataset the RDP composition of every run
    on it, its labels and warnings, and the per-trial budgets."""
    lines = []
    tuning = summary.get("tuning_aware_epsilon")
    if isinstance(tuning, dict) and tuning:
        lines.append("\nPrivacy (RDP upper bounds, E7/E14): every run on a private dataset composes, whatever its "
                     "target epsilon")
        for sha, t in tuning.items():
            if "runs" not in t:  # a summary written before per-dataset figures
                lines.extend(wrap(f"  target {sha}: tuning-aware epsilon {t.get('tuning_aware_epsilon')}"))
                continue
            composed = t.get("tuning_aware_epsilon")
            targets = ", ".join(f"{e:g}" for e in t.get("target_epsilons") or []) or "none"
            figure = "unknown" if composed is None else f"{composed:.3f}"
            single = t.get("max_single_trial_epsilon_rdp")
            lines.extend(wrap(f"  tuning-aware epsilon {figure} at delta {t['delta']:g} on dataset {sha[:16]}: "
                              f"{t['runs']} run(s) composed ({t['trials']} trial(s); targets {targets})"
                              + (f"; the largest single trial {single:.3f}" if _is_number(single) else "")))
            lines.extend(line for label in t.get("labels") or [] for line in wrap(f"    LABEL: {label}"))
            lines.extend(line for w in t.get("warnings") or [] for line in wrap(f"    WARNING: {w}"))
    elif tuning:
        lines.extend(wrap(f"\nTuning-aware epsilon: {tuning}"))
    pbt = summary.get("pbt_population")
    if pbt:
        lines.extend(wrap(f"  PBT population: {pbt['members']} members, {pbt['exploits']} exploits; population "
                          f"epsilon {pbt['population_epsilon']:.3f} at delta {pbt['delta']:g} "
                          f"({'within' if pbt['within_budget'] else 'OVER'} its budget)"))
    within = results["within_budget"].dropna() if "within_budget" in results else pd.Series(dtype=bool)
    if len(within):
        lines.append(f"  per-trial budgets: {int(within.sum())}/{len(within)} within (enforcing accountant)")
    return lines


def trial_counts(results: pd.DataFrame, summary: dict) -> dict:
    """How many trials finished (TERMINATED), failed (ERROR) and were planned (the table's rows, and the trials a
    stopped search never sampled), and whether the study is partial (stopped before all of them ran)."""
    status = results["status"] if "status" in results else pd.Series(dtype=object)
    finished, failed = int((status == "TERMINATED").sum()), int((status == "ERROR").sum())
    unfinished = max(int(status.isin(("INTERRUPTED", "NOT_RUN")).sum()), int(summary.get("unfinished_trials") or 0))
    return {"finished_trials": finished, "failed_trials": failed,
            "planned_trials": finished + failed + unfinished, "partial": unfinished > 0}


def header_line(name: str, counts: dict) -> str:
    line = f"study {name}: {counts['finished_trials']} of {counts['planned_trials']} trials finished"
    if counts["failed_trials"]:
        line += f", {counts['failed_trials']} failed"
    if counts["partial"]:
        line += " (PARTIAL: the study was stopped; the tables show the finished trials only)"
    return line


def outcome_record(cells: list[dict], column: str, names: dict[str, str], counts: dict) -> dict:
    """What :func:`outcome_cells` printed, for ``study_summary.json``: the table's figures as printed (public
    validation figures of DP-trained arms; the private eval split's, not a DP release, E15; the non-private arm's
    and the untrained model's, which no DP covers), the trial each cell would release, and the trial counts."""
    table = []
    for cell in cells:
        entry = {k: v for k, v in cell.items() if k != "arms"}
        entry["arms"] = [{**{k: v for k, v in r.items() if k != "strategy"}, "name": names.get(r["arm"], r["arm"])}
                         for r in cell["arms"]]
        if cell.get("nonprivate"):
            entry["nonprivate"] = {**cell["nonprivate"], "name": names.get(cell["nonprivate"]["arm"],
                                                                          cell["nonprivate"]["arm"])}
        table.append(entry)
    return {
        "results_table": {"column": column, "decimals": metric_decimals(column), "cells": table,
                          "note": "figures rounded as raydp study printed them; the private eval split's and the "
                                  "non-private arm's are not DP releases (E15); results.parquet has them in full"},
        "would_release": [{"model": c["model"], "epsilon": c["epsilon"], **c["would_release"]}
                          for c in cells if c.get("would_release")],
        **counts,
    }
