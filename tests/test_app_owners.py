"""Owners in the web app's handlers, without a browser: under ISAGI_AUTH each
handler works as the request's user, and another user's session id (as the
page's state or as a chosen id) gets exactly the answer of an unknown id;
nothing of alice's is read, changed, forked or deleted by bob. Also: a
message is checked before a session is made, the caps on live sessions, the
cleanup of downloads and uploads, and error messages that name the user's
own file. A fake engine, a real SQLite history store, real .miku files."""

from __future__ import annotations

import os
import re
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

from isagi.app.loader import EngineHolder
from isagi.app.ui import WebUI
from isagi.app.uploads import NOT_YOUR_UPLOAD
from isagi.config import load_settings
from isagi.ids import new_session_id
from isagi.pipeline.engine import Engine
from isagi.session.registry import SessionLimit, SessionRegistry
from isagi.session.service import SessionService
from isagi.storage.history import HistoryStore
from tests.tiny_engine import engine_for
from tests.uploads import upload

SECRET = "alice-secret-zebra"


def req(user: str | None, host: str = "10.0.0.1") -> SimpleNamespace:
    """What the handlers read of a gr.Request: the logged-in user and the client address."""
    return SimpleNamespace(username=user, client=SimpleNamespace(host=host))


ALICE, BOB = req("alice", "10.0.0.1"), req("bob", "10.0.0.2")


