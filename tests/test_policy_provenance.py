"""Saved policies carry the provenance of the runs that trained them (ERRATA E14): inherited on copy and
continuation, a paper-mode policy refuses to drive a strict run, and its replay buffer does not leave
with ``raydp policy export`` unless asked."""

import json
import os
import tarfile
from pathlib import Path

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

#: the residual RLDP campaign's policies (issue 29): records of what its studies ran, kept beside them
RESIDUAL_POLICIES = Path(__file__).resolve().parents[1] / "experiments" / "residual-rldp" / "policies"
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
def test_policy_service_inherits_and_appends_provenance(local_ray, tmp_path):
    """The live service: a policy continued from a saved one records the earlier runs and its own."""
    from raydp.control.sac import SACSettings
    from raydp.control.service import PolicySession

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


def test_export_refuses_an_old_policy_that_names_its_data_by_a_plain_hash(tmp_path):
    """A v1 manifest's provenance holds dataset_sha256, a plain hash of the records; exporting it
    would release that hash. `raydp migrate` rewrites it first."""
    from raydp.control.store import export_policy

    path = fake_policy(tmp_path, "oldpol", provenance=[entry()])
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["format"] = "raydp-policy-v1"
    manifest["provenance"][0]["dataset_sha256"] = "ab" * 32
    (path / "manifest.json").write_text(json.dumps(manifest))
    archive = tmp_path / "old.tar.gz"
    with pytest.raises(ConfigError, match=r"run `raydp migrate` on it before exporting") as refused:
        export_policy(path, archive)
    assert "\n" not in str(refused.value) and not archive.exists()


def test_a_continued_policys_totals_cover_every_study_that_trained_it():
    """residual-public-102 continued residual-public-60 with 42 episodes: its record's totals are the two studies'
    figures summed (its own top-level counts are the second study's), and its episodes match its provenance."""
    from raydp.control.store import resolve_policy, training_totals

    first = load_manifest(resolve_policy("residual-public-60", RESIDUAL_POLICIES))
    later = load_manifest(resolve_policy("residual-public-102", RESIDUAL_POLICIES))
    record = later["trained_on"]["pretraining"]
    totals = training_totals(later)
    assert training_totals(first)["episodes"] == len(first["provenance"]) == 60
    assert totals["episodes"] == len(later["provenance"]) == 60 + record["episodes"] == 102
    assert totals["transitions"] == first["transitions"] + later["transitions"] == 1620 + 1134
    assert totals["sac_updates"] == first["sac_updates"] + later["sac_updates"]
    assert totals["cpu_seconds"] == pytest.approx(first["trained_on"]["pretraining"]["cpu_seconds"]
                                                  + record["cpu_seconds"], abs=0.11)


# -- lifetime figures: every save records what trained the policy over its whole life -----------------------------
CAMPAIGN_LIFETIMES = {"residual-public": (12, 324, 2592), "residual-public-60": (60, 1620, 12960),
                      "residual-public-102": (102, 2754, 22032)}


def test_the_campaign_policies_lifetime_figures_come_out_of_their_manifests():
    """The residual campaign's policies were saved before the lifetime field: residual-public and -60 (one study
    each) count their own figures, residual-public-102 its record's corrected totals (60 + 42 episodes); what a
    service that restores them continues from is the same."""
    from raydp.control.store import lifetime_of, resolve_policy, training_totals

    for name, (runs, transitions, updates) in CAMPAIGN_LIFETIMES.items():
        manifest = load_manifest(resolve_policy(name, RESIDUAL_POLICIES))
        assert "lifetime" not in manifest, name  # an older manifest: loads, and its figures come from the rules
        totals = training_totals(manifest)
        assert (totals["episodes"], totals["transitions"], totals["sac_updates"]) == (runs, transitions, updates)
        assert lifetime_of(manifest) == {"runs": runs, "transitions": transitions, "sac_updates": updates}


