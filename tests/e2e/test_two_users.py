"""Two users against a real ``isagi web`` (``ISAGI_AUTH="alice:a,bob:b"``, the
default model): bob cannot list, search, export, download, resume, continue,
load or delete anything of alice's, through ``gradio_client``, through every
event of the page called by ``fn_index`` on the queue (private ones included;
a file input naming alice's autosaved session gets the neutral answer), his
calls naming alice's own Gradio session hash are refused, and in the real
browser.

Marked ``model`` (a live server on the real model); the browser test also
``browser``. ``ISAGI_E2E_AUTH_URL`` points them at a running server instead.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from isagi.app.uploads import NOT_YOUR_UPLOAD
from tests.e2e.conftest import shown_rows
from tests.gradio_raw import RawGradio, component_id

pytestmark = pytest.mark.model

SECRET = "zebra-quartz-7731"
QUESTION = f"Remember the code word {SECRET}. What is a zebra?"


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def alice(auth_url: str):
    """alice's client, her session (one real turn holding SECRET) and its id."""
    from gradio_client import Client

    client = Client(auth_url, auth=("alice", "a"), verbose=False)
    client.predict(QUESTION, 16, False, 0.7, "tier", api_name="/send")
    table, note = client.predict("", api_name="/list_sessions")
    rows = table["data"] if isinstance(table, dict) else table
    assert len(rows) >= 1, note
    sid = rows[0][0]
    return client, sid


def autosave_of(sid: str) -> str:
    """Where the server keeps alice's session (the test's server runs on ISAGI_TEST_HOME; a
    server of ISAGI_E2E_AUTH_URL keeps it somewhere unknown: a path that does not exist)."""
    home = os.environ.get("ISAGI_TEST_HOME") if not os.environ.get("ISAGI_E2E_AUTH_URL") else None
    return str(Path(home) / "sessions" / f"{sid}.miku") if home else "/nonexistent/alice.miku"


def alice_intact(client: Any, sid: str) -> None:
    """alice still sees her session, with its turn and its secret, and can export it."""
    table, _ = client.predict(SECRET, api_name="/list_sessions")
    rows = table["data"] if isinstance(table, dict) else table
    mine = [r for r in rows if r[0] == sid]
    assert len(mine) == 1 and mine[0][2] >= 1, rows  # her session, with its turn
    path, _ = client.predict(sid, api_name="/export_markdown")
    with open(path, encoding="utf-8") as f:
        assert SECRET in f.read()


# --------------------------------------------------------------------------- gradio_client


def test_bob_through_gradio_client_gets_nothing_of_alices(auth_url: str, alice) -> None:
    from gradio_client import Client

    a_client, sid = alice
    bob = Client(auth_url, auth=("bob", "b"), verbose=False)
    # list and search
    table, note = bob.predict("", api_name="/list_sessions")
    rows = table["data"] if isinstance(table, dict) else table
    assert sid not in json.dumps(rows) and SECRET not in json.dumps(rows)
    table, note = bob.predict(SECRET, api_name="/list_sessions")
    rows = table["data"] if isinstance(table, dict) else table
    assert rows in ([], [[]]) or all(not any(r) for r in rows), rows
    assert note.startswith("0 session")
    # export (= download) in both formats: no file, "not found"
    for api in ("/export_markdown", "/export_json"):
        path, msg = bob.predict(sid, api_name=api)
        assert not isinstance(path, str) and "Could not export" in msg and "no such session" in msg, (api, msg)
        assert SECRET not in msg
    # resume (and so continue): not found, nothing of hers in bob's page
    out = bob.predict(sid, "tier", api_name="/resume")
    assert "No session" in out[0] and SECRET not in json.dumps(out, default=str)
    # continue: bob's message goes to a session of his own, never hers
    out = bob.predict("What did I say before?", 16, False, 0.7, "tier", api_name="/send")
    assert SECRET not in json.dumps(out, default=str)
    # load: a file object naming alice's autosaved session on the server opens nothing
    out = bob.predict({"path": autosave_of(sid), "orig_name": "x.miku"}, "tier", api_name="/load_miku")
    assert NOT_YOUR_UPLOAD in json.dumps(out, ensure_ascii=False) and SECRET not in json.dumps(out, default=str)
    # save the open .miku: bob's own session only
    path, msg = bob.predict(api_name="/save_miku")
    if path:
        with open(path, "rb") as f:
            assert SECRET.encode() not in f.read()
    # the named endpoints are the only public ones; delete is not among them
    api = bob.view_api(print_info=False, return_format="dict")
    assert "/delete" not in json.dumps(api["named_endpoints"])
    alice_intact(a_client, sid)


