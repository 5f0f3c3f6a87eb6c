"""Study files (``trials/NAME.yaml``): what a study runs, validated before any trial starts.

A study is the cartesian product models x epsilons x seeds x strategies, where each ``rldp`` entry is
further expanded over the SAC grid T_RL x B_SAC x K (RLDP Sec. 3.2), or sampled by Optuna over the
same ranges; a ``pbt`` entry (``search: pbt``) is a population of members trained by Ray Tune's
Population Based Training over (clip, sigma_scale) (``pbt`` block). ``base`` holds the
:class:`~raydp.config.TrainConfig` fields every trial shares (data, epochs, batch size...). ``selection``
says which perplexity picks trials (ERRATA E15): the public validation split by default; ``private`` uses
the private eval split, which is not a DP release, and every output says so. Every trial's config is built
and validated up front, and every distinct privacy plan is calibrated (an impossible budget is an error
naming the trial), so a bad study file fails before Ray starts anything. The trials themselves are planned from
a validated study in :mod:`raydp.study.grid`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, model_validator

from raydp.config import StrictModel, load_yaml_mapping, validate_config
from raydp.control.modes import resolve_values
from raydp.errors import ConfigError
from raydp.evaluation.results import EvalConfig
from raydp.strategies.registry import (SPECS, STRATEGY_CHOICES, capability_names, get_spec, strategy_class,
                                       with_capability)
from raydp.study.grid import PUBLIC_ONLY_SEARCH_FIELDS, SEARCHABLE_RUN_FIELDS
from raydp.study.routes import SEARCH_SPACE_VALUES, SEARCH_VALUES


def _known_strategy(name: str) -> str:
    if name not in STRATEGY_CHOICES:
        raise ValueError(f"unknown strategy {name!r}; known: {', '.join(STRATEGY_CHOICES)}")
    return name


#: nonprivate or a registered strategy (an unknown name is an error naming its position)
StrategyName = Annotated[str, AfterValidator(_known_strategy)]


class SACGrid(StrictModel):
    """RLDP Sec. 3.2: T_RL in {16..112}, B_SAC in {4,8,16,32}, K in {1,2,4} (defaults: Sec. 4.5's robust cell)."""

    t_rl: list[int] = Field([112], min_length=1)
    b_sac: list[int] = Field([4], min_length=1)
    k: list[int] = Field([2], min_length=1)

    @model_validator(mode="after")
    def _positive(self):
        for name in ("t_rl", "b_sac", "k"):
            if any(v <= 0 for v in getattr(self, name)):
                raise ValueError(f"sac_grid.{name} values must be > 0")
        return self


class OptunaSettings(StrictModel):
    """Optuna over the SAC grid's ranges instead of the full grid, or over a ``search_space`` (per cell)."""

    num_samples: int = Field(8, gt=0, description="trials per search (a search_space: per strategy, model and epsilon)")
    seed: int = 0
    sampler: Literal["tpe", "cmaes"] = Field("tpe", description="Optuna's sampler: TPE (Bayesian optimisation) or "
                                             "CMA-ES (a search_space's numeric dimensions)")
    startup_trials: int = Field(4, ge=1, description="a search_space's random trials before the sampler models the "
                                "results (Optuna's TPE default, 10, would make a 10-trial search a random one)")


class BanditSettings(StrictModel):
    """``search: bandit``: the episode-level contextual bandit over a ``search_space`` (raydp.study.schedule_bandit)."""

    num_samples: int = Field(10, gt=0, description="episodes per epsilon (the study runs num_samples x epsilons)")
    seed: int = Field(0, description="seeds the random start, the candidates and the Thompson draws (public)")
    startup_trials: int = Field(2, ge=1, description="random episodes per epsilon before Thompson sampling")
    candidates: int = Field(1024, ge=16, description="random arms scored per decision (besides those tried)")


class SearchDimension(StrictModel):
    """One searched value: a range (``low``, ``high``, ``log``) or a list of ``choices``."""

    low: float | None = None
    high: float | None = None
    log: bool = Field(False, description="sample log-uniformly")
    choices: list | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _one_kind(self):
        if self.choices is not None:
            if self.low is not None or self.high is not None:
                raise ValueError("a search dimension is a range (low, high) or choices, not both")
            return self
        if self.low is None or self.high is None or not self.low < self.high:
            raise ValueError("a search range needs low < high (or give choices)")
        if self.log and self.low <= 0:
            raise ValueError("a log search range needs low > 0")
        return self

    def corners(self) -> list:
        return list(self.choices) if self.choices is not None else [self.low, self.high]


class MutationRange(StrictModel):
    """The range PBT samples a hyperparameter from (and clamps its perturbations to)."""

    low: float = Field(gt=0)
    high: float = Field(gt=0)
    log: bool = Field(False, description="sample log-uniformly")

    @model_validator(mode="after")
    def _ordered(self):
        if not self.low < self.high:
            raise ValueError(f"a mutation range needs low < high, got [{self.low:g}, {self.high:g}]")
        return self


class PBTMutations(StrictModel):
    """What PBT explores: the members' (clip, sigma_scale) (:class:`raydp.strategies.pbt.PBTSettings`)."""

    clip: MutationRange = MutationRange(low=0.1, high=2.0, log=True)
    sigma_scale: MutationRange = MutationRange(low=0.8, high=1.5)


class PBTStudySettings(StrictModel):
    """Population Based Training over (clip, sigma) with Ray Tune's ``PopulationBasedTraining`` (search: pbt).

    ``members`` members start from settings drawn from the ranges (seeded by ``seed``); every
    ``perturbation_interval`` evaluations (of ``eval_every`` steps each) the worst ``quantile_fraction``
    copy a top member's checkpoint (its ledger included) and perturb its settings (x0.8 / x1.2, or a fresh
    draw with ``resample_probability``), clamped to the ranges. ``synch``: Tune's synchronous PBT (every
    member still training reaches the perturbation point before any exploits; a member that ended before it
    takes no part), the only mode offered: asynchronous
    exploits are a function of timing, which depends on private batch sizes. The metric is the PUBLIC validation perplexity (ERRATA E15), minimised."""

    members: int = Field(4, ge=2, description="population size M")
    perturbation_interval: int = Field(1, gt=0, description="evaluations between perturbations")
    hyperparam_mutations: PBTMutations = PBTMutations()
    quantile_fraction: float = Field(0.25, gt=0, le=0.5)
    resample_probability: float = Field(0.25, ge=0, le=1)
    synch: Literal[True] = Field(True, description="synchronous PBT only: asynchronous exploits would depend on "
                                 "which members reported first, i.e. on run times, which grow with the private "
                                 "batch sizes")
    seed: int = Field(0, ge=0, description="seed of the initial settings and of PBT's choices (public)")


class TransferSettings(StrictModel):
    """Train RLDP policies on ``source_model`` first (stage 1); then every RLDP trial on the study's
    models also runs frozen with the matching source policy (same epsilon, seed and SAC cell)."""

    source_model: str


class WandbSettings(StrictModel):
    """Metrics to Weights & Biases: offline by default (no network), online when configured. Only what a run
    may release is sent (curves of the metrics, the privacy spent and the dials; tables; the DP adapters as an
    artifact); never training text, prompts or canaries; attack results only on opt-in."""

    mode: Literal["offline", "online", "disabled"] | None = Field(
        None, description="default: $WANDB_MODE, else offline (no network)")
    project: str | None = Field(None, description="default: $WANDB_PROJECT, else raydp")
    entity: str | None = Field(None, description="default: $WANDB_ENTITY (wandb reads it)")
    artifacts: bool = Field(True, description="log each DP trial's releasable files (adapters, summary, ledger, "
                                              "PRIVACY.txt) as a wandb artifact; non-private trials never")
    attacks: bool = Field(False, description="opt in: also send the attack and audit results (private: measured "
                                             "on the private records), labelled unprotected/")

    def resolved(self) -> tuple[str, str, str | None]:
        """(mode, project, entity): the study's values, else wandb's environment variables, else the defaults."""
        mode = self.mode or os.environ.get("WANDB_MODE") or "offline"
        if mode not in ("offline", "online", "disabled", "dryrun", "run"):
            raise ConfigError(f"WANDB_MODE={mode!r}: use offline, online or disabled")
        return ({"dryrun": "offline", "run": "online"}.get(mode, mode),
                self.project or os.environ.get("WANDB_PROJECT") or "raydp", self.entity or os.environ.get("WANDB_ENTITY"))


class PrivateSelectionSettings(StrictModel):
    """``selection: private-dp``: private hyperparameter selection (Papernot & Steinke, ICLR 2022, Thms. 2 and 6;
    :mod:`raydp.study.private_selection`). Per (model, epsilon, seed) cell the study draws a secret number K of
    trials from ``distribution``, each trial's settings independently from ``search_space``, scores each trial by
    one Gaussian release on the private validation split, and releases only the best trial. The study's epsilon
    is the END-TO-END epsilon of that released result; each trial's budget is solved from it."""

    distribution: Literal["poisson", "geometric", "logarithmic", "truncated-negative-binomial"] = Field(
        "logarithmic", description="the law of K: poisson (Thm. 6; K may be 0: nothing released) or a truncated "
        "negative binomial (Thm. 2; geometric: shape 1, logarithmic: shape 0)")
    mean: float = Field(4.0, ge=1.0, description="E[K], the expected number of trials per cell")
    shape: float | None = Field(None, ge=0.0, description="eta of a truncated-negative-binomial (not for the others)")
    score_range: tuple[float, float] = Field((30.0, 110.0), description=(
        "each validation record's value-token NLL (nats; a free-text record's whole-text NLL) is clipped to "
        "[low, high]; a patient contributes the mean of its records', so one patient moves the summed score by at "
        "most high - low"))
    score_noise: float = Field(6.0, gt=0, description=(
        "the score's noise multiplier: Gaussian noise of std score_noise x (high - low) on the summed score "
        "(RDP order a: a / (2 score_noise^2))"))

    @model_validator(mode="after")
    def _consistent(self):
        low, high = self.score_range
        if not high > low:
            raise ValueError("private_selection.score_range needs low < high")
        if (self.shape is not None) != (self.distribution == "truncated-negative-binomial"):
            raise ValueError("private_selection.shape is the eta of a truncated-negative-binomial only (and it "
                             "needs one)")
        if self.distribution != "poisson" and self.mean <= 1.0:
            raise ValueError(f"a {self.distribution} number of trials needs mean > 1")
        return self


class Resources(StrictModel):
    cpus_per_trial: int = Field(2, gt=0, description="CPU threads of each trial's run")
    gpus_per_trial: float = Field(0.0, ge=0, description="GPUs of each trial's run (a cluster)")


def upgrade_study_values(values):
    """An old study file's values in today's form (every StudyConfig is read through this; a stored study.json
    too). A strategy's legacy settings block in ``base`` (RLDP's ``base.rldp`` of older study files) becomes that
    strategy's ``strategy_settings``, like every other strategy's (:func:`raydp.config.upgrade_train_values`)."""
    if not isinstance(values, dict) or not isinstance(values.get("base"), dict):
        return values
    blocks = {spec.legacy_block: name for name, spec in SPECS.items()
              if spec.legacy_block and spec.legacy_block in values["base"]}
    if not blocks:
        return values
    base, arms = dict(values["base"]), dict(values.get("strategy_settings") or {})
    for block, owner in blocks.items():
        legacy = base.pop(block)
        if legacy is None:
            continue
        if not isinstance(legacy, dict):
            raise ValueError(f"base.{block}: give the strategy's settings as a mapping (strategy_settings.{owner})")
        both = sorted(set(legacy) & set(arms.get(owner) or {}))
        if both:
            raise ValueError(f"base.{block}.{both[0]} and strategy_settings.{owner}.{both[0]} are both set: "
                             f"{block}'s settings now go under strategy_settings.{owner} only")
        arms[owner] = {**legacy, **(arms.get(owner) or {})}
    return {**values, "base": base, "strategy_settings": arms}


#: controller settings a settings_grid may not vary: the study composes the provenance of the policy its
#: strategy_settings name
GRID_FORBIDDEN_RLDP = frozenset({"policy", "policy_dir", "frozen", "save_policy"})


class StudyConfig(StrictModel):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str = ""
    base: dict = Field(default_factory=dict, description="TrainConfig fields shared by all trials")
    models: list[str] = Field(["embedded"], min_length=1)
    epsilons: list[float] = Field(min_length=1)
    seeds: list[int] = Field([0], min_length=1)
    strategies: list[StrategyName] = Field(["static", "rldp"], min_length=1,
                                  description="nonprivate or registered DP strategies (raydp.strategies.registry)")
    strategy_settings: dict[str, dict] = Field(
        default_factory=dict, description="per strategy, its settings (TrainConfig.settings) in every trial of it")
    settings_grid: dict[str, dict[str, list]] = Field(
        default_factory=dict, description="per strategy, settings to grid over: one trial per combination, e.g. "
        "{static-pairwise: {clip: [0.01, 0.1]}} (tuning a baseline's clip on public data), or the run fields lr, "
        "lr_decay, lr_end, warmup_steps, rescale_moments; e.g. {rldp: {action_decoding: [paper, relative]}}")
    tuned_from: str | None = Field(None, description=(
        "a finished search study's directory (search_space, on PUBLIC data): each trial of a strategy it searched "
        "runs with the best values of its (strategy, model, epsilon) cell (study_summary.json search_best)"))
    sac_grid: SACGrid = SACGrid()
    search: Literal[SEARCH_VALUES] = Field("grid", description=(  # the search routes' values (raydp.study.routes)
        "grid; optuna (a search_space or RLDP's SAC cell); pbt; random: independent draws from search_space, "
        "with selection: private-dp only; bandit: one contextual bandit over one strategy's search_space across "
        "the epsilons, on public episodes"))
    optuna: OptunaSettings = OptunaSettings()
    bandit: BanditSettings = BanditSettings()
    search_space: dict[str, dict[str, SearchDimension]] = Field(default_factory=dict, description=(
        "search: optuna: per strategy, the settings (and run fields lr, lr_decay, lr_end, warmup_steps, weight_decay, "
        "rescale_moments, and on public data batch_size) Optuna searches, one search of optuna.num_samples trials "
        "per model and epsilon at the study's one seed; e.g. {clip-schedule: {clip: {low: 0.1, high: 10, log: true}, lr: {...}}}. Without it, "
        "search: optuna searches RLDP's SAC cell"))
    pbt: PBTStudySettings = PBTStudySettings()
    policy: Literal["per-trial", "shared"] = Field(
        "per-trial", description="each RLDP trial trains its own policy, or all share one policy service (shared: "
        "public data only, since concurrent runs' transitions reach it in an order timing decides)")
    save_policy: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]+$", description=(
        "policy: shared only: when the study ends, save the shared policy as policy_dir/NAME with its training "
        "record (trials, wall time, the data it saw): pre-training a policy on public data (trials/pretrain.yaml)"))
    policy_dir: str = Field("policies", description="where save_policy writes")
    resources: Resources = Resources()
    private_data: bool = Field(True, description="the data is private: report the tuning-aware epsilon (E7)")
    max_failures: int = Field(2, ge=0, description="Tune retries of a failed trial (resumed from its checkpoint)")
    transfer: TransferSettings | None = None
    storage: str | None = Field(None, description=(
        "where every node reads the dataset and Tune keeps experiments, checkpoints and the trials' run directories: "
        "a pyarrow URI (s3://bucket/prefix, with ?endpoint_override=HOST:PORT&scheme=http for an S3-compatible "
        "store; gs://...) or a directory all nodes mount; default: the study directory on this machine. It holds "
        "the private dataset: it must be the data owner's"))
    wandb: WandbSettings = WandbSettings()
    target_baseline: Literal["best"] = "best"
    evaluate: EvalConfig | None = Field(None, description=(
        "attack and audit trials after they train (raydp.evaluation: membership inference, canary extraction, "
        "exposure, epsilon audit; which trials: attack); the results are for the data owner, never selection (E15)"))
    attack: Literal["released", "all"] = Field("released", description=(
        "with evaluate: which trials are attacked. released: after the trials, the trial the study would release in "
        "each (model, epsilon) cell (raydp.study.results.would_release), and every trial of attack_strategies; all: "
        "every trial as it finishes, to compare the leakage of every arm"))
    attack_strategies: list[str] = Field(default_factory=list, description=(
        "with evaluate and attack: released, strategies whose every trial is attacked too (e.g. nonprivate, the "
        "leakage of a model trained without DP)"))
    selection: Literal["public", "private", "private-dp", "none"] = Field(
        "public", description="the perplexity that picks trials, drives Optuna, steps-to-target and the report: "
                              "on the PUBLIC validation split (default: base.public_validation, the user's public "
                              "records, else raydp's synthetic public population), or on the private eval split, "
                              "which no accountant covers (ERRATA E15; labelled in results and reports); private-dp: "
                              "a DP score on the private validation split, one end-to-end epsilon "
                              "(private_selection); none: the recipe alone, nothing chosen on any split (one DP arm; "
                              "the trial released in each cell is its first seed's)")
    private_selection: PrivateSelectionSettings | None = Field(None, description=(
        "selection: private-dp: the law of the number of trials and the score release (defaults if omitted)"))

    @model_validator(mode="before")
    @classmethod
    def _upgrade(cls, values):
        return upgrade_study_values(values)

    @model_validator(mode="after")
    def _consistent(self):
        unknown = [s for s in self.strategy_settings if s not in STRATEGY_CHOICES]
        if unknown:
            raise ValueError(f"unknown strategy {unknown[0]!r}; known: {', '.join(STRATEGY_CHOICES)}")
        if "settings" in self.base:
            raise ValueError("strategy settings go in strategy_settings: {NAME: {...}}, not base.settings")
        if any(e <= 0 for e in self.epsilons):
            raise ValueError("epsilons must be > 0")
        for key in ("strategy", "epsilon", "seed", "model"):
            if key in self.base:
                raise ValueError(f"base.{key} is set by the study's grid ({key}s); remove it from base")
        self._check_controller()
        if self.attack_strategies and (self.evaluate is None or self.attack != "released"):
            raise ValueError("attack_strategies names arms attacked beside the released trials: it needs evaluate "
                             "and attack: released")
        if self.evaluate is not None and self.attack == "released" and self.selection == "private" \
                and not self.attack_strategies:
            raise ValueError("selection: private marks no trial for release, so attack: released would attack none: "
                             "set attack: all, or name attack_strategies")
        unknown = [s for s in self.attack_strategies if s not in self.strategies]
        if unknown:
            raise ValueError(f"attack_strategies: {unknown[0]!r} is not one of this study's strategies")
        if self.evaluate is not None and self.evaluate.audit and not (self.base.get("data") or {}).get("n_audit"):
            raise ValueError("evaluate.audit needs audit canaries in the data: set base.data.n_audit (e.g. 100) "
                             "or evaluate: {audit: false}")
        if self.selection == "private-dp" or self.search == "random" or self.private_selection is not None:
            self._check_private_selection()
        if self.selection == "none":
            self._check_no_selection()
        if self.search_space:
            self._check_search_space()
        elif self.search == "bandit":
            raise ValueError("search: bandit chooses one strategy's values: give its search_space")
        elif self.search == "optuna":
            if self.controller_strategy is None:
                raise ValueError("search: optuna without a search_space tunes a controller's SAC settings; it needs "
                                 f"{capability_names('controller')} in strategies")
            if len(self.models) * len(self.epsilons) * len(self.seeds) != 1 or self.transfer is not None:
                raise ValueError("search: optuna tunes the SAC settings on one cell: give one model, one "
                                 "epsilon and one seed (and no transfer)")
        if self.search == "pbt" or self.population_strategy is not None:
            self._check_pbt()
        if self.storage is not None and (self.search == "pbt" or self.transfer is not None or self.policy == "shared"):
            raise ValueError("storage: PBT, transfer and shared-policy studies keep state on the driver's machine; run "
                             "them without storage (or with a directory every node mounts as results_dir)")
        if self.transfer is not None:
            controller = self.controller_strategy
            if controller is None:
                raise ValueError("transfer moves a controller's policy: it needs "
                                 f"{capability_names('controller')} in strategies")
            if resolve_values(self.strategy_settings.get(controller)).fixed_pairs:
                raise ValueError("transfer needs the size-agnostic policy "
                                 f"(strategy_settings.{controller}.architecture: shared)")
            if self.policy == "shared":
                raise ValueError("transfer trains one policy per source trial; use policy: per-trial")
            if controller in self.settings_grid:
                raise ValueError("transfer pairs each frozen trial with one source trial: no "
                                 f"settings_grid.{controller}")
        for strategy, grid in self.settings_grid.items():
            spec = get_spec(strategy)
            if strategy not in self.strategies or not spec.private or spec.population:
                raise ValueError(f"settings_grid.{strategy}: not a DP strategy of this study (strategies)")
            if not grid or any(not isinstance(v, list) or not v for v in grid.values()):
                raise ValueError(f"settings_grid.{strategy}: give each setting a non-empty list of values")
            if spec.controller and set(grid) & GRID_FORBIDDEN_RLDP:
                raise ValueError(f"settings_grid.{strategy} cannot vary {sorted(set(grid) & GRID_FORBIDDEN_RLDP)[0]}: "
                                 f"the policy a trial starts from is the study's (strategy_settings.{strategy}), so its "
                                 "provenance is composed")
            if spec.controller and self.policy == "shared":
                raise ValueError(f"settings_grid.{strategy}: one shared policy cannot act under several "
                                 f"{strategy} settings; use policy: per-trial")
            if not spec.controller and set(grid) & set(self.strategy_settings.get(strategy) or {}):
                raise ValueError(f"settings_grid.{strategy} and strategy_settings.{strategy} both set "
                                 f"{sorted(set(grid) & set(self.strategy_settings[strategy]))[0]}")
        if self.save_policy is not None and (self.policy != "shared" or self.controller_strategy is None):
            raise ValueError("save_policy saves a study's shared policy: it needs policy: shared and "
                             f"{capability_names('controller')} in strategies")
        if self.save_policy is not None and (self.strategy_settings.get(self.controller_strategy) or {}).get("frozen"):
            raise ValueError("save_policy saves what a shared policy learned: a frozen policy learns nothing (drop "
                             "frozen or save_policy)")
        source = (self.base.get("data") or {}).get("source", "synthetic")
        if self.save_policy is not None and source != "public":
            # a trial that fails for good has trained the shared policy but left no provenance entry (E14)
            raise ValueError("save_policy pre-trains on public data only: set base.data.source: public")
        if not self.private_data and source != "public":
            raise ValueError("private_data: false is for public data only (base.data.source: public); other data "
                             "is private and the study reports its tuning-aware epsilon (ERRATA E7)")
        if self.policy == "shared" and self.controller_strategy is not None:
            if len(self.sac_grid.b_sac) > 1 or len(self.sac_grid.k) > 1 or self.search == "optuna":
                raise ValueError("a shared policy has one B_SAC and one K (they are the policy service's "
                                 "settings): give single sac_grid.b_sac and sac_grid.k values and search: grid")
            if source != "public":
                # concurrent trials feed one learner in the order their transitions arrive, which timing (so
                # the private batch sizes) decides: their actions would not be post-processing of DP releases
                raise ValueError("policy: shared trains one policy on concurrent trials in an order timing decides: "
                                 "it is for public data only (base.data.source: public); use policy: per-trial")
        return self

    def _check_controller(self) -> None:
        """A study starts its own policies (per trial, or one shared service) and reaches them through the
        broker: a ``controller`` other than ``broker`` (e.g. an RLlink policy server) in ``base`` or in any
        arm's settings would be ignored or fail mid-study, so it is refused here."""
        places = [("base", self.base)] + [(f"{name}.{strategy}", values) for name, arms in
                                          (("strategy_settings", self.strategy_settings),
                                           ("settings_grid", self.settings_grid)) for strategy, values in arms.items()]
        for where, values in places:
            if "controller" in values and values["controller"] != "broker":
                raise ValueError(f"{where}.controller: a study starts its own RLDP policies (controller: broker); "
                                 f"{values['controller']!r} is for one `raydp train` run: remove it")

    def _check_private_selection(self) -> None:
        """What Papernot & Steinke's theorems need (independent draws, one worst-case trial curve, a secret K),
        and what the mode does not release (every trial but the best), as refusals before anything runs."""
        if self.selection != "private-dp" or self.search != "random":
            raise ValueError("private selection is selection: private-dp with search: random (independent draws "
                             "from search_space; the theorems do not cover adaptive samplers) together")
        if len(self.strategies) != 1 or not self.search_space or set(self.search_space) != set(self.strategies):
            raise ValueError("selection: private-dp selects among one strategy's trials: give one strategy and its "
                             "search_space")
        strategy = self.strategies[0]
        spec = get_spec(strategy)
        if not spec.private or spec.controller or spec.population \
                or getattr(strategy_class(strategy), "mechanism", None) == "local":
            raise ValueError(f"selection: private-dp needs a DP-SGD strategy whose privacy is planned before it runs; "
                             f"{strategy!r} is not one")
        if not self.private_data or (self.base.get("data") or {}).get("source") == "public":
            raise ValueError("selection: private-dp selects on private data; on public data select publicly "
                             "(selection: public)")
        fractions = (self.base.get("data") or {}).get("fractions") or {}
        if "validation" in fractions and not fractions["validation"] > 0:
            raise ValueError("selection: private-dp scores the private validation split: base.data.fractions."
                             "validation must be > 0")
        if (self.base.get("task") or {}).get("kind", "lm") != "lm":
            raise ValueError("selection: private-dp scores the value-token NLL of a language-modelling task: "
                             "base.task.kind must be lm")
        for key in ("unsafe_fixed_randomness", "common_random_numbers"):
            if self.base.get(key):
                raise ValueError(f"selection: private-dp needs secret randomness: base.{key} is refused")
        refused = {"tuned_from": self.tuned_from, "settings_grid": self.settings_grid, "transfer": self.transfer,
                   "evaluate": self.evaluate, "storage": self.storage, "save_policy": self.save_policy}
        for key, value in refused.items():
            if value:
                raise ValueError(f"selection: private-dp does not take {key} (it releases the best trial only; "
                                 "attack the released run with raydp eval)" if key == "evaluate" else
                                 f"selection: private-dp does not take {key}")
        if self.wandb.resolved()[0] != "disabled":
            raise ValueError("selection: private-dp releases the best trial only: wandb would log every trial (and "
                             "so how many ran); set wandb: {mode: disabled}")

    def _check_no_selection(self) -> None:
        """``selection: none`` chooses nothing on any split: one DP arm (the recipe's, or the settings the file
        gives), no search and no grid of settings to choose among."""
        dp = [s for s in self.strategies if get_spec(s).private]
        grid = self.sac_grid
        one_cell = not dp or not get_spec(dp[0]).controller or len(grid.t_rl) * len(grid.b_sac) * len(grid.k) == 1
        if len(dp) != 1 or self.search != "grid" or self.search_space or self.settings_grid.get(dp[0]) \
                or not one_cell:
            raise ValueError("selection: none runs one DP arm and chooses nothing: give one DP strategy (beside "
                             "nonprivate, if any) and no search, search_space or settings_grid")

    @property
    def selection_settings(self) -> PrivateSelectionSettings:
        """``private_selection``, or its defaults where the study file omits it."""
        return self.private_selection or PrivateSelectionSettings()

    def _check_search_space(self) -> None:
        if self.search not in SEARCH_SPACE_VALUES:
            raise ValueError("search_space is searched by Optuna (search: optuna), a bandit (search: bandit) or "
                             "drawn independently (search: random, selection: private-dp)")
        if self.search == "bandit":
            if self.private_data or self.selection != "public":
                raise ValueError("search: bandit learns from public episodes only: set private_data: false (and "
                                 "selection: public)")
            if len(self.search_space) != 1 or len(self.models) != 1:
                raise ValueError("search: bandit learns one strategy's values on one model across the epsilons: "
                                 "give one search_space strategy and one model")
        if self.search in ("optuna", "bandit") and len(self.seeds) != 1:
            raise ValueError("a search_space search runs every candidate at the study's one seed (common random "
                             "numbers on public data): give one seed, and run the chosen values on more seeds after")
        for strategy, space in self.search_space.items():
            spec = get_spec(strategy)
            if strategy not in self.strategies or spec.controller or spec.population:
                raise ValueError(f"search_space.{strategy}: not a strategy of this study with settings to search "
                                 "(strategies; a controller's SAC cell is searched without a search_space)")
            if not spec.private and (self.private_data or self.search != "optuna"):
                raise ValueError(f"search_space.{strategy}: a non-private arm's run fields are searched by Optuna on "
                                 "public data only (search: optuna, private_data: false): trained without DP, its "
                                 "choices on private data would be a release no accountant covers")
            if not space:
                raise ValueError(f"search_space.{strategy}: name at least one setting to search")
            model = strategy_class(strategy).settings_model if spec.private else None  # non-private: run fields only
            fields = set(model.model_fields) if model is not None else set()
            for name in space:
                if name not in fields and name not in SEARCHABLE_RUN_FIELDS:
                    raise ValueError(f"search_space.{strategy}.{name}: not a setting of {strategy} "
                                     f"({', '.join(sorted(fields)) or 'none'}) nor a searchable run field "
                                     f"({', '.join(SEARCHABLE_RUN_FIELDS)})")
                if name in PUBLIC_ONLY_SEARCH_FIELDS and self.private_data:
                    raise ValueError(f"search_space.{strategy}.{name} is searched on public data only (private_data: "
                                     "false): it sets each trial's sampling rate and steps, privacy parameters a "
                                     "search would choose from private results")
                if name in PUBLIC_ONLY_SEARCH_FIELDS and space[name].choices is None:
                    raise ValueError(f"search_space.{strategy}.{name}: give its values as choices (a batch size is "
                                     "a whole number)")
                fixed = set(self.strategy_settings.get(strategy) or {}) | set(self.settings_grid.get(strategy) or {})
                if name in fixed:
                    raise ValueError(f"search_space.{strategy}.{name} is also fixed in strategy_settings or "
                                     "settings_grid: give it one place")

    @property
    def controller_strategy(self) -> str | None:
        """The study's strategy whose dials a live policy sets (RLDP), or None."""
        return next(iter(with_capability(self.strategies, "controller")), None)

    @property
    def population_strategy(self) -> str | None:
        """The study's strategy whose members Tune's PBT trains, or None."""
        return next(iter(with_capability(self.strategies, "population")), None)

    def _check_pbt(self) -> None:
        if self.search != "pbt":
            raise ValueError(f"strategy {self.population_strategy!r} trains a population: set search: pbt")
        if self.population_strategy is None:
            names = capability_names("population")
            raise ValueError(f"search: pbt trains a population of {names} members: add {names} to strategies")
        if len(self.models) * len(self.epsilons) * len(self.seeds) != 1 or self.transfer is not None:
            raise ValueError("search: pbt trains one population: give one model, one epsilon and one seed "
                             "(and no transfer)")
        if self.selection != "public":
            raise ValueError("search: pbt selects members on the public validation split (ERRATA E15): "
                             "selection: private is refused")
        if not self.base.get("eval_every"):
            raise ValueError("search: pbt perturbs every pbt.perturbation_interval evaluations: set base.eval_every "
                             "(steps between evaluations)")
        if self.strategy_settings.get(self.population_strategy):
            raise ValueError(f"the {self.population_strategy} members' settings are PBT's: give their ranges in "
                             f"pbt.hyperparam_mutations, not strategy_settings.{self.population_strategy}")


