"""Where a session's file lives: the one owner of the ``<id>.miku`` path in the sessions folder.

Every part that names, finds, lists or removes a session's autosave asks a
:class:`SessionFiles` for the sessions folder: the engine when it makes a session, the web
registry when it reopens one, the page and the API when they serve a file, ``isagi sessions
delete`` and the page's Delete, and the start-up repair of the history. What a file *holds*
is :mod:`isagi.session.files`.

Paths recorded elsewhere (a history row's ``miku_path``) are never followed out of the
folder: a candidate counts only when it resolves to a ``.miku`` file directly inside it.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

from isagi.ids import is_session_id

if TYPE_CHECKING:
    from isagi.storage.fences import Fence
    from isagi.storage.miku import MikuState

SUFFIX = ".miku"


class SessionFiles:
    """The sessions folder (``Settings.sessions_dir``) and the rules for the files in it: the
    directory implementation of :class:`isagi.session.store.SessionStore` (the default)."""

    shared = False  # one process owns the folder (the data directory's flock): no leases

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def path(self, session_id: str) -> Path:
        """Where the session ``session_id`` autosaves: a file directly in the folder (an id from
        outside is checked against the server's pattern where it enters, :mod:`isagi.ids`)."""
        if not session_id or session_id in (".", "..") or any(c in session_id for c in "/\\\0"):
            raise ValueError(f"a session id names a file in the sessions folder, not {session_id!r}")
        return self.root / f"{session_id}{SUFFIX}"

    def _inside(self, candidate: str | os.PathLike[str]) -> Path | None:
        """``candidate`` resolved, when it is a ``.miku`` directly inside the folder."""
        root = self.root.resolve()
        p = Path(candidate)
        p = p if p.is_absolute() else root / p
        with contextlib.suppress(OSError, RuntimeError):
            real = p.resolve()
            if real.parent == root and real.suffix == SUFFIX:
                return real
        return None

    def _candidates(self, session_id: str, recorded: str | os.PathLike[str] | None) -> list[Path]:
        found: list[Path] = []
        for cand in (recorded, f"{session_id}{SUFFIX}" if is_session_id(session_id) else None):
            real = self._inside(cand) if cand else None
            if real is not None and real not in found:
                found.append(real)
        return found

    def find(self, session_id: str, recorded: str | os.PathLike[str] | None = None) -> Path | None:
        """The session's file inside the folder (its recorded path first, then ``<id>.miku``), or None."""
        return next((p for p in self._candidates(session_id, recorded) if p.is_file()), None)

    def remove(self, session_id: str, recorded: str | os.PathLike[str] | None = None, *,
               fence: Fence | None = None) -> list[Path]:
        """Remove a deleted session's file(s) inside the folder; the paths removed. ``fence`` is
        not used: one process owns the directory (there are no leases)."""
        removed: list[Path] = []
        for real in self._candidates(session_id, recorded):
            with contextlib.suppress(FileNotFoundError):
                real.unlink()
                removed.append(real)
        return removed

    def all(self) -> list[Path]:
        """Every session file in the folder (named by a session id, and a file there, not a link
        out of it), in name order."""
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.glob(f"*{SUFFIX}")
                      if is_session_id(p.stem) and self._inside(p) is not None and p.is_file())

    # -- the bytes (the same for every path, in the folder or not: a download, ``--save``) ----
    def read(self, path: str | os.PathLike[str], *, expected_fingerprint: str | None = None,
             allow_other_model: bool = False) -> MikuState:
        """The file at ``path``, read and checked (:func:`storage.miku.read_miku`)."""
        from isagi.storage.miku import read_miku

        return read_miku(path, expected_fingerprint=expected_fingerprint, allow_other_model=allow_other_model)

    def write(self, path: str | os.PathLike[str], state: MikuState, *, fence: Fence | None = None) -> None:
        """Save ``state`` at ``path`` atomically (:func:`storage.miku.write_miku`), its folder made
        first. ``fence`` is not used: one process owns the directory (there are no leases)."""
        from isagi.storage.miku import write_miku

        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_miku(path, state)

    def read_bytes(self, path: str | os.PathLike[str]) -> bytes:
        """The file's bytes as they are (a download of the saved file)."""
        return Path(path).read_bytes()

    def modified(self, path: str | os.PathLike[str]) -> float | None:
        """When the file was last written (seconds since 1970), None when there is none."""
        try:
            return Path(path).stat().st_mtime
        except OSError:
            return None
