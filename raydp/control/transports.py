"""The registered controller transports: how a run whose dials a live policy sets reaches that policy.

A transport is one module holding its address parser, its client factory and its launcher, plus one line in
:data:`TRANSPORTS`. This module stays free of Ray and torch imports (the config validates ``controller`` with
it before anything starts); a spec names its parser, client and launcher as ``"module:attribute"``, loaded when
used (the parser's module must be as light as this one).

- ``broker`` (the default): the launcher starts a policy service for the run (:mod:`raydp.control.service`);
  the run owns its policy (``settings.policy``, ``frozen``, ``save_policy`` apply).
- ``rllink://HOST:PORT``: a policy server reached over RLlib's RLlink protocol (:mod:`raydp.control.rllink`);
  the server owns the policy (``external``), so a run's ``settings.policy`` and friends do not apply.

A launcher is built from the run's config before Ray starts (its checks fail with one line then),
``start()`` returns the connection dict the run actor builds its client from (``connection["kind"]`` is the
transport's ``kind``), ``finish(summary, output)`` adds the transport's record to the run's summary, and
``close()`` releases what ``start`` made.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from raydp.control.address import BROKER


@dataclass(frozen=True)
class TransportSpec:
    kind: str
    #: what a ``controller`` value naming this transport looks like: the bare kind (``"broker"``), or an address
    #: with a scheme (``"rllink://HOST:PORT"``: a value names it when it starts with ``rllink://``)
    form: str
    #: ``"module:function"``: function(connection, run_id) -> the run's policy client
    client: str
    #: ``"module:Class"``: Class(config, overwrite_policy=False), see the module docstring
    launcher: str
    #: ``"module:function"``: function(value) -> the value's address, ValueError (one line) for a bad one; its
    #: module must import no Ray or torch (the config validates with it); None: the bare kind takes no address
    parser: str | None = None
    #: the policy lives outside the run (a server): the run's own policy settings do not apply
    external: bool = False

    def matches(self, value) -> bool:
        """Whether a ``controller`` value names this transport."""
        if not isinstance(value, str):
            return False
        scheme, sep, _ = self.form.partition("://")
        return value.startswith(scheme + sep) if sep else value == self.form

    def parse(self, value: str):
        """The value's address (ValueError, one line, for a bad one); None for a transport without one."""
        return None if self.parser is None else _load(self.parser)(value)

    def connect(self, connection: dict, run_id: str):
        """The run's policy client for ``connection`` (this transport's ``client``)."""
        return _load(self.client)(connection, run_id)

    def launch(self, config, overwrite_policy: bool = False):
        """This transport's launcher for ``config``: its checks run now, before Ray starts."""
        return _load(self.launcher)(config, overwrite_policy=overwrite_policy)


def _load(target: str):
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


TRANSPORTS: tuple[TransportSpec, ...] = (
    TransportSpec(BROKER, BROKER, "raydp.control.service:broker_client", "raydp.control.service:BrokerLaunch"),
    TransportSpec("rllink", "rllink://HOST:PORT", "raydp.control.rllink:rllink_client",
                  "raydp.control.rllink:RLlinkLaunch", parser="raydp.control.address:parse_rllink", external=True),
)


def expected_forms() -> str:
    """The registered transports' value forms, for an error message: ``'broker' or 'rllink://HOST:PORT'``."""
    forms = [f"'{spec.form}'" for spec in TRANSPORTS]
    return forms[0] if len(forms) == 1 else ", ".join(forms[:-1]) + " or " + forms[-1]


def transport_for(value: str) -> TransportSpec:
    """The transport a ``controller`` value names (ValueError, one line, for none)."""
    for spec in TRANSPORTS:
        if spec.matches(value):
            return spec
    raise ValueError(f"expected {expected_forms()}, got {value!r}")


def transport_of_connection(connection: dict) -> TransportSpec:
    """The transport of a connection dict (``kind``; a dict without it is a broker's, made before the key)."""
    kind = connection.get("kind", BROKER)
    for spec in TRANSPORTS:
        if spec.kind == kind:
            return spec
    raise ValueError(f"unknown policy connection kind {kind!r} (expected one of "
                     f"{', '.join(s.kind for s in TRANSPORTS)})")


def parse_controller(value: str):
    """The address of the transport ``value`` names (None for the broker); ValueError (one line) for a bad value."""
    return transport_for(value).parse(value)
