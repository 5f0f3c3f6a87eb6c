"""DP runs through the CLI: the reported epsilon is true, and impossible requests fail before training."""

import json

import pyarrow.parquet as pq
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import PLDAccountant

from raydp.cli import main

COMMON = ["--quiet", "--n-records", "600", "--epochs", "1"]


@pytest.fixture(scope="module")
def static_run(tmp_path_factory, raydp_cache):
    out = tmp_path_factory.mktemp("dp") / "static"
    assert main(["train", "--output", str(out), "--strategy", "static", "--epsilon", "2", *COMMON]) == 0
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
