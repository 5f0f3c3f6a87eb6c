"""Build, load and describe a dataset directory: attack/train/eval splits with canaries (Sec. 2.1).

The privacy unit is the patient (ERRATA E11): the split assigns whole patients (``patient_nbr``) to
one split each, so no patient is both a member (train) and a "non-member" (eval, attack). The
target record counts keep the old rule (rounding half up): ``n_attack = round(0.2 * N)``, then of
the remaining ``R = N - n_attack`` records ``n_eval = round(0.1 * R)`` and ``n_train = R - n_eval``
(20% / 72% / 8%). The distinct patients, in ascending ``patient_nbr`` order, are permuted with
``SeedSequence([seed, SPLIT_STREAM])``; walking that order, the attack split takes the prefix of
patients whose record count is nearest ``round(0.2 * N)`` (ties to the shorter prefix), the eval
split takes the next run of patients whose record count is nearest ``round(0.1 * (N - attack
records))``, and train takes the remaining patients. Each split holds at least one patient, so at
least 3 distinct patients are needed; record counts are near, not exactly, 20% / 72% / 8%. Rows
keep their source order within a split. The attack set is never trained on.

A CSV source capped with ``n_records`` keeps whole patients too: patients are drawn in an order
permuted with ``SeedSequence([seed, SUBSAMPLE_STREAM])`` and kept until the kept rows reach
``n_records``, so the cap may keep a few more than ``n_records`` rows.

Audit canaries (``n_audit``, :func:`raydp.data.canaries.draw_audit_canaries`): records of the synthetic
``'audit'`` population, one patient each (patient ids from 6e9, encounter ids from 7e9: never a real or
private synthetic id), each a short narrative with its own secret appended
(:func:`raydp.data.canaries.audit_text`); those whose fair coin came up
are appended to train (after its own rows), the others are held back. ``audit.parquet`` lists all of
them (``secret``, ``included``, ``text``, ``patient_nbr``); the train split marks them in
``audit_canary``. They are units like any patient: the run's epsilon covers each of them.

Layout of ``out_dir``: ``train.parquet`` (``text``, the 50 record fields, ``has_canary``, ``audit_canary``),
``eval.parquet`` and ``attack.parquet`` (``text`` and the record fields), ``canaries.parquet``
(``secret``, ``train_row``, ``encounter_id``), ``audit.parquet`` and ``manifest.json``. The manifest's
``privacy_unit`` (``"patient"``), ``unit_column`` (``"patient_nbr"``) and ``units`` (distinct
patients per split) say what the splits are disjoint in; a directory built before E11 has no
``privacy_unit`` and its record-level splits may share patients. The directory is written to a
temporary sibling and renamed into place, so a failed build leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

import raydp
from raydp.errors import DataError
from raydp.data import canaries, schema
from raydp.data.csv_source import load_diabetes_csv, load_ids_mapping
from raydp.data.schema import IdMaps
from raydp.data.synthetic import generate_records
from raydp.data.verbalise import verbalise_records

SPLITS = ("train", "eval", "attack")
ATTACK_FRACTION = 0.2
EVAL_FRACTION = 0.1
SPLIT_STREAM = 0x53504C54  # "SPLT"
SUBSAMPLE_STREAM = 0x53554253  # "SUBS"
PRIVACY_UNIT = "patient"  # ERRATA E11: the unit the splits (and DP) are taken over
UNIT_COLUMN = "patient_nbr"
SPLIT_RULE = ("whole patients (patient_nbr) per split: distinct patients permuted with the split "
              "seed; attack = the prefix whose records are nearest round(0.2*N), eval = the next "
              "patients whose records are nearest round(0.1*(N-attack)), train = the rest; "
              "half up, ties to fewer patients")
DEFAULT_SYNTHETIC_SIZE = 101_766  # the size of the real table
SYNTHETIC_NOTE = "Synthetic records: they describe no real patient."
REAL_NOTE = ("Records come from a user-supplied CSV and may describe real patients; treat every "
             "file in this directory as sensitive.")
MANIFEST = "manifest.json"
AUDIT_PATIENT_BASE = 6_000_000_000  # one patient per audit canary


def _round_half_up(x: float) -> int:
    return int(np.floor(x + 0.5))


def split_sizes(n: int) -> dict[str, int]:
    """Target record counts of the train/eval/attack splits of ``n`` records.

    The patient-level split (ERRATA E11) gets as near these as whole patients allow; see the
    module docstring.
    """
    n_attack = _round_half_up(ATTACK_FRACTION * n)
    rest = n - n_attack
    n_eval = _round_half_up(EVAL_FRACTION * rest)
    return {"train": rest - n_eval, "eval": n_eval, "attack": n_attack}


def _nearest_prefix(cum: np.ndarray, target: int, lo: int, hi: int) -> int:
    """The k in [lo, hi] whose ``cum[k - 1]`` is nearest ``target``; ties to the smaller k."""
    ks = np.arange(lo, hi + 1)
    return int(ks[np.argmin(np.abs(cum[ks - 1] - target))])


def split_indices(units: np.ndarray, seed: int) -> dict[str, np.ndarray]:
    """Disjoint sorted row indices of each split, whole units (patients) each, deterministic in
    ``seed`` (ERRATA E11; the rule is in the module docstring).

    ``units`` holds the unit id (``patient_nbr``) of every row; every split gets at least one unit.
    """
    units = np.asarray(units)
    n = len(units)
    uniq, inverse, counts = np.unique(units, return_inverse=True, return_counts=True)
    n_units = len(uniq)
    if n_units < 3:
        raise DataError(f"{n} records of {n_units} distinct patient(s) are too few to split into "
                        f"non-empty train/eval/attack sets by patient (need at least 3 patients)")
    perm = np.random.default_rng(np.random.SeedSequence([seed, SPLIT_STREAM])).permutation(n_units)
    cum = np.cumsum(counts[perm])
    a = _nearest_prefix(cum, split_sizes(n)["attack"], 1, n_units - 2)
    n_attack = int(cum[a - 1])
    target_eval = _round_half_up(EVAL_FRACTION * (n - n_attack))
    e = _nearest_prefix(cum[a:] - n_attack, target_eval, 1, n_units - a - 1)
    which = np.empty(n_units, dtype=np.int64)  # 0 attack, 1 eval, 2 train, per unique unit
    which[perm[:a]] = 0
    which[perm[a:a + e]] = 1
    which[perm[a + e:]] = 2
    row_split = which[inverse.reshape(-1)]
    return {"attack": np.flatnonzero(row_split == 0), "eval": np.flatnonzero(row_split == 1),
            "train": np.flatnonzero(row_split == 2)}


def texts_sha256(texts_by_split: dict[str, list[str]]) -> str:
    """sha256 over the given splits in SPLITS order: each split name, then its texts, NUL-separated.

    ``texts_sha256(all three splits)`` is the manifest's ``content_sha256``;
    ``texts_sha256({split: texts})`` is that split's entry in ``split_sha256``.
    """
    h = hashlib.sha256()
    for split in SPLITS:
        if split not in texts_by_split:
            continue
        h.update(split.encode() + b"\0")
        for t in texts_by_split[split]:
            h.update(t.encode("utf-8") + b"\0")
    return h.hexdigest()


def _check_seed(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise DataError(f"{name} must be an integer >= 0, got {value!r}")
    return int(value)


#: ``source: public`` builds a dataset from the PUBLIC synthetic population (raydp.data.public): episodes
#: that pre-train a controller or tune a baseline's clip spend no private budget (issue 12). Its seeds
#: start at PUBLIC_EPISODE_SEED, apart from the public corpus's other uses (model pre-training, the probe,
#: public validation, extraction profiles), so a policy never trains on the records it is selected by.
PUBLIC_SOURCE = "public"
PUBLIC_EPISODE_SEED = 1_000_000
PUBLIC_NOTE = ("public records: the public synthetic population (a proxy of the private one); no private "
               "data, no private budget spent")


def _resolve_id_maps(ids_mapping: str | os.PathLike | IdMaps | None) -> IdMaps:
    if ids_mapping is None:
        return schema.default_id_maps()
    if isinstance(ids_mapping, IdMaps):
        return ids_mapping
    return load_ids_mapping(ids_mapping)


def _load_source(source, n_records, seed, ids_mapping, progress):
    if isinstance(source, str) and source == PUBLIC_SOURCE:
        n = DEFAULT_SYNTHETIC_SIZE if n_records is None else n_records
        records = generate_records(n, PUBLIC_EPISODE_SEED + seed, population="public", progress=progress)
        info = {"source": PUBLIC_SOURCE, "synthetic": True, "public": True, "note": PUBLIC_NOTE}
        return records, _resolve_id_maps(ids_mapping), info
    if isinstance(source, str) and source == "synthetic":
        n = DEFAULT_SYNTHETIC_SIZE if n_records is None else n_records
        records = generate_records(n, seed, population="private", progress=progress)
        info = {"source": "synthetic", "synthetic": True, "note": SYNTHETIC_NOTE}
        return records, _resolve_id_maps(ids_mapping), info
    if not isinstance(source, (str, os.PathLike)):
        raise DataError(f"source must be 'synthetic' or a CSV path, got {source!r}")
    path = Path(source)
    records, _ = load_diabetes_csv(path)
    if n_records is not None:
        if isinstance(n_records, bool) or not isinstance(n_records, (int, np.integer)) \
                or n_records < 1:
            raise DataError(f"n_records must be an integer >= 1, got {n_records!r}")
        if n_records < len(records):
            records = _cap_by_patient(records, int(n_records), seed)
    info = {"source": str(path.resolve()), "synthetic": False, "note": REAL_NOTE,
            "source_sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    return records, _resolve_id_maps(ids_mapping), info


def _cap_by_patient(records: pd.DataFrame, n_records: int, seed: int) -> pd.DataFrame:
    """Whole patients, drawn in a seeded order until the kept rows reach ``n_records`` (E11).

    The result keeps the source row order and may hold a few more than ``n_records`` rows (the
    last patient drawn brings all of its encounters).
    """
    uniq, inverse, counts = np.unique(records[UNIT_COLUMN].to_numpy(), return_inverse=True,
                                      return_counts=True)
    rng = np.random.default_rng(np.random.SeedSequence([seed, SUBSAMPLE_STREAM]))
    perm = rng.permutation(len(uniq))
    n_keep = int(np.searchsorted(np.cumsum(counts[perm]), n_records)) + 1
    kept = np.zeros(len(uniq), dtype=bool)
    kept[perm[:n_keep]] = True
    return records.loc[kept[inverse.reshape(-1)]].reset_index(drop=True)


def _audit_records(n: int, canary_seed: int, progress: bool) -> pd.DataFrame:
    """``n`` records of the audit population, one patient each (ids never shared with any split)."""
    if n == 0:
        return generate_records(1, canary_seed, population="audit", progress=False).iloc[:0]
    frame = generate_records(n, canary_seed, population="audit", progress=progress)
    frame[UNIT_COLUMN] = AUDIT_PATIENT_BASE + np.arange(n, dtype=np.int64)
    return frame


def _split_table(frame: pd.DataFrame, texts: list[str], extra: dict | None = None) -> pa.Table:
    cols: dict[str, pa.Array] = {"text": pa.array(texts, type=pa.string())}
    for field in schema.arrow_schema():
        cols[field.name] = pa.array(frame[field.name].to_numpy(), type=field.type)
    cols.update(extra or {})
    return pa.table(cols)


def _prepare_target(out: Path, overwrite: bool) -> list[Path]:
    """Check ``out`` may be (re)written; create missing ancestors and return those created."""
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise DataError(f"dataset directory {out} exists and is not a directory")
        if any(out.iterdir()) and not overwrite:
            raise DataError(f"dataset directory {out} exists and is not empty "
                            f"(pass overwrite=True to replace it)")
    created: list[Path] = []
    parent = out.parent
    missing = []
    while not parent.exists():
        missing.append(parent)
        parent = parent.parent
    if not parent.is_dir():
        raise DataError(f"cannot create dataset directory {out}: {parent} is not a directory")
    try:
        for d in reversed(missing):
            d.mkdir()
            created.append(d)
    except OSError as e:
        _remove_created(created)
        raise DataError(f"cannot create dataset directory {out}: {e.strerror or e}") from None
    return created


def _remove_created(created: list[Path]) -> None:
    for d in reversed(created):
        try:
            d.rmdir()
        except OSError:
            pass


def build_dataset(
    out_dir: str | os.PathLike,
    *,
    source: str | os.PathLike = "synthetic",
    n_records: int | None = None,
    seed: int = 0,
    n_canary: int = 10,
    canary_seed: int = 42,
    n_audit: int = 0,
    ids_mapping: str | os.PathLike | IdMaps | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Build the split directory ``out_dir`` and return its manifest.

    ``source`` is ``"synthetic"`` (``n_records`` records, default the real table's 101766) or the
    path of ``diabetic_data.csv`` (``n_records`` then optionally caps it by a seeded subsample of
    whole patients, which may keep a few more than ``n_records`` rows; ``None`` keeps every row).
    The splits are disjoint in patients (ERRATA E11).
    ``ids_mapping`` is an ``IDs_mapping.csv`` path or :class:`IdMaps`; default the embedded tables.
    ``n_audit`` audit canaries (module docstring) are added, about half of them to train.
    """
    seed = _check_seed("seed", seed)
    canary_seed = _check_seed("canary_seed", canary_seed)
    out = Path(out_dir)
    if out.exists() and out.is_dir() and any(out.iterdir()) and not overwrite:
        raise DataError(f"dataset directory {out} exists and is not empty "
                        f"(pass overwrite=True to replace it)")

    if isinstance(source, str) and source == PUBLIC_SOURCE:
        n_canary, n_audit = 0, 0  # canaries are instruments of a private dataset: public episodes carry none
    records, id_maps, info = _load_source(source, n_records, seed, ids_mapping, progress)
    units = records[UNIT_COLUMN].to_numpy(dtype=np.int64)
    idx = split_indices(units, seed)
    secrets, canary_rows = canaries.draw_canaries(n_canary, len(idx["train"]), canary_seed)
    frames = {s: records.iloc[idx[s]].reset_index(drop=True) for s in SPLITS}
    texts = {s: verbalise_records(frames[s], id_maps, progress=progress) for s in SPLITS}
    has_canary = np.zeros(len(frames["train"]), dtype=bool)
    for secret, row in zip(secrets, canary_rows):
        texts["train"][row] += canaries.suffix(secret)
        has_canary[row] = True
    audit_secrets, audit_in = canaries.draw_audit_canaries(n_audit, canary_seed, set(secrets))
    audit_frame = _audit_records(len(audit_secrets), canary_seed, progress)
    audit_texts = [canaries.audit_text(t, s) for t, s in
                   zip(verbalise_records(audit_frame, id_maps, progress=progress), audit_secrets)]
    n_base_train = len(frames["train"])
    frames["train"] = pd.concat([frames["train"], audit_frame[audit_in]], ignore_index=True)
    texts["train"] = texts["train"] + [t for t, keep in zip(audit_texts, audit_in) if keep]
    has_canary = np.concatenate([has_canary, np.zeros(int(audit_in.sum()), dtype=bool)])
    is_audit = np.arange(len(frames["train"])) >= n_base_train
    train_units = frames["train"][UNIT_COLUMN].to_numpy(dtype=np.int64)

    tables = {
        "train": _split_table(frames["train"], texts["train"],
                              {"has_canary": pa.array(has_canary, type=pa.bool_()),
                               "audit_canary": pa.array(is_audit, type=pa.bool_())}),
        "eval": _split_table(frames["eval"], texts["eval"]),
        "attack": _split_table(frames["attack"], texts["attack"]),
    }
    canary_table = pa.table({
        "secret": pa.array(secrets, type=pa.string()),
        "train_row": pa.array(canary_rows, type=pa.int64()),
        "encounter_id": pa.array(frames["train"]["encounter_id"].to_numpy()[canary_rows],
                                 type=pa.int64()),
    })
    audit_table = pa.table({
        "secret": pa.array(audit_secrets, type=pa.string()),
        "included": pa.array(audit_in, type=pa.bool_()),
        "text": pa.array(audit_texts, type=pa.string()),
        UNIT_COLUMN: pa.array(audit_frame[UNIT_COLUMN].to_numpy(), type=pa.int64()),
    })
    manifest = {
        "schema_version": schema.SCHEMA_VERSION,
        "created_by": f"raydp {raydp.__version__}",
        **info,
        "ids_mapping": "embedded" if ids_mapping is None or isinstance(ids_mapping, IdMaps)
        else str(Path(ids_mapping).resolve()),
        "seed": seed,
        "canary_seed": canary_seed,
        "n_canary": int(n_canary),
        "canary_format": "' secret_id=<10 characters of [A-Z0-9]>.' appended to a train text",
        "n_records": int(len(records)),
        "sizes": {s: len(texts[s]) for s in SPLITS},
        "privacy_unit": PRIVACY_UNIT,
        "unit_column": UNIT_COLUMN,
        "n_audit": int(n_audit),
        "audit_included": int(audit_in.sum()),
        "audit_rule": ("audit canaries: one synthetic patient each, its own secret in the canary format, "
                       "in train by an independent fair coin (Steinke, Nasr, Jagielski 2023)"),
        "units": {s: int(len(np.unique(train_units if s == "train" else units[idx[s]]))) for s in SPLITS},
        "split_rule": SPLIT_RULE,
        "content_sha256": texts_sha256(texts),
        "split_sha256": {s: texts_sha256({s: texts[s]}) for s in SPLITS},
        "files": [f"{s}.parquet" for s in SPLITS] + ["canaries.parquet", "audit.parquet", MANIFEST],
    }
    _write_atomically(out, overwrite, tables, {"canaries": canary_table, "audit": audit_table}, manifest)
    return manifest


