"""Record -> pseudo-clinical narrative, in the template of RLDP Table 1 / Table A.1 (Sec. 2.1).

One templated clause per attribute, in the file's column order (encounter_id and patient_nbr are
never verbalised). Values are copied verbatim from the record ("race is AfricanAmerican", as in
Table 1), so the vocabulary is the template plus the field values; '?', 'None', empty and absent
values read "unknown". Id columns read the ``IDs_mapping.csv`` description; a 'NULL' description
reads "unknown" and an id absent from the mapping reads as the id itself. Where Table A.1 joins the
change and diabetesMed clauses with a comma we use a period, like Table 1. Pure and deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from tqdm.auto import tqdm

from raydp.data import schema
from raydp.data.schema import IdMaps

UNKNOWN = "unknown"
PREAMBLE = "The patient has the following profile."
_MISSING = {"?", "", "None", "NULL", "nan", "NaN"}
_MED_STATE = {
    "Steady": "is unchanged",
    "No": "is not prescribed",
    "Up": "is increased",
    "Down": "is decreased",
}
_READMITTED = {
    "<30": "the patient was readmitted in less than 30 days.",
    ">30": "the patient was readmitted in more than 30 days.",
    "NO": "the patient was not readmitted.",
}
_CHANGE = {
    "Ch": "the patient's diabetic medications were changed.",
    "No": "the patient's diabetic medications were not changed.",
}
_DIABETES_MED = {
    "Yes": "the patient was prescribed diabetic medication.",
    "No": "the patient was not prescribed diabetic medication.",
}
_VISITS = (
    ("number_outpatient", "outpatient"),
    ("number_emergency", "emergency"),
    ("number_inpatient", "inpatient"),
)
_DIAGS = (
    ("diag_1", "the primary diagnosis code (first three digits of ICD9)"),
    ("diag_2", "the secondary diagnosis code (first three digits of ICD9)"),
    ("diag_3", "the additional secondary diagnosis code (first three digits of ICD9)"),
)
_ID_LABELS = (
    ("admission_type_id", "admission type id"),
    ("discharge_disposition_id", "discharge disposition id"),
    ("admission_source_id", "admission source id"),
)


def _value(record: Mapping[str, Any], column: str) -> str | None:
    """The field as text, or None when missing."""
    v = record.get(column) if hasattr(record, "get") else record[column]
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    s = str(v).strip()
    return None if s in _MISSING else s


def _count(record: Mapping[str, Any], column: str) -> str | None:
    s = _value(record, column)
    if s is None:
        return None
    try:
        return str(int(float(s)))
    except ValueError:
        return s


def _id_text(record: Mapping[str, Any], column: str, id_maps: IdMaps) -> str:
    s = _count(record, column)
    if s is None:
        return UNKNOWN
    try:
        desc = id_maps.table(column).get(int(s))
    except ValueError:
        return s
    if desc is None:
        return s
    desc = desc.strip()
    return UNKNOWN if desc in _MISSING else desc


class _Narrative:
    """Clauses joined by spaces, remembering the character span of every field value written into them."""

    def __init__(self):
        self.parts: list[str] = []
        self.spans: list[tuple[int, int]] = []
        self._length = 0

    def clause(self, *pieces: str, values=()) -> None:
        """One clause from ``pieces``; those at the indices ``values`` are field values (their spans are kept)."""
        if self.parts:
            self._length += 1  # the joining space
        for i, piece in enumerate(pieces):
            if i in values and piece:
                self.spans.append((self._length, self._length + len(piece)))
            self._length += len(piece)
        self.parts.append("".join(pieces))

    def text(self) -> str:
        return " ".join(self.parts)


def verbalise_spans(record: Mapping[str, Any], id_maps: IdMaps | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The narrative of one record and the character spans ``[start, end)`` of its field values, as the
    verbaliser writes them (phrases included: "not prescribed", "readmitted in less than 30 days"): what the
    value-token metric scores (:mod:`raydp.evaluation.perplexity`). The template around them is not a value."""
    maps = id_maps if id_maps is not None else _DEFAULT_MAPS
    v = lambda c: _value(record, c) or UNKNOWN  # noqa: E731
    out = _Narrative()
    out.clause(PREAMBLE)
    out.clause("race is ", v("race"), ".", values=(1,))
    out.clause("gender is ", v("gender"), ".", values=(1,))
    age = _value(record, "age")
    if age and age.startswith("[") and age.endswith(")") and "-" in age:
        lo, hi = age[1:-1].split("-", 1)
        out.clause("the patient ages between ", lo, " and ", hi, " years old.", values=(1, 3))
    else:
        out.clause("age is ", age or UNKNOWN, ".", values=(1,))
    out.clause("weight is ", v("weight"), ".", values=(1,))
    for column, label in _ID_LABELS:
        out.clause(f"{label} is ", _id_text(record, column, maps), ".", values=(1,))
    days = _count(record, "time_in_hospital")
    if days is None:
        out.clause("time in hospital is ", UNKNOWN, ".", values=(1,))
    else:
        unit = "day" if days == "1" else "days"
        out.clause("the patient stayed in the hospital for ", days, f" {unit}.", values=(1,))
    out.clause("payer code is ", v("payer_code"), ".", values=(1,))
    out.clause("medical specialty is ", v("medical_specialty"), ".", values=(1,))
    for column, label in (("num_lab_procedures", "num lab procedures"), ("num_procedures", "num procedures"),
                          ("num_medications", "num medications")):
        out.clause(f"{label} is ", _count(record, column) or UNKNOWN, ".", values=(1,))
    for column, kind in _VISITS:
        k = _count(record, column)
        if k is None:
            out.clause(f"the number of {kind} visits in the year preceding the encounter is ", UNKNOWN, ".",
                       values=(1,))
        elif k == "0":
            out.clause("the patient had ", "no", f" {kind} visits in the year preceding the encounter.", values=(1,))
        else:
            noun = "visit" if k == "1" else "visits"
            out.clause("the patient had ", k, f" {kind} {noun} in the year preceding the encounter.", values=(1,))
    for column, label in _DIAGS:
        out.clause(f"{label} is ", v(column), ".", values=(1,))
    out.clause("number diagnoses is ", _count(record, "number_diagnoses") or UNKNOWN, ".", values=(1,))
    out.clause("max glu serum is ", v("max_glu_serum"), ".", values=(1,))
    out.clause("A1Cresult is ", v("A1Cresult"), ".", values=(1,))
    for med in schema.MEDICATIONS:
        state = _MED_STATE.get(_value(record, med) or "", f"is {UNKNOWN}")
        out.clause(f"{med} is ", state.removeprefix("is "), ".", values=(1,))
    for column, phrases, missing in (("change", _CHANGE, "change is unknown."),
                                     ("diabetesMed", _DIABETES_MED, "diabetesMed is unknown."),
                                     ("readmitted", _READMITTED, "readmitted is unknown.")):
        phrase = phrases.get(_value(record, column) or "", missing)
        out.clause(*_phrase_parts(phrase), values=(1,))
    return out.text(), out.spans


