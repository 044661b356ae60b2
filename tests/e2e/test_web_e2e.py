"""End-to-end: a real browser (Debian's Chromium through Playwright) against a live
``isagi web`` on the default model (issue 6, "Tests (real browser)").

Each test opens its own browser context(s), so each has its own server-side
session. Screenshots of real sessions are kept in ``artifacts/screenshots/``.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

SHORT = 48  # max new tokens for the tests that do not need long replies


# --------------------------------------------------------------------------- helpers


def wait_text(page, selector: str, text: str, timeout_ms: int = 120_000) -> None:
    """Wait until the element exists and its text contains ``text``."""
    page.wait_for_function(
        "([sel, t]) => { const e = document.querySelector(sel); return !!e && e.innerText.includes(t); }",
        arg=[selector, text], timeout=timeout_ms,
    )


def set_max_tokens(page, n: int, attempts: int = 4) -> None:
    """Open the settings accordion and set "Max new tokens" to ``n``.

    Retried: on a loaded machine the accordion may still be opening, or the
    slider may not have taken the typed value yet, when the first try runs.
    """
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    box = page.locator("#isagi-max-tokens input[type=number]")
    if not box.is_visible():
        page.get_by_text("Generation settings").click()
        box.wait_for(state="visible", timeout=30_000)
    # the slider ends at the server's limit (ISAGI_MAX_NEW_TOKENS): asking more means its end
    n = min(n, int(float(page.locator("#isagi-max-tokens input[type=range]").get_attribute("max") or n)))
    for attempt in range(attempts):
        if not box.is_visible():
            page.get_by_text("Generation settings").click()
            box.wait_for(state="visible", timeout=30_000)
        box.fill(str(n))
        box.press("Enter")
        box.blur()
        try:
            page.wait_for_function(
                f"document.querySelector('#isagi-max-tokens input[type=range]').value == '{n}'",
                timeout=15_000,
            )
            return
        except PlaywrightTimeout:
            if attempt == attempts - 1:
                raise


def reply_count(page) -> int:
    """Replies whose turn has finished (their info line no longer says 'generating')."""
    return page.evaluate(
        "Array.from(document.querySelectorAll('#isagi-chat .isagi-info'))"
        ".filter(e => !e.innerText.includes('generating')).length"
    )


def badges(page) -> list[str]:
    """The technical name (RETRIEVE, REFUSED, ...) of each reply's badge, from its class: the
    badge shows the plain name ("Answered from memory"), which badge_words reads."""
    return page.evaluate(
        "Array.from(document.querySelectorAll('#isagi-chat .isagi-info .isagi-tier:first-child'))"
        ".map(e => (Array.from(e.classList).find(c => c.startsWith('isagi-tier-')) || '')"
        ".slice('isagi-tier-'.length).toUpperCase())"
    )


def badge_words(page) -> list[tuple[str, str]]:
    """(what the badge says, its hover title) of each reply's badge, as the user sees them."""
    return page.evaluate(
        "Array.from(document.querySelectorAll('#isagi-chat .isagi-info .isagi-tier:first-child'))"
        ".map(e => [e.innerText.trim(), e.getAttribute('title') || ''])"
    )


REPLY_CHARS = (
    "Array.from(document.querySelectorAll('#isagi-chat .message-content'))"
    ".filter(e => !e.querySelector('.isagi-info')).map(e => e.innerText.length).reduce((a, b) => a + b, 0)"
)


def send(page, text: str) -> None:
    box = page.locator("#isagi-input textarea")
    box.fill(text)
    box.press("Enter")


def alert_text(page) -> str:
    """The alert line's message: not the hidden timer Gradio keeps counting inside it."""
    return page.inner_text("#isagi-alert [data-testid=markdown-wrapper]").strip()


def send_and_wait(page, text: str, timeout_ms: int = 300_000) -> str:
    """Send, wait until the turn has finished, return its badge."""
    before = reply_count(page)
    send(page, text)
    page.wait_for_function(
        "n => Array.from(document.querySelectorAll('#isagi-chat .isagi-info'))"
        ".filter(e => !e.innerText.includes('generating')).length > n",
        arg=before, timeout=timeout_ms,
    )
    page.wait_for_function(
        "() => !document.querySelector('#isagi-chat').innerText.includes('generating…')", timeout=timeout_ms
    )
    return badges(page)[-1]


def trajectories(page) -> int:
    text = page.inner_text("#isagi-manifold-summary")
    m = re.search(r"Trajectories:\s*(\d+)", text)
    assert m, text
    return int(m.group(1))


def session_id(page) -> str:
    m = re.search(r"session\s+(\w+)", page.inner_text("#isagi-manifold-summary"))
    assert m
    return m.group(1)


