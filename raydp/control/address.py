"""Where an RLDP run's controller is: the broker (default) or a policy server over RLlink.

Kept free of Ray imports so that configuration validation (:mod:`raydp.config`) can parse the address
before anything starts. ``rllink://HOST:PORT`` names a policy server (:mod:`raydp.control.rllink`);
``rllink://:PORT`` is the loopback interface. A non-loopback host is accepted only when written out, and
:func:`plaintext_warning` says why it deserves a warning: RLlink traffic (observations, actions, policy
weights, the pickled algorithm config) is not encrypted; the shared-secret handshake authenticates
the opening of each connection, not each message.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit

BROKER = "broker"
SCHEME = "rllink"
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class RLlinkAddress:
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"{SCHEME}://{self.host}:{self.port}"

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost: treated as remote
        return False


def parse_controller(value: str) -> RLlinkAddress | None:
    """None for the broker, else the policy server's address; ValueError (one line) for a bad URL."""
    if value == BROKER:
        return None
    if not isinstance(value, str) or not value.startswith(f"{SCHEME}://"):
        raise ValueError(f"expected 'broker' or 'rllink://HOST:PORT', got {value!r}")
    parts = urlsplit(value)
    if parts.username is not None or parts.password is not None:
        raise ValueError("do not put a secret in the controller URL; set RAYDP_RLLINK_SECRET instead")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"expected 'rllink://HOST:PORT' with nothing after the port, got {value!r}")
    try:
        port = parts.port
    except ValueError:
        port = None
    if port is None or not 0 < port < 65536:
        raise ValueError(f"expected 'rllink://HOST:PORT' with a port in 1..65535, got {value!r}")
    host = parts.hostname or LOOPBACK
    if ":" in host:
        raise ValueError("IPv6 addresses are not supported by the RLlink server (IPv4 or a host name)")
    return RLlinkAddress(host, port)


def plaintext_warning(host: str) -> str:
    return (f"warning: RLlink traffic to {host} is plaintext (observations, actions, weights and the pickled "
            "algorithm config); the secret authenticates each connection's opening only. Prefer loopback, "
            "e.g. through an SSH tunnel")


class Secret(bytes):
    """A shared secret that does not print itself (it travels in a run's connection dict)."""

    def __repr__(self) -> str:
        return "Secret(<hidden>)"

    __str__ = __repr__

    def __reduce__(self):
        return (Secret, (bytes(self),))
