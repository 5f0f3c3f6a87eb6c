"""The empirical epsilon audit (one run, Steinke et al. 2023; the bounds are :mod:`raydp.evaluation.audit`) as a
registered attack: the audit canaries' scores become lower bounds on epsilon, compared with the run's claim.
The report shows it in its own section (the verdict), so its spec has no attacks table."""

from __future__ import annotations

import math

from raydp.data import load_audit_canaries
from raydp.evaluation.audit import audit_scores
from raydp.evaluation.base import AttackContext, AttackSpec, present


def run(ctx: AttackContext) -> dict | None:
    from raydp.evaluation import attacks  # lazy: studies and reports read this spec without importing torch

    audit = load_audit_canaries(ctx.dataset) if ctx.settings.audit else None
    if audit is None:
        ctx.result["audit_note"] = ("no audit canaries in this run's dataset (build it with n_audit > 0, e.g. "
                                    "`raydp data build --n-audit 100`)" if ctx.settings.audit
                                    else "audit not requested")
        return None
    if audit["included"].all() or not audit["included"].any():
        ctx.result["audit_note"] = (f"all {len(audit)} audit canaries fell on one side of their coins: no audit "
                                    "(use more, e.g. n_audit 100)")
        return None
    ctx.say(f"audit: {len(audit)} audit canaries ({int(audit['included'].sum())} included)")
    scores, scored = attacks.audit_canary_scores(ctx.loaded.model, ctx.loaded.tokenizer, list(audit["text"]),
                                                 list(audit["secret"]), ctx.loaded.device, max_length=ctx.max_length,
                                                 batch_size=ctx.settings.batch_size)
    claimed = ctx.result["claimed"]
    delta = claimed["delta"] if claimed["delta"] is not None else ctx.config.delta
    bound = audit_scores(scores, audit["included"].to_numpy(), delta=delta, confidence=ctx.confidence)
    eps = claimed["epsilon"]
    comparable = claimed["comparable"] and eps is not None and math.isfinite(eps)
    # the verdict rests on the one-run bound, the one with a theorem for a single run; Clopper-Pearson across
    # one run's canaries is the conventional estimator, shown for comparison (raydp.evaluation.audit)
    return {**bound.as_dict(), "unscored": int((~scored).sum()),
            "score": "log p(secret | its record) under the model minus under the base model",
            "claimed_epsilon": eps,
            "consistent": bool(bound.epsilon_one_run <= eps) if comparable else None,
            "verdict_basis": "epsilon_one_run (Steinke et al. 2023, Thm 5.2); Clopper-Pearson is "
                             "shown for comparison, without a one-run theorem",
            "note": claimed["note"]}


def summary(audit: dict) -> str:
    claimed = audit["claimed_epsilon"]
    verdict = {True: "not refuted", False: "VIOLATION: the one-run bound exceeds the claimed epsilon",
               None: f"not compared ({audit.get('note') or 'no claimed epsilon'})"}[audit["consistent"]]
    return (f"audit epsilon >= {audit['epsilon_one_run']:.3f} (one run) / "
            f"{audit['epsilon_clopper_pearson']:.3f} (Clopper-Pearson) vs claimed "
            f"{'n/a' if claimed is None else f'{claimed:.3f}'}: {verdict}")


def flat(audit: dict) -> dict:
    return {"audit_epsilon_one_run": audit["epsilon_one_run"],
            "audit_epsilon_clopper_pearson": audit["epsilon_clopper_pearson"],
            "audit_m": audit["m"], "audit_consistent": audit["consistent"]}


def line(row) -> str | None:
    """The one-run bound beside the epsilon the trial spent (``epsilon``; a non-private trial has none), flagged when
    above it."""
    if not present(row.get("audit_epsilon_one_run")):
        return None
    spent = row.get("epsilon")
    number = isinstance(spent, (int, float)) and not isinstance(spent, bool) and math.isfinite(spent)
    claimed = f"spent {spent:.2f}" if number else "not DP"
    above = present(row.get("audit_consistent")) and not bool(row["audit_consistent"])
    return (f"audit epsilon >= {row['audit_epsilon_one_run']:.2f} ({claimed})"
            + (": ABOVE what it spent, a privacy bug" if above else ""))


SPEC = AttackSpec("audit", run, summary, flat, line)  # the report's audit section shows it