def open_tab(page, name: str) -> None:
    page.get_by_role("tab", name=name).click()


# --------------------------------------------------------------------------- tests


def test_reply_streams_in_and_a_tier_badge_appears_then_retrieve(new_page, screenshot_dir):
    page = new_page()
    # A long reply: on llama.cpp 96 tokens take ~0.6 s, too few 0.1 s display updates to count on.
    set_max_tokens(page, 256)
    send(page, "Tell me a long story about the ocean.")
    # Stream: the reply grows over several observations before the turn ends.
    lengths: list[int] = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        lengths.append(page.evaluate(REPLY_CHARS))
        if reply_count(page) >= 1 and "generating…" not in page.inner_text("#isagi-chat"):
            break
        page.wait_for_timeout(50)
    distinct = sorted(set(lengths))
    assert len(distinct) >= 4, f"the reply did not stream in (chat lengths seen: {distinct[:10]})"
    first = badges(page)[-1]
    assert first in ("EXPLORE", "EXPAND", "AUGMENT"), first
    assert trajectories(page) == 1
    page.screenshot(path=str(screenshot_dir / "01-first-reply.png"), full_page=True)

    again = send_and_wait(page, "Tell me a long story about the ocean.")
    assert again == "RETRIEVE"
    assert "RETRIEVE" in page.inner_text("#isagi-turn")
    page.screenshot(path=str(screenshot_dir / "02-retrieve.png"), full_page=True)


def test_two_browsers_never_share_memory(new_page, screenshot_dir):
    a, b = new_page(), new_page()
    for p in (a, b):
        set_max_tokens(p, SHORT)
    question = "What is the boiling point of water at sea level?"
    assert send_and_wait(a, question) != "RETRIEVE"
    # b asks the same question while a is still open: not answered from a's memory
    assert send_and_wait(b, question) != "RETRIEVE"
    assert session_id(a) != session_id(b)  # (a page has a session from its first message on)
    # while both send at once, the queue serialises them and each stays its own
    send(a, question)
    send(b, "Name three colours of the rainbow.")
    a.wait_for_function("() => document.querySelectorAll('#isagi-chat .isagi-info').length >= 2 && "
                        "!document.querySelector('#isagi-chat').innerText.includes('generating…')", timeout=300_000)
    b.wait_for_function("() => document.querySelectorAll('#isagi-chat .isagi-info').length >= 2 && "
                        "!document.querySelector('#isagi-chat').innerText.includes('generating…')", timeout=300_000)
    assert badges(a)[-1] == "RETRIEVE", "a's own repeat is answered from a's memory"
    assert badges(b)[-1] != "RETRIEVE"
    assert trajectories(a) == 1 and trajectories(b) == 2
    assert "Name three colours" not in a.inner_text("#isagi-chat")
    b.screenshot(path=str(screenshot_dir / "03-second-browser.png"), full_page=True)


def test_save_reload_load_restores_the_manifold(new_page, tmp_path, screenshot_dir):
    page = new_page()
    set_max_tokens(page, SHORT)
    for q in ("What is photosynthesis?", "Who wrote Hamlet?", "Why is the sky blue?"):
        send_and_wait(page, q)
    n = trajectories(page)
    assert n >= 2
    open_tab(page, "Sessions")
    page.click("#isagi-save")
    page.wait_for_selector("#isagi-download a")
    with page.expect_download() as dl:
        page.locator("#isagi-download a").first.click()
    saved = tmp_path / "session.miku"
    dl.value.save_as(saved)
    assert saved.stat().st_size > 0

    sid = session_id(page)
    page.reload()  # a reload keeps the session (its id is in the browser's storage)
    wait_text(page, "#isagi-manifold-summary", sid)
    assert trajectories(page) == n
    page.click("#isagi-new")  # a new, empty chat; the file is loaded into a fresh session
    page.wait_for_function(
        "sid => !document.querySelector('#isagi-manifold-summary').innerText.includes(sid)", arg=sid)
    assert trajectories(page) == 0
    open_tab(page, "Sessions")
    page.set_input_files("#isagi-upload input[type=file]", str(saved))
    wait_text(page, "#isagi-files-note", "Loaded")
    open_tab(page, "Chat")
    wait_text(page, "#isagi-manifold-summary", f"Trajectories: {n}")
    assert trajectories(page) == n
    assert f"({n} trajectories" in page.inner_text("#isagi-map")
    assert "Who wrote Hamlet?" in page.inner_text("#isagi-chat")
    page.screenshot(path=str(screenshot_dir / "04-loaded-miku.png"), full_page=True)
    # the loaded memory is live: a repeated question is answered from it
    assert send_and_wait(page, "Who wrote Hamlet?") == "RETRIEVE"


