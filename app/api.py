"""The OpenAI-compatible API: ``POST /v1/chat/completions`` and ``GET /v1/models``.

Owns translating between OpenAI's chat protocol and ISAGI's sessions, so any
OpenAI client (the ``openai`` package, ``curl``, editor plugins, chat front
ends) can talk to ISAGI and keep its living memory. It is mounted on the same
FastAPI app as the page (:func:`app.server.create_app`) and runs every turn
through the same session service as the page (:class:`isagi.session.service.SessionService`:
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
is dropped: the engine rolls it back and no turn is kept (:meth:`isagi.session.service.TurnRun.end`).

With several replicas (a shared session store), a turn whose server lost the session to another
meanwhile (:class:`~isagi.errors.SessionMoved`) and whose reply was not kept is a 503
``session_moved`` saying to send the request again (the balancer retries a 503 elsewhere; a
client sends it again with its ``X-Isagi-Session``): the page's "reload the page" means nothing
to an API client. A streamed reply already under way ends with that error instead of its last
chunk. A reply saved just before the takeover is answered as usual, its ``isagi.notice`` saying
that the next request goes on with the conversation (:data:`isagi.errors.MOVED_SAVED_API`).

This module only translates: the request is read by :mod:`app.api_request`, every session
action is one call of the service, and the turn's typed events (:mod:`isagi.pipeline.events`)
become OpenAI JSON or server-sent chunks.
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
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

# At module level: FastAPI resolves the handlers' annotations (``from __future__``) here.
from starlette.requests import Request
from starlette.responses import StreamingResponse

from isagi.app.api_request import ApiError, ChatRequest, parse_api_keys, parse_request
from isagi.app.loader import EngineHolder, EngineLoading
from isagi.errors import (
    MOVED,
    MOVED_API,
    MOVED_SAVED,
    MOVED_SAVED_API,
    ConversationChanged,
    IsagiError,
    ServerDraining,
    SessionBusy,
    SessionLimit,
    SessionMoved,
)
from isagi.ids import is_session_id
from isagi.pipeline.events import Done, TurnEvent, shown_text
from isagi.session.service import LOCAL_OWNER, SessionService

if TYPE_CHECKING:
    from isagi.app.login import Backoff
    from isagi.config import Settings
    from isagi.engines.base import GenerationOptions
    from isagi.pipeline.engine import Engine
    from isagi.session.turn import Message, Turn

__all__ = ["MAX_BODY_BYTES", "Api", "ApiError", "mount_api", "parse_api_keys", "parse_request"]

log = logging.getLogger(__name__)

SESSION_HEADER = "X-Isagi-Session"
MAX_BODY_BYTES = 16 * 1024 * 1024  # a whole conversation is sent each time: room for a long one
MAX_TURNS_IN_FLIGHT = 32  # API turns running or waiting for the model at once (the model runs one at a time)
DISCONNECT_POLL_S = 0.2  # how often a request waiting for its turn looks whether its client is still there
BUSY_WAIT_S = 10.0  # how long a turn waits for its session's lock (the page's STOP_WAIT_S)
PARSES_AT_ONCE = 2  # bodies parsed at once: a 16 MiB body of tiny messages takes ~150 MiB as objects
DRAINING = ("This server is shutting down (nothing of this request was done); send it again: behind a "
            "balancer it goes to another server.")


def draining_error() -> ApiError:
    """A request refused by a draining server (SIGTERM): a 503 the balancer retries elsewhere."""
    return ApiError(503, DRAINING, type="server_error", code="server_draining", headers={"Retry-After": "1"})


def moved_error() -> ApiError:
    """A turn whose session another server took over before its reply was kept: a 503 that the
    balancer retries (it reaches that server) and a client sends again; nothing of it was kept."""
    return ApiError(503, MOVED_API, type="server_error", code="session_moved", headers={"Retry-After": "1"})


def _is_loopback(host: str | None) -> bool:
    """Whether ``host`` is this machine (``::ffff:127.0.0.1``, a dual-stack socket's IPv4 client, too)."""
    try:
        ip = ipaddress.ip_address((host or "").split("%")[0])
    except ValueError:
        return False
    return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback




@dataclass
class PreparedRequest:
    """A request ready for its turn: what was asked, in which of the caller's sessions."""

    request: ChatRequest
    engine: Engine
    owner: str
    sid: str
    message: Message  # the new user message, checked against the server's limits
    expect: list[tuple[str, str]] | None  # the exchanges the session was found by (None: named or new)


@dataclass
class Answered:
    """A turn's end as the API answers it: the turn (None: dropped, its client left) and its notice."""

    turn: Turn | None
    notice: str | None = None


@dataclass
class Started:
    """The turn has its session and runs: errors after this one belong to the stream."""


WorkItem = Started | TurnEvent | Answered | ApiError  # what a turn's worker thread sends the response


class Api:
    """The API's handlers' state: the engine holder, the session service, keys and in-flight turns."""

    def __init__(self, holder: EngineHolder | None, sessions: SessionService | None, settings: Settings,
                 backoff: Backoff) -> None:
        self.holder = holder
        self.sessions = sessions
        self.settings = settings
        self.backoff = backoff  # failures per client address: the page's login throttle
        self.keys = {hashlib.sha256(k.encode()).digest(): u for k, u in parse_api_keys(settings.api_keys).items()}
        self.created = int(time.time())
        self.max_turns = MAX_TURNS_IN_FLIGHT
        self._in_flight = 0
        self._count = threading.Lock()
        self._parsing = threading.BoundedSemaphore(PARSES_AT_ONCE)

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
    def caller(self, request: Request) -> str:
        """The owner a request works as, or an :class:`ApiError` (401, 403, 429)."""
        client = _client(request) or "unknown"
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

    def engine(self) -> Engine:
        """The engine, or a 503 saying what the loader does (a failed load: no server detail)."""
        assert self.holder is not None
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
    def _unknown_model(model_id: str, engine: Engine) -> ApiError:
        return ApiError(404, f"The model {model_id[:80]!r} is not served here; use {engine.lm.model_id!r} "
                        "(GET /v1/models).", param="model", code="model_not_found")

    # -- sessions ------------------------------------------------------------------
    def _service(self) -> SessionService:
        assert self.sessions is not None
        return self.sessions

    def session_for(self, owner: str, client: str | None, req: ChatRequest,
                    named: str | None) -> tuple[str, list[tuple[str, str]] | None]:
        """The id of the caller's session this request continues (see the module's docstring),
        and, when it was found by the replayed turns, those turns (the turn checks that the
        session still holds just them once it has its lock)."""
        from isagi.pipeline.prompts import clean_message

        sessions = self._service()
        if named:
            sid = self._with_room(lambda: sessions.reopen(named, owner, client), owner, client) \
                if is_session_id(named) else None
            if sid is not None:
                return sid, None
            raise ApiError(404, f"No session {named[:64]!r} of yours to continue here; leave out "
                           f"{SESSION_HEADER} to start one.", param=SESSION_HEADER, code="session_not_found")
        if req.earlier:
            want = [(clean_message(u), a) for u, a in req.earlier]
            found = self._with_room(lambda: sessions.find(owner, client, want), owner, client)
            if found is not None:
                return found, want
        new = self._with_room(lambda: sessions.new(owner, client, for_request=True), owner, client)
        assert new is not None
        return new, None

    def _with_room(self, make: Callable[[], str | None], owner: str, client: str | None) -> str | None:
        """:meth:`isagi.session.service.SessionService.with_room`, a full cap answered as a 429."""
        try:
            return self._service().with_room(make, owner, client)
        except SessionLimit as exc:  # the service's words: which cap, what to do
            raise ApiError(429, str(exc), type="rate_limit_error", code="session_limit",
                           headers={"Retry-After": "5"}) from None
        except ServerDraining:
            raise draining_error() from None
        except SessionBusy as exc:  # open on another ISAGI server (a shared session store)
            raise ApiError(409, str(exc), code="session_busy", headers={"Retry-After": "5"}) from None

    # -- a turn --------------------------------------------------------------------
    def run_turn(self, p: PreparedRequest, emit: Callable[[TurnEvent], bool],
                 started: Callable[[], None]) -> Answered:
        """Run the prepared turn; returns its turn and notice. ``emit(event)`` gets each event
        before the turn's Done and returns False once nobody listens: the turn is then dropped
        (nothing kept) and ``Answered(None)`` returned. ``started()`` is called once the turn runs
        (an error before it is the request's). Another request that continued a replayed
        conversation meanwhile makes this one a 409 (its question would follow a reply its client
        never saw)."""
        try:
            with self._service().turn(p.sid, p.owner, p.message, p.request.options, if_left="drop",
                                      timeout=BUSY_WAIT_S, expect=p.expect) as run:
                events = run.events()
                try:
                    first = next(events, None)
                except IsagiError as exc:  # e.g. a session at its most turns
                    raise ApiError(400, " ".join(str(exc).split()), param="messages") from None
                started()
                answered = Answered(None)
                event = first
                while event is not None:
                    if isinstance(event, Done):
                        answered = Answered(event.turn, run.answer_notice(event))
                        break
                    if not emit(event):
                        break
                    event = next(events, None)
        except ConversationChanged as exc:
            raise ApiError(409, str(exc), code="conversation_changed") from None
        except SessionMoved:  # another server took the session over: this request was not kept
            raise moved_error() from None
        except ServerDraining:
            raise draining_error() from None
        except SessionBusy as exc:
            raise ApiError(409, str(exc), code="session_busy") from None
        except KeyError:
            raise ApiError(404, "This session was closed meanwhile; send the conversation again.",
                           code="session_not_found") from None
        if answered.notice == MOVED:  # the page's words: this reply was not kept, the page reloads
            raise moved_error()
        if answered.notice == MOVED_SAVED:
            answered.notice = MOVED_SAVED_API
        return answered

    def prepare(self, request: Request, owner: str, raw: bytes | None) -> PreparedRequest:
        """What ``owner`` (:meth:`caller`) asks, in which session. ``raw``: the body, None when it
        was over :data:`MAX_BODY_BYTES`."""
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
        sid, expect = self.session_for(owner, _client(request), req, request.headers.get(SESSION_HEADER))
        return PreparedRequest(req, engine, owner, sid, checked, expect)

    # -- answers -------------------------------------------------------------------
    @staticmethod
    def finish_reason(turn: Turn, options: GenerationOptions) -> str:
        if turn.verdict in ("refused", "withheld"):
            return "content_filter"
        if turn.generated and (turn.new_tokens or 0) >= options.max_new_tokens:
            return "length"
        return "stop"

    @staticmethod
    def extension(sid: str, turn: Turn, notice: str | None) -> dict[str, Any]:
        return {"session": sid, "tier": turn.tier, "verdict": turn.verdict, "distance": turn.distance,
                "teh_prompt": turn.teh_prompt, "teh_reply": turn.teh_reply, "notice": notice}

    @staticmethod
    def usage(engine: Engine, turn: Turn, content: str) -> dict[str, int]:
        """Tokens of the prompt the model read and of the reply sent (the model's tokenizer's count)."""
        out = engine.prompts.count_tokens(content) if content else 0
        # (a turn the engine ran counts its prompt's tokens; only a turn read from a file may not)
        prompt = turn.prompt_tokens or 0
        return {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out}


def _client(request: Request) -> str | None:
    """The request's client address (None: unknown)."""
    return request.client.host if request.client is not None else None


async def read_body(request: Request) -> bytes | None:
    """The request's body, or None once it is over :data:`MAX_BODY_BYTES` (read no further)."""
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > MAX_BODY_BYTES:
            return None
        parts.append(part)
    return b"".join(parts)


def _send_soon(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[WorkItem], item: WorkItem) -> None:
    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens any more
        loop.call_soon_threadsafe(queue.put_nowait, item)


def _api(request: Request) -> Api:
    api: Api = request.app.state.isagi_api
    return api


def _failure(exc: ApiError, sid: str | None = None) -> Any:
    from fastapi.responses import JSONResponse

    headers = dict(exc.headers)
    if sid:
        headers[SESSION_HEADER] = sid
    return JSONResponse(status_code=exc.status, content=exc.body(), headers=headers)


# --------------------------------------------------------------------------- the routes

def list_models(request: Request) -> Any:
    """``GET /v1/models``."""
    api = _api(request)
    try:
        api.caller(request)
        return api.models()
    except ApiError as exc:
        return _failure(exc)


def get_model(model_id: str, request: Request) -> Any:
    """``GET /v1/models/{model_id}``."""
    api = _api(request)
    try:
        api.caller(request)
        return api.model(model_id)
    except ApiError as exc:
        return _failure(exc)


def unknown_url(rest: str, request: Request) -> Any:
    """Any other ``/v1`` address (or method): OpenAI's 404, not the page's."""
    return _failure(ApiError(404, f"Invalid URL ({request.method} /v1/{rest[:80]}); this server has "
                             "POST /v1/chat/completions and GET /v1/models.", code="unknown_url"))


async def chat_completions(request: Request) -> Any:
    """``POST /v1/chat/completions``: one turn of the caller's session, answered whole or streamed."""
    from starlette.concurrency import run_in_threadpool

    api = _api(request)
    try:
        owner = api.caller(request)  # before the body: a stranger's body is never read
        raw = await read_body(request)
        api.take_slot()  # before a session is made: a full queue makes none
    except ApiError as exc:
        return _failure(exc, request.headers.get(SESSION_HEADER))
    try:
        prepared = await run_in_threadpool(api.prepare, request, owner, raw)
    except BaseException as exc:
        api.free_slot()
        if isinstance(exc, ApiError):
            return _failure(exc, request.headers.get(SESSION_HEADER))
        raise
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[WorkItem] = asyncio.Queue()
    gone = threading.Event()
    try:
        threading.Thread(target=_work, args=(api, prepared, loop, queue, gone), name="isagi-api-turn",
                         daemon=True).start()
    except BaseException:
        api.free_slot()
        raise
    watcher = asyncio.create_task(_watch(request, gone))
    try:
        item = await queue.get()
        if isinstance(item, ApiError):
            return _failure(item, prepared.sid)
        if not prepared.request.stream:
            while not isinstance(item, Answered):
                item = await queue.get()
                if isinstance(item, ApiError):
                    return _failure(item, prepared.sid)
    finally:
        watcher.cancel()  # a stream's own end (and its client's) is the response's to see
    if isinstance(item, Answered):
        return _whole_answer(api, prepared, item)
    return _Stream(_chunks(api, prepared, queue, gone), gone.set, media_type="text/event-stream",
                   headers={SESSION_HEADER: prepared.sid, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _work(api: Api, prepared: PreparedRequest, loop: asyncio.AbstractEventLoop,
          queue: asyncio.Queue[WorkItem], gone: threading.Event) -> None:
    """The turn, in its own thread: its events, then its answer or error, onto ``queue``."""
    def emit(event: TurnEvent) -> bool:
        if gone.is_set():
            return False
        _send_soon(loop, queue, event)
        return True

    item: WorkItem = ApiError(500, "This turn ended unexpectedly; try again.", type="server_error")
    try:
        item = api.run_turn(prepared, emit, lambda: _send_soon(loop, queue, Started()))
    except ApiError as exc:
        item = exc
    except Exception as exc:  # a bug: the engine has rolled the turn back
        log.exception("API turn failed in session %s", prepared.sid)
        item = ApiError(500, f"This turn failed ({type(exc).__name__}); the session is as it was before it. "
                        "Try again, and report the error if it repeats.", type="server_error")
    finally:
        api.free_slot()  # before the answer: a client that has it may send the next one
        _send_soon(loop, queue, item)


async def _watch(request: Request, gone: threading.Event) -> None:
    """A client gone before its answer (a non-streamed one, or one still waiting for its session
    or the model) ends the turn, which is then dropped as a stream's is."""
    while not gone.is_set():
        if await request.is_disconnected():
            gone.set()
            return
        await asyncio.sleep(DISCONNECT_POLL_S)


def _whole_answer(api: Api, p: PreparedRequest, answered: Answered) -> Any:
    """A non-streamed chat completion."""
    from fastapi.responses import JSONResponse

    turn = answered.turn
    if turn is None:  # its client left: dropped, nothing kept; nobody reads this
        return _failure(ApiError(499, "The client closed the request; the turn was not kept."), p.sid)
    content = turn.reply_text
    return JSONResponse(headers={SESSION_HEADER: p.sid}, content={
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
        "model": p.engine.lm.model_id,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content, "refusal": None},
                     "logprobs": None, "finish_reason": api.finish_reason(turn, p.request.options)}],
        "usage": api.usage(p.engine, turn, content),
        "isagi": api.extension(p.sid, turn, answered.notice),
    })


