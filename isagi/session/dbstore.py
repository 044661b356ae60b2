"""Session files in PostgreSQL: the :class:`~isagi.session.store.SessionStore` that replicas share.

Each ``.miku`` file of the sessions folder is one row of ``session_files`` (its name and its
whole bytes, :class:`storage.history.SessionFileModel`, made by the history's Alembic
revision 0003). A save replaces the row in one transaction (an upsert), so a reader sees the
old bytes or the new ones, never a mix, as the directory's write-and-rename gives. A live
session's save carries its lease's fence (:mod:`storage.fences`), checked in that transaction:
a process that lost the session's lease to another writes nothing more of it. A removal (a
delete, a retention pass) carries the fence of the lease its remover holds meanwhile, checked
the same way, so it never removes a file that another process has taken over and saves. The names
and the rules are the folder's (:class:`~isagi.session.folder.SessionFiles`): only a path
directly inside the sessions folder is kept here; any other path (a download, ``isagi chat
--save``) is a local file, written as the folder writes one.
"""

from __future__ import annotations

import datetime as _dt
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from isagi.errors import MikuError, StorageError
from isagi.ids import is_session_id
from isagi.session.folder import SUFFIX, SessionFiles

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from isagi.storage.fences import Fence
    from isagi.storage.miku import MikuState

NAME_MAX = 80  # session_files.name


