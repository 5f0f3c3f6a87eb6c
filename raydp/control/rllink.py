"""RLDP's controller over RLlib's external-env protocol (RLlink), beside the broker.

RLlib 2.60's external-env interface is RLlink (``ray.rllib.env.external``): the RLlib side runs an
``EnvRunnerServerForExternalInference`` that listens on a TCP port; a client pings it, gets the pickled
``AlgorithmConfig`` (GET_CONFIG) and the policy weights (GET_STATE), acts locally and sends its
experience back as RLlib episodes (EPISODES). Every message here goes through Ray's own
``send_rllink_message`` / ``get_rllink_message``; nothing re-implements the wire format.

Authentication (the part RLlink lacks). The stock server accepts any TCP client and its message decoder
(msgpack with msgpack_numpy) unpickles object arrays before the message type is even looked at: an
unauthenticated connection is remote code execution, and GET_CONFIG / GET_STATE hand out the config and
the weights to anyone. :class:`AuthenticatedRLlinkServer` therefore runs a mutual HMAC-SHA256
challenge/response on the raw socket right after ``accept()``, before a single RLlink byte is decoded:

    server -> client   MAGIC | n_s                       (32 random bytes)
    client -> server   n_c | HMAC(k, "client" | A | n_s | n_c)
    server -> client   HMAC(k, "server" | A | n_c | n_s)

``A`` is the address, ``127.0.0.1:PORT`` as the client dialled it and as the server bound it (length-
prefixed), so a relay from a free port to another raydp server with the same secret (e.g. Ray's token)
fails: each side checks the MAC against its own address.

The server reads exactly 64 bytes (5 s timeout) and compares in constant time; a failure closes the
socket. The client verifies the server's answer before it sends anything RLlink, because it too
unpickles what the server sends (the config). ``k`` is derived from a shared secret:
``RAYDP_RLLINK_SECRET`` (16+ characters), else Ray's auth token read from Ray's documented token
sources in Ray's order (``RAY_AUTH_TOKEN``, the file ``RAY_AUTH_TOKEN_PATH`` names, ``~/.ray/auth_token``).
Ray 2.60 has no public Python API for the token (its loader is ``ray._raylet``, private), so the
documented environment/file contract is what is read. The secret never enters ``env_config``: the
whole config is pickled to every client. With neither, the server refuses to start (one-line
:class:`~raydp.errors.ConfigError`). After the handshake the peer is trusted exactly as Ray trusts a
token holder: its messages are decoded with RLlib's decoder, pickle included.

Loopback only. After the handshake, messages are plaintext and carry no MAC: across machines an on-path
attacker could read the weights and inject pickled messages (code execution). The server therefore
refuses to listen on, and the client to connect to, anything but an IPv4 loopback host (one-line
:class:`~raydp.errors.ConfigError`, :func:`raydp.control.address.require_loopback`); a remote server is
reached through an SSH tunnel, e.g. ``ssh -L 5555:127.0.0.1:5555 server``, so that both ends are
loopback. IPv6 is refused (``::1`` too) and ``localhost`` is the literal 127.0.0.1 for both bind and
connect, never resolved: the server binds one IPv4 address, and a client sent to ``[::1]:P`` (where
/etc/hosts may put ``localhost``) would reach whoever holds that socket. The server binds 127.0.0.1 by
default (Ray's class hard-codes "localhost"; here the host comes from ``env_config["host"]``) and holds
its listening socket for its whole life, so no other local process can bind the port between or during
runs. It serves one client at a time: while a run is served, a second client waits in the listen
backlog and its handshake times out after 5 s with "busy with another run"; the next client is accepted
as soon as the current one leaves.

What this does not protect against, honestly: after the handshake, RLlink frames carry no per-message MAC
(Ray's wire format, kept as is), so the session's integrity rests on loopback only, the port held for the
server's life and the handshake; a local process with the same UID as the server or the run can read
their memory, the secret and the policy anyway. An idle connection that never answers the challenge
holds the (single) accept loop for up to the 5 s handshake timeout, delaying the clients behind it.

Training semantics are the broker path's (:mod:`raydp.control.service`): the algorithm is
:func:`raydp.control.sac.sac_config` with this server as its EnvRunner, each transition is stored as
its own 1-step episode and ``algo.train()`` runs once per transition (K updates of B_SAC), by the same
:class:`raydp.control.training.TrainingLoop` as the broker's service, with its randomness (SAC loss,
replay sampling) from the public SAC seed.

Decisions are deterministic given the run's releases and public seeds, as through the broker: the
actions set the DP clips, so they must be post-processing of DP releases plus public randomness, and how
far training got at any moment depends on timing, which depends on the private batch sizes. At each
decision the client closes its previous decision into a transition, uploads it (EPISODES), then fetches
the weights (GET_STATE), which the server answers only once it has trained on every transition it
received (:meth:`raydp.control.training.TrainingLoop.wait_trained`: the listener waits; never
EPISODES_AND_GET_STATE, which Ray's server blocks until a training step). The client then acts locally,
exploring with its own generator (:func:`raydp.control.broker.exploration_generator`: the policy's SAC seed
and the run's public seed, else a hash of its run id; the run's global RNG is not touched). So a decision's
weights are exactly those trained on every transition the run uploaded so far, and its action a function
of the restored policy, the run's transitions and the public seeds, however slow the learner. A server
serves one run at a time (below), so no other run's transitions interleave. Timings the client keeps
(``latencies``, ``timings``) are in-memory diagnostics for benchmarks, never written to a run's files.

The policy (:class:`RLlinkPolicyServer`): a new one, or a saved policy directory restored before the
server listens (``restore``: module, replay buffer and provenance, :func:`raydp.control.training.
restore_policy`); ``frozen`` serves the restored weights untrained: ``env_config["frozen"]`` tells the
clients, which then act greedily and upload nothing, and the training thread is not started.
``env_config["policy"]`` declares the policy's privacy mode and clip decoding (a restored policy's come
from its manifest, and must be the server config's). Runs declare theirs (ERRATA E3/E14): a client that
uploads is given its run's ``expect`` (required unless the policy is frozen), refuses a server whose
policy may not drive its run (a paper-mode policy may not drive a strict run, and a paper-mode run may
not train a strict policy), and sends the declaration as the ``declared`` key of every EPISODES body; the
server drops (``refused_uploads``) any upload that declares nothing or another mode or decoding than its
policy's. :meth:`RLlinkPolicyServer.stop` can save the policy (:mod:`raydp.control.store`'s format,
written to a temporary sibling and renamed into place). Provenance (ERRATA E14): a run's client sends
its provenance entry (the one a broker run passes to ``save_policy``) as the ``provenance`` key of its
final EPISODES message body; the server validates it (:func:`raydp.control.store.provenance_entry`: JSON
values only), gives it a fresh ``entry_id`` (a client cannot choose one, so no entry shadows another) and
appends it to the restored policy's inherited list. Transitions from a connection that ended without an
entry (a run that died) are recorded at save as one entry of unknown dataset and spend
(``unattributed_transitions``), labelled with the privacy mode that connection declared, so the manifest
never hides that the policy learned from them. A malformed message from an authenticated peer (a bad
body, chunk or entry) is dropped whole and counted (``malformed``); the listener keeps serving.
"""

