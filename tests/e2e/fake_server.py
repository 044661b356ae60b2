"""A live ``isagi web`` on the fake engine, for browser tests that need the page,
the sessions and the history store but not the model (fast to start anywhere).

    python -m tests.e2e.fake_server --port 7861 [--token-delay 0.02]

The app is the real one (:func:`app.server.create_app`, Gradio, FastAPI, the
session registry, a real SQLite history store and real ``.miku`` autosaves
under ``ISAGI_HOME``); only the engine is :class:`tests.test_app_fakes.FakeEngine`
(a scripted token stream). Settings come from the environment as for ``isagi web``
(:func:`isagi.config.load_settings`), so ``ISAGI_AUTH`` works the same.
"""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=7861)
    p.add_argument("--token-delay", type=float, default=0.01, help="seconds per fake token")
    args = p.parse_args(argv)

    import uvicorn

    from app.server import create_app
    from isagi.config import load_settings
    from storage.history import HistoryStore
    from tests.test_app_fakes import FakeEngine

    settings = load_settings()
    store = HistoryStore(settings.resolved_database_url)
    engine = FakeEngine(settings, token_delay=args.token_delay, store=store)
    app = create_app(engine, settings)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5)
    finally:
        store.close()


if __name__ == "__main__":
    main()
