"""The secret detector's measured recall (ERRATA E16): :func:`field_recall` on the sensitive field values of
records, ground truth from the verbaliser alone (:func:`value_regions`), and :func:`canary_recall` on injected
secrets, each with the fraction of non-sensitive tokens masked (over-redaction); see :mod:`raydp.data.redaction`."""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from raydp.data import schema
from raydp.data.redaction.detector import SecretDetector, apply_mask
from raydp.data.redaction.patterns import SENSITIVE_FIELDS
from raydp.data.schema import IdMaps
from raydp.data.verbalise import verbalise
from raydp.errors import ConfigError


_S = "\u2063S\u2063"  # sentinels: verbalised verbatim, never in a value (U+2063 is not whitespace)
_LO, _HI = "\u2063L\u2063", "\u2063H\u2063"
_COUNT_FIELDS = frozenset(c for c in schema.INT_COLUMNS if c not in schema.ID_COLUMNS)


def _rows(records: Any) -> list[Mapping[str, Any]]:
    if hasattr(records, "to_dict") and hasattr(records, "columns"):
        keys = [str(c) for c in records.columns]
        return [dict(zip(keys, v)) for v in zip(*(records[c].tolist() for c in records.columns))]
    return [dict(r) for r in records]


def _word_at(text: str, p: int) -> str:
    m = re.compile(r"[^\s]+").match(text, p)
    return m.group(0).rstrip(".") if m else ""


def value_regions(record: Mapping[str, Any], field: str, text: str | None = None,
                  id_maps: IdMaps | None = None) -> list[tuple[int, int]] | None:
    """Where ``verbalise(record)`` writes ``field``'s value: character ranges, or None when it writes
    "unknown". Found by verbalising the record again with the field set to a sentinel: the texts agree up
    to the value, and (for text fields) after it; counts are the one word there ("3", or "no" for 0)."""
    text = verbalise(record, id_maps) if text is None else text
    if field == "age":
        age = record.get("age")
        if isinstance(age, str) and age.startswith("[") and age.endswith(")") and "-" in age:
            t = verbalise({**record, "age": f"[{_LO}-{_HI})"}, id_maps)
            p1, p2s = t.find(_LO), t.find(_HI)
            if p1 < 0 or p2s < 0 or t[:p1] != text[:p1]:
                return None
            lo = _word_at(text, p1)
            gap = t[p1 + len(_LO):p2s]
            p2 = p1 + len(lo) + len(gap)
            if text[p1 + len(lo):p2] != gap:
                raise RuntimeError(f"verbaliser template changed around the age clause: {text!r}")
            hi = _word_at(text, p2)
            return [(p1, p1 + len(lo)), (p2, p2 + len(hi))]
    t = verbalise({**record, field: _S}, id_maps)
    p = t.find(_S)
    if p < 0:
        raise RuntimeError(f"the verbaliser does not write field {field!r}")
    if t[:p] != text[:p]:  # the known value's clause has another template: the field reads "unknown"
        cp = next((i for i, (a, b) in enumerate(zip(text, t)) if a != b), min(len(text), len(t)))
        if "unknown" in text[cp:cp + 80]:
            return None
        raise RuntimeError(f"cannot locate field {field!r} in {text!r}")
    if field in _COUNT_FIELDS:
        word = _word_at(text, p)
        return None if word == "unknown" else [(p, p + len(word))]
    tail = t[p + len(_S):]  # the template after a text value is the same whatever the value
    if not text.endswith(tail) or len(text) - len(tail) < p:
        raise RuntimeError(f"cannot locate field {field!r} in {text!r}")
    end = len(text) - len(tail)
    return None if text[p:end] == "unknown" else [(p, end)]


def _covered(regions: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int, str]]) -> bool:
    """Every character of every region lies in some span (spans sorted, non-overlapping)."""
    for a, b in regions:
        pos = a
        for s, e, _ in spans:
            if e <= pos:
                continue
            if s > pos:
                break
            pos = e
            if pos >= b:
                break
        if pos < b:
            return False
    return True


def _hits(tokens: list[tuple[int, int]], ranges: Sequence[tuple[int, ...]]) -> list[bool]:
    """For each token (sorted (start, end)), whether it overlaps one of ``ranges`` (sorted by start)."""
    out, j, n = [], 0, len(ranges)
    ranges = sorted((r[0], r[1]) for r in ranges)
    for a, b in tokens:
        while j < n and ranges[j][1] <= a:
            j += 1
        k, hit = j, False
        while k < n and ranges[k][0] < b:
            if ranges[k][1] > a:
                hit = True
                break
            k += 1
        out.append(hit)
    return out


