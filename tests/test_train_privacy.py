"""Whole DP runs: secret randomness per run (E12), the patient as the unit (E11), labels on artifacts."""

import json

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from raydp.config import TrainConfig
from raydp.data import load_manifest
from raydp.data.identity import keyed_id
from raydp.privacy import randomness as randomness_module
from raydp.privacy.randomness import VOID_LABEL, PrivateRandomness
from raydp.runner.run import run_training

SMALL = {"strategy": "static-pairwise", "epsilon": 2.0, "data": {"n_records": 400}, "max_steps": 4,
         "eval_every": 100, "eval_max_records": 16, "public_eval_records": 16}


def adapter_weights(run_dir):
    return load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))


def same_weights(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, raydp_cache):
    """Two runs of the identical config; the OS-entropy seeds each drew are captured here."""
    drawn = []
    real = PrivateRandomness.fresh

    def capture():
        r = real()
        drawn.append(r)
        return r

    root = tmp_path_factory.mktemp("secret")
    mp = pytest.MonkeyPatch()
    mp.setattr(randomness_module.PrivateRandomness, "fresh", staticmethod(capture))
    try:
        runs = [root / "a", root / "b"]
        for out in runs:
            run_training(TrainConfig(**SMALL), out, progress=False)
    finally:
        mp.undo()
    return runs, drawn


def test_identical_configs_draw_different_batches_and_noise(two_runs):
    runs, drawn = two_runs
    assert len(drawn) == 2 and drawn[0].sampling_entropy != drawn[1].sampling_entropy
    assert drawn[0].noise_seed != drawn[1].noise_seed
    assert not same_weights(adapter_weights(runs[0]), adapter_weights(runs[1]))


def test_no_output_file_holds_the_sampling_or_noise_seed(two_runs):
    runs, drawn = two_runs
    needles = []
    for r in drawn:
        for value, width in ((r.sampling_entropy, 16), (r.noise_seed, 16)):
            needles += [str(value).encode(), format(value, "x").encode(), format(value, "X").encode(),
                        value.to_bytes(width, "little"), value.to_bytes(width, "big")]
    files = [p for run in runs for p in run.rglob("*") if p.is_file()]
    assert len(files) > 10
    for path in files:
        data = path.read_bytes()
        assert not any(n in data for n in needles), path


def test_summary_and_ledger_state_the_patient_unit_and_the_guarantee(two_runs):
    run = two_runs[0][0]
    summary = json.loads((run / "summary.json").read_text())
    privacy = summary["privacy"]
    manifest = load_manifest(run / "private" / "dataset")
    assert privacy["privacy_unit"] == "patient" == manifest["privacy_unit"]
    assert privacy["n_units"] == manifest["units"]["train"] < manifest["sizes"]["train"]
    assert "train_records" not in summary  # a DP run's record count is not released (issue 26)
    assert privacy["q"] == pytest.approx(16 / privacy["n_units"])  # q = B / N_patients
    assert summary["dataset_id"] == manifest["dataset_id"] == keyed_id(manifest["content_sha256"])
    assert manifest["content_sha256"] not in json.dumps(summary)  # only the keyed id leaves the dataset
    assert privacy["guarantee"] == "fixed-schedule" and privacy["filter"] is None
    assert privacy["randomness"] == "os-entropy" and not privacy["epsilon_void"] and privacy["labels"] == []
    meta = json.loads(pq.read_schema(run / "privacy_ledger.parquet").metadata[b"raydp.privacy_ledger"])
    assert meta["privacy_unit"] == "patient" and meta["randomness"] == "os-entropy" and meta["labels"] == []
    assert "seed" not in json.dumps(meta)
    assert (run / "private" / "README").exists() and not (run / "dataset").exists()
    assert summary["dropout"].startswith("off")  # dropout would draw from the public-seeded generator


def test_unsafe_fixed_randomness_replays_and_voids_the_epsilon(tmp_path, raydp_cache):
    config = TrainConfig(**SMALL, unsafe_fixed_randomness=True)
    runs = [tmp_path / "a", tmp_path / "b"]
    for out in runs:
        run_training(config, out, progress=False)
    assert same_weights(adapter_weights(runs[0]), adapter_weights(runs[1]))  # replayable by anyone with the seed
    privacy = json.loads((runs[0] / "summary.json").read_text())["privacy"]
    assert privacy["epsilon_void"] and VOID_LABEL in privacy["labels"] and VOID_LABEL in privacy["verdict"]
    meta = json.loads(pq.read_schema(runs[0] / "privacy_ledger.parquet").metadata[b"raydp.privacy_ledger"])
    assert meta["randomness"] == "unsafe-fixed-seed" and VOID_LABEL in meta["labels"]


def test_record_unit_on_request(tmp_path, raydp_cache):
    summary = run_training(TrainConfig(**{**SMALL, "max_steps": 1}, privacy_unit="record"), tmp_path / "r",
                           progress=False)
    assert summary["privacy"]["privacy_unit"] == "record"
    manifest = load_manifest(tmp_path / "r" / "private" / "dataset")
    assert summary["privacy"]["n_units"] == manifest["sizes"]["train"]
    assert "group privacy" in summary["privacy"]["unit_note"]


def test_a_csv_source_keeps_all_rows_unless_subsampled_by_patient():
    from raydp.errors import ConfigError
    from raydp.settings import validate_config

    assert TrainConfig(data={"source": "diabetic_data.csv"}).data.n_records is None
    assert TrainConfig(data={"source": "diabetic_data.csv", "sample_fraction": 0.5}).data.sample_fraction == 0.5
    assert TrainConfig().data.n_records == 10_000  # the embedded default's synthetic size (the benchmark)
    # a row-count cap on a CSV would let one patient's presence move others (E11): refused, in one line
    with pytest.raises(ConfigError, match="sample_fraction"):
        validate_config(TrainConfig, {"data": {"source": "diabetic_data.csv", "n_records": 500}})
    with pytest.raises(ConfigError, match="subsamples a CSV"):
        validate_config(TrainConfig, {"data": {"sample_fraction": 0.5}})
    with pytest.raises(ConfigError, match="leave nothing for train"):
        validate_config(TrainConfig, {"data": {"fractions": {"attack": 0.5, "eval": 0.5}}})
