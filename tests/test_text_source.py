"""A table of free text as the private data (issue 31): any CSV, Parquet or JSON Lines file with a text column
and a privacy-unit column, through the same unit-level splits, DP training and report."""

import json

import numpy as np
import pandas as pd
import pytest

from raydp.errors import DataError

WORDS = "the patient reports mild pain after surgery and was advised rest fluids and review in two weeks".split()


def notes(n_units=60, seed=0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for u in range(n_units):
        for _ in range(int(rng.integers(1, 4))):  # 1-3 notes per patient
            rows.append({"mrn": f"MRN-{u:05d}", "note": " ".join(rng.choice(WORDS, size=12)) + ".",
                         "other": int(rng.integers(0, 9))})
    return pd.DataFrame(rows)


@pytest.fixture()
def table_files(tmp_path):
    frame = notes()
    frame.to_csv(tmp_path / "notes.csv", index=False)
    frame.to_parquet(tmp_path / "notes.parquet")
    frame.to_json(tmp_path / "notes.jsonl", orient="records", lines=True)
    return frame, tmp_path


@pytest.mark.parametrize("suffix", ["csv", "parquet", "jsonl"])
def test_a_text_table_is_split_by_unit_with_canaries(table_files, suffix):
    from raydp.data import build_from_config, load_canaries, load_texts, load_units
    from raydp.config import DataConfig
    from raydp.data.text_source import unit_digest

    frame, root = table_files
    data = DataConfig(source=str(root / f"notes.{suffix}"), text_column="note", unit_column="mrn", n_canary=3,
                      n_audit=4)
    out = root / f"built-{suffix}"
    manifest = build_from_config(data, out, progress=False)
    assert manifest["n_records"] == len(frame) and manifest["privacy_unit"] == "patient"
    units = {s: load_units(out, s) for s in ("train", "eval", "attack", "validation")}
    texts = {s: load_texts(out, s) for s in units}
    # every source row once, in exactly the split of its unit; no unit in two splits
    digest = dict(zip(frame["mrn"], unit_digest(frame["mrn"].tolist())))
    where = {}
    for s, us in units.items():
        for u, t in zip(us, texts[s]):
            if int(u) in set(digest.values()):  # not a canary's own unit
                where.setdefault(int(u), set()).add(s)
    assert all(len(v) == 1 for v in where.values()) and set(where) == set(digest.values())
    assert sorted(t for s in texts for t, u in zip(texts[s], units[s]) if int(u) in set(digest.values())) \
        == sorted(frame["note"])
    assert not any("MRN-" in str(u) for us in units.values() for u in us)  # no source identifier stored
    canaries = load_canaries(out)
    assert len(canaries) == 3 and all(texts["train"][r].endswith(f"secret_id={s}.")
                                      for r, s in zip(canaries["train_row"], canaries["secret"]))


def test_one_unit_added_moves_no_other_unit(table_files):
    from raydp.data import build_from_config, load_texts, load_units
    from raydp.config import DataConfig

    frame, root = table_files
    more = pd.concat([frame, pd.DataFrame([{"mrn": "MRN-NEW", "note": "an extra note of one more patient.",
                                            "other": 0}])], ignore_index=True)
    more.to_csv(root / "more.csv", index=False)
    placed = []
    for name in ("notes.csv", "more.csv"):
        out = root / f"b-{name}"
        build_from_config(DataConfig(source=str(root / name), text_column="note", unit_column="mrn", n_canary=0),
                          out, progress=False)
        placed.append({(int(u), t): s for s in ("train", "eval", "attack", "validation")
                       for u, t in zip(load_units(out, s), load_texts(out, s))})
    before, after = placed
    assert all(after[k] == s for k, s in before.items()) and len(after) == len(before) + 1


@pytest.mark.parametrize("columns, message", [
    (("text", "mrn"), "has no column 'text' (text_column); its columns: mrn, note, other"),
    (("note", "patient"), "has no column 'patient' (unit_column)"),
])
def test_a_missing_column_is_a_one_line_error(table_files, capsys, columns, message):
    from raydp.cli import main

    _, root = table_files
    code = main(["data", "build", "--source", str(root / "notes.csv"), "--text-column", columns[0],
                 "--unit-column", columns[1], "--output", str(root / "x")])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1 and not (root / "x").exists()


def test_bad_text_tables_are_refused(tmp_path):
    from raydp.config import DataConfig
    from raydp.data.text_source import read_text_table

    pd.DataFrame({"note": ["a", None], "mrn": ["1", "2"]}).to_parquet(tmp_path / "gap.parquet")
    with pytest.raises(DataError, match="1 row\\(s\\) without a 'note' or 'mrn' value"):
        read_text_table(tmp_path / "gap.parquet", "note", "mrn")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(DataError, match="unknown file type '.txt'"):
        read_text_table(tmp_path / "notes.txt", "note", "mrn")
    with pytest.raises(ValueError, match="needs both text_column and unit_column"):
        DataConfig(source="x.csv", text_column="note")


def test_dp_training_on_a_text_table_reports_perplexity(table_files, tmp_path):
    from raydp.config import TrainConfig
    from raydp.report import write_report
    from raydp.runner.run import run_training

    _, root = table_files
    config = TrainConfig.model_validate({
        "model": "embedded-tiny", "strategy": "static", "epsilon": 4.0, "max_steps": 6, "eval_max_records": 16,
        "public_eval_records": 16, "warmup_steps": 1,
        "data": {"source": str(root / "notes.csv"), "text_column": "note", "unit_column": "mrn", "n_canary": 2}})
    summary = run_training(config, tmp_path / "run", progress=False)
    assert summary["privacy"]["within_budget"] and summary["privacy"]["privacy_unit"] == "patient"
    assert summary["privacy"]["n_units"] < len(notes())  # units, not rows, are protected
    assert np.isfinite(summary["final_eval_perplexity"]) and "final_eval_value_nll" not in summary
    assert write_report(tmp_path / "run").exists()
    assert "MRN-" not in json.dumps(summary)
