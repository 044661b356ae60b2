"""An OpenAI chat request read and checked, and the errors the API answers with.

Owns turning a ``POST /v1/chat/completions`` body into a :class:`ChatRequest` (the new user
message, the earlier exchanges a stateless client sends back, the generation options within
the server's limits) or an :class:`ApiError` with OpenAI's error shape and a message that says
what to fix; and reading ``ISAGI_API_KEYS``. Nothing here touches a session: :mod:`app.api`
does that through the session service.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from isagi.engines.base import GenerationOptions
from isagi.errors import ConfigError
from isagi.session.service import LOCAL_OWNER, MAX_TURNS

MAX_STOP_SEQUENCES = 4
ROLES = ("system", "developer", "user", "assistant")
# A conversation's messages: a session's turns (a question and a reply each), its new question,
# and room for system messages; a longer one could never continue a session.
MAX_MESSAGES = 2 * MAX_TURNS + 64


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


# --------------------------------------------------------------------------- the request


@dataclass
class ChatRequest:
    """What ISAGI takes from an OpenAI chat request."""

    model: str
    text: str  # the new (last) user message, as sent
    earlier: list[tuple[str, str]] | None  # the earlier (user, assistant) exchanges; None: not pairs
    stream: bool
    include_usage: bool
    options: GenerationOptions


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
        temperature=temperature if temperature is not None and sample else 0.7,
        top_p=1.0 if top_p is None else top_p,
        seed=None if seed is None else seed % 2**32,
    )
    return ChatRequest(model, said[-1][1], earlier, stream, include_usage, options)
