"""The chat tab's handlers: page load, Send and Enter, Regenerate, Stop, the sync of two tabs,
New chat, the map's colouring.

Handlers get the browser's session *id* from ``gr.State`` and look the Session up in the
:class:`~isagi.session.registry.SessionRegistry`; the Session itself never enters Gradio's state. The
server-side Session is the single source of truth: the chat is re-rendered from the
session's turns and never read back from the browser. The id is also kept in the browser's
storage (``gr.BrowserState``), so a page reload reopens the same session
(:meth:`ChatHandlers.on_load`); a load makes no session, the first message does.

Model work (a turn, Regenerate, an exploration) runs in one Gradio concurrency group
(``concurrency_id="model"``, :func:`app.layout.build_blocks`), so a waiting browser sees its
queue position; the engine's ``model_turns`` admits as many turns into the model as it has
sequence slots (``ISAGI_PARALLEL``). Stop sets the
session's stop event (the turn loop ends after the current token and the turn is recorded
as ``cancelled``) and cancels the Gradio event.

Every text from outside shown in the chat (messages, replies while they stream and once
finished, stored replies) is rendered by :func:`app.render_safe.render_text` to HTML on the
server; the Chatbot inserts it as it is (no markdown in the browser).
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any

from isagi.app import plots
from isagi.app.handlers.page import NOT_LOGGED_IN, Page
from isagi.app.loader import EngineLoading
from isagi.app.render_safe import render_text
from isagi.app.updates import KEEP, PageUpdate
from isagi.app.views import (
    chat_window,
    manifold_summary,
    pending_html,
    reply_fields,
    turn_markdown,
    user_html,
    verdict_alert,
)
from isagi.errors import SessionBusy, SessionLimit
from isagi.ids import is_session_id
from isagi.pipeline.events import Decided, Done, Token, shown_text
from isagi.session.registry import SAVED_AGAIN
from isagi.session.service import LOCAL_OWNER, TurnRun

log = logging.getLogger(__name__)

STREAM_INTERVAL_S = 0.1  # at most 10 display updates per second while streaming (a browser keeps up)
STOP_WAIT_S = 10.0
SYNC_S = 2.0  # how often a page checks whether another tab changed its session


class ChatHandlers:
    """The chat tab's events (:data:`app.updates.TURN` and the others they name)."""

    def __init__(self, page: Page) -> None:
        self.page = page

    # -- page load and loading banner --------------------------------------
    def on_load(self, sid: str | None, colour_by: str = "tier", request: Any = None) -> PageUpdate:
        """Page load (outputs :data:`~app.updates.LOAD`): ``sid`` is the id the browser kept (its
        storage), or None. While the model loads, the page's timer is started (:meth:`on_tick`
        reopens the session once it is ready); otherwise it stays stopped.

        A reload shows the same session (same id, conversation and memory): live,
        parked, or reopened from its autosaved ``.miku`` when the history says it
        is the caller's. An unknown id, another owner's, or none opens nothing: the
        first message makes a session (a load never makes an empty one).
        """
        import gradio as gr

        p = self.page
        owner, client = p.who(request)
        if owner is None:
            return p.view(None, colour_by, None).but(state=None, status=NOT_LOGGED_IN)
        if p.holder.ready:
            try:
                sid = self._reattach(sid, owner, client)
            except (SessionLimit, SessionBusy) as exc:  # a cap, or open on another ISAGI server
                return p.view(None, colour_by, owner).but(state=None, status=f"**{exc}**")
            # a reload during a reply: this page shows the session at once (the page that left
            # does not park it), and the reply the left page ran, stopped, is read as recorded
            p.sessions.attach(_page_of(request), sid, owner)
            p.sessions.settle(sid, owner, STOP_WAIT_S)
        loading = not (p.holder.ready or p.holder.failed)  # the banner's timer, only while loading
        update = p.view(sid, colour_by, owner).but(
            state=sid, status=p.status_line(owner), timer=gr.Timer(active=loading))
        waiting = p.sessions.waiting_notice(sid, owner) if p.holder.ready else None
        # still unsaved (a full disk): a reloaded page says so again
        return update.but(alert=p.warn(waiting) if waiting else "")

    def _reattach(self, sid: Any, owner: str, client: str | None) -> str | None:
        """``owner``'s session ``sid`` made live under its own id, or None (unknown,
        another owner's, or no saved state: nothing of it is read)."""
        try:
            return self.page.sessions.reopen(sid, owner, client)
        except EngineLoading:
            return None

    def on_tick(self, sid: str | None, colour_by: str = "tier", request: Any = None) -> PageUpdate:
        """While loading (outputs :data:`~app.updates.TICK`): refresh the banner; once ready: reopen
        the browser's session (if any), stop the timer."""
        import gradio as gr

        p = self.page
        if not (p.holder.ready or p.holder.failed):
            return PageUpdate(state=sid, status=p.status_line(p.who(request)[0]), timer=gr.Timer(active=True))
        return self.on_load(sid, colour_by, request).but(timer=gr.Timer(active=False))

    # -- a turn ----------------------------------------------------------------
    def _options(self, max_tokens: float | None, sample: bool, temperature: float | None, *, seed: int | None = None) -> Any:
        from isagi.engines.base import GenerationOptions

        n = int(max_tokens or self.page.settings.max_new_tokens)
        return GenerationOptions(
            max_new_tokens=max(1, n), do_sample=bool(sample),
            temperature=float(temperature or 0.7), seed=seed,
        )

    def send(
        self, message: str, sid: str | None, max_tokens: float = 0, sample: bool = False,
        temperature: float = 0.7, colour_by: str = "tier", request: Any = None,
    ) -> Iterator[PageUpdate]:
        """Run a turn, streaming updates of :data:`~app.updates.TURN`.

        The message is checked before any session is made: an invalid message
        never creates one. ``sid`` of another owner is an unknown id: a new
        session of the caller's is made for the message.
        """
        from isagi.errors import IsagiError

        p = self.page
        owner, client = p.who(request)
        if owner is None:
            yield PageUpdate(state=sid, alert=p.warn(NOT_LOGGED_IN))
            return
        try:
            engine = p.engine
            checked = engine.check(message)  # validated once, here: the turn takes it as it is
        except (EngineLoading, IsagiError) as exc:
            yield PageUpdate(state=sid, alert=p.warn(str(exc)))
            return
        options = self._options(max_tokens, sample, temperature)
        yield from self._turn(sid, checked, options, colour_by, owner=owner, clear_box=True,
                              new_if_unknown=True, client=client, page=_page_of(request))

    def edit_send(
        self, message: str, edit_turn: str | None, sid: str | None, max_tokens: float = 0, sample: bool = False,
        temperature: float = 0.7, colour_by: str = "tier", request: Any = None,
    ) -> Iterator[PageUpdate]:
        """Resend an edited message (outputs :data:`~app.updates.EDIT_TURN`): ``edit_turn`` is the
        position of the turn whose question was edited (the page's Edit sets it). The chat is cut
        there and the edited question runs in its place: the session's memory and metric forget
        the cut exchanges, and the file and the history hold the conversation as it now is
        (:meth:`isagi.pipeline.engine.Engine.edit`). The page's editing state is cleared at once."""
        from isagi.errors import IsagiError

        p = self.page
        owner, _ = p.who(request)
        done = PageUpdate(edit_turn="")
        if owner is None:
            yield done.but(state=sid, alert=p.warn(NOT_LOGGED_IN))
            return
        try:
            at = int(str(edit_turn or "").strip())
        except ValueError:
            yield done.but(state=sid, alert=p.warn("Nothing is being edited: use Edit on one of your messages first."))
            return
        try:
            checked = p.engine.check(message)
        except (EngineLoading, IsagiError) as exc:
            yield done.but(state=sid, alert=p.warn(str(exc)))
            return
        if not p.sessions.holds(sid, owner):
            yield done.but(state=sid, alert=p.warn("This chat was closed; reload the page and edit again."))
            return
        yield done
        yield from self._turn(sid, checked, self._options(max_tokens, sample, temperature), colour_by,
                              owner=owner, clear_box=True, edit_at=at, page=_page_of(request))

    def version(self, sid: str | None, colour_by: str = "tier", step: int = -1, request: Any = None) -> PageUpdate:
        """Show the last reply's previous (``step`` -1) or next (+1) version (outputs
        :data:`~app.updates.VERSION`): the chat continues from the version shown, and the file and
        the history hold it (no model work)."""
        from isagi.errors import IsagiError

        p = self.page
        owner, _ = p.who(request)
        if owner is None:
            return PageUpdate(alert=p.warn(NOT_LOGGED_IN))
        try:
            session, notice = p.sessions.switch_version(sid, owner, 1 if step > 0 else -1)
        except (KeyError, EngineLoading):
            return PageUpdate(alert=p.warn("This chat was closed; reload the page."))
        except IsagiError as exc:  # no such version, or busy with a reply
            return PageUpdate(alert=p.warn(str(exc)))
        return p.view_of(session, colour_by).but(alert=p.warn(notice) if notice else "")

    def regenerate(
        self, sid: str | None, max_tokens: float = 0, sample: bool = False,
        temperature: float = 0.7, colour_by: str = "tier", request: Any = None,
    ) -> Iterator[PageUpdate]:
        """Run the last question again, sampling; the new turn replaces the last one everywhere.

        The engine does it (:meth:`isagi.pipeline.engine.Engine.regenerate`): it undoes the last turn in
        the session (metric, memory, turns), runs the question again (an answer from memory is
        generated anew) and the new turn takes the old one's place in the history store and the
        autosaved file too; if it fails, the old turn stays.
        """
        owner, refusal = self._may(sid, request, self.page.sessions.can_regenerate, "Nothing to regenerate yet.",
                                   "Nothing to regenerate: send a message first.")
        if owner is None:
            yield refusal or PageUpdate()
            return
        options = self._options(max_tokens, True, temperature, seed=random.randrange(2**31))
        yield from self._turn(sid, None, options, colour_by, regenerate=True, owner=owner, page=_page_of(request))

    def continue_reply(
        self, sid: str | None, max_tokens: float = 0, sample: bool = False,
        temperature: float = 0.7, colour_by: str = "tier", request: Any = None,
    ) -> Iterator[PageUpdate]:
        """Continue the last reply, cut at the token limit, as a new turn recorded as its
        continuation (:meth:`isagi.pipeline.engine.Engine.continue_reply`); outputs
        :data:`~app.updates.TURN`. The chat shows the reply and its continuation as one reply.
        Anything else last (a reply that ended by itself, a refusal, a Stop) is answered with
        :data:`~isagi.pipeline.engine.NOT_CUT`."""
        from isagi.pipeline.engine import NOT_CUT

        owner, refusal = self._may(sid, request, self.page.sessions.can_continue, NOT_CUT, NOT_CUT)
        if owner is None:
            yield refusal or PageUpdate()
            return
        yield from self._turn(sid, None, self._options(max_tokens, sample, temperature), colour_by,
                              owner=owner, continuing=True)

    def _may(
        self, sid: str | None, request: Any, can: Callable[[str | None, str | None], bool], unknown: str,
        nothing: str,
    ) -> tuple[str | None, PageUpdate | None]:
        """(the caller, None) when ``can(sid, caller)`` says the last turn allows the action
        (Regenerate, Continue); else (None, the alert saying why not: not logged in, still
        loading, ``unknown`` session, or ``nothing`` to act on)."""
        p = self.page
        owner, _ = p.who(request)
        if owner is None:
            return None, PageUpdate(state=sid, alert=p.warn(NOT_LOGGED_IN))
        try:
            ok = can(sid, owner)
        except (KeyError, EngineLoading) as exc:
            return None, PageUpdate(state=sid, alert=p.warn(str(exc) if isinstance(exc, EngineLoading) else unknown))
        return (owner, None) if ok else (None, PageUpdate(state=sid, alert=p.warn(nothing)))

    def _turn(
        self, sid: str | None, message: Any, options: Any, colour_by: str, *,
        regenerate: bool = False, owner: str = LOCAL_OWNER, clear_box: bool = False,
        new_if_unknown: bool = False, client: str | None = None, edit_at: int | None = None,
        page: str = "", continuing: bool = False,
    ) -> Iterator[PageUpdate]:
        """One turn of session ``sid`` as page updates: take the session, stream, show the result.

        ``regenerate``: the engine's Regenerate of the last question (``message`` is not used);
        the new turn replaces the last one, or, if it fails, the old one stays. ``clear_box``
        empties the message box once the message is shown. ``new_if_unknown``: a new session of
        ``owner`` from ``client`` when ``sid`` is unknown or another owner's (a first message).
        ``page``: the browser page it runs for (a reload or close of it stops the turn).
        """
        p = self.page
        with contextlib.ExitStack() as held:
            try:
                run = held.enter_context(p.sessions.turn(sid, owner, message, options, regenerate=regenerate,
                                                         if_left="keep", timeout=STOP_WAIT_S,
                                                         new_if_unknown=new_if_unknown, client=client,
                                                         edit_at=edit_at, page=page,
                                                         continue_reply=continuing))
            except (SessionBusy, SessionLimit) as exc:
                yield PageUpdate(state=sid, alert=p.warn(str(exc)))
                return
            except KeyError:  # dropped meanwhile (e.g. reclaimed while empty): the next message makes one
                yield PageUpdate(state=None, alert=p.warn("This chat was closed; send your message again."))
                return
            sid = run.sid
            session = run.session
            failure = yield from self._stream(sid, run, message, regenerate=regenerate, clear_box=clear_box,
                                              edit_at=edit_at, continuing=continuing)
            if failure is not None:  # the engine has put the session back as it was
                yield PageUpdate(state=sid, chat=chat_window(session), alert=failure.alert,
                                 seen=p.seen(sid, session))
                return
            alert = verdict_alert(reply_fields(session.last_turn))
            if run.notice:  # kept in memory or in the file, not everywhere yet: say so plainly
                alert = "\n\n".join(a for a in (alert, p.warn(run.notice)) if a)
            yield p.view_of(session, colour_by).but(state=sid, alert=alert, status=p.status_line(owner),
                                                    seen=p.seen(sid, session))

    def _stream(
        self, sid: str, run: TurnRun, message: Any, *, regenerate: bool, clear_box: bool,
        edit_at: int | None = None, continuing: bool = False,
    ) -> Generator[PageUpdate, None, _Failure | None]:
        """Stream the engine's turn into chat updates; returns None when it ended, or the failure.

        A turn closed early (Stop's cancel, a lost client) is ended at once and
        recorded as cancelled instead of holding the model. A bug (not bad input)
        is logged; the engine has put the session back as it was before this turn.
        """
        from isagi.errors import IsagiError

        p = self.page
        session = run.session
        so_far = ""  # Continue: the reply the streamed text goes on from
        at: int | None  # the position the user message is shown at (None: Continue shows none)
        if continuing or (regenerate and session.turns and session.turns[-1].continues):
            # Continue (or Regenerate of a continuation): the chat up to the reply so far, which grows
            shown = chat_window(session, drop_last=regenerate)
            history, text, at = shown[:-2], "", None
            so_far = _reply_so_far(session.turns[:-1] if regenerate else session.turns)
        elif regenerate:  # the chat without the turn being replaced, then its question again
            history = chat_window(session, drop_last=True)
            text = session.turns[-1].user_text if session.turns else ""
            at = len(session.turns) - 1
        elif edit_at is not None:  # the chat cut before the edited question, then the question as edited
            history = chat_window(session, upto=edit_at)
            text, at = message.text, edit_at
        else:
            history = chat_window(session)
            text, at = message.text, len(session.turns)
        user = [{"role": "user", "content": user_html(text, at)}] if at is not None else []
        reply, info = "", pending_html(None, None)
        opened = [{"role": "assistant", "content": render_text(so_far)}] if so_far else []
        yield PageUpdate(state=sid, chat=[*history, *user, *opened, {"role": "assistant", "content": info}], alert="",
                         textbox="" if clear_box else KEEP)
        last = 0.0
        try:
            for ev in run.events():
                if isinstance(ev, Decided):
                    info = pending_html(ev.tier, ev.distance)
                elif isinstance(ev, Done):
                    continue
                else:
                    reply += shown_text(ev)
                    now = time.monotonic()
                    if isinstance(ev, Token) and now - last < STREAM_INTERVAL_S:
                        continue
                    last = now
                partial = render_text(so_far + reply)  # the same rendering as the finished reply
                shown = [*history, *user, *([{"role": "assistant", "content": partial}] if partial else []),
                         {"role": "assistant", "content": info}]
                yield PageUpdate(state=sid, chat=shown)
        except IsagiError as exc:
            run.end(keep=False)  # bad input: the engine raised before recording anything
            return _BadInput(p.warn(str(exc)))
        except Exception as exc:
            log.exception("turn failed in session %s", sid)
            run.end(keep=False)  # a failure here, not in the engine: the engine rolls the turn back
            return _Failure(p.warn(
                f"This turn failed ({type(exc).__name__}: {exc}). Your session is as it was before it; "
                "try again, and report the error if it repeats."))
        # a turn left early (Stop's cancel, a lost client) is recorded as cancelled: the service's
        # turn ends it so (if_left="keep") when this generator is closed
        return None

    def stop(self, sid: str | None, colour_by: str = "tier", request: Any = None) -> PageUpdate:
        """Ask the running turn to stop, wait until it has, and show the final state
        (outputs :data:`~app.updates.STOP`)."""
        p = self.page
        owner, _ = p.who(request)
        if owner is None:
            return PageUpdate()
        try:
            stopped = p.sessions.stop(sid, owner, STOP_WAIT_S)
        except EngineLoading:
            return PageUpdate()
        if stopped.still_running:
            return PageUpdate(alert="The model is still finishing a step; it will stop shortly.")
        session = stopped.session
        if session is None:
            return PageUpdate()
        last_bot = reply_fields(session.last_turn)
        # A stopped turn stores no trajectory and does not move the metric: the plots stay.
        took = stopped.latency_s
        if last_bot is not None and last_bot.get("verdict") == "cancelled" and took is not None:
            note = f"Stopped: the turn ended {took:.2f} s after Stop reached the server; the partial reply is kept."
        else:
            note = "Nothing was generating."
        return PageUpdate(chat=chat_window(session), alert=note, turn=turn_markdown(last_bot, p.safety()),
                          summary=manifold_summary(session))

    # -- what the page shows ------------------------------------------------------
    def sync(self, sid: str | None, seen: str | None, colour_by: str = "tier", request: Any = None) -> PageUpdate:
        """The page's periodic check (every :data:`SYNC_S`; outputs :data:`~app.updates.SYNC`):
        when its session changed since the page last drew it (a turn sent from another tab of
        the same browser), draw it again; otherwise, and while a turn runs, change nothing."""
        p = self.page
        owner, _ = p.who(request)
        if owner is None or not is_session_id(sid) or not p.holder.ready:
            return PageUpdate()
        entry = p.sessions.peek(sid, owner)
        if entry is None:  # not live here (nothing changed), or a turn runs
            return PageUpdate()
        session = entry.session
        now = p.seen(sid, session)
        if entry.resaved:  # the server wrote what the last notice said was waiting: say so
            entry.resaved = False
            return p.view_of(session, colour_by).but(seen=now, alert=SAVED_AGAIN)
        if now == seen:
            return PageUpdate()
        return p.view_of(session, colour_by).but(seen=now)

    def sync_with_status(self, sid: str | None, seen: str | None, colour_by: str = "tier",
                         request: Any = None) -> PageUpdate:
        """:meth:`sync`, with the banner as it is now: its live-session count moves as other pages
        open and close sessions, so the page's periodic check redraws it too."""
        owner, _ = self.page.who(request)
        update = self.sync(sid, seen, colour_by, request)
        return update.but(status=self.page.status_line(owner)) if owner is not None else update

    def page_shows(self, sid: str | None, request: Any = None) -> PageUpdate:
        """The page's session id changed (load, a first message, New chat, Resume, a load): the
        registry learns which page shows it; the id goes to the browser's storage (``stored``)."""
        p = self.page
        owner, _ = p.who(request)
        p.sessions.attach(_page_of(request), sid if is_session_id(sid) else None, owner)
        return PageUpdate(stored=sid) if is_session_id(sid) else PageUpdate()

    def page_closed(self, request: Any = None) -> None:
        """The page was closed or reloaded (Gradio's unload): its session, shown by no other
        page, is saved and parked (no longer live: it can be deleted; a reload resumes it)."""
        owner, _ = self.page.who(request)
        if owner is not None:
            self.page.sessions.detach(_page_of(request), owner)

    def new_chat(self, sid: str | None, colour_by: str = "tier", request: Any = None) -> PageUpdate:
        """A new, empty session for the page (outputs :data:`~app.updates.NEW_CHAT`); the one it
        leaves is saved and parked."""
        p = self.page
        owner, client = p.who(request)
        if owner is None:
            return p.view(None, colour_by, None).but(state=None, alert=p.warn(NOT_LOGGED_IN))
        try:
            p.engine  # noqa: B018 - raises while loading
        except EngineLoading as exc:
            return p.view(sid, colour_by, owner).but(state=sid, alert=p.warn(str(exc)))
        try:
            new, unsaved = p.sessions.new_chat(owner, client, leaving=sid)
        except SessionLimit as exc:
            return p.view(None, colour_by, owner).but(state=None, alert=p.warn(str(exc)))
        return p.view(new, colour_by, owner).but(state=new, alert=p.left_note(unsaved))

    def recolour(self, sid: str | None, colour_by: str, request: Any = None) -> PageUpdate:
        """The trajectory map coloured by ``colour_by`` (outputs :data:`~app.updates.RECOLOUR`)."""
        p = self.page
        owner, _ = p.who(request)
        try:
            session = p.sessions.session(sid, owner)
        except (KeyError, EngineLoading):
            return PageUpdate(map=plots.map_figure({}))
        return PageUpdate(map=p.map_of(session, colour_by))


def _reply_so_far(turns: list[Any]) -> str:
    """The text of the last reply with the continuations it already has."""
    parts: list[str] = []
    for t in reversed(turns):
        parts.append(t.reply_text)
        if not t.continues:
            break
    return "".join(reversed(parts))


def _page_of(request: Any) -> str:
    """The browser page a request comes from: its Gradio session hash ('' when unknown)."""
    page = getattr(request, "session_hash", None)
    return page if isinstance(page, str) else ""


@dataclass
class _Failure:
    """A turn that failed on a bug: the session was put back; ``alert`` says so."""

    alert: str


class _BadInput(_Failure):
    """A turn refused as bad input (an IsagiError): the session is as it was."""
