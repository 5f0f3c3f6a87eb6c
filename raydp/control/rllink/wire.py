"""The msgpack RLlib's RLlink wire functions use: numpy arrays, without patching msgpack process-wide.

RLlib's ``send_rllink_message`` / ``get_rllink_message`` read their msgpack from a module global of
``ray.rllib.env.external.rllink`` (``msgpack``, None until their first call fills it with ``try_import_msgpack``).
That helper calls ``msgpack_numpy.patch()``, which replaces ``msgpack.packb``/``unpackb`` for the whole process, and
Ray's own task-argument serialization then encodes a numpy array inside a dict as msgpack_numpy's dict, which an
unpatched worker decodes as a dict (measured: ``ray.get(f.remote({"a": np.arange(3.)}))`` sees a dict after the
patch). Every process that speaks RLlink (a run's actor, the policy server) also makes Ray calls, so
:func:`use_numpy_msgpack` gives the wire functions :class:`NumpyMsgpack` instead, before their first call, and
msgpack stays unpatched. It is called where RLlink is spoken (the server's EnvRunner, the run's client, the probe
before a run starts), never when a module is imported: importing raydp changes nothing in Ray. The global is
Ray's private detail: :data:`RAY_WIRE_GLOBAL` names it, and ``tests/test_private_apis.py`` checks that Ray's
module still has it and that the wire functions still read it.
"""

from __future__ import annotations

import functools

import msgpack
import msgpack_numpy
import ray.rllib.env.external.rllink as _rllib_rllink

#: the module global of ``ray.rllib.env.external.rllink`` its wire functions take their msgpack from (Ray 2.60)
RAY_WIRE_GLOBAL = "msgpack"


class NumpyMsgpack:
    """msgpack with numpy arrays (msgpack_numpy's encode/decode hooks), as an object with ``packb``/``unpackb``."""

    packb = staticmethod(functools.partial(msgpack.packb, default=msgpack_numpy.encode))
    unpackb = staticmethod(functools.partial(msgpack.unpackb, object_hook=msgpack_numpy.decode))


def use_numpy_msgpack() -> None:
    """Make RLlink's wire functions use :class:`NumpyMsgpack` (idempotent). Call it before this process sends or
    receives its first RLlink message; a RuntimeError if Ray's module no longer has the global (a Ray other than
    the one pinned in pyproject.toml)."""
    if not hasattr(_rllib_rllink, RAY_WIRE_GLOBAL):
        raise RuntimeError(f"ray.rllib.env.external.rllink has no {RAY_WIRE_GLOBAL!r} global: RLlink's wire "
                           "functions changed in this Ray, which raydp was not checked on (see pyproject.toml)")
    if getattr(_rllib_rllink, RAY_WIRE_GLOBAL) is not NumpyMsgpack:
        setattr(_rllib_rllink, RAY_WIRE_GLOBAL, NumpyMsgpack)
