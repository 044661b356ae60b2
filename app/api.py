"""The OpenAI-compatible API: ``POST /v1/chat/completions`` and ``GET /v1/models``.

Owns translating between OpenAI's chat protocol and ISAGI's sessions, so any
OpenAI client (the ``openai`` package, ``curl``, editor plugins, chat front
ends) can talk to ISAGI and keep its living memory. It is mounted on the same
FastAPI app as the page (:func:`app.server.create_app`) and runs every turn
through the same pipeline (:mod:`app.turns`, :class:`app.sessions.SessionRegistry`,
the engine's tiers, RETRIEVE, guard, record and autosave), so an API
conversation is a session like any other: in the Sessions tab, the history,
exports and its ``.miku``.

OpenAI clients are stateless: they send the whole conversation each time. A
request maps to one of the caller's sessions by the ``X-Isagi-Session``
header (echoed in every response), or, without it, to the caller's session
(live, or saved in the history: then made live again under its id, as a page
reload does) whose recorded turns equal the request's earlier messages;
otherwise a new session is made. Only the last (user) message is new; system messages
are ignored (the system prompt is the server's, ``ISAGI_SYSTEM_PROMPT``).
Responses carry an ``isagi`` object (session id, tier, verdict, TEH) beside
OpenAI's fields; clients ignore it.

Callers: with ``ISAGI_API_KEYS`` (``alice:KEY,...``) a Bearer key works as its
owner (the same names as ``ISAGI_AUTH``); a missing or wrong key is a 401 and
counts as a failed login of the client's address (:class:`app.login.Backoff`,
the page's throttle: after too many, keys and passwords from that address wait). Without any auth setting the API answers loopback
clients only, as owner ``local``; with ``ISAGI_AUTH`` but no keys it answers
nobody (a 401 saying to set ``ISAGI_API_KEYS``).

Limits are the page's: message characters and tokens and the prompt budget
(:meth:`isagi.pipeline.engine.Engine.check`), the per-client and overall session caps
(the registry's; at a cap the caller's least recently used idle API session is
parked, so one-off questions do not lock a client out), one turn of a session
at a time (a replayed conversation that another request continued meanwhile is
a 409), and the one model (the engine's lock); at most
:data:`MAX_TURNS_IN_FLIGHT` API turns run or wait for it at once, beyond that a
429 as from a full queue. The key is checked before the body is read, and the
body (at most :data:`MAX_BODY_BYTES`, :data:`MAX_MESSAGES` messages) is parsed
by :data:`PARSES_AT_ONCE` requests at a time.

Every failure is an OpenAI-shaped error ``{"error": {"message", "type",
"param", "code"}}`` with a 4xx status (a 503 while the model loads), never a
bare 500. A turn whose client disconnects before its answer (streamed or not)
is dropped: the engine rolls it back and no turn is kept (:func:`app.turns.abandon`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import ipaddress
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# At module level: FastAPI resolves the handlers' annotations (``from __future__``) here.
from starlette.requests import Request

from app import turns
from app.loader import EngineLoading
from app.sessions import SAVED_AGAIN, SessionBusy, SessionLimit
from isagi.errors import ConfigError, IsagiError
from isagi.ids import is_session_id
from isagi.pipeline.events import Done, shown_text
from isagi.session.folder import SessionFiles
from storage.miku import MAX_TURNS
from storage.owners import LOCAL_OWNER

log = logging.getLogger(__name__)

SESSION_HEADER = "X-Isagi-Session"
MAX_BODY_BYTES = 16 * 1024 * 1024  # a whole conversation is sent each time: room for a long one
MAX_STOP_SEQUENCES = 4
MAX_TURNS_IN_FLIGHT = 32  # API turns running or waiting for the model at once (the model runs one at a time)
DISCONNECT_POLL_S = 0.2  # how often a request waiting for its turn looks whether its client is still there
BUSY_WAIT_S = 10.0  # how long a turn waits for its session's lock (the page's STOP_WAIT_S)
ROLES = ("system", "developer", "user", "assistant")
# A conversation's messages: a session's turns (a question and a reply each), its new question,
# and room for system messages; a longer one could never continue a session.
MAX_MESSAGES = 2 * MAX_TURNS + 64
PARSES_AT_ONCE = 2  # bodies parsed at once: a 16 MiB body of tiny messages takes ~150 MiB as objects
MATCH_SCAN = 50  # a caller's most recently updated sessions looked at for a replayed conversation
MADE_KEPT = 1024  # ids of sessions the API made live, remembered before the gone ones are forgotten
PARK_TRIES = 4  # sessions parked at most to make room for one (the client's, the user's, the server's cap)


class ApiError(Exception):
    """An OpenAI-shaped error: ``status``, a one-line ``message``, its ``type``, ``param`` and ``code``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def parse_api_keys(spec: str | None) -> dict[str, str]:
    """``"alice:KEY,bob:KEY2"`` → ``{"KEY": "alice", "KEY2": "bob"}``; ``None``/empty → no keys."""
    keys: dict[str, str] = {}
    for item in (spec or "").split(","):
        item = item.strip()
        if not item:
            continue
        user, sep, key = item.partition(":")
        user, key = user.strip(), key.strip()
        if not sep or not user or not key:
            raise ConfigError(f"ISAGI_API_KEYS entry {user[:20]!r}… is not user:key; write it as user:KEY,user2:KEY2.")
        if user == LOCAL_OWNER:
            raise ConfigError(f"ISAGI_API_KEYS: the user name {LOCAL_OWNER!r} is reserved; pick another name.")
        if len(user) > 64:
            raise ConfigError(f"ISAGI_API_KEYS: the user name {user[:20]!r}… is longer than 64 characters.")
        if key in keys:
            raise ConfigError(f"ISAGI_API_KEYS: two entries ({keys[key]!r}, {user!r}) share a key; give each its own.")
        keys[key] = user
    return keys