def _write_files(tmp: Path, tables: dict[str, pa.Table], extra: dict[str, pa.Table],
                 manifest: dict) -> None:
    for name, table in {**tables, **extra}.items():
        pq.write_table(table, tmp / f"{name}.parquet")
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")


def _write_atomically(out: Path, overwrite: bool, tables, extra, manifest) -> None:
    created = _prepare_target(out, overwrite)
    tag = uuid.uuid4().hex[:12]
    tmp = out.parent / f".{out.name}.tmp-{tag}"
    old = out.parent / f".{out.name}.old-{tag}"
    try:
        tmp.mkdir()
    except OSError as e:
        _remove_created(created)
        raise DataError(f"cannot write dataset directory {out}: {e.strerror or e}") from None
    try:
        _write_files(tmp, tables, extra, manifest)
        if out.exists() and any(out.iterdir()):
            os.rename(out, old)
            try:
                os.rename(tmp, out)
            except BaseException:
                os.rename(old, out)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)  # replaces an empty directory in place
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_created(created)
        if isinstance(e, OSError):
            raise DataError(f"cannot write dataset directory {out}: "
                            f"{' '.join(str(e.strerror or e).split())}") from None
        raise


def _dataset_file(dataset_dir: str | os.PathLike, name: str) -> Path:
    d = Path(dataset_dir)
    if not d.is_dir():
        raise DataError(f"dataset directory {d} does not exist")
    f = d / name
    if not f.is_file():
        raise DataError(f"dataset directory {d} has no {name}")
    return f


