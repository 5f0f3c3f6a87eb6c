"""What `raydp study` prints: a short, plain log a new user can read.

One tiny study (the non-private arm and RLDP with its own policy, attacked and audited) runs once through `raydp
study` in a subprocess, its stdout and stderr pipes (not a terminal); every test of it reads that output: at most 120
lines of at most 160 characters, no ANSI escape, no carriage return, none of Ray Tune's tables or hints nor RLlib's
notices; a line per finished trial; one compact table per (model, epsilon) whose every number is in
study_summary.json, with the trial the study would release marked and recorded; the attack and audit line per trial.
The rest are fast tests of the formatting on hand-made results (one seed: no NaN, "1 seed: no test"; three seeds:
mean ± sd), of the trial a study would release, of a stopped study's header, and of the filters of third-party notices.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

#: the tiny study: the non-private arm and one DP arm, RLDP with a policy of its own (whose RLlib actors print the
#: notices raydp filters), on the tiny embedded model, a few steps, attacked and audited
OUTPUT_STUDY = {
    "name": "tinyout",
    "models": ["embedded-tiny"],
    "epsilons": [2.0],
    "seeds": [0],
    "strategies": ["nonprivate", "rldp"],
    "sac_grid": {"t_rl": [4], "b_sac": [4], "k": [2]},
    "strategy_settings": {"rldp": {"t_warm": 4, "n_max": 8, "hidden": 32}},
    "resources": {"cpus_per_trial": 1},
    "wandb": {"mode": "disabled"},
    "base": {"data": {"n_records": 400, "n_audit": 20}, "max_steps": 16, "eval_every": 8, "eval_max_records": 16,
             "warmup_steps": 4},
    "evaluate": {"generations": 20, "exposure_candidates": 50, "membership_records": 16},
    "attack_strategies": ["nonprivate"],  # attack: released (the default): the released trial, and the non-private
}
MAX_LINES, MAX_WIDTH = 120, 160
ARM = "rldp T_RL=4 B_SAC=4 K=2"  # the DP arm's full label


@pytest.fixture(scope="module")
def printed(tmp_path_factory, raydp_cache):
    """(stdout, stderr, study directory) of `raydp study` on the tiny study, run once."""
    root = tmp_path_factory.mktemp("output")
    path = root / "tinyout.yaml"
    path.write_text(yaml.safe_dump(OUTPUT_STUDY))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAYDP_TUNE_VERBOSE", "TQDM_DISABLE",
                                                            "RAY_COLOR_PREFIX")}
    run = subprocess.run([sys.executable, "-m", "raydp", "study", str(path), "--results-dir", str(root / "out")],
                         env=env, capture_output=True, text=True, timeout=900, cwd=root)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout, run.stderr, root / "out" / "tinyout"


def _table_rows(stdout: str) -> list[str]:
    """The compact table's rows (the header and the arms, the references included) of the one cell."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("embedded-tiny, epsilon 2:"))
    rows = []
    for line in lines[start + 1:]:
        if not line.startswith("  ") or line.startswith("  * the trial") or line.startswith("  share of"):
            break
        rows.append(line)
    return rows


def test_the_output_is_short_narrow_and_plain(printed):
    stdout, stderr, _ = printed
    lines = (stdout + stderr).splitlines()
    assert len(lines) < MAX_LINES, len(lines)
    assert max(len(line) for line in lines) <= MAX_WIDTH, max(lines, key=len)
    assert "\x1b[" not in stdout + stderr and "\r" not in stdout + stderr
    for noise in ("╭", "Current best trial", "Trial status", "Tuner.restore", "View detailed results",
                  "Token authentication is enabled", "DeprecationWarning", "new API stack", "gputil", "Traceback"):
        assert noise not in stdout + stderr, noise


def test_each_finished_trial_prints_one_line(printed):
    _, stderr, _ = printed
    trial_lines = [line for line in stderr.splitlines() if re.match(r"\[\d/2\] ", line)]
    assert len(trial_lines) == 2, stderr[-2000:]
    assert {line.split(" ", 2)[1] for line in trial_lines} == {"nonprivate", "rldp"}
    for line in trial_lines:
        assert re.search(r": value NLL \d+\.\d\d \(public\), \d+ s$", line), line


