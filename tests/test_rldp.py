"""RLDP end to end on a real local Ray: runs as actors, a live RLlib SAC policy, saved policies, transfer."""

import json
import time

import numpy as np
import pandas as pd
import pytest
import ray
import torch

from raydp.config import TrainConfig, validate_config
from raydp.control.features import ObservationLayout
from raydp.control.modules import greedy_action
from raydp.control.sac import SACSettings, module_spec
from raydp.control.service import PolicySession
from raydp.privacy.ledger import LEDGER_FILENAME, PrivacyLedger
from raydp.runner.launch import train



def tiny_config(**overrides):
    values = {"model": "embedded-tiny", "strategy": "rldp", "epsilon": 2.0, "data": {"n_records": 400},
              "max_steps": 24, "eval_every": 12, "eval_max_records": 16, "warmup_steps": 4,
              "settings": {"t_warm": 4, "t_rl": 4, "b_sac": 4, "k": 2, "n_max": 8, "hidden": 32}}
    for key, value in overrides.items():
        if isinstance(value, dict):
            values[key] = {**values.get(key, {}), **value}
        else:
            values[key] = value
    return validate_config(TrainConfig, values)


# -- the policy service alone ----------------------------------------------------------------------
LAYOUT = ObservationLayout("shared", 6)
SETTINGS = SACSettings(b_sac=3, k=3, hidden=32)


def observation(seed, n=4):
    rng = np.random.default_rng(seed)
    return LAYOUT.pack(rng.normal(size=(n, LAYOUT.f_adapter)), rng.normal(size=LAYOUT.g_global))


@pytest.fixture(scope="module")
def trained_session(local_ray):
    session = PolicySession(LAYOUT, SETTINGS)
    client = session.client("probe-run")
    reward = None
    for i in range(6):  # 6 decisions -> 5 transitions
        client.decide(observation(i), reward)
        reward = 0.1 * i
    ray.get(session.service.wait_idle.remote())
    yield session
    session.close()


def test_each_transition_gets_k_sac_updates_of_b_sac(trained_session):
    counters = trained_session.counters()
    assert counters["errors"] == []
    assert counters["transitions_trained"] == 5 and counters["train_calls"] == 5
    # RLlib's own learner metric: K updates x B_SAC transitions, per transition
    assert counters["module_steps_trained"] == 5 * SETTINGS.k * SETTINGS.b_sac
    assert counters["replay_size"] == 5
    assert counters["alpha"] == pytest.approx(0.04)  # fixed temperature
    assert trained_session.info()["weights_seq"] > 0  # new weights reached the broker


def test_saved_policy_reloads_and_gives_identical_actions(trained_session, tmp_path):
    weights, _ = ray.get(trained_session.broker.get_weights.remote())
    live = module_spec(LAYOUT, SETTINGS, inference_only=True).build()
    live.set_state(weights)
    obs = observation(99)
    from ray.rllib.core.columns import Columns

    with torch.no_grad():
        expected = greedy_action(live.forward_inference({Columns.OBS: torch.as_tensor(obs[None])})[
            Columns.ACTION_DIST_INPUTS])[0].numpy()
    manifest = trained_session.save(tmp_path / "p", trained_on={"model": "none"}, results={})
    assert manifest["transitions"] == 5 and manifest["layout"]["version"] == "rldp-obs-v1"
    with PolicySession(LAYOUT, SETTINGS, restore=tmp_path / "p", frozen=True) as frozen:
        client = frozen.client("reuse")
        first = client.decide(obs, None)
        again = client.decide(obs, 0.0)
        assert np.array_equal(first, again)  # frozen: the same action for the same observation
        # The frozen policy acts in another process (the broker actor), whose BLAS may sum in another
        # order: equal up to float32 rounding, not bit for bit.
        np.testing.assert_allclose(first, expected, rtol=0, atol=1e-6)
        assert frozen.info()["pending"] == 0  # a frozen policy records no transitions
    # restoring for further training keeps the replay buffer
    with PolicySession(LAYOUT, SETTINGS, restore=tmp_path / "p") as resumed:
        assert resumed.counters()["replay_size"] == 5