class DatabaseSessionFiles:
    """The sessions folder kept in a PostgreSQL table (``ISAGI_SESSIONS_URL``)."""

    shared = True  # every replica reaches it: a live session is leased (isagi.session.lease)

    def __init__(self, url: str, root: str | os.PathLike[str]) -> None:
        import sqlalchemy as sa
        from sqlalchemy.exc import SQLAlchemyError

        from isagi.storage.migrations import upgrade_to_head

        self.root = Path(root)
        self._local = SessionFiles(root)
        self.url = url
        try:
            self.engine: Engine = sa.create_engine(url, pool_pre_ping=True, future=True)
            with self.engine.begin() as conn:
                upgrade_to_head(conn)  # behind the migrations' lock: replicas starting together wait
        except (ImportError, SQLAlchemyError) as exc:
            reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
            raise StorageError(
                f"Cannot open the session store (ISAGI_SESSIONS_URL): {reason}. Check that the "
                "PostgreSQL server is running and the URL is right, or unset ISAGI_SESSIONS_URL to "
                "keep sessions in the local sessions directory."
            ) from None

    # -- names -----------------------------------------------------------------------------
    def _name(self, path: str | os.PathLike[str] | None) -> str | None:
        """The row name of ``path`` when it is a ``.miku`` directly inside the folder, else None."""
        if path is None or str(path) == "":
            return None
        p = Path(path)
        p = p if p.is_absolute() else self.root / p
        if p.suffix != SUFFIX or len(p.name) > NAME_MAX or p.name.startswith("."):
            return None
        if Path(os.path.abspath(p)).parent != Path(os.path.abspath(self.root)):
            return None
        return p.name

    def _candidates(self, session_id: str, recorded: str | os.PathLike[str] | None) -> list[str]:
        found: list[str] = []
        for cand in (self._name(recorded), f"{session_id}{SUFFIX}" if is_session_id(session_id) else None):
            if cand is not None and cand not in found:
                found.append(cand)
        return found

    def path(self, session_id: str) -> Path:
        return self._local.path(session_id)

    # -- the table -------------------------------------------------------------------------
    def _error(self, what: str, exc: Exception) -> StorageError:
        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        return StorageError(f"Could not {what} in the session store: {reason}. Check that the PostgreSQL "
                            "server (ISAGI_SESSIONS_URL) is reachable, then try again.")

    def _existing(self, names: list[str]) -> set[str]:
        import sqlalchemy as sa
        from sqlalchemy.exc import SQLAlchemyError

        from isagi.storage.history import SessionFileModel

        if not names:
            return set()
        try:
            with self.engine.connect() as conn:
                rows = conn.execute(sa.select(SessionFileModel.name).where(SessionFileModel.name.in_(names)))
                return {r[0] for r in rows}
        except SQLAlchemyError as exc:
            raise self._error("look up a session", exc) from None

    def find(self, session_id: str, recorded: str | os.PathLike[str] | None = None) -> Path | None:
        """The session's file (its recorded name first, then ``<id>.miku``), or None."""
        names = self._candidates(session_id, recorded)
        there = self._existing(names)
        return next((self.root / n for n in names if n in there), None)

    def remove(self, session_id: str, recorded: str | os.PathLike[str] | None = None, *,
               fence: Fence | None = None) -> list[Path]:
        """Remove a deleted session's file(s); the paths removed. ``fence``: the remover's lease of
        the session, checked in the delete's own transaction (:class:`~isagi.errors.SessionMoved`
        once another process took the session over, nothing removed): a delete or a retention
        pass that lost the lease never removes the file its new holder goes on saving."""
        import sqlalchemy as sa
        from sqlalchemy.exc import SQLAlchemyError

        from isagi.storage.fences import check
        from isagi.storage.history import SessionFileModel

        names = self._candidates(session_id, recorded)
        if not names:
            return []
        try:
            with self.engine.begin() as conn:
                if fence is not None:
                    check(conn, fence)  # SessionMoved: another process took the session over
                gone = conn.execute(sa.delete(SessionFileModel).where(SessionFileModel.name.in_(names))
                                    .returning(SessionFileModel.name)).scalars().all()
        except SQLAlchemyError as exc:
            raise self._error("remove a session", exc) from None
        return [self.root / n for n in names if n in set(gone)]

    def all(self) -> list[Path]:
        """Every session file (named by a session id), in name order."""
        import sqlalchemy as sa
        from sqlalchemy.exc import SQLAlchemyError

        from isagi.storage.history import SessionFileModel

        try:
            with self.engine.connect() as conn:
                names = conn.execute(sa.select(SessionFileModel.name).order_by(SessionFileModel.name)).scalars().all()
        except SQLAlchemyError as exc:
            raise self._error("list the sessions", exc) from None
        return [self.root / n for n in names if n.endswith(SUFFIX) and is_session_id(n[: -len(SUFFIX)])]

    def read_bytes(self, path: str | os.PathLike[str]) -> bytes:

        from isagi.storage.history import SessionFileModel

        name = self._name(path)
        if name is None:
            return self._local.read_bytes(path)
        data = self._column(SessionFileModel.data, name, "read a session")
        if data is None:
            raise MikuError(f"{path} does not exist")
        return bytes(data)

    def read(self, path: str | os.PathLike[str], *, expected_fingerprint: str | None = None,
             allow_other_model: bool = False) -> MikuState:
        from isagi.storage.miku import decode_miku

        if self._name(path) is None:
            return self._local.read(path, expected_fingerprint=expected_fingerprint,
                                    allow_other_model=allow_other_model)
        return decode_miku(self.read_bytes(path), path=path, expected_fingerprint=expected_fingerprint,
                           allow_other_model=allow_other_model)

    def write(self, path: str | os.PathLike[str], state: MikuState, *, fence: Fence | None = None) -> None:
        """Save ``state`` as ``path``'s row, replacing it whole in one transaction. ``fence``: the
        writer's lease of the session; the write happens only while it is current
        (:class:`~isagi.errors.SessionMoved` otherwise, nothing written)."""
        from isagi.storage.miku import encode_miku

        name = self._name(path)
        if name is None:
            self._local.write(path, state)
            return
        self.write_bytes(path, encode_miku(state), fence=fence)

    def write_bytes(self, path: str | os.PathLike[str], data: bytes, *, fence: Fence | None = None) -> None:
        """``data`` as ``path``'s row (checked bytes only: :meth:`write` encodes a state), only
        while ``fence`` (if any) is current, checked in the same transaction (:mod:`storage.fences`)."""
        from sqlalchemy.dialects.postgresql import insert
        from sqlalchemy.exc import SQLAlchemyError

        from isagi.storage.fences import check
        from isagi.storage.history import SessionFileModel

        name = self._name(path)
        if name is None:
            raise ValueError(f"{path} is not a session file of the store")
        now = _dt.datetime.now(_dt.UTC)
        stmt = insert(SessionFileModel).values(name=name, data=data, updated_at=now)
        stmt = stmt.on_conflict_do_update(index_elements=[SessionFileModel.name],
                                          set_={"data": stmt.excluded.data, "updated_at": now})
        try:
            with self.engine.begin() as conn:
                if fence is not None:
                    check(conn, fence)  # SessionMoved: another process took the session over
                conn.execute(stmt)
        except SQLAlchemyError as exc:
            raise StorageError(f"Could not save the session {name} in the session store: "
                               f"{str(getattr(exc, 'orig', None) or exc).strip().splitlines()[0]}. "
                               "The previous version (if any) is unchanged; check that the PostgreSQL "
                               "server (ISAGI_SESSIONS_URL) is reachable.") from None

    def modified(self, path: str | os.PathLike[str]) -> float | None:

        from isagi.storage.history import SessionFileModel

        name = self._name(path)
        if name is None:
            return self._local.modified(path)
        t = self._column(SessionFileModel.updated_at, name, "read a session's time")
        return None if t is None else t.timestamp()

    def _column(self, column: Any, name: str, doing: str) -> Any:
        """``column`` of the stored file ``name`` (None: no such file); a :class:`StorageError`
        saying what failed when the database does."""
        import sqlalchemy as sa
        from sqlalchemy.exc import SQLAlchemyError

        from isagi.storage.history import SessionFileModel

        try:
            with self.engine.connect() as conn:
                return conn.execute(sa.select(column).where(SessionFileModel.name == name)).scalar()
        except SQLAlchemyError as exc:
            raise self._error(doing, exc) from None

    def close(self) -> None:
        self.engine.dispose()
