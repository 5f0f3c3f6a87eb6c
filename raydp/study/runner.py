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

import hashlib
import json
import logging
import math
import os
import random
import shutil
import sys
import tempfile
import time
import uuid
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.fs
import torch

from raydp.control.connection import client_from_connection
from raydp.control.store import add_totals, training_totals
from raydp.control.store import load_manifest as load_policy_manifest
from raydp.control.policies import check_policy_privacy, trained_on
from raydp.data import load_manifest, load_texts, manifest_id, resolve_dataset
from raydp.data.build import is_public_dataset
from raydp.data.tasks import classification_spec
from raydp.errors import ConfigError
from raydp.files import atomic_write, owner_only, private_dir, tighten_umask, user_scratch
from raydp.evaluation.evaluate import evaluate_run
from raydp.evaluation.results import flat_metrics
from raydp.model.embedded import ensure_embedded_model, is_embedded_name
from raydp.privacy.accounting.rdp import epsilon_over_steps
from raydp.privacy.lifetime import LifetimeReceipt, read_budget
from raydp.runner.local_setup import is_local, plan_local_run
from raydp.runner.privacy_setup import LifetimeCharge, build_strategy, plan_key, plan_private_run, training_units
from raydp.runner.privacy_setup import charge_lifetime as charge_lifetime_budget  # prepare_study's flag has the name
from raydp.runner.run import run_training
from raydp.study.config import (TUNING_FORMAT, TUNING_RECORD, StudyConfig, draw_in_range, load_study, optuna_trial,
                                search_cells, search_trial, trial_config, trial_grid, upgrade_study_values)
from raydp.study.population import (PopulationAdmit, join_population, population_filter, population_summary,
                                    start_population, write_population)
from raydp.study.private_selection import SECRET_STATE, run_private_selection
from raydp.study.results import collect_results, selection_value, trial_labels
from raydp.study.trial import Trial, tune_trial


def prepare_study(study: StudyConfig, study_dir: Path, progress: bool = True,
                  build_models: bool = False, charge_lifetime: bool = False,
                  lifetime_nonce: str | None = None) -> tuple[str, list[Trial]]:
    """Build the dataset, validate every trial and calibrate every plan; returns (dataset_dir, trials).
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
    n_train = len(load_texts(dataset, "train"))
    trials, plans, trial_plans, unit_names = [], {}, {}, {}
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
                    unit_names[key] = units.name  # the key holds the privacy unit: one per plan
                    if is_local(strategy):  # forward-pass local DP: its own plan (ERRATA E8)
                        plans[key] = plan_local_run(config, strategy, units,
                                                    classification_spec(config.task.label).n_classes)
                    else:
                        plans[key] = plan_private_run(config, units.public_count, strategy)
                except ConfigError as exc:
                    raise ConfigError(f"trial {trial.name}: {exc}") from None
        if not trial.search:  # a corner is only checked: Optuna's trials are named when they run
            trials.append(trial)
            if config.is_private:
                trial_plans[f"study:{lifetime_nonce}/{trial.name}"] = LifetimeCharge.of(
                    plans[key], config, strategy, unit_names[key])
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
    if study.search != "grid" or search_cells(study):
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


def lock_study_dir(study_dir: Path):
    """An exclusive lock on the study directory for this driver's lifetime (the open file holds it; closing it, or
    the process ending, releases it). Two drivers in one directory would both run its unfinished trials, with fresh
    noise, under one lifetime charge; the second is refused."""
    import fcntl  # lazy: POSIX only (a study's driver locks its directory; the rest of the module runs anywhere)

    path = Path(study_dir) / "work" / "driver.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "a")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise ConfigError(f"another raydp study is running in {study_dir}: wait for it, or stop it first") from None
    return handle


#: study-file fields a resume may change: none of them changes what a trial runs or spends
RESUMABLE_CHANGES = ("description", "resources", "wandb", "max_failures")


def check_resumed_study(study: StudyConfig, study_dir: Path) -> None:
    """A resumed study must be the study that ran: its trials were charged (and Tune restores them) under their
    names, so a plan changed under the same names would run trials that no charge covers."""
    saved_path = Path(study_dir) / "study.json"
    if not saved_path.is_file():
        raise ConfigError(f"{study_dir} has no study.json: it cannot be resumed (nothing says which study ran there)")
    saved = upgrade_study_values(json.loads(saved_path.read_text()))  # a study.json from before issue 30: base.rldp
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


#: eval-row fields logged to wandb (numbers only) and their names there, against ``eval/step``: ``eval/*`` is the
#: private eval split (unprotected, docs/privacy.md), ``public/*`` public validation
WANDB_EVAL_FIELDS = {"perplexity": "eval/perplexity", "value_nll": "eval/value_nll",
                     "nll_per_token": "eval/nll_per_token", "public_perplexity": "public/perplexity",
                     "public_value_nll": "public/value_nll"}
#: summary fields sent to wandb and their names there (the same split prefixes)
WANDB_SUMMARY_FIELDS = {"final_eval_perplexity": "eval/final_perplexity", "best_eval_perplexity": "eval/best_perplexity",
                        "final_eval_value_nll": "eval/final_value_nll",
                        "final_public_perplexity": "public/final_perplexity",
                        "best_public_perplexity": "public/best_perplexity",
                        "final_public_value_nll": "public/final_value_nll", "steps": "steps"}
#: train-metrics columns logged as curves (x-axis ``train/step``): the DP release's dials
WANDB_TRAIN_FIELDS = ("sigma", "sigma_eff", "clip_mean", "noisy_grad_norm", "lr")
#: a DP run's files sent as its wandb artifact: the releasable ones (tests/releasable.py classifies them)
WANDB_ARTIFACT_FILES = ("adapter", "summary.json", "config.json", "PRIVACY.txt", "privacy_ledger.parquet")
#: wandb keeps at most this many rows of a table (more are dropped silently): longer runs' dials table is strided
WANDB_TABLE_ROWS = 10_000


def wandb_target(study: StudyConfig, study_dir: Path) -> dict:
    """Where a study's trials log, resolved once on the driver (so one worker's WANDB_* cannot change it), and
    the base of their run ids: a digest of the study's directory on the driver and its name (public)."""
    mode, project, entity = study.wandb.resolved()
    base = hashlib.sha256(f"{Path(study_dir).resolve()}|{study.name}".encode()).hexdigest()
    return {"mode": mode, "project": project, "entity": entity, "id_base": base}


