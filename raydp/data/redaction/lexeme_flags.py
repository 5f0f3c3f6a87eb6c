"""The secret detector's spaCy speed-up: lexeme flags, used only on the spaCy versions it was checked on.

spaCy's Matcher calls a token pattern's Python predicates (REGEX, IN, comparisons) on every token when they sit on a
pattern's first token (~1.5 us each), which made the ruler ~50x slower than the tokenizer. :func:`compile_to_flags`
turns those predicates into lexeme flags (computed once per distinct string, cached in the vocabulary, checked in
C), and :class:`TokenFlags` reads the high-context level's per-token rules (pronoun, capitalised) as flag columns of
``Doc.to_array``; ``Doc.text``/``Doc.ents``/Token objects are avoided when reading the result. What remains is the
Matcher (~0.15 us per token per token pattern, 24 token patterns).

Lexeme flags claim bits of spaCy's lexeme attribute space (``Vocab.add_flag`` with the ids 19-63 that
``lex_attr_getters`` leaves free) and put integer attribute ids in Matcher patterns: spaCy internals that a release
may change. So they are used only on the spaCy versions in :data:`CHECKED_SPACY` (:func:`lexeme_flags_supported`);
on any other, the patterns go to the ruler as written and :class:`TokenFlags` computes the same predicates in
Python, per distinct string: the same spans, slower (``tests/test_redaction.py`` compares the two paths).
"""

from __future__ import annotations

import re
from typing import Any

from raydp.errors import ConfigError

#: spaCy versions (major, minor) the lexeme-flag path was checked on against the plain path
CHECKED_SPACY: tuple[tuple[int, int], ...] = ((3, 8),)
#: the lexeme flag ids spaCy's vocabulary may leave free (``attrs.FLAG19`` .. ``FLAG63``)
FLAG_IDS = range(19, 64)


def lexeme_flags_supported(version: str) -> bool:
    """Whether spaCy ``version`` (its ``__version__``) is one the lexeme-flag path was checked on."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return m is not None and (int(m[1]), int(m[2])) in CHECKED_SPACY


def free_flag_ids(vocab) -> list[int]:
    return [b for b in FLAG_IDS if b not in vocab.lex_attr_getters]


_LEXICAL = {"ORTH": lambda s: s, "TEXT": lambda s: s, "LOWER": str.lower, "LENGTH": len}
_COMPARE_OPS = {"==": lambda a, b: a == b, "!=": lambda a, b: a != b, ">=": lambda a, b: a >= b,
                "<=": lambda a, b: a <= b, ">": lambda a, b: a > b, "<": lambda a, b: a < b}


class LexFlag:
    """A Python predicate on a lexical attribute, as a lexeme flag getter (picklable for n_process)."""

    def __init__(self, attr: str, op: str, arg: Any):
        self.attr, self.op, self.arg = attr, op, arg
        self._rx = re.compile(arg) if op == "REGEX" else None
        self._set = frozenset(arg) if op in ("IN", "NOT_IN") else None

    def __call__(self, string: str) -> bool:
        value = _LEXICAL[self.attr](string)
        if self.op == "REGEX":
            return self._rx.search(value) is not None
        if self.op == "IN":
            return value in self._set
        if self.op == "NOT_IN":
            return value not in self._set
        return _COMPARE_OPS[self.op](value, self.arg)

    def __getstate__(self):
        return (self.attr, self.op, self.arg)

    def __setstate__(self, state):
        self.__init__(*state)


def compile_to_flags(patterns: list[dict], vocab) -> tuple[list[dict], int]:
    """Patterns with the Python predicates (REGEX, IN, NOT_IN, comparisons) on lexical attributes of the
    tokens that can start a match turned into lexeme flags, which the Matcher checks in C.

    spaCy's Matcher calls a pattern's Python predicates on *every* token for a pattern's first token
    (~1.5 us each), which made the ruler ~50x slower than the tokenizer; a lexeme flag is computed once
    per distinct string and cached in the vocabulary. Later tokens keep their predicates (they are only
    tried inside a partial match). Returns the patterns and the number of flags used."""
    free = free_flag_ids(vocab)
    flags: dict[tuple, int] = {}

    def flag_for(attr: str, op: str, arg: Any) -> int | None:
        key = (attr, op, tuple(sorted(arg)) if isinstance(arg, (list, tuple)) else arg)
        if key not in flags:
            if not free:
                return None
            flags[key] = vocab.add_flag(LexFlag(attr, op, arg), flag_id=free.pop(0))
        return flags[key]

    out = []
    for entry in patterns:
        if isinstance(entry["pattern"], str):  # a phrase pattern (PhraseMatcher): already fast
            out.append(entry)
            continue
        tokens = []
        leading = True
        for spec in entry["pattern"]:
            spec = dict(spec)
            if leading:
                for attr in [a for a in spec if a.upper() in _LEXICAL and isinstance(spec[a], dict)]:
                    preds = spec[attr]
                    if len(preds) != 1:
                        continue
                    (op, arg), = preds.items()
                    fid = flag_for(attr.upper(), op, arg)
                    if fid is not None:
                        del spec[attr]
                        spec[fid] = True
            tokens.append(spec)
            op = str(spec.get("OP", ""))
            leading = leading and (op in ("?", "*") or op.startswith("{0"))
        out.append({**entry, "pattern": tokens})
    return out, len(flags)


class TokenFlags:
    """Per-token predicates (:class:`LexFlag`, on a token's string) as columns of ``Doc.to_array``: with
    ``use_flags``, lexeme flags added to ``vocab`` (:attr:`columns` are their ids; :meth:`fill` does nothing);
    without, :attr:`columns` are ``ORTH`` placeholders that :meth:`fill` replaces, in Python, by the predicates'
    values (cached per string id), so the rows read the same either way."""

    def __init__(self, vocab, predicates: list[LexFlag], use_flags: bool):
        self.predicates = list(predicates)
        self.use_flags = bool(use_flags)
        if self.use_flags:
            free = free_flag_ids(vocab)
            if len(free) < len(self.predicates):  # pragma: no cover - 45 flags, ~30 used by the ruler
                raise ConfigError("no free lexeme flags left in the spaCy vocabulary for the detector")
            self.columns: list = [vocab.add_flag(p, flag_id=b) for p, b in zip(self.predicates, free)]
        else:
            self.columns = ["ORTH"] * len(self.predicates)
        self._cache: dict[int, list[int]] = {}

    def fill(self, rows: list[list[int]], first: int, strings) -> None:
        """Set ``rows[i][first:first + len(columns)]`` to the predicates' values (the plain path only)."""
        if self.use_flags:
            return
        n, cache = len(self.predicates), self._cache
        for row in rows:
            orth = row[first]
            values = cache.get(orth)
            if values is None:
                text = strings[orth]
                values = cache[orth] = [int(p(text)) for p in self.predicates]
            row[first:first + n] = values
