"""A byte-level BPE tokenizer trained locally (the embedded default never downloads one)."""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import ByteLevelBPETokenizer
from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<pad>"


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a GPT-2-style byte-level BPE tokenizer on ``texts`` (public data only).

    The result is a ``PreTrainedTokenizerFast`` with ``<|endoftext|>`` as bos/eos/unk and a separate
    ``<pad>`` token, ready for ``save_pretrained`` and ``AutoTokenizer.from_pretrained``.
    """
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        texts, vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS_TOKEN, PAD_TOKEN], show_progress=False
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=1_000_000,
    )
