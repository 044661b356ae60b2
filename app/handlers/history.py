"""The sessions table's handlers: search and list, pick a row, Resume, Export, Delete.

Only the caller's own sessions are listed, resumed, exported or deleted; another owner's
id is answered as an unknown one. Resume switches to the caller's own live (or parked)
session under its id, or reopens one from its autosaved ``.miku``; Delete asks first
(:meth:`HistoryHandlers.ask_delete`) and removes the history rows and the saved state.
"""

from __future__ import annotations

from typing import Any

from isagi.app.handlers.page import NOT_LOGGED_IN, Page
from isagi.app.loader import EngineLoading
from isagi.app.render_safe import md_cell
from isagi.app.updates import PageUpdate
from isagi.app.views import counted, download_name, short
from isagi.errors import IsagiError, SessionLimit, SessionNotFound
from isagi.ids import is_session_id


class HistoryHandlers:
    """The sessions tab's table events (outputs :data:`~app.updates.LIST`, ``RESUME``, ``FILE``,
    ``ASK_DELETE``, ``CONFIRM_DELETE``)."""

    def __init__(self, page: Page) -> None:
        self.page = page

    def list_sessions(self, query: str = "", request: Any = None) -> PageUpdate:
        """The table (id, title, turns, updated, state) of the caller's sessions, optionally searched."""
        rows, note = self.page.session_rows(self.page.who(request)[0], query)
        return PageUpdate(table=rows, sessions_note=note)

    @staticmethod
    def select_row(evt: Any, rows: Any) -> PageUpdate:
        """The session id of the clicked row (outputs :data:`~app.updates.SELECT`)."""
        try:
            r = evt.index[0] if isinstance(evt.index, list | tuple) else evt.index
            data = rows.values.tolist() if hasattr(rows, "values") else rows
            return PageUpdate(chosen=str(data[r][0]))
        except Exception:
            return PageUpdate(chosen="")

    def resume(self, chosen: str, sid: str | None, colour_by: str = "tier", request: Any = None) -> PageUpdate:
        """Open one of the caller's past sessions: their own live (or parked) one is switched
        to under its id, never forked; another from its saved living state (its autosaved ``.miku``).

        When the chat tab is shown (the session resumed), its alert line is emptied: the
        previous chat's alert is not the resumed one's."""
        import gradio as gr

        p = self.page
        owner, client = p.who(request)
        chosen = (chosen or "").strip()

        def refused(why: str) -> PageUpdate:
            return PageUpdate(state=sid, sessions_note=p.warn(why))

        def switched(new: str, note: str) -> PageUpdate:
            return p.view(new, colour_by, owner).but(state=new, sessions_note=note, tabs=gr.Tabs(selected="chat"),
                                                     alert="")

        if not chosen:
            return refused("Pick a session in the table first.")
        if owner is None:
            return refused(f"No session {short(chosen, 64)} in your history.")
        if chosen == sid and p.sessions.holds(sid, owner):
            return switched(sid, "That session is already open.")
        # the caller's own live (or parked) one, e.g. open in another tab, is switched to; another
        # is opened from its saved living state
        try:
            opened = p.sessions.resume(chosen, owner, client, leaving=sid)
        except (SessionNotFound, SessionLimit) as exc:
            return refused(str(exc))
        except (KeyError, EngineLoading, IsagiError) as exc:
            return refused(f"Could not resume {chosen}: {exc}")
        left = p.left_note(opened.left_unsaved)
        new, session = opened.sid, opened.session
        note = f"Resumed “{md_cell(short(session.title or chosen, 80))}” ({_size(session)})."
        if opened.forked:
            note += f" It is open in another browser, so this is a copy with id {new}."
        if left:
            note += f"\n\n{left}"
        return switched(new, note)

    def export(self, chosen: str, sid: str | None, fmt: str, request: Any = None) -> PageUpdate:
        """The chosen (or the open) session's history as Markdown or JSON, for download:
        only the caller's own sessions (another's id is "not found")."""
        p = self.page
        owner, _ = p.who(request)
        target = (chosen or "").strip() or (sid or "")
        shown = short(target, 64) or "(none)"
        if owner is None:
            return PageUpdate(files_note=p.warn(NOT_LOGGED_IN))
        try:
            text = p.sessions.export(target, owner, "markdown" if fmt == "markdown" else "json")
        except SessionNotFound as exc:  # unknown and another's alike, or no history store
            msg = str(exc) if p.sessions.store is None else f"Could not export session {shown}: {exc}"
            return PageUpdate(files_note=p.warn(msg))
        except Exception as exc:
            return PageUpdate(files_note=p.warn(f"Could not export session {shown}: {exc}"))
        ext = "md" if fmt == "markdown" else "json"
        path = p.download_dir() / download_name(target if is_session_id(target) else "session", ext)
        path.write_text(text, encoding="utf-8")
        p.hand_out(owner, path)
        return PageUpdate(download=str(path), files_note=f"Exported session {md_cell(shown)} as {ext.upper()}.")

    # -- delete, in two steps -------------------------------------------------------
    def _deletable(self, chosen: str, sid: str | None, owner: str | None) -> tuple[Any, str | None]:
        """(the caller's history summary of ``chosen``, None) when it may be deleted, else (None, why)."""
        if not chosen:
            return None, "Pick a session in the table first."
        summary = self.page.own_summary(chosen, owner)
        if summary is None or owner is None:
            return None, f"No session {short(chosen, 64)} in your history."
        if chosen == sid:
            return None, "That is the chat open on this page: start a New chat first, then delete it."
        if chosen in self.page.sessions.live_ids(owner):
            return None, "That session is open in a browser; close it there first."
        return summary, None

    def ask_delete(self, chosen: str, sid: str | None, request: Any = None) -> PageUpdate:
        """Delete, step one: name what would be deleted and show "Yes, delete" and "Cancel".
        ``pending`` is the id waiting for confirmation (None: nothing)."""
        import gradio as gr

        owner, _ = self.page.who(request)
        chosen = (chosen or "").strip()
        summary, why = self._deletable(chosen, sid, owner)
        if summary is None:
            return PageUpdate(pending=None, sessions_note=self.page.warn(why or ""),
                              confirm=gr.Button(visible=False), cancel=gr.Button(visible=False))
        title = md_cell(short(summary.title or "(untitled)", 80))
        return PageUpdate(
            pending=chosen,
            sessions_note=(f"**Delete session {chosen}** (“{title}”, {counted(summary.turns, 'turn')}) from your history, "
                           "with its saved state? This cannot be undone: click **Yes, delete** to confirm."),
            confirm=gr.Button(visible=True), cancel=gr.Button(visible=True))

    def confirm_delete(self, pending: str | None, sid: str | None, request: Any = None) -> PageUpdate:
        """Delete, step two ("Yes, delete"): delete the session named in step one; the two
        buttons hide again and nothing waits any more."""
        import gradio as gr

        done = PageUpdate(pending=None, confirm=gr.Button(visible=False), cancel=gr.Button(visible=False))
        if not pending:
            return done.but(sessions_note="Nothing to delete: pick a session and click Delete first.")
        return self.delete(pending, sid, request).but(**done.changed())

    @staticmethod
    def cancel_delete() -> PageUpdate:
        import gradio as gr

        return PageUpdate(pending=None, sessions_note="Nothing was deleted.",
                          confirm=gr.Button(visible=False), cancel=gr.Button(visible=False))

    def delete(self, chosen: str, sid: str | None, request: Any = None) -> PageUpdate:
        """Delete one of the caller's sessions: its history and its autosaved ``.miku`` (the page
        asks first: :meth:`ask_delete`). Not the page's own chat, nor one open in another page.
        Sets the table and the note."""
        p = self.page
        owner, _ = p.who(request)
        chosen = (chosen or "").strip()
        summary, why = self._deletable(chosen, sid, owner)
        if summary is None or owner is None:
            return PageUpdate(sessions_note=p.warn(why or ""))
        try:
            removed = p.sessions.delete(chosen, owner)
        except SessionNotFound as exc:
            return PageUpdate(sessions_note=p.warn(str(exc)))
        except Exception as exc:
            return PageUpdate(sessions_note=p.warn(f"Could not delete {chosen}: {exc}"))
        rows, _ = p.session_rows(owner)
        gone = f" and its saved state ({removed[0].name})" if removed else ""
        return PageUpdate(table=rows, sessions_note=f"Deleted session {chosen} from the history{gone}.")


def _size(session: Any) -> str:
    """'3 turns, 1 trajectory': what a resumed session holds."""
    return f"{counted(len(session.turns), 'turn')}, {counted(len(session.memory), 'trajectory', 'trajectories')}"
