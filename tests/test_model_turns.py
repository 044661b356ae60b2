"""Several turns in the model at once: the gate in front of it (ModelTurns), the order in which
the step runner takes replies' tokens and prompt chunks, and the setting that sizes both."""

from __future__ import annotations

import threading
from collections import deque

import pytest

from isagi.config import SERVER_PARALLEL, load_settings
from isagi.engines.llamacpp_steps import Step, StepRunner
from isagi.errors import ConfigError
from isagi.pipeline.model_turns import ModelTurns


def test_the_gate_admits_one_turn_per_slot_and_the_next_waits():
    turns = ModelTurns(2)
    entered = threading.Event()
    with turns, turns:
        assert turns.inside == 2 and turns.locked()
        t = threading.Thread(target=lambda: (turns.__enter__(), entered.set(), turns.__exit__()))
        t.start()
        assert not entered.wait(0.2), "a third turn waits while two slots are in use"
    assert entered.wait(5), "and goes in once one leaves"
    t.join()
    assert turns.inside == 0 and not turns.locked()


def test_one_slot_is_one_turn_at_a_time():
    assert ModelTurns(1).slots == ModelTurns(0).slots == 1


def _runner() -> StepRunner:
    r = StepRunner.__new__(StepRunner)  # the scheduling rule alone, without a llama.cpp context
    r._pending, r._last_singles = deque(), False
    return r


def test_replies_and_a_prompt_take_turns_and_singles_go_in_sequence_order():
    r = _runner()
    prompt = Step(seq=3, tokens=[1] * 700, start=0)
    r._pending.extend([Step(2, [5], 10), prompt, Step(0, [6], 7), Step(2, [8], 11)])
    first = r._take()
    assert [s.seq for s in first] == [0, 2] and first[1].tokens == [5], \
        "one token per sequence, its oldest first, in ascending sequence order"
    assert r._take()[0] is prompt, "after a group of replies' tokens, a prompt waiting goes next"
    r._pending.appendleft(prompt)  # the prompt has chunks left
    assert [s.seq for s in r._take()] == [2], "then the replies again"
    assert r._take()[0] is prompt, "then the prompt's next chunk"
    assert not r._pending


def test_without_replies_prompts_run_one_after_another():
    r = _runner()
    a, b = Step(0, [1, 2], 0), Step(1, [3, 4], 0)
    r._pending.extend([a, b])
    assert r._take()[0] is a and r._take()[0] is b


def test_parallel_is_read_from_the_environment_and_checked():
    assert load_settings(environ={"ISAGI_PARALLEL": "4"}).parallel == 4
    assert load_settings(environ={}, parallel=8).parallel == 8
    # left open: one slot for a single user, the servers' default for a server
    assert load_settings(environ={}).slots == 1
    assert load_settings(environ={}).for_server().slots == SERVER_PARALLEL
    assert load_settings(environ={"ISAGI_PARALLEL": "2"}).for_server().slots == 2, "a setting is kept"
    for bad in ("0", "65"):
        with pytest.raises(ConfigError, match="ISAGI_PARALLEL"):
            load_settings(environ={"ISAGI_PARALLEL": bad})
    with pytest.raises(ConfigError, match="whole number"):
        load_settings(environ={"ISAGI_PARALLEL": "many"})
