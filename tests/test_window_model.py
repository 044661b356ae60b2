"""A long session on the real model through llama.cpp: past the prompt budget, the history
window drops old exchanges in blocks, and between drops each turn evaluates only its new
tokens because the previous turn's saved KV cache covers the rest (isagi.window,
isagi.engines.kv_prefix). The mechanism, not the timing: tokens are counted."""

from __future__ import annotations

import pytest

from isagi.agent import Engine
from isagi.bench.turn import NEW_QUESTIONS, history_exchanges
from isagi.engines.base import GenerationOptions
from isagi.turn import Turn
from isagi.window import KEEP_SHARE

pytestmark = pytest.mark.model

BUDGET = 512
REPLY_TOKENS = 24


def test_between_block_drops_a_turn_evaluates_only_its_new_tokens(llama_engine) -> None:
    settings = llama_engine.settings.with_overrides(prompt_token_budget=BUDGET, max_message_tokens=64)
    engine = Engine(settings, llama_engine.lm, llama_engine.profile, store=None)
    lm = engine.lm
    s = engine.new_session(autosave=False)
    s.turns += [Turn(user_text=q, reply_text=r, verdict="ok") for q, r in history_exchanges(12)]
    lm.prefixes.clear()  # as after loading the session: nothing saved yet
    turns = []
    for question in NEW_QUESTIONS[:12]:
        start, _ = engine.history_window(s, question)
        prompt = engine._prompt(s, question, None)
        lookup = engine._prompt(s, question, None, with_history=False)
        alone = len(lm.chat_tokens(lookup))
        before = lm.evaluated_tokens
        t = engine.turn(s, question, record=False, options=GenerationOptions(max_new_tokens=REPLY_TOKENS))
        assert t.generated and t.verdict == "ok"
        turns.append({"start": start, "ids": lm.chat_tokens(prompt), "alone": alone, "tier": t.tier,
                      "new_tokens": t.new_tokens, "evaluated": lm.evaluated_tokens - before,
                      # the lookup prompt evaluates its message and what follows it; its system prompt
                      # comes from a saved KV cache once there is one
                      "lookup": alone - lm.content_span(lookup)[0]})
        assert t.prompt_tokens == len(turns[-1]["ids"]) <= BUDGET

    first = turns[0]
    assert first["evaluated"] >= len(first["ids"]), "with nothing saved the whole window is evaluated"
    starts = [t["start"] for t in turns]
    assert starts == sorted(starts), "the window start never moves back"
    checked = drops = 0
    for prev, cur in zip(turns, turns[1:], strict=False):
        history = len(cur["ids"]) - cur["alone"]
        if cur["start"] != prev["start"]:
            drops += 1
            room = BUDGET - cur["alone"]
            assert history <= KEEP_SHARE * room, "a drop frees a block: the history takes about half the room"
            continue
        if "AUGMENT" in (prev["tier"], cur["tier"]):
            continue  # a related exchange sat in one of the prompts: they share less
        assert cur["ids"][: len(prev["ids"])] == prev["ids"], "the prompt extends the previous one"
        new = len(cur["ids"]) - len(prev["ids"])  # the previous reply, the new message, the template
        # every reply token but the last is fed back through the model while decoding
        prompt_evaluated = cur["evaluated"] - cur["lookup"] - (cur["new_tokens"] - 1)
        assert 0 < prompt_evaluated <= new + 1, (prompt_evaluated, new, history)
        assert new < history / 3, "the history itself is much larger than what the turn evaluated"
        checked += 1
    assert 1 <= drops <= len(turns) // 3, "the budget was passed, and the start moved in blocks"
    assert checked >= 5, f"only {checked} turns between drops were checked"
