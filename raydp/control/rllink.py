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
    client -> server   n_c | HMAC(k, "client" | n_s | n_c)
    server -> client   HMAC(k, "server" | n_c | n_s)

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

The server binds 127.0.0.1 by default (Ray's class hard-codes "localhost"; here the host comes from
``env_config["host"]``), serves one client at a time (its listening socket is closed while a client is
connected, so a second run is refused rather than left hanging) and re-listens 0.2 s after a client
leaves (Ray waits 5 s). Traffic is not encrypted: see :func:`raydp.control.address.plaintext_warning`.

Training semantics are the broker path's (:mod:`raydp.control.service`): the algorithm is
:func:`raydp.control.sac.sac_config` with this server as its EnvRunner, each transition is stored as
its own 1-step episode and ``algo.train()`` runs once per transition (K updates of B_SAC). The client
uploads each transition with EPISODES right after acting and fetches the weights with GET_STATE before
its next decision (never EPISODES_AND_GET_STATE, which blocks until learning starts), so a decision
sees weights trained on every earlier transition, as through the broker.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import pickle
import socket
import stat
import sys
import threading
import time
import uuid
import zlib
from collections import deque
from pathlib import Path

import numpy as np
import torch
from ray.rllib.core import COMPONENT_RL_MODULE
from ray.rllib.env.external import RLlink, get_rllink_message, send_rllink_message
from ray.rllib.env.external.env_runner_server_for_external_inference import EnvRunnerServerForExternalInference
from ray.rllib.env.single_agent_episode import SingleAgentEpisode
from ray.rllib.utils.metrics import NUM_ENV_STEPS_SAMPLED_LIFETIME, WEIGHTS_SEQ_NO

from raydp.control.address import LOOPBACK, RLlinkAddress, Secret, is_loopback, plaintext_warning
from raydp.control.broker import log_sampled
from raydp.control.features import ObservationLayout
from raydp.control.sac import SACSettings, sac_config
from raydp.errors import ConfigError

logger = logging.getLogger("raydp.rllink")

SECRET_ENV = "RAYDP_RLLINK_SECRET"
MIN_SECRET_BYTES = 16
MAGIC = b"RAYDP-RLLINK-1"
NONCE_BYTES = 32
MAC_BYTES = 32
HANDSHAKE_TIMEOUT_S = 5.0
RELISTEN_S = 0.2
POLL_MIN_S, POLL_MAX_S = 0.02, 0.5


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


