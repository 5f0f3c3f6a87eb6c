"""Evaluation: held-out perplexity (RLDP Sec. 3.3); privacy attacks come with the evaluation issue."""

from raydp.evaluation.perplexity import PerplexityResult, evaluate_perplexity

__all__ = ["PerplexityResult", "evaluate_perplexity"]