def _fake_algo():
    """What write_policy reads of an algorithm: its module's state and its replay buffer (no RLlib)."""
    from types import SimpleNamespace

    class Module:
        def get_state(self):
            return {"pi.weight": np.ones((2, 2), dtype=np.float32)}

    return SimpleNamespace(learner_group=SimpleNamespace(_learner=SimpleNamespace(module={"default_policy": Module()})),
                           local_replay_buffer=SimpleNamespace(episodes=[]))


def test_a_save_adds_its_sessions_counts_to_the_restored_lifetime_once(tmp_path):
    """A session's counters are cumulative: its checkpoint snapshot (no new run) and its final save each add them
    to the restored policy's figures, so the final save does not count the snapshot's transitions again; a
    session restored from the snapshot (a retried trial) continues the snapshot's figures."""
    from raydp.control.sac import SACSettings
    from raydp.control.store import lifetime_of
    from raydp.control.training import write_policy

    algo, root = _fake_algo(), tmp_path / "policies"

    def save(name, provenance, transitions, inherited=None):
        return write_policy(algo, root / name, layout=LAYOUT, settings=SACSettings(b_sac=4, k=2),
                            trained_on={"model": "m"}, results={}, transitions=transitions, updates=2 * transitions,
                            name=None, provenance=provenance, inherited=inherited)

    fresh = save("fresh", [entry()], 5)  # a fresh policy (nothing restored): its lifetime is its session
    assert fresh["lifetime"] == {"runs": 1, "transitions": 5, "sac_updates": 10} and fresh["transitions"] == 5
    inherited, chain = lifetime_of(load_manifest(root / "fresh")), provenance_of(fresh)
    snapshot = save("snapshot", chain, 3, inherited)  # 3 transitions into the next session
    final = save("final", chain + [provenance_entry(entry(eps=0.5))], 7, inherited)  # 7 in all, and its run
    assert snapshot["lifetime"] == {"runs": 1, "transitions": 5 + 3, "sac_updates": 10 + 6}
    assert final["lifetime"] == {"runs": 2, "transitions": 5 + 7, "sac_updates": 10 + 14}  # not 5 + 3 + 7
    assert final["transitions"] == 7 and final["sac_updates"] == 14  # the top-level counts stay the session's
    from_snapshot = lifetime_of(load_manifest(root / "snapshot"))
    resumed = save("resumed", chain + [provenance_entry(entry(eps=0.5))], 2, from_snapshot)
    assert resumed["lifetime"] == {"runs": 2, "transitions": 5 + 3 + 2, "sac_updates": 10 + 6 + 4}
    # an unknown inherited count stays unknown
    assert save("unknown", chain, 1, {"runs": 1, "transitions": None, "sac_updates": 4})["lifetime"] == \
        {"runs": 1, "transitions": None, "sac_updates": 6}


def test_training_totals_prefer_the_lifetime_field_with_the_study_records_seconds(tmp_path):
    from raydp.control.store import list_policies, training_totals

    record = {"episodes": 1, "transitions": 3, "sac_updates": 6, "wall_seconds": 10.0, "cpu_seconds": 20.0,
              "gpu_seconds": 0.0}
    stale = {**record, "totals": {"episodes": 2, "transitions": 40, "sac_updates": 80, "wall_seconds": 30.0,
                                  "cpu_seconds": 50.0, "gpu_seconds": 0.0}}
    lifetime = {"runs": 3, "transitions": 45, "sac_updates": 90}

    def manifest(name, pretraining, with_lifetime):
        path = tmp_path / name
        path.mkdir()
        return write_manifest(path, layout=LAYOUT, sac=SAC, trained_on={"model": "m", "pretraining": pretraining},
                              results={}, transitions=3, updates=6, provenance=[entry()],
                              lifetime=lifetime if with_lifetime else None)

    assert training_totals(manifest("a", stale, True)) == {
        "episodes": 3, "transitions": 45, "sac_updates": 90, "wall_seconds": 30.0, "cpu_seconds": 50.0,
        "gpu_seconds": 0.0}
    assert training_totals(manifest("b", record, True))["cpu_seconds"] == 20.0  # one study: its own seconds
    assert training_totals(manifest("c", None, True))["cpu_seconds"] is None  # saved by a run: no study's seconds
    assert training_totals(manifest("d", stale, False))["transitions"] == 40  # older: the record's totals
    older = manifest("e", record, False)
    assert "lifetime" not in load_manifest(tmp_path / "e") and training_totals(older)["transitions"] == 3
    listed = {p["name"]: p["totals"]["transitions"] for p in list_policies(tmp_path)}  # what `policy list` shows
    assert (listed["a"], listed["d"], listed["e"]) == (45, 40, 3)  # lifetime transitions


