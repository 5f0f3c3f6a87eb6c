"""Benchmark: the RLDP controller's overhead on a run (issue 4 target: RLDP / static wall time <= 1.03).

Runs the embedded default as Ray actors with the same threads and the same number of steps:
``static`` (flat clip, constant sigma_0), ``static-pairwise`` (the same pairwise mechanism as RLDP, no
controller) and ``rldp`` (strict mode: DP histogram and loss releases every step, a decision every
T_RL = 112 steps through the broker, K SAC updates per transition in the policy service). Rounds are
interleaved. Printed:

  * run wall time (the actor's whole run: data, model, evaluations, training, outputs) per strategy and
    the ratios rldp / static and rldp / static-pairwise;
  * the training-loop time alone (sum of step times, ``train_loop_seconds``) and the same ratios;
  * the policy's start-up time (broker + SAC service, paid once per policy, not per run);
  * the action round trip (run -> broker -> action) over many calls: median and p95.

Run: python bench/bench_controller.py [--steps 448] [--rounds 1] [--t-rl 112]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import ray


def one_run(strategy: str, steps: int, t_rl: int, threads: int, out: Path) -> dict:
    from raydp.config import TrainConfig, validate_config
    from raydp.runner.actor import FineTuningRun
    from raydp.runner.launch import start_policy

    # epochs high enough that max_steps sets the step count (and sigma_0 is calibrated for it)
    config = validate_config(TrainConfig, {"strategy": strategy, "epsilon": 2.0, "epochs": 100.0, "max_steps": steps,
                                           **({"settings": {"t_rl": t_rl}} if strategy == "rldp" else {})})
    session, startup = None, 0.0
    if strategy == "rldp":
        started = time.perf_counter()
        session = start_policy(config)
        startup = time.perf_counter() - started
    try:
        actor = FineTuningRun.options(num_cpus=threads).remote(threads)
        ray.get(actor.pid.remote())  # actor start-up is not part of the run
        started = time.perf_counter()
        summary = ray.get(actor.run.remote(config.model_dump(mode="json"), str(out), True,
                                           session.connection() if session else None, f"bench-{strategy}", False))
        wall = time.perf_counter() - started
        ray.kill(actor)
    finally:
        if session is not None:
            session.close()
    loop = float(summary["train_loop_seconds"])
    return {"wall": wall, "loop": loop, "startup": startup, "summary": summary}


def action_round_trip(calls: int = 300) -> tuple[float, float]:
    from raydp.control.features import ObservationLayout
    from raydp.control.sac import SACSettings
    from raydp.control.service import PolicySession

    layout = ObservationLayout("shared", 64)
    with PolicySession(layout, SACSettings()) as session:
        client = session.client("latency")
        obs = layout.pack(np.zeros((4, layout.f_adapter)), np.zeros(layout.g_global))
        for i in range(calls):
            client.decide(obs, None)  # no reward: nothing to train, pure acting round trip
        lat = np.array(client.latencies[10:]) * 1000
    return float(np.median(lat)), float(np.percentile(lat, 95))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=448, help="steps per run (448 = 4 decisions at T_RL=112)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--t-rl", type=int, default=112)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from raydp.runner.launch import ensure_ray

    ensure_ray(args.threads)
    strategies = ("static", "static-pairwise", "rldp")
    results = {s: [] for s in strategies}
    with tempfile.TemporaryDirectory() as tmp:
        one_run("static", 8, args.t_rl, args.threads, Path(tmp) / "warm")  # model cache, imports
        for r in range(args.rounds):
            for s in strategies:
                res = one_run(s, args.steps, args.t_rl, args.threads, Path(tmp) / f"{s}-{r}")
                results[s].append(res)
                print(f"round {r} {s:<16} wall {res['wall']:7.1f} s   loop {res['loop']:7.1f} s", flush=True)
    wall = {s: statistics.median(x["wall"] for x in v) for s, v in results.items()}
    loop = {s: statistics.median(x["loop"] for x in v) for s, v in results.items()}
    last = results["rldp"][-1]["summary"]
    assert last["steps"] == args.steps, f"the runs did {last['steps']} steps, not {args.steps}"
    print(f"\n{args.steps} steps, T_RL={args.t_rl}, {last['controller']['decisions']} decisions, "
          f"{args.threads} threads per run")
    print(f"RLDP run wall / static run wall            {wall['rldp'] / wall['static']:.3f}  (target <= 1.03)")
    print(f"RLDP run wall / static-pairwise run wall   {wall['rldp'] / wall['static-pairwise']:.3f}")
    print(f"RLDP loop / static loop                    {loop['rldp'] / loop['static']:.3f}")
    print(f"RLDP loop / static-pairwise loop           {loop['rldp'] / loop['static-pairwise']:.3f}")
    print(f"policy start-up (broker + SAC service)     {statistics.median(x['startup'] for x in results['rldp']):.1f} s "
          "(once per policy)")
    med, p95 = action_round_trip()
    print(f"action round trip, 290 calls               median {med:.2f} ms, p95 {p95:.2f} ms")


if __name__ == "__main__":
    main()
