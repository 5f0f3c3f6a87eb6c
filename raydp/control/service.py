"""The policy service: one RLlib SAC algorithm shared by any number of runs (Alg. 1 lines 31-36).

:class:`PolicyService` is a Ray actor that owns the algorithm; a background thread
(:class:`raydp.control.training.TrainingLoop`, shared with the RLlink policy server) calls
``algo.train()`` once for every transition the runs report through the broker (K updates of B_SAC
each, :mod:`raydp.control.sac`) and RLlib's weight sync pushes the new weights to the broker. It never
waits on a run: with no transition pending it sleeps. :class:`PolicySession` is the driver-side handle:
it starts the broker (and, unless the policy is frozen, the service), hands out :class:`PolicyClient`\\ s
to runs, saves the policy and shuts everything down.

Provenance (ERRATA E14): the service keeps the list of runs that trained its policy: the restored
policy's list (inherited), plus one entry for each run that saves the policy with
``save_policy(..., provenance=entry)`` (:mod:`raydp.control.store` gives the entry's shape). Every saved
manifest carries the list as it stands. A shared service's snapshot saved when one run ends has also
learned from runs still going, whose entries come when they save.
"""

from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path

import numpy as np
import ray
import torch

from raydp.control.broker import BrokerEnvRunner, PolicyBroker
from raydp.control.features import ObservationLayout
from raydp.control.sac import SACSettings, sac_config
from raydp.control.store import MODULE_DIR, append_provenance, load_manifest, policy_layout, provenance_entry
from raydp.control.training import TrainingLoop, restore_policy, write_policy


@ray.remote(num_cpus=0, max_concurrency=4)
class PolicyService:
    """Owns the SAC Algorithm; trains while transitions are pending (see the module docstring)."""

    def __init__(self, layout: dict, settings: dict, broker_name: str, namespace: str,
                 restore: str | None = None):
        torch.set_num_threads(1)
        self.layout = ObservationLayout(**layout)
        self.settings = SACSettings(**settings)
        self.broker = ray.get_actor(broker_name, namespace=namespace)
        self.algo = sac_config(self.layout, self.settings, BrokerEnvRunner,
                               {"broker_name": broker_name, "namespace": namespace}).build_algo()
        # runs that trained this policy (ERRATA E14), inherited first; restoring also syncs the broker
        self.provenance: list[dict] = restore_policy(self.algo, Path(restore)) if restore else []
        self.training = TrainingLoop(self.algo, lambda: ray.get(self.broker.num_pending.remote()),
                                     name="broker-sac-train").start()

    def counters(self) -> dict:
        learner = self.algo.learner_group._learner
        return {**self.training.counters(),
                "replay_size": self.algo.local_replay_buffer.get_num_timesteps(),
                "alpha": float(learner.curr_log_alpha["default_policy"].exp())}  # the learner's live temperature

    def wait_idle(self, timeout_s: float = 120.0) -> bool:
        """Wait until every reported transition has been trained on."""
        return self.training.wait_idle(timeout_s)

    def save(self, path: str, trained_on: dict, results: dict, name: str | None = None,
             provenance: dict | None = None) -> dict:
        """Write module checkpoint, replay buffer and manifest to ``path`` (a fresh directory).

        ``provenance``: the entry of the run that saves (shape in :mod:`raydp.control.store`); it is
        appended to the policy's provenance list, which the manifest records (ERRATA E14)."""
        entry = provenance_entry(provenance) if provenance is not None else None  # validate before writing
        self.wait_idle()
        with self.training.lock:
            if entry is not None:
                append_provenance(self.provenance, entry)
            return write_policy(self.algo, Path(path), layout=self.layout, settings=self.settings,
                                trained_on=trained_on, results=results,
                                transitions=self.training.transitions_trained,
                                updates=self.training.train_calls * self.settings.k, name=name,
                                provenance=self.provenance)

    def stop(self) -> None:
        self.training.stop(timeout_s=30)
        with self.training.lock:
            self.algo.stop()


class PolicyClient:
    """A run's connection to the broker: one round trip per decision (``decide``), ``end`` to leave."""

    def __init__(self, broker, run_id: str, explore: bool, service=None):
        self.broker, self.run_id, self.explore, self.service = broker, run_id, explore, service
        self.layout = ObservationLayout(**ray.get(broker.register.remote(run_id, explore)))
        self.latencies: list[float] = []
        self.weights_seen: list[int] = []

    def decide(self, obs: np.ndarray, reward: float | None) -> np.ndarray:
        started = time.perf_counter()
        action, seq = ray.get(self.broker.decide.remote(self.run_id, obs, reward))
        self.latencies.append(time.perf_counter() - started)
        self.weights_seen.append(seq)
        return np.asarray(action)

    def end(self) -> None:
        ray.get(self.broker.end.remote(self.run_id))

    def save_policy(self, path: Path, trained_on: dict, results: dict, provenance: dict | None = None) -> dict | None:
        """Snapshot the shared policy (None for a frozen policy: it does not change).

        ``provenance``: this run's entry (ERRATA E14), a dict ``{"dataset_sha256", "privacy_mode"
        ('strict'|'paper'), "privacy_unit", "epsilon", "delta", "guarantee", "rdp_orders", "rdp_curve"}``
        (:mod:`raydp.control.store`); appended to the policy's inherited provenance. None: a snapshot
        (e.g. a checkpoint) that adds no run."""
        if self.service is None:
            return None
        return ray.get(self.service.save.remote(str(path), trained_on, results, None, provenance))


def _module_weights(path: Path) -> dict:
    from ray.rllib.core.rl_module.rl_module import RLModule

    return RLModule.from_checkpoint(str(path / MODULE_DIR)).get_state(inference_only=True)


class PolicySession:
    """Driver-side: broker (+ service unless frozen) for one policy; runs connect with :meth:`client`.

    ``restore``: a saved policy directory (its layout wins); ``frozen``: act greedily with its weights,
    no training.
    """

    def __init__(self, layout: ObservationLayout, settings: SACSettings, *, restore: Path | None = None,
                 frozen: bool = False, namespace: str = "raydp", name: str | None = None):
        if frozen and restore is None:
            raise ValueError("a frozen policy needs a saved policy to restore")
        if restore is not None:
            layout = policy_layout(load_manifest(restore))
        self.layout, self.settings, self.frozen, self.namespace = layout, settings, frozen, namespace
        self.name = name or f"rldp-broker-{uuid.uuid4().hex[:8]}"
        weights = _module_weights(restore) if frozen else None
        self.broker = PolicyBroker.options(name=self.name, namespace=namespace, lifetime=None).remote(
            layout.as_dict(), settings.as_dict(), weights, settings.seed)
        ray.get(self.broker.info.remote())  # the runner looks the broker up by name: it must exist first
        self.service = None
        if not frozen:
            self.service = PolicyService.remote(layout.as_dict(), settings.as_dict(), self.name, namespace,
                                                str(restore) if restore else None)
            ray.get(self.service.counters.remote())

    def client(self, run_id: str) -> PolicyClient:
        return PolicyClient(self.broker, run_id, explore=not self.frozen, service=self.service)

    def connection(self) -> dict:
        """What a run actor needs to build its client (picklable; :func:`raydp.control.connection.
        client_from_connection` builds it)."""
        return {"kind": "broker", "broker_name": self.name, "namespace": self.namespace,
                "explore": not self.frozen, "service": self.service}

    def counters(self) -> dict:
        return ray.get(self.service.counters.remote()) if self.service is not None else {}

    def info(self) -> dict:
        return ray.get(self.broker.info.remote())

    def save(self, path: Path, trained_on: dict, results: dict, overwrite: bool = False,
             provenance: dict | None = None) -> dict:
        """Save the policy as ``path`` (see :meth:`PolicyClient.save_policy` for ``provenance``)."""
        if self.service is None:
            raise ValueError("a frozen policy is not trained; nothing new to save")
        path = Path(path)
        if path.exists():
            if not overwrite:
                from raydp.errors import ConfigError

                raise ConfigError(f"policy {path} already exists (pass --overwrite to replace it)")
            shutil.rmtree(path)
        return ray.get(self.service.save.remote(str(path), trained_on, results, path.name, provenance))

    def close(self) -> None:
        if self.service is not None:
            try:
                ray.get(self.service.stop.remote(), timeout=60)
            except Exception:
                pass
            ray.kill(self.service)
        ray.kill(self.broker)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

