"""Load benchmark of the web app: concurrent browser sessions through the HTTP API.

``isagi bench web --sessions 8 --turns 5 --json``: each session is its own
``gradio_client.Client`` (its own Gradio session, so its own server-side
ISAGI session), driven by its own thread; each sends ``turns`` distinct
questions through the same ``/send`` event the page uses, one after the other.
Measured per turn: latency (submit → final output) and queue wait (submit →
the event starts processing). A turn counts as answered when its final chat
output ends with a finished tier/verdict line. Replies are capped at
``max_new_tokens`` (32 by default) so the run measures the serving path and
the queue rather than long generations; the output says so.

With ``base_url=None`` a live server (``python -m isagi.cli web``) is started
on a free loopback port with the given settings' data directory, and stopped
afterwards. Nothing here is hard-coded: every figure is measured in the run.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from isagi.bench import live_server

TOPICS = (
    "volcanoes", "honey bees", "the moon", "glaciers", "chess", "bread", "copper", "owls",
    "rainbows", "tides", "coral reefs", "the violin", "deserts", "comets", "maple trees", "salt",
)
_FINISHED = re.compile(r"isagi-tier-(?!pending)\w+")


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    vs = sorted(values)
    pos = (len(vs) - 1) * q
    lo, hi = int(pos), min(int(pos) + 1, len(vs) - 1)
    return round(vs[lo] + (vs[hi] - vs[lo]) * (pos - lo), 4)


def question(index: int, t: int, turns: int) -> str:
    """Session ``index``'s question ``t`` (from 0) of ``turns``: distinct for every (index, t)."""
    topic = TOPICS[(index * turns + t) % len(TOPICS)]
    return f"In one sentence, tell me something about {topic} (session {index}, question {t + 1})."


def _finished(chat: Any) -> bool:
    if not isinstance(chat, list) or not chat:
        return False
    last = chat[-1]
    content = last.get("content") if isinstance(last, dict) else None
    if isinstance(content, list):  # gradio_client gives [{"type": "text", "text": ...}, ...]
        content = " ".join(str(c.get("text", "")) for c in content if isinstance(c, dict))
    return isinstance(content, str) and bool(_FINISHED.search(content)) and "generating" not in content


def _session(url: str, index: int, turns: int, max_new_tokens: int, out: dict[str, list],
             load: Path | None = None) -> None:
    from gradio_client import Client, handle_file
    from gradio_client.utils import Status

    try:
        client = Client(url, verbose=False)
    except Exception as exc:
        out["errors"].append(f"session {index}: connect: {exc}")
        return
    if load is not None:  # a long session, opened the way the page's file input opens one
        try:
            note = client.predict(handle_file(str(load)), "tier", api_name="/load_miku")[0]
        except Exception as exc:
            out["errors"].append(f"session {index}: load: {type(exc).__name__}: {exc}")
            return
        if "Loaded" not in str(note):
            out["errors"].append(f"session {index}: load: {str(note)[:200]}")
            return
    for t in range(turns):
        text = question(index, t, turns)
        t0 = time.monotonic()
        started: float | None = None
        try:
            job = client.submit(text, max_new_tokens, False, 0.7, "tier", api_name="/send")
            while not job.done():
                code = job.status().code
                if started is None and code in (Status.PROCESSING, Status.ITERATING, Status.PROGRESS):
                    started = time.monotonic()
                time.sleep(0.01)
            outputs = job.outputs()
            job.result()
        except Exception as exc:
            out["errors"].append(f"session {index} turn {t + 1}: {type(exc).__name__}: {exc}")
            continue
        done = time.monotonic()
        out["latency"].append(done - t0)
        out["queue_wait"].append((started or done) - t0)
        final = outputs[-1] if outputs else None
        # the client leaves out the State output: the chat is the first output
        chat = final[0] if isinstance(final, list | tuple) and final else None
        if _finished(chat):
            out["answered"].append(1)
        else:
            out["errors"].append(f"session {index} turn {t + 1}: no finished reply in the final output")


def _drive(url: str, sessions: int, turns: int, max_new_tokens: int, load: Path | None,
           *, first: int = 0, session: Any = None) -> tuple[dict[str, list], float]:
    """``sessions`` concurrent runs of ``session`` (default: :func:`_session`, through the page),
    one thread each, numbered from ``first`` (so their questions differ from other passes')."""
    out: dict[str, list] = {"latency": [], "queue_wait": [], "answered": [], "errors": []}
    threads = [
        threading.Thread(target=session or _session, args=(url, first + i, turns, max_new_tokens, out, load),
                         daemon=True)
        for i in range(sessions)
    ]
    t0 = time.monotonic()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return out, time.monotonic() - t0