# --------------------------------------------------------------------------- every fn_index


def test_bob_calling_every_event_by_fn_index_gets_nothing_of_alices(auth_url: str, alice) -> None:
    """Every event of the page, named, private or hidden, called as bob with alice's
    session id in each text and state slot, from a fresh Gradio session and from
    alice's own (her page state holds her session id): no output carries her
    secret, and her session is intact afterwards."""
    a_client, sid = alice
    import httpx

    raw = RawGradio(httpx.Client(base_url=auth_url, timeout=300), "bob", "b")
    state_ids = {cid for cid, c in raw.components.items() if c.get("type") in ("state", "browserstate")}
    text_ids = {component_id(raw, "isagi-chosen"), component_id(raw, "isagi-search"), component_id(raw, "isagi-input")}
    takes_an_id = [d for d in raw.deps() if set(d["inputs"]) & (state_ids | text_ids)]
    names = sorted(str(d.get("api_name")) for d in takes_an_id)
    # the page's events that take a session id: load, timer, send, submit, regenerate, stop,
    # new chat, clear, recolour, list/search (x2), resume, export x2, delete, save, upload, and the
    # sync of the state to the browser's storage (the load reads the stored id)
    assert len(takes_an_id) >= 18, names
    assert any(d.get("api_visibility") == "private" for d in takes_an_id)
    hers_on_disk = autosave_of(sid)
    seen: list[tuple[str, str, bool]] = []
    for session_hash, hers in ((uuid.uuid4().hex[:11], False), (a_client.session_hash, True)):
        for dep in takes_an_id:
            data = [raw.value_for(cid, sid, hers_on_disk) for cid in dep["inputs"]]
            res = raw.call(dep, data, session_hash)
            out = json.dumps(res, default=str)
            assert SECRET not in out, (dep["id"], dep.get("api_name"), out[:500])
            assert (403 in (res.get("refused"), res.get("status"))) == hers, (dep.get("api_name"), out[:300])
            if dep.get("api_name") == "load_miku" and not hers:
                assert NOT_YOUR_UPLOAD in out, out[:300]
            seen.append((str(dep.get("api_name")), session_hash, bool(res.get("success"))))
    assert len(seen) == 2 * len(takes_an_id)
    alice_intact(a_client, sid)


# --------------------------------------------------------------------------- the browser


def _login_page(browser: Any, url: str, user: str, password: str) -> tuple[Any, Any]:
    ctx = browser.new_context(viewport={"width": 1440, "height": 1000})
    page = ctx.new_page()
    page.set_default_timeout(120_000)
    page.goto(url)
    page.locator("input[type=text]").first.fill(user)
    page.locator("input[type=password]").first.fill(password)
    page.get_by_role("button", name="Login").click()
    page.wait_for_selector("#isagi-input textarea")
    page.get_by_role("tab", name="Sessions").click()
    page.click("#isagi-refresh")
    page.wait_for_function("() => document.body.innerText.includes('most recent session(s)')")
    return ctx, page


@pytest.mark.browser
def test_bob_in_the_browser_does_not_see_alices_session(auth_url: str, browser, alice, screenshot_dir) -> None:
    """alice's page lists her session (the control); bob's page does not, finds nothing
    for her secret, and resume, export and delete of her id typed by hand say not found."""
    from tests.e2e.test_web_e2e import wait_text

    a_client, sid = alice
    ctx, page = _login_page(browser, auth_url, "alice", "a")
    try:
        wait_text(page, "#isagi-sessions", sid)
    finally:
        ctx.close()
    ctx, page = _login_page(browser, auth_url, "bob", "b")
    try:
        body = page.inner_text("body")
        assert sid not in [r["id"] for r in shown_rows(page)] and SECRET not in body
        page.locator("#isagi-search textarea, #isagi-search input").first.fill(SECRET)
        page.click("#isagi-refresh")
        page.wait_for_function("() => document.body.innerText.includes('0 session(s) with messages')")
        page.locator("#isagi-chosen textarea, #isagi-chosen input").first.fill(sid)
        page.click("#isagi-resume")
        page.wait_for_function("() => document.body.innerText.includes('in your history')")
        page.click("#isagi-export-md")
        page.wait_for_function("() => document.body.innerText.includes('Could not export')")
        page.click("#isagi-delete")
        page.wait_for_timeout(2000)
        body = page.inner_text("body")
        assert SECRET not in body and page.locator("#isagi-download a").count() == 0
        page.screenshot(path=str(screenshot_dir / "two-users-bob-sessions.png"), full_page=True)
    finally:
        ctx.close()
    alice_intact(a_client, sid)