def evaluation_metrics(row: dict, selection: str, private_run: bool = True) -> dict:
    """Tune metrics of one evaluation row (``perplexity``/``value_nll``: private eval split;
    ``public_perplexity``/``public_value_nll``: public validation split), and ``selection_score``, what Tune,
    Optuna and PBT minimise: the value-token NLL (nats per record) where the run reports it, else perplexity
    (``selection_metric`` says which), on the study's ``selection`` split (ERRATA E15; a run without a public
    figure falls back to the private one, and ``selection_split`` says so)."""
    metric = "value_nll" if row.get("value_nll") is not None else "perplexity"
    private, public = (row.get("value_nll"), row.get("public_value_nll")) if metric == "value_nll" else \
        (row.get("perplexity"), row.get("public_perplexity"))
    value, split = selection_value(private, public, selection)
    out = {"eval_perplexity": row.get("perplexity"), "public_perplexity": row.get("public_perplexity"),
           "selection_score": value, "selection_split": split, "selection_metric": metric,
           # what ResultGrid.get_best_result() ranks: NaN (skipped) for a non-private run, no DP arm
           "dp_selection_score": value if private_run else float("nan")}
    if metric == "value_nll":
        out.update(eval_value_nll=private, public_value_nll=public)
    return out


def privacy_label_of(summary: dict) -> str:
    """Every label of a run's epsilon, '; '-joined ('' if none): ERRATA E3 (paper mode), E12 (void)..."""
    return "; ".join(trial_labels(summary))


