"""The registered attacks, in the order they run and are reported. A new attack is one module defining an
:class:`~raydp.evaluation.base.AttackSpec` named ``SPEC`` (its run, headline, flat columns and report table; light
at import) plus one line in :data:`_MODULES`: :func:`raydp.evaluation.evaluate.evaluate_run`, ``summary_line``,
``flat_metrics`` (:mod:`raydp.evaluation.results`) and the report's attacks section read :data:`ATTACKS` only."""

from __future__ import annotations

import importlib

from raydp.evaluation.base import AttackSpec

_MODULES = (
    "raydp.evaluation.membership",
    "raydp.evaluation.extraction",
    "raydp.evaluation.exposure",
    "raydp.evaluation.epsilon_audit",
)

ATTACKS: tuple[AttackSpec, ...] = tuple(importlib.import_module(module).SPEC for module in _MODULES)
