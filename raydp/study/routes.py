"""One registry of a study's search routes: how its trials are chosen and run, one :class:`SearchRoute` each.

A study file's ``search`` (and ``selection: private-dp``) picks its routes; :func:`raydp.study.runner.run_study` loops
over :func:`study_routes` and never asks for a route by name. Every Tune study runs the ``grid`` route first (its
planned trials: the whole grid, or the baselines beside a search), then the one route its ``search`` names:

* ``grid``: the planned trials, a transfer study's source stage first (:func:`raydp.study.searches.fit_grid`);
* ``optuna``: a controller's SAC cell sampled by Optuna (:func:`raydp.study.searches.fit_optuna`);
* ``search-space``: ``search: optuna`` over a ``search_space``, one Optuna search per (strategy, model, epsilon)
  cell (:func:`raydp.study.searches.fit_search_cells`);
* ``bandit``: the episode-level contextual bandit over a ``search_space`` (:func:`raydp.study.searches.fit_bandit`);
  its decisions are the study's ``search_best``;
* ``pbt``: Population Based Training of the population strategy's members (:func:`raydp.study.pbt.fit`);
* ``private-dp``: ``search: random`` with ``selection: private-dp``, Papernot and Steinke's private selection, which
  runs the whole study itself (:func:`raydp.study.runner._run_private_selection`), outside Tune's routes.

A new route is one module with its ``fit(context) -> FitOutcome`` and one :class:`SearchRoute` line in ``_ROUTES``:
a study file's ``search`` takes its values from the registry (:data:`SEARCH_VALUES`, StudyConfig's choices). Targets are
``"module:function"`` strings, imported when the route runs, so reading the registry loads no Ray (``raydp study
--check``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from raydp.errors import ConfigError

if TYPE_CHECKING:
    from raydp.study.config import StudyConfig
    from raydp.study.searches import TuneStorage
    from raydp.study.trial import Trial


@dataclass(frozen=True)
class FitContext:
    """What a route's fit is given: the study's trainable (``run_trial`` with the trial's resources), the study,
    its prepared trials (policy paths resolved), the Tune config keys every trial shares
    (:meth:`raydp.study.params.TrialParams.to_tune`), Tune's storage, and whether to print progress and resume."""

    trainable: Any
    study: StudyConfig
    trials: list[Trial]
    common: dict
    storage: TuneStorage
    progress: bool
    resume: bool


@dataclass(frozen=True)
class FitOutcome:
    """A route's result grids (Tune's ``ResultGrid`` or lists of results) and how many of its trials did not finish
    (after a Ctrl-C Tune saves its state and returns; a search's planned samples never drawn count too): a stopped
    route ends the study's loop, its later routes wait for ``--resume``."""

    grids: list = field(default_factory=list)
    stopped: int = 0


def _load(target: str):
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class SearchRoute:
    """One way a study's trials are chosen and run."""

    name: str
    #: the study file's ``search`` value this route serves
    search: str
    summary: str
    #: whether the route runs in ``study``
    applies: Callable[[StudyConfig], bool]
    #: "module:function": ``fit(FitContext) -> FitOutcome`` (None for a route that runs the study itself)
    fit_target: str | None = None
    #: "module:function": ``run(study, study_dir, progress, resume, held) -> study_dir`` for a route that runs the
    #: whole study itself, outside Tune's routes and their summary (private selection)
    runs_study: str | None = None
    #: the Tune experiments it may run (each under the study's Tune storage, and staged by Tune in Ray's temporary
    #: folder): ``--resume`` looks for them, and their staging is removed when the study ends
    experiments: Callable[[StudyConfig], list[str]] = lambda study: []
    #: its trials are planned (calibrated) before any trial starts, so a lifetime budget can charge them first
    planned_before_run: bool = False
    #: why a study on this route cannot be resumed (None: it can)
    refuses_resume: str | None = None
    #: "module:function": ``(study, table, split, metric, study_dir) -> list`` of the study summary's ``search_best``
    #: (None: the results table's own, :func:`raydp.study.results.search_best`)
    search_best: str | None = None
    #: "module:function": ``(study_dir) -> dict`` added to the study summary
    summary_of: str | None = None
    #: whether the ``search`` value it serves searches a ``search_space`` (a study file's search_space is refused
    #: under a search that none of its routes take it)
    takes_search_space: bool = False
    #: what ``raydp study --check`` says the route will run in ``study`` beside the grid (None: its ``summary``)
    planned: Callable[[StudyConfig], str] | None = None

    def planned_line(self, study: StudyConfig) -> str:
        return self.planned(study) if self.planned else f"the {self.name} route: {self.summary}"

    def fit(self, context: FitContext) -> FitOutcome:
        if self.fit_target is None:
            raise ConfigError(f"search route {self.name!r} runs its study itself: it has no fit")
        return _load(self.fit_target)(context)

    def run_study(self, *args):
        return _load(self.runs_study)(*args)

    def best(self, *args) -> list:
        return _load(self.search_best)(*args)

    def summary_for(self, study_dir) -> dict:
        return _load(self.summary_of)(study_dir) if self.summary_of else {}


def _source_and_grid(study) -> list[str]:
    return [f"{study.name}-source", study.name]


def _sampled(by: str, samples: Callable[[StudyConfig], int]) -> Callable[[StudyConfig], str]:
    """``planned`` of a route that draws ``samples(study)`` trials in each search cell."""
    def planned(study) -> str:
        from raydp.study.grid import search_cells  # the registry itself imports no study planning

        cells = len(search_cells(study))
        return f"{samples(study) * cells} {by} in {cells} search cell(s)"
    return planned


def _search_cells(study) -> list[str]:
    from raydp.study.grid import search_cells  # the registry itself imports no study planning
    from raydp.study.searches import search_run_name

    return [search_run_name(study, cell) for cell in search_cells(study)]


_ROUTES = (
    SearchRoute("grid", "grid", "every planned trial: the grid, or the baselines beside a search; a transfer study's "
                "source stage first", applies=lambda s: True, fit_target="raydp.study.searches:fit_grid",
                experiments=_source_and_grid, planned_before_run=True),
    SearchRoute("optuna", "optuna", "a controller's SAC cell (T_RL, B_SAC, K) sampled by Optuna",
                applies=lambda s: s.search == "optuna" and not s.search_space,
                fit_target="raydp.study.searches:fit_optuna", experiments=lambda s: [f"{s.name}-optuna"],
                planned=_sampled("sampled by Optuna", lambda s: s.optuna.num_samples)),
    SearchRoute("bandit", "bandit", "the episode-level contextual bandit over one strategy's search_space, on public "
                "episodes", applies=lambda s: s.search == "bandit", fit_target="raydp.study.searches:fit_bandit",
                experiments=lambda s: [f"{s.name}-bandit"], search_best="raydp.study.bandit:bandit_best",
                takes_search_space=True, planned=_sampled("chosen by the bandit", lambda s: s.bandit.num_samples)),
    SearchRoute("pbt", "pbt", "Population Based Training of the population strategy's members",
                applies=lambda s: s.search == "pbt", fit_target="raydp.study.pbt:fit",
                experiments=lambda s: [f"{s.name}-pbt"],
                refuses_resume="a PBT study cannot be resumed (its population filter's state lived in the stopped "
                "run): run it again into another --results-dir; what the stopped run spent still counts (E7/E14)",
                summary_of="raydp.study.population:population_summary"),
    SearchRoute("search-space", "optuna", "one Optuna search per (strategy, model, epsilon) cell over a search_space",
                applies=lambda s: s.search == "optuna" and bool(s.search_space),
                fit_target="raydp.study.searches:fit_search_cells", experiments=_search_cells,
                takes_search_space=True, planned=_sampled("sampled by Optuna", lambda s: s.optuna.num_samples)),
    SearchRoute("private-dp", "random", "private selection: a secret number of independent draws per cell, the best "
                "released with one end-to-end epsilon", applies=lambda s: s.selection == "private-dp",
                runs_study="raydp.study.runner:_run_private_selection", takes_search_space=True),
)

#: the routes by name, in the order a study runs them
ROUTES: dict[str, SearchRoute] = {route.name: route for route in _ROUTES}
#: the values of a study file's ``search`` (StudyConfig's choices): those the routes serve, the grid's first
SEARCH_VALUES: tuple[str, ...] = tuple(dict.fromkeys(route.search for route in _ROUTES))
#: the ``search`` values under which a study file may give a ``search_space``
SEARCH_SPACE_VALUES: tuple[str, ...] = tuple(dict.fromkeys(r.search for r in _ROUTES if r.takes_search_space))


def get_route(name: str) -> SearchRoute:
    try:
        return ROUTES[name]
    except KeyError:
        raise ConfigError(f"unknown search route {name!r}; known: {', '.join(ROUTES)}") from None


def study_routes(study: StudyConfig) -> list[SearchRoute]:
    """The routes ``study`` runs, in order: the one that runs the whole study where one applies (private selection),
    else every Tune route that applies (the grid first)."""
    routes = [route for route in _ROUTES if route.applies(study)]
    whole = [route for route in routes if route.runs_study]
    return whole[:1] or routes


def experiment_names(study: StudyConfig) -> list[str]:
    """Every Tune experiment a study may run, over every route (a route that does not apply runs none of them, and
    looking for them costs nothing): the grid, its source stage, the searches and the population."""
    return [name for route in _ROUTES for name in route.experiments(study)]
