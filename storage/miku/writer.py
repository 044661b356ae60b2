"""Saving a session file atomically, and clearing what killed saves left behind.

The encoded bytes (:mod:`storage.miku.encode`) go to a temporary file in the
target's directory, which is fsynced, renamed over the target and the
directory fsynced, so a crash or a full disk leaves the old file or the new
one, never a mix; an OS error becomes one :class:`StorageError` that says
what to do. Temporary files a killed save could not remove are removed here
too, by name and age.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import tempfile
import time
from pathlib import Path

from isagi.errors import StorageError
from isagi.storage.miku.encode import _encode_parts
from isagi.storage.miku.frame import DEFAULT_CHECKSUM
from isagi.storage.miku.state import MikuState

_WRITE_CHUNK = 8 * 1024**2


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view[:_WRITE_CHUNK])
        if written <= 0:  # pragma: no cover - os.write raises instead
            raise OSError(errno.EIO, "write returned no progress")
        view = view[written:]


def write_miku(
    path: str | os.PathLike[str], state: MikuState, *, checksum: str = DEFAULT_CHECKSUM
) -> None:
    """Save ``state`` to ``path`` atomically.

    The bytes go to a temporary file ``.NAME.XXXX.tmp`` in the same
    directory, which is fsynced and then renamed over ``path`` (and the
    directory fsynced), so a crash or a full disk at any moment leaves either
    the old file or the new one, never a mix. On an OS error the temporary
    file is removed, the old file is untouched, and :class:`StorageError`
    says what happened. A save that is killed cannot remove its temporary
    file: the next save of the same ``path`` removes those left for a minute
    or more, and :func:`remove_stale_temp_files` removes all of a directory's
    (for a server at start).
    """
    path = Path(path)
    parts = _encode_parts(state, checksum)
    parent = path.parent if str(path.parent) else Path(".")
    tmp: str | None = None
    try:
        parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temp_files(parent, older_than_s=60.0, name=path.name)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent)
        try:
            with contextlib.suppress(OSError):
                os.fchmod(fd, path.stat().st_mode & 0o777 if path.exists() else 0o600)
            for part in parts:
                _write_all(fd, part)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        tmp = None
        _fsync_dir(parent)
    except OSError as exc:
        hint = ""
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            hint = " The disk is full: free some space and save again."
        elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            hint = " Check that the directory is writable."
        raise StorageError(
            f"Could not save the session to {path}: {exc.strerror or exc}.{hint} "
            "The previous file (if any) is unchanged."
        ) from exc
    finally:
        if tmp is not None:  # failed or interrupted before the rename
            with contextlib.suppress(OSError):
                os.unlink(tmp)


_STALE_TEMP = re.compile(r"\..+\.miku\.[A-Za-z0-9_]+\.tmp")


def remove_stale_temp_files(
    directory: str | os.PathLike[str], *, older_than_s: float = 60.0, name: str | None = None
) -> list[Path]:
    """Remove what killed saves left in ``directory``; return the removed paths.

    Only files named as :func:`write_miku` names its temporary files
    (``.NAME.miku.XXXX.tmp``, of the file ``name`` only when given) and
    unchanged for ``older_than_s`` seconds (a save takes well under a second,
    so one in progress elsewhere is left alone) are removed; a directory that
    does not exist has none.
    """
    removed: list[Path] = []
    now = time.time()
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return removed
    except OSError as exc:
        raise StorageError(f"Could not list {directory}: {exc.strerror or exc}") from exc
    for entry in entries:
        if not _STALE_TEMP.fullmatch(entry.name) or not entry.is_file(follow_symlinks=False):
            continue
        if name is not None and not entry.name.startswith(f".{name}."):
            continue
        with contextlib.suppress(OSError):
            if now - entry.stat(follow_symlinks=False).st_mtime >= older_than_s:
                os.unlink(entry.path)
                removed.append(Path(entry.path))
    return removed


def _fsync_dir(directory: Path) -> None:
    try:
        dfd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # pragma: no cover - e.g. platforms without directory fds
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(dfd)
    finally:
        os.close(dfd)

