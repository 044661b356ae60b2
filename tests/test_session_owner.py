"""Who changes a session (issue 23): the engine and the session, not the page.

- Regenerate is the engine's (``Engine.regenerate``), used by the page and the terminal
  (``/regenerate``); a Regenerate of an answer from memory (RETRIEVE) generates a new
  reply and stores it in place of the remembered one.
- A turn whose autosave fails stays in the session (and reaches the history store once
  its file is written); the user is told plainly that the file was not written, whatever
  the failure, and the next message writes it.
- A loaded ``.miku`` is recorded at once and the page switches to it; Delete asks first and
  works for a session whose page was closed; a page redraws its session when another tab
  of the browser changed it.

The real engine on the tiny random model (tests/tiny_engine.py), a real registry, history
store and ``.miku`` files.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

from isagi.app.loader import EngineHolder
from isagi.app.ui import WebUI
from isagi.console.terminal import chat_loop
from isagi.engines.base import GenerationOptions
from isagi.errors import InputError, StorageError
from isagi.pipeline.events import Decided, Done, Token
from isagi.session.files import load_session
from isagi.session.registry import SessionRegistry
from isagi.session.service import SessionService
from tests.tiny_engine import tiny_engine
from tests.uploads import upload

# send()/regenerate() yield (state, chat, textbox, alert, turn, summary, map, growth, teh, status, seen)
QUESTION = "What is the boiling point of water?"


def run(gen):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gr.Warning outside a request falls back to warnings
        return list(gen)


def quiet(fn, *args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kw)


def make_ui(tmp_path: Path) -> WebUI:
    engine = tiny_engine(tmp_path, max_new_tokens=8)
    holder = EngineHolder(engine)
    return WebUI(holder, SessionService(SessionRegistry(lambda: holder.engine, idle_s=600)), engine.settings)


def history(ui: WebUI, sid: str) -> list[tuple[str, str]]:
    """(question, reply) of every exchange the history store holds for ``sid``."""
    rows = ui.page.engine.store.get_turns(sid, owner="local")
    return [(q.text, a.text) for q, a in zip(rows[::2], rows[1::2], strict=True)]


def in_file(ui: WebUI, path: Path) -> list[tuple[str, str]]:
    return [(t.user_text, t.reply_text) for t in load_session(ui.page.engine.frame, path).turns]


def page(hash_: str) -> SimpleNamespace:
    """A request from the browser page ``hash_`` (no login: the owner is ``local``)."""
    return SimpleNamespace(session_hash=hash_, username=None, client=SimpleNamespace(host="10.0.0.1"))


# --------------------------------------------------------------------------- Regenerate


def test_regenerate_of_an_answer_from_memory_generates_and_replaces_the_stored_one(tmp_path):
    ui = make_ui(tmp_path)
    sid = ui.page.registry.create()
    run(ui.chat.send(QUESTION, sid, 8))
    run(ui.chat.send(QUESTION, sid, 8))
    session = ui.page.registry.entry(sid).session
    stored = session.turns[0].reply_text
    assert [t.tier for t in session.turns] == ["EXPLORE", "RETRIEVE"] and session.turns[1].reply_text == stored
    n_memory = len(session.memory)
    run(ui.chat.regenerate(sid, 8))
    again = session.turns[-1]
    assert again.generated and again.tier != "RETRIEVE", "Regenerate answered from memory again"
    assert again.reply_text != stored and len(session.turns) == 2
    assert len(session.memory) == n_memory, "the new reply replaces the stored one, it is not stored beside it"
    assert session.memory.to_columns()["reply_text"] == [again.reply_text]
    # the next time the question comes, memory answers with the regenerated reply
    run(ui.chat.send(QUESTION, sid, 8))
    assert session.turns[-1].tier == "RETRIEVE" and session.turns[-1].reply_text == again.reply_text
    assert history(ui, sid) == in_file(ui, session.miku_path) == [(t.user_text, t.reply_text) for t in session.turns]


def test_the_engine_regenerates_and_puts_the_old_turn_back_when_the_new_one_fails(tmp_path):
    engine = tiny_engine(tmp_path, max_new_tokens=6)
    session = engine.new_session()
    with pytest.raises(InputError, match="Nothing to regenerate"):
        engine.regenerate(session)
    engine.turn(session, QUESTION)
    engine.turn(session, "Name three primary colours.")
    old, growth = session.turns[-1], session.metric.growth
    turn = [e for e in engine.regenerate(session) if isinstance(e, Done)][0].turn
    assert session.turns[-1] is turn is not old and len(session.turns) == 2 and len(session.memory) == 2
    assert session.metric.growth == pytest.approx(growth)
    before = (list(session.turns), len(session.memory), session.metric.growth)
    events = engine.regenerate(session)
    next(events)  # the decision; then the model fails (here: the events are closed)
    events.close()
    assert (session.turns, len(session.memory), session.metric.growth) == before
    assert session.can_regenerate  # the undo is still there
    assert [r.text for r in engine.store.get_turns(session.id, owner="local")][-1] == turn.reply_text


def test_a_turn_closed_before_it_is_recorded_leaves_the_session_as_it_was(tmp_path):
    """The engine rolls back what a turn did before it was recorded: here RETRIEVE's count of
    a use of the stored answer, made before the answer is streamed."""
    engine = tiny_engine(tmp_path, max_new_tokens=6)
    session = engine.new_session()
    engine.turn(session, QUESTION)
    hits = list(session.memory.to_columns()["hits"])
    events = engine.stream_turn(session, QUESTION)
    kinds = [type(next(events)), type(next(events))]  # the decision, the stored answer
    events.close()  # e.g. a second Ctrl-C, or a page that crashed
    assert kinds == [Decided, Token]
    assert len(session.turns) == 1 and list(session.memory.to_columns()["hits"]) == hits
    assert not engine.model_turns.locked()


def test_the_terminal_regenerates_the_last_reply(tmp_path):
    engine = tiny_engine(tmp_path, max_new_tokens=6)
    session = engine.new_session()
    out, err = Console(file=io.StringIO(), width=200), Console(file=io.StringIO(), width=200)
    answers: list[str] = []
    real = engine.stream_turn

    def spy(*args, **kwargs):
        for event in real(*args, **kwargs):
            if isinstance(event, Done):
                answers.append(event.turn.reply_text)
            yield event

    engine.stream_turn = spy
    items = iter([QUESTION, "/regenerate"])  # isagi.console.terminal.REGENERATE

    def read_line(_prompt: str) -> str:
        line = next(items, None)
        if line is None:
            raise EOFError
        return line

    n = chat_loop(engine, session, GenerationOptions(max_new_tokens=6), interactive=False, out=out, err=err,
                  read_line=read_line)
    assert n == 2 and len(answers) == 2 and answers[0] != answers[1]
    assert [t.user_text for t in session.turns] == [QUESTION], "/regenerate is a command, not a message"
    assert session.turns[0].reply_text == answers[1]
    rows = engine.store.get_turns(session.id, owner="local")
    assert [r.text for r in rows] == [QUESTION, answers[1]]
    assert [t.reply_text for t in load_session(engine.frame, session.miku_path).turns] == [answers[1]]


# --------------------------------------------------------------------------- a failed autosave


@pytest.mark.parametrize("failure", [
    StorageError("Could not save the session: Read-only file system."),  # a read-only sessions directory
    RuntimeError("a bug in the writer"),  # anything else
])
def test_a_failed_autosave_keeps_the_turn_and_says_the_file_was_not_written(tmp_path, monkeypatch, failure):
    import isagi.storage.miku
    ui = make_ui(tmp_path)
    sid = ui.page.registry.create()
    run(ui.chat.send(QUESTION, sid, 6))
    session = ui.page.registry.entry(sid).session
    real = isagi.storage.miku.write_miku

    def broken(*args, **kwargs):
        raise failure

    monkeypatch.setattr(isagi.storage.miku, "write_miku", broken)
    final = run(ui.chat.send("Name three primary colours.", sid, 6))[-1]
    alert = final.alert
    assert "file was not written" in alert and "next message" in alert, alert
    assert "This turn failed" not in alert and str(tmp_path) not in alert
    assert [t.user_text for t in session.turns] == [QUESTION, "Name three primary colours."]  # kept, shown
    assert "Name three primary colours." in str(final.chat)
    assert [q for q, _ in in_file(ui, session.miku_path)] == [QUESTION]
    assert [q for q, _ in history(ui, sid)] == [QUESTION]  # the history never gets ahead of the file
    assert ui.page.registry.retry_history() == 1  # it waits for the file, not lost
    monkeypatch.setattr(isagi.storage.miku, "write_miku", real)
    final = run(ui.chat.send("How do plants make food?", sid, 6))[-1]  # the next autosave writes it all
    assert "not written" not in final.alert
    expected = [(t.user_text, t.reply_text) for t in session.turns]
    assert len(expected) == 3 and in_file(ui, session.miku_path) == expected == history(ui, sid)


# --------------------------------------------------------------------------- the page's sessions


def test_a_loaded_miku_is_recorded_listed_and_shown(tmp_path):
    import gradio as gr

    ui = make_ui(tmp_path)
    sid = ui.page.registry.create()
    for q in (QUESTION, "Name three primary colours."):
        run(ui.chat.send(q, sid, 6))
    path = quiet(ui.files.save_miku, sid).download
    other = ui.page.registry.create()
    out = quiet(ui.files.load_miku, upload(ui, path), other, "tier")
    new, note, table, tabs, alert = out.state, out.files_note, out.table, out.tabs, out.alert
    assert new not in (sid, other) and note.startswith("Loaded")
    assert [q for q, _ in history(ui, new)] == [QUESTION, "Name three primary colours."]  # before any new turn
    assert new in [row[0] for row in table] and [r[2] for r in table if r[0] == new] == [2]
    assert isinstance(tabs, gr.Tabs) and alert == ""
    run(ui.chat.send("How do plants make food?", new, 6))
    assert len(history(ui, new)) == 3  # recorded once each


def test_resume_empties_the_previous_chats_alert(tmp_path):
    ui = make_ui(tmp_path)
    a = ui.page.registry.create()
    run(ui.chat.send(QUESTION, a, 6))
    b = quiet(ui.chat.new_chat, a).state
    out = quiet(ui.history.resume, a, b, "tier")
    assert out.state == a and out.alert == ""


def test_delete_asks_first_and_works_once_the_page_is_closed(tmp_path):
    ui = make_ui(tmp_path)
    one, two = page("page-one"), page("page-two")
    sid = run(ui.chat.send(QUESTION, None, 6, request=one))[-1].state
    quiet(ui.chat.page_shows, sid, request=one)
    assert "open in a browser" in quiet(ui.history.ask_delete, sid, None, request=two).sessions_note
    quiet(ui.chat.page_closed, request=one)  # the tab is closed: its session is saved and parked
    assert sid not in ui.page.registry.live_ids("local")
    assert [r[4] for r in quiet(ui.history.list_sessions, "", request=two).table if r[0] == sid] == ["saved"]
    asked = quiet(ui.history.ask_delete, sid, None, request=two)
    pending, question, yes = asked.pending, asked.sessions_note, asked.confirm
    assert pending == sid and "cannot be undone" in question and yes.visible
    assert "”, 1 turn)" in question, "counted: one turn, not '1 turns'"
    assert history(ui, sid), "asking deletes nothing"
    confirmed = quiet(ui.history.confirm_delete, pending, None, request=two)
    table, done = confirmed.table, confirmed.sessions_note
    assert confirmed.pending is None and not confirmed.confirm.visible and not confirmed.cancel.visible
    assert done.startswith(f"Deleted session {sid}") and sid not in [r[0] for r in table]


def test_a_page_redraws_its_session_when_another_tab_changed_it(tmp_path):
    ui = make_ui(tmp_path)
    sid = run(ui.chat.send(QUESTION, None, 6))[-1].state
    session = ui.page.registry.entry(sid).session
    seen_here = ui.page.seen(sid, session)
    unchanged = quiet(ui.chat.sync, sid, seen_here)
    assert unchanged.changed() == {}  # nothing to redraw
    run(ui.chat.send("Name three primary colours.", sid, 6))  # from another tab of the same browser
    redrawn = quiet(ui.chat.sync, sid, seen_here)
    assert redrawn.seen == ui.page.seen(sid, session) and "Name three primary colours." in str(redrawn.chat)
