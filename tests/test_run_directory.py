"""raydp.run_directory: the one module that names a run's files.

- no other module of raydp spells a run's file name as a string literal (they use RunDirectory or its constants);
- RunDirectory's paths are those a real training run writes, and its summary reads back;
- a ledger save that dies half-way leaves the previous ledger whole (raydp.files.atomic_replace).
"""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest

import raydp.run_directory as rd
from raydp.run_directory import RunDirectory, RunSummary

PACKAGE = Path(rd.__file__).resolve().parent
#: a run's file names that only raydp/run_directory.py may spell (the names are distinctive enough to find by text)
RUN_FILE_NAMES = frozenset({rd.SUMMARY, rd.LEDGER, rd.EVAL_METRICS, rd.TRAIN_METRICS, rd.CONTROL_TRACE,
                            rd.CONTROLLER_DECISIONS, rd.EVALUATION})


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the module's, classes' and functions' docstring nodes."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                found.add(id(first.value))
    return found


def run_file_literals(path: Path) -> list[tuple[int, str]]:
    """(line, name) of every string constant in ``path`` that is exactly one of a run's file names (docstrings
    aside; an f-string's pieces are constants too, so a name inside a longer message is not a hit)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = _docstrings(tree)
    hits = [node for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and node.value in RUN_FILE_NAMES and id(node) not in skip]
    return [(node.lineno, node.value) for node in sorted(hits, key=lambda n: (n.lineno, n.col_offset))]


def test_the_guard_sees_a_literal_and_skips_docstrings_and_messages(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('"""Reads summary.json."""\n\n'
                      'def f(d):\n'
                      '    """summary.json"""\n'
                      '    print(f"no eval_metrics.parquet in {d}")\n'
                      '    return d / "summary.json", "evaluation.json"\n')
    assert run_file_literals(module) == [(6, "summary.json"), (6, "evaluation.json")]


def test_only_run_directory_spells_a_runs_file_names():
    """A run's file names live in raydp/run_directory.py alone: every other module reads them from RunDirectory
    or its constants, so a renamed or added file is one edit and no reader can drift from the writer."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == Path(rd.__file__).resolve():
            continue
        offenders += [f"{path.relative_to(PACKAGE.parent)}:{line}: {name!r}" for line, name in run_file_literals(path)]
    assert not offenders, "a run's file name spelled outside raydp/run_directory.py:\n" + "\n".join(offenders)


def test_the_names_importable_elsewhere_are_run_directorys():
    from raydp.evaluation.results import EVALUATION_FILE
    from raydp.privacy.ledger import LEDGER_FILENAME
    from raydp.strategies.rldp import DECISIONS_FILE, TRACE_FILE

    assert (EVALUATION_FILE, LEDGER_FILENAME, TRACE_FILE, DECISIONS_FILE) == (
        rd.EVALUATION, rd.LEDGER, rd.CONTROL_TRACE, rd.CONTROLLER_DECISIONS)
    run = RunDirectory("some/run")
    assert run.root == Path("some/run") and run.ledger == Path("some/run") / LEDGER_FILENAME
    assert {run.root / name for name in rd.RELEASE_FILES} == {run.adapter, run.summary, run.config,
                                                              run.privacy_note, run.ledger}


@pytest.fixture(scope="module")
def real_run(tmp_path_factory, raydp_cache) -> tuple[Path, dict]:
    """A tiny real DP run (embedded-tiny, 4 steps, as tests/test_report_html.py trains)."""
    from raydp.config import TrainConfig
    from raydp.runner.run import run_training

    out = tmp_path_factory.mktemp("run") / "run"
    config = TrainConfig(model="embedded-tiny", strategy="static", epsilon=2.0, seed=0, data={"n_records": 400},
                         max_steps=4, eval_every=2, eval_max_records=16, public_eval_records=16, warmup_steps=2,
                         cpus=1)
    return out, run_training(config, out, progress=False)


