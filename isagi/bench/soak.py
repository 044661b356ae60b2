"""``isagi bench soak``: does a long-running server's memory come back?

Starts a real ``isagi web`` (:mod:`isagi.bench.live_server`) on a fresh data directory and
floods it the way a busy public server is used: ``page_sessions`` one-question chats through
the page (``gradio_client``, each a new browser session; it never closes its page, so they stay
live, and there must be fewer than ``ISAGI_MAX_SESSIONS_PER_CLIENT``, 32, to leave the API room),
then ``conversations`` one-off conversations through the OpenAI-compatible API (each a new first
message, so each makes a session; at the client's cap the API parks its oldest idle one). A
request that fails counts in ``failed``, with the first few reasons in ``errors``. It reads the server process's resident memory (``VmRSS`` of ``/proc/<pid>/status``)
after every ``every`` of them, and again after ``idle_s`` seconds with no traffic.

What it reports: the RSS after the first ``every`` API conversations and at the end, their
difference (the target: within 300 MiB after 1,500), the RSS when idle, and the sessions
folder's size. Replies are capped at ``max_new_tokens`` (8) so the run measures what each
conversation leaves behind, not decoding.
"""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from isagi.bench import live_server

MIB = 1024 * 1024


def rss_mib(pid: int) -> float:
    """The resident set size of process ``pid`` in MiB (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"no VmRSS for process {pid}")


def _api_conversation(client: Any, model: str, index: int, max_new_tokens: int) -> str | None:
    """One one-off conversation; None when answered, else why not."""
    r = client.post("/v1/chat/completions", json={
        "model": model, "max_tokens": max_new_tokens,
        "messages": [{"role": "user", "content": f"In one line, what is fact number {index} about the sea?"}]})
    return None if r.status_code == 200 else f"{r.status_code}: {r.text[:200]}"


def run(*, conversations: int = 1500, page_sessions: int = 20, every: int = 100, idle_s: float = 60.0,
        idle_minutes: float | None = None, max_new_tokens: int = 8, home: Path | None = None,
        start_timeout_s: float = 3600.0) -> dict[str, Any]:
    """The soak (module docstring); a fresh data directory unless ``home``. ``idle_minutes``: the
    server's ``ISAGI_IDLE_MINUTES`` (None: its default), so the idle reading can come after its
    sessions were evicted."""
    import os

    import httpx

    from isagi.bench.web import _session

    home = home or Path(tempfile.mkdtemp(prefix="isagi-bench-soak-"))
    before = os.environ.get("ISAGI_IDLE_MINUTES")
    if idle_minutes is not None:
        os.environ["ISAGI_IDLE_MINUTES"] = str(idle_minutes)
    try:
        server = live_server.start(home, start_timeout_s)
    finally:
        if before is None:
            os.environ.pop("ISAGI_IDLE_MINUTES", None)
        else:
            os.environ["ISAGI_IDLE_MINUTES"] = before
    pid = server.proc.pid
    samples: list[dict[str, Any]] = [{"part": "start", "done": 0, "rss_mib": round(rss_mib(pid), 1)}]
    errors: list[str] = []
    t0 = time.monotonic()
    try:
        out: dict[str, list] = {"latency": [], "queue_wait": [], "answered": [], "errors": []}
        for i in range(page_sessions):
            _session(server.url, 100_000 + i, 1, max_new_tokens, out, None)
            if (i + 1) % every == 0 or i + 1 == page_sessions:
                samples.append({"part": "page", "done": i + 1, "rss_mib": round(rss_mib(pid), 1)})
        errors += out["errors"]
        with httpx.Client(base_url=server.url, timeout=600) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            for i in range(conversations):
                why = _api_conversation(client, model, i, max_new_tokens)
                if why is not None:
                    errors.append(f"api conversation {i}: {why}")
                if (i + 1) % every == 0 or i + 1 == conversations:
                    samples.append({"part": "api", "done": i + 1, "rss_mib": round(rss_mib(pid), 1)})
        flood_s = time.monotonic() - t0
        threading.Event().wait(idle_s)
        idle = round(rss_mib(pid), 1)
    finally:
        server.stop()
    api = [s for s in samples if s["part"] == "api"]
    first, last = api[0] if api else samples[0], samples[-1]
    files = list((home / "sessions").glob("*.miku"))
    return {
        "page_sessions": page_sessions, "conversations": conversations, "max_new_tokens": max_new_tokens,
        "failed": len(errors), "errors": errors[:5], "flood_s": round(flood_s, 1), "samples": samples,
        "rss_after_first_api_mib": first["rss_mib"], "rss_end_mib": last["rss_mib"],
        "growth_after_first_api_mib": round(last["rss_mib"] - first["rss_mib"], 1),
        "target_growth_mib": 300, "idle_s": idle_s, "idle_minutes": idle_minutes, "rss_idle_mib": idle,
        "session_files": len(files), "session_files_mib": round(sum(f.stat().st_size for f in files) / MIB, 1),
    }
