"""The chat page's live state without a browser (issue 39): the waiting line of messages sent
during a reply (:mod:`app.outbox`, :mod:`app.handlers.waiting`) and a reload during a reply
(the left page's turn is stopped and recorded; the reloaded page reads it so, and the session
is not parked under it). The browser side is tests/e2e/test_live_state_browser.py."""

from __future__ import annotations

import threading
import warnings
from pathlib import Path
from types import SimpleNamespace

from isagi.app.handlers import chat as chat_handlers
from isagi.app.handlers.waiting import WAITING_NOTE
from isagi.app.loader import EngineHolder
from isagi.app.outbox import Outbox
from isagi.app.ui import WebUI
from isagi.app.updates import KEEP
from isagi.engines.base import GenerationOptions
from isagi.session.registry import SessionRegistry
from isagi.session.service import SessionService
from tests.tiny_engine import tiny_engine

A, B = ("local", "page-a"), ("local", "page-b")


def page(hash_: str, user: str | None = None) -> SimpleNamespace:
    """What the handlers read of a gr.Request: the page (session hash), the user, the client."""
    return SimpleNamespace(session_hash=hash_, username=user, client=SimpleNamespace(host="10.0.0.1"))


def quiet(gen):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gr.Warning outside a request falls back to warnings
        return list(gen)


def make_ui(tmp_path: Path) -> WebUI:
    engine = tiny_engine(tmp_path, max_new_tokens=8)
    holder = EngineHolder(engine)
    return WebUI(holder, SessionService(SessionRegistry(lambda: holder.engine, idle_s=600)), engine.settings)


# -- the waiting line ---------------------------------------------------------------------------
def test_the_line_keeps_order_per_page_and_owner():
    box = Outbox()
    for text in ("one", "two"):
        assert box.put(A, text)
    box.put(B, "other page")
    box.put(("bob", "page-a"), "bob's")  # the same page hash under another owner: another line
    assert box.waiting(A) == ["one", "two"]
    assert box.claim(A)
    assert [box.next(A), box.next(A), box.next(A)] == ["one", "two", None]
    assert box.waiting(B) == ["other page"] and box.waiting(("bob", "page-a")) == ["bob's"]


def test_one_run_sends_a_page_line_and_nothing_added_is_left_behind():
    box = Outbox()
    box.put(A, "one")
    assert box.claim(A)
    assert not box.claim(A)  # a second run leaves the line to the first
    assert box.next(A) == "one"
    box.put(A, "two")  # sent during the first run's turn: that run takes it
    assert not box.claim(A)
    assert box.next(A) == "two"
    assert box.next(A) is None  # empty: the claim is given up in the same step
    box.put(A, "three")
    assert box.claim(A)  # so the run this message starts sends it
    assert box.next(A) == "three"


def test_a_run_that_ends_early_gives_up_its_claim():
    box = Outbox()
    box.put(A, "one")
    assert box.claim(A)
    box.release(A)
    assert box.claim(A) and box.next(A) == "one"


def test_the_line_is_bounded_per_page_and_in_all():
    box = Outbox(per_page=2, total=3)
    assert box.put(A, "1") and box.put(A, "2")
    assert not box.put(A, "3")
    assert box.put(B, "4")
    assert not box.put(("local", "page-c"), "5")  # the server's bound
    assert box.take_all(A) == ["1", "2"]  # Stop: back to the box, room again
    assert box.put(("local", "page-c"), "5")
    assert box.forget(B) == ["4"] and box.waiting(B) == []


# -- the handlers -------------------------------------------------------------------------------
def test_a_queued_message_shows_waiting_at_once_then_each_is_sent_in_order(tmp_path):
    ui = make_ui(tmp_path)
    w = ui.waiting
    shown = w.queue("What is a lighthouse?", None, request=page("p1"))
    assert shown.textbox is KEEP  # emptied by the page as it sent: what is typed since stays
    assert len(shown.chat) == 1 and "What is a lighthouse?" in shown.chat[0]["content"]
    assert WAITING_NOTE in shown.chat[0]["content"]
    w.queue("Who keeps it?", None, request=page("p1"))
    updates = quiet(w.send_waiting(None, 8, request=page("p1")))
    assert all(u.textbox is KEEP for u in updates)  # the box is never touched: the user may type
    sid = next(u.state for u in updates if u.state is not KEEP)
    session = ui.page.sessions.session(sid, "local")
    assert [t.user_text for t in session.turns] == ["What is a lighthouse?", "Who keeps it?"]
    # while the first streamed, the second was drawn after it, waiting
    first_turn = [u.chat for u in updates if u.chat is not KEEP][0]
    assert "Who keeps it?" in first_turn[-1]["content"] and WAITING_NOTE in first_turn[-1]["content"]
    assert WAITING_NOTE not in repr(updates[-1].chat)
    assert w.outbox.waiting(("local", "p1")) == []


