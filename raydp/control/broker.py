"""The broker between fine-tuning runs and the SAC policy (RLlib's external-env pattern, new API stack).

Control is inverted as in an external environment: each run owns its training loop and, every T_RL
steps, reaches the broker with its observation and the reward of its previous action; the broker closes
the run's open (obs, action) into a transition (:meth:`Broker.report`), samples an action
(:meth:`Broker.act`) and keeps (obs, action) open. The policy service's RLlib algorithm uses
:class:`BrokerEnvRunner` (a custom ``EnvRunner``, RLlib's documented extension point for external
environments) whose ``sample()`` takes pending transitions from the broker; inside every ``train()``,
the runner's ``set_state`` pushes the new weights back to the broker.

Decisions are deterministic given the run's releases and public seeds. The actions set the DP clip radii,
so they must be post-processing of the run's DP releases plus public randomness; when training finishes,
and so which weights a decision would see, depends on timing, and timing depends on the private (Poisson)
batch sizes. Hence:

* a decision waits for the learner (:class:`raydp.control.service.PolicyClient`): the run reports its
  transition (:meth:`Broker.report` returns how many transitions the broker has queued), waits until the
  service has trained on all of them (:meth:`raydp.control.training.TrainingLoop.wait_trained`; the
  weights reach the broker inside each ``train()``), and only then asks the broker to act. The broker's
  actor never waits itself (one call at a time; the runner calls :meth:`Broker.drain` and
  :meth:`Broker.set_weights` from inside ``train()``), so nothing deadlocks;
* each run explores with its own ``torch.Generator`` (:func:`exploration_generator`), seeded from public
  values only: the policy's SAC seed and the run's public seed given at :meth:`Broker.register` (a run's
  config ``seed``; without one, a hash of its run id). No generator is shared between runs, so a run's
  exploration noise does not depend on what other runs do or when;
* no decision expires: a run that dies leaves only its open (obs, action), never a transition, and a run
  that comes back after any pause closes its open decision as usual.

With one run per policy (``raydp train``, a study's ``policy: per-trial``), a decision is then a function
of the restored policy, the run's transitions so far and the public seeds. A policy shared by concurrent
runs trains on their transitions in the order they arrive, which timing decides: studies allow it on
public data only (``policy: shared``, :mod:`raydp.study.config`). Any number of runs can share one broker
(runs join with :meth:`Broker.register`, leave with :meth:`Broker.end`); no listening ports (Ray handles
and a named actor only). Nothing here writes timing to a run's files.
"""

from __future__ import annotations

import time
import zlib
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

#: the SeedSequence stream of exploration (the learner's are :mod:`raydp.control.training`'s)
EXPLORATION_STREAM = 3


def run_seed(run_id: str, seed: int | None = None) -> int:
    """A run's public exploration seed: ``seed`` (its config's) when given, else a hash of its run id."""
    return int(seed) if seed is not None else zlib.crc32(str(run_id).encode())


