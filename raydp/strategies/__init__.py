"""Strategies: what sets the clip radii and the noise multiplier of each DP step."""

from raydp.errors import ConfigError
from raydp.strategies.base import Dials, StepRelease, Strategy, StrategyContext
from raydp.strategies.static import DPLoRAStrategy, StaticPairwiseStrategy, StaticStrategy

#: DP strategies by name (``nonprivate`` is not a strategy: it has no privacy dials).
STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (StaticStrategy, DPLoRAStrategy, StaticPairwiseStrategy)
}


def make_strategy(name: str, **kwargs) -> Strategy:
    try:
        cls = STRATEGIES[name]
    except KeyError:
        raise ConfigError(f"unknown strategy {name!r}; known: nonprivate, {', '.join(STRATEGIES)}, rldp") from None
    return cls(**kwargs)


__all__ = ["STRATEGIES", "Dials", "StepRelease", "Strategy", "StrategyContext", "make_strategy"]
