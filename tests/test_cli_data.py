"""`raydp data build|show` from the command line."""

import json
import subprocess
import sys

from raydp.cli import main


def test_data_build_and_show(tmp_path, capsys):
    out = tmp_path / "ds"
    assert main(["data", "build", "--output", str(out), "--n-records", "200", "--n-canary", "3"]) == 0
    assert (out / "manifest.json").exists() and (out / "train.parquet").exists()
    capsys.readouterr()
    assert main(["data", "show", str(out)]) == 0
    printed = capsys.readouterr().out
    head, narrative = printed.split("\nsample narrative", 1)
    info = json.loads(head)
    assert info["n_canary"] == 3
    assert "The patient has the following profile." in narrative


def test_data_build_refuses_bad_input(tmp_path, capsys):
    assert main(["data", "build", "--output", str(tmp_path / "x"), "--n-records", "0"]) == 2
    assert "n-records" in capsys.readouterr().err
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "f").write_text("mine")
    assert main(["data", "build", "--output", str(occupied), "--n-records", "50"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("raydp: error:") and "\n" not in err
    assert [p.name for p in occupied.iterdir()] == ["f"]


def test_module_entry_point():
    done = subprocess.run([sys.executable, "-m", "raydp", "--version"], capture_output=True, text=True, check=True)
    assert done.stdout.startswith("raydp ")
