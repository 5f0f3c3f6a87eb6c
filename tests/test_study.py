"""Studies: validation before anything runs, a real Tune run, results and report, ``ray job submit``."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from raydp.errors import ConfigError
from raydp.study.config import load_study, trial_grid

REPO = Path(__file__).resolve().parents[1]

TINY_STUDY = {
    "name": "tiny",
    "models": ["embedded-tiny"],
    "epsilons": [2.0],
    "seeds": [0],
    "strategies": ["static", "rldp"],
    "sac_grid": {"t_rl": [4], "b_sac": [4], "k": [2]},
    "resources": {"cpus_per_trial": 1},
    "base": {"data": {"n_records": 400}, "max_steps": 24, "eval_every": 8, "eval_max_records": 16,
             "warmup_steps": 4, "rldp": {"t_warm": 4, "n_max": 8, "hidden": 32}},
}


def write_study(tmp_path, **changes):
    values = json.loads(json.dumps(TINY_STUDY))
    for key, value in changes.items():
        values[key] = value
    path = tmp_path / f"{values.get('name', 'study')}.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


@pytest.mark.parametrize("changes, message", [
    ({"epsilon": [2.0]}, "epsilon: unknown field"),
    ({"epsilons": [-1.0]}, "epsilons must be > 0"),
    ({"strategies": ["static", "magic"]}, "strategies.1"),
    ({"sac_grid": {"t_rl": [0]}}, "sac_grid.t_rl values must be > 0"),
    ({"base": {"strategy": "static"}}, "base.strategy is set by the study's grid"),
    ({"base": {"batch_size": -3}}, "batch_size"),
    ({"base": {"data": {"n_records": 400}, "delta": 0.01}}, "trial static_embedded-tiny_eps2_seed0: delta=0.01"),
    ({"base": {"data": {"n_records": 400}, "rldp": {"frozen": True}}}, "frozen policy needs"),
    ({"name": "bad name!"}, "name"),
    ({"policy": "shared", "sac_grid": {"t_rl": [4], "b_sac": [4, 8], "k": [2]}}, "a shared policy has one B_SAC"),
])
def test_invalid_study_files_fail_before_any_trial(tmp_path, changes, message, capsys):
    from raydp.cli import main

    path = write_study(tmp_path, **changes)
    assert main(["study", str(path), "--results-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "out" / "tiny" / "tune").exists()  # no trial was started


def test_missing_and_broken_study_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read study"):
        load_study(tmp_path / "nope.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_study(broken)


def test_shipped_study_files_validate_and_expand():
    quick = load_study(REPO / "trials" / "quickstart.yaml")
    assert [t["strategy"] for t in trial_grid(quick)] == ["static", "rldp"]
    grid = load_study(REPO / "trials" / "paper_grid.yaml")
    n_rldp = 8 * 4 * 3
    assert len(trial_grid(grid)) == 4 * 5 * 3 * (3 + n_rldp)
    load_study(REPO / "trials" / "transfer.yaml")


@pytest.fixture(scope="module")
def tiny_study(raydp_cache, tmp_path_factory):
    import ray

    from raydp.runner.launch import RAY_NAMESPACE
    from raydp.study.runner import run_study

    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, namespace=RAY_NAMESPACE, log_to_driver=False,
                 runtime_env={"env_vars": {"RAYDP_CACHE": os.environ["RAYDP_CACHE"], "HF_HUB_OFFLINE": "1"}})
    root = tmp_path_factory.mktemp("study")
    path = write_study(root)
    study_dir = run_study(path, root / "out", progress=False)
    yield study_dir
    ray.shutdown()


def test_study_results_table(tiny_study):
    table = pd.read_parquet(tiny_study / "results.parquet")
    assert sorted(table["strategy"]) == ["rldp", "static"]
    assert (table["status"] == "TERMINATED").all() and table["within_budget"].all()
    assert (table["epsilon_pld"] <= 2.0).all() and (table["steps"] == 24).all()
    assert {"steps_to_target", "epsilon_prv", "epsilon_gdp", "trial_seconds", "privacy_mode", "config"} <= set(table)
    static = table[table["strategy"] == "static"].iloc[0]
    assert static["steps_to_target"] <= 1.0  # the best baseline reaches its own final perplexity
    for run_dir in table["run_dir"]:
        assert (Path(run_dir) / "privacy_ledger.parquet").exists()
    assert (Path(table[table["strategy"] == "rldp"].iloc[0]["run_dir"]) / "control_trace.parquet").exists()
    summary = json.loads((tiny_study / "study_summary.json").read_text())
    sha = json.loads((tiny_study / "dataset" / "manifest.json").read_text())["content_sha256"]
    tuning = summary["tuning_aware_epsilon"][sha]  # one figure per dataset (E7/E14)
    assert tuning["trials"] == 2 and tuning["unknown_spend"] == []
    assert tuning["tuning_aware_epsilon"] == tuning["composition_epsilon_rdp"] > tuning["max_single_trial_epsilon_rdp"]
    assert tuning["repeat_and_select_epsilon_rdp"] > tuning["max_single_trial_epsilon_rdp"]
    assert summary["selection"]["requested"] == "public"  # E15 (falls back, labelled, where runs lack it)
    assert {"final_public_perplexity", "privacy_labels", "selection_split"} <= set(table)


def test_evaluations_reach_tune_only_with_their_checkpoint(tiny_study):
    """E: every Tune result that carries a perplexity is a checkpoint's report (or the final one)."""
    for result_file in (tiny_study / "tune" / "tiny").glob("*/result.json"):
        results = [json.loads(line) for line in result_file.read_text().splitlines() if line.strip()]
        assert results
        for r in results:
            if r.get("eval_perplexity") is not None:
                assert r.get("checkpoint") or r.get("done"), r
            assert "selection_perplexity" in r and r["selection_split"] in ("public", "private")
        assert "privacy_label" in results[-1] and results[-1]["done"]


