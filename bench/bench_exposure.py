"""Validation: the extrapolated exposure from N candidates against the rank among 100,000, on trained runs.

Trains small runs of the embedded tiny model with canaries (two non-private ones, whose canaries get exposure, and one DP
run, whose sit near 0 bits), then for the first ``--canaries`` canaries of each scores the canary and a pool of
``--reference`` uniform candidates after the canary's record, drawn as ``raydp eval`` draws them (same seed, same
secrets excluded), so that the first N of the pool are the N candidates the attack itself would use. For each N,
block j of the pool (candidates j*N .. (j+1)*N - 1; block 0 is the attack's own) gives an extrapolated exposure and
its 95% bootstrap interval (the attack's resamples, seeded as it seeds them), and the reference is the canary's rank
among the rest of the pool (independent of the block). Prints per canary: reference, estimate, interval, |error|,
covered (block 0), then per N over every block the share within 0.3 bits and the share covered, among canaries whose
reference is at most 6 bits, and all; then the time of exposure per canary (the first run's first
``--timing-canaries``): rank over 10,000 candidates (the default before extrapolation) against extrapolation from N,
both through ``attacks.exposure``. No assertions.

Run: nice -n 10 python bench/bench_exposure.py [--canaries 3] [--reference 100000] [--blocks 3] [--runs-dir DIR]
(``--runs-dir`` keeps the trained runs and the canaries' scores there, and a rerun reuses them.)
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import numpy as np

#: small runs of the embedded tiny model with its 10 canaries, made to memorise (as tests/test_evaluation.py's
#: AUDITABLE run: few records, LoRA rank 32 on attention and MLP, lr 0.01), so that the canaries' exposure spreads
#: over 1-8 bits; the DP run's sit near 0. (Short runs of the embedded default, lr 2e-3, 400 records, gave 0.8-1
#: bit after 4 and 12 epochs: too little to test the extrapolation.) Scoring costs the same per candidate on both.
BASE = {"model": "embedded-tiny", "data": {"n_records": 100}, "batch_size": 16, "warmup_steps": 0, "lr": 0.01,
        "eval_max_records": 16, "public_eval_records": 16, "seed": 0, "cpus": 2,
        "lora": {"r": 32, "alpha": 64, "target_modules": ["c_attn", "c_fc", "c_proj"]}}
RUNS = {
    "nonprivate-100ep": {"strategy": "nonprivate", "epochs": 100},
    "nonprivate-30ep": {"strategy": "nonprivate", "epochs": 30},
    "static-eps2-30ep": {"strategy": "static", "epsilon": 2.0, "epochs": 30},
}
SIZES = (500, 1000, 2000)
BAR_BITS, BAR_ERROR = 6.0, 0.3


def _train(root: Path, name: str) -> Path:
    from raydp.config import TrainConfig
    from raydp.run_directory import RunDirectory
    from raydp.runner.run import run_training

    run = root / name
    if not RunDirectory(run).summary.is_file():
        started = time.perf_counter()
        run_training(TrainConfig.model_validate({**BASE, **RUNS[name]}), run, progress=False)
        print(f"trained {name} in {time.perf_counter() - started:.0f} s", flush=True)
    return run


def _canaries(run: Path):
    """(model, tokenizer, device, contexts, secrets) of the run, as raydp.evaluation.exposure reads them."""
    import json

    from raydp.config import TrainConfig
    from raydp.data import load_canaries, load_split
    from raydp.evaluation import attacks
    from raydp.evaluation.evaluate import load_trained_model, run_dataset_dir
    from raydp.run_directory import RunDirectory

    files = RunDirectory(run)
    config = TrainConfig.model_validate(json.loads(files.config.read_text()))
    dataset = run_dataset_dir(run, config, json.loads(files.summary.read_text()))
    loaded = load_trained_model(run, config, "cpu")
    canaries = load_canaries(dataset)
    secrets = list(canaries["secret"])
    texts = list(load_split(dataset, "train")["text"].iloc[canaries["train_row"].to_numpy()])
    contexts = [t[:off] for t, off in zip(texts, attacks.secret_offsets(texts, secrets))]
    return loaded, contexts, secrets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--canaries", type=int, default=3, help="canaries per run")
    parser.add_argument("--reference", type=int, default=100_000, help="candidates of the rank reference")
    parser.add_argument("--blocks", type=int, default=3, help="disjoint candidate blocks per N (block 0: the attack's)")
    parser.add_argument("--resamples", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0, help="the evaluation's seed (EvalConfig.seed)")
    parser.add_argument("--runs", default=",".join(RUNS), help="which of " + ", ".join(RUNS))
    parser.add_argument("--runs-dir", default=None)
    parser.add_argument("--timing-canaries", type=int, default=2,
                        help="canaries of the first run timed through attacks.exposure")
    args = parser.parse_args()

    import torch

    from raydp.data.canaries import random_secrets
    from raydp.evaluation import attacks, exposure_fit
    from raydp.evaluation.scoring import candidate_logprobs

    torch.set_num_threads(2)
    root = Path(args.runs_dir) if args.runs_dir else Path(tempfile.mkdtemp(prefix="bench-exposure-"))
    space_bits = 10 * math.log2(36)
    rows, blocks, timing = [], [], {}
    for name in args.runs.split(","):
        run = _train(root, name)
        loaded, contexts, secrets = _canaries(run)
        rng = np.random.default_rng(np.random.SeedSequence([args.seed, 0x45585053]))  # as attacks.exposure draws
        pool = random_secrets(rng, args.reference, exclude=set(secrets))
        texts = [c + "." for c in pool]
        for i in range(min(args.canaries, len(secrets))):
            started = time.perf_counter()
            cache = run / f"bench-exposure-scores-{args.seed}-{args.reference}-{i}.npy"  # a rerun reuses them
            if cache.is_file():
                scores = np.load(cache)
            else:
                scores = candidate_logprobs(loaded.model, loaded.tokenizer, contexts[i], [secrets[i] + "."] + texts,
                                            loaded.device, 256)
                np.save(cache, scores)
            scored_s = time.perf_counter() - started
            own, others = scores[0], scores[1:]
            full = exposure_fit.rank_exposure(own, others)
            print(f"{name} canary {i}: scored {len(scores)} strings in {scored_s:.0f} s; rank among all "
                  f"{args.reference}: {full:.2f} bits", flush=True)
            for n in SIZES:
                for j in range(args.blocks):
                    block = slice(j * n, (j + 1) * n)
                    rest = np.concatenate([others[:block.start], others[block.stop:]])
                    reference = exposure_fit.rank_exposure(own, rest)
                    boot = np.random.default_rng(np.random.SeedSequence([args.seed, 0x45585053, 1]))  # the attack's
                    fit = exposure_fit.extrapolated_exposure(np.array([-own]), -others[block][None, :], rng=boot,
                                                             resamples=args.resamples, cap=space_bits)
                    record = {"run": name, "canary": i, "n": n, "block": j, "reference": reference,
                              "estimate": fit.estimate[0], "low": fit.low[0], "high": fit.high[0],
                              "resolvable": math.log2(len(rest) + 1)}
                    record["error"] = abs(record["estimate"] - reference)
                    record["covered"] = record["low"] <= reference <= record["high"]
                    blocks.append(record)
                    if j == 0:
                        rows.append(record)
                        print(f"  N {n}: estimate {record['estimate']:.2f} ({record['low']:.2f}-{record['high']:.2f}) "
                              f"against {reference:.2f}", flush=True)
        for i in range(min(args.timing_canaries, len(secrets)) if name == args.runs.split(",")[0] else 0):
            for label, method, k in [("rank 10000", "rank", 10_000),
                                     *((f"extrapolate {n}", "extrapolate", n) for n in SIZES)]:
                started = time.perf_counter()
                attacks.exposure(loaded.model, loaded.tokenizer, contexts[i:i + 1], secrets[i:i + 1], loaded.device,
                                 candidates=k, seed=args.seed, method=method, resamples=args.resamples)
                timing.setdefault(label, []).append(time.perf_counter() - started)
        del loaded

    print(f"\nruns in {root}; evaluation seed {args.seed}; reference: rank among the pool of {args.reference} less "
          f"the block; {args.resamples} bootstrap resamples; 95% percentile intervals\n")
    print("| run | canary | N | reference (bits) | estimate | 95% interval | abs. error | covered |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['run']} | {r['canary']} | {r['n']} | {r['reference']:.2f} | {r['estimate']:.2f} | "
              f"{r['low']:.2f}-{r['high']:.2f} | {r['error']:.2f} | {'yes' if r['covered'] else 'NO'} |")
    print(f"\nover {args.blocks} disjoint blocks per canary and N (block 0 above):\n")
    print(f"| N | canaries x blocks, reference <= {BAR_BITS:g} bits | within {BAR_ERROR} bits | covered | "
          "median abs. error | all: within | all: covered | median interval width |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for n in SIZES:
        mine = [b for b in blocks if b["n"] == n]
        low = [b for b in mine if b["reference"] <= BAR_BITS]

        def share(items, key):
            return f"{sum(bool(key(b)) for b in items)}/{len(items)}"

        print(f"| {n} | {len(low)} | {share(low, lambda b: b['error'] <= BAR_ERROR)} | "
              f"{share(low, lambda b: b['covered'])} | "
              f"{np.median([b['error'] for b in low]) if low else float('nan'):.2f} | "
              f"{share(mine, lambda b: b['error'] <= BAR_ERROR)} | {share(mine, lambda b: b['covered'])} | "
              f"{np.median([b['high'] - b['low'] for b in mine]):.2f} |")
    base = np.mean(timing["rank 10000"])
    print("\n| exposure of one canary (attacks.exposure, CPU) | seconds | vs rank 10,000 |")
    print("| --- | --- | --- |")
    for label, times in timing.items():
        print(f"| {label} | {np.mean(times):.2f} | {np.mean(times) / base:.2f}x |")


if __name__ == "__main__":
    main()
