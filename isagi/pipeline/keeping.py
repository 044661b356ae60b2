"""Where a finished turn is kept: the session's autosaved file, then the history store.

Owns :class:`TurnKeeper`, the object :class:`isagi.pipeline.engine.Engine` is given to
persist each turn (the engine itself imports neither the history store nor
:mod:`isagi.session.files`, so the two never import each other), and
:func:`reconcile_history`, the start-up repair that brings the history store
level with the files.

The ``.miku`` file is the source of truth. It holds the living state (metric,
memory, basis) and every turn with all its figures, so the history's rows can
always be rebuilt from it, while the living state can never be rebuilt from
the history. So a turn is written to the file first (atomically, with all
turns so far) and only then to the history store, and the history never holds
a turn the file lacks: a kill between the two leaves the history behind the
file, never ahead of it, and :func:`reconcile_history` adds what it lacks at
the next start.

A turn the history store cannot take (a full disk, a read-only database) is
not lost: it waits in the keeper's backlog, in order, and is written before
the next turn of that session, by :meth:`TurnKeeper.retry` (which the web
app calls every few seconds), or from the file at the next start. A turn whose
file cannot be written stays in the live session, which the next save writes
whole; its history rows wait until then. The keeper remembers such a session
(:meth:`TurnKeeper.unsaved`), and the web app saves it again every few seconds
(:meth:`isagi.session.registry.SessionRegistry.retry_saves`), so a turn is kept only in
memory no longer than the disk stays full. Either way the keeper returns a
plain notice saying so (:func:`isagi.errors.not_saved_notice`: the file was not
written, the next message saves it again), and never raises for it, whatever
the failure: the turn happened and is shown, and the session is never rolled
back for it. Regenerate *replaces* the session's last exchange in the store, so the
store, the live session and the file count the same turns.

With session files several servers share, a live session carries its lease's fence
(:attr:`Session.lease <isagi.session.state.Session.lease>`) and both writes carry it: once
another server has taken the session over, the file write or the history write is refused
(:class:`~isagi.errors.SessionMoved`). That is not a storage failure to retry: the keeper
forgets what of the session waits, writes nothing more of it, and returns the "moved" notice
(:data:`isagi.errors.MOVED`; :data:`~isagi.errors.MOVED_SAVED` when the file was written before
the takeover, so the new holder has the turn); the registry then drops the session here. The start-up repair
holds each session's lease while it repairs it and carries that lease's fence the same way:
a repair whose lease connection broke while another server took the session over adds no
row after that server's (it leaves the session to that server's own saves).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from isagi.errors import (
    MOVED_SAVED,
    IsagiError,
    SessionMoved,
    StorageError,
    not_saved_notice,
    retry_when,
    storage_cause,
)

if TYPE_CHECKING:
    from isagi.session.files import SessionFrame
    from isagi.session.lease import Hold
    from isagi.session.state import Session
    from isagi.session.store import SessionStore
    from isagi.session.turn import Turn
    from isagi.storage.fences import Fence
    from isagi.storage.history import HistoryStore

log = logging.getLogger(__name__)

SaveFile = Callable[["Session", Path], None]
MAX_TRACKED = 4096  # sessions whose history count the keeper remembers (a bound for a long-running server)
FLUSH_BATCH = 500  # appended exchanges written per transaction (a loaded session may bring thousands)


class Keeper(Protocol):
    """What keeps a session's turns: the seam between the turn pipeline (which calls it for
    each recorded turn) and the files and history store (which it writes). :class:`TurnKeeper`
    is the one implementation; the engine and the session registry know only this."""

    def __call__(self, session: Session, turn: Turn, *, replaces_from: int | None = None) -> str | None:
        """Persist ``turn``, just recorded in ``session``; a notice for the user when part waits.
        ``replaces_from``: the turn's position, when it replaces every exchange kept from there on
        (Regenerate: the last one; an edited message: it and all after it); None: appended."""

    def adopted(self, session: Session) -> str | None:
        """Persist a session just opened from a file under a new id, every turn of it."""

    def saved(self, session: Session) -> str | None:
        """The session's file was written by someone else: bring the history up to it."""

    def unsaved(self, session: Session) -> bool:
        """Whether the session's last save failed (it is kept only in memory until saved)."""

    def retry(self) -> int:
        """Write the history rows that wait; how many still wait."""

    def waiting(self, session: Session) -> int:
        """How many of the session's exchanges the history does not hold yet."""


