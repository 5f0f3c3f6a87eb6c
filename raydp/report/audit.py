"""The page's empirical privacy audit section: each trial's claimed epsilon beside the audit's lower bounds
(:mod:`raydp.evaluation.audit`); a one-run bound above the claim is shown as "VIOLATION: bug"."""

from __future__ import annotations

from raydp.report import figures
from raydp.report.load import Report, _dig, _evaluated, _missing_evaluation_note
from raydp.report.markup import Cell, _eps, _missing, _section, figure, how, num, para, table, trial_cell

AUDIT_TOLERANCE = 1e-9


def _violation(audit: dict, claimed) -> bool:
    """The verdict rests on the one-run bound (the one with a theorem for a single run); Clopper-Pearson
    across one run's canaries is shown for comparison only (raydp.evaluation.audit)."""
    if audit.get("consistent") is False:
        return True
    if _missing(claimed) or audit.get("consistent") is None and "consistent" in audit:
        return False
    b = audit.get("epsilon_one_run")
    return not _missing(b) and float(b) > float(claimed) + AUDIT_TOLERANCE


def _verdict(audit: dict, claimed, bad: bool) -> Cell:
    if bad:
        return Cell("VIOLATION: bug", "violation")
    if _missing(claimed) or audit.get("consistent") is None and "consistent" in audit:
        return Cell("not compared" + (f": {audit['note']}" if audit.get("note") else " (no claimed epsilon)"))
    return Cell("not refuted", "ok")


def audit(r: Report) -> str:
    evaluated = _evaluated(r)
    body = [how("an empirical privacy audit inserts m canaries, trains, and guesses which were included: the "
                "guesses give a statistical LOWER bound on epsilon at the stated confidence (the one-run bound of "
                "Steinke et al. 2023, Thm 5.2; beside it, for comparison only, the Clopper-Pearson estimator, "
                "which has no theorem for one run). An audit can refute a claim, never prove it: a one-run bound "
                "above the claimed epsilon means the implementation or accounting is wrong and is shown as "
                "VIOLATION: bug; a bound below it means only \"not refuted\".")]
    rows, fig_rows = [], []
    for row, ev in evaluated:
        a = ev.get("audit")
        if not isinstance(a, dict):
            continue
        claimed = a.get("claimed_epsilon", _dig(ev, "claimed", "epsilon"))
        bad = _violation(a, claimed)
        one_run_detail = (f" ({a.get('one_run_correct')}/{a.get('one_run_guesses')} correct)"
                          if a.get("one_run_guesses") is not None else "")
        rows.append([trial_cell(row["trial"]), row["strategy"], _eps(row.get("epsilon_target")),
                     Cell(num(claimed, 3), "num"),
                     Cell(num(a.get("epsilon_one_run"), 3) + one_run_detail,
                          "num bad" if _above(a.get("epsilon_one_run"), claimed) else "num"),
                     Cell(num(a.get("epsilon_clopper_pearson"), 3), "num"),
                     Cell(str(a.get("m", "n/a")), "num"), Cell(str(a.get("n_included", "n/a")), "num"),
                     Cell("n/a" if a.get("confidence") is None else f"{a['confidence']:.4g}", "num"),
                     Cell("n/a" if a.get("delta") is None else f"{a['delta']:g}", "num"),
                     _verdict(a, claimed, bad)])
        fig_rows.append((str(row["trial"]), None if _missing(claimed) else float(claimed),
                         a.get("epsilon_one_run"), a.get("epsilon_clopper_pearson"), bad))
    if rows:
        n_bad = sum(1 for f in fig_rows if f[4])
        if n_bad:
            body.append(f'<p class="violation">VIOLATION: bug: {n_bad} trial(s) have an audit lower bound above '
                        "their claimed epsilon; the epsilon of these runs cannot be trusted.</p>")
        body.append(table("table-audit", ["trial", "strategy", "ε target", "claimed ε", "one-run lower bound",
                                          "Clopper-Pearson (comparison only)", "m (canaries)", "included", "confidence",
                                          "δ", "verdict"], rows))
        body.append(figure("fig-audit", figures.audit_figure(fig_rows, "fig-audit"),
                           "Claimed epsilon per trial (bars) beside the audit's lower bounds (dots); a trial whose "
                           "lower bound exceeds its claim is drawn in red."))
    note = _missing_evaluation_note(r, evaluated)
    if note:
        body.append(para(note, "missing"))
    unaudited = [ev for _, ev in evaluated if not isinstance(ev.get("audit"), dict)]
    if unaudited:
        body.append(para("no evaluation has an audit section (the audit was not run)" if not rows else
                         f"{len(unaudited)} evaluated trial(s) have no audit section", "missing"))
    for why in dict.fromkeys(str(ev["audit_note"]) for ev in unaudited if ev.get("audit_note")):
        body.append(para(f"not audited: {why}", "missing"))
    return _section("sec-audit", "Empirical privacy audit", "\n".join(body))


def _above(bound, claimed) -> bool:
    return not _missing(bound) and not _missing(claimed) and float(bound) > float(claimed) + AUDIT_TOLERANCE
