"""The typed trial (raydp/study/trial.py, issue 30): made once from the study config, it round-trips through the
plain dict Tune carries (param_space, a trial's final report) and through a results.parquet row, old rows
included; a bad trial dict is a one-line error naming its key; its arm is the results table's."""

import json

import numpy as np
import pandas as pd
import pytest

from raydp.errors import ConfigError
from raydp.study.arms import arms
from raydp.study.config import StudyConfig
from raydp.study.grid import search_cells, search_trial, trial_config, trial_grid
from raydp.study.trial import Trial, tune_trial

IDENTITY = ("name", "model", "strategy", "epsilon", "seed", "t_rl", "b_sac", "k", "grid", "tuned", "search",
            "frozen")


def make_study(**changes):
    values = {"name": "typed", "models": ["embedded-tiny"], "epsilons": [0.5, 2.0], "seeds": [0, 1],
              "strategies": ["nonprivate", "static-pairwise", "rldp"], "base": {"delta": 1e-5},
              "settings_grid": {"static-pairwise": {"clip": [0.03, 0.1]}, "rldp": {"action_decoding": ["paper",
                                                                                                     "relative"]}},
              "sac_grid": {"t_rl": [16, 112], "b_sac": [4], "k": [2]}, "wandb": {"mode": "disabled"}}
    values.update(changes)
    return StudyConfig(**values)


def transfer_study():
    return make_study(settings_grid={"static-pairwise": {"clip": [0.03]}}, transfer={"source_model": "embedded"},
                      base={"delta": 1e-5, "rldp": {"architecture": "shared"}})


def test_every_planned_trial_round_trips_through_tunes_plain_dict():
    for study in (make_study(), transfer_study(),
                  make_study(strategies=["static", "pbt"], settings_grid={}, search="pbt", epsilons=[2.0], seeds=[0],
                             base={"delta": 1e-5, "eval_every": 4})):
        trials = trial_grid(study)
        assert len({t.name for t in trials}) == len(trials) > 1
        for trial in trials:
            plain = json.loads(json.dumps(trial.to_dict()))  # plain values only: JSON keeps them all
            assert Trial.from_dict(plain) == trial
            assert tune_trial({"trial": plain}) == trial  # a grid trial's Tune config
            assert tune_trial({"trial_specs": {trial.name: plain}, "trial_name": trial.name}) == trial  # older config
            assert trial_config(study, Trial.from_dict(plain)) == trial_config(study, trial)
    assert tune_trial({"t_rl": 16, "b_sac": 4, "k": 2}) is None  # an Optuna-sampled trial: made when it runs


def test_the_grid_plans_strategies_variants_sac_cells_and_transfer_twins():
    trials = trial_grid(make_study())
    nonprivate = [t for t in trials if t.strategy == "nonprivate"]
    assert [(t.epsilon, t.seed) for t in nonprivate] == [(None, 0), (None, 1)]  # one per seed, no epsilon
    rldp = [t for t in trials if t.strategy == "rldp"]
    assert len(rldp) == 2 * 2 * 2 * 2 and {t.t_rl for t in rldp} == {16, 112}  # eps x seed x T_RL x variant
    assert {t.arm.label(cell=False) for t in rldp} == {"rldp [action_decoding=paper]",
                                                       "rldp [action_decoding=relative]"}
    pairwise = [t for t in trials if t.strategy == "static-pairwise"]
    assert {t.variant for t in pairwise} == {"clip=0.03", "clip=0.1"} and all(t.t_rl is None for t in pairwise)

    twins = trial_grid(transfer_study())
    sources = [t for t in twins if t.stage == "source"]
    frozen = [t for t in twins if t.frozen_from]
    assert sources and {t.model for t in sources} == {"embedded"} and len(frozen) == len(sources)
    keys = {s.source_key for s in sources}
    assert all(t.frozen and t.frozen_from in keys and t.name.endswith("_frozen") for t in frozen)
    assert all(t.arm.label().endswith("(frozen policy)") for t in frozen)


def test_a_search_trial_is_its_cell_with_the_sampled_values_and_a_name_of_its_own():
    study = make_study(strategies=["static-pairwise"], settings_grid={}, search="optuna", seeds=[0],
                       search_space={"static-pairwise": {"clip": {"low": 0.01, "high": 1.0, "log": True}}})
    cells = search_cells(study)
    assert [(c.strategy, c.epsilon) for c in cells] == [("static-pairwise", 0.5), ("static-pairwise", 2.0)]
    trial = search_trial(Trial.from_dict(cells[0].to_dict()), {"clip": np.float64(0.25)}, "abc")
    assert trial.search == {"clip": 0.25} and type(trial.search["clip"]) is float  # a numpy value made plain
    assert trial.name == f"{cells[0].name}_optuna-abc" and trial.variant == "clip=0.25"
    assert Trial.from_dict(json.loads(json.dumps(trial.to_dict()))) == trial


