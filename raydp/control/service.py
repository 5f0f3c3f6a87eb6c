"""The policy service: one RLlib SAC algorithm shared by any number of runs (Alg. 1 lines 31-36).

:class:`PolicyService` is a Ray actor that owns the algorithm; a background thread
(:class:`raydp.control.training.TrainingLoop`, shared with the RLlink policy server) calls
``algo.train()`` once for every transition the runs report through the broker (K updates of B_SAC
each, :mod:`raydp.control.sac`) and RLlib's weight sync pushes the new weights to the broker inside each
``train()``. :class:`PolicySession` is the driver-side handle: it starts the broker (and, unless the policy
is frozen, the service), hands out :class:`PolicyClient`\\ s to runs, saves the policy and shuts everything
down.

Decisions are synchronous: deterministic given the run's releases and public seeds (the actions set the DP
clips, so they must be post-processing of DP releases plus public randomness; training speed follows the
step times, which depend on the private batch sizes). A :class:`PolicyClient` decision is three calls:
the broker closes the run's previous decision into a transition and says how many it has queued
(:meth:`raydp.control.broker.Broker.report`), the service waits until its training loop has trained on
that many (:meth:`PolicyService.wait_trained`; the weights reached the broker inside ``train()``), and the
broker acts with those weights and the run's own public-seeded generator
(:meth:`~raydp.control.broker.Broker.act`). No actor waits on another while holding the broker (its actor
runs one call at a time and the learner's EnvRunner calls it from inside ``train()``): the wait is the
service's, on a thread of its own. The learner's randomness (SAC loss, replay sampling) comes from the
public SAC seed (:mod:`raydp.control.training`), so with one run per policy a decision is a function of the
restored policy, the run's transitions so far and the public seeds, however slow the learner is. A policy
shared by concurrent runs trains on their transitions in arrival order, which timing decides: a study
shares one on public data only (:mod:`raydp.study.config`). A frozen policy has no learner: the broker acts
greedily in one call.

Provenance (ERRATA E14): the service keeps the list of runs that trained its policy: the restored
policy's list (inherited), plus one entry for each run that saves the policy with
``save_policy(..., provenance=entry)`` (:mod:`raydp.control.store` gives the entry's shape). Every saved
manifest carries the list as it stands. A shared service's snapshot saved when one run ends has also
learned from runs still going, whose entries come when they save.

Lifetime: the service also keeps the restored policy's lifetime figures (runs, transitions, SAC updates:
:func:`raydp.control.store.lifetime_of`), and every save's manifest records them plus this service's own
counts as ``lifetime`` (a checkpoint snapshot too: its transitions are real; it adds no run).
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
from raydp.control.policies import check_policy_privacy, policy_layout_for, sac_settings
from raydp.control.sac import SACSettings, sac_config
from raydp.control.store import (append_provenance, build_module, copy_policy, load_manifest, load_module_state,
                                 policy_layout, provenance_entry)
from raydp.control.training import TrainingLoop, restore_policy, restored_lifetime, write_policy
from raydp.errors import ConfigError


@ray.remote(num_cpus=0, max_concurrency=16)
class PolicyService:
    """Owns the SAC Algorithm; trains while transitions are pending (see the module docstring). Its calls run
    on up to 16 threads: decisions waiting in :meth:`wait_trained` do not hold up the others.
    ``train_delay_s``: a test hook, a sleep before every ``train()`` (a slow learner)."""

    def __init__(self, layout: dict, settings: dict, broker_name: str, namespace: str,
                 restore: str | None = None, train_delay_s: float = 0.0):
        torch.set_num_threads(1)
        self.layout = ObservationLayout(**layout)
        self.settings = SACSettings(**settings)
        self.broker = ray.get_actor(broker_name, namespace=namespace)
        self.algo = sac_config(self.layout, self.settings, BrokerEnvRunner,
                               {"broker_name": broker_name, "namespace": namespace}).build_algo()
        # runs that trained this policy (ERRATA E14), inherited first; restoring also syncs the broker
        self.provenance: list[dict] = restore_policy(self.algo, Path(restore)) if restore else []
        # the restored policy's runs, transitions and SAC updates (raydp.control.store.lifetime_of; None: a fresh
        # policy): every save's lifetime figures are these plus this service's
        self.inherited_lifetime: dict | None = restored_lifetime(self.algo)
        self.training = TrainingLoop(self.algo, lambda: ray.get(self.broker.num_pending.remote()),
                                     name="broker-sac-train", seed=self.settings.seed,
                                     train_delay_s=train_delay_s).start()

    def counters(self) -> dict:
        learner = self.algo.learner_group._learner
        return {**self.training.counters(),
                "replay_size": self.algo.local_replay_buffer.get_num_timesteps(),
                "alpha": float(learner.curr_log_alpha["default_policy"].detach().exp())}  # the learner's live temperature

    def wait_idle(self, timeout_s: float = 120.0) -> bool:
        """Wait until every reported transition has been trained on."""
        return self.training.wait_idle(timeout_s)

    def wait_trained(self, n: int) -> int:
        """Return once the policy has trained on the first ``n`` transitions the broker queued (the broker
        then holds the weights trained on them); however long that takes. RuntimeError if training failed
        (:meth:`raydp.control.training.TrainingLoop.wait_trained`). Returns the count trained."""
        self.training.wait_trained(int(n))
        return self.training.transitions_trained

    def save(self, path: str, trained_on: dict, results: dict, name: str | None = None,
             provenance: dict | None = None) -> dict:
        """Write module checkpoint, replay buffer and manifest to ``path`` (a fresh directory).

        ``provenance``: the entry of the run that saves (shape in :mod:`raydp.control.store`); it is
        appended to the policy's provenance list, which the manifest records (ERRATA E14). The manifest's
        ``transitions`` and ``sac_updates`` are this service's; its ``lifetime`` adds the restored policy's."""
        entry = provenance_entry(provenance) if provenance is not None else None  # validate before writing
        self.wait_idle()
        with self.training.lock:
            if entry is not None:
                append_provenance(self.provenance, entry)
            return write_policy(self.algo, Path(path), layout=self.layout, settings=self.settings,
                                trained_on=trained_on, results=results,
                                transitions=self.training.transitions_trained,
                                updates=self.training.train_calls * self.settings.k, name=name,
                                provenance=self.provenance, inherited=self.inherited_lifetime)

    def stop(self) -> None:
        self.training.stop(timeout_s=30)
        with self.training.lock:
            self.algo.stop()


class PolicyClient:
    """A run's connection to the broker (``decide``; ``end`` to leave).

    ``decide`` waits for the learner (see the module docstring): the broker closes the previous decision into
    a transition (``report``), the service trains on every transition queued so far (``wait_trained``), and
    the broker acts with those weights and this run's own generator (``act``); without a service (a frozen
    policy) the broker acts in one call. ``seed``: the run's public exploration seed (its config's ``seed``;
    None: a hash of ``run_id``, :func:`raydp.control.broker.run_seed`). ``latencies`` and ``weights_seen``
    are in-memory diagnostics for benchmarks: timing depends on the private batch sizes, so a run never
    writes them to its files."""

    def __init__(self, broker, run_id: str, explore: bool, service=None, seed: int | None = None):
        self.broker, self.run_id, self.explore, self.service = broker, run_id, explore, service
        self.layout = ObservationLayout(**ray.get(broker.register.remote(run_id, explore, seed)))
        self.latencies: list[float] = []
        self.weights_seen: list[int] = []

    def decide(self, obs: np.ndarray, reward: float | None) -> np.ndarray:
        started = time.perf_counter()
        if self.service is None:  # frozen: nothing trains, nothing to wait for
            action, seq = ray.get(self.broker.decide.remote(self.run_id, obs, reward))
        else:
            queued = ray.get(self.broker.report.remote(self.run_id, obs, reward))
            ray.get(self.service.wait_trained.remote(queued))
            action, seq = ray.get(self.broker.act.remote(self.run_id, obs))
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
    """A saved policy's inference weights, its module rebuilt from the manifest (nothing unpickled)."""
    return build_module(load_manifest(path), load_module_state(path)).get_state(inference_only=True)


class PolicySession:
    """Driver-side: broker (+ service unless frozen) for one policy; runs connect with :meth:`client`.

    ``restore``: a saved policy directory (its layout wins); ``frozen``: act greedily with its weights,
    no training. ``train_delay_s``: a test hook, the learner sleeps this long before every ``train()``
    (decisions wait for it: they come later, never different).
    """

    def __init__(self, layout: ObservationLayout, settings: SACSettings, *, restore: Path | None = None,
                 frozen: bool = False, namespace: str = "raydp", name: str | None = None,
                 train_delay_s: float = 0.0):
        if frozen and restore is None:
            raise ValueError("a frozen policy needs a saved policy to restore")
        if restore is not None:
            layout = policy_layout(load_manifest(restore))
        self.layout, self.settings, self.frozen, self.namespace = layout, settings, frozen, namespace
        self.name = name or f"rldp-broker-{uuid.uuid4().hex[:8]}"
        weights = _module_weights(restore) if frozen else None
        # Both actors start at once: each is a fresh process that imports torch and RLlib. One after the other, a
        # session took 11.9-17.5 s to start on a 2-core machine; at once, 6.3-8.4 s (bench/bench_policy_start.py).
        # The service finds the broker by its name, which Ray registers when .remote() returns (a named actor's
        # registration is synchronous), and its calls to the broker wait until the broker is up. Both are up before a
        # run looks the broker up by name.
        self.broker = PolicyBroker.options(name=self.name, namespace=namespace, lifetime=None).remote(
            layout.as_dict(), settings.as_dict(), weights, settings.seed)
        self.service = None
        try:
            ready = [self.broker.info.remote()]
            if not frozen:
                self.service = PolicyService.remote(layout.as_dict(), settings.as_dict(), self.name, namespace,
                                                    str(restore) if restore else None, train_delay_s)
                ready.append(self.service.counters.remote())
            ray.get(ready)
        except BaseException:
            for actor in (self.service, self.broker):  # neither outlives a session that never started
                if actor is not None:
                    try:
                        ray.kill(actor)
                    except Exception:  # noqa: BLE001 - the start's own error is the one to raise
                        pass
            raise

    def client(self, run_id: str, seed: int | None = None) -> PolicyClient:
        """Run ``run_id``'s client; ``seed``: its public exploration seed (None: a hash of ``run_id``)."""
        return PolicyClient(self.broker, run_id, explore=not self.frozen, service=self.service, seed=seed)

    def connection(self, seed: int | None = None) -> dict:
        """What a run actor needs to build its client (picklable; :func:`raydp.control.connection.
        client_from_connection` builds it); ``seed``: the run's public exploration seed (its config's
        ``seed``; None: the client hashes its run id)."""
        out = {"kind": "broker", "broker_name": self.name, "namespace": self.namespace,
               "explore": not self.frozen, "service": self.service}
        if seed is not None:
            out["seed"] = int(seed)
        return out

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


# ---- the broker transport (raydp.control.transports) ---------------------------------------------------------

def broker_client(connection: dict, run_id: str) -> PolicyClient:
    """The run's client on the broker actor ``connection`` names (:meth:`PolicySession.connection`)."""
    broker = ray.get_actor(connection["broker_name"], namespace=connection["namespace"])
    return PolicyClient(broker, run_id, explore=connection["explore"], service=connection.get("service"),
                        seed=connection.get("seed"))


def start_policy_session(config, namespace: str, restore: Path | None = None) -> PolicySession:
    """A policy service for the config's controller settings (``restore``: a policy snapshot to continue from,
    e.g. a trial's checkpoint, instead of the settings' ``policy``). A paper-mode policy refuses to drive a
    strict run (:func:`raydp.control.policies.check_policy_privacy`, ERRATA E14)."""
    restore = check_policy_privacy(config, restore)
    layout = None if restore is not None else policy_layout_for(config)
    return PolicySession(layout, sac_settings(config), restore=restore, frozen=config.strategy_settings().frozen,
                         namespace=namespace)


class BrokerLaunch:
    """The broker transport's launcher: a policy service started for the run, which owns its policy (saved
    under ``policy_dir/save_policy`` when the run ends). The checks run when it is built, before Ray starts."""

    def __init__(self, config, overwrite_policy: bool = False):
        check_policy_privacy(config)  # a paper-mode policy may not drive a strict run (E14)
        s = config.strategy_settings()
        self.config, self.overwrite_policy, self.session = config, overwrite_policy, None
        self.named = Path(s.policy_dir).expanduser() / s.save_policy if s.save_policy else None
        if self.named is not None and self.named.exists() and not overwrite_policy:
            raise ConfigError(f"policy {self.named} already exists (pass --overwrite-policy to replace it)")

    def start(self, namespace: str) -> dict:
        self.session = start_policy_session(self.config, namespace)
        return self.session.connection(seed=self.config.seed)

    def finish(self, summary: dict, output: Path) -> None:
        summary["policy_service"] = self.session.counters()
        if self.named is not None:
            copy_policy(Path(output) / "policy", self.named, overwrite=self.overwrite_policy)
            summary["saved_policy"] = str(self.named)

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
