"""Ray's processes listen on every interface; what protects them is Ray's token authentication, which raydp's
local clusters turn on (issue 26: the README said no port listens). Each test starts Ray in a subprocess, so
nothing it starts leaks into other tests."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest

START = r"""
import os
os.environ.pop("RAY_AUTH_MODE", None)  # the default
from raydp.runner.launch import ensure_ray
import ray
ensure_ray(num_cpus=1)
from ray._private.authentication.authentication_utils import is_token_auth_enabled
print("AUTH", is_token_auth_enabled())
import psutil, re, subprocess, urllib.request
mine = {c.pid for c in psutil.Process().children(recursive=True)}
lines = subprocess.run(["ss", "-ltnp"], capture_output=True, text=True).stdout.splitlines()
served = []
for line in lines:
    pid = re.search(r"pid=(\d+)", line)
    if pid and int(pid.group(1)) in mine:
        port = line.split()[3].rsplit(":", 1)[1]
        try:
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read()
            served.append(body.decode(errors="replace"))
        except Exception:
            pass
# the node's memory and CPU, and the workers' (components named ray::...): what follows the private batch sizes
print("PROCESS_METRICS", any("ray_node_" in b or 'Component="ray::' in b for b in served))
"""

INTRUDER = """
import subprocess, sys, os
address = ray.get_runtime_context().gcs_address
env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 32}
r = subprocess.run([sys.executable, "-c", f"import ray; ray.init(address='{address}'); print('CONNECTED')"],
                   env=env, capture_output=True, text=True, timeout=180)
print("INTRUDER", "CONNECTED" in r.stdout)
"""


def run(extra: str = "") -> str:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    result = subprocess.run([sys.executable, "-c", START + extra + "\nray.shutdown()\n"], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_a_local_cluster_starts_with_token_authentication_and_serves_no_process_metrics():
    """Token auth is on; and no port of the session serves the dashboard agent's per-process memory and CPU
    metrics without the token (they follow the private batch sizes)."""
    out = run()
    assert "AUTH True" in out and "PROCESS_METRICS False" in out


REFUSED = """
import os, sys, psutil, ray
from raydp.errors import ConfigError
from raydp.runner.launch import ensure_ray
inits, init = [], ray.init
ray.init = lambda *args, **kwargs: inits.append(1) or init(*args, **kwargs)  # counted: a cluster started, or joined
for mode in sys.argv[1:] or [None]:
    if mode is not None:
        os.environ["RAY_AUTH_MODE"] = mode
    try:
        ensure_ray(num_cpus=1)
    except ConfigError as exc:
        print("REFUSED", repr(mode), exc)
    print("STARTED", repr(mode), ray.is_initialized(), len(psutil.Process().children(recursive=True)), len(inits))
"""


def test_a_local_cluster_without_token_authentication_is_refused_before_it_starts():
    """Ray turns the token off for any RAY_AUTH_MODE but "token" (an empty one too): each is refused before a local
    cluster starts."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    modes = ["disabled", "off", "", "Disabled"]
    result = subprocess.run([sys.executable, "-c", REFUSED, *modes], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    for mode in modes:
        assert f"REFUSED {mode!r} Ray's token authentication is off" in result.stdout, result.stdout
        assert f"STARTED {mode!r} False 0 0" in result.stdout  # no Ray was started only to be stopped
    # RAY_ADDRESS=local is Ray's "start a new local cluster": the same refusal, not a join
    result = subprocess.run([sys.executable, "-c", REFUSED, "disabled"], env={**env, "RAY_ADDRESS": "local"},
                            capture_output=True, text=True, timeout=300)
    assert "REFUSED 'disabled' Ray's token authentication is off" in result.stdout, result.stdout + result.stderr
    assert "STARTED 'disabled' False 0 0" in result.stdout


@pytest.mark.slow  # ~40 s: a head started with `ray start`, its own ports; the local refusal is the test above
def test_a_process_joining_without_token_mode_is_refused(tmp_path):
    """A process that joins a cluster (RAY_ADDRESS) without token mode of its own is refused once joined, and its
    connection is closed. The cluster here runs without the token too (`RAY_AUTH_MODE=disabled ray start --head`),
    else the join itself would fail. What raydp checks is the joining process's mode: a process in token mode joining
    a cluster without it is not refused (a node without the token accepts any caller; docs/privacy.md)."""
    from test_study_job import _ray_cli, _stop_head

    temp_dir = tempfile.mkdtemp(prefix="rauth", dir="/tmp")  # short: Ray's socket paths must fit
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_AUTH_MODE"] = "disabled"
    with socket.socket() as s:  # a free port for the head's GCS
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = subprocess.run([_ray_cli(), "start", "--head", "--port", str(port), "--num-cpus", "1",
                            "--include-dashboard", "false", "--disable-usage-stats", "--temp-dir", temp_dir],
                           env=env, capture_output=True, text=True, timeout=180)
    assert start.returncode == 0, start.stderr
    try:
        joining = {**env, "RAY_ADDRESS": f"127.0.0.1:{port}", "HOME": str(tmp_path)}  # no ~/.ray/auth_token
        joining.pop("RAY_AUTH_MODE")  # the joining process sets no mode
        result = subprocess.run([sys.executable, "-c", REFUSED], env=joining, capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
        assert "REFUSED None Ray's token authentication is off" in result.stdout
        assert "STARTED None False 0 1" in result.stdout  # joined once, then left
    finally:
        _stop_head(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.slow  # ~30 s: a wrong token's connection attempt times out; the mode itself is the test above
def test_a_process_without_the_token_cannot_join_the_cluster():
    out = run(INTRUDER)
    assert "AUTH True" in out and "INTRUDER False" in out
