"""Rough edges a first user meets: each is refused in one line, or behaves as documented. Fast, no Ray."""

from __future__ import annotations

import pytest

from raydp.cli import main
from raydp.errors import ModelError


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("raydp: error: ") and err.count("\n") == 1, err
    return err


@pytest.fixture()
def weights_without_tokenizer(tmp_path):
    """A tiny GPT-2 built from config and saved with save_pretrained: config and weights, no tokenizer files."""
    from transformers import GPT2Config, GPT2LMHeadModel

    path = tmp_path / "no-tokenizer"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=64, n_positions=32, bos_token_id=0,
                               eos_token_id=0)).save_pretrained(path)
    return path


def test_a_model_directory_without_a_tokenizer_is_refused_in_one_line(weights_without_tokenizer, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--model", str(weights_without_tokenizer), "--output", str(out), "--n-records", "60",
                 "--epochs", "1", "--quiet"]) == 2
    err = _one_line_error(capsys)
    assert "has no tokenizer" in err and str(weights_without_tokenizer) in err
    assert "tokenizer.json" in err and "tokenizer_config.json" in err  # which files were looked for
    assert not out.exists()


def test_tokenizer_settings_without_a_vocabulary_are_refused(weights_without_tokenizer):
    """A tokenizer_config.json alone passes the look for files; AutoTokenizer then builds an empty vocabulary."""
    from raydp.model import load_model

    (weights_without_tokenizer / "tokenizer_config.json").write_text('{"tokenizer_class": "GPT2Tokenizer"}')
    with pytest.raises(ModelError, match="has no tokenizer: .* gives an empty vocabulary"):
        load_model(str(weights_without_tokenizer), device="cpu", progress=False)


def _study_file(folder, **changes):
    import yaml

    values = {"name": "paths", "models": ["embedded-tiny"], "epsilons": [2.0], "strategies": ["static"],
              "resources": {"cpus_per_trial": 1}, **changes}
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "paths.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def _notes(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("mrn,note\n" + "\n".join(f"m{u},note {u} of the patient" for u in range(40)) + "\n")
    return path


def test_a_study_files_relative_paths_are_read_beside_it_first_then_in_the_working_directory(tmp_path, monkeypatch):
    from raydp.study.config import load_study

    studies, elsewhere = tmp_path / "studies", tmp_path / "elsewhere"
    data = {"source": "notes.csv", "text_column": "note", "unit_column": "mrn"}
    path = _study_file(studies, base={"data": data}, tuned_from="tuned/search.json")
    beside = _notes(studies / "notes.csv")
    (studies / "tuned").mkdir()
    (studies / "tuned" / "search.json").write_text("{}")
    _notes(elsewhere / "notes.csv")  # the same name in the working directory: the study file's own comes first
    monkeypatch.chdir(elsewhere)
    study = load_study(path)
    assert study.base["data"]["source"] == str(beside)
    assert study.tuned_from == str(studies / "tuned" / "search.json")
    beside.unlink()  # not beside the study file: the working directory's
    assert load_study(path).base["data"]["source"] == str(elsewhere / "notes.csv")
    # a search study's directory that has not run yet stays as written (the trial grid says it is not finished)
    assert load_study(_study_file(studies, tuned_from="runs/studies/search")).tuned_from == "runs/studies/search"


def test_a_study_files_missing_source_names_both_places_in_one_line(tmp_path, monkeypatch, capsys):
    studies, elsewhere = tmp_path / "studies", tmp_path / "elsewhere"
    elsewhere.mkdir()
    path = _study_file(studies, base={"data": {"source": "notes.csv", "text_column": "note", "unit_column": "mrn"}})
    monkeypatch.chdir(elsewhere)
    assert main(["study", str(path), "--check"]) == 2
    err = _one_line_error(capsys)
    assert "base.data.source: notes.csv" in err
    assert str(studies / "notes.csv") in err and str(elsewhere / "notes.csv") in err