def test_the_table_marks_the_trial_it_would_release_and_the_summary_records_it(printed):
    from raydp.study.results import would_release

    stdout, _, study_dir = printed
    summary = json.loads((study_dir / "study_summary.json").read_text())
    results = pd.read_parquet(study_dir / "results.parquet")
    expected = would_release(results, "final_public_value_nll")
    assert len(expected) == 1 and expected["arm"].iloc[0] == ARM
    assert summary["would_release"] == [{"model": "embedded-tiny", "epsilon": 2.0, "trial": expected["trial"].iloc[0],
                                         "arm": ARM, "seed": 0}]
    rows = _table_rows(stdout)
    header = rows[0]
    assert "public validation (selects)" in header and "private eval (not DP)" in header
    assert "share of non-private gain" in header and "epsilon spent" in header
    marked = [r for r in rows[1:] if r.lstrip().startswith("*")]
    assert len(marked) == 1 and "rldp [1]" in marked[0] and "(1 seed)" in marked[0]
    assert f"  [1] {ARM}" in stdout  # the footnote: the arm's full label
    assert f"the trial this study would release: {expected['trial'].iloc[0]}" in stdout
    assert summary["finished_trials"] == summary["planned_trials"] == 2 and summary["partial"] is False
    assert stdout.splitlines()[0] == "study tinyout: 2 of 2 trials finished"


def _numbers(row: str) -> list[str]:
    """The figures of a table row (its arm's name, which may hold a footnote number, left out)."""
    cells = re.split(r"\s{2,}", row.strip().lstrip("*").strip())
    return [n for cell in cells[1:] for n in re.findall(r"\d+(?:\.\d+)?", cell)]


def _flat_numbers(value) -> set[float]:
    if isinstance(value, bool):
        return set()
    if isinstance(value, (int, float)):
        return {float(value)}
    if isinstance(value, dict):
        return set().union(*(_flat_numbers(v) for v in value.values())) if value else set()
    if isinstance(value, list):
        return set().union(*(_flat_numbers(v) for v in value)) if value else set()
    return set()


def test_every_number_of_the_table_is_in_the_summary(printed):
    stdout, _, study_dir = printed
    summary = json.loads((study_dir / "study_summary.json").read_text())
    recorded = _flat_numbers(summary["results_table"])
    rows = _table_rows(stdout)[1:]
    assert len(rows) == 3  # the DP arm, the non-private arm, the untrained model
    for row in rows:
        numbers = _numbers(row)
        assert numbers, row
        for n in numbers:
            assert float(n) in recorded, (n, row)
    # and the figures are the results' own, rounded as printed
    results = pd.read_parquet(study_dir / "results.parquet")
    dp = results[results["strategy"] == "rldp"].iloc[0]
    cell = summary["results_table"]["cells"][0]
    assert cell["arms"][0]["public"] == round(dp["final_public_value_nll"], 2)
    assert cell["arms"][0]["private"] == round(dp["final_eval_value_nll"], 2)
    assert cell["arms"][0]["epsilon_spent"] == round(dp["epsilon"], 2)


def test_the_summary_holds_only_classified_fields(printed):
    """What the table adds to study_summary.json is classified like every other field of a releasable file (the
    attack figures, private, are not in it)."""
    from releasable import unclassified_study

    _, _, study_dir = printed
    results = pd.read_parquet(study_dir / "results.parquet")
    nonprivate = list(results[results["strategy"] == "nonprivate"]["trial"])
    assert unclassified_study(study_dir, nonprivate_trials=nonprivate) == []
    assert "mia" not in (study_dir / "study_summary.json").read_text()


def test_attacks_audit_and_privacy_are_one_line_each(printed):
    stdout, stderr, _ = printed
    attacks = [line for line in stdout.splitlines() if "membership AUC" in line]
    assert len(attacks) == 2 and all("canaries" in a and "audit epsilon >=" in a for a in attacks)
    # attack: released (the default) after the trials: the released trial and, named, the non-private one
    assert "attacked: the trial this study would release in each cell, and every nonprivate trial" in stdout
    summary = json.loads((printed[2] / "study_summary.json").read_text())
    assert summary["attacked"]["rule"] == "released" and len(summary["attacked"]["trials"]) == 2
    # both after the trials, on the driver, each announced on stderr
    assert sum(line.startswith("raydp: attacking ") for line in stderr.splitlines()) == 2
    assert "attacked: the trial this study would release in each (model, epsilon) cell" in \
        (printed[2] / "report.html").read_text()
    assert any(a.lstrip().startswith("rldp [1] eps 2 seed 0:") and "(spent " in a for a in attacks)
    assert re.search(r"tuning-aware epsilon \d+\.\d{3} at delta 1e-05", stdout)
    assert "Table 2 analogue" in stdout and "Table 3 analogue" in stdout  # the study has an RLDP trial
    assert "no DP baseline in this study" in stdout and "RLDP against" not in stdout  # nothing to test it against
    assert "nan" not in stdout.lower().replace("non-", "")


