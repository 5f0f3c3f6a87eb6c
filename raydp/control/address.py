"""Where an RLDP run's controller is: the broker (default) or a policy server over RLlink.

Kept free of Ray imports so that configuration validation (:mod:`raydp.config`) can parse the address
before anything starts. ``rllink://HOST:PORT`` names a policy server (:mod:`raydp.control.rllink`);
``rllink://:PORT`` is 127.0.0.1. Only IPv4 loopback hosts (127.0.0.0/8, and ``localhost``, which is
always the literal 127.0.0.1) are accepted, by the config, the run and the server alike
(:func:`require_loopback`): RLlink traffic (observations, actions, policy weights, the pickled algorithm
config) is not encrypted and its messages carry no MAC (the shared-secret handshake authenticates the
opening of each connection only), so an on-path attacker between two machines could read the weights and
inject pickled messages, i.e. run code. Across machines, an SSH tunnel makes both ends loopback
(:data:`TUNNEL_HINT`).

IPv6 is refused, ``::1`` included, and ``localhost`` is never resolved (:func:`loopback_host`): the server
binds one IPv4 address, and a client that reached the same port on another address (``localhost`` may
resolve to ``::1`` first, e.g. Debian's /etc/hosts) would talk to whoever holds that socket, and a relay
there passes the handshake through and then owns the plaintext session.
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit

from raydp.errors import ConfigError

BROKER = "broker"
SCHEME = "rllink"
LOOPBACK = "127.0.0.1"
TUNNEL_HINT = "use an SSH tunnel so that both ends are loopback, e.g. `ssh -L 5555:127.0.0.1:5555 server`"


@dataclass(frozen=True)
class RLlinkAddress:
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"{SCHEME}://{self.host}:{self.port}"


def loopback_host(host: str) -> str | None:
    """The IPv4 loopback literal to bind or connect to for ``host`` (``localhost``, any case, is 127.0.0.1,
    never looked up), or None when ``host`` is not IPv4 loopback (IPv6 ``::1`` included; a host name other
    than localhost is treated as remote)."""
    if not isinstance(host, str):
        return None
    if host.lower() == "localhost":
        return LOOPBACK
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    return str(address) if address.version == 4 and address.is_loopback else None


def is_loopback(host: str) -> bool:
    """True for an IPv4 loopback host (127.0.0.0/8 or ``localhost``); False for IPv6 (``::1`` too)."""
    return loopback_host(host) is not None


def parse_rllink(value: str) -> RLlinkAddress:
    """The policy server's address in ``rllink://HOST:PORT``; ValueError (one line) for a bad URL."""
    if not isinstance(value, str) or not value.startswith(f"{SCHEME}://"):
        raise ValueError(f"expected 'rllink://HOST:PORT', got {value!r}")
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
    loopback = loopback_host(host)
    if loopback is None:  # a ValueError: the config names the field
        raise ValueError(loopback_refusal(host, "connect to"))
    return RLlinkAddress(loopback, port)


def loopback_refusal(host: str, verb: str) -> str:
    """The one-line refusal of a non-loopback RLlink host (see the module docstring)."""
    return (f"RLlink will not {verb} {host}: only IPv4 loopback hosts (127.0.0.1, localhost) are allowed, because "
            f"RLlink messages are plaintext and unauthenticated after the handshake; {TUNNEL_HINT}")


def require_loopback(host: str, verb: str = "connect to") -> str:
    """The IPv4 loopback literal for ``host`` (:func:`loopback_host`: what is bound or connected to, never a
    name); ConfigError (one line, with the SSH tunnel to use instead) unless ``host`` is IPv4 loopback."""
    loopback = loopback_host(host)
    if loopback is None:
        raise ConfigError(loopback_refusal(host, verb))
    return loopback


class Secret(bytes):
    """A shared secret that does not print itself (it travels in a run's connection dict)."""

    def __repr__(self) -> str:
        return "Secret(<hidden>)"

    __str__ = __repr__

    def __reduce__(self):
        return (Secret, (bytes(self),))