@dataclass
class _Backlog:
    """One session's exchanges the history store does not hold yet, oldest first."""

    session: Session
    # (turn, the position from which it replaces the kept exchanges, or None: appended)
    ops: list[tuple[Turn, int | None]] = field(default_factory=list)
    counted: bool = False  # the store's own count was read, and what it lacked before is in ops
    filed: bool = True  # the session's file holds every turn in ops (the history may follow)
    lock: threading.Lock = field(default_factory=threading.Lock)


class TurnKeeper:
    """Persist a turn: the autosave (``save``) first, then the history rows (``store``, optional).

    ``save(session, path)`` writes the session's file; the engine's default is
    :func:`isagi.session.files.save_session` bound to the engine's frame. Calling the
    keeper returns ``None`` when everything is kept, else a notice for the
    user (no server path or URL in it) that says what waits and until when.
    """

    def __init__(self, store: HistoryStore | None = None, save: SaveFile | None = None, *, model_id: str = "") -> None:
        self.store = store
        self.save = save
        self.model_id = model_id
        self._told: dict[tuple[str, str], str] = {}  # (owner, session id) -> the file path the store holds
        self._backlogs: dict[tuple[str, str], _Backlog] = {}  # only sessions with exchanges waiting
        # sessions whose history the keeper has brought level once (so a new backlog of theirs need
        # not count the store's rows again); ids only: a settled session is not held in memory
        self._counted: OrderedDict[tuple[str, str], None] = OrderedDict()
        # sessions whose last save failed (a full disk): whoever holds them saves them again
        # (the web registry every few seconds, isagi.pipeline.keeping's module docstring)
        self._unsaved: dict[tuple[str, str], Session] = {}
        self._guard = threading.Lock()  # protects the dicts, never held during I/O

    def __call__(self, session: Session, turn: Turn, *, replaces_from: int | None = None) -> str | None:
        backlog = None
        while self.store is not None:
            backlog = self._backlog(session)
            with backlog.lock:
                with self._guard:
                    current = self._backlogs.get((session.owner, session.id)) is backlog
                if current:  # not settled away meanwhile (by a retry on another thread)
                    backlog.ops.append((turn, replaces_from))
                    break
        return self._autosave(session, backlog)

    def adopted(self, session: Session) -> str | None:
        """A session made live from a file under a new id (a loaded ``.miku``): write its own file
        and record every turn of it in the history now, so the history lists it before its next
        turn. Returns a notice as a turn's keeping does (None: all kept)."""
        if not session.turns:
            return None
        backlog = self._backlog(session) if self.store is not None else None
        return self._autosave(session, backlog)

    def _autosave(self, session: Session, backlog: _Backlog | None) -> str | None:
        """Write the session's file, then bring the history up to it; a notice when either waits."""
        if self.save is not None and session.miku_path is not None:
            try:
                self.save(session, Path(str(session.miku_path)))
            except SessionMoved as exc:  # another server holds it now: nothing more of it is written here
                self._forget(session)
                log.warning("session %s was taken over by another server: its last turn was not saved here",
                            session.id)
                return str(exc)
            except Exception as exc:  # any failure: the file was not written; the turns wait in memory
                with self._guard:
                    self._unsaved[(session.owner, session.id)] = session
                if isinstance(exc, StorageError | OSError):
                    log.warning("could not save session %s to %s: %s", session.id, session.miku_path, exc)
                else:
                    log.exception("could not save session %s to %s", session.id, session.miku_path)
                if backlog is not None:
                    backlog.filed = False  # the history never gets ahead of the file
                cause = storage_cause(exc) if isinstance(exc, StorageError | OSError) \
                    else f"an unexpected error, {type(exc).__name__}"
                return not_saved_notice(cause)
        return self.saved(session)

    def saved(self, session: Session) -> str | None:
        """The session's file now holds all its turns: bring the history up to it.

        Called after each turn's save, and by whoever else writes a session's
        whole file (idle eviction, shutdown). Returns a notice, or None when the
        history holds every turn.
        """
        with self._guard:
            self._unsaved.pop((session.owner, session.id), None)
        if self.store is None:
            return None
        with self._guard:
            backlog = self._backlogs.get((session.owner, session.id))
        if backlog is None:
            return None
        backlog.filed = True
        exc = self._flush(backlog)
        if exc is None:
            self._tell_path(session)
            self._settle(backlog)
            return None
        if isinstance(exc, SessionMoved):  # its file was written before another server took it over
            self._forget(session)
            return MOVED_SAVED  # so the turn is in the chat that server continues
        waiting = len(backlog.ops)
        cause = storage_cause(exc)
        turns = "This turn is" if waiting == 1 else f"These {waiting} turns are"
        return (f"The history could not record this turn ({cause}). {turns} kept in the chat's saved "
                f"file and will be added to the history with your next message, or at the server's next "
                f"start, {retry_when(cause)}.")

    def retry(self) -> int:
        """Write every waiting exchange whose file is written (e.g. once the disk has room again);
        returns how many exchanges still wait."""
        with self._guard:
            backlogs = [b for b in self._backlogs.values() if b.ops and b.filed]
        for b in backlogs:
            exc = self._flush(b)
            if exc is None:
                self._tell_path(b.session)
                self._settle(b)
            elif isinstance(exc, SessionMoved):
                self._forget(b.session)
        with self._guard:
            return sum(len(b.ops) for b in self._backlogs.values())

    def unsaved(self, session: Session) -> bool:
        """Whether ``session``'s last save failed and nothing has written its file since."""
        with self._guard:
            return self._unsaved.get((session.owner, session.id)) is session

    def waiting(self, session: Session) -> int:
        """How many of ``session``'s exchanges the history store does not hold yet."""
        with self._guard:
            backlog = self._backlogs.get((session.owner, session.id))
        return 0 if backlog is None else len(backlog.ops)

    # -- plumbing ------------------------------------------------------------------
    def _backlog(self, session: Session) -> _Backlog:
        key = (session.owner, session.id)
        with self._guard:
            backlog = self._backlogs.get(key)
            if backlog is None or backlog.session is not session:
                ops = backlog.ops if backlog is not None else []
                counted = backlog.counted if backlog is not None else key in self._counted
                backlog = _Backlog(session, ops=ops, counted=counted)
                self._backlogs[key] = backlog
            return backlog

    def _settle(self, b: _Backlog) -> None:
        """``b`` has nothing waiting: forget it (and with it its session, which a parked or
        closed chat must not keep in memory), remembering only that its history is level."""
        key = (b.session.owner, b.session.id)
        with b.lock, self._guard:
            if b.ops or self._backlogs.get(key) is not b:
                return
            del self._backlogs[key]
            self._counted[key] = None
            self._counted.move_to_end(key)
            while len(self._counted) > MAX_TRACKED:
                self._counted.popitem(last=False)

    def _forget(self, session: Session) -> None:
        """``session`` was taken over by another server: what of it waits here is never written,
        and nothing about it is remembered (if it comes back here, it is counted afresh)."""
        key = (session.owner, session.id)
        with self._guard:
            backlog = self._backlogs.get(key)
            if backlog is not None and backlog.session is session:
                del self._backlogs[key]  # (a flush of it in progress is refused: its fence is lost)
            if self._unsaved.get(key) is session:
                del self._unsaved[key]
            self._counted.pop(key, None)
            self._told.pop(key, None)

    def _flush(self, b: _Backlog) -> IsagiError | None:
        """Write ``b``'s waiting exchanges in order; the first failure stops it and is returned
        (a :class:`~isagi.errors.SessionMoved`: none of them may be written by this server)."""
        session, store = b.session, self.store
        if store is None:  # (a keeper without a store has no backlogs)
            return None
        with b.lock:
            try:
                if not b.counted:
                    # A session new to this keeper: the store may lack more than this turn
                    # (a loaded file's earlier turns under a fresh id), so the whole
                    # conversation is what the store must end up holding.
                    n = store.exchange_count(session.id, owner=session.owner)
                    appended = sum(1 for _, at in b.ops if at is None)
                    earlier = session.turns[n:max(n, len(session.turns) - appended)]
                    b.ops[:0] = [(t, None) for t in earlier]
                    b.counted = True
                while b.ops:
                    if b.ops[0][1] is not None:  # Regenerate, an edit: the exchanges from there on replaced
                        _n, created = store.record_exchange(
                            session.id, b.ops[0][0], owner=session.owner, model_id=self.model_id,
                            title=session.title, replace_from=b.ops[0][1], fence=session.lease)
                        done = 1
                    else:  # appended turns (a loaded file's earlier ones too): a transaction per batch
                        run = []
                        for turn, at in b.ops[:FLUSH_BATCH]:
                            if at is not None:
                                break
                            run.append(turn)
                        _n, created = store.record_exchanges(
                            session.id, run, owner=session.owner, model_id=self.model_id, title=session.title,
                            fence=session.lease)
                        done = len(run)
                    del b.ops[:done]
                    if created:
                        with self._guard:
                            self._told.pop((session.owner, session.id), None)
            except SessionMoved as exc:
                log.warning("session %s was taken over by another server: %d exchange(s) not written here",
                            session.id, len(b.ops))
                b.ops.clear()
                return exc
            except StorageError as exc:
                log.warning("history write for session %s failed (%d exchange(s) wait): %s",
                            session.id, len(b.ops), exc)
                return exc
        return None

    def _tell_path(self, session: Session) -> None:
        """Tell the store where the session's file is, when it is new to it."""
        if self.store is None or self.save is None or session.miku_path is None:
            return
        key, path = (session.owner, session.id), str(session.miku_path)
        with self._guard:
            if self._told.get(key) == path:
                return
        try:
            self.store.set_miku_path(session.id, path, owner=session.owner, fence=session.lease)
        except SessionMoved:  # the new holder tells it
            return
        except StorageError as exc:  # told again after the next turn
            log.warning("could not record the file of session %s: %s", session.id, exc)
            return
        with self._guard:
            if len(self._told) >= MAX_TRACKED:
                self._told.clear()
            self._told[key] = path


