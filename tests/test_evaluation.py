"""The evaluation of a run: the audit catches a broken mechanism (``raydp eval`` end to end: its exit code and
verdict) and passes the correct one; the CLI's errors; a released cell's evaluation kept out of it; the report
renders the run's evaluation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from raydp.config import TrainConfig
from raydp.errors import ConfigError
from raydp.evaluation.results import EvalConfig

# A run where memorisation is possible, so that an audit has power: few real records (truncated to 64
# tokens), 100 audit canaries (short records, 41 included), LoRA on attention and MLP, 200 epochs. The
# held-back canaries count in N (q = 32 / 122), so batch 32 keeps about 16 units a step; with batch 16
# (8 a step, twice the steps) the noise-off run memorised much less (39 of 40, or chance, in two runs).
# With the noise on, the mechanism is 0.3-DP; with it off, nothing protects the canaries.
AUDITABLE = {"model": "embedded-tiny", "strategy": "static", "epsilon": 0.3, "delta": 1e-5,
             "data": {"n_records": 30, "n_audit": 100}, "max_length": 64, "epochs": 200, "batch_size": 32,
             "lr": 0.01, "warmup_steps": 0, "eval_every": 1000, "eval_max_records": 8, "public_eval_records": 8,
             "settings": {"clip": 10.0}, "lora": {"r": 32, "alpha": 64, "target_modules": ["c_attn", "c_fc", "c_proj"]}}
QUICK = ["--generations", "40", "--candidates", "100", "--membership-records", "16"]
QUICK_SETTINGS = EvalConfig(generations=40, exposure_candidates=100, membership_records=16)  # QUICK's settings


def _train(tmp_path: Path, name: str, **changes) -> Path:
    from raydp.runner.run import run_training

    run = tmp_path / name
    run_training(TrainConfig.model_validate({**AUDITABLE, **changes}), run, progress=False)
    return run


@pytest.mark.parametrize("seeds", [(2,), pytest.param((0, 2), marks=pytest.mark.slow)])
def test_the_audit_catches_a_mechanism_with_its_noise_off(tmp_path, monkeypatch, capsys, seeds):
    """The bug: the DP step adds no noise but the ledger still charges epsilon 0.3. The one-run audit's
    lower bound must land far above 0.3, and `raydp eval` must exit 3 and say so."""
    from raydp.cli import main
    from raydp.privacy.engine import DPStep

    monkeypatch.setattr(DPStep, "add_noise", lambda self, clipped, stds, mode: clipped.float())
    # The one-run audit's power is one draw of the training randomness, and at m = 100 it misses a noise-off run in
    # some draws. Fixed sampling randomness makes a draw repeatable on one CPU, but float rounding moves it between
    # CPUs: seeds 0-3 gave 0.48, 0.30, 1.91, 1.91 on one (after the fused GELU) and seeds 0-5 gave 1.91, 1.54, 1.87,
    # 0.24, 0.36, 1.91 on another (2026-11-28), where seed 3, the single draw this test used to take, fell under the
    # claim. The fast tier takes seed 2, at the cap on the first CPU and 1.87 on the second; the slow tier adds seed 0,
    # the other CPU's weak draw. The audit must flag at least one draw, every flagged one must say so, and the stronger
    # must be far above the claim. Fixed randomness labels the epsilon void, which the audit rightly does not compare;
    # the bug under test is a run that claims its epsilon, so the label comes off the summary (what the broken code
    # would have written).
    draws = []
    for seed in seeds:
        run = _train(tmp_path, f"broken-{seed}", unsafe_fixed_randomness=True, seed=seed)
        summary = json.loads((run / "summary.json").read_text())
        assert any("void" in label for label in summary["privacy"]["labels"])
        summary["privacy"]["labels"] = [label for label in summary["privacy"]["labels"] if "void" not in label]
        (run / "summary.json").write_text(json.dumps(summary))
        claimed = summary["privacy"]["epsilon"]
        assert claimed <= 0.3  # the accounting does not know
        code = main(["eval", str(run), *QUICK])
        captured = capsys.readouterr()
        audit = json.loads((run / "evaluation.json").read_text())["audit"]
        assert audit["claimed_epsilon"] == claimed
        assert code == (3 if not audit["consistent"] else 0)
        if code == 3:
            assert "leak more than their claimed epsilon" in captured.err and "VIOLATION" in captured.out
        draws.append(audit)
    assert any(not audit["consistent"] for audit in draws)
    strongest = max(draws, key=lambda audit: audit["epsilon_one_run"])
    assert strongest["epsilon_one_run"] > 4 * claimed  # seed 2: 1.91 (the cap at m = 100) and 1.87 on the CPUs above
    assert strongest["epsilon_clopper_pearson"] > claimed


def test_the_correct_mechanism_passes_its_audit_and_reports(tmp_path):
    from raydp.evaluation.evaluate import evaluate_run
    from raydp.evaluation.results import summary_line
    from raydp.report import write_report

    run = _train(tmp_path, "correct")
    line = summary_line(evaluate_run(run, QUICK_SETTINGS, progress=False))
    text = (run / "evaluation.json").read_text()
    result = json.loads(text)  # standard JSON: no NaN
    assert "NaN" not in text and "Infinity" not in text
    assert "not a DP release" in result["label"]
    audit = result["audit"]
    assert audit["consistent"] is True and audit["m"] == 100 and audit["unscored"] == 0
    assert audit["epsilon_one_run"] <= audit["claimed_epsilon"] and audit["epsilon_clopper_pearson"] <= 0.3
    mia, ext, exp = result["membership"], result["extraction"], result["exposure"]
    assert 0 <= mia["loss"]["auc"] <= 1 and mia["n_members"] == mia["n_nonmembers"] > 0
    assert ext["generations"] == 40 and ext["n_canary"] == 10 and 0 <= ext["n_valid"] <= 40
    assert exp["candidates"] == 100 and len(exp["per_canary"]) == 10
    assert 0 <= exp["max"] <= exp["max_measurable_bits"] == pytest.approx(math.log2(101))
    assert result["seconds"]["total"] > 0 and result["cost_ratio"] > 0
    assert result["claimed"]["privacy_unit"] == "patient"
    assert "MIA AUC" in line and "not refuted" in line
    # the run's HTML report shows the evaluation
    assert write_report(run) == run / "report.html"
    page = (run / "report.html").read_text()
    assert 'id="table-audit"' in page and 'id="table-membership"' in page
    assert 'class="violation"' not in page and '>not refuted<' in page


def test_eval_refuses_what_is_not_a_finished_run(tmp_path, capsys):
    from raydp.cli import main

    assert main(["eval", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    (tmp_path / "empty").mkdir()
    assert main(["eval", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert "summary.json" in err and err.count("\n") == 1
    assert main(["eval", str(tmp_path / "empty"), "--generations", "-1"]) == 2
    assert "generations" in capsys.readouterr().err
    assert list((tmp_path / "empty").iterdir()) == []  # nothing written


def test_eval_settings_validate_and_load_from_yaml(tmp_path):
    from raydp.cli import build_parser, eval_config_from_args

    path = tmp_path / "eval.yaml"
    path.write_text("generations: 100\nextraction_prompt: narrative\n")
    args = build_parser().parse_args(["eval", "run", "--config", str(path), "--candidates", "7"])
    settings = eval_config_from_args(args)
    assert settings == EvalConfig(generations=100, extraction_prompt="narrative", exposure_candidates=7)
    assert EvalConfig().generations == 4000  # RLDP Sec. 3.3's T


def test_eval_of_a_released_cell_writes_nothing_into_it(tmp_path, monkeypatch, capsys):
    """A released cell of a private selection (released/CELL) holds releasable files only, as its PRIVACY.txt says:
    `raydp eval` on it writes its evaluation (attacks on private records: private) to the study's private
    work/evaluations/CELL/, never beside them; a released cell without its study around it is refused, nothing
    written. (It wrote released/CELL/evaluation.json.) The attacks are left out here (ATTACKS empty): where the file
    goes does not depend on them."""
    import shutil

    import raydp.evaluation.evaluate as evaluate
    from raydp.runner.run import run_training

    run = tmp_path / "run"
    run_training(TrainConfig.model_validate({"model": "embedded-tiny", "strategy": "static", "epsilon": 2.0,
                                             "data": {"n_records": 60}, "max_steps": 2, "warmup_steps": 0,
                                             "eval_max_records": 4, "public_eval_records": 4}), run, progress=False)
    study = tmp_path / "study"
    cell = study / "released" / "embedded-tiny_eps2_seed0"
    (study / "work").mkdir(parents=True)
    cell.mkdir(parents=True)
    shutil.copytree(run / "adapter", cell / "adapter")
    config = json.loads((run / "config.json").read_text())
    config["data"]["source"] = str(run / "private" / "dataset")  # a private-dp trial reads the study's dataset/
    (cell / "config.json").write_text(json.dumps(config))
    shutil.copyfile(run / "summary.json", cell / "summary.json")
    (cell / "selection.json").write_text("{}")
    (cell / "PRIVACY.txt").write_text("Everything in this directory is releasable\n")
    before = sorted(p.name for p in cell.iterdir())
    monkeypatch.setattr(evaluate, "ATTACKS", [])

    evaluate.evaluate_run(cell, progress=False)
    written = study / "work" / "evaluations" / cell.name / "evaluation.json"
    assert json.loads(written.read_text())["format"] and oct(written.stat().st_mode & 0o777) == "0o600"
    assert sorted(p.name for p in cell.iterdir()) == before  # nothing new in the releasable folder
    assert f"is in {written}" in capsys.readouterr().err
    # released/ copied out of its study: refused, nothing written
    alone = tmp_path / "copied" / cell.name
    shutil.copytree(cell, alone)
    with pytest.raises(ConfigError, match="without its study directory around it") as refused:
        evaluate.evaluate_run(alone, progress=False)
    assert "\n" not in str(refused.value)  # one line
    assert sorted(p.name for p in alone.iterdir()) == before
    # an explicit place inside a released cell is refused too; one outside it is taken
    with pytest.raises(ConfigError, match="inside a released cell"):
        evaluate.evaluate_run(cell, progress=False, out=cell / "adapter" / "evaluation.json")
    evaluate.evaluate_run(alone, progress=False, out=tmp_path / "owner" / "evaluation.json")
    assert (tmp_path / "owner" / "evaluation.json").is_file()
