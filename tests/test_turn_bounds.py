"""Bounded turns without a model: message validation, the prompt's token budget,
and which earlier exchanges may enter a prompt (Stop pollution, issue 14).

The engine runs with a byte-level stand-in tokenizer (one token per UTF-8 byte,
so an emoji is 4 tokens) and the real :class:`~isagi.engines.hf.model.LoadedModel`
template path; the model's context comes from its config as for a real model.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from isagi.config import load_settings
from isagi.engines.hf.model import LoadedModel
from isagi.errors import ConfigError, InputError
from isagi.pipeline.engine import Engine, Session
from isagi.pipeline.events import Done
from isagi.pipeline.prompts import clean_message
from isagi.session.turn import Turn, turns_from_messages, turns_to_messages

CONTEXT = 512


class ByteTokenizer:
    """One token per UTF-8 byte; the template writes "role: content" lines."""

    eos_token_id = 0
    unk_token_id = None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": list(text.encode("utf-8"))}

    def apply_chat_template(self, messages: list[dict[str, str]], **_: object) -> dict[str, torch.Tensor]:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        return {"input_ids": torch.tensor([list(text.encode())], dtype=torch.long)}


def _engine(tmp_path: Any, **overrides: Any) -> Engine:
    settings = load_settings(environ={}, home=tmp_path, device="cpu", system_prompt="Be brief.", **overrides)
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=CONTEXT))
    lm = LoadedModel(model=model, tokenizer=ByteTokenizer(), model_id="stub", source="config",
                     fingerprint="test", quant="none", device=torch.device("cpu"), device_reason="test")
    from isagi.engines.hf.engine import TransformersEngine

    return Engine(settings, TransformersEngine(lm), profile=None)


def _session(exchanges: list[tuple[str, str, str]]) -> Session:
    s = Session(id="s", basis=None, metric=None, memory=None)  # type: ignore[arg-type]
    s.turns += [Turn(user_text=user, reply_text=reply, verdict=verdict) for user, reply, verdict in exchanges]
    return s


# -- validation -----------------------------------------------------------------


@pytest.mark.parametrize("message", ["Hi \udcff", "\ud83d alone", "a\udfffb"])
def test_lone_surrogates_are_refused_with_one_line(message: str) -> None:
    with pytest.raises(InputError, match="not valid text") as info:
        clean_message(message)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("message", ["", "\x00\x00", "\x00 \x07\x1b", " \t\n ", "\u200b\u200d\ufeff", "\u2028\x85"])
def test_control_format_and_blank_only_messages_are_empty(message: str) -> None:
    with pytest.raises(InputError, match="empty"):
        clean_message(message)


def test_control_characters_are_removed_but_newlines_and_tabs_kept() -> None:
    assert clean_message("  a\x00b\x1b[31mc\r\n\td\x7f ") == "ab[31mc\n\td"
    assert clean_message("👩\u200d💻 ok") == "👩\u200d💻 ok"  # joiners inside real text stay


def test_the_token_limit_counts_tokens_not_characters(tmp_path: Any) -> None:
    engine = _engine(tmp_path, max_message_tokens=100)
    assert engine.prompts.validate("x" * 100) == "x" * 100
    emoji = "😀" * 30  # 30 characters, 120 byte tokens
    with pytest.raises(InputError) as info:
        engine.prompts.validate(emoji)
    assert "120 tokens" in str(info.value) and "limit is 100 tokens" in str(info.value)


def test_the_character_limit_still_applies_first(tmp_path: Any) -> None:
    engine = _engine(tmp_path, max_message_chars=10)
    with pytest.raises(InputError, match="11 characters; the limit is 10"):
        engine.prompts.validate("x" * 11)


def test_a_message_alone_over_the_prompt_budget_is_refused(tmp_path: Any) -> None:
    engine = _engine(tmp_path, max_new_tokens=256, max_message_tokens=1024)
    assert engine.prompts.budget == CONTEXT - 256  # the context caps the 2,048 default
    fits = "y" * (engine.prompts.budget - engine.prompts.prompt_tokens(engine.prompts.messages("", None, [])))
    assert engine.prompts.validate(fits) == fits
    with pytest.raises(InputError, match=f"prompt budget is {CONTEXT - 256}"):
        engine.prompts.validate(fits + "y")


def test_settings_for_the_budgets(tmp_path: Any) -> None:
    s = load_settings({"ISAGI_MAX_MESSAGE_TOKENS": "300", "ISAGI_PROMPT_TOKENS": "900"})
    assert (s.max_message_tokens, s.prompt_token_budget) == (300, 900)
    with pytest.raises(ConfigError, match="ISAGI_PROMPT_TOKENS"):
        load_settings({"ISAGI_MAX_MESSAGE_TOKENS": "300", "ISAGI_PROMPT_TOKENS": "200"})
    with pytest.raises(ConfigError, match="whole number"):
        load_settings({"ISAGI_MAX_MESSAGE_TOKENS": "many"})
    assert _engine(tmp_path, prompt_token_budget=100, max_message_tokens=50).prompts.budget == 100


# -- the budgeted prompt ------------------------------------------------------------


def test_history_beyond_the_budget_is_dropped_oldest_first_whole_exchanges(tmp_path: Any) -> None:
    engine = _engine(tmp_path, prompt_token_budget=200, max_message_tokens=50, max_new_tokens=16)
    s = _session([(f"question {i}", f"answer number {i} " + "z" * 7 * i, "ok") for i in range(10)])
    prompt = engine.prompts.build(s, "new question", None)
    assert engine.prompts.prompt_tokens(prompt) <= 200
    history = prompt[1:-1]
    full = s.chat_history()
    assert len(history) % 2 == 0 and 0 < len(history) < len(full)
    assert history == full[len(full) - len(history):], "the kept history is the newest whole exchanges"
    assert [m["role"] for m in history] == ["user", "assistant"] * (len(history) // 2)
    assert prompt[0]["role"] == "system" and prompt[-1] == {"role": "user", "content": "new question"}


@pytest.mark.parametrize("user, reply", [("hi", "hello"), ("Was ist 2+2? 😀", "4.\n- vier"), ("", "x" * 40)])
def test_an_exchange_is_counted_as_the_whole_prompt_counts_it(tmp_path: Any, user: str, reply: str) -> None:
    engine = _engine(tmp_path)
    asked = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": user}]
    alone = engine.prompts.prompt_tokens(asked)
    cost = engine.prompts.prompt_tokens([*asked, {"role": "assistant", "content": reply}, asked[1]]) - alone
    assert engine.prompts._exchange_tokens(_session([]), user, reply) == (cost, alone)
    assert engine.prompts._asking_tokens(user) == alone


def _grow(engine: Engine, s: Session, turns: int) -> list[list[dict[str, str]]]:
    """The prompts of ``turns`` more turns, each answered with a short reply that joins ``s``."""
    prompts = []
    for i in range(turns):
        question = f"{i} + {i}?"
        prompts.append(engine.prompts.build(s, question, None))
        s.turns.append(Turn(user_text=question, reply_text=f"{2 * i}.", verdict="ok"))
    return prompts


def test_between_drops_each_prompt_extends_the_last_one_and_drops_come_in_blocks(tmp_path: Any) -> None:
    """What lets the saved KV cache cover a turn's prompt: it starts with the previous prompt and reply."""
    engine = _engine(tmp_path, prompt_token_budget=400, max_message_tokens=60, max_new_tokens=16)
    s = _session([])
    prompts = _grow(engine, s, 80)
    drops = 0
    for i, (before, after) in enumerate(zip(prompts, prompts[1:], strict=False)):
        assert engine.prompts.prompt_tokens(after) <= 400
        asked, answered = before[-1], {"role": "assistant", "content": s.turns[i].reply_text}
        if after[: len(before) + 1] == [*before, answered]:
            continue  # the previous prompt, its reply, then the new message: only those are new
        drops += 1
        assert after[0] == before[0] and after[-3] == asked, "a drop keeps the system prompt and the newest"
        kept = engine.prompts.prompt_tokens(after) - engine.prompts.prompt_tokens([after[0], after[-1]])
        assert kept <= 0.5 * (400 - engine.prompts.prompt_tokens([after[0], after[-1]])), "a drop frees half the room"
    assert 2 <= drops <= 80 // 6, "the window moves in blocks, not one exchange per turn"