def default_keeper(frame: Callable[[], SessionFrame], store: HistoryStore | None, *, model_id: str,
                   files: SessionStore | None = None) -> TurnKeeper:
    """The keeper an engine started by :meth:`isagi.pipeline.engine.Engine.start` uses: files
    written with :func:`isagi.session.files.save_session` under the engine's ``frame()``, into
    ``files`` (the session store: the sessions directory or the database the replicas share; a
    path outside it, e.g. ``isagi chat --save``, stays a local file); None: local files. With
    the database, the history store is told where the leases' epochs are, so that its writes of
    a leased session are fenced too (:meth:`storage.history.HistoryStore.use_leases`)."""
    from isagi.session.dbstore import DatabaseSessionFiles
    from isagi.session.files import save_session

    if store is not None and isinstance(files, DatabaseSessionFiles):
        store.use_leases(files.engine)

    return TurnKeeper(store, lambda session, path: save_session(frame(), session, path, files=files),
                      model_id=model_id)


# --------------------------------------------------------------------------- the start-up repair


@dataclass
class Reconciled:
    """What :func:`reconcile_history` found and did, per session id."""

    checked: int = 0  # session files read (those written after their history's last record)
    added: dict[str, int] = field(default_factory=dict)  # exchanges added to the history
    replaced: list[str] = field(default_factory=list)  # last exchange replaced (a Regenerate)
    history_ahead: dict[str, int] = field(default_factory=dict)  # history rows beyond the file
    disagree: list[str] = field(default_factory=list)  # differ before their ends: left alone
    skipped: dict[str, str] = field(default_factory=dict)  # file -> why it was not used
    held_elsewhere: list[str] = field(default_factory=list)  # open on a server (its lease): left to it

    @property
    def repaired(self) -> int:
        return len(self.added) + len(self.replaced)

    def lines(self) -> list[str]:
        """One line per kind of finding, for the log and the terminal (none: nothing to say)."""
        out: list[str] = []
        if self.added:
            n = sum(self.added.values())
            out.append(f"start-up check: the history of {len(self.added)} session(s) was behind its saved file "
                       f"(a save ended early); {n} exchange(s) added from the files: "
                       + ", ".join(sorted(self.added)))
        if self.replaced:
            out.append(f"start-up check: the last exchange of {len(self.replaced)} session(s) replaced from the "
                       "file (a Regenerate ended early): " + ", ".join(sorted(self.replaced)))
        if self.history_ahead:
            out.append(f"start-up check: the history of {len(self.history_ahead)} session(s) holds exchanges its "
                       "file lacks (written by an older version); kept in the history, not in the living state: "
                       + ", ".join(f"{k} (+{v})" for k, v in sorted(self.history_ahead.items())))
        if self.disagree:
            out.append(f"start-up check: {len(self.disagree)} session(s) differ between history and file before "
                       "their last exchange; both left as they are: " + ", ".join(sorted(self.disagree)))
        if self.held_elsewhere:
            out.append(f"start-up check: {len(self.held_elsewhere)} session(s) open on another ISAGI server "
                       "left to it (its own saves bring their history up to their files)")
        for name, why in sorted(self.skipped.items()):
            out.append(f"start-up check: {name} not checked: {why}")
        return out


