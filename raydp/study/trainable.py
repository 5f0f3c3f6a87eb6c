"""A study's Tune trainable: one trial, one fine-tuning run in the trial's actor (:func:`run_trial`).

The trial rebuilds its study, its :class:`~raydp.study.trial.Trial` and its validated config from Tune's config,
reads the study's dataset (on its own node where the study has a ``storage``), starts or connects to its policy
(a controller trial), and runs :func:`raydp.runner.run.run_training` under the lifetime charge the driver made for it.
Every evaluation reaches Tune only with its checkpoint (the training loop checkpoints an evaluation step before it
calls ``on_evaluation``); a retried or restored trial resumes from its latest checkpoint (:func:`_restore_point`)
with exactly its ledger. :func:`evaluation_metrics` is what a report carries (``selection_score``: what the study
selects on, E15). :class:`_Reporter` logs a DP trial's releasable figures to wandb. With ``$RAYDP_PROFILE_DIR``
the trainable runs under cProfile (:data:`PROFILE_ENV`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.fs
import torch

from raydp import run_directory
from raydp.control.connection import client_from_connection
from raydp.control.policies import trained_on
from raydp.data import load_manifest, manifest_id
from raydp.evaluation.evaluate import evaluate_run
from raydp.evaluation.results import flat_metrics
from raydp.errors import ConfigError, RaydpError
from raydp.files import atomic_replace, atomic_write, locked, tighten_umask, user_scratch
from raydp.privacy.accounting.rdp import epsilon_over_steps
from raydp.privacy.lifetime import LifetimeReceipt
from raydp.notices import quiet_exit_tracebacks
from raydp.run_directory import RunDirectory
from raydp.runner.privacy_setup import has_lifetime_budget
from raydp.runner.run import run_training
from raydp.study.config import StudyConfig
from raydp.study.params import TrialParams
from raydp.study.grid import optuna_trial, search_trial, trial_config
from raydp.study.population import PopulationAdmit
from raydp.study.results import selection_value, trial_labels
from raydp.study.searches import study_filesystem
from raydp.study.trial import Trial


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
WANDB_ARTIFACT_FILES = run_directory.RELEASE_FILES
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

        safe = {k: v for k, v in trial.to_dict().items() if k not in ("policy_path", "privacy_plan")}  # settings only, no data
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
        evals = _read_parquet(RunDirectory(run_dir).eval_metrics)
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
        files = RunDirectory(run_dir)
        train, ledger = _read_parquet(files.train_metrics), _read_parquet(files.ledger)
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
#: a trial's cost by phase (docs/throughput.md). A developer's setting, off unless set; a local Ray hands the driver's environment
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
    quiet_exit_tracebacks()  # Ray's SIGTERM of a finished trial's worker is no error to print
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
            atomic_write(out / "PRIVACY.txt", PROFILE_README)  # the profiles' own note (not a run's file)
            # replaced in one rename (raydp.files.atomic_replace): Tune may end the trial's process while it writes
            # (the final report says done), which must leave no truncated .prof behind
            final = out / f"{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}.prof"
            atomic_replace(final, profiler.dump_stats)
        except OSError as exc:
            logging.getLogger(__name__).warning("trial %s: its profile was not written to %s: %s", name, directory,
                                                exc.strerror or exc)


def _run_trial(config: dict) -> None:
    """The Tune trainable's body: one fine-tuning run in this trial's actor.

    Checkpoints (adapters, optimizer, RNG, sampler, ledger, strategy state, and a per-trial policy's
    snapshot) go to Tune at every evaluation and before every controller decision; a retried trial
    resumes from the latest one with exactly its ledger. Each checkpoint's report carries the step and
    the latest evaluation's perplexities (:func:`evaluation_metrics`): an evaluation reaches Tune only
    with (or after) the checkpoint of its step. ``config`` is Tune's (:meth:`TrialParams.from_tune`); a grid trial's
    run is refused if its privacy plan is not the one the driver charged (:attr:`TrialParams.expected_plan`)."""
    from ray import tune  # lazy: `raydp study --check` loads no Ray
    from ray.tune import Checkpoint  # lazy: as above

    from raydp.control.broker import run_seed  # lazy: imports Ray, which `raydp study --check` does not load
    from raydp.runner.launch import start_policy  # lazy: imports Ray, which `raydp study --check` does not load

    tighten_umask()  # this trial's process writes private files (a joined cluster's worker may have a looser mask)
    params = TrialParams.from_tune(config)
    study = params.study
    if not params.log_checkpoints:  # the driver writes to a log, not a terminal (run_study)
        logging.getLogger(CHECKPOINT_LOGGER).setLevel(logging.WARNING)
    # a grid trial: its own spec only (the config's size does not grow with the study); in a study started before
    # that (resumed), every spec in every config
    trial = params.trial
    if trial is None and params.search_cell is not None:  # an Optuna-sampled search_space trial
        trial = search_trial(params.search_cell, params.search, tune.get_context().get_trial_id())
    elif trial is None:  # an Optuna-sampled SAC cell
        trial = optuna_trial(study, params.t_rl, params.b_sac, params.k, tune.get_context().get_trial_id())
    dataset = node_local_dataset(params)
    run_config = trial_config(study, trial, dataset, trial.policy_path)
    check_trial_charged(params.expected_plan, run_config, dataset)  # before anything is written
    torch.set_num_threads(run_config.cpus or 1)
    # with the study's storage, the trial writes on its own node and its run directory travels back to the study
    # as its final checkpoint (fetch_trial_outputs); without it, into the study directory (one machine, or NFS)
    root = user_scratch("trials", study.name) if params.storage else Path(params.study_dir)
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
            if session is not None and not run_config.strategy_settings().frozen:
                client.save_policy(Path(d) / "policy", trained_on=trained_on(run_config), results={})  # a snapshot: no new provenance entry (the run adds it at its end)
            rows = state["trainer"].get("eval_rows") or [{}]
            tune.report({"step": state["trainer"]["step_count"], "checkpoint": True, "eval_step": rows[-1].get("step"),
                         **evaluation_metrics(rows[-1], study.selection, run_config.is_private)},
                        checkpoint=Checkpoint.from_directory(d))

    entered_at = time.time()
    reporter = _Reporter(study, trial, run_config, root, params.wandb)
    try:
        if run_config.is_controlled:
            if params.connection:
                # exploration seeded from the trial's name (public), not the process id
                client = client_from_connection({**params.connection, "seed": run_seed(trial.name)},
                                                f"{trial.name}-{os.getpid()}")
            else:
                session = start_policy(run_config, restore=policy_snapshot)
                client = session.client(trial.name)
        summary = run_training(run_config, out, overwrite=True, progress=False, client=client,
                               # the study charged every trial before any started, under this label, on the
                               # driver's dataset: a run on another copy is refused (check_receipt)
                               _charged_by=LifetimeReceipt(params.dataset_id,
                                                           f"study:{params.lifetime_nonce}/{trial.name}"),
                               expected_plan=params.expected_plan,  # the plan the study charged, or None (searched)
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
        if study.evaluate is not None and study.attack == "all":  # attacks and audit: for the data owner, never
            # Tune's metric (E15); under attack: released they run after the trials (raydp.study.attack_phase)
            started_eval = time.perf_counter()
            try:  # a failed evaluation must not fail (and retrain) a trained trial: it is recorded instead
                attacks = flat_metrics(evaluate_run(out, study.evaluate.model_copy(update={"device": run_config.device}),
                                                    progress=False, audits_in_family=params.n_trials))
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
                               run_config.is_private)
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
                **({"checkpoint": Checkpoint.from_directory(out)} if params.storage else {}))




def _population_hook(params: TrialParams, trial: Trial):
    """A PBT member's ``population_admit`` (its population filter, by the actor's name), else None."""
    if not params.population:
        return None
    return PopulationAdmit(params.population, params.population_namespace, trial.name)



def _node_id() -> str | None:
    import ray  # lazy: `raydp study --check` loads no Ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None



def check_trial_charged(expected_plan: dict | None, config, dataset: str) -> None:
    """Refuse (one line, before anything is written) a DP trial that carries no privacy plan on a dataset with a
    lifetime budget: only a plan the driver calibrated and charged before the study started may run on it, and which
    routes plan their trials is each route's own word (:attr:`raydp.study.routes.SearchRoute.planned_before_run`), so
    the trial checks it too."""
    if expected_plan is not None or not config.is_private:
        return
    manifest = load_manifest(dataset)
    if has_lifetime_budget(manifest):
        raise ConfigError(f"dataset {manifest_id(manifest)} has a lifetime budget, and this DP trial carries no "
                          "privacy plan: the study's driver did not plan and charge it; nothing was started")


def node_local_dataset(params: TrialParams) -> str:
    """A trial's dataset directory on its own node: downloaded once per node from the study's storage (into the
    node's temporary directory, keyed by the study's storage path), or the driver's when there is no storage. A copy
    already there is used only if it is the driver's dataset (its manifest's id is :attr:`TrialParams.dataset_id`):
    one left by an earlier study of the same name and storage is fetched again and replaced."""
    if not params.storage:
        return params.dataset
    filesystem, _ = study_filesystem(params.storage)
    key = hashlib.sha256(params.dataset_remote.encode()).hexdigest()[:16]
    scratch = user_scratch("datasets")
    local = scratch / key
    if _copy_id(local) == params.dataset_id:
        return str(local)
    staging = scratch / f"{key}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        pyarrow.fs.copy_files(params.dataset_remote, str(staging), source_filesystem=filesystem,
                              destination_filesystem=pyarrow.fs.LocalFileSystem())
        fetched = _copy_id(staging)
        if fetched != params.dataset_id:
            raise ConfigError(f"the study's storage holds dataset {fetched}, not {params.dataset_id}, the one its "
                              "trials were charged on; nothing was started")
        with locked(scratch / f"{key}.lock"):  # one trial on this node replaces a copy at a time
            if _copy_id(local) != params.dataset_id:
                if local.exists():  # a stale copy (another dataset under this study's name): set aside, removed
                    stale = scratch / f"{key}.stale-{os.getpid()}-{uuid.uuid4().hex[:8]}"
                    local.rename(stale)
                    shutil.rmtree(stale, ignore_errors=True)
                staging.rename(local)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already when it became the node's copy
    return str(local)


def _copy_id(directory: Path) -> str | None:
    """The dataset id of a dataset copy's manifest; None where there is no readable manifest."""
    try:
        return manifest_id(load_manifest(directory))
    except (OSError, ValueError, RaydpError):  # no directory, no manifest, or no id to compute
        return None
