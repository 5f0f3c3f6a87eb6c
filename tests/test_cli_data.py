"""`raydp data build|show` from the command line."""

import json
import subprocess
import sys

from raydp.cli import main


def test_data_build_and_show(tmp_path, capsys):
    from raydp.data import load_texts

    out = tmp_path / "ds"
    assert main(["data", "build", "--output", str(out), "--n-records", "200", "--n-canary", "3"]) == 0
    assert (out / "manifest.json").exists() and (out / "train.parquet").exists()
    record = load_texts(out, "eval")[0]
    built = capsys.readouterr().out
    assert json.loads(built)["n_canary"] == 3  # the description only: no record, no narrative
    assert main(["data", "show", str(out)]) == 0
    shown = capsys.readouterr().out
    assert json.loads(shown)["n_canary"] == 3
    for printed in (built, shown):  # no record's text, nor any narrative's, unless asked for
        assert record not in printed and "The patient has the following profile." not in printed
    assert main(["data", "show", str(out), "--sample"]) == 0
    head, narrative = capsys.readouterr().out.split("\nsample narrative", 1)
    assert json.loads(head)["n_canary"] == 3
    assert record in narrative and "PRIVATE" not in head  # synthetic records describe no one


def test_a_real_record_prints_only_with_sample_and_labelled_private(tmp_path, capsys):
    """A text table is real data: `data build` and `data show` print none of its texts; `--sample` prints one
    under the PRIVATE line."""
    from raydp.data import load_texts

    rows = [f"mrn-{u},visit {u} note {w} the patient reports mild pain" for u in range(40) for w in range(2)]
    (tmp_path / "notes.csv").write_text("mrn,note\n" + "\n".join(rows) + "\n")
    out = tmp_path / "ds"
    assert main(["data", "build", "--source", str(tmp_path / "notes.csv"), "--text-column", "note",
                 "--unit-column", "mrn", "--output", str(out)]) == 0
    assert main(["data", "show", str(out)]) == 0
    quiet = capsys.readouterr().out
    assert "mild pain" not in quiet and "PRIVATE" not in quiet
    assert main(["data", "show", str(out), "--sample"]) == 0
    printed = capsys.readouterr().out
    assert "PRIVATE: a record of the eval split follows" in printed
    assert printed.rstrip().endswith(load_texts(out, "eval")[0])


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