def quiet(fn, *args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gr.Warning outside a request falls back to warnings
        out = fn(*args, **kw)
        return list(out) if hasattr(out, "__next__") else out


def make_ui(tmp_path: Path, **settings_kw) -> tuple[WebUI, Engine, HistoryStore]:
    kw = {"auth": "alice:a,bob:b", **settings_kw}
    settings = load_settings(environ={}, home=tmp_path, max_new_tokens=8, **kw)
    store = HistoryStore(f"sqlite:///{tmp_path / 'history.db'}")
    engine = engine_for(settings, store)
    holder = EngineHolder(engine)
    registry = SessionRegistry(lambda: holder.engine, idle_s=600,
                               max_per_client=settings.max_sessions_per_client,
                               max_total=settings.max_sessions)
    return WebUI(holder, SessionService(registry), settings), engine, store


@pytest.fixture
def world(tmp_path):
    ui, engine, store = make_ui(tmp_path)
    a = ui.page.registry.create("alice", "10.0.0.1")
    for q in (f"{SECRET} one", f"{SECRET} two"):
        quiet(ui.chat.send, q, a, 4, False, 0.7, "tier", ALICE)
    yield ui, engine, store, a
    store.close()


def alice_unchanged(ui: WebUI, store: HistoryStore, a: str) -> None:
    entry = ui.page.registry.entry(a, "alice")
    assert entry.owner == "alice" and len(entry.session.messages) == 4 and len(entry.session.memory) == 2
    assert not entry.stop.is_set()
    assert store.get_session(a, owner="alice").turns == 2
    assert (Path(ui.page.settings.sessions_dir) / f"{a}.miku").is_file()


def text_of(out) -> str:
    """Everything a handler's outputs would put on bob's page, as one string."""
    return repr(out)


def same_answer(x: str, y: str, xid: str, yid: str) -> bool:
    return x.replace(xid, "ID") == y.replace(yid, "ID")


def test_every_handler_answers_bob_as_for_an_unknown_id(world):
    ui, engine, store, a = world
    unknown = new_session_id()
    assert store.get_session(a, owner="alice").turns == 2
    b = ui.page.registry.create("bob", "10.0.0.2")
    assert b != a
    # the page state (or the browser's storage) holding alice's id: every event treats it as unknown
    page = quiet(ui.chat.on_load, a, "tier", BOB)
    assert page.state is None and SECRET not in text_of(page)  # nothing reopened, nothing made
    assert "· 1 live session(s)" in page.status  # bob's one, not the server's two
    out = quiet(ui.chat.recolour, a, "tier", BOB)
    assert SECRET not in text_of(out)
    assert SECRET not in text_of(quiet(ui.page.view, a, "tier", "bob"))
    regen = quiet(ui.chat.regenerate, a, 4, False, 0.7, "tier", BOB)
    assert "Nothing to regenerate" in regen[-1].alert and SECRET not in text_of(regen)
    stop = quiet(ui.chat.stop, a, "tier", BOB)
    assert SECRET not in text_of(stop)
    saved = quiet(ui.files.save_miku, a, BOB)
    assert "no session to save" in saved.files_note and SECRET not in text_of(saved)
    new = quiet(ui.chat.new_chat, a, "tier", BOB)
    assert new.state != a and a in ui.page.registry  # alice's session was not released
    sent = quiet(ui.chat.send, "bob asks", a, 4, False, 0.7, "tier", BOB)
    bob_sid = sent[-1].state
    assert bob_sid != a and SECRET not in text_of(sent)
    assert ui.page.registry.entry(bob_sid, "bob").session.messages[0]["text"] == "bob asks"
    # the chosen id of the Sessions tab, and the open session, for export, resume, delete
    for fn, args, note in (
        (ui.history.resume, ("tier",), "sessions_note"),
        (ui.history.export, ("markdown",), "files_note"),
        (ui.history.export, ("json",), "files_note"),
        (ui.history.delete, (), "sessions_note"),
    ):
        theirs = quiet(fn, a, b, *args, request=BOB)
        none = quiet(fn, unknown, b, *args, request=BOB)
        assert SECRET not in text_of(theirs), fn.__name__
        said, said_none = getattr(theirs, note), getattr(none, note)
        assert same_answer(said, said_none, a, unknown), (fn.__name__, said, said_none)
        assert re.search(r"No session|Could not export", said), said
    for fmt in ("markdown", "json"):  # nothing chosen: the open session (alice's id as the state)
        theirs = quiet(ui.history.export, "", a, fmt, request=BOB)
        assert SECRET not in text_of(theirs) and "Could not export" in theirs.files_note
    # the sessions table and search
    listed = quiet(ui.history.list_sessions, "", BOB)
    rows = listed.table
    assert a not in text_of(rows) and SECRET not in text_of(rows)
    listed = quiet(ui.history.list_sessions, SECRET, BOB)
    rows, note = listed.table, listed.sessions_note
    assert rows == [] and note.startswith("0 session")
    alice_unchanged(ui, store, a)
    # and alice still can do all of it
    rows = quiet(ui.history.list_sessions, SECRET, ALICE).table
    assert [r[0] for r in rows] == [a]
    path = quiet(ui.history.export, a, None, "markdown", request=ALICE).download
    assert SECRET in Path(path).read_text()


def test_no_login_means_nothing_at_all(world):
    ui, engine, store, a = world
    nobody = req(None)
    assert quiet(ui.chat.on_load, a, "tier", nobody).state is None
    assert quiet(ui.history.list_sessions, "", nobody).table == []
    assert "Log in" in quiet(ui.history.export, a, a, "json", request=nobody).files_note
    assert "No session" in quiet(ui.history.delete, a, a, request=nobody).sessions_note
    sent = quiet(ui.chat.send, "hi", a, 4, False, 0.7, "tier", nobody)
    assert "Log in" in sent[-1].alert
    alice_unchanged(ui, store, a)


def test_delete_removes_history_and_the_autosave(world):
    ui, engine, store, a = world
    miku = Path(ui.page.settings.sessions_dir) / f"{a}.miku"
    assert miku.is_file()
    out = quiet(ui.history.delete, a, None, request=ALICE)
    assert "open in a browser" in out.sessions_note and miku.is_file()  # live: refused, kept
    quiet(ui.chat.new_chat, a, "tier", ALICE)  # alice moves on: the session is saved and dropped
    assert a not in ui.page.registry
    out = quiet(ui.history.delete, a, None, request=ALICE)
    assert out.sessions_note.startswith(f"Deleted session {a}") and f"{a}.miku" in out.sessions_note
    assert not miku.exists()
    assert store.list_sessions(owner="alice") == []
    assert "No session" in quiet(ui.history.resume, a, None, "tier", request=ALICE).sessions_note


def test_resume_takes_alices_session_back_only_for_alice(world):
    ui, engine, store, a = world
    quiet(ui.chat.new_chat, a, "tier", ALICE)
    out = quiet(ui.history.resume, a, None, "tier", request=BOB)
    assert "No session" in out.sessions_note and not ui.page.registry.holds(a, "bob")
    out = quiet(ui.history.resume, a, None, "tier", request=ALICE)
    assert out.state == a and "Resumed" in out.sessions_note
    assert len(ui.page.registry.entry(a, "alice").session.memory) == 2


def test_an_invalid_message_makes_no_session(tmp_path):
    ui, engine, store = make_ui(tmp_path, auth=None)
    calls: list[int] = []
    real = engine.stream_turn
    engine.stream_turn = lambda *a, **k: calls.append(1) or real(*a, **k)
    for bad in ("", "   ", "\x00\x00", "x" * 9000):
        for _ in range(25):
            out = quiet(ui.chat.send, bad, None, 4)
            assert out[-1].state is None and out[-1].alert.startswith("⚠️")
    assert len(ui.page.registry) == 0 and calls == []
    store.close()


def test_live_session_caps_per_client_user_and_overall(tmp_path):
    ui, engine, store = make_ui(tmp_path, max_sessions_per_client=3, max_sessions=5)
    one = req("alice", "10.0.0.1")
    sids = [ui.page.registry.create("alice", "10.0.0.1") for _ in range(3)]
    # a fourth session from the same client: the oldest empty session is reclaimed
    fourth = ui.page.registry.create("alice", "10.0.0.1")
    assert fourth and sids[0] not in ui.page.registry and len(ui.page.registry.live_ids("alice")) == 3
    for sid in ui.page.registry.live_ids("alice"):  # all three in use now
        quiet(ui.chat.send, "hello", sid, 2, False, 0.7, "tier", one)
    out = quiet(ui.chat.send, "one more", None, 2, False, 0.7, "tier", one)
    assert "Too many open chats" in out[-1].alert and "ISAGI_MAX_SESSIONS_PER_CLIENT" in out[-1].alert
    # the same user from another address: the per-user cap holds too
    out = quiet(ui.chat.send, "one more", None, 2, False, 0.7, "tier", req("alice", "10.9.9.9"))
    assert "user alice" in out[-1].alert
    # bob is not affected by alice's cap, but the overall cap (5) binds
    b1 = quiet(ui.chat.send, "hi", None, 2, False, 0.7, "tier", BOB)[-1].state
    b2 = quiet(ui.chat.send, "hi", None, 2, False, 0.7, "tier", BOB)[-1].state
    assert b1 and b2 and len(ui.page.registry) == 5
    out = quiet(ui.chat.send, "hi", None, 2, False, 0.7, "tier", BOB)
    assert "ISAGI_MAX_SESSIONS" in out[-1].alert and len(ui.page.registry) == 5
    page = quiet(ui.chat.on_load, None, "tier", req("bob", "10.0.0.7"))  # a page load takes no slot
    assert page.state is None and "live session(s)" in page.status and len(ui.page.registry) == 5
    store.close()


def test_a_session_made_for_a_turn_about_to_run_is_not_reclaimed_as_an_empty_chat(tmp_path):
    """An API conversation's new session is empty and idle between its making and its turn's
    lock: another request at the cap took it as an empty chat to reclaim, and the turn found
    its session gone (a 404 under `isagi bench api --sessions 8`)."""
    ui, engine, store = make_ui(tmp_path, max_sessions_per_client=2, max_sessions=5)
    claimed = ui.page.registry.create("alice", "10.0.0.1", claimed=True)
    ui.page.registry.create("alice", "10.0.0.1")
    ui.page.registry.create("alice", "10.0.0.1")  # at the cap: the unclaimed empty one goes
    assert claimed in ui.page.registry
    in_use = ui.page.registry.live_ids("alice")[-1]
    with ui.page.registry.using(in_use, owner="alice"), pytest.raises(SessionLimit, match="Too many open chats"):
        ui.page.registry.create("alice", "10.0.0.1")  # only a claimed one and one in use left
    with ui.page.registry.using(claimed, owner="alice"):  # its turn took it: an ordinary chat again
        pass
    for _ in range(2):  # the two empty, idle ones are reclaimed, the older first
        ui.page.registry.create("alice", "10.0.0.1")
    assert claimed not in ui.page.registry  # empty and idle after its turn: reclaimable as any other
    store.close()


def test_download_directories_are_removed(world):
    ui, engine, store, a = world
    path = quiet(ui.history.export, a, None, "json", request=ALICE).download
    d = Path(path).parent
    assert d.name.startswith("dl-") and d.is_dir()
    assert ui.page.sweep_downloads(3600) == 0 and d.is_dir()  # a fresh one stays (Gradio copies it)
    old = time.time() - 120
    os.utime(d, (old, old))
    path2 = quiet(ui.files.save_miku, a, ALICE).download  # the next download sweeps the old one
    assert not d.exists() and Path(path2).is_file()
    root = Path(path2).parent.parent
    ui.page.cleanup()
    assert not root.exists()


def test_uploads_are_removed_once_read_and_errors_name_the_users_file(world, tmp_path):
    ui, engine, store, a = world
    good_path = quiet(ui.files.save_miku, a, ALICE).download
    good = Path(good_path).read_bytes()
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF
    src = tmp_path / "my notes.miku"
    src.write_bytes(bytes(bad))
    up = upload(ui, src, "alice")
    out = quiet(ui.files.load_miku, up, a, "tier", ALICE)
    assert "Could not load my notes.miku" in out.files_note, out.files_note
    for server_path in (str(ui.page.uploads.root), Path(up).parent.name, str(tmp_path), "/tmp"):
        assert server_path not in out.files_note
    assert not Path(up).exists() and not Path(up).parent.exists()  # the upload is gone once read
    assert ui.page.uploads.waiting() == []
    src.write_bytes(good)
    up = upload(ui, src, "bob")
    out = quiet(ui.files.load_miku, up, None, "tier", BOB)
    assert "Loaded `my notes.miku`" in out.files_note and not Path(up).exists()
    loaded = ui.page.registry.entry(out.state, "bob")
    assert loaded.owner == "bob" and out.state != a  # bob's own fork, with a fresh id
    # a file outside the upload cache (here a test's own) is neither opened nor removed
    outside = tmp_path / "keep.miku"
    outside.write_bytes(good)
    out = quiet(ui.files.load_miku, str(outside), None, "tier", BOB)
    assert NOT_YOUR_UPLOAD in out.files_note and outside.exists()


def test_through_gradio_routes_bob_calling_every_event_by_fn_index_gets_nothing(tmp_path):
    """The real Gradio app and routes (FastAPI's test client): alice sends a message;
    bob, logged in, calls every event that takes a session id by ``fn_index``,
    with alice's id in each text and state slot, from a fresh Gradio session and
    from alice's own (whose state holds her id; every call naming it is refused):
    nothing of hers comes back and her session, history and file are intact."""
    from fastapi.testclient import TestClient

    from isagi.app.server import create_app
    from tests.gradio_raw import RawGradio, component_id

    settings = load_settings(environ={}, home=tmp_path, auth="alice:a,bob:b", max_new_tokens=8)
    store = HistoryStore(f"sqlite:///{tmp_path / 'history.db'}")
    app = create_app(engine_for(settings, store), settings)
    registry = app.state.isagi_registry
    with TestClient(app) as alice_http:
        alice = RawGradio(alice_http, "alice", "a")
        send = next(d for d in alice.deps() if d.get("api_name") == "send")
        data = [alice.value_for(c, "") for c in send["inputs"]]
        data[0] = f"{SECRET} question"
        assert alice.call(send, data, "alicehash")["success"]
        [a] = registry.live_ids("alice")
        assert store.get_session(a, owner="alice").turns == 1
        # the same HTTP client (one event loop), now logged in as bob: his login cookie replaces hers
        bob = RawGradio(alice_http, "bob", "b")
        states = {cid for cid, c in bob.components.items() if c.get("type") in ("state", "browserstate")}
        texts = {component_id(bob, e) for e in ("isagi-chosen", "isagi-search", "isagi-input")}
        takes_an_id = [d for d in bob.deps() if set(d["inputs"]) & (states | texts)]
        assert len(takes_an_id) >= 18  # the page load reads the browser storage; its sync takes the state
        assert sum(d.get("api_visibility") == "private" for d in takes_an_id) >= 7  # load, timer, ..., delete
        # bob's own page session runs every event (a file slot naming alice's autosave gets the
        # neutral answer); alice's session hash is hers alone: refused
        hers_on_disk = str(settings.sessions_dir / f"{a}.miku")
        for session_hash, hers in (("bobfresh", False), ("alicehash", True)):
            for dep in takes_an_id:
                res = bob.call(dep, [bob.value_for(c, a, hers_on_disk) for c in dep["inputs"]], session_hash)
                assert SECRET not in repr(res), (dep.get("api_name"), repr(res)[:400])
                refused = 403 in (res.get("refused"), res.get("status"))
                assert refused == hers, (session_hash, dep.get("api_name"), repr(res)[:300])
                if dep.get("api_name") == "load_miku" and not hers:
                    assert NOT_YOUR_UPLOAD in repr(res), repr(res)[:300]
        entry = registry.entry(a, "alice")
        assert entry.owner == "alice" and entry.session.messages[0]["text"] == f"{SECRET} question"
        assert len(entry.session.messages) == 2
        assert store.get_session(a, owner="alice").turns == 1
        assert (settings.sessions_dir / f"{a}.miku").is_file()
        # bob's own sessions exist (his sends ran in sessions of his), none holds alice's text
        for sid in registry.live_ids("bob"):
            assert all(SECRET not in m["text"] for m in registry.entry(sid, "bob").session.messages)
    store.close()


def test_an_evicted_session_resumes_only_for_its_owner(tmp_path):
    ui, engine, store = make_ui(tmp_path)
    reg = ui.page.registry
    a = ui.page.registry.create("alice", "10.0.0.1")
    quiet(ui.chat.send, f"{SECRET} evicted", a, 4, False, 0.7, "tier", ALICE)
    assert reg.evict_idle(now=time.monotonic() + 10_000) == [a]
    assert a not in reg and reg.holds(a, "alice") and not reg.holds(a, "bob")
    with pytest.raises(KeyError):
        reg.entry(a, "bob")  # parked for alice: bob's lookup is "unknown", nothing is loaded
    assert a not in reg
    assert reg.entry(a, "alice").session.messages[0]["text"] == f"{SECRET} evicted"
    assert reg.release(a, owner="bob") is False and a in reg
    store.close()


def test_the_chat_list_edit_versions_and_continue_answer_bob_as_for_an_unknown_id(world):
    """Issue 39's new actions, called by bob with alice's session id (as a hostile client would
    send it): nothing of alice's is shown, renamed, deleted, cut or switched."""
    ui, engine, store, a = world
    title = store.get_session(a, owner="alice").title
    outs = [
        quiet(ui.chats.open_chat, a, None, "", "tier", BOB),
        quiet(ui.chats.rename, "bob was here", a, "", BOB),
        quiet(ui.chats.ask_delete, a, BOB),
        quiet(ui.chats.delete, a, "", "tier", BOB),
        quiet(ui.chats.list_chats, a, SECRET, BOB),
        quiet(ui.chat.edit_send, "bob's question", "0", a, 4, False, 0.7, "tier", BOB),
        quiet(ui.chat.version, a, "tier", -1, BOB),
        quiet(ui.chat.continue_reply, a, 4, False, 0.7, "tier", BOB),
    ]
    assert SECRET not in text_of(outs), "nothing of alice's reaches bob's page"
    assert store.get_session(a, owner="alice").title == title
    alice_unchanged(ui, store, a)
