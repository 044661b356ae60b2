"""A live ``isagi web`` on the tiny test engine, for browser tests that need the page,
the sessions and the history store but not the real model (fast to start anywhere).

    python -m tests.e2e.fake_server --port 7861

The app is the real one (:func:`app.server.create_app`, Gradio, FastAPI, the
session registry, a real SQLite history store and real ``.miku`` autosaves
under ``ISAGI_HOME``); the engine is the real :class:`isagi.agent.Engine` on the
tiny random model of :mod:`tests.tiny_engine` (readable noise for replies). Settings come from the environment as for ``isagi web``
(:func:`isagi.config.load_settings`), so ``ISAGI_AUTH`` works the same.
"""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=7861)
    p.add_argument("--slow-load", type=float, default=0.0,
                   help="seconds the page-load handler waits first (what a busy server does to it)")
    args = p.parse_args(argv)

    import uvicorn

    from app.server import create_app, uvicorn_options
    from isagi.config import load_settings
    from tests.tiny_engine import tiny_engine

    env = load_settings()  # ISAGI_HOME, ISAGI_AUTH, ... as for `isagi web`
    engine = tiny_engine(env.home, auth=env.auth, max_new_tokens=min(env.max_new_tokens, 48))
    if args.slow_load > 0:
        _slow_down_page_load(args.slow_load)
    app = create_app(engine, engine.settings)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5,
                    **uvicorn_options(env))
    finally:
        if engine.store is not None:
            engine.store.close()


def _slow_down_page_load(seconds: float) -> None:
    """Make every page load take ``seconds`` longer, as a loaded 2-core server does."""
    import time

    from app.ui import WebUI

    on_load = WebUI.on_load

    def slow_on_load(self, *args, **kwargs):
        time.sleep(seconds)
        return on_load(self, *args, **kwargs)

    WebUI.on_load = slow_on_load


if __name__ == "__main__":
    main()
