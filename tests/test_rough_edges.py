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
    values = {key: value for key, value in values.items() if value is not None}  # None: the key left out
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


@pytest.fixture()
def unreachable_hub(monkeypatch, tmp_path):
    """The Hub online (HF_HUB_OFFLINE unset for this test) at a closed localhost port, with an empty cache. The
    values huggingface_hub read at its import are set too: the test session imported it offline."""
    import socket

    from huggingface_hub import constants

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{probe.getsockname()[1]}"
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return endpoint, tmp_path / "hub"


def test_an_unreachable_hub_fails_at_once_in_one_line_with_the_offline_hint(unreachable_hub, tmp_path, capsys):
    import time

    endpoint, _ = unreachable_hub
    started = time.monotonic()
    assert main(["train", "--model", "raydp-tests/no-such-model", "--output", str(tmp_path / "run"),
                 "--n-records", "60", "--quiet"]) == 2
    assert time.monotonic() - started < 5  # one attempt: huggingface_hub's retries took about a minute
    err = _one_line_error(capsys)
    assert f"cannot reach the Hugging Face Hub at {endpoint}" in err and "HF_HUB_OFFLINE=1" in err
    assert not (tmp_path / "run").exists()


def test_an_unreachable_hub_loads_a_cached_model_from_the_cache(unreachable_hub, tiny_tokenizer_dir):
    """The Hub unreachable and the model in the cache: it loads from the cache, with no retries."""
    import shutil
    import time

    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from raydp.model import load_model

    _, cache = unreachable_hub
    repo = cache / "models--raydp-tests--tiny-cached"
    commit = "0" * 40
    snapshot = repo / "snapshots" / commit
    GPT2LMHeadModel(GPT2Config(vocab_size=len(AutoTokenizer.from_pretrained(tiny_tokenizer_dir)), n_positions=32,
                               n_embd=16, n_layer=1, n_head=2)).save_pretrained(snapshot)
    shutil.copytree(tiny_tokenizer_dir, snapshot, dirs_exist_ok=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    started = time.monotonic()
    loaded = load_model("raydp-tests/tiny-cached", device="cpu", progress=False)
    assert time.monotonic() - started < 8 and loaded.model_type == "gpt2" and len(loaded.pairs) == 1


def test_the_offline_hub_still_fails_in_one_line(tmp_path, capsys):
    """HF_HUB_OFFLINE=1 (the tests' setting): a Hub name that is not cached is refused by transformers, in one line."""
    assert main(["train", "--model", "raydp-tests/no-such-model", "--output", str(tmp_path / "run"),
                 "--n-records", "60", "--quiet"]) == 2
    err = _one_line_error(capsys)
    assert "cannot load model 'raydp-tests/no-such-model'" in err and not (tmp_path / "run").exists()


@pytest.mark.parametrize("config, words", [
    ("epochz: 1\n", "invalid config: epochz: unknown field (did you mean epochs?)"),
    ("data: {n_record: 50}\n", "invalid config: data.n_record: unknown field (did you mean n_records?)"),
    ("strategy: rldp\nepsilon: 2\nsettings: {t_wrm: 5}\n",
     "invalid config: settings.t_wrm: unknown field (did you mean t_warm?)"),
    ("lora: {rank: 4}\n", "invalid config: lora.rank: unknown field\n"),  # nothing near: no guess
])
def test_a_misspelt_config_key_names_the_nearest_field(tmp_path, capsys, config, words):
    (tmp_path / "run.yaml").write_text(config)
    assert main(["train", "--config", str(tmp_path / "run.yaml"), "--output", str(tmp_path / "run")]) == 2
    assert words in _one_line_error(capsys)


@pytest.mark.parametrize("changes, words", [
    ({"epsilon": [2.0], "epsilons": None}, "epsilon: unknown field (did you mean epsilons?)"),  # not: epsilons missing
    ({"sac_grid": {"trl": [4]}}, "sac_grid.trl: unknown field (did you mean t_rl?)"),
    ({"base": {"batch_sise": 4}}, "batch_sise: unknown field (did you mean batch_size?)"),  # a trial's TrainConfig
])
def test_a_misspelt_study_key_names_the_nearest_field(tmp_path, capsys, changes, words):
    path = _study_file(tmp_path, **changes)
    assert main(["study", str(path), "--check"]) == 2
    assert words in _one_line_error(capsys)
