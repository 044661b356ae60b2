"""Ctrl-C in ``isagi chat`` (isagi.console.terminal): the first stops the reply, not the chat;
a second one (within DOUBLE_PRESS_S, or at the prompt) leaves. Real SIGINTs sent to
this process while the real turn streams on the tiny model."""

from __future__ import annotations

import contextlib
import io
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from isagi.console.terminal import StopOnInterrupt, chat_loop
from isagi.engines.hf.generation import GenerationOptions
from isagi.pipeline.events import Token
from tests.tiny_engine import tiny_engine

STORY = "Tell me a long story about a dragon."
QUESTION = "What is 3 times 4?"


@pytest.fixture(autouse=True)
def default_sigint() -> Iterator[None]:
    """Each test starts with Python's own Ctrl-C handler, whatever the test run inherited: a run
    started in the background by a non-interactive shell (``make test &``) has SIGINT ignored,
    and a child process inherits that, so the terminal would never see Ctrl-C."""
    before = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def consoles() -> tuple[Console, Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, width=200), Console(file=io.StringIO(), width=200), buf


def lines(*items: str | type[BaseException]):
    """A read_line that returns each item in turn (an exception class is raised), then EOF."""
    it = iter(items)

    def read(_prompt: str) -> str:
        item = next(it, EOFError)
        if isinstance(item, type):
            raise item
        return item

    return read


def interrupt_after(engine: Any, tokens: int, presses: int = 1) -> list[int]:
    """Make the engine's next stream send ``presses`` SIGINTs to this process after ``tokens`` tokens."""
    real = engine.stream_turn
    sent: list[int] = []

    def stream(*args: Any, **kwargs: Any) -> Iterator[Any]:
        n = 0
        for event in real(*args, **kwargs):
            yield event
            n += isinstance(event, Token)
            if n == tokens and not sent:
                for _ in range(presses):
                    sent.append(1)
                    signal.raise_signal(signal.SIGINT)
        engine.stream_turn = real

    engine.stream_turn = stream
    return sent


def test_the_handler_sets_stop_then_raises_and_is_removed() -> None:
    before = signal.getsignal(signal.SIGINT)
    stop = threading.Event()
    t = [100.0]
    with StopOnInterrupt(stop, window_s=2.0, clock=lambda: t[0]) as guard:
        assert signal.getsignal(signal.SIGINT) == guard._handle
        signal.raise_signal(signal.SIGINT)
        assert stop.is_set()
        t[0] += 5.0  # a second press long after the first: another stop, not a leave
        signal.raise_signal(signal.SIGINT)
        t[0] += 0.5
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) == before


def test_ctrl_c_stops_the_reply_and_the_chat_goes_on(tmp_path: Path) -> None:
    engine = tiny_engine(tmp_path)
    session = engine.new_session()
    out, err, buf = consoles()
    sent = interrupt_after(engine, tokens=3)
    options = GenerationOptions(max_new_tokens=200, ignore_eos=True)
    n = chat_loop(engine, session, options, interactive=True, out=out, err=err,
                  read_line=lines(STORY, QUESTION, KeyboardInterrupt, "never read"))
    assert sent == [1] and n == 2
    stopped, answered = session.turns
    assert stopped.verdict == "cancelled" and 3 <= stopped.new_tokens < 200 and stopped.reply_text
    assert answered.verdict == "ok" and answered.user_text == QUESTION
    # the stopped story is not in the next prompt: the question was asked as if first
    alone = engine.prompts.prompt_tokens([{"role": "system", "content": engine.settings.system_prompt},
                                  {"role": "user", "content": QUESTION}])
    assert answered.prompt_tokens == alone
    assert [r.verdict for r in engine.store.get_turns(session.id, owner="local")] == ["cancelled"] * 2 + ["ok"] * 2
    assert "isagi> " in buf.getvalue()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_ctrl_c_during_a_reply_leaves(tmp_path: Path) -> None:
    engine = tiny_engine(tmp_path)
    session = engine.new_session()
    out, err, _ = consoles()
    sent = interrupt_after(engine, tokens=2, presses=2)
    options = GenerationOptions(max_new_tokens=200, ignore_eos=True)
    n = chat_loop(engine, session, options, interactive=True, out=out, err=err,
                  read_line=lines(STORY, QUESTION))
    assert sent == [1, 1] and n == 0, "left at once: the next line is never read"
    assert session.turns == [] and not engine.model_turns.locked()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_piped_lines_get_one_reply_line_each(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    engine = tiny_engine(tmp_path)
    session = engine.new_session()
    out, err, _ = consoles()
    n = chat_loop(engine, session, GenerationOptions(max_new_tokens=6), interactive=False, out=out, err=err,
                  read_line=lines(QUESTION, QUESTION))
    assert n == 2 and [t.tier for t in session.turns] == ["EXPLORE", "RETRIEVE"]
    printed = capsys.readouterr().out.splitlines()
    expected = [t.reply_text.replace("\r", " ").replace("\n", " ").strip() for t in session.turns]
    assert printed == expected


CHILD = """
import faulthandler
import signal
import sys
faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for the stacks of a child that hangs
from isagi import cli
from isagi.pipeline.engine import Engine
from tests.tiny_engine import tiny_lm, tiny_profile

cli._engine = lambda settings, with_store=True: Engine.start(
    settings, with_store=with_store, lm=tiny_lm(), profile=tiny_profile())
sys.argv = ["isagi", "chat", "--home", sys.argv[1], "--max-new-tokens", "1500"]
cli.main()
"""


def _read_until(fd: int, needle: bytes, seen: bytearray, timeout: float = 120.0) -> None:
    import os
    import select
    import time

    deadline = time.monotonic() + timeout
    while needle not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"timed out waiting for {needle!r}; got {bytes(seen[-400:])!r}"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # the child closed the terminal
                chunk = b""
            assert chunk, f"the chat ended before {needle!r}; got {bytes(seen[-400:])!r}"
            seen += chunk


def _wait_or_dump(pid: int, fd: int, seen: bytearray, timeout: float = 60.0) -> int:
    """The child's wait status; a child still running after ``timeout`` (it once hung after the last
    Ctrl-C, under load, in a run of the whole suite) fails the test with every thread's stack."""
    import os
    import select
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.1)
    os.kill(pid, signal.SIGUSR1)  # faulthandler writes the stacks to the terminal
    with contextlib.suppress(AssertionError):
        _read_until(fd, b"Thread", seen, timeout=5.0)
    while select.select([fd], [], [], 1.0)[0]:  # the rest of the stacks, until the terminal is quiet
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        seen += chunk
    raise AssertionError(f"isagi chat did not leave {timeout:.0f} s after Ctrl-C at the prompt; it printed:\n"
                         + bytes(seen[-6000:]).decode(errors="replace"))


