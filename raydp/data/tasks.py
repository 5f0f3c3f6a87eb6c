"""Classification tasks read off the narratives (EW-FT and DualTune-GhostDP use sequence classification).

A label field's clause is removed from each narrative and a prompt ending in the clause's common
opening is appended; the class is the word that follows it in the verbaliser's template. For
``change``::

    "... metformin is increased. ... the patient's diabetic medications were changed. ..."
    -> input "... metformin is increased. ... the patient's diabetic medications were"   label "changed"

The classes come from the verbaliser's own sentences (:mod:`raydp.data.verbalise`), so the real CSV and
the synthetic records give the same task; a record whose clause reads "unknown" has no label and is left
out. Fields:

* ``change`` (default): medications changed or not. On the synthetic records it is a function of the
  medication clauses (a drug increased or decreased) plus noise (a started drug), so it is learnable.
* ``diabetesMed``: any diabetes medication prescribed.
* ``readmitted``: readmitted (in less or more than 30 days) or not, the natural target on the real CSV. The
  structured generator makes it depend on severity and past inpatient visits; the independent generator draws it
  on its own, so there no model can beat the majority class.

Canaries. An audit canary's text is six sentences and its secret (:mod:`raydp.data.canaries`): it has
no label clause. It gets a label drawn from its secret (a hash of the secret modulo the number of classes:
as random as the secret, and fixed before training), the usual form of a canary for a classifier
(a record with a random label), so audit canaries stay in the training set with their coins.

Labels are private data (they are part of the record): a DP strategy must protect them (DP-SGD does, the
forward local mechanism releases them by randomized response; :mod:`raydp.privacy.local`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from raydp.data.verbalise import _CHANGE, _DIABETES_MED, _READMITTED
from raydp.data.canaries import PATTERN as CANARY_PATTERN
from raydp.errors import ConfigError

#: the verbaliser's sentences of each label field, value -> sentence
LABEL_FIELDS: dict[str, dict[str, str]] = {
    "change": _CHANGE,
    "diabetesMed": _DIABETES_MED,
    "readmitted": _READMITTED,
}


@dataclass(frozen=True)
class ClassificationSpec:
    """A label field as a prompt and class words: ``prompt`` + " " + ``classes[y]`` is the clause's start."""

    field: str
    prompt: str
    classes: tuple[str, ...]
    #: the field's sentence -> class index
    sentences: tuple[tuple[str, int], ...]

    @property
    def n_classes(self) -> int:
        return len(self.classes)

    def describe(self) -> dict:
        return {"field": self.field, "prompt": self.prompt, "classes": list(self.classes)}


def classification_spec(field: str) -> ClassificationSpec:
    """The prompt and classes of ``field`` from the verbaliser's template (the words the sentences share,
    then the first word where they differ)."""
    if field not in LABEL_FIELDS:
        raise ConfigError(f"unknown label field {field!r}; choose one of {', '.join(LABEL_FIELDS)}")
    sentences = list(LABEL_FIELDS[field].values())
    words = [s.rstrip(".").split(" ") for s in sentences]
    common = 0
    while all(len(w) > common + 1 for w in words) and len({w[common] for w in words}) == 1:
        common += 1
    classes = tuple(dict.fromkeys(w[common] for w in words))
    if len(classes) < 2:
        raise ConfigError(f"label field {field!r} has fewer than two classes in the template")
    return ClassificationSpec(field=field, prompt=" ".join(words[0][:common]), classes=classes,
                              sentences=tuple((s, classes.index(w[common])) for s, w in zip(sentences, words)))


def canary_label(secret: str, n_classes: int) -> int:
    """The label of a canary without a label clause: its secret's hash modulo the number of classes."""
    return int(hashlib.sha256(secret.encode()).hexdigest(), 16) % n_classes


def to_classification(texts: list[str], spec: ClassificationSpec) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(inputs, labels, kept): each narrative with its label clause removed and the prompt appended, its
    class index, and the positions in ``texts`` of the narratives that have a known label (a canary
    without a label clause gets :func:`canary_label`)."""
    inputs, labels, kept = [], [], []
    for i, text in enumerate(texts):
        found = [(s, y) for s, y in spec.sentences if f" {s}" in f" {text}"]
        canary = CANARY_PATTERN.search(text)
        if not found and canary is not None:
            inputs.append(f"{text} {spec.prompt}")
            labels.append(canary_label(canary.group(1), spec.n_classes))
            kept.append(i)
            continue
        if len(found) != 1:
            continue  # "unknown" (or, impossibly, two clauses): no label
        sentence, y = found[0]
        rest = f" {text} ".replace(f" {sentence} ", " ", 1).strip()
        inputs.append(f"{rest} {spec.prompt}")
        labels.append(y)
        kept.append(i)
    return inputs, np.asarray(labels, dtype=np.int64), np.asarray(kept, dtype=np.int64)
