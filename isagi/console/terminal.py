"""The terminal chat loop behind ``isagi chat``: read a line, stream the reply, repeat.

Owns what Ctrl-C means in the terminal. While a reply streams, Ctrl-C stops
that reply (the turn ends as ``cancelled``, is kept and recorded, and never
enters a later prompt) and the chat goes on; a second Ctrl-C within
:data:`DOUBLE_PRESS_S` seconds, or Ctrl-C (or Ctrl-D) at the prompt, leaves
the chat. The SIGINT handler that does this is installed only while a reply
streams (:class:`StopOnInterrupt`) and the previous one is put back in
``finally``.

With a pipe (not a terminal) the loop reads one message per line and prints
one reply per line, an empty line for an empty or refused input.

A line that is exactly :data:`REGENERATE` (``/regenerate``) is a command, not a
message: the last question runs again and its new reply replaces the last one
in the session, its file and the history store (the engine's
:meth:`~isagi.pipeline.engine.Engine.regenerate`, as the web page's Regenerate).
A line that is exactly :data:`CONTINUE` (``/continue``) extends the last reply when it was cut
at the token limit (:meth:`~isagi.pipeline.engine.Engine.continue_reply`, as the page's Continue);
its text streams on where the reply stopped.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from isagi.errors import InputError
from isagi.pipeline.events import Done, shown_text

DOUBLE_PRESS_S = 2.0  # a second Ctrl-C within this many seconds of the first leaves the chat
REGENERATE = "/regenerate"  # the command that runs the last question again (see the module's docstring)
CONTINUE = "/continue"  # the command that extends a reply cut at the token limit
HELP = (f"{REGENERATE} runs your last question again and replaces its reply; "
        f"{CONTINUE} extends a reply cut at the token limit")


class StopOnInterrupt:
    """While active, Ctrl-C sets ``stop``; a second Ctrl-C within ``window_s`` raises KeyboardInterrupt.

    Only the main thread can own SIGINT; elsewhere this does nothing (Ctrl-C
    then behaves as Python's default).
    """

    def __init__(self, stop: threading.Event, window_s: float = DOUBLE_PRESS_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stop = stop
        self.window_s = window_s
        self.clock = clock
        self.pressed_at: float | None = None
        self._previous: Any = None
        self._installed = False

    def _handle(self, signum: int, frame: Any) -> None:
        now = self.clock()
        if self.pressed_at is not None and now - self.pressed_at <= self.window_s:
            raise KeyboardInterrupt
        self.pressed_at = now
        self.stop.set()

    def __enter__(self) -> StopOnInterrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False


def chat_loop(
    engine: Any,
    session: Any,
    options: Any,
    *,
    interactive: bool,
    out: Any,
    err: Any,
    verbose: bool = False,
    quiet: bool = False,
    read_line: Callable[[str], str] = input,
) -> int:
    """Chat until end of input or Ctrl-C at the prompt; returns the number of turns run.

    ``out`` and ``err`` are rich consoles (stdout and stderr). After each reply, what the
    turn was in plain words goes to stderr (:func:`what_it_was`; ``quiet`` leaves it out,
    ``verbose`` adds its figures).
    """
    turns = 0
    while True:
        try:
            line = read_line("you> " if interactive else "")
        except (EOFError, KeyboardInterrupt):
            if interactive:
                err.print("")
            break
        if not line.strip():
            if not interactive:
                out.print("")  # one reply line per input line, even for an empty one
            continue
        try:
            if line.strip() == REGENERATE:
                start = engine.regenerate(session, options=_sampling(options), stop=(stop := threading.Event()))
            elif line.strip() == CONTINUE:
                start = engine.continue_reply(session, options, stop=(stop := threading.Event()))
            else:
                message = engine.check(line)  # an InputError here runs nothing
                start = engine.stream_turn(session, message, options=options, stop=(stop := threading.Event()))
            turn, notice = _one_turn(start, stop, interactive=interactive, out=out)
        except InputError as exc:
            err.print(str(exc), style="yellow", markup=False, highlight=False, soft_wrap=True)
            if not interactive:
                out.print("")
            continue
        except KeyboardInterrupt:  # the second Ctrl-C while a reply streamed
            if interactive:
                out.print()
            break
        turns += 1
        if notice:  # part of the turn could not be saved yet (a full disk): the chat goes on
            err.print(notice, style="yellow", markup=False, highlight=False, soft_wrap=True)
        if turn.verdict == "cancelled" and interactive:
            err.print("[dim](stopped; Ctrl-C again at the prompt leaves)[/]")
        if not quiet:
            err.print(f"[dim]({what_it_was(turn.tier, turn.verdict)})[/]", highlight=False)
        if verbose:
            teh = f"{turn.teh_prompt:.1f}%" if turn.teh_prompt is not None else "-"
            err.print(f"[dim]tier={turn.tier} d={turn.distance} zone={turn.zone} "
                      f"TEH={teh} verdict={turn.verdict} {turn.latency_s:.2f}s[/]")
    return turns


def what_it_was(tier: str | None, verdict: str) -> str:
    """A turn in the words the page and the README use: its tier for an answer ("answered from
    memory", "a new topic", ...), else what happened to it ("refused by the safety layer")."""
    from isagi.console.tables import TIER_WORDS, VERDICT_WORDS

    if verdict != "ok":
        return VERDICT_WORDS.get(verdict, verdict)
    return TIER_WORDS.get(tier or "", "answered")


def _sampling(options: Any) -> Any:
    """``options`` for a Regenerate: sampled, with a fresh seed (greedy decoding would repeat the reply)."""
    import dataclasses
    import random

    return dataclasses.replace(options, do_sample=True, seed=random.randrange(2**31))


def _one_turn(events: Any, stop: threading.Event, *, interactive: bool, out: Any) -> tuple[Any, str | None]:
    """Run one turn's ``events`` with Ctrl-C as ``stop``; print the reply as it streams (terminal)
    or as one line (pipe).

    Returns the turn and what of it could not be saved yet (the "done" event's notice)."""
    turn, notice = None, None
    # Ctrl-C means Stop from the moment the reply's prompt shows: "isagi> " is printed with the
    # handler installed (printed before it, a Ctrl-C right after it left the chat instead)
    with StopOnInterrupt(stop):
        if interactive:
            out.print("isagi> ", end="")
        for event in events:
            if isinstance(event, Done):
                turn, notice = event.turn, event.notice
            elif interactive and (text := shown_text(event)):
                out.print(text, end="", highlight=False, markup=False, soft_wrap=True)
    assert turn is not None
    if interactive:
        out.print()
    else:
        sys.stdout.write(turn.reply_text.replace("\r", " ").replace("\n", " ").strip() + "\n")
        sys.stdout.flush()
    return turn, notice