def test_empty_too_long_and_full_messages_go_back_to_the_box(tmp_path):
    ui = make_ui(tmp_path)
    w = ui.waiting
    empty = w.queue("   ", None, request=page("p1"))
    assert "empty" in empty.alert and empty.chat is KEEP, "an empty message is explained, nothing waits"
    assert w.outbox.waiting(("local", "p1")) == []
    too_long = "x" * (ui.page.settings.max_message_chars + 1)
    refused = w.queue(too_long, None, request=page("p1"))
    assert refused.textbox == too_long and refused.alert  # back in the box
    w.outbox = Outbox(per_page=1)
    w.queue("one", None, request=page("p1"))
    full = w.queue("two", None, request=page("p1"))
    assert full.textbox == "two" and "waiting" in full.alert
    assert w.outbox.waiting(("local", "p1")) == ["one"]


def test_stop_gives_the_waiting_messages_back_to_the_box(tmp_path):
    ui = make_ui(tmp_path)
    w = ui.waiting
    w.queue("one", None, request=page("p1"))
    w.queue("two", None, request=page("p1"))
    stopped = w.stop(None, "typed meanwhile", request=page("p1"))
    assert stopped.textbox == "one\n\ntwo\n\ntyped meanwhile"
    assert "back in the box" in stopped.alert
    assert quiet(w.send_waiting(None, 8, request=page("p1")))[0].changed() == {}  # nothing left to send


# -- a reload during a reply ---------------------------------------------------------------------
def _running_turn(svc: SessionService, sid: str, page_hash: str) -> tuple[threading.Thread, threading.Event]:
    """A long turn of ``sid`` for page ``page_hash`` running in a thread, as the page's event runs it."""
    from isagi.session.turn import Message

    started = threading.Event()
    long = GenerationOptions(max_new_tokens=100_000, ignore_eos=True)

    def run() -> None:
        with svc.turn(sid, "local", Message("a long answer please"), long, page=page_hash) as turn:
            for _ in turn.events():
                started.set()

    t = threading.Thread(target=run)
    t.start()
    assert started.wait(60)
    return t, started


def test_a_page_that_goes_away_stops_its_turn_and_a_reload_reads_it_stopped(tmp_path):
    ui = make_ui(tmp_path)
    svc = ui.page.sessions
    sid = svc.new("local", None)
    svc.attach("old", sid, "local")
    t, _ = _running_turn(svc, sid, "old")
    # the reloaded page loads first (the order varies): it shows the session, the turn still runs
    svc.attach("new", sid, "local")
    svc.detach("old", "local")  # the old page's unload: its turn is stopped, not left to run
    t.join(60)
    assert not t.is_alive()
    session = svc.session(sid, "local")
    assert [turn.verdict for turn in session.turns] == ["cancelled"]
    assert svc.live_ids("local") == [sid]  # shown by the new page: not parked under it


def test_a_reload_reads_the_session_once_the_stopping_turn_has_recorded_itself(tmp_path, monkeypatch):
    """The unload came first and stopped the turn, which still ends (a model step, a prompt
    chunk): the reloaded page's load waits for it instead of reading the session without it."""
    # the load waits up to STOP_WAIT_S (10 s); the turn below takes 1 s and a tiny model's turn,
    # which a loaded machine may stretch past that: the test is of the waiting, not its limit
    monkeypatch.setattr(chat_handlers, "STOP_WAIT_S", 60.0)
    ui = make_ui(tmp_path)
    svc = ui.page.sessions
    sid = svc.new("local", None)
    entry = svc.registry.entry(sid, "local")
    ui.chat.on_load(sid, request=page("old"))  # once before: the view's imports are not timed below
    entry.lock.acquire()
    entry.stop.set()  # as detach() does for the page that went away

    def ends_later() -> None:  # the stopping turn: its last step, then it records itself
        threading.Event().wait(1.0)
        ui.page.engine.turn(entry.session, "What is a lighthouse?")
        entry.lock.release()

    t = threading.Thread(target=ends_later)
    t.start()
    update = ui.chat.on_load(sid, request=page("new"))
    t.join(60)
    assert "What is a lighthouse?" in repr(update.chat), "the load read the session before the turn ended"
    assert update.state == sid
    assert svc.registry.live_entry(sid, "local") is not None


def test_a_turn_nobody_stopped_is_not_waited_for(tmp_path):
    ui = make_ui(tmp_path)
    svc = ui.page.sessions
    sid = svc.new("local", None)
    svc.attach("tab1", sid, "local")
    t, _ = _running_turn(svc, sid, "tab1")
    try:
        assert svc.settle(sid, "local", 0.2) is True  # another tab's reply runs on: no wait
        svc.stop(sid, "local", 30)
        assert svc.settle(sid, "local", 30) is True
    finally:
        svc.registry.request_stop(sid, "local")
        t.join(60)


def test_one_user_with_many_pages_cannot_fill_the_line_for_everyone():
    """A client names its page (Gradio's session hash): many made-up pages of one user stop at
    that user's bound, and another user's message still waits."""
    box = Outbox(per_page=10, total=50, per_owner=30)
    taken = sum(box.put(("mallory", f"page{i}"), "spam") for i in range(100))
    assert taken == 30
    assert box.put(("alice", "p1"), "my question") and box.waiting(("alice", "p1")) == ["my question"]
