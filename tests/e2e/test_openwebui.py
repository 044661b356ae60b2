"""A real chat front end, Open WebUI, talking to ISAGI through its OpenAI-compatible API.

Open WebUI runs from its own virtual environment (``ISAGI_TEST_OPENWEBUI``; ``make
openwebui-test`` installs it with ``.ci/openwebui.sh`` and runs this file), offline and
without a login, pointed at ISAGI's ``/v1`` through a logging proxy. ISAGI is the app on
the fake engine with a scripted reply (what is tested here is the protocol, not the
model). A user in Chromium picks ISAGI's model, sends a message and a follow-up and sees
both replies; ISAGI recorded the four turns as one session. Stop pressed while a reply
streams keeps no turn in ISAGI, and the next message is answered.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import urllib.request
from pathlib import Path

import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from tests.e2e.conftest import _free_port, live_server
from tests.e2e.openwebui import LoggingProxy, open_webui

pytestmark = [pytest.mark.openwebui, pytest.mark.browser]

REPLY = "Hello from ISAGI through Open WebUI."
MESSAGE = "What is the capital of France?"
FOLLOW_UP = "And the capital of Germany?"
WAIT_MS = 120_000


def _venv() -> Path:
    value = os.environ.get("ISAGI_TEST_OPENWEBUI")
    if not value:
        pytest.skip("no Open WebUI: run `make openwebui-test` (installs it in a virtual environment of its own)")
    venv = Path(value)
    assert (venv / "bin" / "open-webui").exists(), f"ISAGI_TEST_OPENWEBUI={venv} has no bin/open-webui"
    return venv


def _turns(home: Path) -> list[tuple[str, str, str]]:
    """(session id, role, text) of every turn ISAGI's history store holds, in order."""
    db = home / "history.sqlite3"
    if not db.exists():
        return []
    with sqlite3.connect(db) as c:
        return c.execute("SELECT session_id, role, text FROM turns ORDER BY id").fetchall()


@pytest.fixture(scope="module")
def isagi(tmp_path_factory):
    """Two ISAGI servers on the fake engine, keyed by speed: a reply streams in a moment
    ("fast") or at 0.5 s a token ("slow", for Stop). Each: (URL, home)."""
    servers = {}
    with live_server(tmp_path_factory, fake=True, fake_args=("--reply", REPLY, "--token-delay-s", "0.02"),
                     home=(fast := tmp_path_factory.mktemp("fast-home"))) as fast_url, \
         live_server(tmp_path_factory, fake=True, fake_args=("--reply", REPLY, "--token-delay-s", "0.5"),
                     home=(slow := tmp_path_factory.mktemp("slow-home"))) as slow_url:
        servers = {"fast": (fast_url, fast), "slow": (slow_url, slow)}
        yield servers


@pytest.fixture(scope="module")
def front_end(isagi, tmp_path_factory):
    """(Open WebUI's URL, the proxy, ISAGI's model id); the proxy starts on the fast server."""
    venv = _venv()
    fast_url = isagi["fast"][0]
    with urllib.request.urlopen(fast_url + "v1/models", timeout=10) as r:
        model = json.load(r)["data"][0]["id"]
    proxy = LoggingProxy(_free_port(), ("127.0.0.1", int(fast_url.rstrip("/").rsplit(":", 1)[1])))
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        api = f"http://127.0.0.1:{proxy.server_address[1]}/v1"
        with open_webui(venv, tmp_path_factory.mktemp("owui"), _free_port(), api, model) as url:
            yield url, proxy, model
    finally:
        proxy.shutdown()


def _use(proxy: LoggingProxy, server: tuple[str, Path]) -> None:
    with proxy.lock:
        proxy.upstream = ("127.0.0.1", int(server[0].rstrip("/").rsplit(":", 1)[1]))
        proxy.log.clear()


