"""``raydp report STUDY`` and the end of ``raydp study``: a study's tables as text for the terminal.

Every table starts with the study's compact table per (model, epsilon) (:mod:`raydp.study.outcome`); the Table 2 and
3 analogues and the verdicts print only where the study has RLDP trials, a learned controller's challenge only where
it ran; then the tuning-aware epsilon of each dataset (ERRATA E7/E14), with its labels and warnings. The figures
and tests behind them are :mod:`raydp.study.statistics`.

A ``selection: private-dp`` study has no results table: it is shown by its released cells
(:func:`raydp.study.selection_release.format_selection`), and composed with other studies on the same dataset by its
own figure, the RDP composition of its cells' end-to-end curves (:func:`_combined_privacy`).

``raydp study`` prints :func:`format_study` (the compact table, attacks, gates, research tables and the tuning-aware
epsilon, at most 160 characters a line) and records its figures with :func:`record_outcome`; ``raydp report`` prints
:func:`format_report` (every table).
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from raydp.study.outcome import (attack_lines, format_outcome, header_line, outcome_cells, outcome_record,
                                 privacy_lines, public_records_lines, short_names, trial_counts, wrap)
from raydp.study.results import CHALLENGERS, CONTROLLERS
from raydp.study.statistics import (BASELINES_EXCLUDED, NO_TEST, VERDICT_ALPHA, _final_column, _one_dataset,
                                    _read_summary, _study_datasets, accuracy_table, cell_arm_keys, challenge,
                                    challenge_success, column_split, combine_studies, gates, headroom,
                                    is_private_selection, load_results, metric_label, split_label, table2, table3,
                                    verdicts)


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
    cells = outcome_cells(results, column, (summary.get("selection") or {}).get("requested") or "public")
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
    lines += public_records_lines(results, column)
    lines += format_outcome(cells, column, names)
    lines += attack_lines(results, names, summary.get("attacked"))
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
