"""Load benchmark of the OpenAI-compatible API, beside the page's, on one live server.

``isagi bench api --sessions 8 --turns 5 --json``: turn latency through
``POST /v1/chat/completions`` (the official ``openai`` client, streaming) next
to ``isagi bench web``'s (``gradio_client`` through the page's ``/send``), in
the same run against the same server, and their ratio (api / web) at p50 and
p95: what the API adds to a turn.

Each API session is one client conversation sent the OpenAI way (the whole
message list every turn) and kept to one ISAGI session by the
``X-Isagi-Session`` header: the first turn goes without it, the server's
answer names the session, every later turn sends it back (the header path of
:mod:`app.api`; without it the server would find the session by matching the
replayed messages). A turn counts as answered when its stream ended with a
``finish_reason``. Measured per turn, as ``bench web`` measures: latency
(submit → the stream's end, after its last token and finishing chunk) and
queue wait (submit → the response's headers, which the server sends once the
turn runs). The page's part is ``bench web``'s own session driver, unchanged.

Both parts send the same questions but for the session numbers in them
(:func:`isagi.bench.web.question`: every pass asks the same topics in the same
order, :func:`first`), with the same reply cap (``max_new_tokens``, 32 by
default) and greedy decoding, each in sessions of its own; as the session
numbers differ, no question is asked twice in a run and neither part can
answer from the other's memory or have its prompts' KV states saved by the
other (the engine keeps KV prefixes of earlier prompts across sessions). One unmeasured turn through each part warms the server first; then
the parts alternate in ABBA order (api, web, web, api, ... over ``rounds``
rounds) so slow drift of the machine biases neither; the output lists the
order run. Like ``bench web`` it drives a server without a login
(the API answers loopback callers then).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from isagi.bench import live_server
from isagi.bench.web import TOPICS, _drive, _figures, _server, page_token_cap, question
from isagi.errors import ConfigError, InputError

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam

SESSION_HEADER = "X-Isagi-Session"  # app.api's header (the app layer is above this one)
PARTS = ("api", "web")


def _api_session(url: str, index: int, turns: int, max_new_tokens: int, out: dict[str, list],
                 load: Path | None = None) -> None:
    """One conversation of ``turns`` turns through the API, streamed; figures into ``out``
    (the keys of :func:`isagi.bench.web._drive`'s). ``load`` is not used (no long sessions here)."""
    import openai

    client = openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key="none", max_retries=0, timeout=3600)
    try:
        model = client.models.list().data[0].id
    except Exception as exc:
        out["errors"].append(f"api session {index}: models: {type(exc).__name__}: {exc}")
        return
    messages: list[ChatCompletionMessageParam] = []
    sid: str | None = None
    for t in range(turns):
        messages.append({"role": "user", "content": question(index, t, turns)})
        t0 = time.monotonic()
        started: float | None = None
        finish: str | None = None
        reply: list[str] = []
        try:
            with client.chat.completions.with_streaming_response.create(
                    model=model, messages=messages, stream=True, max_tokens=max_new_tokens, temperature=0,
                    extra_headers={SESSION_HEADER: sid} if sid else None) as response:
                started = time.monotonic()  # the headers: the server sends them once the turn runs
                got = response.headers.get(SESSION_HEADER)
                chunks = response.parse()
                assert isinstance(chunks, openai.Stream)  # stream=True (the wrapper's type drops it)
                for chunk in chunks:
                    for choice in chunk.choices:
                        reply.append(choice.delta.content or "")
                        finish = choice.finish_reason or finish
        except Exception as exc:
            out["errors"].append(f"api session {index} turn {t + 1}: {type(exc).__name__}: {exc}")
            return  # the conversation cannot go on without this reply
        done = time.monotonic()
        out["latency"].append(done - t0)
        out["queue_wait"].append((started or done) - t0)
        if sid is not None and got != sid:
            out["errors"].append(f"api session {index} turn {t + 1}: answered in session {got}, not {sid}")
            return
        sid = got
        messages.append({"role": "assistant", "content": "".join(reply)})
        if finish is not None:
            out["answered"].append(1)
        else:
            out["errors"].append(f"api session {index} turn {t + 1}: the stream ended without a finish_reason")


def order(rounds: int) -> list[str]:
    """The parts in the order run: ABBA over ``rounds`` rounds (api web, web api, api web, ...)."""
    return [p for r in range(rounds) for p in (PARTS if r % 2 == 0 else PARTS[::-1])]


def first(k: int, sessions: int) -> int:
    """The number of pass ``k``'s first session: passes are numbered apart, each from a multiple
    of the topics' count (so every pass asks the same topics in the same order; only the session
    numbers in the questions differ) and from 1 such step on (numbers of the same digits)."""
    step = len(TOPICS) * -(-sessions // len(TOPICS))
    return (k + 1) * step


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def run(
    base_url: str | None,
    sessions: int = 8,
    turns: int = 5,
    settings: Any = None,
    *,
    rounds: int = 2,
    max_new_tokens: int = 32,
    start_timeout_s: float = 3600.0,
) -> dict[str, Any]:
    """Both parts, alternating, against one server (``base_url``, or one started here with
    ``settings``' data directory); their figures, pooled over the rounds, and api / web."""
    if sessions < 1 or turns < 1 or rounds < 1:
        raise InputError("--sessions, --turns and --rounds must each be 1 or more.")
    try:
        import openai  # noqa: F401 - a dev dependency; said here, before a server is started
    except ImportError:
        raise ConfigError("isagi bench api drives the server with the official openai client; "
                          "install it first: pip install openai") from None
    runs = order(rounds)
    pooled: dict[str, dict[str, list]] = {p: {"latency": [], "queue_wait": [], "answered": [], "errors": []}
                                          for p in PARTS}
    wall = dict.fromkeys(PARTS, 0.0)
    with _server(base_url, settings, start_timeout_s) as url:
        model = live_server.health(url).get("model")
        max_new_tokens = page_token_cap(url, max_new_tokens)  # both parts under the server's cap
        # one unmeasured turn through each part first (numbered after every measured pass): the
        # server's first turns (cold caches, first requests of each route) would bias the first part
        warmup = [e for j, part in enumerate(PARTS) for e in _drive(
            url, 1, 1, max_new_tokens, None, first=first(len(runs), sessions) + j,
            session=_api_session if part == "api" else None)[0]["errors"]]
        for k, part in enumerate(runs):
            out, took = _drive(url, sessions, turns, max_new_tokens, None, first=first(k, sessions),
                               session=_api_session if part == "api" else None)
            for key, values in out.items():
                pooled[part][key] += values
            wall[part] += took
    figures = {p: _figures(pooled[p], wall[p], sessions * rounds, turns, max_new_tokens, model) for p in PARTS}
    return {
        "api": figures["api"],
        "web": figures["web"],
        "ratio_api_to_web": {k: _ratio(figures["api"][k], figures["web"][k]) for k in ("p50_s", "p95_s")},
        "order": runs,
        "warmup": "one unmeasured turn through each part before the passes",
        "warmup_errors": warmup[:5],
        "rounds": rounds,
        "api_sessions_by": f"the {SESSION_HEADER} header (the whole message list sent each turn too)",
        "questions": "every pass asks the same topics in the same order, in sessions of its own; only "
                     "the session numbers in the questions differ, so none is asked twice",
        "note": f"per part: {rounds} round(s) of {sessions} concurrent sessions x {turns} turns, pooled; "
                f"replies capped at {max_new_tokens} new tokens, greedy; ratio = api / web",
    }
