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
    shared = TrialParams(study=study, dataset="/data", dataset_id="rdi1:" + "a" * 32, study_dir="/study",
                         wandb={"mode": "disabled"}, n_trials=3, lifetime_nonce="abc")
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
    assert set(common) == {"study", "dataset", "dataset_id", "study_dir", "wandb", "connection", "log_checkpoints",
                           "n_trials", "lifetime_nonce"}
    with pytest.raises(ConfigError, match="unknown key 'nonsense'"):
        TrialParams.from_tune({**common, "nonsense": 1})
    with pytest.raises(ConfigError, match="n_trials must be an integer"):
        TrialParams.from_tune({**common, "n_trials": "3"})
    # a trial that does not know the driver's dataset could not tell its own copy from the one it was charged on
    with pytest.raises(ConfigError, match="missing key 'dataset_id'"):
        TrialParams.from_tune({k: v for k, v in common.items() if k != "dataset_id"})


def test_trial_params_built_on_the_driver_carry_the_driver_datasets_id(prepared):
    from raydp.data import load_manifest, manifest_id
    from raydp.study.params import TrialParams

    study, dataset, _ = prepared
    params = TrialParams(study=study, dataset=dataset, study_dir="/study")
    assert params.dataset_id == manifest_id(load_manifest(dataset)) and params.dataset_id.startswith("rdi1:")
    assert TrialParams.from_tune(params.to_tune()).dataset_id == params.dataset_id


def test_prepare_study_hands_each_dp_trial_the_plan_it_charged(prepared):
    from raydp.data import load_manifest, load_texts, manifest_id
    from raydp.runner.privacy_setup import plan_private_run, plan_record, training_units
    from raydp.study.grid import trial_config

    study, dataset, trial = prepared
    config = trial_config(study, trial, dataset)
    units = training_units(config, dataset, len(load_texts(dataset, "train")))
    plan = plan_private_run(config, units.public_count)
    dataset_id = manifest_id(load_manifest(dataset))
    assert trial.privacy_plan == plan_record(plan, config, units, dataset_id)
    assert trial.privacy_plan["mechanism"] == "central" and trial.privacy_plan["sigma_0"] > 0
    # the plan names what it was charged on: the dataset, the privacy unit and the unit count N
    assert trial.privacy_plan["dataset_id"] == dataset_id
    assert (trial.privacy_plan["privacy_unit"], trial.privacy_plan["units"]) == (units.name, units.public_count)
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


@pytest.fixture(scope="module")
def other_copy(prepared, tmp_path_factory):
    """A dataset built as the study's was but with another canary_seed: the same size, so the same plan numbers."""
    from raydp.data import load_manifest, manifest_id, resolve_dataset
    from raydp.study.grid import trial_config

    study, dataset, trial = prepared
    data = trial_config(study, trial).data.model_copy(update={"canary_seed": 7})
    other = str(resolve_dataset(data, tmp_path_factory.mktemp("other") / "dataset", progress=False))
    assert manifest_id(load_manifest(other)) != manifest_id(load_manifest(dataset))
    return other


def test_a_run_on_another_copy_of_the_data_than_the_charged_one_is_refused_naming_the_dataset(
        prepared, other_copy, tmp_path, monkeypatch):
    """Two datasets of one size plan the same q, steps and sigma_0: only the plan's dataset id tells them apart."""
    from raydp.data import load_manifest, manifest_id
    from raydp.runner import run as run_module
    from raydp.study.grid import trial_config

    study, dataset, trial = prepared

    def no_model(*args, **kwargs):
        raise AssertionError("the run went past its plan check")

    monkeypatch.setattr(run_module, "load_model", no_model)  # before the model, so before any step
    config = trial_config(study, trial, other_copy)
    with pytest.raises(ConfigError, match="not the one its study charged") as refused:
        run_module.run_training(config, tmp_path / "run", progress=False, charge_lifetime=False,
                                expected_plan=trial.privacy_plan)
    message = str(refused.value)
    assert f"dataset_id {manifest_id(load_manifest(dataset))!r} charged" in message
    assert f"{manifest_id(load_manifest(other_copy))!r} here" in message
    assert "sigma_0" not in message and "planned_steps" not in message  # the numbers agree: only the dataset differs
    assert not (tmp_path / "run").exists()


