"""The chat list beside the conversation (issue 39), in Chromium on the fake engine's live app.

What a user of Open WebUI or ChatGPT reaches for first: their chats listed newest first, one
click to open one, a rename that stays (a reload, a server restart, ``isagi sessions list``),
search over titles and messages, and Delete asked once more before it deletes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.e2e.conftest import ROOT, live_server, open_page
from tests.e2e.test_reload import user_messages
from tests.e2e.test_web_e2e import send_and_wait, session_id

pytestmark = pytest.mark.browser


def chat_titles(page) -> list[str]:
    """The chat list's rows as the page shows them, top to bottom."""
    return page.eval_on_selector_all("#isagi-chats label", "ls => ls.map(l => l.innerText.trim())")


def open_title(page) -> str:
    """The title of the chat marked open in the list ('' when none is)."""
    return page.eval_on_selector_all(
        "#isagi-chats label", "ls => (ls.find(l => l.querySelector('input').checked) || {innerText: ''}).innerText.trim()")


def wait_titles(page, want: list[str], timeout_ms: int = 60_000) -> None:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_function(
            "want => JSON.stringify(Array.from(document.querySelectorAll('#isagi-chats label'))"
            ".map(l => l.innerText.trim())) === JSON.stringify(want)", arg=want, timeout=timeout_ms)
    except PlaywrightTimeout:
        assert chat_titles(page) == want, page.inner_text("#isagi-alert")  # what it shows instead, and why


def rename(page, title: str) -> None:
    box = page.locator("#isagi-chat-title input, #isagi-chat-title textarea").first
    box.fill(title)
    box.press("Enter")


def sessions_cli(home, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "ISAGI_HOME": str(home), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "isagi.cli", "sessions", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_chats_are_listed_opened_renamed_searched_and_deleted(browser, tmp_path_factory, screenshot_dir):
    home = tmp_path_factory.mktemp("chat-list-home")
    with live_server(tmp_path_factory, fake=True, home=home) as url:
        ctx = browser.new_context(viewport={"width": 1440, "height": 1000})
        page = open_page(ctx, url)
        assert chat_titles(page) == []
        send_and_wait(page, "What is a lighthouse?")
        wait_titles(page, ["What is a lighthouse?"])
        a = session_id(page)
        page.click("#isagi-sidebar-new")
        page.wait_for_function("a => !document.querySelector('#isagi-manifold-summary').innerText.includes(a)", arg=a)
        send_and_wait(page, "Tell me about tides.")
        wait_titles(page, ["Tell me about tides.", "What is a lighthouse?"])  # newest first
        assert open_title(page) == "Tell me about tides."
        b = session_id(page)

        # one click opens a chat: its conversation and its memory, under its own id
        page.locator("#isagi-chats label", has_text="What is a lighthouse?").click()
        page.wait_for_function("a => document.querySelector('#isagi-manifold-summary').innerText.includes(a)", arg=a)
        assert user_messages(page) == ["What is a lighthouse?"]
        assert open_title(page) == "What is a lighthouse?"

        # rename: the list, a reload, the command line and a restart all show the new title
        rename(page, "Lighthouses")
        wait_titles(page, ["Tell me about tides.", "Lighthouses"])
        page.screenshot(path=str(screenshot_dir / "chat-list.png"))
        page.reload()
        page.wait_for_selector("#isagi-input textarea:not([disabled])")
        wait_titles(page, ["Tell me about tides.", "Lighthouses"])
        assert page.locator("#isagi-chat-title input, #isagi-chat-title textarea").first.input_value() == "Lighthouses"

        # search looks at titles and at messages
        search = page.locator("#isagi-chats-search input, #isagi-chats-search textarea").first
        search.fill("lighthouses")
        wait_titles(page, ["Lighthouses"])
        search.fill("tides")
        wait_titles(page, ["Tell me about tides."])
        search.fill("")
        wait_titles(page, ["Tell me about tides.", "Lighthouses"])
        ctx.close()
    listed = sessions_cli(home, "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert {r["id"]: r["title"] for r in json.loads(listed.stdout)} == {a: "Lighthouses", b: "Tell me about tides."}

    with live_server(tmp_path_factory, fake=True, home=home) as url:  # a restart keeps it too
        ctx = browser.new_context(viewport={"width": 1440, "height": 1000})
        page = open_page(ctx, url)
        wait_titles(page, ["Tell me about tides.", "Lighthouses"])
        page.locator("#isagi-chats label", has_text="Lighthouses").click()
        page.wait_for_function("a => document.querySelector('#isagi-manifold-summary').innerText.includes(a)", arg=a)
        assert page.locator("#isagi-chat-title input, #isagi-chat-title textarea").first.input_value() == "Lighthouses"

        # delete asks once more, and Cancel keeps the chat
        page.click("#isagi-chat-delete")
        page.wait_for_selector("#isagi-chat-delete-confirm", state="visible")
        assert "Lighthouses" in page.inner_text("#isagi-alert")
        page.click("#isagi-chat-delete-cancel")
        page.wait_for_selector("#isagi-chat-delete-confirm", state="hidden")
        assert chat_titles(page) == ["Tell me about tides.", "Lighthouses"]
        page.click("#isagi-chat-delete")
        page.click("#isagi-chat-delete-confirm")
        wait_titles(page, ["Tell me about tides."])
        assert user_messages(page) == []
        ctx.close()
    listed = sessions_cli(home, "list", "--json")
    assert [r["id"] for r in json.loads(listed.stdout)] == [b]
    assert not list((home / "sessions").glob(f"*{a}*"))