def test_corrupted_upload_shows_an_error_and_keeps_the_session(new_page, tmp_path, screenshot_dir):
    page = new_page()
    set_max_tokens(page, SHORT)
    send_and_wait(page, "What is a prime number?")
    sid, n = session_id(page), trajectories(page)
    bad = tmp_path / "corrupted.miku"
    bad.write_bytes(b"MIKU" + bytes(range(256)) * 8)
    open_tab(page, "Sessions")
    page.set_input_files("#isagi-upload input[type=file]", str(bad))
    wait_text(page, "#isagi-files-note", "Could not load")
    note = page.inner_text("#isagi-files-note")
    assert "unchanged" in note
    page.screenshot(path=str(screenshot_dir / "05-corrupted-upload.png"), full_page=True)
    open_tab(page, "Chat")
    assert session_id(page) == sid and trajectories(page) == n
    assert "What is a prime number?" in page.inner_text("#isagi-chat")
    assert send_and_wait(page, "What is a prime number?") == "RETRIEVE"


def test_stop_ends_generation_within_a_second(new_page, screenshot_dir):
    page = new_page()
    set_max_tokens(page, 2048)
    send(page, "Write a very long story about a lighthouse keeper and a storm, with many chapters.")
    # wait until the reply is streaming
    page.wait_for_function(
        "() => { const i = document.querySelectorAll('#isagi-chat .isagi-info'); "
        "return i.length && document.querySelector('#isagi-chat').innerText.length > 400; }",
        timeout=300_000,
    )
    page.wait_for_timeout(300)
    assert "generating" in page.inner_text("#isagi-chat"), "the reply ended before Stop: nothing to stop"
    clicked = time.monotonic()
    page.click("#isagi-stop")
    # streaming stops: the last change of the reply text (info lines excluded) after the click
    last_len, last_change = page.evaluate(REPLY_CHARS), clicked
    while time.monotonic() - last_change < 2.0 and time.monotonic() - clicked < 30:
        n = page.evaluate(REPLY_CHARS)
        if n != last_len:
            last_len, last_change = n, time.monotonic()
        page.wait_for_timeout(20)
    # the server confirms that generation ended (the turn is recorded as stopped)
    page.wait_for_selector("#isagi-chat .isagi-tier-cancelled", timeout=30_000)
    confirmed = time.monotonic() - clicked
    stream_stop = last_change - clicked
    page.screenshot(path=str(screenshot_dir / "06-stopped.png"), full_page=True)
    info = page.locator("#isagi-chat .isagi-info").last.inner_text()
    tokens = int(re.search(r"(\d+) tokens", info).group(1))
    ended = re.search(r"turn ended ([0-9.]+) s after Stop", page.inner_text("#isagi-alert"))
    server_s = float(ended.group(1)) if ended else float("nan")
    print(f"stop: streaming ended {stream_stop:.3f} s after the click; the server's turn ended "
          f"{server_s:.3f} s after it received Stop; stopped state shown after {confirmed:.3f} s; "
          f"{tokens} tokens generated")
    assert tokens < 2048
    # The requirement: Stop ends generation within a second.
    assert stream_stop <= 1.0, f"streaming went on for {stream_stop:.2f} s after Stop"
    assert server_s <= 1.0, f"the model worked on for {server_s:.2f} s after Stop"
    # the model is free again for the next turn
    set_max_tokens(page, SHORT)
    assert send_and_wait(page, "Say hello.") in ("EXPLORE", "EXPAND", "AUGMENT")


def test_empty_and_oversized_messages_are_explained(new_page):
    page = new_page()
    page.click("#isagi-send")
    wait_text(page, "#isagi-alert", "empty")
    page.locator("#isagi-input textarea").fill("x" * 9000)
    page.click("#isagi-send")
    wait_text(page, "#isagi-alert", "limit")
    assert "8,000" in page.inner_text("#isagi-alert")
    assert reply_count(page) == 0


def test_sessions_tab_lists_searches_and_exports(new_page, tmp_path):
    page = new_page()
    set_max_tokens(page, SHORT)
    marker = f"zebra{int(time.time())}"
    send_and_wait(page, f"Tell me one fact about the {marker}.")
    sid = session_id(page)
    open_tab(page, "Sessions")
    page.locator("#isagi-search textarea, #isagi-search input").first.fill(marker)
    page.click("#isagi-refresh")
    wait_text(page, "#isagi-sessions", sid)
    page.locator("#isagi-chosen textarea, #isagi-chosen input").first.fill(sid)
    page.click("#isagi-export-md")
    page.wait_for_selector("#isagi-download a")
    with page.expect_download() as dl:
        page.locator("#isagi-download a").first.click()
    out = Path(tmp_path / "export.md")
    dl.value.save_as(out)
    assert marker in out.read_text()
