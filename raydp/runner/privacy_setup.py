"""Wiring a DP run: privacy unit, checks of the request, sigma_0 calibration, ledger, guard, strategy,
secret randomness, sampler.

Everything here runs before the first training step, so an impossible request (epsilon <= 0,
delta >= 1/N_units, q > 1, a target no sigma reaches) is a one-line error before any training.

Which guarantee applies (said in every summary and ledger):

* a strategy whose sigma schedule is fixed before training (static, static-pairwise, dp-lora) is
  calibrated and enforced with the configured upper-bound accountant (PLD by default) on its ledger;
* a strategy that chooses sigma from earlier releases (``Strategy.adaptive_sigma``: RLDP) is calibrated
  with RDP and enforced by a Renyi filter whose budget curve is fixed before training (ERRATA E13,
  :mod:`raydp.privacy.filter`); its reported epsilon is the filter's, not a post-hoc PLD of the ledger.

The number of privacy units (patients, or records) is treated as public: q = B / N_units.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from raydp.config import TrainConfig
from raydp.data import load_manifest, load_units, manifest_id
from raydp.data.build import is_public_dataset
from raydp.errors import ConfigError
from raydp.privacy import BudgetGuard, PrivacyLedger, calibrate_sigma, get_accountant, planned_steps
from raydp.privacy.accounting import REPORTED_ACCOUNTANTS
from raydp.privacy.accounting.pld import replace_one_epsilon
from raydp.privacy.calibration import SigmaEffMap
from raydp.privacy.mechanism import release_precisions
from raydp.privacy.schedule import CONSTANT, SigmaSchedule
from raydp.privacy.statistics import releases_sigma_map
from raydp.privacy.clipping import PerSampleGradientComputer
from raydp.privacy.engine import DPStep
from raydp.privacy.ghost import GhostClippingComputer
from raydp.privacy.accounting.rdp import DEFAULT_ORDERS, rdp_vector
from raydp.privacy.filter import FILTER_NAME, FilterGuard, RenyiFilter
from raydp.privacy.ledger import NEIGHBOURING_RELATION
from raydp.privacy.lifetime import charge, read_budget, record_spend
from raydp.privacy.randomness import PrivateRandomness
from raydp.runner.sampling import PoissonSampler
from raydp.strategies import make_strategy
from raydp.strategies.base import PlanRequest, Strategy, StrategyContext



UNIT_NOTES = {
    "patient": "privacy unit: patient (add/remove all of one patient's encounters; ERRATA E11)",
    "record": "privacy unit: record (add/remove one encounter); a patient with k encounters gets only "
              "group privacy in k (ERRATA E11)",
}


@dataclass(frozen=True)
class PrivacyUnits:
    """What DP protects in a run (ERRATA E11): the unit of every training record and how many there are.

    ``ids`` is None when every record is its own unit. The number of units is treated as public."""

    name: str
    count: int
    ids: np.ndarray | None = None
    #: audit canaries whose coin kept them out of train (raydp.data.splits): counted in :attr:`public_count`
    held_back: int = 0

    @property
    def public_count(self) -> int:
        """N for q = B / N, the step count, the delta check and the gradient's normaliser q * N: the units
        with every audit canary counted in, so that nothing the mechanism uses depends on the audit's coins
        (Steinke et al. 2023 audit the add/remove mechanism with q fixed; the coins stay unpublished)."""
        return self.count + self.held_back

    @property
    def note(self) -> str:
        return UNIT_NOTES[self.name]


def training_units(config: TrainConfig, dataset_dir: str | Path, n_records: int) -> PrivacyUnits:
    """The privacy unit of a run on a built dataset: the patient by default on data with patient ids
    (``privacy_unit: auto``), or the record when asked for (or when an old dataset has no patient split)."""
    manifest = load_manifest(dataset_dir)
    has_patients = manifest.get("privacy_unit") == "patient"
    wanted = config.privacy_unit
    held_back = int(manifest.get("n_audit", 0)) - int(manifest.get("audit_included", 0))  # one record, one patient
    if wanted == "patient" and not has_patients:
        raise ConfigError(f"dataset {dataset_dir} has no patient-level split; rebuild it to protect patients "
                          "(or set privacy_unit: record)")
    if wanted == "record" or not has_patients:
        return PrivacyUnits("record", n_records, held_back=held_back)
    ids = load_units(dataset_dir, "train")
    return PrivacyUnits("patient", int(len(np.unique(ids))), ids, held_back=held_back)


def is_public_source(source: str) -> bool:
    """Whether a run's data source is public: the public population, or a dataset directory that regenerates as
    it (:func:`raydp.data.build.is_public_dataset`: not merely a manifest that says so)."""
    if source == "public":
        return True
    path = Path(source).expanduser()
    if not path.is_dir():
        return False
    return is_public_dataset(path)


def private_randomness(config: TrainConfig, start_step: int = 0) -> PrivateRandomness:
    """Fresh OS entropy per run and per resume (ERRATA E12); derived from ``seed`` (and the step a resumed
    run starts at) only under the unsafe option, or on public data with ``common_random_numbers``."""
    if config.unsafe_fixed_randomness:
        return PrivateRandomness.unsafe_from_seed(config.seed, start_step)
    if config.common_random_numbers:
        if not is_public_source(config.data.source):
            raise ConfigError("common_random_numbers fixes the DP sampling and noise: it is for public data only "
                              f"(data.source: public); {config.data.source} is not public (ERRATA E12)")
        return PrivateRandomness.common_on_public_data(config.seed, start_step)
    return PrivateRandomness.fresh()


@dataclass(frozen=True)
class PrivacyPlan:
    """The checked request: sampling rate, planned steps and the calibrated sigma_0 (Alg. 1 line 1).

    ``sigma_map`` maps the gradient sigma to the step's sigma_eff when the strategy adds its own releases
    (strict-mode statistics, ERRATA E3); sigma_0 is calibrated through it."""

    q: float
    planned_steps: int
    sigma_0: float
    sigma_map: SigmaEffMap = SigmaEffMap()
    #: the calibrating and enforcing accountant: the config's for a fixed schedule, "rdp" (the Renyi
    #: filter's budget curve) for adaptive sigma
    accountant: str = "pld"
    adaptive: bool = False
    #: sigma_t = sigma_0 * m(t), fixed before training (:mod:`raydp.privacy.schedule`)
    schedule: SigmaSchedule = CONSTANT


@dataclass
class PrivateRun:
    sampler: PoissonSampler
    step: DPStep
    strategy: Strategy
    ledger: PrivacyLedger
    guard: BudgetGuard | FilterGuard
    q: float
    planned_steps: int
    sigma_0: float
    units: PrivacyUnits
    randomness: PrivateRandomness
    plan: PrivacyPlan


def sampling_rate(batch_size: int, n_train: int) -> float:
    """q = B / N_units (RLDP Sec. 3.1; B is the expected number of units per step); q > 1 is impossible."""
    q = batch_size / n_train
    if q > 1:
        raise ConfigError(f"batch_size {batch_size} exceeds the {n_train} training units (q = {q:.3g} > 1)")
    return q


def check_delta_below_inverse_n(delta: float, n_train: int) -> None:
    """delta must be < 1/N_units: a larger delta permits releasing a unit's data outright."""
    if delta >= 1.0 / n_train:
        raise ConfigError(f"delta={delta:g} must be < 1/N_train = {1.0 / n_train:.3g} (N_train = {n_train} "
                          "privacy units)")


