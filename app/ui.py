"""The page's handlers put together: :class:`WebUI`, one object per area of the page.

``ui.page`` is what the areas share (:class:`app.handlers.page.Page`); ``ui.chat`` the chat
tab (``ui.waiting`` its Send and Enter), ``ui.chats`` the chat list beside it, ``ui.history`` the sessions table, ``ui.files`` a session's ``.miku``, ``ui.explorer``
the concept explorer. Every handler returns (or yields) an :class:`app.updates.PageUpdate`;
:func:`app.layout.build_blocks` wires each to its components by name. Testable without a
browser: a test calls a handler and reads the update by name.
"""

from __future__ import annotations

from typing import Any

from isagi.app.handlers.chat import ChatHandlers
from isagi.app.handlers.chats import ChatListHandlers
from isagi.app.handlers.explore import ExploreHandlers
from isagi.app.handlers.files import FileHandlers
from isagi.app.handlers.history import HistoryHandlers
from isagi.app.handlers.page import Page
from isagi.app.handlers.waiting import WaitingHandlers
from isagi.app.loader import EngineHolder
from isagi.app.uploads import UploadLedger
from isagi.session.service import SessionService


class WebUI:
    """The page's handlers, by area, over one engine holder and one session service."""

    def __init__(self, holder: EngineHolder, sessions: SessionService, settings: Any,
                 uploads: UploadLedger | None = None) -> None:
        """``uploads``: the server's ledger of uploads (its upload route records them); without
        one (tests of the handlers alone) the page keeps its own, under its temporary directory."""
        self.page = Page(holder, sessions, settings, uploads)
        self.chat = ChatHandlers(self.page)
        self.waiting = WaitingHandlers(self.chat)
        self.chats = ChatListHandlers(self.page)
        self.history = HistoryHandlers(self.page)
        self.files = FileHandlers(self.page)
        self.explorer = ExploreHandlers(self.page)