class _Reporter:
    """A DP trial's wandb run, unless disabled: evaluations as they come (``eval/*``, ``public/*`` against
    ``eval/step``); at the end the dials and the privacy spent over steps (``train/*`` against ``train/step``),
    tables of both, the summary and its releasable files as an artifact; attack results only when the study opts
    in. A non-private trial sends nothing (nothing in it is releasable). One wandb run per trial, resumed (never
    duplicated) when Tune retries or restores it. wandb never fails a trial: an error turns the reporter off with
    a warning. Tune gets evaluations with their checkpoint (:func:`run_trial`), never from here."""

    def __init__(self, study: StudyConfig, trial: Trial, config, study_dir: Path, target: dict | None = None):
        self.run, self.settings, self.config, self.trial = None, study.wandb, config, trial.name
        target = target or wandb_target(study, study_dir)
        if target["mode"] == "disabled" or not config.is_private:
            return
        self._guard("start", self._start, study, trial, config, study_dir, target)

    def _start(self, study, trial, config, study_dir, target) -> None:
        import wandb  # lazy: only a trial that logs to wandb loads it

        safe = {k: v for k, v in trial.to_dict().items() if k not in ("policy_path",)}  # settings only, no data
        os.environ.setdefault("WANDB_SILENT", "true")  # no "syncing is offline" lines per trial in a study's log
        run_id = hashlib.sha256(f"{target['id_base']}|{trial.name}".encode()).hexdigest()[:24]
        self.run = wandb.init(
            project=target["project"], entity=target["entity"], mode=target["mode"], id=run_id, resume="allow",
            group=study.name, name=trial.name, dir=str(study_dir), reinit="create_new",
            # nothing about the machine (not even its host name), its git checkout, code or packages; no system metrics (memory and CPU
            # over time follow the private batch sizes); no console capture; quiet: no banner in a study's log
            settings=wandb.Settings(x_disable_stats=True, quiet=True, console="off", disable_git=True,
                                    save_code=False, disable_code=True, x_disable_meta=True,
                                    x_disable_machine_info=True, x_save_requirements=False, host="trial"),
            config={**safe, "epochs": config.epochs, "batch_size": config.batch_size, "delta": config.delta,
                    "accountant": config.accountant})
        for axis in ("eval", "train"):
            self.run.define_metric(f"{axis}/step")
        for prefix in ("eval", "public"):
            self.run.define_metric(f"{prefix}/*", step_metric="eval/step")
        self.run.define_metric("train/*", step_metric="train/step")

    def _guard(self, what: str, call, *args) -> None:
        try:
            call(*args)
        except Exception as exc:  # noqa: BLE001 - wandb is a side channel of the trial, never its failure
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            logging.getLogger(__name__).warning("trial %s: wandb %s failed, nothing more goes to wandb: %s",
                                                self.trial, what, first)
            run, self.run = self.run, None
            if run is not None:
                try:
                    run.finish(exit_code=1)
                except Exception:  # noqa: BLE001
                    pass

    def evaluation(self, step: int, row) -> None:
        """``on_evaluation(step, row)``: ``row`` is the eval row (step, epoch, perplexity, value_nll,
        public_perplexity, public_value_nll...); a bare number is read as the private perplexity."""
        if self.run is None:
            return
        if not isinstance(row, dict):
            row = {"perplexity": row}
        numbers = {name: float(row[key]) for key, name in WANDB_EVAL_FIELDS.items() if _is_number(row.get(key))}
        if numbers:
            self._guard("log", self.run.log, {"eval/step": int(step), **numbers})

    def finish(self, summary: dict, run_dir: Path) -> None:
        """The run's curves, tables, summary and artifact; the wandb run stays open for :meth:`close`."""
        if self.run is not None:
            self._guard("finish", self._finish, summary, Path(run_dir))

    def _finish(self, summary: dict, run_dir: Path) -> None:
        import wandb  # lazy: only a trial that logs to wandb loads it

        privacy = summary.get("privacy") or {}
        self.run.summary.update({name: summary.get(key) for key, name in WANDB_SUMMARY_FIELDS.items()})
        self.run.summary.update({"epsilon": privacy.get("epsilon"), "privacy_label": privacy_label_of(summary)})
        rows = self._train_rows(privacy, run_dir)
        for row in rows:
            self.run.log(row)
        if rows:
            columns = sorted({key for row in rows for key in row}, key=lambda c: (c != "train/step", c))
            stride = -(-len(rows) // WANDB_TABLE_ROWS)
            self.run.log({"tables/dials": wandb.Table(columns=columns, data=[[row.get(c) for c in columns]
                                                                             for row in rows[::stride]])})
        evals = _read_parquet(run_dir / "eval_metrics.parquet")
        if evals is not None and len(evals):
            columns = {"step": "eval/step", **WANDB_EVAL_FIELDS}
            table = evals[[c for c in columns if c in evals]].rename(columns=columns).reset_index(drop=True)
            self.run.log({"tables/evaluations": wandb.Table(dataframe=table)})
        if self.settings.artifacts:
            artifact = wandb.Artifact(f"adapter-{self.run.id}", type="model",
                                      description="a DP run's releasable files (PRIVACY.txt says what each is)",
                                      metadata={"epsilon": privacy.get("epsilon"), "delta": privacy.get("delta"),
                                                "privacy_label": privacy_label_of(summary)})
            for name in WANDB_ARTIFACT_FILES:
                path = run_dir / name
                if path.is_dir():
                    artifact.add_dir(str(path), name=name)
                elif path.is_file():
                    artifact.add_file(str(path), name=name)
            self.run.log_artifact(artifact)

    def _train_rows(self, privacy: dict, run_dir: Path) -> list[dict]:
        """One row per step: the dials of the train metrics, each clip radius of the ledger and, for DP-SGD's
        ledger (a central mechanism, one row per step), the RDP bound of the privacy spent so far at up to 40
        steps. A local mechanism's ledger (one row per epoch, ERRATA E16's accounting) gets no such curve."""
        train = _read_parquet(run_dir / "train_metrics.parquet")
        ledger = _read_parquet(run_dir / "privacy_ledger.parquet")
        if train is None or "step" not in train:
            return []
        clips, spent = {}, {}
        if ledger is not None and len(ledger):
            ledger = ledger.sort_values("step")
            if "clip" in ledger:  # the ledger's step i is the (i+1)-th step of the train metrics
                clips = {int(s) + 1: np.atleast_1d(np.asarray(c, float)) for s, c in zip(ledger["step"], ledger["clip"])
                         if c is not None}
            central = "local" not in (privacy.get("epsilon_by_accountant") or {})
            if central and {"q", "sigma_eff"} <= set(ledger):
                counts, eps = epsilon_over_steps(ledger["q"], ledger["sigma_eff"], float(self.config.delta))
                steps = ledger["step"].to_numpy()
                spent = {int(steps[int(k) - 1]) + 1: float(e) for k, e in zip(counts, eps)}
        rows = []
        for rec in train.sort_values("step").to_dict("records"):
            k = int(rec["step"])  # steps done (1-based)
            row = {"train/step": k, **{f"train/{f}": float(rec[f]) for f in WANDB_TRAIN_FIELDS if _is_number(rec.get(f))}}
            row.update({f"train/clip_{i}": float(c) for i, c in enumerate(clips.get(k, ())) if np.isfinite(c)})
            if k in spent:
                row["train/epsilon_spent"] = spent[k]
            rows.append(row)
        return rows

    def close(self, attacks: dict | None = None) -> None:
        """Attack and audit results when the study opted in (``wandb.attacks``), labelled ``unprotected/``:
        they are measured on the private records. Then the run ends."""
        if self.run is None:
            return
        if attacks and self.settings.attacks:
            self._guard("log", self.run.summary.update,
                        {f"unprotected/{k}": float(v) for k, v in attacks.items() if _is_number(v)})
        if self.run is not None:
            self._guard("close", self.run.finish)
        self.run = None
        import wandb  # lazy: only a trial that logs to wandb loads it

        # Stop wandb's service now: left to its atexit hook it finds the service already gone when Ray
        # ends the trial's worker and prints a ConnectionResetError traceback per trial
        try:
            wandb.teardown()
        except Exception:  # noqa: BLE001
            pass


def _is_number(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool) \
        and math.isfinite(float(value))


def _read_parquet(path: Path):
    return pd.read_parquet(path) if path.is_file() else None


CHECKPOINT_STATE = "state.pt"
#: Ray's logger of "Checkpoint successfully created at: ..." (INFO, in the trial's process, forwarded to the
#: driver): one log line per evaluation and per controller decision of every trial
CHECKPOINT_LOGGER = "ray.train._internal.storage"
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


def _restore_point(workdir: Path) -> tuple[dict | None, Path | None]:
    """The trial's latest Tune checkpoint (after a retry or ``Tuner.restore``), copied locally."""
    from ray import tune  # lazy: `raydp study --check` loads no Ray

    checkpoint = tune.get_checkpoint()
    if checkpoint is None:
        return None, None
    local = workdir / "restore"
    shutil.rmtree(local, ignore_errors=True)
    with checkpoint.as_directory() as d:
        shutil.copytree(d, local)
    state = torch.load(local / CHECKPOINT_STATE, weights_only=False)
    return state, (local / "policy" if (local / "policy").exists() else None)


#: names a directory (an absolute path): a trial's process that has it set runs its trainable under cProfile and leaves
#: the statistics there, one ``TRIAL-PID-ID.prof`` per attempt, written as ``TRIAL-PID-ID.prof.partial`` and renamed
#: (a ``.partial`` left behind is from a process that ended while writing). bench/bench_episode.py --study reads them:
#: a trial's cost by phase, issue 28. A developer's setting, off unless set; a local Ray hands the driver's environment
#: to its trials. The files' call counts give the private splits' record counts and the total of the secret Poisson
#: batch sizes exactly, and their times follow them: unprotected, to be kept with the run's private data
#: (docs/privacy.md).
PROFILE_ENV = "RAYDP_PROFILE_DIR"
PROFILE_README = ("PRIVATE: the call counts and times of profiled trials (RAYDP_PROFILE_DIR). They give the private "
                  "splits' record counts and the total of the secret Poisson batch sizes exactly. Never release them.\n")


def run_trial(params: dict) -> None:
    """The Tune trainable (:func:`_run_trial`), under cProfile where the trial's process has ``$RAYDP_PROFILE_DIR``
    set (:data:`PROFILE_ENV`). Tune sees one trainable either way, so a study resumes whether or not it was profiled.
    The statistics are written also when the trial fails; a failure to write them is a warning, never the trial's
    failure. (cProfile profiles the calling thread, Tune's runner thread, on Python 3.11; from 3.12 it may see every
    thread of the process.)"""
    directory = os.environ.get(PROFILE_ENV)
    if not directory:
        return _run_trial(params)
    import cProfile

    profiler = cProfile.Profile()
    try:
        return profiler.runcall(_run_trial, params)
    finally:
        name = (params.get("trial") or {}).get("name") or "trial"  # a grid trial's spec; a searched one is unnamed
        try:
            out = Path(directory)
            out.mkdir(parents=True, exist_ok=True)
            (out / "PRIVACY.txt").write_text(PROFILE_README)
            # written under a temporary name and renamed: Tune may end the trial's process while it writes (the final
            # report says done), which must leave no truncated .prof behind
            final = out / f"{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}.prof"
            partial = final.with_name(f"{final.name}.partial")  # private like the rest: no hidden name
            try:
                profiler.dump_stats(partial)
                os.replace(partial, final)
            except OSError:
                partial.unlink(missing_ok=True)
                raise
        except OSError as exc:
            logging.getLogger(__name__).warning("trial %s: its profile was not written to %s: %s", name, directory,
                                                exc.strerror or exc)


def _run_trial(params: dict) -> None:
    """The Tune trainable's body: one fine-tuning run in this trial's actor.

    Checkpoints (adapters, optimizer, RNG, sampler, ledger, strategy state, and a per-trial policy's
    snapshot) go to Tune at every evaluation and before every controller decision; a retried trial
    resumes from the latest one with exactly its ledger. Each checkpoint's report carries the step and
    the latest evaluation's perplexities (:func:`evaluation_metrics`): an evaluation reaches Tune only
    with (or after) the checkpoint of its step."""
    from ray import tune  # lazy: `raydp study --check` loads no Ray
    from ray.tune import Checkpoint  # lazy: as above

    from raydp.control.broker import run_seed  # lazy: imports Ray, which `raydp study --check` does not load
    from raydp.runner.launch import start_policy  # lazy: imports Ray, which `raydp study --check` does not load

    tighten_umask()  # this trial's process writes private files (a joined cluster's worker may have a looser mask)
    study = StudyConfig(**params["study"])
    if not params.get("log_checkpoints", True):  # the driver writes to a log, not a terminal (run_study)
        logging.getLogger(CHECKPOINT_LOGGER).setLevel(logging.WARNING)
    # a grid trial: its own spec only (the config's size does not grow with the study); in a study started before
    # that (resumed), every spec in every config
    trial = tune_trial(params)
    if trial is None and "search_cell" in params:  # an Optuna-sampled search_space trial
        trial = search_trial(Trial.from_dict(params["search_cell"]), params["search"],
                             tune.get_context().get_trial_id())
    elif trial is None:  # an Optuna-sampled SAC cell
        trial = optuna_trial(study, params["t_rl"], params["b_sac"], params["k"], tune.get_context().get_trial_id())
    dataset = node_local_dataset(params)
    config = trial_config(study, trial, dataset, trial.policy_path)
    torch.set_num_threads(config.cpus or 1)
    # with the study's storage, the trial writes on its own node and its run directory travels back to the study
    # as its final checkpoint (fetch_trial_outputs); without it, into the study directory (one machine, or NFS)
    root = user_scratch("trials", study.name) if params.get("storage") else Path(params["study_dir"])
    out = root / "trials" / trial.name
    workdir = root / "work" / trial.name
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "pid").write_text(str(os.getpid()))
    resume, policy_snapshot = _restore_point(workdir)
    session = client = None
    started = time.perf_counter()

    def checkpoint(state: dict) -> None:
        with tempfile.TemporaryDirectory(dir=workdir) as d:
            torch.save(state, Path(d) / CHECKPOINT_STATE)
            if session is not None and not config.strategy_settings().frozen:
                client.save_policy(Path(d) / "policy", trained_on=trained_on(config), results={})  # a snapshot: no new provenance entry (the run adds it at its end)
            rows = state["trainer"].get("eval_rows") or [{}]
            tune.report({"step": state["trainer"]["step_count"], "checkpoint": True, "eval_step": rows[-1].get("step"),
                         **evaluation_metrics(rows[-1], study.selection, config.is_private)},
                        checkpoint=Checkpoint.from_directory(d))

    entered_at = time.time()
    reporter = _Reporter(study, trial, config, root, params.get("wandb"))
    try:
        if config.is_controlled:
            if params.get("connection"):
                # exploration seeded from the trial's name (public), not the process id
                client = client_from_connection({**params["connection"], "seed": run_seed(trial.name)},
                                                f"{trial.name}-{os.getpid()}")
            else:
                session = start_policy(config, restore=policy_snapshot)
                client = session.client(trial.name)
        summary = run_training(config, out, overwrite=True, progress=False, client=client,
                               # the study charged every trial before any started, under this label
                               _charged_by=LifetimeReceipt(manifest_id(load_manifest(dataset)),
                                                           f"study:{params.get('lifetime_nonce')}/{trial.name}"),
                               on_evaluation=reporter.evaluation, on_checkpoint=checkpoint, resume=resume,
                               population_admit=_population_hook(params, trial))  # PBT: the population filter
        reporter.finish(summary, out)
    except BaseException:
        reporter.close()  # never raises (_Reporter._guard)
        raise
    finally:
        if session is not None:
            session.close()
    attacks = {}
    try:
        if study.evaluate is not None:  # attacks and audit: for the data owner, never Tune's metric (E15)
            started_eval = time.perf_counter()
            try:  # a failed evaluation must not fail (and retrain) a trained trial: it is recorded instead
                attacks = flat_metrics(evaluate_run(out, study.evaluate.model_copy(update={"device": config.device}),
                                                    progress=False, audits_in_family=params.get("n_trials", 1)))
            except Exception as exc:  # noqa: BLE001 - reported in the trial's results, not raised
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                attacks = {"evaluation_error": f"{type(exc).__name__}: {first}"}
                logging.getLogger(__name__).warning("trial %s: evaluation failed: %s", trial.name, first)
            attacks["eval_seconds"] = time.perf_counter() - started_eval
    finally:
        reporter.close(attacks)  # never raises
    final = evaluation_metrics({"perplexity": summary["final_eval_perplexity"],
                                "public_perplexity": summary.get("final_public_perplexity"),
                                # the value-token NLL where the run reports it: the metric its evaluations had
                                "value_nll": summary.get("final_eval_value_nll"),
                                "public_value_nll": summary.get("final_public_value_nll")}, study.selection,
                               config.is_private)
    tune.report({"step": summary["steps"], **final,
                 "final_eval_perplexity": summary["final_eval_perplexity"],
                 "best_eval_perplexity": summary["best_eval_perplexity"],
                 "final_public_perplexity": summary.get("final_public_perplexity"),
                 "best_public_perplexity": summary.get("best_public_perplexity"),
                 "epsilon": (summary["privacy"] or {}).get("epsilon"),
                 "privacy_label": privacy_label_of(summary),
                 "trial_seconds": time.perf_counter() - started - attacks.get("eval_seconds", 0.0),
                 "trial_name": trial.name,
                 "entered_at": entered_at, "run_wall_seconds": summary["wall_seconds"],
                 "trial_spec": json.dumps(trial.to_dict()), **attacks, "done": True,
                 "node_id": _node_id()},  # which Ray node ran it (a cluster's placement, public)
                **({"checkpoint": Checkpoint.from_directory(out)} if params.get("storage") else {}))


