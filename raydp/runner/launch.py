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

import contextlib
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path

from raydp.config import TrainConfig
from raydp.control.service import start_policy_session
from raydp.control.transports import transport_for
from raydp.errors import ConfigError
from raydp.files import atomic_write, owner_only
from raydp.model.loading import check_model_name
from raydp.run_directory import RunDirectory

RAY_NAMESPACE = "raydp"


def ensure_ray(num_cpus: int | None = None, private: bool = True) -> None:
    """Join the Ray cluster in RAY_ADDRESS (e.g. under ``ray job submit``) or start a local one
    (:func:`start_local_ray`); where this process already runs Ray, use it.

    Ray's own processes (GCS, raylets, workers) listen on every interface of the host, whatever the node address.
    What protects them is Ray's token authentication, on by default for a local cluster since Ray 2.60 (the
    pinned minimum; ``RAY_AUTH_MODE=disabled`` turns it off: don't): a process without the token (kept in
    ``~/.ray/auth_token``) can neither connect nor submit work (tests/test_ray_auth.py). A local cluster is refused
    before it starts where ``RAY_AUTH_MODE`` turns the token off, and a process that joins a cluster (RAY_ADDRESS)
    without token mode is refused once joined (one-line ConfigError). A remote cluster must enable it on every node
    (docs/privacy.md, "Ray's ports"): whether it does cannot be seen from a client, which this does not check.

    A local cluster also runs without Ray's metrics collection: the dashboard agent would otherwise serve every
    process's memory and CPU over time, without the token, on every interface, and those follow the private
    Poisson batch sizes. (Ray's autoscaler and dashboard still serve their own metrics, node launch
    times and dashboard request durations, on two ports: no run data.)

    Ray's temporary folder holds what Tune stages of a study (trial results, settings, the number of trials) and
    every worker's log: a local cluster keeps it in an owner-only folder (:func:`start_local_ray`). With
    ``private`` (work on private data), a Ray that this process started before with a temporary folder other local
    users can enter is refused (one line); a joined cluster's folders are its operator's (docs/privacy.md)."""
    import ray

    if ray.is_initialized():
        if private:
            check_ray_temp_dir()
        return
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    address = os.environ.get("RAY_ADDRESS", "")
    if address and address != "local":  # Ray reads "local" as: start a new local cluster (the branch below)
        ray.init(namespace=RAY_NAMESPACE, log_to_driver=True)
    else:
        start_local_ray(num_cpus=num_cpus or os.cpu_count(), log_to_driver=True)
    try:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled
    except ImportError:  # a Ray without token authentication (below the pinned minimum)
        is_token_auth_enabled = None
    # This process's own mode: a process joining (RAY_ADDRESS) without token mode. Whether the cluster's nodes
    # enforce the token is not visible from here (a node without it accepts any caller): docs/privacy.md.
    if is_token_auth_enabled is not None and not is_token_auth_enabled():
        ray.shutdown()
        raise ConfigError(_AUTH_OFF)


_AUTH_OFF = ("Ray's token authentication is off (RAY_AUTH_MODE=disabled, or a cluster started without it): anyone "
             "who reaches its ports could run code beside the private data; set RAY_AUTH_MODE=token on every node")

#: the owner-only folder this process's local Ray keeps its temporary files in (removed at exit)
_OWNED_TEMP_ROOT: Path | None = None


