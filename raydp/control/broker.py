"""The broker between fine-tuning runs and the SAC policy (RLlib's external-env pattern, new API stack).

Control is inverted as in an external environment: each run owns its training loop and, every T_RL
steps, calls :meth:`Broker.decide` with its observation and the reward of its previous action;
the broker closes the run's open (obs, action) into a transition, samples an action with the latest
weights, and keeps (obs, action) open. The policy service's RLlib algorithm uses
:class:`BrokerEnvRunner` (a custom ``EnvRunner``, RLlib's documented extension point for external
environments) whose ``sample()`` takes pending transitions from the broker; after training, the
runner's ``set_state`` pushes the new weights back to the broker.

Properties: any number of runs share one broker (runs join with :meth:`register`, leave with
:meth:`end`); a run that dies only leaves an open (obs, action), dropped after ``open_ttl_s``; nothing
waits on a run; no listening ports (Ray handles and a named actor only).
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np
import ray
import torch
from ray.rllib.core import COMPONENT_RL_MODULE, DEFAULT_AGENT_ID, DEFAULT_MODULE_ID
from ray.rllib.env import INPUT_ENV_SPACES
from ray.rllib.env.env_runner import EnvRunner
from ray.rllib.utils.checkpoints import Checkpointable
from ray.rllib.utils.metrics import (
    NUM_AGENT_STEPS_SAMPLED,
    NUM_AGENT_STEPS_SAMPLED_LIFETIME,
    NUM_ENV_STEPS_SAMPLED,
    NUM_ENV_STEPS_SAMPLED_LIFETIME,
    NUM_EPISODES,
    NUM_EPISODES_LIFETIME,
    WEIGHTS_SEQ_NO,
)

from raydp.control.features import ObservationLayout
from raydp.control.sac import SACSettings, module_spec
from raydp.control.training import transition_episodes


class Broker:
    """Acts for the runs with the latest policy weights and queues their transitions for training.

    A plain class (its Ray actor is :data:`PolicyBroker`), so its bookkeeping is tested without Ray."""

    def __init__(self, layout: dict, settings: dict, weights: dict | None = None, seed: int = 0,
                 open_ttl_s: float = 3600.0):
        torch.set_num_threads(1)
        torch.manual_seed(seed)
        self.layout = ObservationLayout(**layout)
        self.module = module_spec(self.layout, SACSettings(**settings), inference_only=True).build()
        self.weights_seq = -1
        if weights is not None:
            self.set_weights(weights, 0)
        self.open: dict[str, tuple[np.ndarray, np.ndarray, float]] = {}
        self.pending: deque = deque()
        self.runs: dict[str, dict] = {}
        self.open_ttl_s = open_ttl_s
        self.transitions = 0
        self.dropped_open = 0

    # -- runs ----------------------------------------------------------------------------------
    def register(self, run_id: str, explore: bool = True) -> dict:
        self.runs[run_id] = {"explore": explore, "decisions": 0, "joined": time.time(), "ended": False}
        return self.layout.as_dict()

    def decide(self, run_id: str, obs, reward: float | None) -> tuple[np.ndarray, int]:
        """Close the run's open decision with (reward, obs) and act on obs: (action, weights seq)."""
        obs = np.asarray(obs, dtype=np.float32)
        run = self.runs.setdefault(run_id, {"explore": True, "decisions": 0, "joined": time.time(), "ended": False})
        previous = self.open.pop(run_id, None)
        if previous is not None and reward is not None and run["explore"]:
            self.pending.append((previous[0], previous[1], float(reward), obs))
            self.transitions += 1
        action = self._act(obs, run["explore"])
        self.open[run_id] = (obs, action, time.time())
        run["decisions"] += 1
        return action, self.weights_seq

    def end(self, run_id: str) -> None:
        self.open.pop(run_id, None)
        if run_id in self.runs:
            self.runs[run_id]["ended"] = True

    def _act(self, obs: np.ndarray, explore: bool) -> np.ndarray:
        from ray.rllib.core.columns import Columns

        from raydp.control.modules import MaskedGaussian, greedy_action

        with torch.no_grad():
            logits = self.module.forward_inference({Columns.OBS: torch.as_tensor(obs[None])})[
                Columns.ACTION_DIST_INPUTS]
            action = MaskedGaussian.from_logits(logits).sample() if explore else greedy_action(logits)
        return action[0].numpy().astype(np.float32)

    # -- the trainer's side ----------------------------------------------------------------------
    def num_pending(self) -> int:
        return len(self.pending)

    def drain(self, max_items: int = 1) -> list:
        self._expire_open()
        out = []
        while self.pending and len(out) < max_items:
            out.append(self.pending.popleft())
        return out

    def set_weights(self, weights: dict, seq: int) -> None:
        self.module.set_state(weights)
        self.weights_seq = int(seq)

    def get_weights(self) -> tuple[dict, int]:
        return self.module.get_state(inference_only=True), self.weights_seq

    def info(self) -> dict:
        return {"weights_seq": self.weights_seq, "pending": len(self.pending), "open": len(self.open),
                "transitions": self.transitions, "dropped_open": self.dropped_open,
                "runs": {k: dict(v) for k, v in self.runs.items()}}

    def _expire_open(self) -> None:
        now = time.time()
        for run_id in [r for r, (_, _, t) in self.open.items() if now - t > self.open_ttl_s]:
            del self.open[run_id]
            self.dropped_open += 1


