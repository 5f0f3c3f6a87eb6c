"""The policy's side shared by both transports: RLlib's SAC algorithm trained once per pending transition on
a background thread (:class:`TrainingLoop`), and a policy restored from or written to a policy directory
(:func:`restore_policy`, :func:`write_policy`; the format is :mod:`raydp.control.store`'s).

:class:`raydp.control.service.PolicyService` (transitions from the broker) and
:class:`raydp.control.rllink.RLlinkPolicyServer` (transitions from RLlink clients) both use them; they
differ only in how pending transitions are counted (the ``pending`` callable) and where the algorithm's
EnvRunner takes them from in ``sample()``.
"""

from __future__ import annotations

import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

import numpy as np

from raydp.control.store import (
    MODULE_DIR,
    REPLAY_FILE,
    load_manifest,
    provenance_of,
    read_replay,
    write_manifest,
    write_replay,
)

LEARNER_MODULE = "learner_group/learner/rl_module/default_policy"
POLL_MIN_S, POLL_MAX_S = 0.02, 0.5
ERROR_PAUSE_S = 0.5


class TrainingLoop:
    """Calls ``algo.train()`` once per pending transition (``pending()``: how many are waiting), on its own
    thread, and counts what it trained.

    Each ``train()`` samples one transition from the algorithm's EnvRunner and makes K updates of B_SAC
    (:mod:`raydp.control.sac`). Idle polling backs off from 20 ms to 0.5 s: decisions are T_RL steps
    (seconds) apart, and a tight poll would take CPU from the runs on a small machine. An exception (from
    ``pending()`` or ``train()``) is recorded in ``errors`` and the loop keeps serving after a pause.
    ``lock`` is held around every ``train()``: hold it to read or write the algorithm between them."""

    def __init__(self, algo, pending: Callable[[], int], name: str = "sac-train",
                 poll_s: tuple[float, float] = (POLL_MIN_S, POLL_MAX_S), error_pause_s: float = ERROR_PAUSE_S):
        self.algo, self.pending, self.name = algo, pending, name
        self.poll_min_s, self.poll_max_s = poll_s
        self.error_pause_s = error_pause_s
        self.lock = threading.Lock()
        self.train_calls = self.transitions_trained = self.module_steps_trained = self.env_steps_sampled = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._busy = False
        self.thread: threading.Thread | None = None

    def start(self) -> "TrainingLoop":
        self.thread = threading.Thread(target=self.run, name=self.name, daemon=True)
        self.thread.start()
        return self

    def run(self) -> None:
        idle = self.poll_min_s
        while not self._stop.is_set():
            try:
                if self.pending() == 0:
                    self._stop.wait(idle)
                    idle = min(2 * idle, self.poll_max_s)
                    continue
                idle = self.poll_min_s
                with self.lock:
                    self._busy = True
                    try:
                        self._train_once()
                    finally:
                        self._busy = False
            except Exception as exc:  # keep serving; counters() reports it
                self.errors.append(repr(exc))
                self._stop.wait(self.error_pause_s)

    def _train_once(self) -> None:
        from ray.rllib.utils.metrics import ENV_RUNNER_RESULTS, NUM_ENV_STEPS_SAMPLED_LIFETIME

        result = self.algo.train()
        self.train_calls += 1
        self.transitions_trained += 1
        self.module_steps_trained += module_steps(result)
        lifetime = result.get(ENV_RUNNER_RESULTS, {}).get(NUM_ENV_STEPS_SAMPLED_LIFETIME)
        if lifetime is not None:  # RLlib's own count of the env steps its runner sampled
            self.env_steps_sampled = int(getattr(lifetime, "peek", lambda: lifetime)())

    def counters(self) -> dict:
        return {"train_calls": self.train_calls, "transitions_trained": self.transitions_trained,
                "module_steps_trained": self.module_steps_trained, "env_steps_sampled": self.env_steps_sampled,
                "errors": list(self.errors)}

    def wait_idle(self, timeout_s: float = 60.0) -> bool:
        """Wait until every pending transition has been trained on (False on timeout)."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.pending() == 0 and not self._busy:
                return True
            time.sleep(0.02)
        return False

    def stop(self, timeout_s: float = 60.0) -> None:
        self._stop.set()
        if self.thread is not None:
            self.thread.join(timeout=timeout_s)


def module_steps(result: dict) -> int:
    """Transitions consumed by SAC updates in one train() (RLlib's own learner metric)."""
    from ray.rllib.utils.metrics import LEARNER_RESULTS, NUM_MODULE_STEPS_TRAINED

    learner = result.get(LEARNER_RESULTS, {}).get("default_policy", {})
    value = learner.get(NUM_MODULE_STEPS_TRAINED, 0)
    return int(getattr(value, "peek", lambda: value)())


def replay_transitions(buffer) -> dict[str, np.ndarray]:
    """The replay buffer's 1-step episodes as arrays (what ``replay.npz`` holds)."""
    episodes = list(buffer.episodes)
    if not episodes:
        return {"obs": np.zeros((0,)), "action": np.zeros((0,)), "reward": np.zeros((0,)), "next_obs": np.zeros((0,))}
    return {"obs": np.stack([e.get_observations(0) for e in episodes]),
            "action": np.stack([e.get_actions(0) for e in episodes]),
            "reward": np.array([e.get_rewards(0) for e in episodes], dtype=np.float64),
            "next_obs": np.stack([e.get_observations(1) for e in episodes])}


def transition_episodes(transitions, config) -> list:
    """(obs, action, reward, next_obs) transitions as RLlib 1-step episodes: what every EnvRunner of the
    policy (the broker's, the RLlink server's) hands ``train()``, and what a restored replay buffer holds."""
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode

    return [SingleAgentEpisode(observations=[o, o2], actions=[a], rewards=[float(r)],
                               observation_space=config.observation_space, action_space=config.action_space,
                               len_lookback_buffer=0).to_numpy()
            for o, a, r, o2 in transitions]


def one_step_episodes(replay: dict, config) -> list:
    """Transitions as arrays (``obs``, ``action``, ``reward``, ``next_obs``: ``replay.npz``) as 1-step episodes."""
    return transition_episodes(zip(replay["obs"], replay["action"], replay["reward"], replay["next_obs"]), config)


def restore_policy(algo, path: Path) -> list[dict]:
    """Load a saved policy into ``algo``: the module (RLlib then syncs the EnvRunner's weights) and the
    replay buffer. Returns the policy's provenance (ERRATA E14), which a continued policy inherits."""
    path = Path(path).resolve()  # RLlib reads a relative path as a URI
    provenance = provenance_of(load_manifest(path))
    algo.restore_from_path(str(path / MODULE_DIR), component=LEARNER_MODULE)
    replay = read_replay(path / REPLAY_FILE)
    if replay and len(replay["reward"]):
        algo.local_replay_buffer.add(one_step_episodes(replay, algo.config))
    return provenance


def write_policy(algo, path: Path, *, layout, settings, trained_on: dict, results: dict, transitions: int,
                 updates: int, name: str | None, provenance: list[dict]) -> dict:
    """Write ``algo``'s policy as the fresh directory ``path``: module checkpoint, replay buffer and manifest
    (with ``provenance``, one entry per run that trained it). Returns the manifest. Written in a temporary
    sibling directory renamed into place: a save that fails leaves nothing at ``path`` (and no sibling)."""
    out = Path(path).resolve()  # RLlib reads a relative path as a URI
    if out.exists():
        raise FileExistsError(f"{out} already exists")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        module = algo.learner_group._learner.module["default_policy"]
        module.save_to_path(str(tmp / MODULE_DIR))
        write_replay(tmp / REPLAY_FILE, replay_transitions(algo.local_replay_buffer))
        manifest = write_manifest(tmp, layout=layout, sac=settings.as_dict(), trained_on=trained_on, results=results,
                                  transitions=transitions, updates=updates, name=name or out.name,
                                  provenance=provenance)
        tmp.rename(out)  # fails if a non-empty ``path`` appeared meanwhile (an empty directory is replaced)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest
