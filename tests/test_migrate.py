"""``raydp migrate``: files written before dataset ids name datasets by a plain content hash, which lets anyone who
knows all records but one recover the last; migration must leave no part of that hash behind (issue 26)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from raydp.cli import main
from raydp.data import build_dataset
from raydp.data.identity import keyed_id
from raydp.errors import DataError
from raydp.migrate import migrate


@pytest.fixture
def old_study(tmp_path):
    """A study directory as the old code wrote it: summaries, results and the study summary name the dataset by
    its content hash, and the report abbreviates it (16 digits and an ellipsis)."""
    root = tmp_path / "study"
    manifest = build_dataset(root / "dataset", n_records=200, progress=False)
    sha = manifest["content_sha256"]
    run = root / "trials" / "static_m_eps2_seed0"
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"dataset_sha256": sha, "privacy": {"epsilon": 2.0}}))
    pd.DataFrame({"trial": ["static_m_eps2_seed0"], "dataset_sha256": [sha]}).to_parquet(root / "results.parquet")
    (root / "study_summary.json").write_text(json.dumps({"tuning_aware_epsilon": {sha: {"dataset_sha256": sha,
                                                                                       "runs": 1}}}))
    (root / "report.html").write_text(f"<td>dataset {sha[:16]}…</td><td>{sha}</td>")
    (root / "log.jsonl").write_text(json.dumps({"dataset_sha256": sha}) + "\n" + json.dumps({"x": 1}) + "\n")
    return root, sha


def test_migration_leaves_no_part_of_the_plain_hash(old_study):
    root, sha = old_study
    assert migrate([root], check=True).remaining  # the old files are flagged
    result = migrate([root])
    new = keyed_id(sha)
    assert result.mapping == {sha: new}
    for f in root.rglob("*"):
        if f.is_file() and "dataset" not in f.relative_to(root).parts[:1]:  # the private dataset keeps its hashes
            blob = f.read_bytes()
            assert sha[:8].encode() not in blob, f  # not even a fragment of the old hash (any 8 of its digits)
    assert json.loads((root / "trials" / "static_m_eps2_seed0" / "summary.json").read_text())["dataset_id"] == new
    assert list(pd.read_parquet(root / "results.parquet")["dataset_id"]) == [new]
    assert list(json.loads((root / "study_summary.json").read_text())["tuning_aware_epsilon"]) == [new]
    assert migrate([root], check=True).remaining == []


def test_check_flags_a_file_holding_a_hash_on_its_own(tmp_path, capsys):
    """A report copied out alone: nothing else names the hash, but a 64-digit or 12-16-digit hex run stands out."""
    (tmp_path / "report.html").write_text("<p>dataset " + "ab" * 32 + "</p>")
    assert main(["migrate", "--check", str(tmp_path)]) == 1
    assert "report.html" in capsys.readouterr().out
    # migrating it cannot find the hash's dataset: it says so and fails instead of "rewrote 0 file(s)" and success
    assert main(["migrate", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "still a plain dataset hash" in captured.out and "report.html" in captured.out
    assert captured.err.startswith("raydp: 1 file(s) still hold") and captured.err.count("\n") == 1


def test_migration_needs_the_owners_existing_key(old_study, tmp_path, monkeypatch):
    root, _ = old_study
    monkeypatch.setenv("RAYDP_OWNER_KEY", str(tmp_path / "nobody" / "owner.key"))
    with pytest.raises(DataError, match="no dataset owner key"):
        migrate([root])  # a new key would give ids that match nothing the owner made
    assert not (tmp_path / "nobody").exists()


def test_a_pickled_policy_is_converted_to_the_state_file_format(tmp_path):
    """A v2 policy kept RLlib's module checkpoint, which pickles classes by module path (moving a file
    broke it). `raydp migrate` writes the same weights as module.safetensors and removes every pickle; the module
    is rebuilt from the manifest alone."""
    import shutil

    import numpy as np

    from raydp.control.store import build_module, load_manifest, load_module_state

    shipped = Path(__file__).resolve().parents[1] / "policies" / "public-embedded"
    old = tmp_path / "policies" / "old"
    old.mkdir(parents=True)
    manifest = json.loads((shipped / "manifest.json").read_text())
    module = build_module(manifest, load_module_state(shipped))
    module.save_to_path(str((old / "module").resolve()))  # RLlib's checkpoint, as v2 policies were saved
    shutil.copy(shipped / "replay.npz", old / "replay.npz")
    (old / "manifest.json").write_text(json.dumps({**manifest, "format": "raydp-policy-v2"}))
    assert list(old.rglob("*.pkl"))
    before = load_module_state(old)
    assert len(migrate([tmp_path / "policies"]).policies) == 1  # converted
    assert migrate([tmp_path / "policies"], check=True).remaining == []  # nothing left that looks like a hash
    assert not list(old.rglob("*.pkl")) and not (old / "module").exists()
    assert load_manifest(old)["format"] == "raydp-policy-v3"
    after = load_module_state(old)
    assert sorted(after) == sorted(before) and all(np.array_equal(after[k], np.asarray(before[k])) for k in before)
