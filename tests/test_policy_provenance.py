"""Saved policies carry the provenance of the runs that trained them (ERRATA E14): inherited on copy and
continuation, a paper-mode policy refuses to drive a strict run, and its replay buffer does not leave
with ``raydp policy export`` unless asked."""

import json
import os
import tarfile

import numpy as np
import pytest

from raydp.control.features import ObservationLayout
from raydp.control.store import (
    MANIFEST,
    check_policy_privacy_mode,
    copy_policy,
    load_manifest,
    policy_privacy_mode,
    provenance_entry,
    provenance_of,
    write_manifest,
    write_replay,
)
from raydp.errors import ConfigError
from raydp.privacy.accounting.rdp import DEFAULT_ORDERS, rdp_vector

LAYOUT = ObservationLayout("shared", 8)
SAC = {"b_sac": 4, "k": 2}


def entry(mode="strict", sha="rdi1:" + "a" * 32, eps=2.0):
    curve = 100 * rdp_vector(0.05, 1.2)
    return {"dataset_id": sha, "privacy_mode": mode, "privacy_unit": "record", "epsilon": eps, "delta": 1e-5,
            "guarantee": "ledger", "rdp_orders": np.asarray(DEFAULT_ORDERS), "rdp_curve": curve}


def fake_policy(root, name, provenance=None, trained_on=None, legacy=False):
    """A policy directory with a manifest and a replay file (no RLlib module: these tests never load it)."""
    path = root / name
    path.mkdir(parents=True)
    write_replay(path / "replay.npz", {"obs": np.zeros((2, 3)), "action": np.zeros((2, 1)),
                                       "reward": np.zeros(2), "next_obs": np.zeros((2, 3))})
    write_manifest(path, layout=LAYOUT, sac=SAC, trained_on=trained_on or {"model": "embedded-tiny", "action_decoding": "relative"}, results={},
                   transitions=2, updates=4, provenance=provenance)
    if legacy:  # a manifest written before provenance existed
        manifest = json.loads((path / MANIFEST).read_text())
        del manifest["provenance"]
        (path / MANIFEST).write_text(json.dumps(manifest))
    return path


def test_manifest_records_provenance_json_ready_with_ids(tmp_path):
    path = fake_policy(tmp_path, "p", provenance=[entry()])
    manifest = load_manifest(path)
    (e,) = manifest["provenance"]
    assert e["dataset_id"] == "rdi1:" + "a" * 32 and e["privacy_mode"] == "strict" and e["entry_id"]
    assert e["rdp_orders"] == list(DEFAULT_ORDERS) and len(e["rdp_curve"]) == len(DEFAULT_ORDERS)
    assert policy_privacy_mode(manifest) == "strict"
    with pytest.raises(ValueError, match="privacy_mode"):
        provenance_entry({**entry(), "privacy_mode": "lenient"})
    with pytest.raises(ValueError, match="same length"):
        provenance_entry({**entry(), "rdp_curve": [1.0]})


def test_copy_keeps_provenance_and_continuation_inherits_it(tmp_path):
    first = fake_policy(tmp_path, "first", provenance=[entry()])
    copied = copy_policy(first, tmp_path / "copy")
    assert load_manifest(copied)["provenance"] == load_manifest(first)["provenance"]
    assert load_manifest(copied)["name"] == "copy"
    # continuing from the copy: the service starts from provenance_of(restored) and appends its run
    inherited = provenance_of(load_manifest(copied))
    second = fake_policy(tmp_path, "second", provenance=inherited + [provenance_entry(entry(eps=0.5))])
    chain = load_manifest(second)["provenance"]
    assert [e["epsilon"] for e in chain] == [2.0, 0.5]
    assert chain[0]["entry_id"] == load_manifest(first)["provenance"][0]["entry_id"]  # the same run, same id


def test_legacy_manifest_reads_as_one_entry_and_keeps_its_mode(tmp_path):
    legacy = fake_policy(tmp_path, "old", trained_on={"model": "embedded", "epsilon": 2.0, "privacy_mode": "paper"},
                         legacy=True)
    (e,) = provenance_of(load_manifest(legacy))
    assert e["legacy"] and e["dataset_id"] is None and e["privacy_mode"] == "paper"
    assert policy_privacy_mode(load_manifest(legacy)) == "paper"
    # a policy continued from it stays paper-mode, although its own run was strict
    continued = fake_policy(tmp_path, "continued", provenance=provenance_of(load_manifest(legacy)) + [entry()])
    assert policy_privacy_mode(load_manifest(continued)) == "paper"