def test_run_directory_names_what_a_real_run_writes(real_run):
    """Every file RunDirectory names that an uncontrolled run writes is there, and the run writes nothing at its
    top level that RunDirectory does not name; its summary and config read back."""
    out, summary = real_run
    run = RunDirectory(out)
    written = {run.adapter, run.config, run.summary, run.privacy_note, run.ledger, run.train_metrics,
               run.eval_metrics, run.private}
    for path in written:
        assert path.exists(), f"the run wrote no {path.name}"
    assert run.adapter.is_dir() and run.private_dataset.is_dir()
    assert set(out.iterdir()) == written, "the run wrote a file RunDirectory does not name"
    for absent in (run.control_trace, run.controller_decisions, run.policy, run.evaluation):  # a controlled run's,
        assert not absent.exists()                                                        # or raydp eval's
    assert run.is_finished()
    read = run.read_summary()
    assert isinstance(read, RunSummary) and read.raw == json.loads(json.dumps(summary))
    assert (read.model, read.strategy, read.steps) == ("embedded-tiny", "static", summary["steps"])
    assert read.epsilon == summary["privacy"]["epsilon"] and read.final_eval_perplexity > 0
    assert read.dataset_id == summary["dataset_id"]
    assert run.read_config()["model"] == "embedded-tiny"
    assert RunDirectory(out / "missing").read_config() is None and not RunDirectory(out / "missing").is_finished()

    from raydp.privacy.ledger import PrivacyLedger

    assert len(PrivacyLedger.load(run.ledger)) == summary["steps"]
    assert PrivacyLedger.load(run.root).to_arrow().equals(PrivacyLedger.load(run.ledger).to_arrow())


def test_a_ledger_save_that_dies_half_way_leaves_the_previous_ledger_whole(tmp_path, monkeypatch):
    """A crash while the ledger is rewritten (the writer dies half-way, or the sync fails) leaves the previous ledger
    as it was, readable, and no temporary file beside it."""
    import pyarrow.parquet as pq

    from raydp.privacy.ledger import PrivacyLedger

    def ledger(steps: int) -> PrivacyLedger:
        book = PrivacyLedger(delta=1e-5, epsilon_target=2.0, accountant="pld")
        for step in range(steps):
            book.record_gaussian(0.01, 1.0, clip=[1.0], step=step)
        return book

    path = RunDirectory(tmp_path).ledger
    ledger(3).save(tmp_path)
    before = path.read_bytes()

    def half_written(table, where, **kwargs):  # the parquet writer dies after part of the file
        Path(where).write_bytes(before[: len(before) // 2])
        raise OSError("killed while writing")

    with monkeypatch.context() as patch:
        patch.setattr(pq, "write_table", half_written)
        with pytest.raises(OSError, match="killed while writing"):
            ledger(5).save(tmp_path)
    assert path.read_bytes() == before and len(PrivacyLedger.load(path)) == 3

    def no_sync(fd):
        raise OSError("sync failed")

    with monkeypatch.context() as patch:
        patch.setattr(os, "fsync", no_sync)
        with pytest.raises(OSError, match="sync failed"):
            ledger(5).save(tmp_path)
    assert path.read_bytes() == before and len(PrivacyLedger.load(path)) == 3
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    ledger(5).save(tmp_path)  # and a save that completes replaces it
    assert len(PrivacyLedger.load(path)) == 5


def test_atomic_create_keeps_the_first_creators_file_and_leaves_no_partial_one(tmp_path, monkeypatch):
    """The owner key is created once (raydp.files.atomic_create): a second creator leaves the first's file as it is,
    and a creation that dies half-way leaves neither a key nor a temporary file."""
    from raydp.files import atomic_create

    key = tmp_path / "config" / "owner.key"
    assert atomic_create(key, "first\n") and not atomic_create(key, "second\n")
    assert key.read_text() == "first\n" and (key.stat().st_mode & 0o777) == 0o600
    assert [p.name for p in key.parent.iterdir()] == ["owner.key"]

    def no_sync(fd):
        raise OSError("sync failed")

    other = tmp_path / "config" / "other.key"
    with monkeypatch.context() as patch:
        patch.setattr(os, "fsync", no_sync)
        with pytest.raises(OSError, match="sync failed"):
            atomic_create(other, "half\n")
    assert [p.name for p in key.parent.iterdir()] == ["owner.key"]
