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


def verbalise(record: Mapping[str, Any], id_maps: IdMaps | None = None) -> str:
    """The narrative of one record (a mapping column -> value, e.g. a dict or a pandas row)."""
    maps = id_maps if id_maps is not None else _DEFAULT_MAPS
    v = lambda c: _value(record, c) or UNKNOWN  # noqa: E731
    out = [PREAMBLE, f"race is {v('race')}.", f"gender is {v('gender')}."]

    age = _value(record, "age")
    if age and age.startswith("[") and age.endswith(")") and "-" in age:
        lo, hi = age[1:-1].split("-", 1)
        out.append(f"the patient ages between {lo} and {hi} years old.")
    else:
        out.append(f"age is {age or UNKNOWN}.")
    out.append(f"weight is {v('weight')}.")
    for column, label in _ID_LABELS:
        out.append(f"{label} is {_id_text(record, column, maps)}.")

    days = _count(record, "time_in_hospital")
    if days is None:
        out.append("time in hospital is unknown.")
    else:
        unit = "day" if days == "1" else "days"
        out.append(f"the patient stayed in the hospital for {days} {unit}.")
    out.append(f"payer code is {v('payer_code')}.")
    out.append(f"medical specialty is {v('medical_specialty')}.")
    out.append(f"num lab procedures is {_count(record, 'num_lab_procedures') or UNKNOWN}.")
    out.append(f"num procedures is {_count(record, 'num_procedures') or UNKNOWN}.")
    out.append(f"num medications is {_count(record, 'num_medications') or UNKNOWN}.")
    for column, kind in _VISITS:
        k = _count(record, column)
        if k is None:
            out.append(f"the number of {kind} visits in the year preceding the encounter is "
                       f"{UNKNOWN}.")
        elif k == "0":
            out.append(f"the patient had no {kind} visits in the year preceding the encounter.")
        else:
            noun = "visit" if k == "1" else "visits"
            out.append(f"the patient had {k} {kind} {noun} in the year preceding the encounter.")
    for column, label in _DIAGS:
        out.append(f"{label} is {v(column)}.")
    out.append(f"number diagnoses is {_count(record, 'number_diagnoses') or UNKNOWN}.")
    out.append(f"max glu serum is {v('max_glu_serum')}.")
    out.append(f"A1Cresult is {v('A1Cresult')}.")
    for med in schema.MEDICATIONS:
        state = _MED_STATE.get(_value(record, med) or "", f"is {UNKNOWN}")
        out.append(f"{med} {state}.")
    out.append(_CHANGE.get(_value(record, "change") or "", "change is unknown."))
    out.append(_DIABETES_MED.get(_value(record, "diabetesMed") or "", "diabetesMed is unknown."))
    out.append(_READMITTED.get(_value(record, "readmitted") or "", "readmitted is unknown."))
    return " ".join(out)


def verbalise_records(
    records: Any, id_maps: IdMaps | None = None, *, progress: bool = True
) -> list[str]:
    """Narratives of every row of a record table (pandas DataFrame) or an iterable of mappings."""
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
    return [verbalise(r, id_maps) for r in bar]


_DEFAULT_MAPS = schema.default_id_maps()