def test_a_trial_round_trips_through_a_results_row_and_parquet(tmp_path):
    study = make_study(base={"delta": 1e-5, "rldp": {"frozen": True, "policy": "public-embedded"}},
                       settings_grid={"static-pairwise": {"clip": [0.03]}})
    trials = trial_grid(study)
    assert all(t.frozen == (t.strategy == "rldp") for t in trials)  # the study's controller settings freeze it
    searched = Trial(model="m", epsilon=2.0, seed=3, strategy="clip-schedule", search={"clip": 0.123456},
                     tuned={"lr": 0.001})
    trials.append(searched)
    for trial in trials:
        back = Trial.from_row(trial.row())
        assert {f: getattr(back, f) for f in IDENTITY} == {f: getattr(trial, f) for f in IDENTITY}
        assert back.arm == trial.arm and back.row() == trial.row()
    table = pd.DataFrame([t.row() for t in trials])  # NaN for missing numbers, floats for the SAC cell
    table.to_parquet(tmp_path / "results.parquet", index=False)
    read = pd.read_parquet(tmp_path / "results.parquet")
    assert [Trial.from_row(row) for _, row in read.iterrows()] == [Trial.from_row(t.row()) for t in trials]
    assert list(arms(read)) == [t.arm.label() for t in trials]
    assert list(arms(read, cell=False)) == [t.arm.label(cell=False) for t in trials]


def test_an_old_results_row_without_the_grid_column_still_loads():
    """Rows written before the ``grid`` column: the settings_grid values come back from ``variant`` (less the
    search and tuned values), NaN is missing, numpy numbers are plain; the arm is the one the row always had."""
    old = pd.DataFrame([
        {"trial": "rldp_embedded_eps2_seed0_trl16-b4-k2_actiondecodingpaper", "status": "TERMINATED",
         "model": "embedded", "strategy": "rldp", "epsilon_target": 2.0, "seed": 0, "t_rl": 16.0, "b_sac": 4.0,
         "k": 2.0, "frozen_policy": True, "variant": "action_decoding=paper", "search": None, "tuned": None},
        {"trial": "static-pairwise_embedded_eps2_seed1_clip0.03", "status": "TERMINATED", "model": "embedded",
         "strategy": "static-pairwise", "epsilon_target": 2.0, "seed": 1, "t_rl": np.nan, "b_sac": np.nan,
         "k": np.nan, "frozen_policy": False, "variant": "clip=0.03, lr=0.001", "search": None,
         "tuned": json.dumps({"lr": 0.001})},
        {"trial": "nonprivate_embedded_seed0", "status": "TERMINATED", "model": "embedded", "strategy": "nonprivate",
         "epsilon_target": np.nan, "seed": 0, "t_rl": np.nan, "b_sac": np.nan, "k": np.nan, "frozen_policy": False,
         "variant": None, "search": None, "tuned": None}])
    rldp, pairwise, nonprivate = (Trial.from_row(row) for _, row in old.iterrows())
    assert (rldp.t_rl, rldp.b_sac, rldp.k, rldp.grid, rldp.frozen) == (16, 4, 2, {"action_decoding": "paper"}, True)
    assert type(rldp.t_rl) is int and type(rldp.seed) is int
    assert rldp.name == old["trial"][0] == rldp.default_name()  # the name it ran under, which its fields rebuild
    assert pairwise.grid == {"clip": 0.03} and pairwise.tuned == {"lr": 0.001} and pairwise.variant == old["variant"][1]
    assert nonprivate.epsilon is None and nonprivate.grid is None and nonprivate.t_rl is None
    assert [t.arm.label() for t in (rldp, pairwise, nonprivate)] == list(arms(old))
    with pytest.raises(ConfigError, match="missing column 'strategy'"):
        Trial.from_row(old.drop(columns="strategy").iloc[0])


