"""Owner-only files and durable writes: the one place raydp decides how a file that may hold private data is
created, replaced and locked.

Everything raydp writes may hold private records or figures computed from them (datasets, run folders, ledgers,
a study's Tune state, its results and report), so what it creates is owner-only from the moment it exists:

- :func:`private_umask` sets the process's umask to 077 around a command's writes (files 0600, folders 0700), so
  files that other libraries create on raydp's behalf (pyarrow, safetensors, Tune, Ray's own processes started
  inside it) are owner-only too, not only raydp's own;
- :func:`atomic_write` replaces a file in one step: a fresh temporary sibling (``mkstemp``: a unique name, mode
  0600), fsync, rename, fsync of the folder. A crash leaves either the previous file whole or the new one, never a
  truncated file, and two writers never share a temporary name;
- :func:`atomic_create` creates a file that must never be replaced once it exists (a key): written to a fresh
  temporary sibling, fsynced, then hard-linked into place, so that of two creators the first wins whole;
- :func:`locked` holds an exclusive ``flock`` on a lock file (0600) for a read-modify-write;
- :func:`private_dir` creates a folder 0700 (every level it creates), or checks that an existing one is the
  caller's and owner-only: a predictable name in a shared place such as /tmp must not be a folder another user
  made first; and that no folder above it lets another user swap it (:func:`check_ancestors`).

A umask is the process's, not a thread's: :func:`private_umask` only ever tightens it (077 is or-ed into the
current mask), so a thread writing meanwhile gets a stricter mode, never a looser one.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import stat
import tempfile
from pathlib import Path

from raydp.errors import ConfigError

#: group and other bits: none is set on anything raydp writes that may hold private data
GROUP_OTHER = 0o077
#: a private file's mode
PRIVATE_FILE = 0o600
#: a private folder's mode
PRIVATE_DIR = 0o700


@contextlib.contextmanager
def private_umask():
    """Within the block, files and folders are created without group or other bits (the previous mask is
    restored after it; nested blocks restore in order)."""
    previous = os.umask(GROUP_OTHER)
    os.umask(previous | GROUP_OTHER)
    try:
        yield
    finally:
        os.umask(previous)


def owner_only(function):
    """Decorate a command that writes private data: it runs inside :func:`private_umask`."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        with private_umask():
            return function(*args, **kwargs)

    return wrapper


def tighten_umask() -> None:
    """Make the rest of this process's writes owner-only (a trial's worker process, which Ray may have started
    with a looser mask; never loosened back)."""
    os.umask(os.umask(GROUP_OTHER) | GROUP_OTHER)


def atomic_write(path: str | os.PathLike, data: bytes | str, mode: int = PRIVATE_FILE, fsync: bool = True) -> Path:
    """Replace ``path`` with ``data`` (text is written as UTF-8) in one rename; its mode is ``mode`` (owner-only
    unless a caller passes a wider one for a file that holds nothing private). Creates the parent folder (0700) if
    needed. On any failure the temporary file is removed and the previous file stays as it was."""
    payload = data.encode("utf-8") if isinstance(data, str) else data
    return atomic_replace(path, lambda tmp: Path(tmp).write_bytes(payload), mode=mode, fsync=fsync)


def atomic_replace(path: str | os.PathLike, write, mode: int = PRIVATE_FILE, fsync: bool = True) -> Path:
    """Like :func:`atomic_write` for a writer that takes a path (e.g. ``pyarrow.parquet.write_table``): ``write``
    is called with a fresh temporary sibling's path (``mkstemp``: a unique name, 0600), which then replaces
    ``path`` after an fsync; the folder is synced after the rename."""
    path = Path(path)
    if not path.parent.is_dir():
        private_dir(path.parent, check=False)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    os.close(fd)
    try:
        with private_umask():
            write(tmp)
        if fsync:
            with open(tmp, "rb") as handle:
                os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if fsync:
        _fsync_dir(path.parent)
    return path


