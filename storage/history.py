"""The SQL history store: every session and every turn, queryable later.

This module owns the history database: the SQLAlchemy 2.x models of
``sessions`` and ``turns``, opening a database from a URL (SQLite file under
``ISAGI_HOME`` by default, PostgreSQL or any SQLAlchemy URL by setting),
migrating it to the newest Alembic revision on open, and the queries the CLI
and the web app need (record a turn, list, search, export, delete). It knows
nothing about models or geometry: a turn arrives as a
``TurnRecord`` of plain numbers and texts (an :class:`isagi.session.turn.Turn`).

One exchange is two rows in ``turns`` (``seq`` counts rows within a session
from 0): the user row (seq 2n) carries the query-side figures (tier, distance,
nearest query, zone, TEH of the prompt, prompt tokens) and the assistant row
(seq 2n+1) the reply-side ones (TEH of the reply, latency, new tokens, metric
growth); both carry the turn's tier and verdict. Both rows are written in one
transaction that first locks the session (``BEGIN IMMEDIATE`` on SQLite,
``SELECT ... FOR UPDATE`` elsewhere), so concurrent writers never interleave
or reuse sequence numbers; a unique index on (session_id, seq) enforces it.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from sqlalchemy import (
    BigInteger,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
    create_engine,
    delete,
    event,
    func,
    inspect,
    select,
    update,
)
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker
from sqlalchemy.orm import Session as OrmSession
from sqlalchemy.pool import ConnectionPoolEntry, StaticPool

from isagi.errors import StorageError, storage_cause
from isagi.storage.fences import Fence
from isagi.storage.fences import check as check_fence
from isagi.storage.owners import LOCAL_OWNER
from isagi.storage.titles import make_title, session_title

if TYPE_CHECKING:
    import sqlite3

T = TypeVar("T")
ROLES = ("user", "assistant")
OWNER_MAX = 64
# The rows of an exchange that store a figure of its record (a column's ``info``): the user row
# the query side's, the assistant row the reply side's, both the turn's tier and verdict.
_USER_ROW: dict[str, object] = {"rows": ("user",)}
_REPLY_ROW: dict[str, object] = {"rows": ("assistant",)}
_BOTH_ROWS: dict[str, object] = {"rows": ROLES}
# The record's field each row's ``text`` holds.
TEXT_OF = {"user": "user_text", "assistant": "reply_text"}


# --------------------------------------------------------------------------- models


class Base(DeclarativeBase):
    """Declarative base of the history schema (its metadata is what Alembic builds)."""


class SessionModel(Base):
    __tablename__ = "sessions"
    __table_args__ = (Index("ix_sessions_owner_updated", "owner", "updated_at"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    title: Mapped[str | None] = mapped_column(String(200))
    model_id: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[_dt.datetime] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[_dt.datetime] = mapped_column(DateTime(timezone=True))
    miku_path: Mapped[str | None] = mapped_column(Text)
    # Last column: revision 0002 adds it to existing databases (rows before it are "local").
    owner: Mapped[str] = mapped_column(String(OWNER_MAX), server_default=LOCAL_OWNER)


class SessionFileModel(Base):
    """A session's ``.miku`` file when the sessions live in the database (ISAGI_SESSIONS_URL,
    :mod:`storage.session_files`): its name in the sessions folder and its whole bytes, replaced
    in one transaction (a reader sees the old bytes or the new, never a mix)."""

    __tablename__ = "session_files"

    name: Mapped[str] = mapped_column(String(80), primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary)
    updated_at: Mapped[_dt.datetime] = mapped_column(DateTime(timezone=True))


class SessionLeaseModel(Base):
    """A leased session's fencing epoch when the sessions live in the database
    (:mod:`storage.fences`): one higher at each acquisition of its lease; every write of the
    session checks it is still the writer's."""

    __tablename__ = "session_leases"

    session_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    epoch: Mapped[int] = mapped_column(BigInteger)