def test_a_session_that_fails_to_start_leaves_no_actor_behind(trained_session, tmp_path):
    """The broker and the service start at once; when one fails (here the service: the saved policy's module file is
    missing), the session's start raises and neither actor lives on under the session's name."""
    import shutil

    from raydp.control.store import MODULE_FILE

    trained_session.save(tmp_path / "p", trained_on={"model": "none"}, results={})
    shutil.copytree(tmp_path / "p", tmp_path / "broken")
    (tmp_path / "broken" / MODULE_FILE).unlink()
    with pytest.raises(Exception) as caught:  # kept: its traceback holds the session, and so the broker's handle
        PolicySession(LAYOUT, SETTINGS, restore=tmp_path / "broken", name="broken-session")
    assert "PolicyService" in str(caught.value) and MODULE_FILE in str(caught.value)  # the service's own error
    deadline = time.time() + 30
    while time.time() < deadline:  # ray.kill is asynchronous: the name goes once the actor is dead
        try:
            ray.get_actor("broken-session", namespace="raydp")
        except ValueError:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the broker of a session that failed to start is still alive")


# -- runs as Ray actors ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def rldp_run(local_ray, tmp_path_factory):
    root = tmp_path_factory.mktemp("rldp")
    config = tiny_config(settings={"save_policy": "tiny", "policy_dir": str(root / "policies")})
    summary = train(config, root / "run", progress=False)
    return root, summary


def test_rldp_run_is_within_budget_with_its_traces(rldp_run):
    root, summary = rldp_run
    run = root / "run"
    privacy = summary["privacy"]
    assert privacy["within_budget"] and privacy["epsilon"] <= 2.0
    assert privacy["privacy_mode"] == "strict" and privacy["privacy_label"] is None
    assert privacy["releases_per_step"] == ["gradient", "norm_histogram", "loss_sum"]
    ledger = PrivacyLedger.load(run / LEDGER_FILENAME)
    assert len(ledger) == summary["steps"] == 24
    assert all(len(row.releases) == 3 for row in ledger)
    trace = pd.read_parquet(run / "control_trace.parquet")
    assert list(trace["step"]) == list(range(1, 25)) and {"clip_0", "clip_1", "sigma"} <= set(trace.columns)
    decisions = pd.read_parquet(run / "controller_decisions.parquet")
    assert list(decisions["step"]) == [8, 12, 16, 20, 24]  # t > T_warm and t mod T_RL == 0
    controller = summary["controller"]
    assert controller["decisions"] == 5 and controller["transitions"] == 4
    # no timing in releasable files: it depends on the private batch sizes (the decisions do not)
    assert not {"action_latency_ms_median", "weights_versions_seen"} & set(controller)
    assert "latency_s" not in decisions.columns
    assert summary["policy_service"]["transitions_trained"] == 4
    assert summary["policy_service"]["module_steps_trained"] == 4 * 2 * 4
    assert json.loads((run / "summary.json").read_text())["policy_service"]["transitions_trained"] == 4
    # Adaptive sigma: the guarantee is the Renyi filter's (E13), fixed before training; the realized
    # per-step RDP, recomputed here with dp_accounting at integer orders, stays under its budget curve.
    assert_within_the_filters_budget(privacy, ledger)
    assert set(decisions["privacy_mode"]) == {"strict"} and decisions["privacy_label"].isna().all()
    saved = json.loads((root / "policies" / "tiny" / "manifest.json").read_text())
    assert saved["trained_on"]["n_adapter_pairs"] == 2 and saved["architecture"] == "shared"
    assert saved["provenance"][-1]["dataset_id"] == summary["dataset_id"]  # E14
    assert saved["provenance"][-1]["privacy_mode"] == "strict"


# ~50 s: a frozen saved policy driving a larger model in paper mode; frozen actions are
# test_rldp.py::test_saved_policy_reloads_and_gives_identical_actions, a saved policy's reuse by a later
# study test_study.py::test_rldp_trials_can_share_one_policy, the paper-mode label test_policy_provenance.py
@pytest.mark.slow
def test_frozen_policy_controls_a_model_with_more_adapters_in_paper_mode(rldp_run, tmp_path):
    root, _ = rldp_run
    config = tiny_config(model="embedded-tiny-deep",
                         settings={"policy": "tiny", "policy_dir": str(root / "policies"), "frozen": True,
                               "privacy_mode": "paper"})
    summary = train(config, tmp_path / "deep", progress=False)
    assert summary["n_adapter_pairs"] == 4  # the policy was trained with 2
    privacy = summary["privacy"]
    assert privacy["privacy_mode"] == "paper"
    assert privacy["privacy_label"] == ("epsilon covers the gradient releases only; the controller observed "
                                        "unprivatized statistics")
    assert privacy["releases_per_step"] == ["gradient"] and privacy["within_budget"]
    assert summary["controller"]["decisions"] == 5
    trace = pd.read_parquet(tmp_path / "deep" / "control_trace.parquet")
    assert {f"clip_{i}" for i in range(4)} <= set(trace.columns)
    assert not (tmp_path / "deep" / "policy").exists()  # a frozen policy is not re-saved
    assert summary["policy_service"] == {}


