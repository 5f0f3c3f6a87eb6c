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
