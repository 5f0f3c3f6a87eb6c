"""``raydp study trials/NAME``: a study on Ray Tune (``tune.Tuner``), one trial per fine-tuning run.

Before Ray starts anything, the study file is validated, the dataset is built once for all trials
(every trial reads the same built dataset directory), every trial's config is validated and every
distinct privacy plan is calibrated, so an impossible budget fails with the trial named.

Each trial is a Tune function trainable: the trial's actor IS the run (it owns the training loop) and
its resources are a ``tune.PlacementGroupFactory`` bundle ({CPU: cpus_per_trial, GPU: gpus_per_trial});
its torch threads equal its CPUs. An RLDP trial either starts its own policy (broker and SAC service,
zero-CPU actors that fit its placement group) or connects to the study's shared policy. Every evaluation
reaches Tune only with its checkpoint (the training loop checkpoints an evaluation step before it calls
``on_evaluation``), so a reported perplexity always has the ledger that produced it; ``on_evaluation``
logs numbers to wandb. Reports carry ``eval_perplexity`` and ``eval_value_nll`` (the PRIVATE eval split: not a
DP release, ERRATA E15), ``public_perplexity`` and ``public_value_nll`` (the public validation split) and
``selection_score``, the one the study selects on (the value-token NLL where the run reports it; ``selection``:
public by default; Optuna's and PBT's metric); the final report carries the
trial's results and ``privacy_label`` (every label of its epsilon, '; '-joined; E3/E12).

Outputs under ``<results_dir>/<study name>/``: ``dataset/``, ``trials/<trial>/`` (each run's outputs:
metrics, ledger, controller traces, adapters), ``tune/`` (Tune's experiment state, for
``Tuner.restore``), ``results.parquet`` (:mod:`raydp.study.results`) and ``study_summary.json``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

from raydp.control.policies import check_policy_privacy, trained_on
from raydp.control.store import add_totals, training_totals
from raydp.control.store import load_manifest as load_policy_manifest
from raydp.data import load_manifest, manifest_id
from raydp.errors import ConfigError
from raydp.files import atomic_write, owner_only, private_dir
from raydp.run_directory import RunDirectory
from raydp.study.attack_phase import attack_released
from raydp.study.config import StudyConfig, load_study
from raydp.study.grid import TUNING_FORMAT, TUNING_RECORD, trial_config, trial_grid
from raydp.study.params import TrialParams
from raydp.study.prepare import (build_study_models, check_resumed_study, lock_study_dir, prepare_study,
                                 resumed_attack_rule, study_lifetime_nonce, study_record,
                                 write_lifetime_nonce)
from raydp.study.private_selection import SECRET_STATE, run_private_selection
from raydp.study.results import collect_results
from raydp.study.routes import FitContext, experiment_names, study_routes
from raydp.study.searches import TuneStorage, fetch_trial_outputs, upload_dataset
from raydp.study.trainable import run_trial, wandb_target


STUDY_PRIVACY_NOTE = """What in this study directory is private (ERRATA E11-E15):
- dataset/  the private splits: never release.
- work/     per-trial scratch, including restored checkpoints: keep private.
- tune/     Tune's state and checkpoints (adapter weights, optimizer moments, ledger: post-processing of DP
            releases, but paper-mode trials' controller state holds unprivatized statistics) and Tune's
            automatic timings, which depend on the private batch sizes: keep private.
- trials/<trial>/evaluation.json, the attack and audit columns of results.parquet (mia_*, canary_*,
            exposure_*, audit_*) and report.html's attack and audit sections: computed from private records
            (`evaluate:`), not a DP release: for the data owner, keep private.
- trials/<non-private trial>/ (strategy nonprivate): trained without DP on the private records; nothing in it is
            protected: keep private.
