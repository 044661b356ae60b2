"""The chat page says what is happening now (issue 39, "honest, live state"), in the real
browser (Debian's Chromium through Playwright) on the fake engine, whose replies stream a fixed
text slowly enough to act while they stream (:mod:`tests.e2e.fake_server`).

- A message sent while a reply streams shows at once in the conversation, greyed, "waiting
  for the model", the box empties, and it is answered after that reply, as a normal turn.
- Two messages sent quickly during a reply are both answered, in the order sent, once each.
- Stop gives messages that still wait back to the message box instead of sending them.
- A reload during a reply shows the question and its partial reply as stopped, at once,
  without a server restart (before, the page read the session while the left page's turn
  still held it, then that session was parked under the new page: the question vanished).
"""

from __future__ import annotations

import time

import pytest

from tests.e2e.conftest import live_server, open_page, wait_ready
from tests.e2e.test_reload import user_messages
from tests.e2e.test_web_e2e import badges, reply_count, send

pytestmark = pytest.mark.browser

REPLY = "A slow scripted reply, streaming in token by token so a test can act while it streams."
STREAMING = "() => document.querySelector('#isagi-chat').innerText.includes('A slow scripted')"
WAITING = ("q => Array.from(document.querySelectorAll('#isagi-chat .isagi-waiting'))"
           ".some(e => e.innerText.includes(q))")


@pytest.fixture(scope="module")
def slow_url(tmp_path_factory):
    """Replies take about 7 s (24 tokens, 0.3 s each): time to send while one streams."""
    with live_server(tmp_path_factory, fake=True, fake_args=("--reply", REPLY, "--token-delay-s", "0.3")) as url:
        yield url


@pytest.fixture(scope="module")
def slower_url(tmp_path_factory):
    """2 s a token: a reload lands while the reply's turn still holds the session."""
    with live_server(tmp_path_factory, fake=True, fake_args=("--reply", REPLY, "--token-delay-s", "2.0")) as url:
        yield url




def generating(page) -> bool:
    return "generating" in page.inner_text("#isagi-chat")


def wait_replies(page, n: int, timeout_ms: int = 180_000) -> None:
    """Wait until ``n`` replies have finished and nothing generates or waits any more."""
    page.wait_for_function(
        "n => Array.from(document.querySelectorAll('#isagi-chat .isagi-info'))"
        ".filter(e => !e.innerText.includes('generating')).length >= n"
        " && !document.querySelector('#isagi-chat .isagi-waiting')"
        " && !document.querySelector('#isagi-chat').innerText.includes('generating')",
        arg=n, timeout=timeout_ms)


def test_a_message_sent_during_a_reply_shows_as_waiting_at_once_then_is_answered(slow_url, context_of,
                                                                                  screenshot_dir):
    page = open_page(context_of(), slow_url)
    first, second = "What is a lighthouse?", "And who keeps it?"
    send(page, first)
    page.wait_for_function(STREAMING, timeout=120_000, polling=50)
    box = page.locator("#isagi-input textarea")
    box.fill(second)
    t0 = time.monotonic()
    box.press("Enter")
    page.wait_for_function(WAITING, arg=second, timeout=30_000, polling="raf")
    shown_after = time.monotonic() - t0
    still_streaming = generating(page)
    print(f"\nthe waiting message showed {shown_after * 1000:.0f} ms after Enter (issue 39 wants under 500 ms)")
    page.screenshot(path=str(screenshot_dir / "message-waiting-for-the-model.png"), full_page=True)
    assert still_streaming, "the first reply had ended before the message showed: it was not shown while waiting"
    assert "waiting for the model" in page.inner_text("#isagi-chat")
    assert box.input_value() == "", "the box still holds the sent message"
    wait_replies(page, 2)
    assert user_messages(page) == [first, second]
    assert len(badges(page)) == 2