def test_shipped_policy_is_strict_public_and_usable():
    from raydp.config import TrainConfig, validate_config
    from raydp.control.policies import check_policy_privacy
    from raydp.control.store import resolve_policy

    manifest = load_manifest(resolve_policy("public-embedded", "policies"))
    assert policy_privacy_mode(manifest) == "strict"
    assert manifest["trained_on"]["pretraining"]["public_data"]
    assert manifest["provenance"] and all(e["public_data"] for e in manifest["provenance"])
    config = validate_config(TrainConfig, {"strategy": "rldp", "epsilon": 2.0, "settings": {"policy": "public-embedded"}})
    assert check_policy_privacy(config) is not None  # no error


def test_a_policy_acts_only_in_the_clip_decoding_it_learned(tmp_path):
    from raydp.config import TrainConfig, validate_config
    from raydp.control.policies import check_policy_privacy

    fake_policy(tmp_path, "eq10", provenance=[entry()], trained_on={"model": "embedded-tiny"})  # before the option
    def config(decoding):
        return validate_config(TrainConfig, {"model": "embedded-tiny", "strategy": "rldp", "epsilon": 2.0, "settings": {
            "policy": "eq10", "policy_dir": str(tmp_path), "action_decoding": decoding}})

    with pytest.raises(ConfigError, match="acts in 'paper' clip decoding; this run decodes 'relative'"):
        check_policy_privacy(config("relative"))
    assert check_policy_privacy(config("paper")) == tmp_path / "eq10"


def test_a_policy_refuses_settings_of_another_network_width(tmp_path):
    from raydp.config import TrainConfig, validate_config
    from raydp.control.policies import check_policy_privacy

    path = fake_policy(tmp_path, "narrow", provenance=[entry()])
    manifest = json.loads((path / MANIFEST).read_text())
    (path / MANIFEST).write_text(json.dumps({**manifest, "sac": {**manifest["sac"], "hidden": 32}}))
    def config(**settings):
        return validate_config(TrainConfig, {"model": "embedded-tiny", "strategy": "rldp", "epsilon": 2.0, "settings": {
            "policy": "narrow", "policy_dir": str(tmp_path), "action_decoding": "relative", **settings}})

    with pytest.raises(ConfigError, match="has networks 32 wide; this run's settings.hidden is 7"):
        check_policy_privacy(config(hidden=7))
    assert check_policy_privacy(config(hidden=32)) == tmp_path / "narrow"


def test_paper_policy_refuses_to_drive_a_strict_run(tmp_path):
    from raydp.config import TrainConfig, validate_config
    from raydp.control.policies import check_policy_privacy
    from raydp.runner.launch import start_policy

    fake_policy(tmp_path, "paperpol", provenance=[entry(), entry(mode="paper")])
    fake_policy(tmp_path, "strictpol", provenance=[entry()])

    def config(policy, mode):
        return validate_config(TrainConfig, {"model": "embedded-tiny", "strategy": "rldp", "epsilon": 2.0,
                                             "settings": {"policy": policy, "policy_dir": str(tmp_path),
                                                          "privacy_mode": mode}})

    message = ("policy paperpol was trained in paper mode (it saw unprivatized statistics); "
               "use settings.privacy_mode=paper or a strict policy")
    with pytest.raises(ConfigError) as err:
        start_policy(config("paperpol", "strict"))  # before any Ray actor starts
    assert str(err.value) == message
    assert check_policy_privacy(config("paperpol", "paper")) == (tmp_path / "paperpol")
    assert check_policy_privacy(config("strictpol", "strict")) == (tmp_path / "strictpol")