def reconcile_history(store: HistoryStore, sessions_dir: str | Path, *, files: SessionStore | None = None) -> Reconciled:
    """Bring the history store level with the autosaved ``.miku`` files (the source of truth).

    Reads only the files written after their session's last history record
    (or with no history at all): in step, a file is always written before its
    history rows. For each, the history's exchanges are compared with the
    file's turns: missing ones are added (a file without a history row gets
    one, as the owner the file names), a last exchange that differs is
    replaced (an interrupted Regenerate); anything else is reported and left
    alone, so nothing is ever deleted. Run only while no other process writes
    the data directory (:class:`isagi.datadir.DataDir` says whether). ``files``: the session
    store holding them (default: the directory ``sessions_dir``); with one shared by replicas,
    a session another server holds is left to it, and each one repaired is held (its lease)
    while it is (:func:`isagi.session.lease.maintenance_holds`).
    """
    from isagi.session.folder import SessionFiles
    from isagi.session.lease import maintenance_holds

    report = Reconciled()
    store_files: SessionStore = files if files is not None else SessionFiles(Path(sessions_dir))
    try:
        paths = store_files.all()
    except OSError:
        return report
    if not paths:
        return report
    with maintenance_holds(store_files, store) as hold:
        return _reconcile(store, store_files, paths, hold, report)


