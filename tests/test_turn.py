"""The Turn record and the real turn pipeline on a tiny random model (no download).

The record: its file form round-trips every field, untrusted file values are
dropped rather than trusted, messages pair into turns. The pipeline: the real
Engine.stream_turn with a synthetic profile writes one Turn to the session, the
history store and the autosaved file alike; refused and withheld turns; the
message is validated once; Regenerate's store replacement; no import cycle.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import isagi.pipeline.engine as pipeline_engine
from isagi.errors import InputError, StorageError
from isagi.pipeline.events import Decided, Done, Refused, Token
from isagi.session.files import load_session
from isagi.session.turn import TURN_FIELDS, Message, Turn, turns_from_messages, turns_to_messages
from tests.tiny_engine import tiny_engine

WATER = "What is the boiling point of water?"
PLANTS = "How do plants make food?"


def full_turn() -> Turn:
    return Turn(user_text="q ✓", reply_text="a\nb", tier="AUGMENT", distance=0.125, nearest_query="near",
                zone="science", teh_prompt=12.5, teh_reply=3.0, verdict="withheld", category="fraud",
                latency_s=0.5, prompt_tokens=40, new_tokens=9, metric_growth=0.01, context_dependent=True,
                cluster=4, memory_id=7, generated=True, cut=True, continues=True, asked_at=1.7e9, answered_at=1.7e9 + 1)


def test_every_field_round_trips_through_the_file_form() -> None:
    t = full_turn()
    assert all(getattr(t, name) != getattr(Turn("", ""), name) for name in TURN_FIELDS), "no field at its default"
    user, reply = t.to_messages()
    assert (user["role"], reply["role"]) == ("user", "assistant")
    back = Turn.from_messages(user, reply)
    assert back == t and back.to_dict() == t.to_dict()
    assert turns_from_messages(turns_to_messages([t, t])) == [t, t]


@pytest.mark.parametrize("field, value", [("distance", [1, 2]), ("distance", float("nan")), ("teh_prompt", "12"),
                                          ("latency_s", 10**400), ("new_tokens", True), ("new_tokens", 2.5),
                                          ("tier", 5), ("context_dependent", "yes"), ("cluster", {"a": 1})])
def test_a_file_value_of_the_wrong_type_is_dropped_not_trusted(field: str, value: object) -> None:
    user, reply = full_turn().to_messages()
    reply[field] = value
    back = Turn.from_messages(user, reply)
    assert getattr(back, field) == getattr(Turn("", ""), field)  # the default: nothing made up
    assert back.reply_text == "a\nb" and back.tier == ("AUGMENT" if field != "tier" else None)


def test_messages_pair_into_turns_as_well_as_they_can() -> None:
    msgs = [
        {"role": "system", "text": "imported system prompt"},
        {"role": "user", "text": "unanswered", "created": 5.0},
        {"role": "user", "text": "asked", "time": 6.0},
        {"role": "assistant", "text": "answered", "time": 7.0, "tier": "EXPLORE"},
        {"role": "assistant", "text": "a reply on its own"},
        {"role": "user", "text": "last, unanswered"},
    ]
    turns = turns_from_messages(msgs)
    assert [(t.user_text, t.reply_text, t.verdict) for t in turns] == [
        ("unanswered", "", "cancelled"), ("asked", "answered", "ok"),
        ("", "a reply on its own", "ok"), ("last, unanswered", "", "cancelled"),
    ]
    assert (turns[0].asked_at, turns[1].asked_at, turns[1].answered_at) == (5.0, 6.0, 7.0)
    assert [t.accepted for t in turns] == [False, True, True, False]


# -- the real pipeline on the tiny model -------------------------------------------------


def test_one_turn_is_the_same_record_in_the_session_the_store_and_the_file(tmp_path: Path) -> None:
    engine = tiny_engine(tmp_path)
    s = engine.new_session()
    events = list(engine.stream_turn(s, WATER))
    kinds = [type(e) for e in events]
    assert kinds[0] is Decided and kinds[-1] is Done and set(kinds[1:-1]) == {Token}
    turn = events[-1].turn
    assert s.turns == [turn] and turn.user_text == WATER
    assert turn.reply_text == "".join(e.text for e in events if isinstance(e, Token))
    assert (turn.tier, turn.verdict, turn.generated, turn.new_tokens) == ("EXPLORE", "ok", True, 12)
    assert turn.zone in engine.profile.zones.names and 0 <= turn.teh_prompt <= 100
    assert turn.prompt_tokens == engine.prompts.prompt_tokens([{"role": "system", "content": engine.settings.system_prompt},
                                                      {"role": "user", "content": WATER}])
    assert turn.metric_growth == s.metric.growth > 0 and turn.cluster == 0 and len(s.memory) == 1
    assert turn.asked_at <= turn.answered_at and turn.latency_s > 0
    # the history store: the two rows hold the turn's figures
    user, reply = engine.store.get_turns(s.id, owner="local")
    assert (user.text, user.tier, user.zone, user.teh_prompt, user.prompt_tokens, user.verdict) == (
        WATER, "EXPLORE", turn.zone, turn.teh_prompt, turn.prompt_tokens, "ok")
    assert (reply.text, reply.new_tokens, reply.latency_s, reply.metric_growth) == (
        turn.reply_text, 12, turn.latency_s, turn.metric_growth)
    # the autosaved file: the same Turn, every field
    assert load_session(engine.frame, s.miku_path).turns == s.turns
    assert engine.store.get_session(s.id, owner="local").miku_path == str(s.miku_path)
    # the repeat: RETRIEVE from the real rule, the stored reply, nothing generated
    again = engine.turn(s, WATER)
    assert (again.tier, again.generated, again.new_tokens, again.reply_text) == ("RETRIEVE", False, 0, turn.reply_text)
    assert again.distance == pytest.approx(0.0, abs=1e-6) and again.nearest_query == WATER
    assert engine.store.get_session(s.id, owner="local").turns == 2 == len(load_session(engine.frame, s.miku_path).turns)


def test_a_refused_turn_generates_nothing_learns_nothing_and_is_recorded(tmp_path: Path) -> None:
    engine = tiny_engine(tmp_path, refuse=True)
    s = engine.new_session()
    events = list(engine.stream_turn(s, WATER))
    turn = events[-1].turn
    assert isinstance(events[0], Decided) and events[0].tier is None
    assert [type(e) for e in events[1:]] == [Refused, Done] and events[1].text == turn.reply_text
    assert (turn.verdict, turn.tier, turn.generated, turn.new_tokens) == ("refused", None, False, 0)
    assert turn.category in engine.profile.safety.categories and turn.category.replace("_", " ") in turn.reply_text
    assert turn.teh_prompt > engine.profile.safety.threshold
    assert len(s.memory) == 0 and s.metric.growth == 0.0
    assert [r.verdict for r in engine.store.get_turns(s.id, owner="local")] == ["refused", "refused"]
    assert s.chat_history() == []


def test_a_withheld_reply_is_replaced_learns_nothing_and_stays_out_of_prompts(tmp_path: Path) -> None:
    engine = tiny_engine(tmp_path, withhold=True)
    s = engine.new_session()
    turn = engine.turn(s, WATER)
    assert turn.verdict == "withheld" and turn.reply_text.startswith("[reply withheld]")
    assert turn.teh_reply is not None and turn.teh_reply > engine.profile.safety.reply_threshold
    assert turn.category in engine.profile.safety.categories and turn.generated
    assert len(s.memory) == 0 and s.metric.growth == 0.0
    assert s.chat_history() == [] and engine.prompts.fitting_history(s, PLANTS) == []


def test_the_message_is_validated_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = tiny_engine(tmp_path, with_store=False)
    calls: list[str] = []
    real = engine.prompts.validate
    monkeypatch.setattr(engine.prompts, "validate", lambda m: calls.append(m) or real(m))
    s = engine.new_session(autosave=False)
    message = engine.check("  " + WATER + "\x00 ")
    assert message == Message(WATER) and calls == ["  " + WATER + "\x00 "]
    engine.turn(s, message)
    assert len(calls) == 1, "a checked Message is not validated again"
    engine.turn(s, PLANTS)
    assert len(calls) == 2
    with pytest.raises(InputError, match="empty"):
        engine.stream_turn(s, "   ")  # at the call, before any event or lock
    assert len(s.turns) == 2 and not engine.model_turns.locked()


def test_replacing_the_last_turn_in_the_store_keeps_the_counts(tmp_path: Path) -> None:
    engine = tiny_engine(tmp_path)
    store = engine.store
    store.ensure_session("s1", owner="ann", model_id="m")
    assert store.replace_last_turn("s1", Turn("first", "one"), owner="ann") == 1  # nothing to replace: the first
    store.record_turn("s1", Turn("second", "two"), owner="ann")
    assert store.replace_last_turn("s1", Turn("second", "two, again", tier="EXPAND"), owner="ann") == 2
    rows = store.get_turns("s1", owner="ann")
    assert [(r.seq, r.text) for r in rows] == [(0, "first"), (1, "one"), (2, "second"), (3, "two, again")]
    assert store.get_session("s1", owner="ann").turns == 2 and rows[2].tier == "EXPAND"
    with pytest.raises(StorageError, match="No session"):  # another owner's session is not found
        store.replace_last_turn("s1", Turn("x", "y"), owner="bob")
    assert len(store.get_turns("s1", owner="ann")) == 4


def test_agent_and_session_io_do_not_import_each_other() -> None:
    code = (
        "import sys, isagi.session.files; a = 'isagi.pipeline.engine' in sys.modules; "
        "import isagi.pipeline.engine; b = any(m in sys.modules for m in ('isagi.storage.history', 'isagi.pipeline.keeping')); "
        "print(a, b)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_a_session_with_its_own_basis_of_another_k_routes_zones_in_the_profiles(tmp_path):
    """An imported research session keeps its own UGT basis (here k=3, the profile's is 8):
    its turns still run, the zone routed in the profile's coordinates."""
    import dataclasses

    from isagi.manifold.ugt import fit_basis
    from tests.tiny_engine import tiny_engine

    engine = tiny_engine(tmp_path, max_new_tokens=4)
    s = engine.new_session(autosave=False)
    rng = np.random.default_rng(0)
    own = fit_basis(rng.standard_normal((20, engine.lm.hidden_size)), 3)
    s = dataclasses.replace(s, basis=own, metric=type(s.metric)(k=3), memory=type(s.memory)(k=3))
    turn = engine.turn(s, "What is a lighthouse for?")
    assert turn.verdict == "ok" and turn.zone in engine.profile.zones.names


def _spied(engine, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, bool]]:
    """(messages, states_only) of every prompt the engine's turns open, in order."""
    opened: list[tuple[int, bool]] = []
    real = engine.lm.generation

    def spy(messages, *args, **kwargs):
        opened.append((len(messages), kwargs.get("states_only", False)))
        return real(messages, *args, **kwargs)

    monkeypatch.setattr(engine.lm, "generation", spy)
    return opened


