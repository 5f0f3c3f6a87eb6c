"""Evaluation: held-out perplexity (RLDP Sec. 3.3), privacy attacks (membership inference, canary extraction,
exposure) and the empirical epsilon audit (``raydp eval``: :func:`raydp.evaluation.evaluate.evaluate_run`).

Module map: ``perplexity`` (utility), ``scoring`` (log-likelihoods of endings, batched; the attacks' one
primitive), ``attacks`` (the attacks' metrics), ``audit`` (lower bounds on epsilon from canary scores),
``base`` and ``registry`` (what an attack is, and the registered ones: ``membership``, ``extraction``,
``exposure``, ``epsilon_audit``), ``results`` (settings and the ``evaluation.json`` format), ``evaluate`` (a
finished run end to end).
"""

__all__ = ["PerplexityResult", "evaluate_perplexity"]


def __getattr__(name: str):
    """The package's names load on first use (PEP 562), so that ``raydp.evaluation.settings`` (the CLI's flags)
    imports no torch."""
    if name in __all__:
        from raydp.evaluation import perplexity

        return getattr(perplexity, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
