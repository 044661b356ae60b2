"""The page's sessions in the real browser (Debian's Chromium through Playwright), on a live
app with the tiny real engine (:mod:`tests.e2e.fake_server`) whose replies stream a fixed
text slowly enough to act while they stream, and which refuses messages holding a marker
(as the safety layer refuses); ``ISAGI_E2E_URL`` cannot run these (they need that server).

Each is a bug a newcomer met (issue 23):
- after Resume, the previous chat's refusal alert stayed under the resumed chat;
- a message sent while a reply streamed was silently dropped;
- Delete was refused for a session whose tab was closed (the table said "live"), and
  asked no confirmation when it worked;
- loading a ``.miku`` neither refreshed the sessions table nor switched to the chat;
- of two tabs on one session, the other stayed stale until it sent.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import live_server, open_page, shown_rows, table_rows
from tests.e2e.test_reload import user_messages
from tests.e2e.test_web_e2e import open_tab, send, send_and_wait, session_id, wait_text

pytestmark = pytest.mark.browser

MARKER = "forbidden-topic-4711"  # the server refuses every message holding it
REPLY = "A slow scripted reply, streaming in token by token so a test can act while it streams."


@pytest.fixture(scope="module")
def slow_url(tmp_path_factory):
    """A fake-engine app: replies stream REPLY at 0.2 s a token (about 5 s a reply, time for
    a test to act while one streams); MARKER is refused."""
    with live_server(tmp_path_factory, fake=True,
                     fake_args=("--reply", REPLY, "--token-delay-s", "0.2", "--refuse-marker", MARKER)) as url:
        yield url


@pytest.fixture
def context_of(browser):
    contexts = []

    def make():
        ctx = browser.new_context(viewport={"width": 1440, "height": 1000}, accept_downloads=True)
        contexts.append(ctx)
        return ctx

    yield make
    for ctx in contexts:
        ctx.close()


def chosen(page, sid: str) -> None:
    page.locator("#isagi-chosen textarea, #isagi-chosen input").first.fill(sid)


def test_after_resume_the_previous_chats_refusal_alert_is_gone(slow_url, context_of, screenshot_dir):
    page = open_page(context_of(), slow_url)
    send_and_wait(page, "What is a lighthouse?")
    a = session_id(page)
    page.click("#isagi-new")
    page.wait_for_function("a => !document.querySelector('#isagi-manifold-summary').innerText.includes(a)", arg=a)
    assert send_and_wait(page, f"Tell me about {MARKER}.") == "REFUSED"
    wait_text(page, "#isagi-alert", "refused")
    open_tab(page, "Sessions")
    chosen(page, a)
    page.click("#isagi-resume")
    wait_text(page, "#isagi-manifold-summary", a)
    page.wait_for_timeout(500)
    page.screenshot(path=str(screenshot_dir / "resume-clears-the-alert.png"), full_page=True)
    assert "refused" not in page.inner_text("#isagi-alert"), "the previous chat's alert stayed"
    assert MARKER not in page.inner_text("#isagi-chat")


def test_a_message_sent_while_a_reply_streams_is_sent_after_it(slow_url, context_of, screenshot_dir):
    page = open_page(context_of(), slow_url)
    first, second = "What is a lighthouse?", "And who keeps it?"
    send(page, first)
    page.wait_for_function("() => document.querySelector('#isagi-chat').innerText.includes('A slow scripted')",
                           timeout=120_000, polling=50)
    send(page, second)  # while the first reply still streams
    assert "generating" in page.inner_text("#isagi-chat"), "the first reply had ended: nothing was tested"
    page.wait_for_function(
        "q => document.querySelector('#isagi-chat').innerText.includes(q)"
        " && !document.querySelector('#isagi-chat .isagi-waiting')"
        " && !document.querySelector('#isagi-chat').innerText.includes('generating')",
        arg=second, timeout=30_000)
    page.screenshot(path=str(screenshot_dir / "message-sent-while-streaming.png"), full_page=True)
    assert user_messages(page) == [first, second]
    assert page.input_value("#isagi-input textarea") == ""


def test_delete_works_once_the_tab_is_closed_and_asks_first(slow_url, context_of, screenshot_dir):
    tab = open_page(context_of(), slow_url)
    send_and_wait(tab, "What is a lighthouse?")
    sid = session_id(tab)
    other = open_page(context_of(), slow_url)  # another browser of the same owner (no login)
    assert [r["state"] for r in table_rows(other) if r["id"] == sid] == ["live"]
    tab.close()
    for _ in range(15):  # the server learns of the closed tab through Gradio's heartbeat
        if [r["state"] for r in table_rows(other) if r["id"] == sid] == ["saved"]:
            break
        other.wait_for_timeout(1000)
    assert [r["state"] for r in table_rows(other) if r["id"] == sid] == ["saved"], "the closed tab's session is live"
    chosen(other, sid)
    other.click("#isagi-delete")
    other.wait_for_selector("#isagi-delete-confirm", state="visible")
    assert "cannot be undone" in other.inner_text("body")
    assert sid in [r["id"] for r in table_rows(other)], "asking deleted it"
    other.click("#isagi-delete-confirm")
    wait_text(other, "body", f"Deleted session {sid}")
    other.screenshot(path=str(screenshot_dir / "delete-after-the-tab-closed.png"), full_page=True)
    assert sid not in [r["id"] for r in shown_rows(other)]
    assert not other.locator("#isagi-delete-confirm").is_visible()


def test_loading_a_miku_lists_it_and_shows_the_chat(slow_url, context_of, tmp_path, screenshot_dir):
    page = open_page(context_of(), slow_url)
    send_and_wait(page, "What is a lighthouse?")
    sid = session_id(page)
    open_tab(page, "Sessions")
    page.click("#isagi-save")
    page.wait_for_selector("#isagi-download a")
    with page.expect_download() as dl:
        page.locator("#isagi-download a").first.click()
    saved = tmp_path / "saved.miku"
    dl.value.save_as(saved)
    page.set_input_files("#isagi-upload input[type=file]", str(saved))
    page.wait_for_function(
        "sid => { const t = document.querySelector('#isagi-manifold-summary').innerText; "
        "return /session \\w+/.test(t) && !t.includes(sid); }", arg=sid)
    new = session_id(page)
    page.wait_for_selector("#isagi-chat", state="visible", timeout=30_000)  # the chat tab is shown
    assert "What is a lighthouse?" in page.inner_text("#isagi-chat")
    page.screenshot(path=str(screenshot_dir / "loaded-miku-shows-the-chat.png"), full_page=True)
    open_tab(page, "Sessions")  # no refresh: the load has put the loaded session in the table
    page.wait_for_timeout(500)
    assert new in [r["id"] for r in shown_rows(page)], "the table does not list the loaded session"


def test_two_tabs_on_one_session_stay_in_step(slow_url, context_of, screenshot_dir):
    ctx = context_of()
    one = open_page(ctx, slow_url)
    kept_before = one.evaluate("() => localStorage.getItem('isagi-session-id')")
    send_and_wait(one, "What is a lighthouse?")
    sid = session_id(one)
    # the browser keeps the id one event after the first message (see test_reload): a second tab
    # opened before that write opens nothing
    one.wait_for_function("v => localStorage.getItem('isagi-session-id') !== v", arg=kept_before)
    two = open_page(ctx, slow_url)  # the same browser: the same session
    wait_text(two, "#isagi-manifold-summary", sid)
    send_and_wait(one, "Who keeps it?")
    wait_text(two, "#isagi-chat", "Who keeps it?", timeout_ms=20_000)  # without sending anything
    two.screenshot(path=str(screenshot_dir / "two-tabs-in-step.png"), full_page=True)
    assert user_messages(two) == user_messages(one) == ["What is a lighthouse?", "Who keeps it?"]
