"""Build, load and describe a dataset directory: train/eval/attack/validation splits with canaries (Sec. 2.1).

The privacy unit is the patient (ERRATA E11), and each patient is assigned to a split on its own: its
``patient_nbr`` is hashed with the split seed (BLAKE2b keyed with the seed and a stream tag, read as a
uniform u in [0, 1)) and u is compared with fixed thresholds: attack for u < f_attack, eval for the next
f_eval, validation (the private validation split, for private selection) for the next f_validation, train
for the rest (defaults 0.2 / 0.2 / 0.05 / 0.55, :data:`DEFAULT_FRACTIONS`; a study or run sets them with
``data.fractions``). No patient's split depends on any other patient, so adding or removing one patient
from the source table changes that patient's membership and nothing else. The neighbouring relation this
gives for the source table: add/remove-one patient in the table is add/remove-one patient in at most one
split (the training split, or an evaluation split, which is unprotected, E15); a DP guarantee for the
training set under add/remove-one patient therefore holds for the source table under the same relation.
Split sizes are binomial around the fractions, not exact; a required split (train, eval, attack) that
gets no patient is an error. The seed is public: it decides which split a patient WOULD be in, not whether
the patient is in the table. Rows keep their source order within a split. The attack set is never
trained on.

A CSV source subsampled with ``sample_fraction`` keeps each patient the same way: a patient is kept when
its own hash (another stream of the same seed) is below the fraction, so a kept patient brings all of its
encounters and one patient's presence never moves another. (The earlier cap ``n_records``, which drew
patients in a seeded order until a row count was reached, let one patient move many others; it is refused
for a CSV.)

Audit canaries (``n_audit``, :func:`raydp.data.canaries.draw_audit_canaries`): records of the synthetic
``'audit'`` population, one patient each (patient ids from 6e9, encounter ids from 7e9: never a real or
private synthetic id), each a short narrative with its own secret appended
(:func:`raydp.data.canaries.audit_text`); those whose fair coin came up
are appended to train (after its own rows), the others are held back. ``audit.parquet`` lists all of
them (``secret``, ``included``, ``text``, ``patient_nbr``); the train split marks them in
``audit_canary``. They are units like any patient: the run's epsilon covers each of them.

Layout of ``out_dir``: ``train.parquet`` (``text``, the 50 record fields, ``has_canary``, ``audit_canary``),
``eval.parquet``, ``attack.parquet`` and ``validation.parquet`` (``text`` and the record fields),
``canaries.parquet`` (``secret``, ``train_row``, ``encounter_id``), ``audit.parquet`` and ``manifest.json``.
The manifest's ``privacy_unit`` (``"patient"``), ``unit_column`` (``"patient_nbr"``) and ``units`` (distinct
patients per split) say what the splits are disjoint in; a directory built before E11 has no
``privacy_unit`` and its record-level splits may share patients. The manifest is private like the rest of
the directory: it holds the content hashes (``content_sha256``, ``split_sha256``, ``source_sha256``); what
leaves the directory is only the keyed ``dataset_id`` (:mod:`raydp.data.identity`). The directory is written
to a temporary sibling and renamed into place, so a failed build leaves nothing behind; the folder and every
file in it are owner-only from the moment they exist (0700 and 0600, :mod:`raydp.files`).
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
from raydp.files import PRIVATE_DIR, check_ancestors, owner_only
from raydp.data import canaries, schema
from raydp.data.csv_source import load_diabetes_csv, load_ids_mapping
from raydp.data.identity import keyed_id, manifest_id, public_id
from raydp.data.schema import IdMaps
from raydp.data.synthetic import DEFAULT_GENERATOR, generate_records
from raydp.data.verbalise import verbalise_records

SPLITS = ("train", "eval", "attack")  # the required splits
VALIDATION = "validation"  # the private validation split (private selection); empty unless its fraction is set
ALL_SPLITS = (*SPLITS, VALIDATION)
#: the fraction of patients in each split; train takes the rest (:func:`check_fractions`)
DEFAULT_FRACTIONS = {"attack": 0.2, "eval": 0.2, VALIDATION: 0.05}
BUCKET_ORDER = ("attack", "eval", VALIDATION)  # [0, f_attack), then eval, then validation; train above
SPLIT_STREAM = b"raydp-split"
SUBSAMPLE_STREAM = b"raydp-subsample"
PRIVACY_UNIT = "patient"  # ERRATA E11: the unit the splits (and DP) are taken over
UNIT_COLUMN = "patient_nbr"
SPLIT_RULE = ("each patient (patient_nbr) on its own: u = BLAKE2b(patient_nbr, key = split seed) in [0, 1); "
              "attack if u < f_attack, then eval, then validation, train above; no patient's split depends on "
              "another's (add/remove-one patient in the table is add/remove-one patient in one split)")
DEFAULT_SYNTHETIC_SIZE = 101_766  # the size of the real table
SYNTHETIC_NOTE = "Synthetic records: they describe no real patient."
REAL_NOTE = ("Records come from a user-supplied CSV and may describe real patients; treat every "
             "file in this directory as sensitive.")
MANIFEST = "manifest.json"
AUDIT_PATIENT_BASE = 6_000_000_000  # one patient per audit canary
CANARY_PATIENT_BASE = 5_000_000_000  # one patient per secret canary


def check_fractions(fractions: dict | None) -> dict[str, float]:
    """The split fractions (defaults for missing keys), checked: each in [0, 1), attack and eval > 0, and
    train's share (1 minus their sum) > 0. A DataError (one line) otherwise."""
    given = dict(fractions or {})
    unknown = sorted(set(given) - set(DEFAULT_FRACTIONS))
    if unknown:
        raise DataError(f"unknown split fraction(s) {', '.join(unknown)} (known: {', '.join(DEFAULT_FRACTIONS)}; "
                        "train takes the rest)")
    out = {**DEFAULT_FRACTIONS, **given}
    for name, value in out.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
            raise DataError(f"split fraction {name} must be a number in [0, 1), got {value!r}")
        out[name] = float(value)
    for name in ("attack", "eval"):
        if out[name] <= 0:
            raise DataError(f"split fraction {name} must be > 0 (the {name} split is required)")
    if sum(out.values()) >= 1:
        raise DataError(f"split fractions {out} leave nothing for train (their sum must be < 1)")
    return out


