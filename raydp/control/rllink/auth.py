"""The RLlink transport's authentication: the shared secret and the mutual HMAC-SHA256 handshake run on the raw
socket before a single RLlink byte is decoded (the protocol and what it does not protect against:
:mod:`raydp.control.rllink`)."""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import stat
import sys
from pathlib import Path

from raydp.control.address import Secret
from raydp.errors import ConfigError

SECRET_ENV = "RAYDP_RLLINK_SECRET"
MIN_SECRET_BYTES = 16
MAGIC = b"RAYDP-RLLINK-2"  # v2: the MACs cover the address
NONCE_BYTES = 32
MAC_BYTES = 32
HANDSHAKE_TIMEOUT_S = 5.0


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

