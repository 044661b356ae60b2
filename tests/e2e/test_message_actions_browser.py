"""Message actions in Chromium (issue 39): Edit and resend a sent message, Copy any message.

On the fake engine's live app. Edit puts the message back into the box with a line saying what
Send will do; Esc cancels; Send cuts the chat at that message and resends it, and the manifold
forgets what was cut: the edited-away question is no longer answered from memory.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import live_server, open_page, table_rows
from tests.e2e.test_reload import user_messages
from tests.e2e.test_web_e2e import send_and_wait, session_id, trajectories

pytestmark = pytest.mark.browser

A, B, C, D = ("How do plants make food?", "What is the boiling point of water?",
              "Name three primary colours.", "Why is the sky **blue**?")


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with live_server(tmp_path_factory, fake=True) as u:
        yield u


def user_row(page, i: int):
    return page.locator("#isagi-chat [data-testid=user]").nth(i)


def box_value(page) -> str:
    return page.locator("#isagi-input textarea").input_value()


def test_edit_and_resend_cuts_the_chat_and_the_memory_forgets_what_was_cut(browser, url, screenshot_dir):
    ctx = browser.new_context(viewport={"width": 1440, "height": 1000})
    page = open_page(ctx, url)
    for q in (A, B, C):
        send_and_wait(page, q)
    sid = session_id(page)
    assert user_messages(page) == [A, B, C], "the actions' words are not part of a message's text"

    # Edit fills the box with the message as sent, and says what Send will do; Esc cancels
    user_row(page, 1).hover()
    user_row(page, 1).locator(".isagi-edit").click()
    assert box_value(page) == B
    assert "Editing your message 2" in page.inner_text("#isagi-editing")
    page.keyboard.press("Escape")
    page.wait_for_selector("#isagi-editing", state="detached")
    assert user_messages(page) == [A, B, C], "Esc cancelled the edit: nothing was sent"

    user_row(page, 1).locator(".isagi-edit").click()
    box = page.locator("#isagi-input textarea")
    box.fill(D)
    page.screenshot(path=str(screenshot_dir / "edit-message.png"))
    box.press("Enter")
    page.wait_for_function(
        "n => document.querySelectorAll('#isagi-chat [data-testid=user]').length === n "
        "&& !document.querySelector('#isagi-chat').innerText.includes('generating…')", arg=2, timeout=120_000)
    assert user_messages(page) == [A, "Why is the sky blue?"]
    assert session_id(page) == sid, "the same chat, cut and continued"
    # (read by its words: Gradio keeps a hidden "0.1s" timer inside the summary while an event runs)
    assert trajectories(page) == 2, "the cut exchanges left the memory"
    assert [r["turns"] for r in table_rows(page) if r["id"] == sid] == ["2"], "the history holds the chat as it now is"

    # the question edited away is no longer answered from memory; one that stayed still is
    page.click("button[role=tab]:has-text('Chat')")
    assert send_and_wait(page, B) != "RETRIEVE"
    assert send_and_wait(page, A) == "RETRIEVE"
    ctx.close()


def test_copy_puts_a_message_on_the_clipboard(browser, url):
    ctx = browser.new_context(viewport={"width": 1440, "height": 1000})
    ctx.grant_permissions(["clipboard-read", "clipboard-write"])
    page = open_page(ctx, url)
    send_and_wait(page, D)
    user_row(page, 0).locator(".isagi-copy").click()
    user_row(page, 0).locator(".isagi-copy.isagi-copied").wait_for()  # the write is asynchronous
    assert page.evaluate("navigator.clipboard.readText()") == D, "a question is copied exactly as sent"
    reply = page.locator("#isagi-chat [data-testid=bot]").first
    reply.locator(".isagi-copy").click()
    reply.locator(".isagi-copy.isagi-copied").wait_for()
    copied = page.evaluate("navigator.clipboard.readText()")
    assert copied and copied == reply.locator(".message-content").evaluate(
        "b => { const c = b.cloneNode(true); c.querySelectorAll('.isagi-actions').forEach(n => n.remove()); "
        "document.body.appendChild(c); const t = c.innerText.trim(); c.remove(); return t; }")
    assert page.locator("#isagi-chat .isagi-info .isagi-copy").count() == 0, "the info line has no Copy"
    ctx.close()


def test_regenerate_keeps_versions_and_the_arrows_switch_them(browser, url):
    ctx = browser.new_context(viewport={"width": 1440, "height": 1000})
    page = open_page(ctx, url)
    send_and_wait(page, A)
    first = page.locator("#isagi-chat [data-testid=bot]").first.inner_text()
    page.click("#isagi-regen")
    page.wait_for_selector("#isagi-chat .isagi-versions", timeout=120_000)
    page.wait_for_function("() => !document.querySelector('#isagi-chat').innerText.includes('generating…')")
    versions = page.locator("#isagi-chat .isagi-versions")
    assert versions.inner_text().replace("‹", "").strip() == "2/2"
    page.locator("#isagi-chat .isagi-version-prev").click()
    page.wait_for_function("() => document.querySelector('#isagi-chat .isagi-versions').innerText.includes('1/2')")
    assert page.locator("#isagi-chat [data-testid=bot]").first.inner_text() == first, "the first reply is back"
    page.reload()
    page.wait_for_selector("#isagi-input textarea:not([disabled])")
    page.wait_for_function("() => (document.querySelector('#isagi-chat .isagi-versions') || {innerText: ''})"
                           ".innerText.includes('1/2')")
    ctx.close()