def planned_dp_steps(config: TrainConfig, q: float) -> int:
    """Steps = ceil(epochs / q) (ERRATA E10), capped by ``max_steps``."""
    steps = planned_steps(config.epochs, q)
    return min(steps, config.max_steps) if config.max_steps else steps


def build_strategy(config: TrainConfig, controller=None) -> Strategy:
    """The configured strategy with its settings (RLDP also takes a policy client)."""
    extra = {"client": controller} if config.is_controlled else {}
    return make_strategy(config.strategy, config.strategy_settings(), **extra)


def plan_key(config: TrainConfig, strategy: Strategy) -> tuple:
    """What a privacy plan depends on: runs with equal keys calibrate the same sigma_0."""
    if getattr(strategy, "mechanism", None) == "local":  # a local plan depends on the whole strategy
        return (config.epsilon, config.delta, config.batch_size, config.epochs, config.max_steps,
                config.privacy_unit, strategy.name, repr(strategy.settings))
    return (config.epsilon, config.delta, config.batch_size, config.epochs, config.max_steps, config.accountant,
            config.privacy_unit, strategy.adaptive_sigma, release_precisions(strategy.releases()),
            strategy.schedule_key())


def plan_private_run(config: TrainConfig, n_units: int, strategy: Strategy | None = None) -> PrivacyPlan:
    """Check the request against the data and calibrate sigma_0; needs no model, so it runs first.

    ``n_units``: the number of training privacy units (:func:`training_units`). A strategy with its own
    releases is calibrated with them (ERRATA E3), so the run still lands on its target epsilon; a
    strategy with adaptive sigma is calibrated with RDP, the accountant of its Renyi filter (E13)."""
    q = sampling_rate(config.batch_size, n_units)
    check_delta_below_inverse_n(config.delta, n_units)
    steps = planned_dp_steps(config, q)
    strategy = strategy if strategy is not None else build_strategy(config)  # its releases set sigma_eff
    sigma_map = releases_sigma_map(strategy.releases())
    accountant = "rdp" if strategy.adaptive_sigma else config.accountant
    strategy.plan(PlanRequest(epsilon=config.epsilon, delta=config.delta, q=q, planned_steps=steps,
                              accountant=accountant))
    schedule = strategy.schedule()
    if strategy.adaptive_sigma and not schedule.is_constant:
        raise ConfigError(f"strategy {strategy.name!r}: an adaptive-sigma strategy plans a constant schedule")
    calibration = calibrate_sigma(config.epsilon, config.delta, q, steps, accountant, sigma_eff=sigma_map,
                                  schedule=schedule)
    return PrivacyPlan(q=q, planned_steps=steps, sigma_0=calibration.sigma, sigma_map=sigma_map,
                       accountant=accountant, adaptive=strategy.adaptive_sigma, schedule=schedule)