# -- fast: the formatting on hand-made results ----------------------------------------------------------------------
def _hand_results(seeds, rldp=True, status="TERMINATED"):
    """A finished study's results table: non-private, two static-pairwise variants, clip-schedule and (with ``rldp``)
    frozen RLDP at epsilon 2, value-token NLL on both splits; the static-pairwise [clip=0.01] arm is best on public
    validation."""
    arms = {("nonprivate", None, None): (63.0, 65.0), ("static-pairwise", 2.0, "clip=0.01"): (64.0, 66.0),
            ("static-pairwise", 2.0, "clip=0.1"): (64.5, 66.4), ("clip-schedule", 2.0, None): (64.2, 66.1)}
    if rldp:
        arms[("rldp", 2.0, "lr=0.009049911227773816, lr_decay=cosine, rescale_moments=True, t_warm=24, "
                           "residual_range=0.7")] = (64.1, 66.2)
    rows = []
    for (strategy, eps, variant), (private, public) in arms.items():
        for seed in seeds:
            rl = strategy == "rldp"
            rows.append({
                "trial": f"{strategy}_m_eps{eps:g}_seed{seed}" + (f"_{variant[:9]}" if variant else "") if eps
                else f"{strategy}_m_seed{seed}",
                "status": status, "model": "m", "strategy": strategy, "epsilon_target": eps if eps else math.nan,
                "seed": seed, "variant": variant, "t_rl": 24.0 if rl else None, "b_sac": 16.0 if rl else None,
                "k": 8.0 if rl else None, "frozen_policy": rl, "run_dir": "/nonexistent", "steps": 10,
                "planned_steps": 10, "initial_eval_value_nll": 70.0, "initial_public_value_nll": 72.0,
                "final_eval_value_nll": private + 0.05 * seed, "final_public_value_nll": public + 0.05 * seed,
                "final_eval_perplexity": 5.0, "final_public_perplexity": 5.1,
                "epsilon": 1.98 if eps else math.nan, "within_budget": True if eps else None,
                "selection_split": "public", "selection_metric": "value_nll", "steps_to_target": math.nan,
                "mia_auc": 0.51, "mia_cal_auc": 0.5, "canary_exact_matches": 0, "canary_n_valid": 20,
                "exposure_mean": 1.2, "exposure_max": 2.5, "audit_epsilon_one_run": 0.0, "audit_consistent": True})
    return pd.DataFrame(rows)


def _hand_study(root: Path, results: pd.DataFrame, **summary) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    results.to_parquet(root / "results.parquet")
    (root / "study_summary.json").write_text(json.dumps({
        "study": "hand", "selection": {"split": "public", "metric": "value_nll",
                                       "note": "selection used the public validation split (E15)"},
        "tuning_aware_epsilon": {"rdi1:" + "a" * 32: {
            "runs": 4, "trials": 4, "target_epsilons": [2.0], "tuning_aware_epsilon": 3.5, "delta": 1e-5,
            "max_single_trial_epsilon_rdp": 2.1, "repeat_and_select_epsilon_rdp": 2.5, "labels": [],
            "warnings": ["non-private trial(s) trained on this dataset: anything derived from them (models, metrics) "
                         "has no DP guarantee; the figure covers the DP runs only: nonprivate_m_seed0"]}},
        **summary}))
    return root


