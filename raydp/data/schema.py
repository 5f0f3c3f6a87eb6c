"""Schema of the UCI "Diabetes 130-US Hospitals 1999-2008" table (RLDP Sec. 2.1).

The 50 columns of ``diabetic_data.csv`` in the file's order, their value domains, and the three id
tables of ``IDs_mapping.csv`` (embedded as defaults). ``'?'`` means missing; ``max_glu_serum`` and
``A1Cresult`` use ``'None'`` (or an empty cell in some re-distributions) for "not measured".

In memory a record table is a pandas DataFrame with the columns of :data:`COLUMNS`: the columns in
:data:`INT_COLUMNS` are ``int64``, every other column holds the CSV's strings unchanged.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pandas as pd
import pyarrow as pa

SCHEMA_VERSION = "1"

MEDICATIONS: tuple[str, ...] = (
    "metformin",
    "repaglinide",
    "nateglinide",
    "chlorpropamide",
    "glimepiride",
    "acetohexamide",
    "glipizide",
    "glyburide",
    "tolbutamide",
    "pioglitazone",
    "rosiglitazone",
    "acarbose",
    "miglitol",
    "troglitazone",
    "tolazamide",
    "examide",
    "citoglipton",
    "insulin",
    "glyburide-metformin",
    "glipizide-metformin",
    "glimepiride-pioglitazone",
    "metformin-rosiglitazone",
    "metformin-pioglitazone",
)

COLUMNS: tuple[str, ...] = (
    "encounter_id",
    "patient_nbr",
    "race",
    "gender",
    "age",
    "weight",
    "admission_type_id",
    "discharge_disposition_id",
    "admission_source_id",
    "time_in_hospital",
    "payer_code",
    "medical_specialty",
    "num_lab_procedures",
    "num_procedures",
    "num_medications",
    "number_outpatient",
    "number_emergency",
    "number_inpatient",
    "diag_1",
    "diag_2",
    "diag_3",
    "number_diagnoses",
    "max_glu_serum",
    "A1Cresult",
    *MEDICATIONS,
    "change",
    "diabetesMed",
    "readmitted",
)
assert len(COLUMNS) == 50

MISSING = "?"

RACES = ("Caucasian", "AfricanAmerican", "Hispanic", "Asian", "Other", MISSING)
GENDERS = ("Female", "Male", "Unknown/Invalid")
AGES = tuple(f"[{lo}-{lo + 10})" for lo in range(0, 100, 10))
WEIGHTS = (
    MISSING,
    "[0-25)",
    "[25-50)",
    "[50-75)",
    "[75-100)",
    "[100-125)",
    "[125-150)",
    "[150-175)",
    "[175-200)",
    ">200",
)
MAX_GLU_SERUM = ("None", "", "Norm", ">200", ">300")
A1C_RESULT = ("None", "", "Norm", ">7", ">8")
MEDICATION_STATES = ("No", "Steady", "Up", "Down")
CHANGE = ("No", "Ch")
DIABETES_MED = ("Yes", "No")
READMITTED = ("NO", ">30", "<30")

# Inclusive ranges observed in the real file (the UCI description fixes time_in_hospital at 1-14).
ID_COLUMNS = ("admission_type_id", "discharge_disposition_id", "admission_source_id")
INT_RANGES: dict[str, tuple[int, int | None]] = {
    "encounter_id": (1, None),
    "patient_nbr": (1, None),
    "admission_type_id": (1, None),
    "discharge_disposition_id": (1, None),
    "admission_source_id": (1, None),
    "time_in_hospital": (1, 14),
    "num_lab_procedures": (1, 132),
    "num_procedures": (0, 6),
    "num_medications": (1, 81),
    "number_outpatient": (0, 42),
    "number_emergency": (0, 76),
    "number_inpatient": (0, 21),
    "number_diagnoses": (1, 16),
}
INT_COLUMNS: tuple[str, ...] = tuple(c for c in COLUMNS if c in INT_RANGES)

CATEGORICAL: dict[str, tuple[str, ...]] = {
    "race": RACES,
    "gender": GENDERS,
    "age": AGES,
    "weight": WEIGHTS,
    "max_glu_serum": MAX_GLU_SERUM,
    "A1Cresult": A1C_RESULT,
    **{m: MEDICATION_STATES for m in MEDICATIONS},
    "change": CHANGE,
    "diabetesMed": DIABETES_MED,
    "readmitted": READMITTED,
}

# ICD-9 codes as the file writes them: leading zeros dropped ('8'), 250.xx with decimals, V/E codes.
DIAG_PATTERN = re.compile(r"\?|\d{1,3}(\.\d{1,2})?|V\d{1,2}(\.\d{1,2})?|E\d{3}(\.\d{1,2})?")
PAYER_CODE_PATTERN = re.compile(r"\?|[A-Z]{2}")
# Free-text specialty such as 'Surgery-Cardiovascular/Thoracic': non-empty, no surrounding spaces.
SPECIALTY_PATTERN = re.compile(r"\?|\S(.*\S)?")
PATTERNS: dict[str, tuple[re.Pattern[str], str]] = {
    "diag_1": (DIAG_PATTERN, "an ICD-9 code such as '250.83', 'V57', 'E909' or '?'"),
    "diag_2": (DIAG_PATTERN, "an ICD-9 code such as '250.83', 'V57', 'E909' or '?'"),
    "diag_3": (DIAG_PATTERN, "an ICD-9 code such as '250.83', 'V57', 'E909' or '?'"),
    "payer_code": (PAYER_CODE_PATTERN, "a two-letter payer code or '?'"),
    "medical_specialty": (SPECIALTY_PATTERN, "a non-empty specialty name or '?'"),
}
assert set(INT_RANGES) | set(CATEGORICAL) | set(PATTERNS) == set(COLUMNS)


@dataclass(frozen=True)
class IdMaps:
    """The three id -> description tables of ``IDs_mapping.csv``; absent ids are still valid."""

    admission_type_id: dict[int, str]
    discharge_disposition_id: dict[int, str]
    admission_source_id: dict[int, str]

    def table(self, column: str) -> dict[int, str]:
        return getattr(self, column)


# The real IDs_mapping.csv (descriptions stripped of the file's stray leading spaces).
ADMISSION_TYPE: dict[int, str] = {
    1: "Emergency",
    2: "Urgent",
    3: "Elective",
    4: "Newborn",
    5: "Not Available",
    6: "NULL",
    7: "Trauma Center",
    8: "Not Mapped",
}
DISCHARGE_DISPOSITION: dict[int, str] = {
    1: "Discharged to home",
    2: "Discharged/transferred to another short term hospital",
    3: "Discharged/transferred to SNF",
    4: "Discharged/transferred to ICF",
    5: "Discharged/transferred to another type of inpatient care institution",
    6: "Discharged/transferred to home with home health service",
    7: "Left AMA",
    8: "Discharged/transferred to home under care of Home IV provider",
    9: "Admitted as an inpatient to this hospital",
    10: "Neonate discharged to another hospital for neonatal aftercare",
    11: "Expired",
    12: "Still patient or expected to return for outpatient services",
    13: "Hospice / home",
    14: "Hospice / medical facility",
    15: "Discharged/transferred within this institution to Medicare approved swing bed",
    16: "Discharged/transferred/referred another institution for outpatient services",
    17: "Discharged/transferred/referred to this institution for outpatient services",
    18: "NULL",
    19: "Expired at home. Medicaid only, hospice.",
    20: "Expired in a medical facility. Medicaid only, hospice.",
    21: "Expired, place unknown. Medicaid only, hospice.",
    22: "Discharged/transferred to another rehab fac including rehab units of a hospital .",
    23: "Discharged/transferred to a long term care hospital.",
    24: "Discharged/transferred to a nursing facility certified under Medicaid but not certified "
    "under Medicare.",
    25: "Not Mapped",
    26: "Unknown/Invalid",
    27: "Discharged/transferred to a federal health care facility.",
    28: "Discharged/transferred/referred to a psychiatric hospital of psychiatric distinct part "
    "unit of a hospital",
    29: "Discharged/transferred to a Critical Access Hospital (CAH).",
    30: "Discharged/transferred to another Type of Health Care Institution not Defined Elsewhere",
}
ADMISSION_SOURCE: dict[int, str] = {
    1: "Physician Referral",
    2: "Clinic Referral",
    3: "HMO Referral",
    4: "Transfer from a hospital",
    5: "Transfer from a Skilled Nursing Facility (SNF)",
    6: "Transfer from another health care facility",
    7: "Emergency Room",
    8: "Court/Law Enforcement",
    9: "Not Available",
    10: "Transfer from critial access hospital",
    11: "Normal Delivery",
    12: "Premature Delivery",
    13: "Sick Baby",
    14: "Extramural Birth",
    15: "Not Available",
    17: "NULL",
    18: "Transfer From Another Home Health Agency",
    19: "Readmission to Same Home Health Agency",
    20: "Not Mapped",
    21: "Unknown/Invalid",
    22: "Transfer from hospital inpt/same fac reslt in a sep claim",
    23: "Born inside this hospital",
    24: "Born outside this hospital",
    25: "Transfer from Ambulatory Surgery Center",
    26: "Transfer from Hospice",
}


def default_id_maps() -> IdMaps:
    """The embedded copy of the real ``IDs_mapping.csv`` tables."""
    return IdMaps(dict(ADMISSION_TYPE), dict(DISCHARGE_DISPOSITION), dict(ADMISSION_SOURCE))


def arrow_schema() -> pa.Schema:
    """Arrow types of the record fields as written to the split Parquet files."""
    return pa.schema([(c, pa.int64() if c in INT_RANGES else pa.string()) for c in COLUMNS])


def expected(column: str) -> str:
    """A one-line description of the domain of ``column``, for error messages."""
    if column in INT_RANGES:
        lo, hi = INT_RANGES[column]
        return f"an integer >= {lo}" if hi is None else f"an integer in {lo}..{hi}"
    if column in CATEGORICAL:
        return "one of " + ", ".join(repr(v) for v in CATEGORICAL[column])
    return PATTERNS[column][1]


def invalid_mask(column: str, values: pd.Series) -> pd.Series:
    """Mask of the cells of ``values`` (the CSV's strings) outside the domain of ``column``."""
    s = values.astype(str)
    if column in CATEGORICAL:
        return ~s.isin(CATEGORICAL[column])
    if column in INT_RANGES:
        lo, hi = INT_RANGES[column]
        ok = s.str.fullmatch(r"[0-9]{1,18}")
        n = pd.to_numeric(s.where(ok, "0"))
        bad = ~ok | (n < lo)
        if hi is not None:
            bad |= n > hi
        return bad
    pattern = PATTERNS[column][0]
    return ~s.str.fullmatch(pattern.pattern)
