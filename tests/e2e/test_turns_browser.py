"""Regenerate, Stop and Esc in the real browser (Debian's Chromium through Playwright), on a
live app with the tiny real engine (:mod:`tests.e2e.fake_server`), so they run anywhere
in seconds. ``ISAGI_E2E_URL`` runs the Regenerate tests against a running server on the real
model; Stop and Esc always get a fake server of their own whose replies stream a fixed text
slowly (:func:`scripted_url`), so that a reply still streams when they act.

- Regenerate replaces the last turn: the chat, the history store (Sessions table) and
  the autosaved file count the same turns afterwards.
- Stop, then a question: the stopped reply never enters the next prompt (the prompt is
  exactly as long as in a session without the stopped turn).
"""

from __future__ import annotations

import re

import pytest

from tests.e2e.conftest import live_server, open_page, table_rows
from tests.e2e.test_reload import user_messages
from tests.e2e.test_web_e2e import badges, open_tab, send, send_and_wait, session_id

pytestmark = pytest.mark.browser


def prompt_tokens(page) -> int:
    """The prompt size shown beside the latest reply ("P + N tokens")."""
    info = page.locator("#isagi-chat .isagi-info").last.inner_text()
    return int(re.search(r"(\d+) \+ \d+ tokens", info).group(1))


def table_turns(page, sid: str) -> int:
    """The turns column of ``sid``'s row in the Sessions table."""
    (row,) = [r for r in table_rows(page) if r["id"] == sid]
    return int(row["turns"])


# Regenerate's "generating…" line can last less than a poll on a fast machine: an observer
# on the chat records it, and a changed latency in the "Latest turn" panel (to the ms) counts
# too. Only the latency: the panel's whole text also changes while the event is pending (Gradio
# keeps a hidden "0.0s" timer inside each output), before the new turn has even started.
_LATENCY = "((document.querySelector('#isagi-turn').innerText.match(/Latency\\s+([0-9.]+ s)/) || [])[1] || '')"
_WATCH = """() => {
  window.__isagiSaw = false;
  const chat = document.querySelector('#isagi-chat');
  window.__isagiObs = new MutationObserver(() => {
    if (chat.innerText.includes('generating')) window.__isagiSaw = true;
  });
  window.__isagiObs.observe(chat, {childList: true, subtree: true, characterData: true});
  return LATENCY;
}""".replace("LATENCY", _LATENCY)
_ENDED = """before => (window.__isagiSaw || LATENCY !== before)
  && !document.querySelector('#isagi-chat').innerText.includes('generating')""".replace("LATENCY", _LATENCY)


def regenerate_and_wait(page) -> None:
    """Click Regenerate and wait until its new turn has ended."""
    before = page.evaluate(_WATCH)
    page.click("#isagi-regen")
    page.wait_for_function(_ENDED, arg=before, timeout=120_000)
    page.evaluate("() => window.__isagiObs.disconnect()")



# Stop and Esc need a reply that is still streaming when they act. The tiny engine's own replies
# end within about a second of streaming (256 tokens at most), too soon on a fast machine.
SCRIPT = "A slow scripted story about a lighthouse keeper, streaming token by token so Stop can act."
SECOND_STREAMING = ("() => { const c = document.querySelector('#isagi-chat').innerText;"
                    " return c.includes('generating') && (c.match(/A slow scripted/g) || []).length >= 2; }")


@pytest.fixture(scope="module")
def scripted_url(tmp_path_factory):
    """A fake server whose every reply streams :data:`SCRIPT` over its first 24 tokens, one every
    0.2 s (about 5 s a reply, while the tiny model decodes that many, as it does here)."""
    with live_server(tmp_path_factory, fake=True, fake_args=("--reply", SCRIPT, "--token-delay-s", "0.2")) as url:
        yield url


def start_a_long_reply(page) -> None:
    """A first exchange, then a second reply, once it streams (about 4 s of it are left then)."""
    send_and_wait(page, "Say hello.")
    send(page, "Write a very long story about a lighthouse keeper.")
    page.wait_for_function(SECOND_STREAMING, timeout=120_000, polling=50)


def test_regenerate_replaces_the_turn_everywhere(fake_url, browser, screenshot_dir):
    ctx = browser.new_context(viewport={"width": 1440, "height": 1000})
    try:
        page = open_page(ctx, fake_url)
        for q in ("What is a lighthouse?", "Why is the sea salty?"):
            send_and_wait(page, q)
        sid = session_id(page)
        n_badges = len(badges(page))
        regenerate_and_wait(page)  # the new turn streams, then its final info line replaces that
        page.wait_for_timeout(500)
        page.screenshot(path=str(screenshot_dir / "regenerate-replaces.png"), full_page=True)
        assert session_id(page) == sid
        assert len(user_messages(page)) == 2 and len(badges(page)) == n_badges  # replaced, not added
        assert table_turns(page, sid) == 2  # the history store counts the same turns
        open_tab(page, "Chat")
    finally:
        ctx.close()


