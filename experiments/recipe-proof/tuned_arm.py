"""Arm (d) of the recipe's proof: write tuned-eps{E}.yaml, the 5-seed study of each epsilon's search winner.

Reads each search's ``study_summary.json`` (``search_best``: the lowest final held-out metric of its 16 trials,
the value-token NLL for the records, perplexity for the letters, chosen without noise: NOT private) and writes a grid study that runs those values at seeds 0-4 on the same
data and base as the other arms. ``tuned_from`` reads public searches only, so the values are written out.

Run: python experiments/recipe-proof/tuned_arm.py runs/studies [--letters]   (the directory holding the searches)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
RUN_FIELDS = ("lr", "lr_decay", "lr_end", "warmup_steps")
#: the two tables: the study names' prefix, the private data and the held-out records
KINDS = {"structured": ("proof-", {"source": "data/unseen.csv"}, "data/unseen-holdout.csv", "the hospital's held-out records"),
         "letters": ("proof-letters-", {"source": "data/letters.csv", "text_column": "letter",
                                        "unit_column": "patient"}, "data/letters-holdout.csv", "held-out letters")}


def study_file(best: dict, epsilon: float, search: str, kind: str) -> str:
    prefix, data, holdout, _ = KINDS[kind]
    base = {"recipe": "none", "data": data, "public_validation": holdout, "epochs": 3, "batch_size": 16, "weight_decay": 0.0,
            **{k: best[k] for k in RUN_FIELDS}}
    study = {"name": f"{prefix}tuned-eps{epsilon:g}",
             "description": f"arm (d) - the values static-pairwise's search chose on {KINDS[kind][3]} without noise "
                            f"(NOT private), epsilon {epsilon:g}, 5 seeds",
             "models": ["embedded"], "epsilons": [epsilon], "seeds": [0, 1, 2, 3, 4],
             "strategies": ["static-pairwise"], "strategy_settings": {"static-pairwise": {"clip": best["clip"]}},
             "resources": {"cpus_per_trial": 1}, "private_data": True, "base": base}
    head = (f"# Arm (d) of the recipe's proof at epsilon {epsilon:g} (README.md here), written by tuned_arm.py from\n"
            f"# {search}'s search_best: chosen on held-out records WITHOUT noise, an upper bound that is not private.\n")
    return head + yaml.safe_dump(study, sort_keys=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("studies", help="the directory holding the proof-[letters-]tuned-search-eps* studies")
    parser.add_argument("--letters", action="store_true", help="the letters' searches (default: the structured)")
    args = parser.parse_args()
    kind = "letters" if args.letters else "structured"
    prefix = KINDS[kind][0]
    for eps in (0.5, 2.0, 8.0):
        search = f"{prefix}tuned-search-eps{eps:g}"
        summary = json.loads((Path(args.studies) / search / "study_summary.json").read_text())
        (cell,) = [c for c in summary["search_best"] if c["epsilon"] == eps]
        out = HERE / f"{prefix.removeprefix('proof-')}tuned-eps{eps:g}.yaml"
        out.write_text(study_file(cell["best"], eps, search, kind))
        (metric,) = [k for k in cell if k.startswith("final_public_")]  # the metric the search selected on
        print(f"wrote {out}: {cell['best']} (held-out {metric.removeprefix('final_public_')} {cell[metric]:.4f})")


if __name__ == "__main__":
    main()
