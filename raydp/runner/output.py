"""Run output directories that appear only when complete.

A run writes into a hidden staging directory beside the requested output and renames it into place at
the end; on any failure the staging directory is removed, so bad input or a crash never leaves a
half-written output behind.
"""

from __future__ import annotations

import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from raydp.errors import ConfigError
from raydp.files import check_ancestors


def check_output_dir(output: Path, overwrite: bool) -> None:
    """Refuse an existing non-empty output (unless ``overwrite``) or a path that is not a directory."""
    if output.exists() and not output.is_dir():
        raise ConfigError(f"output {output} exists and is not a directory")
    if output.exists() and any(output.iterdir()) and not overwrite:
        raise ConfigError(f"output directory {output} exists and is not empty (pass --overwrite to replace it)")


@contextmanager
def staged_output(output: str | Path, overwrite: bool = False):
    """Yield a staging directory; on success it replaces ``output``, on failure it is deleted."""
    output = Path(output).expanduser().absolute()
    check_output_dir(output, overwrite)
    check_ancestors(output.parent)  # no other user can swap the run's folder for theirs (before anything is made)
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.partial-", dir=output.parent))
    except OSError as exc:
        raise ConfigError(f"cannot write output directory {output}: {exc.strerror}") from None
    try:
        yield staging
        if output.exists():
            shutil.rmtree(output)
        staging.rename(output)  # a directory publish (the whole run at once), not a file write: not atomic_write
    finally:
        shutil.rmtree(staging, ignore_errors=True)
