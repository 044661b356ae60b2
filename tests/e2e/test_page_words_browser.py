"""What the page says, in Chromium on the fake engine: the README's plain tier names on the
badges (the technical name in the badge's hover title and in the Turn panel), "Signed in as"
with a Log out that brings the login page back, and, while the model loads, a closed message
box that opens when the model can answer, with no red alert left.

Marked ``browser``; the fake server (:mod:`tests.e2e.fake_server`) starts in seconds.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import live_server, open_page
from tests.e2e.test_web_e2e import alert_text, badge_words, send_and_wait, set_max_tokens

pytestmark = pytest.mark.browser


def test_badges_say_the_readmes_words_and_hover_gives_the_tier(browser, fake_url, screenshot_dir):
    ctx = browser.new_context(viewport={"width": 1440, "height": 1000})
    try:
        page = open_page(ctx, fake_url)
        empty = page.inner_text("#isagi-chat")  # the empty chat's placeholder
        assert "answered from memory" in empty and "RETRIEVE" not in empty, empty
        set_max_tokens(page, 8)
        assert send_and_wait(page, "What is a lighthouse for?") == "EXPLORE"
        words, title = badge_words(page)[-1]
        assert words == "New topic" and "tier EXPLORE" in title, (words, title)
        assert send_and_wait(page, "What is a lighthouse for?") == "RETRIEVE"
        words, title = badge_words(page)[-1]
        assert words == "Answered from memory" and "tier RETRIEVE" in title, (words, title)
        panel = page.inner_text("#isagi-turn")
        assert "Answered from memory (RETRIEVE)" in panel, panel
        page.screenshot(path=str(screenshot_dir / "plain-words-badges.png"), full_page=True)
    finally:
        ctx.close()


def _login(page, url: str, user: str, password: str) -> None:
    page.goto(url)
    page.locator("input[type=password]").first.wait_for()
    page.locator("input[type=text]").first.fill(user)
    page.locator("input[type=password]").first.fill(password)
    page.get_by_role("button", name="Login").click()


def test_signed_in_as_and_log_out_brings_the_login_back(browser, fake_auth_url, screenshot_dir):
    ctx = browser.new_context(viewport={"width": 1440, "height": 1000})
    try:
        page = ctx.new_page()
        page.set_default_timeout(120_000)
        _login(page, fake_auth_url, "alice", "a")
        page.wait_for_function(
            "() => (document.querySelector('#isagi-status')?.innerText || '').includes('Signed in as alice')")
        body = page.inner_text("body")
        assert "ISAGI_AUTH" not in body
        page.screenshot(path=str(screenshot_dir / "signed-in.png"))
        page.locator("#isagi-logout").click()
        page.locator("input[type=password]").first.wait_for()  # Gradio's login page again
        assert "Signed in as" not in page.inner_text("body")
        page.reload()
        page.locator("input[type=password]").first.wait_for()  # signed out for good, not only on screen
        assert page.locator("#isagi-input").count() == 0
    finally:
        ctx.close()


def test_the_login_page_speaks_to_users(browser, fake_auth_url):
    ctx = browser.new_context()
    try:
        page = ctx.new_page()
        page.goto(fake_auth_url)
        page.locator("input[type=password]").first.wait_for(timeout=120_000)
        text = page.inner_text("body")
        assert "ISAGI chat" in text and "Sign in with the user name and password" in text, text
        assert "ISAGI_AUTH" not in text
    finally:
        ctx.close()


def test_the_box_opens_when_the_model_can_answer_and_no_alert_is_left(browser, tmp_path_factory, screenshot_dir):
    gate = Path(tmp_path_factory.mktemp("gate")) / "loaded"
    with live_server(tmp_path_factory, fake=True, fake_args=("--load-gate", str(gate)), loaded=False) as url:
        ctx = browser.new_context(viewport={"width": 1440, "height": 1000})
        try:
            page = ctx.new_page()
            page.set_default_timeout(120_000)
            page.goto(url)
            page.wait_for_function(
                "() => (document.querySelector('#isagi-status')?.innerText || '').includes('Loading the model')")
            first = page.inner_text("#isagi-status")
            page.wait_for_function(  # a tick of the banner's timer has run since (its seconds moved)
                "t => (document.querySelector('#isagi-status')?.innerText || '') !== t", arg=first)
            status = page.inner_text("#isagi-status")
            assert "alibrat" not in status and "onvert" not in status, status  # the fake only loads
            assert page.locator("#isagi-input textarea").is_disabled()
            assert page.locator("#isagi-send").is_disabled()
            page.screenshot(path=str(screenshot_dir / "loading-box-closed.png"))
            gate.touch()
            page.wait_for_selector("#isagi-input textarea:not([disabled])")
            # opened by the tick that found the model ready, whose banner says so: one event updates
            # both, but the page may paint the box a frame before the banner on a loaded machine
            page.wait_for_function(
                "() => (document.querySelector('#isagi-status')?.innerText || '').includes('live session(s)')",
                timeout=30_000)
            assert not page.locator("#isagi-send").is_disabled()
            assert alert_text(page) == ""
            set_max_tokens(page, 8)
            assert send_and_wait(page, "Hello there") == "EXPLORE"
            assert alert_text(page) == ""
        finally:
            ctx.close()