#: the places in a study file that name a file or directory (True: one the study reads, which must exist; False:
#: one that may not exist yet, e.g. a search study still to run, or a directory the study writes); "*" is any key.
#: Model names are not among them: a model name is also a Hub name, and it names the study's trials.
STUDY_PATHS: tuple[tuple[tuple[str, ...], bool], ...] = (
    (("base", "data", "source"), True), (("base", "data", "ids_mapping"), True), (("base", "public_validation"), True),
    (("tuned_from",), False), (("policy_dir",), False), (("storage",), False),
    (("strategy_settings", "*", "policy"), False), (("strategy_settings", "*", "policy_dir"), False))
#: data.source values that name no file
DATA_SOURCE_KEYWORDS = ("synthetic", "public")


def study_relative_path(value: str, study_file: Path) -> Path | None:
    """Where a relative path of a study file is: beside the study file if it is there, else in the working directory
    (absolute, the first that exists); None if in neither."""
    for root in (study_file.parent, Path.cwd()):
        if (root / value).exists():
            return Path(os.path.abspath(root / value))
    return None


def _is_relative_path(value) -> bool:
    return isinstance(value, str) and bool(value) and "://" not in value and value not in DATA_SOURCE_KEYWORDS \
        and not Path(value).expanduser().is_absolute()