def test_two_messages_sent_quickly_during_a_reply_are_both_answered_in_order(slow_url, context_of):
    page = open_page(context_of(), slow_url)
    questions = ["What is a lighthouse?", "Who keeps it?", "And at night?"]
    send(page, questions[0])
    page.wait_for_function(STREAMING, timeout=120_000, polling=50)
    send(page, questions[1])
    send(page, questions[2])
    page.wait_for_function(WAITING, arg=questions[2], timeout=30_000)
    assert generating(page), "the first reply had ended: nothing waited"
    waiting = page.evaluate("Array.from(document.querySelectorAll('#isagi-chat .isagi-waiting'))"
                            ".map(e => e.innerText)")
    waiting = [w.split("\n")[0] for w in waiting]
    # both wait, in order (or, on a slow machine, the first reply just ended and took the first)
    assert waiting and waiting == questions[-len(waiting):], waiting
    wait_replies(page, 3, timeout_ms=300_000)
    assert user_messages(page) == questions  # each once, in order
    assert reply_count(page) == 3


def test_stop_gives_the_waiting_messages_back_to_the_box(slow_url, context_of):
    page = open_page(context_of(), slow_url)
    send(page, "What is a lighthouse?")
    page.wait_for_function(STREAMING, timeout=120_000, polling=50)
    send(page, "Who keeps it?")
    page.wait_for_function(WAITING, arg="Who keeps it?", timeout=30_000)
    page.click("#isagi-stop")
    page.wait_for_function("() => document.querySelector('#isagi-input textarea').value.includes('Who keeps it?')",
                           timeout=60_000)
    page.wait_for_selector("#isagi-chat .isagi-tier-cancelled", timeout=60_000)
    page.wait_for_timeout(1500)  # nothing more is sent: what waited is in the box, not in a turn
    assert user_messages(page) == ["What is a lighthouse?"]
    assert not page.query_selector("#isagi-chat .isagi-waiting")
    assert "back in the box" in page.inner_text("#isagi-alert")


def test_a_reload_during_a_reply_shows_it_stopped_at_once(slower_url, context_of, screenshot_dir):
    page = open_page(context_of(), slower_url)
    question = "What is a lighthouse?"
    send(page, question)
    page.wait_for_function(STREAMING, timeout=120_000, polling=50)
    assert generating(page)
    page.reload()
    wait_ready(page)
    page.wait_for_selector("#isagi-chat .isagi-tier-cancelled", timeout=30_000)
    page.screenshot(path=str(screenshot_dir / "reload-during-a-reply.png"), full_page=True)
    assert user_messages(page) == [question]
    assert "A slow scripted" in page.inner_text("#isagi-chat"), "the partial reply is not shown"
    assert not generating(page)
    page.wait_for_timeout(4_000)  # two syncs later it is still there (it was not parked under the page)
    assert user_messages(page) == [question]
    assert page.query_selector("#isagi-chat .isagi-tier-cancelled")


# Records, for each element id, whether a turn's timer was drawn in it (Gradio's progress tracker
# there took the "minimal" look the turn events ask for; a hidden tracker has the class "hide" and
# counts its seconds unseen), and whether a timer ("0.1s") was ever part of its text.
_TRACKERS = """ids => { window.__shown = {}; window.__read = {};
  for (const id of ids) { const el = document.getElementById(id); window.__shown[id] = false;
    window.__read[id] = false;
    const look = () => { for (const t of el.querySelectorAll('[data-testid=status-tracker]'))
      if (t.classList.contains('minimal')) window.__shown[id] = true;
      if (/\\d\\.\\ds/.test(el.innerText)) window.__read[id] = true; };
    look();
    new MutationObserver(look)
    .observe(el, {childList: true, subtree: true, characterData: true, attributes: true}); } }"""


def test_a_turns_timer_shows_on_the_chat_only(slow_url, context_of):
    """Gradio draws a running event's timer ("0.1s") over each output it shows progress on: over
    the alert line it read as an alert, and over the panels and the status line as noise."""
    page = open_page(context_of(), slow_url)
    ids = ["isagi-chat", "isagi-alert", "isagi-turn", "isagi-status"]
    page.evaluate(_TRACKERS, ids)
    send(page, "What is a lighthouse?")
    wait_replies(page, 1)
    shown = page.evaluate("() => window.__shown")
    assert shown == {"isagi-chat": True, "isagi-alert": False, "isagi-turn": False, "isagi-status": False}, shown
    # and the timer of a hidden tracker is not part of the text (what a screen reader reads)
    read = page.evaluate("() => window.__read")
    assert read == {"isagi-chat": True, "isagi-alert": False, "isagi-turn": False, "isagi-status": False}, read
