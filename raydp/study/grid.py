"""A study's trials, planned from its study file: the grid, transfer stages, PBT members, Optuna's SAC cell and the
search cells (:class:`~raydp.study.trial.Trial`), the values a ``tuned_from`` search chose, and each trial's
validated :class:`~raydp.config.TrainConfig` (:func:`trial_config`).

A study is the cartesian product models x epsilons x seeds x strategies, where each controller entry is further
expanded over the SAC grid T_RL x B_SAC x K (RLDP Sec. 3.2) and each ``settings_grid`` entry over its values
(:func:`trial_grid`). The study file itself (its models and their validation) is :mod:`raydp.study.config`.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from raydp.config import TrainConfig, validate_config
from raydp.errors import ConfigError
from raydp.strategies.registry import get_spec
from raydp.study.trial import Trial

if TYPE_CHECKING:
    from raydp.study.config import MutationRange, StudyConfig

#: TrainConfig fields a search_space may vary beside a strategy's settings (public choices of the run; the epochs
#: are not among them: a compute tier fixes them)
SEARCHABLE_RUN_FIELDS = ("lr", "lr_decay", "lr_end", "warmup_steps", "weight_decay", "rescale_moments", "batch_size")
#: searchable on public data only (as choices): the expected batch sets the sampling rate and the steps, so each trial's
#: privacy parameters, and a search picks a trial's values from earlier trials' results. On private data that would
#: choose privacy parameters adaptively, which the study's composition of per-trial curves does not cover (it would
#: need a privacy filter: Feldman & Zrnic, NeurIPS 2021). A settings_grid fixes them in advance: each grid trial is
#: planned from its own config, and the composition covers it.
PUBLIC_ONLY_SEARCH_FIELDS = ("batch_size",)


def optuna_trial(study: StudyConfig, t_rl: int, b_sac: int, k: int, trial_id: str) -> Trial:
    """An Optuna-sampled RLDP trial on the study's single (model, epsilon, seed) cell."""
    return Trial.plan(study, model=study.models[0], epsilon=study.epsilons[0], seed=study.seeds[0],
                      strategy=study.controller_strategy, t_rl=int(t_rl), b_sac=int(b_sac), k=int(k),
                      optuna_id=trial_id)


def trial_grid(study: StudyConfig) -> list[Trial]:
    """The grid's trials (rldp expanded over the SAC grid); with ``transfer``, the source-model RLDP trials
    (``stage: source``) come first and every RLDP trial gets a frozen twin that reuses its source trial's
    policy."""
    trials = _grid(study, study.models)
    if study.search_space:  # the searched strategies' trials are Optuna's (search_cells); the rest stay a grid
        return [t for t in trials if t.strategy not in study.search_space]
    controller = study.controller_strategy
    if study.search == "optuna":  # the SAC cells are Optuna's to choose; the baselines stay a grid
        return [t for t in trials if t.strategy != controller]
    if study.search == "pbt":  # the population's members (stage "pbt", run by PBT); the baselines stay a grid
        population = study.population_strategy
        return [m for t in trials for m in (pbt_members(study, t) if t.strategy == population else [t])]
    if study.transfer is None:
        return trials
    sources = [t.derive(stage="source") for t in _grid(study, [study.transfer.source_model])
               if t.strategy == controller]
    frozen = []
    for t in trials:
        if t.strategy == controller:
            source = next(s for s in sources if (s.epsilon, s.seed, s.t_rl, s.b_sac, s.k) == (t.epsilon, t.seed,
                                                                                                t.t_rl, t.b_sac, t.k))
            frozen.append(t.derive(frozen_from=source.source_key, frozen=True))
    return sources + trials + frozen


def pbt_members(study: StudyConfig, trial: Trial) -> list[Trial]:
    """The PBT population of a ``pbt`` grid cell: ``members`` trials (``stage: pbt``, ``member: i``), each
    with its initial settings drawn from the mutation ranges (seeded by ``pbt.seed``: public choices)."""
    rng = np.random.default_rng(study.pbt.seed)
    ranges = study.pbt.hyperparam_mutations
    members = []
    for i in range(study.pbt.members):
        settings = {name: float(f"{draw_in_range(getattr(ranges, name), rng):.6g}") for name in ("clip", "sigma_scale")}
        members.append(trial.derive(stage="pbt", member=i, settings=settings))
    return members


