"""The live sessions of a server: which session each id names, who owns it, who uses it now.

Owns the mapping *session id → live Session* (docs/architecture.md, Layout: the model and the
per-model profile are shared, a Session never is). Gradio's ``gr.State`` holds
only the id string (State values are deep-copied per event, a Session with its
FAISS index must not be); every handler looks the Session up here.

What it guarantees:

- Isolation: each id maps to its own Session object; an adopted session whose
  id is already live gets a fresh id, so two browsers never share one. A page
  reload (the id kept in the browser's storage) reopens its owner's own session
  under its id (:meth:`SessionRegistry.reopen`): tabs of one browser share it.
- One user of a session at a time: each entry has a plain ``threading.Lock``
  (not an RLock: a streaming handler takes it in one worker thread and may
  release it in another), held for the whole of a turn, a save or a load.
- Stop: each entry has a ``threading.Event`` that the Stop button sets and the
  turn pipeline polls between tokens.
- Idle eviction: a session unused for ``idle_s`` seconds is saved to its
  ``.miku`` (sessions with no turns are not written) and dropped from memory;
  its id is parked with the file path, and the next use of the id resumes it
  from the file transparently. A session whose file cannot be written (a full
  disk) is never dropped: it stays live until a save succeeds. Each file
  written here also lets the engine's keeper bring the history up to it.
- Pages: which browser pages (Gradio session hashes) show each session
  (:meth:`SessionRegistry.attach`); when the last page of a session is closed
  (:meth:`SessionRegistry.detach`, on Gradio's unload) the session is saved and
  parked, so it is no longer "live" and can be deleted, and a reload resumes it.

Nothing here changes a session's turns, metric or memory: a turn, Regenerate
and the rollback of a failed turn are the engine's (:class:`isagi.pipeline.engine.Engine`,
:meth:`isagi.session.state.Session.checkpoint`).
- One writer across replicas: with a shared session store (``ISAGI_SESSIONS_URL``) a session
  is live here only while this process holds its lease (:mod:`isagi.session.lease`), taken
  where it becomes live (create, adopt, reopen, the resume of a parked id) before its file is
  read, and given back where it stops being live (release, park, eviction, discard, reclaim,
  :meth:`SessionRegistry.close`). Another process's session answers :class:`SessionBusy`
  after a bounded wait (``lease_wait_s``) during which that process is asked to let go of it
  (:meth:`SessionRegistry.hand_over`: saved and parked there once no turn runs in it); once
  free, it is taken over from its last save. With the local sessions directory there are no
  leases (one process: the data directory's flock).
- Fenced writes: a session made live under a lease carries that acquisition's fence
  (:attr:`Session.lease <isagi.session.state.Session.lease>`), and every write of it (the file,
  the history rows) is refused once another process has taken the lease
  (:class:`~isagi.errors.SessionMoved`, :mod:`isagi.storage.fences`). Such a session is
  dropped here unsaved: at the end of the turn whose results were refused, or at the save that
  was; its caller is told it moved (:data:`isagi.errors.MOVED`).
- Draining (SIGTERM, :meth:`SessionRegistry.drain`): no session is made live and no turn starts
  any more (:class:`~isagi.errors.ServerDraining`); each live session is saved, parked and its
  lease given back as soon as no turn runs in it, so the turns in flight finish and another
  replica takes each session over at once.
- Owners: each entry (and each parked id) belongs to an owner (the logged-in
  user, ``local`` without a login) and remembers its client address; every
  lookup takes the caller's owner, and another owner's id raises ``KeyError``
  exactly as an unknown id does.
- Caps: at most ``max_per_client`` live sessions per client address and per
  logged-in owner, and ``max_total`` in all. At a cap the oldest empty sessions
  (no messages, not in use) of that client are reclaimed first (then anyone's
  for the overall cap); if none is, :class:`SessionLimit` says so.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from isagi.errors import IsagiError, ServerDraining, SessionBusy, SessionLimit, SessionMoved
from isagi.ids import new_session_id
from isagi.session.lease import BUSY_ELSEWHERE
from isagi.session.state import Session
from isagi.storage.owners import LOCAL_OWNER

if TYPE_CHECKING:
    from isagi.pipeline.engine import Engine
    from isagi.session.files import SessionFrame
    from isagi.session.lease import SessionLeases
    from isagi.session.store import SessionStore
    from isagi.storage.fences import Fence

SaveFn = Callable[["SessionFrame", Session, Path], None]
LoadFn = Callable[..., Session]

log = logging.getLogger(__name__)

DEFAULT_IDLE_S = 30 * 60.0
# How often the server tries again to write a session whose save failed (a full disk) and history
# rows that wait: a turn stays only in memory for about this long after space returns.
SAVE_RETRY_S = 5.0
SAVED_AGAIN = "Saved: this chat's file and history are written now (there was room on the disk again)."
MAX_PAGES = 10_000  # open pages the registry remembers (the oldest are forgotten beyond it)
LEASE_WAIT_S = 5.0  # how long a request waits for another replica to let go of its session
HAND_OVER_WAIT_S = 60.0  # how long a session asked for by another replica waits for its turn to end
DRAIN_POLL_S = 0.05  # how often a drain looks for sessions whose turn has ended
HOLD_TRIES = 3  # lookups of a session parked (handed over) while its lock was awaited
DRAINING = "This ISAGI server is shutting down; reload the page to go on with this chat on another one."
MAX_PARKABLE = 1024  # ids of parkable sessions remembered before those gone are forgotten

__all__ = ["SAVED_AGAIN", "SAVE_RETRY_S", "Drained", "Entry", "SessionBusy", "SessionLimit", "SessionRegistry",
           "give_back_memory"]


@dataclass
class Entry:
    """One live session and what the app keeps beside it."""

    session: Session
    owner: str = LOCAL_OWNER
    client: str | None = None  # the client address that opened it (None: unknown)
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)
    last_used: float = 0.0
    notice: str | None = None  # what the last turn could not keep yet (a full disk), for the page
    resaved: bool = False  # a save the server retried on its own has written what the notice said waits
    stop_requested_at: float | None = None  # monotonic time Stop reached the server
    stop_latency_s: float | None = None  # from then until the turn had ended
    # Made for a request that has not begun its turn yet (an API conversation's first message):
    # empty and idle for that moment, but not to be reclaimed as an empty chat by another
    # request at a cap. Cleared when a turn takes its lock (:meth:`SessionRegistry.using`).
    claimed: bool = False
    # The browser page (Gradio session hash) whose turn holds the lock now ("": none, or not a
    # page's): when that page goes away (a reload, a closed tab), the turn is stopped at once.
    turn_page: str = ""


@dataclass
class Drained:
    """What a drain did: the sessions saved and given back, and those still live at its end
    (a turn still running at the bound, or a save that failed: the shutdown tries again)."""

    released: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)


def give_back_memory() -> None:
    """Collect what dropped sessions left (reference cycles) and hand the freed heap back to the
    system (glibc keeps freed memory for reuse: without this an idle server's RSS stays at its
    peak, issue 37)."""
    import gc

    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, looked up once (``find_library`` runs ``ldconfig``); None elsewhere."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    with contextlib.suppress(OSError, AttributeError):
        return ctypes.CDLL(name).malloc_trim if name else None
    return None


class SessionRegistry:
    """Live sessions by id, with owners, caps and idle eviction.

    ``get_engine`` returns the shared engine (it is called lazily, so the
    registry can exist while the model is still loading). ``save(engine,
    session, path)`` and ``load(engine, path)`` default to
    :mod:`isagi.session.files`'s; tests pass their own and a fake ``clock``.
    Every method that takes an id takes the caller's ``owner`` (default
    ``local``: the app without a login).
    """

    def __init__(
        self,
        get_engine: Callable[[], Engine],
        *,
        idle_s: float = DEFAULT_IDLE_S,
        save: SaveFn | None = None,
        load: LoadFn | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_per_client: int = 32,
        max_total: int = 256,
        files: SessionStore | None = None,
        leases: SessionLeases | None = None,
        lease_wait_s: float = LEASE_WAIT_S,
    ) -> None:
        self._get_engine = get_engine
        self._files = files
        self._leases = leases
        self.lease_wait_s = float(lease_wait_s)
        self.idle_s = float(idle_s)
        self._save = save
        self._load = load
        self._clock = clock
        self.max_per_client = int(max_per_client)
        self.max_total = int(max_total)
        self._entries: dict[str, Entry] = {}
        self._parked: dict[str, tuple[Path | None, str]] = {}  # id -> (file, owner)
        self._pages: dict[str, str] = {}  # a browser page (Gradio session hash) -> the session id it shows
        # sessions made live for a stateless client's request (the API): parked to make room at a cap
        self._parkable: dict[str, None] = {}
        self._reclaimed: list[str] = []  # ids reclaimed under the guard, whose leases still go
        self._guard = threading.Lock()  # protects the two dicts, never held during I/O
        self._reaper: threading.Thread | None = None
        self._reaper_stop = threading.Event()
        self.evicted_total = 0
        self.reclaimed_total = 0
        self.draining = False  # SIGTERM: nothing new starts (drain)
        self._handing: set[str] = set()  # ids another process asked for, being handed over
        if leases is not None:
            leases.listen(self.hand_over)

    # -- helpers ---------------------------------------------------------------
    @property
    def engine(self) -> Engine:
        return self._get_engine()

    def _save_fn(self) -> SaveFn:
        if self._save is None:
            from isagi.session.files import save_session

            self._save = functools.partial(save_session, files=self.files)
        return self._save

    def _load_fn(self) -> LoadFn:
        if self._load is None:
            from isagi.session.files import load_session

            self._load = functools.partial(load_session, files=self.files)
        return self._load

    def _flush_reclaimed(self) -> None:
        with self._guard:
            ids, self._reclaimed = self._reclaimed, []
        self._unlease(*ids)

    @property
    def files(self) -> SessionStore:
        """Where the sessions' files live (default: the engine's settings say,
        :func:`isagi.session.store.session_files`)."""
        if self._files is not None:
            return self._files
        from isagi.session.store import session_files

        return session_files(self.engine.settings)

    @property
    def leases(self) -> SessionLeases | None:
        """This process's session leases: None with a store only this process uses."""
        if self._leases is not None:
            return self._leases
        files = self.files
        if not files.shared:
            return None
        from isagi.session.dbstore import DatabaseSessionFiles
        from isagi.session.lease import process_leases

        if not isinstance(files, DatabaseSessionFiles):
            return None
        self._leases = process_leases(files.url)
        self._leases.listen(self.hand_over)
        return self._leases

    def _lease(self, sid: str, *, wait: bool = True) -> bool:
        """Hold ``sid``'s lease (no leases: nothing); :class:`SessionBusy` when another process
        keeps it past the bounded wait. True when it was taken just now (not held before).
        While draining, :class:`ServerDraining`: nothing is made live any more."""
        if self.draining:
            raise ServerDraining(DRAINING)
        leases = self.leases
        if leases is None or leases.held(sid):
            return False
        if not leases.acquire(sid, self.lease_wait_s if wait else 0.0):
            raise SessionBusy(BUSY_ELSEWHERE)
        return True

    def _fence(self, sid: str) -> Fence | None:
        """The fence of ``sid``'s lease held here, for the session made live under it (no leases: None)."""
        leases = self.leases
        return None if leases is None else leases.fence(sid)

    def _unlease(self, *sids: str) -> None:
        """Give back the leases of ``sids`` that are no longer live here (never under the guard)."""
        leases = self.leases
        if leases is None:
            return
        for sid in sids:
            with self._guard:
                if sid in self._entries:
                    continue
            leases.release(sid)

    @contextmanager
    def leased(self, sid: str) -> Iterator[Fence | None]:
        """Hold ``sid``'s lease while its file is read and it is made live (the service's
        reopen and resume) or written without making it live (a rename): what is read is its
        last save, and no other process writes it meanwhile. Gives the lease's fence, which such
        a write carries (None: no leases). Given back on leaving unless ``sid`` became live here."""
        taken = self._lease(sid)
        try:
            yield self._fence(sid)
        finally:
            if taken:
                self._unlease(sid)

    def _autosave_path(self, sid: str) -> Path:
        return self.files.path(sid)

    def __len__(self) -> int:
        with self._guard:
            return len(self._entries)

    def __contains__(self, sid: object) -> bool:
        with self._guard:
            return sid in self._entries

    def live_ids(self, owner: str | None = None) -> list[str]:
        """Ids of the live sessions (of ``owner`` only, when given)."""
        with self._guard:
            return [sid for sid, e in self._entries.items() if owner is None or e.owner == owner]

    def busy_count(self) -> int:
        """Live sessions whose lock an event (a turn) holds now."""
        with self._guard:
            return sum(1 for e in self._entries.values() if e.lock.locked())

    def holds(self, sid: str | None, owner: str) -> bool:
        """True when ``owner`` has ``sid`` live or parked (another owner's id: False)."""
        with self._guard:
            e = self._entries.get(sid or "")
            if e is not None:
                return e.owner == owner
            parked = self._parked.get(sid or "")
            return parked is not None and parked[1] == owner

    def is_live(self, sid: str | None) -> bool:
        """True when ``sid`` is live or parked for anyone (its id is taken)."""
        with self._guard:
            return (sid or "") in self._entries or (sid or "") in self._parked

    def discard(self, sid: str, owner: str, *, timeout: float = 10.0, keep_lease: bool = False) -> bool:
        """Drop ``owner``'s live ``sid`` without saving it (its session is being deleted), once no
        event holds it; whether it was live. :class:`SessionBusy` while a turn still runs.
        ``keep_lease``: its lease stays held (:meth:`deleting` gives it back after the delete)."""
        with self._guard:
            entry = self._entries.get(sid)
        if entry is None or entry.owner != owner:
            return False
        if not entry.lock.acquire(timeout=timeout):
            raise SessionBusy("This chat is busy with a reply; stop it first, then delete it.")
        try:
            with self._guard:
                if self._entries.get(sid) is entry:
                    del self._entries[sid]
                self._parkable.pop(sid, None)
        finally:
            entry.lock.release()
        if not keep_lease:
            self._unlease(sid)
        return True

    @contextmanager
    def deleting(self, sid: str, owner: str) -> Iterator[Fence | None]:
        """For deleting ``owner``'s session ``sid``: hold its lease (waiting, bounded, while another
        process keeps it and asking that one to let go; :class:`SessionBusy` past the wait), drop
        its live copy here unsaved (:class:`SessionBusy` while a turn runs in it, before anything
        is deleted) and give the fence that the delete's writes carry (None: no leases). Without
        the lease, a server that has the session open would save it again after the delete (its
        file and its history rows back), and a deleter whose lease went would delete what the
        new holder writes. The lease is given back on leaving."""
        leases = self.leases
        taken = leases is not None and self._lease(sid)
        live_here = False
        try:
            live_here = self.discard(sid, owner, keep_lease=True)
            self.forget(sid, owner)
            yield self._fence(sid)
        finally:
            if taken or live_here:
                self._unlease(sid)

    def forget(self, sid: str, owner: str) -> bool:
        """Drop ``owner``'s parked (evicted) id, e.g. after its session was deleted."""
        with self._guard:
            parked = self._parked.get(sid)
            if parked is None or parked[1] != owner:
                return False
            del self._parked[sid]
            return True

    # -- caps ----------------------------------------------------------------------
    def _reclaim_empty(self, match: Callable[[Entry], bool], need: int) -> int:
        """Drop up to ``need`` empty, idle-now sessions matching ``match``, oldest first.

        Called with the guard held. An empty session holds nothing to keep (it
        is never written); its browser gets a fresh one at its next message.
        """
        empties = sorted(
            (e for e in self._entries.values()
             if match(e) and not e.session.turns and not e.lock.locked() and not e.claimed),
            key=lambda e: e.last_used,
        )
        n = 0
        for e in empties[:need]:
            self._entries.pop(e.session.id, None)
            self._reclaimed.append(e.session.id)  # their leases go after the guard
            n += 1
        self.reclaimed_total += n
        return n

    def _admit(self, owner: str, client: str | None) -> None:
        """Make room for one more session of ``owner`` from ``client`` or raise SessionLimit
        (guard held)."""
        cap = self.max_per_client
        groups: list[tuple[str, Callable[[Entry], bool]]] = []
        if client is not None:
            groups.append((f"this client ({client})", lambda e: e.client == client))
        if owner != LOCAL_OWNER:
            groups.append((f"user {owner}", lambda e: e.owner == owner))
        for what, match in groups:
            count = sum(1 for e in self._entries.values() if match(e))
            if count >= cap and self._reclaim_empty(match, count - cap + 1) < count - cap + 1:
                raise SessionLimit(
                    f"Too many open chats for {what}: the limit is {cap} "
                    "(ISAGI_MAX_SESSIONS_PER_CLIENT). Close other tabs or wait until idle chats "
                    "are saved and closed (after the idle time), then try again."
                )
        total = len(self._entries)
        if total >= self.max_total:
            need = total - self.max_total + 1
            got = self._reclaim_empty(lambda e: e.owner == owner and e.client == client, need)
            if got < need:
                got += self._reclaim_empty(lambda e: True, need - got)
            if got < need:
                raise SessionLimit(
                    f"The server has the most open chats it keeps ({self.max_total}, "
                    "ISAGI_MAX_SESSIONS). Try again in a few minutes, when idle chats have been "
                    "saved and closed."
                )

    # -- creating and adopting -------------------------------------------------
    def create(self, owner: str = LOCAL_OWNER, client: str | None = None, *, claimed: bool = False) -> str:
        """A new empty session of ``owner`` (autosaving under the sessions directory);
        returns its id. Raises :class:`SessionLimit` at a cap. ``claimed``: made for a turn
        about to run (:attr:`Entry.claimed`)."""
        with self._guard:
            self._admit(owner, client)  # check before building anything
        self._flush_reclaimed()
        session = self.engine.new_session()
        session.owner = owner
        taken = self._lease(session.id, wait=False)  # a fresh id: free at once
        session.lease = self._fence(session.id)
        try:
            with self._guard:
                self._admit(owner, client)
                while session.id in self._entries or session.id in self._parked:
                    if taken:  # a fresh id live meanwhile: nothing was made, ask again
                        raise SessionBusy("This chat is busy with another request; try again in a moment.")
                    session = self.engine.new_session()
                    session.owner = owner
                self._entries[session.id] = Entry(session, owner=owner, client=client, last_used=self._clock(),
                                                  claimed=claimed)
        finally:
            if taken:
                self._unlease(session.id)  # only if it did not become live
            self._flush_reclaimed()
        return session.id

    def adopt(self, session: Session, *, fresh_id: bool = False, owner: str = LOCAL_OWNER,
              client: str | None = None) -> str:
        """Make a loaded or resumed session live as ``owner``'s; returns its id.

        An id that is live or parked (another browser holds it) is replaced by
        a fresh one, so two browsers never share a session: the loaded copy is
        a fork. ``fresh_id=True`` always forks (an uploaded file: continuing
        it must not overwrite the autosave of the session it was saved from).
        The session autosaves to ``sessions_dir/<id>.miku`` from then on.
        Raises :class:`SessionLimit` at a cap.
        """
        files = self.files
        with self._guard:
            self._admit(owner, client)
            if fresh_id:
                session.id = ""
            while not session.id or session.id in self._entries or session.id in self._parked:
                session.id = new_session_id()
        self._flush_reclaimed()
        taken = self._lease(session.id, wait=not fresh_id)  # SessionBusy: open on another server
        session.lease = self._fence(session.id)
        try:
            with self._guard:
                self._admit(owner, client)
                if session.id in self._entries or session.id in self._parked:  # made live meanwhile
                    raise SessionBusy("This chat is busy with another request; try again in a moment.")
                session.owner = owner
                session.miku_path = files.path(session.id)
                self._entries[session.id] = Entry(session, owner=owner, client=client, last_used=self._clock())
        finally:
            if taken:
                self._unlease(session.id)
            self._flush_reclaimed()
        return session.id

    def reopen(self, session: Session, *, owner: str = LOCAL_OWNER, client: str | None = None) -> str:
        """Make ``owner``'s saved ``session`` live again under its own id (a page reload,
        a Resume); returns that id, never a fork.

        If the id is already live or parked for ``owner`` (another tab of the same
        browser got there first), that one is kept and ``session`` is dropped; an id
        live or parked for another owner raises ``KeyError``. Raises
        :class:`SessionLimit` at a cap.
        """
        sid = session.id
        files = self.files
        with self._guard:
            known = sid in self._entries or sid in self._parked
        taken = False if known else self._lease(sid)  # SessionBusy: open on another server
        session.lease = self._fence(sid)
        try:
            with self._guard:
                entry = self._entries.get(sid)
                parked = self._parked.get(sid)
                if entry is not None or parked is not None:
                    holder = entry.owner if entry is not None else parked[1] if parked is not None else None
                    if holder != owner:
                        raise KeyError(sid)
                else:
                    self._admit(owner, client)
                    session.owner = owner
                    session.miku_path = files.path(sid)
                    self._entries[sid] = Entry(session, owner=owner, client=client, last_used=self._clock())
                    return sid
        finally:
            if taken:
                self._unlease(sid)
            self._flush_reclaimed()
        self.entry(sid, owner)  # live: touch it; parked: resume it from its file
        return sid

    # -- parking to make room ----------------------------------------------------------
    def mark_parkable(self, sid: str) -> None:
        """``sid`` was made live (or named) by a stateless client's request: at a cap it may be
        parked to make room for that client's next conversation (:meth:`park_one_parkable`)."""
        with self._guard:
            self._parkable[sid] = None
            if len(self._parkable) > MAX_PARKABLE:  # forget the ids no longer live or parked
                self._parkable = {m: None for m in self._parkable if m in self._entries or m in self._parked}

    def park_one_parkable(self, owner: str, client: str | None) -> bool:
        """Park ``owner``'s least recently used idle parkable session (``client``'s first); whether
        one was. One whose file cannot be written stays live (logged)."""
        with self._guard:
            idle = sorted((e.client != client, e.last_used, sid) for sid, e in self._entries.items()
                          if sid in self._parkable and e.owner == owner and not e.lock.locked())
        for *_, sid in idle:
            try:
                if self.release(sid, park=True, owner=owner):
                    return True
            except IsagiError as exc:  # its file could not be written: it stays live
                log.warning("could not park session %s to make room: %s", sid, exc)
        return False

    # -- using -------------------------------------------------------------------
    def entry(self, sid: str | None, owner: str = LOCAL_OWNER) -> Entry:
        """``owner``'s live entry for ``sid``, resuming a parked (evicted) session from its file.

        An id that is unknown (``None``, or from before a restart without a
        file) or another owner's raises ``KeyError``, the same for both.
        """
        if not sid:
            raise KeyError("no session")
        with self._guard:
            entry = self._entries.get(sid)
            if entry is not None:
                if entry.owner != owner:
                    raise KeyError(sid)
                entry.last_used = self._clock()
                return entry
            if sid not in self._parked or self._parked[sid][1] != owner:
                raise KeyError(sid)
            path = self._parked[sid][0]
        # Resume outside the guard (file I/O); another thread may race us: first one wins.
        # With a shared store its lease comes first, so the file read is its last save.
        taken = self._lease(sid)
        try:
            files = self.files
            if path is not None and files.modified(path) is not None:
                session = self._load_fn()(self.engine.frame, Path(path), session_id=sid)
                session.miku_path = Path(path)
            else:
                session = self.engine.new_session(session_id=sid)
            session.owner = owner
            session.lease = self._fence(sid)
            with self._guard:
                entry = self._entries.get(sid)
                if entry is None:
                    entry = Entry(session, owner=owner, last_used=self._clock())
                    self._entries[sid] = entry
                    self._parked.pop(sid, None)
                elif entry.owner != owner:
                    raise KeyError(sid)
                entry.last_used = self._clock()
                return entry
        finally:
            if taken:
                self._unlease(sid)

    def ensure(self, sid: str | None, owner: str = LOCAL_OWNER, client: str | None = None) -> tuple[str, Entry]:
        """``owner``'s entry for ``sid``, or a brand-new session when ``sid`` is unknown
        (or another owner's)."""
        if sid:
            with contextlib.suppress(KeyError):
                return sid, self.entry(sid, owner)
        new = self.create(owner, client)
        return new, self.entry(new, owner)

    @contextmanager
    def using(self, sid: str, *, timeout: float = 30.0, owner: str = LOCAL_OWNER) -> Iterator[Entry]:
        """Hold ``owner``'s session's lock (one event at a time); raise :class:`SessionBusy` on timeout."""
        with self.held(lambda: self.entry(sid, owner), owner, timeout=timeout) as entry:
            yield entry

    @contextmanager
    def held(self, look_up: Callable[[], Entry], owner: str, *, timeout: float = 30.0) -> Iterator[Entry]:
        """:meth:`holding` the entry ``look_up()`` gives; one parked while its lock was awaited
        (handed over to another server that asked for it, or saved idle) is looked up again,
        which resumes it (taking its lease back: the other server is asked in turn)."""
        with contextlib.ExitStack() as stack:
            for attempt in range(HOLD_TRIES):
                entry = look_up()
                try:
                    held = stack.enter_context(self.holding(entry, timeout=timeout))
                except KeyError:
                    if attempt + 1 < HOLD_TRIES and self.holds(entry.session.id, owner):
                        continue
                    raise
                yield held
                return

    @contextmanager
    def holding(self, entry: Entry, *, timeout: float = 30.0) -> Iterator[Entry]:
        """Hold the lock of ``entry`` (looked up already); :class:`SessionBusy` on timeout, and
        :class:`KeyError` when it was dropped meanwhile (an empty one reclaimed at a cap);
        :class:`ServerDraining` once the server drains."""
        if self.draining:
            raise ServerDraining(DRAINING)
        if not entry.lock.acquire(timeout=timeout):
            raise SessionBusy("This chat is busy with another request; try again in a moment.")
        try:
            with self._guard:
                current = self._entries.get(entry.session.id) is entry
            if not current:
                raise KeyError(entry.session.id)
            self._still_leased(entry)
            entry.last_used = self._clock()
            entry.claimed = False
            yield entry
        finally:
            entry.last_used = self._clock()
            lease = entry.session.lease
            moved = lease is not None and lease.lost  # a write of this event was refused: taken over
            if moved:
                self._drop_moved(entry)
            entry.lock.release()

    def _still_leased(self, entry: Entry) -> None:
        """With leases: :class:`~isagi.errors.SessionMoved` (and the entry dropped unsaved) when
        this process has lost the session's lease (its connection broke and another server may
        have taken it), or a write of it found that another server did."""
        leases = self.leases
        sid = entry.session.id
        if leases is None:
            return
        lease = entry.session.lease
        if not (lease is not None and (lease.lost or leases.fence(sid) is not lease)) and leases.confirm(sid):
            return
        self._drop_moved(entry)
        raise SessionMoved()

    def _drop_moved(self, entry: Entry) -> None:
        """Another server has (or may have) taken ``entry``'s session over: drop it here unsaved
        and forget its lease (the caller holds its lock)."""
        sid = entry.session.id
        with self._guard:
            mine = self._entries.get(sid) is entry
            if mine:
                del self._entries[sid]
                self._parkable.pop(sid, None)
        if mine:
            log.warning("lost the lease of session %s: dropped here unsaved (another server holds it now)", sid)
            self._unlease(sid)

    def _live(self, sid: str | None, owner: str) -> Entry | None:
        with self._guard:
            entry = self._entries.get(sid or "")
        return entry if entry is not None and entry.owner == owner else None

    def live_entry(self, sid: str | None, owner: str) -> Entry | None:
        """``owner``'s live entry for ``sid``, or None (parked, unknown, another's): nothing is
        resumed and the entry is not touched (a page's periodic check keeps nothing alive)."""
        return self._live(sid, owner)

    # -- pages ---------------------------------------------------------------------
    def attach(self, page: str, sid: str | None) -> None:
        """The browser page ``page`` (its Gradio session hash) now shows ``sid`` (None: nothing)."""
        if not page:
            return
        with self._guard:
            if sid:
                self._pages.pop(page, None)
                self._pages[page] = sid
                while len(self._pages) > MAX_PAGES:  # pages whose close never reached the server
                    self._pages.pop(next(iter(self._pages)))
            else:
                self._pages.pop(page, None)

    def detach(self, page: str, owner: str | None) -> str | None:
        """The page ``page`` was closed (or reloaded): a turn it runs is stopped after its current
        token (recorded as cancelled, as Stop does; a reloaded page shows it so); when no other
        page shows its session, save and park it (:meth:`release`), so it is no longer live; a reload resumes it from its file.
        Returns the id parked, or None (no session, another page still shows it, in use, or the
        save failed: then it stays live)."""
        with self._guard:
            sid = self._pages.pop(page, None)
            running = [e for e in self._entries.values()
                       if page and e.turn_page == page and e.owner == owner and e.lock.locked()]
            if sid is None or sid in self._pages.values():
                sid = None
        for entry in running:  # the turn that page ran ends now, recorded as stopped
            if not entry.stop.is_set():
                entry.stop_requested_at = time.monotonic()
            entry.stop.set()
        if sid is None:
            return None
        try:
            if not self.release(sid, park=True, owner=owner, unless_shown=True):
                return None
            if not self._entries:  # the last open chat closed: nothing of the model's state is kept
                self._when_idle()
            return sid
        except Exception as exc:  # a failed save keeps it live (release says so); nobody to tell
            log.warning("could not park session %s after its page closed: %s", sid, exc)
            return None

    def request_stop(self, sid: str | None, owner: str = LOCAL_OWNER) -> bool:
        """Ask ``owner``'s running turn of ``sid`` (if any) to stop after its current token."""
        entry = self._live(sid, owner)
        if entry is None:
            return False
        if not entry.stop.is_set():
            entry.stop_requested_at = time.monotonic()
        entry.stop.set()
        return entry.lock.locked()

    def wait_until_free(self, sid: str | None, timeout: float, owner: str = LOCAL_OWNER) -> bool:
        """Wait until no event holds the session (True) or ``timeout`` passes (False)."""
        entry = self._live(sid, owner)
        if entry is None:
            return True
        if entry.lock.acquire(timeout=timeout):
            entry.lock.release()
            return True
        return False

    # -- saving and dropping -----------------------------------------------------
    def persist(self, entry: Entry) -> Path | None:
        """Write a held entry's session to its file now (a change outside a turn, e.g. a rename);
        the caller holds its lock (:meth:`using`). Raises when the file cannot be written."""
        return self._persist(entry)

    def _persist(self, entry: Entry) -> Path | None:
        """Write the session's file (if it has turns), then let the engine's keeper bring the
        history up to it (turns a full disk held back); raises when the file cannot be written."""
        session = entry.session
        if not session.turns:
            return None  # nothing to keep: an empty chat is not written
        self._still_leased(entry)  # never overwrite what another server now writes
        path = session.miku_path or self._autosave_path(session.id)
        engine = self.engine
        try:
            self._save_fn()(engine.frame, session, Path(path))  # fenced: SessionMoved once taken over
        except SessionMoved:
            self._drop_moved(entry)
            raise
        if engine.keep is not None:
            engine.keep.saved(session)  # a history that still cannot take them keeps them waiting (and logs it)
        if session.lease is not None and session.lease.lost:  # the history's write found it taken over
            self._drop_moved(entry)
            raise SessionMoved()
        return Path(path)

    def retry_saves(self) -> list[str]:
        """Save again every live session whose last save failed (the engine's keeper remembers
        them), each under its lock (one in use is tried at the next round); the ids written."""
        try:
            keep = self.engine.keep
        except Exception:  # still loading
            return []
        if keep is None:
            return []
        unsaved = keep.unsaved
        with self._guard:
            entries = [e for e in self._entries.values() if unsaved(e.session)]
        done: list[str] = []
        for entry in entries:
            if not entry.lock.acquire(blocking=False):
                continue
            try:
                if not unsaved(entry.session):
                    continue  # a turn saved it meanwhile
                self._persist(entry)
            except Exception as exc:  # still no room: the next round tries again
                log.debug("session %s still cannot be saved: %s", entry.session.id, exc)
                continue
            finally:
                entry.lock.release()
            entry.notice, entry.resaved = None, True
            done.append(entry.session.id)
        if done:
            log.info("saved %d session(s) that a failed save had left in memory", len(done))
        return done

    def retry_history(self) -> int:
        """Ask the engine's keeper to write the history rows a full disk held back; returns how
        many still wait (0 also while the engine loads or when it keeps no backlog)."""
        try:
            keep = self.engine.keep
        except Exception:  # still loading
            return 0
        if keep is None:
            return 0
        left = keep.retry()
        # a turn whose notice said its history rows wait, now written: the page and the API say so
        with self._guard:
            told = [e for e in self._entries.values() if e.notice and not e.resaved]
        for entry in told:
            if not keep.unsaved(entry.session) and keep.waiting(entry.session) == 0:
                entry.notice, entry.resaved = None, True
        return left

    def release(self, sid: str | None, *, park: bool = False, owner: str | None = LOCAL_OWNER,
                unless_shown: bool = False, timeout: float = 10.0) -> bool:
        """Save (if it has turns) and drop ``owner``'s ``sid`` now.

        ``park=True`` keeps the id resumable by its holder (as idle eviction
        does); the default forgets it: the browser that held it has moved on
        (New chat, a loaded file, a closed tab), so resuming it from the
        history later keeps its id instead of forking it. ``owner=None`` is
        for the server itself (a closed tab's state): any owner.

        A session whose file cannot be written (a full disk) stays live, so
        nothing is lost: idle eviction and shutdown try again. The caller is
        told with the :class:`~isagi.errors.StorageError`, except the server
        itself (``owner=None``), for which it is logged and False returned.
        ``unless_shown``: left live (False) when a page shows it by the time its lock is free (a
        reloaded page that opened it while its turn ended). ``timeout``: how long to wait for a
        turn in it to end (then False: left live).
        """
        with self._guard:
            entry = self._entries.get(sid or "")
        if entry is None or (owner is not None and entry.owner != owner):
            return False
        if not entry.lock.acquire(timeout=timeout):
            return False  # busy: idle eviction will save and drop it later
        try:
            if unless_shown:
                with self._guard:
                    if entry.session.id in self._pages.values():
                        return False
            try:
                path = self._persist(entry)
            except SessionMoved:  # taken over by another server: dropped here (logged)
                if owner is None:
                    return False
                raise
            except Exception as exc:  # kept live: dropping it would lose it
                log.warning("could not save session %s on release (%s); kept in memory", entry.session.id, exc)
                if owner is None:
                    return False
                raise
            with self._guard:
                self._entries.pop(entry.session.id, None)
                if park:
                    self._parked[entry.session.id] = (path, entry.owner)
        finally:
            entry.lock.release()
        self._unlease(entry.session.id)
        return True

    def hand_over(self, sid: str) -> None:
        """Another process waits for the lease of ``sid``, live here (its requests go there now):
        save and park it once no turn runs in it (within :data:`HAND_OVER_WAIT_S`), on a thread
        of its own, so that process takes it over from that save. Called by the leases' listener."""
        with self._guard:
            if sid not in self._entries or sid in self._handing:
                return
            self._handing.add(sid)

        def run() -> None:
            try:
                if self.release(sid, park=True, owner=None, timeout=HAND_OVER_WAIT_S):
                    log.info("session %s handed over to another server that asked for it", sid)
            except Exception as exc:  # kept live here: that server's wait ends as busy
                log.warning("could not hand session %s over: %s", sid, exc)
            finally:
                with self._guard:
                    self._handing.discard(sid)

        threading.Thread(target=run, name="isagi-hand-over", daemon=True).start()

    def drain(self, within_s: float, stop: Callable[[], bool] = lambda: False) -> Drained:
        """SIGTERM: from now on no turn starts and no session is made live here
        (:class:`ServerDraining`); each live session is saved, parked and its lease given back
        as soon as no turn runs in it, until none is left, ``within_s`` seconds have passed, or
        ``stop()`` says so (a second signal). What is left live the shutdown saves as before."""
        self.draining = True
        deadline = time.monotonic() + max(0.0, within_s)
        out = Drained()
        failed: set[str] = set()
        while True:
            with self._guard:
                live = [(sid, e) for sid, e in self._entries.items() if sid not in failed]
            for sid, entry in live:
                if entry.lock.locked():
                    continue  # a turn runs: the next round looks again
                if self.release(sid, park=True, owner=None, timeout=0):
                    out.released.append(sid)
                    continue
                with self._guard:
                    still = self._entries.get(sid) is entry
                if still and not entry.lock.locked():
                    failed.add(sid)  # its save failed (logged): the shutdown's save_all tries again
            if not live or time.monotonic() >= deadline or stop():
                break
            time.sleep(DRAIN_POLL_S)
        out.left = self.live_ids()
        return out

    def evict_idle(self, now: float | None = None) -> list[str]:
        """Save and drop every session idle for longer than ``idle_s``; returns their ids.

        A session in use (its lock held) is never evicted. A failed save keeps
        the session in memory (nothing is lost) and is logged.
        """
        now = self._clock() if now is None else now
        with self._guard:
            candidates = [
                (sid, e) for sid, e in self._entries.items() if now - e.last_used > self.idle_s
            ]
        evicted: list[str] = []
        for sid, entry in candidates:
            if not entry.lock.acquire(blocking=False):
                continue
            try:
                if now - entry.last_used <= self.idle_s:
                    continue  # used meanwhile
                try:
                    path = self._persist(entry)
                except SessionMoved:  # taken over by another server: dropped here (logged)
                    continue
                except Exception as exc:  # keep it live: dropping would lose it
                    log.warning("could not save idle session %s (%s); kept in memory", sid, exc)
                    continue
                with self._guard:
                    if self._entries.get(sid) is entry:
                        del self._entries[sid]
                        self._parked[sid] = (path, entry.owner)
                        evicted.append(sid)
            finally:
                entry.lock.release()
        self.evicted_total += len(evicted)
        self._unlease(*evicted)
        if evicted:
            self._when_idle()
        return evicted

    def _when_idle(self) -> None:
        """Sessions were dropped: with none live any more, the engine's saved states of past
        conversations go too (a closed session keeps nothing model-sized), then the freed memory
        goes back to the system."""
        with self._guard:
            idle = not self._entries
        if idle:
            try:
                freed = self.engine.lm.forget_saved_states()
            except Exception as exc:  # still loading, or a stand-in engine: nothing to forget
                log.debug("could not forget the engine's saved states: %s", exc)
            else:
                if freed:
                    log.info("no session is open: dropped %.0f MiB of saved model states", freed / 2**20)
        give_back_memory()

    def start_reaper(self, interval_s: float = 60.0, retry_s: float = SAVE_RETRY_S) -> None:
        """In a daemon thread: :meth:`retry_saves` and :meth:`retry_history` every ``retry_s``
        seconds, :meth:`evict_idle` every ``interval_s``."""
        if self._reaper is not None:
            return
        self._reaper_stop.clear()

        def loop() -> None:
            step = min(interval_s, retry_s)
            next_evict = time.monotonic() + interval_s
            while not self._reaper_stop.wait(step):
                try:
                    self.retry_saves()
                    self.retry_history()
                    if self._clock() >= next_evict:
                        next_evict = time.monotonic() + interval_s
                        self.evict_idle()
                except Exception as exc:  # the reaper must survive a bad session
                    log.warning("idle eviction failed: %s", exc)

        self._reaper = threading.Thread(target=loop, name="isagi-session-reaper", daemon=True)
        self._reaper.start()

    def stop_reaper(self) -> None:
        self._reaper_stop.set()
        if self._reaper is not None:
            self._reaper.join(timeout=5)
        self._reaper = None

    def save_all(self) -> int:
        """Save every live session that has turns (on shutdown); returns how many."""
        n = 0
        for sid in self.live_ids():
            with self._guard:
                entry = self._entries.get(sid)
            if entry is None or not entry.lock.acquire(timeout=5):
                continue
            try:
                if self._persist(entry) is not None:
                    n += 1
            except Exception as exc:
                log.warning("could not save session %s on shutdown: %s", sid, exc)
            finally:
                entry.lock.release()
        return n

    def close(self) -> None:
        """At shutdown, after :meth:`save_all`: nothing is live here any more, and every lease
        goes back, so another server takes these sessions over at once."""
        with self._guard:
            ids = list(self._entries)
            self._entries.clear()
        self._unlease(*ids)