def test_one_seed_prints_no_nan_and_no_test_instead_of_a_p_value(tmp_path):
    from raydp.study.tables import format_report, format_study

    study = _hand_study(tmp_path / "one", _hand_results([0]))
    out = format_study(study)
    assert "nan" not in out.lower().replace("non-", "") and "Holm p=1" not in out
    assert "(1 seed)" in out and "±" not in out.split("Attacks")[0]
    assert "gate: N/A (1 seed: no test): m: non-private vs static-pairwise" in out
    assert "m eps 2: RLDP 1 seed: no test (rldp [" in out  # the verdict names arms by their short names
    assert "m eps 2: 1 seed: no test: clip-schedule vs static-pairwise [" in out
    assert "m: NOT JUDGED: one seed in every cell" in out and "NOT MET" not in out
    assert max(len(line) for line in out.splitlines()) <= MAX_WIDTH  # the long RLDP label is a wrapped footnote
    assert "[2] rldp [lr=0.009049911227773816" in out
    assert "Table 2 analogue" in out  # the study has an RLDP trial
    full = format_report(study)
    assert "nan pooled sd" not in full and "1 seed: no test" in full


def test_three_seeds_print_mean_and_sd_and_release_the_best_arms_best_seed(tmp_path):
    from raydp.study.tables import format_study, record_outcome

    study = _hand_study(tmp_path / "three", _hand_results([0, 1, 2]))
    out = format_study(study)
    best = next(line for line in out.splitlines() if line.lstrip().startswith("*"))
    assert "static-pairwise [1]" in best and "66.05 ± 0.05 (3 seeds)" in best and "1.98" in best
    assert "the trial this study would release: static-pairwise_m_eps2_seed0_clip=0.01" in out
    record = record_outcome(study)
    assert record["would_release"] == [{"model": "m", "epsilon": 2.0, "trial": "static-pairwise_m_eps2_seed0_clip=0.01",
                                        "arm": "static-pairwise [clip=0.01]", "seed": 0}]
    saved = json.loads((study / "study_summary.json").read_text())
    assert saved["would_release"] == record["would_release"] and saved["study"] == "hand"  # added, nothing lost
    cell = saved["results_table"]["cells"][0]
    assert [a["name"] for a in cell["arms"]] == ["static-pairwise [1]", "clip-schedule", "rldp [2]",
                                                 "static-pairwise [3]"]
    assert cell["arms"][0]["public_sd"] == 0.05 and cell["nonprivate"]["gain_share_pct"] == 100


def test_no_research_tables_without_rldp(tmp_path):
    from raydp.study.tables import format_report, format_study

    study = _hand_study(tmp_path / "plain", _hand_results([0, 1, 2], rldp=False))
    for out in (format_study(study), format_report(study)):
        assert "Table 2 analogue" not in out and "Table 3 analogue" not in out and "RLDP against" not in out
        assert "clip-schedule against the best tuned baseline" in out  # the learned schedule's own test stays


def test_would_release_takes_the_best_dp_arm_by_its_mean_then_its_best_seed():
    from raydp.study.results import would_release

    rows = [("nonprivate", None, 0, 50.0), ("a", 2.0, 0, 60.0), ("a", 2.0, 1, 70.0),  # a: the best trial, mean 65
            ("b", 2.0, 0, 62.0), ("b", 2.0, 1, 61.0),  # b: the best mean, 61.5; its best seed is 1
            ("a", 8.0, 0, 55.0), ("b", 8.0, 0, 58.0)]
    table = pd.DataFrame([{"trial": f"{s}_{e}_{seed}", "status": "TERMINATED", "model": "m", "strategy": s,
                           "epsilon_target": e if e else math.nan, "seed": seed, "final_public_value_nll": v,
                           "final_eval_value_nll": 0.0 if s == "a" else 99.0}  # the private split never selects
                          for s, e, seed, v in rows])
    got = would_release(table, "final_public_value_nll")
    assert list(zip(got["epsilon"], got["trial"], got["arm"])) == [(2.0, "b_2.0_1", "b"), (8.0, "a_8.0_0", "a")]
    assert list(got["seeds"]) == [2, 1] and list(got["arm_mean"]) == [61.5, 55.0]
    with pytest.raises(ValueError, match="public validation"):
        would_release(table, "final_eval_value_nll")
    table.loc[table["trial"] == "b_2.0_1", "status"] = "ERROR"  # unfinished trials are no candidates
    assert would_release(table, "final_public_value_nll")["trial"].iloc[0] == "b_2.0_0"


def test_a_stopped_study_says_it_is_partial(tmp_path):
    from raydp.study.tables import format_study, record_outcome

    results = _hand_results([0], rldp=False)
    results.loc[results["strategy"] == "clip-schedule", "status"] = "INTERRUPTED"
    study = _hand_study(tmp_path / "stopped", results, unfinished_trials=1)
    out = format_study(study)
    assert out.splitlines()[0].startswith("study hand: 3 of 4 trials finished (PARTIAL: the study was stopped")
    record = record_outcome(study)
    assert record["partial"] is True and record["finished_trials"] == 3 and record["planned_trials"] == 4


