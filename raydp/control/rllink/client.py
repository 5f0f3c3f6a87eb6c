"""The run's side of the RLlink transport: :class:`RLlinkPolicyClient` (a run's controller connection, with
:class:`raydp.control.service.PolicyClient`'s interface), :func:`check_policy_server` (the probe before a run
starts), and the transport's pieces for :mod:`raydp.control.transports` (:func:`rllink_connection`,
:func:`rllink_client`, :class:`RLlinkLaunch`). The protocol and its semantics: :mod:`raydp.control.rllink`.
"""

from __future__ import annotations

import pickle
import socket
import time
import uuid
from pathlib import Path

import numpy as np
import torch
from ray.rllib.core import COMPONENT_RL_MODULE
from ray.rllib.env.external import RLlink, get_rllink_message, send_rllink_message
from ray.rllib.env.single_agent_episode import SingleAgentEpisode
from ray.rllib.utils.metrics import WEIGHTS_SEQ_NO

from raydp.control.address import RLlinkAddress, Secret, parse_rllink, require_loopback
from raydp.control.broker import exploration_generator, run_seed
from raydp.control.features import ObservationLayout
from raydp.control.rllink.auth import HANDSHAKE_TIMEOUT_S, _key, client_handshake, handshake_address, resolve_secret
from raydp.control.rllink.checks import check_served_policy, run_declaration
from raydp.control.rllink.wire import use_numpy_msgpack
from raydp.control.store import provenance_entry
from raydp.errors import ConfigError


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
        use_numpy_msgpack()  # before the first RLlink message
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



def check_policy_server(address: RLlinkAddress, secret: bytes, expect: dict | None = None,
                        timeout_s: float = 10.0) -> None:
    """Before a run starts: the server is IPv4 loopback, answers, proves the secret and accepts ours
    (PING/PONG), and its policy may drive the run (``expect``, :func:`check_served_policy`), else a one-line
    ConfigError. The run's own connection then waits in the server's backlog until this probe has left."""
    host = require_loopback(address.host, "connect to")
    url = RLlinkAddress(host, address.port).url
    key = _key(secret)
    use_numpy_msgpack()  # before the first RLlink message
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



# -- the rllink transport (raydp.control.transports) --------------------------------------------------

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
