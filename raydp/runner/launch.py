"""``raydp train``: a run in-process, or (RLDP) a Ray actor driven by a live RLlib SAC policy.

For an RLDP run this starts (or joins) Ray, starts the policy (broker, and the SAC service unless the
policy is frozen), runs the fine-tuning as a :class:`~raydp.runner.actor.FineTuningRun` actor, saves
the policy under ``policy_dir/NAME`` if asked, and shuts the policy down. With ``controller:
rllink://HOST:PORT`` (an IPv4 loopback host: a remote server is reached through an SSH tunnel) the policy is a
running policy server (:mod:`raydp.runner.policy_server`) and the same run actor reaches it over RLlink
(:mod:`raydp.control.rllink`): nothing is started on the policy's side, and the run's provenance entry goes
to the server, which saves the policy if it was started with ``--save``.

Either way the run's client explores from the run's public ``seed`` (with the policy's SAC seed) and
waits, at every decision, for the policy to have trained on all of the run's earlier transitions: its
decisions are deterministic given its releases and public seeds (:mod:`raydp.control.broker`), never
dependent on timing, which depends on the private batch sizes.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

from raydp.config import TrainConfig
from raydp.control.policies import check_policy_privacy, policy_layout_for, sac_settings
from raydp.errors import ConfigError

RAY_NAMESPACE = "raydp"


def ensure_ray(num_cpus: int | None = None) -> None:
    """Join the Ray cluster in RAY_ADDRESS (e.g. under ``ray job submit``) or start a local one.

    Ray's own processes (GCS, raylets, workers) listen on every interface of the host, whatever the node address.
    What protects them is Ray's token authentication, on by default for a local cluster since Ray 2.60 (the
    pinned minimum; ``RAY_AUTH_MODE=disabled`` turns it off: don't): a process without the token (kept in
    ``~/.ray/auth_token``) can neither connect nor submit work (tests/test_ray_auth.py). A remote cluster must
    enable it on every node (docs/privacy.md, "Ray's ports"); a cluster without it is refused (one-line ConfigError).

    A local cluster also runs without Ray's metrics collection: the dashboard agent would otherwise serve every
    process's memory and CPU over time, without the token, on every interface, and those follow the private
    Poisson batch sizes (issue 26). (Ray's autoscaler and dashboard still serve their own metrics, node launch
    times and dashboard request durations, on two ports: no run data.)"""
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if os.environ.get("RAY_ADDRESS"):
        ray.init(namespace=RAY_NAMESPACE, log_to_driver=True)
    else:
        ray.init(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, namespace=RAY_NAMESPACE,
                 log_to_driver=True, _system_config={"enable_metrics_collection": False})
    try:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled
    except ImportError:  # a Ray without token authentication (below the pinned minimum)
        is_token_auth_enabled = None
    if is_token_auth_enabled is not None and not is_token_auth_enabled():
        ray.shutdown()
        raise ConfigError("Ray's token authentication is off (RAY_AUTH_MODE=disabled, or a cluster started without "
                          "it): anyone who reaches its ports could run code beside the private data; set "
                          "RAY_AUTH_MODE=token on every node")


def start_policy(config: TrainConfig, restore: Path | None = None):
    """A :class:`~raydp.control.service.PolicySession` for the config's RLDP settings (``restore``: a
    policy snapshot to continue from, e.g. a trial's checkpoint, instead of ``rldp.policy``). A
    paper-mode policy refuses to drive a strict run
    (:func:`raydp.control.policies.check_policy_privacy`, ERRATA E14)."""
    from raydp.control.service import PolicySession

    if config.controller != "broker":  # e.g. a study trial: only `raydp train` reaches a policy server
        raise ConfigError(f"controller {config.controller!r} is for `raydp train`; this starts its own policy "
                          "(controller: broker)")
    s = config.rldp
    restore = check_policy_privacy(config, restore)
    layout = None if restore is not None else policy_layout_for(config)
    return PolicySession(layout, sac_settings(config), restore=restore, frozen=s.frozen, namespace=RAY_NAMESPACE)


def _rewrite_json(path: Path, payload: dict) -> None:
    """Replace a JSON file atomically (the run's summary gains the policy service's counters)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(payload, indent=2))
    tmp.replace(path)


def train(config: TrainConfig, output: str | Path, overwrite: bool = False, progress: bool = True,
          overwrite_policy: bool = False) -> dict:
    """Run one fine-tuning; an RLDP run becomes a Ray actor controlled by a live policy."""
    if not config.is_controlled:
        from raydp.runner.run import run_training

        return run_training(config, output, overwrite=overwrite, progress=progress)
    if config.controller != "broker":
        return _train_over_rllink(config, output, overwrite=overwrite, progress=progress)
    from raydp.control.store import copy_policy
    from raydp.model.loading import check_model_name

    check_model_name(config.model)
    check_policy_privacy(config)  # before Ray starts: a paper-mode policy may not drive a strict run (E14)
    s = config.rldp
    named = Path(s.policy_dir).expanduser() / s.save_policy if s.save_policy else None
    if named is not None and named.exists() and not overwrite_policy:
        raise ConfigError(f"policy {named} already exists (pass --overwrite-policy to replace it)")
    ensure_ray()
    session = start_policy(config)
    try:
        summary = _run_actor(config, output, overwrite, session.connection(seed=config.seed), progress)
        summary["policy_service"] = session.counters()
        if named is not None:
            copy_policy(Path(output) / "policy", named, overwrite=overwrite_policy)
            summary["saved_policy"] = str(named)
        _rewrite_json(Path(output) / "summary.json", summary)
        return summary
    finally:
        session.close()


def _run_actor(config: TrainConfig, output: str | Path, overwrite: bool, connection: dict, progress: bool) -> dict:
    """The run as a :class:`~raydp.runner.actor.FineTuningRun` actor (either transport) with its client
    built from ``connection``; returns its summary."""
    import ray

    from raydp.runner.actor import FineTuningRun

    threads = config.cpus or os.cpu_count() or 1
    run = FineTuningRun.options(num_cpus=min(threads, int(ray.available_resources().get("CPU", 1)) or 1)).remote(
        threads)
    return ray.get(run.run.remote(config.model_dump(mode="json"), str(Path(output).resolve()), overwrite,
                                  connection, f"run-{uuid.uuid4().hex[:8]}", progress))


def _train_over_rllink(config: TrainConfig, output: str | Path, overwrite: bool = False,
                       progress: bool = True) -> dict:
    """An RLDP run driven by the policy server at ``config.controller`` (see the module docstring). The
    secret is resolved here, before Ray starts (:func:`raydp.control.rllink.resolve_secret`), and handed to
    the run actor; the server must be loopback, answer, and serve a policy of the run's privacy mode and
    clip decoding (one-line ConfigErrors, before Ray starts)."""
    from raydp.control.address import parse_controller
    from raydp.control.rllink import check_policy_server, resolve_secret, rllink_connection
    from raydp.model.loading import check_model_name

    address = parse_controller(config.controller)
    check_model_name(config.model)
    secret, _ = resolve_secret()
    expect = {"privacy_mode": config.rldp.privacy_mode, "action_decoding": config.rldp.action_decoding}
    check_policy_server(address, secret, expect)  # a one-line error now rather than a failed run actor later
    ensure_ray()
    summary = _run_actor(config, output, overwrite, rllink_connection(address, secret, expect, seed=config.seed),
                         progress)
    summary["controller_transport"] = {"kind": "rllink", "address": address.url}
    _rewrite_json(Path(output) / "summary.json", summary)
    return summary
