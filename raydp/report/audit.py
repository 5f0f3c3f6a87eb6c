"""The page's empirical privacy audit section: each trial's claimed epsilon beside the audit's lower bounds
(:mod:`raydp.evaluation.audit`); a one-run bound above the claim is shown as "VIOLATION: bug"."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from raydp.report import figures
from raydp.report.load import Report, _dig, _evaluated, _missing_evaluation_note
from raydp.report.markup import Cell, _eps, _missing, _section, figure, how, num, para, table, trial_cell

AUDIT_TOLERANCE = 1e-9
#: an audit is informative here when its one-run bound could reach this share of the claimed epsilon
INFORMATIVE_SHARE = 0.5
#: the most canaries the page looks for (beyond it: 'more than')
MAX_CANARIES = 100_000


# -- what an audit of m canaries could show ---------------------------------------------------------
@dataclass(frozen=True)
class AuditPower:
    """What the one-run audit (Steinke, Nasr & Jagielski 2023, "Privacy Auditing with One (1) Training Run",
    arXiv:2305.08846) could show at a claimed epsilon, with the audit's own guess grid, Bonferroni correction, delta
    and confidence (:mod:`raydp.evaluation.audit`):

    * ``perfect`` (``canaries_perfect``): the lower bound with ``m`` canaries (the canaries needed for a bound of
      :data:`INFORMATIVE_SHARE` x epsilon) when every guess is right: the most any attack can show;
    * ``strongest`` (``canaries_strongest``): the same when each guess is right with probability
      e^eps / (1 + e^eps), the most an eps-DP run allows (randomized response at eps is the mechanism that makes
      their Thm 3.1 tight: the number right is then Binomial(r, e^eps / (1 + e^eps))), counting its median-like
      floor(r e^eps / (1 + e^eps)) of the r guesses right.

    The bound of r guesses with v right is the largest eps' whose Thm 5.2 p-value (:func:`one_run_p_value`) is at
    most (1 - confidence) / G, over the G grid entries; canaries are counted to within one by bisection after
    doubling (None: more than :data:`MAX_CANARIES`)."""

    perfect: float
    strongest: float
    canaries_perfect: int | None
    canaries_strongest: int | None


def _bound(m: int, r: int, v: int, significance: float, delta: float) -> float:
    """The largest eps' >= 0 that r guesses with v right reject at ``significance`` (Steinke et al. 2023, Thm 5.2:
    the p-value is nondecreasing in eps'), found by doubling and bisection; 0.0 when eps' = 0 is not rejected."""
    from raydp.evaluation.audit import one_run_p_value

    def rejected(eps: float) -> bool:
        return one_run_p_value(m, r, v, eps, delta) <= significance

    if not rejected(0.0):
        return 0.0
    low, high = 0.0, 1.0
    while rejected(high):
        low, high = high, 2.0 * high
        if high > 1e3:
            return math.inf
    while high - low > 1e-6:
        mid = (low + high) / 2
        low, high = (mid, high) if rejected(mid) else (low, mid)
    return low


def _guesses(m: int, rate: float) -> list[tuple[int, int]]:
    """(r, v) per entry of the audit's guess grid for ``m`` canaries, v = floor(r * rate) guesses right."""
    from raydp.evaluation.audit import one_run_guess_grid

    return [(k_plus + k_minus, math.floor((k_plus + k_minus) * rate + 1e-12))
            for k_plus, k_minus in one_run_guess_grid(m)]


def _best_bound(m: int, rate: float, delta: float, confidence: float) -> float:
    entries = _guesses(m, rate)
    return max(_bound(m, r, v, (1.0 - confidence) / len(entries), delta) for r, v in entries)


def _reaches(m: int, rate: float, epsilon: float, delta: float, confidence: float) -> bool:
    """Whether some grid entry's bound reaches ``epsilon`` with m canaries (its p-value there is small enough)."""
    from raydp.evaluation.audit import one_run_p_value

    entries = _guesses(m, rate)
    significance = (1.0 - confidence) / len(entries)
    return any(one_run_p_value(m, r, v, epsilon, delta) <= significance for r, v in entries)


