"""Continue (issue 39): a reply cut at the token limit is extended by a new turn, recorded as its
continuation, and the session, its memory, the history store and the file all hold the reply as one.

On the tiny engine (a random transformers model built from a config, byte tokens: its replies
never end before the token limit, so every generated reply is cut) and on the page's handlers
over it, the same code the browser drives.
"""

from __future__ import annotations

import html
import re

import pytest

from isagi.app.views import chat_window
from isagi.engines.base import GenerationOptions
from isagi.errors import InputError
from isagi.manifold.sameness import content_key
from isagi.pipeline.engine import NOT_CUT
from isagi.pipeline.events import Done
from isagi.session.files import load_session
from isagi.session.turn import CONTINUE_TEXT
from tests.greedy import ROUNDING, assert_greedy, slack
from tests.test_app_ui import counts, make_ui, run
from tests.tiny_engine import tiny_engine, tiny_lm

Q = "How do plants make food?"


def test_a_reply_prefix_is_fed_as_the_prompt_then_the_replys_own_tokens():
    lm = tiny_lm()
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": Q}]
    prefix = "Plants use light, <b>water</b> and"
    with lm.generation(chat, 2, GenerationOptions(max_new_tokens=1), reply_prefix=prefix) as gen:
        fed = [int(t) for t in gen.input_ids[0].tolist()]
        assert gen.prompt_tokens == len(fed)
    assert fed == lm.chat_tokens(chat) + list(prefix.encode()), "the prompt ready to answer, then the prefix"
    # byte tokens: the same as the whole text, the template's open assistant turn and the reply in it
    assert bytes(fed).decode() == "".join(f"{m['role']}: {m['content']}\n" for m in chat) + "assistant:" + prefix
    with lm.generation(chat, 2, GenerationOptions(max_new_tokens=1)) as plain:
        assert plain.prompt_tokens == len(lm.chat_tokens(chat)), "no prefix: the prompt alone"


def test_a_greedy_reply_cut_and_continued_is_the_reply_decoded_in_one_go(tmp_path):
    engine = tiny_engine(tmp_path, max_new_tokens=8)
    whole = engine.turn(engine.new_session(), Q, options=GenerationOptions(max_new_tokens=8))
    s = engine.new_session()
    cut = engine.turn(s, Q, options=GenerationOptions(max_new_tokens=4))
    assert cut.cut and cut.new_tokens == 4
    done = [e for e in engine.continue_reply(s, GenerationOptions(max_new_tokens=4)) if isinstance(e, Done)]
    more = done[0].turn
    assert more.continues and more.user_text == CONTINUE_TEXT and more.verdict == "ok" and more.new_tokens == 4
    assert cut.reply_text + more.reply_text == whole.reply_text, "the model went on from where the reply stopped"
    assert more.prompt_tokens == cut.prompt_tokens + len(cut.reply_text.encode())
    assert s.exchanges() == [[{"role": "user", "content": Q}, {"role": "assistant", "content": whole.reply_text}]]
    assert s.memory.get(cut.memory_id)["reply_text"] == whole.reply_text, "memory answers with the whole reply"
    assert len(s.memory) == 1 and more.memory_id is None, "a continuation is not a new question"
    assert s.last_user_key() == content_key(Q), "the next question's context is the question, not the Continue"


def test_continue_moves_no_metric_and_regenerate_of_a_continuation_replaces_it(tmp_path):
    engine = tiny_engine(tmp_path, max_new_tokens=8)
    s = engine.new_session()
    engine.turn(s, Q, options=GenerationOptions(max_new_tokens=4))
    M = s.metric.M.copy()
    list(engine.continue_reply(s, GenerationOptions(max_new_tokens=4)))
    assert (s.metric.M == M).all()
    first = s.turns[-1].reply_text
    list(engine.regenerate(s, options=GenerationOptions(max_new_tokens=3)))
    assert len(s.turns) == 2 and s.turns[-1].continues and s.turns[-1].new_tokens == 3
    assert s.turns[-1].reply_text == first[:3], "greedy: the same continuation, three tokens this time"
    assert s.memory.get(s.turns[0].memory_id)["reply_text"] == s.turns[0].reply_text + first[:3]


