"""A page reload and Resume, without a browser: the page's load handler gets the
session id the browser kept (its storage) and reopens that same session (same id,
messages and memory) whether it is live, parked (evicted) or only in its autosaved
``.miku`` (a restarted server); an unknown id, junk, or another owner's id opens
nothing and reveals nothing. Resume of one's own live session switches to it (no
fork). A rejected upload does not leave an earlier "Loaded" note. A closed tab's
state parks its session instead of forgetting it. A fake engine, a real SQLite
history store, real .miku files."""

from __future__ import annotations

import html
import re
import time

import numpy as np
import pytest

from isagi.app.loader import EngineHolder
from isagi.app.ui import WebUI
from isagi.app.updates import KEEP
from isagi.ids import new_session_id
from isagi.session.registry import SessionRegistry
from isagi.session.service import SessionService
from tests.test_app_owners import ALICE, BOB, SECRET, make_ui, quiet, req
from tests.tiny_engine import tiny_engine
from tests.uploads import upload

# self-contained questions (a follow-up such as "secret one" is only answered from
# memory in its own context: see isagi.manifold.sameness.depends_on_context)
Q1, Q2 = f"What do volcanoes have to do with {SECRET}?", f"How do glaciers move past {SECRET}?"


def _talk(ui: WebUI, who, *texts: str, sid: str | None = None) -> str:
    for t in texts:
        sid = quiet(ui.chat.send, t, sid, 4, False, 0.7, "tier", who)[-1].state
    assert sid
    return sid


def _user_texts(chat: list[dict]) -> list[str]:
    """The user's messages of a chat, as the page shows them (the chat holds them rendered,
    ``<p>text</p>``, beside a hidden copy of the text as sent, which Edit reads)."""
    shown = (re.sub(r'<span class="isagi-raw">.*?</span>', "", m["content"], flags=re.S) for m in chat
             if m["role"] == "user")
    return [html.unescape(re.sub(r"<[^>]+>", "", c)).strip() for c in shown]


@pytest.fixture
def alice_world(tmp_path):
    ui, engine, store = make_ui(tmp_path)
    a = _talk(ui, ALICE, Q1, Q2)
    yield ui, engine, store, a
    store.close()


def test_a_reload_shows_the_same_live_session(alice_world):
    ui, engine, store, a = alice_world
    entry = ui.page.registry.entry(a, "alice")
    n_live = len(ui.page.registry)
    page = quiet(ui.chat.on_load, a, "tier", ALICE)
    assert page.state == a
    assert _user_texts(page.chat) == [Q1, Q2]
    assert ui.page.registry.entry(a, "alice") is entry  # the same live object, not a copy
    assert len(ui.page.registry) == n_live
    # and the conversation goes on in it: the repeated question is answered from its memory
    out = quiet(ui.chat.send, Q1, page.state, 4, False, 0.7, "tier", ALICE)[-1]
    assert out.state == a and "isagi-tier-retrieve" in out.chat[-1]["content"]


def test_a_reload_after_eviction_resumes_from_the_file_under_the_same_id(alice_world):
    ui, engine, store, a = alice_world
    cols = ui.page.registry.entry(a, "alice").session.memory.to_columns()
    assert ui.page.registry.evict_idle(now=time.monotonic() + 10_000) == [a]
    assert a not in ui.page.registry
    page = quiet(ui.chat.on_load, a, "tier", ALICE)
    assert page.state == a and len(_user_texts(page.chat)) == 2
    back = ui.page.registry.entry(a, "alice").session
    np.testing.assert_array_equal(back.memory.to_columns()["query_x"], cols["query_x"])


def test_a_reload_after_a_server_restart_reopens_the_autosave(alice_world, tmp_path):
    ui, engine, store, a = alice_world
    before = ui.page.registry.entry(a, "alice").session
    growth, cols = before.metric.growth, before.memory.to_columns()
    ui.page.registry.save_all()
    # a new server process: a new registry (nothing live, nothing parked), the same store and files
    holder = EngineHolder(engine)
    ui2 = WebUI(holder, SessionService(SessionRegistry(lambda: holder.engine, idle_s=600)), ui.page.settings)
    page = quiet(ui2.chat.on_load, a, "tier", ALICE)
    assert page.state == a, "the same id, not a fork"
    assert _user_texts(page.chat) == [Q1, Q2]
    s = ui2.page.registry.entry(a, "alice").session
    assert s.owner == "alice" and s.metric.growth == pytest.approx(growth)
    np.testing.assert_array_equal(s.memory.to_columns()["query_x"], cols["query_x"])
    assert ui2.page.registry.live_ids() == [a]
    # it autosaves to its own file again, and the history keeps counting its turns
    _talk(ui2, ALICE, "three", sid=a)
    assert store.get_session(a, owner="alice").turns == 3