def _open_chat(browser, url: str):
    ctx = browser.new_context(viewport={"width": 1280, "height": 800})
    page = ctx.new_page()
    page.set_default_timeout(WAIT_MS)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url, wait_until="domcontentloaded")
    page.locator("#chat-input").wait_for(state="visible")
    # The first start's "what's new" dialog covers the page, and on a busy machine it may open
    # late: Escape until the box takes a click (a trial click fails while anything covers it).
    for _ in range(30):
        page.keyboard.press("Escape")
        try:
            page.locator("#chat-input").click(trial=True, timeout=1000)
            page.wait_for_timeout(500)  # a dialog that opens just now is closed on the next round
            page.locator("#chat-input").click(trial=True, timeout=1000)
            break
        except PlaywrightTimeout:
            continue
    return ctx, page, errors


def _send(page, text: str) -> None:
    page.locator("#chat-input").click()
    page.keyboard.type(text)
    page.keyboard.press("Enter")


def _replies_shown(page, n: int) -> None:
    page.wait_for_function("([t, n]) => document.body.innerText.split(t).length - 1 >= n", arg=[REPLY, n],
                           timeout=WAIT_MS)


def test_a_user_chats_with_isagi_in_open_webui_and_isagi_keeps_one_session(browser, front_end, isagi,
                                                                          screenshot_dir):
    url, proxy, model = front_end
    _use(proxy, isagi["fast"])
    ctx, page, errors = _open_chat(browser, url)
    try:
        # the chat's model selector names ISAGI's model (Open WebUI's default model, set as a user would)
        page.get_by_text(model, exact=True).first.wait_for(state="visible")
        _send(page, MESSAGE)
        _replies_shown(page, 1)
        page.locator("button[aria-label='Stop']").wait_for(state="detached")  # the stream has ended
        _send(page, FOLLOW_UP)
        _replies_shown(page, 2)
        page.locator("button[aria-label='Stop']").wait_for(state="detached")  # the stream has ended
        page.wait_for_timeout(1000)
        page.screenshot(path=str(screenshot_dir / "openwebui-chat.png"))
        assert not errors, errors
    finally:
        ctx.close()
    turns = _turns(isagi["fast"][1])
    assert [(role, text) for _, role, text in turns] == [
        ("user", MESSAGE), ("assistant", REPLY), ("user", FOLLOW_UP), ("assistant", REPLY)], turns
    assert len({sid for sid, _, _ in turns}) == 1, "the follow-up did not continue the first message's session"
    chats = [r for r in proxy.log if r["path"].endswith("/chat/completions")]
    assert len(chats) == 2 and all(r["status"] == 200 and r["model"] == model for r in chats), chats
    assert chats[0]["session"] == chats[1]["session"] == turns[0][0], "X-Isagi-Session names the session kept"


def test_stop_in_open_webui_keeps_no_turn_in_isagi_and_the_chat_goes_on(browser, front_end, isagi, screenshot_dir):
    url, proxy, _ = front_end
    _use(proxy, isagi["slow"])
    ctx, page, errors = _open_chat(browser, url)
    try:
        _send(page, MESSAGE)
        page.wait_for_function("t => document.body.innerText.includes(t)", arg=REPLY.split()[0], timeout=WAIT_MS)
        page.locator("button[aria-label='Stop']").click()
        page.wait_for_timeout(3000)
        page.screenshot(path=str(screenshot_dir / "openwebui-stop.png"))
        assert _turns(isagi["slow"][1]) == [], "a stopped reply was kept as a turn"
        _send(page, FOLLOW_UP)
        page.wait_for_function("t => document.body.innerText.includes(t)", arg=REPLY, timeout=WAIT_MS)
        page.locator("button[aria-label='Stop']").wait_for(state="detached", timeout=WAIT_MS)
        page.wait_for_timeout(1000)
        page.screenshot(path=str(screenshot_dir / "openwebui-after-stop.png"))
        assert not errors, errors
    finally:
        ctx.close()
    assert [(role, text) for _, role, text in _turns(isagi["slow"][1])] == [("user", FOLLOW_UP), ("assistant", REPLY)]
    assert any(r["client_left"] for r in proxy.log), "Open WebUI's Stop never reached ISAGI as a hang-up"
