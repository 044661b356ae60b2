"""What every area of the page shares: :class:`Page`.

Owns the owner of a request (:meth:`Page.who`: the logged-in user under ISAGI_AUTH,
``local`` without a login), what the page draws of a session (:meth:`Page.view`: the chat
and the five manifold panels, bounded whatever the session's length), the banner, alert
texts (one line, escaped, never a server path: :meth:`Page.warn`), the caller's own
history rows, and the app's temporary directory (downloads live there for a minute; Gradio
serves its own copy, which it deletes after ten minutes).

The registry and the history store answer another owner's session id exactly as an
unknown id ("not found"), whether the id comes from the page, the API or an event called
by ``fn_index``: every area asks through here with the request's owner.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from isagi.app import plots
from isagi.app.loader import EngineHolder, EngineLoading
from isagi.app.render_safe import esc, md_cell
from isagi.app.updates import PageUpdate
from isagi.app.uploads import MIB, UploadLedger
from isagi.app.views import (
    chat_window,
    highlight_row,
    manifold_summary,
    reply_fields,
    short,
    turn_markdown,
)
from isagi.session.registry import SessionRegistry
from isagi.session.service import LOCAL_OWNER, SessionService
from isagi.session.turn import turns_to_messages

if TYPE_CHECKING:
    from isagi.pipeline.engine import Engine
    from isagi.safety.runtime import SafetyProfile
    from isagi.session.service import SessionSummary

PLOT_WINDOW_TURNS = 1000
DOWNLOAD_TTL_S = 60.0  # our copy of a download; Gradio has copied it to its cache by then
NOT_LOGGED_IN = "Log in first: this server requires a login. Reload the page to get the login form."
# Gradio's logout route (relative: it works under a proxy's path too), for this browser only
# (all_session=false: the user's other browsers stay signed in); Gradio then shows its login page.
LOGOUT = "logout?all_session=false"


class Page:
    """One engine holder, the session service and the settings, as every handler area sees them."""

    def __init__(self, holder: EngineHolder, sessions: SessionService, settings: Any,
                 uploads: UploadLedger | None = None) -> None:
        """``uploads``: the server's ledger of uploads (its upload route records them); without
        one (tests of the handlers alone) the page keeps its own, under its temporary directory."""
        self.holder = holder
        self.sessions = sessions
        self.settings = settings
        self._tmp: Path | None = None  # made on first use, removed by cleanup()
        self._uploads = uploads

    # -- the engine and the request's owner ---------------------------------
    @property
    def engine(self) -> Engine:
        return self.holder.engine

    @property
    def registry(self) -> SessionRegistry:
        """The live sessions (the service's; for the status line and tests)."""
        return self.sessions.registry

    def safety(self) -> SafetyProfile | None:
        """The loaded profile's safety layer, or None (still loading, or none)."""
        try:
            return self.engine.profile.safety
        except Exception:
            return None

    def tier_bounds(self) -> tuple[float, float] | None:
        """The d (as the page shows it) where Related ends and where New topic starts on the loaded
        model: its calibrated distance scale's knots (the tiers read d rescaled onto the seed
        thresholds, :mod:`isagi.manifold.distance_scale`); None while loading or without a scale."""
        try:
            scale = self.engine.profile.distance_scale
            return float(scale.augment_at), float(scale.explore_at)
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

    # -- the temporary directory ----------------------------------------------
    @property
    def uploads(self) -> UploadLedger:
        """The ledger of uploads this app opens files from."""
        if self._uploads is None:
            root = self._ensure_tmp() / "uploads"
            root.mkdir(exist_ok=True)
            self._uploads = UploadLedger(root, self.settings.upload_quota_mb * MIB)
        return self._uploads

    def download_dir(self) -> Path:
        """A fresh ``dl-*`` directory; those older than DOWNLOAD_TTL_S are removed first."""
        root = self._ensure_tmp()
        self.sweep_downloads(DOWNLOAD_TTL_S)
        return Path(tempfile.mkdtemp(prefix="dl-", dir=root))

    def hand_out(self, owner: str, path: Path) -> None:
        """Record the copy of download ``path`` that Gradio will serve (it copies an output file
        into its cache, named by the file's hash and name) as ``owner``'s alone: the guard
        (:mod:`app.guard`) serves it to nobody else, and it is removed after a while
        (:data:`app.uploads.DOWNLOAD_TTL_S`). tests/test_app_trust.py checks the two paths agree."""
        from gradio.processing_utils import hash_file
        from gradio_client.utils import strip_invalid_filename_characters

        cached = Path(self.uploads.root) / hash_file(path) / strip_invalid_filename_characters(path.name)
        self.uploads.hand_out(owner, cached)

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

    # -- what the page draws ----------------------------------------------------
    def view(self, sid: str | None, colour_by: str = "tier", owner: str | None = LOCAL_OWNER) -> PageUpdate:
        """The chat and the five panels (:data:`app.updates.VIEW`) of ``owner``'s session, from its
        live state; empty ones when there is none (unknown, another owner's, or still loading).

        Every event that switches the page's session draws it here, so this sets ``seen`` too
        (what the page now shows): a sync sent before the switch, with the session the page
        left, then finds that session as drawn and paints nothing over the new one."""
        try:
            session = self.sessions.session(sid, owner)
        except (KeyError, EngineLoading):
            empty: list[dict[str, Any]] = []
            return PageUpdate(chat=[], turn=turn_markdown(None), summary="Trajectories: **0**",
                              map=plots.map_figure({}), growth=plots.growth_figure(empty),
                              teh=plots.teh_figure(empty), seen=None)
        return self.view_of(session, colour_by).but(seen=self.seen(sid, session))

    def view_of(self, session: Any, colour_by: str) -> PageUpdate:
        """The page's view of ``session``: a bounded amount of work and data whatever its
        length (the chat's newest turns, the plots' newest turns and trajectories)."""
        first = max(0, len(session.turns) - PLOT_WINDOW_TURNS)
        msgs = turns_to_messages(session.turns[first:])
        safety = self.safety()
        return PageUpdate(
            chat=chat_window(session),
            turn=turn_markdown(reply_fields(session.last_turn), safety, self.tier_bounds()),
            summary=manifold_summary(session),
            map=self.map_of(session, colour_by),
            growth=plots.growth_figure(msgs, first_turn=first + 1),
            teh=plots.teh_figure(msgs, safety.threshold if safety is not None else None, first_turn=first + 1),
        )

    @staticmethod
    def map_of(session: Any, colour_by: str) -> Any:
        """The trajectory map of the newest :data:`PLOT_WINDOW_TURNS` stored trajectories."""
        cols = session.memory.to_columns()
        total = len(session.memory)
        if total > PLOT_WINDOW_TURNS:
            cols = {k: v[-PLOT_WINDOW_TURNS:] for k, v in cols.items()}
        return plots.map_figure(cols, colour_by=colour_by, highlight=highlight_row(session, cols), total=total)

    @staticmethod
    def seen(sid: str | None, session: Any) -> str:
        """What a page showing ``session`` (as ``sid``) has drawn: the session object and its version
        (:attr:`isagi.session.state.Session.version`, which every recorded turn and rollback moves)."""
        return f"{sid}:{id(session)}:{session.version}"

    def status_line(self, owner: str | None = None) -> str:
        """The banner, as it is now (the page redraws it on load, on every turn and at every sync).
        With a login, the live-session count is the user's own (not the server's), and the
        banner says who is signed in, with a Log out link (:meth:`signed_in`)."""
        h = self.holder
        signed = self.signed_in(owner)
        if h.ready:
            e = self.engine
            lm = e.lm
            n = self.sessions.live_count(owner if owner is not None and self.settings.auth else None)
            return (
                f"Model **{lm.model_id}** ({lm.quant}, {lm.device}) · layer {e.layer} · "
                f"k = {e.profile.basis.B.shape[1]} · {n} live session(s){signed}"
            )
        if h.failed:
            return (f"**The model could not be loaded:** {esc(self.public(self.hide_paths(str(h.error or ''))))}"
                    f"{signed}")
        return (f"⏳ **{esc(self.hide_paths(h.describe()))}.** The message box opens once the model can "
                f"answer.{signed}")

    def signed_in(self, owner: str | None) -> str:
        """'' without a login; with one, " · Signed in as NAME" (the page's Log out button, beside
        the banner, goes to :data:`LOGOUT`)."""
        if not self.settings.auth or not owner:
            return ""
        return f" · Signed in as **{md_cell(owner)}**"

    def input_open(self) -> tuple[Any, Any]:
        """The message box and Send as the page should have them now: open when, and only when,
        the model can answer (closed while it loads, and after a failed load)."""
        import gradio as gr

        ready = self.holder.ready
        return gr.Textbox(interactive=ready), gr.Button(interactive=ready)

    # -- what the page says -------------------------------------------------------
    def warn(self, msg: str) -> str:
        """Show ``msg`` (plain text, possibly quoting outside text) as a pop-up and return it
        for the alert line: one line, no server path or URL, escaped for both (the pop-up
        renders HTML, the alert markdown)."""
        import gradio as gr

        text = esc(self.public(self.hide_paths(" ".join(str(msg).split()))))
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

    def public(self, msg: str) -> str:
        """``msg`` without the server's data directory or database URL."""
        from isagi.app.public import public_text

        s = self.settings
        home = Path(s.home)
        with contextlib.suppress(OSError, RuntimeError):
            home = home.resolve()
        return public_text(msg, (str(s.home), str(home), s.resolved_database_url))

    # -- the caller's sessions ------------------------------------------------------
    def left_note(self, unsaved: Exception | None) -> str:
        """'' when the session a page left was saved; else a warning that it is kept in memory
        (a full disk) and saved once that works again."""
        from isagi.errors import storage_cause

        if unsaved is None:
            return ""
        return self.warn(f"Your previous chat could not be saved ({storage_cause(unsaved)}). It is kept in "
                         "memory and saved once that works again; nothing of it is lost.")

    def own_summary(self, chosen: str, owner: str | None) -> SessionSummary | None:
        """``owner``'s history summary of ``chosen``, or None (unknown and another's alike, or the
        model still loading)."""
        return self.sessions.summary(chosen, owner) if self.holder.ready else None

    def session_rows(self, owner: str | None, query: str = "") -> tuple[list[list[Any]], str]:
        """(rows, note): ``owner``'s sessions (id, title, turns, updated, state), the newest 100,
        or those with a message containing ``query``."""
        if owner is None:
            return [], NOT_LOGGED_IN
        if not self.holder.ready:
            return [], "The history store is not available yet."
        if self.sessions.store is None:
            return [], "No history store is configured."
        try:
            summaries = self.sessions.summaries(owner, query)
        except Exception as exc:
            return [], self.warn(f"Could not read the history: {exc}")
        if query and query.strip():
            note = f"{len(summaries)} session(s) with messages containing “{md_cell(short(query.strip(), 80))}”."
        else:
            note = f"{len(summaries)} most recent session(s)."
        live = set(self.sessions.live_ids(owner))
        rows = [
            [s.id, s.title or "(untitled)", s.turns, s.updated_at.strftime("%Y-%m-%d %H:%M"),
             "live" if s.id in live else ("saved" if s.miku_path else "history only")]
            for s in summaries
        ]
        return rows, note
