"""A study's preparation on the driver, before Ray starts anything: every trial validated, every distinct privacy
plan calibrated, the study's DP trials charged to their dataset's lifetime budget, and the study directory locked.

:func:`prepare_study` builds the dataset once for all trials and returns the trials to run; an impossible budget
fails here with the trial named. The lifetime charge is made under a random tag of the study run
(:func:`study_lifetime_nonce`, kept in the study's private ``work/``), so a resumed study is not charged twice and a
study run again is. A resumed study must be the study that ran (:func:`check_resumed_study`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import uuid
from dataclasses import replace
from pathlib import Path

from raydp.control.policies import check_policy_privacy
from raydp.data import load_manifest, load_texts, manifest_id, resolve_dataset
from raydp.data.build import is_public_dataset
from raydp.data.public_records import PublicRecords
from raydp.data.tasks import classification_spec
from raydp.errors import ConfigError
from raydp.files import atomic_write, locked
from raydp.model.embedded import ensure_embedded_model, is_embedded_name
from raydp.privacy.lifetime import read_budget
from raydp.recipe import TABLE_FORMAT, TIER_FACTORS, shipped_table
from raydp.runner.local_setup import is_local, plan_local_run
from raydp.runner.privacy_setup import (LifetimeCharge, build_strategy, plan_key, plan_private_run, plan_record,
                                        training_units)
from raydp.runner.privacy_setup import charge_lifetime as charge_lifetime_budget  # prepare_study's flag has the name
from raydp.study.config import StudyConfig, upgrade_study_values
from raydp.study.grid import search_cells, search_trial, trial_config, trial_grid
from raydp.study.routes import study_routes
from raydp.study.selection_route import selection_route
from raydp.study.trial import Trial


def prepare_study(study: StudyConfig, study_dir: Path, progress: bool = True,
                  build_models: bool = False, charge_lifetime: bool = False,
                  lifetime_nonce: str | None = None) -> tuple[str, list[Trial]]:
    """Build the dataset, validate every trial and calibrate every plan; returns (dataset_dir, trials), each DP
    trial with the plan calibrated for it (:attr:`Trial.privacy_plan <raydp.study.trial.Trial.privacy_plan>`), which its run must
    match.
    ``build_models``: also build the embedded models the study uses, once, here (not in every trial). Where
    the dataset has a lifetime budget (:mod:`raydp.privacy.lifetime`), every DP trial's plan is checked against
    it, and with ``charge_lifetime`` charged under ``lifetime_nonce`` (a random tag of this study run, kept in its
    private ``work/``: a resumed study is not charged twice, a study run again is charged again) and each trial's
    name."""
    lifetime_nonce = lifetime_nonce or uuid.uuid4().hex
    names = [t.name for t in trial_grid(study)]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate:  # two trials in one run directory (e.g. a settings_grid value listed twice)
        raise ConfigError(f"two trials would both be named {duplicate}: remove the repeated value")
    # a search_space's corners (every dimension at its low, then its high end) are validated and calibrated too
    corners = [search_trial(cell, {k: d.corners()[i if i < len(d.corners()) else -1]
                                   for k, d in study.search_space[cell.strategy].items()}, f"corner{i}")
               for cell in search_cells(study) for i in (0, 1)]
    probe = trial_config(study, (trial_grid(study) + corners)[0])  # validates base + the first trial before building
    dataset = str(resolve_dataset(probe.data, study_dir / "dataset", progress=progress))
    needs_public = not study.private_data or study.save_policy is not None or \
        (study.policy == "shared" and study.controller_strategy is not None)
    if needs_public:  # what the study file declares public must BE the public population, not a leftover or a relabel
        if not is_public_dataset(dataset):
            raise ConfigError(f"the study declares its data public (private_data: false, a shared policy or "
                              f"save_policy), but {dataset} is not raydp's public population")
    manifest = load_manifest(dataset)
    if probe.public_validation:  # the user's public records: apart from the private ones, before anything is charged
        PublicRecords.of(probe.public_validation, manifest).check_apart(Path(dataset), manifest)
    route = selection_route(study, probe.public_validation, manifest)  # refuses public selection it cannot serve
    if route and progress:
        print(f"raydp: {route}", flush=True)
    n_train = len(load_texts(dataset, "train"))
    dataset_id = manifest_id(manifest)  # each DP trial's plan names the dataset it is charged on
    trials, plans, trial_plans, trial_units = [], {}, {}, {}
    for trial in trial_grid(study) + corners:
        config = trial_config(study, trial, dataset)
        if config.is_controlled and config.strategy_settings().policy and not trial.frozen_from:
            try:  # a paper-mode policy may not drive a strict trial (ERRATA E14): fail before Ray starts
                # resolved here, where the user's relative paths mean what they wrote; the trial gets it absolute
                trial = replace(trial, policy_path=str(check_policy_privacy(config)))
            except ConfigError as exc:
                raise ConfigError(f"trial {trial.name}: {exc}") from None
        if config.is_private:
            strategy = build_strategy(config)
            key = plan_key(config, strategy)
            if key not in plans:
                try:
                    units = training_units(config, dataset, n_train)  # patients by default (E11)
                    trial_units[key] = units  # the key holds the privacy unit: one per plan
                    if is_local(strategy):  # forward-pass local DP: its own plan (ERRATA E8)
                        plans[key] = plan_local_run(config, strategy, units,
                                                    classification_spec(config.task.label).n_classes)
                    else:
                        plans[key] = plan_private_run(config, units.public_count, strategy)
                except ConfigError as exc:
                    raise ConfigError(f"trial {trial.name}: {exc}") from None
        if not trial.search:  # a corner is only checked: Optuna's trials are named when they run
            # a DP trial carries the plan charged for it: its run refuses any other (raydp.runner.run.run_training)
            trials.append(replace(trial, privacy_plan=plan_record(plans[key], config, trial_units[key], dataset_id))
                          if config.is_private else trial)
            if config.is_private:
                trial_plans[f"study:{lifetime_nonce}/{trial.name}"] = LifetimeCharge.of(
                    plans[key], config, strategy, trial_units[key].name)
    _charge_lifetime(study, dataset, trial_plans, commit=charge_lifetime)
    if build_models:
        build_study_models(trials, progress)
    return dataset, trials


def _charge_lifetime(study: StudyConfig, dataset: str, trial_plans: dict, commit: bool) -> None:
    """The study's DP trials against its dataset's lifetime budget, if the owner set one: all of them in one
    charge, on this machine, before any starts. Optuna's and PBT's trials are not planned before they run:
    refused there. Without a budget the grid's trials are recorded (:func:`raydp.privacy.lifetime.record_spend`);
    searched trials are planned only when they run, and are not."""
    manifest = load_manifest(dataset)
    dataset_id = manifest_id(manifest)
    if read_budget(dataset_id, manifest.get("source_sha256")) is None and not manifest.get("lifetime_budget"):
        charge_lifetime_budget(manifest, trial_plans, commit=commit)  # no budget: records what the trials spend
        return
    if not all(route.planned_before_run for route in study_routes(study)):
        raise ConfigError(f"dataset {dataset_id} has a lifetime budget: a study on it must be a grid "
                          f"(search: {study.search} trials are not planned before they run, so they cannot be "
                          f"charged first)")
    charge_lifetime_budget(manifest, trial_plans, commit=commit)


#: where a study run keeps the tag its trials were charged to a lifetime budget under (private: work/)
LIFETIME_NONCE = Path("work") / "lifetime-nonce"


def study_lifetime_nonce(study_dir: Path, resume: bool) -> str:
    """A resumed study's tag, or a fresh study's new one. The tag is kept with the directory it was drawn for: a
    resume reads it back only in that same directory, so a copy of a study directory (or a tag pasted into
    another) resumed elsewhere runs its trials again and is charged again; so is a moved one, or one whose tag
    file is missing (conservative: charged twice rather than not at all)."""
    path = Path(study_dir) / LIFETIME_NONCE
    if resume and path.is_file():
        lines = path.read_text().splitlines()
        if len(lines) == 2 and lines[1] == str(Path(study_dir).resolve()):
            return lines[0].strip()
    return uuid.uuid4().hex


def write_lifetime_nonce(study_dir: Path, nonce: str) -> None:
    """Keep the study run's tag, and the directory it belongs to, in the study's private ``work/``."""
    path = Path(study_dir) / LIFETIME_NONCE
    text = f"{nonce}\n{Path(study_dir).resolve()}\n"
    if not path.is_file() or path.read_text() != text:  # a resume leaves it as it was
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, text)


def lock_study_dir(study_dir: Path) -> contextlib.ExitStack:
    """An exclusive lock on the study directory for this driver's lifetime (:func:`raydp.files.locked` on
    ``work/driver.lock``, held until the returned stack is closed, or the process ends). Two drivers in one directory
    would both run its unfinished trials, with fresh noise, under one lifetime charge; the second is refused."""
    held = contextlib.ExitStack()
    try:
        held.enter_context(locked(Path(study_dir) / "work" / "driver.lock", blocking=False))
    except BlockingIOError:
        raise ConfigError(f"another raydp study is running in {study_dir}: wait for it, or stop it first") from None
    return held


#: study-file fields a resume may change: none of them changes what a trial runs or spends
RESUMABLE_CHANGES = ("description", "resources", "wandb", "max_failures")
#: study.json's record of the recipe table version whose entries filled the trials' unset settings (``recipe: auto``)
RECIPE_TABLE_KEY = "recipe_table"


def recipe_table_id() -> str:
    """The shipped recipe table's version and a digest of its entries and of the compute tiers' factors (an edit that
    kept the version shows too, and so does a changed tier)."""
    table = shipped_table()
    entries = json.dumps({**table.model_dump(mode="json"), "tier_factors": TIER_FACTORS}, sort_keys=True).encode()
    return f"{table.version} sha256:{hashlib.sha256(entries).hexdigest()[:16]}"


def study_record(study: StudyConfig) -> str:
    """study.json: the study's values, and under ``recipe: auto`` the recipe table its trials take their unset
    settings from (:func:`recipe_table_id`; :func:`check_resumed_study` refuses a resume under another table)."""
    values = study.model_dump(mode="json")
    if (study.base or {}).get("recipe", "auto") == "auto":
        values[RECIPE_TABLE_KEY] = recipe_table_id()
    return json.dumps(values, indent=2)


def _trials_tables(study_dir: Path) -> set[str]:
    """The recipe tables the trials of a study directory recorded taking settings from (``recipe_applied.table``)."""
    tables = set()
    for config in Path(study_dir).glob("trials/*/config.json"):
        try:
            applied = json.loads(config.read_text()).get("recipe_applied")
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(applied, dict) and applied.get("table"):
            tables.add(str(applied["table"]))
    return tables


def check_recipe_table(saved: dict, study: StudyConfig, study_dir: Path) -> None:
    """A study that ran under ``recipe: auto`` resumes only under the recipe table it started with. A study.json
    from before the table was recorded is accepted when every trial that took a recipe named this table's version
    (the digest was not recorded then)."""
    recorded = saved.pop(RECIPE_TABLE_KEY, None)
    if (saved.get("base") or {}).get("recipe", "auto") != "auto" or (study.base or {}).get("recipe", "auto") != "auto":
        return  # not a recipe: auto study (a changed base.recipe is the study file's change, said as one)
    now = recipe_table_id()
    if recorded == now:
        return
    if recorded is None:
        tables = _trials_tables(study_dir)
        if tables <= {f"{TABLE_FORMAT} {shipped_table().version}"}:
            return
    ran = f"the recipe table {recorded}" if recorded else "a recipe table it did not record"
    raise ConfigError(f"{study_dir} ran under {ran}, and this raydp ships {now}: resumed, its trials would take "
                      "other settings; resume it with the raydp it started with, or run it again into another "
                      "--results-dir")


def attack_rule_of(saved: dict) -> dict:
    """A saved study.json's ``attack`` and ``attack_strategies``: a study that ran before they existed attacked
    every trial as it finished (``attack: all`` where it had ``evaluate:``)."""
    if "attack" in saved:
        return {"attack": saved["attack"], "attack_strategies": saved.get("attack_strategies") or []}
    return {"attack": "all" if saved.get("evaluate") is not None else "released", "attack_strategies": []}


def resumed_attack_rule(study: StudyConfig, study_dir: Path, resume: bool) -> StudyConfig:
    """A resumed study whose file does not name ``attack`` attacks as it started (a study started before the
    setting attacked every trial), so its finished and its remaining trials are attacked alike."""
    saved_path = Path(study_dir) / "study.json"
    if not resume or "attack" in study.model_fields_set or not saved_path.is_file():
        return study
    return study.model_copy(update=attack_rule_of(json.loads(saved_path.read_text())))


def check_resumed_study(study: StudyConfig, study_dir: Path) -> None:
    """A resumed study must be the study that ran: its trials were charged (and Tune restores them) under their
    names, so a plan changed under the same names would run trials that no charge covers."""
    saved_path = Path(study_dir) / "study.json"
    if not saved_path.is_file():
        raise ConfigError(f"{study_dir} has no study.json: it cannot be resumed (nothing says which study ran there)")
    saved = upgrade_study_values(json.loads(saved_path.read_text()))  # an older study.json may carry base.rldp
    saved = {**saved, **attack_rule_of(saved)}  # a study.json from before `attack`: it attacked every trial
    check_recipe_table(saved, study, study_dir)
    now = json.loads(json.dumps(study.model_dump(mode="json")))
    changed = sorted(k for k in set(saved) | set(now) if k not in RESUMABLE_CHANGES and saved.get(k) != now.get(k))
    if changed:
        raise ConfigError(f"the study file changed since {study_dir} ran ({', '.join(changed)}): resume it with the "
                          "file it ran with, or run the changed study into another --results-dir")


def build_study_models(trials: list[Trial], progress: bool) -> None:
    """Build the embedded models the study's trials use, once, here (not in every trial)."""
    for model in dict.fromkeys(t.model for t in trials):
        if is_embedded_name(model):
            ensure_embedded_model(model, progress=progress)