def test_continue_is_refused_unless_the_last_reply_was_cut(tmp_path):
    engine = tiny_engine(tmp_path, max_new_tokens=8)
    s = engine.new_session()
    with pytest.raises(InputError, match="Nothing to continue"):
        engine.continue_reply(s)
    engine.turn(s, Q, options=GenerationOptions(max_new_tokens=4))
    engine.turn(s, Q)  # an exact repeat: answered from memory, not cut
    assert s.turns[-1].tier == "RETRIEVE" and not s.turns[-1].cut
    with pytest.raises(InputError) as exc:
        engine.continue_reply(s)
    assert str(exc.value) == NOT_CUT


def _reply_bubbles(chat: list[dict]) -> list[str]:
    return [m["content"] for m in chat if m["role"] == "assistant" and "isagi-info" not in m["content"]]


def test_the_page_continues_a_cut_reply_and_shows_it_as_one_everywhere(tmp_path):
    ui = make_ui(tmp_path)[0]
    sid = ui.page.registry.create()
    run(ui.chat.send(Q, sid, 4))
    s = ui.page.registry.entry(sid).session
    cut = s.turns[-1]
    assert cut.cut
    outs = run(ui.chat.continue_reply(sid, 4))
    assert not outs[-1].alert
    more = s.turns[-1]
    assert [t.continues for t in s.turns] == [False, True] and more.user_text == CONTINUE_TEXT
    assert counts(ui, sid) == (2, 2, 2), "session, history store and file agree"
    whole = cut.reply_text + more.reply_text
    assert s.memory.get(cut.memory_id)["reply_text"] == whole
    final = outs[-1].chat
    users = [m for m in final if m["role"] == "user"]
    assert len(users) == 1, "the continuation has no request of its own on the page"
    (bubble,) = _reply_bubbles(final)
    assert html.unescape(re.sub(r"<[^>]+>", "", bubble)).strip() == whole.strip(), "one reply: both parts"

    assert "continued" in final[-1]["content"], "its info line says the reply was continued"
    # the streamed updates grew the one reply, never a second question
    for out in outs:
        if isinstance(out.chat, list):
            assert len([m for m in out.chat if m["role"] == "user"]) == 1
    # after a reload: the file's turns show the same chat
    reloaded = load_session(ui.page.engine.frame, s.miku_path)
    assert [t.continues for t in reloaded.turns] == [False, True]
    assert chat_window(reloaded) == chat_window(s)
    # the history store keeps the continuation readably: its request is the marker
    rows = ui.page.engine.store.get_turns(sid, owner="local")
    assert [r.text for r in rows] == [Q, cut.reply_text, CONTINUE_TEXT, more.reply_text]
    # the next question's bubble carries its own position (Edit resends it there), the Continue counted
    users = [m["content"] for m in run(ui.chat.send("Why is the sky blue?", sid, 4))[-1].chat if m["role"] == "user"]
    assert "isagi-turn-0" in users[0] and "isagi-turn-2" in users[1] and len(users) == 2


def test_the_page_refuses_continue_after_a_reply_that_ended_by_itself(tmp_path):
    ui = make_ui(tmp_path)[0]
    sid = ui.page.registry.create()
    assert NOT_CUT in run(ui.chat.continue_reply(sid, 4))[-1].alert, "nothing sent yet"
    run(ui.chat.send(Q, sid, 4))
    run(ui.chat.send(Q, sid, 4))  # answered from memory: the stored reply, which did not stop at a limit
    out = run(ui.chat.continue_reply(sid, 4))
    assert NOT_CUT in out[-1].alert
    assert counts(ui, sid) == (2, 2, 2), "nothing was recorded"


def test_the_terminal_continues_a_cut_reply_and_a_continuation_cut_again(tmp_path):
    import io

    from rich.console import Console

    from isagi.console.terminal import CONTINUE, chat_loop

    engine = tiny_engine(tmp_path, max_new_tokens=4)
    session = engine.new_session()
    out, err = Console(file=io.StringIO(), width=200), Console(file=io.StringIO(), width=200)
    items = iter([Q, CONTINUE, "Why is the sky blue?", CONTINUE, CONTINUE])

    def read_line(_prompt: str) -> str:
        line = next(items, None)
        if line is None:
            raise EOFError
        return line

    # the last /continue follows a continuation that was cut again: it continues once more
    n = chat_loop(engine, session, GenerationOptions(max_new_tokens=4), interactive=False, out=out, err=err,
                  read_line=read_line)
    assert n == 5
    assert [t.continues for t in session.turns] == [False, True, False, True, True]
    assert [x["content"] for x, _ in session.exchanges()] == [Q, "Why is the sky blue?"]
    assert session.exchanges()[1][1]["content"] == "".join(t.reply_text for t in session.turns[2:])
    assert counts_in_file(engine, session) == 5