def test_trial_lines(capsys):
    from types import SimpleNamespace

    from raydp.study.progress import TrialLines, trial_label, trial_line
    from raydp.study.trial import Trial

    spec = Trial(model="embedded", strategy="static-pairwise", epsilon=2.0, seed=0)
    result = {"selection_score": 65.3123, "selection_split": "public", "selection_metric": "value_nll",
              "time_total_s": 41.4}
    assert trial_line(2, 4, trial_label(spec, "x"), result) == \
        "[2/4] static-pairwise embedded eps2 seed0: value NLL 65.31 (public), 41 s"
    plain = Trial(model="embedded", strategy="nonprivate", epsilon=None, seed=1)
    assert trial_label(plain, "x") == "nonprivate embedded seed1"
    assert trial_line(1, 4, "x", {}, failed=True).startswith("[1/4] x: failed")
    tuned = Trial(model="m", strategy="clip-schedule", epsilon=2.0, seed=0, tuned={"clip": 0.014422366502531475,
                                                                                 "lr": 0.009049911227773816})
    assert len(trial_label(tuned, "x")) < 60
    # Tune's callback: the trial's place among the experiment's, its spec from its config; nothing with --quiet
    done = SimpleNamespace(status="TERMINATED", config={}, last_result={})
    trial = SimpleNamespace(status="RUNNING", config={"trial": spec.to_dict()}, last_result=result)
    TrialLines().on_trial_complete(0, [done, trial, SimpleNamespace(status="PENDING")], trial)
    TrialLines(lines=False).on_trial_complete(0, [done, trial], trial)
    TrialLines().experiment_started("x", "/tmp/x", "s", "f", 3)
    assert capsys.readouterr().err == "[2/3] static-pairwise embedded eps2 seed0: value NLL 65.31 (public), 41 s\n"
    # a search's searcher makes its trials one by one: the count is out of its samples, not the trials made so far
    TrialLines(total=16).on_trial_complete(0, [done, trial, SimpleNamespace(status="PENDING")], trial)
    assert capsys.readouterr().err.startswith("[2/16] static-pairwise")


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_third_party_notices_are_filtered_at_their_loggers_and_raydps_are_not():
    from raydp.notices import quiet_library_notices
    from raydp.study.searches import TUNE_VERBOSE_ENV, tune_verbosity

    quiet_library_notices()
    quiet_library_notices()  # idempotent: one filter per logger
    assert len(logging.getLogger("ray.tune.tune").filters) == 1
    auth, deprecation, tune, analysis, ours = (logging.getLogger(n) for n in (
        "ray._private.authentication.authentication_token_setup", "ray._common.deprecation", "ray.tune.tune",
        "ray.tune.analysis.experiment_analysis", "raydp.study.runner"))
    collect = _Collect()  # on each logger itself: Ray's loggers may not propagate to the root
    for logger in (auth, deprecation, tune, analysis, ours):
        logger.addHandler(collect)
    try:
        auth.warning("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out.")
        deprecation.warning("DeprecationWarning: `RLModule(config=[RLModuleConfig object])` has been deprecated.")
        tune.warning("Experiment has been interrupted, but the most recent state was saved.\nResume experiment with: "
                     "Tuner.restore(path=...)")
        analysis.warning("Failed to fetch metrics for 2 trial(s):\n- run_trial_1: FileNotFoundError('...')")
        deprecation.warning("DeprecationWarning: `other_api` has been deprecated.")
        auth.warning("Token authentication is disabled for this Ray cluster.")
        ours.warning("trial x: wandb start failed")
    finally:
        for logger in (auth, deprecation, tune, analysis, ours):
            logger.removeHandler(collect)
    assert collect.messages == ["DeprecationWarning: `other_api` has been deprecated.",
                                "Token authentication is disabled for this Ray cluster.", "trial x: wandb start failed"]
    os.environ.pop(TUNE_VERBOSE_ENV, None)
    assert tune_verbosity(True) == 0 and tune_verbosity(False) == 0
    os.environ[TUNE_VERBOSE_ENV] = "2"
    try:
        assert tune_verbosity(True) == 2 and tune_verbosity(False) == 0
    finally:
        os.environ.pop(TUNE_VERBOSE_ENV)


