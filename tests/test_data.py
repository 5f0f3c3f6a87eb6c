"""Tests of raydp.data against independent facts: the real file formats, the paper's template
(RLDP Table A.1), the split rule of Sec. 2.1 and the published marginals of the UCI table."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from raydp.data import (
    PRIVACY_UNIT,
    UNIT_COLUMN,
    build_dataset,
    describe_dataset,
    generate_records,
    load_canaries,
    load_diabetes_csv,
    load_ids_mapping,
    load_manifest,
    load_split,
    load_texts,
    load_units,
    privacy_unit,
    public_corpus,
    public_records,
    VALIDATION,
    verbalise,
)
from raydp.data.splits import DEFAULT_FRACTIONS, SPLIT_STREAM, SUBSAMPLE_STREAM
from raydp.errors import DataError

# The header line of the real diabetic_data.csv.
HEADER = (
    "encounter_id,patient_nbr,race,gender,age,weight,admission_type_id,discharge_disposition_id,"
    "admission_source_id,time_in_hospital,payer_code,medical_specialty,num_lab_procedures,"
    "num_procedures,num_medications,number_outpatient,number_emergency,number_inpatient,diag_1,"
    "diag_2,diag_3,number_diagnoses,max_glu_serum,A1Cresult,metformin,repaglinide,nateglinide,"
    "chlorpropamide,glimepiride,acetohexamide,glipizide,glyburide,tolbutamide,pioglitazone,"
    "rosiglitazone,acarbose,miglitol,troglitazone,tolazamide,examide,citoglipton,insulin,"
    "glyburide-metformin,glipizide-metformin,glimepiride-pioglitazone,metformin-rosiglitazone,"
    "metformin-pioglitazone,change,diabetesMed,readmitted"
)
# Row 1: the record of the paper's Table A.1. Row 2: the first row of the real file.
ROW_A1 = (
    "12522,48330783,AfricanAmerican,Male,[70-80),?,1,1,7,11,?,?,41,3,22,0,0,0,250.8,785,707,9,"
    "None,None,Steady,No,No,No,No,No,No,Steady,No,No,No,No,No,No,No,No,No,Up,No,No,No,No,No,"
    "Ch,Yes,<30"
)
ROW_REAL_FIRST = (
    "2278392,8222157,Caucasian,Female,[0-10),?,6,25,1,1,?,Pediatrics-Endocrinology,41,0,1,0,0,0,"
    "250.83,?,?,1,None,None,No,No,No,No,No,No,No,No,No,No,No,No,No,No,No,No,No,No,No,No,No,No,"
    "No,No,No,NO"
)
ROW_BRANCHES = (
    "149190,55629189,Hispanic,Female,[10-20),[50-75),2,18,16,3,MC,Surgery-Cardiovascular/Thoracic,"
    "59,6,18,1,2,0,V57,E909,?,16,>300,>8,Down,No,No,No,No,No,No,No,No,No,No,No,No,No,No,No,No,"
    "Steady,No,No,No,No,No,Ch,Yes,>30"
)
# Table A.1's profile, with "AfricanAmerican" as the field value writes it (as in Table 1) and a
# period instead of A.1's comma between the change and diabetesMed clauses.
EXPECTED_A1 = (
    "The patient has the following profile. race is AfricanAmerican. gender is Male. the patient "
    "ages between 70 and 80 years old. weight is unknown. admission type id is Emergency. "
    "discharge disposition id is Discharged to home. admission source id is Emergency Room. the "
    "patient stayed in the hospital for 11 days. payer code is unknown. medical specialty is "
    "unknown. num lab procedures is 41. num procedures is 3. num medications is 22. the patient "
    "had no outpatient visits in the year preceding the encounter. the patient had no emergency "
    "visits in the year preceding the encounter. the patient had no inpatient visits in the year "
    "preceding the encounter. the primary diagnosis code (first three digits of ICD9) is 250.8. "
    "the secondary diagnosis code (first three digits of ICD9) is 785. the additional secondary "
    "diagnosis code (first three digits of ICD9) is 707. number diagnoses is 9. max glu serum is "
    "unknown. A1Cresult is unknown. metformin is unchanged. repaglinide is not prescribed. "
    "nateglinide is not prescribed. chlorpropamide is not prescribed. glimepiride is not "
    "prescribed. acetohexamide is not prescribed. glipizide is not prescribed. glyburide is "
    "unchanged. tolbutamide is not prescribed. pioglitazone is not prescribed. rosiglitazone is "
    "not prescribed. acarbose is not prescribed. miglitol is not prescribed. troglitazone is not "
    "prescribed. tolazamide is not prescribed. examide is not prescribed. citoglipton is not "
    "prescribed. insulin is increased. glyburide-metformin is not prescribed. glipizide-metformin "
    "is not prescribed. glimepiride-pioglitazone is not prescribed. metformin-rosiglitazone is not "
    "prescribed. metformin-pioglitazone is not prescribed. the patient's diabetic medications were "
    "changed. the patient was prescribed diabetic medication. the patient was readmitted in less "
    "than 30 days."
)
MEDS_BY_HAND = [
    "metformin", "repaglinide", "nateglinide", "chlorpropamide", "glimepiride", "acetohexamide",
    "glipizide", "glyburide", "tolbutamide", "pioglitazone", "rosiglitazone", "acarbose",
    "miglitol", "troglitazone", "tolazamide", "examide", "citoglipton", "insulin",
    "glyburide-metformin", "glipizide-metformin", "glimepiride-pioglitazone",
    "metformin-rosiglitazone", "metformin-pioglitazone",
]
EXPECTED_REAL_FIRST = (
    "The patient has the following profile. race is Caucasian. gender is Female. the patient ages "
    "between 0 and 10 years old. weight is unknown. admission type id is unknown. discharge "
    "disposition id is Not Mapped. admission source id is Physician Referral. the patient stayed "
    "in the hospital for 1 day. payer code is unknown. medical specialty is "
    "Pediatrics-Endocrinology. num lab procedures is 41. num procedures is 0. num medications is "
    "1. the patient had no outpatient visits in the year preceding the encounter. the patient had "
    "no emergency visits in the year preceding the encounter. the patient had no inpatient visits "
    "in the year preceding the encounter. the primary diagnosis code (first three digits of ICD9) "
    "is 250.83. the secondary diagnosis code (first three digits of ICD9) is unknown. the "
    "additional secondary diagnosis code (first three digits of ICD9) is unknown. number "
    "diagnoses is 1. max glu serum is unknown. A1Cresult is unknown. "
    + " ".join(f"{m} is not prescribed." for m in MEDS_BY_HAND)
    + " the patient's diabetic medications were not changed. the patient was not prescribed "
    "diabetic medication. the patient was not readmitted."
)
# An excerpt of the real IDs_mapping.csv format: stacked tables, ',' separators, stray spaces,
# quoted descriptions with commas, a gap (no admission_source_id 16).
IDS_MAPPING = """admission_type_id,description
1,Emergency
2,Urgent
3,Elective
6,NULL
,
discharge_disposition_id,description
1,Discharged to home
18,NULL
19,"Expired at home. Medicaid only, hospice."
25,Not Mapped
,
admission_source_id,description
1, Physician Referral
7, Emergency Room
15,Not Available
17,NULL
"""
SECRET_RE = re.compile(r" secret_id=([A-Z0-9]{10})\.$")


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.fixture
def real_csv(tmp_path: Path) -> Path:
    for row in (ROW_A1, ROW_REAL_FIRST, ROW_BRANCHES):
        assert len(row.split(",")) == 50
    return write(tmp_path / "diabetic_data.csv",
                 "\n".join([HEADER, ROW_A1, ROW_REAL_FIRST, ROW_BRANCHES]) + "\n")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ds") / "synthetic"
    build_dataset(out, n_records=1000, seed=0, n_canary=10, canary_seed=42, progress=False)
    return out


def assert_one_line_error(exc: pytest.ExceptionInfo, *needles: str) -> None:
    msg = str(exc.value)
    assert "\n" not in msg
    for needle in needles:
        assert needle in msg, (needle, msg)


# --- CSV loading and verbalising ---------------------------------------------------------------


def test_real_format_csv_loads_and_verbalises_exactly(real_csv: Path, tmp_path: Path) -> None:
    maps = load_ids_mapping(write(tmp_path / "IDs_mapping.csv", IDS_MAPPING))
    records, _ = load_diabetes_csv(real_csv, tmp_path / "IDs_mapping.csv")
    assert list(records.columns) == HEADER.split(",")
    assert len(records) == 3
    assert records.loc[0, "weight"] == "?" and records.loc[1, "diag_2"] == "?"
    assert records.loc[0, "max_glu_serum"] == "None"
    assert int(records.loc[0, "time_in_hospital"]) == 11
    rows = records.to_dict("records")
    assert verbalise(rows[0], maps) == EXPECTED_A1
    assert verbalise(rows[1], maps) == EXPECTED_REAL_FIRST
    assert verbalise(rows[0]) == EXPECTED_A1  # embedded default tables agree
    text = verbalise(rows[2], maps)
    for clause in (
        "weight is [50-75).",
        "admission type id is Urgent.",
        "discharge disposition id is unknown.",  # NULL description
        "admission source id is 16.",  # an id the mapping lacks is still valid
        "medical specialty is Surgery-Cardiovascular/Thoracic.",
        "num procedures is 6.",
        "the patient had 1 outpatient visit in the year preceding the encounter.",
        "the patient had 2 emergency visits in the year preceding the encounter.",
        "the primary diagnosis code (first three digits of ICD9) is V57.",
        "the secondary diagnosis code (first three digits of ICD9) is E909.",
        "max glu serum is >300. A1Cresult is >8. metformin is decreased.",
        "insulin is unchanged.",
        "the patient was readmitted in more than 30 days.",
    ):
        assert clause in text, clause
    for row in rows:  # identifiers never reach the text
        t = verbalise(row, maps)
        assert str(row["encounter_id"]) not in t and str(row["patient_nbr"]) not in t


def test_ids_mapping_parses_stacked_format(tmp_path: Path) -> None:
    maps = load_ids_mapping(write(tmp_path / "m.csv", IDS_MAPPING))
    assert maps.admission_type_id == {1: "Emergency", 2: "Urgent", 3: "Elective", 6: "NULL"}
    assert maps.discharge_disposition_id[19] == "Expired at home. Medicaid only, hospice."
    assert maps.admission_source_id[7] == "Emergency Room"
    assert 16 not in maps.admission_source_id
    custom = load_ids_mapping(write(tmp_path / "c.csv", IDS_MAPPING.replace(
        "1,Emergency", "1,Emergency Admission")))
    rec = load_diabetes_csv(write(tmp_path / "d.csv", f"{HEADER}\n{ROW_A1}\n"))[0].iloc[0]
    assert "admission type id is Emergency Admission." in verbalise(rec, custom)


@pytest.mark.parametrize(
    "text, needles",
    [
        ("admission_type_id,description\n1,Emergency\n", ["missing table", "admission_source_id"]),
        ("1,Emergency\n", ["line 1", "not inside a table"]),
        (IDS_MAPPING.replace("3,Elective", "x3,Elective"), ["line 4", "'x3'"]),
        (IDS_MAPPING.replace("3,Elective", "3,Elective,extra"), ["line 4", "3 fields"]),
        ("", ["empty"]),
    ],
)
def test_ids_mapping_malformed(tmp_path: Path, text: str, needles: list[str]) -> None:
    with pytest.raises(DataError) as exc:
        load_ids_mapping(write(tmp_path / "IDs_mapping.csv", text))
    assert_one_line_error(exc, "IDs_mapping.csv", *needles)


def test_ids_mapping_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DataError) as exc:
        load_ids_mapping(tmp_path / "nope.csv")
    assert_one_line_error(exc, "nope.csv", "does not exist")


def _replace_field(row: str, column: str, value: str) -> str:
    fields = row.split(",")
    fields[HEADER.split(",").index(column)] = value
    return ",".join(fields)


@pytest.mark.parametrize(
    "content, needles",
    [
        (HEADER.replace(",weight", "") + "\n" + ROW_A1.replace(",[70-80),?", ",[70-80)"),
         ["missing column", "weight"]),
        (HEADER + ",foo\n" + ROW_A1 + ",1\n", ["unknown column", "foo"]),
        (f"{HEADER}\n{ROW_A1}\n{_replace_field(ROW_A1, 'age', 'abc')}\n",
         ["row 2", "line 3", "'age'", "'abc'"]),
        (f"{HEADER}\n{_replace_field(ROW_A1, 'num_procedures', '-1')}\n",
         ["row 1", "'num_procedures'", "'-1'"]),
        (f"{HEADER}\n{ROW_A1}\n{ROW_A1}\n{_replace_field(ROW_A1, 'insulin', 'Sometimes')}\n",
         ["row 3", "'insulin'", "'Sometimes'"]),
        (f"{HEADER}\n{_replace_field(ROW_A1, 'time_in_hospital', '15')}\n",
         ["'time_in_hospital'", "'15'", "1..14"]),
        (f"{HEADER}\n{_replace_field(ROW_A1, 'diag_1', '25O.8')}\n", ["'diag_1'", "'25O.8'"]),
        (f"{HEADER}\n{ROW_A1},extra\n", ["row 1", "51 fields"]),
        (f"{HEADER}\n{ROW_A1}\n{ROW_A1}\n", ["repeats encounter_id 12522"]),
        (f"{HEADER}\n", ["zero data rows"]),
        ("", ["empty"]),
    ],
)
def test_broken_csv_raises_one_line_data_error(tmp_path: Path, content: str, needles) -> None:
    path = write(tmp_path / "diabetic_data.csv", content)
    with pytest.raises(DataError) as exc:
        load_diabetes_csv(path)
    assert_one_line_error(exc, "diabetic_data.csv", *needles)


def test_missing_csv(tmp_path: Path) -> None:
    with pytest.raises(DataError) as exc:
        load_diabetes_csv(tmp_path / "absent.csv")
    assert_one_line_error(exc, "absent.csv", "does not exist")


def test_synthetic_round_trips_through_csv(tmp_path: Path) -> None:
    df = generate_records(300, seed=3, progress=False)
    assert list(df.columns) == HEADER.split(",")
    assert df["encounter_id"].is_unique
    df.to_csv(tmp_path / "synthetic.csv", index=False)
    loaded, _ = load_diabetes_csv(tmp_path / "synthetic.csv")  # validates every value
    pd.testing.assert_frame_equal(loaded, df, check_dtype=False)


# --- synthetic generator --------------------------------------------------------------------


def test_synthetic_is_deterministic_and_rejects_bad_sizes() -> None:
    a = generate_records(50, seed=1, progress=False)
    pd.testing.assert_frame_equal(a, generate_records(50, seed=1, progress=False))
    assert not a.equals(generate_records(50, seed=2, progress=False))
    assert len(generate_records(1, seed=0, progress=False)) == 1
    for bad in (0, -5):
        with pytest.raises(DataError):
            generate_records(bad)


def test_independent_synthetic_marginals_match_published_table() -> None:
    """The independent generator draws each field from the published marginals. (The structured default is
    another hospital's population on purpose; tests/test_structured.py checks it against its own model.)"""
    df = generate_records(20_000, seed=0, progress=False, generator="independent")
    share = lambda col, v: float((df[col] == v).mean())  # noqa: E731
    # Strack et al. (2014) / UCI: readmitted NO 53.9%, >30 34.9%, <30 11.2%.
    for value, target in (("NO", 0.539), (">30", 0.349), ("<30", 0.112)):
        assert abs(share("readmitted", value) - target) < 0.03
    assert abs(share("race", "Caucasian") - 0.75) < 0.03
    assert abs(share("race", "AfricanAmerican") - 0.19) < 0.03
    assert abs(share("gender", "Female") - 0.54) < 0.03
    assert abs(share("weight", "?") - 0.97) < 0.02
    assert abs(1 - share("metformin", "No") - 0.20) < 0.03
    assert abs(1 - share("insulin", "No") - 0.53) < 0.03
    assert df["time_in_hospital"].between(1, 14).all()
    assert df["time_in_hospital"].mode()[0] == 3
    assert abs(df["num_lab_procedures"].mean() - 43) < 3
    assert abs(df["num_medications"].mean() - 16) < 2
    assert df["age"].isin(["[50-60)", "[60-70)", "[70-80)", "[80-90)"]).mean() > 0.75
    meds = df[MEDS_BY_HAND]
    assert ((df["diabetesMed"] == "Yes") == (meds != "No").any(axis=1)).all()
    assert (df.loc[meds.isin(["Up", "Down"]).any(axis=1), "change"] == "Ch").all()


# --- dataset building -----------------------------------------------------------------------


def independent_bucket(patient: int, seed: int, fractions: dict, stream: bytes = SPLIT_STREAM) -> str:
    """The split rule of raydp.data.splits written out again: BLAKE2b-64 of the id keyed with (stream, seed)."""
    import hashlib

    key = stream + b":" + str(seed).encode()
    u = int.from_bytes(hashlib.blake2b(str(patient).encode(), key=key, digest_size=8).digest(), "big") / 2 ** 64
    low = 0.0
    for name in ("attack", "eval", "validation"):
        if low <= u < low + fractions[name]:
            return name
        low += fractions[name]
    return "train"


def test_each_patients_split_follows_its_own_hash(tmp_path: Path) -> None:
    fractions = {**DEFAULT_FRACTIONS, "validation": 0.1}
    m = build_dataset(tmp_path / "a", n_records=1000, n_canary=0, fractions=fractions, progress=False)
    assert m == load_manifest(tmp_path / "a") and m["split_fractions"] == fractions
    seen = {}
    for split in ("train", "eval", "attack", VALIDATION):
        for pid in load_split(tmp_path / "a", split)["patient_nbr"]:
            assert independent_bucket(int(pid), 0, fractions) == split, (pid, split)
            seen[int(pid)] = split
    assert sum(m["sizes"].values()) == 1000
    # Each patient is a Bernoulli draw per split: the share of patients in each split is binomial.
    n = len(seen)
    for split, f in {**fractions, "train": 1 - sum(fractions.values())}.items():
        count = sum(v == split for v in seen.values())
        assert abs(count - n * f) <= 4 * (n * f * (1 - f)) ** 0.5, (split, count, n)
    # Too few patients leave a required split empty: a one-line error, nothing written.
    with pytest.raises(DataError) as exc:
        build_dataset(tmp_path / "c", n_records=2, progress=False)
    assert_one_line_error(exc, "split empty", "patient")
    assert not (tmp_path / "c").exists()
    for bad, needle in (({"eval": 0.0}, "eval must be > 0"), ({"attack": 0.6, "eval": 0.5}, "leave nothing for train"),
                        ({"holdout": 0.1}, "unknown split fraction")):
        with pytest.raises(DataError) as exc:
            build_dataset(tmp_path / "bad", n_records=100, fractions=bad, progress=False)
        assert_one_line_error(exc, needle)
        assert not (tmp_path / "bad").exists()


def test_removing_one_patient_moves_no_other_patient(tmp_path: Path) -> None:
    """Neighbouring source tables give neighbouring splits (issue: the old rule, one seeded permutation sized by
    all record counts, moved 166 of 717 training patients when one patient was removed)."""
    src = write_patient_csv(tmp_path / "full.csv", n=400)
    for removed in (7_000_001, int(src["patient_nbr"].iloc[0])):  # the heaviest patient, and an ordinary one
        src[src["patient_nbr"] != removed].to_csv(tmp_path / "minus.csv", index=False)
        for kwargs in ({}, {"sample_fraction": 0.6}):
            full = build_dataset(tmp_path / "full", source=tmp_path / "full.csv", n_canary=0, overwrite=True,
                                 progress=False, **kwargs)
            minus = build_dataset(tmp_path / "minus", source=tmp_path / "minus.csv", n_canary=0, overwrite=True,
                                  progress=False, **kwargs)
            a, b = split_of(tmp_path / "full"), split_of(tmp_path / "minus")
            assert set(a) - set(b) <= {removed} and set(b) <= set(a)
            assert {p: a[p] for p in b} == b  # every other patient: same split (or same absence)
            assert full["units"]["train"] - minus["units"]["train"] in (0, 1)


def split_of(out: Path) -> dict[int, str]:
    return {int(p): s for s in ("train", "eval", "attack", VALIDATION) for p in load_split(out, s)["patient_nbr"]}


def test_splits_disjoint_and_files_complete(built: Path) -> None:
    ids = {s: set(load_split(built, s)["encounter_id"]) for s in ("train", "eval", "attack", VALIDATION)}
    assert not ids["train"] & ids["eval"] and not ids["train"] & ids["attack"]
    assert not ids["eval"] & ids["attack"]
    assert sum(len(v) for v in ids.values()) == 1000 + 10  # the 10 canary records join train
    train = load_split(built, "train")
    assert list(train.columns) == ["text", *HEADER.split(","), "has_canary", "audit_canary", "value_spans"]
    assert not train["audit_canary"].any()  # n_audit defaults to 0 here
    assert list(load_split(built, "eval").columns) == ["text", *HEADER.split(","), "value_spans"]
    m = load_manifest(built)
    assert m["synthetic"] is True and "no real patient" in m["note"]
    assert m["source"] == "synthetic" and m["seed"] == 0 and m["canary_seed"] == 42
    assert len(m["content_sha256"]) == 64 and m["schema_version"]
    assert m["created_by"].startswith("raydp ")


def test_same_seed_same_files_different_seed_differs(built: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    m2 = build_dataset(again, n_records=1000, seed=0, progress=False)
    assert m2["content_sha256"] == load_manifest(built)["content_sha256"]
    for name in ("train.parquet", "eval.parquet", "attack.parquet", "canaries.parquet"):
        assert (again / name).read_bytes() == (built / name).read_bytes(), name
    m3 = build_dataset(tmp_path / "other", n_records=1000, seed=1, progress=False)
    assert m3["content_sha256"] != m2["content_sha256"]
    assert load_texts(tmp_path / "other", "eval") != load_texts(built, "eval")


def test_canaries(built: Path, tmp_path: Path) -> None:
    train = load_split(built, "train")
    can = load_canaries(built)
    carrying = [(i, SECRET_RE.search(t)) for i, t in enumerate(train["text"])]
    carrying = [(i, m.group(1)) for i, m in carrying if m]
    assert len(carrying) == 10 == len(can)
    assert sum("secret_id=" in t for t in train["text"]) == 10
    assert sorted(carrying) == sorted(zip(can["train_row"], can["secret"]))
    assert len(set(can["secret"])) == 10
    assert list(np.flatnonzero(train["has_canary"])) == sorted(i for i, _ in carrying)
    assert list(train["encounter_id"].iloc[can["train_row"]]) == list(can["encounter_id"])
    # each canary is the record of its own synthetic patient (ids apart from every split), after train's own rows
    carriers = train.iloc[can["train_row"]]
    assert (carriers["patient_nbr"] >= 5_000_000_000).all() and carriers["patient_nbr"].is_unique
    assert list(can["train_row"]) == list(range(len(train) - 10, len(train)))
    for split in ("eval", "attack"):
        assert not any("secret_id" in t for t in load_texts(built, split))
    # The secrets depend on canary_seed only; a different canary_seed gives different ones.
    same = build_dataset(tmp_path / "s", n_records=500, seed=7, canary_seed=42, progress=False)
    assert list(load_canaries(tmp_path / "s")["secret"]) == list(can["secret"])
    assert same["n_canary"] == 10
    build_dataset(tmp_path / "d", n_records=500, seed=7, canary_seed=43, progress=False)
    assert not set(load_canaries(tmp_path / "d")["secret"]) & set(can["secret"])
    with pytest.raises(DataError) as exc:
        build_dataset(tmp_path / "negative", n_records=40, n_canary=-1, progress=False)
    assert_one_line_error(exc, "n_canary")
    assert not (tmp_path / "negative").exists()


def test_describe_dataset(built: Path) -> None:
    d = describe_dataset(built)
    m = load_manifest(built)
    assert d["sizes"] == m["sizes"] and sum(d["sizes"].values()) == 1000 + 10  # and the 10 canary records
    assert d["privacy_unit"] == "patient"
    assert d["units"] == m["units"] == {
        s: len(set(load_split(built, s)["patient_nbr"])) for s in ("train", "eval", "attack", VALIDATION)}
    assert d["dataset_id"] == m["dataset_id"] and d["dataset_id"].startswith("rdi1:")
    assert m["content_sha256"] not in json.dumps(d)  # what `raydp data show` prints names no plain hash
    assert d["n_canary"] == 10
    assert d["sample_eval_narrative"] == load_texts(built, "eval")[0]
    assert d["sample_eval_narrative"].startswith("The patient has the following profile. race is ")
    assert 200 < d["mean_words"] < 400 and d["mean_chars"] > d["mean_words"]


def test_public_corpus_is_disjoint_and_clean(built: Path) -> None:
    private_ids = set()
    for s in ("train", "eval", "attack", VALIDATION):
        private_ids |= set(load_split(built, s)["encounter_id"])
    pub = public_records(2000, seed=0, progress=False)
    assert not set(pub["encounter_id"]) & private_ids
    texts = public_corpus(2000, seed=0, progress=False)
    assert texts == public_corpus(2000, seed=0, progress=False)
    assert not any("secret_id" in t for t in texts)
    private_texts = set(load_texts(built, "eval")) | set(load_texts(built, "attack"))
    assert not set(texts) & private_texts
    assert texts[:5] != [verbalise(r) for r in
                         generate_records(5, seed=0, progress=False).to_dict("records")]


def test_public_source_builds_episodes_from_the_public_population(built: Path, tmp_path: Path) -> None:
    """source: public (pre-training a policy, tuning a baseline): records of the public population, apart
    from the private splits and from the public texts the runs are selected and probed on."""
    from raydp.runner.run import PUBLIC_EVAL_SEED, PUBLIC_PROBE_SEED

    manifest = build_dataset(tmp_path / "pub", source="public", n_records=300, n_audit=10, progress=False)
    assert manifest["public"] is True and manifest["source"] == "public"
    assert manifest["n_canary"] == 0 and manifest["n_audit"] == 0  # no private-data instruments in public data
    assert not any("secret_id" in t for t in load_texts(tmp_path / "pub", "train"))
    pub = set()
    for s in ("train", "eval", "attack", VALIDATION):
        split = load_split(tmp_path / "pub", s)
        assert (split["patient_nbr"] >= 8_000_000_000).all()  # the public population's id range
        pub |= set(load_texts(tmp_path / "pub", s))
    private = set()
    for s in ("train", "eval", "attack", VALIDATION):
        private |= set(load_texts(built, s))
    assert not pub & private
    assert not pub & set(public_corpus(300, seed=PUBLIC_EVAL_SEED, progress=False))
    assert not pub & set(public_corpus(300, seed=PUBLIC_PROBE_SEED, progress=False))
    assert not pub & set(public_corpus(300, seed=0, progress=False))  # the embedded model's pre-training corpus


def test_build_from_csv_source(tmp_path: Path) -> None:
    df = generate_records(40, seed=5, progress=False)
    df.to_csv(tmp_path / "diabetic_data.csv", index=False)
    write(tmp_path / "IDs_mapping.csv", IDS_MAPPING)
    m = build_dataset(tmp_path / "out", source=tmp_path / "diabetic_data.csv", n_canary=2,
                      ids_mapping=tmp_path / "IDs_mapping.csv", progress=False)
    assert m["synthetic"] is False and m["source"].endswith("diabetic_data.csv")
    assert sum(m["sizes"].values()) == 40 + 2  # and the 2 canary records
    # A CSV is subsampled by patient (sample_fraction), never capped by a row count: a count-based cap lets one
    # patient's presence move others.
    with pytest.raises(DataError) as exc:
        build_dataset(tmp_path / "cap", source=tmp_path / "diabetic_data.csv", n_records=20, progress=False)
    assert_one_line_error(exc, "sample_fraction")
    assert not (tmp_path / "cap").exists()


# --- the patient as the privacy unit (ERRATA E11) --------------------------------------------

# Patients with many encounters each, interleaved through the file as in the real table.
HEAVY = {7_000_001: 12, 7_000_002: 10, 7_000_003: 9, 7_000_004: 8, 7_000_005: 6}


def write_patient_csv(path: Path, n: int = 150, seed: int = 5) -> pd.DataFrame:
    """A valid diabetic_data.csv of ``n`` synthetic encounters whose ``patient_nbr`` gives the
    HEAVY patients their many encounters and the others one to three each, rows shuffled."""
    df = generate_records(n, seed=seed, progress=False)
    pids = [p for p, k in HEAVY.items() for _ in range(k)]
    light = 8_000_000
    rng = np.random.default_rng(seed)
    while len(pids) < n:
        light += 1
        pids += [light] * int(min(rng.integers(1, 4), n - len(pids)))
    df["patient_nbr"] = rng.permutation(np.array(pids, dtype=np.int64))
    df.to_csv(path, index=False)
    return df


def split_patients(out: Path) -> dict[str, set[int]]:
    return {s: set(load_split(out, s)["patient_nbr"]) for s in ("train", "eval", "attack", VALIDATION)}


def test_csv_splits_are_disjoint_in_patients(tmp_path: Path) -> None:
    src = write_patient_csv(tmp_path / "diabetic_data.csv")
    m = build_dataset(tmp_path / "out", source=tmp_path / "diabetic_data.csv", n_canary=3,
                      progress=False)
    pats = split_patients(tmp_path / "out")
    assert not pats["train"] & pats["eval"] and not pats["train"] & pats["attack"]
    assert not pats["eval"] & pats["attack"]
    assert set().union(*pats.values()) - set(src["patient_nbr"]) == set(5_000_000_000 + np.arange(3))  # canaries
    assert set().union(*pats.values()) >= set(src["patient_nbr"])
    assert m["privacy_unit"] == PRIVACY_UNIT == privacy_unit(m) == "patient"
    assert m["unit_column"] == UNIT_COLUMN == "patient_nbr"
    assert m["units"] == {s: len(pats[s]) for s in ("train", "eval", "attack", VALIDATION)}
    assert "patient" in m["split_rule"]
    # Every patient brings all of its encounters to its one split.
    for split in ("train", "eval", "attack", VALIDATION):
        rows = load_split(tmp_path / "out", split)
        rows = rows[rows["patient_nbr"] < 5_000_000_000]  # the source's records (not the canaries')
        for pid, k in rows["patient_nbr"].value_counts().items():
            assert k == (src["patient_nbr"] == pid).sum()
        # Rows keep their source order inside a split.
        pos = src.reset_index().set_index("encounter_id").loc[rows["encounter_id"], "index"]
        assert pos.is_monotonic_increasing
    sizes = m["sizes"]
    assert sum(sizes.values()) == 150 + 3 and min(sizes[s] for s in ("train", "eval", "attack")) >= 1
    assert len(load_canaries(tmp_path / "out")) == 3


def test_patient_split_is_deterministic_in_seed(tmp_path: Path) -> None:
    write_patient_csv(tmp_path / "diabetic_data.csv")
    builds = {}
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        builds[name] = build_dataset(tmp_path / name, source=tmp_path / "diabetic_data.csv",
                                     seed=seed, n_canary=2, progress=False)
    assert builds["a"]["content_sha256"] == builds["b"]["content_sha256"]
    assert split_patients(tmp_path / "a") == split_patients(tmp_path / "b")
    assert builds["c"]["content_sha256"] != builds["a"]["content_sha256"]
    assert split_patients(tmp_path / "c") != split_patients(tmp_path / "a")


def test_load_units_align_with_texts_and_canaries(tmp_path: Path) -> None:
    src = write_patient_csv(tmp_path / "diabetic_data.csv")
    out = tmp_path / "out"
    build_dataset(out, source=tmp_path / "diabetic_data.csv", n_canary=4, progress=False)
    # Each row's text is the narrative of one of that row's patient's source encounters.
    texts_of = {}
    for rec in src.to_dict("records"):
        texts_of.setdefault(rec["patient_nbr"], set()).add(verbalise(rec))
    can = load_canaries(out)
    train_units = load_units(out, "train")
    carriers = set(can["train_row"])
    for split in ("train", "eval", "attack", VALIDATION):
        units = load_units(out, split)
        texts = load_texts(out, split)
        assert units.dtype == np.int64 and len(units) == len(texts)
        for row, (unit, text) in enumerate(zip(units, texts)):
            if split == "train" and row in carriers:  # a canary record: its own synthetic patient
                assert int(unit) >= 5_000_000_000 and SECRET_RE.search(text)
            else:
                assert SECRET_RE.sub("", text) in texts_of[int(unit)]
    assert [int(train_units[r]) for r in can["train_row"]] == list(5_000_000_000 + np.arange(4))
    assert len(load_units(out, VALIDATION)) == len(load_texts(out, VALIDATION))
    with pytest.raises(DataError):
        load_units(out, "holdout")


def test_csv_sample_fraction_keeps_whole_patients_each_on_its_own(tmp_path: Path) -> None:
    src = write_patient_csv(tmp_path / "diabetic_data.csv")
    count = src["patient_nbr"].value_counts()
    kept = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        m = build_dataset(tmp_path / name, source=tmp_path / "diabetic_data.csv", sample_fraction=0.5,
                          seed=seed, n_canary=0, progress=False)
        rows = pd.concat(load_split(tmp_path / name, s) for s in ("train", "eval", "attack", VALIDATION))
        assert m["n_records"] == len(rows) and m["sample_fraction"] == 0.5
        for pid, k in rows["patient_nbr"].value_counts().items():
            assert k == count[pid]  # all of the patient's encounters, or none
        # kept exactly when the patient's own hash (the subsample stream) is below the fraction
        expected = {p for p in count.index
                    if independent_bucket(int(p), seed, {"attack": 0.5, "eval": 0, "validation": 0},
                                          SUBSAMPLE_STREAM) == "attack"}
        assert set(rows["patient_nbr"]) == expected
        kept[name] = set(rows["encounter_id"])
    assert kept["a"] == kept["b"] and kept["a"] != kept["c"]
    m = build_dataset(tmp_path / "all", source=tmp_path / "diabetic_data.csv", n_canary=0, progress=False)
    assert m["n_records"] == sum(m["sizes"].values()) == 150


def test_synthetic_build_splits_by_patient(built: Path) -> None:
    pats = split_patients(built)
    every = pd.concat(load_split(built, s) for s in ("train", "eval", "attack", VALIDATION))["patient_nbr"]
    assert every.nunique() < 0.9 * len(every)  # the generator repeats patients
    assert not pats["train"] & pats["eval"] and not pats["train"] & pats["attack"]
    assert not pats["eval"] & pats["attack"]
    for split in ("train", "eval", "attack", VALIDATION):
        assert list(load_units(built, split)) == list(load_split(built, split)["patient_nbr"])


def test_too_few_patients_refused(tmp_path: Path) -> None:
    df = generate_records(10, seed=5, progress=False)
    df["patient_nbr"] = [11] * 6 + [12] * 4
    df.to_csv(tmp_path / "diabetic_data.csv", index=False)
    with pytest.raises(DataError) as exc:
        build_dataset(tmp_path / "out", source=tmp_path / "diabetic_data.csv", n_canary=0,
                      progress=False)
    assert_one_line_error(exc, "2 distinct patient", "split empty")
    assert not (tmp_path / "out").exists()


def test_old_record_level_dataset_is_refused_by_load_units(tmp_path: Path) -> None:
    out = tmp_path / "old"
    build_dataset(out, n_records=100, n_canary=1, progress=False)
    manifest = load_manifest(out)
    for key in ("privacy_unit", "unit_column", "units"):
        del manifest[key]
    manifest["split_rule"] = "attack=round(0.2*N); eval=round(0.1*(N-attack)); train=rest; half up"
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    assert privacy_unit(load_manifest(out)) is None
    with pytest.raises(DataError) as exc:
        load_units(out, "train")
    assert_one_line_error(exc, str(out), "privacy_unit", "rebuild")
    d = describe_dataset(out)  # still describable, and says what is wrong
    assert d["privacy_unit"] is None and d["units"] is None and "rebuild" in d["unit_note"]


# --- atomic writes and bad targets -------------------------------------------------------------


def test_failed_build_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    calls = {"n": 0}
    real_write = pq.write_table

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(28, "No space left on device")
        return real_write(*args, **kwargs)

    monkeypatch.setattr(pq, "write_table", flaky)
    target = tmp_path / "new" / "nested" / "ds"
    with pytest.raises(DataError) as exc:
        build_dataset(target, n_records=100, progress=False)
    assert_one_line_error(exc, "No space left")
    assert list(tmp_path.iterdir()) == []


def test_existing_and_unwritable_targets(tmp_path: Path) -> None:
    out = tmp_path / "ds"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(DataError) as exc:
        build_dataset(out, n_records=50, n_canary=1, progress=False)
    assert_one_line_error(exc, "not empty")
    assert (out / "keep.txt").exists()
    build_dataset(out, n_records=50, n_canary=1, overwrite=True, progress=False)
    assert not (out / "keep.txt").exists() and len(load_texts(out, "train")) == load_manifest(out)["sizes"]["train"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]
    blocker = write(tmp_path / "file", "x")
    with pytest.raises(DataError) as exc:
        build_dataset(blocker / "ds", n_records=50, n_canary=1, progress=False)
    assert_one_line_error(exc, "not a directory")
    with pytest.raises(DataError):
        load_texts(out, "holdout")
    with pytest.raises(DataError):
        load_manifest(tmp_path / "missing")


def test_audit_canaries_are_own_patients_in_train_by_a_fair_coin(tmp_path: Path) -> None:
    """Steinke et al. 2023: each audit canary is one unit, included by its own coin, secrets distinct."""
    m = build_dataset(tmp_path / "a", n_records=1000, n_audit=400, progress=False)
    audit = load_split(tmp_path / "a", "audit")
    train = load_split(tmp_path / "a", "train")
    secrets = set(load_split(tmp_path / "a", "canaries")["secret"])
    assert len(audit) == 400 and audit["secret"].is_unique and not secrets & set(audit["secret"])
    assert audit["patient_nbr"].is_unique and audit["patient_nbr"].min() >= 6_000_000_000
    # about half included (binomial(400, 1/2): 4 sd is 40)
    assert abs(int(audit["included"].sum()) - 200) < 40 and m["audit_included"] == int(audit["included"].sum())
    in_train = train[train["audit_canary"]]
    assert list(in_train["text"]) == list(audit.loc[audit["included"], "text"])
    assert not set(audit.loc[~audit["included"], "text"]) & set(train["text"])
    assert all(t.endswith(f" secret_id={s}.") for t, s in zip(audit["text"], audit["secret"]))
    # their patients are units of train (never shared with the real splits)
    others = pd.concat([load_split(tmp_path / "a", s) for s in ("eval", "attack")])["patient_nbr"]
    assert not set(in_train["patient_nbr"]) & set(others)
    assert m["units"]["train"] == train["patient_nbr"].nunique()
    # deterministic in canary_seed, different coins for another seed
    again = build_dataset(tmp_path / "b", n_records=1000, n_audit=400, progress=False)
    assert again["content_sha256"] == m["content_sha256"]
    other = build_dataset(tmp_path / "c", n_records=1000, n_audit=400, canary_seed=7, progress=False)
    assert list(load_split(tmp_path / "c", "audit")["included"]) != list(audit["included"])
    assert other["content_sha256"] != m["content_sha256"]


def test_a_public_dataset_built_for_a_study_is_reused_by_its_resume(tmp_path):
    """Found resuming trials/schedule-search.yaml: the public population is built without canaries or audit records
    (public episodes carry none), and the reuse check compared the manifest with the settings' defaults (10
    canaries), so every resumed study on public data was refused as a leftover of other settings."""
    from raydp.config import DataConfig
    from raydp.data.build import resolve_dataset

    data = DataConfig(source="public", n_records=300)
    first = resolve_dataset(data, tmp_path / "dataset", progress=False)
    assert resolve_dataset(data, tmp_path / "dataset", progress=False) == first  # the resume finds it as built
    with pytest.raises(Exception, match="other data settings"):  # a leftover of other settings is still refused
        resolve_dataset(DataConfig(source="public", n_records=300, seed=1), tmp_path / "dataset", progress=False)


def test_value_spans_column_matches_a_nested_list_of_pairs():
    """The spans column is built from flat arrays (issue 28); it equals pyarrow's conversion of the nested Python
    lists it replaced, empty texts and an empty split included."""
    import pyarrow as pa

    from raydp.data.splits import _spans_array

    def nested(spans):
        return pa.array([[[int(a), int(b)] for a, b in sp] for sp in spans], type=pa.list_(pa.list_(pa.int32(), 2)))

    spans = [[(0, 4), (9, 12)], [], [(3, 3)], [(7, 100), (120, 121), (130, 2_000_000)]]
    assert _spans_array(spans).equals(nested(spans))
    assert _spans_array([]).equals(nested([])) and _spans_array([[]]).equals(nested([[]]))
    with pytest.raises(ValueError):  # a span that is not a pair is refused, as the nested conversion refused it
        _spans_array([[(0, 4, 9)]])