def test_the_window_is_the_same_after_save_and_load_and_for_a_regenerated_turn(tmp_path: Any) -> None:
    engine = _engine(tmp_path, prompt_token_budget=400, max_message_tokens=60, max_new_tokens=16)
    s = _session([])
    prompts = _grow(engine, s, 45)
    live = engine.prompts.build(s, "And the next one?", None)
    loaded = Session(id="s", basis=None, metric=None, memory=None,  # type: ignore[arg-type]
                     turns=turns_from_messages(turns_to_messages(s.turns)))
    assert engine.prompts.build(loaded, "And the next one?", None) == live, "a loaded session: the same window"
    # Regenerate undoes the last turn and asks it again: the window it had when first asked
    last = s.turns.pop()
    assert engine.prompts.build(s, last.user_text, None) == prompts[-1]
    s.turns.append(last)
    # refused and stopped turns between exchanges change nothing
    s.turns.insert(10, Turn(user_text="stopped story", reply_text="Once upon", verdict="cancelled"))
    assert engine.prompts.build(s, "And the next one?", None) == live


def test_the_newest_exchange_is_kept_when_it_fits_and_skipped_when_it_cannot(tmp_path: Any) -> None:
    engine = _engine(tmp_path, prompt_token_budget=140, max_message_tokens=50, max_new_tokens=16)
    s = _session([("old", "short", "ok"), ("newest", "n" * 40, "ok")])
    assert engine.prompts.build(s, "hi", None)[1:-1] == s.chat_history(), "both fit"
    huge = _session([("old", "short", "ok"), ("newest", "n" * 400, "ok")])
    assert engine.prompts.build(huge, "hi", None)[1:-1] == [], "older turns never jump the queue over a newer one"


