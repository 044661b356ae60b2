"""Stop during a long prompt's evaluation (issue 39), on the real default model through llama.cpp,
with one sequence and with two slots (ISAGI_PARALLEL=2, the step runner): the turn ends long
before the evaluation would, recorded as cancelled with an empty reply, and the next turn of the
same session is answered normally (the KV cache was left consistent)."""

from __future__ import annotations

import threading
import time

import pytest

from isagi.engines.base import GenerationOptions
from isagi.session.turn import Message

pytestmark = pytest.mark.model

LONG = " ".join(f"Paragraph {i}: the harbour town kept its boats, nets and lanterns in good order." for i in range(110))


@pytest.fixture(scope="module", params=[1, 2], ids=["one-sequence", "two-slots"])
def engine(request, settings_default):
    from isagi.pipeline.engine import Engine

    engine = Engine.start(settings_default.with_overrides(backend="llamacpp", parallel=request.param),
                          with_store=False)
    assert engine.lm.slots == request.param
    yield engine
    engine.lm.close()


def _turn(engine, session, text: str, stop: threading.Event | None = None):
    done = None
    for event in engine.stream_turn(session, Message(text), options=GenerationOptions(max_new_tokens=8), stop=stop):
        done = event
    return done.turn  # the last event is Done


def test_a_stop_during_a_long_prompt_ends_the_turn_and_the_next_turn_is_answered(engine):
    assert engine.lm.count_tokens(LONG) > 1500
    full_session = engine.new_session(autosave=False)
    t0 = time.monotonic()
    _turn(engine, full_session, "Summarise this: " + LONG)
    full_s = time.monotonic() - t0

    session = engine.new_session(autosave=False)
    stop = threading.Event()
    threading.Timer(full_s / 10, stop.set).start()  # early in the prompt's evaluation
    t0 = time.monotonic()
    stopped = _turn(engine, session, "Summarise this: " + LONG, stop)
    stopped_s = time.monotonic() - t0
    assert stopped.verdict == "cancelled" and stopped.reply_text == ""
    assert stopped_s < 10 and stopped_s < full_s / 2, (stopped_s, full_s)
    assert session.turns[-1].verdict == "cancelled"

    # the next turn, on whatever the stopped evaluation left in the engine's cache, is answered as
    # in a session whose same cancelled turn was stopped before anything was evaluated
    after = _turn(engine, session, "What is the capital of France?")
    reference = engine.new_session(autosave=False)
    _turn(engine, reference, "Summarise this: " + LONG, _set())
    expected = _turn(engine, reference, "What is the capital of France?")
    assert after.verdict == "ok" and after.reply_text
    assert after.reply_text == expected.reply_text


def _set() -> threading.Event:
    event = threading.Event()
    event.set()
    return event