def _phrase_parts(phrase: str) -> tuple[str, str, str]:
    """A whole-clause value ("the patient was not readmitted.") as (template prefix, value, "."): the value is what
    follows "the patient was " / "the patient's diabetic medications were " (or the field name), up to the period."""
    for prefix in ("the patient's diabetic medications were ", "the patient was ", "change is ", "diabetesMed is ",
                   "readmitted is "):
        if phrase.startswith(prefix):
            return prefix, phrase[len(prefix):-1], "."
    return "", phrase[:-1], "."


def verbalise(record: Mapping[str, Any], id_maps: IdMaps | None = None) -> str:
    """The narrative of one record (a mapping column -> value, e.g. a dict or a pandas row)."""
    return verbalise_spans(record, id_maps)[0]


def verbalise_records(
    records: Any, id_maps: IdMaps | None = None, *, progress: bool = True, spans: bool = False
) -> list[str] | tuple[list[str], list[list[tuple[int, int]]]]:
    """Narratives of every row of a record table (pandas DataFrame) or an iterable of mappings; with ``spans``,
    also each narrative's value spans (:func:`verbalise_spans`)."""
    if hasattr(records, "to_dict") and hasattr(records, "columns"):
        total = len(records)
        keys = [str(c) for c in records.columns]
        values = [records[c].tolist() for c in records.columns]  # far faster than to_dict
        rows: Iterable[Mapping[str, Any]] = (dict(zip(keys, v)) for v in zip(*values))
    else:
        rows = list(records)
        total = len(rows)
    bar = tqdm(rows, total=total, desc="verbalising", unit="rec",
               disable=None if progress else True, leave=False)
    if not spans:
        return [verbalise(r, id_maps) for r in bar]
    pairs = [verbalise_spans(r, id_maps) for r in bar]
    return [t for t, _ in pairs], [sp for _, sp in pairs]


_DEFAULT_MAPS = schema.default_id_maps()