def start_local_ray(num_cpus: int | None = None, **init_kwargs) -> Path:
    """Start a local Ray cluster whose temporary folder is owner-only; returns that folder.

    Ray makes its temporary folders world-writable on purpose (``try_make_directory_shared``: mode 0777 for the
    temporary root, the session, its logs and sockets), and Tune stages each experiment there
    (``session_*/artifacts/*/<experiment>/driver_artifacts``: every trial's results and settings, so how many trials
    ran). Here the root is ``/tmp/raydp-ray-<random>/ray`` inside a fresh ``mkdtemp`` folder (0700, so nothing
    below it can be reached by another local user; short, since Ray's Unix socket paths must stay under 107
    bytes); Ray's processes start under an owner-only umask, so what they write is 0600/0700, and the folders Ray
    opened are closed again once it runs (:func:`close_ray_temp_dir`). The whole folder is removed when this
    process exits, after Ray has shut down. Refused, before anything starts, where ``RAY_AUTH_MODE`` turns Ray's
    token authentication off (Ray's rule: any value but ``token``)."""
    global _OWNED_TEMP_ROOT
    import atexit

    import ray

    from raydp.files import private_umask

    if os.environ.get("RAY_AUTH_MODE", "token").lower() != "token":
        raise ConfigError(_AUTH_OFF)  # refused before a local cluster starts
    root = Path(tempfile.mkdtemp(prefix="raydp-ray-", dir="/tmp" if os.path.isdir("/tmp") else None))
    # registered before ray.init, so it runs after Ray's own exit handler (atexit runs last-registered first)
    atexit.register(_remove_temp_root, root)
    init_kwargs.setdefault("include_dashboard", False)
    init_kwargs.setdefault("namespace", RAY_NAMESPACE)
    system_config = {"enable_metrics_collection": False, **init_kwargs.pop("_system_config", {})}
    try:
        with private_umask():  # Ray's processes inherit it: their files are owner-only
            ray.init(num_cpus=num_cpus, _temp_dir=str(root / "ray"), _system_config=system_config, **init_kwargs)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    _OWNED_TEMP_ROOT = root
    close_ray_temp_dir()
    return root


def _remove_temp_root(root: Path) -> None:
    import ray

    if ray.is_initialized() and _OWNED_TEMP_ROOT == root:
        ray.shutdown()
    shutil.rmtree(root, ignore_errors=True)


def ray_temp_dir() -> Path | None:
    """The temporary folder of the Ray this process runs (None where it runs none)."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None) if ray.is_initialized() else None
    return Path(node.get_temp_dir_path()) if node is not None else None


def close_ray_temp_dir() -> None:
    """Take the group and other bits off every folder under this process's own Ray's temporary folder (Ray opens
    its folders to everyone, and opens new ones as it goes, e.g. a job's runtime environment; the owner-only
    folder around them already keeps other users out)."""
    if _OWNED_TEMP_ROOT is None or ray_temp_dir() is None:
        return
    for folder, dirs, _ in os.walk(_OWNED_TEMP_ROOT):
        for name in [folder, *(os.path.join(folder, d) for d in dirs)]:
            with contextlib.suppress(OSError):
                if os.lstat(name).st_mode & 0o077:
                    os.chmod(name, 0o700)


def check_ray_temp_dir() -> None:
    """Refuse (one line) a Ray started in this process whose temporary folder another local user can reach: Tune
    would stage a study's trials there. Reachable unless the folder, or a folder above it, is this user's and
    closed to group and others."""
    temp = ray_temp_dir()
    if temp is None:  # a client of a remote cluster: its folders are its operator's (docs/privacy.md)
        return
    for folder in (temp, *temp.parents):
        try:
            info = os.stat(folder)
        except OSError:
            continue
        if info.st_uid == os.getuid() and not info.st_mode & 0o077:
            return
    raise ConfigError(f"Ray is already running in this process with its temporary folder {temp} open to other local "
                      "users, where Tune would keep a copy of this work on private data: let raydp start Ray, or "
                      "start it with ray.init(_temp_dir=<a folder inside an owner-only one>)")


def remove_tune_staging(experiment: str) -> None:
    """Remove what Tune staged of ``experiment`` in Ray's temporary folder on this (the driver's) node
    (``session_*/artifacts/<timestamp>/<experiment>``: its trials' results and settings): the study keeps its own
    copy in its storage, and a resume reads that."""
    temp = ray_temp_dir()
    if temp is None:
        return
    for staged in Path(temp).glob(f"session_*/artifacts/*/{experiment}"):
        shutil.rmtree(staged, ignore_errors=True)
    close_ray_temp_dir()


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
    atomic_write(path, json.dumps(payload, indent=2))


@owner_only
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
        _rewrite_json(RunDirectory(output).summary, summary)
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
