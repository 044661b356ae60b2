"""One writer per session across replicas: a live session's lease, held in PostgreSQL.

When the session files are shared (``ISAGI_SESSIONS_URL``, :mod:`isagi.session.store`), a
process serves a session only while it holds that session's lease; the registry
(:class:`isagi.session.registry.SessionRegistry`) takes it where a session becomes live and
gives it back where it stops being live. The lease is a session-level PostgreSQL advisory lock
(``pg_try_advisory_lock``) on one connection the process keeps open: PostgreSQL frees it when
that connection ends, so a replica that dies (SIGKILL, a lost host) lets go of its sessions
without any clock or heartbeat (docs/architecture.md, "Several replicas", says why this and
not a lease row). With the default sessions directory there is no lease: one process owns the
data directory (its flock).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from typing import TYPE_CHECKING, Protocol

from isagi.errors import StorageError

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection, Engine

log = logging.getLogger(__name__)

POLL_S = 0.05  # how often a waiting acquire asks again
BUSY_ELSEWHERE = "This chat is open on another ISAGI server; try again in a moment."
MOVED = ("This chat was taken over by another ISAGI server (this one lost its hold on it); "
         "reload the page to continue it there.")


class SessionLeases(Protocol):
    """Which sessions this process may write."""

    def acquire(self, sid: str, timeout: float = 0.0) -> bool: ...
    def release(self, sid: str) -> None: ...
    def held(self, sid: str) -> bool: ...  # this process believes it holds it (no round trip)
    def confirm(self, sid: str) -> bool: ...  # the database says it does
    def close(self) -> None: ...


def lease_key(sid: str) -> int:
    """The advisory lock's signed 64-bit key of session ``sid`` (BLAKE2b of the id: a collision
    would only make two sessions wait for each other, never share a writer)."""
    digest = hashlib.blake2b(f"isagi-session:{sid}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


class AdvisoryLeases:
    """Leases as PostgreSQL advisory locks on one connection of this process (thread-safe)."""

    def __init__(self, url: str, *, poll_s: float = POLL_S) -> None:
        import sqlalchemy as sa
        from sqlalchemy.exc import SQLAlchemyError
        from sqlalchemy.pool import NullPool

        self.url = url
        self.poll_s = float(poll_s)
        self._guard = threading.Lock()
        self._held: set[str] = set()
        try:
            self._engine: Engine = sa.create_engine(url, poolclass=NullPool, future=True)
            self._conn: Connection | None = self._connect()
        except (ImportError, SQLAlchemyError) as exc:
            raise StorageError(f"Cannot reach PostgreSQL for session leases (ISAGI_SESSIONS_URL): {_reason(exc)}. "
                               "Check that the server is running and the URL is right.") from None

    def _connect(self) -> Connection:
        return self._engine.connect().execution_options(isolation_level="AUTOCOMMIT")

    def _scalar(self, sql: str, **params: object) -> object:
        """One query on the lease connection (guard held). A connection that broke has lost every
        lease (PostgreSQL freed them): they are forgotten, a new connection made, the query retried."""
        import sqlalchemy as sa
        from sqlalchemy.exc import SQLAlchemyError

        for attempt in (1, 2):
            try:
                if self._conn is None:
                    self._conn = self._connect()
                return self._conn.execute(sa.text(sql), params).scalar()
            except SQLAlchemyError as exc:
                if self._held:
                    log.warning("the session lease connection broke (%s): %d lease(s) lost", _reason(exc), len(self._held))
                self._held.clear()
                if self._conn is not None:
                    try:
                        self._conn.invalidate()
                    except SQLAlchemyError:
                        log.debug("could not invalidate the lease connection", exc_info=True)
                self._conn = None
                if attempt == 2:
                    raise StorageError(f"Session leases are unavailable ({_reason(exc)}); check that "
                                       "PostgreSQL (ISAGI_SESSIONS_URL) is reachable.") from None
        raise AssertionError("unreachable")  # pragma: no cover

    def _try(self, sid: str) -> bool:
        with self._guard:
            if sid in self._held:
                return True
            if self._scalar("SELECT pg_try_advisory_lock(:k)", k=lease_key(sid)):
                self._held.add(sid)
                return True
            return False

    def acquire(self, sid: str, timeout: float = 0.0) -> bool:
        """Take ``sid``'s lease, waiting up to ``timeout`` seconds while another process holds it;
        whether this process holds it now (already held: True at once)."""
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            if self._try(sid):
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(self.poll_s, left))

    def release(self, sid: str) -> None:
        """Give ``sid``'s lease back (not held: nothing)."""
        with self._guard:
            if sid not in self._held:
                return
            self._held.discard(sid)
            try:
                self._scalar("SELECT pg_advisory_unlock(:k)", k=lease_key(sid))
            except StorageError as exc:  # the connection is gone: PostgreSQL freed it already
                log.debug("lease of %s: %s", sid, exc)

    def held(self, sid: str) -> bool:
        with self._guard:
            return sid in self._held

    def confirm(self, sid: str) -> bool:
        """Whether PostgreSQL still has ``sid``'s lock for this process's connection."""
        key = lease_key(sid) & 0xFFFFFFFFFFFFFFFF
        with self._guard:
            if sid not in self._held:
                return False
            try:
                ok = bool(self._scalar(
                    "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted "
                    "AND pid = pg_backend_pid() AND objsubid = 1 AND classid::bigint = :hi "
                    "AND objid::bigint = :lo)", hi=key >> 32, lo=key & 0xFFFFFFFF))
            except StorageError:
                return False
            if not ok:
                self._held.discard(sid)
            return ok

    def close(self) -> None:
        """End the lease connection: PostgreSQL frees every lease this process held."""
        with self._guard:
            self._held.clear()
            if self._conn is not None:
                try:
                    self._conn.close()
                except Exception as exc:  # closing a broken connection
                    log.debug("closing the lease connection: %s", exc)
                self._conn = None
        self._engine.dispose()


def _reason(exc: BaseException) -> str:
    return str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]


_process: dict[str, AdvisoryLeases] = {}
_process_guard = threading.Lock()


def process_leases(url: str) -> AdvisoryLeases:
    """This process's leases on ``url`` (one connection per process and URL)."""
    with _process_guard:
        leases = _process.get(url)
        if leases is None:
            leases = _process[url] = AdvisoryLeases(url)
        return leases
