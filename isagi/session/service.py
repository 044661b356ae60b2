"""The session service: everything a front end does with a session, one call per action.

Owns the live sessions (:class:`~isagi.session.registry.SessionRegistry`), opening them (new,
by id, from the caller's history, from an uploaded file), running a turn and Stop, parking
and making room at the caps, and the saved side: the session files
(:class:`~isagi.session.store.SessionStore`, :mod:`isagi.session.files`) and the history
store. The page's handlers (:mod:`app.handlers`) and the OpenAI-compatible API
(:mod:`app.api`) call it and only translate: arguments in from their protocol, the typed
turn events (:mod:`isagi.pipeline.events`) and results out into page updates or OpenAI JSON.
So "reopen a saved session" or "park a session to make room" is written once, here, and both
front ends behave alike; neither imports the files or the store.

Every call takes the caller's ``owner``; another owner's session id is answered exactly as
an unknown one (``None``, :class:`KeyError` or :class:`~isagi.errors.SessionNotFound`).
The engine is reached through ``get_engine`` at each call, so the service exists while the
model still loads (the front end's own loader raises then).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from isagi.errors import (
    ConversationChanged,
    InputError,
    IsagiError,
    SessionBusy,
    SessionLimit,
    SessionNotFound,
)
from isagi.session.registry import SAVED_AGAIN, Drained, Entry, SessionRegistry
from isagi.session.state import Session
from isagi.storage.miku import MAX_MIKU_BYTES, MAX_TURNS
from isagi.storage.owners import LOCAL_OWNER

if TYPE_CHECKING:
    from isagi.engines.base import GenerationOptions
    from isagi.pipeline.engine import Engine
    from isagi.pipeline.events import Done, TurnEvent
    from isagi.session.retention import Pruned
    from isagi.session.store import SessionStore
    from isagi.session.turn import Message
    from isagi.storage.history import HistoryStore
    from isagi.storage.history import (
        SessionSummary as SessionSummary,  # the front ends' name for it
    )

# The names a front end needs of the layers below it (it imports neither the files nor the store):
# the owner of work without a login, and the most a session file holds (bytes, turns).
__all__ = ["LOCAL_OWNER", "MAX_MIKU_BYTES", "MAX_TURNS", "Opened", "SessionService", "Stopped", "TurnRun", "same_exchanges"]

log = logging.getLogger(__name__)

BUSY_WAIT_S = 10.0  # how long a turn waits for its session's lock before it is refused as busy
MATCH_SCAN = 50  # a caller's most recently updated sessions looked at for a replayed conversation
PARK_TRIES = 4  # sessions parked at most to make room for one (the client's, the user's, the server's cap)
TITLE_SCAN = 500  # a caller's most recently updated sessions whose titles a search looks at

Exchange = tuple[str, str]  # (question, reply) as a client sends it back


def same_exchanges(recorded: list[tuple[str, str, str]], said: list[Exchange]) -> bool:
    """Whether a session's ``recorded`` (question, reply, verdict) exchanges are the ``said``
    (question, reply) ones a client sends back. A withheld reply counts as said both as recorded
    and as streamed (the part generated before it was withheld, then the notice)."""
    if len(recorded) != len(said):
        return False
    for (q, reply, verdict), (q2, reply2) in zip(recorded, said, strict=True):
        if q != q2 or not (reply2 == reply or (verdict == "withheld" and reply2.endswith("\n\n" + reply))):
            return False
    return True


def _exchanges(session: Session) -> list[tuple[str, str, str]]:
    return [(t.user_text, t.reply_text, t.verdict) for t in list(session.turns)]


@dataclass
class Opened:
    """A session made live for the caller: its id, the session, and whether it is a copy (its
    own id was held elsewhere) and what of it could not be saved yet."""

    sid: str
    session: Session
    forked: bool = False
    notice: str | None = None
    # the session the caller's page left for this one could not be saved (it stays live in memory)
    left_unsaved: Exception | None = None


@dataclass
class Stopped:
    """What Stop found: the session (None: not live), and how long the stopped turn took to end
    after Stop reached the server (None: nothing was generating)."""

    session: Session | None
    latency_s: float | None = None
    still_running: bool = False


@dataclass
class TurnRun:
    """One turn of a session whose lock the caller holds (:meth:`SessionService.turn`).

    :meth:`events` yields the engine's typed events; a front end only translates them. A run
    left before its :class:`~isagi.pipeline.events.Done` (the consumer stopped iterating, or
    raised) ends as :meth:`SessionService.turn` was told: *kept* as a cancelled turn (the
    page's Stop, a lost browser) or *dropped*, rolled back (an API client gone).
    """

    sid: str
    entry: Entry
    _open: Callable[[], Generator[TurnEvent, None, None]]
    _events: Generator[TurnEvent, None, None] | None = None
    finished: bool = False
    notice: str | None = None  # the Done event's: what could not be saved yet

    @property
    def session(self) -> Session:
        return self.entry.session

    def events(self) -> Iterator[TurnEvent]:
        """The turn's events. An :class:`~isagi.errors.IsagiError` before the first one is bad
        input (the session is as it was)."""
        from isagi.pipeline.events import Done

        self._events = self._open()
        for event in self._events:
            if isinstance(event, Done):
                self.finished = True
                self.notice = self.entry.notice = event.notice
            yield event

    def answer_notice(self, done: Done) -> str | None:
        """The notice an answer carries: the turn's own, or, when it has none and the server has
        since written what an earlier answer said was waiting, :data:`SAVED_AGAIN` (said once)."""
        if done.notice is None and self.entry.resaved:
            self.entry.resaved = False
            return SAVED_AGAIN
        return done.notice

    def end(self, *, keep: bool) -> None:
        """End a turn whose consumer left before its Done (from the thread that iterates it).

        ``keep=True``: stop it after the current token and let the engine record the partial
        reply as a cancelled turn. ``keep=False``: close the events; the engine rolls the turn
        back, so it leaves nothing behind."""
        events, self._events = self._events, None
        self.finished = True
        if events is None:
            return
        if not keep:
            try:
                events.close()
            except Exception as exc:  # never mask the caller's own end
                log.warning("closing an abandoned turn failed: %s", exc)
            return
        entry = self.entry
        if not entry.stop.is_set():
            entry.stop_requested_at = time.monotonic()
        entry.stop.set()
        try:
            for _ in events:
                pass
        except Exception as exc:  # never mask the close
            log.warning("draining a cancelled turn failed: %s", exc)


class SessionService:
    """The live and saved sessions of one engine, as every front end uses them (module docstring)."""

    def __init__(self, registry: SessionRegistry) -> None:
        self.registry = registry

    @classmethod
    def start(cls, get_engine: Callable[[], Engine], *, idle_s: float, max_per_client: int,
              max_total: int) -> SessionService:
        """A service over a new registry with the server's idle time and caps."""
        return cls(SessionRegistry(get_engine, idle_s=idle_s, max_per_client=max_per_client, max_total=max_total))

    # -- what it reaches -----------------------------------------------------------------
    @property
    def engine(self) -> Engine:
        return self.registry.engine

    @property
    def store(self) -> HistoryStore | None:
        """The history store (None: none configured)."""
        return self.engine.store

    def _files(self) -> SessionStore:
        return self.registry.files

    # -- live sessions ---------------------------------------------------------------------
    def session(self, sid: str | None, owner: str | None) -> Session:
        """``owner``'s live session ``sid`` (a parked one is resumed); :class:`KeyError` when
        unknown or another's."""
        if owner is None:
            raise KeyError(sid)
        return self.registry.entry(sid, owner).session

    def peek(self, sid: str | None, owner: str) -> Entry | None:
        """``owner``'s live, idle entry for ``sid`` or None (parked, unknown, another's, or a turn
        runs): nothing is resumed or touched (a page's periodic look keeps nothing alive)."""
        entry = self.registry.live_entry(sid, owner)
        return None if entry is None or entry.lock.locked() else entry

    def waiting_notice(self, sid: str | None, owner: str) -> str | None:
        """What ``owner``'s live session ``sid`` still has to save (its last turn's notice, a
        full disk), for a page that shows it again (a reload); None when all is saved."""
        entry = self.registry.live_entry(sid, owner)
        return entry.notice if entry is not None else None

    def holds(self, sid: str | None, owner: str | None) -> bool:
        """Whether ``owner`` has ``sid`` live or parked."""
        return owner is not None and bool(sid) and self.registry.holds(sid, owner)

    def live_ids(self, owner: str | None = None) -> list[str]:
        return self.registry.live_ids(owner)

    def live_count(self, owner: str | None = None) -> int:
        return len(self.registry) if owner is None else len(self.registry.live_ids(owner))

    def new_chat(self, owner: str, client: str | None, *, leaving: str | None = None) -> tuple[str, Exception | None]:
        """A new empty session for a page leaving ``leaving`` (saved and parked first); its id and
        the storage error when the left one could not be saved (it stays live)."""
        left = self._leave(leaving, owner)
        return self.new(owner, client), left

    def new(self, owner: str, client: str | None, *, for_request: bool = False) -> str:
        """A new empty session of ``owner``; its id. ``for_request``: made for a stateless
        client's turn about to run (it may be parked later to make room for that client's next
        conversation: :meth:`with_room`). :class:`~isagi.errors.SessionLimit` at a cap."""
        sid = self.registry.create(owner, client, claimed=for_request)
        if for_request:
            self.registry.mark_parkable(sid)
        return sid

    def release(self, sid: str | None, owner: str | None) -> bool:
        """Save and park the session a page leaves (New chat, Resume of another, a load).
        A save that fails keeps it live and raises the storage error (nothing is lost)."""
        return self.registry.release(sid, park=True, owner=owner)

    def _leave(self, sid: str | None, owner: str) -> Exception | None:
        """:meth:`release` ``sid`` (the session a page leaves); the storage error when its save
        failed (it stays live: nothing is lost), else None."""
        try:
            self.release(sid, owner)
        except (IsagiError, OSError) as exc:
            return exc
        return None

    def attach(self, page: str, sid: str | None, owner: str | None) -> None:
        """The browser page ``page`` now shows ``sid`` (only ``owner``'s own: else nothing)."""
        self.registry.attach(page, sid if self.holds(sid, owner) else None)

    def detach(self, page: str, owner: str) -> str | None:
        """The page was closed: its session, shown by no other page, is saved and parked."""
        return self.registry.detach(page, owner)

    # -- opening -------------------------------------------------------------------------------
    def summary(self, sid: str | None, owner: str | None) -> SessionSummary | None:
        """``owner``'s history summary of ``sid``, or None (unknown, another's, no history)."""
        store = self.store
        if store is None or owner is None or not sid or len(sid) > 64:
            return None
        try:
            return store.get_session(sid, owner=owner)
        except (IsagiError, ValueError):
            return None

    def saved_file(self, summary: SessionSummary) -> Path | None:
        """The session's ``.miku`` inside the sessions directory (a recorded path elsewhere is ignored)."""
        return self._files().find(summary.id, summary.miku_path)

    def _read(self, sid: str, owner: str) -> Session:
        """``owner``'s saved session ``sid`` read from its file; :class:`SessionNotFound` saying why
        when there is none (not in their history, or no file), and a file the loader refuses
        raises its :class:`~isagi.errors.IsagiError`."""
        from isagi.session.files import load_session

        summary = self.summary(sid, owner)
        if summary is None:
            raise SessionNotFound(f"No session {sid[:64]} in your history.")
        path = self.saved_file(summary)
        if path is None:
            raise SessionNotFound(f"Session {sid} has no saved living state; export its history instead.")
        return load_session(self.engine.frame, path, session_id=sid, files=self._files())

    def reopen(self, sid: str | None, owner: str, client: str | None) -> str | None:
        """``owner``'s session ``sid`` made live under its own id, never a fork (a page reload, an
        API request naming it): live or parked, or reopened from its saved file. None when it is
        unknown, another owner's, or cannot be read (logged). :class:`SessionLimit` at a cap."""
        from isagi.ids import is_session_id

        if not is_session_id(sid):
            return None
        assert sid is not None
        if self.registry.holds(sid, owner):
            return sid
        try:
            with self.registry.leased(sid):  # another server's: SessionBusy after a bounded wait
                return self.registry.reopen(self._read(sid, owner), owner=owner, client=client)
        except (SessionLimit, SessionBusy):
            raise
        except SessionNotFound:  # unknown, another's, or no file: nothing to reopen
            return None
        except (IsagiError, KeyError, OSError) as exc:  # unreadable, or live for another owner
            log.warning("could not reopen session %s: %s", sid, exc)
            return None

    def resume(self, sid: str, owner: str, client: str | None, *, leaving: str | None = None) -> Opened:
        """``owner``'s session ``sid`` from the history (the Sessions tab's Resume): their live or
        parked one under its id, else opened from its saved file (a copy with a fresh id when
        that id is held elsewhere). :class:`SessionNotFound` saying why when it cannot be; a file
        the loader refuses raises its error. ``leaving``: the session the page showed, saved and
        parked once the other is open (left as it is when that fails)."""
        from isagi.ids import is_session_id

        if is_session_id(sid) and self.registry.holds(sid, owner):
            opened = Opened(sid, self.registry.entry(sid, owner).session)
            opened.left_unsaved = self._leave(leaving, owner)
            return opened
        with self.registry.leased(sid):  # its last save, read while no other server writes it
            session = self._read(sid, owner)
            left = self._leave(leaving, owner)
            new = self.registry.adopt(session, owner=owner, client=client)
        return Opened(new, session, forked=new != sid, left_unsaved=left)

    def read_upload(self, path: Path) -> Session:
        """A ``.miku`` file read as a session of this engine (the loader's checks; its
        :class:`~isagi.errors.IsagiError` says what is wrong)."""
        from isagi.session.files import load_session

        return load_session(self.engine.frame, path)

    def adopt_upload(self, session: Session, owner: str, client: str | None, *, leaving: str | None = None) -> Opened:
        """Make an uploaded session live as a fork of ``owner``'s (a fresh id: continuing it must
        not overwrite the session it was saved from) and write it at once, its file and every
        turn into the history; the notice says what has to wait. ``leaving``: as :meth:`resume`."""
        left = self._leave(leaving, owner)
        sid = self.registry.adopt(session, fresh_id=True, owner=owner, client=client)
        notice = None
        with contextlib.suppress(KeyError, IsagiError), self.registry.using(sid, owner=owner) as entry:
            notice = self.engine.keep_loaded(entry.session)
        return Opened(sid, session, forked=True, notice=notice, left_unsaved=left)

    def save_copy(self, sid: str | None, owner: str | None, directory: Path, name: Callable[[Session], str]) -> tuple[Path, Session]:
        """Write ``owner``'s session to ``directory / name(session)`` (a download), under its lock."""
        from isagi.session.files import save_session

        if owner is None or not sid:
            raise KeyError(sid)
        with self.registry.using(sid, owner=owner) as entry:
            path = directory / name(entry.session)
            save_session(self.engine.frame, entry.session, path)
            return path, entry.session

    # -- a stateless client's conversations (the API) ----------------------------------------
    def with_room(self, make: Callable[[], str | None], owner: str, client: str | None) -> str | None:
        """``make()`` (a session made or reopened live), making room at a cap by parking the
        caller's least recently used idle session made for a stateless client (kept in its file
        and history, resumed by its id or its replay, as idle eviction does): a script of many
        one-off questions must not lock its user (and their page) out until the idle time.
        :class:`SessionLimit` when the cap stays full."""
        for _ in range(PARK_TRIES):
            try:
                sid = make()
            except SessionLimit:
                if self.registry.park_one_parkable(owner, client):
                    continue
                break
            if sid is not None:
                self.registry.mark_parkable(sid)
            return sid
        raise SessionLimit("Too many open chats for this client or user (ISAGI_MAX_SESSIONS_PER_CLIENT), all of "
                           "them busy or open in a page; try again shortly.")

    def find(self, owner: str, client: str | None, want: list[Exchange]) -> str | None:
        """The caller's session whose turns are exactly ``want`` (questions as
        :func:`isagi.pipeline.prompts.clean_message` keeps them), or None: a live one (the newest
        used first), else one of their :data:`MATCH_SCAN` most recently updated sessions in the
        history, made live again under its id (:meth:`reopen`)."""
        found: list[tuple[float, str]] = []
        for sid in self.registry.live_ids(owner):
            entry = self.registry.live_entry(sid, owner)
            if entry is not None and same_exchanges(_exchanges(entry.session), want):
                found.append((entry.last_used, sid))
        if found:
            return max(found)[1]
        store = self.store
        if store is None:
            return None
        for summary in store.list_sessions(limit=MATCH_SCAN, owner=owner):
            if summary.turns != len(want) or self.registry.live_entry(summary.id, owner) is not None:
                continue
            try:
                rows = store.get_turns(summary.id, owner=owner)
                same = [r.role for r in rows] == ["user", "assistant"] * len(want) and same_exchanges(
                    [(q.text, a.text, a.verdict) for q, a in zip(rows[::2], rows[1::2], strict=True)], want)
            except IsagiError:
                continue
            if same and (reopened := self.reopen(summary.id, owner, client)) is not None:
                return reopened
        return None

    # -- a turn ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def turn(
        self, sid: str | None, owner: str, message: Message | None, options: GenerationOptions, *,
        regenerate: bool = False, if_left: Literal["keep", "drop"] = "keep", timeout: float = BUSY_WAIT_S,
        expect: list[Exchange] | None = None, new_if_unknown: bool = False, client: str | None = None,
        edit_at: int | None = None, page: str = "", continue_reply: bool = False,
    ) -> Iterator[TurnRun]:
        """Hold ``owner``'s session ``sid`` for one turn of ``message`` (or Regenerate of its last
        question, or ``message`` as the edited question of turn ``edit_at``, which it replaces
        with every turn after it: :meth:`~isagi.pipeline.engine.Engine.edit`, or with
        ``continue_reply`` a continuation of its last reply, cut at the token limit:
        :meth:`~isagi.pipeline.engine.Engine.continue_reply`) and give its
        :class:`TurnRun` (its ``sid`` is the session's).

        :class:`~isagi.errors.SessionBusy` when another event holds it past ``timeout``,
        :class:`KeyError` when it is unknown (closed meanwhile), unless ``new_if_unknown``: then
        a new session of ``owner`` from ``client`` is made (the page's first message; a
        :class:`SessionLimit` at a cap). ``expect``: the exchanges the session was found by
        (:meth:`find`); another request that continued it meanwhile raises
        :class:`~isagi.errors.ConversationChanged`. A run left before its end is ended as
        ``if_left`` says (:meth:`TurnRun.end`). ``page``: the browser page the turn is for (its
        Gradio session hash); when that page goes away the turn is stopped
        (:meth:`~isagi.session.registry.SessionRegistry.detach`).
        """
        engine = self.engine

        def look_up() -> Entry:
            if new_if_unknown:
                return self.registry.ensure(sid, owner, client)[1]
            return self.registry.entry(sid, owner)

        with self.registry.held(look_up, owner, timeout=timeout) as entry:
            if expect is not None and not same_exchanges(_exchanges(entry.session), expect):
                raise ConversationChanged("Another request continued this conversation first; send the "
                                          "conversation again with that request's reply.")
            entry.stop.clear()
            entry.stop_requested_at = entry.stop_latency_s = None
            entry.notice = None
            entry.turn_page = page

            def open_events() -> Generator[TurnEvent, None, None]:
                if regenerate:
                    return engine.regenerate(entry.session, options=options, stop=entry.stop)
                if continue_reply:
                    return engine.continue_reply(entry.session, options=options, stop=entry.stop)
                assert message is not None
                if edit_at is not None:
                    return engine.edit(entry.session, edit_at, message, options=options, stop=entry.stop)
                return engine.stream_turn(entry.session, message, options=options, stop=entry.stop)

            run = TurnRun(entry.session.id, entry, open_events)
            try:
                yield run
            finally:
                if not run.finished:
                    run.end(keep=if_left == "keep")
                entry.turn_page = ""
                if entry.stop_requested_at is not None:
                    entry.stop_latency_s = time.monotonic() - entry.stop_requested_at

    def stop(self, sid: str | None, owner: str, wait_s: float) -> Stopped:
        """Ask ``owner``'s running turn of ``sid`` to stop after its current token and wait up to
        ``wait_s`` for it to end."""
        self.registry.request_stop(sid, owner)
        if not self.registry.wait_until_free(sid, wait_s, owner):
            return Stopped(None, still_running=True)
        try:
            entry = self.registry.entry(sid, owner)
        except KeyError:
            return Stopped(None)
        return Stopped(entry.session, entry.stop_latency_s)

    def settle(self, sid: str | None, owner: str, wait_s: float) -> bool:
        """Wait up to ``wait_s`` for a turn of ``owner``'s session ``sid`` that was asked to stop
        (Stop, or its page went away) to end and be recorded, so that what a page reads next
        holds it (a reload during a reply shows the stopped turn). A turn nobody stopped is not
        waited for (another tab's reply may run for long). False when a stopping turn still runs."""
        entry = self.registry.live_entry(sid, owner)
        if entry is None or not entry.lock.locked() or not entry.stop.is_set():
            return True
        return self.registry.wait_until_free(sid, wait_s, owner)

    def can_continue(self, sid: str | None, owner: str | None) -> bool:
        """Whether ``owner``'s session ``sid`` ends with a reply cut at the token limit (KeyError: unknown)."""
        from isagi.pipeline.engine import Engine

        return Engine.can_continue(self.session(sid, owner))

    def switch_version(self, sid: str | None, owner: str, step: int) -> tuple[Session, str | None]:
        """Show the previous (``step`` -1) or next (+1) version of the last reply of ``owner``'s
        session ``sid`` (:meth:`~isagi.pipeline.engine.Engine.switch_version`); the session and the
        keeper's notice. :class:`~isagi.errors.InputError` when there is none that way, KeyError
        when the session is unknown, :class:`~isagi.errors.SessionBusy` while a turn runs."""
        with self.registry.using(sid or "", owner=owner, timeout=1.0) as entry:
            session = entry.session
            versions = session.versions.get(len(session.turns) - 1)
            if versions is None:
                raise InputError("This reply has no other version: Regenerate makes one.")
            to = versions.current + step
            if not 0 <= to < len(versions.replies):
                raise InputError("There is no version that way.")
            return session, self.engine.switch_version(session, to)

    def can_regenerate(self, sid: str | None, owner: str | None) -> bool:
        """Whether ``owner``'s session ``sid`` has a last question to run again (KeyError: unknown)."""
        return self.session(sid, owner).can_regenerate

    # -- the history -------------------------------------------------------------------------
    def summaries(self, owner: str, query: str = "", limit: int = 100) -> list[SessionSummary]:
        """``owner``'s sessions, the newest ``limit``, or those whose title or a message contains
        ``query`` (titles first, then messages; case does not matter)."""
        store = self.store
        if store is None:
            return []
        if not query.strip():
            return store.list_sessions(limit=limit, owner=owner)
        q = query.strip()
        found: list[str] = [s.id for s in store.list_sessions(limit=TITLE_SCAN, owner=owner)
                            if q.casefold() in (s.title or "").casefold()]
        for hit in store.search(q, limit=2 * limit, owner=owner):
            if hit.session_id not in found:
                found.append(hit.session_id)
        return [store.get_session(i, owner=owner) for i in found[:limit]]

    def title(self, sid: str | None, owner: str | None) -> str | None:
        """The title of ``owner``'s chat ``sid`` ("" while untitled), None when it has no message
        yet or is not theirs: the live session's own, else its history's."""
        if not sid or owner is None:
            return None
        entry = self.registry.live_entry(sid, owner)
        if entry is not None:
            return (entry.session.title or "") if entry.session.turns else None
        summary = self.summary(sid, owner)
        return None if summary is None else (summary.title or "")

    def rename(self, sid: str, owner: str, title: str) -> str:
        """Give ``owner``'s session ``sid`` the title ``title``, everywhere it is kept: the live
        session (the page's list and a later autosave), its saved file and its history row.
        Returns the title as stored (one line, cut at :data:`~isagi.storage.titles.TITLE_MAX`).
        :class:`SessionNotFound` when it is not theirs; :class:`~isagi.errors.InputError` for an empty title."""
        from isagi.session.files import retitle_file
        from isagi.storage.titles import make_title

        if not isinstance(title, str) or not title.strip():
            raise InputError("A chat's title needs at least one character that is not a space.")
        new = make_title(title)
        summary = self.summary(sid, owner)
        store = self.store
        if summary is None or store is None:
            raise SessionNotFound(f"No session {sid[:64]} in your history.")
        if self.registry.holds(sid, owner):
            with self.registry.using(sid, owner=owner) as entry:
                entry.session.title = new
                entry.session.version += 1  # a page showing it redraws its list
                self.registry.persist(entry)  # SessionMoved: another server holds it now, nothing written
                store.rename_session(sid, new, owner=owner, fence=entry.session.lease)
            return new
        if self.registry.leases is None:
            if (path := self.saved_file(summary)) is not None:
                retitle_file(path, new, files=self._files())
            store.rename_session(sid, new, owner=owner)
            return new
        with self.registry.leased(sid) as fence:  # files shared: not while another server writes it
            if (path := self.saved_file(summary)) is not None:
                retitle_file(path, new, files=self._files(), fence=fence)
            store.rename_session(sid, new, owner=owner, fence=fence)
        return new

    def export(self, sid: str, owner: str, fmt: Literal["markdown", "json"]) -> str:
        """``owner``'s session ``sid``'s history as Markdown or JSON (:class:`SessionNotFound`)."""
        store = self.store
        if store is None:
            raise SessionNotFound("No history store is configured.")
        if self.summary(sid, owner) is None:
            raise SessionNotFound("no such session in your history.")
        return store.export(sid, fmt, owner=owner)

    def delete(self, sid: str, owner: str) -> list[Path]:
        """Delete ``owner``'s session ``sid``: its history rows, its saved file, and its live copy
        if a page has it open (dropped unsaved; :class:`~isagi.errors.SessionBusy` while a turn
        runs in it). With files shared by replicas, only under its lease (another server that has
        it open is asked to let go; :class:`~isagi.errors.SessionBusy` while it keeps it), and
        the writes carry the lease's fence (:meth:`SessionRegistry.deleting`).
        Returns the files removed; :class:`SessionNotFound` when it is not theirs."""
        summary = self.summary(sid, owner)
        store = self.store
        if summary is None or store is None:
            raise SessionNotFound(f"No session {sid[:64]} in your history.")
        # its lease held (files shared: another server open on it lets go, or SessionBusy) and
        # its live copy here dropped (the chat list deletes the open chat); the writes fenced
        with self.registry.deleting(sid, owner) as fence:
            if not store.delete_session(sid, owner=owner, fence=fence):
                raise SessionNotFound(f"No session {sid[:64]} in your history.")
            return self._files().remove(sid, summary.miku_path, fence=fence)

    def prune(self, older_than_days: float) -> Pruned:
        """Remove sessions last updated more than ``older_than_days`` ago, never a live one
        (:func:`isagi.session.retention.prune_sessions`)."""
        from isagi.session.retention import prune_sessions

        return prune_sessions(self.store, self._files(), older_than_days, is_live=self.registry.is_live)

    # -- the server's own rounds -------------------------------------------------------------
    def start_reaper(self, interval_s: float) -> None:
        self.registry.start_reaper(interval_s)

    def stop_reaper(self) -> None:
        self.registry.stop_reaper()

    def save_all(self) -> int:
        """Save every live session with turns (at shutdown); how many were written."""
        return self.registry.save_all()

    @property
    def draining(self) -> bool:
        """Whether the server drains (SIGTERM): nothing new starts."""
        return self.registry.draining

    def busy_count(self) -> int:
        """Live sessions a turn (or another event) holds now."""
        return self.registry.busy_count()

    def drain(self, within_s: float, stop: Callable[[], bool] = lambda: False) -> Drained:
        """SIGTERM's drain (:meth:`isagi.session.registry.SessionRegistry.drain`): nothing new
        starts; the turns in flight finish; each session is saved and its lease given back."""
        return self.registry.drain(within_s, stop)

    def close(self) -> None:
        """At shutdown, after :meth:`save_all`: drop the live sessions and give back their leases."""
        self.registry.close()

    def retry_history(self) -> int:
        """Write the history rows a full disk held back; how many still wait."""
        return self.registry.retry_history()