def test_cli_train_refuses_a_paper_policy_in_strict_mode(tmp_path, capsys):
    from raydp.cli import main

    fake_policy(tmp_path, "paperpol", provenance=[entry(mode="paper")])
    code = main(["train", "--output", str(tmp_path / "run"), "--model", "embedded-tiny", "--strategy", "rldp",
                 "--epsilon", "2", "--policy", "paperpol", "--policy-dir", str(tmp_path), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "trained in paper mode" in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists()


def test_export_of_a_paper_policy_needs_include_private_replay(tmp_path, capsys):
    from raydp.cli import main

    fake_policy(tmp_path, "paperpol", provenance=[entry(mode="paper")])
    archive = tmp_path / "out.tar.gz"
    assert main(["policy", "export", "paperpol", "--policy-dir", str(tmp_path), "--to", str(archive)]) == 2
    err = capsys.readouterr().err
    assert "replay buffer holds unprivatized statistics of private data" in err and err.count("\n") == 1
    assert "--include-private-replay" in err and not archive.exists()
    assert main(["policy", "export", "paperpol", "--policy-dir", str(tmp_path), "--to", str(archive),
                 "--include-private-replay"]) == 0
    assert "unprivatized statistics" in capsys.readouterr().out
    with tarfile.open(archive) as tar:
        assert "paperpol/replay.npz" in tar.getnames()
    # a strict policy exports without the flag
    fake_policy(tmp_path, "strictpol", provenance=[entry()])
    assert main(["policy", "export", "strictpol", "--policy-dir", str(tmp_path), "--to",
                 str(tmp_path / "s.tar.gz")]) == 0


def test_policy_show_and_list_print_provenance(tmp_path, capsys):
    from raydp.cli import main

    b, c = "rdi1:" + "b" * 32, "rdi1:" + "c" * 32
    fake_policy(tmp_path, "mixed", provenance=[entry(sha=b), entry(mode="paper", sha=c)])
    assert main(["policy", "show", "mixed", "--policy-dir", str(tmp_path)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["format"] == "raydp-policy-v3" and shown["privacy_mode"] == "paper"
    assert [e["dataset_id"] for e in shown["provenance"]] == [b, c]
    assert [e["privacy_mode"] for e in shown["provenance"]] == ["strict", "paper"]
    assert main(["policy", "list", "--policy-dir", str(tmp_path)]) == 0
    listing = capsys.readouterr().out
    assert f"paper, 2 run(s) on dataset(s) {b}, {c}" in listing


@pytest.mark.slow
def test_policy_service_inherits_and_appends_provenance(tmp_path, raydp_cache):
    """The live service: a policy continued from a saved one records the earlier runs and its own."""
    import ray

    from raydp.control.sac import SACSettings
    from raydp.control.service import PolicySession
    from raydp.runner.launch import RAY_NAMESPACE

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, namespace=RAY_NAMESPACE, log_to_driver=False,
                 runtime_env={"env_vars": {"RAYDP_CACHE": os.environ["RAYDP_CACHE"]}})
    try:
        settings = SACSettings(b_sac=3, k=1, hidden=16)
        with PolicySession(ObservationLayout("shared", 4), settings) as first:
            m1 = first.save(tmp_path / "one", trained_on={"model": "x"}, results={}, provenance=entry(eps=0.5))
            snapshot = first.client("r").save_policy(tmp_path / "snap", trained_on={"model": "x"}, results={})
        assert [e["epsilon"] for e in m1["provenance"]] == [0.5]
        assert snapshot["provenance"] == m1["provenance"]  # a snapshot adds no run
        with PolicySession(None, settings, restore=tmp_path / "one") as second:
            m2 = second.save(tmp_path / "two", trained_on={"model": "x"}, results={}, provenance=entry(eps=1.0))
        assert [e["epsilon"] for e in m2["provenance"]] == [0.5, 1.0]
        assert m2["provenance"][0]["entry_id"] == m1["provenance"][0]["entry_id"]
        assert load_manifest(tmp_path / "two")["provenance"] == m2["provenance"]
    finally:
        if started:
            ray.shutdown()


def test_an_entry_must_be_json_and_a_failed_save_leaves_nothing_behind(tmp_path):
    """A manifest is JSON: an entry with bytes (or NaN, or a non-string key) is refused when validated, not
    when the manifest is written; and a policy save that fails midway leaves no directory behind."""
    from types import SimpleNamespace

    from raydp.control.sac import SACSettings
    from raydp.control.training import write_policy

    for bad in ({"note": b"\x00"}, {"epsilon": float("nan")}, {"extra": {1: "x"}}, {"labels": {"a"}}):
        with pytest.raises(ValueError, match="not a JSON value") as refused:
            provenance_entry({**entry(), **bad})
        assert "\n" not in str(refused.value)
    assert json.loads(json.dumps(provenance_entry({**entry(), "extra": {"k": np.float32(0.5)}})))

    class Module:
        def get_state(self):
            return {"pi.weight": np.ones((2, 2), dtype=np.float32)}

    algo = SimpleNamespace(learner_group=SimpleNamespace(_learner=SimpleNamespace(module={"default_policy": Module()})),
                           local_replay_buffer=SimpleNamespace(episodes=[]))

    def save(path, provenance):
        return write_policy(algo, path, layout=LAYOUT, settings=SACSettings(b_sac=4, k=2), trained_on={"model": "m"},
                            results={}, transitions=0, updates=0, name=None, provenance=provenance)

    root = tmp_path / "policies"
    with pytest.raises(ValueError):
        save(root / "broken", [{**entry(), "note": b"\x00"}])
    assert not (root / "broken").exists() and os.listdir(root) == []  # no half-written policy, no temporary
    manifest = save(root / "good", [entry()])
    assert sorted(os.listdir(root)) == ["good"] and manifest["name"] == "good"
    assert load_manifest(root / "good") == manifest and (root / "good" / "module.safetensors").is_file()
    with pytest.raises(FileExistsError):
        save(root / "good", [entry()])


def test_a_manifest_that_declares_no_privacy_mode_counts_as_paper(tmp_path):
    """Unknown is not strict: a policy whose manifest says nothing about the mode of (some of) the runs that
    trained it may have seen unprivatized statistics, so a strict run refuses it, saying why."""
    no_mode = {"model": "embedded-tiny", "action_decoding": "relative"}
    nothing = load_manifest(fake_policy(tmp_path, "nothing", provenance=[], trained_on=no_mode))
    legacy = load_manifest(fake_policy(tmp_path, "legacy", trained_on=no_mode, legacy=True))
    for manifest in (nothing, legacy):
        assert policy_privacy_mode(manifest) == "paper"
        with pytest.raises(ConfigError, match="declares no privacy mode") as refused:
            check_policy_privacy_mode(manifest, "strict", "p")
        assert "\n" not in str(refused.value)
        check_policy_privacy_mode(manifest, "paper", "p")  # a paper-mode run may use it
    # the run entries decide when trained_on is silent; trained_on alone decides when there are none
    assert policy_privacy_mode(load_manifest(fake_policy(tmp_path, "entries", provenance=[entry()],
                                                         trained_on=no_mode))) == "strict"
    assert policy_privacy_mode(load_manifest(fake_policy(tmp_path, "declared", provenance=[],
                                                         trained_on={**no_mode, "privacy_mode": "strict"}))) == "strict"


def test_export_refuses_an_old_policy_that_names_its_data_by_a_plain_hash(tmp_path, capsys):
    """Issue 26 review: a v1 manifest's provenance holds dataset_sha256, a plain hash of the records; exporting it
    would release that hash. `raydp migrate` rewrites it first."""
    from raydp.cli import main

    path = fake_policy(tmp_path, "oldpol", provenance=[entry()])
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["format"] = "raydp-policy-v1"
    manifest["provenance"][0]["dataset_sha256"] = "ab" * 32
    (path / "manifest.json").write_text(json.dumps(manifest))
    archive = tmp_path / "old.tar.gz"
    assert main(["policy", "export", "oldpol", "--policy-dir", str(tmp_path), "--to", str(archive)]) == 2
    err = capsys.readouterr().err
    assert "run `raydp migrate` on it before exporting" in err and err.count("\n") == 1 and not archive.exists()


def test_a_continued_policys_totals_cover_every_study_that_trained_it():
    """residual-public-102 continued residual-public-60 with 42 episodes: its record's totals are the two studies'
    figures summed (its own top-level counts are the second study's), and its episodes match its provenance."""
    from raydp.control.store import resolve_policy, training_totals

    first = load_manifest(resolve_policy("residual-public-60", "policies"))
    later = load_manifest(resolve_policy("residual-public-102", "policies"))
    record = later["trained_on"]["pretraining"]
    totals = training_totals(later)
    assert training_totals(first)["episodes"] == len(first["provenance"]) == 60
    assert totals["episodes"] == len(later["provenance"]) == 60 + record["episodes"] == 102
    assert totals["transitions"] == first["transitions"] + later["transitions"] == 1620 + 1134
    assert totals["sac_updates"] == first["sac_updates"] + later["sac_updates"]
    assert totals["cpu_seconds"] == pytest.approx(first["trained_on"]["pretraining"]["cpu_seconds"]
                                                  + record["cpu_seconds"], abs=0.11)