def same_exchanges(recorded: list[tuple[str, str, str]], said: list[tuple[str, str]]) -> bool:
    """Whether a session's ``recorded`` (question, reply, verdict) exchanges are the ``said``
    (question, reply) ones a client sends back. A withheld reply counts as said both as recorded
    and as streamed (the part generated before it was withheld, then the notice)."""
    if len(recorded) != len(said):
        return False
    for (q, reply, verdict), (q2, reply2) in zip(recorded, said, strict=True):
        if q != q2 or not (reply2 == reply or (verdict == "withheld" and reply2.endswith("\n\n" + reply))):
            return False
    return True


def _is_loopback(host: str | None) -> bool:
    """Whether ``host`` is this machine (``::ffff:127.0.0.1``, a dual-stack socket's IPv4 client, too)."""
    try:
        ip = ipaddress.ip_address((host or "").split("%")[0])
    except ValueError:
        return False
    return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback


# --------------------------------------------------------------------------- the request


@dataclass
class ChatRequest:
    """What ISAGI takes from an OpenAI chat request."""

    model: str
    text: str  # the new (last) user message, as sent
    earlier: list[tuple[str, str]] | None  # the earlier (user, assistant) exchanges; None: not pairs
    stream: bool
    include_usage: bool
    options: Any  # isagi.engines.base.GenerationOptions


def _content(m: dict[str, Any], i: int) -> str:
    """The text of message ``i``: a string, or a list of text parts (joined)."""
    c = m.get("content")
    if c is None and m.get("role") == "assistant":
        return ""
    if isinstance(c, str):
        return c
    kinds = {"text": "text", "refusal": "refusal"} if m.get("role") == "assistant" else {"text": "text"}
    if isinstance(c, list) and all(isinstance(p, dict) and p.get("type") in kinds
                                   and isinstance(p.get(kinds[p["type"]]), str) for p in c):
        return "".join(p[kinds[p["type"]]] for p in c)  # an assistant's parts: text or refusal (OpenAI's)
    raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts (ISAGI takes text only).",
                   param=f"messages[{i}].content")


def _number(body: dict[str, Any], name: str, lo: float, hi: float) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not lo <= v <= hi:
        raise ApiError(400, f"{name} must be a number from {lo:g} to {hi:g}; got {json.dumps(v)[:40]}.", param=name)
    return float(v)


