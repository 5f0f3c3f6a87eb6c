"""Other projects' private APIs that raydp relies on, against what the code was written for. pyproject.toml pins
Ray and dp_accounting to the minor versions these were checked on; a new version is adopted when these pass.

* Ray: the private methods of ``EnvRunnerServerForExternalInference`` that raydp's RLlink server overrides, with
  the signatures recorded beside the override (:data:`raydp.control.rllink.server.RAY_OVERRIDES`), the calls by
  which Ray's listener reaches them, the attributes of Ray's it uses, and the module global of RLlink's wire
  functions that :func:`raydp.control.rllink.wire.use_numpy_msgpack` sets.
* dp_accounting: the private helpers of ``rdp_privacy_accountant`` that :mod:`raydp.privacy.accounting.selection`
  calls, with the signatures it was written for (recorded here: :data:`DP_ACCOUNTING_PRIVATE`).

Fast: imports only, no Ray started.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

SELECTION = Path(__file__).resolve().parents[1] / "raydp" / "privacy" / "accounting" / "selection.py"

#: dp_accounting 0.6.0's private helpers (dp_accounting/rdp/rdp_privacy_accountant.py) that selection.py calls,
#: with the signatures (``str(inspect.signature(...))``) its calls were written for
DP_ACCOUNTING_PRIVATE: dict[str, str] = {
    "_compute_rdp_repeat_and_select": "(orders: Sequence[float], rdp: Sequence[float], mean: float, shape: float) "
                                      "-> Sequence[float]",
    "_gamma_truncated_negative_binomial": "(shape: float, mean: float, tolerance: float = 1e-09) -> float",
}


def signature_drift(owner, recorded: dict[str, str]) -> list[str]:
    """One line per recorded name that ``owner`` (a class or module) no longer has, or whose signature differs."""
    out = []
    for name, expected in sorted(recorded.items()):
        found = getattr(owner, name, None)
        if found is None:
            out.append(f"{owner.__name__}.{name}: gone (written for {name}{expected})")
            continue
        actual = str(inspect.signature(found))
        if actual != expected:
            out.append(f"{owner.__name__}.{name}: now {name}{actual}, written for {name}{expected}")
    return out


def _unannotated(signature: inspect.Signature) -> inspect.Signature:
    return signature.replace(parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()],
                             return_annotation=inspect.Signature.empty)


def _ray_server():
    from ray.rllib.env.external.env_runner_server_for_external_inference import EnvRunnerServerForExternalInference

    return EnvRunnerServerForExternalInference


def test_rays_overridden_private_methods_keep_the_signatures_the_overrides_were_written_for():
    from raydp.control.rllink.server import RAY_OVERRIDES, AuthenticatedRLlinkServer

    ray_class = _ray_server()
    assert not signature_drift(ray_class, RAY_OVERRIDES), "\n".join(signature_drift(ray_class, RAY_OVERRIDES))
    # the record is the overrides' own: each is overridden, with Ray's parameters
    for name in RAY_OVERRIDES:
        assert name in vars(AuthenticatedRLlinkServer), name
        mine, ray = (inspect.signature(getattr(cls, name)) for cls in (AuthenticatedRLlinkServer, ray_class))
        assert _unannotated(mine) == _unannotated(ray), name  # the same parameters (raydp's annotations are strings)
    # and it covers every private method of Ray's that the server overrides
    overridden = {name for name, value in vars(AuthenticatedRLlinkServer).items() if inspect.isfunction(value)
                  and name.startswith("_") and not name.startswith("__") and hasattr(ray_class, name)}
    assert overridden == set(RAY_OVERRIDES)


def test_rays_listener_still_calls_the_overrides_and_sets_the_attributes_the_server_uses():
    """An override Ray's listener no longer calls would silently leave its part out: the handshake, above all."""
    from raydp.control.rllink.server import RAY_ATTRIBUTES, RAY_LISTENER_CALLS

    ray_class = _ray_server()
    listener = inspect.getsource(ray_class._client_message_listener)
    assert [call for call in RAY_LISTENER_CALLS if call not in listener] == []
    init = inspect.getsource(ray_class.__init__)
    assert "target=self._client_message_listener" in init  # the listener thread Ray starts runs that method
    assert [name for name in RAY_ATTRIBUTES if f"self.{name} =" not in init and f"self.{name}:" not in init] == []


def test_rllinks_wire_functions_still_read_the_module_global_raydp_sets():
    import ray.rllib.env.external.rllink as wire

    from raydp.control.rllink.wire import RAY_WIRE_GLOBAL

    assert hasattr(wire, RAY_WIRE_GLOBAL)
    for function in (wire.send_rllink_message, wire.get_rllink_message):
        assert RAY_WIRE_GLOBAL in function.__code__.co_names, function.__name__  # a global it reads (and fills)


def test_dp_accountings_private_helpers_keep_the_signatures_selection_was_written_for():
    from dp_accounting.rdp import rdp_privacy_accountant

    drift = signature_drift(rdp_privacy_accountant, DP_ACCOUNTING_PRIVATE)
    assert not drift, "\n".join(drift)


def test_the_record_names_every_private_dp_accounting_helper_selection_uses():
    """selection.py reaches them as ``_rdp_accountant._name``: a new one needs its signature recorded above."""
    tree = ast.parse(SELECTION.read_text())
    aliases = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
               and (node.module or "").startswith("dp_accounting") for a in node.names}
    used = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name) and node.value.id in aliases and node.attr.startswith("_")}
    assert used == set(DP_ACCOUNTING_PRIVATE)


@pytest.mark.parametrize("change", ["renamed", "parameter", "default"])
def test_the_check_fails_when_a_signature_differs_from_the_record(change):
    from raydp.control.rllink.server import RAY_OVERRIDES

    recorded = dict(RAY_OVERRIDES)
    if change == "renamed":
        recorded["_recycle_socket"] = recorded.pop("_recycle_sockets")
    elif change == "parameter":
        recorded["_process_episodes_message"] = "(self, msg_type, msg_body, extra)"
    else:
        recorded["_recycle_sockets"] = "(self, sleep: float = 5.0)"
    drift = signature_drift(_ray_server(), recorded)
    assert len(drift) == 1 and ("gone" if change == "renamed" else "now") in drift[0]
    from dp_accounting.rdp import rdp_privacy_accountant

    altered = {**DP_ACCOUNTING_PRIVATE, "_gamma_truncated_negative_binomial": "(shape: float, mean: float) -> float"}
    assert len(signature_drift(rdp_privacy_accountant, altered)) == 1


def test_tunes_progress_reporter_setup_keeps_the_signature_and_the_start_time_patch_holds():
    """raydp.study.progress.keep_reporters_start_time patches Tune's ProgressReporter.setup (a second reporter beside
    TrialLines is set up without a start time and raised on a trial's failure): the method it wraps must still take
    start_time, and after the patch a setup without one keeps the reporter's own start, so a failure's line prints."""
    import inspect

    from ray.tune.experimental.output import AirVerbosity, ProgressReporter, TuneTerminalReporter

    from raydp.study.progress import TrialLines, keep_reporters_start_time

    TrialLines(lines=False)  # applies the patch
    keep_reporters_start_time()  # idempotent
    assert getattr(ProgressReporter.setup, "_raydp_keeps_start_time", False)
    assert "start_time" in inspect.signature(inspect.unwrap(TuneTerminalReporter.setup)).parameters
    tunes_own = TuneTerminalReporter(AirVerbosity.SILENT)
    tunes_own.setup(total_num_samples=1)  # what Tune's CallbackList.setup does to every callback
    assert isinstance(tunes_own._start_time, float)
