"""The web app's handlers without a browser: streaming, badges, per-browser isolation,
Stop (the model work really ends and the turn is recorded), Regenerate, input errors,
.miku save / load / corrupted upload, and the plots.

The real engine (``Engine.stream_turn``) on a tiny random model with a synthetic
profile (tests/tiny_engine.py), a real SessionRegistry, history store and .miku
files: the tiers come from the real rule (isagi.manifold.decide)."""

from __future__ import annotations

import threading
import warnings
from pathlib import Path

import numpy as np
import pytest

import isagi.app.handlers.chat
import isagi.app.handlers.page
import isagi.app.views
from isagi.app import plots
from isagi.app.loader import EngineHolder
from isagi.app.render_safe import render_text
from isagi.app.ui import WebUI
from isagi.app.updates import KEEP
from isagi.app.views import chat_messages, info_html
from isagi.pipeline.engine import Engine
from isagi.session.files import load_session
from isagi.session.registry import SessionRegistry
from isagi.session.service import SessionService
from tests.tiny_engine import tiny_engine
from tests.uploads import upload

# send()/regenerate() yield (state, chat, textbox, alert, turn, summary, map, growth, teh, status)


def make_ui(tmp_path: Path, **engine_kw) -> tuple[WebUI, Engine]:
    engine = tiny_engine(tmp_path, max_new_tokens=8, **engine_kw)
    holder = EngineHolder(engine)
    registry = SessionRegistry(lambda: holder.engine, idle_s=600)
    return WebUI(holder, SessionService(registry), engine.settings), engine


def counts(ui: WebUI, sid: str) -> tuple[int, int, int]:
    """(turns in the live session, exchanges in the history store, turns in the autosaved file)."""
    session = ui.page.registry.entry(sid).session
    stored = ui.page.engine.store.get_session(sid, owner="local").turns
    in_file = len(load_session(ui.page.engine.frame, session.miku_path).turns)
    return len(session.turns), stored, in_file


def run(gen):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gr.Warning outside a request falls back to warnings
        return list(gen)


def badges(chat: list[dict]) -> list[str]:
    import re

    return [m for c in chat for m in re.findall(r"isagi-tier-(\w+)", c["content"])]


@pytest.fixture
def ui(tmp_path):
    return make_ui(tmp_path)[0]


def test_reply_streams_and_gets_a_badge(ui, monkeypatch):
    monkeypatch.setattr(isagi.app.handlers.chat, "STREAM_INTERVAL_S", 0.0)  # every token is a display update
    sid = ui.page.registry.create()
    outs = run(ui.chat.send("tell me something", sid, 8))
    chats = [o.chat for o in outs if isinstance(o.chat, list)]
    replies = [c[-2]["content"] for c in chats if len(c) >= 3 and c[-2]["role"] == "assistant"]
    assert len(replies) >= 2, "the reply must arrive in several updates"
    final = outs[-1]
    assert badges(final.chat) == ["explore"]
    assert outs[0].textbox == "" and KEEP is final.textbox, "Send empties the box once, as the message shows"
    assert "Trajectories: **1**" in final.summary
    assert "EXPLORE" in final.turn
    # the stored text stays raw; every streamed update is that text's growing prefix through the
    # same rendering as the finished reply (render_text); the info line is display only
    s = ui.page.registry.entry(sid).session
    text = s.turns[-1].reply_text
    lengths = [next(k for k in range(len(text) + 1) if render_text(text[:k]) == r) for r in replies]
    assert lengths == sorted(lengths) and replies[-1] == render_text(text) == final.chat[-2]["content"]
    assert s.turns[-1].new_tokens == 8
    assert s.turns[-1].tier == "EXPLORE" and s.turns[-1].verdict == "ok"
    assert counts(ui, sid) == (1, 1, 1)


