"""Any table of free text as a private dataset: a CSV, Parquet or JSON Lines file with a text column and a
privacy-unit column (clinical notes and their patient, messages and their user...).

The same splits as the Diabetes-130 records (:mod:`raydp.data.splits`): each unit is assigned to a split by its
own keyed hash (ERRATA E11), so one unit's presence never moves another; all of a unit's rows go together, and
the run's DP guarantee is for add/remove-one unit (the manifest's ``privacy_unit`` stays ``"patient"``, the word
the code uses for its unit). A unit id of any type (an integer, a string such as a medical record number) is
stored as a 62-bit BLAKE2b digest of its text (``patient_nbr``), never as itself: the split files hold no
identifier of the source. Canaries are texts of their own synthetic units (a carrier sentence and the secret,
:func:`raydp.data.canaries.suffix`), appended to train; audit canaries likewise, each in train by a fair coin.
There are no value spans (free text has no record fields): runs on such a dataset report perplexity, not the
value-token metric. Bad input is a one-line :class:`~raydp.errors.DataError` naming the problem (a missing file
or column, an empty or missing text, an unknown file type).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

import raydp
from raydp.data import canaries
from raydp.data.identity import keyed_id
from raydp.data.splits import (ALL_SPLITS, AUDIT_PATIENT_BASE, CANARY_PATIENT_BASE, MANIFEST, PRIVACY_UNIT, SPLIT_RULE,
                               SUBSAMPLE_STREAM, UNIT_COLUMN, _write_atomically, check_fractions, split_indices,
                               texts_sha256, unit_uniforms)
from raydp.errors import DataError

TEXT_SUFFIXES = (".csv", ".parquet", ".jsonl", ".json")
#: the carrier of a secret or audit canary (a synthetic unit of its own); the number makes every context distinct
CANARY_CARRIER = "Note {k}. The patient was seen in clinic and the plan was reviewed with them."
UNIT_DIGEST_BITS = 62


def unit_digest(values) -> np.ndarray:
    """Each unit id (any type, by its text) as a 62-bit BLAKE2b digest, int64: the split files keep no source
    identifier, and distinct ids collide with probability ~ n^2 / 2^63."""
    out = np.empty(len(values), dtype=np.int64)
    for i, v in enumerate(values):
        digest = hashlib.blake2b(str(v).encode(), digest_size=8, person=b"raydp-unit").digest()
        out[i] = int.from_bytes(digest, "big") >> (64 - UNIT_DIGEST_BITS)
    return out


def read_text_table(path: str | Path, text_column: str, unit_column: str) -> pd.DataFrame:
    """``text`` and ``unit`` (the source's id, as read) of every row; a one-line DataError on bad input."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"text source {path} is not a file")
    suffix = path.suffix.lower()
    if suffix not in TEXT_SUFFIXES:
        raise DataError(f"text source {path}: unknown file type {suffix or '(none)'!r}; use one of "
                        f"{', '.join(TEXT_SUFFIXES)}")
    try:
        if suffix == ".csv":
            frame = pd.read_csv(path, dtype={unit_column: str}, keep_default_na=False, na_values=[""])
        elif suffix == ".parquet":
            frame = pd.read_parquet(path)
        else:
            frame = pd.read_json(path, lines=True, dtype={unit_column: str})
    except (OSError, ValueError, pa.ArrowException) as exc:
        raise DataError(f"text source {path} cannot be read: {' '.join(str(exc).split())[:200]}") from None
    for column, what in ((text_column, "text_column"), (unit_column, "unit_column")):
        if column not in frame.columns:
            raise DataError(f"text source {path} has no column {column!r} ({what}); its columns: "
                            f"{', '.join(map(str, frame.columns))}")
    text, unit = frame[text_column], frame[unit_column]
    missing = int(text.isna().sum() + unit.isna().sum())
    if missing:
        raise DataError(f"text source {path}: {missing} row(s) without a {text_column!r} or {unit_column!r} value")
    text = text.astype(str)
    if not (text.str.strip() != "").all():
        raise DataError(f"text source {path}: {int((text.str.strip() == '').sum())} row(s) with an empty "
                        f"{text_column!r}")
    if frame.empty:
        raise DataError(f"text source {path} has no rows")
    return pd.DataFrame({"text": text.to_numpy(), "unit": unit.astype(str).to_numpy()})


def build_text_dataset(out_dir: str | Path, *, source: str | Path, text_column: str, unit_column: str,
                       seed: int = 0, n_canary: int = 10, canary_seed: int = 42, n_audit: int = 0,
                       fractions: dict | None = None, sample_fraction: float | None = None,
                       overwrite: bool = False) -> dict[str, Any]:
    """Build a dataset directory from a table of free text (module docstring); returns its manifest."""
    fractions = check_fractions(fractions)
    out = Path(out_dir)
    if out.exists() and out.is_dir() and any(out.iterdir()) and not overwrite:
        raise DataError(f"dataset directory {out} exists and is not empty (pass overwrite=True to replace it)")
    table = read_text_table(source, text_column, unit_column)
    units = unit_digest(table["unit"].tolist())
    if sample_fraction is not None:
        uniq, inverse = np.unique(units, return_inverse=True)
        kept = (unit_uniforms(uniq, seed, SUBSAMPLE_STREAM) < sample_fraction)[inverse.reshape(-1)]
        table, units = table.loc[kept].reset_index(drop=True), units[kept]
        if table.empty:
            raise DataError(f"sample_fraction={sample_fraction} kept no unit of {source}")
    idx = split_indices(units, seed, fractions)
    texts = {s: table["text"].iloc[idx[s]].tolist() for s in ALL_SPLITS}
    split_units = {s: units[idx[s]] for s in ALL_SPLITS}
    secrets = canaries.draw_canaries(n_canary, canary_seed)
    canary_rows = np.arange(len(texts["train"]), len(texts["train"]) + len(secrets), dtype=np.int64)
    texts["train"] += [CANARY_CARRIER.format(k=k + 1) + canaries.suffix(s) for k, s in enumerate(secrets)]
    train_units = np.concatenate([split_units["train"], CANARY_PATIENT_BASE + np.arange(len(secrets))])
    audit_secrets, audit_in = canaries.draw_audit_canaries(n_audit, canary_seed, set(secrets))
    audit_texts = [canaries.audit_text(CANARY_CARRIER.format(k=len(secrets) + k + 1), s)
                   for k, s in enumerate(audit_secrets)]
    audit_units = AUDIT_PATIENT_BASE + np.arange(len(audit_secrets), dtype=np.int64)
    n_base = len(texts["train"])
    texts["train"] += [t for t, keep in zip(audit_texts, audit_in) if keep]
    train_units = np.concatenate([train_units, audit_units[audit_in]]).astype(np.int64)
    has_canary = np.zeros(len(texts["train"]), dtype=bool)
    has_canary[canary_rows] = True
    is_audit = np.arange(len(texts["train"])) >= n_base

    def split_table(s: str, extra: dict | None = None) -> pa.Table:
        unit = train_units if s == "train" else split_units[s]
        return pa.table({"text": pa.array(texts[s], type=pa.string()),
                         UNIT_COLUMN: pa.array(unit, type=pa.int64()),
                         "encounter_id": pa.array(np.arange(len(texts[s]), dtype=np.int64)), **(extra or {})})

    tables = {"train": split_table("train", {"has_canary": pa.array(has_canary), "audit_canary": pa.array(is_audit)}),
              **{s: split_table(s) for s in ALL_SPLITS if s != "train"}}
    extra = {"canaries": pa.table({"secret": pa.array(secrets, type=pa.string()),
                                   "train_row": pa.array(canary_rows, type=pa.int64()),
                                   "encounter_id": pa.array(canary_rows, type=pa.int64())}),
             "audit": pa.table({"secret": pa.array(audit_secrets, type=pa.string()),
                                "included": pa.array(audit_in, type=pa.bool_()),
                                "text": pa.array(audit_texts, type=pa.string()),
                                UNIT_COLUMN: pa.array(audit_units, type=pa.int64())})}
    content = texts_sha256(texts)
    manifest = {
        "schema_version": "text-1",
        "created_by": f"raydp {raydp.__version__}",
        "source": "text table",  # the file's path is the owner's; the content hash below identifies it
        "synthetic": False,
        "note": "Free text from a user-supplied table; it may describe real people: treat every file here as "
                "sensitive.",
        "text_source": {"text_column": text_column, "unit_column": unit_column, "format": Path(source).suffix.lower()},
        "source_sha256": hashlib.sha256(Path(source).expanduser().read_bytes()).hexdigest(),
        "seed": seed, "canary_seed": canary_seed, "n_canary": int(n_canary),
        "canary_format": "' secret_id=<10 characters of [A-Z0-9]>.' after a carrier sentence of its own unit, in train",
        "n_records": int(len(table)),
        "sizes": {s: len(texts[s]) for s in ALL_SPLITS},
        "privacy_unit": PRIVACY_UNIT, "unit_column": UNIT_COLUMN,
        "unit_rule": f"the source's {unit_column!r} value, stored as a 62-bit BLAKE2b digest of its text",
        "n_audit": int(n_audit), "audit_included": int(np.sum(audit_in)),
        "units": {s: int(len(np.unique(train_units if s == "train" else split_units[s]))) for s in ALL_SPLITS},
        "split_rule": SPLIT_RULE, "split_fractions": fractions,
        "neighbouring_relation": ("add/remove-one unit in the source table is add/remove-one unit in at most one "
                                  "split (each unit's split depends on its own id only)"),
        "content_sha256": content,
        "split_sha256": {s: texts_sha256({s: texts[s]}) for s in ALL_SPLITS},
        "dataset_id": keyed_id(content),
        "files": [f"{s}.parquet" for s in ALL_SPLITS] + ["canaries.parquet", "audit.parquet", MANIFEST],
    }
    if sample_fraction is not None:
        manifest["sample_fraction"] = float(sample_fraction)
    _write_atomically(out, overwrite, tables, extra, manifest)
    return manifest