def _param_space(study: StudyConfig, trials: list[Trial], common: dict) -> dict:
    """Tune grid-searches the trials' specs: each trial's config holds its own spec only, so configs (and every
    ``result.json`` row, which repeats its config) stay the same size however many trials the study has."""
    from ray import tune  # lazy: `raydp study --check` loads no Ray

    return {**common, "trial": tune.grid_search([t.to_dict() for t in trials])}


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
    if resume and study.search == "pbt":  # the population filter's spent curve lives in the study's actor only
        raise ConfigError("a PBT study cannot be resumed (its population filter's state lived in the stopped run): run "
                          "it again into another --results-dir; what the stopped run spent still counts (E7/E14)")
    study_dir = (Path(results_dir) / study.name).resolve()
    if study.selection == "private-dp":
        return _run_private_selection(study, study_dir, progress, resume, held)
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
    atomic_write(study_dir / "study.json", json.dumps(study.model_dump(mode="json"), indent=2))
    write_lifetime_nonce(study_dir, nonce)  # a resume here is not charged twice (private: work/)
    session = None
    common = {"study": study.model_dump(mode="json"), "dataset": dataset, "study_dir": str(study_dir),
              "wandb": wandb_target(study, study_dir),
              "connection": None, "log_checkpoints": sys.stderr.isatty(),
              "n_trials": len(trials),  # audits in the family: each trial's audit is Bonferroni-corrected
              "lifetime_nonce": nonce}  # the tag of the trials' lifetime charge (their receipt's label)
    if study.policy == "shared" and study.controller_strategy is not None:
        from raydp.control.service import start_policy_session  # lazy: imports Ray (`raydp study --check` does not)

        # the controller settings' `policy` is where the shared policy starts (continued, its provenance inherited)
        first = next(t for t in trials if t.strategy == study.controller_strategy)
        session = start_policy_session(trial_config(study, first, dataset, first.policy_path), RAY_NAMESPACE)
        common["connection"] = session.connection()
    bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    trainable = tune.with_resources(run_trial, tune.PlacementGroupFactory([bundle]))
    if study.storage is not None:  # every node reads the dataset from the study's storage (study_storage_dataset)
        common.update(storage=study.storage, dataset_remote=upload_dataset(study, dataset))
    started, fit_started = time.perf_counter(), time.time()
    # a frozen transfer trial starts from its stage-1 trial's policy
    sources = {t.source_key: str(study_dir / "trials" / t.name / "policy") for t in trials if t.stage == "source"}
    trials = [replace(t, policy_path=sources[t.frozen_from]) if t.frozen_from else t for t in trials]
    stages = [[t for t in trials if t.stage == "source"],
              [t for t in trials if t.stage not in ("source", "pbt")]]  # PBT members: _fit_pbt
    grids, stopped = [], 0
    try:
        for i, stage in enumerate(s for s in stages if s):
            name = study.name if i == len([s for s in stages if s]) - 1 else f"{study.name}-source"
            grids.append(_fit(trainable, _param_space(study, stage, common), storage, name, study, progress, resume))
            stopped = unfinished_in(grids[-1])
            if stopped:  # Ctrl-C: Tune saved this stage and returned; the next stages wait for --resume
                break
        if not stopped and study.search == "bandit":
            grids.append(_fit_bandit(trainable, study, common, storage, progress, resume))
            stopped = unfinished_in(grids[-1], planned=study.bandit.num_samples * len(search_cells(study)))
        elif not stopped and study.search_space:
            for cell in search_cells(study):  # one Tuner per cell: a Ctrl-C in one must not go on to the next
                grids.append(_fit_search(trainable, study, cell, common, storage, progress, resume))
                stopped = unfinished_in(grids[-1], planned=study.optuna.num_samples)
                if stopped:
                    break
        elif not stopped and study.search == "optuna":
            grids.append(_fit_optuna(trainable, study, common, storage, progress, resume))
        if not stopped and study.search == "pbt":
            grids.append(_fit_pbt(study, [t for t in trials if t.stage == "pbt"], common, storage, progress))
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
    summary = {"study": study.name, "trials": len(trials), "wall_seconds": round(wall, 1),
               "results": str(study_dir / "results.parquet"), **_overheads(results, fit_started)}
    summary.update(table.attrs if hasattr(table, "attrs") else {})
    if study.search == "bandit":  # each cell's values are the bandit's decision, not its best episode
        from raydp.study.bandit import bandit_best  # lazy: imports Ray, which `raydp study --check` does not load

        selection = summary["selection"]
        summary["search_best"] = bandit_best(study, table, selection["split"], selection["metric"], study_dir)
    summary.update(population_summary(study_dir))  # PBT: the population's epsilon (empty otherwise)
    if shared_counters is not None:
        summary["shared_policy"] = shared_counters
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