from __future__ import annotations

import hashlib
import hmac
import functools
import logging
import os
import pickle
import socket
import stat
import sys
import threading
import time
import uuid
from collections import deque
from pathlib import Path

import msgpack
import msgpack_numpy
import numpy as np
import torch
import ray.rllib.env.external.rllink as _rllib_rllink
from ray.rllib.core import COMPONENT_RL_MODULE
from ray.rllib.env.external import RLlink, get_rllink_message, send_rllink_message
from ray.rllib.env.external.env_runner_server_for_external_inference import EnvRunnerServerForExternalInference
from ray.rllib.env.single_agent_episode import SingleAgentEpisode
from ray.rllib.utils.metrics import WEIGHTS_SEQ_NO

from raydp.control.address import (LOOPBACK, RLlinkAddress, Secret, loopback_host, loopback_refusal, parse_rllink,
                                   require_loopback)
from raydp.control.broker import exploration_generator, log_sampled, run_seed
from raydp.control.modes import DECODINGS, PAPER, unprotected
from raydp.control.features import ObservationLayout
from raydp.control.policies import check_policy_decoding
from raydp.control.sac import SACSettings, sac_config
from raydp.control.store import (
    PRIVACY_MODES,
    append_provenance,
    check_policy_privacy_mode,
    load_manifest,
    policy_action_decoding,
    policy_layout,
    policy_privacy_mode,
    provenance_entry,
)
from raydp.control.training import TrainingLoop, restore_policy, transition_episodes, write_policy
from raydp.errors import ConfigError


