"""The registered attacks, in the order they run and are reported. A new attack is one module defining an
:class:`~raydp.evaluation.base.AttackSpec` (its run, headline, flat columns and report table; light at import)
plus one line here: :func:`raydp.evaluation.evaluate.evaluate_run`, ``summary_line``, ``flat_metrics``
(:mod:`raydp.evaluation.results`) and the report's attacks section read this tuple only."""

from __future__ import annotations

from raydp.evaluation import epsilon_audit, exposure, extraction, membership
from raydp.evaluation.base import AttackSpec

ATTACKS: tuple[AttackSpec, ...] = (
    membership.SPEC,
    extraction.SPEC,
    exposure.SPEC,
    epsilon_audit.SPEC,
)
