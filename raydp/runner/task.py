"""The task a run trains and evaluates: language modelling (the default) or classification.

A task gives the run its splits, the per-example loss (what the DP step clips per example) and the
held-out metric; the loop and the DP step are the same for both (the task is injected, not a fork of the loop).

* ``lm``: per-sequence next-token NLL (:mod:`raydp.model.loss`), perplexity.
* ``classification``: a label field of the narratives as a prompt classifier (:mod:`raydp.data.tasks`,
  :mod:`raydp.model.classifier`), label perplexity and accuracy. Prompts are fixed-length and
  left-filled (no sequence length in the attention mask). Every training record must have a label
  (the number of training units is treated as public: dropping some would change it).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from raydp.data.tasks import ClassificationSpec, classification_spec, to_classification
from raydp.errors import ConfigError
from raydp.evaluation.classification import evaluate_classification
from raydp.evaluation.perplexity import evaluate_perplexity
from raydp.model.batches import TokenizedSplit
from raydp.model.classifier import class_token_ids, per_example_cross_entropy
from raydp.model.loss import per_sequence_nll

TASKS = ("lm", "classification")


@dataclass
class Task:
    kind: str = "lm"
    spec: ClassificationSpec | None = None
    class_ids: tuple[int, ...] | None = None
    #: where the class logits are read: the last token (causal LM) or the mask token (encoder)
    position: int = -1
    #: appended to every prompt (an encoder's mask token)
    suffix: str = ""

    @classmethod
    def build(cls, kind: str, label: str, tokenizer, encoder: bool = False) -> Task:
        if kind not in TASKS:
            raise ConfigError(f"unknown task {kind!r}; choose one of {', '.join(TASKS)}")
        if encoder and kind == "lm":
            raise ConfigError("an encoder (masked LM) trains the classification task only: set "
                              "task: {kind: classification}")
        if kind == "lm":
            return cls()
        spec = classification_spec(label)
        if not encoder:
            try:
                return cls(kind, spec, class_token_ids(tokenizer, spec.classes))
            except ConfigError:  # e.g. a clause tokenizer: " changed" and " not" both start with the space
                return cls(kind, spec, class_token_ids(tokenizer, spec.classes, leading_space=False), suffix=" ")
        if tokenizer.mask_token is None:
            raise ConfigError("this encoder's tokenizer has no mask token to classify with")
        suffix = f" {tokenizer.mask_token}"
        ids = tokenizer(f"{spec.prompt}{suffix}")["input_ids"]  # the mask's place from the end (before [SEP])
        position = ids.index(tokenizer.mask_token_id) - len(ids)
        return cls(kind, spec, class_token_ids(tokenizer, spec.classes), position, suffix)

    @property
    def is_classification(self) -> bool:
        return self.kind == "classification"

    def length_cap(self, configured: int | None, max_positions: int) -> int:
        """Tokens per sequence: the config's ``max_length``, else the model's, at most 384 for a classification
        prompt and 512 for a narrative."""
        return configured or min(max_positions, 384 if self.is_classification else 512)

    def split(self, texts: list[str], tokenizer, max_length: int, units=None, require_all: bool = False,
              spans=None) -> TokenizedSplit:
        """The tokenised split of ``texts`` (classification: prompts and labels; ``require_all``: every
        text must have a label, e.g. the training split whose unit count is public; ``spans``: the texts' value
        spans, for the value-token metric of language modelling)."""
        if not self.is_classification:
            return TokenizedSplit(texts, tokenizer, max_length, units=units, spans=spans)
        inputs, labels, kept = to_classification(texts, self.spec)
        inputs = [f"{text}{self.suffix}" for text in inputs]
        if require_all and len(kept) != len(texts):
            raise ConfigError(f"{len(texts) - len(kept)} training records have no {self.spec.field!r} label: "
                              "a classification run needs a label on every training record")
        return TokenizedSplit(inputs, tokenizer, max_length, units=None if units is None else units[kept],
                              labels=labels, fixed_length=True)

    def loss(self, logits, input_ids, attention_mask, labels=None):
        """Per-example loss, shape ``[batch]``."""
        if not self.is_classification:
            return per_sequence_nll(logits, input_ids, attention_mask)
        return per_example_cross_entropy(logits, labels, self.class_ids, self.position)

    @property
    def evaluate(self):
        """``evaluate(model, split, device, max_sequences=...)`` (the loop's evaluation function)."""
        if not self.is_classification:
            return evaluate_perplexity
        return partial(evaluate_classification, class_ids=self.class_ids, position=self.position)

    def describe(self) -> dict:
        out = {"kind": self.kind}
        if self.spec is not None:
            out.update(self.spec.describe(), metric="accuracy (and label perplexity)")
        else:
            out["metric"] = "perplexity"
        return out
