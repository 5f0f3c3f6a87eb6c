"""Population Based Training (``search: pbt``) on Ray Tune: the study's scheduler, its members' trainable and the fit.

The population's shared Renyi filter (an actor every member asks before each step) is :mod:`raydp.study.population`;
this module is Tune's side: :class:`SyncPBTScheduler` (synchronous PBT whose sync points are a function of the
members' step counts only), :func:`run_pbt_member` (a member's trainable: :func:`raydp.study.trainable.run_trial`
under the member's own name after an exploit), the perturbation helpers (:class:`_ClampToRanges`,
:class:`_SeededDraw`) and :func:`_fit_pbt`. It imports Ray: load it only to run a PBT study.
"""

from __future__ import annotations

import random
import shutil
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import ray
import torch
from ray import tune
from ray.tune.experiment import Trial as TuneTrial
from ray.tune.schedulers import PopulationBasedTraining

from raydp.runner.launch import RAY_NAMESPACE
from raydp.study.config import StudyConfig
from raydp.study.grid import draw_in_range, trial_config
from raydp.study.population import join_population, population_filter, start_population, write_population
from raydp.study.routes import FitContext, FitOutcome
from raydp.study.searches import TuneStorage, _run_config
from raydp.study.trainable import CHECKPOINT_STATE, run_trial
from raydp.study.trial import Trial


def run_pbt_member(params: dict) -> None:
    """The Tune trainable of a PBT member: :func:`run_trial` under the member's own name, with PBT's current
    (clip, sigma_scale).

    After an exploit Tune restarts this trial with a mutated copy of the DONOR's config and the donor's
    checkpoint. So the member is not read from the config (which names the donor) but from the population
    actor, which registered this Tune trial id at its first start; the checkpoint (the donor's ledger,
    weights, optimizer; fresh secret randomness, ERRATA E12) is restored by :func:`run_trial` into this
    member's own work and output directories, with the NEW settings (the PBT strategy keeps no state in its
    checkpoints). A killed incarnation's half-written output is removed first."""
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


class SyncPBTScheduler(PopulationBasedTraining):
    """Ray Tune's ``PopulationBasedTraining`` with two changes for a DP population:

    * No perturbation at a member's last planned step (``final_step``): its plan is done, and an exploit
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
    if not members:
        return []
    settings, ranges = study.pbt, study.pbt.hyperparam_mutations
    specs = {m.name: m for m in members}
    population, planned_steps = population_filter(study, members, common["dataset"])
    eval_every = trial_config(study, members[0], common["dataset"]).eval_every
    bounds = {"clip": ranges.clip, "sigma_scale": ranges.sigma_scale}
    scheduler = SyncPBTScheduler(
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


def fit(context: FitContext) -> FitOutcome:
    """The ``pbt`` route (:mod:`raydp.study.routes`): the population of the study's PBT members (:func:`_fit_pbt`)."""
    members = [t for t in context.trials if t.stage == "pbt"]
    return FitOutcome([_fit_pbt(context.study, members, context.common, context.storage, context.progress)])