def test_the_related_exchange_fits_the_budget_too(tmp_path: Any) -> None:
    engine = _engine(tmp_path, prompt_token_budget=200, max_message_tokens=50, max_new_tokens=16)
    s = _session([(f"q{i}", "a" * 30, "ok") for i in range(6)])
    related = {"query_text": "earlier", "reply_text": "r" * 60}
    with_related = engine.prompts.build(s, "now", related)
    # after the history, just before the message (the prompt still starts as the last turn's did)
    assert with_related[-3:-1] == [{"role": "user", "content": "earlier"}, {"role": "assistant", "content": "r" * 60}]
    assert engine.prompts.prompt_tokens(with_related) <= 200
    assert len(with_related) < len(engine.prompts.build(s, "now", None)) + 2, "history gave way to the related exchange"
    too_big = {"query_text": "earlier", "reply_text": "r" * 400}
    prompt = engine.prompts.build(s, "now", too_big)
    assert engine.prompts.prompt_tokens(prompt) <= 200 and all(m["content"] != "r" * 400 for m in prompt)


# -- Stop pollution ------------------------------------------------------------------


def test_cancelled_withheld_and_refused_turns_never_enter_a_prompt(tmp_path: Any) -> None:
    engine = _engine(tmp_path)
    s = _session([
        ("What is 2+2?", "4", "ok"),
        ("Tell me a long story", "Once upon a time a dragon", "cancelled"),
        ("Something harmful", "[reply withheld] no", "withheld"),
        ("Worse", "I can't help with that", "refused"),
        ("Capital of France?", "Paris", "ok"),
    ])
    # A file's user message without a reply (a turn that never finished) loads as a cancelled turn.
    s.turns += turns_from_messages([{"role": "user", "text": "Unanswered (a failed turn)"}])
    assert s.turns[-1].verdict == "cancelled"
    expected = [
        {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris"},
    ]
    assert s.chat_history() == expected
    prompt = engine.prompts.build(s, "What is 3 times 4?", None)
    assert prompt[1:-1] == expected
    text = " ".join(m["content"] for m in prompt)
    for leaked in ("dragon", "long story", "withheld", "harmful", "Worse", "Unanswered"):
        assert leaked not in text


def test_a_session_of_only_a_stopped_turn_gives_an_empty_history(tmp_path: Any) -> None:
    s = _session([("Tell me a story", "Once upon", "cancelled")])
    assert s.chat_history() == [] and list(s.recent_exchanges()) == []
    assert _engine(tmp_path).prompts.build(s, "What is 3 times 4?", None)[1:-1] == []


# -- the terminal ---------------------------------------------------------------------


def test_piped_invalid_utf8_and_nul_only_lines_give_one_line_errors(tmp_path: Any, monkeypatch: Any) -> None:
    from typer.testing import CliRunner

    import isagi.cli as cli

    engine = _engine(tmp_path)
    engine.new_session = lambda *a, **k: _session([])  # type: ignore[method-assign]
    monkeypatch.setattr(cli, "_engine", lambda settings, **_: engine)
    result = CliRunner().invoke(cli.app, ["chat", "--home", str(tmp_path)], input=b"Hi \xff\n\x00\x00\n")
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output and result.exception is None
    assert "not valid text" in result.output and "empty" in result.output
    assert result.stdout.count("\n") == 2, "one (empty) reply line per input line"


def test_a_related_exchange_already_in_the_history_is_not_repeated(tmp_path: Any) -> None:
    engine = _engine(tmp_path, prompt_token_budget=400, max_message_tokens=50, max_new_tokens=16)
    s = _session([("q0", "a0", "ok"), ("q1", "a1", "ok")])
    in_history = {"query_text": "q0", "reply_text": "a0"}
    prompt = engine.prompts.build(s, "now", in_history)
    assert prompt == engine.prompts.build(s, "now", None)
    assert [m["content"] for m in prompt].count("q0") == 1
    elsewhere = {"query_text": "q0", "reply_text": "another reply"}  # same question, other answer
    assert engine.prompts.build(s, "now", elsewhere)[-3:-1] == [
        {"role": "user", "content": "q0"}, {"role": "assistant", "content": "another reply"}]


def test_a_session_as_long_as_its_file_can_hold_refuses_the_next_turn_before_any_work(tmp_path) -> None:
    """At storage.miku.MAX_TURNS turns the next message is refused with one line that says
    what to do; nothing runs, the session is unchanged. Regenerate (which replaces the
    last turn) still works there."""
    from isagi.storage.miku import MAX_TURNS
    from tests.tiny_engine import tiny_engine

    engine = tiny_engine(tmp_path, with_store=False, max_new_tokens=4)
    session = engine.new_session()
    engine.turn(session, "the first question")
    session.turns[:] = session.turns * MAX_TURNS
    with pytest.raises(InputError, match="start a new chat") as err:
        engine.stream_turn(session, "one more question")
    assert "\n" not in str(err.value) and len(session.turns) == MAX_TURNS
    session.turns.pop()  # Regenerate: the caller undid the last turn, the new one replaces it
    events = list(engine.stream_turn(session, "the first question again", replaces_last=True))
    assert isinstance(events[-1], Done) and len(session.turns) == MAX_TURNS
