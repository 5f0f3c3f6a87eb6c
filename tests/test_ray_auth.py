"""Ray's processes listen on every interface; what protects them is Ray's token authentication, which raydp's
local clusters turn on (issue 26: the README said no port listens). Each test starts Ray in a subprocess, so
nothing it starts leaks into other tests."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

START = """
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


def test_a_cluster_without_token_authentication_is_refused(monkeypatch):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_AUTH_MODE"] = "disabled"
    script = "from raydp.runner.launch import ensure_ray\nensure_ray(num_cpus=1)"
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "token authentication is off" in result.stderr


@pytest.mark.slow  # ~30 s: a wrong token's connection attempt times out; the mode itself is the test above
def test_a_process_without_the_token_cannot_join_the_cluster():
    out = run(INTRUDER)
    assert "AUTH True" in out and "INTRUDER False" in out
