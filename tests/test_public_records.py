"""The user's own public records (public_validation) for a free-text dataset, and the route a study on private free
text takes without them: the records are read in the dataset's form, refused when they are not apart from the
private data, and a study selects and prints on them; without them a study says which route it took (the recipe
alone, or private selection with its end-to-end epsilon), and refuses public selection on raydp's synthetic records.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import yaml

from raydp.errors import ConfigError

WORDS = "the patient reports mild pain after surgery and was advised rest fluids and review in two weeks".split()
OTHER = "discharge summary stable vitals tolerated diet follow up clinic medication reconciled".split()


def notes(units: range, words=WORDS, seed=0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame([{"mrn": f"MRN-{u:05d}", "note": " ".join(rng.choice(words, size=12)) + "."}
                         for u in units for _ in range(1 + u % 2)])


@pytest.fixture(scope="module")
def text_data(tmp_path_factory):
    """(private notes.csv, a built dataset of it, public notes of other patients, the same with one shared)."""
    from raydp.data.text_source import build_text_dataset

    root = tmp_path_factory.mktemp("notes")
    notes(range(0, 200)).to_csv(root / "notes.csv", index=False)
    build_text_dataset(root / "dataset", source=root / "notes.csv", text_column="note", unit_column="mrn",
                       n_canary=2)
    public = notes(range(10_000, 10_040), words=OTHER, seed=1)
    public.to_csv(root / "public_notes.csv", index=False)
    shared = public.copy()
    shared.loc[3, "mrn"] = "MRN-00007"  # a patient of the private table
    shared.to_csv(root / "shared.csv", index=False)
    respelled = public.copy()
    respelled.loc[5, "mrn"] = " mrn-00007 "  # the same patient as another export spells it
    respelled.to_csv(root / "respelled.csv", index=False)
    renamed = public.copy()
    renamed.loc[2, "note"] = "  " + notes(range(0, 200))["note"].iloc[11].replace(" ", "\n ")  # a private note,
    # re-wrapped, under a new id
    renamed.to_csv(root / "renamed.csv", index=False)
    return root


def test_public_texts_are_read_in_the_datasets_form_and_must_be_apart(text_data):
    from raydp.data import load_manifest
    from raydp.data.public_records import PublicRecords

    manifest = load_manifest(text_data / "dataset")
    records = PublicRecords.of(text_data / "public_notes.csv", manifest)
    texts, spans = records.texts(5)
    assert records.kind == "text" and spans is None
    assert texts == pd.read_csv(text_data / "public_notes.csv")["note"].tolist()[:5]
    records.check_apart(text_data / "dataset", manifest)  # other patients: accepted
    for name in ("shared.csv", "respelled.csv"):
        with pytest.raises(ConfigError, match="shares units .* with the private dataset's"):
            PublicRecords.of(text_data / name, manifest).check_apart(text_data / "dataset", manifest)
    with pytest.raises(ConfigError, match="holds a text of the private dataset's .* split"):
        PublicRecords.of(text_data / "renamed.csv", manifest).check_apart(text_data / "dataset", manifest)
    with pytest.raises(ConfigError, match="is the private dataset's own source file"):
        PublicRecords.of(text_data / "notes.csv", manifest).check_apart(text_data / "dataset", manifest)
    with pytest.raises(ConfigError, match="public_validation: .*has no column 'note'"):
        pd.DataFrame({"text": ["x"], "mrn": ["MRN-1"]}).to_csv(text_data / "wrong.csv", index=False)
        PublicRecords.of(text_data / "wrong.csv", manifest).texts(1)
    with pytest.raises(ConfigError, match="is not a file"):
        PublicRecords.of(text_data / "missing.csv", manifest)


def test_a_dataset_whose_splits_cannot_be_read_fails_the_check_closed(text_data, tmp_path):
    import shutil

    from raydp.data import load_manifest
    from raydp.data.public_records import PublicRecords, spellings

    broken = tmp_path / "broken"
    shutil.copytree(text_data / "dataset", broken)
    victim = next(p for p in broken.glob("*.parquet") if "eval" in p.name)
    victim.write_bytes(b"not parquet")
    manifest = load_manifest(broken)
    with pytest.raises(ConfigError, match="cannot compare .* nothing was started"):
        PublicRecords.of(text_data / "public_notes.csv", manifest).check_apart(broken, manifest)
    assert {"42", "0042", "42.0"} <= spellings("0042") | spellings("42.0") and "42" in spellings(" 42.0 ")


def test_a_text_split_is_scored_for_private_selection_by_each_texts_whole_nll(text_data):
    """record_values (private selection's per-record value) on free text: each text's whole NLL, one text per
    forward pass, summing to what the split's evaluation reports (nll_per_record x records)."""
    from raydp.data import load_texts
    from raydp.evaluation.perplexity import evaluate_perplexity
    from raydp.model import load_model
    from raydp.runner.task import Task
    from raydp.study.private_selection import record_values

    loaded = load_model("embedded-tiny", progress=False)
    split = Task().split(load_texts(text_data / "dataset", "validation")[:6], loaded.tokenizer, 64)
    values = record_values(loaded.model, split, loaded.device)
    whole = evaluate_perplexity(loaded.model, split, loaded.device)
    assert split.value_masks is None and len(values) == 6 and (values > 0).all()
    assert values.sum() == pytest.approx(whole.nll_per_record * 6, rel=1e-4)


def test_the_runs_public_validation_split_is_the_users_texts(text_data):
    from raydp.data import load_manifest
    from raydp.model import load_model
    from raydp.runner.run import public_validation_split

    loaded = load_model("embedded-tiny", progress=False)
    manifest = load_manifest(text_data / "dataset")
    split = public_validation_split(loaded.tokenizer, 64, 7, source=str(text_data / "public_notes.csv"),
                                    manifest=manifest)
    first = pd.read_csv(text_data / "public_notes.csv")["note"].tolist()[:7]
    assert len(split) == 7 and split.value_masks is None
    assert list(split.sequences[0][:8]) == loaded.tokenizer(first[0])["input_ids"][:8]


def _study(text_data, **extra) -> dict:
    return {"name": "notes", "models": ["embedded-tiny"], "epsilons": [4.0], "seeds": [0],
            "strategies": ["static-pairwise"], "wandb": {"mode": "disabled"},
            "resources": {"cpus_per_trial": 1},
            "base": {"data": {"source": str(text_data / "notes.csv"), "text_column": "note", "unit_column": "mrn",
                              "n_canary": 2},
                     "max_steps": 4, "eval_every": 4, "eval_max_records": 16, "public_eval_records": 16,
                     "warmup_steps": 1, "recipe": "none"}, **extra}


def test_a_study_on_private_free_text_without_public_records_names_its_route(text_data, tmp_path, capsys):
    """Public selection on raydp's synthetic records is refused before anything runs; selection: none and
    private-dp say which route they took (private-dp with its end-to-end epsilon per cell, from `--check`)."""
    from raydp.cli import main
    from raydp.study.config import StudyConfig
    from raydp.study.prepare import prepare_study

    refused = StudyConfig.model_validate(_study(text_data))
    with pytest.raises(ConfigError, match="free text and it gives no public records of its own.*selection: none"):
        prepare_study(refused, tmp_path / "refused", progress=False)
    assert not (tmp_path / "refused" / "trials").exists()
    capsys.readouterr()
    prepare_study(StudyConfig.model_validate(_study(text_data, selection="none")), tmp_path / "none")
    assert "no public records of your texts: route: the recipe alone (selection: none)" in capsys.readouterr().out
    base = {**_study(text_data)["base"], "data": {**_study(text_data)["base"]["data"], "fractions": {"validation": 0.2}}}
    private_dp = _study(text_data, search="random", selection="private-dp",
                        search_space={"static-pairwise": {"clip": {"low": 0.01, "high": 1.0, "log": True}}}, base=base)
    path = tmp_path / "private-dp.yaml"
    path.write_text(yaml.safe_dump(private_dp))  # the default score_range is for a record's value tokens
    assert main(["study", str(path), "--check"]) == 2
    assert "set private_selection.score_range for texts like yours" in capsys.readouterr().err
    path.write_text(yaml.safe_dump({**private_dp, "private_selection": {"score_range": [50.0, 400.0]}}))
    assert main(["study", str(path), "--check"]) == 0
    out = capsys.readouterr().out
    assert "route: private selection (selection: private-dp)" in out and "the released best at" in out
    shared = {**private_dp, "private_selection": {"score_range": [50.0, 400.0]},
              "base": {**base, "public_validation": str(text_data / "shared.csv")}}
    path.write_text(yaml.safe_dump(shared))  # refused before any charge, and by --check
    assert main(["study", str(path), "--check"]) == 2
    assert "shares units" in capsys.readouterr().err


def test_selection_none_runs_one_dp_arm_and_releases_its_first_seed():
    from raydp.study.config import StudyConfig
    from raydp.study.results import fixed_release

    base = {"name": "s", "models": ["embedded-tiny"], "epsilons": [1.0], "selection": "none"}
    StudyConfig.model_validate({**base, "strategies": ["nonprivate", "static-pairwise"]})
    for bad in ({"strategies": ["static", "static-pairwise"]},
                {"strategies": ["static-pairwise"], "settings_grid": {"static-pairwise": {"clip": [0.1, 1.0]}}}):
        with pytest.raises(ValueError, match="selection: none runs one DP arm"):
            StudyConfig.model_validate({**base, **bad})
    table = pd.DataFrame([
        {"trial": f"t{seed}", "model": "m", "epsilon_target": 1.0, "strategy": "static-pairwise", "seed": seed,
         "status": "TERMINATED", "final_public_perplexity": value}
        for seed, value in ((2, 1.0), (0, 9.0), (1, 5.0))])
    released = fixed_release(table, "final_public_perplexity")
    assert released["trial"].tolist() == ["t0"] and released["seed"].tolist() == [0]  # not the best: the first
    table.loc[table["seed"] == 0, "status"] = "ERROR"  # the planned trial failed: nothing released, not seed 1
    assert fixed_release(table, "final_public_perplexity").empty


def test_a_study_given_the_users_public_texts_selects_and_prints_on_them(text_data, tmp_path, local_ray):
    from raydp.study.runner import run_study
    from raydp.study.tables import format_study

    study = _study(text_data, settings_grid={"static-pairwise": {"clip": [0.05, 1.0]}})
    study["base"]["public_validation"] = str(text_data / "public_notes.csv")
    path = tmp_path / "notes.yaml"
    path.write_text(yaml.safe_dump(study))
    study_dir = run_study(path, tmp_path / "out", progress=False)
    results = pd.read_parquet(study_dir / "results.parquet")
    assert results["public_validation"].tolist() == ["public_notes.csv"] * 2
    for run_dir in results["run_dir"]:
        summary = json.loads((tmp_path / "out" / "notes" / "trials" / run_dir.split("/")[-1] /
                              "summary.json").read_text())
        assert summary["public_validation"] == str(text_data / "public_notes.csv")
    best = results.loc[results["final_public_perplexity"].idxmin(), "trial"]
    printed = format_study(study_dir)
    assert "NOTE: public validation records: yours (public_notes.csv)" in printed
    assert f"the trial this study would release: {best}" in printed
    from raydp.report import write_report

    assert "public validation (public_notes.csv)" in write_report(study_dir).read_text()  # its curves' axis