def test_plain_output_sets_and_restores_the_environment(monkeypatch):
    from transformers.utils import logging as hf

    from raydp.runner.progress import PLAIN_OUTPUT_ENV, plain_output

    monkeypatch.delenv("RAY_COLOR_PREFIX", raising=False)
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    monkeypatch.setenv("TQDM_DISABLE", "0")  # the user's own setting wins
    assert hf.is_progress_bar_enabled()
    with plain_output(True):
        assert os.environ["RAY_COLOR_PREFIX"] == PLAIN_OUTPUT_ENV["RAY_COLOR_PREFIX"]
        assert os.environ["TQDM_DISABLE"] == "0"
        assert not hf.is_progress_bar_enabled()  # this process imported tqdm before: its bars are turned off here
    assert "RAY_COLOR_PREFIX" not in os.environ and os.environ["TQDM_DISABLE"] == "0"
    assert "HF_HUB_DISABLE_PROGRESS_BARS" not in os.environ and hf.is_progress_bar_enabled()
    with plain_output(False):
        assert "RAY_COLOR_PREFIX" not in os.environ and hf.is_progress_bar_enabled()


def test_a_registered_attacks_part_of_the_trial_line_comes_from_its_spec(monkeypatch):
    """The study's attack lines loop over the attack registry: a new attack's ``line`` shows up beside the built-in
    ones, a trial none of them attacked gets no line, and a failed evaluation says so."""
    import raydp.study.outcome as outcome
    from raydp.evaluation.base import AttackSpec, present

    mine = AttackSpec("mine", run=lambda ctx: None, summary=str, flat=dict,
                      line=lambda row: f"mine {row['mine_score']:.1f}" if present(row.get("mine_score")) else None)
    monkeypatch.setattr(outcome, "ATTACKS", (*outcome.ATTACKS, mine))
    results = pd.DataFrame([
        {"model": "m", "epsilon_target": 2.0, "strategy": "static", "seed": 0, "status": "TERMINATED",
         "mia_auc": 0.51, "mia_cal_auc": 0.5, "mine_score": 3.25, "epsilon": 1.99},
        {"model": "m", "epsilon_target": 2.0, "strategy": "static", "seed": 1, "status": "TERMINATED",
         "mia_auc": None, "mine_score": None, "epsilon": 2.0},
        {"model": "m", "epsilon_target": 2.0, "strategy": "static", "seed": 2, "status": "TERMINATED",
         "evaluation_error": "boom", "epsilon": 2.0}])
    lines = outcome.attack_lines(results, {})
    assert lines[0].startswith("\nAttacks and audit")
    assert len(lines) == 3 and "seed 0: membership AUC 0.51 (calibrated 0.50); mine 3.2" in lines[1]
    assert "seed 2: evaluation failed: boom" in lines[2]
    assert outcome.attack_lines(results.iloc[[1]], {}) == []


def test_an_audit_bound_above_the_spent_epsilon_is_flagged_on_its_trials_line():
    """The one-run audit's lower bound beside the epsilon the trial spent; above it, the line says it is a privacy
    bug (an audit bound above the claim is never hidden); a non-private trial's bound says 'not DP'."""
    from raydp.study.outcome import attack_lines

    results = pd.DataFrame([
        {"model": "m", "epsilon_target": 2.0, "strategy": "static", "seed": 0, "status": "TERMINATED",
         "audit_epsilon_one_run": 2.7, "audit_consistent": False, "epsilon": 2.0},
        {"model": "m", "epsilon_target": 2.0, "strategy": "static", "seed": 1, "status": "TERMINATED",
         "audit_epsilon_one_run": 0.3, "audit_consistent": True, "epsilon": 1.98},
        {"model": "m", "epsilon_target": None, "strategy": "nonprivate", "seed": 0, "status": "TERMINATED",
         "audit_epsilon_one_run": 4.1, "audit_consistent": None, "epsilon": None}])
    lines = attack_lines(results, {})
    assert any("seed 0: audit epsilon >= 2.70 (spent 2.00): ABOVE what it spent, a privacy bug" in l for l in lines)
    assert any("seed 1: audit epsilon >= 0.30 (spent 1.98)" in l and "ABOVE" not in l for l in lines)
    assert any("nonprivate" in l and "audit epsilon >= 4.10 (not DP)" in l for l in lines)


