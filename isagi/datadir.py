"""The data directory at start: writable, one start-up at a time, left consistent.

Owns what a process that writes sessions (``isagi web``, ``isagi chat``) does
to ``ISAGI_HOME`` before its first write, in :func:`open_data_dir`:

1. :func:`check_writable`: the data directory and its ``sessions/`` can be
   created and written (a file is written, synced and removed in each), else
   one :class:`~isagi.errors.DataDirError` line says why (read-only, full, no
   permission), so ``isagi web`` exits at once instead of serving a page that
   cannot keep anything.
2. :class:`DataDir`: an advisory lock (``flock``) on ``$ISAGI_HOME/.lock``.
   Every such process holds it shared while it runs; a starting one first asks
   for it exclusively. Only if it gets it (no other ISAGI process is writing
   there, so no save is in progress) does it remove *every* temporary file a
   killed save left in ``sessions/`` and repair the history from the session
   files (:func:`isagi.pipeline.keeping.reconcile_history`); otherwise it removes only
   temporary files untouched for a minute and leaves the repair to a later
   start. Then it holds the lock shared until :meth:`DataDir.close`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from isagi.config import Settings
from isagi.errors import DataDirError, StorageError, storage_cause

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no lock, so never "alone"
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"
SHARED_WAIT_S = 30.0  # how long a start waits for another process's start-up check to end


def check_writable(settings: Settings) -> None:
    """Raise :class:`DataDirError` (one line, what to do) unless the data directory and its
    ``sessions/`` directory can be created and written."""
    for directory in (settings.home, settings.sessions_dir):
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".write-check.", dir=directory)
            try:
                os.write(fd, b"isagi")
                os.fsync(fd)
            finally:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(probe)
        except OSError as exc:
            cause = storage_cause(exc)
            fix = ("free some space" if cause == "the disk is full"
                   else "make it writable, or point ISAGI_HOME (--home) at a writable directory")
            raise DataDirError(
                f"cannot write to the data directory {directory} ({exc.strerror or exc}): {fix}."
            ) from None


@dataclass
class DataDir:
    """A data directory this process writes: the lock it holds and what the start-up did."""

    settings: Settings
    alone: bool = False  # no other ISAGI process wrote here when this one started
    removed: list[Path] = field(default_factory=list)  # temporary files of killed saves
    repair: Any = None  # isagi.pipeline.keeping.Reconciled, when the check ran
    _file: IO[bytes] | None = None

    def lines(self) -> list[str]:
        """What the start-up did, one line each, for the log and the terminal."""
        out = []
        if self.removed:
            out.append(f"start-up check: removed {len(self.removed)} temporary file(s) of interrupted saves")
        if not self.alone:
            out.append("start-up check: another ISAGI process uses this data directory; the history was not "
                       "checked against the session files (the next start alone checks it)")
        if self.repair is not None:
            out.extend(self.repair.lines())
        return out

    def close(self) -> None:
        """Release the lock (at shutdown)."""
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None


def _lock(path: Path) -> tuple[IO[bytes] | None, bool]:
    """Open the lock file and take the lock: (file, alone). Exclusive if free (alone),
    else shared, waiting for another process's start-up to end."""
    if fcntl is None:
        return None, False
    try:
        f = open(path, "ab")  # noqa: SIM115 - held for the process's life, closed by DataDir.close
    except OSError as exc:
        raise DataDirError(f"cannot open the lock file {path} ({exc.strerror or exc}).") from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return f, True
    except OSError:
        pass
    deadline = time.monotonic() + SHARED_WAIT_S
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return f, False
        except OSError:
            if time.monotonic() > deadline:
                log.warning("the data directory's lock stayed taken for %.0f s; going on without it", SHARED_WAIT_S)
                return f, False
            time.sleep(0.1)


@contextlib.contextmanager
def no_other_process(settings: Settings, doing: str,
                     instead: str = "let the server do it (ISAGI_SESSION_RETENTION)") -> Iterator[None]:
    """Hold the data directory's lock exclusively while ``doing`` (a command that must not run
    beside a server, e.g. removing sessions it may have open); a :class:`DataDirError` saying
    to stop the other process, or to do ``instead``, when one holds it."""
    if fcntl is None:
        yield
        return
    settings.home.mkdir(parents=True, exist_ok=True)
    with open(settings.home / LOCK_NAME, "ab") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise DataDirError(f"another ISAGI process (a server or a chat) is using {settings.home}; stop it "
                               f"before {doing}, or {instead}.") from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def open_data_dir(settings: Settings, *, repair: bool = True) -> DataDir:
    """Check, lock and tidy the data directory before this process writes to it.

    ``repair``: check the history against the session files (only when alone;
    opens the history store of ``settings``). Raises :class:`DataDirError` when
    the directory cannot be written. The caller logs or prints :meth:`DataDir.lines`.
    """
    from isagi.storage.miku import remove_stale_temp_files

    check_writable(settings)
    f, alone = _lock(settings.home / LOCK_NAME)
    data = DataDir(settings, alone=alone, _file=f)
    try:
        # Alone, no save is in progress: every temporary file is a killed save's.
        older = float("-inf") if alone else 60.0
        with contextlib.suppress(StorageError):
            data.removed = remove_stale_temp_files(settings.sessions_dir, older_than_s=older)
        if alone and repair:
            data.repair = _reconcile(settings)
        if alone and f is not None:
            fcntl.flock(f, fcntl.LOCK_SH)  # from now on others may start beside this one
    except BaseException:
        data.close()
        raise
    return data


def _reconcile(settings: Settings) -> Any:
    """The history repaired from the session files; a history that cannot be opened is
    reported (the engine's own start reports it too) and skipped."""
    from isagi.pipeline.keeping import Reconciled, reconcile_history
    from isagi.session.store import session_files
    from isagi.storage.history import HistoryStore

    try:
        files = session_files(settings)
        if not files.all():
            return None
    except StorageError as exc:  # the shared store is away: the server's own start says so too
        report = Reconciled()
        report.skipped["the session store"] = f"could not be read ({exc})"
        return report
    try:
        store = HistoryStore(settings.resolved_database_url)
    except StorageError as exc:
        report = Reconciled()
        report.skipped["the history"] = f"could not be opened ({exc})"
        return report
    try:
        return reconcile_history(store, settings.sessions_dir, files=files)
    finally:
        store.close()