def planned_rdp_curve(plan: PrivacyPlan, delta: float, orders=DEFAULT_ORDERS) -> np.ndarray:
    """What a planned run may spend, as an RDP curve at ``orders``, fixed before it starts: an adaptive run's
    Renyi-filter budget (ERRATA E13), else the fixed schedule's steps, each a Poisson-subsampled Gaussian at
    sigma_eff(sigma_0 m(t)) (RDP composition, Mironov 2017, Prop. 1)."""
    if plan.adaptive:
        return RenyiFilter.for_plan(plan.q, plan.sigma_map(plan.sigma_0), plan.planned_steps, delta, orders).budget
    total = np.zeros(len(orders))
    for multiplier, count in plan.schedule.segments(plan.planned_steps, plan.q):
        total = total + count * rdp_vector(plan.q, plan.sigma_map(plan.sigma_0 * multiplier), orders)
    return total


#: two plans' numbers that differ by less than this, relatively, are the same number (one calibration run on two
#: machines); anything more is a different plan
PLAN_TOLERANCE = 1e-9


def plan_record(plan, config: TrainConfig, units: PrivacyUnits | None, dataset_id: str | None) -> dict | None:
    """What a run's privacy plan fixes before its first step, as plain JSON (None for a non-private run): the dataset
    it runs on (its keyed ``dataset_id``, :func:`raydp.data.manifest_id`), the privacy unit and the public unit count N;
    for DP-SGD the target (epsilon, delta), the accountant, the sampling rate q, the planned steps, the calibrated
    sigma_0, the sigma schedule and the releases' precisions; for forward-pass local DP its epochs, q, records per unit
    and per-epoch sigmas. A study's driver charges a trial this plan, and the trial's run must run it, on that dataset
    (:func:`check_expected_plan`): two datasets of one size (say two builds that differ only in their canaries) plan
    the same numbers, and only the dataset id tells them apart."""
    if plan is None:
        return None
    if units is None:
        raise ConfigError("a private run's plan record names its privacy units")
    target = {"epsilon": float(config.epsilon), "delta": float(config.delta), "dataset_id": dataset_id,
              "privacy_unit": units.name, "units": int(units.public_count)}
    if isinstance(plan, PrivacyPlan):
        return {"mechanism": "central", **target, "accountant": plan.accountant, "q": float(plan.q),
                "planned_steps": int(plan.planned_steps), "sigma_0": float(plan.sigma_0), "adaptive": bool(plan.adaptive),
                "schedule": [float(m) for m in plan.schedule.per_epoch],
                "release_precisions": [plan.sigma_map.extra_precision, plan.sigma_map.relative_precision]}
    return {"mechanism": "local", **target, "q": float(plan.paper_q), "planned_steps": int(plan.planned_steps),
            "epochs": int(plan.epochs), "records_per_unit": int(plan.records_per_unit),
            "sigmas": [float(s) for s in plan.plan.sigmas],
            "epsilon_label": None if plan.epsilon_label is None else float(plan.epsilon_label)}