def test_report_prints_the_paper_tables(tiny_study, capsys):
    from raydp.cli import main

    assert main(["report", str(tiny_study)]) == 0
    out = capsys.readouterr().out
    assert "Table 2 analogue" in out and "Table 3 analogue" in out and "Tuning-aware epsilon" in out
    assert "T_RL=4 B_SAC=4 K=2" in out


def test_wandb_is_offline_and_logs_no_text(tiny_study):
    runs = list((tiny_study / "wandb").glob("offline-run-*"))
    assert len(runs) == 2  # one offline run per trial, nothing sent anywhere
    from raydp.data import load_canaries, load_texts

    secrets = list(load_canaries(tiny_study / "dataset")["secret"])
    texts = [t[:40].encode() for t in load_texts(tiny_study / "dataset", "train")[:50]]
    for run in runs:
        for f in run.rglob("*"):
            if f.is_file():
                blob = f.read_bytes()
                assert not any(secret.encode() in blob for secret in secrets)
                assert b"secret_id=" not in blob and not any(t in blob for t in texts)


def test_optuna_chooses_the_sac_cells(tiny_study, tmp_path):
    from raydp.study.runner import run_study

    path = write_study(tmp_path, name="tuned", search="optuna", optuna={"num_samples": 2},
                       sac_grid={"t_rl": [4, 8], "b_sac": [4], "k": [1, 2]}, wandb={"mode": "disabled"})
    study_dir = run_study(path, tmp_path / "out", progress=False)
    table = pd.read_parquet(study_dir / "results.parquet")
    assert sorted(table["strategy"]) == ["rldp", "rldp", "static"]
    rldp = table[table["strategy"] == "rldp"]
    assert rldp["trial"].str.contains("optuna-").all() and (rldp["status"] == "TERMINATED").all()
    assert set(rldp["t_rl"]) <= {4, 8} and set(rldp["k"]) <= {1, 2}


def test_rldp_trials_can_share_one_policy(tiny_study, tmp_path):
    from raydp.study.runner import run_study

    path = write_study(tmp_path, name="shared", strategies=["rldp"], seeds=[0, 1], policy="shared",
                       wandb={"mode": "disabled"})
    study_dir = run_study(path, tmp_path / "out", progress=False)
    table = pd.read_parquet(study_dir / "results.parquet")
    assert len(table) == 2 and (table["status"] == "TERMINATED").all()
    transitions = [json.loads((Path(d) / "summary.json").read_text())["controller"]["transitions"]
                   for d in table["run_dir"]]
    shared = json.loads((study_dir / "study_summary.json").read_text())["shared_policy"]
    assert shared["transitions_trained"] == sum(transitions) > 0  # one service trained on both trials


