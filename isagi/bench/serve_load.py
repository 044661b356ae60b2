"""The closed-loop load of ``isagi bench serve``: users chatting with an OpenAI-compatible server.

Owns what one run sends and what it measures, the same for ISAGI and for the
anchor (llama.cpp's ``llama-server``): ``users`` threads, each a user with the
official ``openai`` client, each holding conversations of ``turns`` turns sent
the OpenAI way (the system prompt, then the whole conversation so far, every
turn; no ISAGI header, so ISAGI finds the session by the replayed messages as
it does for any OpenAI client), streamed, greedy (temperature 0), replies of
at most ``max_tokens`` tokens. A user sends its next turn as soon as the last
one ended (closed loop): one conversation each, or new conversations until
``duration_s`` has passed (a turn begun by then is finished and counted).

Every question is an everyday question of its own (:data:`TASKS` in
:data:`FRAMES`), numbered by :func:`question`: a run is given the first number
it may use, so the two servers of one cell are asked the same questions and no
server is asked one twice (ISAGI keeps every answered turn in its memory and
could answer a repeated question from it).

Per turn: latency (the request sent to the stream's end), time to the first
token (to the first chunk with text) and the reply's tokens (the stream's
``usage``, which both servers send when asked). A turn finishes when its
stream ends with a ``finish_reason``; a turn not finished ``deadline_s`` after
it was sent is given up (the stream closed) and counts as unfinished; it ends its
user's conversation, whose remaining turns are counted as not reached.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam

# Everyday questions: each task in each frame, so a long run never asks one twice.
TASKS = (
    "boil an egg", "fold a fitted sheet", "keep basil alive on a windowsill", "save money on groceries",
    "get a stain out of a shirt", "fall asleep faster", "clean a cast iron pan", "pack a suitcase",
    "make a cup of tea", "remember people's names", "wake up earlier", "keep a houseplant watered",
    "sharpen a kitchen knife", "learn to ride a bike", "cook rice on the stove", "defrost a freezer",
    "start running as a beginner", "write a thank-you note", "clean a microwave", "store fresh herbs",
    "iron a shirt", "choose a ripe avocado", "keep a car battery healthy", "organise a small closet",
    "make pancakes", "plan a weekly budget", "wash a wool sweater", "hang a picture frame",
    "keep bread fresh", "get rid of fruit flies", "brew coffee with a French press", "unclog a sink",
    "prepare for a job interview", "keep a cat entertained", "fix a squeaky door", "make a shopping list",
    "stay warm on a cold walk", "teach a dog to sit", "keep a tidy desk", "roast vegetables",
    "cut an onion without crying", "plant tomatoes", "back up photos on a phone", "descale a kettle",
    "make a simple salad dressing", "clean windows without streaks", "walk more each day",
    "keep shoes from smelling", "pick a good watermelon", "water a lawn in summer",
)
FRAMES = (
    "How do I {task}?",
    "What is the quickest way to {task}?",
    "What mistake do people often make when they {task}?",
    "Give me one tip to {task}.",
    "What do I need before I {task}?",
    "Why is it sometimes hard to {task}?",
)
QUESTIONS = len(TASKS) * len(FRAMES)


def question(n: int) -> str:
    """Question number ``n`` (from 0): every task in the first frame, then in the next, ...;
    past :data:`QUESTIONS` the list starts again with the round said, so the text still differs."""
    task, frame, again = n % len(TASKS), (n // len(TASKS)) % len(FRAMES), n // QUESTIONS
    text = FRAMES[frame].format(task=TASKS[task])
    return text if again == 0 else f"{text} (Asked again: {again}.)"


def number(first: int, users: int, turns: int, user: int, conversation: int, turn: int) -> int:
    """The question number of ``turn`` of ``conversation`` of ``user`` in a run numbered from ``first``."""
    return first + (conversation * users + user) * turns + turn


@dataclass
class Turns:
    """What a run's turns measured (appended to from every user's thread)."""

    latency: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    decode_s_per_token: list[float] = field(default_factory=list)
    tiers: dict[str, int] = field(default_factory=dict)  # ISAGI's tier per turn (its "isagi" field)
    unfinished: int = 0  # given up at the deadline
    not_reached: int = 0  # turns of a conversation after one that was given up or failed
    errors: list[str] = field(default_factory=list)
    session_changes: int = 0  # ISAGI answered a later turn of a conversation in another session
    highest: int = -1  # the highest question number asked
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class Load:
    """One run's shape: who asks what, how long, under which limits."""

    users: int
    turns: int = 4
    max_tokens: int = 32
    duration_s: float | None = None
    deadline_s: float = 75.0
    system_prompt: str = ""
    first: int = 0  # the first question number of the run


