"""A study's Tune experiments: where Tune keeps them (:class:`TuneStorage`), every Tuner's run config, and the fits
of the grid, of Optuna (RLDP's SAC cell, or a ``search_space`` per search cell) and of the episode-level bandit.

Each fit is one ``tune.Tuner`` (restored from its experiment state with ``--resume``) of the study's trainable
(:func:`raydp.study.trainable.run_trial`) and returns its ``ResultGrid``. On private data a search runs one trial at
a time (:func:`_search_concurrency`). Population Based Training's fit is :mod:`raydp.study.pbt`'s. Nothing here
imports Ray until a fit runs (``raydp study --check`` loads no Ray).
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow.fs

from raydp.errors import ConfigError
from raydp.run_directory import RunDirectory
from raydp.study.config import StudyConfig
from raydp.study.grid import search_cells
from raydp.study.routes import FitContext, FitOutcome
from raydp.study.trial import Trial, tune_trial


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


def _run_config(name: str, storage: TuneStorage, study: StudyConfig, progress: bool,
                keep: int | None = CHECKPOINTS_KEPT, total: int | None = None):
    """Every Tuner's RunConfig: its experiment under ``storage``, retries, a bounded number of checkpoints
    (``keep``; PBT keeps all: an exploit copies a donor's checkpoint, which a bound could delete first), and its
    console: Tune's reporter at :func:`tune_verbosity`, else :class:`raydp.study.progress.TrialLines` (with
    ``progress`` a line per finished trial, counted out of ``total``, a search's samples, which its searcher creates
    as trials one by one; without, nothing: not even Tune's announcement of the experiment)."""
    from ray import tune  # lazy: `raydp study --check` loads no Ray

    from raydp.notices import quiet_library_notices
    from raydp.study.progress import TrialLines  # lazy: imports Ray, as above

    quiet_library_notices()  # e.g. Tune's Tuner.restore hint when a study is stopped: raydp prints its --resume one
    verbose = tune_verbosity(progress)
    return tune.RunConfig(name=name, storage_path=storage.path, storage_filesystem=storage.filesystem,
                          failure_config=tune.FailureConfig(max_failures=study.max_failures),
                          checkpoint_config=tune.CheckpointConfig(num_to_keep=keep),
                          verbose=verbose, callbacks=None if verbose else [TrialLines(lines=progress, total=total)])



def _param_space(study: StudyConfig, trials: list[Trial], common: dict) -> dict:
    """Tune grid-searches the trials' specs: each trial's config holds its own spec only, so configs (and every
    ``result.json`` row, which repeats its config) stay the same size however many trials the study has."""
    from ray import tune  # lazy: `raydp study --check` loads no Ray

    return {**common, "trial": tune.grid_search([t.to_dict() for t in trials])}



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
        run_config=_run_config(f"{study.name}-optuna", storage, study, progress, total=study.optuna.num_samples),
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


def fetch_trial_outputs(results, trials_dir: Path) -> None:
    """Each finished trial's run directory, from its final checkpoint on the study's storage into ``trials_dir``."""
    for result in results:
        metrics = result.metrics or {}
        name = metrics.get("trial_name")
        checkpoint = getattr(result, "checkpoint", None)
        if not metrics.get("done") or not name or checkpoint is None or RunDirectory(trials_dir / name).is_finished():
            continue
        checkpoint.to_directory(str(trials_dir / name))


def search_run_name(study: StudyConfig, cell: Trial) -> str:
    """The Tune experiment (and Optuna study) of one search cell."""
    eps = "" if cell.epsilon is None else f"-eps{cell.epsilon:g}"  # a non-private cell has none
    return f"{study.name}-search-{cell.strategy}-{cell.model.replace('/', '_')}{eps}"


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
        run_config=_run_config(name, storage, study, progress, total=study.optuna.num_samples),
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
    samples = study.bandit.num_samples * len(search_cells(study))
    tuner = tune.Tuner(
        trainable,
        param_space=dict(common),
        tune_config=tune.TuneConfig(search_alg=BanditSearch(study), num_samples=samples,
                                    max_concurrent_trials=_search_concurrency(study)),
        run_config=_run_config(name, storage, study, progress, total=samples),
    )
    return tuner.fit()


def unfinished_in(grid, planned: int | None = None) -> int:
    """How many of one Tuner's trials did not finish (after a Ctrl-C Tune saves its state and returns): those that
    neither ended (``done``) nor failed, and, for a search of ``planned`` samples, those never sampled."""
    results = list(grid)
    running = sum(1 for r in results if r.error is None and not (r.metrics or {}).get("done"))
    return running + (max(0, planned - len(results)) if planned is not None else 0)


# -- the routes' fits (raydp.study.routes) ----------------------------------------------------------------
def fit_grid(context: FitContext) -> FitOutcome:
    """The ``grid`` route: the study's planned trials (PBT's members aside: the ``pbt`` route's), a transfer study's
    source stage first as its own Tuner; a stage stopped by a Ctrl-C leaves the next for ``--resume``."""
    trials = context.trials
    stages = [[t for t in trials if t.stage == "source"],
              [t for t in trials if t.stage not in ("source", "pbt")]]  # PBT members: the pbt route
    stages = [s for s in stages if s]
    study, grids, stopped = context.study, [], 0
    for i, stage in enumerate(stages):
        name = study.name if i == len(stages) - 1 else f"{study.name}-source"
        grids.append(_fit(context.trainable, _param_space(study, stage, context.common), context.storage, name, study,
                          context.progress, context.resume))
        stopped = unfinished_in(grids[-1])
        if stopped:  # Ctrl-C: Tune saved this stage and returned; the next stages wait for --resume
            break
    return FitOutcome(grids, stopped)


def fit_optuna(context: FitContext) -> FitOutcome:
    """The ``optuna`` route: a controller's SAC cell sampled by Optuna (:func:`_fit_optuna`)."""
    return FitOutcome([_fit_optuna(context.trainable, context.study, context.common, context.storage, context.progress,
                                   context.resume)])


def fit_search_cells(context: FitContext) -> FitOutcome:
    """The ``search-space`` route: one Tuner per search cell (:func:`_fit_search`); a Ctrl-C in one must not go on
    to the next."""
    study, grids, stopped = context.study, [], 0
    for cell in search_cells(study):
        grids.append(_fit_search(context.trainable, study, cell, context.common, context.storage, context.progress,
                                 context.resume))
        stopped = unfinished_in(grids[-1], planned=study.optuna.num_samples)
        if stopped:
            break
    return FitOutcome(grids, stopped)


def fit_bandit(context: FitContext) -> FitOutcome:
    """The ``bandit`` route (:func:`_fit_bandit`)."""
    study = context.study
    grid = _fit_bandit(context.trainable, study, context.common, context.storage, context.progress, context.resume)
    return FitOutcome([grid], unfinished_in(grid, planned=study.bandit.num_samples * len(search_cells(study))))
