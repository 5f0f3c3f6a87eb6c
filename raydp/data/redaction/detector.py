"""The secret detector: :class:`SecretDetector` (spaCy's tokenizer and entity ruler with the rules of
:mod:`raydp.data.redaction.patterns`, optionally a trained pipeline), its spans and masking, and the forked
workers of ``n_process``; see :mod:`raydp.data.redaction`. spaCy is imported when a detector is built."""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence

from raydp.data import schema
from raydp.data.redaction.lexeme_flags import LexFlag, TokenFlags, compile_to_flags, lexeme_flags_supported
from raydp.data.redaction.patterns import (
    _CLAUSE_KEYS,
    _ID_CLAUSE_KEYS,
    _KINDS,
    E16_LABEL,
    LEVELS,
    MASK,
    PRONOUNS,
    _clause_regex,
    _ruler_patterns,
)
from raydp.data.schema import IdMaps
from raydp.errors import ConfigError


def _merge(spans: Iterable[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
    """Union of overlapping or touching spans; a merged span takes the label of its longest part."""
    out: list[list] = []
    for s, e, label in sorted(spans):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            cur = out[-1]
            if e - s > cur[3]:
                cur[2], cur[3] = label, e - s
            cur[1] = max(cur[1], e)
        else:
            out.append([s, e, label, e - s])
    return [(s, e, label) for s, e, label, _ in out]


def _subtract(spans: list[tuple[int, int, str]], keep: list[tuple[int, int]]) -> list[tuple[int, int, str]]:
    if not keep:
        return spans
    out = []
    for s, e, label in spans:
        pieces = [(s, e)]
        for ks, ke in keep:
            nxt = []
            for a, b in pieces:
                if ke <= a or ks >= b:
                    nxt.append((a, b))
                else:
                    if a < ks:
                        nxt.append((a, ks))
                    if ke < b:
                        nxt.append((ke, b))
            pieces = nxt
        out.extend((a, b, label) for a, b in pieces if b > a)
    return out


def apply_mask(text: str, spans: Sequence[tuple[int, int, str]], mask: str = MASK) -> str:
    """``text`` with each (merged, sorted) span replaced by ``mask``."""
    parts, pos = [], 0
    for s, e, _ in spans:
        parts.append(text[pos:s])
        parts.append(mask)
        pos = e
    parts.append(text[pos:])
    return "".join(parts)


def _validate(patterns: list[dict]) -> None:
    from spacy.schemas import validate_token_pattern

    for entry in patterns:
        if isinstance(entry["pattern"], str):
            continue
        errors = validate_token_pattern(entry["pattern"])
        if errors:  # pragma: no cover - a bug in the rules above
            raise ValueError(f"bad ruler pattern {entry}: {errors}")


def _import_spacy():
    try:
        import spacy
    except ImportError:
        raise ConfigError("the secret detector (DualTune-GhostDP's redacted phase 1) needs spaCy, an optional "
                          "extra: pip install 'rldp-finetune[redaction]'") from None
    return spacy


def _loosen_tokenizer(nlp) -> None:
    """Make a canary one token: '=' always splits, a period after a capital or digit is a suffix, and
    URL matching needs a scheme or 'www.' (it otherwise glues 'secret_id=AB12CD34EF'); and "id" is no
    special case (English splits it like "I'd" into "i" "d", a pronoun; and a special case hit stops
    spaCy's tokenizer caching for the rest of the text: with "id" in every narrative, 20x slower)."""
    from spacy.tokenizer import Tokenizer

    tok = nlp.tokenizer
    if not isinstance(tok, Tokenizer):  # a custom tokenizer: left as it is
        return
    rules = {k: v for k, v in (tok.rules or {}).items() if k.lower() != "id"}
    infix, suffix, url = (getattr(tok.infix_finditer, "__self__", None),
                          getattr(tok.suffix_search, "__self__", None), tok.url_match)
    scheme = re.compile(r"^(?:[a-zA-Z][\w+.-]*://|www\.)")
    # one new Tokenizer: each attribute set on the old one reloads its ~1,300 special cases (0.1 s)
    nlp.tokenizer = Tokenizer(
        nlp.vocab, rules=rules, prefix_search=tok.prefix_search,
        suffix_search=(re.compile(rf"{suffix.pattern}|(?<=[A-Z0-9])\.$").search
                       if isinstance(suffix, re.Pattern) else tok.suffix_search),
        infix_finditer=(re.compile(f"{infix.pattern}|=").finditer
                        if isinstance(infix, re.Pattern) else tok.infix_finditer),
        token_match=tok.token_match,
        url_match=None if url is None else _SchemeURL(url, scheme),
        faster_heuristics=tok.faster_heuristics)


class _SchemeURL:
    """spaCy's URL match, only for strings with a scheme or 'www.' (picklable)."""

    def __init__(self, url, scheme: re.Pattern[str]):
        self.url, self.scheme = url, scheme

    def __call__(self, string: str):
        return self.url(string) if self.scheme.match(string) else None


class SecretDetector:
    """A rule-based (optionally trained-pipeline) secret detector; see the module docstring.

    ``level``: ``"base"`` or ``"high_context"``. ``pipeline``: an installed spaCy pipeline's package name
    or a path on disk (never downloaded); ``None`` uses ``spacy.blank("en")``. ``mask``: the replacement
    text. ``keep``: literal strings never masked. ``id_maps``: the id tables whose descriptions the
    high-context clause rules know (default: the embedded ``IDs_mapping.csv``).
    """

    def __init__(self, level: str = "base", pipeline: str | None = None, *, mask: str = MASK,
                 keep: Iterable[str] = (), id_maps: IdMaps | None = None):
        if level not in LEVELS:
            raise ConfigError(f"secret detector level must be one of {', '.join(LEVELS)}, got {level!r}")
        spacy = _import_spacy()
        self.level = level
        self.pipeline = None if pipeline is None else str(pipeline)
        self.mask = mask
        self.keep = tuple(k for k in keep if k)
        self._spacy_version = spacy.__version__
        if pipeline is None:
            nlp = spacy.blank("en")
        else:
            try:
                nlp = spacy.load(self.pipeline)
            except Exception as e:  # noqa: BLE001 - OSError E050/E053, bad config, missing factory ...
                reason = " ".join(str(e).split())[:300]
                raise ConfigError(f"spaCy pipeline {self.pipeline!r} cannot be loaded (it is never "
                                  f"downloaded; install the package or pass a directory): {reason}") from None
        _loosen_tokenizer(nlp)
        self._trained = [name for name in nlp.pipe_names]
        ruler_name = "raydp_secret_ruler"
        where = {"before": "ner"} if "ner" in nlp.pipe_names else {}
        ruler = nlp.add_pipe("entity_ruler", name=ruler_name, config={"validate": False}, **where)
        self._patterns = _ruler_patterns()
        _validate(self._patterns)
        # the lexeme-flag speed-up only on the spaCy versions it was checked on; else the plain predicates
        self._lexeme_flags = lexeme_flags_supported(spacy.__version__)
        compiled, self._n_flags = (compile_to_flags(self._patterns, nlp.vocab) if self._lexeme_flags
                                   else (self._patterns, 0))
        ruler.add_patterns(compiled)
        self.nlp = nlp
        self._config = {"level": level, "pipeline": self.pipeline, "mask": mask, "keep": self.keep,
                        "id_maps": id_maps}
        strings = nlp.vocab.strings
        self._kinds = {strings.add(f"raydp:{k}"): (label, {strings.add(w) for w in left},
                                                   {strings.add(w) for w in right})
                       for k, (label, left, right) in _KINDS.items()}
        # the high-context token rules (pronoun, capitalised) as columns 6 and 7 of the token array
        self._token_flags = TokenFlags(nlp.vocab, [LexFlag("LOWER", "IN", sorted(PRONOUNS)),
                                                   LexFlag("TEXT", "REGEX", r"^[A-Z](?=.*[a-z])")],
                                       use_flags=self._lexeme_flags)
        self._cols = ["ENT_IOB", "ENT_TYPE", "ENT_ID", "IDX", "LENGTH", "LOWER", *self._token_flags.columns, "ORTH",
                      "IS_SPACE"]
        self._sentence_enders = {strings.add(w) for w in (".", "!", "?", "\n", "\n\n")}
        from spacy.symbols import PRON, PROPN, VERB

        self._pos_tags = {PRON: "POS_PRON", PROPN: "POS_PROPN", VERB: "POS_VERB"}
        self._dep_tags = {strings.add(d): f"DEP_{d.upper()}" for d in ("nsubj", "dobj", "pobj")}
        # base: the ruler only; high_context with a trained pipeline: everything
        self._disable = self._trained if level == "base" else []
        self._clauses = (_clause_regex(id_maps or schema.default_id_maps()) if level == "high_context"
                         else None)

    # -- spans ---------------------------------------------------------------------------------------
    def _docs(self, texts: Iterable[str], batch_size: int = 64) -> Iterator:
        return self.nlp.pipe(texts, batch_size=batch_size, disable=self._disable)

    def _doc_spans(self, doc, text: str | None = None) -> list[tuple[int, int, str]]:
        """Spans of ``doc``; ``text`` is ``doc.text`` when the caller has it (``Doc.text`` rebuilds the
        string from Token objects: as slow as the ruler)."""
        # Token attributes as one array (Token objects cost ~1 us each: as much as the ruler itself).
        cols = self._cols
        arr = doc.to_array(cols).tolist() if len(doc) else []
        iob_i, type_i, id_i, idx_i, len_i, lower_i = range(6)
        strings = self.nlp.vocab.strings
        raw: list[tuple[int, int, str]] = []
        n = len(arr)
        i = 0
        while i < n:
            if arr[i][iob_i] != 3:  # B of an entity
                i += 1
                continue
            s, e = i, i + 1
            while e < n and arr[e][iob_i] == 1:
                e += 1
            i = e
            kind = self._kinds.get(arr[s][id_i])
            if kind is None:  # a trained NER's entity (only at high_context)
                label = strings[arr[s][type_i]]
            else:
                label, left, right = kind
                while s < e - 1 and arr[s][lower_i] in left:
                    s += 1
                while e > s + 1 and arr[e - 1][lower_i] in right:
                    e -= 1
            raw.append((arr[s][idx_i], arr[e - 1][idx_i] + arr[e - 1][len_i], label))
        if text is None and (self.level == "high_context" or self.keep):
            text = doc.text
        if self.level == "high_context":
            self._token_flags.fill(arr, 6, strings)  # the plain path computes the token rules' columns here
            for m in self._clauses.finditer(text):
                g = m.lastindex
                raw.append((m.start(g), m.end(g), "ATTRIBUTE"))
            raw.extend(self._token_spans(doc, arr))
        spans = _merge(raw)
        if self.keep:
            kept = [(m.start(), m.end()) for k in self.keep for m in re.finditer(re.escape(k), text)]
            spans = _subtract(spans, kept)
        return spans

    def _token_spans(self, doc, arr: list[list[int]]) -> Iterator[tuple[int, int, str]]:
        idx_i, len_i, pron_i, cap_i, orth_i, space_i = 3, 4, 6, 7, 8, 9
        trained = bool(self._trained)
        has_pos = trained and doc.has_annotation("POS")
        has_dep = trained and doc.has_annotation("DEP")
        has_sent = trained and doc.has_annotation("SENT_START")
        extra = doc.to_array(["POS", "DEP", "SENT_START"]).tolist() if trained else None
        enders = self._sentence_enders
        prev_orth = None
        for k, row in enumerate(arr):
            a, b = row[idx_i], row[idx_i] + row[len_i]
            if row[pron_i]:
                yield a, b, "PRONOUN"
            elif row[cap_i]:
                if has_sent:
                    initial = extra[k][2] == 1
                else:
                    initial = prev_orth is None or prev_orth in enders
                if not initial:
                    yield a, b, "PROPER"
            if extra is not None:
                pos, dep = extra[k][0], extra[k][1]
                if has_pos and pos in self._pos_tags:
                    yield a, b, self._pos_tags[pos]
                if has_dep and dep in self._dep_tags:
                    yield a, b, self._dep_tags[dep]
            if not row[space_i]:
                prev_orth = row[orth_i]

    def spans(self, text: str) -> list[tuple[int, int, str]]:
        """Sorted, non-overlapping ``(start, end, label)`` character spans to mask in ``text``."""
        return self._doc_spans(next(iter(self._docs([text]))), text)

    def spans_all(self, texts: Iterable[str], *, batch_size: int = 64,
                  n_process: int = 1) -> list[list[tuple[int, int, str]]]:
        """:meth:`spans` of every text, through ``nlp.pipe``; ``n_process > 1`` splits the texts over
        that many worker processes (forked where the platform can, each returning spans, not Docs)."""
        texts = list(texts)
        if n_process > 1 and len(texts) >= 2 * n_process * batch_size:
            return _parallel_spans(self, texts, batch_size, n_process)
        return [self._doc_spans(d, t) for d, t in zip(self._docs(texts, batch_size), texts)]

    def redact(self, text: str) -> str:
        """``text`` with every span replaced by the mask."""
        return apply_mask(text, self.spans(text), self.mask)

    def redact_all(self, texts: Iterable[str], *, batch_size: int = 64, n_process: int = 1) -> list[str]:
        """:meth:`redact` of every text, through ``nlp.pipe`` (see :meth:`spans_all`)."""
        texts = list(texts)
        return [apply_mask(t, s, self.mask)
                for t, s in zip(texts, self.spans_all(texts, batch_size=batch_size, n_process=n_process))]

    def describe(self) -> dict:
        """Level, pipeline, versions and rule counts, for a run summary."""
        counts = Counter(p["label"] for p in self._patterns)
        out = {
            "level": self.level,
            "pipeline": self.pipeline or "spacy.blank('en')",
            "spacy_version": self._spacy_version,
            "components": list(self.nlp.pipe_names),
            "trained_components": list(self._trained) if self.level == "high_context" else [],
            "mask": self.mask,
            "ruler_patterns": len(self._patterns),
            "token_patterns": sum(not isinstance(p["pattern"], str) for p in self._patterns),
            "phrase_patterns": sum(isinstance(p["pattern"], str) for p in self._patterns),
            "lexeme_flags": self._n_flags,
            "patterns_per_label": dict(sorted(counts.items())),
            "guarantee": "none: redaction is not DP (ERRATA E16)",
            "label": E16_LABEL,
        }
        if self.level == "high_context":
            out["clause_rules"] = len(_CLAUSE_KEYS) + len(_ID_CLAUSE_KEYS) + 3
            out["pronouns"] = len(PRONOUNS)
            out["token_rules"] = ["pronoun", "capitalised non-sentence-initial token"] + (
                ["trained entities", "POS in PRON/PROPN/VERB", "dep in nsubj/dobj/pobj"]
                if self._trained else [])
        if self.keep:
            out["keep"] = list(self.keep)
        return out

    def __repr__(self) -> str:
        return f"SecretDetector(level={self.level!r}, pipeline={self.pipeline!r})"


_WORKER: SecretDetector | None = None


def _init_worker(config: dict) -> None:
    global _WORKER
    _WORKER = SecretDetector(**config)


def _worker_spans(args: tuple[list[str], int]) -> list[list[tuple[int, int, str]]]:
    texts, batch_size = args
    return _WORKER.spans_all(texts, batch_size=batch_size)


def _parallel_spans(detector: SecretDetector, texts: list[str], batch_size: int,
                    n_process: int) -> list[list[tuple[int, int, str]]]:
    import multiprocessing as mp

    global _WORKER
    step = math.ceil(len(texts) / (4 * n_process))
    chunks = [(texts[i:i + step], batch_size) for i in range(0, len(texts), step)]
    if "fork" in mp.get_all_start_methods():  # the workers inherit this detector: no start-up cost
        _WORKER = detector
        ctx, init = mp.get_context("fork"), {}
    else:  # pragma: no cover - macOS/Windows: each worker builds its own detector
        ctx, init = mp.get_context("spawn"), {"initializer": _init_worker, "initargs": (detector._config,)}
    try:
        with ctx.Pool(n_process, **init) as pool:
            parts = pool.map(_worker_spans, chunks)
    finally:
        _WORKER = None
    return [s for part in parts for s in part]
