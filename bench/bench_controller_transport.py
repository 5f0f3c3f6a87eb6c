"""Action round trip of an RLDP decision: the broker (Ray actor calls) versus RLlink (a policy server over TCP).

Both paths get the same policy (the default RLDP config's layout and SAC settings: shared, 64 slots, hidden
128) and the same client-side work: a client in its own Ray actor process, as a run is, calls
``decide(obs, reward)`` every ``--gap`` seconds (real decisions are T_RL steps, i.e. seconds, apart, so the
policy trains between them). Timed per decision, as ``PolicyClient.latencies`` / ``RLlinkPolicyClient.latencies``:

* broker: one ``ray.get(broker.decide.remote(...))`` (the broker acts, with the latest weights, and queues
  the transition for the service);
* RLlink: GET_STATE (the latest weights, every decision by default), local inference, and EPISODES (the
  transition) on one authenticated socket to the server (its SAC algorithm in this driver process).

Prints median and p90 of each, the RLlink/broker ratio and RLlink's parts. Usage:

    python bench/bench_controller_transport.py [--decisions 200] [--gap 0.05] [--weights-every 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

import numpy as np
import ray


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p * (len(xs) - 1))))]


def stats_ms(xs) -> dict:
    return {"n": len(xs), "median_ms": 1e3 * statistics.median(xs), "p90_ms": 1e3 * pct(xs, 0.9),
            "mean_ms": 1e3 * statistics.fmean(xs)}


@ray.remote(num_cpus=0)
class BenchRun:
    """Stands in for a run actor: builds its client from a connection and decides on a timer."""

    def __init__(self):
        import torch

        torch.set_num_threads(1)

    def decide_loop(self, kind: str, connection: dict, n: int, gap_s: float, n_pairs: int, seed: int,
                    weights_every: int) -> dict:
        if kind == "broker":
            from raydp.control.connection import client_from_connection

            client = client_from_connection(connection, "bench-broker")
        else:
            from raydp.control.rllink import RLlinkPolicyClient

            client = RLlinkPolicyClient(connection["host"], connection["port"], "bench-rllink",
                                        secret=connection["secret"], weights_every=weights_every,
                                        expect=connection["expect"])
        layout, rng = client.layout, np.random.default_rng(seed)
        reward = None
        for _ in range(n):
            obs = layout.pack(rng.normal(size=(n_pairs, layout.f_adapter)), rng.normal(size=layout.g_global))
            client.decide(obs, reward)
            reward = float(rng.normal())
            time.sleep(gap_s)
        client.end()
        out = {"latencies": list(client.latencies), "weights_seen": list(client.weights_seen)}
        if kind == "rllink":
            out["timings"] = {k: list(v) for k, v in client.timings.items()}
            client.close()  # end() leaves the socket open for save_policy's provenance entry
        return out


def weights_message_bytes(server) -> int:
    """Size of a SET_STATE message on the wire, by Ray's own encoder (through a socket pair)."""
    import threading

    from ray.rllib.env.external import send_rllink_message

    a, b = socket.socketpair()
    with a, b:
        sender = threading.Thread(target=send_rllink_message,
                                  args=(a, {"type": "SET_STATE", "state": server.runner.get_state()}))
        sender.start()
        header = b.recv(8, socket.MSG_WAITALL)
        size = int(header.decode())
        remaining = size
        while remaining:
            remaining -= len(b.recv(min(remaining, 1 << 20)))
        sender.join()
    return 8 + size


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--decisions", type=int, default=200)
    p.add_argument("--warmup", type=int, default=10, help="first decisions left out of the statistics")
    p.add_argument("--gap", type=float, default=0.05, help="seconds between decisions")
    p.add_argument("--pairs", type=int, default=2, help="adapter pairs of the pretend run")
    p.add_argument("--weights-every", type=int, default=1, help="RLlink: GET_STATE every N decisions")
    p.add_argument("--cpus", type=int, default=2)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)

    os.environ.setdefault("RAYDP_RLLINK_SECRET", os.urandom(24).hex())  # this bench's own secret
    from raydp.config import TrainConfig
    from raydp.control.address import RLlinkAddress
    from raydp.control.policies import policy_layout_for, sac_settings, trained_on
    from raydp.control.rllink import RLlinkPolicyServer, resolve_secret, rllink_connection
    from raydp.control.service import PolicySession

    config = TrainConfig(strategy="rldp", epsilon=2.0)
    layout, settings = policy_layout_for(config), sac_settings(config)
    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False, namespace="raydp")
    results = {"layout": layout.as_dict(), "sac": settings.as_dict(), "decisions": args.decisions,
               "gap_s": args.gap, "weights_every": args.weights_every, "cpus": args.cpus,
               "load_average": os.getloadavg(), "nproc": os.cpu_count()}
    run = BenchRun.remote()

    with PolicySession(layout, settings) as session:
        out = ray.get(run.decide_loop.remote("broker", session.connection(), args.decisions, args.gap, args.pairs, 0,
                                             args.weights_every))
        results["broker"] = stats_ms(out["latencies"][args.warmup:])
        results["broker"]["transitions_trained"] = session.counters()["transitions_trained"]

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = RLlinkPolicyServer(layout, settings, port=port, trained_on=trained_on(config)).start()
    try:
        connection = rllink_connection(RLlinkAddress("127.0.0.1", port), resolve_secret()[0],
                                       {"privacy_mode": config.strategy_settings().privacy_mode,
                                        "action_decoding": config.strategy_settings().action_decoding})
        out = ray.get(run.decide_loop.remote("rllink", connection, args.decisions, args.gap, args.pairs, 0,
                                             args.weights_every))
        server.wait_idle(60)
        results["rllink"] = stats_ms(out["latencies"][args.warmup:])
        results["rllink"]["parts"] = {k: stats_ms(v[args.warmup:]) for k, v in out["timings"].items()}
        results["rllink"]["transitions_trained"] = server.counters()["transitions_trained"]
        results["rllink"]["weights_message_bytes"] = weights_message_bytes(server)
    finally:
        server.stop()
    ray.shutdown()

    b, r = results["broker"], results["rllink"]
    results["ratio_median"] = r["median_ms"] / b["median_ms"]
    results["ratio_p90"] = r["p90_ms"] / b["p90_ms"]
    print(f"machine: {results['nproc']} CPUs, load average {results['load_average'][0]:.1f}; "
          f"{args.decisions} decisions ({args.warmup} warm-up left out), {args.gap * 1e3:.0f} ms apart")
    print(f"{'transport':<10} {'median ms':>10} {'p90 ms':>10}")
    print(f"{'broker':<10} {b['median_ms']:>10.2f} {b['p90_ms']:>10.2f}")
    print(f"{'rllink':<10} {r['median_ms']:>10.2f} {r['p90_ms']:>10.2f}")
    print(f"ratio rllink/broker: median {results['ratio_median']:.2f}x, p90 {results['ratio_p90']:.2f}x")
    parts = ", ".join(f"{k} {v['median_ms']:.2f}" for k, v in r["parts"].items())
    print(f"rllink parts (median ms): {parts}; weights message {r['weights_message_bytes'] / 1024:.0f} KiB "
          f"(GET_STATE every {args.weights_every} decision(s))")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
