"""The broker's bookkeeping without Ray: runs share it, and a run that dies leaves only its open decision,
never turned into a transition; no open decision expires (whether a transition forms may not depend on
timing, which depends on the private batch sizes). The same end to end, through Ray and the policy service,
is the slow test_rldp.py::test_two_runs_share_a_policy_and_one_can_die; expiry and per-run exploration are
test_controller_determinism.py's."""

import numpy as np
import pytest
import torch

from raydp.control.broker import Broker
from raydp.control.features import ObservationLayout
from raydp.control.sac import SACSettings

LAYOUT = ObservationLayout("shared", 4)


def observation(seed):
    rng = np.random.default_rng(seed)
    return LAYOUT.pack(rng.normal(size=(2, LAYOUT.f_adapter)), rng.normal(size=LAYOUT.g_global))


@pytest.fixture
def torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # the broker sets one thread for its actor process


def test_a_run_that_dies_leaves_only_an_open_decision(torch_threads):
    broker = Broker(LAYOUT.as_dict(), SACSettings(hidden=16).as_dict())
    assert broker.register("survivor") == LAYOUT.as_dict() and broker.register("victim")
    for i in range(3):  # each closes its previous decision with the reward of its action
        action, _ = broker.decide("survivor", observation(i), None if i == 0 else float(i))
        assert action.shape == (LAYOUT.act_dim,)
        broker.decide("victim", observation(10 + i), None if i == 0 else -float(i))
    # the victim dies here: it never decides again and never ends
    transitions = broker.drain(10)
    assert sorted(r for _, _, r, _ in transitions) == [-2.0, -1.0, 1.0, 2.0]
    survivor = [t for t in transitions if t[2] > 0]
    seen = observation(1).astype(np.float32)  # the next observation closes a decision and opens the next
    assert np.array_equal(survivor[0][3], seen) and np.array_equal(survivor[1][0], seen)
    broker.decide("survivor", observation(3), 3.0)
    assert [r for _, _, r, _ in broker.drain(10)] == [3.0]
    info = broker.info()
    assert info["open"] == 2 and info["transitions"] == 5  # the victim's decision stays open: none expires
    broker.end("survivor")
    runs = broker.info()["runs"]
    assert runs["survivor"]["ended"] and not runs["victim"]["ended"] and runs["survivor"]["decisions"] == 4
    assert broker.info()["open"] == 1  # ending drops the run's open decision; nothing became a transition
    assert broker.num_pending() == 0