def _run_private_selection(study: StudyConfig, study_dir: Path, progress: bool, resume: bool, held: list) -> Path:
    """A ``selection: private-dp`` study (:mod:`raydp.study.private_selection`) in its locked directory; a
    directory this call created is removed again when the study fails before any trial was drawn."""
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


def experiment_names(study: StudyConfig) -> list[str]:
    """Every Tune experiment a study may run (each under its Tune storage, and staged by Tune in Ray's temporary
    folder): the grid, its source stage, the searches and the population."""
    return [f"{study.name}-source", study.name, f"{study.name}-optuna", f"{study.name}-bandit", f"{study.name}-pbt",
            *(search_run_name(study, cell) for cell in search_cells(study))]


def unfinished_in(grid, planned: int | None = None) -> int:
    """How many of one Tuner's trials did not finish (after a Ctrl-C Tune saves its state and returns): those that
    neither ended (``done``) nor failed, and, for a search of ``planned`` samples, those never sampled."""
    results = list(grid)
    running = sum(1 for r in results if r.error is None and not (r.metrics or {}).get("done"))
    return running + (max(0, planned - len(results)) if planned is not None else 0)


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


#: Tune's own console output for a study (``raydp study --verbose``: 1, ``-vv``: 2); unset or 0, raydp's line per
#: finished trial instead (:class:`raydp.study.progress.TrialLines`)
TUNE_VERBOSE_ENV = "RAYDP_TUNE_VERBOSE"


def tune_verbosity(progress: bool) -> int:
    """Tune's console verbosity: 0 (silent) unless :data:`TUNE_VERBOSE_ENV` asks for Tune's reporter, and then only
    with ``progress``. Ray 2.60's default output engine (``ray.tune.experimental.output``, unless
    ``RAY_AIR_NEW_OUTPUT=0``) prints at 1 a status table at most every 30 s (with the best trial's whole config)
    and a block when a trial starts or ends; 2 adds a block per result and per checkpoint. That engine ignores a
    ``progress_reporter`` (with a warning), so none is passed. The line per checkpoint from the trial's process
    (:data:`CHECKPOINT_LOGGER`) is quieted by :func:`run_trial` off a terminal."""
    level = os.environ.get(TUNE_VERBOSE_ENV, "").strip()
    return int(level) if progress and level in ("1", "2") else 0


#: checkpoints a trial keeps (a retry resumes from the latest; a PBT exploit copies the donor's latest)
CHECKPOINTS_KEPT = 2


class TuneStorage:
    """Where Tune keeps a study's experiments and checkpoints: ``study_dir/tune`` on this machine, or, with the
    study's ``storage`` (a URI such as ``s3://bucket/prefix?endpoint_override=host:port&scheme=http``, or a
    directory every node mounts), ``<storage>/<study name>/tune`` on storage every node reaches."""

    def __init__(self, path: str, filesystem=None):
        self.path, self.filesystem = path, filesystem

    @classmethod
    def for_study(cls, study: StudyConfig, study_dir: Path) -> TuneStorage:
        if study.storage is None:
            return cls(str(study_dir / "tune"))
        filesystem, base = study_filesystem(study.storage)
        return cls(f"{base.rstrip('/')}/{study.name}/tune", filesystem)

    def experiment(self, name: str) -> str:
        return f"{self.path}/{name}"

    def can_restore(self, name: str) -> bool:
        from ray import tune  # lazy: `raydp study --check` loads no Ray

        return tune.Tuner.can_restore(self.experiment(name), storage_filesystem=self.filesystem)

    def restore(self, name: str, trainable, **kwargs):
        from ray import tune  # lazy: `raydp study --check` loads no Ray

        return tune.Tuner.restore(self.experiment(name), trainable=trainable, storage_filesystem=self.filesystem,
                                  **kwargs)


def study_filesystem(uri: str):
    """(pyarrow filesystem, path) of a study's ``storage`` URI; a one-line ConfigError if pyarrow cannot open it."""
    try:
        return pyarrow.fs.FileSystem.from_uri(uri)
    except (pyarrow.ArrowException, ValueError, OSError) as exc:
        raise ConfigError(f"storage: cannot open {uri!r}: {' '.join(str(exc).split())[:200]}") from None