def unit_uniforms(units: np.ndarray, seed: int, stream: bytes) -> np.ndarray:
    """One number in [0, 1) per unit id: BLAKE2b-64 of the id keyed with (stream, seed), as a fraction.

    A function of the unit's own id and the (public) seed only: no unit's value depends on another's."""
    key = stream + b":" + str(int(seed)).encode()
    out = np.empty(len(units), dtype=np.float64)
    for i, unit in enumerate(np.asarray(units).tolist()):
        digest = hashlib.blake2b(str(int(unit)).encode(), key=key, digest_size=8).digest()
        out[i] = int.from_bytes(digest, "big") / 2.0 ** 64
    return out


def split_of_units(units: np.ndarray, seed: int, fractions: dict | None = None) -> np.ndarray:
    """The split name of each unit id (:func:`unit_uniforms` against the fractions' thresholds)."""
    fractions = check_fractions(fractions)
    u = unit_uniforms(units, seed, SPLIT_STREAM)
    which = np.full(len(u), "train", dtype=object)
    low = 0.0
    for name in BUCKET_ORDER:
        high = low + fractions[name]
        which[(u >= low) & (u < high)] = name
        low = high
    return which


def split_indices(units: np.ndarray, seed: int, fractions: dict | None = None) -> dict[str, np.ndarray]:
    """Disjoint sorted row indices of each split (:data:`ALL_SPLITS`), whole units (patients) each, a
    function of each unit's own id and ``seed`` (ERRATA E11; the rule is in the module docstring).

    ``units`` holds the unit id (``patient_nbr``) of every row. A required split with no unit is a
    DataError."""
    units = np.asarray(units)
    fractions = check_fractions(fractions)
    uniq, inverse = np.unique(units, return_inverse=True)
    which = split_of_units(uniq, seed, fractions)[inverse.reshape(-1)]
    out = {name: np.flatnonzero(which == name) for name in ALL_SPLITS}
    for name in SPLITS:
        if len(out[name]) == 0:
            raise DataError(f"{len(units)} records of {len(uniq)} distinct patient(s) leave the {name} split empty "
                            f"(each patient is assigned on its own; fractions {fractions}): use more records or "
                            "another split seed")
    return out