def test_rldp_needs_a_policy_to_freeze():
    from raydp.errors import ConfigError

    with pytest.raises(ConfigError, match="frozen policy needs"):
        tiny_config(settings={"frozen": True})


# ~2.5-5 min: two Ray actor runs sharing one policy service is test_study.py::
# test_rldp_trials_can_share_one_policy; a run killed mid-training is test_study.py::
# test_a_killed_trial_resumes_with_exactly_the_planned_ledger; a dead run's open decision (kept, never
# a transition) is test_broker.py::test_a_run_that_dies_leaves_only_an_open_decision
@pytest.mark.slow
def test_two_runs_share_a_policy_and_one_can_die(local_ray, tmp_path):
    from raydp.runner.actor import FineTuningRun

    with PolicySession(ObservationLayout("shared", 8), SACSettings(b_sac=4, k=2, hidden=32)) as session:
        survivor_cfg = tiny_config(max_steps=40, epochs=5, settings={"t_rl": 2, "t_warm": 2})  # 5 epochs > 40 steps
        victim_cfg = tiny_config(max_steps=400, data={"n_records": 400, "seed": 1}, settings={"t_rl": 2, "t_warm": 2})
        survivor, victim = (FineTuningRun.options(num_cpus=1).remote(1) for _ in range(2))
        done = survivor.run.remote(survivor_cfg.model_dump(mode="json"), str(tmp_path / "a"), False,
                                   session.connection(), "survivor", False)
        victim.run.remote(victim_cfg.model_dump(mode="json"), str(tmp_path / "b"), False,
                          session.connection(), "victim", False)
        deadline = time.time() + 300
        while session.info()["runs"].get("victim", {}).get("decisions", 0) < 3:
            assert time.time() < deadline, "the victim run never reached the policy"
            time.sleep(0.5)
        ray.kill(victim)
        trained_at_kill = session.counters()["train_calls"]
        summary = ray.get(done, timeout=600)
        assert summary["privacy"]["within_budget"] and summary["steps"] == 40
        assert summary["controller"]["decisions"] == 19  # steps 4, 6, ..., 40
        ray.get(session.service.wait_idle.remote())
        counters = session.counters()
        assert counters["errors"] == [] and counters["train_calls"] > trained_at_kill  # training went on
        info = session.info()
        assert info["pending"] == 0 and info["runs"]["survivor"]["ended"] and not info["runs"]["victim"]["ended"]
        assert not (tmp_path / "b").exists()  # the killed run left no half-written output


def test_policy_cli_lists_shows_and_exports(rldp_run, tmp_path, capsys):
    import tarfile

    from raydp.cli import main
    from raydp.control.store import POLICY_FORMAT

    root, _ = rldp_run
    policies = str(root / "policies")
    assert main(["policy", "list", "--policy-dir", policies]) == 0
    listing = capsys.readouterr().out
    assert "tiny" in listing and "embedded-tiny (2 pairs, eps 2)" in listing
    assert main(["policy", "show", "tiny", "--policy-dir", policies]) == 0
    assert json.loads(capsys.readouterr().out)["format"] == POLICY_FORMAT
    archive = tmp_path / "tiny.tar.gz"
    assert main(["policy", "export", "tiny", "--policy-dir", policies, "--to", str(archive)]) == 0
    with tarfile.open(archive) as tar:
        assert {"tiny/manifest.json", "tiny/replay.npz"} <= set(tar.getnames())
    assert main(["policy", "show", "missing", "--policy-dir", policies]) == 2
    assert "no saved policy 'missing'" in capsys.readouterr().err


def assert_within_the_filters_budget(privacy: dict, ledger) -> None:
    """An adaptive-sigma run's guarantee is the Renyi filter's (E13), fixed before training: its realized
    per-step RDP, recomputed with dp_accounting at integer orders, stays under the filter's budget curve."""
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant as dpa_rdp

    flt = privacy["filter"]
    assert privacy["guarantee"] == "renyi-filter" and privacy["epsilon"] == pytest.approx(flt["epsilon"])
    orders = [a for a in flt["orders"] if float(a).is_integer()]
    acc = dpa_rdp.RdpAccountant(orders)
    for q, s in zip(ledger.q, ledger.sigma_eff):
        acc.compose(dp_event.PoissonSampledDpEvent(float(q), dp_event.GaussianDpEvent(float(s))))
    budget = [b for a, b in zip(flt["orders"], flt["budget_rdp"]) if float(a).is_integer()]
    assert all(r <= b * (1 + 1e-6) for r, b in zip(acc._rdp, budget))