def _run_config(name: str, storage: TuneStorage, study: StudyConfig, progress: bool, keep: int | None = CHECKPOINTS_KEPT):
    """Every Tuner's RunConfig: its experiment under ``storage``, retries, a bounded number of checkpoints
    (``keep``; PBT keeps all: an exploit copies a donor's checkpoint, which a bound could delete first), and its
    console: Tune's reporter at :func:`tune_verbosity`, else :class:`raydp.study.progress.TrialLines` (with
    ``progress`` a line per finished trial; without, nothing: not even Tune's announcement of the experiment)."""
    from ray import tune  # lazy: `raydp study --check` loads no Ray

    from raydp.notices import quiet_library_notices
    from raydp.study.progress import TrialLines  # lazy: imports Ray, as above

    quiet_library_notices()  # e.g. Tune's Tuner.restore hint when a study is stopped: raydp prints its --resume one
    verbose = tune_verbosity(progress)
    return tune.RunConfig(name=name, storage_path=storage.path, storage_filesystem=storage.filesystem,
                          failure_config=tune.FailureConfig(max_failures=study.max_failures),
                          checkpoint_config=tune.CheckpointConfig(num_to_keep=keep),
                          verbose=verbose, callbacks=None if verbose else [TrialLines(lines=progress)])


def _node_id() -> str | None:
    import ray  # lazy: `raydp study --check` loads no Ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


def _search_concurrency(study: StudyConfig) -> int | None:
    """Trials an Optuna search runs at once: on private data one, because with several the next trial's settings
    depend on which trials had finished when a slot freed, i.e. on run times, which follow the private batch sizes
    (the argument that keeps a shared policy off private data, ERRATA E12/E14); on public data, any."""
    return 1 if study.private_data else None


def _trial_dirname(trial) -> str:
    """A grid trial's directory under Tune's experiment: its id and raydp's trial name (not its whole spec)."""
    spec = tune_trial(trial.config or {})
    return f"{trial.trial_id}_{spec.name if spec is not None else 'trial'}"[:140]


def _fit(trainable, param_space: dict, storage: TuneStorage, name: str, study: StudyConfig, progress: bool,
         resume: bool):
    """One Tuner run (restored from its experiment state with ``resume``)."""
    from ray import tune  # lazy: `raydp study --check` loads no Ray

    if resume and storage.can_restore(name):
        tuner = storage.restore(name, trainable, resume_errored=True, param_space=param_space)
    else:
        tuner = tune.Tuner(
            trainable,
            param_space=param_space,
            # ResultGrid.get_best_result(): the best DP trial (a non-private trial's dp_selection_score is NaN)
            tune_config=tune.TuneConfig(metric="dp_selection_score", mode="min",
                                        trial_dirname_creator=_trial_dirname),
            run_config=_run_config(name, storage, study, progress),
        )
    return tuner.fit()


def _fit_optuna(trainable, study: StudyConfig, common: dict, storage: TuneStorage, progress: bool, resume: bool):
    """RLDP's SAC cell (T_RL, B_SAC, K) chosen by Optuna (TPE) over the study's grid values, on the
    ``selection_score`` metric: the public validation split unless ``selection: private`` (E15)."""
    from ray import tune  # lazy: `raydp study --check` loads no Ray
    from ray.tune.search.optuna import OptunaSearch  # lazy: as above (and no Optuna)

    space = {"t_rl": tune.choice(study.sac_grid.t_rl), "b_sac": tune.choice(study.sac_grid.b_sac),
             "k": tune.choice(study.sac_grid.k)}
    if resume and storage.can_restore(f"{study.name}-optuna"):
        return storage.restore(f"{study.name}-optuna", trainable, resume_errored=True).fit()
    tuner = tune.Tuner(
        trainable,
        param_space={**common, **space},
        tune_config=tune.TuneConfig(search_alg=OptunaSearch(metric="selection_score", mode="min",
                                                            seed=study.optuna.seed),
                                    num_samples=study.optuna.num_samples,
                                    max_concurrent_trials=_search_concurrency(study)),
        run_config=_run_config(f"{study.name}-optuna", storage, study, progress),
    )
    return tuner.fit()


def upload_dataset(study: StudyConfig, dataset: str) -> str:
    """Copy the built dataset to ``<storage>/<study>/dataset`` (trials on any node read it from there); returns
    its path on the storage's filesystem. The dataset is private: the storage must be the data owner's."""
    filesystem, base = study_filesystem(study.storage)
    remote = f"{base.rstrip('/')}/{study.name}/dataset"
    pyarrow.fs.copy_files(str(dataset), remote, source_filesystem=pyarrow.fs.LocalFileSystem(),
                          destination_filesystem=filesystem)
    return remote


def node_local_dataset(params: dict) -> str:
    """A trial's dataset directory on its own node: downloaded once per node from the study's storage (into the
    node's temporary directory, keyed by the study's storage path), or the driver's when there is no storage."""
    if not params.get("storage"):
        return params["dataset"]
    filesystem, _ = study_filesystem(params["storage"])
    key = hashlib.sha256(params["dataset_remote"].encode()).hexdigest()[:16]
    local = user_scratch("datasets") / key
    if not (local / "manifest.json").exists():
        staging = local.with_name(f"{key}.partial-{os.getpid()}")
        staging.mkdir(parents=True, exist_ok=True)
        pyarrow.fs.copy_files(params["dataset_remote"], str(staging), source_filesystem=filesystem,
                              destination_filesystem=pyarrow.fs.LocalFileSystem())
        try:
            staging.rename(local)
        except OSError:  # another trial on this node got there first
            shutil.rmtree(staging, ignore_errors=True)
    return str(local)


def fetch_trial_outputs(results, trials_dir: Path) -> None:
    """Each finished trial's run directory, from its final checkpoint on the study's storage into ``trials_dir``."""
    for result in results:
        metrics = result.metrics or {}
        name = metrics.get("trial_name")
        checkpoint = getattr(result, "checkpoint", None)
        if not metrics.get("done") or not name or checkpoint is None or (trials_dir / name / "summary.json").exists():
            continue
        checkpoint.to_directory(str(trials_dir / name))


def search_run_name(study: StudyConfig, cell: Trial) -> str:
    """The Tune experiment (and Optuna study) of one search cell."""
    return f"{study.name}-search-{cell.strategy}-{cell.model.replace('/', '_')}-eps{cell.epsilon:g}"


def _search_space(space: dict) -> dict:
    """The study's search_space of one strategy as Tune domains (Optuna samples them through OptunaSearch)."""
    from ray import tune  # lazy: `raydp study --check` loads no Ray

    out = {}
    for name, dim in space.items():
        if dim.choices is not None:
            out[name] = tune.choice(list(dim.choices))
        else:
            out[name] = (tune.loguniform if dim.log else tune.uniform)(dim.low, dim.high)
    return out


