"""The policy's side shared by both transports: RLlib's SAC algorithm trained once per pending transition on
a background thread (:class:`TrainingLoop`), and a policy restored from or written to a policy directory
(:func:`restore_policy`, :func:`write_policy`; the format is :mod:`raydp.control.store`'s).

:class:`raydp.control.service.PolicyService` (transitions from the broker) and
:class:`raydp.control.rllink.RLlinkPolicyServer` (transitions from RLlink clients) both use them; they
differ only in how pending transitions are counted (the ``pending`` callable) and where the algorithm's
EnvRunner takes them from in ``sample()``.

Determinism (a privacy requirement): a run's clip radii must be post-processing of its DP releases and of
public randomness only. How fast the learner trains depends on the machine and on the runs' step times,
which grow with their private (Poisson) batch sizes; so no decision may depend on how far training got.
Both transports therefore make a decision wait until the learner has trained on every transition reported
before it (:meth:`TrainingLoop.wait_trained`), and the training is itself a function of the sequence of
transitions and the public SAC seed: the loop keeps its own global-RNG state (torch, numpy, random: what
RLlib's SAC loss draws its reparameterized actions from), seeded from the SAC seed and swapped in around
every ``train()``, and the replay buffer's sampler (RLlib 2.60's ``EpisodeReplayBuffer`` draws from
``np.random.default_rng(seed=None)``, i.e. OS entropy, unless reseeded) is seeded from it too
(:func:`seed_replay`). One ``train()`` per transition, in the order the transitions arrived, with the
weights synced to the acting side inside ``train()`` (RLlib's ``sync_weights`` at the end of SAC's
``training_step``), so when ``wait_trained(n)`` returns the acting side holds the weights trained on the
first ``n`` transitions, whatever the learner's speed.
"""

from __future__ import annotations

import random
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

import numpy as np

from raydp.control.store import (
    REPLAY_FILE,
    continue_lifetime,
    lifetime_of,
    load_manifest,
    load_module_state,
    provenance_of,
    read_replay,
    save_module_state,
    write_manifest,
    write_replay,
)

POLL_MIN_S, POLL_MAX_S = 0.02, 0.5
ERROR_PAUSE_S = 0.5
#: SeedSequence streams derived from the public SAC seed (the exploration stream is the acting side's,
#: :func:`raydp.control.broker.exploration_generator`)
TRAINING_STREAM, REPLAY_STREAM = 1, 2


def _seed_sequence(*values: int) -> np.random.SeedSequence:
    return np.random.SeedSequence([int(v) & 0xFFFFFFFFFFFFFFFF for v in values])


def training_rng_state(seed: int) -> tuple:
    """The global-RNG state (torch CPU, numpy, random) the learner's ``train()`` calls run under, from the
    public SAC seed: RLlib's SAC loss samples its actions from torch's global generator."""
    import torch

    torch_seed, np_seed, py_seed = (int(x) for x in _seed_sequence(TRAINING_STREAM, seed).generate_state(3))
    return (torch.Generator().manual_seed(torch_seed).get_state(), np.random.RandomState(np_seed).get_state(),
            random.Random(py_seed).getstate())


def _global_rng_state() -> tuple:
    import torch

    return torch.get_rng_state(), np.random.get_state(), random.getstate()


def _set_global_rng_state(state: tuple) -> None:
    import torch

    torch.set_rng_state(state[0])
    np.random.set_state(state[1])
    random.setstate(state[2])


def seed_replay(algo, seed: int) -> None:
    """Seed the replay buffer's sampler from the public SAC seed: RLlib 2.60's ``EpisodeReplayBuffer`` samples
    with ``self.rng``, created as ``np.random.default_rng(seed=None)`` (OS entropy) whatever
    ``config.debugging(seed=...)`` says."""
    buffer = algo.local_replay_buffer
    if not hasattr(buffer, "rng"):
        raise TypeError(f"{type(buffer).__name__} has no rng to seed: the policy's training would not be "
                        "deterministic")
    buffer.rng = np.random.default_rng(_seed_sequence(REPLAY_STREAM, seed))


