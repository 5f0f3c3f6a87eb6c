"""A dataset's lifetime privacy budget (issue 32): set once by the owner, every DP run and study charged its plan,
and a run or study that would pass it refused before it starts, with one line and nothing written. The composed
figure is checked against dp_accounting composing the same planned steps (an independent accountant)."""

from __future__ import annotations

import json

import dp_accounting
import pytest

from raydp.cli import main
from raydp.config import TrainConfig, validate_config
from raydp.data import load_manifest, load_texts, manifest_id
from raydp.errors import ConfigError
from raydp.privacy.accounting.rdp import DEFAULT_ORDERS
from raydp.privacy.lifetime import (
    charge, read_budget, register_path, set_budget, set_dataset_budget, spent_epsilon)
from raydp.data.splits import build_dataset
from raydp.runner.privacy_setup import plan_private_run, training_units
from tests._support import copy_dataset


@pytest.fixture(scope="module", autouse=True)
def own_owner_key(tmp_path_factory):
    """This module's datasets under an owner key of their own: the same records under the session's key have the
    same id as other tests' datasets, which must not inherit the budgets set here."""
    import os

    before = os.environ.get("RAYDP_OWNER_KEY")
    os.environ["RAYDP_OWNER_KEY"] = str(tmp_path_factory.mktemp("lifetime-owner") / "owner.key")
    yield
    if before is None:
        os.environ.pop("RAYDP_OWNER_KEY", None)
    else:
        os.environ["RAYDP_OWNER_KEY"] = before


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, own_owner_key, small_dataset):
    """The session's small dataset, copied: this module writes a lifetime budget into it (its register under this
    module's owner key)."""
    return copy_dataset(small_dataset, tmp_path_factory.mktemp("budgeted") / "data")


def tiny(dataset, **overrides) -> TrainConfig:
    values = {"model": "embedded-tiny", "strategy": "static", "epsilon": 2.0, "data": {"source": str(dataset)},
              "max_steps": 6, "eval_max_records": 8, "public_eval_records": 8, "warmup_steps": 2}
    values.update(overrides)
    return validate_config(TrainConfig, values)


def dp_accounting_epsilon(plans, delta: float) -> float:
    """The same planned steps composed by dp_accounting's RDP accountant (constant sigma plans)."""
    accountant = dp_accounting.rdp.RdpAccountant(list(DEFAULT_ORDERS))
    for plan in plans:
        event = dp_accounting.PoissonSampledDpEvent(plan.q, dp_accounting.GaussianDpEvent(plan.sigma_map(plan.sigma_0)))
        accountant.compose(event, plan.planned_steps)
    return accountant.get_epsilon(delta)


def test_a_run_past_the_lifetime_budget_is_refused_before_it_starts(dataset, tmp_path, capsys):
    from raydp.runner.launch import train

    dataset_id = manifest_id(load_manifest(dataset))
    assert main(["data", "budget", str(dataset)]) == 0 and "no lifetime budget" in capsys.readouterr().out
    assert main(["data", "budget", str(dataset), "--epsilon", "2.5", "--delta", "1e-5"]) == 0
    assert load_manifest(dataset)["lifetime_budget"] == {"epsilon": 2.5, "delta": 1e-5, "privacy_unit": "patient"}
    from raydp.data.identity import owner_key_path

    assert register_path(dataset_id).is_file() and register_path(dataset_id).parents[1] == owner_key_path().parent
    config = tiny(dataset)
    units = training_units(config, str(dataset), len(load_texts(dataset, "train")))
    plan = plan_private_run(config, units.public_count)
    one, two = dp_accounting_epsilon([plan], 1e-5), dp_accounting_epsilon([plan, plan], 1e-5)
    assert one < 2.5 < two  # so the first run fits and the second does not

    train(config, tmp_path / "first", progress=False)
    register = read_budget(dataset_id)
    assert [label.split("#")[0] for label in register["charges"]] == [f"run:{(tmp_path / 'first').resolve()}"]
    assert spent_epsilon(register) == pytest.approx(one, rel=1e-3)
    summary = (tmp_path / "first" / "summary.json").read_text()
    with pytest.raises(ConfigError, match="past its lifetime budget"):  # a rerun into the same directory spends again
        train(config, tmp_path / "first", overwrite=True, progress=False)
    assert (tmp_path / "first" / "summary.json").read_text() == summary  # the first run's outputs untouched

    with pytest.raises(ConfigError, match=r"lifetime spend to epsilon=.*past its lifetime budget 2.5 .*nothing was started"):
        train(config, tmp_path / "second", progress=False)
    assert not (tmp_path / "second").exists() and len(read_budget(dataset_id)["charges"]) == 1
    assert main(["train", "--source", str(dataset), "--model", "embedded-tiny", "--strategy", "static",
                 "--epsilon", "2", "--output", str(tmp_path / "cli"), "--quiet", "--max-steps", "6"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "past its lifetime budget" in err[0] and not (tmp_path / "cli").exists()
    assert main(["data", "budget", str(dataset)]) == 0
    assert f"composed epsilon {one:.3f}" in capsys.readouterr().out

    # the budget is set once; a non-private run releases nothing and is not charged
    with pytest.raises(ConfigError, match="it is set once"):
        set_budget(dataset_id, 5.0, 1e-5)
    train(tiny(dataset, strategy="nonprivate", epsilon=None), tmp_path / "plain", progress=False)
    assert len(read_budget(dataset_id)["charges"]) == 1


def test_composition_matches_dp_accounting_and_charges_are_atomic(tmp_path, monkeypatch):
    """Two fixed plans and an adaptive one (its Renyi-filter budget) composed by the register, against
    dp_accounting composing the same steps; a refused charge writes nothing."""
    monkeypatch.setenv("RAYDP_OWNER_KEY", str(tmp_path / "owner.key"))
    from raydp.runner.privacy_setup import PrivacyPlan, planned_rdp_curve

    dataset_id = "rdi1:" + "ab" * 16
    set_budget(dataset_id, 10.0, 1e-6)
    plans = [PrivacyPlan(q=0.02, planned_steps=300, sigma_0=1.1), PrivacyPlan(q=0.05, planned_steps=100, sigma_0=2.0)]
    after = charge(dataset_id, {f"r{i}": planned_rdp_curve(p, 1e-6) for i, p in enumerate(plans)})
    assert after == pytest.approx(dp_accounting_epsilon(plans, 1e-6), rel=1e-6)
    adaptive = PrivacyPlan(q=0.02, planned_steps=300, sigma_0=1.1, accountant="rdp", adaptive=True)
    curve = planned_rdp_curve(adaptive, 1e-6)  # the filter's budget: the same steps, with the filter's slack
    assert (curve >= planned_rdp_curve(plans[0], 1e-6)).all() and curve[3] == pytest.approx(
        planned_rdp_curve(plans[0], 1e-6)[3], rel=1e-3)
    before = register_path(dataset_id).read_bytes()
    with pytest.raises(ConfigError, match="past its lifetime budget 10"):
        charge(dataset_id, {f"big{i}": planned_rdp_curve(plans[0], 1e-6) for i in range(40)})
    assert register_path(dataset_id).read_bytes() == before
    assert oct(register_path(dataset_id).stat().st_mode & 0o777) == "0o600"
    assert charge(dataset_id, {"r0": planned_rdp_curve(plans[0], 1e-6)}) == pytest.approx(after)  # already charged
    with pytest.raises(ConfigError, match="not a private dataset id"):
        set_budget("public:" + "0" * 64, 1.0, 1e-5)
    with pytest.raises(ConfigError, match="0 < epsilon"):
        set_budget("rdi1:" + "cd" * 16, -1.0, 1e-5)
    assert json.loads(register_path(dataset_id).read_text())["dataset_id"] == dataset_id


def test_a_study_is_charged_once_per_study_run_and_refused_past_the_budget(tmp_path):
    """All of a grid study's DP trials are charged in one step before any starts, under the study run's tag: a
    resume (same tag) is not charged again, the same study run again (a new tag) is, and a study that would pass
    the budget is refused with nothing charged. Optuna studies are refused on a budgeted dataset."""
    from raydp.study.config import load_study
    from raydp.study.prepare import LIFETIME_NONCE, prepare_study, study_lifetime_nonce, write_lifetime_nonce
    from tests.test_study import write_study

    data = tmp_path / "data"
    manifest = build_dataset(data, n_records=401, progress=False)
    dataset_id = manifest_id(manifest)
    register = set_budget(dataset_id, 4.0, 1e-5, source_sha256=manifest.get("source_sha256"))
    assert {k: register[k] for k in ("epsilon", "delta", "privacy_unit")} == {
        "epsilon": 4.0, "delta": 1e-5, "privacy_unit": "patient"}
    base = {"data": {"source": str(data)}, "max_steps": 6}
    one = load_study(write_study(tmp_path, name="one", strategies=["static"], base=base, wandb={"mode": "disabled"}))
    prepare_study(one, tmp_path / "out" / "one", progress=False, charge_lifetime=True, lifetime_nonce="first")
    charges = read_budget(dataset_id)["charges"]
    assert list(charges) == ["study:first/static_embedded-tiny_eps2_seed0"]
    prepare_study(one, tmp_path / "out" / "one", progress=False, charge_lifetime=True, lifetime_nonce="first")
    assert read_budget(dataset_id)["charges"] == charges  # resumed: not charged twice
    prepare_study(one, tmp_path / "out" / "one", progress=False, lifetime_nonce="again")  # --check: checks only
    assert read_budget(dataset_id)["charges"] == charges
    prepare_study(one, tmp_path / "out" / "one", progress=False, charge_lifetime=True, lifetime_nonce="again")
    assert len(read_budget(dataset_id)["charges"]) == 2  # the same study run again spends again

    many = load_study(write_study(tmp_path, name="many", seeds=[0, 1, 2, 3], strategies=["static"], base=base,
                                  wandb={"mode": "disabled"}))
    with pytest.raises(ConfigError, match="4 more run\\(s\\) would take its lifetime spend"):
        prepare_study(many, tmp_path / "out" / "many", progress=False, charge_lifetime=True)
    assert len(read_budget(dataset_id)["charges"]) == 2
    search = load_study(write_study(tmp_path, name="searched", strategies=["static"], base=base, search="optuna",
                                    search_space={"static": {"clip": {"low": 0.01, "high": 1.0, "log": True}}},
                                    wandb={"mode": "disabled"}))
    with pytest.raises(ConfigError, match="must be a grid"):
        prepare_study(search, tmp_path / "out" / search.name, progress=False)

    study_dir = tmp_path / "out" / "resumed"
    write_lifetime_nonce(study_dir, "kept")
    assert study_lifetime_nonce(study_dir, resume=True) == "kept"
    assert study_lifetime_nonce(study_dir, resume=False) != "kept"
    # a copy of the directory (or its tag pasted elsewhere) resumed there runs its trials again: charged again
    import shutil

    shutil.copytree(study_dir, tmp_path / "copy")
    assert study_lifetime_nonce(tmp_path / "copy", resume=True) != "kept"
    (study_dir / LIFETIME_NONCE).write_text("kept\n")  # a tag without its directory (an older study): a new one
    assert study_lifetime_nonce(study_dir, resume=True) != "kept"


def test_a_budgeted_dataset_refuses_what_a_charge_cannot_cover(dataset, tmp_path, monkeypatch):
    """Fail closed and refuse: a run whose epsilon carries caveats (paper mode, void randomness), a local-DP
    plan, another privacy unit, and any run when the dataset says it is budgeted but its register is not found
    (another owner key on this machine)."""
    from raydp.runner.privacy_setup import LifetimeCharge, PrivacyPlan, charge_lifetime

    manifest = load_manifest(dataset)
    if read_budget(manifest_id(manifest)) is None:  # when run alone
        set_dataset_budget(dataset, 2.5, 1e-5)
        manifest = load_manifest(dataset)
    plan = PrivacyPlan(q=0.01, planned_steps=10, sigma_0=5.0)
    with pytest.raises(ConfigError, match="caveats \\(paper mode"):
        charge_lifetime(manifest, {"x": LifetimeCharge(plan, 1e-5, "patient", ("paper mode",))}, commit=False)
    with pytest.raises(ConfigError, match="local-DP"):
        charge_lifetime(manifest, {"x": LifetimeCharge(object(), 1e-5, "patient")}, commit=False)
    with pytest.raises(ConfigError, match="per patient: a run protecting each record"):
        charge_lifetime(manifest, {"x": LifetimeCharge(plan, 1e-5, "record")}, commit=False)
    assert charge_lifetime(manifest, {"x": LifetimeCharge(plan, 1e-5, "patient")}, commit=False) is not None
    monkeypatch.setenv("RAYDP_OWNER_KEY", str(tmp_path / "other.key"))
    with pytest.raises(ConfigError, match="has a lifetime budget, but its register is not at"):
        charge_lifetime(manifest, {"x": LifetimeCharge(plan, 1e-5, "patient")}, commit=False)
    other = tmp_path / "other"
    build_dataset(other, n_records=402, progress=False)
    with pytest.raises(ConfigError, match="1/N units"):  # delta >= 1/N units
        set_dataset_budget(other, 1, 0.01)
    assert "lifetime_budget" not in load_manifest(other)


def test_a_trainer_given_the_dataset_directory_fails_closed(tmp_path, monkeypatch):
    """Second review, finding 4: DPTraining given only a dataset_id cannot know that the dataset has a budget, so a
    missing register meant an uncharged run. Given the dataset directory, its manifest says so: charged, or refused
    where the register is not found; given the id alone, refused wherever its register is not found."""
    from raydp.integrations.transformers import DPTraining
    from raydp.model import load_model

    data = tmp_path / "data"
    build_dataset(data, n_records=403, progress=False)
    set_dataset_budget(data, 6, 1e-5)  # the manifest says so too
    assert load_manifest(data)["lifetime_budget"] == {"epsilon": 6, "delta": 1e-5, "privacy_unit": "patient"}
    dataset_id = manifest_id(load_manifest(data))
    from raydp.data import load_units

    texts = load_texts(data, "train")
    loaded = load_model("embedded-tiny", progress=False)
    settings = dict(strategy="static", epsilon=2.0, delta=1e-5, batch_size=8, epochs=1, max_length=64,
                    units=load_units(data, "train"))  # per patient, as the budget
    DPTraining(loaded.model, texts, loaded.tokenizer, **settings, dataset=data)
    assert len(read_budget(dataset_id)["charges"]) == 1  # charged at set-up
    with pytest.raises(ConfigError, match="dataset_id is not the id of"):
        DPTraining(loaded.model, texts, loaded.tokenizer, **settings, dataset=data, dataset_id="rdi1:" + "e" * 64)
    monkeypatch.setenv("RAYDP_OWNER_KEY", str(tmp_path / "another.key"))  # another machine's owner key
    with pytest.raises(ConfigError, match="has a lifetime budget, but its register is not at"):
        DPTraining(loaded.model, texts, loaded.tokenizer, **settings, dataset=data)
    # the id alone, where its register is not: it cannot tell whether the dataset has a budget, so it is refused,
    # with or without an owner key here, and whatever this key built (review 3: a key's own builds proved nothing)
    with pytest.raises(ConfigError, match="may have a lifetime budget that this machine cannot see from its id alone"):
        DPTraining(loaded.model, texts, loaded.tokenizer, **settings, dataset_id=dataset_id)
    build_dataset(tmp_path / "here", n_records=403, progress=False)  # the same records
    with pytest.raises(ConfigError, match="cannot see from its id alone"):
        DPTraining(loaded.model, texts, loaded.tokenizer, **settings,
                   dataset_id=manifest_id(load_manifest(tmp_path / "here")))
    monkeypatch.undo()  # the owner's machine, where its register is: the id alone is charged
    DPTraining(loaded.model, texts, loaded.tokenizer, **settings, dataset_id=dataset_id)
    assert len(read_budget(dataset_id)["charges"]) == 2


def test_the_budget_follows_the_source_under_another_owner_key(tmp_path, monkeypatch):
    """Issue 32, review finding 3: the same source built under another owner key has another id; its runs are
    charged to the budget set under the first (the register's salted source tag), and the register holds no plain
    fingerprint of the source."""
    from raydp.privacy.lifetime import register_for
    from raydp.runner.privacy_setup import PrivacyPlan, planned_rdp_curve

    monkeypatch.setenv("RAYDP_OWNER_KEY", str(tmp_path / "owner.key"))
    source = "cd" * 32  # a manifest's source_sha256
    first, rebuilt, other = "rdi1:" + "01" * 16, "rdi1:" + "02" * 16, "rdi1:" + "03" * 16
    set_budget(first, 3.0, 1e-6, source_sha256=source)
    text = register_path(first).read_text()
    assert source not in text and json.loads(text)["source_tag"]["hmac"] != source
    assert register_for(rebuilt, source) == register_path(first)  # the same source: its budget
    assert register_for(rebuilt, "ef" * 32) == register_path(rebuilt)  # another source: none
    assert register_for(rebuilt) == register_path(rebuilt) and read_budget(other, "ef" * 32) is None

    plan = PrivacyPlan(q=0.02, planned_steps=300, sigma_0=1.1)
    one = charge(rebuilt, {"a": planned_rdp_curve(plan, 1e-6)}, source_sha256=source)
    assert one == pytest.approx(dp_accounting_epsilon([plan], 1e-6), rel=1e-6) and one < 3.0
    assert list(read_budget(first)["charges"]) == ["a"] and not register_path(rebuilt).exists()
    with pytest.raises(ConfigError, match="past its lifetime budget 3"):
        charge(rebuilt, {f"b{i}": planned_rdp_curve(plan, 1e-6) for i in range(3)}, source_sha256=source)
    assert rebuilt in read_budget(first)["aliases"]  # adopted when charged: the id alone finds the budget now
    with pytest.raises(ConfigError, match="past its lifetime budget 3"):
        charge(rebuilt, {"c0": planned_rdp_curve(plan, 1e-6), "c1": planned_rdp_curve(plan, 1e-6)})
    assert charge(other, {"d": planned_rdp_curve(plan, 1e-6)}) is None  # another dataset: no budget


def test_a_source_rebuilt_under_a_new_owner_key_keeps_its_budget(tmp_path, monkeypatch, capsys):
    """End to end (review finding 3): a CSV built and budgeted under one owner key, rebuilt under a new key beside
    it, is another dataset id; `raydp data budget` shows the first budget and a run on the rebuild is charged to it."""
    from raydp.data.synthetic import generate_records
    from raydp.runner.launch import train

    generate_records(400, seed=11, progress=False).to_csv(tmp_path / "diabetic_data.csv", index=False)
    monkeypatch.setenv("RAYDP_OWNER_KEY", str(tmp_path / "keys" / "first.key"))
    assert main(["data", "build", "--source", str(tmp_path / "diabetic_data.csv"), "--output", str(tmp_path / "a")]) == 0
    first = manifest_id(load_manifest(tmp_path / "a"))
    plan = plan_private_run(tiny(tmp_path / "a"), training_units(tiny(tmp_path / "a"), str(tmp_path / "a"), len(
        load_texts(tmp_path / "a", "train"))).public_count)
    budget = (dp_accounting_epsilon([plan], 1e-5) + dp_accounting_epsilon([plan, plan], 1e-5)) / 2  # fits one run
    set_dataset_budget(tmp_path / "a", float(f"{budget:.4f}"), 1e-5)

    monkeypatch.setenv("RAYDP_OWNER_KEY", str(tmp_path / "keys" / "second.key"))  # a new key, the same budgets/
    assert main(["data", "build", "--source", str(tmp_path / "diabetic_data.csv"), "--output", str(tmp_path / "b")]) == 0
    rebuilt = manifest_id(load_manifest(tmp_path / "b"))
    assert rebuilt != first and not load_manifest(tmp_path / "b").get("lifetime_budget")
    capsys.readouterr()
    assert main(["data", "budget", str(tmp_path / "b")]) == 0
    assert f"lifetime budget epsilon={float(f'{budget:.4f}'):g}" in capsys.readouterr().out
    assert read_budget(rebuilt) == read_budget(first) and rebuilt in read_budget(first)["aliases"]  # the id alone
    train(tiny(tmp_path / "b"), tmp_path / "run", progress=False)
    assert len(read_budget(first)["charges"]) == 1 and not register_path(rebuilt).exists()
    with pytest.raises(ConfigError, match="past its lifetime budget"):
        train(tiny(tmp_path / "b"), tmp_path / "again", progress=False)
    assert not (tmp_path / "again").exists()


def test_a_register_that_cannot_be_read_fails_closed_when_looking_for_a_source(tmp_path, monkeypatch):
    """Review 2, F2: the search for a rebuilt source's budget skipped a register it could not read, so a truncated
    register left the rebuild's runs uncharged. It is now an error, and nothing is charged."""
    from raydp.runner.privacy_setup import PrivacyPlan, planned_rdp_curve

    monkeypatch.setenv("RAYDP_OWNER_KEY", str(tmp_path / "owner.key"))
    source, first, rebuilt = "cd" * 32, "rdi1:" + "01" * 16, "rdi1:" + "02" * 16
    set_budget(first, 3.0, 1e-6, source_sha256=source)
    path = register_path(first)
    path.write_text(path.read_text()[:-5])
    curve = planned_rdp_curve(PrivacyPlan(q=0.02, planned_steps=300, sigma_0=1.1), 1e-6)
    with pytest.raises(ConfigError, match="cannot be read.*nothing was started"):
        charge(rebuilt, {"a": curve}, source_sha256=source)
    assert not register_path(rebuilt).exists()


def test_malformed_or_linked_registers_fail_closed(tmp_path, monkeypatch):
    """Review 3: an alias list that is not a list of ids, and a register that is a link, are errors (a string of
    aliases matched as a substring; a charge replaced the link instead of charging the register it named)."""
    monkeypatch.setenv("RAYDP_OWNER_KEY", str(tmp_path / "owner.key"))
    first, other = "rdi1:" + "01" * 16, "rdi1:" + "03" * 16
    set_budget(first, 3.0, 1e-6, source_sha256="cd" * 32)
    register = json.loads(register_path(first).read_text())
    register_path(first).write_text(json.dumps({**register, "aliases": "junk" + other + "junk"}))
    with pytest.raises(ConfigError, match="aliases must be a list of dataset ids"):
        read_budget(other)
    register_path(first).write_text(json.dumps(register))
    register_path(other).symlink_to(register_path(first))
    with pytest.raises(ConfigError, match="must not be a link"):
        read_budget(other)


def test_two_budgets_set_at_once_on_one_source_make_one_register(tmp_path, monkeypatch):
    """Two builds of one source (two ids) budgeted at the same moment: the lookup of the source's register and the
    creation of one are one locked step, so the second finds the first's register. The lookup is slowed down here so
    that without the directory lock both would find none and create two (the race review 3 documented)."""
    import threading
    import time

    import raydp.privacy.lifetime as lifetime

    monkeypatch.setenv("RAYDP_OWNER_KEY", str(tmp_path / "owner.key"))
    source = "ab" * 32
    ids = ["rdi1:" + "0a" * 16, "rdi1:" + "0b" * 16]
    looked_up = lifetime.register_for

    def slow_lookup(*args, **kwargs):
        found = looked_up(*args, **kwargs)
        time.sleep(0.3)  # both threads inside the window between finding no register and creating one
        return found

    monkeypatch.setattr(lifetime, "register_for", slow_lookup)
    errors = []

    def set_one(dataset_id):
        try:
            set_budget(dataset_id, 4.0, 1e-6, source_sha256=source)
        except ConfigError as exc:  # the same values: the second call returns the first's register
            errors.append(exc)

    threads = [threading.Thread(target=set_one, args=(i,)) for i in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    registers = sorted(p.name for p in register_path(ids[0]).parent.glob("*.json"))
    assert not errors and len(registers) == 1
    assert read_budget(ids[1], source)["dataset_id"] == read_budget(ids[0], source)["dataset_id"]


def test_a_rebuild_with_another_split_seed_fraction_or_cap_is_charged_to_the_budget(tmp_path, monkeypatch):
    """A source file built again under the same owner key with another split seed, split fraction and sample fraction has
    another dataset id, and its runs are charged to the budget set on the first build (the register matches the
    manifest's fingerprint of the source file, which the build's settings do not change). docs/privacy.md said such a
    rebuild has no budget: its sentence must say that it is charged."""
    from pathlib import Path

    from raydp.config import DataConfig
    from raydp.data import build_from_config
    from raydp.data.synthetic import generate_records
    from raydp.runner.privacy_setup import LifetimeCharge, charge_lifetime

    generate_records(400, seed=11, progress=False).to_csv(tmp_path / "diabetic_data.csv", index=False)
    monkeypatch.setenv("RAYDP_OWNER_KEY", str(tmp_path / "owner.key"))
    source = str(tmp_path / "diabetic_data.csv")
    build_from_config(validate_config(DataConfig, {"source": source}), tmp_path / "a", progress=False)
    build_from_config(validate_config(DataConfig, {"source": source, "seed": 7, "fractions": {"eval": 0.1},
                                                   "sample_fraction": 0.8}), tmp_path / "b", progress=False)
    first, rebuilt = load_manifest(tmp_path / "a"), load_manifest(tmp_path / "b")
    assert manifest_id(first) != manifest_id(rebuilt)
    config = tiny(tmp_path / "b")
    plan = plan_private_run(config, training_units(config, str(tmp_path / "b"), len(
        load_texts(tmp_path / "b", "train"))).public_count)
    budget = (dp_accounting_epsilon([plan], 1e-5) + dp_accounting_epsilon([plan, plan], 1e-5)) / 2  # fits one run
    set_dataset_budget(tmp_path / "a", float(f"{budget:.4f}"), 1e-5)
    run = {"run": LifetimeCharge(plan, 1e-5, "patient")}
    assert charge_lifetime(rebuilt, run) == pytest.approx(dp_accounting_epsilon([plan], 1e-5), rel=1e-4)
    assert list(read_budget(manifest_id(first))["charges"]) == ["run"]  # charged to the first build's budget
    with pytest.raises(ConfigError, match="past its lifetime budget"):
        charge_lifetime(rebuilt, {"again": LifetimeCharge(plan, 1e-5, "patient")})
    docs = " ".join((Path(__file__).parents[1] / "docs" / "privacy.md").read_text().split())
    assert "has another id and no budget" not in docs
    assert "another split seed, split fractions or sample fraction) is charged to it" in docs


def test_a_plain_caller_cannot_skip_the_charge_on_a_budgeted_dataset(small_dataset, tmp_path, monkeypatch):
    """run_training(charge_lifetime=False) ran a DP run uncharged on a budgeted dataset. Now only a caller that holds
    the run's charge skips it, by passing its receipt (_charged_by): a plain False, something that is not a receipt,
    another dataset's receipt or one naming a charge the register does not hold is refused, nothing written; a
    receipt of a charge in the register runs without a second charge; without a budget, False still runs (a plain
    run's own charge: test_a_run_past_the_lifetime_budget_is_refused_before_it_starts)."""
    from raydp.privacy.lifetime import LifetimeReceipt
    from raydp.runner.privacy_setup import LifetimeCharge, build_strategy, charge_lifetime
    from raydp.runner.run import run_training

    monkeypatch.setenv("RAYDP_OWNER_KEY", str(tmp_path / "owner.key"))
    data = copy_dataset(small_dataset, tmp_path / "data")  # its manifest gets a budget below
    config = tiny(data, max_steps=2)
    run_training(config, tmp_path / "unbudgeted", progress=False, charge_lifetime=False)  # nothing to charge
    set_dataset_budget(data, 8, 1e-5)
    manifest = load_manifest(data)
    dataset_id = manifest_id(manifest)
    for name, skip in [("plain", {"charge_lifetime": False}), ("not-a-receipt", {"_charged_by": True}),
                       ("other-dataset", {"_charged_by": LifetimeReceipt("rdi1:" + "f" * 32, "study:x/t")}),
                       ("never-charged", {"_charged_by": LifetimeReceipt(dataset_id, "study:x/t")})]:
        with pytest.raises(ConfigError, match="lifetime"):
            run_training(config, tmp_path / name, progress=False, **skip)
        assert not (tmp_path / name).exists(), name
    assert read_budget(dataset_id)["charges"] == {}
    plan = plan_private_run(config, training_units(config, str(data), len(load_texts(data, "train"))).public_count)
    charge_lifetime(manifest, {"study:x/t": LifetimeCharge.of(plan, config, build_strategy(config), "patient")})
    run_training(config, tmp_path / "held", progress=False, _charged_by=LifetimeReceipt(dataset_id, "study:x/t"))
    assert list(read_budget(dataset_id)["charges"]) == ["study:x/t"]  # charged once, by the caller


def test_spend_on_a_dataset_without_a_budget_is_recorded_and_printed_when_a_run_starts(small_dataset, tmp_path,
                                                                                         monkeypatch, capsys):
    """Without a budget nothing used to record what DP runs spent: a second run now says what the first one spent
    (checked against dp_accounting), in an owner-only record beside the owner key, and why a DP run takes fewer
    steps than a non-private one at the same epochs."""
    import stat

    from raydp.privacy.lifetime import spend_record_path, spent_so_far
    from raydp.runner.launch import train

    monkeypatch.setenv("RAYDP_OWNER_KEY", str(tmp_path / "key" / "owner.key"))  # its spend record: this test's
    data = small_dataset  # only read: the record of what DP runs spent lies beside the owner key
    dataset_id = manifest_id(load_manifest(data))
    config = tiny(data)
    plan = plan_private_run(config, training_units(config, str(data), len(load_texts(data, "train"))).public_count)
    capsys.readouterr()
    train(config, tmp_path / "first", progress=True)
    first = capsys.readouterr().err
    assert "earlier DP run" not in first  # nothing was spent before it
    assert f"plan {plan.planned_steps} steps" in first and "a non-private run takes batches of 16 records" in first
    record = spend_record_path(dataset_id)
    assert record.is_file() and stat.S_IMODE(record.stat().st_mode) == 0o600
    train(config, tmp_path / "second", progress=True)
    line = next(x for x in capsys.readouterr().err.splitlines() if "earlier DP run" in x)
    expected = dp_accounting_epsilon([plan], 1e-5)
    assert f"1 earlier DP run(s) on it compose to epsilon {expected:.3g} at delta 1e-05" in line
    assert "raydp data budget" in line
    assert read_budget(dataset_id) is None and spent_so_far(dataset_id, 1e-5)["runs"] == 2  # no budget: 2 DP runs
