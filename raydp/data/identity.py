"""A dataset's identity: a keyed hash that only its owner can compute.

Runs on the same private records must compose (the study's tuning-aware epsilon, ``raydp report A B``, a
saved policy's provenance: ERRATA E7/E14), so every released file names the dataset it was trained on. A
plain hash of the records cannot be that name: anyone who knows every record but one recomputes the hash
for each candidate value of the last one and learns it with certainty, whatever epsilon the run claims
(add/remove-one and replace-one alike). The name is therefore a keyed hash,

    dataset_id = "rdi1:" + HMAC-SHA256(owner_key, "raydp dataset id v1" || content_sha256)[:32 hex]

(RFC 2104; HMAC-SHA256 is a pseudorandom function of its message under a secret key, Bellare 2006), where
``content_sha256`` is the SHA-256 of the split texts (:func:`raydp.data.splits.texts_sha256`, kept only in
the dataset's own manifest, which is private) and ``owner_key`` is 32 random bytes created once on the data
owner's machine and stored outside every releasable file. The same records under the same key give the same
id, so runs compose; without the key nobody can test a candidate dataset against an id. What the id is
for, and what it is not for:

* it matches runs, studies and policy provenance on the same dataset for its owner; it says nothing about
  the records to anyone else (a random-looking 128-bit tag);
* it does not match the same people under different contents (another size or cap of one CSV): those are
  different ids, as they were different hashes (the report says so);
* it does not survive a lost key: runs made under a new key no longer match older ones, and their spend
  would no longer be composed. Keep the key with the data (back it up; copy it to every machine that builds
  datasets for the same owner, e.g. a cluster's head node, with ``RAYDP_OWNER_KEY``). A key is created only when
  a dataset is built; reading or migrating old files needs the existing one;
* it is a function of the content: two releases with the same id were trained on the same records (an unchanged
  id across periodic retrains says nobody joined or left), and a dataset one patient larger has another id
  (its runs are not recognised as the same people's: compose them yourself).

The key lives at ``$RAYDP_OWNER_KEY`` if set (a file path), else ``~/.config/raydp/owner.key``; it is
created (mode 0600) the first time a private dataset is identified. Public data (``source: public``, the
public synthetic population) needs no secret: its id is ``"public:" + content_sha256``, which anyone may
recompute (the records are public).

Manifests and run summaries written before ids existed carry the plain ``content_sha256`` (field
``dataset_sha256``); :func:`identity_of` converts such a value for its owner, and ``raydp migrate`` rewrites
old files so that no plain hash stays in a releasable file (old and new runs on the same data still
compose, because the id is computed from the same content hash).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from pathlib import Path

from raydp.errors import DataError
from raydp.files import atomic_create, private_dir

ID_VERSION = "rdi1"
PUBLIC_PREFIX = "public:"
KEY_ENV = "RAYDP_OWNER_KEY"
_DOMAIN = b"raydp dataset id v1\0"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_KEY = re.compile(r"^[0-9a-f]{64}$")
_ID = re.compile(r"^(rdi1:[0-9a-f]{32}|public:[0-9a-f]{64})$")


def owner_key_path() -> Path:
    """Where the owner's key is: ``$RAYDP_OWNER_KEY``, else ``~/.config/raydp/owner.key``."""
    configured = os.environ.get(KEY_ENV)
    if configured:
        return Path(configured).expanduser()
    base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config").expanduser()
    return base / "raydp" / "owner.key"


def owner_key(create: bool = True) -> bytes:
    """The owner's 32-byte key, created (0600, atomically: two processes that race both read the winner's)
    on first use when ``create``. A DataError (one line) if it cannot be read or is malformed."""
    path = owner_key_path()
    if not path.exists():
        if not create:
            raise DataError(f"no dataset owner key at {path}: old files name their datasets by hashes that only the "
                            f"owner's key turns into ids (set {KEY_ENV} to the owner's key file)")
        _create_key(path)
    try:
        info = path.stat()
        if info.st_mode & 0o077 or (hasattr(os, "getuid") and info.st_uid != os.getuid()):
            raise DataError(f"dataset owner key {path} must be owned by this user and readable by nobody else "
                            f"(chmod 600 {path})")
        text = path.read_text().strip()
    except OSError as exc:
        raise DataError(f"cannot read the dataset owner key {path}: {exc.strerror or exc}") from None
    if not _KEY.match(text):
        raise DataError(f"dataset owner key {path} is malformed (expected 64 hex digits)")
    return bytes.fromhex(text)


def _create_key(path: Path) -> None:
    try:
        private_dir(path.parent, check=False)  # a folder it makes is owner-only whatever the caller's umask
        atomic_create(path, secrets.token_hex(32) + "\n")  # if another process created the key first, theirs wins
    except OSError as exc:
        raise DataError(f"cannot create the dataset owner key {path}: {exc.strerror or exc}") from None


def keyed_id(content_sha256: str, key: bytes | None = None) -> str:
    """The id of private data whose split texts hash to ``content_sha256`` (module docstring)."""
    if not isinstance(content_sha256, str) or not _SHA256.match(content_sha256):
        raise DataError(f"not a content hash: {str(content_sha256)[:80]!r}")
    mac = hmac.new(owner_key() if key is None else key, _DOMAIN + content_sha256.encode(), hashlib.sha256)
    return f"{ID_VERSION}:{mac.hexdigest()[:32]}"


def public_id(content_sha256: str) -> str:
    """The id of public data: its plain content hash, which anyone may recompute."""
    return PUBLIC_PREFIX + content_sha256


def is_dataset_id(value) -> bool:
    """Whether ``value`` is an id in this format (``rdi1:`` and 32 hex digits, or ``public:`` and a 64-digit hash),
    as opposed to a plain hash or anything else."""
    return isinstance(value, str) and bool(_ID.match(value))


def manifest_id(manifest: dict, key: bytes | None = None) -> str | None:
    """A dataset manifest's id: its ``dataset_id`` (written since ids exist), else computed from its private
    ``content_sha256`` (a directory built before them); None if it has neither."""
    if is_dataset_id(manifest.get("dataset_id")):
        return manifest["dataset_id"]
    sha = manifest.get("content_sha256")
    if not sha:
        return None
    return public_id(sha) if manifest.get("public") else keyed_id(sha, key)


def identity_of(record: dict, key: bytes | None = None) -> str | None:
    """The dataset id a released record names: ``dataset_id``, or a legacy ``dataset_sha256`` (a plain content
    hash, written before ids existed) converted with the owner's key (``public_data`` ones stay public)."""
    if record.get("dataset_id") is not None:
        return record["dataset_id"]
    legacy = record.get("dataset_sha256")
    if legacy is None:
        return None
    if is_dataset_id(legacy) or not _SHA256.match(str(legacy)):
        return str(legacy)  # already an id, or a path-like fallback (``unhashed:...``)
    public = record.get("public_data") or record.get("data_source") == "public"
    # reading an old file never creates a key: a new key would give ids that match nothing the owner made
    return public_id(legacy) if public else keyed_id(legacy, key if key is not None else owner_key(create=False))


def frame_ids(frame):
    """The dataset id of each row of a results table (``dataset_id``; an old table's ``dataset_sha256``
    converted as :func:`identity_of` does). A pandas Series, empty if the table names no dataset."""
    import pandas as pd

    if "dataset_id" in frame:
        return frame["dataset_id"]
    if "dataset_sha256" in frame:
        return frame["dataset_sha256"].map(lambda v: identity_of({"dataset_sha256": v}) if isinstance(v, str) else None)
    return pd.Series([None] * len(frame), index=frame.index, dtype=object)
