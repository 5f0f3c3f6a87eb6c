"""What a released run directory reveals about the records it did not protect by DP (issue 26).

The adversary of these tests knows every record of the source table but one field of one patient, knows the code
and reads every releasable file of the run (everything but ``private/``). Before dataset ids were keyed, the
summary named the dataset by the SHA-256 of its split texts: rebuilding the dataset for each candidate value and
hashing it recovered the missing value with certainty, whatever epsilon the run claimed. The same search now
finds nothing: the released id is keyed with the data owner's secret, and no other digest of the records is
released. A second test checks every field of every releasable file against the allowlist of fields that are
public, charged to the ledger, the keyed id, or labelled unprotected (tests/releasable.py). Both run on static
DP-SGD and on DualTune with each phase 1 (public corpus; redacted private records, labelled E16), whose reports of
phase 1 must not state the private record count.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from raydp.config import TrainConfig
from raydp.data import build_dataset, generate_records, load_manifest
from raydp.data.identity import keyed_id
from raydp.runner.phases import PUBLIC_PHASE_ONE_RECORDS
from raydp.runner.run import run_training
from releasable import unclassified_run

CANDIDATES = ("NO", ">30", "<30")


#: the runs released: static DP-SGD, and DualTune with each phase 1 (a few steps of it: the public corpus's default
#: size, 5,000 records, for 0.01 epochs; the redacted private records for one batch)
RUNS = {"static": ("static", {}),
        "dualtune-public": ("dualtune", {"phase1_epochs": 0.01}),
        "dualtune-redacted": ("dualtune", {"phase1": "redacted", "phase1_epochs": 0.1})}


@pytest.fixture(scope="module", params=list(RUNS))
def released(request, tmp_path_factory, raydp_cache):
    """A DP run trained on a CSV table; returns (run directory, the table, the target row, its true value)."""
    strategy, settings = RUNS[request.param]
    root = tmp_path_factory.mktemp(f"release-{request.param}")
    table = generate_records(120, seed=11, progress=False)
    singles = table["patient_nbr"].value_counts()
    target = int(table.index[table["patient_nbr"].map(singles) == 1][0])  # a patient with one encounter
    truth = table.at[target, "readmitted"]
    table.to_csv(root / "diabetic_data.csv", index=False)
    config = TrainConfig(model="embedded-tiny", strategy=strategy, settings=settings, epsilon=2.0, max_steps=2,
                         eval_every=100, eval_max_records=8, public_eval_records=8,
                         data={"source": str(root / "diabetic_data.csv"), "n_canary": 2})
    run_training(config, root / "run", progress=False)
    return root / "run", table, target, truth


def released_text(run_dir: Path) -> str:
    """Every releasable file of the run as text (Parquet tables and their metadata decoded)."""
    parts = []
    for f in sorted(run_dir.rglob("*")):
        rel = f.relative_to(run_dir).as_posix()
        if f.is_dir() or rel.startswith("private/"):
            continue
        if f.suffix == ".parquet":
            table = pq.read_table(f)
            parts.append(json.dumps(table.to_pylist(), default=str) + str(table.schema.metadata))
        else:
            parts.append(f.read_bytes().decode("utf-8", "replace"))
    return "\n".join(parts)


def fingerprints(manifest: dict, csv: Path) -> set[str]:
    """Every digest of the records an adversary can compute without the owner's key, full and abbreviated."""
    digests = {manifest["content_sha256"], *manifest["split_sha256"].values(), manifest["dataset_id"],
               hashlib.sha256(csv.read_bytes()).hexdigest()}
    return digests | {d.split(":")[-1][:12] for d in digests}


def test_a_missing_record_cannot_be_recovered_from_the_released_files(released, tmp_path, monkeypatch):
    run_dir, table, target, truth = released
    text = released_text(run_dir)
    config = json.loads((run_dir / "config.json").read_text())["data"]
    owner_key_file = os.environ["RAYDP_OWNER_KEY"]
    monkeypatch.setenv("RAYDP_OWNER_KEY", str(tmp_path / "adversary.key"))  # the adversary has its own key
    matches = []
    for value in CANDIDATES:
        candidate = table.copy()
        candidate.at[target, "readmitted"] = value
        csv = tmp_path / value.replace("<", "lt").replace(">", "gt") / "diabetic_data.csv"
        csv.parent.mkdir()
        candidate.to_csv(csv, index=False)
        manifest = build_dataset(csv.parent / "ds", source=csv, seed=config["seed"], n_canary=config["n_canary"],
                                 canary_seed=config["canary_seed"], n_audit=config["n_audit"],
                                 fractions=config["fractions"], progress=False)
        if any(f in text for f in fingerprints(manifest, csv)):
            matches.append(value)
        if value == truth:
            true_content = manifest["content_sha256"]
    assert matches == [], f"the released files single out {matches} (truth {truth!r})"
    # The id still names the dataset for its owner: the owner's key maps the true content to the released id,
    # so runs on the same data compose.
    monkeypatch.setenv("RAYDP_OWNER_KEY", owner_key_file)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["dataset_id"] == keyed_id(true_content) == load_manifest(run_dir / "private" / "dataset")["dataset_id"]


def test_every_field_of_every_releasable_file_is_public_charged_or_labelled(released):
    run_dir = released[0]
    assert unclassified_run(run_dir) == []
    summary = json.loads((run_dir / "summary.json").read_text())
    # N is released and said to be: the replace-one guarantee covers it
    privacy = summary["privacy"]
    assert "replace-one" in privacy["public_counts"]
    assert privacy["epsilon_replace_one"] > privacy["epsilon"] and privacy["delta_replace_one"] == privacy["delta"]
    # the private record count is not released: a public phase 1's size is a public constant, a redacted one's
    # counts (the private record count's) are not reported
    phase = summary["phase_one"]
    assert (phase is not None) == (summary["strategy"] == "dualtune")
    if phase is not None and phase["data"] == "public":
        assert phase["records"] == phase["trained_records"] == PUBLIC_PHASE_ONE_RECORDS
    elif phase is not None:
        assert not {"records", "trained_records", "steps"} & set(phase)
