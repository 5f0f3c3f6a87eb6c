"""A run's policy client from the connection dict its launcher passed: one factory for every registered transport
(:mod:`raydp.control.transports`).

``connection["kind"]`` says which: ``"broker"`` (:meth:`raydp.control.service.PolicySession.connection`:
a :class:`raydp.control.service.PolicyClient` on the named broker actor) or ``"rllink"``
(:func:`raydp.control.rllink.rllink_connection`: a :class:`raydp.control.rllink.RLlinkPolicyClient`
on a policy server). A dict without ``kind`` is a broker's (connections made before the key existed).
Both clients have the same interface (``layout``, ``decide``, ``end``, ``save_policy``, ``latencies``,
``weights_seen``, ``service``); the RLlink one also holds a socket, released by ``close()``. Both decide
deterministically given the run's releases and public seeds: a decision waits until the policy has trained
on every transition the run reported before it, and explores with the run's own generator, seeded from the
policy's SAC seed and ``connection["seed"]`` (the run's public config seed, when the launcher passes it;
else a hash of ``run_id``: :func:`raydp.control.broker.run_seed`).
"""

from __future__ import annotations

from raydp.control.transports import TRANSPORTS, transport_of_connection

KINDS = tuple(spec.kind for spec in TRANSPORTS)


def client_from_connection(connection: dict, run_id: str):
    """The policy client of run ``run_id`` for ``connection`` (ValueError for an unknown kind)."""
    return transport_of_connection(connection).connect(connection, run_id)
