"""Benchmark: what one run of the benchmark default costs, by phase, and episodes per CPU-hour (issue 28).

Prints, from one process:
  * a profile of one DP run (static-pairwise, epsilon 2, the embedded default) by phase, as shares of the run's wall
    time: data (build, verbalise, tokenise), model (build or load), forward, backward, per-sample norms and
    clipping, noise, optimizer, evaluation on each split, accounting and the guard, the rest;
  * the wall time of ``--runs`` runs of each configuration in ``--configs`` (interleaved, each run in a fresh
    subprocess so that every configuration starts with cold caches), their median, and episodes per CPU-hour (one CPU
    per run, as a study gives each trial); ``default-memory-returned`` is the default without
    :mod:`raydp.runner.allocator`;
  * the DP / non-private step time ratio on the default.

Times are CPU times on this machine (2 cores here, shared with whatever else runs); compare configurations
within one invocation only. The phases come from cProfile's cumulative times of the functions that implement them
(``PHASES``), so they overlap where one phase calls another (forward inside per-sample gradients); the shares say
where time goes, not a partition.

Issue 28's comparison, this code against 034c558 (before the issue's changes) and the word-level tokenizer:
  git archive 034c558 raydp | tar -x -C /tmp/old034
  python bench/bench_episode.py --runs 1 --configs default,eval-7@/tmp/old034,words-eval-7@/tmp/old034
(``words-eval-7`` needs the ``embedded-words`` preset, which 034c558 lacks: time it with this code, or add the
preset to the old package's copy.)

``--study FILE`` instead runs a study (``raydp study FILE``, into a temporary directory) with every trial's trainable
under cProfile (``RAYDP_PROFILE_DIR``, :data:`raydp.study.trainable.PROFILE_ENV`) and prints a trial's cost by phase:
the run's phases, the controller's start and decisions, checkpoints, the attacks and audit, and what Ray and Tune add
outside the trainables. cProfile slows Python-heavy phases (the controller, reporting) more than the arithmetic.

Run: python bench/bench_episode.py [--runs 2] [--threads 1] [--configs default,eval-start-end]
     python bench/bench_episode.py --study trials/quickstart.yaml
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: phase -> (module suffix, function name) whose cumulative time is the phase's
PHASES = {
    "data: build and verbalise": ("raydp/data/splits.py", "build_dataset"),
    "data: tokenise": ("raydp/model/batches.py", "__init__"),
    "model: load": ("raydp/model/loading.py", "load_model"),
    "train: per-sample gradients (forward+backward)": ("raydp/privacy/clipping.py", "compute"),
    "train: backward": ("torch/_tensor.py", "backward"),
    "train: clip and sum": ("raydp/privacy/engine.py", "clip"),
    "train: noise": ("raydp/privacy/engine.py", "add_noise"),
    "train: optimizer": ("raydp/runner/loop.py", "update"),
    "train: accounting and guard": ("raydp/privacy/guard.py", "admit"),
    "evaluation: private eval split": ("raydp/runner/loop.py", "evaluate"),
    "evaluation: public validation": ("raydp/runner/loop.py", "evaluate_public"),
}

#: a study trial's phases (its trainable profiled, ``--study``): the run's, and what a trial adds around it
TRIAL_PHASES = {
    "the trainable, whole": ("raydp/study/trainable.py", "_run_trial"),
    "train: steps (forward, backward, DP stages, update)": ("raydp/runner/loop.py", "train_step"),
    **{k: v for k, v in PHASES.items() if k != "data: build and verbalise"},  # a study builds its dataset once
    "data: public corpus": ("raydp/data/public.py", "public_corpus"),
    "controller: policy start": ("raydp/runner/launch.py", "start_policy"),
    "controller: decisions": ("raydp/strategies/rldp.py", "between_steps"),
    "checkpoints (state, policy snapshot, Tune report)": ("raydp/study/trainable.py", "checkpoint"),
    "attacks and audit": ("raydp/evaluation/evaluate.py", "evaluate_run"),
}

CONFIGS = {
    "default": {},
    # evaluation only before and after training (no intermediate curve): what a study that needs only the final
    # figure may choose
    "eval-start-end": {"eval_every": 100_000},
    # the evaluation cadence before issue 28 (every 250 steps besides step 0 and epoch ends: 7 in a default run)
    "eval-7": {"eval_every": 250},
    # the word-level tokenizer (~340 tokens per narrative) with the old cadence: the benchmark default as run before
    # the clause tokenizer (issue 28's "today")
    "words-eval-7": {"model": "embedded-words", "eval_every": 250},
    # the default with glibc's own allocator settings (raydp.runner.allocator turned off): the allocator's share
    "default-memory-returned": {},
}
#: environment a configuration's subprocess runs with
CONFIG_ENV = {"default-memory-returned": {"RAYDP_KEEP_FREED_MEMORY": "0"}}
#: the directory holding this checkout's raydp package
HERE = Path(__file__).resolve().parents[1]


def config(name: str, strategy: str = "static-pairwise", **extra):
    from raydp.config import TrainConfig

    values = {"strategy": strategy, **({"epsilon": 2.0} if strategy != "nonprivate" else {}), **CONFIGS[name], **extra}
    return TrainConfig(**values)


def profile(cfg, out: Path) -> dict:
    from raydp.runner.run import run_training

    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    summary = run_training(cfg, out, overwrite=True, progress=False)
    profiler.disable()
    wall = time.perf_counter() - started
    return {"wall": wall, "train_loop": summary["train_loop_seconds"], "steps": summary["steps"],
            "phases": phase_seconds(pstats.Stats(profiler).stats, PHASES)}


def phase_seconds(stats: dict, phases: dict) -> dict:
    """Each phase's cumulative seconds in a cProfile statistics table (``pstats.Stats.stats``)."""
    return {phase: sum(v[3] for (path, _, name), v in stats.items() if path.endswith(module) and name == function)
            for phase, (module, function) in phases.items()}