def _mac(key: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(key, role + first + second, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed the connection during the handshake")
        buf += chunk
    return buf


def server_handshake(conn: socket.socket, key: bytes) -> bool:
    """True when the peer proved the secret (and got our proof back); reads exactly 64 bytes."""
    conn.settimeout(HANDSHAKE_TIMEOUT_S)
    try:
        n_s = os.urandom(NONCE_BYTES)
        conn.sendall(MAGIC + n_s)
        reply = _recv_exact(conn, NONCE_BYTES + MAC_BYTES)
        n_c, mac = reply[:NONCE_BYTES], reply[NONCE_BYTES:]
        if not hmac.compare_digest(mac, _mac(key, b"client", n_s, n_c)):
            return False
        conn.sendall(_mac(key, b"server", n_c, n_s))
        conn.settimeout(None)
        return True
    except (OSError, ConnectionError):
        return False


def client_handshake(sock: socket.socket, key: bytes) -> None:
    """Prove the secret and check the server's proof; ConnectionError (one line) on any failure."""
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    try:
        hello = _recv_exact(sock, len(MAGIC) + NONCE_BYTES)
        if hello[: len(MAGIC)] != MAGIC:
            raise ConnectionError("the server does not speak raydp's authenticated RLlink (no handshake)")
        n_s, n_c = hello[len(MAGIC):], os.urandom(NONCE_BYTES)
        sock.sendall(n_c + _mac(key, b"client", n_s, n_c))
        answer = _recv_exact(sock, MAC_BYTES)
    except socket.timeout:
        raise ConnectionError("the server did not complete the handshake (busy with another run, or not a "
                              "raydp policy server)") from None
    except ConnectionError as exc:
        raise ConnectionError(f"the server refused the handshake ({exc}); is the secret the server's?") from None
    if not hmac.compare_digest(answer, _mac(key, b"server", n_c, n_s)):
        raise ConnectionError("the server failed to prove the secret; refusing its messages")
    sock.settimeout(None)


# -- the RLlib side ---------------------------------------------------------------------------------
class _Stopped(Exception):
    """Ends the listener thread when the server stops."""


def _one_step_episodes(transitions, config) -> list:
    from raydp.control.service import _episodes

    return _episodes({"obs": [t[0] for t in transitions], "action": [t[1] for t in transitions],
                      "reward": [t[2] for t in transitions], "next_obs": [t[3] for t in transitions]}, config)


class AuthenticatedRLlinkServer(EnvRunnerServerForExternalInference):
    """RLlib's RLlink EnvRunner with the handshake in front and the broker's training semantics:
    uploaded episodes are split into transitions, and ``sample()`` hands out one per call (as
    :class:`raydp.control.broker.BrokerEnvRunner` does), so each ``train()`` is K updates per transition.
    ``env_config``: ``host`` (default 127.0.0.1), ``port``, ``layout`` and ``sac`` (for the clients)."""

    def __init__(self, *, config, **kwargs):
        secret, self.secret_source = resolve_secret()  # before the listener thread exists: no secret, no server
        self._key = _key(secret)
        self._stopping = False
        self._bound = threading.Event()
        self.bind_error: OSError | None = None
        self._pending: deque = deque()
        self._pending_lock = threading.Lock()
        self._state_lock = threading.RLock()
        self.accepted = self.refused = self.transitions_received = self.malformed = 0
        super().__init__(config=config, **kwargs)

    # connection handling ------------------------------------------------------------------------
    def _recycle_sockets(self, sleep: float = 0.0):
        self._close_sockets_if_necessary()
        self.client_socket = None
        if self._stopping:
            raise _Stopped
        time.sleep(min(sleep, RELISTEN_S))
        self.host = str(self.config.env_config.get("host", LOOPBACK))
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((self.host, self.port))
        except OSError as exc:
            listener.close()
            self.bind_error = exc
            self._bound.set()
            raise _Stopped from None
        listener.listen(1)
        listener.settimeout(0.5)
        self.server_socket = listener
        self._bound.set()
        while True:
            try:
                conn, addr = listener.accept()
            except socket.timeout:
                if self._stopping:
                    raise _Stopped from None
                continue
            except OSError:
                if self._stopping:
                    raise _Stopped from None
                raise
            if server_handshake(conn, self._key):
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self.client_socket, self.address = conn, addr
                self.accepted += 1
                logger.info("RLlink client %s authenticated", addr)
                listener.close()  # one run at a time: a second one is refused, not left hanging
                return
            self.refused += 1
            logger.warning("RLlink client %s refused: no proof of the secret", addr)
            conn.close()

    def _client_message_listener(self):
        try:
            super()._client_message_listener()
        except _Stopped:
            return

    def stop(self):
        self._stopping = True
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
            raise ConfigError(f"cannot listen on {self.host}:{self.port}: {self.bind_error.strerror}")

    # experience --------------------------------------------------------------------------------
    def _process_episodes_message(self, msg_type, msg_body):
        if msg_type == RLlink.EPISODES_AND_GET_STATE:
            self._blocked_on_state = True  # as Ray's server: the answer is the next weights
        obs_dim, act_dim = self.config.observation_space.shape[0], self.config.action_space.shape[0]
        transitions = []
        for state in msg_body.get("episodes", []):
            try:
                episode = SingleAgentEpisode.from_state(state)
                n = len(episode)
                obs = np.asarray(episode.get_observations(slice(0, n + 1)), dtype=np.float32)
                act = np.asarray(episode.get_actions(slice(0, n)), dtype=np.float32)
                rew = np.asarray(episode.get_rewards(slice(0, n)), dtype=np.float64)
                if obs.shape != (n + 1, obs_dim) or act.shape != (n, act_dim) or rew.shape != (n,) or not (
                        np.isfinite(obs).all() and np.isfinite(act).all() and np.isfinite(rew).all()):
                    raise ValueError("shape or value")
            except Exception:  # a malformed chunk is dropped, never trained on
                self.malformed += 1
                continue
            transitions += [(obs[i], act[i], float(rew[i]), obs[i + 1]) for i in range(n)]
        with self._pending_lock:
            self._pending.extend(transitions)
            self.transitions_received += len(transitions)

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
        episodes = _one_step_episodes(batch, self.config) if batch else []
        log_sampled(self.metrics, len(episodes))
        return episodes

    # weights: RLlib's sync (training thread) and GET_STATE (listener thread) never interleave ----------
    def get_state(self, components=None, *, not_components=None, **kwargs):
        with self._state_lock:
            return super().get_state(components, not_components=not_components, **kwargs)

    def set_state(self, state):
        with self._state_lock:
            super().set_state(state)


class RLlinkPolicyServer:
    """The policy service over RLlink: RLlib's SAC algorithm (:func:`raydp.control.sac.sac_config`, the
    broker path's) with :class:`AuthenticatedRLlinkServer` as its EnvRunner, and a thread that calls
    ``algo.train()`` once per transition a client uploads (as :class:`raydp.control.service.PolicyService`).
    Saves nothing: the replay buffer (the runs' controller observations) stays in memory."""

    def __init__(self, layout: ObservationLayout, settings: SACSettings, host: str = LOOPBACK, port: int = 5555):
        resolve_secret()  # the one-line refusal before anything is built
        if not is_loopback(host):
            print(f"raydp: {plaintext_warning(host)}", file=sys.stderr)
        self.layout, self.settings = layout, settings
        self.address = RLlinkAddress(host, int(port))
        env_config = {"host": host, "port": int(port), "layout": layout.as_dict(), "sac": settings.as_dict()}
        self.algo = sac_config(layout, settings, AuthenticatedRLlinkServer, env_config).build_algo()
        self.runner: AuthenticatedRLlinkServer = self.algo.env_runner
        try:
            self.runner.wait_bound()
        except ConfigError:
            self._stop_algo()
            raise
        self.lock = threading.Lock()
        self.train_calls = self.transitions_trained = self.module_steps_trained = self.env_steps_sampled = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._busy = False
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return self.address.url

    def start(self) -> "RLlinkPolicyServer":
        self.thread = threading.Thread(target=self._loop, name="rllink-sac-train", daemon=True)
        self.thread.start()
        return self

    def _loop(self) -> None:
        from raydp.control.service import _module_steps
        from ray.rllib.utils.metrics import ENV_RUNNER_RESULTS

        idle = POLL_MIN_S
        while not self._stop.is_set():
            if self.runner.num_pending() == 0:
                self._stop.wait(idle)
                idle = min(2 * idle, POLL_MAX_S)
                continue
            idle = POLL_MIN_S
            try:
                with self.lock:
                    self._busy = True
                    result = self.algo.train()
                    self.train_calls += 1
                    self.transitions_trained += 1
                    self.module_steps_trained += _module_steps(result)
                    lifetime = result.get(ENV_RUNNER_RESULTS, {}).get(NUM_ENV_STEPS_SAMPLED_LIFETIME)
                    if lifetime is not None:  # RLlib's own count of the env steps its runner sampled
                        self.env_steps_sampled = int(getattr(lifetime, "peek", lambda: lifetime)())
            except Exception as exc:  # keep serving; counters() reports it
                self.errors.append(repr(exc))
                time.sleep(0.5)
            finally:
                self._busy = False

    def counters(self) -> dict:
        learner = self.algo.learner_group._learner
        return {"train_calls": self.train_calls, "transitions_trained": self.transitions_trained,
                "module_steps_trained": self.module_steps_trained, "env_steps_sampled": self.env_steps_sampled,
                "transitions_received": self.runner.transitions_received, "pending": self.runner.num_pending(),
                "malformed_chunks": self.runner.malformed,
                "replay_size": self.algo.local_replay_buffer.get_num_timesteps(),
                "alpha": float(learner.curr_log_alpha["default_policy"].detach().exp()),
                "listening": self.runner.thread.is_alive(),  # False: the listener died (e.g. the port was taken)
                "clients_accepted": self.runner.accepted, "clients_refused": self.runner.refused,
                "weights_seq_no": self.runner._weights_seq_no, "errors": list(self.errors)}

    def wait_idle(self, timeout_s: float = 60.0) -> bool:
        """Wait until every received transition has been trained on."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.runner.num_pending() == 0 and not self._busy:
                return True
            time.sleep(0.02)
        return False

    def _stop_algo(self) -> None:
        runner = self.algo.env_runner
        self.algo.stop()  # stops the runner (sockets closed, listener woken)
        if runner is not None and runner.thread.is_alive():
            runner.thread.join(timeout=5)  # algo.stop() does not join it

    def stop(self) -> None:
        self._stop.set()
        if self.thread is not None:
            self.thread.join(timeout=60)
        with self.lock:
            self._stop_algo()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


# -- the run's side ---------------------------------------------------------------------------------
class RLlinkPolicyClient:
    """A run's controller connection over RLlink, with :class:`raydp.control.service.PolicyClient`'s
    interface (``decide``, ``end``, ``save_policy``, ``latencies``, ``weights_seen``, ``layout``).

    ``decide(obs, reward)``: ``reward`` is the reward of the previous action (None at the first decision),
    as through the broker. It closes the open (obs, action) into a transition, refreshes the weights
    (GET_STATE, every ``weights_every`` decisions), acts locally (a Gaussian sample from its own torch
    generator: the run's global RNG is not touched) and uploads pending transitions (EPISODES, every
    ``upload_every``). ``latencies`` time the whole call. ``save_policy`` returns None: the policy server
    owns the policy (``service`` is None, so a run does not try to snapshot it)."""

    service = None

    def __init__(self, host: str, port: int, run_id: str, *, secret: bytes | None = None, explore: bool = True,
                 seed: int | None = None, weights_every: int = 1, upload_every: int = 1,
                 connect_timeout_s: float = 30.0):
        from ray.rllib.core.columns import Columns

        self._columns = Columns
        self.run_id, self.explore = run_id, explore
        self.weights_every, self.upload_every = max(1, int(weights_every)), max(1, int(upload_every))
        key = _key(secret if secret is not None else resolve_secret()[0])
        self.sock = self._connect(host, int(port), connect_timeout_s)
        try:
            client_handshake(self.sock, key)  # before anything is decoded: the config is a pickle
            kind, _ = self._rpc(RLlink.PING)
            if kind != RLlink.PONG:
                raise ConnectionError(f"expected PONG, got {kind}")
            kind, body = self._rpc(RLlink.GET_CONFIG)
            if kind != RLlink.SET_CONFIG:
                raise ConnectionError(f"expected SET_CONFIG, got {kind}")
            self.config = pickle.loads(body["config"])  # the server proved the secret
            env_config = self.config.env_config
            self.layout = ObservationLayout(**env_config["layout"])
            self.server_settings = dict(env_config.get("sac") or {})
            self.module = self.config.get_rl_module_spec(inference_only=True).build()
            self.module.eval()
            self.weights_seq = -1
            self._refresh_weights()
        except BaseException:
            self.sock.close()
            raise
        self.generator = torch.Generator().manual_seed(
            int(seed) if seed is not None else zlib.crc32(run_id.encode()))
        self.latencies: list[float] = []
        self.weights_seen: list[int] = []
        self.timings: dict[str, list[float]] = {"weights": [], "act": [], "upload": []}
        self.uploaded = 0
        self._open: tuple[np.ndarray, np.ndarray] | None = None
        self._pending: list[tuple] = []
        self._episode_id = uuid.uuid4().hex
        self._t = 0  # env steps of the current episode already uploaded or pending
        self._decisions = 0
        self._closed = False

    @staticmethod
    def _connect(host: str, port: int, timeout_s: float) -> socket.socket:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=HANDSHAKE_TIMEOUT_S)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return sock
            except (ConnectionRefusedError, socket.timeout) as exc:
                if time.monotonic() > deadline:
                    raise ConnectionError(f"no RLlink policy server at {host}:{port} ({exc.__class__.__name__}; "
                                          "is it running? it serves one run at a time)") from None
                time.sleep(0.25)

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
        from raydp.control.modules import MaskedGaussian, greedy_action

        with torch.no_grad():
            logits = self.module.forward_inference({self._columns.OBS: torch.as_tensor(obs[None])})[
                self._columns.ACTION_DIST_INPUTS]
            if self.explore:  # the broker's MaskedGaussian sample, drawn from this client's generator
                dist = MaskedGaussian.from_logits(logits)
                noise = torch.randn(dist.loc.shape, generator=self.generator, dtype=dist.loc.dtype)
                action = dist.loc + dist._dist.scale * noise
            else:
                action = greedy_action(logits)
        return action[0].numpy().astype(np.float32)

    def _chunk(self) -> SingleAgentEpisode:
        obs = [t[0] for t in self._pending] + [self._pending[-1][3]]
        # no spaces in the chunk: the server has them, and serialising them would double the message's cost
        return SingleAgentEpisode(id_=self._episode_id, observations=obs, actions=[t[1] for t in self._pending],
                                  rewards=[t[2] for t in self._pending], t_started=self._t - len(self._pending),
                                  len_lookback_buffer=0)

    def _upload(self) -> None:
        if not self._pending:
            return
        send_rllink_message(self.sock, {"type": RLlink.EPISODES.name, "episodes": [self._chunk().get_state()]})
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
        if self._decisions > 0 and self._decisions % self.weights_every == 0:
            self._refresh_weights()  # trained on every transition uploaded so far (if training kept up)
        t1 = time.perf_counter()
        action = self._act(obs)
        t2 = time.perf_counter()
        self._open = (obs, action)
        if len(self._pending) >= self.upload_every:
            self._upload()
        t3 = time.perf_counter()
        self._decisions += 1
        self.timings["weights"].append(t1 - t0)
        self.timings["act"].append(t2 - t1)
        self.timings["upload"].append(t3 - t2)
        self.latencies.append(t3 - started)
        self.weights_seen.append(self.weights_seq)
        return action

    def end(self) -> None:
        """Upload what is pending (the open decision has no reward and is dropped, as by the broker), wait
        for the server to have read it (a PING answered in order) and close."""
        if self._closed:
            return
        try:
            self._upload()
            kind, _ = self._rpc(RLlink.PING)
            if kind != RLlink.PONG:
                raise ConnectionError(f"expected PONG, got {kind}")
        finally:
            self.close()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._open = None
            try:
                self.sock.close()
            except OSError:
                pass

    def save_policy(self, path, trained_on: dict, results: dict, provenance: dict | None = None) -> None:
        """None: the policy lives in the policy server, which saves nothing (see the module docstring)."""
        return None


def check_policy_server(address: RLlinkAddress, secret: bytes, timeout_s: float = 10.0) -> None:
    """Before a run starts: the server answers, proves the secret and accepts ours (PING/PONG), else a
    one-line ConfigError. The server re-listens 0.2 s after this probe leaves; the run then connects."""
    key = _key(secret)
    try:
        sock = RLlinkPolicyClient._connect(address.host, address.port, timeout_s)
    except OSError as exc:  # refused, unreachable, unknown host (ConnectionError is an OSError)
        raise ConfigError(f"policy server {address.url}: {str(exc).splitlines()[0][:200]}") from None
    try:
        client_handshake(sock, key)
        send_rllink_message(sock, {"type": RLlink.PING.name})
        kind, _ = get_rllink_message(sock)
        if kind != RLlink.PONG:
            raise ConnectionError(f"expected PONG, got {kind}")
    except (ConnectionError, OSError) as exc:
        raise ConfigError(f"policy server {address.url}: {str(exc).splitlines()[0][:200]}") from None
    finally:
        sock.close()


def client_from_rllink_connection(connection: dict, run_id: str) -> RLlinkPolicyClient:
    """The run actor's client from what the launcher passed (see :func:`rllink_connection`)."""
    return RLlinkPolicyClient(connection["host"], connection["port"], run_id, secret=connection.get("secret"),
                              explore=connection.get("explore", True))


def rllink_connection(address: RLlinkAddress, secret: bytes) -> dict:
    """What a run actor needs to reach the policy server (the secret travels inside Ray, which already
    runs arbitrary code in that actor; it prints as ``Secret(<hidden>)``)."""
    return {"kind": "rllink", "host": address.host, "port": address.port, "secret": Secret(secret),
            "explore": True}
