"""A policy shipped to run frozen carries no replay buffer (raydp.control.store.copy_policy_without_replay): it
loads as the full policy does and acts the same on the same observations. The quickstart's policy in policies/ is
the residual campaign's residual-public-174 without it."""

import json
from pathlib import Path

import numpy as np

from raydp.control.store import (
    MANIFEST,
    MODULE_FILE,
    REPLAY_FILE,
    build_module,
    copy_policy_without_replay,
    load_manifest,
    load_module_state,
    read_replay,
    resolve_policy,
)

REPO = Path(__file__).resolve().parents[1]
FULL = REPO / "experiments" / "residual-rldp" / "policies" / "residual-public-174"  # module, replay, manifest
SHIPPED = REPO / "policies" / "residual-public-174"


def _greedy_actions(path: Path, observations: np.ndarray) -> np.ndarray:
    """The actions a frozen run takes with the policy at ``path``: the broker built as a frozen session builds it
    (the module's inference weights), acting without exploration."""
    from raydp.control.broker import Broker

    manifest = load_manifest(path)
    weights = build_module(manifest, load_module_state(path)).get_state(inference_only=True)
    broker = Broker(manifest["layout"], manifest["sac"], weights, seed=0)
    broker.register("run", explore=False)
    return np.stack([broker.decide("run", obs, None)[0] for obs in observations])


def test_a_policy_without_its_replay_buffer_loads_and_acts_as_the_full_one(tmp_path):
    from raydp.config import TrainConfig, validate_config
    from raydp.control.policies import check_policy_privacy
    from raydp.study.config import load_study

    stripped = copy_policy_without_replay(FULL, tmp_path / "policies" / "frozen-174")
    assert sorted(p.name for p in stripped.iterdir()) == [MANIFEST, MODULE_FILE]
    assert read_replay(stripped / REPLAY_FILE) == {}  # what restoring it reads: no transitions
    full, copy = load_manifest(FULL), load_manifest(stripped)
    assert copy == {**full, "name": "frozen-174", "replay_buffer": "removed"}  # provenance and training record kept
    assert resolve_policy("frozen-174", tmp_path / "policies") == stripped.resolve()
    quickstart = load_study(REPO / "trials" / "quickstart.yaml").strategy_settings["rldp"]  # how it runs the policy
    config = validate_config(TrainConfig, {"strategy": "rldp", "epsilon": 2.0, "settings": {
        **quickstart, "policy": "frozen-174", "policy_dir": str(tmp_path / "policies")}})
    assert config.strategy_settings().frozen
    assert check_policy_privacy(config) == stripped.resolve()  # strict, residual decoding, the same width
    observations = read_replay(FULL / REPLAY_FILE)["obs"][::600][:8]  # observations the policy was trained on
    assert len(observations) == 8
    actions = _greedy_actions(FULL, observations)
    assert np.array_equal(_greedy_actions(stripped, observations), actions)
    assert np.ptp(actions, axis=0).max() > 0  # the observations differ in what the policy does


def test_the_shipped_quickstart_policy_is_the_campaigns_without_its_replay_buffer():
    assert not (SHIPPED / REPLAY_FILE).exists() and (FULL / REPLAY_FILE).is_file()
    assert (SHIPPED / MODULE_FILE).read_bytes() == (FULL / MODULE_FILE).read_bytes()
    assert json.loads((SHIPPED / MANIFEST).read_text()) == {**load_manifest(FULL), "replay_buffer": "removed"}