def _never_refusing(engine) -> None:
    """Prompt and reply thresholds at 100 %: no verdict depends on the tiny profile's readings."""
    import dataclasses

    safety = dataclasses.replace(engine.profile.safety, threshold=100.0, reply_threshold=100.0)
    engine.profile = dataclasses.replace(engine.profile, safety=safety)


def test_the_lookup_prefill_is_states_only_once_the_reply_comes_from_a_history_prompt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading in the conversation off: the first turn decodes its reply from the lookup prompt (a
    full prefill); a later turn decodes from the prompt with history, so its lookup prefill only
    has to reach the captured layers, and the reply's decoding is a full one."""
    engine = tiny_engine(tmp_path, with_store=False, max_new_tokens=4, read_in_conversation=False)
    opened = _spied(engine, monkeypatch)
    session = engine.new_session("s", autosave=False)
    first = engine.turn(session, "Name a colour.")
    assert first.verdict == "ok" and first.reply_text
    assert opened == [(2, False)]  # system + message, decoded from
    opened.clear()
    engine.turn(session, "Name a fruit.")
    assert opened == [(2, True), (4, False)]  # the lookup prompt, then system + exchange + message


def test_a_later_turn_reads_its_message_in_the_conversation_and_decodes_from_that_prefill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A message after some history whose reading there is clearly below the prompt guard's
    threshold is read once: in the reply's own prompt, which the reply is decoded from. Its TEH
    and coordinates are that reading's, and no states are cached under the message read alone."""
    import dataclasses

    engine = tiny_engine(tmp_path, with_store=False, max_new_tokens=4, read_in_conversation=True)
    _never_refusing(engine)
    safety = dataclasses.replace(engine.profile.safety, threshold=100.0 + pipeline_engine.CONVERSATION_MARGIN + 1)
    engine.profile = dataclasses.replace(engine.profile, safety=safety)
    opened = _spied(engine, monkeypatch)
    session = engine.new_session("s", autosave=False)
    engine.turn(session, "Name a colour.")
    cached = len(session.prompt_states)
    opened.clear()
    second = engine.turn(session, "Name a fruit.")
    assert second.verdict == "ok" and second.reply_text and second.generated
    assert opened == [(4, False)]  # system + exchange + message, read and decoded from: no other prefill
    assert len(session.prompt_states) == cached  # nothing cached under the message read alone


