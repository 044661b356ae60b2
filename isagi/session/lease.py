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

A process can lose a lease while it lives on (its lease connection broke: PostgreSQL restarted,
a network cut, ``pg_terminate_backend``, a pause past keepalive). So each acquisition also makes
the session's epoch one higher, in the statement that takes the lock, and the process keeps the
:class:`~isagi.storage.fences.Fence` it got (:meth:`AdvisoryLeases.fence`): every write of the
session carries it and is refused once another acquisition has bumped the epoch
(:mod:`isagi.storage.fences`), so a holder that lost the lease mid-turn writes nothing after the
new holder took over.

A process that waits for a lease asks its holder to let go (``NOTIFY`` on the channel
:data:`WANTED_CHANNEL`, with the session id, again every :data:`ASK_AGAIN_S` while it waits);
each process listens on a connection of its own and tells its registry, which saves and parks
the session once no turn runs in it (:meth:`isagi.session.registry.SessionRegistry.hand_over`).
So a conversation whose requests the balancer sends elsewhere (its stickiness lost: a balancer
restarted, a replica back from the dead) moves there, instead of being refused until its holder
drops it idle.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from isagi.errors import MOVED, StorageError
from isagi.storage.fences import ACQUIRE, Fence

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection, Engine

    from isagi.session.store import SessionStore
    from isagi.storage.history import HistoryStore


@dataclasses.dataclass(frozen=True)
class Claim:
    """What a maintenance pass's ``hold(sid)`` got: ``free`` (no server holds the session, and
    the pass holds its lease until the hold ends) and, with a shared store, the ``fence`` of that
    lease, which every write of the pass carries (None: a store only this process uses)."""

    free: bool
    fence: Fence | None = None


Hold = Callable[[str], contextlib.AbstractContextManager[Claim]]  # maintenance_holds' hold(sid)

log = logging.getLogger(__name__)

POLL_S = 0.05  # how often a waiting acquire tries again
ASK_AGAIN_S = 1.0  # how often a waiting acquire asks the holder again to let go
WANTED_CHANNEL = "isagi_lease_wanted"  # NOTIFY channel: the payload is the session id wanted
LISTEN_POLL_S = 0.5  # how long the listener waits for a notification before it looks at close()
BUSY_ELSEWHERE = "This chat is open on another ISAGI server; try again in a moment."
__all__ = ["BUSY_ELSEWHERE", "MOVED", "AdvisoryLeases", "Claim", "SessionLeases", "lease_key",
           "maintenance_holds", "process_leases"]