class TurnModel(Base):
    __tablename__ = "turns"
    __table_args__ = (
        UniqueConstraint("session_id", "seq", name="uq_turns_session_seq"),
        Index("ix_turns_owner", "owner"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    session_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("sessions.id", ondelete="CASCADE", name="fk_turns_session_id")
    )
    seq: Mapped[int] = mapped_column(Integer)
    role: Mapped[str] = mapped_column(String(16))
    text: Mapped[str] = mapped_column(Text)
    # The exchange's figures: each a field of the record under the same name (TurnRecord), on
    # the rows its ``info`` names.
    tier: Mapped[str | None] = mapped_column(String(16), info=_BOTH_ROWS)
    distance: Mapped[float | None] = mapped_column(Float, info=_USER_ROW)
    nearest_query: Mapped[str | None] = mapped_column(Text, info=_USER_ROW)
    zone: Mapped[str | None] = mapped_column(String(32), info=_USER_ROW)
    teh_prompt: Mapped[float | None] = mapped_column(Float, info=_USER_ROW)
    teh_reply: Mapped[float | None] = mapped_column(Float, info=_REPLY_ROW)
    verdict: Mapped[str] = mapped_column(String(16), default="ok", info=_BOTH_ROWS)
    latency_s: Mapped[float | None] = mapped_column(Float, info=_REPLY_ROW)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer, info=_USER_ROW)
    new_tokens: Mapped[int | None] = mapped_column(Integer, info=_REPLY_ROW)
    metric_growth: Mapped[float | None] = mapped_column(Float, info=_REPLY_ROW)
    created_at: Mapped[_dt.datetime] = mapped_column(DateTime(timezone=True))
    # The session's owner again, so that a search filters the rows it reads.
    owner: Mapped[str] = mapped_column(String(OWNER_MAX), server_default=LOCAL_OWNER)


def _figure_columns() -> list[Column[object]]:
    return [c for c in inspect(TurnModel).columns if "rows" in c.info]


# The record's figures, in column order, and those each row of an exchange stores: the one list,
# read from the model above.
FIGURES = tuple(c.key for c in _figure_columns())
ROW_FIGURES = {role: tuple(c.key for c in _figure_columns() if role in c.info["rows"]) for role in ROLES}


# --------------------------------------------------------------------------- value types


class TurnRecord(Protocol):
    """One exchange as the store reads it: the fields it writes, plain numbers and texts.

    :class:`isagi.session.turn.Turn` (the one turn record) is one; the store needs no more of it.
    Its fields are :data:`TEXT_OF`'s and the :data:`FIGURES` (tests/test_history.py checks it).
    """

    user_text: str
    reply_text: str
    tier: str | None
    distance: float | None
    nearest_query: str | None
    zone: str | None
    teh_prompt: float | None
    teh_reply: float | None
    verdict: str
    latency_s: float | None
    prompt_tokens: int | None
    new_tokens: int | None
    metric_growth: float | None


@dataclass(frozen=True)
class SessionSummary:
    id: str
    title: str | None
    model_id: str
    created_at: _dt.datetime
    updated_at: _dt.datetime
    turns: int  # exchanges (user messages)
    miku_path: str | None = None
    owner: str = LOCAL_OWNER


@dataclass(frozen=True)
class TurnRow:
    """One stored message (a user or an assistant row) with its figures (:data:`FIGURES`, in
    order; :func:`_from_row` makes it)."""

    seq: int
    role: str
    text: str
    tier: str | None
    distance: float | None
    nearest_query: str | None
    zone: str | None
    teh_prompt: float | None
    teh_reply: float | None
    verdict: str
    latency_s: float | None
    prompt_tokens: int | None
    new_tokens: int | None
    metric_growth: float | None
    created_at: _dt.datetime


@dataclass(frozen=True)
class SearchHit:
    session_id: str
    session_title: str | None
    seq: int
    role: str
    text: str
    created_at: _dt.datetime


# --------------------------------------------------------------------------- helpers


def _now() -> _dt.datetime:
    return _dt.datetime.now(_dt.UTC)


def _utc(t: _dt.datetime) -> _dt.datetime:
    """SQLite returns naive datetimes; everything stored is UTC."""
    return t.replace(tzinfo=_dt.UTC) if t.tzinfo is None else t.astimezone(_dt.UTC)


