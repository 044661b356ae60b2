"""Two logged-in users in the real browser (Debian's Chromium through Playwright) on the
fake engine with ``ISAGI_AUTH="alice:a,bob:b"``: the Gradio session hash of alice's page
is hers alone (bob's page, with his login, reading her event stream or joining the queue
with it is refused, while his own works), and a file input names only the page user's
own upload (bob's page loads his own .miku; the same page naming a server path gets the
neutral answer, whether or not the path exists)."""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

import pytest

from isagi.app.guard import OTHER_LOGIN
from isagi.app.uploads import NOT_YOUR_UPLOAD
from tests.e2e.test_web_e2e import open_tab, send_and_wait, wait_text

pytestmark = pytest.mark.browser

HASH = re.compile(r"(?:session_hash=|/heartbeat/)([A-Za-z0-9]+)")


def login(browser: Any, url: str, user: str, password: str) -> tuple[Any, Any, list[str]]:
    """A logged-in page of ``user`` and the Gradio session hashes its requests carry."""
    ctx = browser.new_context(viewport={"width": 1440, "height": 1000}, accept_downloads=True)
    page = ctx.new_page()
    page.set_default_timeout(120_000)
    hashes: list[str] = []
    page.on("request", lambda r: hashes.extend(HASH.findall(r.url)))
    page.goto(url)
    page.locator("input[type=text]").first.fill(user)
    page.locator("input[type=password]").first.fill(password)
    page.get_by_role("button", name="Login").click()
    page.wait_for_selector("#isagi-input textarea")
    page.wait_for_function("() => document.querySelector('#isagi-status').innerText.includes('live session(s)')")
    return ctx, page, hashes


# In the page, with its own cookies: the status of reading a session's event stream, and of
# joining the queue with a session hash (the stream is aborted once its headers are in).
PROBE = """async ([hash, fnIndex]) => {
  const ctl = new AbortController();
  const data = await fetch(`gradio_api/queue/data?session_hash=${hash}`, {signal: ctl.signal});
  const dataStatus = data.status; ctl.abort();
  const join = await fetch('gradio_api/queue/join', {method: 'POST',
      headers: {'Content-Type': 'application/json'},
      body: JSON.stringify({data: [''], fn_index: fnIndex, session_hash: hash, event_data: null, trigger_id: null})});
  return [dataStatus, join.status, await join.text()];
}"""

# In the page: run load_miku by fn_index with a file object naming ``path``, and return the
# files note it answers. ``hash`` must be one no page client listens on: Gradio hands each
# message of a session to whichever of its open event streams reads it first, and the page's
# own client opens one every two seconds (its sync timer), so on the page's hash this stream
# could miss its answer and wait for ever.
LOAD = """async ([hash, fnIndex, path, nInputs, slot]) => {
  const data = Array(nInputs).fill(null); data[slot] = {path, orig_name: 'x.miku', meta: {_type: 'gradio.FileData'}};
  data[nInputs - 1] = 'tier';
  const join = await fetch('gradio_api/queue/join', {method: 'POST', headers: {'Content-Type': 'application/json'},
      body: JSON.stringify({data, fn_index: fnIndex, session_hash: hash, event_data: null, trigger_id: null})});
  const {event_id} = await join.json();
  const stream = await fetch(`gradio_api/queue/data?session_hash=${hash}`);
  const reader = stream.body.getReader(); let text = '';
  const late = new Promise(res => setTimeout(() => res({late: true}), 60000));
  while (true) {
    const read = await Promise.race([reader.read(), late]);
    if (read.late) { reader.cancel(); return `no answer to ${event_id} in 60 s: ${text}`; }
    const {value, done} = read; if (done) break;
    text += new TextDecoder().decode(value);
    for (const line of text.split('\\n')) {
      if (!line.startsWith('data:')) continue;
      const msg = JSON.parse(line.slice(5));
      if (msg.event_id === event_id && msg.msg === 'process_completed') { reader.cancel(); return msg.output.data[1]; }
    }
  }
  return text;
}"""


def fresh_hash() -> str:
    """A session hash no page listens on (see LOAD); the login that first uses it holds it."""
    return f"probe{secrets.token_hex(6)}"


def test_a_pages_session_hash_and_uploads_are_its_users_own(fake_auth_url, browser, tmp_path, screenshot_dir):
    a_ctx, alice, a_hashes = login(browser, fake_auth_url, "alice", "a")
    b_ctx, bob, b_hashes = login(browser, fake_auth_url, "bob", "b")
    try:
        send_and_wait(alice, "alice's question about lighthouses")
        config = json.loads(bob.evaluate("async () => JSON.stringify(await (await fetch('config')).json())"))
        deps = {d.get("api_name"): d for d in config["dependencies"]}
        listing, load = deps["list_sessions"], deps["load_miku"]
        upload_id = next(c["id"] for c in config["components"] if c.get("props", {}).get("elem_id") == "isagi-upload")
        assert a_hashes and b_hashes and set(a_hashes).isdisjoint(b_hashes)
        hers = a_hashes[0]
        # bob's page with alice's session hash: refused; with one of his own: served. (Not the
        # hash his page runs on: Gradio ends a session's running events when one of its event
        # streams is cut, as the probe cuts it, and his page would lose its connection.)
        status, joined, body = bob.evaluate(PROBE, [hers, listing["id"]])
        assert (status, joined) == (403, 403) and OTHER_LOGIN in body, body
        status, joined, _ = bob.evaluate(PROBE, [fresh_hash(), listing["id"]])
        assert (status, joined) == (200, 200)
        # bob's page names server paths in the file input: one neutral answer for all
        notes = {bob.evaluate(LOAD, [fresh_hash(), load["id"], path, len(load["inputs"]), load["inputs"].index(upload_id)])
                 for path in ("/etc/passwd", "/nonexistent/alice.miku", "../../history.sqlite3")}
        assert len(notes) == 1 and NOT_YOUR_UPLOAD in notes.pop()
        # alice saves her session; bob's page loads a .miku of his own through the file input
        open_tab(alice, "Sessions")
        alice.click("#isagi-save")
        alice.wait_for_selector("#isagi-download a")
        with alice.expect_download() as dl:
            alice.locator("#isagi-download a").first.click()
        saved = tmp_path / "given-to-bob.miku"
        dl.value.save_as(saved)
        open_tab(bob, "Sessions")
        bob.set_input_files("#isagi-upload input[type=file]", str(saved))
        wait_text(bob, "#isagi-files-note", "Loaded")
        bob.screenshot(path=str(screenshot_dir / "trust-bob-loads-his-own-file.png"), full_page=True)
        # alice's page is unaffected by all of it
        open_tab(alice, "Chat")
        assert "alice's question about lighthouses" in alice.inner_text("#isagi-chat")
    finally:
        a_ctx.close()
        b_ctx.close()
