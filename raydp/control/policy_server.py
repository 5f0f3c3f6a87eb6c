"""``python -m raydp.control.policy_server --config RUN.yaml --port P``: an RLDP policy server over RLlink.

It builds the SAC algorithm an RLDP run's config would get through the broker (the same observation
layout, :func:`raydp.control.policies.policy_layout_for`, and SAC settings,
:func:`raydp.control.policies.sac_settings`), listens on ``--host`` (127.0.0.1 unless given) and trains
once per transition a run uploads, until interrupted. Runs reach it with
``raydp train --strategy rldp --controller rllink://HOST:PORT``. The secret is ``RAYDP_RLLINK_SECRET`` or
Ray's auth token (:func:`raydp.control.rllink.resolve_secret`); without one it refuses to start. It saves
nothing: the replay buffer stays in memory. A separate module from :mod:`raydp.control.rllink` so that the
server class pickled into the config clients receive is ``raydp.control.rllink``'s, never ``__main__``'s.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--config", required=True, help="the runs' YAML config (TrainConfig fields; its `rldp` "
                        "block sets the layout and SAC settings)")
    parser.add_argument("--port", type=int, default=5555, help="TCP port (default 5555)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="interface to bind (default 127.0.0.1; another one is plaintext, with a warning)")
    parser.add_argument("--cpus", type=int, default=1, help="CPUs of the local Ray it starts (default 1)")
    parser.add_argument("--report-every", type=float, default=30.0, metavar="S",
                        help="print the counters every S seconds (0: never)")
    parser.add_argument("--max-seconds", type=float, default=None, help="stop after this long (default: never)")
    return parser


def build_parser() -> argparse.ArgumentParser:
    return add_arguments(argparse.ArgumentParser(prog="python -m raydp.control.policy_server",
                                                 description=__doc__.splitlines()[0]))


def run(args) -> int:
    from raydp.config import TrainConfig, load_yaml_mapping, validate_config
    from raydp.control.policies import policy_layout_for, sac_settings
    from raydp.control.rllink import resolve_secret

    if not 0 < args.port < 65536:
        from raydp.errors import ConfigError

        raise ConfigError(f"--port must be in 1..65535, got {args.port}")
    values = load_yaml_mapping(args.config)
    values.setdefault("strategy", "rldp")
    values.pop("controller", None)  # the runs' transport, not the server's
    config = validate_config(TrainConfig, values)
    layout, settings = policy_layout_for(config), sac_settings(config)
    _, source = resolve_secret()  # refuse before Ray starts
    import ray

    from raydp.control.rllink import RLlinkPolicyServer

    if not ray.is_initialized():
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")
        ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    server = RLlinkPolicyServer(layout, settings, host=args.host, port=args.port).start()
    print(f"policy server listening on {server.url} (layout {layout.architecture}/{layout.n_slots} slots, "
          f"B_SAC={settings.b_sac}, K={settings.k}; secret from {source})", flush=True)
    stop = threading.Event()  # Ctrl-C / SIGTERM: stop cleanly (RLlib leaves SIGINT without KeyboardInterrupt)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    started = last = time.monotonic()
    status = 0
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
        server.stop()
        ray.shutdown()
    print(f"policy server stopped: {json.dumps(server.counters())}", flush=True)
    return status


def main(argv: list[str] | None = None) -> int:
    from raydp.errors import RaydpError

    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except RaydpError as exc:
        print(f"raydp: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