def exploration_generator(sac_seed: int, seed: int) -> torch.Generator:
    """The run's own exploration generator, from public values only: the policy's SAC seed and the run's seed
    (:func:`run_seed`). Both transports use it, so a run explores alike through the broker and over RLlink."""
    state = np.random.SeedSequence([EXPLORATION_STREAM, int(sac_seed) & 0xFFFFFFFFFFFFFFFF,
                                    int(seed) & 0xFFFFFFFFFFFFFFFF]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed((int(state[0]) << 31) ^ int(state[1]))


class Broker:
    """Acts for the runs with the policy's weights and queues their transitions for training.

    A plain class (its Ray actor is :data:`PolicyBroker`), so its bookkeeping is tested without Ray.
    ``seed``: the policy's public SAC seed (the initial module, replaced by the learner's weights when the
    service starts, and every run's exploration generator, :func:`exploration_generator`)."""

    def __init__(self, layout: dict, settings: dict, weights: dict | None = None, seed: int = 0):
        torch.set_num_threads(1)
        torch.manual_seed(seed)  # the module's initial weights; exploration never draws from this generator
        self.seed = int(seed)
        self.layout = ObservationLayout(**layout)
        self.module = module_spec(self.layout, SACSettings(**settings), inference_only=True).build()
        self.weights_seq = -1
        if weights is not None:
            self.set_weights(weights, 0)
        self.open: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.pending: deque = deque()
        self.runs: dict[str, dict] = {}
        self.generators: dict[str, torch.Generator] = {}
        self.transitions = 0

    # -- runs ----------------------------------------------------------------------------------
    def register(self, run_id: str, explore: bool = True, seed: int | None = None) -> dict:
        """A run joins: ``explore`` (sample, and record its transitions; False: act greedily), ``seed`` its
        public exploration seed (:func:`run_seed`). Registering again restarts the run's generator."""
        seed = run_seed(run_id, seed)
        self.runs[run_id] = {"explore": explore, "decisions": 0, "ended": False, "seed": seed}
        self.generators[run_id] = exploration_generator(self.seed, seed)
        return self.layout.as_dict()

    def _run(self, run_id: str) -> dict:
        if run_id not in self.runs:  # a run that never registered explores from its run id's seed
            self.register(run_id)
        return self.runs[run_id]

    def report(self, run_id: str, obs, reward: float | None) -> int:
        """Close the run's open decision with (reward, obs) into a transition; returns how many transitions
        the broker has queued so far (all runs): the decision on ``obs`` waits until the policy has trained
        on that many (:meth:`raydp.control.training.TrainingLoop.wait_trained`) before :meth:`act`."""
        obs = np.asarray(obs, dtype=np.float32)
        run = self._run(run_id)
        previous = self.open.pop(run_id, None)
        if previous is not None and reward is not None and run["explore"]:
            self.pending.append((previous[0], previous[1], float(reward), obs))
            self.transitions += 1
        return self.transitions

    def act(self, run_id: str, obs) -> tuple[np.ndarray, int]:
        """Act on ``obs`` with the current weights and the run's own generator, keep (obs, action) open:
        (action, weights seq)."""
        obs = np.asarray(obs, dtype=np.float32)
        run = self._run(run_id)
        action = self._act(obs, self.generators[run_id] if run["explore"] else None)
        self.open[run_id] = (obs, action)
        run["decisions"] += 1
        return action, self.weights_seq

    def decide(self, run_id: str, obs, reward: float | None) -> tuple[np.ndarray, int]:
        """:meth:`report` then :meth:`act` in one call, with the weights the broker holds: for a frozen policy
        (nothing trains) or bookkeeping without a learner; a run with a learner waits between the two."""
        self.report(run_id, obs, reward)
        return self.act(run_id, obs)

    def end(self, run_id: str) -> None:
        self.open.pop(run_id, None)
        if run_id in self.runs:
            self.runs[run_id]["ended"] = True

    def _act(self, obs: np.ndarray, generator: torch.Generator | None) -> np.ndarray:
        from raydp.control.modules import act

        return act(self.module, obs, generator)

    # -- the trainer's side ----------------------------------------------------------------------
    def num_pending(self) -> int:
        return len(self.pending)

    def drain(self, max_items: int = 1) -> list:
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
                "transitions": self.transitions, "runs": {k: dict(v) for k, v in self.runs.items()}}


#: the broker as a Ray actor: one call at a time, so decisions and drains never interleave (and no call waits)
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
        """RLlib's weight sync, inside ``train()``: keep the weights and push them to the broker (before
        ``train()`` returns, so before a decision waiting on it is answered)."""
        if COMPONENT_RL_MODULE in state:
            s = state[COMPONENT_RL_MODULE]
            s = ray.get(s) if isinstance(s, ray.ObjectRef) else s
            self.module.set_state(s.get(DEFAULT_MODULE_ID, s))
            self._weights_seq_no = state.get(WEIGHTS_SEQ_NO, self._weights_seq_no)
            ray.get(self.broker.set_weights.remote(self.module.get_state(inference_only=True),
                                                   self._weights_seq_no))