def plan_differences(expected: dict, actual: dict | None) -> list[str]:
    """The fields in which two :func:`plan_record` plans differ (numbers within :data:`PLAN_TOLERANCE` agree)."""
    actual = actual if actual is not None else {"mechanism": "none"}
    return [key for key in sorted(set(expected) | set(actual), key=lambda k: (k != "mechanism", k))
            if not _same(expected.get(key), actual.get(key))]


def check_expected_plan(expected: dict, plan, config: TrainConfig, units: PrivacyUnits | None,
                        dataset_id: str | None) -> None:
    """Refuse (one line, before any step) a run whose plan is not ``expected``, the plan its caller (a study's
    driver) calibrated and charged for it: the plan that was charged must be the plan that runs, on the dataset it
    was charged on (``dataset_id``: the run's dataset's, :func:`raydp.data.manifest_id`)."""
    actual = plan_record(plan, config, units, dataset_id)
    differing = plan_differences(expected, actual)
    if differing:
        actual = actual or {"mechanism": "none"}
        detail = ", ".join(f"{key} {expected.get(key)!r} charged, {actual.get(key)!r} here" for key in differing)
        raise ConfigError(f"this run's privacy plan is not the one its study charged ({detail}): nothing was started")


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=PLAN_TOLERANCE, abs_tol=0.0)
    return a == b


@dataclass(frozen=True)
class LifetimeCharge:
    """One run's claim on its dataset's lifetime budget: its plan, delta, privacy unit and the caveats on its
    epsilon (a strategy's labels, void randomness): a run with caveats cannot be charged."""

    plan: object  # PrivacyPlan, or a local plan (refused)
    delta: float
    unit: str
    caveats: tuple[str, ...] = ()

    @classmethod
    def of(cls, plan, config: TrainConfig, strategy: Strategy, unit: str) -> LifetimeCharge:
        labels = getattr(strategy, "labels", None)  # a local strategy has none (it is refused on its plan)
        caveats = tuple(labels() if labels else ()) + (
            ("unsafe_fixed_randomness",) if config.unsafe_fixed_randomness else ())
        return cls(plan, config.delta, unit, caveats)


def has_lifetime_budget(manifest: dict) -> bool:
    """Whether the dataset of ``manifest`` has a lifetime budget: its register is found here, or its manifest says it
    has one (a register on another machine)."""
    return bool(manifest.get("lifetime_budget")) or \
        read_budget(manifest_id(manifest), manifest.get("source_sha256")) is not None


def charge_lifetime(manifest: dict, runs: dict[str, LifetimeCharge], commit: bool = True) -> float | None:
    """Charge planned runs (label -> :class:`LifetimeCharge`) to the dataset's lifetime budget, if it has one
    (:mod:`raydp.privacy.lifetime`), in one step: a one-line ConfigError, nothing charged, when they would exceed
    it. Refused on a budgeted dataset: local-DP runs (no RDP curve), runs whose epsilon carries caveats (paper
    mode, a redacted private phase 1, void randomness: their charge would not bound what they reveal), and runs
    of another privacy unit. A dataset marked budgeted whose register is not found is refused (fail closed)."""
    dataset_id, required = manifest_id(manifest), bool(manifest.get("lifetime_budget"))
    source = manifest.get("source_sha256")  # the budget follows the source under another owner key
    if not runs:
        return None
    if read_budget(dataset_id, source) is None and not required:  # no budget: what they spend is still recorded
        if commit:
            record_spend(dataset_id, {label: planned_rdp_curve(run.plan, run.delta) for label, run in runs.items()
                                      if isinstance(run.plan, PrivacyPlan)})  # a local-DP run has no RDP curve
        return None
    for label, run in runs.items():
        if not isinstance(run.plan, PrivacyPlan):
            raise ConfigError(f"{label}: dataset {dataset_id} has a lifetime budget, and a local-DP run's accounting "
                              f"cannot be charged to it")
        if run.caveats:
            raise ConfigError(f"{label}: dataset {dataset_id} has a lifetime budget, and this run's epsilon carries "
                              f"caveats ({'; '.join(run.caveats)[:120]}) that a charge cannot cover")
    units = {run.unit for run in runs.values()}
    if len(units) > 1:
        raise ConfigError(f"runs on dataset {dataset_id} protect different units ({sorted(units)}): charge them apart")
    curves = {label: planned_rdp_curve(run.plan, run.delta) for label, run in runs.items()}
    return charge(dataset_id, curves, DEFAULT_ORDERS, commit=commit, privacy_unit=units.pop(), required=required,
                  source_sha256=source)


