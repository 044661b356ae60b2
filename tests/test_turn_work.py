"""The work one turn does once: the memory serialised to columns once (the autosave, the
page's map and the next turn's Regenerate snapshot share it), the history fitted to the prompt
budget once (AUGMENT's prompt trims that fit, it does not fit again), and each turn's chat
messages built once for the file and the page alike.

The web page's own handler (``ChatHandlers.send``) on the tiny model (tests/tiny_engine.py), so what
is counted is what a turn in the browser costs."""

from __future__ import annotations

import pytest

from isagi.manifold.cog import TierThresholds
from isagi.manifold.memory import TrajectoryMemory
from isagi.pipeline.prompts import Prompts
from isagi.session.turn import Turn
from tests.test_app_ui import make_ui, run


def _count(monkeypatch: pytest.MonkeyPatch, cls: type, name: str) -> list[int]:
    calls = [0]
    real = getattr(cls, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(cls, name, counted)
    return calls


@pytest.mark.parametrize("tier", ["EXPAND", "AUGMENT"])
def test_one_web_turn_serialises_fits_and_builds_once(tmp_path, monkeypatch, tier):
    ui, engine = make_ui(tmp_path)
    # every turn with a stored neighbour is of this tier (AUGMENT: it takes the related exchange)
    bound = 10.0 if tier == "AUGMENT" else 0.0
    engine.thresholds = TierThresholds(retrieve=0.0, augment=bound, expand=10.0)
    sid = ui.page.registry.create()
    for q in ("what is a prime number?", "how do tides work?"):
        run(ui.chat.send(q, sid, 8))
    columns = _count(monkeypatch, TrajectoryMemory, "_build_columns")
    fits = _count(monkeypatch, Prompts, "history_window")
    messages = _count(monkeypatch, Turn, "_build_messages")
    run(ui.chat.send("why is the sky blue?", sid, 8))
    session = ui.page.registry.entry(sid).session
    assert session.turns[-1].tier == tier and session.turns[-1].verdict == "ok", session.turns[-1]
    assert columns[0] == 1, "the memory's columns are built once per turn (autosave, map, snapshot)"
    assert fits[0] == 1, "the history is fitted once per turn"
    assert messages[0] == 1, "only the new turn's messages are built; the older ones are reused"


def test_shared_columns_and_messages_cannot_be_changed_through_a_reader(tmp_path):
    ui, _engine = make_ui(tmp_path)
    sid = ui.page.registry.create()
    run(ui.chat.send("what is a prime number?", sid, 8))
    session = ui.page.registry.entry(sid).session
    cols = session.memory.to_columns()
    with pytest.raises(ValueError):
        cols["query_x"][0, 0] = 1.0  # read-only: the next reader gets what the memory holds
    cols["query_text"].append("not in the memory")
    assert session.memory.to_columns()["query_text"] == ["what is a prime number?"]
    before = session.turns[-1].to_messages()
    session.turns[-1].reply_text = "changed"  # a changed turn builds its messages anew
    assert session.turns[-1].to_messages()[1]["text"] == "changed" != before[1]["text"]
