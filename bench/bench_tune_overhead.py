"""Benchmark: Ray Tune's scheduling overhead per trial, as raydp's studies use it (issue 5 target <= 5 s).

Runs N trials of a trivial function trainable with the same resources request raydp uses (a
``PlacementGroupFactory`` bundle of ``--cpus`` CPUs), ``--cpus`` CPUs per trial on this machine, and
prints (Tuner wall time - the trials' own run time / concurrency) / N: what Tune adds per trial
(placement group, actor start, result and checkpoint bookkeeping). The trials import torch, as a
raydp trial does, and report once.

Run: python bench/bench_tune_overhead.py [--trials 8] [--cpus 1]
"""

from __future__ import annotations

import argparse
import tempfile
import time


def trivial(config: dict) -> None:
    import torch  # noqa: F401  (a raydp trial imports torch first)
    from ray import tune

    started = time.perf_counter()
    time.sleep(config["work_s"])
    tune.report({"own_seconds": time.perf_counter() - started + 0.0})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--cpus", type=int, default=1)
    parser.add_argument("--work-s", type=float, default=2.0)
    args = parser.parse_args()
    import ray
    from ray import tune

    ray.init(include_dashboard=False, log_to_driver=False)
    concurrency = max(1, int(ray.cluster_resources()["CPU"] // args.cpus))
    trainable = tune.with_resources(trivial, tune.PlacementGroupFactory([{"CPU": args.cpus}]))
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        grid = tune.Tuner(trainable, param_space={"work_s": args.work_s, "i": tune.grid_search(list(range(args.trials)))},
                          run_config=tune.RunConfig(storage_path=tmp, verbose=0)).fit()
        wall = time.perf_counter() - started
    own = sum(r.metrics["own_seconds"] for r in grid)
    per_trial = (wall - own / concurrency) / args.trials
    print(f"{args.trials} trials, {concurrency} at a time, {args.work_s:.1f} s of work each: Tuner wall {wall:.1f} s")
    print(f"Tune scheduling overhead per trial: {per_trial:.2f} s (target <= 5 s)")


if __name__ == "__main__":
    main()