def _drive_broker(client, layout, decisions: int, seed: int, reward: float | None = None) -> None:
    """``decisions`` decisions of one run through the broker: each closes the run's open decision into a
    transition, but a first one with no ``reward`` (a run's start)."""
    rng = np.random.default_rng(seed)
    for _ in range(decisions):
        client.decide(layout.pack(rng.normal(size=(3, layout.f_adapter)), rng.normal(size=layout.g_global)), reward)
        reward = float(rng.normal())


# slow (~30 s on CI): the live service; the lifetime arithmetic is test_a_save_adds_its_sessions_counts_to_the_restored_
# lifetime_once (fast), and a shared study's saved lifetime is tests/test_study.py's test_rldp_trials_can_share_one_policy
@pytest.mark.slow
def test_the_policy_service_saves_lifetime_figures_and_a_snapshot_counts_nothing_twice(local_ray, tmp_path):
    """The live service: a policy saved before the lifetime field existed is continued by a session that snapshots
    it (as a checkpoint does) and then saves it; a third session continues the snapshot."""
    from raydp.control.sac import SACSettings
    from raydp.control.service import PolicySession

    layout, settings = ObservationLayout("shared", 4), SACSettings(b_sac=3, k=2, hidden=16)
    with PolicySession(layout, settings) as first:
        _drive_broker(first.client("a"), layout, 3, seed=1)  # 2 transitions
        m1 = first.save(tmp_path / "one", trained_on={"model": "x"}, results={}, provenance=entry(eps=0.5))
    assert m1["lifetime"] == {"runs": 1, "transitions": 2, "sac_updates": 4} and m1["transitions"] == 2
    old = json.loads((tmp_path / "one" / MANIFEST).read_text())
    del old["lifetime"]  # as written before the field existed: its own counts are its lifetime
    (tmp_path / "one" / MANIFEST).write_text(json.dumps(old))
    with PolicySession(None, settings, restore=tmp_path / "one") as second:
        client = second.client("b")
        _drive_broker(client, layout, 4, seed=2)  # 3 transitions
        snapshot = client.save_policy(tmp_path / "snap", trained_on={"model": "x"}, results={})  # a checkpoint
        _drive_broker(client, layout, 4, seed=3, reward=0.5)  # 4 more (the first closes the open one): 7 in all
        m2 = second.save(tmp_path / "two", trained_on={"model": "x"}, results={}, provenance=entry(eps=1.0))
        counters = second.counters()
    assert counters["transitions_trained"] == 7 and counters["errors"] == []
    assert snapshot["lifetime"] == {"runs": 1, "transitions": 2 + 3, "sac_updates": 4 + 6}  # no run added
    assert m2["lifetime"] == {"runs": 2, "transitions": 2 + 7, "sac_updates": 4 + 14}  # the snapshot's 3 once
    assert m2["transitions"] == 7 and load_manifest(tmp_path / "two")["lifetime"] == m2["lifetime"]
    with PolicySession(None, settings, restore=tmp_path / "snap") as third:  # e.g. a trial retried from it
        _drive_broker(third.client("c"), layout, 2, seed=4)  # 1 transition
        m3 = third.save(tmp_path / "three", trained_on={"model": "x"}, results={}, provenance=entry(eps=2.0))
    assert m3["lifetime"] == {"runs": 2, "transitions": 2 + 3 + 1, "sac_updates": 4 + 6 + 2}