def test_a_trials_lifetime_receipt_names_the_drivers_dataset_not_its_own_copy(prepared, other_copy, tmp_path,
                                                                               monkeypatch):
    """The trainable's receipt is the driver's charge: on another copy, run_training's check_receipt refuses it."""
    from raydp.data import load_manifest, manifest_id
    from raydp.privacy.lifetime import check_receipt
    from raydp.study import trainable
    from raydp.study.params import TrialParams

    study, dataset, trial = prepared
    held = {}

    def stop_at_run(config, output, **kwargs):
        held.update(kwargs)
        raise RuntimeError("stopped before the run")

    monkeypatch.setattr(trainable, "run_training", stop_at_run)
    monkeypatch.setattr(trainable, "_restore_point", lambda workdir: (None, None))  # no Tune session here
    params = TrialParams(study=study, dataset=other_copy, dataset_id=manifest_id(load_manifest(dataset)),
                         study_dir=str(tmp_path / "study"), lifetime_nonce="n0", trial=trial)
    with pytest.raises(RuntimeError, match="stopped before the run"):
        trainable._run_trial(params.to_tune())
    receipt = held["_charged_by"]
    assert receipt.dataset_id == params.dataset_id and receipt.label == f"study:n0/{trial.name}"
    assert held["expected_plan"] == trial.privacy_plan
    with pytest.raises(ConfigError, match="not on this run's dataset"):
        check_receipt(receipt, manifest_id(load_manifest(other_copy)))


def _node_cache(monkeypatch, tmp_path):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "node-tmp"))  # this node's temporary folder
    (tmp_path / "node-tmp").mkdir(mode=0o700)


def test_a_nodes_stale_dataset_copy_is_fetched_again_and_replaced(prepared, other_copy, tmp_path, monkeypatch):
    import hashlib
    import shutil

    import pyarrow.fs

    from raydp.data import load_manifest, manifest_id
    from raydp.files import user_scratch
    from raydp.study import trainable
    from raydp.study.params import TrialParams

    study, dataset, _ = prepared
    _node_cache(monkeypatch, tmp_path)
    storage = tmp_path / "storage"
    remote = storage / study.name / "dataset"
    shutil.copytree(dataset, remote)
    params = TrialParams(study=study, dataset=dataset, study_dir=str(tmp_path / "study"), storage=str(storage),
                         dataset_remote=str(remote))
    cache = user_scratch("datasets")
    key = hashlib.sha256(str(remote).encode()).hexdigest()[:16]
    shutil.copytree(other_copy, cache / key)  # an earlier study of this name and storage left its dataset here
    local = trainable.node_local_dataset(params)
    assert local == str(cache / key)
    assert manifest_id(load_manifest(local)) == params.dataset_id == manifest_id(load_manifest(dataset))
    assert sorted(p.name for p in cache.iterdir()) == sorted([key, f"{key}.lock"])  # no partial or stale left

    def no_fetch(*args, **kwargs):
        raise AssertionError("the node's copy is the driver's dataset: nothing to fetch")

    monkeypatch.setattr(pyarrow.fs, "copy_files", no_fetch)
    assert trainable.node_local_dataset(params) == local  # the right copy is kept


def test_a_storage_holding_another_dataset_than_the_charged_one_is_refused(prepared, other_copy, tmp_path,
                                                                          monkeypatch):
    import shutil

    from raydp.data import load_manifest, manifest_id
    from raydp.files import user_scratch
    from raydp.study import trainable
    from raydp.study.params import TrialParams

    study, dataset, _ = prepared
    _node_cache(monkeypatch, tmp_path)
    remote = tmp_path / "storage" / study.name / "dataset"
    shutil.copytree(other_copy, remote)
    params = TrialParams(study=study, dataset=dataset, study_dir=str(tmp_path / "study"),
                         storage=str(tmp_path / "storage"), dataset_remote=str(remote))
    with pytest.raises(ConfigError, match=f"holds dataset {manifest_id(load_manifest(other_copy))}, not "
                                          f"{manifest_id(load_manifest(dataset))}"):
        trainable.node_local_dataset(params)
    assert list(user_scratch("datasets").iterdir()) == []  # nothing kept


def test_a_dp_trial_without_a_plan_is_refused_on_a_dataset_with_a_lifetime_budget(prepared, tmp_path):
    """A searched trial carries no plan; which routes plan their trials is each route's own word, so the trial
    checks it: on a budgeted dataset only a plan the driver charged may run."""
    import shutil

    from raydp.data import load_manifest
    from raydp.study.grid import trial_config
    from raydp.study.trainable import check_trial_charged

    study, dataset, trial = prepared
    budgeted = tmp_path / "budgeted"
    shutil.copytree(dataset, budgeted)
    manifest = load_manifest(budgeted)
    (budgeted / "manifest.json").write_text(json.dumps({**manifest, "lifetime_budget": True}))
    config = trial_config(study, trial, str(budgeted))
    with pytest.raises(ConfigError, match="the study's driver did not plan and charge it") as refused:
        check_trial_charged(None, config, str(budgeted))
    assert manifest["dataset_id"] in str(refused.value) and "\n" not in str(refused.value)
    check_trial_charged(trial.privacy_plan, config, str(budgeted))  # planned and charged: its run compares the plan
    check_trial_charged(None, trial_config(study, trial, dataset), dataset)  # no budget: nothing to charge first
    nonprivate = config.model_copy(update={"strategy": "nonprivate"})
    check_trial_charged(None, nonprivate, str(budgeted))  # a non-private trial spends nothing
