"""RLDP's controller decides deterministically given the run's releases and public seeds (the actions set the
DP clips, so they must be post-processing of DP releases plus public randomness; timing depends on the
private batch sizes and must not reach them): the same releases and seeds give bit-identical actions under
different learner delays, through the broker and over RLlink; runs sharing a broker do not change each
other's exploration; an open decision never expires; and a study shares one policy across concurrent trials
on public data only. Real Ray (a local cluster), real RLlib SAC learners."""

import os
import socket
import time

import numpy as np
import pytest
import torch

from raydp.control.broker import Broker, PolicyBroker
from raydp.control.features import ObservationLayout
from raydp.control.sac import SACSettings
from raydp.control.service import PolicySession

LAYOUT = ObservationLayout("shared", 4)
SETTINGS = SACSettings(b_sac=3, k=2, hidden=16, seed=7)
RUN_SEED = 11  # the run's public config seed
DECISIONS = 6  # -> 5 transitions, each trained on before the next decision
SLOW_LEARNER_S = 0.3  # the delayed learner sleeps this long before every train()


def observation(i: int) -> np.ndarray:
    rng = np.random.default_rng(1000 + i)
    return LAYOUT.pack(rng.normal(size=(2, LAYOUT.f_adapter)), rng.normal(size=LAYOUT.g_global))


def scripted_rewards() -> list[float | None]:
    """The reward reported with each decision (None at the first: no previous action)."""
    return [None] + [float(np.sin(i)) for i in range(1, DECISIONS)]


def drive(client, pause_s: float = 0.0) -> list[np.ndarray]:
    """The scripted run: its releases' observations and rewards, ``pause_s`` between decisions (a run whose
    steps take longer, as a larger private batch would)."""
    actions = []
    for i, reward in enumerate(scripted_rewards()):
        actions.append(np.asarray(client.decide(observation(i), reward)).copy())
        time.sleep(pause_s)
    return actions


@pytest.fixture
def torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # a broker built in-process sets one thread


# -- (a) through the broker: the same actions whatever the learner's delay --------------------------------
def test_broker_decisions_are_the_same_under_different_learner_delays(local_ray):
    """A fast learner beside a slow run, and a slow learner beside a fast run: each decision waits for the
    training on every earlier transition, and the training's randomness is the public SAC seed's, so the
    actions are bit-identical. (Before, the broker acted with whatever weights had arrived.)"""
    runs = []
    for delay_s, pause_s in ((0.0, 0.3), (SLOW_LEARNER_S, 0.0)):
        with PolicySession(LAYOUT, SETTINGS, train_delay_s=delay_s) as session:
            client = session.client("run", seed=RUN_SEED)
            actions = drive(client, pause_s)
            client.end()
            counters = session.counters()
            runs.append({"actions": actions, "trained": counters["transitions_trained"],
                         "errors": counters["errors"], "weights_seq": session.info()["weights_seq"]})
    fast, slow = runs
    for i, (a, b) in enumerate(zip(fast["actions"], slow["actions"])):
        assert np.array_equal(a, b), f"decision {i} differs: {a} vs {b}"
    assert fast["errors"] == slow["errors"] == []
    assert fast["trained"] == slow["trained"] == DECISIONS - 1
    assert fast["weights_seq"] > 0 and slow["weights_seq"] > 0  # the decisions saw trained weights


# -- (b) runs sharing a broker: each explores with its own generator --------------------------------------
def test_runs_sharing_a_broker_do_not_change_each_others_exploration(local_ray):
    """Run A's exploration noise is a function of public seeds only: alone, or interleaved with run B's
    decisions (before, one global generator served every run: B's draws shifted A's noise)."""
    import ray

    def run_a(with_b: bool) -> list[np.ndarray]:
        broker = PolicyBroker.remote(LAYOUT.as_dict(), SETTINGS.as_dict(), None, SETTINGS.seed)
        try:
            ray.get(broker.register.remote("a"))
            ray.get(broker.register.remote("b"))
            out = []
            for i, reward in enumerate(scripted_rewards()):
                if with_b:  # B decides before and after each of A's decisions
                    ray.get(broker.decide.remote("b", observation(50 + i), reward))
                action, _ = ray.get(broker.decide.remote("a", observation(i), reward))
                out.append(np.asarray(action))
                if with_b:
                    ray.get(broker.decide.remote("b", observation(80 + i), reward))
            return out
        finally:
            ray.kill(broker)

    alone, shared = run_a(False), run_a(True)
    for i, (a, b) in enumerate(zip(alone, shared)):
        assert np.array_equal(a, b), f"run A's decision {i} changed when run B shared the broker"


