"""A non-editable install (issue 31): the wheel carries the shipped policies (only those: under WHEEL_MAX_BYTES),
and from another directory the quickstart's study validates (its policy found) and `raydp policy list` finds
them. Slow tier: it builds the wheel (without dependencies: the test environment has them) and installs it into a
directory of its own."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
WHEEL_MAX_BYTES = 5 * 1024 * 1024  # the shipped policies are what most of it weighs; campaigns' stay in experiments/

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    root = tmp_path_factory.mktemp("install")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(root / "dist"), str(REPO)], check=True, cwd=root)
    wheel = next((root / "dist").glob("*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(root / "site"),
                    str(wheel)], check=True, cwd=root)
    elsewhere = root / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(root / "site"), "RAYDP_OWNER_KEY": str(root / "owner.key")}
    return root / "site", elsewhere, env, wheel


def _run(args, cwd, env):
    return subprocess.run([sys.executable, "-m", "raydp", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


def test_the_wheel_ships_the_policies_and_the_installed_copy_is_used(installed):
    site, elsewhere, env, wheel = installed
    assert wheel.stat().st_size < WHEEL_MAX_BYTES, wheel.stat().st_size
    where = subprocess.run([sys.executable, "-c", "import raydp; print(raydp.__file__)"], cwd=elsewhere, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where).is_relative_to(site)  # not the repository's editable copy
    shipped = {p.name for p in (site / "raydp" / "shipped_policies").iterdir()}
    assert shipped == {p.name for p in (REPO / "policies").iterdir() if (p / "manifest.json").is_file()}
    listed = _run(["policy", "list"], elsewhere, env)
    assert listed.returncode == 0, listed.stderr
    assert all(name in listed.stdout for name in shipped)


def test_the_quickstart_validates_from_another_directory(installed):
    _, elsewhere, env, _ = installed
    checked = _run(["study", "--check", str(REPO / "trials" / "quickstart.yaml")], elsewhere, env)
    assert checked.returncode == 0, checked.stderr
    assert "all configs valid" in checked.stdout