class _NumpyMsgpack:
    """msgpack with numpy arrays (msgpack_numpy's encode/decode hooks), without patching msgpack process-wide.

    RLlib's RLlink wire functions get their msgpack from ``try_import_msgpack``, which calls
    ``msgpack_numpy.patch()``: that replaces ``msgpack.packb``/``unpackb`` for the whole process, and Ray's own
    task-argument serialization then encodes a numpy array inside a dict as msgpack_numpy's dict, which an
    unpatched worker decodes as a dict (measured: ``ray.get(f.remote({"a": np.arange(3.)}))`` sees a dict after
    the patch). Every process that speaks RLlink (a run's actor, the policy server) also makes Ray calls, so the
    wire functions get this object instead (the module global they use, set before their first call), and
    msgpack stays unpatched."""

    packb = staticmethod(functools.partial(msgpack.packb, default=msgpack_numpy.encode))
    unpackb = staticmethod(functools.partial(msgpack.unpackb, object_hook=msgpack_numpy.decode))


_rllib_rllink.msgpack = _NumpyMsgpack


logger = logging.getLogger("raydp.rllink")

SECRET_ENV = "RAYDP_RLLINK_SECRET"
MIN_SECRET_BYTES = 16
MAGIC = b"RAYDP-RLLINK-2"  # v2: the MACs cover the address
NONCE_BYTES = 32
MAC_BYTES = 32
HANDSHAKE_TIMEOUT_S = 5.0
BACKLOG = 4  # connections the kernel queues while a run is served (each then times out "busy")


# -- the shared secret ------------------------------------------------------------------------------
def resolve_secret(environ=None, home: Path | None = None) -> tuple[Secret, str]:
    """(secret, where it came from): ``RAYDP_RLLINK_SECRET``, else Ray's auth token from Ray's documented
    sources in Ray's order; a one-line ConfigError when there is none (the server then refuses to start)."""
    env = os.environ if environ is None else environ
    explicit = env.get(SECRET_ENV, "")
    if explicit:
        if len(explicit.encode()) < MIN_SECRET_BYTES:
            raise ConfigError(f"{SECRET_ENV} is too short: use at least {MIN_SECRET_BYTES} characters")
        return Secret(explicit.encode()), SECRET_ENV
    token = env.get("RAY_AUTH_TOKEN", "").strip()
    if token:
        return Secret(token.encode()), "RAY_AUTH_TOKEN"
    path = env.get("RAY_AUTH_TOKEN_PATH")
    if path:  # Ray treats an unreadable or empty token file as a fatal misconfiguration; so does this
        try:
            token = Path(path).expanduser().read_text().strip()
        except OSError as exc:
            raise ConfigError(f"RAY_AUTH_TOKEN_PATH {path}: cannot read the Ray auth token ({exc.strerror})") from None
        if not token:
            raise ConfigError(f"RAY_AUTH_TOKEN_PATH {path} is empty")
        return Secret(token.encode()), "RAY_AUTH_TOKEN_PATH"
    default = Path(home or Path.home()) / ".ray" / "auth_token"
    try:
        token = default.read_text().strip()
    except OSError:
        token = ""
    if token:
        if default.stat().st_mode & (stat.S_IRGRP | stat.S_IROTH):
            print(f"raydp: warning: {default} is readable by other users; the RLlink secret is only as private "
                  "as that file (chmod 600 it)", file=sys.stderr)
        return Secret(token.encode()), "~/.ray/auth_token"
    raise ConfigError(f"no RLlink secret: set {SECRET_ENV} ({MIN_SECRET_BYTES}+ characters) or configure a Ray "
                      "auth token (`ray get-auth-token --generate`); the policy server never runs unauthenticated")


def _key(secret: bytes) -> bytes:
    """The HMAC key: the secret, separated from its other uses (Ray's token also authenticates Ray)."""
    return hmac.new(bytes(secret), b"raydp rllink handshake v1", hashlib.sha256).digest()


