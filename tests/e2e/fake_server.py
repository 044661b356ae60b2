"""A live ``isagi web`` on the tiny test engine, for browser tests that need the page,
the sessions and the history store but not the real model (fast to start anywhere).

    python -m tests.e2e.fake_server --port 7861

The app is the real one (:func:`app.server.create_app`, Gradio, FastAPI, the
session registry, a real SQLite history store and real ``.miku`` autosaves
under ``ISAGI_HOME``); the engine is the real :class:`isagi.pipeline.engine.Engine` on the
tiny random model of :mod:`tests.tiny_engine` (readable noise for replies). Settings come from the environment as for ``isagi web``
(:func:`isagi.config.load_settings`), so ``ISAGI_AUTH`` works the same.

``--reply TEXT`` makes every generated reply that text (the real decoding still
runs, with its states, its guard and Stop; each token carries the next piece of
TEXT over the first 24 tokens, one token every ``--token-delay-s`` so the page sees it
stream): for tests of what the page does with a reply's text, e.g. a hostile one.

``--refuse-marker TEXT`` makes the safety layer refuse every message containing TEXT
(the tiny profile's thresholds refuse nothing otherwise): for tests of what the page
does after a refusal.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from collections.abc import Iterator
from typing import Any


class ScriptedDecoding:
    """A real decoding whose tokens carry ``script``, ``per_token`` characters each."""

    def __init__(self, real: Any, script: str, per_token: int, delay_s: float) -> None:
        self._real, self._script, self._per_token, self._delay_s = real, script, per_token, delay_s
        self._shown = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def __enter__(self) -> ScriptedDecoding:
        self._real.__enter__()
        return self

    def __exit__(self, *exc: object) -> Any:
        return self._real.__exit__(*exc)

    @property
    def text(self) -> str:
        return self._script[: self._shown]

    def stream(self) -> Iterator[Any]:
        for event in self._real.stream():
            if self._shown >= len(self._script):
                return  # the script is told: the reply ends there, whatever the reply limit
            piece = self._script[self._shown : self._shown + self._per_token]
            self._shown += len(piece)
            time.sleep(self._delay_s)
            yield dataclasses.replace(event, text=piece)


def script_replies(engine: Any, script: str, tokens: int, delay_s: float) -> None:
    """Every reply of ``engine`` generates ``script``, spread over its first ``tokens`` tokens,
    one token every ``delay_s`` seconds."""
    real = engine.lm.generation
    per_token = max(1, math.ceil(len(script) / max(1, tokens)))
    engine.lm.generation = lambda *a, **k: ScriptedDecoding(real(*a, **k), script, per_token, delay_s)


def refuse_containing(engine: Any, marker: str) -> None:
    """``engine`` refuses every message containing ``marker`` as its safety layer refuses: a
    ``refused`` turn, nothing generated."""
    from isagi.session.turn import Turn

    real = engine._guard

    def guard(p: Any) -> tuple[float, Any]:
        teh_prompt, refusal = real(p)
        if refusal is None and marker in p.text:
            refusal = Turn(user_text=p.text, reply_text="I can't help with that (refused in this test).",
                           zone=p.zone, teh_prompt=teh_prompt, verdict="refused", category="test",
                           prompt_tokens=p.prompt_tokens, new_tokens=0)
        return teh_prompt, refusal

    engine._guard = guard


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=7861)
    p.add_argument("--slow-load", type=float, default=0.0,
                   help="seconds the page-load handler waits first (what a busy server does to it)")
    p.add_argument("--reply", help="the text every generated reply streams (default: the model's own)")
    p.add_argument("--token-delay-s", type=float, default=0.02, help="with --reply: seconds per token")
    p.add_argument("--refuse-marker", help="refuse every message containing this text")
    p.add_argument("--load-gate", help="the model 'loads' until this file exists (/health says loading)")
    args = p.parse_args(argv)

    from isagi.app.server import create_app, uvicorn_options
    from isagi.app.shutdown import run_server
    from isagi.config import load_settings
    from tests.tiny_engine import tiny_engine

    env = load_settings()  # ISAGI_HOME, ISAGI_AUTH, ... as for `isagi web`
    # the server's reply limit is the page's too (issue 37: the page can no longer ask past it), so
    # the fake keeps the real default; tests that want short replies set the slider lower
    engine = tiny_engine(env.home, auth=env.auth, api_keys=env.api_keys, max_new_tokens=env.max_new_tokens)
    if args.slow_load > 0:
        _slow_down_page_load(args.slow_load)
    if args.reply:
        script_replies(engine, args.reply, tokens=24, delay_s=args.token_delay_s)
    if args.refuse_marker:
        refuse_containing(engine, args.refuse_marker)
    app = create_app(gated(engine, args.load_gate) if args.load_gate else engine, engine.settings)
    try:
        run_server(app, args.host, args.port, **uvicorn_options(env))  # as isagi web: the same shutdown
    finally:
        if engine.store is not None:
            engine.store.close()


def gated(engine: Any, gate: str) -> Any:
    """A loader factory that reports loading the model until the file ``gate`` exists, then
    hands over ``engine``: a page opened meanwhile sees the model loading, for as long as the
    test wants."""
    from pathlib import Path

    from isagi.app.loader import LOADING

    def factory(progress: Any) -> Any:
        progress(LOADING, 0, 1)
        while not Path(gate).exists():
            time.sleep(0.2)
        return engine

    return factory


def _slow_down_page_load(seconds: float) -> None:
    """Make every page load take ``seconds`` longer, as a loaded 2-core server does."""
    import time

    from isagi.app.handlers.chat import ChatHandlers

    on_load = ChatHandlers.on_load

    def slow_on_load(self, *args, **kwargs):
        time.sleep(seconds)
        return on_load(self, *args, **kwargs)

    ChatHandlers.on_load = slow_on_load


if __name__ == "__main__":
    main()
