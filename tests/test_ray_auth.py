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
os.environ.pop("RAY_AUTH_MODE", None)
from raydp.runner.launch import ensure_ray
import ray
ensure_ray(num_cpus=1)
from ray._private.authentication.authentication_utils import is_token_auth_enabled
print("AUTH", is_token_auth_enabled())
{extra}
ray.shutdown()
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
    result = subprocess.run([sys.executable, "-c", START.format(extra=extra)], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_a_local_cluster_starts_with_token_authentication():
    assert "AUTH True" in run()


@pytest.mark.slow  # ~30 s: a wrong token's connection attempt times out; the mode itself is the test above
def test_a_process_without_the_token_cannot_join_the_cluster():
    out = run(INTRUDER)
    assert "AUTH True" in out and "INTRUDER False" in out
