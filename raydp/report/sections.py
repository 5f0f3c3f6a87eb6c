"""The page's tables: the overview, final utility (RLDP paper Tables 2 and 3 analogues), privacy (every
accountant, the tuning-aware epsilon, PBT, a non-private phase 1) and the attacks (Tables 4-9 analogues)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np
import pandas as pd

from raydp.data.identity import frame_ids as dataset_ids
from raydp.evaluation.base import Column
from raydp.evaluation.registry import ATTACKS
from raydp.privacy.accounting import REPORTED_ACCOUNTANTS
from raydp.report import figures
from raydp.report.curves import _clip_basis, _frontier
from raydp.report.load import Report, _dig, _evaluated, _groups, _missing_evaluation_note
from raydp.report.markup import (Cell, _e, _eps, _missing, _section, figure, how, mean_std, num, para, pm_cell, table,
                                 trial_cell)
from raydp.study.arms import Arm
from raydp.study.statistics import VERDICT_ALPHA, gates, headroom, table2, table3, verdicts
from raydp.study.results import CONTROLLERS

PRIVATE_SPLIT_WARNING = "private eval split: unprotected (ERRATA E15): these perplexities are not a DP release"
ATTACK_LABEL_FALLBACK = ("attack and audit metrics are computed from private records: not a DP release, "
                         "not covered by any accountant (ERRATA E15)")


def overview(r: Report) -> str:
    res = r.results
    statuses = res["status"].fillna("unknown").value_counts()
    status_text = ", ".join(f"{n} {s}" for s, n in statuses.items())
    datasets = sorted({str(x) for x in dataset_ids(res).dropna()})
    units = sorted({str(x) for x in res.get("privacy_unit", pd.Series(dtype=object)).dropna()})
    eps = sorted({float(x) for x in res["epsilon_target"].dropna()})
    rows = [
        ("kind", "study directory" if r.kind == "study" else "single run directory"),
        ("directory", r.root.name),  # its name only: no absolute path of the machine that ran it
        ("trials", f"{len(res)} ({status_text})"),
        ("models", ", ".join(sorted({str(m) for m in res["model"].dropna()})) or "n/a"),
        ("strategies", ", ".join(dict.fromkeys(res["strategy"].astype(str))) or "n/a"),
        ("target epsilons", ", ".join(f"{e:g}" for e in eps) + (" + non-private" if res["epsilon_target"].isna().any()
                                                                 else "") if eps else "non-private only"),
        ("seeds", ", ".join(str(int(s)) for s in sorted(res["seed"].dropna().unique())) if "seed" in res else "n/a"),
        ("dataset id (keyed: only its owner can compute it)", Cell(", ".join(datasets) or "n/a",
                                                   title=", ".join(datasets) or None)),
        ("privacy unit(s)", ", ".join(units) or "n/a"),
        ("selection", r.note),
    ]
    if r.kind == "study" and r.summary.get("wall_seconds") is not None:
        rows.append(("study wall time (unprotected: timings follow the private batch sizes)",
                     f"{float(r.summary['wall_seconds']):.0f} s"))
    body = [how("what was run: one row per setting. Every figure and table below uses the selection split named "
                "here; the private eval split is never a DP release (ERRATA E15)."),
            table("table-overview", ["", ""], [(Cell(k, "key"), v) for k, v in rows]),
            _arms_table(r)]
    if not r.public:
        body.append(para(PRIVATE_SPLIT_WARNING, "warn"))
    unfinished = int(res["status"].isin(("INTERRUPTED", "NOT_RUN")).sum()) if "status" in res else 0
    unfinished = max(unfinished, int(r.summary.get("unfinished_trials") or 0))
    if r.kind == "study" and (unfinished or r.summary.get("partial")):
        body.append(para(f"PARTIAL: the study was stopped before all its trials ran ({unfinished or 'some'} not "
                         "finished); this page shows the finished trials only. raydp study FILE --resume finishes "
                         "it.", "warn"))
    labels = _labels(res)
    for label in labels:
        body.append(para(f"LABEL: {label}", "warn"))
    if "description" in r.summary:
        body.insert(0, para(str(r.summary["description"])))
    return _section("sec-overview", "Overview", "\n".join(body))


def _arms_table(r: Report) -> str:
    """The key to the short arm names of the figures and tables: per arm, its strategy, the settings its short name
    leaves out (a searched, grid or tuned variant), a controller's SAC cell and policy, its trials, and what its clip
    settings are relative to (from its first trial's summary.json)."""
    res, rows = r.results, []
    for arm in dict.fromkeys(res["arm"]):
        g = res[res["arm"] == arm]
        first = g.iloc[0]
        parts = Arm.from_row(first)
        cell = dataclasses.replace(parts, variant=None).label().partition(" ")[2]  # 'T_RL=4 ... (frozen policy)'
        rows.append([Cell(r.short(arm), "arm", title=arm), parts.strategy,
                     Cell(parts.variant or "—", "settings"), Cell(cell or "—"), Cell(str(len(g)), "num"),
                     Cell(_clip_basis(r.run_summary(first)) or "—")])
    return table("table-arms", ["arm", "strategy", "settings (left out of the arm's name)", "SAC cell, policy",
                                "trials", "clip settings"], rows,
                 caption="arms: the short name figures and tables give each arm, and its settings")


def _arm_cell(r: Report, arm) -> Cell:
    """An arm's cell: its short name, the full label as the cell's tooltip (the arms table has its settings)."""
    short = r.short(arm)
    return Cell(short, "arm", title=None if short == str(arm) else str(arm))


def _cell_text(r: Report, text) -> str:
    """Table 2's RLDP cell ('T_RL=4 B_SAC=4 K=2 [lr=0.009]') with its settings as the arm's short name gives them."""
    cell, sep, variant = str(text).partition(" [")
    if not sep:
        return cell
    for strategy in CONTROLLERS:
        label = f"{strategy} [{variant}"
        if r.short(label) != label:
            return f"{cell} {r.short(label).partition(' ')[2]}".strip()
    return str(text)


def _labels(res: pd.DataFrame) -> list[str]:
    if "privacy_labels" not in res:
        return []
    return list(dict.fromkeys(label for ls in res["privacy_labels"].dropna() for label in str(ls).split("; ") if label))



def tables(r: Report) -> str:
    res = r.results
    split = r.split_name
    rows = []
    for model, eps, group in _groups(res):
        for arm in dict.fromkeys(group["arm"]):
            g = group[group["arm"] == arm]
            finished = g[g[r.column].notna()] if r.column in g else g.iloc[0:0]
            stt = g["steps_to_target"].dropna() if "steps_to_target" in g else pd.Series(dtype=float)
            row = [model, _eps(eps), _arm_cell(r, arm), Cell(f"{len(finished)}/{len(g)}", "num"),
                   pm_cell(g.get(r.column, []), 4),
                   pm_cell(g.get(r.column.replace("final", "best"), []), 4),
                   pm_cell(g.get(r.column.replace("final", "initial"), []), 4),
                   Cell(f"{mean_std(100 * stt, 1)} ({len(stt)}/{len(g)})" if len(stt) else "not reached / n/a", "num")]
            if r.public:
                row.append(pm_cell(g.get(r.private_column, []), 4, "num private"))
            rows.append(row)
    columns = ["model", "ε target", "arm", "seeds", f"final {split} {r.metric}", "best", "initial",
               "steps to target, % (seeds reaching)"]
    if r.public:
        columns.append(f"final private eval {r.metric} (no DP release)")
    body = [how(f"per (model, epsilon, strategy): the {split} {r.metric} at the end of training, mean ± sample "
                "std over seeds (one seed: the value alone); 'seeds' counts seeds with a final value / trials. "
                "Steps to target: the first evaluation at which a trial reached the best baseline's final "
                f"{r.metric}, in % of its planned steps (RLDP paper Sec. 4.2)."),
            table("table-seeds", columns, rows)]
    body.extend(_frontier(r))
    head = headroom(res, r.column)
    if len(head):
        body.append(how(f"The DP gap: per model, epsilon and arm, the final {r.metric} on both splits (mean ± sd over "
                        "seeds); 'recovered' is the share of the non-private arm's gain over the untrained model, "
                        "'sd from non-private' the distance in pooled seed standard deviations. The private eval "
                        "split is unprotected (E15) and shown for reference; the gates are the benchmark's."))
        cols = ["model", "ε", "arm", "seeds", "public", "public recovered", "public sd from non-private",
                "private eval", "private recovered", "private sd from non-private"]
        body.append(table("table-headroom", cols, [
            [rec["model"], _eps(rec["epsilon"]) if rec["epsilon"] != float("inf") else "∞ (non-private)",
             _arm_cell(r, rec["arm"]), Cell(str(rec["seeds"]), "num"),
             Cell(f"{num(rec['public_mean'], 3)} ± {num(rec['public_sd'], 3)}", "num"),
             Cell(num(rec["public_recovered"], 3), "num"), Cell(num(rec["public_sd_from_nonprivate"], 1), "num"),
             Cell(f"{num(rec['eval_mean'], 3)} ± {num(rec['eval_sd'], 3)}", "num private"),
             Cell(num(rec["eval_recovered"], 3), "num private"),
             Cell(num(rec["eval_sd_from_nonprivate"], 1), "num private")] for rec in head.to_dict("records")],
            caption=f"the DP gap: final {r.metric}, mean ± sd over seeds"))
        body.extend(para(g, "gate-pass" if g.startswith("PASS") else "gate-fail") for g in gates(res, r.column))
    t2 = table2(res, r.column)
    body.append(how("Table 2 analogue: RLDP's best SAC cell (mean over seeds) against the best baseline (the "
                    f"DP strategy with the lowest mean final {r.metric}); change < 0 means RLDP is better."))
    if len(t2):
        cols = [("model", "model", str), ("epsilon", "ε", _eps), ("rldp_final", "RLDP", lambda x: num(x, 4)),
                ("rldp_cell", "RLDP cell", str), ("rldp_frozen_final", "RLDP frozen policy", lambda x: num(x, 4)),
                ("best_baseline", "best baseline", str), ("baseline_final", "baseline", lambda x: num(x, 4)),
                ("change_pct", "change", lambda x: "n/a" if _missing(x) else f"{x:+.1f}%")]
        cols = [c for c in cols if c[0] in t2]
        shorten = {"rldp_cell": lambda cell: _cell_text(r, cell), "best_baseline": r.short}
        body.append(table("table2", [c[1] for c in cols],
                          [[Cell(f(rec[k]) if not _missing(rec[k]) else "n/a",
                                 "num" if k.endswith(("final", "pct")) else None) if k not in shorten else
                            Cell(shorten[k](rec[k]), "arm", title=str(rec[k])) if not _missing(rec[k]) else "n/a"
                            for k, _, f in cols] for rec in t2.to_dict("records")],
                          caption=f"final {split} {r.metric}, mean over seeds"))
    else:
        body.append(para(f"Table 2: no DP trials with a final {r.metric}", "missing"))
    v = verdicts(res, r.column)
    if len(v):
        body.append(how("RLDP against the best baseline, per model and epsilon: RLDP's best arm and the baseline arm "
                        "with the lowest mean, both chosen after the fact; Welch's t-test over seeds (two-sided, "
                        f"{VERDICT_ALPHA:g}): wins or loses when the difference is significant, ties otherwise."))
        body.append(table("table-verdicts", ["model", "ε", "RLDP arm", "RLDP", "best baseline", "baseline",
                                             "change", "p", "seeds (RLDP/baseline)", "verdict"],
                          [[rec["model"], _eps(rec["epsilon"]), _arm_cell(r, rec["rldp_arm"]),
                            Cell(f"{num(rec['rldp_mean'], 4)} ± {num(rec['rldp_sd'], 4)}", "num"),
                            _arm_cell(r, rec["best_baseline"]),
                            Cell(f"{num(rec['baseline_mean'], 4)} ± {num(rec['baseline_sd'], 4)}", "num"),
                            Cell(f"{rec['change_pct']:+.2f}%", "num"),
                            Cell("n/a" if rec["p_value"] is None else f"{rec['p_value']:.3g}", "num"),
                            Cell(rec["seeds"], "num"), Cell(rec["verdict"], "verdict")]
                           for rec in v.to_dict("records")],
                          caption=f"final {split} {r.metric}, mean ± sd over seeds"))
    t3 = table3(res, r.column)
    if len(t3):
        body.append(table("table3", ["model", "ε", "RLDP steps to target (% of steps)", "seeds reaching target"],
                          [[rec["model"], _eps(rec["epsilon"]), Cell(num(rec["steps_to_target_pct"], 1), "num"),
                            Cell(rec["seeds_reaching_target"], "num")] for rec in t3.to_dict("records")],
                          caption="Table 3 analogue: RLDP's best cell, steps to reach the best baseline's "
                                  f"final {split} {r.metric}"))
    else:
        body.append(para("Table 3: no RLDP trials", "missing"))
    return _section("sec-tables", "Final utility (Tables 2 and 3)", "\n".join(body))


def privacy(r: Report) -> str:
    res = r.results
    rows = []
    for _, row in res.iterrows():
        within = row.get("within_budget")
        within_cell = (Cell("n/a") if _missing(within) else Cell("yes", "ok") if bool(within) else Cell("NO", "bad"))
        rows.append([trial_cell(row["trial"]), row["strategy"], _eps(row.get("epsilon_target")),
                     Cell(num(row.get("epsilon"), 3), "num"),
                     *(Cell(num(row.get(f"epsilon_{a}"), 3), "num") for a in REPORTED_ACCOUNTANTS),
                     row.get("enforcing_accountant"), row.get("guarantee"), within_cell,
                     row.get("privacy_unit"), row.get("privacy_mode"),
                     Cell(str(row.get("privacy_labels")), "warn-text") if not _missing(row.get("privacy_labels"))
                     else "none"])
    body = [how("one row per trial. ε (enforced) is the figure of the enforcing accountant, the run's guarantee; "
                "the other columns compose the same ledger with each accountant (PLD, PRV, RDP upper bounds; GDP "
                "(a CLT) and Edgeworth (the accountant of EW-Tune and DualTune-GhostDP) are approximations and "
                "enforce nothing, ERRATA E9; under adaptive sigma they are not a guarantee, "
                "ERRATA E13). 'within budget' is the enforcing accountant's verdict; labels qualify the epsilon."),
            table("table-privacy", ["trial", "strategy", "ε target", "ε (enforced)", "ε PLD", "ε PRV", "ε RDP",
                                    "ε GDP (approx.)", "ε Edgeworth (approx.)", "enforcing accountant", "guarantee", "within budget",
                                    "privacy unit", "mode", "labels"], rows)]
    tuning = r.summary.get("tuning_aware_epsilon")
    body.append(how("tuning-aware epsilon (ERRATA E7/E14): every run on the same private dataset spends its "
                    "people's budget, whatever its target; the composition of all of them (RDP) is what releasing "
                    "the best of the study costs. Repeat-and-select holds only if the number of trials were "
                    "Poisson(K)."))
    if isinstance(tuning, dict) and tuning:
        trows, extras = [], []
        for i, (sha, t) in enumerate(tuning.items(), start=1):
            if not isinstance(t, dict):
                continue
            targets = ", ".join(f"{e:g}" for e in t.get("target_epsilons") or []) or (sha if "runs" not in t else "n/a")
            trows.append([Cell(sha[:16] + ("…" if len(sha) > 16 else ""), title=sha),
                          Cell(str(t.get("runs", t.get("trials", "n/a"))), "num"),
                          Cell(str(t.get("trials", "n/a")), "num"), targets,
                          Cell(num(t.get("tuning_aware_epsilon"), 3), "num strong"),
                          Cell("n/a" if t.get("delta") is None else f"{t['delta']:g}", "num"),
                          Cell(num(t.get("max_single_trial_epsilon_rdp"), 3), "num"),
                          Cell(num(t.get("repeat_and_select_epsilon_rdp"), 3), "num"),
                          ", ".join(t.get("privacy_units") or []) or "n/a"])
            for label in t.get("labels") or []:
                extras.append(para(f"LABEL ({sha[:16]}): {label}", "warn"))
            for warning in t.get("warnings") or []:
                extras.append(para(f"WARNING ({sha[:16]}): {warning}", "warn"))
            composed = [c for c in t.get("composed") or [] if isinstance(c, dict)]
            if composed:
                fid = f"fig-tuning-{i}"
                svg = figures.tuning_figure([(str(c.get("name")), c.get("epsilon_rdp")) for c in composed],
                                            t.get("tuning_aware_epsilon"), t.get("max_single_trial_epsilon_rdp"),
                                            f"dataset {sha[:16]}: every run composed", fid)
                extras.append(figure(fid, svg, f"Dataset {sha[:16]}: each composed run's own RDP epsilon (bars) "
                                               f"and the tuning-aware composition of all {len(composed)} "
                                               "(red line)."))
        body.append(table("table-tuning", ["dataset (sha256)", "runs", "trials", "target ε", "tuning-aware ε",
                                           "δ", "largest single trial ε", "repeat-and-select ε", "privacy units"],
                          trows))
        body += extras
    elif tuning:
        body.append(para(f"tuning-aware epsilon: {tuning}"))
    else:
        body.append(para("no tuning-aware epsilon: " + ("a single run (a study composes its trials)" if r.kind == "run"
                                                         else "the study summary has none (public data?)"),
                         "missing"))
    body += _phase_one(res)
    pbt = r.summary.get("pbt_population")
    if isinstance(pbt, dict) and pbt:
        verdict = "within" if pbt.get("within_budget") else "OVER"
        body.append(para(f"PBT population: {pbt.get('members')} members, {pbt.get('exploits')} exploits; population "
                         f"epsilon {num(pbt.get('population_epsilon'), 3)} at delta {pbt.get('delta')} (Renyi filter "
                         f"over every member's steps, discarded ones included): {verdict} its budget",
                         None if pbt.get("within_budget") else "bad"))
    return _section("sec-privacy", "Privacy", "\n".join(body))


def _phase_one(res: pd.DataFrame) -> list[str]:
    """Trials with a non-private phase 1 (DualTune-GhostDP): what it trained on, whether any epsilon covers
    it (ERRATA E16) and the secret detector's recall."""
    if "phase1_data" not in res.columns or res["phase1_data"].isna().all():
        return []
    rows = []
    for _, row in res[res["phase1_data"].notna()].iterrows():
        redacted = row["phase1_data"] == "redacted"
        rows.append([trial_cell(row["trial"]), row["phase1_data"], Cell(num(row.get("phase1_steps"), 0), "num"),
                     Cell(num(row.get("phase1_public_perplexity"), 4), "num"),
                     Cell("NO: epsilon covers phase 2 only", "bad") if redacted else Cell("yes (public data)", "ok"),
                     Cell(num(row.get("detector_canary_recall"), 3), "num"),
                     Cell(num(row.get("detector_field_recall"), 3), "num")])
    return [how("a non-private phase 1 before DP-SGD (DualTune-GhostDP). On the public corpus it needs no epsilon; "
                "on the redacted private records no epsilon covers it: a secret detector is a deterministic function "
                "of the records and gives no DP guarantee (ERRATA E16). Detector recall: on the run's canaries "
                "(computed on private records, not a DP release) and on the sensitive fields of public records."),
            table("table-phase1", ["trial", "phase 1 data", "phase 1 steps", "public perplexity after phase 1",
                                   "covered by epsilon", "detector canary recall", "detector field recall"], rows)]



def attacks(r: Report) -> str:
    evaluated = _evaluated(r)
    body = [how("attacks on the trained model, mean ± std over seeds per (model, epsilon, strategy) (RLDP paper "
                "Tables 4-9). Membership inference: AUC 0.5 and TPR equal to the FPR mean the attacker cannot tell "
                "members from non-members; 'calibrated' subtracts the base model's loss; the null AUC is the loss "
                "attack on the base model, which saw no private record (members and non-members are different "
                "people, so on a finite sample it is not exactly 0.5). Canary extraction: "
                "Jaccard similarity of n-grams between generations and canary secrets (0 = nothing leaked). "
                "Exposure in bits (Carlini et al.), at most the measurable maximum.")]
    note = _missing_evaluation_note(r, evaluated)
    labels = list(dict.fromkeys(str(ev.get("label")) for _, ev in evaluated if ev.get("label")))
    if evaluated:
        for label in labels or [ATTACK_LABEL_FALLBACK]:
            body.append(f'<p class="label-box"><strong>{_e(label)}</strong></p>')
    if note:
        body.append(para(note, "missing"))
    if not evaluated:
        return _section("sec-attacks", "Attacks: membership inference, extraction, exposure", "\n".join(body))
    groups: dict[tuple, list[dict]] = {}
    for row, ev in evaluated:
        groups.setdefault((row["model"], row.get("epsilon_target"), row["arm"]), []).append(ev)
    order = {arm: i for i, arm in enumerate(dict.fromkeys(r.results["arm"]))}  # strategies in the study's order
    keys = sorted(groups, key=lambda k: (str(k[0]), _missing(k[1]), 0 if _missing(k[1]) else float(k[1]),
                                         order.get(k[2], len(order))))

    def cell(evs, column: Column):
        values = [_dig(ev, *column.path) for ev in evs]
        return Cell(_span(values, column.digits), "num") if column.span else pm_cell(values, column.digits)

    evaluations = [ev for _, ev in evaluated]
    for spec in ATTACKS:  # each registered attack's table (raydp.evaluation.registry)
        t = spec.table
        if t is None:
            continue
        rows = []
        for key in keys:
            evs = [ev for ev in groups[key] if any(isinstance(ev.get(k), dict) for k in t.keys)]
            if evs:
                rows.append([key[0], _eps(key[1]), _arm_cell(r, key[2]), Cell(str(len(evs)), "num"),
                             *(cell(evs, c) for c in t.columns)])
        body.append(table(t.id, ["model", "ε", "strategy", "trials", *(c.header for c in t.columns)], rows,
                          caption=t.caption(evaluations)) if rows else para(t.missing, "missing"))
    auc = []
    for key in keys:  # membership inference's figures: AUC per arm, and ROC curves
        with_m = [ev for ev in groups[key] if isinstance(ev.get("membership"), dict)]
        if with_m:
            vals = lambda *p: [v for v in (_dig(ev, *p) for ev in with_m) if not _missing(v)]  # noqa: E731
            la, ca = vals("membership", "loss", "auc"), vals("membership", "calibrated", "auc")
            models = f" · {key[0]}" if len({k[0] for k in keys}) > 1 else ""
            auc.append((f"ε={_eps(key[1])} · {r.short(key[2])}{models}",
                        float(np.mean(la)) if la else np.nan, float(np.std(la, ddof=1)) if len(la) > 1 else np.nan,
                        float(np.mean(ca)) if ca else np.nan, float(np.std(ca, ddof=1)) if len(ca) > 1 else np.nan))
    if auc:
        body.append(figure("fig-attacks", figures.auc_figure(auc, "fig-attacks"),
                           "Membership-inference AUC per (epsilon, strategy), mean ± std over seeds: the loss attack "
                           "(circles) and the calibrated attack (squares); 0.5 is chance."))
    roc = []  # first seed of each (model, epsilon, strategy) whose evaluation kept its ROC curve
    for key in keys:
        ev = next((ev for ev in groups[key] if isinstance(_dig(ev, "membership", "loss", "roc"), dict)), None)
        if ev is not None:
            curve = ev["membership"]["loss"]["roc"]
            roc.append((f"ε={_eps(key[1])} · {r.short(key[2])}", curve["fpr"], curve["tpr"]))
    if roc:
        floor = min(float(_dig(ev, "membership", "fpr_resolution") or 1e-3) for _, ev in evaluated
                    if isinstance(ev.get("membership"), dict))
        body.append(figure("fig-roc", figures.roc_figure(roc, floor, "fig-roc"),
                           f"Membership-inference ROC of the loss attack on log-log axes, first seed of each (epsilon, "
                           f"strategy); the dashed diagonal is chance; below FPR {floor:.2g} (one non-member) nothing "
                           "is resolved."))
    return _section("sec-attacks", "Attacks: membership inference, extraction, exposure", "\n".join(body))


def _span(values: Iterable, digits: int) -> str:
    """One value, or 'min–max' when the trials differ (e.g. a different number of exposure candidates)."""
    v = [float(x) for x in values if not _missing(x)]
    if not v:
        return "n/a"
    low, high = num(min(v), digits), num(max(v), digits)
    return low if low == high else f"{low}–{high}"
