"""Messages for the browser name no server path or URL: app.public on real error messages
(a real SQLite "database or disk is full", a real failed .miku write), and /health's error
of a failed load. The log keeps the detail."""

from __future__ import annotations

from pathlib import Path

import pytest

from isagi.app.public import public_text
from isagi.config import load_settings
from isagi.errors import StorageError, storage_cause
from isagi.session.turn import Turn
from isagi.storage.history import HistoryStore


def _history_full_error(tmp_path: Path) -> StorageError:
    from tests.test_persist import Disk

    store = HistoryStore(f"sqlite:///{tmp_path / 'my data' / 'history.sqlite3'}")
    Disk(store).fill()
    try:
        with pytest.raises(StorageError) as info:
            store.record_exchange("s1", Turn(user_text="q" * 5000, reply_text="a"), owner="local", model_id="m")
    finally:
        store.close()
    return info.value


def test_real_storage_errors_lose_their_paths_and_urls_but_keep_their_cause(tmp_path):
    exc = _history_full_error(tmp_path)
    assert str(tmp_path) in str(exc) and "sqlite:///" in str(exc)  # the terminal's message names both
    shown = public_text(str(exc), [str(tmp_path / "my data")])
    assert str(tmp_path) not in shown and "sqlite" not in shown and "my data" not in shown
    assert shown.endswith("database or disk is full") and storage_cause(exc) == "the disk is full"

    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    from isagi.session.files import session_state
    from isagi.storage.miku import write_miku
    from tests.test_persist import _Engine, _real_session

    with pytest.raises(StorageError) as info:  # a real OSError from the writer: its folder is a file
        write_miku(blocker / "s.miku", session_state(_Engine().frame, _real_session(tmp_path)))
    shown = public_text(str(info.value))
    assert str(tmp_path) not in shown and "a server file" in shown, shown


@pytest.mark.parametrize("message, expected", [
    ("Could not save the session to /srv/isagi/sessions/ab.miku: No space left on device.",
     "Could not save the session to a server file: No space left on device."),
    ("Cannot open the history database postgresql+psycopg://u:***@db:5432/isagi: refused",
     "Cannot open the history database the database: refused"),
    ("see ~/.isagi/sessions.", "see a server file."),
    ("and/or 1/2 of TEH 3.5/100 (127.0.0.1)", "and/or 1/2 of TEH 3.5/100 (127.0.0.1)"),  # not paths
])
def test_public_text(message, expected):
    assert public_text(message) == expected


def test_a_failed_load_shows_no_server_path_on_the_page_or_health(tmp_path):
    from fastapi.testclient import TestClient

    from isagi.app.server import create_app

    settings = load_settings(environ={}, home=tmp_path)
    secret = tmp_path / "models" / "weights.gguf"

    def factory(progress):
        raise StorageError(f"Cannot read {secret}: permission denied")

    app = create_app(factory, settings)
    with TestClient(app) as client:
        app.state.isagi_holder.wait(30)
        body = client.get("/health").json()
        assert body == {"status": "failed", "error": "Cannot read a server file: permission denied"}
        assert str(tmp_path) not in app.state.isagi_ui.page.status_line()
