"""What the web server takes on trust from a client of Gradio's API: as little as it can.

Owns :class:`GradioGuard`, an ASGI middleware in front of the whole app that
looks at every request to Gradio's API (``/gradio_api/...``) before Gradio does:

- **Session hashes.** Gradio keys a page's state, its queue and its event
  stream (``/gradio_api/queue/data?session_hash=...``) by a session hash the
  browser makes up, and checks nothing else: whoever names the hash reads that
  page's events and runs events with its state. Under ``ISAGI_AUTH`` each hash
  is tied to the login that first used it; a request from another login, or
  from no login, naming it (in the query, the path or the JSON body) gets one
  refusal, :data:`OTHER_LOGIN`. Event ids that Gradio's ``/call/`` routes
  stream by are tied the same way.
- **File paths.** In the JSON body of every call, a file object (a dict with a
  ``path``) that does not name one of the caller's own waiting uploads
  (:class:`app.uploads.UploadLedger`) is replaced by ``null`` before Gradio
  sees it: Gradio would otherwise copy any server file it can read into its
  cache (an app that is mounted, not launched, skips its own check), and hand
  the handler a path. The handler then gives its one neutral answer, the same
  for every path, existing or not.
- **Files served.** Gradio's file routes (``/gradio_api/file=<path>`` and the older
  ``/gradio_api/file/<path>``) serve any file in its cache to whoever names the URL. Here a file
  is served only to a login it was handed to: a download the page handed out (Save .miku, an
  export) or a waiting upload, recorded for its owner (:meth:`app.uploads.UploadLedger.hand_out`,
  :meth:`~app.uploads.UploadLedger.holders`). Anyone else, and any file recorded for nobody
  (one a crashed server left in the cache), gets 404; no login 401.
- **Event calls.** The data of a call of one of the page's events (``queue/join``,
  ``run/``, ``call/``) must fit the event's inputs (:class:`app.event_shapes.EventShapes`: how
  many, of which kind, within a slider's range, among a radio's choices); anything else is a
  400 with one line, before Gradio would raise on it (a 500 and a traceback in the log).
- **Uploads.** A multipart request must state its length; room for it is
  reserved in the caller's upload quota before a byte is read (over it: 413
  with the reason), and the upload route's answer (the paths Gradio wrote) is
  recorded for the caller before the client receives it, so the event that
  opens the file always finds it recorded.

Without a login every client is the owner ``local`` (as everywhere in the
app): session hashes are not tied, uploads belong to ``local`` and the quota
is kept per client address.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from isagi.app.event_shapes import EventShapes
from isagi.app.uploads import UploadLedger
from isagi.errors import UploadError
from isagi.session.service import LOCAL_OWNER

API = "/gradio_api/"
MAX_JSON_BODY = 4 * 1024 * 1024  # an event's JSON (a message is at most 8,000 characters)
# A page event nests a few levels (data -> a component's value -> a message's parts); anything
# deeper is not the page's, and deep enough it breaks a recursive parser downstream (a 500)
MAX_JSON_DEPTH = 64
TOO_DEEP = "This request body is nested too deeply; send the page's own JSON."
MAX_BINDINGS = 100_000
BINDING_TTL_S = 24 * 3600.0
OTHER_LOGIN = "This page's session belongs to another login. Reload the page and log in again."
NOT_LOGGED_IN = "Log in first: this file belongs to a login."
NO_FILE = "This upload holds no file: send a multipart body with a complete 'files' part."

Scope = dict[str, Any]
UserOf = Callable[[Scope], "str | None"]


class Bindings:
    """Keys (session hashes, event ids) tied to the login that first used them, bounded:
    entries unused for ``ttl_s`` expire, and past ``max_keys`` the least recently used go."""

    def __init__(self, *, max_keys: int = MAX_BINDINGS, ttl_s: float = BINDING_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_keys = int(max_keys)
        self.ttl_s = float(ttl_s)
        self._clock = clock
        self._map: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._lock = threading.Lock()

    def admit(self, key: str, user: str | None) -> bool:
        """May ``user`` (None: no login) use ``key``? A key nobody holds is tied to ``user``
        (never to no login); a key another login holds is refused."""
        now = self._clock()
        with self._lock:
            held = self._map.get(key)
            if held is not None and now - held[1] > self.ttl_s:
                del self._map[key]
                held = None
            if held is not None and held[0] != user:
                return False
            if user is not None:
                self._map[key] = (user, now)
                self._map.move_to_end(key)
                while len(self._map) > self.max_keys:
                    self._map.popitem(last=False)
            return True

    def holder(self, key: str) -> str | None:
        with self._lock:
            held = self._map.get(key)
            return None if held is None else held[0]

    def __len__(self) -> int:
        with self._lock:
            return len(self._map)


def gradio_login(gradio_app: Any) -> UserOf:
    """The logged-in user of a request, as Gradio's own ``get_current_user`` finds it
    (its login cookie, looked up in the app's tokens); None without a login."""
    from starlette.requests import HTTPConnection

    def user_of(scope: Scope) -> str | None:
        cookies = HTTPConnection(scope).cookies
        cid = gradio_app.cookie_id
        token = cookies.get(f"access-token-{cid}") or cookies.get(f"access-token-unsecure-{cid}")
        user = gradio_app.tokens.get(token) if token else None
        return user if isinstance(user, str) and user else None

    return user_of


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope.get("headers") or []:
        if k.lower() == name:
            return v.decode("latin-1")
    return None


def _without_headers(scope: Scope, *names: bytes) -> Scope:
    drop = set(names)
    return dict(scope, headers=[(k, v) for k, v in scope.get("headers") or [] if k.lower() not in drop])


def _with_length(scope: Scope, n: int) -> Scope:
    """``scope`` with its Content-Length header saying ``n`` (a rewritten body)."""
    plain = _without_headers(scope, b"content-length")
    return dict(plain, headers=[*plain["headers"], (b"content-length", str(n).encode())])


async def _answer(send: Any, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _read_body(receive: Any, limit: int) -> bytes | None:
    """The request's whole body, or None when it is longer than ``limit``."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"".join(chunks)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _served_file(rest: str) -> str | None:
    """The file a request to Gradio's API names on one of its file routes (``file=<path>``,
    ``file/<path>``), from the path after ``/gradio_api/``; None for any other route."""
    for prefix in ("file=", "file/"):
        if rest.startswith(prefix):
            return rest[len(prefix):]
    return None


def _depth(node: Any) -> int:
    """How deep lists and objects nest in a parsed JSON value (a scalar: 0), without recursion."""
    deepest, stack = 0, [(node, 1)]
    while stack:
        value, level = stack.pop()
        if isinstance(value, dict | list):
            deepest = max(deepest, level)
            if level <= MAX_JSON_DEPTH:  # no need to look further down than the limit
                stack += [(v, level + 1) for v in (value.values() if isinstance(value, dict) else value)]
    return deepest


def _replay(body: bytes, receive: Any) -> Any:
    """A ``receive`` that hands out ``body`` once, then whatever the client sends (a disconnect)."""
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class _Held:
    """A ``send`` that holds a small response back until it is complete, then lets
    ``on_body(status, body)`` look at it before the client gets it; ``on_body`` may return a
    (status, detail) that replaces it (a JSON ``{"detail": ...}``)."""

    def __init__(self, send: Any, on_body: Callable[[int, bytes], tuple[int, str] | None]) -> None:
        self.send, self.on_body = send, on_body
        self.start: dict[str, Any] | None = None
        self.chunks: list[bytes] = []

    async def __call__(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.start = message
            return
        if message["type"] == "http.response.body" and self.start is not None:
            self.chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = b"".join(self.chunks)
            start = self.start
            try:
                replaced = self.on_body(int(start.get("status", 0)), body)
                if replaced is not None:
                    body = json.dumps({"detail": replaced[1]}).encode()
                    start = {"type": "http.response.start", "status": replaced[0],
                             "headers": [(b"content-type", b"application/json"),
                                         (b"content-length", str(len(body)).encode())]}
            finally:
                await self.send(start)
                await self.send({"type": "http.response.body", "body": body})
            return
        await self.send(message)


class GradioGuard:
    """ASGI middleware: session hashes and event ids tied to their login, file paths in
    calls limited to the caller's uploads, uploads within the caller's quota and recorded.

    ``user_of(scope)``: the request's logged-in user (:func:`gradio_login`);
    ``auth``: whether the app requires a login.
    """

    def __init__(self, app: Any, *, ledger: UploadLedger, user_of: UserOf, auth: bool,
                 hashes: Bindings | None = None, events: Bindings | None = None,
                 shapes: EventShapes | None = None) -> None:
        self.app = app
        self.shapes = shapes  # the page's events (None: calls are not checked)
        self.ledger = ledger
        self.user_of = user_of
        self.auth = bool(auth)
        self.hashes = hashes if hashes is not None else Bindings()
        self.events = events if events is not None else Bindings()

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        path = scope.get("path") or ""
        at = path.find(API)
        if scope.get("type") != "http" or at < 0:
            await self.app(scope, receive, send)
            return
        route = path[at + len(API):].strip("/")
        user = self.user_of(scope) if self.auth else None
        owner = (user or "") if self.auth else LOCAL_OWNER
        served = _served_file(path[at + len(API):])
        if served is not None:  # a download or a waiting upload is its owner's alone
            holders = self.ledger.holders(served)
            if self.auth and user is None:
                await _answer(send, 401, NOT_LOGGED_IN)
                return
            if holders is None or owner not in holders:  # another's, or recorded for nobody
                await _answer(send, 404, "Not Found")
                return
        if self.auth and not self._url_admitted(route, scope, user):
            await _answer(send, 403, OTHER_LOGIN)
            return
        if scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        if (_header(scope, b"content-type") or "").lower().startswith("multipart/"):
            await self._multipart(route, scope, receive, send, user, owner)
            return
        body = await _read_body(receive, MAX_JSON_BODY)
        if body is None:
            await _answer(send, 413, f"This request is larger than {MAX_JSON_BODY // (1024 * 1024)} MiB.")
            return
        try:
            data = json.loads(body) if body else None
        except (ValueError, UnicodeDecodeError):
            data = None  # not JSON: Gradio refuses it itself
        except RecursionError:  # nesting deeper than Python's parser goes
            await _answer(send, 400, TOO_DEEP)
            return
        if _depth(data) > MAX_JSON_DEPTH:
            await _answer(send, 400, TOO_DEEP)
            return
        if self.shapes is not None and (why := self.shapes.problem(route, data)) is not None:
            await _answer(send, 400, f"This call does not fit the page's event: {why}.")
            return
        if isinstance(data, dict):
            if self.auth and not self._body_admitted(route, data, user):
                await _answer(send, 403, OTHER_LOGIN)
                return
            if self._scrub(data, owner if (user is not None or not self.auth) else None):
                body = json.dumps(data).encode()
                scope = _with_length(scope, len(body))
        if self.auth and user is not None and (route == "queue/join" or route.startswith("call/")):
            # the event id in the answer is tied to the caller before the caller learns it
            await self.app(_without_headers(scope, b"accept-encoding"), _replay(body, receive),
                           _Held(send, lambda status, out: self._bind_event(status, out, user)))
            return
        await self.app(scope, _replay(body, receive), send)

    # -- session hashes and event ids ------------------------------------------------------
    def _url_admitted(self, route: str, scope: Scope, user: str | None) -> bool:
        from urllib.parse import parse_qs

        parts = route.split("/")
        query = parse_qs((scope.get("query_string") or b"").decode("latin-1"))
        hashes = list(query.get("session_hash", []))
        if parts[0] == "heartbeat" and len(parts) >= 2:
            hashes.append(parts[1])
        events: list[str] = []
        if parts[0] == "stream" and len(parts) >= 4:  # stream/{session_hash}/{run}/{component}/...
            hashes.append(parts[1])
        elif parts[0] == "stream" and len(parts) >= 2:  # stream/{event_id}[/close]
            events.append(parts[1])
        if parts[0] == "call" and scope.get("method") == "GET" and len(parts) >= 3:
            events.append(parts[-1])  # call/{api}/{event_id}, call/v2/{api}/{event_id}
        return (all(self.hashes.admit(h, user) for h in hashes)
                and all(self.events.admit(e, user) for e in events))

    def _body_admitted(self, route: str, data: dict[str, Any], user: str | None) -> bool:
        sh = data.get("session_hash")
        if isinstance(sh, str) and sh and not self.hashes.admit(sh, user):
            return False
        eid = data.get("event_id")
        return not (route == "cancel" and isinstance(eid, str) and not self.events.admit(eid, user))

    def _bind_event(self, status: int, body: bytes, user: str) -> None:
        if status != 200:
            return
        try:
            eid = json.loads(body).get("event_id")
        except (ValueError, AttributeError, UnicodeDecodeError, RecursionError):
            return
        if isinstance(eid, str) and eid:
            self.events.admit(eid, user)

    # -- file paths -----------------------------------------------------------------------
    def _scrub(self, node: Any, owner: str | None) -> bool:
        """Replace, in place, every file object not naming one of ``owner``'s uploads by None
        (``owner`` None: nobody's); True if anything was replaced."""
        changed = False
        items: list[tuple[Any, Any]] = (
            list(node.items()) if isinstance(node, dict) else list(enumerate(node)) if isinstance(node, list) else []
        )
        for key, value in items:
            if isinstance(value, dict) and "path" in value:
                if owner is None or not self.ledger.owns(owner, value.get("path")):
                    node[key] = None
                    changed = True
            elif isinstance(value, dict | list):
                changed = self._scrub(value, owner) or changed
        return changed

    # -- uploads --------------------------------------------------------------------------
    async def _multipart(self, route: str, scope: Scope, receive: Any, send: Any,
                         user: str | None, owner: str) -> None:
        if self.auth and user is None:
            await self.app(scope, receive, send)  # Gradio refuses it (no login) before reading it
            return
        length = _header(scope, b"content-length")
        if length is None or not length.strip().isdigit():
            await _answer(send, 411, "An upload must state its length (Content-Length).")
            return
        client = (scope.get("client") or ("?", 0))[0]
        quota_key = owner if self.auth else f"{LOCAL_OWNER}@{client}"
        try:
            reservation = self.ledger.reserve(quota_key, int(length))
        except UploadError as exc:
            await _answer(send, 413, str(exc))
            return
        try:
            if route == "upload":
                def record(status: int, body: bytes) -> tuple[int, str] | None:
                    self.ledger.release(reservation)  # arrived: counted as waiting from now on
                    if status != 200:
                        return None
                    try:
                        paths = json.loads(body)
                    except (ValueError, UnicodeDecodeError):
                        return None
                    if paths == []:  # a malformed multipart body: Gradio read no file from it
                        return 400, NO_FILE
                    if isinstance(paths, list):
                        self.ledger.record(owner, quota_key, paths)
                    return None

                await self.app(_without_headers(scope, b"accept-encoding"), receive, _Held(send, record))
            else:
                await self.app(scope, receive, send)
        finally:
            self.ledger.release(reservation)
