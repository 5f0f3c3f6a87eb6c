"""The registry of a study's search routes (raydp.study.routes): every value of a study file's ``search`` has a route,
every route serves one, and which routes a study runs follows from the study file alone."""

from __future__ import annotations

import subprocess
import sys
import typing
from types import SimpleNamespace

import pytest

from raydp.errors import ConfigError
from raydp.study.config import StudyConfig
from raydp.study.routes import ROUTES, _load, experiment_names, get_route, study_routes


def test_every_search_value_has_a_route_and_every_route_serves_one():
    searches = set(typing.get_args(StudyConfig.model_fields["search"].annotation))
    assert searches == {route.search for route in ROUTES.values()}
    assert len(ROUTES) == len({route.name for route in ROUTES.values()})
    with pytest.raises(ConfigError, match="unknown search route 'nope'"):
        get_route("nope")


def test_a_study_files_search_and_its_search_space_follow_the_registry():
    """StudyConfig's choices are the routes' values, and a search_space is refused under a search no route of which
    takes one (the registry, not a list in the study model, says which)."""
    from raydp.study.routes import SEARCH_SPACE_VALUES, SEARCH_VALUES

    assert typing.get_args(StudyConfig.model_fields["search"].annotation) == SEARCH_VALUES
    assert {"optuna", "bandit", "random"} <= set(SEARCH_SPACE_VALUES) and "grid" not in SEARCH_SPACE_VALUES
    base = {"name": "s", "models": ["embedded-tiny"], "epsilons": [1.0], "strategies": ["static"],
            "search_space": {"static": {"lr": {"low": 1e-4, "high": 1e-2, "log": True}}}}
    with pytest.raises(ValueError, match="search_space is searched by"):
        StudyConfig.model_validate({**base, "search": "grid"})
    with pytest.raises(ValueError, match="search"):
        StudyConfig.model_validate({**base, "search": "nope"})


def test_every_routes_targets_resolve_to_callables():
    for route in ROUTES.values():
        assert (route.fit_target is None) != (route.runs_study is None), route.name  # a Tune fit, or the study itself
        for target in (route.fit_target, route.runs_study, route.search_best, route.summary_of):
            if target is not None:
                assert callable(_load(target)), (route.name, target)


@pytest.mark.parametrize("study, names", [
    ({"search": "grid", "search_space": {}, "selection": "public"}, ["grid"]),
    ({"search": "optuna", "search_space": {}, "selection": "public"}, ["grid", "optuna"]),
    ({"search": "optuna", "search_space": {"clip-schedule": {}}, "selection": "public"}, ["grid", "search-space"]),
    ({"search": "bandit", "search_space": {"clip-schedule": {}}, "selection": "public"}, ["grid", "bandit"]),
    ({"search": "pbt", "search_space": {}, "selection": "public"}, ["grid", "pbt"]),
    ({"search": "random", "search_space": {"static": {}}, "selection": "private-dp"}, ["private-dp"]),
])
def test_a_study_runs_the_grid_then_the_route_its_search_names(study, names):
    assert [route.name for route in study_routes(SimpleNamespace(**study))] == names


def test_only_the_grid_plans_its_trials_before_they_run_and_pbt_refuses_a_resume():
    assert [name for name, route in ROUTES.items() if route.planned_before_run] == ["grid"]
    assert [name for name, route in ROUTES.items() if route.refuses_resume] == ["pbt"]


def test_experiment_names_cover_every_route_in_order():
    study = StudyConfig.model_validate({
        "name": "s", "models": ["embedded-tiny"], "epsilons": [1.0, 2.0], "strategies": ["clip-schedule"],
        "search": "optuna", "search_space": {"clip-schedule": {"lr": {"low": 1e-4, "high": 1e-2, "log": True}}}})
    names = experiment_names(study)
    assert names == [n for route in ROUTES.values() for n in route.experiments(study)]  # every route's, in order
    known = ["s-source", "s", "s-optuna", "s-bandit", "s-pbt", "s-search-clip-schedule-embedded-tiny-eps1",
             "s-search-clip-schedule-embedded-tiny-eps2"]  # today's routes' names (a new route adds its own)
    assert [n for n in names if n in known] == known


def test_reading_the_routes_loads_no_ray():
    code = ("import sys; from types import SimpleNamespace; import raydp.study.runner; "
            "from raydp.study.routes import study_routes, experiment_names; "
            "study_routes(SimpleNamespace(search='pbt', search_space={}, selection='public')); "
            "print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_check_says_what_each_route_beside_the_grid_runs():
    """`raydp study --check`'s line comes from the routes: a searched route says how many trials it draws in how many
    cells, any other route (PBT, or a new one without ``planned``) its summary; nothing is named by a branch in the
    CLI."""
    from dataclasses import replace

    base = {"name": "s", "models": ["embedded-tiny"], "epsilons": [1.0, 2.0], "strategies": ["clip-schedule"]}
    space = {"clip-schedule": {"lr": {"low": 1e-4, "high": 1e-2, "log": True}}}
    searched = StudyConfig.model_validate({**base, "search": "optuna", "search_space": space,
                                           "optuna": {"num_samples": 3}})
    assert ROUTES["search-space"].planned_line(searched) == "6 sampled by Optuna in 2 search cell(s)"
    bandit = StudyConfig.model_validate({**base, "search": "bandit", "search_space": space, "private_data": False,
                                         "base": {"data": {"source": "public"}}, "bandit": {"num_samples": 4}})
    assert ROUTES["bandit"].planned_line(bandit) == "8 chosen by the bandit in 2 search cell(s)"
    new = replace(ROUTES["pbt"], name="mine", summary="my way of choosing trials", planned=None)
    assert new.planned_line(searched) == "the mine route: my way of choosing trials"