def setup_private_run(
    config: TrainConfig, plan: PrivacyPlan, model: torch.nn.Module, pairs, units: PrivacyUnits, device,
    strategy: Strategy | None = None, public_batch=None, start_step: int = 0,
    population_admit=None, loss=None, public_utility=None,
) -> PrivateRun:
    """Ledger, guard, secret randomness, sampler and DP step for a planned run; ``public_batch`` feeds a
    strategy that calibrates on public records (RLDP's histogram bins and loss bound); ``population_admit``
    (PBT): the population Renyi filter's admission, asked by the guard at every step; ``loss``: the
    task's per-example loss (:class:`raydp.runner.task.Task`; default language modelling); ``public_utility``: the
    strategy context's (:class:`raydp.strategies.base.StrategyContext`)."""
    q, steps, sigma_0 = plan.q, plan.planned_steps, plan.sigma_0
    if strategy is None:
        strategy = build_strategy(config)
        strategy.plan(PlanRequest(epsilon=config.epsilon, delta=config.delta, q=q, planned_steps=steps,
                                  accountant=plan.accountant))
    expected = releases_sigma_map(strategy.releases())
    if expected.describe() != plan.sigma_map.describe() or plan.adaptive != strategy.adaptive_sigma \
            or plan.schedule != strategy.schedule():
        raise ConfigError("the privacy plan was calibrated for another strategy than this one")
    randomness = private_randomness(config, start_step)
    if plan.adaptive:
        guard = FilterGuard.for_plan(epsilon_target=config.epsilon, delta=config.delta, planned_steps=steps, q=q,
                                     sigma_0=sigma_0, sigma_eff=plan.sigma_map,
                                     population_admit=population_admit)  # PBT population filter (or None)
    elif population_admit is not None:  # PBT: only an adaptive (Renyi-filtered) run joins a population
        raise ConfigError(f"strategy {strategy.name!r} has a fixed schedule: it cannot join a population filter")
    else:
        guard = BudgetGuard(config.accountant, epsilon_target=config.epsilon, delta=config.delta,
                            planned_steps=steps, q=q, sigma_eff=plan.sigma_map, sigma_hint=sigma_0)
    ledger = PrivacyLedger(delta=config.delta, epsilon_target=config.epsilon,
                           accountant=FILTER_NAME if plan.adaptive else config.accountant,
                           metadata=ledger_metadata(plan, units, randomness, strategy, guard))
    sampler = PoissonSampler(len(units.ids) if units.ids is not None else units.count, q,
                             rng=randomness.sampling_rng(), units=units.ids, n_public=units.public_count)
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
            tensor_sizes=tuple(t.numel() for p in pairs for t in (p.a, p.b)),
            public_utility=public_utility,
        )
    )
    clipped = {id(t) for p in pairs for t in (p.a, p.b)}
    outside = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in clipped]
    if outside:  # the optimizer would apply their raw (unclipped, noiseless) gradients
        raise ConfigError(f"trainable parameters outside the LoRA adapter pairs ({outside[0]}, ...) would get no "
                          "clipping and no noise: restrict lora.target_modules to linear layers")
    if strategy.gradient_source == "ghost":
        if strategy.clip_mode != "flat":
            raise ConfigError(f"strategy {strategy.name!r}: ghost clipping clips flat (one radius over all LoRA "
                              f"gradients), not {strategy.clip_mode}")
        try:
            gradients = GhostClippingComputer(model, pairs, **({"loss": loss} if loss is not None else {}))
        except ValueError as error:  # e.g. a bf16 model on a GPU
            raise ConfigError(f"strategy {strategy.name!r}: {error} (settings.clipping=per_sample)") from None
    elif strategy.gradient_source == "per_sample":
        gradients = PerSampleGradientComputer(model, pairs, loss=loss) if loss is not None else None
    else:
        raise ConfigError(f"strategy {strategy.name!r}: unknown gradient source {strategy.gradient_source!r}")
    step = DPStep(model, pairs, strategy, ledger, guard, q=q, expected_batch_size=sampler.expected_batch_size,
                  planned_steps=steps, device=device, randomness=randomness, sigma_0=sigma_0, gradients=gradients)
    if strategy.needs_public_probe:
        if public_batch is None:
            raise ConfigError(f"strategy {strategy.name!r} needs a public probe batch")
        strategy.calibrate_public(*step.public_probe(public_batch))
    return PrivateRun(sampler, step, strategy, ledger, guard, q, steps, sigma_0, units, randomness, plan)


