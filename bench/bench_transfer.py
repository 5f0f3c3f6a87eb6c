"""Experiment: a policy trained on the embedded 4-layer model drives the 8-layer model frozen.

1. ``source``: RLDP on ``embedded`` (4 adapter pairs), training a shared policy online, saved;
2. ``frozen``: that policy, frozen, on ``embedded-deep`` (8 pairs);
3. ``scratch``: a new policy trained online on ``embedded-deep``;
4. ``static``: the static baseline on ``embedded-deep``.
All at the same epsilon, seed, steps and T_RL. Prints eval perplexity (initial, final, best), the
enforcing accountant's epsilon and the controller's decisions for each.

Run: python bench/bench_transfer.py [--epsilon 2] [--epochs 3] [--t-rl 16] [--out runs/transfer]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epsilon", type=float, default=2.0)
    parser.add_argument("--epochs", type=float, default=3.0)
    parser.add_argument("--t-rl", type=int, default=16)
    parser.add_argument("--out", default="runs/transfer")
    args = parser.parse_args()

    from raydp.config import TrainConfig, validate_config
    from raydp.runner.launch import train

    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    policy_dir = out / "policies"

    def cfg(model, strategy="rldp", **rldp):
        return validate_config(TrainConfig, {"model": model, "strategy": strategy, "epsilon": args.epsilon,
                                             "epochs": args.epochs,
                                             **({"settings": {"t_rl": args.t_rl, "policy_dir": str(policy_dir), **rldp}}
                                                if strategy == "rldp" else {})})

    runs = {
        "source (embedded, online)": cfg("embedded", save_policy="source"),
        "frozen (embedded-deep)": cfg("embedded-deep", policy="source", frozen=True),
        "scratch (embedded-deep, online)": cfg("embedded-deep"),
        "static (embedded-deep)": cfg("embedded-deep", strategy="static"),
    }
    results = {}
    for i, (label, config) in enumerate(runs.items()):
        results[label] = train(config, out / f"run{i}", progress=False)
        s = results[label]
        print(f"{label:<34} pairs {s['n_adapter_pairs']}  ppl {s['initial_eval_perplexity']:.4f} -> "
              f"{s['final_eval_perplexity']:.4f} (best {s['best_eval_perplexity']:.4f})  "
              f"eps {s['privacy']['epsilon']:.4f}  decisions {(s.get('controller') or {}).get('decisions', 0)}",
              flush=True)


if __name__ == "__main__":
    main()