def test_stop_then_a_question_starts_clean(scripted_url, browser, screenshot_dir):
    """The same two questions with and without a stopped story between them: the second
    question's prompt is exactly as long either way (the scripted replies are the same)."""
    ctx = browser.new_context(viewport={"width": 1440, "height": 1000})
    try:
        control = open_page(ctx, scripted_url)
        send_and_wait(control, "Say hello.")
        send_and_wait(control, "Say hello again.")
        clean_prompt = prompt_tokens(control)
        other = browser.new_context(viewport={"width": 1440, "height": 1000})
        page = open_page(other, scripted_url)
        start_a_long_reply(page)
        page.click("#isagi-stop")
        page.wait_for_selector("#isagi-chat .isagi-tier-cancelled", timeout=30_000)
        send_and_wait(page, "Say hello again.")
        page.screenshot(path=str(screenshot_dir / "stop-then-question.png"), full_page=True)
        assert prompt_tokens(page) == clean_prompt, "the stopped story entered the next prompt"
        other.close()
    finally:
        ctx.close()


LAST_REPLY = (
    "() => { const r = Array.from(document.querySelectorAll('#isagi-chat .message-content'))"
    ".filter(e => !e.querySelector('.isagi-info') && !e.closest('.user-row')); "
    "return r.length ? r[r.length - 1].innerText.trim() : ''; }"
)


def test_regenerate_of_an_answer_from_memory_gives_a_new_one(fake_url, browser, screenshot_dir):
    """Regenerate on a RETRIEVE answer generates a new reply (the stored one could never be
    replaced before), and the question asked again is answered with the new one."""
    ctx = browser.new_context(viewport={"width": 1440, "height": 1000})
    try:
        page = open_page(ctx, fake_url)
        question = "What does a lighthouse keeper do at night?"
        send_and_wait(page, question)
        assert send_and_wait(page, question) == "RETRIEVE"
        stored = page.evaluate(LAST_REPLY)
        regenerate_and_wait(page)
        page.wait_for_timeout(500)
        page.screenshot(path=str(screenshot_dir / "regenerate-an-answer-from-memory.png"), full_page=True)
        assert badges(page)[-1] != "RETRIEVE", "Regenerate answered from memory again"
        regenerated = page.evaluate(LAST_REPLY)
        assert regenerated != stored and len(user_messages(page)) == 2
        assert send_and_wait(page, question) == "RETRIEVE"
        assert page.evaluate(LAST_REPLY) == regenerated, "memory still holds the old reply"
    finally:
        ctx.close()


def test_esc_stops_a_reply_as_the_stop_button_does(scripted_url, browser, screenshot_dir):
    """Issue 39: Esc, pressed anywhere on the page while a reply streams, stops it as Stop does
    (the turn is kept as stopped, the chat goes on)."""
    ctx = browser.new_context(viewport={"width": 1440, "height": 1000})
    try:
        page = open_page(ctx, scripted_url)
        start_a_long_reply(page)
        page.keyboard.press("Escape")
        page.wait_for_selector("#isagi-chat .isagi-tier-cancelled", timeout=30_000)
        assert send_and_wait(page, "Say hello again.") != "CANCELLED"
        page.screenshot(path=str(screenshot_dir / "esc-stops.png"), full_page=True)
    finally:
        ctx.close()


STOP_OPACITY = "() => Number(getComputedStyle(document.querySelector('#isagi-stop')).opacity)"


def test_stop_is_drawn_faded_while_nothing_generates(scripted_url, browser, screenshot_dir):
    """Stop is drawn at full strength only while a reply generates (or a message waits for
    the model); before the first turn and after a reply ends it is faded (Open WebUI shows its
    Stop only while a reply generates)."""
    ctx = browser.new_context(viewport={"width": 1440, "height": 1000})
    try:
        page = open_page(ctx, scripted_url)
        page.wait_for_function(f"() => ({STOP_OPACITY})() < 0.6")  # (after its 0.15 s transition)
        start_a_long_reply(page)
        page.wait_for_function(f"() => ({STOP_OPACITY})() == 1")
        page.screenshot(path=str(screenshot_dir / "stop-while-generating.png"))
        page.wait_for_function(
            "() => !document.querySelector('#isagi-chat').innerText.includes('generating')", timeout=60_000)
        page.wait_for_function(f"() => ({STOP_OPACITY})() < 0.6")
        page.screenshot(path=str(screenshot_dir / "stop-faded-when-idle.png"))
    finally:
        ctx.close()