def counts_in_file(engine, session) -> int:
    return len(load_session(engine.frame, session.miku_path).turns)


def test_continue_after_stop_is_refused(tmp_path):
    import threading

    engine = tiny_engine(tmp_path, max_new_tokens=8)
    s = engine.new_session()
    stop = threading.Event()
    for event in engine.stream_turn(s, Q, stop=stop):
        if not isinstance(event, Done):
            stop.set()  # Stop after the first token
    assert s.turns[-1].verdict == "cancelled" and not s.turns[-1].cut
    with pytest.raises(InputError, match="Nothing to continue"):
        engine.continue_reply(s)


@pytest.mark.model
def test_on_the_real_model_a_greedy_reply_cut_and_continued_is_the_greedy_reply(llama_engine):
    """llama.cpp, the embedded GGUF: the reply so far is fed as its own tokens after the prompt
    (re-tokenised from its text), and greedy decoding goes on as it would have: the reply cut
    and continued is the greedy path of the question's prompt (tests/greedy.py: up to the
    rounding of batched kernels), and it parts from the reply decoded in one go, if at all,
    only at a near-tie. Continued after a closed and reopened turn instead, it is not."""
    q = "Write a short story about a lighthouse keeper."
    whole = llama_engine.turn(llama_engine.new_session(), q, options=GenerationOptions(max_new_tokens=32))
    s = llama_engine.new_session()
    cut = llama_engine.turn(s, q, options=GenerationOptions(max_new_tokens=16))
    assert cut.cut and cut.new_tokens == 16
    more = [e for e in llama_engine.continue_reply(s, GenerationOptions(max_new_tokens=16)) if isinstance(e, Done)][0].turn
    assert more.continues and more.verdict == "ok" and more.new_tokens == 16
    lm = llama_engine.lm
    prompt = llama_engine.prompts.messages(q, None, [])
    assert cut.reply_text.startswith(whole.reply_text[:20]) and len(cut.reply_text + more.reply_text) > 60
    # the reply so far as Continue feeds it (its text re-tokenised), then the continuation
    path = lm.tokenize(cut.reply_text, special=False) + lm.tokenize(more.reply_text, special=False)
    assert_greedy(lm, prompt, path, other=lm.tokenize(whole.reply_text, special=False))
    # the check tells a wrong context apart: the same reply so far after its turn was closed
    wrong = [*prompt, {"role": "assistant", "content": cut.reply_text}, {"role": "user", "content": "Go on."}]
    with lm.generation(wrong, lm.default_layer, GenerationOptions(max_new_tokens=16)) as gen:
        for _ in gen.stream():
            pass
        astray = list(gen.new_ids)
    assert slack(lm, prompt, lm.tokenize(cut.reply_text, special=False) + astray).max() > 4 * ROUNDING


def test_regenerate_on_the_page_after_continue_replaces_the_continuation_everywhere(tmp_path):
    ui = make_ui(tmp_path)[0]
    sid = ui.page.registry.create()
    run(ui.chat.send(Q, sid, 4))
    run(ui.chat.continue_reply(sid, 4))
    s = ui.page.registry.entry(sid).session
    outs = run(ui.chat.regenerate(sid, 4))
    assert not outs[-1].alert
    assert [t.continues for t in s.turns] == [False, True] and counts(ui, sid) == (2, 2, 2)
    assert s.memory.get(s.turns[0].memory_id)["reply_text"] == s.turns[0].reply_text + s.turns[1].reply_text
    for out in outs:  # the reply so far grows again in place: never a "[Continue]" question
        if isinstance(out.chat, list):
            assert [m for m in out.chat if m["role"] == "user"] == [out.chat[0]]
            assert CONTINUE_TEXT not in out.chat[0]["content"]
