"""`ray job submit` of a study to a real local head (its own module: no other Ray runs beside it)."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

from tests.test_study import write_study


def _ray_cli():
    return str(Path(sys.executable).with_name("ray"))


def _stop_head(temp_dir: str) -> None:
    """Stop only the head started by the test (``ray stop`` would stop every Ray on the machine)."""
    import psutil

    procs = []
    for p in psutil.process_iter(["cmdline"]):
        if temp_dir in " ".join(p.info["cmdline"] or []):
            procs.append(p)
            procs.extend(p.children(recursive=True))
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=20)
    for p in alive:
        p.kill()


def test_ray_job_submit_runs_a_study_on_a_local_head(tmp_path, raydp_cache):
    """A real head (`ray start --head`), a real job (`ray job submit`), the study's results."""
    import tempfile

    work = tmp_path / "work"
    work.mkdir()
    write_study(work, name="submitted")
    results = tmp_path / "results"
    temp_dir = tempfile.mkdtemp(prefix="rjob", dir="/tmp")  # short: Ray's socket paths must fit
    # Ray's token authentication, with the test's own token
    import secrets

    (tmp_path / "ray_token").write_text(secrets.token_hex(32))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(tmp_path / "ray_token"),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")  # `raydp` on PATH
    start = subprocess.run([_ray_cli(), "start", "--head", "--port", "6391", "--dashboard-port", "8291",
                            "--num-cpus", "2", "--include-dashboard", "true", "--disable-usage-stats",
                            "--dashboard-agent-listen-port", "52391", "--dashboard-agent-grpc-port", "52392",
                            "--temp-dir", temp_dir],
                           env=env, capture_output=True, text=True, timeout=180)
    assert start.returncode == 0, start.stderr
    try:
        deadline = time.time() + 180
        while True:  # the head's job agent may need a while after `ray start` on a busy machine
            job = subprocess.run([_ray_cli(), "job", "submit", "--address", "http://127.0.0.1:8291",
                                  "--working-dir", str(work), "--", "raydp", "study", "submitted.yaml",
                                  "--results-dir", str(results), "--quiet"],
                                 env=env, capture_output=True, text=True, timeout=900)
            if job.returncode == 0 or "No available agent" not in job.stdout + job.stderr or time.time() > deadline:
                break
            time.sleep(3)
        assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
        assert "Table 2 analogue" in job.stdout
    finally:
        _stop_head(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
    table = pd.read_parquet(results / "submitted" / "results.parquet")
    assert len(table) == 2 and (table["status"] == "TERMINATED").all() and table["within_budget"].all()


def test_a_killed_trial_resumes_with_exactly_the_planned_ledger(tiny_study, tmp_path):
    """Kill a trial's run (its actor process) mid-training: Tune retries it from its checkpoint, the
    study finishes, and the trial's ledger has every planned step exactly once."""
    import signal
    import threading

    from raydp.privacy.ledger import PrivacyLedger
    from raydp.study.runner import run_study

    path = write_study(tmp_path, name="killed", strategies=["rldp"], max_failures=2,
                       base={**TINY_STUDY["base"], "max_steps": 48})
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