async def _chunks(api: Api, p: PreparedRequest, queue: asyncio.Queue[WorkItem],
                  gone: threading.Event) -> AsyncIterator[str]:
    """A streamed chat completion's server-sent events."""
    completion, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), p.engine.lm.model_id

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
        body: dict[str, Any] = {
            "id": completion, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], **extra,
        }
        if p.request.include_usage:
            body["usage"] = None  # OpenAI: every chunk but the last has a null usage
        return f"data: {json.dumps(body)}\n\n"

    try:
        yield chunk({"role": "assistant", "content": ""})
        sent: list[str] = []
        while True:
            item = await queue.get()
            if isinstance(item, ApiError):
                yield f"data: {json.dumps(item.body())}\n\n"
                break
            if isinstance(item, Answered):
                turn = item.turn
                if turn is None:
                    break
                yield chunk({}, api.finish_reason(turn, p.request.options),
                            isagi=api.extension(p.sid, turn, item.notice))
                if p.request.include_usage:
                    yield "data: " + json.dumps({
                        "id": completion, "object": "chat.completion.chunk", "created": created,
                        "model": model, "choices": [], "usage": api.usage(p.engine, turn, "".join(sent)),
                    }) + "\n\n"
                break
            if not isinstance(item, Started) and (text := shown_text(item)):
                sent.append(text)
                yield chunk({"content": text})
        yield "data: [DONE]\n\n"
    finally:
        gone.set()


class _Stream(StreamingResponse):
    """A stream that calls ``on_close`` however it ends (a client gone included)."""

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], None], **kw: Any) -> None:
        super().__init__(body, **kw)
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def mount_api(app: Any, holder: EngineHolder, sessions: SessionService, settings: Settings, backoff: Backoff) -> Api:
    """Add ``/v1/models`` and ``/v1/chat/completions`` to ``app`` (before the page's mount)."""
    api = Api(holder, sessions, settings, backoff)
    app.state.isagi_api = api
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", get_model, methods=["GET"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/{rest:path}", unknown_url, methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"])
    return api