def _integer(body: dict[str, Any], name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ApiError(400, f"{name} must be an integer from {lo:,} to {hi:,}; got {json.dumps(v)[:40]}.", param=name)
    return v


def _flag(body: dict[str, Any], name: str, where: str | None = None) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise ApiError(400, f"{where or name} must be true or false.", param=where or name)
    return v


def parse_request(raw: bytes, max_new_tokens: int) -> ChatRequest:
    """The request body checked and read, or an :class:`ApiError` (400) naming what to fix.

    ``max_new_tokens``: the server's reply limit (``ISAGI_MAX_NEW_TOKENS``), the default and
    the cap of ``max_tokens`` (a larger one is capped, not refused). Fields ISAGI does not know are ignored.
    """
    from isagi.engines.base import GenerationOptions

    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "The request body is not valid JSON; send a JSON object.") from None
    except RecursionError:  # nesting deeper than Python's parser goes
        raise ApiError(400, "The request body is nested too deeply; send a JSON object of messages.") from None
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "model is required: a model id from GET /v1/models.", param="model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects.", param="messages")
    if len(messages) > MAX_MESSAGES:
        raise ApiError(400, f"messages holds {len(messages):,} messages; a conversation here has at most "
                       f"{MAX_MESSAGES:,} (a session keeps {MAX_TURNS:,} turns).", param="messages",
                       code="too_many_messages")
    said: list[tuple[str, str]] = []
    for i, m in enumerate(messages):
        if isinstance(m, dict) and m.get("role") in ("tool", "function"):
            raise ApiError(400, f"messages[{i}] is a {m['role']} result, but ISAGI offers no tools (its replies "
                           "never call one); send user and assistant messages.", param=f"messages[{i}]")
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(400, f"messages[{i}] must be an object whose role is one of {', '.join(ROLES)}.",
                           param=f"messages[{i}]")
        if m["role"] in ("system", "developer"):
            _content(m, i)  # checked, not used: the system prompt is the server's
            continue
        said.append((m["role"], _content(m, i)))
    if not said or said[-1][0] != "user":
        raise ApiError(400, "The last message (besides system ones) must be the user's.", param="messages")
    rest = said[:-1]
    pairs = len(rest) % 2 == 0 and all(r == ("user", "assistant")[k % 2] for k, (r, _) in enumerate(rest))
    earlier = [(rest[k][1], rest[k + 1][1]) for k in range(0, len(rest), 2)] if pairs else None

    stream = _flag(body, "stream")
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise ApiError(400, "stream_options must be an object.", param="stream_options")
        if not stream:
            raise ApiError(400, "stream_options is only allowed with stream: true.", param="stream_options")
    include_usage = _flag(opts or {}, "include_usage", "stream_options.include_usage")
    if body.get("n") not in (None, 1):
        raise ApiError(400, "n must be 1: each turn of a session has one reply.", param="n")
    # Above the server's limit: capped to it (clients often send a large default such as 4096);
    # a reply that reaches it ends with finish_reason "length".
    limit = _integer(body, "max_completion_tokens", 1, 2**31 - 1)
    if limit is None:
        limit = _integer(body, "max_tokens", 1, 2**31 - 1)
    if limit is not None:
        limit = min(limit, max_new_tokens)
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0)
    if top_p == 0.0:
        raise ApiError(400, "top_p must be above 0 (1 keeps every token).", param="top_p")
    seed = _integer(body, "seed", -(2**63), 2**63 - 1)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and len(stop) <= MAX_STOP_SEQUENCES
                                 and all(isinstance(s, str) for s in stop)):
        raise ApiError(400, f"stop must be a string or a list of at most {MAX_STOP_SEQUENCES} strings.", param="stop")
    if stop and any(stop):
        raise ApiError(400, "stop sequences are not supported by ISAGI: every reply is kept whole in the "
                       "living memory; leave stop out and end the reply with max_tokens.", param="stop")
    sample = temperature is not None and temperature > 0  # none or 0: greedy, as the page's default
    options = GenerationOptions(
        max_new_tokens=limit or max_new_tokens, do_sample=sample,
        temperature=temperature if sample else 0.7, top_p=1.0 if top_p is None else top_p,
        seed=None if seed is None else seed % 2**32,
    )
    return ChatRequest(model, said[-1][1], earlier, stream, include_usage, options)


# --------------------------------------------------------------------------- the API


