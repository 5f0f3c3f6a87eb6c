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

Modules: :mod:`~raydp.control.rllink.auth` (the shared secret and the handshake),
:mod:`~raydp.control.rllink.wire` (the msgpack RLlink's wire functions use, installed by the server and
the client when they start: :func:`~raydp.control.rllink.wire.use_numpy_msgpack`),
:mod:`~raydp.control.rllink.checks` (a run's declaration against the served policy),
:mod:`~raydp.control.rllink.server` (the RLlib side: :class:`AuthenticatedRLlinkServer`, which overrides
private methods of Ray's ``EnvRunnerServerForExternalInference`` whose signatures it records beside it,
and :class:`RLlinkPolicyServer`) and :mod:`~raydp.control.rllink.client` (the run's side:
:class:`RLlinkPolicyClient`, the probe before a run starts and the transport's launcher).
"""

from raydp.control.rllink.auth import (
    HANDSHAKE_TIMEOUT_S,
    MAC_BYTES,
    MAGIC,
    MIN_SECRET_BYTES,
    NONCE_BYTES,
    SECRET_ENV,
    _key,  # noqa: F401 - the handshake's key derivation, for tests
    client_handshake,
    handshake_address,
    resolve_secret,
    server_handshake,
)
from raydp.control.rllink.checks import check_run_declaration, check_served_policy, run_declaration, served_policy
from raydp.control.rllink.client import (
    RLlinkLaunch,
    RLlinkPolicyClient,
    check_policy_server,
    rllink_client,
    rllink_connection,
)
from raydp.control.rllink.server import BACKLOG, AuthenticatedRLlinkServer, RLlinkPolicyServer
from raydp.control.rllink.wire import NumpyMsgpack, use_numpy_msgpack

__all__ = [
    "BACKLOG", "HANDSHAKE_TIMEOUT_S", "MAC_BYTES", "MAGIC", "MIN_SECRET_BYTES", "NONCE_BYTES", "SECRET_ENV",
    "AuthenticatedRLlinkServer", "NumpyMsgpack", "RLlinkLaunch", "RLlinkPolicyClient", "RLlinkPolicyServer",
    "check_policy_server", "check_run_declaration", "check_served_policy", "client_handshake", "handshake_address",
    "resolve_secret", "rllink_client", "rllink_connection", "run_declaration", "server_handshake", "served_policy",
    "use_numpy_msgpack",
]