def test_a_policy_server_continues_the_restored_policys_lifetime(local_ray, tmp_path, monkeypatch):
    """The RLlink policy server (`raydp policy serve --policy P --save-policy Q`) restores and saves through the
    same functions: its manifest's lifetime adds its transitions to the restored policy's."""
    from raydp.control.policies import policy_layout_for, sac_settings, trained_on
    from raydp.control.rllink import SECRET_ENV
    from raydp.control.service import PolicySession
    from tests.test_rllink import SECRET, connect, drive, policy_server, tiny_config
    from tests.test_rllink import provenance as run_entry

    monkeypatch.setenv(SECRET_ENV, SECRET)
    config = tiny_config()
    layout, settings = policy_layout_for(config), sac_settings(config)
    with PolicySession(layout, settings) as session:
        _drive_broker(session.client("a"), layout, 4, seed=5)  # 3 transitions
        base = session.save(tmp_path / "base", trained_on=trained_on(config), results={}, provenance=run_entry("a"))
    assert base["lifetime"] == {"runs": 1, "transitions": 3, "sac_updates": 3 * settings.k}
    srv = policy_server(config, restore=tmp_path / "base")
    try:
        client = connect(srv, "run-c")
        drive(client, 3, seed=3)  # 2 transitions
        client.end()
        client.save_policy(tmp_path / "ignored", {}, {}, provenance=run_entry("c"))
        client.close()
        assert srv.wait_idle(60)
    finally:
        manifest = srv.stop(save_to=tmp_path / "served")
    assert manifest["transitions"] == 2 and len(manifest["provenance"]) == 2
    assert manifest["lifetime"] == {"runs": 2, "transitions": 3 + 2, "sac_updates": (3 + 2) * settings.k}


RESIDUAL = {"t_warm": 4, "t_rl": 4, "b_sac": 4, "k": 2, "n_max": 8, "hidden": 128,  # residual-public-60's width
            "action_decoding": "residual", "noise_control": False, "residual_range": 0.7,
            "schedule": {"clip": 0.5, "clip_end": 0.2, "depth_tilt": 0.4, "relative": True}}
PUBLIC_DATA = {"source": "public", "n_records": 400}