def _fit_search(trainable, study: StudyConfig, cell: Trial, common: dict, storage: TuneStorage, progress: bool,
                resume: bool):
    """One search cell (strategy, model, epsilon): ``optuna.num_samples`` trials sampled by Optuna (TPE or
    CMA-ES, seeded) over the strategy's ``search_space``, minimising ``selection_score`` (the PUBLIC validation
    split unless ``selection: private``, E15). Optuna's trials are also kept in an SQLite storage beside Tune's
    state (``tune/optuna.sqlite3``, one Optuna study per cell), so a stopped search resumes with its history
    (``--resume`` restores the Tune experiment, whose searcher reloads the Optuna study)."""
    import optuna  # lazy: `raydp study --check` loads no Optuna
    from ray import tune  # lazy: `raydp study --check` loads no Ray
    from ray.tune.search.optuna import OptunaSearch  # lazy: as above

    name = search_run_name(study, cell)
    if resume and storage.can_restore(name):
        return storage.restore(name, trainable, resume_errored=True).fit()
    local = os.path.join(common["study_dir"], "tune")  # Optuna's SQLite storage: on the driver's machine
    os.makedirs(local, exist_ok=True)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    settings = study.optuna
    # TPE: multivariate (clip and learning rate interact), a constant liar for the trials still running in parallel
    sampler = (optuna.samplers.CmaEsSampler(seed=settings.seed, n_startup_trials=settings.startup_trials,
                                            warn_independent_sampling=False)
               if settings.sampler == "cmaes" else
               optuna.samplers.TPESampler(seed=settings.seed, n_startup_trials=settings.startup_trials,
                                          multivariate=True, constant_liar=True))
    searcher = OptunaSearch(metric="selection_score", mode="min", sampler=sampler, study_name=name,
                            storage=optuna.storages.RDBStorage(f"sqlite:///{os.path.join(local, 'optuna.sqlite3')}"))
    tuner = tune.Tuner(
        trainable,
        param_space={**common, "search_cell": cell.to_dict(),
                     "search": _search_space(study.search_space[cell.strategy])},
        tune_config=tune.TuneConfig(search_alg=searcher, num_samples=study.optuna.num_samples,
                                    max_concurrent_trials=_search_concurrency(study)),
        run_config=_run_config(name, storage, study, progress),
    )
    return tuner.fit()


def _fit_bandit(trainable, study: StudyConfig, common: dict, storage: TuneStorage, progress: bool, resume: bool):
    """``search: bandit``: one Tune experiment of ``bandit.num_samples`` episodes per epsilon, each trial's
    context and values from :class:`raydp.study.bandit.BanditSearch` (Tune checkpoints the searcher, so
    ``--resume`` goes on with what it had learned)."""
    from ray import tune  # lazy: `raydp study --check` loads no Ray

    from raydp.study.bandit import BanditSearch  # lazy: imports Ray, as above

    name = f"{study.name}-bandit"
    if resume and storage.can_restore(name):
        return storage.restore(name, trainable, resume_errored=True).fit()
    tuner = tune.Tuner(
        trainable,
        param_space=dict(common),
        tune_config=tune.TuneConfig(search_alg=BanditSearch(study),
                                    num_samples=study.bandit.num_samples * len(search_cells(study)),
                                    max_concurrent_trials=_search_concurrency(study)),
        run_config=_run_config(name, storage, study, progress),
    )
    return tuner.fit()


# -- Population Based Training (search: pbt) ----------------------------------------------------------
def _population_hook(params: dict, trial: Trial):
    """A PBT member's ``population_admit`` (its population filter, by the actor's name), else None."""
    if not params.get("population"):
        return None
    return PopulationAdmit(params["population"], params["population_namespace"], trial.name)


def run_pbt_member(params: dict) -> None:
    """The Tune trainable of a PBT member: :func:`run_trial` under the member's own name, with PBT's current
    (clip, sigma_scale).

    After an exploit Tune restarts this trial with a mutated copy of the DONOR's config and the donor's
    checkpoint. So the member is not read from the config (which names the donor) but from the population
    actor, which registered this Tune trial id at its first start; the checkpoint (the donor's ledger,
    weights, optimizer; fresh secret randomness, ERRATA E12) is restored by :func:`run_trial` into this
    member's own work and output directories, with the NEW settings (the PBT strategy keeps no state in its
    checkpoints). A killed incarnation's half-written output is removed first."""
    from ray import tune  # lazy: `raydp study --check` loads no Ray

    checkpoint, step = tune.get_checkpoint(), None
    if checkpoint is not None:  # the step it resumes at, for the population's lineage
        with checkpoint.as_directory() as d:
            step = int(torch.load(Path(d) / CHECKPOINT_STATE, weights_only=False)["trainer"]["step_count"])
    current = params["pbt"]
    settings = {"clip": float(current["clip"]), "sigma_scale": float(current["sigma_scale"])}
    name = join_population(params["population"], params["population_namespace"], tune.get_context().get_trial_id(),
                           int(current["member"]), checkpoint.path if checkpoint is not None else None, step, settings)
    spec = replace(Trial.from_dict(params["pbt_members"][name]), settings=settings)  # the same member, new settings
    for partial in (Path(params["study_dir"]) / "trials").glob(f".{name}.partial-*"):
        shutil.rmtree(partial, ignore_errors=True)
    run_trial({**params, "trial": spec.to_dict()})


class _ClampToRanges:
    """PBT's ``custom_explore_fn``: a perturbed (x0.8 / x1.2) setting is clamped back into its range."""

    def __init__(self, ranges: dict[str, tuple[float, float]]):
        self.ranges = ranges

    def __call__(self, config: dict) -> dict:
        for key, (low, high) in self.ranges.items():
            config["pbt"][key] = float(min(max(config["pbt"][key], low), high))
        return config