def test_a_reading_not_clearly_safe_in_the_conversation_reads_the_message_alone_as_well(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the reading in the conversation is within the margin of the threshold, the message is
    read alone as before (its TEH decides), and the reply is then decoded from the prompt with
    history, evaluated again."""
    engine = tiny_engine(tmp_path, with_store=False, max_new_tokens=4, read_in_conversation=True)
    _never_refusing(engine)
    monkeypatch.setattr(pipeline_engine, "CONVERSATION_MARGIN", 101.0)  # nothing is clearly below 100 % - 101
    opened = _spied(engine, monkeypatch)
    session = engine.new_session("s", autosave=False)
    engine.turn(session, "Name a colour.")
    opened.clear()
    second = engine.turn(session, "Name a fruit.")
    assert second.verdict == "ok" and second.reply_text
    assert opened == [(4, False), (2, True), (4, False)]
    alone = engine.prompts.build(session, "Name a fruit.", None, with_history=False)
    h, h_safety = session.cached_states(pipeline_engine._prompt_key(alone))  # the read alone, kept as before
    assert second.teh_prompt == pytest.approx(engine._teh(h_safety))


def test_a_question_asked_before_is_answered_from_memory_when_its_reading_in_the_conversation_misses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first question of a session is read alone and stored so; asked again after other turns,
    its reading in the conversation (a random model's, far from the stored one) misses it, and the
    message is read alone as well, which finds it: answered from memory."""
    import dataclasses

    engine = tiny_engine(tmp_path, with_store=False, max_new_tokens=4, read_in_conversation=True)
    _never_refusing(engine)
    safety = dataclasses.replace(engine.profile.safety, threshold=100.0 + pipeline_engine.CONVERSATION_MARGIN + 1)
    engine.profile = dataclasses.replace(engine.profile, safety=safety)
    session = engine.new_session("s", autosave=False)
    first = engine.turn(session, "Name a colour.")
    engine.turn(session, "Name a fruit.")
    session.prompt_states.clear()  # as after a reload: no reading of it is cached
    opened = _spied(engine, monkeypatch)
    again = engine.turn(session, "Name a colour.")
    assert again.tier == "RETRIEVE" and again.reply_text == first.reply_text
    assert opened[0] == (6, False), "read in its conversation first"
