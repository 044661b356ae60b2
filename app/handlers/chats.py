"""The chat list beside the conversation (the page's sidebar): list, search, open, rename,
delete with confirmation.

Owns what a user does with their chats as a whole, the way chat pages people know do it: the
caller's own chats, newest first, one click to open one (no id to copy), the open chat's title
renamed where it is shown (kept in the session, its ``.miku`` and the history store:
:meth:`isagi.session.service.SessionService.rename`), and the open chat deleted after a second
click. Every action goes through the session service; another owner's id is an unknown one.
The Sessions tab stays for exports, uploads and the table of every session.
"""

from __future__ import annotations

from typing import Any

from isagi.app.handlers.page import NOT_LOGGED_IN, Page
from isagi.app.loader import EngineLoading
from isagi.app.updates import PageUpdate
from isagi.app.views import short
from isagi.errors import IsagiError, SessionLimit, SessionNotFound

CHAT_LIST_LIMIT = 100  # chats the sidebar lists (the Sessions tab's search reaches the rest)
UNTITLED = "(untitled)"


class ChatListHandlers:
    """The sidebar's events (outputs :data:`~app.updates.CHATS`, ``OPEN_CHAT``, ``RENAME``,
    ``ASK_DELETE_CHAT``, ``DELETE_CHAT``)."""

    def __init__(self, page: Page) -> None:
        self.page = page

    def _list(self, owner: str | None, sid: str | None, query: str = "") -> PageUpdate:
        """The list of ``owner``'s chats (matching ``query`` in a title or a message), the open
        one ``sid`` selected, and its title in the rename box."""
        import gradio as gr

        p = self.page
        choices: list[tuple[str, str]] = []
        title = ""
        if owner is not None and p.holder.ready and p.sessions.store is not None:
            try:
                summaries = p.sessions.summaries(owner, query, CHAT_LIST_LIMIT)
            except IsagiError:
                summaries = []
            choices = [(short(s.title or UNTITLED, 60), s.id) for s in summaries]
            open_title = p.sessions.title(sid, owner) if sid else None
            if sid and open_title is not None and all(v != sid for _, v in choices) and not query.strip():
                choices.insert(0, (short(open_title or UNTITLED, 60), sid))  # open, not in the history yet
            title = open_title or ""
        value = sid if any(v == sid for _, v in choices) else None
        return PageUpdate(chats=gr.Radio(choices=choices, value=value), chat_title=title)

    def list_chats(self, sid: str | None, query: str = "", request: Any = None) -> PageUpdate:
        """The list as it is now (outputs :data:`~app.updates.CHATS`): after a turn, a switch, a search."""
        return self._list(self.page.who(request)[0], sid, query or "")

    def open_chat(self, chosen: str | None, sid: str | None, query: str = "", colour_by: str = "tier",
                  request: Any = None) -> PageUpdate:
        """Open the clicked chat (outputs :data:`~app.updates.OPEN_CHAT`): the caller's own live
        (or parked) one under its id, else reopened from its saved file; the chat the page
        showed is saved and parked."""
        p = self.page
        owner, client = p.who(request)
        if owner is None:
            return PageUpdate(alert=p.warn(NOT_LOGGED_IN))
        if not chosen or chosen == sid:
            return self._list(owner, sid, query or "")
        try:
            opened = p.sessions.resume(chosen, owner, client, leaving=sid)
        except (SessionNotFound, SessionLimit) as exc:
            return self._list(owner, sid, query or "").but(alert=p.warn(str(exc)))
        except (KeyError, EngineLoading, IsagiError) as exc:
            return self._list(owner, sid, query or "").but(alert=p.warn(f"Could not open that chat: {exc}"))
        note = p.left_note(opened.left_unsaved)
        if opened.forked:
            note = "\n\n".join(x for x in (note, "That chat is open in another browser: this is a copy of it.") if x)
        return p.view(opened.sid, colour_by, owner).but(state=opened.sid, alert=note,
                                                        **self._list(owner, opened.sid, query or "").changed())

    def rename(self, title: str, sid: str | None, query: str = "", request: Any = None) -> PageUpdate:
        """Give the open chat the title in the box (outputs :data:`~app.updates.RENAME`); an
        unchanged title writes nothing."""
        p = self.page
        owner, _ = p.who(request)
        if owner is None:
            return PageUpdate(alert=p.warn(NOT_LOGGED_IN))
        current = p.sessions.title(sid, owner) if sid else None
        if current is None:
            return self._list(owner, sid, query or "").but(
                alert=p.warn("Send a first message: a chat gets its title, and can be renamed, once it has one."))
        if (title or "").strip() == current:
            return PageUpdate()
        try:
            p.sessions.rename(sid or "", owner, title or "")
        except (SessionNotFound, IsagiError, KeyError) as exc:
            return self._list(owner, sid, query or "").but(alert=p.warn(f"Could not rename this chat: {exc}"))
        return self._list(owner, sid, query or "").but(alert="")

    def ask_delete(self, sid: str | None, request: Any = None) -> PageUpdate:
        """Delete, step one (outputs :data:`~app.updates.ASK_DELETE_CHAT`): name the open chat and
        show "Yes, delete" and "Cancel"."""
        import gradio as gr

        p = self.page
        owner, _ = p.who(request)
        title = p.sessions.title(sid, owner) if sid and owner is not None else None
        if title is None:
            return PageUpdate(alert=p.warn("No chat with messages is open: nothing to delete."),
                              chat_confirm=gr.Button(visible=False), chat_cancel=gr.Button(visible=False))
        return PageUpdate(
            alert=(f"**Delete the chat “{short(title or UNTITLED, 80)}”** with its messages and saved state? "
                   "This cannot be undone: click **Yes, delete** to confirm."),
            chat_confirm=gr.Button(visible=True), chat_cancel=gr.Button(visible=True))

    def cancel_delete(self, request: Any = None) -> PageUpdate:
        import gradio as gr

        return PageUpdate(alert="Nothing was deleted.", chat_confirm=gr.Button(visible=False),
                          chat_cancel=gr.Button(visible=False))

    def delete(self, sid: str | None, query: str = "", colour_by: str = "tier", request: Any = None) -> PageUpdate:
        """Delete, step two (outputs :data:`~app.updates.DELETE_CHAT`): the open chat's history rows
        and saved file go, and the page shows a new, empty chat."""
        import gradio as gr

        p = self.page
        owner, _ = p.who(request)
        hidden = {"chat_confirm": gr.Button(visible=False), "chat_cancel": gr.Button(visible=False)}
        if owner is None or not sid:
            return PageUpdate(alert=p.warn(NOT_LOGGED_IN if owner is None else "Nothing to delete."), **hidden)
        title = p.sessions.title(sid, owner)
        try:
            p.sessions.delete(sid, owner)
        except (SessionNotFound, IsagiError) as exc:
            return PageUpdate(alert=p.warn(f"Could not delete this chat: {exc}"), **hidden)
        return p.view(None, colour_by, owner).but(
            state=None, alert=f"Deleted the chat “{short(title or UNTITLED, 80)}”.", **hidden,
            **self._list(owner, None, query or "").changed())