@pytest.mark.parametrize("bad, key", [
    ({"model": "m", "seed": 0}, "'strategy'"),  # missing
    ({"model": "m", "seed": 0, "strategy": "static", "epsilon_target": 2.0}, "'epsilon_target'"),  # a row's name
    ({"model": "m", "seed": "0", "strategy": "static"}, "seed"),  # wrong type
    ({"model": "m", "seed": None, "strategy": "static"}, "seed"),
    ({"model": "m", "seed": 0, "strategy": "static", "t_rl": 1.5}, "t_rl"),
    ({"model": "m", "seed": 0, "strategy": "static", "grid": [0.1]}, "grid"),
    ({"model": "m", "seed": 0, "strategy": "static", "stage": "later"}, "stage"),
    ({"model": "m", "seed": 0, "strategy": "static", "frozen": "yes"}, "frozen"),
    (["model", "m"], "mapping"),
])
def test_a_bad_trial_dict_is_a_one_line_error_naming_the_key(bad, key):
    with pytest.raises(ConfigError) as exc:
        Trial.from_dict(bad)
    assert key in str(exc.value) and "\n" not in str(exc.value)
    if isinstance(bad, dict):
        with pytest.raises(ConfigError, match=key):
            tune_trial({"trial": bad})


def test_the_controller_settings_are_the_studys_block_with_the_trials_grid_values_over_it():
    study = make_study(base={"delta": 1e-5, "rldp": {"privacy_mode": "paper", "action_decoding": "paper"}})
    rldp = next(t for t in trial_grid(study) if t.strategy == "rldp" and t.grid == {"action_decoding": "relative"})
    assert rldp.controller_settings(study) == {"privacy_mode": "paper", "action_decoding": "relative"}
    assert trial_config(study, rldp).strategy_settings().action_decoding == "relative"
    static = next(t for t in trial_grid(study) if t.strategy == "static-pairwise")
    assert static.controller_settings(study) == {}


def test_a_trial_is_read_by_attribute_only():
    trial = Trial(model="m", seed=0, strategy="static", epsilon=2)
    assert trial.epsilon == 2.0 and type(trial.epsilon) is float and trial.name == "static_m_eps2_seed0"
    with pytest.raises(TypeError):
        trial["name"]  # no dict reads left
    with pytest.raises(Exception):
        trial.seed = 1  # frozen


def test_a_non_private_arms_run_fields_are_searched_on_public_data_in_one_cell_per_model():
    """search_space may name the non-private arm (its run fields: lr, schedule, warm-up, weight decay) on public
    data, searched by Optuna: one cell per model without an epsilon, its best values keyed by epsilon None, which a
    study's non-private trials take through tuned_from. On private data it is refused (trained without DP, its
    choice would be an unaccounted release)."""
    from raydp.study.results import search_best
    from raydp.study.searches import search_run_name

    space = {"nonprivate": {"lr": {"low": 1e-4, "high": 1e-2, "log": True}, "weight_decay": {"low": 0.0, "high": 0.1}}}
    public = {"name": "np", "models": ["embedded-tiny"], "epsilons": [0.5, 2.0], "seeds": [0],
              "strategies": ["nonprivate"], "search": "optuna", "search_space": space, "private_data": False,
              "base": {"data": {"source": "public"}}, "wandb": {"mode": "disabled"}}
    study = StudyConfig(**public)
    cells = search_cells(study)
    assert [(c.strategy, c.model, c.epsilon) for c in cells] == [("nonprivate", "embedded-tiny", None)]
    assert search_run_name(study, cells[0]) == "np-search-nonprivate-embedded-tiny" and trial_grid(study) == []
    sampled = trial_config(study, search_trial(cells[0], {"lr": 0.002, "weight_decay": 0.05}, "ab12"))
    assert (sampled.strategy, sampled.lr, sampled.weight_decay) == ("nonprivate", 0.002, 0.05)
    with pytest.raises(ValueError, match="non-private arm's run fields are searched by Optuna on public data only"):
        StudyConfig(**{**public, "private_data": True, "base": {}})
    table = pd.DataFrame([{"trial": f"t{i}", "strategy": "nonprivate", "model": "embedded-tiny",
                           "epsilon_target": np.nan, "status": "TERMINATED", "search": json.dumps({"lr": lr}),
                           "final_public_value_nll": value} for i, (lr, value) in enumerate(((1e-3, 60.0),
                                                                                             (2e-3, 58.5)))])
    best = search_best(table, "public", "value_nll")
    assert best == [{"strategy": "nonprivate", "model": "embedded-tiny", "epsilon": None, "trials": 2,
                     "best": {"lr": 2e-3}, "final_public_value_nll": 58.5, "trial": "t1"}]