def _canaries_for(rate: float, epsilon: float, delta: float, confidence: float) -> int | None:
    low, high = 1, 2
    while not _reaches(high, rate, epsilon, delta, confidence):
        if high >= MAX_CANARIES:
            return None
        low, high = high, min(2 * high, MAX_CANARIES)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if _reaches(mid, rate, epsilon, delta, confidence) else (mid, high)
    return high


@functools.lru_cache(maxsize=256)
def audit_power(epsilon: float, m: int, delta: float, confidence: float) -> AuditPower:
    """:class:`AuditPower` of a one-run audit of ``m`` canaries of a run claiming ``epsilon`` at ``delta``."""
    strongest = 1.0 / (1.0 + math.exp(-epsilon))  # e^eps / (1 + e^eps)
    goal = INFORMATIVE_SHARE * epsilon
    return AuditPower(_best_bound(m, 1.0, delta, confidence), _best_bound(m, strongest, delta, confidence),
                      _canaries_for(1.0, goal, delta, confidence), _canaries_for(strongest, goal, delta, confidence))


def _power_table(audits: list[dict]) -> list[str]:
    """What each audited setting (claimed epsilon, canaries, delta, confidence) could show (:class:`AuditPower`)."""
    settings = []
    for a in audits:
        claimed, m, delta, confidence = (a.get("claimed_epsilon"), a.get("m"), a.get("delta"), a.get("confidence"))
        try:
            key = (round(float(claimed), 3), int(m), float(delta), float(confidence))
        except (TypeError, ValueError):  # a missing or non-numeric figure: nothing to compute
            continue
        if math.isfinite(key[0]) and key[0] > 0 and key[1] >= 2 and 0 <= key[2] < 1 and 0 < key[3] < 1:
            settings.append((key, a))
    if not settings:
        return []
    rows = []
    for setting in dict.fromkeys(key for key, _ in settings):
        claimed, m, delta, confidence = setting
        audited = [a for key, a in settings if key == setting]
        power = audit_power(claimed, m, delta, confidence)
        more = f"more than {MAX_CANARIES:,}"
        zero = sum(1 for a in audited if not float(a.get("epsilon_one_run") or 0.0) > 0.0)
        rows.append([Cell(num(claimed, 3), "num"), Cell(str(m), "num"), Cell(f"{delta:g}", "num"),
                     Cell(f"{confidence:.4g}", "num"), Cell(f"{zero} of {len(audited)}", "num"),
                     Cell(num(power.perfect, 3), "num"),
                     Cell(num(power.strongest, 3), "num"),
                     Cell(more if power.canaries_perfect is None else f"{power.canaries_perfect:,}", "num"),
                     Cell(more if power.canaries_strongest is None else f"{power.canaries_strongest:,}", "num")])
    share = f"{INFORMATIVE_SHARE:g} × claimed ε" if INFORMATIVE_SHARE != 0.5 else "ε/2"
    return [how("what an audit of m canaries could show at the claimed epsilon (Steinke, Nasr & Jagielski 2023, "
                "Thm 5.2, with this audit's guess grid, Bonferroni correction, δ and confidence): the one-run bound "
                "if every guess were right, the most any attack can show, and if each guess were right with "
                "probability e^ε/(1+e^ε), the most an ε-DP run allows (randomized response at ε, Thm 3.1); then the "
                f"number of canaries at which each would reach {share}. A bound of 0 means \"not refuted\", never "
                "more: with fewer canaries than these, even the strongest attack ε allows could not have shown "
                f"{share}; with more, the attack was weaker than ε allows."),
            table("table-audit-power", ["claimed ε", "m (canaries)", "δ", "confidence", "trials with a bound of 0",
                                        "bound at m, every guess right",
                                        "bound at m, strongest attack ε allows", f"canaries for {share}, every guess "
                                        "right", f"canaries for {share}, strongest attack"], rows,
                  caption="the one-run audit's power: the best lower bound it could give")]


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
        audited = [ev for _, ev in evaluated if isinstance(ev.get("audit"), dict)]
        body.extend(_power_table([{**ev["audit"], "claimed_epsilon": ev["audit"].get(
            "claimed_epsilon", _dig(ev, "claimed", "epsilon"))} for ev in audited]))
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