def test_each_run_explores_from_its_public_seed(torch_threads):
    """Different public seeds give different noise; the same seed the same noise, whatever the process's
    global torch generator did meanwhile."""
    first = Broker(LAYOUT.as_dict(), SETTINGS.as_dict(), seed=SETTINGS.seed)
    second = Broker(LAYOUT.as_dict(), SETTINGS.as_dict(), seed=SETTINGS.seed)
    first.register("a", seed=RUN_SEED)
    first.register("b", seed=RUN_SEED + 1)
    second.register("a", seed=RUN_SEED)
    torch.manual_seed(12345)  # the global generator is nobody's exploration
    a1, _ = first.decide("a", observation(0), None)
    b1, _ = first.decide("b", observation(0), None)
    torch.rand(100)
    a2, _ = second.decide("a", observation(0), None)
    assert np.array_equal(a1, a2) and not np.array_equal(a1, b1)
    assert first.info()["runs"]["a"]["seed"] == RUN_SEED


# -- (c) no decision expires -------------------------------------------------------------------------------
def test_an_open_decision_never_expires(monkeypatch, torch_threads):
    """A run whose next decision comes a long time later (its steps were slow) still closes its open decision
    into a transition: whether it does may not depend on timing (before, a time-to-live dropped it)."""
    broker = Broker(LAYOUT.as_dict(), SETTINGS.as_dict(), seed=SETTINGS.seed)
    broker.register("slow-run")
    broker.decide("slow-run", observation(0), None)
    later = time.time() + 10 * 24 * 3600  # ten days on
    monkeypatch.setattr(time, "time", lambda: later)
    assert broker.drain(10) == []  # the trainer polls meanwhile: nothing pending, nothing dropped
    broker.decide("slow-run", observation(1), 0.5)
    (transition,) = broker.drain(10)
    assert transition[2] == 0.5 and np.array_equal(transition[3], observation(1).astype(np.float32))
    assert broker.info()["open"] == 1 and broker.info()["transitions"] == 1


# -- (d) over RLlink: the same property ----------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rllink_decisions_are_the_same_under_different_learner_delays(local_ray, monkeypatch):
    """Over RLlink the server answers GET_STATE only once it has trained on every transition received, and
    the client explores from its own public-seeded generator: the same actions under a slow learner."""
    from raydp.control.rllink import SECRET_ENV, RLlinkPolicyClient, RLlinkPolicyServer

    secret = "determinism-test-secret-0123456789"
    monkeypatch.setenv(SECRET_ENV, secret)
    declared = {"privacy_mode": "strict", "action_decoding": "relative"}
    runs = []
    for delay_s, pause_s in ((0.0, 0.3), (SLOW_LEARNER_S, 0.0)):
        with RLlinkPolicyServer(LAYOUT, SETTINGS, port=free_port(), trained_on=declared,
                                train_delay_s=delay_s) as server:
            client = RLlinkPolicyClient(server.address.host, server.address.port, "run", secret=secret.encode(),
                                        expect=declared, seed=RUN_SEED)
            try:
                actions = drive(client, pause_s)
                client.end()
            finally:
                client.close()
            assert server.wait_idle(60)
            counters = server.counters()
            runs.append({"actions": actions, "trained": counters["transitions_trained"],
                         "errors": counters["errors"], "seen": list(client.weights_seen)})
    fast, slow = runs
    for i, (a, b) in enumerate(zip(fast["actions"], slow["actions"])):
        assert np.array_equal(a, b), f"decision {i} differs: {a} vs {b}"
    assert fast["errors"] == slow["errors"] == []
    assert fast["trained"] == slow["trained"] == DECISIONS - 1
    # the weights each decision acted with: new ones at every decision after the first transition
    assert fast["seen"] == slow["seen"] and len(set(fast["seen"][1:])) == DECISIONS - 1, fast["seen"]


# -- (e) a shared policy only on public data -------------------------------------------------------------------
@pytest.mark.parametrize("data", [{}, {"source": "synthetic"}, {"source": "records.csv"}])
def test_a_study_shares_one_policy_on_public_data_only(data):
    from raydp.config import validate_config
    from raydp.errors import ConfigError
    from raydp.study.config import StudyConfig

    study = {"name": "shared", "models": ["embedded-tiny"], "epsilons": [2.0], "strategies": ["rldp"],
             "policy": "shared", "sac_grid": {"t_rl": [4], "b_sac": [4], "k": [2]},
             "base": {"data": {"n_records": 400, **data}}}
    with pytest.raises(ConfigError) as refused:
        validate_config(StudyConfig, study)
    message = str(refused.value)
    assert "public data only" in message and "policy: per-trial" in message and "\n" not in message
    public = {**study, "base": {"data": {"n_records": 400, "source": "public"}}, "private_data": False}
    assert validate_config(StudyConfig, public).policy == "shared"
    assert validate_config(StudyConfig, {**study, "policy": "per-trial"}).policy == "per-trial"