def test_resume_restores_a_finished_study_without_rerunning(tiny_study):
    from raydp.study.runner import run_study

    before = pd.read_parquet(tiny_study / "results.parquet")
    started = time.perf_counter()
    run_study(tiny_study / ".." / ".." / "tiny.yaml", tiny_study.parent, progress=False, resume=True)
    after = pd.read_parquet(tiny_study / "results.parquet")
    assert list(after["final_eval_perplexity"]) == list(before["final_eval_perplexity"])
    assert time.perf_counter() - started < 60  # Tuner.restore found both trials finished


def test_a_stopped_study_resumes_with_tuner_restore(tmp_path, raydp_cache):
    """Stop the study's driver (Ctrl-C) after a checkpoint, then `raydp study --resume` finishes it."""
    import signal

    from raydp.privacy.ledger import PrivacyLedger

    path = write_study(tmp_path, name="stopped", strategies=["static"], wandb={"mode": "disabled"},
                       base={**TINY_STUDY["base"], "max_steps": 48, "epochs": 6})  # ~150 patients: 6 epochs > 48 steps
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [sys.executable, "-m", "raydp", "study", str(path), "--results-dir", str(out), "--quiet"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 600
    while not list((out / "stopped" / "tune" / "stopped").glob("*/checkpoint_000001")):
        assert proc.poll() is None and time.time() < deadline, "the study ended before it could be stopped"
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=300)
    run_dir = out / "stopped" / "trials" / "static_embedded-tiny_eps2_seed0"
    assert not (run_dir / "summary.json").exists()  # the trial did not finish
    resumed = subprocess.run(cmd + ["--resume"], env=env, capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from_step"] is not None and summary["steps"] == 48
    assert list(PrivacyLedger.load(run_dir / "privacy_ledger.parquet").steps) == list(range(48))
    table = pd.read_parquet(out / "stopped" / "results.parquet")
    assert list(table["status"]) == ["TERMINATED"] and table["within_budget"].all()


def test_a_killed_trial_resumes_with_exactly_the_planned_ledger(tiny_study, tmp_path):
    """Kill a trial's run (its actor process) mid-training: Tune retries it from its checkpoint, the
    study finishes, and the trial's ledger has every planned step exactly once."""
    import signal
    import threading

    from raydp.privacy.ledger import PrivacyLedger
    from raydp.study.runner import run_study

    path = write_study(tmp_path, name="killed", strategies=["rldp"], max_failures=2,
                       base={**TINY_STUDY["base"], "max_steps": 48, "epochs": 6})  # ~150 patients: 6 epochs > 48 steps
    study_dir = tmp_path / "out" / "killed"
    killed = {}

    def killer():
        deadline = time.time() + 600
        while time.time() < deadline:
            checkpoints = list((study_dir / "tune" / "killed").glob("*/checkpoint_*"))
            pids = list((study_dir / "work").glob("*/pid"))
            if len(checkpoints) >= 3 and pids:
                killed["pid"] = int(pids[0].read_text())
                os.kill(killed["pid"], signal.SIGKILL)
                return
            time.sleep(0.2)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    run_study(path, tmp_path / "out", progress=False)
    thread.join(timeout=5)
    assert "pid" in killed, "the trial finished before it could be killed"
    table = pd.read_parquet(study_dir / "results.parquet")
    assert list(table["status"]) == ["TERMINATED"]
    run_dir = Path(table["run_dir"].iloc[0])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from_step"] is not None and 0 < summary["resumed_from_step"] < 48
    ledger = PrivacyLedger.load(run_dir / "privacy_ledger.parquet")
    assert list(ledger.steps) == list(range(48))  # every planned step, none lost, none repeated
    # every decision of Alg. 1 happened once, including the one the checkpoint was taken before
    decisions = pd.read_parquet(run_dir / "controller_decisions.parquet")
    assert list(decisions["step"]) == list(range(8, 49, 4))
    assert summary["privacy"]["within_budget"] and summary["steps"] == 48
    assert int((study_dir / "work" / table["trial"].iloc[0] / "pid").read_text()) != killed["pid"]
