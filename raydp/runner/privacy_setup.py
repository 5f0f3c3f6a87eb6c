"""Wiring a DP run: checks of the request, sigma_0 calibration, ledger, guard, strategy, sampler.

Everything here runs before the first training step, so an impossible request (epsilon <= 0,
delta >= 1/N_train, q > 1, a target no sigma reaches) is a one-line error before any training.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from raydp.config import TrainConfig
from raydp.errors import ConfigError
from raydp.privacy import BudgetGuard, PrivacyLedger, calibrate_sigma, get_accountant, planned_steps
from raydp.privacy.calibration import SigmaEffMap
from raydp.privacy.engine import DPStep
from raydp.privacy.ledger import NEIGHBOURING_RELATION
from raydp.runner.sampling import PoissonSampler
from raydp.strategies import Strategy, StrategyContext, make_strategy
from raydp.strategies.base import PAPER_MODE_LABEL

#: Accountants reported in every DP summary; only upper bounds may enforce (ERRATA E2, E9).
REPORTED_ACCOUNTANTS = ("pld", "prv", "rdp", "gdp")


@dataclass(frozen=True)
class PrivacyPlan:
    """The checked request: sampling rate, planned steps and the calibrated sigma_0 (Alg. 1 line 1).

    ``sigma_map`` maps the gradient sigma to the step's sigma_eff when the strategy adds its own releases
    (strict-mode statistics, ERRATA E3); sigma_0 is calibrated through it."""

    q: float
    planned_steps: int
    sigma_0: float
    sigma_map: SigmaEffMap = SigmaEffMap()


@dataclass
class PrivateRun:
    sampler: PoissonSampler
    step: DPStep
    strategy: Strategy
    ledger: PrivacyLedger
    guard: BudgetGuard
    q: float
    planned_steps: int
    sigma_0: float


def sampling_rate(batch_size: int, n_train: int) -> float:
    """q = B / N_train (RLDP Sec. 3.1); q > 1 is impossible."""
    q = batch_size / n_train
    if q > 1:
        raise ConfigError(f"batch_size {batch_size} exceeds the {n_train} training records (q = {q:.3g} > 1)")
    return q


def check_delta_below_inverse_n(delta: float, n_train: int) -> None:
    """delta must be < 1/N_train: a larger delta permits releasing a record outright."""
    if delta >= 1.0 / n_train:
        raise ConfigError(f"delta={delta:g} must be < 1/N_train = {1.0 / n_train:.3g} (N_train = {n_train})")


def planned_dp_steps(config: TrainConfig, q: float) -> int:
    """Steps = ceil(epochs / q) (ERRATA E10), capped by ``max_steps``."""
    steps = planned_steps(config.epochs, q)
    return min(steps, config.max_steps) if config.max_steps else steps


def build_strategy(config: TrainConfig, controller=None) -> Strategy:
    """The configured strategy (RLDP also takes its controller settings and a policy client)."""
    if config.strategy == "rldp":
        from raydp.strategies.rldp import RLDPStrategy

        return RLDPStrategy(config.rldp, client=controller)
    return make_strategy(config.strategy, **({"clip": config.clip} if config.clip else {}))


def plan_private_run(config: TrainConfig, n_train: int, strategy: Strategy | None = None) -> PrivacyPlan:
    """Check the request against the data and calibrate sigma_0; needs no model, so it runs first.

    A strategy with its own releases is calibrated with them (ERRATA E3), so the run still lands on
    its target epsilon."""
    q = sampling_rate(config.batch_size, n_train)
    check_delta_below_inverse_n(config.delta, n_train)
    steps = planned_dp_steps(config, q)
    strategy = strategy if strategy is not None else build_strategy(config)  # its releases set sigma_eff
    multipliers = strategy.release_noise_multipliers()
    sigma_map = SigmaEffMap(relative_precision=math.fsum(1.0 / (k * k) for k in multipliers))
    calibration = calibrate_sigma(config.epsilon, config.delta, q, steps, config.accountant, sigma_eff=sigma_map)
    return PrivacyPlan(q=q, planned_steps=steps, sigma_0=calibration.sigma, sigma_map=sigma_map)


def setup_private_run(
    config: TrainConfig, plan: PrivacyPlan, model: torch.nn.Module, pairs, n_train: int, device,
    strategy: Strategy | None = None, public_batch=None,
) -> PrivateRun:
    """Ledger, guard, sampler and DP step for a planned run; ``public_batch`` feeds a strategy that
    calibrates on public records (RLDP's histogram bins and loss bound)."""
    q, steps, sigma_0 = plan.q, plan.planned_steps, plan.sigma_0
    strategy = strategy if strategy is not None else build_strategy(config)
    expected = SigmaEffMap(relative_precision=math.fsum(1.0 / (k * k) for k in strategy.release_noise_multipliers()))
    if expected.describe() != plan.sigma_map.describe():
        raise ConfigError("the privacy plan was calibrated for other releases than this strategy makes")
    ledger = PrivacyLedger(delta=config.delta, epsilon_target=config.epsilon, accountant=config.accountant)
    guard = BudgetGuard(config.accountant, epsilon_target=config.epsilon, delta=config.delta,
                        planned_steps=steps, q=q, sigma_eff=plan.sigma_map, sigma_hint=sigma_0)
    sampler = PoissonSampler(n_train, q, seed=config.seed)
    strategy.setup(
        StrategyContext(
            n_pairs=len(pairs),
            pair_depths=tuple(p.relative_depth for p in pairs),
            q=q,
            planned_steps=steps,
            sigma_0=sigma_0,
            epsilon_target=config.epsilon,
            delta=config.delta,
            expected_batch_size=sampler.expected_batch_size,
            privacy_spent=lambda: guard.spent(ledger),
        )
    )
    step = DPStep(model, pairs, strategy, ledger, guard, q=q, expected_batch_size=sampler.expected_batch_size,
                  planned_steps=steps, noise_seed=config.seed + 1_000_003, device=device)
    if strategy.needs_public_probe:
        if public_batch is None:
            raise ConfigError(f"strategy {strategy.name!r} needs a public probe batch")
        strategy.calibrate_public(*step.public_probe(public_batch))
    return PrivateRun(sampler, step, strategy, ledger, guard, q, steps, sigma_0)


def privacy_summary(run: PrivateRun, config: TrainConfig) -> dict:
    """The epsilon of every accountant from the full ledger, and the enforcing accountant's verdict."""
    final = run.guard.final_check(run.ledger)
    epsilons = {config.accountant: final.epsilon}
    for name in REPORTED_ACCOUNTANTS:
        if name not in epsilons:  # same discretisation as the enforcing accountant (set by the target)
            accountant = get_accountant(name).for_target(config.epsilon)
            epsilons[name] = accountant.epsilon(run.ledger, config.delta) if len(run.ledger) else 0.0
    return {
        "mechanism": f"Poisson-subsampled Gaussian, {run.strategy.clip_mode} clipping, {run.strategy.allocation} noise",
        "neighbouring_relation": NEIGHBOURING_RELATION,
        "epsilon_target": config.epsilon,
        "delta": config.delta,
        "q": run.q,
        "planned_steps": run.planned_steps,
        "steps_charged": len(run.ledger),
        "sigma_0": run.sigma_0,
        "releases_per_step": ["gradient", *(s.name for s in run.step.statistics)],
        "sigma_eff_0": run.guard.sigma_map(run.sigma_0),
        "enforcing_accountant": config.accountant,
        "epsilon": final.epsilon,
        "within_budget": final.within_budget,
        "verdict": final.message,
        "epsilon_by_accountant": epsilons,
        "gdp_note": "GDP (CLT) is an approximation reported for comparison with the paper; it enforces nothing",
        "guard_clamps": len(run.step.clamp_events),
        "strategy": run.strategy.describe(),
        "privacy_mode": run.strategy.privacy_mode,
        "privacy_label": PAPER_MODE_LABEL if run.strategy.privacy_mode == "paper" else None,
    }
