"""``isagi sessions``: works as owner ``local`` unless ``--owner`` says otherwise;
another owner's session is "not found"; delete removes the history and the
session's autosaved .miku. Typer's runner on a real SQLite history."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from isagi.cli import app
from isagi.session.turn import Turn
from isagi.storage.history import HistoryStore


def _seed(home: Path) -> tuple[Path, Path]:
    home.mkdir(parents=True, exist_ok=True)
    sessions = home / "sessions"
    sessions.mkdir()
    store = HistoryStore(f"sqlite:///{home / 'history.sqlite3'}")
    files = []
    for sid, owner, text in (("aaaaaaaaaaaa", "alice", "alice private words"), ("111111111111", "local", "local words")):
        store.ensure_session(sid, owner=owner, model_id="m")
        store.record_turn(sid, Turn(user_text=text, reply_text="ok"), owner=owner)
        f = sessions / f"{sid}.miku"
        f.write_bytes(b"state")
        store.set_miku_path(sid, str(f), owner=owner)
        files.append(f)
    store.close()
    return files[0], files[1]


def test_sessions_commands_are_scoped_to_an_owner(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("ISAGI_DATABASE_URL", raising=False)
    home = tmp_path / "home"
    alice_file, local_file = _seed(home)
    run = CliRunner().invoke
    h = ["--home", str(home)]
    out = run(app, ["sessions", "list", "--json", *h])
    assert out.exit_code == 0 and [r["id"] for r in json.loads(out.stdout)] == ["111111111111"]
    out = run(app, ["sessions", "list", "--json", "--owner", "alice", *h])
    assert [r["id"] for r in json.loads(out.stdout)] == ["aaaaaaaaaaaa"]
    assert "alice private" not in run(app, ["sessions", "search", "private", *h]).stdout
    assert "alice private" in run(app, ["sessions", "search", "private", "--owner", "alice", *h]).stdout
    shown = run(app, ["sessions", "show", "aaaaaaaaaaaa", *h])
    assert shown.exit_code != 0 and "No session 'aaaaaaaaaaaa'" in shown.output
    assert "alice private" not in shown.output
    gone = run(app, ["sessions", "delete", "aaaaaaaaaaaa", *h])
    assert gone.exit_code == 1 and alice_file.exists()
    done = run(app, ["sessions", "delete", "111111111111", *h])
    assert done.exit_code == 0 and "111111111111.miku" in done.stdout
    assert not local_file.exists() and alice_file.exists()
    assert json.loads(run(app, ["sessions", "list", "--json", *h]).stdout) == []