class TrainingLoop:
    """Calls ``algo.train()`` once per pending transition (``pending()``: how many are waiting), on its own
    thread, and counts what it trained.

    Each ``train()`` samples one transition from the algorithm's EnvRunner and makes K updates of B_SAC
    (:mod:`raydp.control.sac`). Idle polling backs off from 20 ms to 0.5 s (decisions are T_RL steps, seconds,
    apart, and a tight poll would take CPU from the runs on a small machine); :meth:`wait_trained` wakes it at
    once. An exception (from ``pending()`` or ``train()``) is recorded in ``errors`` and the loop keeps
    serving after a pause; a failed ``train()`` also fails every :meth:`wait_trained` still short of its
    count (the transition it took may be lost: waiting for it would never end, and acting without it would
    not be deterministic). ``lock`` is held around every ``train()``: hold it to read or write the algorithm
    between them.

    ``seed`` (the public SAC seed; None leaves the RNGs alone, for an algorithm without a replay buffer): the
    loop's own global-RNG state, swapped in around every ``train()``, and the replay buffer's sampler are
    seeded from it (module docstring: training is a function of the transitions and the seed).
    ``train_delay_s``: a test hook, a sleep before every ``train()`` (a slow learner): it changes when
    decisions are answered, never what they are."""

    def __init__(self, algo, pending: Callable[[], int], name: str = "sac-train",
                 poll_s: tuple[float, float] = (POLL_MIN_S, POLL_MAX_S), error_pause_s: float = ERROR_PAUSE_S,
                 *, seed: int | None = None, train_delay_s: float = 0.0):
        self.algo, self.pending, self.name = algo, pending, name
        self.poll_min_s, self.poll_max_s = poll_s
        self.error_pause_s = error_pause_s
        self.train_delay_s = float(train_delay_s)
        self.lock = threading.Lock()
        self.train_calls = self.transitions_trained = self.module_steps_trained = self.env_steps_sampled = 0
        self.errors: list[str] = []
        self.failed: str | None = None  # the first failed train(): fails the waits it left short
        self._rng = None
        if seed is not None:
            seed_replay(algo, seed)
            self._rng = training_rng_state(seed)
        self._trained = threading.Condition()
        self._wake = threading.Event()
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
                self._wake.clear()  # cleared before pending() is read: a wake-up after it is never lost
                if self.pending() == 0:
                    self._wake.wait(idle)
                    idle = min(2 * idle, self.poll_max_s)
                    continue
                idle = self.poll_min_s
                if self.train_delay_s:
                    time.sleep(self.train_delay_s)
                with self.lock:
                    self._busy = True
                    try:
                        self._train_once()
                    except Exception as exc:
                        with self._trained:
                            self.failed = self.failed or repr(exc)
                            self._trained.notify_all()
                        raise
                    finally:
                        self._busy = False
            except Exception as exc:  # keep serving; counters() reports it
                self.errors.append(repr(exc))
                self._stop.wait(self.error_pause_s)

    def _train_once(self) -> None:
        from ray.rllib.utils.metrics import ENV_RUNNER_RESULTS, NUM_ENV_STEPS_SAMPLED_LIFETIME

        if self._rng is None:
            result = self.algo.train()
        else:  # the loop's own RNG stream: whatever else in this process draws from the global generators
            outer = _global_rng_state()
            _set_global_rng_state(self._rng)
            try:
                result = self.algo.train()
            finally:
                self._rng = _global_rng_state()
                _set_global_rng_state(outer)
        self.train_calls += 1
        self.module_steps_trained += module_steps(result)
        lifetime = result.get(ENV_RUNNER_RESULTS, {}).get(NUM_ENV_STEPS_SAMPLED_LIFETIME)
        if lifetime is not None:  # RLlib's own count of the env steps its runner sampled
            self.env_steps_sampled = int(getattr(lifetime, "peek", lambda: lifetime)())
        with self._trained:
            self.transitions_trained += 1
            self._trained.notify_all()

    def counters(self) -> dict:
        return {"train_calls": self.train_calls, "transitions_trained": self.transitions_trained,
                "module_steps_trained": self.module_steps_trained, "env_steps_sampled": self.env_steps_sampled,
                "errors": list(self.errors)}

    def wait_trained(self, n: int, timeout_s: float | None = None) -> None:
        """Return once ``train()`` has run on the first ``n`` transitions (so the acting side holds the weights
        trained on them: RLlib syncs them inside ``train()``). It waits however long training takes (a decision
        never acts on older weights); RuntimeError if a ``train()`` failed or the loop stopped before, or
        TimeoutError after ``timeout_s`` (None: no limit)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._trained:
            while self.transitions_trained < n:
                if self.failed is not None:
                    raise RuntimeError(f"the policy's training failed ({self.failed[:200]}): the decision cannot "
                                       "wait for weights trained on every earlier transition")
                if self._stop.is_set():
                    raise RuntimeError("the policy's training stopped before it trained on every earlier transition")
                self._wake.set()
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"the policy trained on {self.transitions_trained} of {n} transitions in "
                                       f"{timeout_s} s")
                self._trained.wait(0.5 if remaining is None else min(remaining, 0.5))

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
        self._wake.set()
        if self.thread is not None:
            self.thread.join(timeout=timeout_s)
        with self._trained:
            self._trained.notify_all()


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


#: the attribute of a restored algorithm that holds the restored policy's lifetime (:func:`restore_policy`)
RESTORED_LIFETIME = "_raydp_restored_lifetime"


def restore_policy(algo, path: Path) -> list[dict]:
    """Load a saved policy into ``algo``: the module (RLlib then syncs the EnvRunner's weights) and the
    replay buffer. Returns the policy's provenance (ERRATA E14), which a continued policy inherits; the
    policy's lifetime figures (:func:`raydp.control.store.lifetime_of`), which every later save of ``algo``
    adds its session's to, are kept with ``algo`` (:func:`restored_lifetime`)."""
    path = Path(path).resolve()
    manifest = load_manifest(path)
    provenance = provenance_of(manifest)
    module = algo.learner_group._learner.module["default_policy"]
    module.set_state(load_module_state(path))
    # as Algorithm.restore_from_path does after loading a learner component: the EnvRunner (and through it the
    # broker) gets the restored weights
    algo.env_runner_group.sync_weights(from_worker_or_learner_group=algo.learner_group, inference_only=True)
    replay = read_replay(path / REPLAY_FILE)
    if replay and len(replay["reward"]):
        algo.local_replay_buffer.add(one_step_episodes(replay, algo.config))
    setattr(algo, RESTORED_LIFETIME, lifetime_of(manifest))
    return provenance


def restored_lifetime(algo) -> dict | None:
    """The lifetime figures (runs, transitions, SAC updates) of the policy :func:`restore_policy` loaded into
    ``algo``; None for a fresh algorithm."""
    return getattr(algo, RESTORED_LIFETIME, None)


def write_policy(algo, path: Path, *, layout, settings, trained_on: dict, results: dict, transitions: int,
                 updates: int, name: str | None, provenance: list[dict], inherited: dict | None = None) -> dict:
    """Write ``algo``'s policy as the fresh directory ``path``: module checkpoint, replay buffer and manifest
    (with ``provenance``, one entry per run that trained it). Returns the manifest. Written in a temporary
    sibling directory renamed into place: a save that fails leaves nothing at ``path`` (and no sibling).

    ``transitions`` and ``updates``: this session's (its training loop's cumulative counters); the manifest's
    ``lifetime`` adds them to ``inherited``, the restored policy's lifetime figures (None: those
    :func:`restore_policy` kept with ``algo``, none for a fresh policy), and counts ``provenance``'s runs
    (:func:`raydp.control.store.continue_lifetime`). So a snapshot (no new run) and a later save of the same
    session each count the session's transitions once."""
    if inherited is None:
        inherited = restored_lifetime(algo)
    lifetime = continue_lifetime(inherited, runs=len(provenance), transitions=transitions, sac_updates=updates)
    out = Path(path).resolve()  # RLlib reads a relative path as a URI
    if out.exists():
        raise FileExistsError(f"{out} already exists")
    out.parent.mkdir(parents=True, exist_ok=True)
    # a directory publish (the whole policy appears at once), not a file write: atomic_write replaces one file
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        module = algo.learner_group._learner.module["default_policy"]
        save_module_state(module.get_state(), tmp)  # named arrays: nothing pickled (raydp.control.store)
        write_replay(tmp / REPLAY_FILE, replay_transitions(algo.local_replay_buffer))
        manifest = write_manifest(tmp, layout=layout, sac=settings.as_dict(), trained_on=trained_on, results=results,
                                  transitions=transitions, updates=updates, name=name or out.name,
                                  provenance=provenance, lifetime=lifetime)
        tmp.rename(out)  # fails if a non-empty ``path`` appeared meanwhile (an empty directory is replaced)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest
