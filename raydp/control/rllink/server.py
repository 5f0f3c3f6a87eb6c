"""The RLlib side of the RLlink transport: :class:`AuthenticatedRLlinkServer`, RLlib's RLlink EnvRunner with the
handshake in front and the broker's training semantics, and :class:`RLlinkPolicyServer`, the SAC algorithm around
it (the protocol, the training and provenance semantics: :mod:`raydp.control.rllink`).

The EnvRunner overrides private methods of Ray's ``EnvRunnerServerForExternalInference``: :data:`RAY_OVERRIDES`
records them with the signatures they were written for (Ray 2.60), :data:`RAY_LISTENER_CALLS` the calls by which
Ray's listener reaches them and :data:`RAY_ATTRIBUTES` the attributes of Ray's it reads or replaces;
``tests/test_private_apis.py`` fails when Ray's class no longer matches, and pyproject.toml pins Ray's minor
version.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from pathlib import Path

import numpy as np
from ray.rllib.env.external import RLlink
from ray.rllib.env.external.env_runner_server_for_external_inference import EnvRunnerServerForExternalInference
from ray.rllib.env.single_agent_episode import SingleAgentEpisode

from raydp.control.address import LOOPBACK, RLlinkAddress, loopback_host, loopback_refusal, require_loopback
from raydp.control.broker import log_sampled
from raydp.control.features import ObservationLayout
from raydp.control.modes import PAPER
from raydp.control.rllink.auth import _key, handshake_address, resolve_secret, server_handshake
from raydp.control.rllink.checks import run_declaration, served_policy
from raydp.control.rllink.wire import use_numpy_msgpack
from raydp.control.sac import SACSettings, sac_config
from raydp.control.store import append_provenance, load_manifest, policy_layout, provenance_entry
from raydp.control.training import TrainingLoop, restore_policy, transition_episodes, write_policy
from raydp.errors import ConfigError

logger = logging.getLogger("raydp.rllink")

BACKLOG = 4  # connections the kernel queues while a run is served (each then times out "busy")

#: The private methods of Ray's ``EnvRunnerServerForExternalInference`` that :class:`AuthenticatedRLlinkServer`
#: overrides, with the signatures (``str(inspect.signature(...))`` of Ray 2.60's) its overrides were written for.
RAY_OVERRIDES: dict[str, str] = {
    "_recycle_sockets": "(self, sleep: float = 0.0)",  # accept and authenticate; the listening socket is held
    "_client_message_listener": "(self)",  # the listener thread's body, ended by _Stopped
    "_process_episodes_message": "(self, msg_type, msg_body)",  # uploads: declared, validated, per transition
    "_send_set_state_message": "(self)",  # the weights, once trained on every received transition
}
#: The calls by which Ray's listener thread (``_client_message_listener``) reaches the overrides: an override Ray
#: no longer calls would silently leave its part out (the handshake, above all).
RAY_LISTENER_CALLS: tuple[str, ...] = ("self._recycle_sockets(", "self._process_episodes_message(",
                                       "self._send_set_state_message(")
#: The attributes Ray's ``__init__`` sets that the server reads or replaces.
RAY_ATTRIBUTES: tuple[str, ...] = ("host", "port", "server_socket", "client_socket", "address", "thread", "metrics",
                                   "_weights_seq_no")


class _Stopped(Exception):
    """Ends the listener thread when the server stops."""


class AuthenticatedRLlinkServer(EnvRunnerServerForExternalInference):
    """RLlib's RLlink EnvRunner with the handshake in front and the broker's training semantics:
    uploaded episodes are split into transitions, and ``sample()`` hands out one per call (as
    :class:`raydp.control.broker.BrokerEnvRunner` does), so each ``train()`` is K updates per transition.
    ``env_config``: ``host`` (default 127.0.0.1; only an IPv4 loopback host is bound), ``port``, ``frozen``
    (drop uploads), ``policy`` (the served policy's privacy mode and clip decoding: an upload is kept only
    if it declares the same), and for the clients ``layout`` and ``sac``. It binds once :meth:`serve` is
    called (after the policy is restored), so no client sees weights that are not the policy's, and keeps
    that listening socket until it stops. Clients' provenance entries collect in ``provenance``;
    ``unattributed`` counts, per declared privacy mode, transitions of connections that ended without one."""

    def __init__(self, *, config, **kwargs):
        secret, self.secret_source = resolve_secret()  # before the listener thread exists: no secret, no server
        use_numpy_msgpack()  # before Ray's listener thread speaks RLlink
        self._key = _key(secret)
        self._stopping = False
        self._serving = threading.Event()
        self._bound = threading.Event()
        self.bind_error: str | None = None
        self.frozen = bool(config.env_config.get("frozen", False))
        self.policy = dict(config.env_config.get("policy") or {})
        self._pending: deque = deque()
        self._pending_lock = threading.Lock()
        self._state_lock = threading.RLock()
        self.accepted = self.refused = self.transitions_received = self.malformed = self.dropped_frozen = 0
        self.refused_uploads = 0  # uploads that declared no run, or a run the policy may not learn from
        self.provenance: list[dict] = []  # entries the clients sent (validated, fresh ids), in arrival order
        self.unattributed: dict[str, int] = {}  # declared mode -> transitions of ended connections without an entry
        self._connection_transitions = 0  # the current connection's, not yet attributed
        self._connection_mode: str | None = None  # what the current connection's uploads declared
        #: called with the number of transitions received before the weights are sent (SET_STATE): returns
        #: once training has caught up (:class:`RLlinkPolicyServer` sets it to its loop's ``wait_trained``)
        self.await_training = None
        super().__init__(config=config, **kwargs)

    # connection handling ------------------------------------------------------------------------
    def serve(self) -> None:
        """Start listening (the listener thread waits for this)."""
        self._serving.set()

    def unattributed_by_mode(self) -> dict[str, int]:
        """Transitions received without a provenance entry, per the privacy mode their connection declared:
        ended connections' and the current one's."""
        with self._pending_lock:
            out = dict(self.unattributed)
            if self._connection_transitions:
                mode = self._connection_mode or PAPER  # never assumed strict
                out[mode] = out.get(mode, 0) + self._connection_transitions
            return out

    def unattributed_transitions(self) -> int:
        return sum(self.unattributed_by_mode().values())

    def _recycle_sockets(self, sleep: float = 0.0):
        """Between clients: close the client's socket only (the listening one is held for the server's whole
        life, so no other process can take the port between runs), then accept and authenticate the next
        client. Ray's ``sleep`` before re-listening is not needed: nothing is re-bound."""
        if self.client_socket is not None:
            try:
                self.client_socket.close()
            except OSError:
                pass
        self.client_socket = None
        with self._pending_lock:  # the connection ended: what it sent without an entry stays unattributed
            if self._connection_transitions:
                mode = self._connection_mode or PAPER
                self.unattributed[mode] = self.unattributed.get(mode, 0) + self._connection_transitions
            self._connection_transitions, self._connection_mode = 0, None
        if self.server_socket is None:
            self._listen()
        while True:
            try:
                conn, addr = self.server_socket.accept()
            except socket.timeout:
                if self._stopping:
                    raise _Stopped from None
                continue
            except OSError:
                if self._stopping:
                    raise _Stopped from None
                raise
            if server_handshake(conn, self._key, handshake_address(self.host, self.port)):
                if self._stopping:  # stopped during the handshake: serve no one
                    conn.close()
                    raise _Stopped
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self.client_socket, self.address = conn, addr
                self.accepted += 1
                logger.info("RLlink client %s authenticated", addr)
                return  # while it is served, later clients wait in the backlog (and time out: busy)
            self.refused += 1
            logger.warning("RLlink client %s refused: no proof of the secret", addr)
            conn.close()

    def _listen(self) -> None:
        """Bind the listening socket once :meth:`serve` was called (an IPv4 loopback literal only)."""
        while not self._serving.wait(0.5):
            if self._stopping:
                raise _Stopped
        if self._stopping:
            raise _Stopped
        host = str(self.config.env_config.get("host", LOOPBACK))
        self.host = loopback_host(host)
        if self.host is None:  # plaintext after the handshake: never on a network interface, never IPv6
            self.bind_error = loopback_refusal(host, "listen on")
            self._bound.set()
            raise _Stopped
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((self.host, self.port))
        except OSError as exc:
            listener.close()
            self.bind_error = f"cannot listen on {self.host}:{self.port}: {exc.strerror}"
            self._bound.set()
            raise _Stopped from None
        listener.listen(BACKLOG)
        listener.settimeout(0.5)
        self.server_socket = listener
        self._bound.set()

    def _client_message_listener(self):
        try:
            super()._client_message_listener()
        except _Stopped:
            return

    def stop(self):
        self._stopping = True
        self._serving.set()  # a listener still waiting to serve wakes up and ends
        for sock in (self.client_socket, self.server_socket):
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # wakes a recv()/accept() blocked in the listener thread
                except OSError:
                    pass
        super().stop()

    def wait_bound(self, timeout_s: float = 30.0) -> None:
        if not self._bound.wait(timeout_s):
            raise ConfigError("the RLlink server did not start listening")
        if self.bind_error is not None:
            raise ConfigError(self.bind_error)

    # experience --------------------------------------------------------------------------------
    def _process_episodes_message(self, msg_type, msg_body):
        """Keep an upload only if it is well formed and declares a run this policy may learn from; anything
        else is counted (``dropped_frozen``, ``malformed``, ``refused_uploads``) and dropped whole: it never
        raises, so a bad message from an authenticated peer cannot end the listener thread."""
        if self.frozen:  # a frozen policy learns nothing: uploads are dropped, provenance too (no run trains it)
            self.dropped_frozen += 1
            return self._drop(msg_type)
        try:
            declared = msg_body.get("declared")
            refusal = self._refusal(declared)
            if refusal is None:
                transitions, entry = self._parse_upload(msg_body)
                if entry is not None and entry["privacy_mode"] != declared["privacy_mode"]:
                    refusal = (f"its provenance entry says {entry['privacy_mode']} mode, its upload "
                               f"{declared['privacy_mode']}")
        except Exception as exc:  # noqa: BLE001 - a malformed message is dropped, never trained on
            self.malformed += 1
            logger.warning("RLlink message dropped: malformed (%s)", str(exc).splitlines()[0][:200] if str(exc) else
                           type(exc).__name__)
            return self._drop(msg_type)
        if refusal is not None:
            self.refused_uploads += 1
            logger.warning("RLlink upload refused: %s", refusal)
            return self._drop(msg_type)
        with self._pending_lock:
            self._pending.extend(transitions)
            self.transitions_received += len(transitions)
            self._connection_transitions += len(transitions)
            self._connection_mode = declared["privacy_mode"]  # labels its transitions if no entry follows
            if entry is not None and append_provenance(self.provenance, entry):
                self._connection_transitions = 0  # this run's transitions are accounted for
        if msg_type == RLlink.EPISODES_AND_GET_STATE:  # answered now, with the current weights: Ray's server
            self._send_set_state_message()  # waits for a training step, which an empty upload never brings

    def _drop(self, msg_type) -> None:
        if msg_type == RLlink.EPISODES_AND_GET_STATE:
            self._send_set_state_message()  # no training step will send it for a dropped upload

    def _refusal(self, declared) -> str | None:
        """Why an upload that declares ``declared`` (the run's privacy mode and clip decoding) may not train
        this policy (ERRATA E3/E14); None if it may."""
        if not isinstance(declared, dict):
            return "it declares no run privacy mode and clip decoding"
        mode, decoding = declared.get("privacy_mode"), declared.get("action_decoding")
        if mode != self.policy.get("privacy_mode") or decoding != self.policy.get("action_decoding"):
            return (f"a run in {str(mode)[:20]!r} mode decoding {str(decoding)[:20]!r} may not train a "
                    f"{self.policy.get('privacy_mode')}-mode policy decoding {self.policy.get('action_decoding')!r}")
        return None

    def _parse_upload(self, body: dict) -> tuple[list, dict | None]:
        """The transitions of an EPISODES body and its provenance entry (validated, with a fresh ``entry_id``:
        a client cannot choose it, so no entry can shadow another); ValueError/TypeError if malformed."""
        episodes = body.get("episodes", [])
        if not isinstance(episodes, list):
            raise ValueError(f"episodes is a {type(episodes).__name__}, not a list")
        obs_dim, act_dim = self.config.observation_space.shape[0], self.config.action_space.shape[0]
        transitions = []
        for state in episodes:
            episode = SingleAgentEpisode.from_state(state)
            n = len(episode)
            obs = np.asarray(episode.get_observations(slice(0, n + 1)), dtype=np.float32)
            act = np.asarray(episode.get_actions(slice(0, n)), dtype=np.float32)
            rew = np.asarray(episode.get_rewards(slice(0, n)), dtype=np.float64)
            if obs.shape != (n + 1, obs_dim) or act.shape != (n, act_dim) or rew.shape != (n,) or not (
                    np.isfinite(obs).all() and np.isfinite(act).all() and np.isfinite(rew).all()):
                raise ValueError("an episode chunk of the wrong shape or with non-finite values")
            transitions += [(obs[i], act[i], float(rew[i]), obs[i + 1]) for i in range(n)]
        entry = body.get("provenance")
        if entry is not None:  # the run's entry (ERRATA E14), with its final upload
            if not isinstance(entry, dict):
                raise ValueError(f"provenance is a {type(entry).__name__}, not a dict")
            entry = provenance_entry({**entry, "entry_id": None})
        return transitions, entry

    def num_pending(self) -> int:
        return len(self._pending)

    def sample(self, **kwargs):
        """One transition (a 1-step episode), as the broker's runner: the service calls ``train()`` only
        when one is pending, so this never waits long."""
        while True:
            with self._pending_lock:
                batch = [self._pending.popleft()] if self._pending else []
            if batch or self._stopping:
                break
            time.sleep(0.01)
        episodes = transition_episodes(batch, self.config)
        log_sampled(self.metrics, len(episodes))
        return episodes

    # weights: RLlib's sync (training thread) and GET_STATE (listener thread) never interleave ----------
    def _send_set_state_message(self):
        """The weights, once training has caught up with every transition received (module docstring): the
        listener waits (the client is waiting for the answer anyway). If training failed or the server
        stops, the client's connection is dropped (ConnectionError: Ray's listener recycles the socket): its
        run cannot get the weights its decision must see."""
        await_training = self.await_training
        if await_training is not None:
            with self._pending_lock:
                received = self.transitions_received
            try:
                await_training(received)
            except Exception as exc:  # noqa: BLE001 - the run fails; the listener keeps serving
                logger.error("RLlink client dropped: %s", str(exc).splitlines()[0][:200] if str(exc) else exc)
                raise ConnectionError(f"no weights trained on every received transition ({exc})") from None
        super()._send_set_state_message()

    def get_state(self, components=None, *, not_components=None, **kwargs):
        with self._state_lock:
            return super().get_state(components, not_components=not_components, **kwargs)

    def set_state(self, state):
        with self._state_lock:
            super().set_state(state)


class RLlinkPolicyServer:
    """The policy service over RLlink: RLlib's SAC algorithm (:func:`raydp.control.sac.sac_config`, the
    broker path's) with :class:`AuthenticatedRLlinkServer` as its EnvRunner, trained once per transition a
    client uploads by :class:`raydp.control.training.TrainingLoop` (as :class:`raydp.control.service.
    PolicyService`).

    ``trained_on``: what the policy's manifest says about its training (:func:`raydp.control.policies.
    trained_on` of the server's config): its ``privacy_mode`` and ``action_decoding`` are those of the runs
    the server accepts. ``restore``: a saved policy directory to start from (its layout wins); the served
    policy's privacy mode and clip decoding are the restored manifest's (:func:`raydp.control.store.
    policy_privacy_mode`, :func:`~raydp.control.store.policy_action_decoding`), and a policy whose mode or
    decoding differs from ``trained_on``'s is refused (one-line ConfigError, before anything is built).
    ``frozen``: serve the restored weights without training them. :meth:`stop` can save the policy (see
    the module docstring). ``train_delay_s``: a test hook, the learner sleeps this long before every
    ``train()`` (the weights a client gets are the same, later)."""

    def __init__(self, layout: ObservationLayout, settings: SACSettings, host: str = LOOPBACK, port: int = 5555,
                 *, trained_on: dict, restore: Path | None = None, frozen: bool = False, train_delay_s: float = 0.0):
        resolve_secret()  # the one-line refusals before anything is built
        host = require_loopback(host, "listen on")  # the IPv4 literal: localhost is never resolved
        if frozen and restore is None:
            raise ConfigError("a frozen policy server needs a saved policy to serve (--policy)")
        self.trained_on = dict(trained_on)
        policy = run_declaration({k: self.trained_on.get(k) for k in ("privacy_mode", "action_decoding")},
                                 "trained_on")
        restored = load_manifest(restore) if restore is not None else None
        if restored is not None:
            layout = policy_layout(restored)
            policy = served_policy(restored, policy, restored.get("name") or Path(restore).name)
        self.layout, self.settings, self.frozen = layout, settings, bool(frozen)
        self.continued_from = restored["name"] if restored is not None else None
        self.address = RLlinkAddress(host, int(port))
        env_config = {"host": host, "port": int(port), "layout": layout.as_dict(), "sac": settings.as_dict(),
                      "frozen": self.frozen, "policy": policy}
        self.algo = sac_config(layout, settings, AuthenticatedRLlinkServer, env_config).build_algo()
        self.runner: AuthenticatedRLlinkServer = self.algo.env_runner
        try:  # the policy is in place before the first client can connect
            self.inherited: list[dict] = restore_policy(self.algo, Path(restore)) if restore is not None else []
            self.runner.serve()
            self.runner.wait_bound()
        except BaseException:
            self._stop_algo()
            raise
        self.training = TrainingLoop(self.algo, self.runner.num_pending, name="rllink-sac-train",
                                     seed=settings.seed, train_delay_s=train_delay_s)
        self.runner.await_training = self.training.wait_trained  # GET_STATE answers with trained weights only

    @property
    def url(self) -> str:
        return self.address.url

    def start(self) -> "RLlinkPolicyServer":
        if not self.frozen:  # a frozen policy is served as restored: no training thread
            self.training.start()
        return self

    def provenance(self) -> list[dict]:
        """The runs that trained this policy (ERRATA E14): the restored policy's, then each client's entry
        (with the id the server gave it), then, if some transitions came without an entry, one entry per
        privacy mode their connections declared that says so."""
        entries = [dict(e) for e in self.inherited]
        with self.runner._pending_lock:
            received = list(self.runner.provenance)
        for entry in received:
            append_provenance(entries, entry)
        for mode, unattributed in sorted(self.runner.unattributed_by_mode().items()):
            entries.append(provenance_entry({  # labelled with the mode its connections declared
                "privacy_mode": mode, "unattributed_transitions": unattributed,
                "note": "transitions from RLlink connections that sent no provenance entry (a run that died or "
                        "was still running): dataset and privacy spend unknown"}))
        return entries

    def counters(self) -> dict:
        learner = self.algo.learner_group._learner
        return {**self.training.counters(),
                "transitions_received": self.runner.transitions_received, "pending": self.runner.num_pending(),
                "malformed_messages": self.runner.malformed, "dropped_frozen": self.runner.dropped_frozen,
                "refused_uploads": self.runner.refused_uploads, "provenance_received": len(self.runner.provenance),
                "unattributed_transitions": self.runner.unattributed_transitions(),
                "replay_size": self.algo.local_replay_buffer.get_num_timesteps(),
                "alpha": float(learner.curr_log_alpha["default_policy"].detach().exp()),
                "listening": self.runner.thread.is_alive(),  # False: the listener died (e.g. the port was taken)
                "clients_accepted": self.runner.accepted, "clients_refused": self.runner.refused,
                "weights_seq_no": self.runner._weights_seq_no, "frozen": self.frozen}

    def wait_idle(self, timeout_s: float = 60.0) -> bool:
        """Wait until every received transition has been trained on."""
        return self.training.wait_idle(timeout_s)

    def save(self, path: Path, name: str | None = None) -> dict:
        """Write the policy to ``path`` (a fresh directory; :mod:`raydp.control.store`'s format) once every
        received transition is trained on; its manifest's provenance is :meth:`provenance`. A policy with
        nothing trained this session is saved too (``transitions`` 0). Refused for a frozen policy (it is
        the restored one, unchanged)."""
        if self.frozen:
            raise ConfigError("a frozen policy is not trained; nothing new to save")
        if not self.training.wait_idle():
            raise ConfigError("the policy server did not finish training on the received transitions")
        with self.training.lock:
            provenance = self.provenance()
            runs = sum(1 for e in provenance[len(self.inherited):] if not e.get("unattributed_transitions"))
            return write_policy(self.algo, Path(path), layout=self.layout, settings=self.settings,
                                trained_on={**self.trained_on, "transport": "rllink", "runs": runs,
                                            "continued_from": self.continued_from},
                                results={}, transitions=self.training.transitions_trained,
                                updates=self.training.train_calls * self.settings.k, name=name,
                                provenance=provenance)

    def _stop_algo(self) -> None:
        runner = self.algo.env_runner
        self.algo.stop()  # stops the runner (sockets closed, listener woken)
        if runner is not None and runner.thread.is_alive():
            runner.thread.join(timeout=5)  # algo.stop() does not join it

    def stop(self, save_to: Path | None = None) -> dict | None:
        """Stop serving. With ``save_to``, first stop listening (no more clients or messages), train on what
        was received and save the policy there (:meth:`save`); returns its manifest."""
        manifest = None
        try:
            if save_to is not None:
                self.runner.stop()
                if self.runner.thread.is_alive():
                    self.runner.thread.join(timeout=5)
                manifest = self.save(save_to)
        finally:
            self.training.stop()
            with self.training.lock:
                self._stop_algo()
        return manifest

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