def test_same_question_retrieves_but_never_across_browsers(ui):
    a = ui.page.registry.create()
    b = ui.page.registry.create()
    assert a != b
    first = run(ui.chat.send("what is the capital of France?", a, 8))[-1]
    again = run(ui.chat.send("what is the capital of France?", a, 8))[-1]
    assert badges(again.chat)[-1] == "retrieve"
    s = ui.page.registry.entry(a).session
    assert s.turns[1].reply_text == s.turns[0].reply_text and s.turns[1].new_tokens == 0
    assert "RETRIEVE" in again.turn and "EXPLORE" in first.turn
    other = run(ui.chat.send("what is the capital of France?", b, 8))[-1]
    assert badges(other.chat) == ["explore"], "browser b must not see a's memory"
    assert len(ui.page.registry.entry(b).session.memory) == 1


@pytest.mark.parametrize("message, needle", [("   ", "empty"), ("x" * 9000, "8,000")])
def test_bad_input_is_explained_and_runs_nothing(tmp_path, message, needle):
    ui, engine = make_ui(tmp_path)
    sid = ui.page.registry.create()
    outs = run(ui.chat.send(message, sid, 8))
    assert len(outs) == 1 and needle in outs[0].alert
    assert ui.page.registry.entry(sid).session.turns == []
    assert engine.store.list_sessions(owner="local") == [] and not ui.page.registry.entry(sid).session.miku_path.exists()


def test_closing_the_stream_stops_the_model_and_records_the_turn(tmp_path):
    """Stop's cancel closes the handler: the engine must end, release its lock and record the turn."""
    ui, engine = make_ui(tmp_path)
    sid = ui.page.registry.create()
    gen = ui.chat.send("long answer please", sid, 500)
    for _ in range(3):
        next(gen)
    gen.close()
    entry = ui.page.registry.entry(sid)
    assert not entry.lock.locked() and not engine.model_turns.locked()
    last = entry.session.turns[-1]
    assert last.verdict == "cancelled" and last.new_tokens < 500
    assert len(entry.session.memory) == 0, "a stopped reply is not learnt"
    assert counts(ui, sid) == (1, 1, 1)


def test_stop_button_ends_generation_and_shows_it(tmp_path):
    ui, engine = make_ui(tmp_path)
    sid = ui.page.registry.create()
    outs: list = []
    streaming = threading.Event()  # a few display updates of the reply have arrived: Stop after them

    def send() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for o in ui.chat.send("go on and on", sid, 100000):
                outs.append(o)
                if len(outs) >= 3:
                    streaming.set()

    t = threading.Thread(target=send)
    t.start()
    entry = ui.page.registry.entry(sid)
    assert streaming.wait(60)
    stopped = ui.chat.stop(sid)
    t.join(30)
    assert not t.is_alive()
    assert entry.session.turns[-1].verdict == "cancelled"
    assert entry.session.turns[-1].new_tokens < 100000
    assert "cancelled" in badges(stopped.chat)
    assert "stopped" in outs[-1].alert.lower()
    # the engine is free again: the next turn runs, and the stopped reply is not in its prompt
    stopped_text = entry.session.turns[-1].reply_text
    prompts = []
    real = engine.prompts.messages
    engine.prompts.messages = lambda text, related, history: prompts.append(history) or real(text, related, history)
    assert badges(run(ui.chat.send("What is 3 times 4?", sid, 4))[-1].chat)[-1] == "explore"
    assert prompts and all(h == [] for h in prompts), "the cancelled turn never enters a prompt"
    assert stopped_text and entry.session.turns[-1].verdict == "ok"