def privacy_labels(strategy: Strategy, randomness: PrivateRandomness) -> list[str]:
    """Every caveat that voids or narrows a run's epsilon; carried by every artifact that states one."""
    labels = list(strategy.labels())
    if randomness.label:
        labels.append(randomness.label)
    return labels


def guarantee_note(plan: PrivacyPlan, accountant: str) -> str:
    if plan.adaptive:
        return ("sigma was chosen adaptively: epsilon is the Renyi filter's guarantee, fixed before training "
                "(Feldman & Zrnic 2021; Lecuyer 2021); other accountants' figures compose the realized ledger "
                "as if it were fixed in advance and are not a guarantee (ERRATA E13)")
    return (f"sigma schedule fixed before training: epsilon is the {accountant.upper()} upper bound of the "
            "ledger's composition")


def ledger_metadata(plan: PrivacyPlan, units: PrivacyUnits, randomness: PrivateRandomness, strategy: Strategy,
                    guard) -> dict:
    """What the ledger file states beside its rows: unit, guarantee, labels (never the seeds)."""
    return {"privacy_unit": units.name, "n_units": units.public_count, "unit_note": units.note,
            "guarantee": FILTER_NAME if plan.adaptive else "fixed-schedule",
            "guarantee_note": guarantee_note(plan, plan.accountant),
            "filter": guard.filter.describe() if plan.adaptive else None,
            "randomness": randomness.source, "labels": privacy_labels(strategy, randomness)}


#: what the released counts mean for the guarantee: N is released, so say under which relation it is covered
PUBLIC_COUNTS_NOTE = (
    "the number of units in train (n_units, N), q = B/N and the step count are released (the record count is not) "
    "and treated as public, as DP-SGD libraries do. epsilon is for add/remove-one unit: it bounds what the "
    "adapters, ledger and statistics reveal about one unit given N, but N itself changes with that unit's presence, "
    "so an adversary who knows every other unit learns membership from N. What covers N too is replace-one (one "
    "unit's records swapped for another's, N unchanged): epsilon_replace_one at delta_replace_one")


def replace_one_guarantee(run: PrivateRun, config: TrainConfig, epsilon: float) -> dict:
    """The run's guarantee under replace-one neighbours (:data:`PUBLIC_COUNTS_NOTE`): a fixed schedule's ledger
    composed by dp_accounting's PLD under REPLACE_ONE (sensitivity doubled) at the same delta; an adaptive run
    (Renyi filter) or a PBT member gets the group-privacy bound of its add/remove guarantee: replace-one is a
    removal then an addition, (2 eps, (1 + e^eps) delta) (Dwork & Roth 2014, Thm 2.2 with k = 2)."""
    population = getattr(run.guard, "population_admit", None) is not None
    if run.plan.adaptive or population:
        delta = (1 + math.exp(epsilon)) * config.delta
        note = "group privacy (k = 2) of the add/remove guarantee: sigma was chosen adaptively"
        if delta * run.units.public_count >= 1:
            note += (f"; VACUOUS: delta_replace_one = {delta:.3g} is not below 1/N (N = {run.units.public_count}), so "
                     "it allows revealing a patient outright")
        return {"epsilon_replace_one": 2 * epsilon, "delta_replace_one": delta, "replace_one_note": note}
    eps = replace_one_epsilon(run.ledger, config.delta) if len(run.ledger) else 0.0
    return {"epsilon_replace_one": eps, "delta_replace_one": config.delta,
            "replace_one_note": "the ledger composed by dp_accounting's PLD under REPLACE_ONE (sensitivity 2C): "
                                "one training patient swapped for another (N unchanged); a patient moving between "
                                "train and another split changes N, which only the public-N convention covers"}


