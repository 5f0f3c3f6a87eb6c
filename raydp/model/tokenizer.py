"""A byte-level BPE tokenizer trained locally (the embedded default never downloads one).

Two pre-tokenisations: ``'words'`` (GPT-2's: merges stay inside a word, so a narrative of ~300 words is ~340
tokens) and ``'clauses'`` (the embedded default since the structured benchmark: the text is cut after each
period and each '=' and merges run across spaces inside a clause, so a frequent clause such as "metformin is not prescribed. "
becomes one token and a narrative is ~50 tokens, its template mostly folded into its values' tokens). Both are
byte-level BPE (any text encodes; nothing is out of vocabulary); the value-token metric scores the tokens that
overlap a value's characters, in nats per record, which compares across the two.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import ByteLevelBPETokenizer, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PRETOKENIZATIONS = ("words", "clauses")
#: up to and including each period (and the space after it) or '=': a canary's ' secret_id=' is cut from its secret,
#: so a secret tokenises the same after its context as on its own (exposure scores candidates that way)
CLAUSE = r"[^.=]*[.=]\s?|[^.=]+$"

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<pad>"


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, pretokenize: str = "words") -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts`` (public data only); ``pretokenize``: ``'words'`` (GPT-2's)
    or ``'clauses'`` (module docstring).

    The result is a ``PreTrainedTokenizerFast`` with ``<|endoftext|>`` as bos/eos/unk and a separate
    ``<pad>`` token, ready for ``save_pretrained`` and ``AutoTokenizer.from_pretrained``.
    """
    if pretokenize not in PRETOKENIZATIONS:
        raise ValueError(f"pretokenize must be one of {PRETOKENIZATIONS}, got {pretokenize!r}")
    if pretokenize == "words":
        bpe = ByteLevelBPETokenizer()
        bpe.train_from_iterator(
            texts, vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS_TOKEN, PAD_TOKEN], show_progress=False
        )
        tokenizer = bpe._tokenizer
    else:
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(CLAUSE), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
            vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS_TOKEN, PAD_TOKEN],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=1_000_000,
    )