def texts_sha256(texts_by_split: dict[str, list[str]]) -> str:
    """sha256 over the given splits in ALL_SPLITS order: each split name, then its texts, NUL-separated.

    ``texts_sha256(every split)`` is the manifest's ``content_sha256`` (private: the released name of the
    dataset is the keyed :func:`raydp.data.identity.keyed_id` of it); ``texts_sha256({split: texts})`` is
    that split's entry in ``split_sha256``.
    """
    h = hashlib.sha256()
    for split in ALL_SPLITS:
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
#: that pre-train a controller or tune a baseline's clip spend no private budget. Its seeds
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


def _load_source(source, n_records, seed, ids_mapping, progress, sample_fraction=None, generator=DEFAULT_GENERATOR):
    if isinstance(source, str) and source in (PUBLIC_SOURCE, "synthetic"):
        if sample_fraction is not None:
            raise DataError("sample_fraction subsamples a CSV; n_records sizes synthetic data")
        n = DEFAULT_SYNTHETIC_SIZE if n_records is None else n_records
        if source == PUBLIC_SOURCE:
            records = generate_records(n, PUBLIC_EPISODE_SEED + seed, population="public", progress=progress,
                                       generator=generator)
            info = {"source": PUBLIC_SOURCE, "synthetic": True, "public": True, "note": PUBLIC_NOTE}
        else:
            records = generate_records(n, seed, population="private", progress=progress, generator=generator)
            info = {"source": "synthetic", "synthetic": True, "note": SYNTHETIC_NOTE}
        info["generator"] = generator
        return records, _resolve_id_maps(ids_mapping), info
    if not isinstance(source, (str, os.PathLike)):
        raise DataError(f"source must be 'synthetic' or a CSV path, got {source!r}")
    if n_records is not None:
        raise DataError("n_records sizes synthetic data; to subsample a CSV use sample_fraction (each patient is "
                        "kept on its own, so one patient's presence never moves another)")
    path = Path(source)
    records, _ = load_diabetes_csv(path)
    if sample_fraction is not None:
        if isinstance(sample_fraction, bool) or not isinstance(sample_fraction, (int, float)) \
                or not 0 < sample_fraction <= 1:
            raise DataError(f"sample_fraction must be a number in (0, 1], got {sample_fraction!r}")
        records = _sample_patients(records, float(sample_fraction), seed)
        if records.empty:
            raise DataError(f"sample_fraction={sample_fraction} kept no patient of {path}")
    info = {"source": str(path.resolve()), "synthetic": False, "note": REAL_NOTE,
            "source_sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    if sample_fraction is not None:
        info["sample_fraction"] = float(sample_fraction)
    return records, _resolve_id_maps(ids_mapping), info


def _sample_patients(records: pd.DataFrame, fraction: float, seed: int) -> pd.DataFrame:
    """The rows of the patients whose own hash (:func:`unit_uniforms`, subsample stream) is below ``fraction``
    (E11: whole patients, each kept or not on its own). Source row order is kept."""
    uniq, inverse = np.unique(records[UNIT_COLUMN].to_numpy(), return_inverse=True)
    kept = unit_uniforms(uniq, seed, SUBSAMPLE_STREAM) < fraction
    return records.loc[kept[inverse.reshape(-1)]].reset_index(drop=True)


def _canary_records(n: int, canary_seed: int, progress: bool, generator: str = DEFAULT_GENERATOR) -> pd.DataFrame:
    """``n`` records of the canary population (private parameters), one patient each, ids never shared with any
    split or the audit canaries; each carries one secret canary."""
    frame = generate_records(max(n, 1), canary_seed, population="canary", progress=progress and n > 0,
                             generator=generator).iloc[:n].reset_index(drop=True)
    frame[UNIT_COLUMN] = CANARY_PATIENT_BASE + np.arange(n, dtype=np.int64)
    return frame


def _audit_records(n: int, canary_seed: int, progress: bool, generator: str = DEFAULT_GENERATOR) -> pd.DataFrame:
    """``n`` records of the audit population, one patient each (ids never shared with any split)."""
    if n == 0:
        return generate_records(1, canary_seed, population="audit", progress=False, generator=generator).iloc[:0]
    frame = generate_records(n, canary_seed, population="audit", progress=progress, generator=generator)
    frame[UNIT_COLUMN] = AUDIT_PATIENT_BASE + np.arange(n, dtype=np.int64)
    return frame


VALUE_SPANS = "value_spans"  # each text's field-value character spans (raydp.data.verbalise.verbalise_spans)


def _spans_array(spans: list[list[tuple[int, int]]]) -> pa.Array:
    """Each text's spans as a ``list<fixed_size_list<int32, 2>>`` column, built from flat arrays (a nested list of
    Python ints took about a quarter of building the benchmark default's dataset)."""
    counts = np.fromiter((len(sp) for sp in spans), dtype=np.int64, count=len(spans))
    flat = np.fromiter((v for sp in spans for a, b in sp for v in (a, b)), dtype=np.int64, count=2 * int(counts.sum()))
    # pyarrow's safe cast refuses an offset outside int32, as the nested conversion did
    offsets = pa.array(np.concatenate([[0], np.cumsum(counts)]), type=pa.int32())
    pairs = pa.FixedSizeListArray.from_arrays(pa.array(flat, type=pa.int32()), 2)
    return pa.ListArray.from_arrays(offsets, pairs, type=pa.list_(pa.list_(pa.int32(), 2)))


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
    check_ancestors(parent)  # no other user can swap the dataset's folder for theirs
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


@owner_only
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
    fractions: dict | None = None,
    sample_fraction: float | None = None,
    generator: str = DEFAULT_GENERATOR,
    overwrite: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Build the split directory ``out_dir`` and return its manifest.

    ``source`` is ``"synthetic"`` (``n_records`` records, default the real table's 101766), ``"public"``
    (the public population) or the path of ``diabetic_data.csv`` (``sample_fraction`` then optionally keeps
    each patient with that probability, on its own; ``None`` keeps every row). The splits are disjoint in
    patients and each patient's split depends on its own id only (ERRATA E11; module docstring);
    ``fractions`` sets the split fractions (:data:`DEFAULT_FRACTIONS`); ``generator`` the synthetic generator
    (``'structured'``, the default, or ``'independent'``; :mod:`raydp.data.synthetic`).
    ``ids_mapping`` is an ``IDs_mapping.csv`` path or :class:`IdMaps`; default the embedded tables.
    ``n_audit`` audit canaries (module docstring) are added, about half of them to train.
    """
    seed = _check_seed("seed", seed)
    canary_seed = _check_seed("canary_seed", canary_seed)
    fractions = check_fractions(fractions)
    out = Path(out_dir)
    if out.exists() and out.is_dir() and any(out.iterdir()) and not overwrite:
        raise DataError(f"dataset directory {out} exists and is not empty "
                        f"(pass overwrite=True to replace it)")

    if isinstance(source, str) and source == PUBLIC_SOURCE:
        n_canary, n_audit = 0, 0  # canaries are instruments of a private dataset: public episodes carry none
    records, id_maps, info = _load_source(source, n_records, seed, ids_mapping, progress, sample_fraction, generator)
    units = records[UNIT_COLUMN].to_numpy(dtype=np.int64)
    idx = split_indices(units, seed, fractions)
    secrets = canaries.draw_canaries(n_canary, canary_seed)
    frames = {s: records.iloc[idx[s]].reset_index(drop=True) for s in ALL_SPLITS}
    texts, spans = {}, {}
    for s in ALL_SPLITS:
        texts[s], spans[s] = verbalise_records(frames[s], id_maps, progress=progress, spans=True)
    # the secret canaries: records of their own synthetic patients, each ending in its secret, appended to train
    # (never a real or private record: which records carry a canary depends on no other patient)
    canary_frame = _canary_records(len(secrets), canary_seed, progress, generator)
    canary_texts, canary_spans = verbalise_records(canary_frame, id_maps, progress=progress, spans=True)
    canary_rows = np.arange(len(frames["train"]), len(frames["train"]) + len(secrets), dtype=np.int64)
    frames["train"] = pd.concat([frames["train"], canary_frame], ignore_index=True)
    texts["train"] = texts["train"] + [t + canaries.suffix(s) for t, s in zip(canary_texts, secrets)]
    spans["train"] = spans["train"] + canary_spans
    has_canary = np.zeros(len(frames["train"]), dtype=bool)
    has_canary[canary_rows] = True
    audit_secrets, audit_in = canaries.draw_audit_canaries(n_audit, canary_seed, set(secrets))
    audit_frame = _audit_records(len(audit_secrets), canary_seed, progress, generator)
    audit_narratives, audit_spans = verbalise_records(audit_frame, id_maps, progress=progress, spans=True)
    audit_texts = [canaries.audit_text(t, s) for t, s in zip(audit_narratives, audit_secrets)]
    audit_spans = [[(a, b) for a, b in sp if b <= len(text) - len(canaries.suffix(secret))]  # the kept prefix
                   for text, secret, sp in zip(audit_texts, audit_secrets, audit_spans)]
    n_base_train = len(frames["train"])
    frames["train"] = pd.concat([frames["train"], audit_frame[audit_in]], ignore_index=True)
    texts["train"] = texts["train"] + [t for t, keep in zip(audit_texts, audit_in) if keep]
    spans["train"] = spans["train"] + [sp for sp, keep in zip(audit_spans, audit_in) if keep]
    has_canary = np.concatenate([has_canary, np.zeros(int(audit_in.sum()), dtype=bool)])
    is_audit = np.arange(len(frames["train"])) >= n_base_train
    train_units = frames["train"][UNIT_COLUMN].to_numpy(dtype=np.int64)

    tables = {
        "train": _split_table(frames["train"], texts["train"],
                              {"has_canary": pa.array(has_canary, type=pa.bool_()),
                               "audit_canary": pa.array(is_audit, type=pa.bool_()),
                               VALUE_SPANS: _spans_array(spans["train"])}),
        **{s: _split_table(frames[s], texts[s], {VALUE_SPANS: _spans_array(spans[s])})
           for s in ("eval", "attack", VALIDATION)},
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
    content = texts_sha256(texts)
    manifest = {
        "schema_version": schema.SCHEMA_VERSION,
        "created_by": f"raydp {raydp.__version__}",
        **info,
        "ids_mapping": "embedded" if ids_mapping is None or isinstance(ids_mapping, IdMaps)
        else str(Path(ids_mapping).resolve()),
        "seed": seed,
        "canary_seed": canary_seed,
        "n_canary": int(n_canary),
        "canary_format": ("' secret_id=<10 characters of [A-Z0-9]>.' appended to the narrative of a synthetic "
                          "record of its own patient, added to train"),
        "n_records": int(len(records)),
        "sizes": {s: len(texts[s]) for s in ALL_SPLITS},
        "privacy_unit": PRIVACY_UNIT,
        "unit_column": UNIT_COLUMN,
        "n_audit": int(n_audit),
        "audit_included": int(audit_in.sum()),
        "audit_rule": ("audit canaries: one synthetic patient each, its own secret in the canary format, "
                       "in train by an independent fair coin (Steinke, Nasr, Jagielski 2023)"),
        "units": {s: int(len(np.unique(train_units if s == "train" else units[idx[s]]))) for s in ALL_SPLITS},
        "split_rule": SPLIT_RULE,
        "split_fractions": fractions,
        "neighbouring_relation": ("add/remove-one patient in the source table is add/remove-one patient in at "
                                  "most one split (each patient's split depends on its own id only)"),
        "content_sha256": content,
        "split_sha256": {s: texts_sha256({s: texts[s]}) for s in ALL_SPLITS},
        # the dataset's released name: keyed with the owner's secret (raydp.data.identity); never the hashes above
        "dataset_id": public_id(content) if info.get("public") else keyed_id(content),
        "files": [f"{s}.parquet" for s in ALL_SPLITS] + ["canaries.parquet", "audit.parquet", MANIFEST],
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
    # a directory publish (the whole dataset appears at once), not a file write: atomic_write replaces one file
    tag = uuid.uuid4().hex[:12]
    tmp = out.parent / f".{out.name}.tmp-{tag}"
    old = out.parent / f".{out.name}.old-{tag}"
    try:
        tmp.mkdir(mode=PRIVATE_DIR)  # private records: owner-only from the start
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


def _check_split(split: str, extra: tuple = ()) -> None:
    if split not in (*ALL_SPLITS, *extra):
        raise DataError(f"unknown split {split!r}; expected one of {', '.join((*ALL_SPLITS, *extra))}")


def _split_file(dataset_dir: str | os.PathLike, split: str) -> Path | None:
    """The parquet file of a split; None for the validation split of a directory built before it existed."""
    if split == VALIDATION and not (Path(dataset_dir) / f"{split}.parquet").is_file() \
            and (Path(dataset_dir) / MANIFEST).is_file():
        return None
    return _dataset_file(dataset_dir, f"{split}.parquet")


def has_split(dataset_dir: str | os.PathLike, split: str) -> bool:
    """Whether the dataset has a non-empty ``split`` (the validation split is empty unless its fraction is set)."""
    sizes = load_manifest(dataset_dir).get("sizes") or {}
    return bool(sizes.get(split))


def load_split(dataset_dir: str | os.PathLike, split: str) -> pd.DataFrame:
    """One split (``train``, ``eval``, ``attack``, ``validation``) as a DataFrame, or ``canaries`` / ``audit``."""
    _check_split(split, ("canaries", "audit"))
    f = _split_file(dataset_dir, split)
    if f is None:
        return pa.schema([pa.field("text", pa.string()), *schema.arrow_schema()]).empty_table().to_pandas()
    try:
        return pq.read_table(f).to_pandas()
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"split file {f} cannot be read: {' '.join(str(e).split())}") from None


def load_texts(dataset_dir: str | os.PathLike, split: str) -> list[str]:
    """The narratives of one split, in file order."""
    _check_split(split)
    f = _split_file(dataset_dir, split)
    if f is None:
        return []
    try:
        return pq.read_table(f, columns=["text"]).column("text").to_pylist()
    except (OSError, KeyError, pa.ArrowException) as e:
        raise DataError(f"split file {f} cannot be read: {' '.join(str(e).split())}") from None


def load_value_spans(dataset_dir: str | os.PathLike, split: str) -> list[list[tuple[int, int]]] | None:
    """The character spans of every text's field values, in ``load_texts`` order (the value-token metric). A
    directory built before they were stored: re-verbalised from the record fields with the embedded id tables,
    and None if that does not give back the stored texts (another ``IDs_mapping.csv``, say)."""
    _check_split(split)
    f = _split_file(dataset_dir, split)
    if f is None:
        return []
    try:
        table = pq.read_table(f)
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"split file {f} cannot be read: {' '.join(str(e).split())}") from None
    if VALUE_SPANS in table.column_names:
        return [[(a, b) for a, b in sp] for sp in table.column(VALUE_SPANS).to_pylist()]
    if "text" not in table.column_names or any(f.name not in table.column_names for f in schema.arrow_schema()):
        return None  # free text (raydp.data.text_source) has no record fields: no value spans
    frame = table.to_pandas()
    texts, spans = verbalise_records(frame, None, progress=False, spans=True)
    stored = [canaries.PATTERN.sub("", t) for t in frame["text"]]  # a train text may end in a canary
    return spans if texts == stored else None


def privacy_unit(manifest: dict[str, Any]) -> str | None:
    """The privacy unit a manifest's splits are disjoint in: ``"patient"``, or ``None`` for a
    directory built before ERRATA E11 (record-level splits that may share patients)."""
    return manifest.get("privacy_unit")


def load_units(dataset_dir: str | os.PathLike, split: str) -> np.ndarray:
    """The unit (patient) id of every row of one split as int64, in ``load_texts`` order (E11).

    A directory built before E11 (no ``privacy_unit`` in its manifest) is refused: its
    record-level splits may put one patient in two splits, so it must be rebuilt.
    """
    _check_split(split)
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
    f = _split_file(dataset_dir, split)
    if f is None:
        return np.zeros(0, dtype=np.int64)
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
    texts = {s: load_texts(dataset_dir, s) for s in ALL_SPLITS}
    every = [t for s in ALL_SPLITS for t in texts[s]]
    unit = privacy_unit(manifest)
    if unit is None:
        units: dict[str, Any] = {"units": None, "unit_note": (
            "built before patient-level splits: record-level splits may share patients; rebuild "
            "with `raydp data build`")}
    else:
        units = {"units": {s: int(len(np.unique(load_units(dataset_dir, s)))) for s in ALL_SPLITS}}

    def mean(xs: list[int]) -> float:
        return float(np.mean(xs)) if xs else 0.0

    return {
        "source": manifest.get("source"),
        "synthetic": manifest.get("synthetic"),
        "sizes": {s: len(texts[s]) for s in ALL_SPLITS},
        "privacy_unit": unit,
        **units,
        "mean_chars": mean([len(t) for t in every]),
        "mean_words": mean([len(t.split()) for t in every]),
        "mean_words_by_split": {s: mean([len(t.split()) for t in texts[s]]) for s in ALL_SPLITS},
        "sample_eval_narrative": texts["eval"][0] if texts["eval"] else None,
        "n_canary": len(load_canaries(dataset_dir)),
        "n_audit": manifest.get("n_audit", 0),
        "audit_included": manifest.get("audit_included", 0),
        "split_fractions": manifest.get("split_fractions"),
        "dataset_id": manifest_id(manifest),
    }