def test_regenerate_replaces_the_last_turn_everywhere(ui):
    sid = ui.page.registry.create()
    run(ui.chat.send("What is the boiling point of water?", sid, 4))
    run(ui.chat.send("Name three primary colours.", sid, 6))
    s = ui.page.registry.entry(sid).session
    growth_before = s.metric.growth
    replaced = s.turns[-1]
    out = run(ui.chat.regenerate(sid, 6))[-1]
    s = ui.page.registry.entry(sid).session
    assert [t.user_text for t in s.turns] == ["What is the boiling point of water?", "Name three primary colours."]
    assert s.turns[-1] is not replaced and s.turns[-1].verdict == "ok"
    assert len(s.memory) == 2, "the undone turn's trajectory must not stay twice"
    assert s.metric.growth == pytest.approx(growth_before)
    assert badges(out.chat)[-1] != "retrieve"
    # history turns == chat turns == file turns, and the store holds the new reply, not the old one
    assert counts(ui, sid) == (2, 2, 2)
    rows = ui.page.engine.store.get_turns(sid, owner="local")
    assert [r.seq for r in rows] == [0, 1, 2, 3]
    assert rows[-1].text == s.turns[-1].reply_text and rows[-2].text == "Name three primary colours."
    table = ui.history.list_sessions("").table
    assert [(r[0], r[2]) for r in table] == [(sid, 2)], "the Sessions tab counts the chat's turns"
    # and again: still two
    run(ui.chat.regenerate(sid, 6))
    assert counts(ui, sid) == (2, 2, 2)


def test_regenerate_without_a_turn_warns(ui):
    sid = ui.page.registry.create()
    out = run(ui.chat.regenerate(sid, 4))
    assert len(out) == 1 and "Nothing to regenerate" in out[0].alert


