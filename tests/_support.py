"""Helpers the tests share that are not fixtures: the session's small dataset is built once (tests/conftest.py,
``small_dataset``) and only read; a test that changes a dataset (a lifetime budget written into its manifest)
works on its own copy."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

#: the session's small dataset: synthetic records, raydp.data.splits.build_dataset's defaults otherwise
SMALL_DATASET_RECORDS = 400


def copy_dataset(dataset: Path, to: Path) -> Path:
    """A private copy of a dataset directory (its files owner-only, as built), for a test that changes it."""
    shutil.copytree(dataset, to, copy_function=shutil.copy2)
    return to


def tree_digest(root: Path) -> str:
    """A digest of every file under ``root`` (path and content): whether a shared dataset was changed."""
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()
