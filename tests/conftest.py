import os
from pathlib import Path

import pytest

# Never reach a model hub from tests; keep Ray and wandb quiet and local.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def raydp_cache(tmp_path_factory) -> Path:
    """One model cache for the whole test session (embedded models are built once)."""
    cache = Path(os.environ.get("RAYDP_TEST_CACHE") or tmp_path_factory.mktemp("raydp-cache"))
    os.environ["RAYDP_CACHE"] = str(cache)
    return cache


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    """A locally trained BPE tokenizer saved with save_pretrained (for tiny random Llama/Mistral/GPT-2)."""
    from raydp.data import public_corpus
    from raydp.model.tokenizer import train_bpe_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    train_bpe_tokenizer(public_corpus(200, seed=1), vocab_size=300).save_pretrained(path)
    return path