def resolve_study_paths(values: dict, study_file: Path) -> dict:
    """``values`` (a study file's mapping) with every relative path of :data:`STUDY_PATHS` made absolute: beside the
    study file first, then in the working directory, so a study runs from any directory. A path the study reads
    that is in neither is a ConfigError naming both places; one that may not exist yet is left as written."""

    def visit(node, keys: tuple[str, ...], where: tuple[str, ...], required: bool):
        if not isinstance(node, dict):
            return node
        key, rest = keys[0], keys[1:]
        names = list(node) if key == "*" else [key] if key in node else []
        if not names:
            return node
        node = dict(node)
        for name in names:
            if rest:
                node[name] = visit(node[name], rest, (*where, str(name)), required)
                continue
            value = node[name]
            if not _is_relative_path(value):
                continue
            found = study_relative_path(value, study_file)
            if found is not None:
                node[name] = str(found)
            elif required:
                field = ".".join((*where, str(name)))
                raise ConfigError(f"{field}: {value} is neither beside the study file "
                                  f"({Path(os.path.abspath(study_file.parent / value))}) nor in the working "
                                  f"directory ({Path(os.path.abspath(value))})")
        return node

    for keys, required in STUDY_PATHS:
        values = visit(values, keys, (), required)
    return values


def load_study(path: str | Path) -> StudyConfig:
    """Read and validate a study file (YAML; ``trials/NAME`` may omit ``.yaml``); its relative paths are taken
    beside it first, then in the working directory (:func:`resolve_study_paths`)."""
    path = Path(path)
    if not path.exists() and path.with_suffix(".yaml").exists():
        path = path.with_suffix(".yaml")
    values = load_yaml_mapping(path, "study")
    try:
        return validate_config(StudyConfig, resolve_study_paths(values, path))
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
