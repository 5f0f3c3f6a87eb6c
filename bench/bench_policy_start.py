"""Benchmark: how long a policy session takes to start (raydp.control.service.PolicySession: the broker and the SAC
service, each a Ray actor in a fresh process), on a local Ray of this machine.

    python bench/bench_policy_start.py --runs 3
    python bench/bench_policy_start.py --runs 3 --against /tmp/old   # also another raydp, and the ratio

``--against DIR`` times the raydp package in DIR the same way, in a subprocess (for example an earlier commit:
``mkdir /tmp/old && git archive REV raydp | tar -x -C /tmp/old``), and prints its mean over this code's.
Each start is timed from the call to the session being ready; the session is then closed. Ray's own start is not
counted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def time_starts(runs: int) -> list[float]:
    import ray

    from raydp.control.features import ObservationLayout
    from raydp.control.sac import SACSettings
    from raydp.control.service import PolicySession

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             _system_config={"enable_metrics_collection": False})
    try:
        seconds = []
        for _ in range(runs):
            started = time.perf_counter()
            session = PolicySession(ObservationLayout("shared", 4), SACSettings(b_sac=3, k=2, hidden=16, seed=7))
            seconds.append(time.perf_counter() - started)
            session.close()
        return seconds
    finally:
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--against", metavar="DIR", help="also time the raydp package in DIR, and print the ratio")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # the subprocess's output
    args = parser.parse_args()
    if args.json:
        print(json.dumps(time_starts(args.runs)))
        return
    here = time_starts(args.runs)
    print(f"this code: {', '.join(f'{s:.1f}' for s in here)} s (mean {statistics.mean(here):.1f} s)")
    if args.against:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [args.against, os.environ.get("PYTHONPATH")]))}
        out = subprocess.run([sys.executable, __file__, "--runs", str(args.runs), "--json"], env=env, check=True,
                             capture_output=True, text=True).stdout
        there = json.loads(out.strip().splitlines()[-1])
        print(f"{args.against}: {', '.join(f'{s:.1f}' for s in there)} s (mean {statistics.mean(there):.1f} s)")
        print(f"ratio (theirs / this code's mean): {statistics.mean(there) / statistics.mean(here):.2f}x")


if __name__ == "__main__":
    main()