- wandb/    wandb's local run files (metrics, timings, system information): keep private.
Releasable: the rest of results.parquet, study_summary.json and trials/<trial>/ except trials/<trial>/private/
and evaluation.json. In them the private-eval perplexities (no accountant covers them, E15) and every timing
(wall_seconds, trial_seconds, a saved policy's creation time...; they depend on the private batch sizes) are
unprotected; the number of patients
in train and q = B/N are released as public (the summary's public_counts and epsilon_replace_one say what covers
them); the dataset is named by its owner-keyed dataset_id, which nobody without the owner's key can compute.
No file here holds a sampling or noise seed or generator state, or a plain hash of the records.
"""



@owner_only
def run_study(path: str | Path, results_dir: str | Path = "runs/studies", progress: bool = True,
              resume: bool = False) -> Path:
    """Run (or, with ``resume``, restore and finish) a study; returns its directory. The study directory is locked
    while this runs (:func:`lock_study_dir`). Everything it writes is owner-only (:mod:`raydp.files`): the study
    folder, its dataset, Tune's storage, the trials and what Ray keeps of them."""
    held: list = []
    try:
        return _run_study(path, results_dir, progress, resume, held)
    finally:
        for handle in held:
            handle.close()


def _run_study(path: str | Path, results_dir: str | Path, progress: bool, resume: bool, held: list) -> Path:
    import ray  # lazy: `raydp study --check` loads no Ray
    from ray import tune  # lazy: as above

    # lazy: imports Ray, which `raydp study --check` does not load
    from raydp.runner.launch import RAY_NAMESPACE, ensure_ray, remove_tune_staging

    study = load_study(path)
    # Tune warns at every forced experiment snapshot that CheckpointConfig(num_to_keep) triggers (each of our
    # evaluations checkpoints): noise in a study's log, not a problem at this scale
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    routes = study_routes(study)  # raydp.study.routes: the grid, then the route the study's search names
    refused = next((route.refuses_resume for route in routes if route.refuses_resume), None)
    if resume and refused:  # e.g. PBT: the population filter's spent curve lives in the study's actor only
        raise ConfigError(refused)
    study_dir = (Path(results_dir) / study.name).resolve()
    whole = next((route for route in routes if route.runs_study), None)
    if whole is not None:  # a route that runs the whole study itself (private selection)
        return whole.run_study(study, study_dir, progress, resume, held)
    trials_dir = study_dir / "trials"
    storage = TuneStorage.for_study(study, study_dir)
    if resume and not any(storage.can_restore(name) for name in experiment_names(study)):
        # A fresh Tuner here would overwrite the trials already run, and their spend on the same private data
        # would drop out of the tuning-aware epsilon (ERRATA E7/E14).
        raise ConfigError(f"nothing to resume in {study_dir}: it has no Tune state (tune/{study.name}); --resume "
                          "finishes a stopped study and never starts one over its trials: run without --resume into "
                          "another --results-dir")
    if not resume and trials_dir.is_dir() and any(trials_dir.iterdir()):
        # A second fit here would overwrite the first one's trials, and its spend on the same private
        # data would drop out of the tuning-aware epsilon (ERRATA E7/E14).
        raise ConfigError(f"study directory {study_dir} already holds trials: finish it with --resume, or run "
                          "into another --results-dir (removing it forgets what its runs spent)")
    # absolute: RLlib's checkpointing reads a relative path as a URI, and the service actor's cwd is not ours
    saved_policy = Path(study.policy_dir).expanduser().resolve() / study.save_policy if study.save_policy else None
    if saved_policy is not None and saved_policy.exists():
        raise ConfigError(f"policy {saved_policy} already exists: remove it or set another save_policy")
    # Validate everything before anything stays on disk: a study directory that did not exist is removed again
    # when preparing fails (a bad trial, an unreachable budget, too many CPUs per trial)
    study = resumed_attack_rule(study_recipe(study, study_dir, resume), study_dir, resume)
    if resume:
        check_resumed_study(study, study_dir)
    created = not study_dir.exists()
    try:
        private_dir(study_dir)
        held.append(lock_study_dir(study_dir))  # released by run_study when this returns or fails
        nonce = study_lifetime_nonce(study_dir, resume)
        dataset, trials = prepare_study(study, study_dir, progress=progress, charge_lifetime=True,
                                        lifetime_nonce=nonce)
        ensure_ray(private=study.private_data)
        cpus, gpus = study.resources.cpus_per_trial, study.resources.gpus_per_trial
        if cpus > ray.cluster_resources().get("CPU", 0):
            raise ConfigError(f"resources.cpus_per_trial={cpus} exceeds the cluster's "
                              f"{int(ray.cluster_resources().get('CPU', 0))} CPUs: no trial could ever start")
        build_study_models(trials, progress)
    except BaseException:
        if created and held:  # only the driver that holds the lock removes what it created
            shutil.rmtree(study_dir, ignore_errors=True)
        raise
    atomic_write(study_dir / "PRIVACY.txt", STUDY_PRIVACY_NOTE)
    atomic_write(study_dir / "study.json", study_record(study))
    write_lifetime_nonce(study_dir, nonce)  # a resume here is not charged twice (private: work/)
    session = None
    shared = TrialParams(study=study, dataset=dataset, study_dir=str(study_dir), wandb=wandb_target(study, study_dir),
                         log_checkpoints=sys.stderr.isatty(),
                         n_trials=len(trials),  # audits in the family: each trial's audit is Bonferroni-corrected
                         lifetime_nonce=nonce)  # the tag of the trials' lifetime charge (their receipt's label)
    if study.policy == "shared" and study.controller_strategy is not None:
        from raydp.control.service import start_policy_session  # lazy: imports Ray (`raydp study --check` does not)

        # the controller settings' `policy` is where the shared policy starts (continued, its provenance inherited)
        first = next(t for t in trials if t.strategy == study.controller_strategy)
        session = start_policy_session(trial_config(study, first, dataset, first.policy_path), RAY_NAMESPACE)
        shared = replace(shared, connection=session.connection())
    bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    trainable = tune.with_resources(run_trial, tune.PlacementGroupFactory([bundle]))
    if study.storage is not None:  # every node reads the dataset from the study's storage (study_storage_dataset)
        shared = replace(shared, storage=study.storage, dataset_remote=upload_dataset(study, dataset))
    common = shared.to_tune()  # what every trial's Tune config holds; each route adds its trials' own keys
    started, fit_started = time.perf_counter(), time.time()
    # a frozen transfer trial starts from its stage-1 trial's policy
    sources = {t.source_key: str(RunDirectory(study_dir / "trials" / t.name).policy) for t in trials
               if t.stage == "source"}
    trials = [replace(t, policy_path=sources[t.frozen_from]) if t.frozen_from else t for t in trials]
    context = FitContext(trainable, study, trials, common, storage, progress, resume)
    grids, stopped = [], 0
    try:
        for route in routes:
            outcome = route.fit(context)
            grids.extend(outcome.grids)
            stopped = outcome.stopped
            if stopped:  # Ctrl-C: Tune saved this route's state and returned; the next routes wait for --resume
                break
        shared_counters = session.counters() if session is not None else None
        if saved_policy is not None:
            _save_study_policy(session, saved_policy, study, dataset, [r for g in grids for r in g],
                               time.perf_counter() - started, shared_counters)
    finally:
        if session is not None:
            session.close()
        for name in experiment_names(study):  # Tune's copy in Ray's temporary folder (the study keeps its own)
            remove_tune_staging(name)
    wall = time.perf_counter() - started
    results = [r for g in grids for r in g]
    if study.storage is not None:  # the trials' run directories come back from the storage they were saved to
        fetch_trial_outputs(results, trials_dir)
    table = collect_results(study, study_dir, trials, results, dataset_dir=dataset)
    attacked = None
    if study.evaluate is not None and study.attack == "released" and not stopped:  # after the trials, on the driver
        chosen, errors = attack_released(study, study_dir, table, progress)
        if chosen:  # read again: the attacked trials' evaluation.json (and any failure) join their rows
            table = collect_results(study, study_dir, trials, results, dataset_dir=dataset, evaluation_errors=errors)
        attacked = {"rule": "released", "strategies": list(study.attack_strategies), "trials": chosen}
    elif study.evaluate is not None:
        attacked = {"rule": "all", "trials": [t for t in table["trial"]] if "trial" in table else []}
    summary = {"study": study.name, "trials": len(trials), "wall_seconds": round(wall, 1),
               "results": str(study_dir / "results.parquet"), **_overheads(results, fit_started)}
    summary.update(table.attrs if hasattr(table, "attrs") else {})
    for route in routes:
        if route.search_best:  # e.g. the bandit: each cell's values are its decision, not its best episode
            selection = summary["selection"]
            summary["search_best"] = route.best(study, table, selection["split"], selection["metric"], study_dir)
        summary.update(route.summary_for(study_dir))  # e.g. PBT: the population's epsilon
    if shared_counters is not None:
        summary["shared_policy"] = shared_counters
    if attacked is not None:
        summary["attacked"] = attacked
    unfinished = int(table["status"].isin(("INTERRUPTED", "NOT_RUN")).sum()) if "status" in table else 0
    unfinished = max(unfinished, stopped)  # a stopped search cell's trials not yet sampled are in no table
    if summary.get("search_best") and not study.private_data and not unfinished:  # a finished public search's record
        ids = sorted(set(table["dataset_id"].dropna())) if "dataset_id" in table else []
        atomic_write(study_dir / TUNING_RECORD, json.dumps({
            "format": TUNING_FORMAT, "study": study.name, "private_data": False, "data_source": "public",
            "dataset_ids": ids, "search_best": summary["search_best"],
            "note": "the best values of each search cell, chosen on public episodes (raydp study ... tuned_from)"},
            indent=2) + "\n")
    if unfinished:  # stopped (Ctrl-C: Tune saved its state and returned): finished trials are in the results
        summary["unfinished_trials"] = unfinished
    atomic_write(study_dir / "study_summary.json", json.dumps(summary, indent=2, default=str))
    return study_dir


def study_recipe(study: StudyConfig, study_dir: Path, resume: bool) -> StudyConfig:
    """The study with its ``recipe`` explicit in ``base``, so its study.json and every trial's parameters record it and
    a resumed study runs under the recipe it started with: a new study takes the file's (``auto`` where the file names
    none); a resumed study whose file names none takes the one its study.json recorded. A study whose study.json
    records none started before recipes existed: its trials ran with the defaults of then, and resuming it would give
    them the recipe's settings, so the resume is refused (the trial's plan check refuses a changed plan, not a changed
    learning rate or clip)."""
    if "recipe" in study.base:
        return study  # named in the file (on resume, check_resumed_study compares it with the study.json's)
    recipe = "auto"
    saved_path = Path(study_dir) / "study.json"
    if resume and saved_path.is_file():  # without a study.json, check_resumed_study refuses the resume
        saved = (json.loads(saved_path.read_text()).get("base") or {})
        if "recipe" not in saved:
            raise ConfigError(f"{study_dir} started before raydp had recipes: resumed, its trials would take the "
                              "recipe's settings (raydp.recipe), not those they started with; resume it with the raydp "
                              "it started with, or run it again into another --results-dir")
        recipe = saved["recipe"]
    return study.model_copy(update={"base": {**study.base, "recipe": recipe}})


def _run_private_selection(study: StudyConfig, study_dir: Path, progress: bool, resume: bool, held: list) -> Path:
    """A ``selection: private-dp`` study (:mod:`raydp.study.private_selection`) in its locked directory; a
    directory this call created is removed again when the study fails before any trial was drawn."""
    study = study_recipe(study, study_dir, resume)
    if resume:
        check_resumed_study(study, study_dir)
    created = not study_dir.exists()
    private_dir(study_dir)  # owner-only, this user's, and nothing above it lets another user swap it
    held.append(lock_study_dir(study_dir))
    try:
        return run_private_selection(study, study_dir, progress, resume)  # its charge tag is drawn with K
    except BaseException:
        if created and not (study_dir / SECRET_STATE).exists():
            shutil.rmtree(study_dir, ignore_errors=True)
        raise


def _save_study_policy(session, path: Path, study: StudyConfig, dataset: str, results, wall: float,
                       counters: dict) -> None:
    """Save a shared policy with its training record: what it saw (the dataset, public or not), how many
    episodes on which models and epsilons, and what the training cost (wall and CPU seconds)."""
    manifest = load_manifest(dataset)
    metrics = [r.metrics or {} for r in results]
    trial_seconds = [float(m["trial_seconds"]) for m in metrics if m.get("trial_seconds") is not None]
    finished = sum(bool(m.get("done")) for m in metrics)
    record = {"study": study.name, "episodes": finished, "episodes_planned": len(results),
              "models": study.models, "epsilons": study.epsilons, "seeds": study.seeds,
              "data_source": manifest.get("source"), "public_data": bool(manifest.get("public")),
              "dataset_id": manifest_id(manifest), "train_records": (manifest.get("sizes") or {}).get("train"),
              "wall_seconds": round(wall, 1), "cpu_seconds": round(sum(trial_seconds) * study.resources.cpus_per_trial, 1),
              "gpu_seconds": round(sum(trial_seconds) * study.resources.gpus_per_trial, 1),
              "transitions": counters.get("transitions_trained"),
              "transitions_sampled_in_updates": counters.get("module_steps_trained"),
              "private_budget_spent": "none (public data)" if manifest.get("public") else
              "see the provenance: every run composes for the people in its dataset (ERRATA E14)"}
    first = trial_config(study, next(t for t in trial_grid(study) if t.strategy == study.controller_strategy), dataset)
    record["sac_updates"] = None if counters.get("train_calls") is None else \
        counters["train_calls"] * first.strategy_settings().k
    start = check_policy_privacy(first)  # the saved policy this study continued (its path), or None
    if start is not None:  # the earlier training's figures, so the record's totals cover the policy's whole training:
        # its lifetime (whoever saved it: a study, a single run, a policy server), the figures the policy service
        # continued from (raydp.control.store.lifetime_of), so these totals equal the saved manifest's lifetime
        earlier = training_totals(load_policy_manifest(start))
        record["continued_from"] = {"policy": first.strategy_settings().policy, **earlier}
        record["totals"] = add_totals(earlier, record)
    path.parent.mkdir(parents=True, exist_ok=True)
    session.save(path, trained_on=trained_on(first, model=", ".join(study.models), epsilon=study.epsilons,
                                             t_rl=study.sac_grid.t_rl, pretraining=record),
                 results={"mean_final_public_perplexity": _mean([m.get("final_public_perplexity") for m in metrics])})


def _mean(values) -> float | None:
    values = [float(v) for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _overheads(results, fit_started: float) -> dict:
    """What a trial costs beyond its training run: Tune's start latency (first trial: Tuner start to the
    trainable's first line) and, per trial, the trainable's time outside ``run_training`` (imports, a
    per-trial policy's start-up, reporting, checkpoints), mean over trials."""
    metrics = [r.metrics or {} for r in results if (r.metrics or {}).get("entered_at")]
    if not metrics:
        return {}
    outside = [m["trial_seconds"] - m["run_wall_seconds"] for m in metrics]
    out = {"per_trial_overhead_seconds": round(sum(outside) / len(outside), 2)}
    entered = [m["entered_at"] for m in metrics if m["entered_at"] >= fit_started]  # not restored results
    if entered:
        out["first_trial_start_latency_seconds"] = round(min(entered) - fit_started, 2)
    return out