def test_a_searchs_candidates_are_counted_as_searched_trials_not_seeds():
    """A search's trials share an arm but not a seed: the table says how many candidates its mean is over."""
    from raydp.study.outcome import format_outcome, outcome_cells

    rows = [{"trial": f"np_{i}", "status": "TERMINATED", "model": "m", "strategy": "nonprivate", "seed": 0,
             "epsilon_target": None, "search": json.dumps({"lr": lr}), "initial_public_value_nll": 72.0,
             "final_public_value_nll": value, "final_eval_value_nll": value + 0.3}
            for i, (lr, value) in enumerate(((1e-3, 64.0), (2e-3, 63.5), (1e-2, 63.1)))]
    cells = outcome_cells(pd.DataFrame(rows), "final_public_value_nll")
    printed = "\n".join(format_outcome(cells, "final_public_value_nll", {}))
    assert "(3 searched trials)" in printed and "3 seeds" not in printed


def test_attack_released_picks_each_cells_released_trial_and_the_named_strategies():
    """attack: released attacks the trial the study would release in each cell (would_release: the best DP arm's
    best seed on public validation; selection: none's fixed trial) and every finished trial of attack_strategies;
    nothing else, and nothing under selection: private (which marks no release)."""
    from types import SimpleNamespace

    from raydp.study.attack_phase import released_trials

    rows = []
    for strategy, eps, seed, public in (("static", 2.0, 0, 66.0), ("static", 2.0, 1, 65.5),
                                        ("static-pairwise", 2.0, 0, 64.0), ("static-pairwise", 2.0, 1, 64.5),
                                        ("static-pairwise", 8.0, 0, 63.0), ("nonprivate", None, 0, 60.0),
                                        ("nonprivate", None, 1, 60.1)):
        rows.append({"trial": f"{strategy}_eps{eps}_seed{seed}", "status": "TERMINATED", "model": "m",
                     "strategy": strategy, "epsilon_target": eps, "seed": seed, "final_public_value_nll": public,
                     "final_eval_value_nll": public + 0.3, "final_public_perplexity": 4.0,
                     "final_eval_perplexity": 4.0, "initial_public_value_nll": 72.0,
                     "initial_eval_value_nll": 72.0})
    table = pd.DataFrame(rows)
    study = SimpleNamespace(selection="public", attack_strategies=[])
    assert released_trials(study, table) == ["static-pairwise_eps2.0_seed0", "static-pairwise_eps8.0_seed0"]
    study = SimpleNamespace(selection="public", attack_strategies=["nonprivate"])
    assert released_trials(study, table)[-2:] == ["nonprivate_epsNone_seed0", "nonprivate_epsNone_seed1"]
    assert released_trials(SimpleNamespace(selection="private", attack_strategies=[]), table) == []


def test_the_attacked_trials_are_said_before_their_lines():
    from raydp.study.outcome import attack_lines

    results = pd.DataFrame([{"model": "m", "epsilon_target": 2.0, "strategy": "static", "seed": 0,
                             "status": "TERMINATED", "mia_auc": 0.5, "epsilon": 2.0}])
    lines = attack_lines(results, {}, {"rule": "released", "strategies": ["nonprivate"], "trials": ["x"]})
    assert "attacked: the trial this study would release in each cell, and every nonprivate trial" in lines[1]
    assert attack_lines(results, {}, {"rule": "all", "trials": ["x"]})[1] == "  attacked: every trial (attack: all)"


def test_a_system_exit_in_a_callback_prints_no_traceback_and_other_errors_still_do(monkeypatch):
    """A trial's worker ended by Ray's SIGTERM raises SystemExit wherever it is; inside a weakref callback Python
    printed it as an 'Exception ignored' traceback that the driver forwarded. The hook drops only that."""
    import sys
    from types import SimpleNamespace

    from raydp.notices import quiet_exit_tracebacks

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(type(u.exc_value).__name__))
    quiet_exit_tracebacks()
    quiet_exit_tracebacks()  # idempotent: one hook
    sys.unraisablehook(SimpleNamespace(exc_value=SystemExit(1)))
    sys.unraisablehook(SimpleNamespace(exc_value=ValueError("x")))
    assert seen == ["ValueError"]
