"""Where session files live: the one seam between the app and a session's ``.miku`` bytes.

:class:`SessionStore` is what every reader and writer of session files asks (the registry's
autosave and resume, the engine's keeper through :attr:`Session.files`, ``isagi sessions``,
export, resume, upload, rename, prune, and the start-up repair). Two implementations:

- :class:`isagi.session.folder.SessionFiles`: the sessions directory under ``ISAGI_HOME``
  (the default, one process: the data directory's flock keeps out a second);
- :class:`isagi.session.dbstore.DatabaseSessionFiles`: a table in PostgreSQL
  (``ISAGI_SESSIONS_URL``) that several replicas share; each live session is then leased to
  one process (:mod:`isagi.session.lease`).

Both name a session's file by a path directly inside the sessions folder (``<id>.miku``), so
what the history records (``miku_path``) means the same on both; a path outside the folder
(a download, ``isagi chat --save``) is always a local file.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from isagi.config import Settings
    from isagi.storage.fences import Fence
    from isagi.storage.miku import MikuState


class SessionStore(Protocol):
    """The session files of a server: where each lives, and their bytes."""

    root: Path
    shared: bool  # True: other processes use the same store (live sessions need a lease)

    def path(self, session_id: str) -> Path: ...
    def find(self, session_id: str, recorded: str | os.PathLike[str] | None = None) -> Path | None: ...
    # fence: the remover's lease of the session (a shared store removes only while it is current)
    def remove(self, session_id: str, recorded: str | os.PathLike[str] | None = None, *,
               fence: Fence | None = None) -> list[Path]: ...
    def all(self) -> list[Path]: ...
    def read(self, path: str | os.PathLike[str], *, expected_fingerprint: str | None = None,
             allow_other_model: bool = False) -> MikuState: ...
    # fence: the writer's lease of the session (a shared store writes only while it is current)
    def write(self, path: str | os.PathLike[str], state: MikuState, *, fence: Fence | None = None) -> None: ...
    def read_bytes(self, path: str | os.PathLike[str]) -> bytes: ...
    def modified(self, path: str | os.PathLike[str]) -> float | None: ...


_shared: dict[tuple[str, str], SessionStore] = {}
_shared_guard = threading.Lock()


def session_files(settings: Settings) -> SessionStore:
    """The store ``settings`` name: the sessions directory, or (``sessions_url``) the database,
    opened once per process and URL (its connection pool is shared)."""
    from isagi.session.folder import SessionFiles

    if not settings.sessions_url:
        return SessionFiles(settings.sessions_dir)
    key = (settings.sessions_url, str(settings.sessions_dir))
    with _shared_guard:
        store = _shared.get(key)
        if store is None:
            from isagi.session.dbstore import DatabaseSessionFiles

            store = _shared[key] = DatabaseSessionFiles(settings.sessions_url, settings.sessions_dir)
        return store