def atomic_create(path: str | os.PathLike, data: bytes | str, mode: int = PRIVATE_FILE) -> bool:
    """Create ``path`` holding ``data`` unless it exists, in one step: a reader never sees it partly written, and
    when two processes create it at once the first one's file stays (``link`` refuses an existing name, where a
    rename would replace it). Returns whether this call created it. Creates the parent folder (0700) if needed."""
    path = Path(path)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    if not path.parent.is_dir():
        private_dir(path.parent, check=False)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
    finally:
        Path(tmp).unlink(missing_ok=True)
    _fsync_dir(path.parent)
    return True


def _fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (a folder's entries are written when the folder is synced)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on a folder: the rename itself still happened
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def locked(path: str | os.PathLike, blocking: bool = True):
    """Hold an exclusive ``flock`` on ``path`` (created 0600 if missing) for the block; with ``blocking=False``
    raise ``BlockingIOError`` at once if another process holds it. The lock goes with the process, so a crash
    never leaves a stale lock."""
    path = Path(path)
    if not path.parent.is_dir():
        private_dir(path.parent, check=False)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, PRIVATE_FILE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def private_dir(path: str | os.PathLike, check: bool = True) -> Path:
    """Create ``path`` and every missing parent owner-only (0700); with ``check``, also refuse (one line) an existing
    ``path`` that is a link, another user's or open to group or others, and tighten one of ours that is open (a
    folder another local user could enter may already have been read: the message says so)."""
    path = Path(path)
    if check:  # before anything is created under a place another user controls
        check_ancestors(path)  # the folders that exist already, up to /
    with private_umask():
        path.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR)
    if not check:
        return path
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"{path} must be a folder, not a link: refusing to write private data through it")
    if info.st_uid != os.getuid():
        raise ConfigError(f"{path} belongs to another user (uid {info.st_uid}): refusing to write private data in it")
    if info.st_mode & GROUP_OTHER:
        os.chmod(path, PRIVATE_DIR)
    return path


def check_ancestors(path: str | os.PathLike) -> None:
    """Refuse (one line) a place where another local user could swap a private folder for one of theirs, or read
    what is written there: every existing folder from ``path`` up to ``/`` (links resolved) must belong to this user
    or root, and none may be writable by group or others unless it is sticky (as /tmp is: there only an entry's
    owner may rename it). OpenSSH's StrictModes rule for a key's folders. A folder writable by others lets them
    rename a study folder away while it runs and put their own in its place, which the study then fills."""
    path = Path(path).resolve()
    for folder in (path, *path.parents):
        try:
            info = os.stat(folder)
        except FileNotFoundError:
            continue
        if info.st_uid not in (os.getuid(), 0):
            raise ConfigError(f"{folder} belongs to another user (uid {info.st_uid}), who could replace what raydp "
                              f"writes below it: use a folder of your own for private data")
        if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
            raise ConfigError(f"{folder} is writable by group or others (mode {stat.S_IMODE(info.st_mode):04o}): "
                              f"another local user could swap the private folders below it for theirs; use an "
                              f"owner-only location, or chmod go-w {folder}")


def user_scratch(*parts: str) -> Path:
    """An owner-only folder of this user's under the system's temporary folder (``$TMPDIR/raydp-<uid>/...``):
    the name is predictable (every trial on a node finds the same one), so it is checked to be the user's own and
    owner-only before anything private goes in (:func:`private_dir`)."""
    base = private_dir(Path(tempfile.gettempdir()) / f"raydp-{os.getuid()}")
    return private_dir(base.joinpath(*parts)) if parts else base


def open_to_others(root: str | os.PathLike) -> list[Path]:
    """Every path at or under ``root`` (links not followed) with a group or other permission bit: what another local
    user could read, list or enter if they can reach it."""
    found = []
    for folder, dirs, names in os.walk(root):
        for name in [None, *dirs, *names]:
            entry = Path(folder) if name is None else Path(folder, name)
            try:
                mode = os.lstat(entry).st_mode
            except FileNotFoundError:
                continue
            if not stat.S_ISLNK(mode) and mode & GROUP_OTHER:
                found.append(entry)
    return sorted(set(found))