# ~65 s (a run, then a study): the fast tier covers its parts: a run's save is PolicyClient.save_policy through the
# service (test_the_policy_service_saves_lifetime_figures_and_a_snapshot_counts_nothing_twice, with a policy saved
# before the lifetime field), a study continuing a saved policy test_study.py::test_rldp_trials_can_share_one_policy
@pytest.mark.slow
def test_a_policy_continued_by_a_run_then_by_a_study_keeps_its_lifetime(local_ray, tmp_path, capsys):
    """The review's case: `raydp train --policy residual-public-60 --save-policy ...` (a single run, not a study)
    listed {episodes 61, transitions: the run's only}. Its save now records the lifetime (60 + 1 runs, 1,620 + the
    run's transitions), and a study that continues it sums on from there, its record's continued_from and totals
    equal to the saved lifetime."""
    import yaml

    from raydp.cli import main
    from raydp.control.store import training_totals
    from raydp.study.runner import run_study
    from tests.test_study import TINY_STUDY, write_study

    policies = tmp_path / "policies"
    copy_policy(RESIDUAL_POLICIES / "residual-public-60", policies / "residual-public-60")  # the campaign's, full
    run_config = {"model": "embedded-tiny", "strategy": "rldp", "epsilon": 2.0, "data": PUBLIC_DATA,
                  "max_steps": 24, "eval_every": 8, "eval_max_records": 16, "public_eval_records": 16,
                  "warmup_steps": 4, "settings": RESIDUAL}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run_config))
    assert main(["train", "--config", str(tmp_path / "run.yaml"), "--policy", "residual-public-60", "--save-policy",
                 "run61", "--policy-dir", str(policies), "--output", str(tmp_path / "run"), "--quiet"]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    run61 = load_manifest(policies / "run61")
    t1 = summary["controller"]["transitions"]
    assert t1 > 0 and run61["transitions"] == t1 and run61["sac_updates"] == 2 * t1  # the session's own
    assert run61["lifetime"] == {"runs": 61, "transitions": 1620 + t1, "sac_updates": 12960 + 2 * t1}
    assert training_totals(run61)["episodes"] == len(run61["provenance"]) == 61
    assert training_totals(run61)["transitions"] == 1620 + t1  # not t1: the review's error

    base = {**TINY_STUDY["base"], "data": PUBLIC_DATA, "public_eval_records": 16}
    rldp = {**RESIDUAL, "policy": "run61", "policy_dir": str(policies)}
    study = write_study(tmp_path, name="after-run", strategies=["rldp"], seeds=[0], policy="shared",
                        wandb={"mode": "disabled"}, base=base, private_data=False, save_policy="study62",
                        policy_dir=str(policies), strategy_settings={"rldp": rldp}, sac_grid={
                            "t_rl": [4], "b_sac": [4], "k": [2]})
    study_dir = run_study(study, tmp_path / "out", progress=False)
    study62 = load_manifest(policies / "study62")
    t2 = study62["transitions"]
    assert t2 > 0 and study62["sac_updates"] == 2 * t2
    lifetime = {"runs": 62, "transitions": 1620 + t1 + t2, "sac_updates": 12960 + 2 * (t1 + t2)}
    assert study62["lifetime"] == lifetime and len(study62["provenance"]) == 62
    record = study62["trained_on"]["pretraining"]
    assert record["transitions"] == t2 and record["continued_from"]["policy"] == "run61"
    assert {k: record["continued_from"][k] for k in ("episodes", "transitions", "sac_updates")} == \
        {"episodes": 61, "transitions": 1620 + t1, "sac_updates": 12960 + 2 * t1}
    assert {k: record["totals"][k] for k in ("episodes", "transitions", "sac_updates")} == \
        {"episodes": 62, "transitions": lifetime["transitions"], "sac_updates": lifetime["sac_updates"]}
    totals = training_totals(study62)
    assert (totals["episodes"], totals["transitions"], totals["sac_updates"]) == (62, *list(lifetime.values())[1:])
    assert totals["cpu_seconds"] is None  # the single run's cost is not recorded: the sum is unknown, not low
    # the trial's own snapshot of the shared policy when it ended (its run entry added): the study's save counted
    # neither its run nor its transitions again
    (snapshot,) = [load_manifest(p.parent) for p in (study_dir / "trials").glob("*/policy/manifest.json")]
    assert snapshot["lifetime"]["runs"] == 62 and snapshot["provenance"] == study62["provenance"]
    assert 1620 + t1 < snapshot["lifetime"]["transitions"] <= lifetime["transitions"]
    capsys.readouterr()  # what the run printed
    assert main(["policy", "list", "--policy-dir", str(policies)]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert f" {1620 + t1}  " in rows["run61"] and f" {lifetime['transitions']}  " in rows["study62"]


def test_the_policy_pre_trained_across_sizes_and_rates_counts_its_whole_chain():
    """residual-public-174: 102 episodes, then 54 (three model sizes, batch 16), then 18 (batch 32), each study
    continuing the last: its totals and provenance cover all 174 runs."""
    from raydp.control.store import resolve_policy, training_totals

    chain = [load_manifest(resolve_policy(name, RESIDUAL_POLICIES))
             for name in ("residual-public-102", "residual-public-156", "residual-public-174")]
    totals = [training_totals(m) for m in chain]
    assert [t["episodes"] for t in totals] == [len(m["provenance"]) for m in chain] == [102, 156, 174]
    for before, after, manifest in zip(totals, totals[1:], chain[1:]):
        assert after["transitions"] == before["transitions"] + manifest["transitions"]
        assert after["sac_updates"] == before["sac_updates"] + manifest["sac_updates"]
    assert chain[2]["trained_on"]["pretraining"]["continued_from"]["policy"] == "residual-public-156"
    assert set(chain[1]["trained_on"]["pretraining"]["models"]) == {"embedded-tiny", "embedded", "embedded-deep"}