def check_owner(owner: str) -> str:
    """``owner`` if it is a usable owner name (1 to 64 characters), else a StorageError."""
    if not isinstance(owner, str) or not owner or len(owner) > OWNER_MAX:
        raise StorageError(f"An owner must be a name of 1 to {OWNER_MAX} characters, not {owner!r}.")
    return owner


def not_found(session_id: str) -> StorageError:
    """The one answer for a session that does not exist *or belongs to someone else*."""
    return StorageError(
        f"No session {session_id!r} in the history; `isagi sessions list` shows the ids."
    )


def _safe_url(url: URL) -> str:
    return url.render_as_string(hide_password=True)


def _fold(s: str | None) -> str | None:
    return None if s is None else s.casefold()


# The one mapping between a record and its rows: _to_rows writes an exchange, _from_row reads a message.


def _to_rows(session_id: str, seq: int, r: TurnRecord, owner: str, now: _dt.datetime) -> list[TurnModel]:
    """One exchange's user row (at ``seq``, even) and assistant row."""
    return [
        TurnModel(session_id=session_id, seq=seq + i, role=role, text=getattr(r, TEXT_OF[role]), created_at=now,
                  owner=owner, **{name: getattr(r, name) for name in ROW_FIGURES[role]})
        for i, role in enumerate(ROLES)
    ]


def _from_row(t: TurnModel) -> TurnRow:
    """One stored message as the store answers it."""
    return TurnRow(seq=t.seq, role=t.role, text=t.text, created_at=_utc(t.created_at),
                   **{name: getattr(t, name) for name in FIGURES})


def _entitle(s: SessionModel, title: str | None, first_message: str | None = None) -> None:
    """An untitled session gets its title (:func:`storage.titles.session_title`), if it has one yet."""
    new = session_title(title, first_message)
    if new and not s.title:
        s.title = new


def _engine_for(url: URL) -> Engine:
    if url.get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=True, future=True)
    database = url.database or ""
    memory = database in ("", ":memory:") or "mode=memory" in str(url)
    kwargs: dict[str, Any] = {"connect_args": {"check_same_thread": False, "timeout": 30}}
    if memory:
        kwargs["poolclass"] = StaticPool
    else:
        Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, **kwargs)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: sqlite3.Connection, _record: ConnectionPoolEntry) -> None:
        # Autocommit at the driver level so that SQLAlchemy's "begin" below
        # decides how transactions start (pysqlite's own BEGIN is deferred).
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        if not memory:
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.close()
        dbapi_conn.create_function("isagi_fold", 1, _fold, deterministic=True)

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        # Take the write lock at the start: read-then-write transactions
        # (next seq number) cannot deadlock or upgrade-fail under concurrency.
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


# --------------------------------------------------------------------------- store