def long_session_file(settings: Any, exchanges: int, path: Path) -> Path:
    """A ``.miku`` of the configured model holding ``exchanges`` earlier exchanges (the texts of
    ``isagi bench turn --history``, stored as answered turns), written as the app writes one."""
    from isagi.bench.turn import history_exchanges
    from isagi.pipeline.engine import Engine
    from isagi.session.files import save_session
    from isagi.session.turn import Turn

    engine = Engine.start(settings, with_store=False)
    session = engine.new_session(f"bench-web-history-{exchanges}", autosave=False)
    now = time.time()
    session.turns += [Turn(user_text=q, reply_text=r, tier="EXPLORE", verdict="ok", generated=True,
                           asked_at=now, answered_at=now) for q, r in history_exchanges(exchanges)]
    save_session(engine.frame, session, path)
    return path


def run_history(base_url: str | None, histories: list[int], sessions: int = 8, turns: int = 5, settings: Any = None,
                *, max_new_tokens: int = 32, start_timeout_s: float = 3600.0) -> dict[str, Any]:
    """``run`` once per number of earlier exchanges, on one server: every session first loads a
    ``.miku`` holding that many (through the page's file input), then takes its turns.
    Reports each pass and the latency ratios to the smallest number, measured in one run."""
    import tempfile

    histories = sorted(set(histories))
    passes = {}
    with _server(base_url, settings, start_timeout_s) as url, \
            tempfile.TemporaryDirectory(prefix="isagi-bench-web-") as tmp:
        max_new_tokens = page_token_cap(url, max_new_tokens)
        for n in histories:
            path = long_session_file(settings, n, Path(tmp) / f"history-{n}.miku")
            passes[n] = _figures(*_drive(url, sessions, turns, max_new_tokens, path), sessions, turns,
                                 max_new_tokens, live_server.health(url).get("model"))
    base = histories[0]
    ratios = {f"ratio_{n}_to_{base}": {k: round(passes[n][k] / passes[base][k], 3) for k in ("p50_s", "p95_s")}
              for n in histories[1:] if passes[n]["p50_s"] and passes[base]["p50_s"]}
    return {**{f"history_{n}": passes[n] for n in histories}, **ratios}


def run(
    base_url: str | None,
    sessions: int = 8,
    turns: int = 5,
    settings: Any = None,
    *,
    max_new_tokens: int = 32,
    start_timeout_s: float = 3600.0,
) -> dict[str, Any]:
    """Drive ``sessions`` concurrent sessions of ``turns`` turns each; return the figures."""
    with _server(base_url, settings, start_timeout_s) as url:
        model = live_server.health(url).get("model")
        max_new_tokens = page_token_cap(url, max_new_tokens)
        out, wall = _drive(url, sessions, turns, max_new_tokens, None)
    return _figures(out, wall, sessions, turns, max_new_tokens, model)


def page_token_cap(url: str, wanted: int) -> int:
    """``wanted`` within the server's reply limit (``ISAGI_MAX_NEW_TOKENS``), read from the end of
    the page's Max new tokens slider: the server refuses more from the page and clamps the API to
    it, so the figures report the cap the turns really ran under."""
    import httpx

    try:
        config = httpx.get(url.rstrip("/") + "/config", timeout=30).json()
        cap = next(int(c["props"]["maximum"]) for c in config["components"]
                   if c.get("props", {}).get("elem_id") == "isagi-max-tokens")
    except (httpx.HTTPError, ValueError, KeyError, StopIteration, TypeError):
        return wanted
    return max(1, min(wanted, cap))


@contextlib.contextmanager
def _server(base_url: str | None, settings: Any, start_timeout_s: float) -> Iterator[str]:
    """``base_url``, or the URL of a live server started here (with ``settings``' data
    directory) and stopped afterwards."""
    if base_url is not None:
        yield base_url
        return
    server = live_server.start(settings.home if settings is not None else None, start_timeout_s)
    try:
        yield server.url
    finally:
        server.stop()


def _figures(out: dict[str, list], wall: float, sessions: int, turns: int, max_new_tokens: int,
             model: Any) -> dict[str, Any]:
    lat, qw = out["latency"], out["queue_wait"]
    return {
        "sessions": sessions,
        "turns": sessions * turns,
        "answered": len(out["answered"]),
        "errors": len(out["errors"]),
        "p50_s": _percentile(lat, 0.5),
        "p95_s": _percentile(lat, 0.95),
        "queue_wait_p50_s": _percentile(qw, 0.5),
        "queue_wait_p95_s": _percentile(qw, 0.95),
        "wall_s": round(wall, 2),
        "max_new_tokens": max_new_tokens,
        "model": model,
        "note": f"replies capped at {max_new_tokens} new tokens; generation is serialised (one model queue)",
        "error_samples": out["errors"][:5],
    }
