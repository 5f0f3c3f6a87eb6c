"""Throughput changes that must keep the arithmetic (issue 28): under the unsafe fixed randomness (replayable), a run
whose evaluations are fewer trains exactly the same adapters and ledger, and its final evaluation is the same."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import torch
from safetensors.torch import load_file

from raydp.config import TrainConfig
from raydp.runner.run import run_training

TINY = {"model": "embedded-tiny", "strategy": "static-pairwise", "epsilon": 2.0, "max_steps": 6, "seed": 3,
        "unsafe_fixed_randomness": True, "data": {"n_records": 300}, "eval_max_records": 16, "public_eval_records": 16}


def test_fewer_evaluations_train_the_same_run(tmp_path, raydp_cache):
    every = run_training(TrainConfig(**TINY, eval_every=2), tmp_path / "every", progress=False)
    ends = run_training(TrainConfig(**TINY), tmp_path / "ends", progress=False)  # step 0, epoch ends, the last
    rows = {name: pq.read_table(tmp_path / name / "eval_metrics.parquet").to_pylist() for name in ("every", "ends")}
    assert [r["step"] for r in rows["every"]] == [0, 2, 4, 6] and [r["step"] for r in rows["ends"]] == [0, 6]
    a, b = (load_file(str(tmp_path / name / "adapter" / "adapter_model.safetensors")) for name in ("every", "ends"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ledgers = [pq.read_table(tmp_path / name / "privacy_ledger.parquet").to_pylist() for name in ("every", "ends")]
    assert ledgers[0] == ledgers[1]
    assert rows["every"][-1] == rows["ends"][-1] and every["final_eval_value_nll"] == ends["final_eval_value_nll"]
    assert json.loads((tmp_path / "ends" / "summary.json").read_text())["privacy"]["epsilon_void"]  # replayable: void


def test_a_cold_model_cache_trains_the_same_run_as_a_warm_one(tmp_path, monkeypatch):
    """Issue 31 (found here): building the embedded model drew from torch's global generator, so a run that built it
    started from other LoRA weights than a run that loaded it. The build now leaves the caller's generator alone."""
    config = TrainConfig(**{**TINY, "strategy": "nonprivate", "epsilon": None})
    monkeypatch.setenv("RAYDP_CACHE", str(tmp_path / "cold-cache"))
    run_training(config, tmp_path / "cold", progress=False)  # builds the model
    run_training(config, tmp_path / "warm", progress=False)  # loads it
    a, b = (load_file(str(tmp_path / name / "adapter" / "adapter_model.safetensors")) for name in ("cold", "warm"))
    assert all(torch.equal(a[k], b[k]) for k in a)