def test_isagi_chat_in_a_terminal_ctrl_c_stops_the_reply_then_leaves(tmp_path: Path) -> None:
    """A real terminal (a pty): Ctrl-C (0x03, the line discipline sends SIGINT) during a reply stops
    it and the prompt comes back; the next question is answered; Ctrl-C at the prompt leaves, status 0."""
    import os
    import pty
    import sys
    import time

    from isagi.config import load_settings
    from isagi.storage.history import HistoryStore

    home = tmp_path / "home"
    pid, fd = pty.fork()
    if pid == 0:  # the child: the CLI in the pty, with the tiny engine
        os.chdir(Path(__file__).resolve().parent.parent)
        os.execv(sys.executable, [sys.executable, "-c", CHILD, str(home)])
    seen = bytearray()
    try:
        _read_until(fd, b"you> ", seen)
        os.write(fd, STORY.encode() + b"\r")
        _read_until(fd, b"isagi> ", seen)
        time.sleep(0.5)  # some tokens stream
        os.write(fd, b"\x03")
        _read_until(fd, b"stopped", seen)
        del seen[: seen.index(b"stopped")]  # the first prompt's "you> " must not count as this one
        _read_until(fd, b"you> ", seen)
        os.write(fd, QUESTION.encode() + b"\r")
        del seen[:]
        _read_until(fd, b"isagi> ", seen)
        _read_until(fd, b"you> ", seen)  # answered, back at the prompt
        os.write(fd, b"\x03")
        status = _wait_or_dump(pid, fd, seen)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0
    store = HistoryStore(load_settings(environ={}, home=home).resolved_database_url)
    (summary,) = store.list_sessions(owner="local")
    rows = store.get_turns(summary.id, owner="local")
    assert summary.turns == 2 and [r.verdict for r in rows] == ["cancelled"] * 2 + ["ok"] * 2
    assert 0 < rows[1].new_tokens < 1500 and rows[2].text == QUESTION


def test_each_reply_is_followed_by_what_the_turn_was_in_plain_words_unless_quiet(tmp_path: Path) -> None:
    """Issue 39: the terminal says after each reply what the turn was, in the README's words
    ("a new topic", "answered from memory"), not only with -v; -q leaves it out."""
    engine = tiny_engine(tmp_path)
    session = engine.new_session()
    out, _, _ = consoles()
    said = io.StringIO()
    err = Console(file=said, width=200)
    chat_loop(engine, session, GenerationOptions(max_new_tokens=6), interactive=False, out=out, err=err,
              read_line=lines(QUESTION, QUESTION))
    assert [t.tier for t in session.turns] == ["EXPLORE", "RETRIEVE"]
    assert said.getvalue().splitlines() == ["(a new topic)", "(answered from memory)"]
    quiet = io.StringIO()
    chat_loop(engine, engine.new_session(), GenerationOptions(max_new_tokens=6), interactive=False, out=out,
              err=Console(file=quiet, width=200), quiet=True, read_line=lines(QUESTION))
    assert quiet.getvalue() == ""
