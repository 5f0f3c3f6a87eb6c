"""A study trial's typed parameters (raydp.study.params.TrialParams) and the plan check: the privacy plan a study's
driver calibrated and charged for a trial is the plan its run runs (raydp.runner.run.run_training's expected_plan)."""

from __future__ import annotations

import json

import pytest
import yaml

from raydp.errors import ConfigError

TINY = {"name": "planned", "models": ["embedded-tiny"], "epsilons": [2.0], "strategies": ["static"],
        "wandb": {"mode": "disabled"},
        "base": {"data": {"n_records": 300}, "max_steps": 2, "warmup_steps": 0, "eval_max_records": 8,
                 "public_eval_records": 8}}


def _study(tmp_path, **changes):
    from raydp.study.config import load_study

    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump({**TINY, **changes}))
    return load_study(path)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """(study, dataset, its one DP trial as the driver planned it), prepared once."""
    from raydp.study.prepare import prepare_study

    root = tmp_path_factory.mktemp("planned")
    study = _study(root)
    dataset, (trial,) = prepare_study(study, root / "out" / study.name, progress=False)
    return study, dataset, trial


def test_trial_params_round_trip_through_tunes_plain_dict(tmp_path):
    from raydp.study.params import TrialParams
    from raydp.study.trial import Trial

    study = _study(tmp_path)
    trial = Trial(model="embedded-tiny", epsilon=2.0, seed=0, strategy="static",
                  privacy_plan={"mechanism": "central", "q": 0.05, "sigma_0": 1.25, "planned_steps": 40})
    shared = TrialParams(study=study, dataset="/data", study_dir="/study", wandb={"mode": "disabled"},
                         n_trials=3, lifetime_nonce="abc")
    grid = TrialParams(**{**shared.__dict__, "trial": trial})
    searched = TrialParams(**{**shared.__dict__, "storage": "s3://b/p", "dataset_remote": "b/p/d",
                              "search_cell": trial.derive(privacy_plan=None), "search": {"clip": 0.5}})
    for params in (shared, grid, searched):
        config = params.to_tune()
        assert json.loads(json.dumps(config)) == config  # plain JSON values only
        assert TrialParams.from_tune(config) == params
    assert grid.expected_plan == trial.privacy_plan
    assert searched.expected_plan is None  # a searched trial is planned when it runs: nothing to compare
    common = shared.to_tune()  # every trial's keys, None or not; the optional ones only where set
    assert set(common) == {"study", "dataset", "study_dir", "wandb", "connection", "log_checkpoints", "n_trials",
                           "lifetime_nonce"}
    with pytest.raises(ConfigError, match="unknown key 'nonsense'"):
        TrialParams.from_tune({**common, "nonsense": 1})
    with pytest.raises(ConfigError, match="n_trials must be an integer"):
        TrialParams.from_tune({**common, "n_trials": "3"})


def test_prepare_study_hands_each_dp_trial_the_plan_it_charged(prepared):
    from raydp.data import load_texts
    from raydp.runner.privacy_setup import plan_private_run, plan_record, training_units
    from raydp.study.grid import trial_config

    study, dataset, trial = prepared
    config = trial_config(study, trial, dataset)
    plan = plan_private_run(config, training_units(config, dataset, len(load_texts(dataset, "train"))).public_count)
    assert trial.privacy_plan == plan_record(plan, config)
    assert trial.privacy_plan["mechanism"] == "central" and trial.privacy_plan["sigma_0"] > 0
    assert "privacy_plan" not in trial.row()  # the plan identifies no arm: results rows do not carry it


def test_a_run_whose_plan_differs_from_the_charged_one_is_refused_before_any_step(prepared, tmp_path, monkeypatch):
    from raydp.runner import run as run_module
    from raydp.study.grid import trial_config

    study, dataset, trial = prepared
    config = trial_config(study, trial, dataset)

    def no_model(*args, **kwargs):
        raise AssertionError("the run went past its plan check")

    monkeypatch.setattr(run_module, "load_model", no_model)  # before the model, so before any step
    charged = dict(trial.privacy_plan)
    for changed in ({"sigma_0": charged["sigma_0"] * 1.01}, {"q": charged["q"] / 2, "planned_steps": 7}):
        with pytest.raises(ConfigError, match="not the one its study charged") as refused:
            run_module.run_training(config, tmp_path / "run", progress=False, charge_lifetime=False,
                                    expected_plan={**charged, **changed})
        assert all(key in str(refused.value) for key in changed)
        assert "epsilon" not in str(refused.value).split("(")[1].split(",")[0]  # only the differing fields
        assert not (tmp_path / "run").exists()
    nonprivate = config.model_copy(update={"strategy": "nonprivate"})
    with pytest.raises(ConfigError, match="mechanism 'central' charged, 'none' here"):
        run_module.run_training(nonprivate, tmp_path / "run", progress=False, expected_plan=charged)


def test_a_run_whose_plan_is_the_charged_one_runs(prepared, tmp_path):
    from raydp.runner.run import run_training
    from raydp.study.grid import trial_config

    study, dataset, trial = prepared
    summary = run_training(trial_config(study, trial, dataset), tmp_path / "run", progress=False,
                           charge_lifetime=False, expected_plan=trial.privacy_plan)
    assert summary["steps"] == 2 and summary["privacy"]["epsilon"] <= 2.0 + 1e-6
