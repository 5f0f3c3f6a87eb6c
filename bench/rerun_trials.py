"""Rerun a finished study's trials in this process, one after another, with whatever raydp package comes first on the
path: the "before" arm of a paired check against older code (issue 28, ``experiments/throughput/throughput-rounding.yaml``). A study
cannot do it, because Ray's workers import raydp from the installed package, not from the driver's PYTHONPATH.

Each trial's ``config.json`` (its dataset is the study's built one) runs as ``raydp train`` would, into OUT/TRIAL;
the final value-token NLL on the private eval and public validation splits is printed per trial.

  git archive b0aba68 raydp | tar -x -C /tmp/oldb0a
  PYTHONPATH=/tmp/oldb0a python bench/rerun_trials.py runs/studies/throughput-rounding /tmp/before
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study_dir", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    import torch

    import raydp
    from raydp.config import TrainConfig
    from raydp.runner.run import run_training

    torch.set_num_threads(1)
    print(f"raydp from {Path(raydp.__file__).parent}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    for trial in sorted(p for p in (args.study_dir / "trials").iterdir() if (p / "config.json").exists()):
        config = TrainConfig(**json.loads((trial / "config.json").read_text()))
        summary = run_training(config, args.out / trial.name, overwrite=True, progress=False)  # charged like any run
        print(trial.name, summary["final_eval_value_nll"], summary["final_public_value_nll"], flush=True)


if __name__ == "__main__":
    main()
