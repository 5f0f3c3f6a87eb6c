"""DualTune-GhostDP end to end: both phase-1 variants (the redacted one through `raydp train`: what its terminal
shows), the run's ledger recomputed with dp_accounting, the E16 label and its consequences (the audit is not
compared), its evaluation, and a study on Ray with both variants beside static DP-SGD, attacked and reported."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import PLDAccountant

from raydp.cli import main
from raydp.strategies.dualtune import REDACTED_LABEL

SMALL = ["--model", "embedded-tiny", "--n-records", "300", "--epochs", "1", "--max-length", "96", "--quiet"]
QUICK_EVAL = {"generations": 10, "exposure_candidates": 20, "membership_records": 8, "audit": False}


def _ledger_epsilon(run, delta):
    accountant = PLDAccountant()
    for row in pq.read_table(run / "privacy_ledger.parquet", columns=["q", "sigma_eff"]).to_pylist():
        accountant.compose(dp_event.PoissonSampledDpEvent(row["q"], dp_event.GaussianDpEvent(row["sigma_eff"])))
    return accountant.get_epsilon(delta)


@pytest.fixture(scope="module")
def public_run(tmp_path_factory):
    from raydp.config import TrainConfig
    from raydp.runner.launch import train

    out = tmp_path_factory.mktemp("dualtune") / "public"  # SMALL's run, as `raydp train` runs it
    train(TrainConfig.model_validate({"model": "embedded-tiny", "data": {"n_records": 300}, "epochs": 1,
                                      "max_length": 96, "strategy": "dualtune", "epsilon": 2,
                                      "settings": {"phase1_epochs": 2, "phase1_lr": 0.01, "clip": 0.5,
                                                   "phase1_records": 200}}), out, progress=False)
    return out


def test_public_phase_one_trains_on_the_public_corpus_and_the_guarantee_covers_the_run(public_run):
    summary = json.loads((public_run / "summary.json").read_text())
    phase, privacy = summary["phase_one"], summary["privacy"]
    assert phase["data"] == "public" and phase["records"] == phase["trained_records"] == 200
    assert phase["steps"] == 26  # 2 epochs of ceil(200 / 16) batches: public counts, reported
    assert phase["public_perplexity_after"] < phase["public_perplexity_before"]  # phase 1 did train
    assert privacy["strategy"]["gradient_source"] == "ghost" and privacy["strategy"]["clip_mode"] == "flat"
    assert privacy["labels"] == [] and privacy["within_budget"]
    assert privacy["epsilon"] == pytest.approx(_ledger_epsilon(public_run, privacy["delta"]), rel=0.02)
    assert privacy["epsilon"] <= 2.0
    rows = pq.read_table(public_run / "privacy_ledger.parquet").to_pylist()
    assert len(rows) == privacy["steps_charged"] == summary["steps"]  # only phase 2 is charged
    assert {tuple(r["clip"]) for r in rows} == {(0.5,)}


def test_redacted_phase_one_is_labelled_and_its_audit_is_not_compared(tmp_path, capsys):
    out = tmp_path / "redacted"
    assert main(["train", "--output", str(out), "--strategy", "dualtune", "--epsilon", "8", *SMALL,
                 "--n-canary", "4", "--set", "phase1=redacted", "--set", "clipping=per_sample"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    phase, privacy = summary["phase_one"], summary["privacy"]
    assert phase["data"] == "redacted"
    # its record and step counts are the private training record count's: not in the summary nor on the terminal
    assert not {"records", "trained_records", "steps"} & set(phase)
    n_train = json.loads((out / "private" / "dataset" / "manifest.json").read_text())["sizes"]["train"]
    printed = capsys.readouterr().out
    assert f"{n_train} records" not in printed and "phase 1 (non-private)      redacted: public perplexity" in printed
    assert phase["detector"]["level"] == "high_context"
    recall = phase["canary_recall_private"]
    assert recall["total"] == 4 and 0 <= recall["recall"] <= 1 and "not a DP release" in recall["note"]
    assert phase["field_recall_public"]  # measured on public records
    assert REDACTED_LABEL in privacy["labels"] and REDACTED_LABEL in privacy["verdict"]
    assert privacy["strategy"]["gradient_source"] == "per_sample"
    assert "phase 2 only" in printed  # the terminal says it too
    from raydp.evaluation.evaluate import evaluate_run
    from raydp.evaluation.settings import EvalConfig

    evaluate_run(out, EvalConfig(**QUICK_EVAL), progress=False)
    claimed = json.loads((out / "evaluation.json").read_text())["claimed"]
    assert claimed["comparable"] is False and "phase 2 only" in claimed["note"]


def test_a_public_phase_one_does_not_depend_on_the_private_training_records(tmp_path):
    """Its size is a public constant by default, not the private record count (which counts the audit canaries
    whose coin came up): the same public texts and report whatever the private training set."""
    from raydp.runner.phases import PUBLIC_PHASE_ONE_RECORDS, phase_one_texts
    from raydp.strategies.registry import make_strategy

    warm = make_strategy("dualtune").warm_start()
    texts, report = phase_one_texts(warm, ["a private record"] * 184, tmp_path)
    assert (texts, report) == phase_one_texts(warm, ["a private record"] * 185, tmp_path)
    assert len(texts) == report["records"] == PUBLIC_PHASE_ONE_RECORDS


def test_dualtune_refuses_bad_settings_with_one_line(tmp_path, capsys):
    for bad in (["--set", "phase1=private"], ["--set", "clipping=fast"], ["--set", "phase1_epochs=-1"]):
        assert main(["train", "--output", str(tmp_path / "x"), "--strategy", "dualtune", *SMALL, *bad]) == 2
        assert capsys.readouterr().err.count("\n") == 1
        assert not (tmp_path / "x").exists()


# ~60 s: both dualtune variants in a Ray study, attacked and reported; each variant end to end is
# test_dualtune.py's runs above, a study with a non-DP-SGD strategy attacked and reported is
# test_forward_ldp.py::test_a_classification_study_runs_a_local_strategy_beside_dp_sgd_on_ray
@pytest.mark.slow
def test_a_study_runs_both_dualtune_variants_beside_static_dp_sgd_on_ray(local_ray, tmp_path):
    import pandas as pd
    import yaml

    from raydp.study.runner import run_study

    study = {"name": "dualtune", "models": ["embedded-tiny"], "epsilons": [8.0], "seeds": [0],
             "strategies": ["static", "dualtune"], "resources": {"cpus_per_trial": 1}, "wandb": {"mode": "disabled"},
             "settings_grid": {"dualtune": {"phase1": ["public", "redacted"]}},
             "strategy_settings": {"dualtune": {"phase1_records": 200}},
             "evaluate": {"generations": 10, "exposure_candidates": 20, "membership_records": 8, "audit": False},
             "attack": "all",
             "base": {"data": {"n_records": 300, "n_canary": 4}, "epochs": 1, "max_length": 64,
                      "eval_max_records": 32, "public_eval_records": 32}}
    path = tmp_path / "dualtune.yaml"
    path.write_text(yaml.safe_dump(study))
    study_dir = run_study(path, tmp_path / "out", progress=False)
    table = pd.read_parquet(study_dir / "results.parquet")
    assert sorted(table["strategy"]) == ["dualtune", "dualtune", "static"]
    assert (table["status"] == "TERMINATED").all() and table["within_budget"].all() and table["mia_auc"].notna().all()
    labels = dict(zip(table["trial"], table["privacy_labels"]))
    redacted = [t for t in labels if "redacted" in t]
    assert len(redacted) == 1 and REDACTED_LABEL in str(labels[redacted[0]])
    assert all(REDACTED_LABEL not in str(v) for t, v in labels.items() if t not in redacted)
    assert table["epsilon_edgeworth"].notna().all()
    assert main(["report", str(study_dir)]) == 0
    page = next(study_dir.glob("**/*.html")).read_text()
    assert "Edgeworth" in page and "phase 2 only" in page


# ~100 s: the one-run audit of a ghost-clipped run; the ghost-clipped release equals the per-sample one
# (test_ghost_clipping.py::test_a_dp_step_with_ghost_clipping_releases_what_per_sample_clipping_releases),
# whose audit is test_evaluation.py::test_the_correct_mechanism_passes_its_audit_and_reports
@pytest.mark.slow
def test_the_epsilon_audit_is_consistent_with_a_ghost_clipped_run(tmp_path):
    """An attack on the ghost-clipped mechanism: the one-run audit (Steinke et al. 2023) of a run where
    memorisation is possible (tests/test_evaluation.py's AUDITABLE settings, whose noise-off twin the
    audit catches) must not bound epsilon above the claim."""
    from raydp.config import TrainConfig
    from raydp.runner.run import run_training
    from tests.test_evaluation import AUDITABLE, QUICK

    config = {**AUDITABLE, "strategy": "dualtune", "settings": {"clip": 10.0, "phase1_epochs": 0}}
    run = tmp_path / "ghost-audit"
    run_training(TrainConfig.model_validate(config), run, progress=False)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["privacy"]["strategy"]["gradient_source"] == "ghost" and summary["phase_one"] is None
    assert main(["eval", str(run), *QUICK]) == 0
    audit = json.loads((run / "evaluation.json").read_text())["audit"]
    assert audit["consistent"] is True and audit["m"] == 100
    assert audit["epsilon_one_run"] <= audit["claimed_epsilon"]
