"""Hostile input against a live ``isagi web``, measured (issue 11's "Done when").

While one user sends a 24,000-token message (7,999 emoji) and uploads a
2,000,000-message ``.miku`` (16 MB), another user asks a one-line question:
this script measures how long each refusal takes and what it says, how long
the other user's turn takes against the same turn alone, and how long
``/health`` takes to answer meanwhile.

    python -m tests.e2e.hostile_web http://127.0.0.1:7860/ [--auth alice:a,bob:b] [--json]

With ``--auth`` the first user is the hostile one and the second the other
user; without, both are anonymous clients. Prints one JSON object. Needs a
running server on any model (the figures are of that server's machine).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

QUESTION = "What is the capital of France?"
EMOJI_MESSAGE = "😀" * 7999  # under the 8,000-character limit, ~24,000 tokens


def _client(url: str, auth: tuple[str, str] | None) -> Any:
    from gradio_client import Client

    return Client(url, auth=auth, verbose=False)


def _turn(client: Any, text: str, max_tokens: int = 32) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = client.predict(text, max_tokens, False, 0.7, "tier", api_name="/send")
    return time.perf_counter() - t0, out


def _alert(out: Any) -> str:
    """The alert line of /send's outputs (chat, textbox, alert, ...)."""
    for item in out:
        if isinstance(item, str) and item.startswith("⚠️"):
            return item
    return ""


def two_million_messages(real: Path, out: Path, n: int = 2_000_000) -> int:
    """A structurally valid .miku with ``n`` messages and the server's own model header
    (taken from a session it saved), so the refusal is about the messages."""
    from isagi.storage import miku
    from tests import miku_bombs

    header = miku.read_miku(real, allow_other_model=True).header
    original = miku_bombs._header
    miku_bombs._header = lambda: dict(header, d=int(header["d"]), k=int(header["k"]))  # noqa: SLF001
    try:
        data = miku_bombs.messages(n)
    finally:
        miku_bombs._header = original
    out.write_bytes(data)
    return len(data)


def _health_poller(url: str, stop: threading.Event, samples: list[float]) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(url + "health", timeout=600) as r:
                r.read()
        except Exception:  # noqa: BLE001 - a failed probe still counts its time
            pass
        samples.append(time.perf_counter() - t0)
        stop.wait(0.2)


def run(url: str, hostile_auth: tuple[str, str] | None, other_auth: tuple[str, str] | None,
        baseline_turns: int = 3) -> dict[str, Any]:
    from gradio_client import handle_file

    url = url.rstrip("/") + "/"
    hostile, uploader, other = (_client(url, hostile_auth), _client(url, hostile_auth), _client(url, other_auth))
    _turn(other, QUESTION)  # warm-up: first turn of a session
    alone = [_turn(other, f"{QUESTION} ({i})")[0] for i in range(baseline_turns)]

    # a real saved session of this server, for its header
    hostile_turn = _turn(hostile, "Hello")
    saved, _ = hostile.predict(api_name="/save_miku")
    work = Path(tempfile.mkdtemp(prefix="isagi-hostile-"))
    bomb = work / "two-million.miku"
    bomb_bytes = two_million_messages(Path(saved), bomb)

    results: dict[str, Any] = {}
    stop = threading.Event()
    health: list[float] = []

    def emoji() -> None:
        t, out = _turn(hostile, EMOJI_MESSAGE)
        results["emoji"] = {"seconds": round(t, 3), "message": _alert(out)}

    def upload() -> None:
        t0 = time.perf_counter()
        out = uploader.predict(handle_file(str(bomb)), "tier", api_name="/load_miku")
        note = next((x for x in out if isinstance(x, str) and ("load" in x.lower())), str(out)[:300])
        results["upload"] = {"seconds": round(time.perf_counter() - t0, 3), "message": note,
                             "bytes": bomb_bytes, "messages": 2_000_000}

    def other_user() -> None:
        time.sleep(0.05)  # the hostile requests are in first
        t, out = _turn(other, f"{QUESTION} (during)")
        results["other_turn_during_s"] = round(t, 3)
        results["other_turn_alert"] = _alert(out)

    poller = threading.Thread(target=_health_poller, args=(url, stop, health), daemon=True)
    poller.start()
    threads = [threading.Thread(target=f) for f in (emoji, upload, other_user)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    stop.set()
    poller.join(5)
    results["other_turn_alone_s"] = [round(x, 3) for x in alone]
    results["other_turn_alone_median_s"] = round(statistics.median(alone), 3)
    results["health_max_s"] = round(max(health), 3) if health else None
    results["health_samples"] = len(health)
    results["hostile_hello_turn_s"] = round(hostile_turn[0], 3)
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("url")
    p.add_argument("--auth", help="user:pw,user2:pw2 (hostile user first, the other user second)")
    args = p.parse_args(argv)
    hostile = other = None
    if args.auth:
        pairs = [tuple(x.split(":", 1)) for x in args.auth.split(",")]
        hostile, other = pairs[0], pairs[1]
    print(json.dumps(run(args.url, hostile, other), ensure_ascii=False, indent=2))


if __name__ == "__main__":
    main()
