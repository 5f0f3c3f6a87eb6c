"""Where an RLDP run's controller is: the broker (default) or a policy server over RLlink.

Kept free of Ray imports so that configuration validation (:mod:`raydp.config`) can parse the address
before anything starts. ``rllink://HOST:PORT`` names a policy server (:mod:`raydp.control.rllink`);
``rllink://:PORT`` is the loopback interface. Only loopback hosts (``localhost``, 127.0.0.0/8)
are accepted, by the config, the run and the server alike (:func:`require_loopback`): RLlink traffic
(observations, actions, policy weights, the pickled algorithm config) is not encrypted and its messages
carry no MAC (the shared-secret handshake authenticates the opening of each connection only), so an
on-path attacker between two machines could read the weights and inject pickled messages, i.e. run code.
Across machines, an SSH tunnel makes both ends loopback (:data:`TUNNEL_HINT`).
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
    if not is_loopback(host):  # a ValueError: the config names the field
        raise ValueError(loopback_refusal(host, "connect to"))
    return RLlinkAddress(host, port)


def loopback_refusal(host: str, verb: str) -> str:
    """The one-line refusal of a non-loopback RLlink host (see the module docstring)."""
    return (f"RLlink will not {verb} {host}: only loopback hosts (127.0.0.1, localhost) are allowed, because "
            f"RLlink messages are plaintext and unauthenticated after the handshake; {TUNNEL_HINT}")


def require_loopback(host: str, verb: str = "connect to") -> None:
    """ConfigError (one line, with the SSH tunnel to use instead) unless ``host`` is loopback."""
    if not is_loopback(host):
        raise ConfigError(loopback_refusal(host, verb))


class Secret(bytes):
    """A shared secret that does not print itself (it travels in a run's connection dict)."""

    def __repr__(self) -> str:
        return "Secret(<hidden>)"

    __str__ = __repr__

    def __reduce__(self):
        return (Secret, (bytes(self),))