def _mac(key: bytes, role: bytes, address: str, first: bytes, second: bytes) -> bytes:
    where = address.encode()
    return hmac.new(key, role + len(where).to_bytes(2, "big") + where + first + second, hashlib.sha256).digest()


def handshake_address(host: str, port: int) -> str:
    """What both MACs cover: the IPv4 literal and port the client dials and the server binds."""
    return f"{host}:{int(port)}"


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed the connection during the handshake")
        buf += chunk
    return buf


def server_handshake(conn: socket.socket, key: bytes, address: str) -> bool:
    """True when the peer proved the secret for this server's ``address`` (and got our proof back); reads
    exactly 64 bytes."""
    conn.settimeout(HANDSHAKE_TIMEOUT_S)
    try:
        n_s = os.urandom(NONCE_BYTES)
        conn.sendall(MAGIC + n_s)
        reply = _recv_exact(conn, NONCE_BYTES + MAC_BYTES)
        n_c, mac = reply[:NONCE_BYTES], reply[NONCE_BYTES:]
        if not hmac.compare_digest(mac, _mac(key, b"client", address, n_s, n_c)):
            return False
        conn.sendall(_mac(key, b"server", address, n_c, n_s))
        conn.settimeout(None)
        return True
    except (OSError, ConnectionError):
        return False


def client_handshake(sock: socket.socket, key: bytes, address: str) -> None:
    """Prove the secret for the dialled ``address`` and check the server's proof for the same address;
    ConnectionError (one line) on any failure."""
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    try:
        hello = _recv_exact(sock, len(MAGIC) + NONCE_BYTES)
        if hello[: len(MAGIC)] != MAGIC:
            raise ConnectionError("the server does not speak raydp's authenticated RLlink (no handshake)")
        n_s, n_c = hello[len(MAGIC):], os.urandom(NONCE_BYTES)
        sock.sendall(n_c + _mac(key, b"client", address, n_s, n_c))
        answer = _recv_exact(sock, MAC_BYTES)
    except socket.timeout:
        raise ConnectionError("the server did not complete the handshake (busy with another run: it serves one "
                              "at a time; or not a raydp policy server)") from None
    except ConnectionError as exc:
        raise ConnectionError(f"the server refused the handshake ({exc}); is the secret the server's?") from None
    if not hmac.compare_digest(answer, _mac(key, b"server", address, n_c, n_s)):
        raise ConnectionError("the server failed to prove the secret; refusing its messages")
    sock.settimeout(None)


# -- the RLlib side ---------------------------------------------------------------------------------
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