def test_after_new_chat_a_stale_stored_id_reopens_that_session(alice_world):
    """New chat saves and forgets the old session; a page still holding its id reopens it."""
    ui, engine, store, a = alice_world
    new = quiet(ui.chat.new_chat, a, "tier", ALICE).state
    assert new != a and a not in ui.page.registry
    page = quiet(ui.chat.on_load, a, "tier", ALICE)
    assert page.state == a and len(_user_texts(page.chat)) == 2


@pytest.mark.parametrize("stored", [None, "", "not an id", 42, {"sid": "x"}, "../../etc/passwd"])
def test_no_or_junk_stored_id_opens_nothing(tmp_path, stored):
    ui, engine, store = make_ui(tmp_path, auth=None)
    page = quiet(ui.chat.on_load, stored, "tier", req(None))
    assert page.state is None and page.chat == [] and len(ui.page.registry) == 0
    assert "live session(s)" in page.status
    store.close()


def test_an_unknown_id_opens_nothing(alice_world):
    ui, engine, store, a = alice_world
    n = len(ui.page.registry)
    page = quiet(ui.chat.on_load, new_session_id(), "tier", ALICE)
    assert page.state is None and page.chat == [] and len(ui.page.registry) == n


@pytest.mark.parametrize("where", ["live", "parked", "file only"])
def test_another_owners_stored_id_opens_nothing_of_theirs(alice_world, where):
    ui, engine, store, a = alice_world
    if where == "parked":
        ui.page.registry.evict_idle(now=time.monotonic() + 10_000)
    elif where == "file only":
        ui.page.registry.release(a, owner="alice")
    page = quiet(ui.chat.on_load, a, "tier", BOB)
    assert page.state is None and SECRET not in repr(page)
    assert not ui.page.registry.holds(a, "bob") and ui.page.registry.live_ids("bob") == []
    assert (a in ui.page.registry) == (where == "live")  # nothing of alice's was loaded for bob
    # alice's own reload still gets it
    assert quiet(ui.chat.on_load, a, "tier", ALICE).state == a


def test_resume_of_ones_own_live_session_switches_to_it(alice_world):
    ui, engine, store, a = alice_world
    other_tab = _talk(ui, ALICE, "another tab")  # alice's second tab, with a session of its own
    live_before = set(ui.page.registry.live_ids("alice"))
    entry = ui.page.registry.entry(a, "alice")
    out = quiet(ui.history.resume, a, other_tab, "tier", request=ALICE)
    assert out.state == a and "Resumed" in out.sessions_note and "copy" not in out.sessions_note
    assert _user_texts(out.chat) == [Q1, Q2]
    assert ui.page.registry.entry(a, "alice") is entry  # the live one, not a copy
    assert set(ui.page.registry.live_ids("alice")) == live_before - {other_tab}  # no new session
    assert [s.id for s in store.list_sessions(owner="alice")].count(a) == 1
    # bob cannot switch to it
    out = quiet(ui.history.resume, a, None, "tier", request=BOB)
    assert "No session" in out.sessions_note and SECRET not in repr(out) and not ui.page.registry.holds(a, "bob")


def test_resume_of_ones_own_parked_session_keeps_its_id(alice_world):
    ui, engine, store, a = alice_world
    ui.page.registry.evict_idle(now=time.monotonic() + 10_000)
    out = quiet(ui.history.resume, a, None, "tier", request=ALICE)
    assert out.state == a and len(_user_texts(out.chat)) == 2 and ui.page.registry.live_ids("alice") == [a]


def test_reopen_keeps_a_session_already_live_and_refuses_another_owners(tmp_path):
    engine = tiny_engine(tmp_path)
    reg = SessionRegistry(lambda: engine)
    a = reg.create("alice")
    live = reg.entry(a, "alice").session
    copy = engine.new_session(session_id=a)
    assert reg.reopen(copy, owner="alice") == a and reg.entry(a, "alice").session is live
    with pytest.raises(KeyError):
        reg.reopen(engine.new_session(session_id=a), owner="bob")
    assert reg.entry(a, "alice").session is live and not reg.holds(a, "bob")


