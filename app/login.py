"""Login checking and throttling for the web app (``ISAGI_AUTH``).

Owns the two halves of a login attempt:

- :class:`Logins`, the callable Gradio's ``auth=`` takes
  (``(username, password) -> bool``): passwords compared in constant time
  (:func:`hmac.compare_digest` of SHA-256 digests, also against a dummy for an
  unknown user), and
  a back-off per user name: after ``max_failures`` failures in a row, attempts
  for that name are refused (HTTP 429, with the wait in the message) for
  ``backoff_s`` seconds, doubled at each further failure up to an hour.
- :class:`LoginThrottleMiddleware`, an ASGI middleware in front of the whole
  app: Gradio's ``auth`` callable never sees the client, so the same back-off
  per client address is kept here, on ``POST /login``, from the status Gradio
  answers (400: wrong credentials, 200: logged in).

Both use :class:`Backoff`, whose table is bounded (expired entries pruned,
then the oldest dropped), so a flood of made-up names or addresses cannot
grow it without limit.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MAX_BACKOFF_S = 3600.0
MAX_KEYS = 10_000


@dataclass
class _State:
    failures: int = 0
    until: float = 0.0  # monotonic time before which attempts are refused
    last: float = 0.0


class Backoff:
    """Failures in a row per key, and how long the key is refused after them."""

    def __init__(self, max_failures: int, backoff_s: float, *, clock: Callable[[], float] = time.monotonic,
                 max_keys: int = MAX_KEYS) -> None:
        self.max_failures = int(max_failures)
        self.backoff_s = float(backoff_s)
        self.max_keys = int(max_keys)
        self._clock = clock
        self._keys: OrderedDict[str, _State] = OrderedDict()
        self._lock = threading.Lock()

    def wait_s(self, key: str) -> float:
        """Seconds before ``key`` may try again (0: now)."""
        with self._lock:
            st = self._keys.get(key)
            return 0.0 if st is None else max(0.0, st.until - self._clock())

    def failure(self, key: str) -> float:
        """Count a failed attempt of ``key``; returns the wait it now has (0: none yet)."""
        now = self._clock()
        with self._lock:
            st = self._keys.pop(key, None) or _State()
            st.failures += 1
            st.last = now
            if st.failures >= self.max_failures:
                extra = st.failures - self.max_failures
                st.until = now + min(MAX_BACKOFF_S, self.backoff_s * (2.0 ** min(extra, 20)))
            self._keys[key] = st
            self._prune(now)
            return max(0.0, st.until - now)

    def success(self, key: str) -> None:
        """A successful attempt clears ``key``'s failures."""
        with self._lock:
            self._keys.pop(key, None)

    def _prune(self, now: float) -> None:
        if len(self._keys) <= self.max_keys:
            return
        for k in [k for k, st in self._keys.items() if st.until <= now and now - st.last > MAX_BACKOFF_S]:
            del self._keys[k]
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)


def refusal(wait_s: float) -> str:
    return (f"Too many failed logins: try again in {math.ceil(wait_s)} s "
            "(each further failure doubles the wait).")


class Logins:
    """Gradio's ``auth`` callable: constant-time password check with a per-user back-off."""

    def __init__(self, pairs: list[tuple[str, str]], backoff: Backoff) -> None:
        self._passwords = {u: p.encode("utf-8") for u, p in pairs}
        self.backoff = backoff

    def __call__(self, username: str, password: str) -> bool:
        from fastapi import HTTPException

        key = username if username in self._passwords else "\0unknown"
        wait = self.backoff.wait_s(key)
        if wait > 0:
            raise HTTPException(status_code=429, detail=refusal(wait))
        expected = self._passwords.get(username)
        given = (password or "").encode("utf-8", "surrogatepass")
        # Digests of equal length: the comparison's time tells neither the password nor its length.
        ok = hmac.compare_digest(hashlib.sha256(given).digest(),
                                 hashlib.sha256(expected if expected is not None else b"\0unknown").digest())
        if ok and expected is not None:
            self.backoff.success(key)
            return True
        self.backoff.failure(key)
        return False


class LoginThrottleMiddleware:
    """ASGI middleware: the back-off per client address on ``POST /login``."""

    def __init__(self, app: Any, backoff: Backoff, path: str = "/login") -> None:
        self.app = app
        self.backoff = backoff
        self.paths = {path, path + "/"}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST" or scope.get("path") not in self.paths:
            await self.app(scope, receive, send)
            return
        client = scope.get("client") or ("?", 0)
        key = str(client[0])
        wait = self.backoff.wait_s(key)
        if wait > 0:
            body = json.dumps({"detail": refusal(wait)}).encode()
            await send({"type": "http.response.start", "status": 429,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"retry-after", str(math.ceil(wait)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        status: list[int] = []

        async def watch(message: dict[str, Any]) -> None:
            if message.get("type") == "http.response.start":
                status.append(int(message.get("status", 0)))
            await send(message)

        await self.app(scope, receive, watch)
        if status and status[0] in (400, 401, 429):
            self.backoff.failure(key)
        elif status and 200 <= status[0] < 400:
            self.backoff.success(key)


def login_message(max_failures: int, backoff_s: float) -> str:
    """The login page's words for the people who sign in (HTML: Gradio puts it in a paragraph
    under its "Login" heading): what the page is, what to type, and what happens after
    repeated failures. How to set the logins up (``ISAGI_AUTH``) is the operator's, in the
    README, never on this page."""
    return (
        "<strong style=\"font-size: 1.25em\">ISAGI chat</strong><br>"
        "Sign in with the user name and password you were given; each user sees only their "
        "own conversations.<br>"
        f"<small>After {int(max_failures)} failed attempts in a row, sign-ins are refused for "
        f"{backoff_s:g} s, even with the right password, and the wait doubles at each further "
        "failure: wait, then try again. Ask whoever runs this server if you forgot your password.</small>"
    )