class Api:
    """The API's handlers, bound to the app's engine holder, registry and settings."""

    def __init__(self, holder: Any, registry: Any, settings: Any, backoff: Any) -> None:
        self.holder = holder
        self.registry = registry
        self.settings = settings
        self.backoff = backoff  # failures per client address: the page's login throttle
        self.keys = {hashlib.sha256(k.encode()).digest(): u for k, u in parse_api_keys(settings.api_keys).items()}
        self.created = int(time.time())
        self.max_turns = MAX_TURNS_IN_FLIGHT
        self._in_flight = 0
        self._count = threading.Lock()
        self._parsing = threading.BoundedSemaphore(PARSES_AT_ONCE)
        self._made: dict[str, None] = {}  # sessions the API made live (parked to make room at a cap)

    def take_slot(self) -> None:
        """Take one of the :attr:`max_turns` places of API turns running or waiting for the
        model (:meth:`free_slot` gives it back); none free: an :class:`ApiError` (429), as a
        full queue, instead of one more thread parked on the model."""
        with self._count:
            if self._in_flight >= self.max_turns:
                raise ApiError(429, f"The model is busy with {self._in_flight} API requests; try again shortly.",
                               type="rate_limit_error", code="server_busy", headers={"Retry-After": "5"})
            self._in_flight += 1

    def free_slot(self) -> None:
        with self._count:
            self._in_flight -= 1

    # -- who and what --------------------------------------------------------------
    def caller(self, request: Any) -> str:
        """The owner a request works as, or an :class:`ApiError` (401, 403, 429)."""
        client = getattr(getattr(request, "client", None), "host", None) or "unknown"
        if not self.keys:
            if self.settings.auth:
                raise ApiError(401, "This server requires a login (ISAGI_AUTH): the API takes Bearer keys from "
                               "ISAGI_API_KEYS, which is not set; ask its operator for a key.",
                               type="invalid_request_error", code="invalid_api_key")
            if not _is_loopback(client):
                raise ApiError(403, "Without ISAGI_API_KEYS the API answers this machine only; set "
                               "ISAGI_API_KEYS=user:KEY on the server and send the key as a Bearer token.",
                               type="permission_error", code="loopback_only")
            return LOCAL_OWNER
        wait = self.backoff.wait_s(client)
        if wait > 0:
            raise ApiError(429, f"Too many failed keys from this address; try again in {math.ceil(wait)} s.",
                           type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": str(math.ceil(wait))})
        auth = request.headers.get("authorization") or ""
        scheme, _, key = auth.partition(" ")
        digest = hashlib.sha256(key.strip().encode()).digest()
        owner = None
        for known, user in self.keys.items():  # every key compared, in constant time
            if hmac.compare_digest(known, digest) and scheme.lower() == "bearer":
                owner = user
        if owner is None:
            self.backoff.failure(client)
            what = "No API key" if not auth else "Incorrect API key"
            raise ApiError(401, f"{what}: send Authorization: Bearer KEY with a key of ISAGI_API_KEYS.",
                           code="invalid_api_key")
        return owner  # a right key clears nothing: a key holder cannot wipe a guesser's record

    def engine(self) -> Any:
        """The engine, or a 503 saying what the loader does (a failed load: no server detail)."""
        try:
            return self.holder.engine
        except EngineLoading:
            if self.holder.failed:
                raise ApiError(503, "The model could not be loaded; the server's log says why. Restart the "
                               "server once that is fixed.", type="server_error", code="model_failed") from None
            raise ApiError(503, f"{self.holder.describe()}. The API answers once the model is ready.",
                           type="server_error", code="model_loading", headers={"Retry-After": "10"}) from None

    def models(self) -> dict[str, Any]:
        engine = self.engine()
        return {"object": "list", "data": [self._model(engine.lm.model_id)]}

    def _model(self, model_id: str) -> dict[str, Any]:
        return {"id": model_id, "object": "model", "created": self.created, "owned_by": "isagi"}

    def model(self, model_id: str) -> dict[str, Any]:
        engine = self.engine()
        if model_id != engine.lm.model_id:
            raise self._unknown_model(model_id, engine)
        return self._model(model_id)

    @staticmethod
    def _unknown_model(model_id: str, engine: Any) -> ApiError:
        return ApiError(404, f"The model {model_id[:80]!r} is not served here; use {engine.lm.model_id!r} "
                        "(GET /v1/models).", param="model", code="model_not_found")

    # -- sessions ------------------------------------------------------------------
    def session_for(self, owner: str, client: str | None, req: ChatRequest,
                    named: str | None) -> tuple[str, list[tuple[str, str]] | None]:
        """The id of the caller's session this request continues (see the module's docstring),
        and, when it was found by the replayed turns, those turns (:meth:`run_turn` checks that
        the session still holds just them once it has its lock)."""
        from isagi.pipeline.prompts import clean_message

        if named:
            if is_session_id(named) and self.registry.holds(named, owner):  # live, or parked: resumed at its use
                with self._count:
                    self._made[named] = None
                return named, None
            summary = self._summary(named, owner) if is_session_id(named) else None
            if summary is not None and (sid := self._admitted(lambda: self._reopen(summary, owner, client),
                                                              owner, client)) is not None:
                return sid, None
            raise ApiError(404, f"No session {named[:64]!r} of yours to continue here; leave out "
                           f"{SESSION_HEADER} to start one.", param=SESSION_HEADER, code="session_not_found")
        if req.earlier:
            want = [(clean_message(u), a) for u, a in req.earlier]
            found = self._admitted(lambda: self.find(owner, client, want), owner, client)
            if found is not None:
                return found, want
        # claimed: another request at the cap must not reclaim it as an empty chat before its turn
        return self._admitted(lambda: self.registry.create(owner, client, claimed=True), owner, client), None

    def _admitted(self, make: Callable[[], str | None], owner: str, client: str | None) -> str | None:
        """``make()`` (a session made or reopened live), making room at a session cap by parking
        the caller's least recently used idle session the API made live (kept in its file and
        the history, resumed by its id or its replay, as idle eviction does): every new
        conversation of a client is a session, and a script of many one-off questions must not
        lock its user (and their page) out until the idle time. A cap still full: a 429."""
        for _ in range(PARK_TRIES):
            try:
                sid = make()
            except SessionLimit:
                if self._park_one(owner, client):
                    continue
                break
            if sid is not None:
                with self._count:
                    self._made[sid] = None
                    if len(self._made) > MADE_KEPT:  # forget the ids of sessions no longer live or parked
                        self._made = {m: None for m in self._made if m in self.registry}
            return sid
        raise ApiError(429, "Too many open chats for this client or user (ISAGI_MAX_SESSIONS_PER_CLIENT), all of "
                       "them busy or open in a page; try again shortly.", type="rate_limit_error",
                       code="session_limit", headers={"Retry-After": "5"})

    def _park_one(self, owner: str, client: str | None) -> bool:
        """Park ``owner``'s least recently used idle session that the API made live (this
        client's first); whether one was."""
        with self._count:
            made = list(self._made)
        idle = []
        for sid in made:
            entry = self.registry.live_entry(sid, owner) if sid in self.registry else None
            if entry is None:
                if sid not in self.registry:
                    with self._count:
                        self._made.pop(sid, None)  # gone (evicted, released, another's never listed)
                continue
            if not entry.lock.locked():
                idle.append((entry.client != client, entry.last_used, sid))
        for *_, sid in sorted(idle):
            try:
                if self.registry.release(sid, park=True, owner=owner):
                    with self._count:
                        self._made.pop(sid, None)
                    return True
            except IsagiError as exc:  # its file could not be written: it stays live
                log.warning("could not park session %s to make room: %s", sid, exc)
        return False

    def find(self, owner: str, client: str | None, want: list[tuple[str, str]]) -> str | None:
        """The caller's session whose turns are exactly ``want`` (the earlier exchanges, their
        questions as :func:`isagi.pipeline.prompts.clean_message` keeps them), or None: a live one (the newest
        used first), else one of their :data:`MATCH_SCAN` most recently updated sessions in the
        history, made live again under its id as a page reload does (parked: resumed; saved
        before a restart: reopened from its ``.miku``)."""
        found: list[tuple[float, str]] = []
        for sid in self.registry.live_ids(owner):
            entry = self.registry.live_entry(sid, owner)
            if entry is None:
                continue
            if same_exchanges([(t.user_text, t.reply_text, t.verdict) for t in list(entry.session.turns)], want):
                found.append((entry.last_used, sid))
        if found:
            return max(found)[1]
        return self._find_saved(owner, client, want)

    def _find_saved(self, owner: str, client: str | None, want: list[tuple[str, str]]) -> str | None:
        engine = self.engine()
        store = getattr(engine, "store", None)
        if store is None:
            return None
        for summary in store.list_sessions(limit=MATCH_SCAN, owner=owner):
            if summary.turns != len(want) or self.registry.live_entry(summary.id, owner) is not None:
                continue
            try:
                rows = store.get_turns(summary.id, owner=owner)
                same = [r.role for r in rows] == ["user", "assistant"] * len(want) and same_exchanges(
                    [(q.text, a.text, a.verdict) for q, a in zip(rows[::2], rows[1::2], strict=True)], want)
            except IsagiError:
                continue
            if same and (sid := self._reopen(summary, owner, client)) is not None:
                return sid
        return None

    def _summary(self, sid: str, owner: str) -> Any:
        """``owner``'s history summary of ``sid``, or None (unknown, another's, no history)."""
        store = getattr(self.engine(), "store", None)
        try:
            return None if store is None else store.get_session(sid, owner=owner)
        except (IsagiError, ValueError):
            return None

    def _reopen(self, summary: Any, owner: str, client: str | None) -> str | None:
        """Make ``owner``'s saved session live again under its id, as a page reload does (parked:
        resumed at its next use; else opened from its ``.miku``); None when it has no living
        state to continue or it cannot be read (a new session it is then)."""
        from isagi.session.files import load_session

        if self.registry.holds(summary.id, owner):
            return summary.id
        engine = self.engine()
        path = SessionFiles(engine.settings.sessions_dir).find(summary.id, summary.miku_path)
        if path is None:
            return None
        try:
            return self.registry.reopen(load_session(engine.frame, path, session_id=summary.id),
                                        owner=owner, client=client)
        except SessionLimit:
            raise  # a cap: :meth:`_admitted` makes room
        except (IsagiError, KeyError, OSError) as exc:  # unreadable, or live for another owner
            log.warning("could not continue session %s from the history: %s", summary.id, exc)
            return None

    # -- a turn --------------------------------------------------------------------
    def run_turn(self, sid: str, owner: str, message: Any, options: Any,
                 emit: Callable[[Any], bool], started: Callable[[], None],
                 expect: list[tuple[str, str]] | None = None) -> tuple[Any, str | None]:
        """Run one turn of ``owner``'s session ``sid`` through the page's pipeline; returns the
        turn and the engine's notice. ``emit(event)`` gets each event before ``done`` and returns
        False once nobody listens: the turn is then dropped (nothing kept) and None returned.
        ``started()`` is called once the turn runs (an error before it is the request's).
        ``expect``: the exchanges the session was found by; another request that continued it
        meanwhile makes this one a 409 (its question would follow a reply its client never saw)."""
        engine = self.engine()
        try:
            with self.registry.using(sid, timeout=BUSY_WAIT_S, owner=owner) as entry:
                if expect is not None and not same_exchanges(
                        [(t.user_text, t.reply_text, t.verdict) for t in list(entry.session.turns)], expect):
                    raise ApiError(409, "Another request continued this conversation first; send the "
                                   "conversation again with that request's reply.", code="conversation_changed")
                turns.begin(entry)
                try:
                    events = turns.open_events(engine, entry, message, options)
                except IsagiError as exc:  # e.g. a session at its most turns
                    raise ApiError(400, " ".join(str(exc).split()), param="messages") from None
                started()
                finished = False
                try:
                    for ev in events:
                        if isinstance(ev, Done):
                            finished = True
                            entry.notice = ev.notice
                            if ev.notice is None and entry.resaved:
                                # the server wrote what the previous answer said was waiting
                                entry.resaved = False
                                return ev.turn, SAVED_AGAIN
                            return ev.turn, ev.notice
                        if not emit(ev):
                            break
                finally:
                    if not finished:
                        turns.abandon(entry, events, keep=False)
                return None, None
        except SessionBusy as exc:
            raise ApiError(409, str(exc), code="session_busy") from None
        except KeyError:
            raise ApiError(404, "This session was closed meanwhile; send the conversation again.",
                           code="session_not_found") from None

    def prepare(self, request: Any, owner: str,
                raw: bytes | None) -> tuple[ChatRequest, Any, str, Any, list[tuple[str, str]] | None]:
        """What ``owner`` (:meth:`caller`) asks, in which session: (request, engine, session id,
        checked message, the exchanges it was found by: :meth:`run_turn`'s ``expect``). ``raw``: the body, None when it was over :data:`MAX_BODY_BYTES`."""
        if raw is None:
            raise ApiError(413, f"The request is over {MAX_BODY_BYTES // 2**20} MiB; send a shorter conversation.")
        engine = self.engine()
        with self._parsing:  # a few at once: many large bodies parsed together would take GiBs
            req = parse_request(raw, int(self.settings.max_new_tokens))
        if req.model != engine.lm.model_id:
            raise self._unknown_model(req.model, engine)
        try:
            checked = engine.check(req.text)  # the page's limits: characters, tokens, prompt budget
        except IsagiError as exc:
            raise ApiError(400, " ".join(str(exc).split()), param="messages", code="message_too_long"
                           if "limit" in str(exc) or "budget" in str(exc) else "invalid_message") from None
        client = getattr(getattr(request, "client", None), "host", None)
        sid, expect = self.session_for(owner, client, req, request.headers.get(SESSION_HEADER))
        return req, engine, sid, checked, expect

    # -- answers -------------------------------------------------------------------
    @staticmethod
    def finish_reason(turn: Any, options: Any) -> str:
        if turn.verdict in ("refused", "withheld"):
            return "content_filter"
        if getattr(turn, "generated", False) and turn.new_tokens >= options.max_new_tokens:
            return "length"
        return "stop"

    @staticmethod
    def extension(sid: str, turn: Any, notice: str | None) -> dict[str, Any]:
        return {"session": sid, "tier": turn.tier, "verdict": turn.verdict, "distance": turn.distance,
                "teh_prompt": turn.teh_prompt, "teh_reply": turn.teh_reply, "notice": notice}

    @staticmethod
    def usage(engine: Any, turn: Any, content: str) -> dict[str, int]:
        """Tokens of the prompt the model read and of the reply sent (the model's tokenizer's count)."""
        out = engine.prompts.count_tokens(content) if content else 0
        return {"prompt_tokens": int(turn.prompt_tokens), "completion_tokens": out,
                "total_tokens": int(turn.prompt_tokens) + out}


async def read_body(request: Any) -> bytes | None:
    """The request's body, or None once it is over :data:`MAX_BODY_BYTES` (read no further)."""
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > MAX_BODY_BYTES:
            return None
        parts.append(part)
    return b"".join(parts)


def _send_soon(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, item: Any) -> None:
    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens any more
        loop.call_soon_threadsafe(queue.put_nowait, item)


def mount_api(app: Any, holder: Any, registry: Any, settings: Any, backoff: Any) -> Api:
    """Add ``/v1/models`` and ``/v1/chat/completions`` to ``app`` (before the page's mount)."""
    from fastapi.responses import JSONResponse
    from starlette.responses import StreamingResponse

    api = Api(holder, registry, settings, backoff)

    class _Stream(StreamingResponse):
        """A stream that calls ``on_close`` however it ends (a client gone included)."""

        def __init__(self, body: Any, on_close: Callable[[], None], **kw: Any) -> None:
            super().__init__(body, **kw)
            self.on_close = on_close

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            try:
                await super().__call__(scope, receive, send)
            finally:
                self.on_close()

    def failure(exc: ApiError, sid: str | None = None) -> Any:
        headers = dict(exc.headers)
        if sid:
            headers[SESSION_HEADER] = sid
        return JSONResponse(status_code=exc.status, content=exc.body(), headers=headers)

    @app.get("/v1/models")
    def list_models(request: Request) -> Any:
        try:
            api.caller(request)
            return api.models()
        except ApiError as exc:
            return failure(exc)

    @app.get("/v1/models/{model_id:path}")
    def get_model(model_id: str, request: Request) -> Any:
        try:
            api.caller(request)
            return api.model(model_id)
        except ApiError as exc:
            return failure(exc)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        from starlette.concurrency import run_in_threadpool

        try:
            owner = api.caller(request)  # before the body: a stranger's body is never read
            raw = await read_body(request)
            api.take_slot()  # before a session is made: a full queue makes none
        except ApiError as exc:
            return failure(exc, request.headers.get(SESSION_HEADER))
        try:
            req, engine, sid, checked, expect = await run_in_threadpool(api.prepare, request, owner, raw)
        except BaseException as exc:
            api.free_slot()
            if isinstance(exc, ApiError):
                return failure(exc, request.headers.get(SESSION_HEADER))
            raise
        completion = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        model = engine.lm.model_id
        headers = {SESSION_HEADER: sid}
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        gone = threading.Event()

        def emit(ev: Any) -> bool:
            if gone.is_set():
                return False
            _send_soon(loop, queue, ("event", ev))
            return True

        def work() -> None:
            item: tuple[str, Any] = ("error", ApiError(500, "This turn ended unexpectedly; try again.",
                                                       type="server_error"))
            try:
                turn, notice = api.run_turn(sid, owner, checked, req.options, emit,
                                            lambda: _send_soon(loop, queue, ("started", None)), expect)
                item = ("done", (turn, notice))
            except ApiError as exc:
                item = ("error", exc)
            except Exception as exc:  # a bug: the engine has rolled the turn back
                log.exception("API turn failed in session %s", sid)
                item = ("error", ApiError(
                    500, f"This turn failed ({type(exc).__name__}); the session is as it was before it. "
                    "Try again, and report the error if it repeats.", type="server_error"))
            finally:
                api.free_slot()  # before the answer: a client that has it may send the next one
                _send_soon(loop, queue, item)

        try:
            threading.Thread(target=work, name="isagi-api-turn", daemon=True).start()
        except BaseException:
            api.free_slot()
            raise

        async def watch() -> None:
            """A client gone before its answer (a non-streamed one, or one still waiting for its
            session or the model) ends the turn, which is then dropped as a stream's is."""
            while not gone.is_set():
                if await request.is_disconnected():
                    gone.set()
                    return
                await asyncio.sleep(DISCONNECT_POLL_S)

        watcher = asyncio.create_task(watch())
        try:
            kind, value = await queue.get()
            if kind == "error":
                return failure(value, sid)
            if not req.stream:
                while kind != "done":
                    kind, value = await queue.get()
                    if kind == "error":
                        return failure(value, sid)
        finally:
            watcher.cancel()  # a stream's own end (and its client's) is the response's to see
        if not req.stream:
            turn, notice = value
            if turn is None:  # its client left: dropped, nothing kept; nobody reads this
                return failure(ApiError(499, "The client closed the request; the turn was not kept."), sid)
            content = turn.reply_text
            return JSONResponse(headers=headers, content={
                "id": completion, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": content, "refusal": None},
                             "logprobs": None, "finish_reason": api.finish_reason(turn, req.options)}],
                "usage": api.usage(engine, turn, content),
                "isagi": api.extension(sid, turn, notice),
            })

        def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
            body: dict[str, Any] = {
                "id": completion, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], **extra,
            }
            if req.include_usage:
                body["usage"] = None  # OpenAI: every chunk but the last has a null usage
            return f"data: {json.dumps(body)}\n\n"

        async def events() -> Any:
            try:
                yield chunk({"role": "assistant", "content": ""})
                sent: list[str] = []
                while True:
                    kind, value = await queue.get()
                    if kind == "event":
                        if text := shown_text(value):
                            sent.append(text)
                            yield chunk({"content": text})
                        continue
                    if kind == "error":
                        yield f"data: {json.dumps(value.body())}\n\n"
                        break
                    turn, notice = value
                    if turn is None:
                        break
                    yield chunk({}, api.finish_reason(turn, req.options), isagi=api.extension(sid, turn, notice))
                    if req.include_usage:
                        yield "data: " + json.dumps({
                            "id": completion, "object": "chat.completion.chunk", "created": created,
                            "model": model, "choices": [], "usage": api.usage(engine, turn, "".join(sent)),
                        }) + "\n\n"
                    break
                yield "data: [DONE]\n\n"
            finally:
                gone.set()

        return _Stream(events(), gone.set, media_type="text/event-stream",
                       headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.api_route("/v1/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"])
    def unknown_url(rest: str, request: Request) -> Any:
        """Any other ``/v1`` address (or method): OpenAI's 404, not the page's."""
        return failure(ApiError(404, f"Invalid URL ({request.method} /v1/{rest[:80]}); this server has "
                                "POST /v1/chat/completions and GET /v1/models.", code="unknown_url"))

    app.state.isagi_api = api
    return api