def test_a_rejected_upload_does_not_still_say_loaded(tmp_path):
    ui, engine, store = make_ui(tmp_path, auth=None)
    me = req(None)
    sid = _talk(ui, me, "alpha")
    path = quiet(ui.files.save_miku, sid, me).download
    good = quiet(ui.files.load_miku, upload(ui, path), sid, "tier", me)
    assert good.files_note.startswith("Loaded")
    bad = tmp_path / "broken.miku"
    bad.write_bytes(b"not a miku file at all")
    out = quiet(ui.files.load_miku, upload(ui, bad), good.state, "tier", me)
    note = out.files_note
    assert "Could not load broken.miku" in note and "Loaded" not in note
    assert out.state == good.state  # the open session is unchanged
    store.close()


def test_a_closed_tabs_state_parks_its_session(tmp_path):
    """Gradio calls the page state's delete callback an hour after the tab closed; by
    then a reload may use the session: it is parked (resumable under its id), not forgotten."""
    import gradio as gr

    from isagi.app.server import create_app

    engine = tiny_engine(tmp_path, max_new_tokens=4)
    app = create_app(engine, engine.settings)
    registry, ui = app.state.isagi_registry, app.state.isagi_ui
    sid = _talk(ui, req(None), "keep me")
    blocks = next(r.app.get_blocks() for r in app.routes if hasattr(getattr(r, "app", None), "get_blocks"))
    from gradio.components.state import default_delete_callback

    # the page's session id: the one State with a delete callback (the others hold no session)
    [state] = [b for b in blocks.blocks.values()
               if type(b) is gr.State and b.delete_callback is not default_delete_callback]
    state.delete_callback(sid)
    assert sid not in registry and registry.holds(sid, "local")
    assert registry.entry(sid).session.messages[0]["text"] == "keep me"
    assert [b for b in blocks.blocks.values() if isinstance(b, gr.BrowserState)]


def test_two_tabs_of_one_browser_share_the_session_and_new_chat_in_one_loses_nothing(alice_world):
    """Browser storage is shared by a browser's tabs: a second tab opens the same session.
    New chat (or an upload, or Resume) in one tab parks the old session, so the other
    tab, still on it, goes on in it (same id, all its messages) instead of a new one."""
    ui, engine, store, a = alice_world
    tab2 = quiet(ui.chat.on_load, a, "tier", ALICE).state
    assert tab2 == a
    b = quiet(ui.chat.new_chat, a, "tier", ALICE).state
    assert b != a and ui.page.registry.holds(a, "alice")
    out = quiet(ui.chat.send, "tab one goes on", a, 4, False, 0.7, "tier", ALICE)[-1]  # tab 1, still on a
    assert out.state == a
    assert _user_texts(out.chat) == [Q1, Q2, "tab one goes on"]
    assert store.get_session(a, owner="alice").turns == 3


def test_a_sync_sent_with_the_session_a_page_left_paints_nothing(alice_world):
    """The page's sync (every two seconds) carries the session the page shows and what it drew
    of it (``seen``). One sent just before the page switches session (a load, New chat, opening
    a chat from the list, Resume) answers after the switch: it must find that session already
    drawn and paint nothing, or the page would show the old chat under the new session. So
    every switch sets ``seen`` to what it drew, and a sync with it changes nothing."""
    ui, engine, store, a = alice_world
    other = _talk(ui, ALICE, "a second chat")
    switches = {
        "load": lambda: quiet(ui.chat.on_load, a, "tier", ALICE),
        "new chat": lambda: quiet(ui.chat.new_chat, a, "tier", ALICE),
        "open from the list": lambda: quiet(ui.chats.open_chat, other, a, "", "tier", ALICE),
        "resume": lambda: quiet(ui.history.resume, a, other, "tier", request=ALICE),
    }
    for name, switch in switches.items():
        out = switch()
        assert out.seen not in (None, KEEP), name
        assert ui.chat.sync(out.state, out.seen, "tier", ALICE).changed() == {}, name
        # and a sync with what the page drew before (nothing yet) does redraw: the check can fail
        assert "chat" in ui.chat.sync(out.state, None, "tier", ALICE).changed(), name