#: the broker as a Ray actor: one call at a time, so decisions and drains never interleave
PolicyBroker = ray.remote(num_cpus=0, max_concurrency=1)(Broker)


def log_sampled(metrics, n: int) -> None:
    """RLlib's sampling counters for ``n`` one-step transitions (no episode ends): what its algorithms
    read from an env runner's metrics."""
    metrics.log_value(NUM_ENV_STEPS_SAMPLED, n, reduce="sum")
    metrics.log_value((NUM_AGENT_STEPS_SAMPLED, DEFAULT_AGENT_ID), n, reduce="sum")
    metrics.log_value(NUM_EPISODES, 0, reduce="sum")
    metrics.log_value(NUM_ENV_STEPS_SAMPLED_LIFETIME, n, reduce="lifetime_sum")
    metrics.log_value((NUM_AGENT_STEPS_SAMPLED_LIFETIME, DEFAULT_AGENT_ID), n, reduce="lifetime_sum")
    metrics.log_value(NUM_EPISODES_LIFETIME, 0, reduce="lifetime_sum")


class BrokerEnvRunner(EnvRunner, Checkpointable):
    """RLlib EnvRunner whose 'environment' is the broker: each sample() is one run's transition."""

    def __init__(self, *, config, **kwargs):
        super().__init__(config=config, **kwargs)
        self._weights_seq_no = 0
        self.module = self.config.get_rl_module_spec(spaces=self.get_spaces(), inference_only=True).build()
        env_config = self.config.env_config
        self.broker = ray.get_actor(env_config["broker_name"], namespace=env_config["namespace"])

    def assert_healthy(self):
        assert self.module is not None

    def get_spaces(self):
        sp = (self.config.observation_space, self.config.action_space)
        return {INPUT_ENV_SPACES: sp, DEFAULT_MODULE_ID: sp}

    def sample(self, **kwargs):
        transitions = ray.get(self.broker.drain.remote(1))
        while not transitions:  # RLlib keeps calling sample() until a step arrives
            time.sleep(0.01)
            transitions = ray.get(self.broker.drain.remote(1))
        episodes = transition_episodes(transitions, self.config)
        log_sampled(self.metrics, len(episodes))
        return episodes

    def get_metrics(self):
        return self.metrics.reduce()

    def get_ctor_args_and_kwargs(self):
        return (), {"config": self.config}

    def get_checkpointable_components(self):
        return [(COMPONENT_RL_MODULE, self.module)]

    def get_state(self, components=None, *, not_components=None, **kwargs):
        return {COMPONENT_RL_MODULE: self.module.get_state(), WEIGHTS_SEQ_NO: self._weights_seq_no}

    def set_state(self, state):
        """RLlib's weight sync: keep the weights and push them to the broker for the runs."""
        if COMPONENT_RL_MODULE in state:
            s = state[COMPONENT_RL_MODULE]
            s = ray.get(s) if isinstance(s, ray.ObjectRef) else s
            self.module.set_state(s.get(DEFAULT_MODULE_ID, s))
            self._weights_seq_no = state.get(WEIGHTS_SEQ_NO, self._weights_seq_no)
            ray.get(self.broker.set_weights.remote(self.module.get_state(inference_only=True),
                                                   self._weights_seq_no))
