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
from raydp.control.service import start_policy_session
from raydp.control.transports import transport_for
from raydp.errors import ConfigError
from raydp.model.loading import check_model_name

RAY_NAMESPACE = "raydp"


def ensure_ray(num_cpus: int | None = None) -> None:
    """Join the Ray cluster in RAY_ADDRESS (e.g. under ``ray job submit``) or start a local one.

    Ray's own processes (GCS, raylets, workers) listen on every interface of the host, whatever the node address.
    What protects them is Ray's token authentication, on by default for a local cluster since Ray 2.60 (the
    pinned minimum; ``RAY_AUTH_MODE=disabled`` turns it off: don't): a process without the token (kept in
    ``~/.ray/auth_token``) can neither connect nor submit work (tests/test_ray_auth.py). A local cluster is refused
    before it starts where ``RAY_AUTH_MODE`` turns the token off, and a process that joins a cluster (RAY_ADDRESS)
    without token mode is refused once joined (one-line ConfigError). A remote cluster must enable it on every node
    (docs/privacy.md, "Ray's ports"): whether it does cannot be seen from a client, which this does not check.

    A local cluster also runs without Ray's metrics collection: the dashboard agent would otherwise serve every
    process's memory and CPU over time, without the token, on every interface, and those follow the private
    Poisson batch sizes (issue 26). (Ray's autoscaler and dashboard still serve their own metrics, node launch
    times and dashboard request durations, on two ports: no run data.)"""
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    refused = ("Ray's token authentication is off (RAY_AUTH_MODE=disabled, or a cluster started without it): anyone "
               "who reaches its ports could run code beside the private data; set RAY_AUTH_MODE=token on every node")
    address = os.environ.get("RAY_ADDRESS", "")
    if address and address != "local":  # Ray reads "local" as: start a new local cluster (the branch below)
        ray.init(namespace=RAY_NAMESPACE, log_to_driver=True)
    elif os.environ.get("RAY_AUTH_MODE", "token").lower() != "token":  # Ray's rule: any other value turns it off
        raise ConfigError(refused)  # refused before a local cluster starts
    else:
        ray.init(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, namespace=RAY_NAMESPACE,
                 log_to_driver=True, _system_config={"enable_metrics_collection": False})
    try:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled
    except ImportError:  # a Ray without token authentication (below the pinned minimum)
        is_token_auth_enabled = None
    # This process's own mode: a process joining (RAY_ADDRESS) without token mode. Whether the cluster's nodes
    # enforce the token is not visible from here (a node without it accepts any caller): docs/privacy.md.
    if is_token_auth_enabled is not None and not is_token_auth_enabled():
        ray.shutdown()
        raise ConfigError(refused)


def start_policy(config: TrainConfig, restore: Path | None = None):
    """A :class:`~raydp.control.service.PolicySession` for the config's controller settings in raydp's Ray
    namespace (:func:`raydp.control.service.start_policy_session`; ``restore``: a policy snapshot to continue from,
    e.g. a trial's checkpoint). Refused for a transport whose policy lives outside the run."""
    if transport_for(config.controller).external:  # e.g. a study trial: only `raydp train` reaches a policy server
        raise ConfigError(f"controller {config.controller!r} is for `raydp train`; this starts its own policy "
                          "(controller: broker)")
    return start_policy_session(config, RAY_NAMESPACE, restore=restore)


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
    check_model_name(config.model)
    launch = transport_for(config.controller).launch(config, overwrite_policy)  # its checks, before Ray starts
    ensure_ray()
    try:
        summary = _run_actor(config, output, overwrite, launch.start(RAY_NAMESPACE), progress)
        launch.finish(summary, Path(output))
        _rewrite_json(Path(output) / "summary.json", summary)
        return summary
    finally:
        launch.close()


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
