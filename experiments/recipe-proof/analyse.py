"""Tables of the recipe's checks and proof: each arm's final value-token NLL per epsilon (mean +- sd over seeds), its
share of non-private's gain against each non-private reference, and Welch's t-tests between arms, Holm-corrected
over the epsilon cells of a comparison.

  python experiments/recipe-proof/analyse.py --metric eval \\
      --arm v1=runs/studies/recipe-check-v1 --arm v0=runs/studies/recipe-check-v0 \\
      --reference default=runs/studies/schedule-final:nonprivate --reference tuned=runs/studies/recipe-check-nonprivate \\
      --compare v1:v0

An arm is LABEL=STUDY_DIR[,STUDY_DIR...][:STRATEGY] (the studies' trials of that strategy; default: its one DP strategy, or
nonprivate for a reference). ``--metric eval`` reads the private eval split (reference only, not a DP release),
``public`` the selection split (the study's public validation records). ``--quantity value-nll`` is the value-token
NLL in nats per record (structured records); ``log-perplexity`` is the log of the perplexity, nats per token, for free
text (whose runs report no value spans): times the eval split's tokens per text it is the NLL per text, and a share
of the gain is the same in either. The untrained model's value is each trial's step-0 evaluation (the same for every
trial of one dataset; checked). ``--unprotected LABEL`` marks an arm chosen without privacy (printed NOT PRIVATE).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

from scipy import stats


def value(summary: dict, when: str, metric: str, quantity: str) -> float:
    if quantity == "value-nll":
        return summary[f"{when}_{metric}_value_nll"]
    return math.log(summary[f"{when}_{metric}_perplexity"])


def read_arm(spec: str, reference: bool, metric: str, quantity: str, seeds: set | None) -> tuple[str, dict, float]:
    """LABEL=DIR[:STRATEGY] -> (label, {epsilon or None: {seed: value}}, the untrained value)."""
    label, _, where = spec.partition("=")
    directories, _, strategy = where.partition(":")
    cells, untrained = defaultdict(dict), set()
    files = [f for d in directories.split(",") for f in sorted(Path(d, "trials").glob("*/summary.json"))]
    for summary_file in files:
        config = json.loads(summary_file.with_name("config.json").read_text())
        if strategy and config["strategy"] != strategy:
            continue
        if not strategy and (config["strategy"] == "nonprivate") != reference:
            continue
        if seeds is not None and config["seed"] not in seeds:
            continue
        summary = json.loads(summary_file.read_text())
        epsilon = None if config["strategy"] == "nonprivate" else float(config["epsilon"])
        cells[epsilon][config["seed"]] = value(summary, "final", metric, quantity)
        untrained.add(round(value(summary, "initial", metric, quantity), 6))
    if not cells:
        raise SystemExit(f"{spec}: no finished trial")
    if len(untrained) != 1:
        raise SystemExit(f"{spec}: trials disagree on the untrained value ({sorted(untrained)}): not one dataset")
    return label, dict(cells), untrained.pop()


DIGITS = {"value-nll": 3, "log-perplexity": 5}
digits = 3


def mean_sd(values) -> str:
    values = list(values)
    sd = statistics.stdev(values) if len(values) > 1 else float("nan")
    return f"{statistics.mean(values):.{digits}f} ± {sd:.{digits}f}"


def holm(pvalues: list[float]) -> list[float]:
    order = sorted(range(len(pvalues)), key=pvalues.__getitem__)
    adjusted, running = [0.0] * len(pvalues), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(pvalues) - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--metric", choices=("eval", "public"), default="eval")
    parser.add_argument("--arm", action="append", default=[], help="LABEL=STUDY_DIR[:STRATEGY]")
    parser.add_argument("--reference", action="append", default=[], help="LABEL=STUDY_DIR[:STRATEGY] (non-private)")
    parser.add_argument("--compare", action="append", default=[], help="A:B, Welch per epsilon, Holm over them")
    parser.add_argument("--quantity", choices=("value-nll", "log-perplexity"), default="value-nll")
    parser.add_argument("--seeds", help="only these seeds, e.g. 0,1,2 (default: every finished one)")
    parser.add_argument("--unprotected", action="append", default=[], help="an arm chosen without privacy")
    args = parser.parse_args()
    global digits
    digits = DIGITS[args.quantity]
    seeds = None if args.seeds is None else {int(x) for x in args.seeds.split(",")}
    arms = [read_arm(a, False, args.metric, args.quantity, seeds) for a in args.arm]
    refs = [read_arm(r, True, args.metric, args.quantity, seeds) for r in args.reference]
    untrained = {u for _, _, u in arms + refs}
    if len(untrained) != 1:
        raise SystemExit(f"the arms were evaluated on different data (untrained {sorted(untrained)})")
    zero = untrained.pop()
    ref_means = {label: statistics.mean(next(iter(cells.values())).values()) for label, cells, _ in refs}
    split = "private eval split (not a DP release)" if args.metric == "eval" else "public validation records"
    unit = ("value-token NLL", "nats per record") if args.quantity == "value-nll" else ("log perplexity", "nats per token")
    print(f"final {unit[0]}, {split}, {unit[1]}; untrained {zero:.4f}")
    for label, cells, _ in refs:
        (values,) = cells.values()
        print(f"  non-private {label}: {mean_sd(values.values())} (seeds {sorted(values)}), gain {zero - ref_means[label]:.3f}")
    print()
    head = "| epsilon | arm | seeds | mean ± sd |" + "".join(f" share vs {r} |" for r in ref_means)
    print(head)
    print("|" + " --- |" * (head.count("|") - 1))
    for epsilon in sorted({e for _, cells, _ in arms for e in cells}):
        for label, cells, _ in arms:
            if epsilon not in cells:
                continue
            values = list(cells[epsilon].values())
            shares = [(zero - statistics.mean(values)) / (zero - m) for m in ref_means.values()]
            name = f"{label} (NOT PRIVATE: chosen without noise)" if label in args.unprotected else label
            print(f"| {epsilon:g} | {name} | {len(values)} | {mean_sd(values)} |" + "".join(f" {s:.1%} |" for s in shares))
    named = {label: cells for label, cells, _ in arms}
    for pair in args.compare:
        a, b = pair.split(":")
        epsilons = sorted(set(named[a]) & set(named[b]))
        tests = [stats.ttest_ind(list(named[a][e].values()), list(named[b][e].values()), equal_var=False)
                 for e in epsilons]
        adjusted = holm([t.pvalue for t in tests])
        print(f"\n{a} - {b}: Welch's t per epsilon, Holm over the {len(epsilons)} cells (negative: {a} lower, better)")
        for e, t, p in zip(epsilons, tests, adjusted):
            diff = statistics.mean(named[a][e].values()) - statistics.mean(named[b][e].values())
            print(f"  epsilon {e:g}: {diff:+.{digits}f} nats (t = {t.statistic:.2f}, p = {t.pvalue:.3g}, Holm p = {p:.3g})")


if __name__ == "__main__":
    main()