# -- the run's side ---------------------------------------------------------------------------------
class RLlinkPolicyClient:
    """A run's controller connection over RLlink, with :class:`raydp.control.service.PolicyClient`'s
    interface (``decide``, ``end``, ``save_policy``, ``latencies``, ``weights_seen``, ``layout``,
    ``service``), plus ``close``.

    Only an IPv4 loopback ``host`` is reached (``localhost`` is 127.0.0.1, never resolved; else a one-line
    ConfigError: tunnel a remote server over SSH). ``expect``: the run's ``{"privacy_mode",
    "action_decoding"}`` (its ``rldp`` settings); the client refuses a server whose policy declares others
    (:func:`check_served_policy`) and sends it, as ``declared``, with every upload: the server drops uploads
    that declare nothing or another run (ERRATA E3/E14). It is required unless the server's policy is frozen
    (a one-line ConfigError after GET_CONFIG): a frozen policy (``env_config["frozen"]``) makes the client act
    greedily and upload nothing.

    ``decide(obs, reward)``: ``reward`` is the reward of the previous action (None at the first decision),
    as through the broker. It closes the open (obs, action) into a transition, uploads pending transitions
    (EPISODES, every ``upload_every``), refreshes the weights (GET_STATE, every ``weights_every`` decisions;
    the server answers once it has trained on every transition it received) and acts locally (a Gaussian
    sample from its own torch generator, :func:`raydp.control.broker.exploration_generator` of the server's
    SAC seed and ``seed``, the run's public seed, else a hash of ``run_id``: the run's global RNG is not
    touched). With the defaults (1 and 1) a decision acts with the weights trained on every transition
    before it, as through the broker. ``latencies`` time the whole call, ``timings`` its parts (in-memory
    diagnostics for benchmarks: never written to a run's files). ``end()`` leaves the decision loop (final upload,
    answered PING); the socket stays open until ``close()`` so that ``save_policy`` can still send the run's
    provenance entry. ``save_policy`` returns None: the policy server owns and saves the policy; it records
    the run's entry (ERRATA E14), sent with the final upload (now, if the run has ended). ``service`` is the
    server's URL (None for a frozen policy, which no run trains): a run calls ``save_policy`` only when it
    is set."""

    def __init__(self, host: str, port: int, run_id: str, *, secret: bytes | None = None, explore: bool = True,
                 seed: int | None = None, weights_every: int = 1, upload_every: int = 1,
                 connect_timeout_s: float = 30.0, expect: dict | None = None):
        from ray.rllib.core.columns import Columns

        host = require_loopback(host, "connect to")  # before a byte is sent; the IPv4 literal
        self.declared = run_declaration(expect)  # a malformed declaration fails before connecting
        self._columns = Columns
        self.run_id = run_id
        self.weights_every, self.upload_every = max(1, int(weights_every)), max(1, int(upload_every))
        key = _key(secret if secret is not None else resolve_secret()[0])
        url = RLlinkAddress(host, int(port)).url
        self.sock = self._connect(host, int(port), connect_timeout_s)
        try:
            client_handshake(self.sock, key, handshake_address(host, port))  # before anything is decoded
            kind, _ = self._rpc(RLlink.PING)
            if kind != RLlink.PONG:
                raise ConnectionError(f"expected PONG, got {kind}")
            kind, body = self._rpc(RLlink.GET_CONFIG)
            if kind != RLlink.SET_CONFIG:
                raise ConnectionError(f"expected SET_CONFIG, got {kind}")
            self.config = pickle.loads(body["config"])  # the server proved the secret
            env_config = self.config.env_config
            check_served_policy(env_config.get("policy") or {}, expect, url)
            self.frozen = bool(env_config.get("frozen", False))
            if self.declared is None and not self.frozen:
                raise ConfigError(f"policy server {url} trains its policy: a client that uploads must declare its "
                                  "run, RLlinkPolicyClient(..., expect={'privacy_mode': ..., 'action_decoding': ...}) "
                                  "from the run's rldp settings (ERRATA E3/E14)")
            self.explore = explore and not self.frozen  # a frozen policy acts greedily, as through the broker
            self.service = None if self.frozen else url
            self.layout = ObservationLayout(**env_config["layout"])
            self.server_settings = dict(env_config.get("sac") or {})
            with torch.random.fork_rng(devices=[]):  # building draws initial weights: not from the run's RNG
                self.module = self.config.get_rl_module_spec(inference_only=True).build()
            self.module.eval()
            self.weights_seq = -1
            self._refresh_weights()
        except BaseException:
            self.sock.close()
            raise
        self.generator = exploration_generator(int(self.server_settings.get("seed", 0)), run_seed(run_id, seed))
        self.latencies: list[float] = []
        self.weights_seen: list[int] = []
        self.timings: dict[str, list[float]] = {"weights": [], "act": [], "upload": []}
        self.uploaded = 0
        self._open: tuple[np.ndarray, np.ndarray] | None = None
        self._pending: list[tuple] = []
        self._episode_id = uuid.uuid4().hex
        self._t = 0  # env steps of the current episode already uploaded or pending
        self._decisions = 0
        self._provenance: dict | None = None  # this run's entry, to send with the final upload
        self._ended = self._closed = False

    @staticmethod
    def _connect(host: str, port: int, timeout_s: float) -> socket.socket:
        """An IPv4 TCP connection to the loopback literal ``host`` (no name resolution, no IPv6)."""
        host = require_loopback(host, "connect to")
        deadline = time.monotonic() + timeout_s
        while True:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.settimeout(HANDSHAKE_TIMEOUT_S)
                sock.connect((host, port))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return sock
            except (ConnectionRefusedError, socket.timeout) as exc:
                sock.close()
                if time.monotonic() > deadline:
                    raise ConnectionError(f"no RLlink policy server at {host}:{port} ({exc.__class__.__name__}; "
                                          "is it running? it serves one run at a time)") from None
                time.sleep(0.25)
            except BaseException:
                sock.close()
                raise

    def _rpc(self, kind: RLlink, **body):
        send_rllink_message(self.sock, {"type": kind.name, **body})
        return get_rllink_message(self.sock)

    def _refresh_weights(self) -> None:
        kind, body = self._rpc(RLlink.GET_STATE)
        if kind != RLlink.SET_STATE:
            raise ConnectionError(f"expected SET_STATE, got {kind}")
        state = body["state"]
        self.module.set_state(state[COMPONENT_RL_MODULE])
        self.weights_seq = int(state.get(WEIGHTS_SEQ_NO, 0))

    def _act(self, obs: np.ndarray) -> np.ndarray:
        from raydp.control.modules import act

        return act(self.module, obs, self.generator if self.explore else None)  # the broker's draw, this generator

    def _chunk(self) -> SingleAgentEpisode:
        obs = [t[0] for t in self._pending] + [self._pending[-1][3]]
        # no spaces in the chunk: the server has them, and serialising them would double the message's cost
        return SingleAgentEpisode(id_=self._episode_id, observations=obs, actions=[t[1] for t in self._pending],
                                  rewards=[t[2] for t in self._pending], t_started=self._t - len(self._pending),
                                  len_lookback_buffer=0)

    def _upload(self, provenance: dict | None = None) -> None:
        if not self._pending and provenance is None:
            return
        body = {"type": RLlink.EPISODES.name, "episodes": [self._chunk().get_state()] if self._pending else [],
                "declared": self.declared}  # our keys in the body; Ray's wire format
        if provenance is not None:
            body["provenance"] = provenance
        send_rllink_message(self.sock, body)
        self.uploaded += len(self._pending)
        self._pending = []

    def decide(self, obs: np.ndarray, reward: float | None) -> np.ndarray:
        started = time.perf_counter()
        obs = np.asarray(obs, dtype=np.float32)
        if self._open is not None and reward is not None and self.explore:
            self._pending.append((self._open[0], self._open[1], float(reward), obs))
            self._t += 1
        elif self._open is not None:  # no reward for the open action: the broker drops it; a new episode starts
            self._upload()
            self._episode_id, self._t = uuid.uuid4().hex, 0
        t0 = time.perf_counter()
        if len(self._pending) >= self.upload_every:
            self._upload()  # before GET_STATE: the weights below are trained on this transition too
        t1 = time.perf_counter()
        if self._decisions > 0 and self._decisions % self.weights_every == 0 and not self.frozen:
            self._refresh_weights()  # the server answers once trained on every transition uploaded so far
        t2 = time.perf_counter()
        action = self._act(obs)
        t3 = time.perf_counter()
        self._open = (obs, action)
        self._decisions += 1
        self.timings["upload"].append(t1 - t0)
        self.timings["weights"].append(t2 - t1)
        self.timings["act"].append(t3 - t2)
        self.latencies.append(t3 - started)
        self.weights_seen.append(self.weights_seq)
        return action

    def end(self) -> None:
        """Leave the decision loop: upload what is pending (the open decision has no reward and is dropped, as
        by the broker) with the provenance entry if one is recorded, and wait for the server to have read it
        (a PING answered in order). The connection stays open for :meth:`save_policy`; :meth:`close` ends it."""
        if self._ended or self._closed:
            return
        self._ended, self._open = True, None
        self._final_upload()

    def _final_upload(self) -> None:
        provenance, self._provenance = self._provenance, None
        self._upload(provenance)
        kind, _ = self._rpc(RLlink.PING)
        if kind != RLlink.PONG:
            raise ConnectionError(f"expected PONG, got {kind}")

    def close(self) -> None:
        """Release the connection (the server serves one run at a time: it takes the next one after this)."""
        if not self._closed:
            self._closed = True
            self._open = None
            try:
                self.sock.close()
            except OSError:
                pass

    def __enter__(self) -> "RLlinkPolicyClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def save_policy(self, path, trained_on: dict, results: dict, provenance: dict | None = None) -> None:
        """None: the policy lives in the policy server, which saves it (``raydp policy-server --save``).
        ``provenance``: this run's entry (ERRATA E14; the shape :func:`raydp.control.store.provenance_entry`
        validates), sent to the server with the run's final upload (at :meth:`end`, or now if the run has
        ended) so that the policy's manifest lists this run. Nothing for a frozen policy (not trained)."""
        if provenance is None or self.frozen:
            return None
        entry = provenance_entry(provenance)  # a bad entry fails here, in the run, not in the server
        if self._closed:
            raise ConnectionError("the RLlink connection is closed: call save_policy before close()")
        self._provenance = entry
        if self._ended:
            self._final_upload()
        return None