def _reconcile(store: HistoryStore, store_files: SessionStore, paths: list[Path], hold: Hold,
               report: Reconciled) -> Reconciled:
    times = store.session_times()
    for path in paths:
        sid = path.stem
        known = times.get(sid)
        written = store_files.modified(path)
        if known is not None and written is not None and written <= known[1].timestamp():
            continue  # written before its history's last record: in step
        with hold(sid) as claim:
            if not claim.free:  # open on a server, whose own saves bring its history up to its file
                report.held_elsewhere.append(sid)
                continue
            report.checked += 1
            try:
                _reconcile_one(store, store_files, path, known, report, claim.fence)
            except SessionMoved:  # its lease went mid-repair and a server took it: its own saves repair it
                report.held_elsewhere.append(sid)
    return report


def _reconcile_one(store: HistoryStore, store_files: SessionStore, path: Path, known: tuple[str, Any] | None,
                   report: Reconciled, fence: Fence | None = None) -> None:
    """:func:`reconcile_history` for one session file written after its history's last record.
    ``fence``: the repair's lease of the session (a shared store): its history writes happen
    only while it is current (:class:`~isagi.errors.SessionMoved` otherwise, nothing written)."""
    from isagi.session.turn import turns_from_messages

    sid = path.stem
    try:
        state = store_files.read(path)
    except StorageError as exc:
        report.skipped[path.name] = f"unreadable ({exc})"
        return
    extra = state.extra
    if extra.get("session_id") != sid:
        report.skipped[path.name] = "its session id is not its name"
        return
    owner = known[0] if known is not None else extra.get("owner")
    if known is not None and extra.get("owner") not in (None, known[0]):
        report.skipped[path.name] = "its owner differs from the history's"
        return
    if not isinstance(owner, str) or not owner:
        report.skipped[path.name] = "no history row and no owner in the file (saved by an older version)"
        return
    turns = turns_from_messages(state.conversation)
    try:
        outcome, n = store.repair_exchanges(sid, turns, owner=owner, model_id=str(state.header["model_id"]),
                                            title=extra.get("title") or None, fence=fence)
        if outcome in ("added", "replaced"):
            store.set_miku_path(sid, str(path), owner=owner, fence=fence)
    except StorageError as exc:
        report.skipped[path.name] = f"the history could not be written ({exc})"
        return
    if outcome == "added":
        report.added[sid] = n
    elif outcome == "replaced":
        report.replaced.append(sid)
    elif outcome == "history ahead":
        report.history_ahead[sid] = n
    elif outcome == "disagree":
        report.disagree.append(sid)