class HistoryStore:
    """Sessions and turns in a SQL database, migrated to the newest schema on open."""

    def __init__(self, url: str) -> None:
        try:
            self.url = make_url(url)
        except Exception as exc:
            raise StorageError(
                f"The history database URL {url!r} is not valid ({exc}). "
                "Use e.g. sqlite:////path/history.db or postgresql+psycopg://user:pw@host/db "
                "(setting ISAGI_DATABASE_URL)."
            ) from None
        where = _safe_url(self.url)
        try:
            self.engine = _engine_for(self.url)
        except (ImportError, SQLAlchemyError, OSError) as exc:
            raise StorageError(
                f"Cannot open the history database {where}: {exc}. "
                "Check the URL and that its database driver is installed."
            ) from None
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        # Where the session leases' epochs are (use_leases): in this database, or another's engine.
        self._leases_here = False
        self._lease_engine: Engine | None = None
        try:
            from isagi.storage.migrations import upgrade_to_head

            with self.engine.begin() as conn:
                upgrade_to_head(conn)
        except SQLAlchemyError as exc:
            self.engine.dispose()
            reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
            cause = storage_cause(exc)
            if cause != "a storage error":  # a local file that cannot be written, not a server
                fix = ("Free some space" if cause == "the disk is full" else
                       "Make its directory writable, or set ISAGI_HOME (or ISAGI_DATABASE_URL) elsewhere")
                raise StorageError(f"Cannot write the history database {where} ({cause}: {reason}). {fix}.") from None
            raise StorageError(
                f"Cannot open the history database {where}: {reason}. "
                "Check that the database server is running and the URL (ISAGI_DATABASE_URL) is right."
            ) from None
        except OSError as exc:
            self.engine.dispose()
            raise StorageError(f"Cannot open the history database {where}: {exc}") from None

    # -- plumbing

    def use_leases(self, leases: Engine) -> None:
        """The session leases' epochs (:mod:`storage.fences`) are in ``leases``' database, the
        shared session store's: from now on a write given a ``fence`` happens only while that
        fence is current. When that database is this store's (one database for both, as shipped)
        the fence is checked in the write's own transaction; otherwise in a transaction of that
        database whose row lock is held until the write has committed (a lease taken meanwhile
        waits for it; only the loss of that one connection between its check and the write's
        commit escapes it)."""
        from isagi.storage.fences import same_database

        try:
            here = same_database(leases, self.engine)
        except SQLAlchemyError as exc:
            reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
            raise StorageError(f"Could not compare the history database with the session store's: {reason}. "
                               "Check that PostgreSQL (ISAGI_SESSIONS_URL, ISAGI_DATABASE_URL) is reachable.") from None
        self._leases_here, self._lease_engine = here, None if here else leases

    @contextlib.contextmanager
    def _tx(self, what: str, fence: Fence | None = None) -> Iterator[OrmSession]:
        """A transaction; with a ``fence`` (once :meth:`use_leases` said where the leases are),
        one that commits only while that fence is current (:class:`~isagi.errors.SessionMoved`
        otherwise, and nothing is written)."""
        try:
            with contextlib.ExitStack() as held:
                if fence is not None and self._lease_engine is not None:
                    # the epochs are in another database: its row stays locked until this commits
                    check_fence(held.enter_context(self._lease_engine.begin()), fence)
                with self._sessions.begin() as db:
                    if fence is not None and self._leases_here:
                        check_fence(db.connection(), fence)  # in the write's own transaction
                    yield db
        except StorageError:
            raise
        except SQLAlchemyError as exc:
            reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
            raise StorageError(
                f"History database error while trying to {what} ({_safe_url(self.url)}): {reason}"
            ) from None

    def _is_sqlite(self) -> bool:
        return self.engine.dialect.name == "sqlite"

    def _get_session(
        self, db: OrmSession, session_id: str, owner: str, *, lock: bool = False
    ) -> SessionModel:
        """The session ``session_id`` of ``owner``; another owner's is "not found" too."""
        q = select(SessionModel).where(SessionModel.id == session_id, SessionModel.owner == owner)
        if lock and not self._is_sqlite():
            q = q.with_for_update()
        s = db.execute(q).scalar_one_or_none()
        if s is None:
            raise not_found(session_id)
        return s

    def _summary(self, s: SessionModel, n: int) -> SessionSummary:
        return SessionSummary(
            id=s.id,
            title=s.title,
            model_id=s.model_id,
            created_at=_utc(s.created_at),
            updated_at=_utc(s.updated_at),
            turns=int(n),
            miku_path=s.miku_path,
            owner=s.owner,
        )

    # -- writing

    def ensure_session(
        self, session_id: str, *, owner: str, model_id: str, title: str | None = None
    ) -> None:
        """Create ``owner``'s session if it does not exist (an existing one is left as
        it is, except that a given ``title`` replaces a missing one).

        An id that another owner holds is "not found" (:class:`StorageError`),
        exactly as an unknown id is for reading: nothing is written to it.
        """
        self._write_session("create a session", session_id, owner=owner, model_id=model_id, title=title,
                            then=lambda db, created: None)

    def _write_session(self, what: str, session_id: str, *, owner: str, model_id: str, title: str | None,
                       then: Callable[[OrmSession, bool], T], fence: Fence | None = None) -> T:
        """In one transaction (fenced by ``fence``: :meth:`_tx`): create ``owner``'s session if it
        does not exist (a given ``title`` replaces a missing one), then ``then(db, created)``; its
        result is returned.

        An id that another owner holds is "not found", exactly as an unknown id is for reading.
        """
        owner = check_owner(owner)
        if not session_id or len(session_id) > 64:
            raise StorageError(f"Session id {session_id!r} must be 1 to 64 characters long.")
        for attempt in range(2):
            try:
                with self._tx(what, fence) as db:
                    s = db.get(SessionModel, session_id)
                    created = s is None
                    if s is None:
                        now = _now()
                        db.add(SessionModel(id=session_id, title=session_title(title),
                                            model_id=model_id, created_at=now, updated_at=now, owner=owner))
                        db.flush()
                    elif s.owner != owner:
                        raise not_found(session_id)
                    else:
                        _entitle(s, title)
                    return then(db, created)
            except StorageError as exc:
                # A concurrent writer created it between our read and insert.
                if attempt or not isinstance(exc.__context__, IntegrityError):
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def record_exchange(
        self, session_id: str, record: TurnRecord, *, owner: str, model_id: str, title: str | None = None,
        replace_last: bool = False, replace_from: int | None = None, fence: Fence | None = None,
    ) -> tuple[int, bool]:
        """A turn as the agent keeps it, in ONE transaction: :meth:`ensure_session`, then
        :meth:`record_turn` (or :meth:`replace_last_turn` with ``replace_last``). ``replace_from``:
        the exchanges from that position on (0 the first) are deleted first, and the turn takes
        that position (an edited message resent: it and every exchange after it are replaced).

        ``fence``: the writer's lease of the session (a shared session store): nothing is written
        unless it is current (:meth:`use_leases`; :class:`~isagi.errors.SessionMoved`).

        Returns (the exchange's number within the session from 1, whether the session was
        created by this call).
        """
        owner = check_owner(owner)
        if replace_from is not None and replace_from < 0:
            raise StorageError(f"replace_from must be 0 or more, got {replace_from}.")

        def write(db: OrmSession, created: bool) -> tuple[int, bool]:
            if replace_last and not created:
                self._drop_last_exchange(db, session_id)
            if replace_from is not None and not created:
                db.execute(delete(TurnModel).where(TurnModel.session_id == session_id,
                                                   TurnModel.seq >= 2 * replace_from))
            return self._add_turn(db, session_id, record, owner), created

        return self._write_session("record a turn", session_id, owner=owner, model_id=model_id, title=title,
                                   then=write, fence=fence)

    def record_exchanges(
        self, session_id: str, records: Sequence[TurnRecord], *, owner: str, model_id: str, title: str | None = None,
        fence: Fence | None = None,
    ) -> tuple[int, bool]:
        """Several turns appended in ONE transaction (a loaded session's earlier turns, a backlog):
        :meth:`record_exchange` without ``replace_last``, for many at once.

        Returns (the last exchange's number within the session, whether the session was created).
        """
        owner = check_owner(owner)
        if not records:
            raise StorageError("record_exchanges needs at least one turn.")
        return self._write_session("record turns", session_id, owner=owner, model_id=model_id, title=title,
                                   then=lambda db, created: (self._add_turns(db, session_id, records, owner), created),
                                   fence=fence)

    def record_turn(self, session_id: str, record: TurnRecord, *, owner: str) -> int:
        """Store one exchange (user row + assistant row) of ``owner``'s session in one
        transaction.

        Returns the exchange's number within the session, from 1.
        """
        owner = check_owner(owner)
        with self._tx("record a turn") as db:
            return self._add_turn(db, session_id, record, owner)

    def _add_turn(self, db: OrmSession, session_id: str, record: TurnRecord, owner: str) -> int:
        """Write one exchange's two rows after the session's last row (inside a transaction)."""
        return self._add_turns(db, session_id, [record], owner)

    def _add_turns(self, db: OrmSession, session_id: str, records: Sequence[TurnRecord], owner: str) -> int:
        """Write the exchanges' rows, two each, after the session's last row (inside a transaction);
        returns the last one's number within the session."""
        for record in records:
            if not isinstance(record.user_text, str) or not isinstance(record.reply_text, str):
                raise StorageError("A turn's user and reply texts must be strings.")
        s = self._get_session(db, session_id, owner, lock=True)
        last = db.execute(
            select(func.max(TurnModel.seq)).where(TurnModel.session_id == session_id)
        ).scalar_one()
        seq = 0 if last is None else last + 1
        seq += seq % 2  # a user row always starts at an even seq
        now = _now()
        rows = []
        for r in records:
            rows += _to_rows(session_id, seq, r, owner, now)
            seq += 2
        db.add_all(rows)
        s.updated_at = now
        _entitle(s, None, records[0].user_text)
        return seq // 2

    def replace_last_turn(self, session_id: str, record: TurnRecord, *, owner: str) -> int:
        """Replace the last exchange of ``owner``'s session by ``record`` (Regenerate), in one transaction.

        The last exchange's two rows are deleted and ``record`` takes their
        sequence numbers; a session without turns gets ``record`` as its first.
        Returns the exchange's number within the session, from 1.
        """
        owner = check_owner(owner)
        with self._tx("replace a turn") as db:
            self._get_session(db, session_id, owner, lock=True)
            self._drop_last_exchange(db, session_id)
            return self._add_turn(db, session_id, record, owner)

    def _drop_last_exchange(self, db: OrmSession, session_id: str) -> None:
        """Delete the session's last exchange (its two rows), if any (inside a transaction)."""
        last = db.execute(
            select(func.max(TurnModel.seq)).where(TurnModel.session_id == session_id)
        ).scalar_one()
        if last is not None:
            db.execute(delete(TurnModel).where(TurnModel.session_id == session_id, TurnModel.seq >= last - last % 2))

    def repair_exchanges(
        self, session_id: str, turns: Sequence[TurnRecord], *, owner: str, model_id: str, title: str | None = None,
        fence: Fence | None = None,
    ) -> tuple[str, int]:
        """Bring ``owner``'s session level with ``turns`` (a session file's, the source of truth),
        in one transaction, deleting nothing but a last exchange that the file replaced.

        Exchanges are compared by their texts and verdict. Returns what was found:
        ``("in step", 0)``; ``("added", n)``: the history held a prefix of the
        file, the n missing exchanges were added (the session row is created if
        it is missing); ``("replaced", 1)``: only the last exchange differed (an
        interrupted Regenerate) and was replaced; ``("history ahead", n)``: the
        history holds n exchanges beyond the file, kept; ``("disagree", i)``: they
        differ from exchange i + 1 on, left alone. ``fence``: the lease the repair holds on the
        session (a shared session store): nothing is written unless it is current
        (:class:`~isagi.errors.SessionMoved`).
        """
        owner = check_owner(owner)

        def repair(db: OrmSession, created: bool) -> tuple[str, int]:
            stored = self._exchanges(db, session_id)
            want = [(t.user_text, t.reply_text, t.verdict) for t in turns]
            common = 0
            while common < min(len(stored), len(want)) and stored[common] == want[common]:
                common += 1
            if common == len(stored) == len(want):
                return "in step", 0
            if common == len(stored):
                for t in turns[common:]:
                    self._add_turn(db, session_id, t, owner)
                return "added", len(want) - common
            if common == len(want) - 1 == len(stored) - 1:
                self._drop_last_exchange(db, session_id)
                self._add_turn(db, session_id, turns[-1], owner)
                return "replaced", 1
            if common == len(want):
                return "history ahead", len(stored) - common
            return "disagree", common

        return self._write_session("repair a session's history", session_id, owner=owner, model_id=model_id,
                                   title=title, then=repair, fence=fence)

    @staticmethod
    def _exchanges(db: OrmSession, session_id: str) -> list[tuple[str, str, str]]:
        """The session's exchanges as (user text, reply text, verdict), in order (inside a transaction)."""
        rows = db.execute(
            select(TurnModel.seq, TurnModel.role, TurnModel.text, TurnModel.verdict)
            .where(TurnModel.session_id == session_id).order_by(TurnModel.seq)
        ).all()
        pairs: dict[int, dict[str, tuple[str, str]]] = {}
        for seq, role, text, verdict in rows:
            pairs.setdefault(seq // 2, {})[role] = (text, verdict)
        out = []
        for n in sorted(pairs):
            user, reply = pairs[n].get("user", ("", "ok")), pairs[n].get("assistant", ("", "ok"))
            out.append((user[0], reply[0], reply[1]))
        return out

    def set_miku_path(self, session_id: str, path: str | Path | None, *, owner: str, fence: Fence | None = None) -> None:
        """Remember where ``owner``'s session's ``.miku`` file is (None forgets it); only while
        ``fence`` (if any) is current."""
        owner = check_owner(owner)
        with self._tx("set the session file", fence) as db:
            self._get_session(db, session_id, owner)
            db.execute(
                update(SessionModel)
                .where(SessionModel.id == session_id, SessionModel.owner == owner)
                .values(miku_path=None if path is None else str(path))
            )

    def delete_session(self, session_id: str, *, owner: str, fence: Fence | None = None) -> bool:
        """Delete ``owner``'s session and its turns; False when ``owner`` has no such
        session (another owner's session is left untouched and answers the same False).

        The session's ``.miku`` autosave is the caller's to remove
        (:meth:`isagi.session.store.SessionStore.remove`); read its ``miku_path`` first.
        ``fence``: the lease the deleter holds on the session (a shared session store): nothing
        is deleted unless it is current (:class:`~isagi.errors.SessionMoved`), so a deleter that
        lost the lease never removes the turns the session's new holder keeps writing.
        """
        owner = check_owner(owner)
        with self._tx("delete a session", fence) as db:
            s = db.get(SessionModel, session_id)
            if s is None or s.owner != owner:
                return False
            db.execute(delete(TurnModel).where(TurnModel.session_id == session_id))
            db.execute(
                delete(SessionModel).where(
                    SessionModel.id == session_id, SessionModel.owner == owner
                )
            )
        return True

    def rename_session(self, session_id: str, title: str, *, owner: str, fence: Fence | None = None) -> bool:
        """Give ``owner``'s session the title ``title`` (one line, at most
        :data:`~isagi.storage.titles.TITLE_MAX` characters, as :func:`~isagi.storage.titles.make_title`
        writes it); False when ``owner`` has no such session (another owner's answers the same).
        ``fence``: only while it is current (the session is live in this process)."""
        owner = check_owner(owner)
        with self._tx("rename a session", fence) as db:
            s = db.get(SessionModel, session_id)
            if s is None or s.owner != owner:
                return False
            s.title = make_title(title)
        return True

    # -- reading

    def list_sessions(
        self, limit: int = 50, offset: int = 0, *, owner: str
    ) -> list[SessionSummary]:
        """``owner``'s sessions, most recently updated first."""
        owner = check_owner(owner)
        counts = (
            select(TurnModel.session_id, func.count().label("n"))
            .where(TurnModel.role == "user", TurnModel.owner == owner)
            .group_by(TurnModel.session_id)
            .subquery()
        )
        q = (
            select(SessionModel, func.coalesce(counts.c.n, 0))
            .outerjoin(counts, counts.c.session_id == SessionModel.id)
            .where(SessionModel.owner == owner)
            .order_by(SessionModel.updated_at.desc(), SessionModel.id)
            .limit(max(0, limit))
            .offset(max(0, offset))
        )
        with self._tx("list sessions") as db:
            return [self._summary(s, n) for s, n in db.execute(q).all()]

    def get_session(self, session_id: str, *, owner: str) -> SessionSummary:
        """One of ``owner``'s sessions; StorageError when ``owner`` has no such session."""
        owner = check_owner(owner)
        with self._tx("read a session") as db:
            s = self._get_session(db, session_id, owner)
            n = db.execute(
                select(func.count())
                .select_from(TurnModel)
                .where(TurnModel.session_id == session_id, TurnModel.role == "user")
            ).scalar_one()
            return self._summary(s, n)

    def exchange_count(self, session_id: str, *, owner: str) -> int:
        """How many exchanges ``owner``'s session holds (0: none, no such session, or another owner's)."""
        owner = check_owner(owner)
        with self._tx("read a session") as db:
            return int(db.execute(
                select(func.count()).select_from(TurnModel)
                .where(TurnModel.session_id == session_id, TurnModel.owner == owner, TurnModel.role == "user")
            ).scalar_one())

    def session_times(self) -> dict[str, tuple[str, _dt.datetime]]:
        """Every session's (owner, last update), of all owners: for the server's start-up check
        (:func:`isagi.pipeline.keeping.reconcile_history`), never for an answer to a user."""
        with self._tx("list sessions") as db:
            return {sid: (owner, _utc(t)) for sid, owner, t in
                    db.execute(select(SessionModel.id, SessionModel.owner, SessionModel.updated_at)).all()}

    def get_turns(self, session_id: str, *, owner: str) -> list[TurnRow]:
        """All stored messages of ``owner``'s session in order; StorageError when unknown."""
        owner = check_owner(owner)
        with self._tx("read turns") as db:
            self._get_session(db, session_id, owner)
            rows = db.execute(
                select(TurnModel)
                .where(TurnModel.session_id == session_id, TurnModel.owner == owner)
                .order_by(TurnModel.seq)
            ).scalars()
            return [_from_row(t) for t in rows]

    def search(self, text: str, limit: int = 50, *, owner: str) -> list[SearchHit]:
        """``owner``'s messages containing ``text`` (case-insensitive substring), newest first."""
        owner = check_owner(owner)
        if not text:
            return []
        if self._is_sqlite():
            cond = func.instr(func.isagi_fold(TurnModel.text), text.casefold()) > 0
        else:
            cond = TurnModel.text.icontains(text, autoescape=True)
        q = (
            select(TurnModel, SessionModel.title)
            .join(SessionModel, SessionModel.id == TurnModel.session_id)
            .where(cond, TurnModel.owner == owner, SessionModel.owner == owner)
            .order_by(TurnModel.created_at.desc(), TurnModel.id.desc())
            .limit(max(0, limit))
        )
        with self._tx("search the history") as db:
            return [
                SearchHit(
                    session_id=t.session_id,
                    session_title=title,
                    seq=t.seq,
                    role=t.role,
                    text=t.text,
                    created_at=_utc(t.created_at),
                )
                for t, title in db.execute(q).all()
            ]

    def export(
        self, session_id: str, fmt: Literal["json", "markdown"] = "json", *, owner: str
    ) -> str:
        """One of ``owner``'s sessions as JSON or Markdown text."""
        if fmt not in ("json", "markdown"):
            raise StorageError(f"Unknown export format {fmt!r}: use json or markdown.")
        info = self.get_session(session_id, owner=owner)
        turns = self.get_turns(session_id, owner=owner)
        if fmt == "json":
            doc = {
                "session": {
                    **asdict(info),
                    "created_at": info.created_at.isoformat(),
                    "updated_at": info.updated_at.isoformat(),
                },
                "messages": [{**asdict(t), "created_at": t.created_at.isoformat()} for t in turns],
            }
            return json.dumps(doc, ensure_ascii=False, indent=2)
        return _markdown(info, turns)

    def close(self) -> None:
        """Release all connections."""
        self.engine.dispose()

    def __enter__(self) -> HistoryStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _fmt(v: float | None, digits: int = 3) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def _markdown(info: SessionSummary, turns: list[TurnRow]) -> str:
    lines = [
        f"# {info.title or info.id}",
        "",
        f"- Session: `{info.id}`",
        f"- Model: `{info.model_id}`",
        f"- Created: {info.created_at.isoformat(timespec='seconds')}",
        f"- Updated: {info.updated_at.isoformat(timespec='seconds')}",
        f"- Turns: {info.turns}",
        "",
    ]
    for t in turns:
        if t.role == "user":
            lines += [
                f"## Turn {t.seq // 2 + 1}",
                "",
                f"**User** · tier {t.tier or '–'} · distance {_fmt(t.distance)} · "
                f"TEH {_fmt(t.teh_prompt)} · zone {t.zone or '–'}",
                "",
                t.text,
                "",
            ]
        else:
            lines += [
                f"**Assistant** · verdict {t.verdict} · TEH {_fmt(t.teh_reply)} · "
                f"latency {_fmt(t.latency_s, 2)} s · tokens {t.new_tokens if t.new_tokens is not None else '–'}",
                "",
                t.text,
                "",
            ]
    return "\n".join(lines).rstrip() + "\n"