def load_manifest(dataset_dir: str | os.PathLike) -> dict[str, Any]:
    """The ``manifest.json`` of a dataset directory."""
    f = _dataset_file(dataset_dir, MANIFEST)
    try:
        manifest = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"manifest {f} cannot be read: {' '.join(str(e).split())}") from None
    if not isinstance(manifest, dict) or "sizes" not in manifest:
        raise DataError(f"manifest {f} is not a raydp dataset manifest")
    return manifest


def load_split(dataset_dir: str | os.PathLike, split: str) -> pd.DataFrame:
    """One split (``train``, ``eval`` or ``attack``) as a DataFrame, or ``canaries`` / ``audit``."""
    if split not in (*SPLITS, "canaries", "audit"):
        raise DataError(f"unknown split {split!r}; expected one of train, eval, attack")
    f = _dataset_file(dataset_dir, f"{split}.parquet")
    try:
        return pq.read_table(f).to_pandas()
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"split file {f} cannot be read: {' '.join(str(e).split())}") from None


def load_texts(dataset_dir: str | os.PathLike, split: str) -> list[str]:
    """The narratives of one split, in file order."""
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; expected one of train, eval, attack")
    f = _dataset_file(dataset_dir, f"{split}.parquet")
    try:
        return pq.read_table(f, columns=["text"]).column("text").to_pylist()
    except (OSError, KeyError, pa.ArrowException) as e:
        raise DataError(f"split file {f} cannot be read: {' '.join(str(e).split())}") from None


