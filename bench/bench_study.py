"""Benchmark: what a whole study costs, arm against arm (issue 47's targets for the README's main job).

Runs ``raydp study`` on one study file in several arms, each arm the file with some top-level keys changed,
``--invocations`` times each, interleaved (arm 1, arm 2, ..., arm 1, arm 2, ...: fair under drifting load), each
in a fresh subprocess and a fresh results directory, and prints per arm:
  * the study's wall time, start to exit of ``raydp study`` (median, and the range over invocations);
  * the trials it attacked, and an attacked trial's attacks and audit (``evaluation.json``'s ``seconds.total``);
  * a trial's own time (``trial_seconds`` in the results table: training and evaluation, not its attacks);
  * the median's ratio to the first arm's, with the range of the per-invocation ratios (invocation i of each arm
    ran next to the others' invocation i).
Every invocation uses the same HOME, so the model cache is warm after the first (run one invocation before timing
if the cache is cold). Times are this machine's (2 cores here); compare arms within one invocation of the bench only.

Issue 47, decision 1 (attack what a study would release, against today's every-trial attacks):
  python bench/bench_study.py trials/quickstart.yaml --arm released --arm "all:attack=all;attack_strategies="

An arm is ``NAME[@DIR][:KEY=VALUE;...]``: each VALUE is YAML and replaces the study file's top-level KEY (an empty
VALUE removes the key); ``@DIR`` runs it with the raydp package in DIR (another commit: ``git archive REV raydp
policies | tar -x -C DIR``), else this checkout's. Relative paths in the file are resolved against its directory first
(as ``raydp study`` does).

Issue 47 as measured: today's every-trial attacks and decision 1 as first built (commit 9f75418, in /tmp/h9f), against
this code:
  python bench/bench_study.py trials/quickstart.yaml --arm "all@/tmp/h9f:attack=all;attack_strategies=" \
      --arm released@/tmp/h9f --arm released
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml


def parse_arm(text: str) -> tuple[str, dict]:
    """``NAME[@DIR][:KEY=VALUE;...]`` -> (``NAME[@DIR]``, {key: value or None to remove})."""
    name, _, rest = text.partition(":")
    changes = {}
    for item in filter(None, (part.strip() for part in rest.split(";"))):
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"an arm's change is KEY=VALUE, got {item!r}")
        changes[key.strip()] = yaml.safe_load(value) if value.strip() else None
    return name.strip(), changes


def arm_file(study_file: Path, changes: dict, where: Path) -> Path:
    """The study file with ``changes`` applied and its relative paths made absolute, written into ``where``."""
    from raydp.study.config import resolve_study_paths

    values = resolve_study_paths(yaml.safe_load(study_file.read_text()), study_file)
    for key, value in changes.items():
        if value is None:
            values.pop(key, None)
        else:
            values[key] = value
    out = where / study_file.name
    where.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(values, sort_keys=False))
    return out


def package_env(package: str | None) -> dict:
    """The environment of a subprocess that imports the raydp package in ``package`` (None: this checkout's)."""
    env = dict(os.environ)
    if package:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.abspath(package), env.get("PYTHONPATH")) if p)
    return env


def imported_package(package: str | None, cwd: Path) -> Path:
    """Where a subprocess run as :func:`run_study` runs it imports raydp from."""
    out = subprocess.run([sys.executable, "-c", "import raydp; print(raydp.__file__)"], env=package_env(package),
                         cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()
    return Path(out).resolve().parent


def run_study(path: Path, results: Path, package: str | None) -> dict:
    """One ``raydp study`` in a subprocess (with the raydp package in ``package``, else this checkout's): its wall
    time, and what its results directory says it cost."""
    env = package_env(package)
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "raydp", "study", str(path), "--results-dir", str(results), "--quiet"],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                   cwd=results.parent)  # not the checkout: `python -m` puts the working directory first on sys.path
    wall = time.perf_counter() - started
    study_dir = next(results.glob("*/study_summary.json")).parent
    summary = json.loads((study_dir / "study_summary.json").read_text())
    attacks = []
    for evaluation in sorted(study_dir.glob("trials/*/evaluation.json")):
        seconds = (json.loads(evaluation.read_text()).get("seconds") or {}).get("total")
        if seconds is not None:
            attacks.append(float(seconds))
    import pandas as pd

    table = pd.read_parquet(study_dir / "results.parquet")
    trial_seconds = [float(v) for v in table.get("trial_seconds", pd.Series(dtype=float)).dropna()]
    return {"wall": wall, "attacked": len(attacks), "attack_seconds": attacks, "trial_seconds": trial_seconds,
            "trials": int(len(table)), "attacked_trials": summary.get("attacked")}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):7.1f} s [{min(values):.1f}, {max(values):.1f}]" if values else "      -"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study", help="a study file (for example trials/quickstart.yaml)")
    parser.add_argument("--arm", action="append", required=True,
                        help="NAME[:KEY=VALUE;...] (repeat; the first is the reference)")
    parser.add_argument("--invocations", type=int, default=3)
    args = parser.parse_args()
    arms = [parse_arm(a) for a in args.arm]
    root = Path(tempfile.mkdtemp(prefix="bench-study-"))
    files = {name: arm_file(Path(args.study).resolve(), changes, root / "files" / f"arm{k}")
             for k, (name, changes) in enumerate(arms)}
    (root / "results").mkdir(parents=True, exist_ok=True)
    for name, _ in arms:
        package = name.partition("@")[2] or None
        where = imported_package(package, root / "results")
        print(f"{name}: raydp from {where}", flush=True)
        if package and Path(package).resolve() not in where.parents:
            raise SystemExit(f"{name}: the subprocess imports raydp from {where}, not from {package}")
    runs: dict[str, list[dict]] = {name: [] for name, _ in arms}
    for i in range(args.invocations):
        for k, (name, _) in enumerate(arms):
            out = run_study(files[name], root / "results" / f"arm{k}-{i}", name.partition("@")[2] or None)
            runs[name].append(out)
            print(f"invocation {i + 1}, {name}: {out['wall']:.1f} s, {out['attacked']} of {out['trials']} trials "
                  f"attacked", flush=True)
    first = arms[0][0]
    print(f"\n{args.study}: {args.invocations} invocations per arm, interleaved; median [min, max]")
    print(f"  {'arm':<18} {'study wall':>26} {'attacked':>9} {'an attack (each)':>26} {'a trial (no attacks)':>26}"
          f"  {'wall / ' + first:>22}")
    for name, _ in arms:
        walls = [r["wall"] for r in runs[name]]
        ratios = [r["wall"] / b["wall"] for r, b in zip(runs[name], runs[first])]
        attacks = [s for r in runs[name] for s in r["attack_seconds"]]
        trials = [s for r in runs[name] for s in r["trial_seconds"]]
        ratio = statistics.median(walls) / statistics.median([r["wall"] for r in runs[first]])
        print(f"  {name:<18} {spread(walls):>26} {runs[name][0]['attacked']:>9} {spread(attacks):>26} "
              f"{spread(trials):>26}  {ratio:6.2f}x [{min(ratios):.2f}, {max(ratios):.2f}]")
    (root / "bench_study.json").write_text(json.dumps(runs, indent=2))
    print(f"(raw figures in {root / 'bench_study.json'})")


if __name__ == "__main__":
    main()
