"""The messages a page has sent that wait for the model (issue 39: an honest, live chat).

A message sent (Enter, Send) while a reply streams, or while the model is busy with other
users' turns, is shown in the conversation at once, greyed, as waiting for the model; it is
sent as soon as the model can take it, in the order sent, and replaced by its normal turn.
This module owns that waiting line, kept on the server per browser page and owner (the
page's Gradio session hash: a page that asks for another owner's line gets its own, empty
one): what waits (:meth:`Outbox.put`), the one run that sends it
(:meth:`Outbox.claim`, :meth:`Outbox.next`), and the chat the page shows meanwhile
(:meth:`Outbox.remember`). It holds no session and never runs the model: the page's handlers
(:mod:`app.handlers.waiting`) do. Bounded per page, per owner and in all, so a client that only ever
queues cannot fill the server's memory.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

MAX_WAITING_PER_PAGE = 10  # messages one page may have waiting (a user types a handful at most)
MAX_WAITING_PER_OWNER = 30  # one user's waiting messages in all their pages (page ids are the client's)
MAX_WAITING = 500  # messages waiting in all pages together

Key = tuple[str, str]  # (owner, page)


class Outbox:
    """Each page's waiting messages, oldest first (module docstring). Thread-safe."""

    def __init__(self, per_page: int = MAX_WAITING_PER_PAGE, total: int = MAX_WAITING,
                 per_owner: int = MAX_WAITING_PER_OWNER) -> None:
        self.per_page, self.total, self.per_owner = per_page, total, per_owner
        self._lock = threading.Lock()
        self._waiting: dict[Key, deque[str]] = {}
        self._shown: dict[Key, list[dict[str, Any]]] = {}
        self._sending: set[Key] = set()
        self._count = 0

    def put(self, key: Key, text: str) -> bool:
        """Add ``text`` to ``key``'s line; False (nothing added) when the page's, its owner's
        (a client names its pages: one user must not take the whole server's line) or the
        server's line is full."""
        with self._lock:
            line = self._waiting.setdefault(key, deque())
            owners = sum(len(q) for (owner, _), q in self._waiting.items() if owner == key[0])
            if len(line) >= self.per_page or owners >= self.per_owner or self._count >= self.total:
                if not line:
                    del self._waiting[key]
                return False
            line.append(text)
            self._count += 1
            return True

    def waiting(self, key: Key) -> list[str]:
        """What waits in ``key``'s line, oldest first."""
        with self._lock:
            return list(self._waiting.get(key, ()))

    def claim(self, key: Key) -> bool:
        """Become the one run that sends ``key``'s line (True), or False: another run sends it
        now and will take what was just added (its :meth:`next` looks under the same lock)."""
        with self._lock:
            if key in self._sending:
                return False
            self._sending.add(key)
            return True

    def next(self, key: Key) -> str | None:
        """The claiming run's next message, taken off the line; None when the line is empty,
        and then the claim is given up in the same step (a message added after this is sent
        by the run its own send starts)."""
        with self._lock:
            line = self._waiting.get(key)
            if not line:
                self._waiting.pop(key, None)
                self._sending.discard(key)
                return None
            self._count -= 1
            return line.popleft()

    def release(self, key: Key) -> None:
        """The claiming run ended early (Stop, a closed page, an error): give up its claim."""
        with self._lock:
            self._sending.discard(key)

    def take_all(self, key: Key) -> list[str]:
        """Empty ``key``'s line and return what waited (Stop gives it back to the message box)."""
        with self._lock:
            line = self._waiting.pop(key, deque())
            self._count -= len(line)
            return list(line)

    def remember(self, key: Key, chat: list[dict[str, Any]] | None) -> None:
        """The chat the page's running turn shows now (None: no turn runs): a message queued
        meanwhile is drawn after it."""
        with self._lock:
            if chat is None:
                self._shown.pop(key, None)
            elif key in self._sending:
                self._shown[key] = chat

    def shown(self, key: Key) -> list[dict[str, Any]] | None:
        """The chat :meth:`remember` keeps for ``key`` (None: no turn of the page runs)."""
        with self._lock:
            return self._shown.get(key)

    def forget(self, key: Key) -> list[str]:
        """The page was closed: its line and chat are dropped; what waited, never sent."""
        with self._lock:
            self._shown.pop(key, None)
            line = self._waiting.pop(key, deque())
            self._count -= len(line)
            return list(line)
