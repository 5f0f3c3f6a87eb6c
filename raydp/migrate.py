"""``raydp migrate PATH...``: rewrite files written before dataset ids so no plain hash of private data stays.

Before :mod:`raydp.data.identity`, run summaries, results tables, study summaries, HTML reports and policy
manifests named a dataset by ``dataset_sha256``, the plain SHA-256 of its split texts. Anyone who knows every
record but one can recompute that hash for each candidate of the last record and learn it with certainty, so
those files void the epsilon they report. This command rewrites them in place, for the data owner (it needs
the owner's key, ``RAYDP_OWNER_KEY`` or ``~/.config/raydp/owner.key``):

1. it collects every plain hash named by a ``dataset_sha256`` field (JSON files, ``results.parquet``);
2. it maps each to its id (:func:`raydp.data.identity.identity_of`: keyed for private data, ``public:<sha>``
   for the public population), the id that new runs on the same records get, so old and new runs compose;
3. it rewrites every file under PATH that holds one of those hashes, or its 12-digit prefix (reports and
   terminal-style summaries abbreviate): ``dataset_sha256`` fields become ``dataset_id``, other occurrences
   become the id, policy manifests become ``raydp-policy-v2``. Each file is replaced atomically;
4. it converts every v2 policy's RLlib module checkpoint (which pickles classes by module path) into the
   ``module.safetensors`` of ``raydp-policy-v3`` (:func:`raydp.control.store.convert_policy_module`).

Dataset directories (a ``manifest.json`` with ``sizes``) are private and keep their content hashes; they gain
their ``dataset_id``. ``--check`` changes nothing and lists the files that still hold a plain hash (exit 1 if
any): run it before releasing a directory.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from raydp.control.store import HASH_FORMATS, MANIFEST, PICKLE_FORMATS, convert_policy_module
from raydp.data.identity import keyed_id, manifest_id, owner_key, public_id
from raydp.errors import ConfigError
from raydp.files import atomic_replace, atomic_write

LEGACY_FIELD = "dataset_sha256"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
TEXT_SUFFIXES = (".json", ".jsonl", ".html", ".htm", ".svg", ".txt", ".csv", ".md", ".log", ".yaml")


@dataclass
class Migration:
    """What :func:`migrate` found and did: ``mapping`` (plain hash -> id), files rewritten, dataset manifests
    given their id, and (``check``) files that still hold a plain hash."""

    mapping: dict[str, str] = field(default_factory=dict)
    rewritten: list[Path] = field(default_factory=list)
    datasets: list[Path] = field(default_factory=list)
    remaining: list[Path] = field(default_factory=list)
    policies: list[Path] = field(default_factory=list)  # policy directories converted to raydp-policy-v3


def _is_dataset_manifest(path: Path, data) -> bool:
    return path.name == "manifest.json" and isinstance(data, dict) and "sizes" in data and "content_sha256" in data


def _files(roots: list[Path]):
    for root in roots:
        if root.is_file():
            yield root
            continue
        for dirpath, _, names in os.walk(root):
            for name in sorted(names):
                yield Path(dirpath) / name


def _dataset_dirs(roots: list[Path]) -> set[Path]:
    out = set()
    for f in _files(roots):
        if f.name == "manifest.json":
            try:
                data = json.loads(f.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError):
                continue
            if _is_dataset_manifest(f, data):
                out.add(f.parent)
    return out


def _collect(value, found: dict[str, bool], public: bool = False) -> None:
    """Every plain hash a ``dataset_sha256`` field holds, with whether its record says the data is public."""
    if isinstance(value, dict):
        public = public or bool(value.get("public_data")) or value.get("data_source") == "public"
        legacy = value.get(LEGACY_FIELD)
        if isinstance(legacy, str) and _SHA256.match(legacy):
            found[legacy] = found.get(legacy, False) or public
        for v in value.values():
            _collect(v, found, public)
    elif isinstance(value, list):
        for v in value:
            _collect(v, found, public)


def _rewrite_json(value, mapping: dict[str, str]):
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if k == LEGACY_FIELD:
                out["dataset_id"] = mapping.get(v, v) if isinstance(v, str) else v
                continue
            out[mapping.get(k, k) if isinstance(k, str) else k] = _rewrite_json(v, mapping)
        if out.get("format") in HASH_FORMATS:
            out["format"] = PICKLE_FORMATS[0]  # ids instead of hashes; its module is converted below
        return out
    if isinstance(value, list):
        return [_rewrite_json(v, mapping) for v in value]
    if isinstance(value, str):
        return _replace_text(value, mapping)
    return value


def _replace_text(text: str, mapping: dict[str, str]) -> str:
    """Every run of hex digits that starts with a known hash's first 12 digits (the whole hash, or an abbreviation
    of any length a report printed) becomes the id."""
    for sha, new in mapping.items():
        if sha[:12] in text:
            text = re.sub(re.escape(sha[:12]) + r"[0-9a-f]*", new, text)
    return text


def _parquet_hashes(path: Path, found: dict[str, bool]) -> None:
    try:
        schema = pq.read_schema(path)
    except (OSError, pa.ArrowException):
        return
    if LEGACY_FIELD in schema.names:
        public = "data_source" in schema.names
        table = pq.read_table(path, columns=[LEGACY_FIELD] + (["data_source"] if public else []))
        values = table.column(LEGACY_FIELD).to_pylist()
        sources = table.column("data_source").to_pylist() if public else [None] * len(values)
        for v, s in zip(values, sources):
            if isinstance(v, str) and _SHA256.match(v):
                found[v] = found.get(v, False) or s == "public"


def _rewrite_parquet(path: Path, mapping: dict[str, str]) -> bool:
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException):
        return False
    changed = False
    columns, names = [], []
    for name, column in zip(table.column_names, table.columns):
        if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
            values = column.to_pylist()
            new = [_replace_text(v, mapping) if isinstance(v, str) else v for v in values]
            if new != values:
                column, changed = pa.array(new, type=column.type), True
        if name == LEGACY_FIELD:
            name, changed = "dataset_id", True
        columns.append(column)
        names.append(name)
    metadata = table.schema.metadata
    if metadata:
        fixed = {k: _replace_text(v.decode("utf-8", "replace"), mapping).encode() for k, v in metadata.items()}
        if fixed != metadata:
            metadata, changed = fixed, True
    if changed:
        out = pa.Table.from_arrays(columns, names=names).replace_schema_metadata(metadata)
        atomic_replace(path, lambda tmp: pq.write_table(out, tmp))
    return changed


#: what a plain content hash looks like standing on its own (not inside an id, a path or a name): all 64 hex digits,
#: or an abbreviation of 12-16 (what reports and terminals printed). 32 digits are left alone: a uuid (an entry id)
_HEX_RUN = re.compile(r"(?<![0-9a-zA-Z:_\-/.])(?:[0-9a-f]{64}|[0-9a-f]{12,16})(?![0-9a-zA-Z_\-])")


def _holds(path: Path, mapping: dict[str, str]) -> bool:
    """Whether a file names a dataset by a plain hash: a legacy field, a known hash's prefix, or (a file checked on
    its own, whose hashes were never collected) any bare run of 12+ hex digits."""
    prefixes = [sha[:12] for sha in mapping]
    if path.suffix == ".parquet":
        try:
            table = pq.read_table(path)
        except (OSError, pa.ArrowException):
            return False
        if LEGACY_FIELD in table.column_names:
            return True
        blob = json.dumps(table.to_pylist(), default=str) + str(table.schema.metadata or "")
    else:
        try:
            blob = path.read_text()
        except (OSError, UnicodeDecodeError):
            return False
        if f'"{LEGACY_FIELD}"' in blob:
            return True
    return any(p in blob for p in prefixes) or bool(_HEX_RUN.search(blob))


def migrate(paths, check: bool = False) -> Migration:
    """Rewrite (or, ``check``, only inspect) every file under ``paths`` (module docstring)."""
    roots = [Path(p).expanduser() for p in paths]
    for root in roots:
        if not root.exists():
            raise ConfigError(f"{root} does not exist")
    datasets = _dataset_dirs(roots)

    def private(f: Path) -> bool:
        return any(d == f.parent or d in f.parents for d in datasets)

    found: dict[str, bool] = {}
    for f in _files(roots):
        if private(f):
            continue
        if f.suffix == ".json":
            try:
                _collect(json.loads(f.read_text()), found)
            except (OSError, UnicodeDecodeError, json.JSONDecodeError):
                continue
        elif f.suffix == ".parquet":
            _parquet_hashes(f, found)
    for d in datasets:  # a study's own dataset names the same hash its runs carry
        manifest = json.loads((d / "manifest.json").read_text())
        found.setdefault(manifest["content_sha256"], bool(manifest.get("public")))
    result = Migration(mapping={sha: (public_id(sha) if public else keyed_id(sha, owner_key(create=False)))
                                for sha, public in found.items()} if not check else {sha: "" for sha in found})
    for f in _files(roots):
        if private(f):
            continue
        if check:
            if (f.suffix in TEXT_SUFFIXES or f.suffix == ".parquet") and _holds(f, result.mapping):
                result.remaining.append(f)
            continue
        if f.suffix == ".parquet":
            if _rewrite_parquet(f, result.mapping):
                result.rewritten.append(f)
        elif f.suffix in TEXT_SUFFIXES:
            try:
                text = f.read_text()
            except (OSError, UnicodeDecodeError):
                continue
            if f.suffix == ".json":
                try:
                    data = json.loads(text)
                except json.JSONDecodeError:  # not one JSON document (JSON lines, say): rewritten as text
                    new = _replace_text(text.replace(f'"{LEGACY_FIELD}"', '"dataset_id"'), result.mapping)
                    if new != text:
                        atomic_write(f, new.encode())
                        result.rewritten.append(f)
                    continue
                new = json.dumps(_rewrite_json(data, result.mapping), indent=2)
                if json.loads(new) != data:
                    atomic_write(f, (new + "\n").encode())
                    result.rewritten.append(f)
            else:
                new = _replace_text(text.replace(f'"{LEGACY_FIELD}"', '"dataset_id"'), result.mapping)
                if new != text:
                    atomic_write(f, new.encode())
                    result.rewritten.append(f)
    if not check:
        for manifest_file in sorted(f for root in roots for f in ([root] if root.is_file() else root.rglob(MANIFEST))
                                    if f.name == MANIFEST):
            try:
                policy = json.loads(manifest_file.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            if isinstance(policy, dict) and policy.get("format") in PICKLE_FORMATS:
                convert_policy_module(manifest_file.parent)
                result.policies.append(manifest_file.parent)
        for d in sorted(datasets):
            manifest = json.loads((d / "manifest.json").read_text())
            if manifest.get("dataset_id") is None:
                manifest["dataset_id"] = manifest_id(manifest, None if manifest.get("public")
                                                     else owner_key(create=False))
                atomic_write(d / "manifest.json", (json.dumps(manifest, indent=2) + "\n").encode())
                result.datasets.append(d)
    return result


def _legacy_field(path: Path) -> bool:
    try:
        return f'"{LEGACY_FIELD}"' in path.read_text()
    except (OSError, UnicodeDecodeError):
        return False