def privacy_unit(manifest: dict[str, Any]) -> str | None:
    """The privacy unit a manifest's splits are disjoint in: ``"patient"``, or ``None`` for a
    directory built before ERRATA E11 (record-level splits that may share patients)."""
    return manifest.get("privacy_unit")


def load_units(dataset_dir: str | os.PathLike, split: str) -> np.ndarray:
    """The unit (patient) id of every row of one split as int64, in ``load_texts`` order (E11).

    A directory built before E11 (no ``privacy_unit`` in its manifest) is refused: its
    record-level splits may put one patient in two splits, so it must be rebuilt.
    """
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; expected one of train, eval, attack")
    manifest = load_manifest(dataset_dir)
    unit = privacy_unit(manifest)
    if unit is None:
        raise DataError(f"dataset {dataset_dir} was built before patient-level splits (its "
                        f"manifest has no privacy_unit; its record-level splits may share patients "
                        f"across train/eval/attack): rebuild it with `raydp data build`")
    column = manifest.get("unit_column")
    if unit != PRIVACY_UNIT or column != UNIT_COLUMN:
        raise DataError(f"dataset {dataset_dir} has privacy_unit {unit!r} / unit_column "
                        f"{column!r}; this raydp knows only {PRIVACY_UNIT!r} / {UNIT_COLUMN!r}")
    f = _dataset_file(dataset_dir, f"{split}.parquet")
    try:
        values = pq.read_table(f, columns=[column]).column(column).to_numpy()
    except (OSError, KeyError, pa.ArrowException) as e:
        raise DataError(f"split file {f} cannot be read: {' '.join(str(e).split())}") from None
    return np.asarray(values, dtype=np.int64)