def test_save_load_round_trip_and_corrupted_upload(ui, tmp_path):
    sid = ui.page.registry.create()
    for q in ("How do plants make food?", "What is the boiling point of water?", "Name three primary colours."):
        run(ui.chat.send(q, sid, 4))
    saved = ui.files.save_miku(sid)
    path, note = saved.download, saved.files_note
    assert Path(path).exists() and "3 trajectories and 3 turns" in note
    one = ui.page.registry.create()
    run(ui.chat.send("How do plants make food?", one, 4))
    assert "Saved 1 trajectory and 1 turn to" in ui.files.save_miku(one).files_note
    # a corrupted upload: an error, the open session untouched
    bad = tmp_path / "bad.miku"
    data = bytearray(Path(path).read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = ui.files.load_miku(upload(ui, bad), sid)
    assert out.state == sid and "Could not load bad.miku" in out.files_note
    assert len(ui.page.registry.entry(sid).session.memory) == 3
    # a fresh browser loads the good file: same trajectories, its own id
    other = ui.page.registry.create()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = ui.files.load_miku(path, other)
    assert out.state == other and "not one you uploaded" in out.files_note, "a download is not an upload"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = ui.files.load_miku(upload(ui, path), other)
    new = out.state
    assert new not in (sid, other)
    loaded = ui.page.registry.entry(new).session
    orig = ui.page.registry.entry(sid).session
    assert loaded is not orig
    np.testing.assert_array_equal(loaded.memory.to_columns()["query_x"], orig.memory.to_columns()["query_x"])
    assert "Trajectories: **3**" in out.summary
    assert f"prompt {orig.turns[-1].prompt_tokens}, reply {orig.turns[-1].new_tokens}" in out.turn, "the Turn panel after a load"
    assert loaded.turns == orig.turns, "every field of every turn survives the upload"
    assert badges(run(ui.chat.send("What is the boiling point of water?", new, 4))[-1].chat)[-1] == "retrieve"


def test_new_chat_starts_empty_and_saves_the_old(ui):
    sid = ui.page.registry.create()
    run(ui.chat.send("remember me", sid, 4))
    path = ui.page.registry.entry(sid).session.miku_path
    new = ui.chat.new_chat(sid).state
    assert new != sid and path.exists()
    assert ui.page.registry.entry(new).session.turns == []


def test_loading_engine_is_reported_not_crashed(tmp_path):
    settings = tiny_engine(tmp_path).settings
    gate, converting = threading.Event(), threading.Event()
    holder = EngineHolder(lambda progress: (progress("converting", 1, 4), converting.set(), gate.wait(30),
                                            tiny_engine(tmp_path))[3])
    reg = SessionRegistry(lambda: holder.engine)
    ui = WebUI(holder, SessionService(reg), settings)
    holder.start()
    assert converting.wait(30)  # the loader's thread has said what it does
    out = run(ui.chat.send("hello", None, 4))
    assert "Loading the model" in out[0].alert
    assert "converting" in ui.page.status_line()
    # A page opened while the model loads starts the banner's timer; its ticks keep it going.
    assert ui.chat.on_load(None).timer.active is True
    assert ui.chat.on_tick(None).timer.active is True
    gate.set()
    assert holder.wait(30)
    assert ui.chat.on_tick(None).timer.active is False  # the tick that finds the model ready stops it
    loaded = ui.chat.on_load(None)
    assert loaded.state is None  # a page load makes no session: the first message does
    # A page opened once the model is ready never ticks: a late tick would reopen the session
    # the page showed when it fired, over a New chat or an upload made since.
    assert loaded.timer.active is False
    assert "0 live session(s)" in ui.page.status_line()
    out = run(ui.chat.send("hello", None, 4))[-1]
    assert out.state in ui.page.registry and badges(out.chat) == ["explore"]
    assert "1 live session(s)" in out.status  # the banner counts the session the message made


def test_info_line_and_chat_messages():
    m = {"role": "assistant", "text": "**bold** reply", "tier": "AUGMENT", "distance": 0.123456,
         "nearest_query": "<script>x</script>", "zone": "science", "teh_prompt": 1.5, "teh_reply": 2.25,
         "verdict": "ok", "latency_s": 0.5, "new_tokens": 12, "prompt_tokens": 30}
    html_ = info_html(m)
    for part in ("AUGMENT", "0.1235", "science", "1.5%", "2.2%", "0.50 s", "30 + 12 tokens"):
        assert part in html_
    assert "<script>" not in html_
    chat = chat_messages([{"role": "user", "text": "hi"}, m])
    assert chat[1]["content"] == "<p><strong>bold</strong> reply</p>\n"  # rendered on the server
    refused = info_html({"verdict": "refused", "tier": None, "teh_prompt": 80.0})
    assert "REFUSED" in refused


def test_pca_map_counts_and_highlight():
    rng = np.random.default_rng(0)
    X = rng.standard_normal((5, 8))
    Y, explained = plots.pca_2d(X)
    assert Y.shape == (5, 2) and 0 < explained[1] <= explained[0] <= 1
    # the projection preserves the centred data's top-2 variance
    C = X - X.mean(0)
    s = np.linalg.svd(C, compute_uv=False)
    np.testing.assert_allclose((Y**2).sum(0), s[:2] ** 2, rtol=1e-9)
    cols = {"query_x": X, "query_text": list("abcde"), "tier": ["EXPAND", "EXPLORE", "EXPAND", "AUGMENT", "EXPLORE"],
            "cluster": [0, 1, 0, 2, 1]}
    fig = plots.map_figure(cols, highlight=4)
    assert sum(len(t.x) for t in fig.data if t.name != "current query") == 5
    assert [t for t in fig.data if t.name == "current query"][0].text == ("e",)
    by_cluster = plots.map_figure(cols, colour_by="cluster")
    assert {t.name for t in by_cluster.data} == {"cluster 0", "cluster 1", "cluster 2"}
    assert len(plots.map_figure({}).data) == 0
    assert plots.pca_2d(X[:1])[0].tolist() == [[0.0, 0.0]]


def test_a_turn_that_crashes_is_reported_and_the_session_kept(tmp_path):
    """An unexpected error mid-stream (a bug, not bad input) ends with a warning and the
    session as it was before the turn — never a reply stuck at "generating…"."""
    ui, engine = make_ui(tmp_path)
    sid = ui.page.registry.create()
    run(ui.chat.send("What is the boiling point of water?", sid, 8))
    session = ui.page.registry.entry(sid).session
    before = (len(session.turns), len(session.memory), session.metric.growth)
    real = engine.stream_turn

    def crashing(session, message, **kw):
        events = real(session, message, **kw)
        try:
            yield next(events)  # the decision, then the model fails
            session.metric.update(np.ones(session.metric.k))  # half-done work the turn must not leave behind
            raise RuntimeError("simulated failure in the forward pass")
        finally:
            events.close()  # as a real failure would: the engine's lock is released

    engine.stream_turn = crashing
    outs = run(ui.chat.send("How do plants make food?", sid, 8))
    final = outs[-1]
    assert "This turn failed" in final.alert and "simulated failure" in final.alert
    assert not any("generating" in m["content"] for m in final.chat)
    assert (len(session.turns), len(session.memory), session.metric.growth) == before
    engine.stream_turn = real
    after = run(ui.chat.send("Name three primary colours.", sid, 8))[-1]
    assert badges(after.chat)[-1] in ("augment", "expand", "explore"), "the session keeps working after the failure"


def test_a_regenerate_that_crashes_keeps_the_turn_it_was_to_replace(tmp_path):
    ui, engine = make_ui(tmp_path)
    sid = ui.page.registry.create()
    run(ui.chat.send("What is the boiling point of water?", sid, 4))
    run(ui.chat.send("How do plants make food?", sid, 4))
    session = ui.page.registry.entry(sid).session
    before = (list(session.turns), len(session.memory), session.metric.growth)
    real = engine.stream_turn

    def crashing(session, message, **kw):
        events = real(session, message, **kw)
        try:
            yield next(events)
            raise RuntimeError("simulated failure in the forward pass")
        finally:
            events.close()

    engine.stream_turn = crashing
    final = run(ui.chat.regenerate(sid, 4))[-1]
    assert "This turn failed" in final.alert
    assert (session.turns, len(session.memory), session.metric.growth) == before
    assert counts(ui, sid) == (2, 2, 2)
    engine.stream_turn = real
    run(ui.chat.regenerate(sid, 4))  # the undo is still there: Regenerate works afterwards
    assert counts(ui, sid) == (2, 2, 2) and session.turns[-1] is not before[0][-1]


def test_a_long_sessions_page_updates_stay_bounded(ui, monkeypatch):
    """Every update of a turn in a session longer than the windows renders the chat's newest
    CHAT_WINDOW_TURNS turns (and a line counting the others) and plots the newest
    PLOT_WINDOW_TURNS turns under their own numbers, not the whole session."""
    monkeypatch.setattr(isagi.app.handlers.page, "PLOT_WINDOW_TURNS", 20)
    window = isagi.app.views.CHAT_WINDOW_TURNS
    sid = ui.page.registry.create()
    run(ui.chat.send("What is the boiling point of water?", sid, 4))
    session = ui.page.registry.entry(sid).session
    session.turns[:] = session.turns * (window + 50)
    out = run(ui.chat.send("Name three primary colours.", sid, 4))
    chats = [o.chat for o in out if isinstance(o.chat, list)]
    assert len(chats) >= 2
    # each turn is a user message, a reply and its info line; the note and the pending turn besides
    assert all(len(c) <= 3 * window + 1 + 3 for c in chats)
    final = out[-1].chat
    assert final[0]["role"] == "assistant" and "51 earlier exchanges" in final[0]["content"]
    assert "Name three primary colours." in final[-3]["content"]
    growth = out[-1].growth
    xs = [x for trace in growth.data for x in trace.x]
    total = len(session.turns)
    assert total == window + 51 and min(xs) == total - 20 + 1 and max(xs) == total


@pytest.mark.parametrize("where", ["file", "history"])
def test_a_chat_taken_over_by_another_server_tells_the_page_to_reload(tmp_path, monkeypatch, where):
    """The page keeps the "reload the page" words of a session moved to another replica (the API
    answers it in its own words: tests/test_api.py)."""
    from isagi.errors import MOVED, MOVED_SAVED, SessionMoved

    ui, engine = make_ui(tmp_path)
    sid = ui.page.registry.create()

    def refused(*_a, **_k):
        raise SessionMoved()

    if where == "file":
        monkeypatch.setattr(engine.keep, "save", refused)
    else:
        monkeypatch.setattr(engine.store, "record_exchanges", refused)
        monkeypatch.setattr(engine.store, "record_exchange", refused)
    outs = run(ui.chat.send("a question", sid, 8))
    alert = outs[-1].alert
    assert (MOVED if where == "file" else MOVED_SAVED) in alert and "reload the page" in alert
