"""Edit-and-resend (issue 39): an edited message replaces its turn and every turn after it, and
the session's manifold forgets the exchanges edited away — in memory, metric, file and history.

On the page's handlers over the tiny engine (a random transformers model built from a config),
the same code the browser drives.
"""

from __future__ import annotations

import numpy as np
import pytest

from isagi.errors import InputError
from isagi.pipeline.rewind import rewind
from isagi.session.files import load_session
from tests.test_app_ui import badges, counts, make_ui, run

A, B, C, D = ("How do plants make food?", "What is the boiling point of water?",
              "Name three primary colours.", "Why is the sky blue?")


@pytest.fixture
def ui(tmp_path):
    return make_ui(tmp_path)[0]


def _asked(ui, *questions: str) -> str:
    sid = ui.page.registry.create()
    for q in questions:
        run(ui.chat.send(q, sid, 4))
    return sid


def test_an_edited_message_replaces_its_turn_and_all_after_it_everywhere(ui):
    sid = _asked(ui, A, B, C)
    out = run(ui.chat.edit_send(D, "1", sid, 4))
    assert out[0].edit_turn == "", "the page's editing state is cleared at once"
    s = ui.page.registry.entry(sid).session
    assert [t.user_text for t in s.turns] == [A, D]
    assert counts(ui, sid) == (2, 2, 2), "session, history and file agree"
    rows = ui.page.engine.store.get_turns(sid, owner="local")
    assert [r.text for r in rows[::2]] == [A, D] and [r.seq for r in rows] == [0, 1, 2, 3]
    assert load_session(ui.page.engine.frame, s.miku_path).turns[-1].user_text == D
    cols = s.memory.to_columns()
    assert list(cols["query_text"]) == [A, D], "the memory keeps no exchange the user edited away"
    users = [m["content"] for m in out[-1].chat if m["role"] == "user"]
    assert 'isagi-turn-1' in users[1] and "sky blue" in users[1], "the resent question sits where the edited one was"


def test_after_an_edit_the_manifold_is_as_if_the_edited_exchanges_never_happened(ui):
    edited = _asked(ui, A, B, C)
    run(ui.chat.edit_send(D, "1", edited, 4))
    fresh = _asked(ui, A, D)
    e, f = (ui.page.registry.entry(x).session for x in (edited, fresh))
    np.testing.assert_allclose(e.metric.M, f.metric.M, rtol=0, atol=1e-6)
    assert len(e.memory) == len(f.memory) == 2
    # the old question is no longer answered from memory (before the edit, it was: an exact repeat)
    repeat = _asked(ui, A, B)
    assert badges(run(ui.chat.send(B, repeat, 4))[-1].chat)[-1] == "retrieve"
    assert badges(run(ui.chat.send(B, edited, 4))[-1].chat)[-1] != "retrieve"


def test_an_edit_that_cannot_run_changes_nothing(ui):
    sid = _asked(ui, A, B)
    s = ui.page.registry.entry(sid).session
    before = ([t.user_text for t in s.turns], s.metric.M.copy(), len(s.memory))
    for turn, message, said in (("7", D, "no longer in this chat"), ("x", D, "use Edit"), ("0", "   ", "")):
        out = run(ui.chat.edit_send(message, turn, sid, 4))
        assert out[-1].alert and said in out[-1].alert
    s = ui.page.registry.entry(sid).session
    assert ([t.user_text for t in s.turns], len(s.memory)) == (before[0], before[2])
    np.testing.assert_array_equal(s.metric.M, before[1])
    assert counts(ui, sid) == (2, 2, 2)


def test_rewind_to_the_start_leaves_an_empty_manifold_and_refuses_a_position_it_lacks(ui):
    sid = _asked(ui, A, B)
    s = ui.page.registry.entry(sid).session
    assert [t.memory_id for t in s.turns] == [0, 1], "each learned turn names its memory record"
    assert rewind(s, 0) == 2
    assert s.turns == [] and len(s.memory) == 0 and s.metric.growth == 0.0 and s.undo is None
    with pytest.raises(ValueError):
        rewind(s, 1)
    with pytest.raises(InputError):
        next(ui.page.engine.edit(s, 0, D))


def test_an_edit_closed_before_it_is_recorded_puts_back_the_turns_it_was_to_cut(ui):
    sid = _asked(ui, A, B, C)
    s = ui.page.registry.entry(sid).session
    before = ([t.user_text for t in s.turns], s.metric.M.copy(), list(s.memory.to_columns()["query_text"]))
    events = ui.page.engine.edit(s, 1, D)
    next(events)  # the decision; then the page goes away (the events are closed)
    events.close()
    assert ([t.user_text for t in s.turns], list(s.memory.to_columns()["query_text"])) == (before[0], before[2])
    np.testing.assert_array_equal(s.metric.M, before[1])
    assert counts(ui, sid) == (3, 3, 3)