def profile_study(study_file: str, root: Path) -> dict:
    """Run the study in ``study_file`` (``raydp study``, in a subprocess, into ``root``) with every trial's trainable
    under cProfile (:data:`raydp.study.trainable.PROFILE_ENV`); return its wall time, each trial's phases and what
    Tune measured (the study summary's start latency and per-trial overhead). A grid study on this machine's local
    Ray; a retried trial's attempts count as trials of their own."""
    from raydp.study.config import load_study

    study = load_study(study_file)
    profiles = (root / "trial-profiles").absolute()
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "raydp", "study", study_file, "--results-dir", str(root / "studies"),
                    "--quiet"], env={**os.environ, "RAYDP_PROFILE_DIR": str(profiles)}, check=True,
                   stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    summary = json.loads(next((root / "studies").glob("*/study_summary.json")).read_text())
    trials = {f.stem: phase_seconds(pstats.Stats(str(f)).stats, TRIAL_PHASES) for f in sorted(profiles.glob("*.prof"))}
    unwritten = sorted(profiles.glob("*.partial"))  # a trial's process ended while it wrote its profile
    if unwritten:
        print(f"{len(unwritten)} trial profile(s) were cut off as their process ended, and are left out: "
              + ", ".join(p.name for p in unwritten))
    if not trials:
        raise SystemExit(f"no trial of {study_file} left a profile in {profiles} (a Ray cluster of its own, RAY_ADDRESS, "
                         "does not get this process's environment)")
    # trials at a time: as many as the CPUs hold, at most the study's trials
    slots = max(1, min(len(trials), int((os.cpu_count() or 1) // study.resources.cpus_per_trial)))
    return {"wall": wall, "trials": trials, "concurrency": slots,
            **{k: summary.get(k) for k in ("per_trial_overhead_seconds", "first_trial_start_latency_seconds")}}


def print_study_profile(study_file: str, out: dict) -> None:
    trials = out["trials"]
    names = [name.split("_")[0] for name in trials]  # TRIAL-PID-ID, a trial's name starting with its strategy
    print(f"one study, {study_file}: {len(trials)} trials, {out['wall']:.1f} s wall (`raydp study`, start to exit)")
    print("per trial: seconds (share of its trainable); cProfile's cumulative times, so phases overlap where one calls "
          "another")
    print(f"  {'phase':<52}" + "".join(f"{n[:18]:>20}" for n in names))
    for phase in TRIAL_PHASES:
        cells = [f"{t[phase]:7.1f} ({100 * t[phase] / t['the trainable, whole']:4.1f}%)" for t in trials.values()]
        print(f"  {phase:<52}" + "".join(f"{c:>20}" for c in cells))
    slots = out["concurrency"]
    outside = (out["wall"] * slots - sum(t["the trainable, whole"] for t in trials.values())) / len(trials)
    print(f"Ray, Tune and the study around the trainables: {outside:.1f} slot-seconds per trial (the study's wall times "
          f"{slots} slots, less the trainables: Ray's start, the study's preparation and report, the trial processes' "
          f"start and imports, idle slots). Tune's own figures: the first trial started "
          f"{out['first_trial_start_latency_seconds']} s after the Tuner; {out['per_trial_overhead_seconds']} s per trial "
          "inside the trainable but outside the run (imports, policy start, reporting)")
    print("The profiles' call counts and times are unprotected: they give the private splits' record counts and the "
          "total of the secret Poisson batch sizes (keep them private)")


def timed(cfg, out: Path) -> float:
    from raydp.runner.run import run_training

    started = time.perf_counter()
    run_training(cfg, out, overwrite=True, progress=False)
    return time.perf_counter() - started


def timed_elsewhere(name: str, package: str, threads: int) -> float:
    """One run of ``name`` with the raydp package in the directory ``package`` (this checkout or another commit's), in
    a fresh subprocess: every configuration pays the same imports and cold caches."""
    path = os.pathsep.join(p for p in (os.path.abspath(package), os.environ.get("PYTHONPATH")) if p)
    result = subprocess.run([sys.executable, os.path.abspath(__file__), "--time-one", name, "--threads", str(threads)],
                            env={**os.environ, **CONFIG_ENV.get(name, {}), "PYTHONPATH": path}, capture_output=True,
                            text=True, check=True)
    return float(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (a study gives each trial 1)")
    parser.add_argument("--configs", default="default,eval-start-end",
                        help="configurations to time with this code; a name@DIR times it with the raydp package in DIR "
                             "(for example another commit: git archive REV raydp | tar -x -C DIR)")
    parser.add_argument("--study", default=None, metavar="FILE",
                        help="instead: run this study file (for example trials/quickstart.yaml) with every trial "
                             "profiled, and print a trial's cost by phase, the controller, checkpoints, attacks and Ray "
                             "and Tune included")
    parser.add_argument("--time-one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    os.environ.setdefault("WANDB_MODE", "disabled")
    root = Path(tempfile.mkdtemp(prefix="bench-episode-"))
    if args.time_one:  # a subprocess of --configs NAME@DIR: print the wall time only
        print(timed(config(args.time_one), root / args.time_one))
        return
    if args.study:
        out = profile_study(args.study, root)
        print_study_profile(args.study, out)
        (root / "bench_episode.json").write_text(json.dumps(out, indent=2))
        print(f"(raw figures in {root / 'bench_episode.json'})")
        return
    names = args.configs.split(",")

    first = profile(config(names[0].split("@")[0]), root / "profile")
    print(f"one DP run of the benchmark default ({first['steps']} steps, {args.threads} thread(s)): "
          f"{first['wall']:.1f} s wall, training loop {first['train_loop']:.1f} s")
    for phase, seconds in first["phases"].items():
        print(f"  {phase:<48} {seconds:7.1f} s  {100 * seconds / first['wall']:5.1f}%")

    walls = {name: [] for name in names}
    for _ in range(args.runs):
        for name in names:  # interleaved: fair under drifting load
            config_name, _, package = name.partition("@")
            walls[name].append(timed_elsewhere(config_name, package or str(HERE), args.threads))
    base = statistics.median(walls[names[0]])
    print(f"\nwall per run, median of {args.runs} (episodes per CPU-hour at {args.threads} CPU per run):")
    for name in names:
        med = statistics.median(walls[name])
        print(f"  {name:<20} {med:7.1f} s   {3600 / (med * args.threads):6.1f} episodes/CPU-hour   "
              f"{med / base:5.2f}x of {names[0]}")

    base = names[0].split("@")[0]
    from raydp.runner.run import run_training

    loops = {}
    for strategy in ("static-pairwise", "nonprivate"):  # not under cProfile, which slows Python-heavy code more
        summary = run_training(config(base, strategy=strategy, max_steps=100, eval_every=100_000),
                               root / strategy, overwrite=True, progress=False)
        loops[strategy] = summary["train_loop_seconds"] / summary["steps"]
    print(f"\nDP / non-private training loop per step (100 steps; DP: Poisson batches of expected size at the fixed "
          f"width, non-private: fixed batches at their longest record's width): "
          f"{loops['static-pairwise'] / loops['nonprivate']:.2f}\n"
          "(the same batch through both steps: bench/bench_dp_step.py)")
    (root / "bench_episode.json").write_text(json.dumps({"profile": first, "walls": walls}, indent=2))
    print(f"(raw figures in {root / 'bench_episode.json'})")


if __name__ == "__main__":
    main()