def check_served_policy(policy: dict, expect: dict | None, url: str) -> None:
    """ConfigError (one line) unless the server's policy (``env_config["policy"]``) may drive a run with
    ``expect``'s privacy mode and clip decoding (nothing is checked without ``expect``): a paper-mode policy
    saw unprivatized statistics and may not drive a strict run; a paper-mode run would feed unprivatized
    statistics to a strict policy (ERRATA E3/E14); a policy acts in one clip decoding."""
    if not expect:
        return
    served, mode = policy.get("privacy_mode"), expect.get("privacy_mode")
    if served != mode:
        if not unprotected(mode):
            raise ConfigError(f"policy server {url} serves a {served or 'undeclared'}-mode policy; a strict run "
                              "may only use a strict one (ERRATA E3/E14): start the server with a strict config")
        raise ConfigError(f"policy server {url} serves a {served or 'undeclared'}-mode policy; a {mode}-mode run "
                          f"would train it on statistics it may not see (ERRATA E14): use a {mode}-mode server")
    decoding = policy.get("action_decoding")
    if decoding != expect.get("action_decoding"):
        raise ConfigError(f"policy server {url} acts in {decoding!r} clip decoding; this run decodes "
                          f"{expect.get('action_decoding')!r} (set settings.action_decoding: {decoding})")


