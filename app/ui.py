"""The Gradio page's event handlers: chat, the manifold panel, sessions and exploration.

Owns what each event does (:class:`WebUI`); the layout and the wiring of events to
components are :mod:`app.layout`, what the page shows of a session :mod:`app.views`
(pure functions). Handlers get the browser's session
*id* from ``gr.State`` and look the Session up in the
:class:`~app.sessions.SessionRegistry`; the Session itself never enters
Gradio's state. The server-side Session is the single source of truth: the
chat display is re-rendered from the session's turns (``session.messages``: raw text, rendered as
markdown only on the page) and is never read back from the browser. The id is
also kept in the browser's storage (``gr.BrowserState``), so a page reload
reopens the same session (:meth:`WebUI.on_load`); a load makes no session, the
first message does.

Model work (a turn, Regenerate, an exploration) runs in one Gradio
concurrency group (``concurrency_id="model"``) of size 2, so a waiting
browser sees its queue position; the engine's ``generation_lock`` serialises
the model itself, and the second slot lets one turn's model work start while
the previous turn is still being recorded and drawn (``isagi bench web`` with
one slot and with two: docs/measurements.md).
Stop sets the session's stop event (the turn loop ends after the current
token and the turn is recorded as ``cancelled``) and cancels the Gradio event.

Owners: every handler takes the Gradio request and works as its owner (the
logged-in user under ISAGI_AUTH, ``local`` without a login): the registry and
the history store answer another owner's session id exactly as an unknown id
("not found"), whether the id comes from the page, the API or an event called
by ``fn_index``. Files made for download live in this app's own temporary
directory for a minute (Gradio serves its own copy, which it deletes after
ten minutes). An uploaded file is opened only when it is one of the caller's
own uploads (:class:`app.uploads.UploadLedger`; anything else, whatever the
path, gets one neutral answer) and is removed once read.

Every text from outside shown in the chat (messages, replies while they stream
and once finished, stored replies, loaded files) is rendered by
:func:`app.render_safe.render_text` to HTML on the server; the Chatbot inserts
it as it is (no markdown in the browser). Messages of alerts and pop-ups are
escaped and never show a server path (:meth:`WebUI._warn`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from app import plots, turns
from app.loader import EngineHolder, EngineLoading
from app.render_safe import esc, md_cell, render_text
from app.sessions import (
    Entry,
    SessionBusy,
    SessionLimit,
    SessionRegistry,
)
from app.uploads import MIB, NOT_YOUR_UPLOAD, UploadLedger
from app.views import (
    chat_window,
    counted,
    fmt,
    highlight_row,
    manifold_summary,
    pending_html,
    reply_fields,
    short,
    slug,
    turn_markdown,
    verdict_alert,
)
from isagi.ids import is_session_id
from isagi.session.folder import SessionFiles
from isagi.session.turn import turns_to_messages
from storage.owners import LOCAL_OWNER

log = logging.getLogger(__name__)

STREAM_INTERVAL_S = 0.1  # at most 10 display updates per second while streaming (a browser keeps up)
PLOT_WINDOW_TURNS = 1000
STOP_WAIT_S = 10.0
SYNC_S = 2.0  # how often a page checks whether another tab changed its session
DOWNLOAD_TTL_S = 60.0  # our copy of a download; Gradio has copied it to its cache by then
GRADIO_CACHE_DELETE = (60, 600)  # Gradio's copies: every minute, those older than 10 minutes
NOT_LOGGED_IN = "Log in first: this server requires a login (ISAGI_AUTH)."


KEEP: Any = object()  # an output a handler leaves as it is on the page (``gr.skip()`` at the boundary)


@dataclass
class TurnUpdate:
    """One update of the page by a turn (Send, Enter, Regenerate), by output name.

    The turn events' outputs, in order: the session id, the chat, the message box,
    the alert line, the five manifold panels, the status banner and what the page has drawn
    (:meth:`WebUI.seen`). A field left ``KEEP`` does not change on the page. ``out()`` is the
    tuple Gradio takes.
    """

    state: Any = KEEP
    chat: Any = KEEP
    textbox: Any = KEEP
    alert: Any = KEEP
    turn: Any = KEEP
    summary: Any = KEEP
    map: Any = KEEP
    growth: Any = KEEP
    teh: Any = KEEP
    status: Any = KEEP  # the banner (its live-session count changes when a message makes a session)
    seen: Any = KEEP  # the session version the page shows now (WebUI.seen), so its sync does not redraw it

    def with_view(self, view: tuple[Any, ...]) -> TurnUpdate:
        """This update with the chat and the panels of ``WebUI._view_of``."""
        chat, turn, summary, map_, growth, teh = view
        return replace(self, chat=chat, turn=turn, summary=summary, map=map_, growth=growth, teh=teh)

    def out(self) -> tuple[Any, ...]:
        import gradio as gr

        return tuple(gr.skip() if (v := getattr(self, f.name)) is KEEP else v for f in fields(self))




# --------------------------------------------------------------------------- rendering


































# --------------------------------------------------------------------------- the app


class WebUI:
    """Handlers bound to one engine holder and one registry (testable without a browser)."""

    def __init__(self, holder: EngineHolder, registry: SessionRegistry, settings: Any,
                 uploads: UploadLedger | None = None) -> None:
        """``uploads``: the server's ledger of uploads (its upload route records them); without
        one (tests of the handlers alone) the app keeps its own, under its temporary directory."""
        self.holder = holder
        self.registry = registry
        self.settings = settings
        self._tmp: Path | None = None  # made on first use, removed by cleanup()
        self._uploads = uploads

    # -- helpers -----------------------------------------------------------
    @property
    def engine(self) -> Any:
        return self.holder.engine

    def _safety(self) -> Any:
        try:
            return self.engine.profile.safety
        except Exception:
            return None

    def who(self, request: Any) -> tuple[str | None, str | None]:
        """(owner, client address) of a request: the logged-in user under ISAGI_AUTH
        (None when there is none), ``local`` without a login."""
        client = getattr(getattr(request, "client", None), "host", None)
        if not self.settings.auth:
            return LOCAL_OWNER, client
        user = getattr(request, "username", None)
        return (user if isinstance(user, str) and user else None), client

    @property
    def uploads(self) -> UploadLedger:
        """The ledger of uploads this app opens files from."""
        if self._uploads is None:
            root = self._ensure_tmp() / "uploads"
            root.mkdir(exist_ok=True)
            self._uploads = UploadLedger(root, self.settings.upload_quota_mb * MIB)
        return self._uploads

    def _download_dir(self) -> Path:
        """A fresh ``dl-*`` directory; those older than DOWNLOAD_TTL_S are removed first."""
        root = self._ensure_tmp()
        self.sweep_downloads(DOWNLOAD_TTL_S)
        return Path(tempfile.mkdtemp(prefix="dl-", dir=root))

    def _ensure_tmp(self) -> Path:
        if self._tmp is None or not self._tmp.is_dir():
            self._tmp = Path(tempfile.mkdtemp(prefix="isagi-web-"))
        return self._tmp

    def sweep_downloads(self, older_than_s: float = DOWNLOAD_TTL_S) -> int:
        """Remove this app's ``dl-*`` directories older than ``older_than_s``; returns how many."""
        if self._tmp is None or not self._tmp.is_dir():
            return 0
        now, n = time.time(), 0
        for d in self._tmp.glob("dl-*"):
            with contextlib.suppress(OSError):
                if now - d.stat().st_mtime >= older_than_s:
                    shutil.rmtree(d)
                    n += 1
        return n

    def cleanup(self) -> None:
        """Remove this app's temporary directory (on shutdown)."""
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def view(self, sid: str | None, colour_by: str = "tier", owner: str | None = LOCAL_OWNER) -> tuple[Any, ...]:
        """(chat, turn panel, summary, map, growth, TEH) of ``owner``'s session, from its live state."""
        try:
            if owner is None:
                raise KeyError(sid)
            entry = self.registry.entry(sid, owner)
        except (KeyError, EngineLoading):
            empty: list[dict[str, Any]] = []
            return ([], turn_markdown(None), "Trajectories: **0**", plots.map_figure({}),
                    plots.growth_figure(empty), plots.teh_figure(empty))
        return self._view_of(entry.session, colour_by)

    def _view_of(self, session: Any, colour_by: str) -> tuple[Any, ...]:
        """The page's view of ``session``: a bounded amount of work and data whatever its
        length (the chat's newest turns, the plots' newest turns and trajectories)."""
        first = max(0, len(session.turns) - PLOT_WINDOW_TURNS)
        msgs = turns_to_messages(session.turns[first:])
        last_bot = reply_fields(session.last_turn)
        safety = self._safety()
        return (
            chat_window(session),
            turn_markdown(last_bot, safety),
            manifold_summary(session),
            self._map(session, colour_by),
            plots.growth_figure(msgs, first_turn=first + 1),
            plots.teh_figure(msgs, getattr(safety, "threshold", None), first_turn=first + 1),
        )

    @staticmethod
    def _map(session: Any, colour_by: str) -> Any:
        """The trajectory map of the newest :data:`PLOT_WINDOW_TURNS` stored trajectories."""
        cols = session.memory.to_columns()
        total = len(session.memory)
        if total > PLOT_WINDOW_TURNS:
            cols = {k: v[-PLOT_WINDOW_TURNS:] for k, v in cols.items()}
        return plots.map_figure(cols, colour_by=colour_by, highlight=highlight_row(session, cols), total=total)

    def status_line(self, owner: str | None = None) -> str:
        """The banner; with a login, the live-session count is the user's own (not the server's)."""
        h = self.holder
        if h.ready:
            e = self.engine
            lm = e.lm
            n = len(self.registry) if owner is None or not self.settings.auth else len(self.registry.live_ids(owner))
            return (
                f"Model **{lm.model_id}** ({lm.quant}, {lm.device}) · layer {e.layer} · "
                f"k = {e.profile.basis.B.shape[1]} · {n} live session(s)"
            )
        if h.failed:
            return f"**The model could not be loaded:** {esc(self._public(self.hide_paths(str(h.error or ''))))}"
        return (f"⏳ **{esc(self.hide_paths(h.describe()))}.** The first start converts the model and calibrates "
                "it; this page works once it is done.")

    # -- page load and loading banner --------------------------------------
    def on_load(self, sid: str | None, colour_by: str = "tier", request: Any = None) -> tuple[Any, ...]:
        """Page load: ``sid`` is the id the browser kept (its storage), or None.

        A reload shows the same session (same id, conversation and memory): live,
        parked, or reopened from its autosaved ``.miku`` when the history says it
        is the caller's. An unknown id, another owner's, or none opens nothing: the
        first message makes a session (a load never makes an empty one).
        """
        owner, client = self.who(request)
        if owner is None:
            return (None, NOT_LOGGED_IN, *self.view(None, colour_by, None))
        if self.holder.ready:
            try:
                sid = self._reattach(sid, owner, client)
            except SessionLimit as exc:
                return (None, f"**{exc}**", *self.view(None, colour_by, owner))
        return (sid, self.status_line(owner), *self.view(sid, colour_by, owner))

    def _reattach(self, sid: Any, owner: str, client: str | None) -> str | None:
        """``owner``'s session ``sid`` made live under its own id, or None (unknown,
        another owner's, or no saved state: nothing of it is read)."""
        from isagi.errors import IsagiError
        from isagi.session.files import load_session

        if not is_session_id(sid):
            return None
        try:
            self.registry.entry(sid, owner)  # live, or parked (evicted): resumed from its file
            return sid
        except KeyError:
            pass
        summary = self._own_summary(sid, owner)  # another owner's id: None, as an unknown one
        path = self._autosave_of(summary) if summary is not None else None
        if path is None:
            return None
        try:
            session = load_session(self.engine.frame, path, session_id=sid)
        except (IsagiError, EngineLoading) as exc:
            log.warning("could not reopen session %s on page load: %s", sid, exc)
            return None
        try:
            return self.registry.reopen(session, owner=owner, client=client)
        except KeyError:
            return None

    def on_tick(self, sid: str | None, colour_by: str = "tier", request: Any = None) -> tuple[Any, ...]:
        """While loading: refresh the banner; once ready: reopen the browser's session (if any), stop the timer."""
        import gradio as gr

        if not (self.holder.ready or self.holder.failed):
            return (sid, self.status_line(), *(gr.skip(),) * 6, gr.Timer(active=True))
        return (*self.on_load(sid, colour_by, request), gr.Timer(active=False))

    # -- chat ----------------------------------------------------------------
    def _options(self, max_tokens: float | None, sample: bool, temperature: float | None, *, seed: int | None = None) -> Any:
        from isagi.engines.base import GenerationOptions

        n = int(max_tokens or self.settings.max_new_tokens)
        return GenerationOptions(
            max_new_tokens=max(1, n), do_sample=bool(sample),
            temperature=float(temperature or 0.7), seed=seed,
        )

    def _warn(self, msg: str) -> str:
        """Show ``msg`` (plain text, possibly quoting outside text) as a pop-up and return it
        for the alert line: one line, no server path or URL, escaped for both (the pop-up
        renders HTML, the alert markdown)."""
        import gradio as gr

        text = esc(self._public(self.hide_paths(" ".join(str(msg).split()))))
        gr.Warning(text)
        return f"⚠️ {text}"

    def hide_paths(self, text: str) -> str:
        """``text`` with every path under the data directory, the upload cache or the
        temporary directory shown as its last part (a file's own name), never in full."""
        roots: set[str] = set()
        for base in (self.settings.home, self.uploads.root, tempfile.gettempdir()):
            with contextlib.suppress(OSError, RuntimeError, TypeError):
                roots |= {str(base), str(Path(base).resolve())}
        for root in sorted((r for r in roots if len(r) > 1), key=len, reverse=True):
            text = re.sub(re.escape(root) + r"(?:[/\\][^\s'\"`:,;()<>]*)?",
                          lambda m: Path(m.group(0)).name or "the data directory", text)
        return text

    def _public(self, msg: str) -> str:
        from app.public import public_text

        s = self.settings
        home = Path(s.home)
        with contextlib.suppress(OSError, RuntimeError):
            home = home.resolve()
        return public_text(msg, (str(s.home), str(home), s.resolved_database_url))

    def _release_for(self, sid: str | None, owner: str | None) -> str:
        """Save and drop the session a browser leaves; a save that fails (a full disk) keeps it
        live in memory and returns a warning saying so, else ''."""
        from isagi.errors import IsagiError, storage_cause

        try:
            self.registry.release(sid, park=True, owner=owner)
        except (IsagiError, OSError) as exc:
            return self._warn(f"Your previous chat could not be saved ({storage_cause(exc)}). It is kept in "
                              "memory and saved once that works again; nothing of it is lost.")
        return ""

    def send(
        self, message: str, sid: str | None, max_tokens: float = 0, sample: bool = False,
        temperature: float = 0.7, colour_by: str = "tier", request: Any = None,
    ) -> Iterator[tuple[Any, ...]]:
        """Run a turn, streaming :class:`TurnUpdate` tuples (state, chat, textbox, alert, panels).

        The message is checked before any session is made: an invalid message
        never creates one. ``sid`` of another owner is an unknown id: a new
        session of the caller's is made for the message.
        """
        from isagi.errors import IsagiError

        owner, client = self.who(request)
        if owner is None:
            yield TurnUpdate(state=sid, alert=self._warn(NOT_LOGGED_IN)).out()
            return
        try:
            engine = self.engine
            checked = engine.check(message)  # validated once, here: the turn takes it as it is
            sid, entry = self.registry.ensure(sid, owner, client)
        except (EngineLoading, IsagiError) as exc:
            yield TurnUpdate(state=sid, alert=self._warn(str(exc))).out()
            return
        options = self._options(max_tokens, sample, temperature)
        for update in self._turn(sid, checked, options, colour_by, owner=owner, clear_box=True):
            yield update.out()

    def regenerate(
        self, sid: str | None, max_tokens: float = 0, sample: bool = False,
        temperature: float = 0.7, colour_by: str = "tier", request: Any = None,
    ) -> Iterator[tuple[Any, ...]]:
        """Run the last question again, sampling; the new turn replaces the last one everywhere.

        The engine does it (:meth:`isagi.pipeline.engine.Engine.regenerate`): it undoes the last turn in
        the session (metric, memory, turns), runs the question again (an answer from memory is
        generated anew) and the new turn takes the old one's place in the history store and the
        autosaved file too; if it fails, the old turn stays.
        """
        owner, _ = self.who(request)
        try:
            if owner is None:
                raise KeyError(sid)
            entry = self.registry.entry(sid, owner)
        except (KeyError, EngineLoading) as exc:
            msg = str(exc) if isinstance(exc, EngineLoading) else "Nothing to regenerate yet."
            yield TurnUpdate(state=sid, alert=self._warn(msg)).out()
            return
        if not entry.session.can_regenerate:
            yield TurnUpdate(state=sid, alert=self._warn("Nothing to regenerate: send a message first.")).out()
            return
        options = self._options(max_tokens, True, temperature, seed=random.randrange(2**31))
        for update in self._turn(sid, None, options, colour_by, regenerate=True, owner=owner):
            yield update.out()

    def _turn(
        self, sid: str, message: Any, options: Any, colour_by: str, *,
        regenerate: bool = False, owner: str = LOCAL_OWNER, clear_box: bool = False,
    ) -> Iterator[TurnUpdate]:
        """One turn of session ``sid`` as page updates: take the session, stream, show the result.

        ``regenerate``: the engine's Regenerate of the last question (``message`` is not used);
        the new turn replaces the last one, or, if it fails, the old one stays. ``clear_box``
        empties the message box once the message is shown.
        """
        with contextlib.ExitStack() as held:
            try:
                entry = held.enter_context(self.registry.using(sid, timeout=STOP_WAIT_S, owner=owner))
            except SessionBusy as exc:
                yield TurnUpdate(state=sid, alert=self._warn(str(exc)))
                return
            except KeyError:  # dropped meanwhile (e.g. reclaimed while empty): the next message makes one
                yield TurnUpdate(state=None, alert=self._warn("This chat was closed; send your message again."))
                return
            session = entry.session
            turns.begin(entry)
            failure = yield from self._stream(sid, entry, message, options, regenerate=regenerate,
                                              clear_box=clear_box)
            if failure is not None:  # the engine has put the session back as it was
                yield TurnUpdate(state=sid, chat=chat_window(session), alert=failure.alert,
                                 seen=self.seen(sid, session))
                return
            alert = verdict_alert(reply_fields(session.last_turn))
            if entry.notice:  # kept in memory or in the file, not everywhere yet: say so plainly
                alert = "\n\n".join(a for a in (alert, self._warn(entry.notice)) if a)
            yield TurnUpdate(state=sid, alert=alert, status=self.status_line(owner),
                             seen=self.seen(sid, session)).with_view(self._view_of(session, colour_by))

    def _stream(
        self, sid: str, entry: Entry, message: Any, options: Any, *, regenerate: bool, clear_box: bool,
    ) -> Iterator[TurnUpdate]:
        """Stream the engine's turn into chat updates; returns None when it ended, or the failure.

        A turn closed early (Stop's cancel, a lost client) is ended at once and
        recorded as cancelled instead of holding the model. A bug (not bad input)
        is logged; the engine has put the session back as it was before this turn.
        """
        from isagi.errors import IsagiError

        session = entry.session
        if regenerate:  # the chat without the turn being replaced, then its question again
            history = chat_window(session, drop_last=True)
            text = session.turns[-1].user_text if session.turns else ""
        else:
            history = chat_window(session)
            text = getattr(message, "text", message)
        user = {"role": "user", "content": render_text(text)}
        reply, info = "", pending_html(None, None)
        yield TurnUpdate(state=sid, chat=[*history, user, {"role": "assistant", "content": info}], alert="",
                         textbox="" if clear_box else KEEP)
        events: Any = None
        finished = False
        last = 0.0
        try:
            events = turns.open_events(self.engine, entry, message, options, regenerate=regenerate)
            for ev in events:
                if ev.kind == "decision":
                    info = pending_html(ev.tier, ev.distance)
                elif ev.kind == "token":
                    reply += ev.text
                    now = time.monotonic()
                    if now - last < STREAM_INTERVAL_S:
                        continue
                    last = now
                elif ev.kind == "done":
                    finished = True
                    entry.notice = ev.notice
                    continue
                partial = render_text(reply)  # the same rendering as the finished reply
                shown = [*history, user, *([{"role": "assistant", "content": partial}] if partial else []),
                         {"role": "assistant", "content": info}]
                yield TurnUpdate(state=sid, chat=shown)
        except IsagiError as exc:
            finished = True
            return _BadInput(self._warn(str(exc)))
        except Exception as exc:
            log.exception("turn failed in session %s", sid)
            finished = True
            if events is not None:
                with contextlib.suppress(Exception):
                    events.close()  # a failure here, not in the engine: the engine rolls the turn back
            return _Failure(self._warn(
                f"This turn failed ({type(exc).__name__}: {exc}). Your session is as it was before it; "
                "try again, and report the error if it repeats."))
        finally:
            if not finished and events is not None:
                turns.abandon(entry, events, keep=True)  # recorded as cancelled, as Stop does
            if entry.stop_requested_at is not None:
                entry.stop_latency_s = time.monotonic() - entry.stop_requested_at
        return None

    def stop(self, sid: str | None, colour_by: str = "tier", request: Any = None) -> tuple[Any, ...]:
        """Ask the running turn to stop, wait until it has, and show the final state."""
        import gradio as gr

        owner, _ = self.who(request)
        if owner is None:
            return (gr.skip(),) * 7
        self.registry.request_stop(sid, owner)
        if not self.registry.wait_until_free(sid, STOP_WAIT_S, owner):
            return (gr.skip(), "The model is still finishing a step; it will stop shortly.", *(gr.skip(),) * 5)
        try:
            entry = self.registry.entry(sid, owner)
        except (KeyError, EngineLoading):
            return (gr.skip(),) * 7
        session = entry.session
        last_bot = reply_fields(session.last_turn)
        # A stopped turn stores no trajectory and does not move the metric: the plots stay.
        took = getattr(entry, "stop_latency_s", None)
        if last_bot is not None and last_bot.get("verdict") == "cancelled" and took is not None:
            note = f"Stopped: the turn ended {took:.2f} s after Stop reached the server; the partial reply is kept."
        else:
            note = "Nothing was generating."
        return (chat_window(session), note,
                turn_markdown(last_bot, self._safety()), manifold_summary(session), gr.skip(), gr.skip(), gr.skip())

    # -- what the page shows ------------------------------------------------------
    @staticmethod
    def seen(sid: str | None, session: Any) -> str:
        """What a page showing ``session`` (as ``sid``) has drawn: the session object and its version
        (:attr:`isagi.session.state.Session.version`, which every recorded turn and rollback moves)."""
        return f"{sid}:{id(session)}:{session.version}"

    def sync(self, sid: str | None, seen: str | None, colour_by: str = "tier", request: Any = None) -> tuple[Any, ...]:
        """The page's periodic check (every :data:`SYNC_S`): when its session changed since the
        page last drew it (a turn sent from another tab of the same browser), draw it again;
        otherwise, and while a turn runs, change nothing. Outputs: what is drawn, then the view."""
        import gradio as gr

        nothing = (gr.skip(),) * 7
        owner, _ = self.who(request)
        if owner is None or not is_session_id(sid) or not self.holder.ready:
            return nothing
        entry = self.registry.live_entry(sid, owner)
        if entry is None or entry.lock.locked():  # not live here (nothing changed), or a turn runs
            return nothing
        session = entry.session
        now = self.seen(sid, session)
        if now == seen:
            return nothing
        return (now, *self._view_of(session, colour_by))

    def page_shows(self, sid: str | None, request: Any = None) -> Any:
        """The page's session id changed (load, a first message, New chat, Resume, a load): the
        registry learns which page shows it; returns the id for the browser's storage (or skip)."""
        import gradio as gr

        owner, _ = self.who(request)
        mine = is_session_id(sid) and owner is not None and self.registry.holds(sid, owner)
        self.registry.attach(_page_of(request), sid if mine else None)
        return sid if is_session_id(sid) else gr.skip()

    def page_closed(self, request: Any = None) -> None:
        """The page was closed or reloaded (Gradio's unload): its session, shown by no other
        page, is saved and parked (no longer live: it can be deleted; a reload resumes it)."""
        owner, _ = self.who(request)
        if owner is not None:
            self.registry.detach(_page_of(request), owner)

    def new_chat(self, sid: str | None, colour_by: str = "tier", request: Any = None) -> tuple[Any, ...]:
        owner, client = self.who(request)
        if owner is None:
            return (None, self._warn(NOT_LOGGED_IN), *self.view(None, colour_by, None))
        try:
            self.engine  # noqa: B018 - raises while loading
        except EngineLoading as exc:
            return (sid, self._warn(str(exc)), *self.view(sid, colour_by, owner))
        note = self._release_for(sid, owner)
        try:
            new = self.registry.create(owner, client)
        except SessionLimit as exc:
            return (None, self._warn(str(exc)), *self.view(None, colour_by, owner))
        return (new, note, *self.view(new, colour_by, owner))

    def recolour(self, sid: str | None, colour_by: str, request: Any = None) -> Any:
        owner, _ = self.who(request)
        try:
            if owner is None:
                raise KeyError(sid)
            session = self.registry.entry(sid, owner).session
        except (KeyError, EngineLoading):
            return plots.map_figure({})
        return self._map(session, colour_by)

    # -- files ---------------------------------------------------------------
    def save_miku(self, sid: str | None, request: Any = None) -> tuple[Any, str]:
        """Write the open session's living state to a ``.miku`` for download."""
        import gradio as gr

        from isagi.errors import IsagiError
        from isagi.session.files import save_session

        owner, _ = self.who(request)
        try:
            if owner is None:
                raise KeyError(sid)
            with self.registry.using(sid, owner=owner) as entry:
                s = entry.session
                path = self._download_dir() / f"isagi-{slug(s.title, 'session')}-{s.id}.miku"
                save_session(self.engine.frame, s, path)
        except (KeyError, EngineLoading, SessionBusy, IsagiError, OSError) as exc:
            msg = "There is no session to save yet." if isinstance(exc, KeyError) else str(exc)
            return gr.skip(), self._warn(msg)
        return str(path), (f"Saved {counted(len(s.memory), 'trajectory', 'trajectories')} and "
                           f"{counted(len(s.turns), 'turn')} to `{path.name}`.")

    def load_miku(self, file: Any, sid: str | None, colour_by: str = "tier", request: Any = None) -> tuple[Any, ...]:
        """Open an uploaded ``.miku`` (a fork with a fresh id, the caller's).

        Only a file the caller uploaded (:meth:`UploadLedger.claim`) is opened;
        any other path, whatever it names and whether or not it exists, gets
        the one answer :data:`~app.uploads.NOT_YOUR_UPLOAD`. Errors leave the
        open session as it is and name the user's own file, never a server
        path. The upload is removed once read, loaded or not.

        A loaded session is written at once (its own file, and every turn into the history
        store), and the page does what Resume does: the sessions table lists it, the chat tab
        shows it, the previous chat's alert goes. Outputs: the page's session, the note, the
        view, the table, the tab, the alert line.
        """
        import gradio as gr

        from isagi.errors import IsagiError
        from isagi.session.files import load_session

        keep = (gr.skip(),) * 9
        owner, client = self.who(request)
        if owner is None:
            return (sid, self._warn(NOT_LOGGED_IN), *keep)
        path = file.get("path") if isinstance(file, dict) else getattr(file, "name", file)
        claim = self.uploads.claim(owner, path)
        if claim is None:
            return (sid, self._warn(NOT_YOUR_UPLOAD), *keep)
        name = claim.name
        with claim:
            try:
                session = load_session(self.engine.frame, claim.path)
            except (IsagiError, EngineLoading) as exc:
                reason = _hide_path(str(exc), claim.path).rstrip()
                reason += "" if reason.endswith((".", "!", "?")) else "."
                return (sid, self._warn(f"Could not load {name}: {reason} Your open session is unchanged."), *keep)
            except Exception as exc:  # a reader bug must not take the page down
                log.exception("loading an upload failed")
                return (sid, self._warn(f"Could not load {name} ({type(exc).__name__}: "
                                        f"{_hide_path(str(exc), claim.path)}). Your open session is unchanged."),
                        *keep)
        note = self._release_for(sid, owner)
        try:
            new = self.registry.adopt(session, fresh_id=True, owner=owner, client=client)
        except SessionLimit as exc:
            return (sid, self._warn(str(exc)), *keep)
        kept = self._keep_loaded(new, owner)
        # No pop-up notice: the note says it, and a later refused file replaces the note, so the
        # page never says "Loaded" beside that error.
        loaded = f"Loaded `{md_cell(name)}`: {len(session.memory)} trajectories, {len(session.turns)} turns."
        rows, _ = self.list_sessions("", request)
        return (new, loaded + "".join(f"\n\n{n}" for n in (note, kept) if n), *self.view(new, colour_by, owner),
                rows, gr.Tabs(selected="chat"), kept)

    def _keep_loaded(self, sid: str, owner: str) -> str:
        """Write the just-loaded session ``sid`` (its file, then all its turns into the history) with
        the engine's keeper; '' or a warning when part of it has to wait (e.g. a full disk)."""
        try:
            with self.registry.using(sid, owner=owner) as entry:
                notice = self.engine.keep_loaded(entry.session)
        except (KeyError, SessionBusy, EngineLoading):
            return ""
        return self._warn(notice) if notice else ""

    # -- sessions tab ------------------------------------------------------------
    def _store(self) -> Any:
        return getattr(self.holder._engine, "store", None) if self.holder.ready else None

    def list_sessions(self, query: str = "", request: Any = None) -> tuple[Any, str]:
        """Rows (id, title, turns, updated, file) of the caller's sessions, optionally searched."""
        owner, _ = self.who(request)
        if owner is None:
            return [], NOT_LOGGED_IN
        store = self._store()
        if store is None:
            msg = "The history store is not available yet." if not self.holder.ready else "No history store is configured."
            return [], msg
        try:
            if query and query.strip():
                hits = store.search(query.strip(), limit=200, owner=owner)
                seen: list[str] = []
                for h in hits:
                    if h.session_id not in seen:
                        seen.append(h.session_id)
                summaries = [store.get_session(i, owner=owner) for i in seen[:100]]
                note = f"{len(summaries)} session(s) with messages containing “{md_cell(short(query.strip(), 80))}”."
            else:
                summaries = store.list_sessions(limit=100, owner=owner)
                note = f"{len(summaries)} most recent session(s)."
        except Exception as exc:
            return [], self._warn(f"Could not read the history: {exc}")
        live = set(self.registry.live_ids(owner))
        rows = [
            [s.id, s.title or "(untitled)", s.turns, s.updated_at.strftime("%Y-%m-%d %H:%M"),
             "live" if s.id in live else ("saved" if s.miku_path else "history only")]
            for s in summaries
        ]
        return rows, note

    @staticmethod
    def select_row(evt: Any, rows: Any) -> str:
        """The session id of the clicked row."""
        try:
            r = evt.index[0] if isinstance(evt.index, list | tuple) else evt.index
            data = rows.values.tolist() if hasattr(rows, "values") else rows
            return str(data[r][0])
        except Exception:
            return ""

    def _own_summary(self, chosen: str, owner: str | None) -> Any:
        """``owner``'s history summary of ``chosen``, or None (unknown and another's alike)."""
        store = self._store()
        if store is None or owner is None or not chosen or len(chosen) > 64:
            return None
        from isagi.errors import IsagiError

        try:
            return store.get_session(chosen, owner=owner)
        except IsagiError:
            return None

    def _autosave_of(self, summary: Any) -> Path | None:
        """The session's ``.miku`` inside the sessions directory (a recorded path elsewhere is ignored)."""
        return SessionFiles(self.settings.sessions_dir).find(summary.id, summary.miku_path)

    def resume(self, chosen: str, sid: str | None, colour_by: str = "tier", request: Any = None) -> tuple[Any, ...]:
        """Open one of the caller's past sessions: their own live (or parked) one is switched
        to under its id, never forked; another from its saved living state (its autosaved ``.miku``).

        Outputs: the page's session, the note, the view, the tab, and the chat's alert line
        (emptied when the chat switches: the previous chat's alert is not the resumed one's)."""
        import gradio as gr

        out = self._resume(chosen, sid, colour_by, request)
        switched = isinstance(out[-1], gr.Tabs)  # the chat tab is shown: the resumed session
        return (*out, "" if switched else gr.skip())

    def _resume(self, chosen: str, sid: str | None, colour_by: str, request: Any) -> tuple[Any, ...]:
        import gradio as gr

        from isagi.errors import IsagiError
        from isagi.session.files import load_session

        owner, client = self.who(request)
        chosen = (chosen or "").strip()
        keep = (sid, gr.skip(), *(gr.skip(),) * 6, gr.skip())
        if not chosen:
            return (sid, self._warn("Pick a session in the table first."), *keep[2:])
        if owner is not None and chosen == sid and self.registry.holds(sid, owner):
            return (sid, "That session is already open.", *self.view(sid, colour_by, owner), gr.Tabs(selected="chat"))
        if owner is not None and is_session_id(chosen) and self.registry.holds(chosen, owner):
            # The caller's own live (or parked) session, e.g. open in another tab: switch to it.
            try:
                session = self.registry.entry(chosen, owner).session
            except (KeyError, EngineLoading, IsagiError) as exc:
                return (sid, self._warn(f"Could not resume {chosen}: {exc}"), *keep[2:])
            left = self._release_for(sid, owner)
            note = (f"Resumed “{md_cell(short(session.title or chosen, 80))}” ({len(session.turns)} turns, "
                    f"{len(session.memory)} trajectories).") + (f"\n\n{left}" if left else "")
            return (chosen, note, *self.view(chosen, colour_by, owner), gr.Tabs(selected="chat"))
        summary = self._own_summary(chosen, owner)
        if summary is None:
            return (sid, self._warn(f"No session {short(chosen, 64)} in your history."), *keep[2:])
        path = self._autosave_of(summary)
        if path is None:
            return (sid, self._warn(f"Session {chosen} has no saved living state; export its history instead."),
                    *keep[2:])
        try:
            session = load_session(self.engine.frame, path, session_id=chosen)
        except (IsagiError, EngineLoading) as exc:
            return (sid, self._warn(f"Could not resume {chosen}: {exc}"), *keep[2:])
        left = self._release_for(sid, owner)
        try:
            new = self.registry.adopt(session, owner=owner, client=client)
        except SessionLimit as exc:
            return (sid, self._warn(str(exc)), *keep[2:])
        note = f"Resumed “{md_cell(short(session.title or chosen, 80))}” ({len(session.turns)} turns, {len(session.memory)} trajectories)."
        if new != chosen:
            note += f" It is open in another browser, so this is a copy with id {new}."
        if left:
            note += f"\n\n{left}"
        return (new, note, *self.view(new, colour_by, owner), gr.Tabs(selected="chat"))

    def export(self, chosen: str, sid: str | None, fmt: str, request: Any = None) -> tuple[Any, str]:
        """The chosen (or the open) session's history as Markdown or JSON, for download:
        only the caller's own sessions (another's id is "not found")."""
        import gradio as gr

        owner, _ = self.who(request)
        target = (chosen or "").strip() or (sid or "")
        shown = short(target, 64) or "(none)"
        try:
            store = self.engine.store
            if store is None:
                return gr.skip(), self._warn("No history store is configured.")
            if owner is None:
                return gr.skip(), self._warn(NOT_LOGGED_IN)
            if self._own_summary(target, owner) is None:  # unknown and another's alike
                return gr.skip(), self._warn(f"Could not export session {shown}: no such session in your history.")
            text = store.export(target, "markdown" if fmt == "markdown" else "json", owner=owner)
        except Exception as exc:
            return gr.skip(), self._warn(f"Could not export session {shown}: {exc}")
        ext = "md" if fmt == "markdown" else "json"
        name = f"isagi-{target}.{ext}" if is_session_id(target) else f"isagi-session.{ext}"
        path = self._download_dir() / name
        path.write_text(text, encoding="utf-8")
        return str(path), f"Exported session {md_cell(shown)} as {ext.upper()}."

    def _deletable(self, chosen: str, sid: str | None, owner: str | None) -> tuple[Any, str | None]:
        """(the caller's history summary of ``chosen``, None) when it may be deleted, else (None, why)."""
        if not chosen:
            return None, "Pick a session in the table first."
        summary = self._own_summary(chosen, owner)
        if summary is None or owner is None:
            return None, f"No session {short(chosen, 64)} in your history."
        if chosen == sid:
            return None, "That is the chat open on this page: start a New chat first, then delete it."
        if chosen in self.registry.live_ids(owner):
            return None, "That session is open in a browser; close it there first."
        return summary, None

    def ask_delete(self, chosen: str, sid: str | None, request: Any = None) -> tuple[Any, ...]:
        """Delete, step one: name what would be deleted and show "Yes, delete" and "Cancel".
        Outputs: the id waiting for confirmation (None: nothing), the note, the two buttons."""
        import gradio as gr

        owner, _ = self.who(request)
        chosen = (chosen or "").strip()
        summary, why = self._deletable(chosen, sid, owner)
        if summary is None:
            return None, self._warn(why or ""), gr.Button(visible=False), gr.Button(visible=False)
        title = md_cell(short(summary.title or "(untitled)", 80))
        return (chosen, f"**Delete session {chosen}** (“{title}”, {summary.turns} turns) from your history, "
                "with its saved state? This cannot be undone: click **Yes, delete** to confirm.",
                gr.Button(visible=True), gr.Button(visible=True))

    def confirm_delete(self, pending: str | None, sid: str | None, request: Any = None) -> tuple[Any, ...]:
        """Delete, step two ("Yes, delete"): delete the session named in step one. Outputs: the
        table, the note, the id waiting (None again), the two buttons (hidden again)."""
        import gradio as gr

        hide = (None, gr.Button(visible=False), gr.Button(visible=False))
        if not pending:
            return (gr.skip(), "Nothing to delete: pick a session and click Delete first.", *hide)
        return (*self.delete(pending, sid, request), *hide)

    @staticmethod
    def cancel_delete() -> tuple[Any, ...]:
        import gradio as gr

        return None, "Nothing was deleted.", gr.Button(visible=False), gr.Button(visible=False)

    def delete(self, chosen: str, sid: str | None, request: Any = None) -> tuple[Any, str]:
        """Delete one of the caller's sessions: its history and its autosaved ``.miku`` (the page
        asks first: :meth:`ask_delete`). Not the page's own chat, nor one open in another page."""
        owner, _ = self.who(request)
        chosen = (chosen or "").strip()
        summary, why = self._deletable(chosen, sid, owner)
        if summary is None or owner is None:
            return gr_skip(), self._warn(why or "")
        try:
            ok = self.engine.store.delete_session(chosen, owner=owner)
        except Exception as exc:
            return gr_skip(), self._warn(f"Could not delete {chosen}: {exc}")
        if not ok:
            return gr_skip(), self._warn(f"No session {chosen} in your history.")
        self.registry.forget(chosen, owner)
        removed = SessionFiles(self.settings.sessions_dir).remove(chosen, summary.miku_path)
        rows, _ = self.list_sessions("", request)
        gone = f" and its saved state ({removed[0].name})" if removed else ""
        return rows, f"Deleted session {chosen} from the history{gone}."

    # -- explore ---------------------------------------------------------------
    def explore(self, seed: str, steps: float, max_tokens: float) -> tuple[str, Any, str]:
        """Safe OGD exploration from a seed: steps with TEH, and the MIKU creativity index."""
        import gradio as gr

        try:
            from isagi.explore.chains import explore_on
        except ImportError as exc:
            return self._warn(f"Exploration is not available in this build ({exc})."), gr.skip(), ""
        from isagi.errors import IsagiError

        try:
            result = explore_on(self.engine, seed or "", steps=int(steps), max_new_tokens=int(max_tokens))
        except (IsagiError, EngineLoading, ValueError) as exc:
            return self._warn(str(exc)), gr.skip(), ""
        data = result.to_dict() if hasattr(result, "to_dict") else dict(result)
        steps_out = data.get("steps", [])
        lines = ["| step | α | TEH mean / max | coherence | text |", "|---|---|---|---|---|"]
        for i, st in enumerate(steps_out, 1):
            txt = md_cell(short(st.get("text", ""), 160))
            flag = " ⚠" if st.get("over_threshold") else ""
            lines.append(
                f"| {st.get('index', i)} | {fmt(st.get('alpha'), 2)} | {fmt(st.get('teh'), 2, '%')} / "
                f"{fmt(st.get('teh_max'), 2, '%')}{flag} | {fmt(st.get('coherence'), 2)} | {txt} |"
            )
        rows = [{"step": st.get("index", i), "teh": st.get("teh"), "alpha": st.get("alpha")}
                for i, st in enumerate(steps_out, 1)]
        fig = plots.explore_figure(rows, data.get("reply_threshold"))
        mcb = data.get("mcb") or {}
        dims = ", ".join(
            f"{k.replace('_', ' ')} {fmt(v, 1)}" for k, v in mcb.items() if k not in ("index", "tier")
        )
        mode = "Safe OGD (steps projected off the forbidden subspace)" if data.get("safe", True) else "regular OGD"
        mcb_md = (
            f"### MIKU creativity index: **{fmt(mcb.get('index'), 1)}** (tier {md_cell(mcb.get('tier', '–'))})\n\n"
            f"{dims}\n\n{mode}; baseline (unsteered): “{md_cell(short(data.get('baseline'), 200))}”"
        )
        return "\n".join(lines), fig, mcb_md


def _hide_path(message: str, path: str | os.PathLike[str]) -> str:
    """``message`` with the server's path of an uploaded file (and its folder) replaced
    by the file's own name: errors never show server paths."""
    p = Path(path)
    for full in sorted({str(p), str(p.resolve()), str(p.absolute())}, key=len, reverse=True):
        message = message.replace(full, p.name)
    for folder in sorted({str(p.parent), str(p.parent.resolve())}, key=len, reverse=True):
        if len(folder) > 1:
            message = message.replace(folder + os.sep, "").replace(folder, "")
    return message


def _page_of(request: Any) -> str:
    """The browser page a request comes from: its Gradio session hash ('' when unknown)."""
    page = getattr(request, "session_hash", None)
    return page if isinstance(page, str) else ""


def gr_skip() -> Any:
    import gradio as gr

    return gr.skip()



@dataclass
class _Failure:
    """A turn that failed on a bug: the session was put back; ``alert`` says so."""

    alert: str


class _BadInput(_Failure):
    """A turn refused as bad input (an IsagiError): the session is as it was."""




# --------------------------------------------------------------------------- layout