def load_canaries(dataset_dir: str | os.PathLike) -> pd.DataFrame:
    """The injected canaries: ``secret``, ``train_row``, ``encounter_id``."""
    return load_split(dataset_dir, "canaries")


def load_audit_canaries(dataset_dir: str | os.PathLike) -> pd.DataFrame | None:
    """The audit canaries (``secret``, ``included``, ``text``, ``patient_nbr``); ``None`` for a directory
    built without them (``n_audit`` 0, or before they existed)."""
    if not (Path(dataset_dir) / "audit.parquet").is_file():
        return None
    table = load_split(dataset_dir, "audit")
    return table if len(table) else None


def describe_dataset(dataset_dir: str | os.PathLike) -> dict[str, Any]:
    """Sizes, privacy unit and distinct units per split, mean characters/words per narrative, an
    eval sample, the canary count and the audit canaries (how many, how many in train).

    ``privacy_unit`` is ``None`` (and ``units`` absent) for a directory built before ERRATA E11;
    ``note`` then says to rebuild it.
    """
    manifest = load_manifest(dataset_dir)
    texts = {s: load_texts(dataset_dir, s) for s in SPLITS}
    every = [t for s in SPLITS for t in texts[s]]
    unit = privacy_unit(manifest)
    if unit is None:
        units: dict[str, Any] = {"units": None, "unit_note": (
            "built before patient-level splits: record-level splits may share patients; rebuild "
            "with `raydp data build`")}
    else:
        units = {"units": {s: int(len(np.unique(load_units(dataset_dir, s)))) for s in SPLITS}}

    def mean(xs: list[int]) -> float:
        return float(np.mean(xs)) if xs else 0.0

    return {
        "source": manifest.get("source"),
        "synthetic": manifest.get("synthetic"),
        "sizes": {s: len(texts[s]) for s in SPLITS},
        "privacy_unit": unit,
        **units,
        "mean_chars": mean([len(t) for t in every]),
        "mean_words": mean([len(t.split()) for t in every]),
        "mean_words_by_split": {s: mean([len(t.split()) for t in texts[s]]) for s in SPLITS},
        "sample_eval_narrative": texts["eval"][0] if texts["eval"] else None,
        "n_canary": len(load_canaries(dataset_dir)),
        "n_audit": manifest.get("n_audit", 0),
        "audit_included": manifest.get("audit_included", 0),
        "content_sha256": manifest.get("content_sha256"),
    }


def resolve_dataset(data, build_dir: str | Path, progress: bool = True) -> Path:
    """The one place a run or a study turns its data settings (:class:`raydp.config.DataConfig`) into a
    dataset directory: a built dataset directory is used as is (its manifest checked); a CSV or the
    synthetic generator is built into ``build_dir`` (reused when already built there)."""
    source = Path(data.source).expanduser()
    if data.source not in ("synthetic", PUBLIC_SOURCE) and source.is_dir():
        load_manifest(source)  # validates that it is a dataset directory
        return source.resolve()
    build_dir = Path(build_dir)
    if not (build_dir / "manifest.json").exists():
        build_dataset(build_dir, source=data.source if data.source in ("synthetic", PUBLIC_SOURCE) else str(source),
                      n_records=data.n_records, seed=data.seed, n_canary=data.n_canary,
                      canary_seed=data.canary_seed, n_audit=data.n_audit, ids_mapping=data.ids_mapping,
                      progress=progress)
    return build_dir.resolve()
