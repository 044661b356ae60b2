"""A long session on the real model through llama.cpp: past the prompt budget, the history
window drops old exchanges in blocks, and between drops each turn evaluates only its new
tokens because the previous turn's saved KV cache covers the rest (isagi.manifold.window,
isagi.engines.kv_prefix); with the context shift a drop turn does too. The mechanism, not the
timing: tokens are counted."""

from __future__ import annotations

import numpy as np
import pytest

from isagi.bench.turn import NEW_QUESTIONS, history_exchanges
from isagi.engines.base import REUSE_ANY, GenerationOptions
from isagi.manifold.window import KEEP_SHARE
from isagi.pipeline.engine import Engine, _prompt_key
from isagi.session.turn import Turn
from tests.greedy import assert_greedy

pytestmark = pytest.mark.model

BUDGET = 512
REPLY_TOKENS = 24


def _long_session_turns(llama_engine, context_shift: bool, in_conversation: bool = False) -> list[dict]:
    """12 turns of a session that starts with 12 exchanges past a 512-token budget, with what each
    turn's prompt was and how many tokens the turn evaluated (``in_conversation``: the message read
    in its conversation first, and alone only when that reading is not clearly safe)."""
    settings = llama_engine.settings.with_overrides(prompt_token_budget=BUDGET, max_message_tokens=64,
                                                    context_shift=context_shift, read_in_conversation=in_conversation)
    engine = Engine(settings, llama_engine.lm, llama_engine.profile, store=None)
    lm = engine.lm
    s = engine.new_session(autosave=False)
    s.turns += [Turn(user_text=q, reply_text=r, verdict="ok") for q, r in history_exchanges(12)]
    lm.prefixes.clear()  # as after loading the session: nothing saved yet
    turns = []
    for question in NEW_QUESTIONS[:12]:
        start, _ = engine.prompts.history_window(s, question)
        history = engine.prompts.fitting_history(s, question)
        prompt = engine.prompts.build(s, question, None, history=history)
        lookup = engine.prompts.build(s, question, None, with_history=False)
        before, shifts = lm.evaluated_tokens, lm.context_shifts
        t = engine.turn(s, question, record=False, options=GenerationOptions(max_new_tokens=REPLY_TOKENS))
        assert t.generated and t.verdict == "ok"
        plain = prompt
        if t.tier == "AUGMENT":  # the related exchange sits in the prompt too, unless the history holds it
            related = _record_of(s, t.nearest_query)
            prompt = engine.prompts.build(s, question, related, history=history)
        # the message read alone too (its states are then cached under the lookup prompt)?
        read_alone = _prompt_key(lookup) in s.prompt_states
        turns.append({"start": start, "prompt": prompt, "ids": lm.chat_tokens(prompt),
                      # read in the conversation, then alone: the reply's prompt was evaluated, saved
                      # and restored (a turn the counts below do not model)
                      "tier": "READ TWICE" if in_conversation and read_alone else t.tier,
                      "inserted": prompt != plain,
                      "alone": len(lm.chat_tokens(lookup)), "new_tokens": t.new_tokens,
                      "evaluated": lm.evaluated_tokens - before, "shifts": lm.context_shifts - shifts,
                      # the lookup prompt evaluates its message and what follows it; its system prompt
                      # comes from a saved KV cache once there is one
                      "lookup": len(lm.chat_tokens(lookup)) - lm.content_span(lookup)[0] if read_alone else 0})
        assert t.prompt_tokens == len(turns[-1]["ids"]) <= BUDGET
    return turns


def _record_of(session, query: str) -> dict:
    """The memory record of the exchange whose question was ``query``."""
    for rid in session.memory.ids:
        rec = session.memory.get(int(rid))
        if rec["query_text"] == query:
            return rec
    raise AssertionError(f"no exchange asked {query!r} in memory")


@pytest.mark.parametrize("context_shift, in_conversation", [(True, False), (False, False), (True, True)],
                         ids=["shift", "no-shift", "shift-read-in-conversation"])