def check_policy_server(address: RLlinkAddress, secret: bytes, expect: dict | None = None,
                        timeout_s: float = 10.0) -> None:
    """Before a run starts: the server is IPv4 loopback, answers, proves the secret and accepts ours
    (PING/PONG), and its policy may drive the run (``expect``, :func:`check_served_policy`), else a one-line
    ConfigError. The run's own connection then waits in the server's backlog until this probe has left."""
    host = require_loopback(address.host, "connect to")
    url = RLlinkAddress(host, address.port).url
    key = _key(secret)
    try:
        sock = RLlinkPolicyClient._connect(host, address.port, timeout_s)
    except OSError as exc:  # refused, unreachable (ConnectionError is an OSError)
        raise ConfigError(f"policy server {url}: {str(exc).splitlines()[0][:200]}") from None
    try:
        client_handshake(sock, key, handshake_address(host, address.port))
        send_rllink_message(sock, {"type": RLlink.PING.name})
        kind, _ = get_rllink_message(sock)
        if kind != RLlink.PONG:
            raise ConnectionError(f"expected PONG, got {kind}")
        if expect:
            send_rllink_message(sock, {"type": RLlink.GET_CONFIG.name})
            kind, body = get_rllink_message(sock)
            if kind != RLlink.SET_CONFIG:
                raise ConnectionError(f"expected SET_CONFIG, got {kind}")
            policy = pickle.loads(body["config"]).env_config.get("policy") or {}  # the server proved the secret
            check_served_policy(policy, expect, url)
    except (ConnectionError, OSError) as exc:
        raise ConfigError(f"policy server {url}: {str(exc).splitlines()[0][:200]}") from None
    finally:
        sock.close()


def run_declaration(expect: dict | None, what: str = "expect") -> dict | None:
    """A run's declaration, ``{"privacy_mode", "action_decoding"}`` (None stays None: a frozen policy's
    client, which uploads nothing); a one-line ConfigError unless both are known values."""
    if expect is None:
        return None
    if (not isinstance(expect, dict) or expect.get("privacy_mode") not in PRIVACY_MODES
            or expect.get("action_decoding") not in DECODINGS):
        shown = {k: expect.get(k) for k in ("privacy_mode", "action_decoding")} if isinstance(expect, dict) else expect
        raise ConfigError(f"{what} must declare the run's privacy_mode (one of {', '.join(PRIVACY_MODES)}) and "
                          f"action_decoding (one of {', '.join(DECODINGS)}); got {str(shown)[:120]}")
    return {"privacy_mode": expect["privacy_mode"], "action_decoding": expect["action_decoding"]}