class _TokenTally:
    """Tokens masked (any character under a span), split by whether they touch a sensitive region."""

    def __init__(self) -> None:
        self.n = self.masked = self.sensitive = self.sensitive_masked = 0

    def add(self, doc, spans: Sequence[tuple[int, int, str]], regions: Sequence[tuple[int, int]]) -> None:
        tokens = [(i, i + n) for i, n, space in doc.to_array(["IDX", "LENGTH", "IS_SPACE"]).tolist()
                  if not space] if len(doc) else []
        for m, sens in zip(_hits(tokens, spans), _hits(tokens, regions)):
            self.n += 1
            self.masked += m
            self.sensitive += sens
            self.sensitive_masked += m and sens

    def summary(self) -> dict:
        non = self.n - self.sensitive
        non_masked = self.masked - self.sensitive_masked
        return {
            "tokens": self.n,
            "masked": self.masked,
            "masked_fraction": self.masked / self.n if self.n else math.nan,
            "sensitive_tokens": self.sensitive,
            "sensitive_masked_fraction": (self.sensitive_masked / self.sensitive if self.sensitive
                                          else math.nan),
            "non_sensitive_tokens": non,
            "non_sensitive_masked": non_masked,
            "non_sensitive_masked_fraction": non_masked / non if non else math.nan,
        }


def _ratio(found: int, total: int) -> dict:
    return {"found": found, "total": total, "recall": found / total if total else math.nan}


def field_recall(records: Any, detector: SecretDetector, id_maps: IdMaps | None = None, *,
                 fields: Iterable[str] = tuple(SENSITIVE_FIELDS), batch_size: int = 64) -> dict:
    """Recall of ``detector`` on the sensitive field values of ``records`` (a DataFrame or mappings).

    Ground truth comes from the verbaliser alone (:func:`value_regions`): for each record and each field
    whose value is not written "unknown", the characters of the value in ``verbalise(record)``. The field
    is found when every one of those characters is masked (a partly masked "250.83" is a miss, and a
    clause altered elsewhere does not count). Returns per-field, per-kind (:data:`SENSITIVE_FIELDS`) and
    overall (micro) recall, the macro mean over fields, and token counts: the fraction of all tokens
    masked, and of non-sensitive tokens (touching no sensitive value) masked, i.e. over-redaction (the
    "and" of "between 40 and 50" counts there: the age's values are the two numbers).
    """
    rows = _rows(records)
    fields = tuple(fields)
    unknown = [f for f in fields if f not in schema.COLUMNS]
    if unknown:
        raise ConfigError(f"unknown field(s) {unknown}; choose among the schema's columns")
    texts = [verbalise(r, id_maps) for r in rows]
    found, total = Counter(), Counter()
    tally = _TokenTally()
    for row, text, doc in zip(rows, texts, detector._docs(texts, batch_size)):
        spans = detector._doc_spans(doc, text)
        all_regions: list[tuple[int, int]] = []
        for f in fields:
            regions = value_regions(row, f, text, id_maps)
            if regions is None:
                continue
            all_regions.extend(regions)
            total[f] += 1
            found[f] += _covered(regions, spans)
        tally.add(doc, spans, all_regions)
    per_field = {f: _ratio(found[f], total[f]) for f in fields}
    recalls = [v["recall"] for v in per_field.values() if v["total"]]
    kinds: dict[str, list[int]] = {}
    for f in fields:
        k = kinds.setdefault(SENSITIVE_FIELDS.get(f, "other"), [0, 0])
        k[0] += found[f]
        k[1] += total[f]
    return {
        "level": detector.level,
        "records": len(rows),
        "fields": per_field,
        "by_kind": {k: _ratio(*v) for k, v in kinds.items()},
        "overall": _ratio(sum(found.values()), sum(total.values())),
        "macro_recall": sum(recalls) / len(recalls) if recalls else math.nan,
        "tokens": tally.summary(),
    }


def canary_recall(texts_with_canaries: Sequence[str], secrets: Sequence[str], detector: SecretDetector,
                  *, batch_size: int = 64) -> dict:
    """Recall of ``detector`` on injected secrets: a secret is found when it appears in no redacted text
    that carried it. Secrets in no text are counted as ``absent`` and left out of the total. Token counts
    are over the texts that carry a secret (the secret's characters are the sensitive region)."""
    secrets = list(dict.fromkeys(s for s in secrets if s))
    if not secrets:
        return {"level": detector.level, **_ratio(0, 0), "absent": 0, "missed": [],
                "tokens": _TokenTally().summary()}
    rx = re.compile("|".join(re.escape(s) for s in sorted(secrets, key=len, reverse=True)))
    carriers = [t for t in texts_with_canaries if rx.search(t)]
    seen: set[str] = set()
    leaked: set[str] = set()
    tally = _TokenTally()
    for text, doc in zip(carriers, detector._docs(carriers, batch_size)):
        spans = detector._doc_spans(doc, text)
        here = {m.group(0) for m in rx.finditer(text)}
        seen |= here
        redacted = apply_mask(text, spans, detector.mask)
        leaked |= {s for s in here if s in redacted}
        tally.add(doc, spans, [(m.start(), m.end()) for m in rx.finditer(text)])
    present = [s for s in secrets if s in seen]
    missed = [s for s in present if s in leaked]
    return {
        "level": detector.level,
        **_ratio(len(present) - len(missed), len(present)),
        "absent": len(secrets) - len(present),
        "missed": missed[:20],
        "tokens": tally.summary(),
    }
