"""Reply versions (issue 39): each Regenerate keeps the reply it replaced; ‹ and › switch the last
reply's version, and which one is current is the session's (chat, prompt, memory, file, history).

On the page's handlers over the tiny engine, the same code the browser drives.
"""

from __future__ import annotations

import pytest

from isagi.errors import MikuError
from isagi.session.files import load_session, save_session
from tests.test_app_ui import badges, make_ui, run

A, B = "How do plants make food?", "What is the boiling point of water?"


@pytest.fixture
def ui(tmp_path):
    return make_ui(tmp_path)[0]


def _three_versions(ui) -> tuple[str, list[str]]:
    sid = ui.page.registry.create()
    run(ui.chat.send(A, sid, 6))
    for _ in range(2):
        run(ui.chat.regenerate(sid, 6))
    s = ui.page.registry.entry(sid).session
    return sid, [t.reply_text for t in s.versions[0].replies]


def _stored_reply(ui, sid: str) -> str:
    rows = ui.page.engine.store.get_turns(sid, owner="local")
    return rows[-1].text


def test_regenerate_keeps_every_reply_and_the_newest_is_current(ui):
    sid, replies = _three_versions(ui)
    s = ui.page.registry.entry(sid).session
    assert len(s.turns) == 1 and s.versions[0].current == 2 and len(replies) == 3
    assert s.turns[0].reply_text == replies[2] == _stored_reply(ui, sid)
    info = ui.page.view_of(s, "tier").chat[-1]["content"]
    assert "3/3" in info and "isagi-version-prev" in info and "isagi-version-next" not in info


def test_switching_a_version_changes_what_the_chat_continues_from_everywhere(ui):
    sid, replies = _three_versions(ui)
    out = ui.chat.version(sid, "tier", -1)
    s = ui.page.registry.entry(sid).session
    assert s.versions[0].current == 1 and s.turns[0].reply_text == replies[1]
    assert "2/3" in out.chat[-1]["content"] and "isagi-version-next" in out.chat[-1]["content"]
    assert _stored_reply(ui, sid) == replies[1], "the history holds the version shown"
    reloaded = load_session(ui.page.engine.frame, s.miku_path)
    assert reloaded.versions[0].current == 1 and reloaded.turns[0].reply_text == replies[1]
    assert [t.reply_text for t in reloaded.versions[0].replies] == replies, "every version survives the file"
    # memory answers the same question with the version shown; a version memory cannot hold
    # (the tiny model's reply may be empty: not accepted) leaves it with the newest version's
    final = run(ui.chat.send(A, sid, 6))[-1]
    assert badges(final.chat)[-1] == "retrieve"
    remembered = replies[1] if replies[1] else replies[2]
    assert ui.page.registry.entry(sid).session.turns[-1].reply_text == remembered



def test_switching_to_an_empty_version_leaves_memory_with_the_reply_it_held(ui, monkeypatch):
    """A version memory cannot hold (an empty reply is not accepted) does not replace the stored
    reply: asking again is answered with the last accepted version shown, never with nothing."""
    from isagi.pipeline import engine as engine_module

    sid = ui.page.registry.create()
    real = engine_module._generate
    outputs = iter(["a kept answer", ""])

    def scripted(*args, **kwargs):
        out = yield from real(*args, **kwargs)
        out.reply = next(outputs)
        return out

    monkeypatch.setattr(engine_module, "_generate", scripted)
    run(ui.chat.send(A, sid, 6))
    run(ui.chat.regenerate(sid, 6))
    s = ui.page.registry.entry(sid).session
    assert [t.reply_text for t in s.versions[0].replies] == ["a kept answer", ""]
    ui.chat.version(sid, "tier", -1)  # to the kept answer: memory answers with it
    ui.chat.version(sid, "tier", 1)  # back to the empty one: memory keeps the kept answer
    assert s.turns[0].reply_text == "" and s.versions[0].current == 1
    monkeypatch.setattr(engine_module, "_generate", real)
    run(ui.chat.send(A, sid, 6))
    assert s.turns[-1].tier == "RETRIEVE" and s.turns[-1].reply_text == "a kept answer"

def test_no_version_past_either_end_and_earlier_turns_keep_theirs(ui):
    sid, replies = _three_versions(ui)
    assert "no version that way" in ui.chat.version(sid, "tier", 1).alert
    run(ui.chat.send(B, sid, 6))
    s = ui.page.registry.entry(sid).session
    chat = ui.page.view_of(s, "tier").chat
    infos = [m["content"] for m in chat if "isagi-info" in m["content"]]
    assert "version 3 of 3" in infos[0] and "isagi-version-prev" not in infos[0]
    assert "no other version" in ui.chat.version(sid, "tier", -1).alert
    # an edit of the first message cuts its versions with it
    run(ui.chat.edit_send("Why is the sky blue?", "0", sid, 6))
    assert ui.page.registry.entry(sid).session.versions == {}


def test_a_file_whose_versions_do_not_fit_its_conversation_is_refused(ui, tmp_path):
    sid, _ = _three_versions(ui)
    s = ui.page.registry.entry(sid).session
    frame = ui.page.engine.frame
    from isagi.session.files import session_state
    from isagi.storage.miku import read_miku, write_miku

    path = tmp_path / "v.miku"
    save_session(frame, s, path)
    state = read_miku(path)
    state.extra["reply_versions"][0]["turn"] = 5
    write_miku(path, state)
    with pytest.raises(MikuError, match="reply_versions"):
        load_session(frame, path)
    assert session_state(frame, s).extra["reply_versions"][0]["current"] == 2