class SessionLeases(Protocol):
    """Which sessions this process may write."""

    def acquire(self, sid: str, timeout: float = 0.0) -> bool: ...
    def release(self, sid: str) -> None: ...
    def held(self, sid: str) -> bool: ...  # this process believes it holds it (no round trip)
    def fence(self, sid: str) -> Fence | None: ...  # the fencing token of the acquisition held (no round trip)
    def confirm(self, sid: str) -> bool: ...  # the database says it does
    def listen(self, wanted: Callable[[str], None]) -> None: ...  # another process waits for one held here
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
        self._held: dict[str, Fence] = {}  # each lease held, with the epoch its acquisition got
        self._wanted: list[Callable[[str], None]] = []
        self._listener: threading.Thread | None = None
        self._closing = threading.Event()
        try:
            self._engine: Engine = sa.create_engine(url, poolclass=NullPool, future=True)
            self._conn: Connection | None = self._connect()
        except (ImportError, SQLAlchemyError) as exc:
            raise StorageError(f"Cannot reach PostgreSQL for session leases (ISAGI_SESSIONS_URL): {_reason(exc)}. "
                               "Check that the server is running and the URL is right.") from None

    def _connect(self) -> Connection:
        return self._engine.connect().execution_options(isolation_level="AUTOCOMMIT")

    def _scalar(self, sql: str, **params: object) -> Any:
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
            # the lock and, once granted, the session's epoch one higher: one statement
            epoch = self._scalar(ACQUIRE, k=lease_key(sid), sid=sid)
            if epoch is not None:
                self._held[sid] = Fence(sid, int(epoch))
                return True
            return False

    def acquire(self, sid: str, timeout: float = 0.0) -> bool:
        """Take ``sid``'s lease, waiting up to ``timeout`` seconds while another process holds it
        (and asking that process to let go of it); whether this process holds it now (already
        held: True at once)."""
        deadline = time.monotonic() + max(0.0, timeout)
        asked = float("-inf")
        while True:
            if self._try(sid):
                return True
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                return False
            if now - asked >= ASK_AGAIN_S:
                asked = now
                self._ask(sid)
            time.sleep(min(self.poll_s, left))

    def _ask(self, sid: str) -> None:
        """Ask whichever process holds ``sid``'s lease to let go of it (a notification)."""
        try:
            with self._guard:
                self._scalar("SELECT pg_notify(:channel, :sid)", channel=WANTED_CHANNEL, sid=sid)
        except StorageError as exc:  # the wait goes on; the holder lets go when idle anyway
            log.debug("could not ask for the lease of %s: %s", sid, exc)

    def listen(self, wanted: Callable[[str], None]) -> None:
        """Call ``wanted(sid)`` (on a thread of this object's) whenever another process waits
        for the lease of a session this process holds."""
        with self._guard:
            self._wanted.append(wanted)
            if self._listener is None:
                self._listener = threading.Thread(target=self._listen, name="isagi-lease-listener", daemon=True)
                self._listener.start()

    def _listen(self) -> None:
        """The listener's loop: a connection of its own that LISTENs on :data:`WANTED_CHANNEL`
        (made again, after a pause, when it breaks), until :meth:`close`."""
        while not self._closing.is_set():
            raw: Any = None
            try:
                raw = self._engine.raw_connection()
                conn = raw.driver_connection  # psycopg's own connection: its notifies()
                conn.autocommit = True
                conn.execute(f"LISTEN {WANTED_CHANNEL}")
                while not self._closing.is_set():
                    for note in conn.notifies(timeout=LISTEN_POLL_S):
                        self._on_wanted(note.payload)
            except Exception as exc:  # SQLAlchemy's, psycopg's or the socket's: listen again
                if not self._closing.is_set():
                    log.warning("the session lease listener lost its connection (%s); it listens again in 1 s",
                                _reason(exc))
                    self._closing.wait(1.0)
            finally:
                if raw is not None:
                    try:
                        raw.invalidate()
                    except Exception as exc:  # a broken connection
                        log.debug("closing the lease listener's connection: %s", exc)

    def _on_wanted(self, sid: str) -> None:
        with self._guard:
            mine = sid in self._held
            callbacks = list(self._wanted)
        if not mine:
            return
        for wanted in callbacks:
            try:
                wanted(sid)
            except Exception:  # a registry's bug must not end the listener
                log.exception("handing over session %s failed", sid)

    def release(self, sid: str) -> None:
        """Give ``sid``'s lease back (not held: nothing)."""
        with self._guard:
            if sid not in self._held:
                return
            del self._held[sid]
            try:
                self._scalar("SELECT pg_advisory_unlock(:k)", k=lease_key(sid))
            except StorageError as exc:  # the connection is gone: PostgreSQL freed it already
                log.debug("lease of %s: %s", sid, exc)

    def held(self, sid: str) -> bool:
        with self._guard:
            return sid in self._held

    def fence(self, sid: str) -> Fence | None:
        """The fencing token of ``sid``'s lease as this process took it (None: not held here)."""
        with self._guard:
            return self._held.get(sid)

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
                self._held.pop(sid, None)
            return ok

    def close(self) -> None:
        """End the lease connection: PostgreSQL frees every lease this process held."""
        self._closing.set()
        listener = self._listener
        if listener is not None and listener is not threading.current_thread():
            listener.join(timeout=LISTEN_POLL_S + 2.0)
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


@contextlib.contextmanager
def maintenance_holds(files: SessionStore, history: HistoryStore | None = None) -> Iterator[Hold]:
    """For a pass over stored sessions that writes them (the start-up repair, retention,
    ``isagi sessions prune``, ``isagi sessions delete``): ``hold(sid)``, a context giving a
    :class:`Claim`: free (no process holds the session's lease, and this pass holds it until the
    context ends, so none takes it meanwhile) or not (open on a server: leave it to that server).
    Its leases are on a connection of their own, so a session live in this very process counts as
    held too. With a store only this process uses (the sessions directory), every session is free.

    Holding the lock is not enough on its own: the pass's lease connection can break while the
    pass goes on (as a server's can), and another process then takes the session. So each claim
    carries the fence of its acquisition, and the pass hands it to every write it makes of that
    session (the file's row, its removal, the history's rows): once another process has taken the
    session over, those writes raise :class:`~isagi.errors.SessionMoved` and write nothing
    (:mod:`isagi.storage.fences`). ``history``: the history store the pass writes, told where the
    epochs are (:meth:`storage.history.HistoryStore.use_leases`) so its writes are fenced too."""
    from isagi.session.dbstore import DatabaseSessionFiles

    if not (files.shared and isinstance(files, DatabaseSessionFiles)):
        yield _always_free
        return
    if history is not None:
        history.use_leases(files.engine)
    leases = AdvisoryLeases(files.url)

    @contextlib.contextmanager
    def hold(sid: str) -> Iterator[Claim]:
        if not leases.acquire(sid, 0.0):
            yield Claim(False)
            return
        try:
            yield Claim(True, leases.fence(sid))
        finally:
            leases.release(sid)

    try:
        yield hold
    finally:
        leases.close()


@contextlib.contextmanager
def _always_free(_sid: str) -> Iterator[Claim]:
    yield Claim(True)