def draw_in_range(bounds: MutationRange, rng) -> float:
    """A draw from ``bounds`` (log-uniform when ``bounds.log``)."""
    if bounds.log:
        return float(math.exp(rng.uniform(math.log(bounds.low), math.log(bounds.high))))
    return float(rng.uniform(bounds.low, bounds.high))


TUNING_RECORD = "tuning_record.json"
TUNING_FORMAT = "raydp-tuning-v1"


def tuning_record(root: Path) -> dict:
    """A finished public search's record: its ``tuning_record.json`` (a directory, or the file itself, e.g. one
    committed under ``trials/tuned/``), else what its study directory holds (study.json, study_summary.json and
    results.parquet's dataset ids)."""
    file = root if root.is_file() else root / TUNING_RECORD
    if file.is_file():
        try:
            record = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError):
            raise ConfigError(f"tuned_from: {file} is not a readable tuning record") from None
        if record.get("format") != TUNING_FORMAT:
            raise ConfigError(f"tuned_from: {file} is not a tuning record ({TUNING_FORMAT})")
        return record
    try:
        searched = json.loads((root / "study.json").read_text())
        summary = json.loads((root / "study_summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        raise ConfigError(f"tuned_from: {root} is not a finished study (no readable study.json and "
                          "study_summary.json)") from None
    try:
        ids = sorted(set(pd.read_parquet(root / "results.parquet", columns=["dataset_id"])["dataset_id"].dropna()))
    except (OSError, KeyError, ValueError):
        ids = []
    return {"format": TUNING_FORMAT, "study": searched.get("name"), "private_data": searched.get("private_data", True),
            "data_source": ((searched.get("base") or {}).get("data") or {}).get("source"), "dataset_ids": ids,
            "search_best": summary.get("search_best") or []}


def tuned_values(study: StudyConfig) -> dict[tuple[str, str, float | None], dict]:
    """The ``tuned_from`` search's best values per (strategy, model, epsilon; None for a non-private strategy):
    ConfigError when the search is
    missing, unfinished, or did not run on public data (its choices would then be a release of the private
    data that this study does not account for, ERRATA E7)."""
    if study.tuned_from is None:
        return {}
    record = tuning_record(Path(study.tuned_from).expanduser())
    name = record.get("study")
    if record.get("private_data", True) or record.get("data_source") != "public":
        raise ConfigError(f"tuned_from: study {name!r} did not run on public data (base.data.source: "
                          "public, private_data: false): its choices are not free to reuse")
    ids = record.get("dataset_ids") or []
    if not ids or any(not str(i).startswith("public:") for i in ids):
        raise ConfigError(f"tuned_from: study {name!r} did not run on public data (its results name "
                          "datasets that are not public:...): its choices are not free to reuse")
    best = {(b["strategy"], b["model"], None if b["epsilon"] is None else float(b["epsilon"])): dict(b["best"])
            for b in record.get("search_best") or []}
    if not best:
        raise ConfigError(f"tuned_from: study {name!r} has no finished search (search_best)")
    searched_strategies = {k[0] for k in best}
    for strategy in set(study.strategies) & searched_strategies:
        for model in study.models:
            for eps in (study.epsilons if get_spec(strategy).private else [None]):
                if (strategy, model, None if eps is None else float(eps)) not in best:
                    raise ConfigError(f"tuned_from: study {name!r} searched {strategy} but not on {model}"
                                      + ("" if eps is None else f" at epsilon {eps:g}"))
    return best


def search_cells(study: StudyConfig) -> list[Trial]:
    """One Optuna search per (searched strategy, model, epsilon) at the study's seed: the cell's fixed fields (a
    non-private strategy: one per model, without an epsilon)."""
    return [Trial.plan(study, model=model, epsilon=eps if get_spec(strategy).private else None, seed=study.seeds[0],
                       strategy=strategy)
            for strategy in study.search_space for model in study.models
            for eps in (study.epsilons if get_spec(strategy).private else [None])]


def search_trial(cell: Trial, values: dict, trial_id: str) -> Trial:
    """An Optuna-sampled trial of a search cell: the cell and the sampled ``values`` (``search``)."""
    return cell.derive(search=dict(values), optuna_id=trial_id)


def _grid(study: StudyConfig, models: list[str]) -> list[Trial]:
    tuned = tuned_values(study)
    trials = []
    for model, eps, seed, strategy in itertools.product(models, study.epsilons, study.seeds, study.strategies):
        spec = get_spec(strategy)
        if not spec.private:
            if (model, seed) in {(t.model, t.seed) for t in trials if t.strategy == strategy}:
                continue  # no epsilon: one non-private trial per model and seed
            trials.append(Trial.plan(study, model=model, epsilon=None, seed=seed, strategy=strategy,
                                     tuned=tuned.get((strategy, model, None))))  # tuned_from's best values
            continue
        sac = itertools.product(study.sac_grid.t_rl, study.sac_grid.b_sac, study.sac_grid.k) if spec.controller \
            else [(None, None, None)]
        grid = study.settings_grid.get(strategy) or {}
        variants = [dict(zip(grid, values)) for values in itertools.product(*grid.values())] if grid else [None]
        for (t_rl, b_sac, k), variant in itertools.product(sac, variants):
            trials.append(Trial.plan(study, model=model, epsilon=eps, seed=seed, strategy=strategy, t_rl=t_rl,
                                     b_sac=b_sac, k=k,
                                     grid=variant,  # this trial's settings from settings_grid
                                     tuned=tuned.get((strategy, model, float(eps)))))  # tuned_from's best values
    return trials


def trial_config(study: StudyConfig, trial: Trial, dataset_dir: str | None = None,
                 policy_path: str | None = None) -> TrainConfig:
    """The full, validated TrainConfig of one trial (``policy_path``: the saved policy a frozen
    transfer trial reuses)."""
    values = {k: v for k, v in study.base.items()}
    values.update({"model": trial.model, "strategy": trial.strategy, "seed": trial.seed,
                   "cpus": study.resources.cpus_per_trial})
    if trial.epsilon is not None:
        values["epsilon"] = trial.epsilon
    if dataset_dir is not None:
        values["data"] = {**values.get("data", {}), "source": dataset_dir}
    if study.strategy_settings.get(trial.strategy):
        values["settings"] = dict(study.strategy_settings[trial.strategy])
    if trial.settings:  # a PBT member's current (clip, sigma_scale)
        values["settings"] = {**values.get("settings", {}), **trial.settings}
    spec = get_spec(trial.strategy)
    for chosen in (trial.grid, trial.tuned, trial.search):  # settings_grid; tuned_from's best; Optuna's values
        if chosen:  # run fields, then the strategy's settings
            run = {k: v for k, v in chosen.items() if k in SEARCHABLE_RUN_FIELDS}
            values.update(run)
            settings = {k: v for k, v in chosen.items() if k not in run}
            if settings:
                values["settings"] = {**values.get("settings", {}), **settings}
    if spec.controller:  # the trial's SAC cell and the policy it starts from
        settings = dict(values.get("settings") or {})
        settings.update({k: v for k, v in (("t_rl", trial.t_rl), ("b_sac", trial.b_sac), ("k", trial.k)) if v is not None})
        if trial.frozen_from:
            settings.update({"policy": policy_path or "(source policy, saved in stage 1)", "frozen": True})
        elif policy_path:  # the study's settings.policy, resolved to an absolute path by the driver
            settings["policy"] = policy_path
        values["settings"] = settings
    where = ", ".join(f"{k}={v}" for k, v in trial.to_dict().items()
                      if v is not None and k not in ("frozen_from", "frozen", "optuna_id", "settings", "stage", "grid",
                                                     "policy_path", "search", "tuned", "name", "privacy_plan"))
    try:
        return validate_config(TrainConfig, values)
    except ConfigError as exc:
        raise ConfigError(f"trial ({where}): {exc}") from None