def _pbt_scheduler(**kwargs):
    """Ray Tune's ``PopulationBasedTraining`` with two changes for a DP population (:class:`_PBTScheduler`)."""
    from ray.tune.experiment import Trial as TuneTrial  # lazy: `raydp study --check` loads no Ray
    from ray.tune.schedulers import PopulationBasedTraining  # lazy: as above

    class _PBTScheduler(PopulationBasedTraining):
        """* No perturbation at a member's last planned step (``final_step``): its plan is done, and an exploit
          there would only copy another member's final weights over its own, at the cost of a restart.
        * Synchronous mode: every sync point is performed, on a grid fixed before training (the first
          perturbation step, then every ``perturbation_interval`` steps), among the members that reach it;
          a member that ended before it (its plan's budget exhausted, the population filter refused a step, a
          failure Tune does not retry) takes no part. Which sync points happen, who takes part and the next
          sync step are functions of the members' step counts, never of the order in which their results
          and ends reach the driver (which follows their step times, hence their private batch sizes).

        How: a member's result at or past the next sync step S records it and pauses it (Tune's function
        trainable blocks in ``tune.report`` until the driver lets it go on, so it runs no step past S). The
        perturbation at S is taken in :meth:`choose_trial_to_run`, which Tune's controller calls at every
        loop, once every member that has not ended is PAUSED at S (its checkpoint at S saved) and at least
        one is; then S advances by one interval. Ray 2.60's synchronous PBT instead perturbs inside the
        result of the last member to arrive, so when the last member it waits for ends rather than reports,
        it waits forever; and a member that errors stays among Tune's live trials."""

        def __init__(self, *, final_step: int, **kw):
            super().__init__(**kw)
            self._final_step = int(final_step)

        def on_trial_result(self, tune_controller, trial, result):
            if result.get(self._time_attr, 0) >= self._final_step and trial in self._trial_state:
                self._trial_state[trial].last_train_time = result[self._time_attr]
                return self.CONTINUE
            if not self._synch or self._metric not in result or self._time_attr not in result:
                return super().on_trial_result(tune_controller, trial, result)
            step = result[self._time_attr]
            if step < self._next_perturbation_sync:  # burn-in included: the first sync step is after it
                return self.CONTINUE
            self._save_trial_state(self._trial_state[trial], step, result, trial)  # score and step at S
            return self.PAUSE  # it waits at S for the others (its report's checkpoint is saved on pausing)

        def _sync_ready(self, tune_controller) -> bool:
            """Whether the sync point ``S = _next_perturbation_sync`` can be performed now: every member that
            has not ended (TERMINATED or ERROR) is PAUSED with its recorded step at or past S."""
            members = [t for t in tune_controller.get_trials() if not t.is_finished()]
            return bool(members) and all(
                t.status == TuneTrial.PAUSED and t in self._trial_state
                and self._trial_state[t].last_train_time >= self._next_perturbation_sync for t in members)

        def _perform_sync(self, tune_controller) -> None:
            """Exploit/explore among the members paused at S (Ray's synchronous step, from the ranked
            population: upper quantile checkpointed first, then the lower quantile exploits), then S += interval."""
            sync = self._next_perturbation_sync
            lower, upper = self._quantiles()  # members not ended, by their score at S
            members = [t for t in tune_controller.get_trials() if not t.is_finished()]
            middle = [t for t in members if t not in lower and t not in upper]
            for t in upper + middle + lower:
                self._trial_state[t].last_perturbation_time = sync
                self._checkpoint_or_exploit(t, tune_controller, upper, lower)
            self._next_perturbation_sync = sync + self._perturbation_interval

        def choose_trial_to_run(self, tune_controller):
            if self._synch and self._sync_ready(tune_controller):
                self._perform_sync(tune_controller)
            return super().choose_trial_to_run(tune_controller)

    return _PBTScheduler(**kwargs)


class _SeededDraw:
    """PBT's resampling of a setting: a draw from its range from a generator seeded by ``pbt.seed``."""

    def __init__(self, bounds, seed: int):
        self.bounds = bounds
        self.rng = np.random.default_rng(seed)

    def __call__(self) -> float:
        return draw_in_range(self.bounds, self.rng)


class _MemberResult:
    """A PBT trial's Tune result under its member's name: its config names the member it trained (Tune's
    config after an exploit is the donor's), so :func:`raydp.study.results.collect_results` counts every
    member exactly once."""

    def __init__(self, result, name: str, specs: dict[str, Trial]):
        self.metrics = result.metrics
        self.error = result.error
        self.checkpoint = result.checkpoint
        self.path = result.path
        self.config = {**(result.config or {}), "trial": specs[name].to_dict()}


def _fit_pbt(study: StudyConfig, members: list[Trial], common: dict, storage: TuneStorage, progress: bool):
    """The PBT population on Ray Tune's ``PopulationBasedTraining`` (see :mod:`raydp.study.population`).

    Before ``Tuner.fit`` the population actor is created with B_pop = M * B. Each member is one Tune trial
    (a grid over the members' initial settings); Tune's time is the member's DP step (``step``, inherited
    with a checkpoint), a perturbation every ``pbt.perturbation_interval`` evaluations of ``eval_every``
    steps; the metric is ``selection_score``, the PUBLIC validation split (ERRATA E15), minimised.
    Every reported result carries the checkpoint of its evaluation, which is what PBT copies. Afterwards
    the population's state (spent curve, exploits) goes to ``pbt_population.json``."""
    import ray  # lazy: `raydp study --check` loads no Ray
    from ray import tune  # lazy: as above

    from raydp.runner.launch import RAY_NAMESPACE  # lazy: imports Ray, which `raydp study --check` does not load

    if not members:
        return []
    settings, ranges = study.pbt, study.pbt.hyperparam_mutations
    specs = {m.name: m for m in members}
    population, planned_steps = population_filter(study, members, common["dataset"])
    eval_every = trial_config(study, members[0], common["dataset"]).eval_every
    bounds = {"clip": ranges.clip, "sigma_scale": ranges.sigma_scale}
    scheduler = _pbt_scheduler(
        final_step=planned_steps, time_attr="step", metric="selection_score", mode="min",
        perturbation_interval=settings.perturbation_interval * eval_every,
        hyperparam_mutations={"pbt": {k: _SeededDraw(r, settings.seed + 1 + i)
                                      for i, (k, r) in enumerate(bounds.items())}},
        quantile_fraction=settings.quantile_fraction, resample_probability=settings.resample_probability,
        custom_explore_fn=_ClampToRanges({k: (r.low, r.high) for k, r in bounds.items()}), synch=settings.synch)
    random.seed(settings.seed)  # PBT's exploit/explore draws (public choices, not DP randomness)
    cpus, gpus = study.resources.cpus_per_trial, study.resources.gpus_per_trial
    trainable = tune.with_resources(run_pbt_member, tune.PlacementGroupFactory(
        [{"CPU": cpus, **({"GPU": gpus} if gpus else {})}]))
    actor, actor_name = start_population(study.name, population, list(specs), RAY_NAMESPACE)
    name = f"{study.name}-pbt"
    try:
        tuner = tune.Tuner(
            trainable,
            param_space={**common, "population": actor_name, "population_namespace": RAY_NAMESPACE,
                         "pbt_members": {name: m.to_dict() for name, m in specs.items()},
                         "pbt": tune.grid_search([{"member": m.member, **m.settings} for m in members])},
            tune_config=tune.TuneConfig(scheduler=scheduler, reuse_actors=False),
            run_config=_run_config(name, storage, study, progress, keep=None),
        )
        with warnings.catch_warnings():  # actors are not reused: a member's thread cannot be reset mid-run
            warnings.filterwarnings("ignore", message="Consider boosting PBT performance")
            grid = tuner.fit()
        state = ray.get(actor.state.remote())
    finally:
        ray.kill(actor)
    logs = list(Path(storage.path, name).glob("pbt_global.txt"))  # local storage (a PBT study refuses other)
    write_population(Path(common["study_dir"]), state, {
        "pbt_global_log_lines": sum(len(p.read_text().splitlines()) for p in logs) if logs else None,
        "perturbation_interval_steps": settings.perturbation_interval * eval_every})
    results = []
    for result in grid:
        trial_id = (result.metrics or {}).get("trial_id")
        owner = state["trials"].get(trial_id) if trial_id else None
        if owner is None:  # no report: find the trial by its directory; else it never started (its own config)
            owner = next((m for t, m in state["trials"].items() if t in str(result.path)), None)
        if owner is None:
            owner = members[int((result.config or {})["pbt"]["member"])].name
        results.append(_MemberResult(result, owner, specs))
    return results


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
