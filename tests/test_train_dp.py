"""A DP run: the reported epsilon is true; impossible requests fail before training, one line at the CLI."""

import json

import pyarrow.parquet as pq
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import PLDAccountant

from raydp.cli import main

COMMON = ["--quiet", "--n-records", "600", "--epochs", "1"]


@pytest.fixture(scope="module")
def static_run(tmp_path_factory, raydp_cache):
    from raydp.config import TrainConfig
    from raydp.runner.launch import train

    out = tmp_path_factory.mktemp("dp") / "static"  # COMMON's run, as `raydp train` runs it
    train(TrainConfig.model_validate({"strategy": "static", "epsilon": 2, "data": {"n_records": 600}, "epochs": 1}),
          out, progress=False)
    return out


def test_ledger_recomputed_independently_matches_reported_epsilon(static_run):
    summary = json.loads((static_run / "summary.json").read_text())
    privacy = summary["privacy"]
    ledgers = list(static_run.glob("*ledger*.parquet"))
    assert len(ledgers) == 1
    rows = pq.read_table(ledgers[0], columns=["step", "q", "sigma_eff"]).to_pylist()
    assert [r["step"] for r in rows] == list(range(privacy["planned_steps"]))  # every step, once
    assert summary["steps"] == privacy["planned_steps"] == privacy["steps_charged"]
    # Independent accountant: Google's dp_accounting PLD, composed here step by step from the file.
    accountant = PLDAccountant()
    for row in rows:
        accountant.compose(dp_event.PoissonSampledDpEvent(row["q"], dp_event.GaussianDpEvent(row["sigma_eff"])))
    independent = accountant.get_epsilon(privacy["delta"])
    assert privacy["epsilon"] == pytest.approx(independent, rel=0.02)
    assert privacy["epsilon"] <= privacy["epsilon_target"] and privacy["within_budget"]
    assert privacy["epsilon"] >= 0.95 * privacy["epsilon_target"]  # calibrated, not wasted
    assert privacy["neighbouring_relation"] == "add_remove_one"
    assert set(privacy["epsilon_by_accountant"]) == {"pld", "prv", "rdp", "gdp", "edgeworth"}


def test_dp_run_reports_no_unprivatized_training_statistics(static_run):
    columns = set(pq.read_table(static_run / "train_metrics.parquet").column_names)
    assert "loss" not in columns and "batch_size" not in columns
    assert "seconds" not in columns  # a step's time grows with its (private) Poisson batch size
    assert {"sigma", "sigma_eff", "clip_mean"} <= columns


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--strategy", "static", "--epsilon", "0"], "epsilon"),
        (["--strategy", "static", "--epsilon", "-1"], "epsilon"),
        (["--strategy", "static"], "needs a target epsilon"),
        (["--strategy", "static", "--epsilon", "2", "--delta", "0.01"], "1/N_train"),
        (["--strategy", "static", "--epsilon", "2", "--batch-size", "5000"], "q = "),
        (["--strategy", "static", "--epsilon", "1e-7"], "unreachable"),
    ],
)
def test_impossible_requests_fail_before_training(extra, message, tmp_path, capsys, raydp_cache):
    out = tmp_path / "run"
    assert main(["train", "--output", str(out), *COMMON, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("raydp: error:") and message in err and "\n" not in err
    assert list(tmp_path.iterdir()) == []


def test_a_dp_run_pads_every_batch_to_the_public_width(static_run, monkeypatch):
    """The run records its batch width: the longest of the public validation records it evaluated on (the same
    records for neighbouring datasets), and pads every training batch to it."""
    from raydp.model import load_model
    from raydp.runner.run import DP_WIDTH_RECORDS, dp_batch_width, public_validation_split
    from raydp.runner.task import Task

    summary = json.loads((static_run / "summary.json").read_text())
    loaded = load_model("embedded", device="cpu", progress=False)
    public = public_validation_split(loaded.tokenizer, 512, DP_WIDTH_RECORDS, Task())
    assert summary["privacy"]["batch_width"] == max(len(s) for s in public.sequences)
    assert summary["privacy"]["records_alone"] is False  # a CPU run computes its batch in one pass (ERRATA E17)
    # configured, or capped at max_length; a smaller public split is topped up to DP_WIDTH_RECORDS records
    assert dp_batch_width(40, 512, public, None) == 40 and dp_batch_width(None, 30, public, None) == 30
    fewer = public_validation_split(loaded.tokenizer, 512, 10, Task())
    assert dp_batch_width(None, 512, fewer, lambda n: public) == summary["privacy"]["batch_width"]


def test_a_record_does_not_change_the_shapes_other_records_are_computed_with():
    """The sensitivity of every DP release assumes one record changes its own contribution only. Padded to its
    longest record, a batch's width (and so the kernels' shapes) followed its records: on this project's 2-core CPU
    one record of 64 tokens or more moved the other records' per-sample gradients (15 of 16 rows, up to 4.7e-7
    relative). At the fixed width a DP run pads to, the other rows stay bit-identical."""
    import torch

    from raydp.data import public_corpus
    from raydp.model import disable_dropout, load_model
    from raydp.model.batches import TokenizedSplit
    from raydp.privacy.clipping import PerSampleGradientComputer

    torch.set_num_threads(1)
    loaded = load_model("embedded", device="cpu", progress=False)
    disable_dropout(loaded.model)  # as every DP run does (ERRATA E12)
    torch.manual_seed(0)
    with torch.no_grad():
        for pair in loaded.pairs:
            pair.b.normal_(0.0, 0.05)  # a trained-looking adapter: nonzero gradients through every matrix
    texts = public_corpus(32, seed=3, progress=False)
    split = TokenizedSplit(texts + [" ".join(texts[:3])], loaded.tokenizer, 512)
    long, width = len(texts), len(split.sequences[-1])
    assert width >= 64 > max(len(s) for s in split.sequences[:long])
    computer = PerSampleGradientComputer(loaded.model, loaded.pairs)
    for base in (list(range(16)), list(range(16, 32))):
        alone = split.collate(base, "cpu", width=width)
        joined = split.collate(base[:5] + [long] + base[5:], "cpu", width=width)
        g0 = computer.compute(alone.input_ids, alone.attention_mask)
        g1 = computer.compute(joined.input_ids, joined.attention_mask)
        others = torch.cat([g1.flat[:5], g1.flat[6:]])
        assert torch.equal(others, g0.flat)
        assert torch.equal(torch.cat([g1.losses[:5], g1.losses[6:]]), g0.losses)
