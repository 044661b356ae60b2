"""The Gradio page: chat, the manifold panel, sessions and exploration.

Owns the layout and the event handlers. Handlers get the browser's session
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
from app.help_text import BADGE_HELP, FIGURE_HELP, help_markdown
from app.loader import EngineHolder, EngineLoading
from app.render_safe import TIERS, UNKNOWN, VERDICTS, enum_label, esc, md_cell, render_text
from app.sessions import (
    Entry,
    SessionBusy,
    SessionLimit,
    SessionRegistry,
    autosave_file,
)
from app.uploads import MIB, NOT_YOUR_UPLOAD, UploadLedger
from isagi.ids import is_session_id
from isagi.session.turn import turns_to_messages
from storage.owners import LOCAL_OWNER

log = logging.getLogger(__name__)

STREAM_INTERVAL_S = 0.1  # at most 10 display updates per second while streaming (a browser keeps up)
# What one page update renders and sends, whatever the session's length: the chat's
# newest turns, and the plots' newest turns and stored trajectories.
CHAT_WINDOW_TURNS = 100
PLOT_WINDOW_TURNS = 1000
STOP_WAIT_S = 10.0
SYNC_S = 2.0  # how often a page checks whether another tab changed its session
DOWNLOAD_TTL_S = 60.0  # our copy of a download; Gradio has copied it to its cache by then
GRADIO_CACHE_DELETE = (60, 600)  # Gradio's copies: every minute, those older than 10 minutes
NOT_LOGGED_IN = "Log in first: this server requires a login (ISAGI_AUTH)."

EMPTY_REPLY = "<p><em>(empty reply)</em></p>"

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


CSS = """
.isagi-info { font-size: 0.85em; color: #444; line-height: 1.6; }
.isagi-tier { display: inline-block; padding: 1px 8px; border-radius: 10px; color: #fff;
  font-weight: 600; font-size: 0.85em; letter-spacing: 0.03em; margin-right: 4px; }
.isagi-tier-retrieve { background: #1a9850; }
.isagi-tier-augment { background: #2c7fb8; }
.isagi-tier-expand { background: #7b3294; }
.isagi-tier-explore { background: #e66101; }
.isagi-tier-refused, .isagi-tier-withheld { background: #b2182b; }
.isagi-tier-cancelled { background: #777; }
.isagi-tier-pending { background: #999; }
.isagi-info [title], .isagi-tier[title] { cursor: help; }
#isagi-sessions th, #isagi-sessions th * { white-space: nowrap; word-break: keep-all; overflow-wrap: normal; }
#isagi-alert p { color: #b2182b; font-weight: 600; }
#isagi-status p { font-size: 0.95em; }
"""


# --------------------------------------------------------------------------- rendering


def _fmt(v: Any, digits: int = 3, suffix: str = "") -> str:
    """A number for the page; anything else (a file can hold anything) is shown as ``?``."""
    if v is None:
        return "–"
    if isinstance(v, bool):
        return UNKNOWN
    try:
        return f"{float(v):.{digits}f}{suffix}"
    except (TypeError, ValueError, OverflowError):
        return UNKNOWN


def _count(v: Any) -> str:
    """A token count for the page: a whole number, or "–"."""
    if isinstance(v, bool):
        return "–"
    if isinstance(v, int):
        return str(v)
    try:
        f = float(v)
    except (TypeError, ValueError):
        return "–"
    return str(int(f)) if f.is_integer() else "–"


def _short(text: str | None, n: int = 70) -> str:
    t = " ".join(str(text or "").split())
    return t if len(t) <= n else t[: n - 1] + "…"


BADGES = (*TIERS, "REFUSED", "WITHHELD", "CANCELLED", "OK", "PENDING")


def badge_label(m: dict[str, Any]) -> str:
    """The badge of an assistant entry: its tier, or its verdict when not ok; ``?`` if unknown.

    Only known labels come out (tiers and verdicts are enums), so the label is
    safe in a class name and in text.
    """
    verdict = m.get("verdict") or "ok"
    if verdict in ("refused", "withheld"):
        return verdict.upper()
    label = m.get("tier") or verdict
    return enum_label(label.upper() if isinstance(label, str) else label, BADGES)


def _badge(label: str) -> str:
    cls = label.lower() if label in BADGES else "unknown"
    tip = f' title="{esc(BADGE_HELP[label])}"' if label in BADGE_HELP else ""
    return f'<span class="isagi-tier isagi-tier-{cls}"{tip}>{esc(label)}</span>'


def _tip(key: str, html_text: str) -> str:
    """``html_text`` (already escaped) with its plain-language explanation on hover."""
    return f'<span title="{esc(FIGURE_HELP[key])}">{html_text}</span>'


def info_html(m: dict[str, Any]) -> str:
    """The line beside a reply: badge, distance and nearest query, zone, TEH, latency, tokens.

    Every field can come from an uploaded file: each is escaped (or allowlisted) here.
    """
    parts = [_badge(badge_label(m))]
    if m.get("verdict") == "cancelled":
        parts.append('<span class="isagi-tier isagi-tier-cancelled">STOPPED</span>')
    if m.get("distance") is not None:
        near = m.get("nearest_query")
        near_txt = f" to “{esc(_short(near, 60))}”" if near else ""
        parts.append(_tip("d", f"d = {_fmt(m['distance'], 4)}{near_txt}"))
    if m.get("zone"):
        parts.append(_tip("zone", f"zone {esc(_short(m['zone'], 40))}"))
    parts.append(_tip("teh", f"TEH {_fmt(m.get('teh_prompt'), 1, '%')} / {_fmt(m.get('teh_reply'), 1, '%')}"))
    if m.get("latency_s") is not None:
        parts.append(_tip("latency", f"{_fmt(m['latency_s'], 2)} s"))
    toks = m.get("new_tokens")
    if toks is not None:
        pt = m.get("prompt_tokens")
        parts.append(_tip("tokens", f"{_count(pt)} + {_count(toks)} tokens" if pt is not None else f"{_count(toks)} tokens"))
    head, rest = parts[0], " · ".join(parts[1:])
    return f'<div class="isagi-info">{head} {rest}</div>'


def pending_html(tier: str | None, distance: float | None) -> str:
    label = "PENDING" if tier is None else enum_label(tier.upper() if isinstance(tier, str) else tier, BADGES)
    d = f" d = {_fmt(distance, 4)} ·" if distance is not None else ""
    return f'<div class="isagi-info">{_badge(label)}{d} generating…</div>'


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Session log → Chatbot messages (each reply followed by its info line).

    Message texts are rendered by :func:`app.render_safe.render_text` (HTML made
    on the server: raw HTML shows as text and images as links, so nothing in a
    message makes the browser fetch a URL); the info line is the app's own
    escaped HTML.
    """
    out: list[dict[str, str]] = []
    for m in messages:
        if m.get("role") == "user":
            out.append({"role": "user", "content": render_text(m.get("text", ""))})
        elif m.get("role") == "assistant":
            out.append({"role": "assistant", "content": render_text(m.get("text", "")) or EMPTY_REPLY})
            out.append({"role": "assistant", "content": info_html(m)})
    return out


def chat_window(session: Any, *, drop_last: bool = False) -> list[dict[str, str]]:
    """The Chatbot messages of ``session``'s newest :data:`CHAT_WINDOW_TURNS` turns
    (without its last turn with ``drop_last``: the one a Regenerate replaces).

    A turn's page update renders and sends this much and no more, however long the
    session: earlier turns stay in the session, its memory, its exports and the
    history store, and a first line says how many are not shown.
    """
    turns = session.turns[:-1] if drop_last else session.turns
    shown = chat_messages(turns_to_messages(turns[-CHAT_WINDOW_TURNS:]))
    hidden = len(turns) - CHAT_WINDOW_TURNS
    if hidden <= 0:
        return shown
    note = (f"*{hidden:,} earlier exchange{'s' if hidden != 1 else ''} of this session "
            "are not shown here; Export (Sessions tab) has them all.*")
    return [{"role": "assistant", "content": render_text(note)}, *shown]


def turn_markdown(m: dict[str, Any] | None, safety: Any = None) -> str:
    """The Turn panel: every figure of the latest turn (file fields escaped for markdown)."""
    if m is None:
        return "*No turn yet. Ask something: the panel shows what the manifold did with it.*"
    thr = getattr(safety, "threshold", None)
    rthr = getattr(safety, "reply_threshold", None)
    category = m.get("category")
    verdict = m.get("verdict") or "ok"
    rows = [
        ("Tier", f"**{badge_label(m)}**" + (f" ({md_cell(_short(category, 60))})" if category else "")),
        ("Verdict", verdict if verdict in VERDICTS else UNKNOWN),
        ("Distance", _fmt(m.get("distance"), 4)),
        ("Nearest stored query", md_cell(_short(m.get("nearest_query"), 90)) or "–"),
        ("Zone", md_cell(_short(m.get("zone"), 40)) or "–"),
        ("TEH prompt", _fmt(m.get("teh_prompt"), 2, "%") + (f" (threshold {thr:.2f}%)" if thr is not None else "")),
        ("TEH reply", _fmt(m.get("teh_reply"), 2, "%") + (f" (threshold {rthr:.2f}%)" if rthr is not None else "")),
        ("Latency", _fmt(m.get("latency_s"), 3, " s")),
        ("Tokens", f"prompt {_count(m.get('prompt_tokens'))}, reply {_count(m.get('new_tokens'))}"),
        ("Metric growth ‖M − I‖", _fmt(m.get("metric_growth"), 4)),
    ]
    body = "\n".join(f"| {k} | {v} |" for k, v in rows)
    return "| Latest turn | |\n|---|---|\n" + body


def _reply_fields(turn: Any) -> dict[str, Any] | None:
    """A turn's reply with its figures (the assistant message of :meth:`~isagi.session.turn.Turn.to_messages`)."""
    return None if turn is None else turn.to_messages()[1]


def manifold_summary(session: Any) -> str:
    mem = session.memory
    n = len(mem)
    clusters = len(getattr(mem, "clusters", {}) or {})
    sid = f"`{session.id}`" if is_session_id(session.id) else md_cell(session.id)
    return (
        f"Trajectories: **{n}** · clusters: **{clusters}** · "
        f"metric growth: **{session.metric.growth:.4f}** · turns: **{len(session.turns)}** · "
        f"session {sid}"
    )


def highlight_row(session: Any, columns: dict[str, Any]) -> int | None:
    """The stored trajectory of the latest query: itself if stored, else its nearest."""
    last = session.last_turn
    texts = list(columns.get("query_text", []))
    if not texts or last is None:
        return None
    user, bot = last.to_messages()
    for target in (user.get("text"), bot.get("nearest_query")):
        if target:
            for i in range(len(texts) - 1, -1, -1):
                if texts[i] == target:
                    return i
    return None


def _slug(text: str | None, fallback: str) -> str:
    s = re.sub(r"[^A-Za-z0-9]+", "-", text or "").strip("-").lower()[:40]
    return s or fallback


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
        last_bot = _reply_fields(session.last_turn)
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
            alert = verdict_alert(_reply_fields(session.last_turn))
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
        last_bot = _reply_fields(session.last_turn)
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
                path = self._download_dir() / f"isagi-{_slug(s.title, 'session')}-{s.id}.miku"
                save_session(self.engine.frame, s, path)
        except (KeyError, EngineLoading, SessionBusy, IsagiError, OSError) as exc:
            msg = "There is no session to save yet." if isinstance(exc, KeyError) else str(exc)
            return gr.skip(), self._warn(msg)
        return str(path), f"Saved {len(s.memory)} trajectories and {len(s.turns)} turns to `{path.name}`."

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
                note = f"{len(summaries)} session(s) with messages containing “{md_cell(_short(query.strip(), 80))}”."
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
        return autosave_file(summary, self.settings.sessions_dir)

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
            note = (f"Resumed “{md_cell(_short(session.title or chosen, 80))}” ({len(session.turns)} turns, "
                    f"{len(session.memory)} trajectories).") + (f"\n\n{left}" if left else "")
            return (chosen, note, *self.view(chosen, colour_by, owner), gr.Tabs(selected="chat"))
        summary = self._own_summary(chosen, owner)
        if summary is None:
            return (sid, self._warn(f"No session {_short(chosen, 64)} in your history."), *keep[2:])
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
        note = f"Resumed “{md_cell(_short(session.title or chosen, 80))}” ({len(session.turns)} turns, {len(session.memory)} trajectories)."
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
        shown = _short(target, 64) or "(none)"
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
            return None, f"No session {_short(chosen, 64)} in your history."
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
        title = md_cell(_short(summary.title or "(untitled)", 80))
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
        from storage.history import remove_session_files

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
        removed = remove_session_files(chosen, summary.miku_path, self.settings.sessions_dir)
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
            txt = md_cell(_short(st.get("text", ""), 160))
            flag = " ⚠" if st.get("over_threshold") else ""
            lines.append(
                f"| {st.get('index', i)} | {_fmt(st.get('alpha'), 2)} | {_fmt(st.get('teh'), 2, '%')} / "
                f"{_fmt(st.get('teh_max'), 2, '%')}{flag} | {_fmt(st.get('coherence'), 2)} | {txt} |"
            )
        rows = [{"step": st.get("index", i), "teh": st.get("teh"), "alpha": st.get("alpha")}
                for i, st in enumerate(steps_out, 1)]
        fig = plots.explore_figure(rows, data.get("reply_threshold"))
        mcb = data.get("mcb") or {}
        dims = ", ".join(
            f"{k.replace('_', ' ')} {_fmt(v, 1)}" for k, v in mcb.items() if k not in ("index", "tier")
        )
        mode = "Safe OGD (steps projected off the forbidden subspace)" if data.get("safe", True) else "regular OGD"
        mcb_md = (
            f"### MIKU creativity index: **{_fmt(mcb.get('index'), 1)}** (tier {md_cell(mcb.get('tier', '–'))})\n\n"
            f"{dims}\n\n{mode}; baseline (unsteered): “{md_cell(_short(data.get('baseline'), 200))}”"
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


def verdict_alert(reply: dict[str, Any] | None) -> str:
    """The alert line after a turn: why nothing (or only part) was generated, or nothing."""
    verdict = (reply or {}).get("verdict")
    if verdict == "refused":
        return ("⚠️ This request was refused by the geometric safety layer (TEH over the threshold): "
                "nothing was generated.")
    if verdict == "withheld":
        return "⚠️ The reply was withheld: its TEH went over the threshold while it streamed."
    if verdict == "cancelled":
        return "Stopped: the generation was ended; the partial reply is kept."
    return ""


# --------------------------------------------------------------------------- layout


def with_request(fn: Any, names: list[str], *fixed: Any) -> Any:
    """``fn`` as a Gradio handler taking inputs ``names`` and the request (as ``request=``).

    Gradio hands the request only to a positional parameter typed ``gr.Request``;
    this module's annotations are strings (no Gradio at import time), so the
    wrapper carries the signature and the real type. ``fixed`` arguments go
    between the inputs and the request (e.g. an export format).
    """
    import inspect

    import gradio as gr

    n = len(names)
    if inspect.isgeneratorfunction(fn):
        def handler(*args: Any) -> Any:
            yield from fn(*args[:n], *fixed, request=args[n] if len(args) > n else None)
    else:
        def handler(*args: Any) -> Any:
            return fn(*args[:n], *fixed, request=args[n] if len(args) > n else None)
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    handler.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(x, kind) for x in names] + [inspect.Parameter("request", kind)]
    )
    handler.__annotations__ = {"request": gr.Request}
    handler.__name__ = getattr(fn, "__name__", "handler")
    handler.__doc__ = getattr(fn, "__doc__", None)
    return handler


def build_blocks(ui: WebUI) -> Any:
    """The page. Call inside ``create_app`` only (never at import time).

    Every handler gets the request (its owner); events not meant for API use
    are private (``api_name=False``): hidden from the API page, though still
    callable by ``fn_index``, so the owner check is in each handler anyway.
    """
    import gradio as gr

    s = ui.settings
    R = with_request  # noqa: N806 - a short local alias for the wiring below
    model_q = {"concurrency_id": "model", "concurrency_limit": 2}
    light_q = {"concurrency_limit": 8}
    with gr.Blocks(title="ISAGI — living-model chat", fill_width=True, analytics_enabled=False,
                   delete_cache=GRADIO_CACHE_DELETE) as demo:
        # A closed tab's state (Gradio drops it an hour after the tab closed): its session is saved
        # and parked, not forgotten, so a page that has reopened it since (a reload) resumes it
        # from its file under the same id.
        state = gr.State(None, delete_callback=lambda sid: ui.registry.release(sid, park=True, owner=None)
                         if sid else None)
        # The same id in the browser's storage, read at page load: a reload reopens the session.
        # The storage key and "secret" are fixed so a restarted server still reads it; the secret
        # is sent to the page (Gradio's obfuscation, not a protection): the server trusts the
        # id no more than any other input (owner checks in every handler).
        stored = gr.BrowserState(None, storage_key="isagi-session-id", secret="isagi-session-id-v1")
        seen = gr.State(None)  # what the page has drawn of its session (WebUI.seen), for its sync
        pending_delete = gr.State(None)  # the session id a Delete waits to have confirmed
        gr.Markdown("## ISAGI — a chat model whose memory lives on a manifold")
        status = gr.Markdown(ui.status_line(), elem_id="isagi-status")
        timer = gr.Timer(2.0, active=not ui.holder.ready)
        sync_timer = gr.Timer(SYNC_S)
        with gr.Tabs(selected="chat") as tabs:
            with gr.Tab("Chat", id="chat"), gr.Row(equal_height=False):
                with gr.Column(scale=5, min_width=420):
                    chat = gr.Chatbot(
                        label="Conversation", elem_id="isagi-chat", height=520,
                        # texts arrive as HTML rendered on the server (render_text); a message's own
                        # copy button would copy that HTML, so code blocks carry their own instead
                        render_markdown=False, sanitize_html=True, buttons=[],
                        feedback_options=None, layout="bubble",
                        placeholder="Ask anything. Repeat a question and it is answered from memory (RETRIEVE).",
                    )
                    alert = gr.Markdown("", elem_id="isagi-alert")
                    with gr.Row():
                        msg = gr.Textbox(
                            placeholder=f"Message (up to {s.max_message_chars:,} characters) — Enter sends",
                            show_label=False, lines=1, max_lines=8, scale=8, elem_id="isagi-input",
                            autofocus=True, interactive=False,
                        )
                        send = gr.Button("Send", variant="primary", scale=1, elem_id="isagi-send",
                                         interactive=False)
                    with gr.Row():
                        stop = gr.Button("Stop", variant="stop", elem_id="isagi-stop")
                        regen = gr.Button("Regenerate", elem_id="isagi-regen")
                        new = gr.Button("New chat", elem_id="isagi-new")
                    with gr.Accordion("Generation settings", open=False):
                        max_tokens = gr.Slider(8, 2048, value=s.max_new_tokens, step=8,
                                               label="Max new tokens", elem_id="isagi-max-tokens")
                        sample = gr.Checkbox(False, label="Sample (otherwise greedy)")
                        temperature = gr.Slider(0.1, 1.5, value=0.7, step=0.05, label="Temperature")
                with gr.Column(scale=4, min_width=380):
                    turn = gr.Markdown(turn_markdown(None), elem_id="isagi-turn")
                    with gr.Accordion("What do these mean?", open=False, elem_id="isagi-help"):
                        gr.Markdown(help_markdown())
                    summary = gr.Markdown("Trajectories: **0**", elem_id="isagi-manifold-summary")
                    colour_by = gr.Radio(["tier", "cluster"], value="tier", label="Colour the map by",
                                         elem_id="isagi-colour")
                    map_plot = gr.Plot(label="Trajectory map", elem_id="isagi-map")
                    growth_plot = gr.Plot(label="Metric growth", elem_id="isagi-growth")
                    teh_plot = gr.Plot(label="TEH", elem_id="isagi-teh")
            with gr.Tab("Sessions", id="sessions") as sessions_tab:
                gr.Markdown("Your past sessions from the history store (with a login, each user sees "
                            "only their own). Every session autosaves its living state; resume one to "
                            "continue it with its memory and metric.")
                with gr.Row():
                    query = gr.Textbox(placeholder="Search message text…", show_label=False, scale=6,
                                       elem_id="isagi-search")
                    refresh = gr.Button("Search / refresh", scale=1, elem_id="isagi-refresh")
                table = gr.Dataframe(headers=["id", "title", "turns", "updated (UTC)", "state"],
                                     interactive=False, wrap=True, elem_id="isagi-sessions")
                sessions_note = gr.Markdown("")
                chosen = gr.Textbox(label="Selected session id", elem_id="isagi-chosen")
                with gr.Row():
                    resume = gr.Button("Resume", variant="primary", elem_id="isagi-resume")
                    export_md = gr.Button("Export Markdown", elem_id="isagi-export-md")
                    export_js = gr.Button("Export JSON", elem_id="isagi-export-json")
                    delete = gr.Button("Delete from history", variant="stop", elem_id="isagi-delete")
                with gr.Row():
                    confirm_delete = gr.Button("Yes, delete", variant="stop", visible=False,
                                               elem_id="isagi-delete-confirm")
                    cancel_delete = gr.Button("Cancel", visible=False, elem_id="isagi-delete-cancel")
                gr.Markdown("### The open session's living state (`.miku`)")
                with gr.Row():
                    save = gr.Button("Save .miku", elem_id="isagi-save")
                    upload = gr.File(label="Load a .miku", file_types=[".miku"], file_count="single",
                                     elem_id="isagi-upload", height=120)
                download = gr.File(label="Download", interactive=False, elem_id="isagi-download")
                files_note = gr.Markdown("", elem_id="isagi-files-note")
            with gr.Tab("Concept explorer", id="explore"):
                gr.Markdown(
                    "Safe OGD concept exploration: a chain of steps from a seed, each steered by "
                    "α·P_safe·v (never along a forbidden direction), with the TEH of every step and "
                    "the MIKU creativity index of the chain. Uses the model: it waits its turn in the queue."
                )
                with gr.Row():
                    seed = gr.Textbox(label="Seed concept", placeholder="e.g. the ocean", scale=4,
                                      elem_id="isagi-seed")
                    steps = gr.Slider(1, 6, value=3, step=1, label="Steps", scale=2)
                    ex_tokens = gr.Slider(16, 128, value=40, step=8, label="Tokens per step", scale=2)
                    run_ex = gr.Button("Run the explorer", variant="primary", scale=1, elem_id="isagi-explore")
                mcb_md = gr.Markdown("", elem_id="isagi-mcb")
                ex_plot = gr.Plot(label="TEH per step")
                ex_steps = gr.Markdown("", elem_id="isagi-steps")

        view_out = [chat, turn, summary, map_plot, growth_plot, teh_plot]
        turn_out = [state, chat, msg, alert, turn, summary, map_plot, growth_plot, teh_plot, status, seen]
        gen_in = [max_tokens, sample, temperature, colour_by]

        # The input opens once the load has set the page's session: a message sent before that
        # would be undone by the load's answer (its session replaced by the one the load read).
        demo.load(R(ui.on_load, ["sid", "colour_by"]), [stored, colour_by], [state, status, *view_out],
                  api_name=False, **light_q
                  ).then(lambda: (gr.Textbox(interactive=True), gr.Button(interactive=True)), None,
                         [msg, send], api_name=False, queue=False)
        # Whatever sets the page's session (load, a message, New chat, Resume, an upload) keeps it
        # in the browser; None (none yet) leaves the stored id (Gradio writes only a value). The
        # registry learns which page shows it; a closed page's session is parked (unload).
        state.change(R(ui.page_shows, ["sid"]), state, stored, api_name=False, queue=False)
        demo.unload(R(ui.page_closed, []))
        # Another tab of this browser may change the session: the page redraws it when it is stale.
        sync_timer.tick(R(ui.sync, ["sid", "seen", "colour_by"]), [state, seen, colour_by], [seen, *view_out],
                        show_progress="hidden", api_name=False, **light_q)
        timer.tick(R(ui.on_tick, ["sid", "colour_by"]), [state, colour_by], [state, status, *view_out, timer],
                   show_progress="hidden", api_name=False, **light_q)
        send_fn = R(ui.send, ["message", "sid", "max_tokens", "sample", "temperature", "colour_by"])
        # Send and Enter are one event: a message sent while a reply streams waits in the browser
        # and is sent (as the box then holds it) once that reply has ended ("always_last"), never
        # dropped.
        ev_send = gr.on([send.click, msg.submit], send_fn, [msg, state, *gen_in], turn_out,
                        show_progress="minimal", api_name="send", trigger_mode="always_last", **model_q)
        ev_regen = regen.click(R(ui.regenerate, ["sid", "max_tokens", "sample", "temperature", "colour_by"]),
                               [state, *gen_in], turn_out, show_progress="minimal",
                               api_name="regenerate", **model_q)
        stop.click(R(ui.stop, ["sid", "colour_by"]), [state, colour_by],
                   [chat, alert, turn, summary, map_plot, growth_plot, teh_plot],
                   cancels=[ev_send, ev_regen], show_progress="hidden", api_name="stop",
                   queue=False)
        new_fn = R(ui.new_chat, ["sid", "colour_by"])
        new.click(new_fn, [state, colour_by], [state, alert, *view_out], api_name="new_chat", **light_q)
        chat.clear(new_fn, [state, colour_by], [state, alert, *view_out], api_name=False, **light_q)
        colour_by.change(R(ui.recolour, ["sid", "colour_by"]), [state, colour_by], map_plot, api_name=False,
                         **light_q)

        list_fn = R(ui.list_sessions, ["query"])
        refresh.click(list_fn, query, [table, sessions_note], api_name="list_sessions", **light_q)
        query.submit(list_fn, query, [table, sessions_note], api_name=False, **light_q)
        def on_select(evt: Any, rows: Any) -> str:
            return ui.select_row(evt, rows)

        on_select.__annotations__ = {"evt": gr.SelectData, "rows": Any, "return": str}
        table.select(on_select, [table], chosen, api_name=False, **light_q)
        resume.click(R(ui.resume, ["chosen", "sid", "colour_by"]), [chosen, state, colour_by],
                     [state, sessions_note, *view_out, tabs, alert], api_name="resume", **light_q)
        export_md.click(R(ui.export, ["chosen", "sid"], "markdown"), [chosen, state], [download, files_note],
                        api_name="export_markdown", **light_q)
        export_js.click(R(ui.export, ["chosen", "sid"], "json"), [chosen, state], [download, files_note],
                        api_name="export_json", **light_q)
        delete.click(R(ui.ask_delete, ["chosen", "sid"]), [chosen, state],
                     [pending_delete, sessions_note, confirm_delete, cancel_delete], api_name=False, **light_q)
        confirm_delete.click(R(ui.confirm_delete, ["pending", "sid"]), [pending_delete, state],
                             [table, sessions_note, pending_delete, confirm_delete, cancel_delete],
                             api_name=False, **light_q)
        cancel_delete.click(ui.cancel_delete, None, [pending_delete, sessions_note, confirm_delete, cancel_delete],
                            api_name=False, queue=False)
        save.click(R(ui.save_miku, ["sid"]), state, [download, files_note], api_name="save_miku", **light_q)
        # The box is emptied once the file is read (loaded or refused): it never shows an earlier
        # file beside a later error, and it takes the next file at once.
        upload.upload(R(ui.load_miku, ["file", "sid", "colour_by"]), [upload, state, colour_by],
                      [state, files_note, *view_out, table, tabs, alert], api_name="load_miku", **light_q
                      ).then(lambda: None, None, upload, api_name=False, queue=False)
        run_ex.click(ui.explore, [seed, steps, ex_tokens], [ex_steps, ex_plot, mcb_md], api_name="explore",
                     **model_q)
        # opening the tab shows the list as it is now (wired last: earlier events keep their fn_index)
        sessions_tab.select(list_fn, query, [table, sessions_note], api_name=False, **light_q)
    return demo
