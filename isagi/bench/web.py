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

import re
import threading
import time
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


def _finished(chat: Any) -> bool:
    if not isinstance(chat, list) or not chat:
        return False
    last = chat[-1]
    content = last.get("content") if isinstance(last, dict) else None
    if isinstance(content, list):  # gradio_client gives [{"type": "text", "text": ...}, ...]
        content = " ".join(str(c.get("text", "")) for c in content if isinstance(c, dict))
    return isinstance(content, str) and bool(_FINISHED.search(content)) and "generating" not in content


def _session(url: str, index: int, turns: int, max_new_tokens: int, out: dict[str, list]) -> None:
    from gradio_client import Client
    from gradio_client.utils import Status

    try:
        client = Client(url, verbose=False)
    except Exception as exc:
        out["errors"].append(f"session {index}: connect: {exc}")
        return
    for t in range(turns):
        topic = TOPICS[(index * turns + t) % len(TOPICS)]
        question = f"In one sentence, tell me something about {topic} (session {index}, question {t + 1})."
        t0 = time.monotonic()
        started: float | None = None
        try:
            job = client.submit(question, max_new_tokens, False, 0.7, "tier", api_name="/send")
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
    server = None
    url = base_url
    if url is None:
        server = live_server.start(settings.home if settings is not None else None, start_timeout_s)
        url = server.url
    try:
        model = live_server.health(url).get("model")
        out: dict[str, list] = {"latency": [], "queue_wait": [], "answered": [], "errors": []}
        threads = [
            threading.Thread(target=_session, args=(url, i, turns, max_new_tokens, out), daemon=True)
            for i in range(sessions)
        ]
        t0 = time.monotonic()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        wall = time.monotonic() - t0
    finally:
        if server is not None:
            server.stop()
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