def privacy_summary(run: PrivateRun, config: TrainConfig) -> dict:
    """The guarantee (the enforcing accountant's, or the Renyi filter's for adaptive sigma), every
    accountant's composition of the ledger beside it, the unit and every label."""
    final = run.guard.final_check(run.ledger)
    labels = privacy_labels(run.strategy, run.randomness)
    population = getattr(run.guard, "population_admit", None)  # a PBT member: the population's guarantee
    epsilon = final.epsilon
    if population is not None:
        epsilon = getattr(population, "epsilon", math.inf)  # a hook that does not say is not a guarantee
        labels.append(f"PBT member: its model depends on the whole population, whose guarantee is epsilon="
                      f"{epsilon:.4f} (population Renyi filter); its own filter kept it within its "
                      f"plan (epsilon={final.epsilon:.4f})")
    epsilons = {} if run.plan.adaptive else {config.accountant: final.epsilon}
    for name in REPORTED_ACCOUNTANTS:
        if name not in epsilons:  # same discretisation as the enforcing accountant (set by the target)
            accountant = get_accountant(name).for_target(config.epsilon)
            epsilons[name] = accountant.epsilon(run.ledger, config.delta) if len(run.ledger) else 0.0
    verdict = final.message
    if labels:
        verdict = f"{verdict} [{'; '.join(labels)}]"
    return {
        "mechanism": f"Poisson-subsampled Gaussian, {run.strategy.clip_mode} clipping, {run.strategy.allocation} noise",
        "neighbouring_relation": NEIGHBOURING_RELATION,
        "privacy_unit": run.units.name,
        "n_units": run.units.public_count,
        "unit_note": run.units.note,
        "epsilon_target": config.epsilon,
        "delta": config.delta,
        "q": run.q,
        "planned_steps": run.planned_steps,
        "steps_charged": len(run.ledger),
        "sigma_0": run.sigma_0,
        "releases_per_step": ["gradient", *(r.name for r in run.step.releases)],
        "schedule": run.plan.schedule.describe(),
        "sigma_eff_0": run.guard.sigma_map(run.sigma_0),
        "guarantee": FILTER_NAME if run.plan.adaptive else "fixed-schedule",
        "guarantee_note": guarantee_note(run.plan, run.plan.accountant),
        "enforcing_accountant": FILTER_NAME if run.plan.adaptive else config.accountant,
        "calibration_accountant": run.plan.accountant,
        "filter": run.guard.filter.describe() if run.plan.adaptive else None,
        "epsilon": epsilon,
        "epsilon_member_filter": final.epsilon if population is not None else None,
        "within_budget": final.within_budget,
        "verdict": verdict,
        "epsilon_by_accountant": epsilons,
        "epsilon_by_accountant_note": ("compositions of the realized ledger as if fixed in advance: not a "
                                       "guarantee under adaptive sigma (ERRATA E13)") if run.plan.adaptive else None,
        "gdp_note": "GDP (CLT) is an approximation reported for comparison with the paper; it enforces nothing",
        "edgeworth_note": ("Edgeworth (Wang et al. 2022; the accountant of EW-Tune and DualTune-GhostDP) is an "
                           "approximation, reported beside the enforcing upper bound; it enforces nothing (ERRATA E9)"),
        "guard_clamps": len(run.step.clamp_events),
        "strategy": run.strategy.describe(),
        "privacy_mode": run.strategy.privacy_mode,
        "randomness": run.randomness.source,
        "epsilon_void": not run.randomness.is_secret,
        "labels": labels,
        "privacy_label": "; ".join(labels) if labels else None,
        "public_counts": PUBLIC_COUNTS_NOTE,
        **replace_one_guarantee(run, config, epsilon),
    }
