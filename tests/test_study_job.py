"""`ray job submit` of a study to a real local head (its own module: no other Ray runs beside it)."""

import pytest
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


# ~105 s: `ray job submit` of a study to a local head (cluster/submit.sh); the study it submits is the
# runner of test_study.py (tiny_study), started in-process
@pytest.mark.slow
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