def test_a_turn_evaluates_only_its_new_tokens_and_the_window_moves_in_blocks(llama_engine, context_shift,
                                                                             in_conversation) -> None:
    lm = llama_engine.lm
    turns = _long_session_turns(llama_engine, context_shift, in_conversation)
    first = turns[0]
    assert first["evaluated"] >= len(first["ids"]), "with nothing saved the whole window is evaluated"
    starts = [t["start"] for t in turns]
    assert starts == sorted(starts), "the window start never moves back"
    between = drops = 0
    for prev, cur in zip(turns, turns[1:], strict=False):
        if prev["inserted"] or cur["inserted"] or "READ TWICE" in (prev["tier"], cur["tier"]):
            continue  # a related exchange sat in one of the prompts (they share less), or a prompt was read twice
        history = len(cur["ids"]) - cur["alone"]
        dropped = 2 * (cur["start"] - prev["start"])  # messages of the exchanges the window dropped
        # the previous prompt without the dropped exchanges starts the new one; the rest is new:
        # the previous reply (fed back while it was decoded), the new message, the template
        kept = lm.chat_tokens([prev["prompt"][0], *prev["prompt"][1 + dropped :]])
        assert cur["ids"][: len(kept)] == kept
        new = len(cur["ids"]) - len(kept)
        # every reply token but the last is fed back through the model while decoding
        prompt_evaluated = cur["evaluated"] - cur["lookup"] - (cur["new_tokens"] - 1)
        assert new < history / 3, "the history itself is much larger than what is new"
        if not dropped:
            between += 1
            assert 0 < prompt_evaluated <= new + 1, (prompt_evaluated, new, history)
            assert cur["shifts"] == 0
            continue
        drops += 1
        room = BUDGET - cur["alone"]
        assert history <= KEEP_SHARE * room, "a drop frees a block: the history takes at most half the room"
        if context_shift:  # the previous turn's cache with the dropped exchanges cut out
            assert cur["shifts"] == 1 and 0 < prompt_evaluated <= new + 1, (prompt_evaluated, new, history)
        else:  # the kept history is evaluated again
            assert cur["shifts"] == 0 and prompt_evaluated >= history
    if in_conversation:  # a shifted history's states are not exact: such a turn reads the message alone too
        shifted = [t for t in turns if t["shifts"]]
        assert 1 <= len(shifted) <= len(turns) // 3, "the budget was passed, and the start moved in blocks"
        assert all(t["tier"] == "READ TWICE" for t in shifted), [t["tier"] for t in shifted]
    else:
        assert 1 <= drops <= len(turns) // 3, "the budget was passed, and the start moved in blocks"
    assert between >= 5, f"only {between} turns between drops were checked"


def test_a_shifted_cache_decodes_as_the_whole_prompt_evaluated_again(default_llama) -> None:
    """The context shift: the previous turn's cache with the oldest exchanges cut out and the rest
    moved down gives the reply a full evaluation of the new prompt gives (the same greedy path up
    to rounding, states alike)."""
    e = default_llama
    system = {"role": "system", "content": "You are a helpful assistant."}
    history = [m for q, r in history_exchanges(16)
               for m in ({"role": "user", "content": q}, {"role": "assistant", "content": r})]
    layer = e.default_layer
    e.prefixes.clear()
    earlier = [system, *history, {"role": "user", "content": "Why is the sea salty?"}]
    with e.generation(earlier, layer, GenerationOptions(max_new_tokens=12), reuse_prefix=REUSE_ANY) as gen:
        for _ in gen.stream():
            pass
        reply = gen.text
    later = [system, *history[12:], earlier[-1], {"role": "assistant", "content": reply},
             {"role": "user", "content": "How do bees make honey?"}]
    options = GenerationOptions(max_new_tokens=24)

    def decode(shift: bool) -> tuple[list[int], np.ndarray, int, int]:
        before, shifts = e.evaluated_tokens, e.context_shifts
        with e.generation(later, layer, options, reuse_prefix=REUSE_ANY, context_shift=shift) as gen:
            gen.prefill()
            assert e._ll.llama_memory_seq_pos_min(e._mem, 0) == 0
            assert e._ll.llama_memory_seq_pos_max(e._mem, 0) == len(gen.ids) - 1, "positions without a gap"
            for _ in gen.stream():
                pass
            return gen.new_ids, gen.reply_hidden(), e.evaluated_tokens - before, e.context_shifts - shifts

    shifted_ids, shifted_states, shifted_cost, shifts = decode(True)
    e.prefixes.clear()
    whole_ids, whole_states, whole_cost, _ = decode(False)
    prompt = len(e.chat_tokens(later))
    assert shifts == 1 and shifted_cost < prompt / 4 < prompt <= whole_cost
    # the same greedy path, up to the rounding of rotated keys (tests/greedy.py): both are the
    # greedy path of the new prompt evaluated whole, parting (if at all) at a near-tie only
    assert_greedy(e, later, shifted_ids, other=whole_ids)
    same = next((i for i, (a, b) in enumerate(zip(shifted_ids, whole_ids, strict=False)) if a != b), len(whole_ids))
    assert same >= 1, (e.detokenize(shifted_ids), e.detokenize(whole_ids))
    a, b = shifted_states[:same], whole_states[:same]
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    assert cos.min() > 0.99, cos