def _model(client: Any) -> str:
    return str(client.models.list().data[0].id)


def _one_turn(client: Any, model: str, messages: list[ChatCompletionMessageParam], load: Load,
              out: Turns) -> tuple[str, str | None] | None:
    """One streamed turn; (reply, ISAGI's session or None) when it finished, None when not
    (given up at the deadline, or failed: said in ``out``)."""
    import openai

    t0 = time.monotonic()
    first: float | None = None
    finish: str | None = None
    tokens: int | None = None
    tier: str | None = None
    reply: list[str] = []
    session: str | None = None
    try:
        with client.chat.completions.with_streaming_response.create(
                model=model, messages=messages, stream=True, max_tokens=load.max_tokens, temperature=0,
                stream_options={"include_usage": True}) as response:
            session = response.headers.get("X-Isagi-Session")
            chunks = response.parse()
            assert isinstance(chunks, openai.Stream)  # stream=True (the wrapper's type drops it)
            for chunk in chunks:
                for choice in chunk.choices:
                    if choice.delta.content:
                        if first is None:
                            first = time.monotonic()
                        reply.append(choice.delta.content)
                    finish = choice.finish_reason or finish
                extra = chunk.model_extra or {}
                if isinstance(extra.get("isagi"), dict):
                    tier = extra["isagi"].get("tier")
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
                if time.monotonic() - t0 > load.deadline_s:
                    break  # given up: leaving the block closes the stream
    except Exception as exc:
        with out.lock:
            if time.monotonic() - t0 > load.deadline_s:
                out.unfinished += 1
            else:
                out.errors.append(f"{type(exc).__name__}: {exc}"[:300])
        return None
    done = time.monotonic()
    if done - t0 > load.deadline_s or finish is None:
        with out.lock:
            if done - t0 > load.deadline_s:
                out.unfinished += 1
            else:
                out.errors.append("the stream ended without a finish_reason")
        return None
    n = tokens if tokens is not None else len(reply)
    with out.lock:
        out.latency.append(done - t0)
        out.ttft.append((first or done) - t0)
        out.tokens.append(n)
        if first is not None and n > 1:
            out.decode_s_per_token.append((done - first) / (n - 1))
        if tier is not None:
            out.tiers[tier] = out.tiers.get(tier, 0) + 1
    return "".join(reply), session


def _user(url: str, index: int, load: Load, out: Turns, ends_at: float | None) -> None:
    """One user: conversations of ``load.turns`` turns, one (no duration) or until ``ends_at``."""
    import openai

    client = openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key="none", max_retries=0,
                           timeout=load.deadline_s)
    try:
        model = _model(client)
    except Exception as exc:
        with out.lock:
            out.errors.append(f"user {index}: models: {type(exc).__name__}: {exc}"[:300])
        return
    conversation = 0
    while True:
        messages: list[ChatCompletionMessageParam] = [{"role": "system", "content": load.system_prompt}]
        session: str | None = None
        for t in range(load.turns):
            n = number(load.first, load.users, load.turns, index, conversation, t)
            with out.lock:
                out.highest = max(out.highest, n)
            messages.append({"role": "user", "content": question(n)})
            got = _one_turn(client, model, messages, load, out)
            if got is None:
                with out.lock:
                    out.not_reached += load.turns - t - 1
                return  # the conversation cannot go on without this reply
            reply, sid = got
            if session is not None and sid != session:
                with out.lock:
                    out.session_changes += 1
            session = sid
            messages.append({"role": "assistant", "content": reply})
        conversation += 1
        if ends_at is None or time.monotonic() >= ends_at:
            return


def drive(url: str, load: Load) -> tuple[Turns, float, tuple[float, float]]:
    """``load.users`` users against the server at ``url``; (what the turns measured, the run's
    wall time, the 1-minute load average before and after)."""
    out = Turns()
    before = os.getloadavg()[0]
    t0 = time.monotonic()
    ends_at = t0 + load.duration_s if load.duration_s else None
    threads = [threading.Thread(target=_user, args=(url, i, load, out, ends_at), daemon=True)
               for i in range(load.users)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return out, time.monotonic() - t0, (before, os.getloadavg()[0])


def greedy_reply(url: str, system_prompt: str, text: str, max_tokens: int) -> str:
    """One greedy, streamed reply to ``text`` after ``system_prompt`` (the prompts' check)."""
    import openai

    client = openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key="none", max_retries=0, timeout=600)
    stream = client.chat.completions.create(
        model=_model(client), stream=True, max_tokens=max_tokens, temperature=0,
        messages=[{"role": "system", "content": system_prompt}, {"role": "user", "content": text}])
    return "".join(choice.delta.content or "" for chunk in stream for choice in chunk.choices)