def check_run_declaration(client, expect: dict) -> None:
    """ConfigError (one line) unless an RLlink client that uploads (``service`` set) declares ``expect``,
    the privacy mode and clip decoding of the run it serves: the server labels and admits the run's
    transitions by that declaration (ERRATA E3/E14). Clients without ``declared`` (the broker's) pass."""
    if getattr(client, "service", None) is None or not hasattr(client, "declared"):
        return
    if client.declared != run_declaration(expect):
        raise ConfigError(f"the RLlink client declares {client.declared} but the run is {run_declaration(expect)}: "
                          "build it with RLlinkPolicyClient(..., expect=<the run's privacy_mode and action_decoding>)")


def served_policy(manifest: dict, expect: dict, name: str) -> dict:
    """What a server restoring the saved policy ``manifest`` serves: its own privacy mode and clip decoding
    (:func:`raydp.control.store.policy_privacy_mode`, :func:`~raydp.control.store.policy_action_decoding`);
    a one-line ConfigError unless they are ``expect``'s (the server's config, whose runs it accepts)."""
    check_policy_privacy_mode(manifest, expect["privacy_mode"], name)  # a paper policy for a strict config
    mode = policy_privacy_mode(manifest)
    if mode != expect["privacy_mode"]:
        raise ConfigError(f"policy {name} is a {mode}-mode policy and this server's config is "
                          f"{expect['privacy_mode']} mode: a server accepts runs of its policy's mode only (ERRATA "
                          f"E3/E14); use a {mode} config")
    check_policy_decoding(manifest, expect["action_decoding"], name)
    return {"privacy_mode": mode, "action_decoding": policy_action_decoding(manifest)}


def rllink_connection(address: RLlinkAddress, secret: bytes, expect: dict, seed: int | None = None) -> dict:
    """What a run actor needs to reach the policy server (the secret travels inside Ray, which already
    runs arbitrary code in that actor; it prints as ``Secret(<hidden>)``); ``expect``: the run's privacy
    mode and clip decoding, which its client checks against the served policy (:func:`check_served_policy`)
    and declares with every upload; ``seed``: the run's public exploration seed (its config's ``seed``;
    None: the client hashes its run id). :func:`raydp.control.connection.client_from_connection` builds the
    client."""
    host = require_loopback(address.host, "connect to")
    declared = run_declaration(expect)
    if declared is None:
        raise ConfigError("a run's RLlink connection declares its privacy_mode and action_decoding (expect)")
    out = {"kind": "rllink", "host": host, "port": address.port, "secret": Secret(secret), "expect": declared}
    if seed is not None:
        out["seed"] = int(seed)
    return out


# ---- the rllink transport (raydp.control.transports) ---------------------------------------------------------

def rllink_client(connection: dict, run_id: str) -> RLlinkPolicyClient:
    """The run's client on the policy server ``connection`` names (:func:`rllink_connection`)."""
    return RLlinkPolicyClient(connection["host"], connection["port"], run_id, secret=connection.get("secret"),
                              expect=connection.get("expect"), seed=connection.get("seed"))


class RLlinkLaunch:
    """The rllink transport's launcher: the run is driven by the policy server at ``config.controller``. The
    secret is resolved when it is built (:func:`resolve_secret`), before Ray starts; the server must be
    loopback, answer, and serve a policy of the run's privacy mode and clip decoding (one-line ConfigErrors)."""

    def __init__(self, config, overwrite_policy: bool = False):
        self.address = parse_rllink(config.controller)
        self.secret, _ = resolve_secret()
        s = config.strategy_settings()
        self.expect = {"privacy_mode": s.privacy_mode, "action_decoding": s.action_decoding}
        self.seed = config.seed
        check_policy_server(self.address, self.secret, self.expect)  # a one-line error now, not a failed actor later

    def start(self, namespace: str) -> dict:
        return rllink_connection(self.address, self.secret, self.expect, seed=self.seed)

    def finish(self, summary: dict, output: Path) -> None:
        summary["controller_transport"] = {"kind": "rllink", "address": self.address.url}

    def close(self) -> None:
        pass
