"""Load and validate the real UCI ``diabetic_data.csv`` and ``IDs_mapping.csv`` (RLDP Sec. 2.1).

Values are kept as the file writes them ('?' stays '?'); integer columns become ``int64``.
Every problem with the user's files is a one-line :class:`~raydp.errors.DataError` naming the
file and, where it applies, the column, row and value.
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path

import numpy as np
import pandas as pd

from raydp.errors import DataError
from raydp.data import schema
from raydp.data.schema import IdMaps


def _one_line(x: object) -> str:
    return " ".join(str(x).split())


def _read_text(path: str | os.PathLike, what: str) -> tuple[Path, str]:
    p = Path(path)
    if not p.exists():
        raise DataError(f"{what} {p} does not exist")
    if not p.is_file():
        raise DataError(f"{what} {p} is not a file")
    try:
        text = p.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataError(f"{what} {p} is not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise DataError(f"{what} {p} cannot be read: {_one_line(e.strerror or e)}") from None
    if not text.strip():
        raise DataError(f"{what} {p} is empty")
    return p, text


def load_diabetes_csv(
    path: str | os.PathLike, ids_mapping_path: str | os.PathLike | None = None
) -> tuple[pd.DataFrame, IdMaps]:
    """Read and validate ``diabetic_data.csv``; returns (records, id maps).

    The id maps come from ``ids_mapping_path`` (the real stacked format) or, by default, from the
    embedded copy in :mod:`raydp.data.schema`.
    """
    p, text = _read_text(path, "diabetes CSV")
    id_maps = load_ids_mapping(ids_mapping_path) if ids_mapping_path is not None else (
        schema.default_id_maps())
    try:
        rows = list(csv.reader(io.StringIO(text, newline="")))
    except csv.Error as e:
        raise DataError(f"diabetes CSV {p} is not valid CSV: {_one_line(e)}") from None
    header = [h.strip() for h in rows[0]]
    missing = [c for c in schema.COLUMNS if c not in header]
    if missing:
        raise DataError(f"diabetes CSV {p} is missing column(s): {', '.join(missing)}")
    extra = [c for c in header if c not in schema.COLUMNS]
    if extra:
        raise DataError(f"diabetes CSV {p} has unknown column(s): {', '.join(extra)}")
    dup = sorted({c for c in header if header.count(c) > 1})
    if dup:
        raise DataError(f"diabetes CSV {p} has duplicate column(s): {', '.join(dup)}")
    # Data rows with their 1-based line numbers; fully blank lines are skipped.
    data = [(i + 2, r) for i, r in enumerate(rows[1:]) if r and any(f.strip() for f in r)]
    if not data:
        raise DataError(f"diabetes CSV {p} has a header but zero data rows")
    for k, (line, r) in enumerate(data, start=1):
        if len(r) != len(header):
            raise DataError(f"diabetes CSV {p}: row {k} (line {line}) has {len(r)} fields, "
                            f"expected {len(header)}")
    columns = list(zip(*(r for _, r in data)))
    frame = pd.DataFrame({h: np.array(columns[i], dtype=object) for i, h in enumerate(header)})
    for c in schema.COLUMNS:
        bad = schema.invalid_mask(c, frame[c]).to_numpy()
        if bad.any():
            k = int(np.argmax(bad))
            raise DataError(f"diabetes CSV {p}: row {k + 1} (line {data[k][0]}) column '{c}' has "
                            f"invalid value {frame[c].iat[k]!r}; expected {schema.expected(c)}")
    frame = frame[list(schema.COLUMNS)]
    for c in schema.INT_COLUMNS:
        frame[c] = frame[c].astype(np.int64)
    ids = frame["encounter_id"]
    if ids.duplicated().any():
        k = int(np.argmax(ids.duplicated().to_numpy()))
        raise DataError(f"diabetes CSV {p}: row {k + 1} (line {data[k][0]}) repeats "
                        f"encounter_id {int(ids.iat[k])}")
    return frame.reset_index(drop=True), id_maps


def load_ids_mapping(path: str | os.PathLike) -> IdMaps:
    """Parse ``IDs_mapping.csv``: three stacked ``<column>,description`` tables, ``,`` between."""
    p, text = _read_text(path, "ids mapping")
    try:
        rows = list(csv.reader(io.StringIO(text, newline="")))
    except csv.Error as e:
        raise DataError(f"ids mapping {p} is not valid CSV: {_one_line(e)}") from None
    tables: dict[str, dict[int, str]] = {}
    current: dict[int, str] | None = None
    for line, r in enumerate(rows, start=1):
        fields = [f.strip() for f in r]
        if not any(fields):
            current = None  # a separator line (',') or a blank line
            continue
        if len(fields) != 2:
            raise DataError(f"ids mapping {p}: line {line} has {len(fields)} fields, expected 2")
        key, desc = fields
        if desc == "description" and key.endswith("_id"):
            if key not in schema.ID_COLUMNS:
                raise DataError(f"ids mapping {p}: line {line} starts unknown table {key!r}; "
                                f"expected one of {', '.join(schema.ID_COLUMNS)}")
            if key in tables:
                raise DataError(f"ids mapping {p}: line {line} repeats table {key!r}")
            current = tables[key] = {}
            continue
        if current is None:
            raise DataError(f"ids mapping {p}: line {line} is not inside a table (expected a "
                            f"header like 'admission_type_id,description')")
        if not key.isdigit():
            raise DataError(f"ids mapping {p}: line {line} has non-integer id {key!r}")
        if int(key) in current:
            raise DataError(f"ids mapping {p}: line {line} repeats id {int(key)}")
        current[int(key)] = desc
    absent = [c for c in schema.ID_COLUMNS if c not in tables]
    if absent:
        raise DataError(f"ids mapping {p} is missing table(s): {', '.join(absent)}")
    return IdMaps(**{c: tables[c] for c in schema.ID_COLUMNS})
