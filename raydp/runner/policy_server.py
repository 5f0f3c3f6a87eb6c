"""``raydp policy-server --config RUN.yaml --port P``: an RLDP policy server over RLlink.

It builds the SAC algorithm an RLDP run's config would get through the broker (the same observation
layout, :func:`raydp.control.policies.policy_layout_for`, and SAC settings,
:func:`raydp.control.policies.sac_settings`), listens on ``--host`` (127.0.0.1 unless given; only an IPv4
loopback host is accepted, ``localhost`` meaning 127.0.0.1: RLlink is plaintext after the handshake, so a
remote server is reached through an SSH tunnel, e.g. ``ssh -L 5555:127.0.0.1:5555 server``) and trains
once per transition a run uploads, until interrupted. It sends a run the weights (GET_STATE) only once it
has trained on every transition received, with training randomness from the config's public seed, so a
run's decisions are deterministic given its releases and public seeds, whatever the server's speed
(:mod:`raydp.control.rllink`). Runs reach it with ``raydp train --strategy rldp
--controller rllink://HOST:PORT``. The secret is ``RAYDP_RLLINK_SECRET`` or Ray's auth token
(:func:`raydp.control.rllink.resolve_secret`); without one it refuses to start.

``--policy DIR`` starts from a saved policy (its layout wins; a paper-mode policy is refused for a strict
config, a strict policy for a paper config, and one that acts in another clip decoding than the config's
too: the server serves its policy's mode and decoding, and keeps only uploads of runs that declare them);
``--frozen`` serves it without training (the runs act greedily and upload nothing); ``--save DIR`` writes
the policy when the server stops (module, replay buffer, manifest: :mod:`raydp.control.store`), its
provenance listing the runs that trained it (ERRATA E14: the restored policy's, then each run's entry,
sent by its client at the run's end). A paper-mode policy's replay buffer holds unprivatized statistics:
a ``--save`` directory of one is private data. A separate module from :mod:`raydp.control.rllink` so that
the server class pickled into the config clients receive is ``raydp.control.rllink``'s, never
``__main__``'s.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from raydp.control.address import require_loopback
from raydp.errors import ConfigError, RaydpError
from raydp.strategies.registry import STRATEGY_CHOICES, with_capability


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--config", required=True, help="the runs' YAML config (TrainConfig fields; the controller "
                        "strategy's `settings` set the layout and SAC settings)")
    parser.add_argument("--port", type=int, default=5555, help="TCP port (default 5555)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="IPv4 loopback address to bind (default 127.0.0.1; others, IPv6 included, are refused: "
                             "reach a remote server through an SSH tunnel, e.g. ssh -L 5555:127.0.0.1:5555 server)")
    parser.add_argument("--policy", metavar="DIR",
                        help="start from a saved policy (a name under the config's settings.policy_dir, or a path)")
    parser.add_argument("--frozen", action="store_true",
                        help="serve --policy without training it (runs act greedily and upload nothing)")
    parser.add_argument("--save", metavar="DIR", help="write the policy to DIR (must not exist) when the server stops")
    parser.add_argument("--cpus", type=int, default=1, help="CPUs of the local Ray it starts (default 1)")
    parser.add_argument("--report-every", type=float, default=30.0, metavar="S",
                        help="print the counters every S seconds (0: never)")
    parser.add_argument("--max-seconds", type=float, default=None, help="stop after this long (default: never)")
    return parser


def build_parser() -> argparse.ArgumentParser:
    return add_arguments(argparse.ArgumentParser(prog="python -m raydp.runner.policy_server",
                                                 description=__doc__.splitlines()[0]))


def _check_args(args) -> Path | None:
    """The one-line refusals that need nothing started; returns the absolute --save path."""
    if not 0 < args.port < 65536:
        raise ConfigError(f"--port must be in 1..65535, got {args.port}")
    require_loopback(args.host, "listen on")
    if args.frozen and not args.policy:
        raise ConfigError("--frozen serves a saved policy: give it with --policy")
    if args.frozen and args.save:
        raise ConfigError("--frozen serves --policy untrained: --save would only copy it (raydp policy export)")
    save = Path(args.save).expanduser().resolve() if args.save else None  # RLlib reads a relative path as a URI
    if save is not None and save.exists():
        raise ConfigError(f"--save {save} already exists: remove it or choose another directory")
    return save


def run(args) -> int:
    from raydp.config import TrainConfig, load_yaml_mapping, validate_config  # lazy: `raydp --help` loads no pandas
    from raydp.control.policies import check_policy_privacy, policy_layout_for, sac_settings, trained_on  # lazy: same
    from raydp.control.rllink import RLlinkPolicyServer, resolve_secret  # lazy: Ray only when the server runs
    from raydp.control.store import resolve_policy  # lazy: `raydp --help` loads no pandas

    save = _check_args(args)
    values = load_yaml_mapping(args.config)
    values.setdefault("strategy", with_capability(STRATEGY_CHOICES, "controller")[0])  # the policy's strategy
    values.pop("controller", None)  # the runs' transport, not the server's
    config = validate_config(TrainConfig, values)
    settings = config.strategy_settings()
    for key in ("policy", "frozen", "save_policy"):  # the server's policy is given by its flags
        if getattr(settings, key):
            raise ConfigError(f"settings.{key} in {args.config}: the policy server takes --policy, --frozen and --save")
    restore = None
    if args.policy:  # a paper-mode policy may not serve a strict config; the decoding must match (E3/E14)
        restore = check_policy_privacy(config, resolve_policy(args.policy, settings.policy_dir))
    layout, settings = policy_layout_for(config), sac_settings(config)
    _, source = resolve_secret()  # refuse before Ray starts
    import ray  # lazy: Ray only when the server runs

    if not ray.is_initialized():  # its temporary folder owner-only, as a study's (raydp.runner.launch)
        from raydp.runner.launch import start_local_ray

        os.environ.setdefault("RAY_DEDUP_LOGS", "0")
        start_local_ray(num_cpus=args.cpus, log_to_driver=False, namespace=None)
    server = RLlinkPolicyServer(layout, settings, host=args.host, port=args.port, trained_on=trained_on(config),
                                restore=restore, frozen=args.frozen).start()
    layout = server.layout
    policy = f"policy {restore}{' (frozen)' if args.frozen else ''}" if restore else "a new policy"
    print(f"policy server listening on {server.url}: {policy}, layout {layout.architecture}/{layout.n_slots} slots, "
          f"B_SAC={settings.b_sac}, K={settings.k}, {server.runner.policy['privacy_mode']} mode; secret from {source}"
          + (f"; saves to {save} when stopped" if save else ""), flush=True)
    stop = threading.Event()  # Ctrl-C / SIGTERM: stop cleanly (RLlib leaves SIGINT without KeyboardInterrupt)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    started = last = time.monotonic()
    status = 0
    manifest = None
    try:
        while not stop.wait(0.5):
            if not server.runner.thread.is_alive():
                print(f"raydp: error: the policy server stopped listening on {server.url} "
                      f"({server.runner.bind_error or 'listener failed'})", file=sys.stderr)
                status = 1
                break
            if args.max_seconds is not None and time.monotonic() - started >= args.max_seconds:
                break
            if args.report_every and time.monotonic() - last >= args.report_every:
                last = time.monotonic()
                print(json.dumps(server.counters()), flush=True)
    finally:
        try:
            manifest = server.stop(save_to=save)
        finally:
            ray.shutdown()
    print(f"policy server stopped: {json.dumps(server.counters())}", flush=True)
    if manifest is not None:
        print(f"policy saved to {save}: {manifest['transitions']} transitions trained this session, "
              f"{len(manifest['provenance'])} provenance entries", flush=True)
    return status


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except RaydpError as exc:
        print(f"raydp: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
