"""Session retention (issue 37): ISAGI_SESSION_RETENTION and ``isagi sessions prune`` remove the
sessions last updated before the cut-off, their history rows and their files, and nothing else:
not a newer session, not one the server has open, not a file outside the sessions folder."""

from __future__ import annotations

import datetime as dt
import json
import os
import time
from pathlib import Path

import pytest
from sqlalchemy import update

from isagi.config import load_settings
from isagi.errors import ConfigError
from isagi.session.folder import SessionFiles
from isagi.session.retention import DAY_S, RetentionTimer, prune_sessions
from isagi.storage.history import SessionModel
from tests.tiny_engine import tiny_engine


def _age(engine, sid: str, days: float) -> None:
    """Make session ``sid`` last updated ``days`` ago: its history row and its file."""
    then = time.time() - days * DAY_S
    with engine.store.engine.begin() as conn:
        conn.execute(update(SessionModel).where(SessionModel.id == sid)
                     .values(updated_at=dt.datetime.fromtimestamp(then, dt.UTC)))
    path = SessionFiles(engine.settings.sessions_dir).path(sid)
    os.utime(path, (then, then))


@pytest.fixture()
def sessions(tmp_path: Path):
    """Four sessions of two owners, each with an exchange in the history and a file: old (40 days),
    old and open in the server, new (1 day), and an old file the history has no row for."""
    engine = tiny_engine(tmp_path / "home")
    made = {}
    for name, owner in (("old", "alice"), ("live", "bob"), ("new", "alice"), ("orphan", "bob")):
        s = engine.new_session()
        s.owner = owner
        engine.turn(s, f"hello from the {name} session")
        made[name] = s.id
    for name in ("old", "live", "orphan"):
        _age(engine, made[name], 40)
    _age(engine, made["new"], 1)
    engine.store.delete_session(made["orphan"], owner="bob")  # its row lost; its file stays
    yield engine, made
    engine.store.close()


def test_prune_removes_the_old_sessions_rows_and_files_and_nothing_else(sessions) -> None:
    engine, made = sessions
    files = SessionFiles(engine.settings.sessions_dir)
    outside = engine.settings.sessions_dir.parent / "keep-me.miku"
    outside.write_bytes(b"not a session of the folder")
    dry = prune_sessions(engine.store, files, 30, is_live=lambda sid: sid == made["live"], dry_run=True)
    assert sorted(dry.sessions) == sorted([made["old"], made["orphan"]]) and files.find(made["old"])
    pruned = prune_sessions(engine.store, files, 30, is_live=lambda sid: sid == made["live"])
    assert sorted(pruned.sessions) == sorted([made["old"], made["orphan"]]) and pruned.kept_live == 1
    assert len(pruned.files) == 2
    times = engine.store.session_times()
    assert made["old"] not in times and made["live"] in times and made["new"] in times
    assert files.find(made["old"]) is None and files.find(made["orphan"]) is None
    assert files.find(made["live"]) and files.find(made["new"]) and outside.is_file()
    assert engine.store.list_sessions(owner="alice")[0].id == made["new"]
    # a second pass finds nothing more to do
    again = prune_sessions(engine.store, files, 30, is_live=lambda sid: sid == made["live"])
    assert again.sessions == [] and again.kept_live == 1


def test_the_cli_prunes_by_hand_and_refuses_a_bad_age(sessions) -> None:
    from typer.testing import CliRunner

    from isagi.cli import app

    engine, made = sessions
    home = str(engine.settings.home)
    runner = CliRunner()
    bad = runner.invoke(app, ["sessions", "prune", "--older-than", "0", "--home", home])
    assert bad.exit_code == 2 and "above 0" in bad.output and "Traceback" not in bad.output
    shown = runner.invoke(app, ["sessions", "prune", "--older-than", "30", "--home", home, "--json"])
    assert shown.exit_code == 0, shown.output
    data = json.loads(shown.stdout)
    assert set(data["sessions"]) == {made["old"], made["live"], made["orphan"]}, "by hand: no server, none open"
    assert made["new"] in engine.store.session_times()


def test_prune_by_hand_refuses_while_a_server_uses_the_data_directory(sessions) -> None:
    """A server saves the sessions it has open again at shutdown (and the next start puts them
    back in the history): pruning beside it deleted sessions that came back. It is refused while
    another process holds the data directory, and runs once it has let go."""
    from typer.testing import CliRunner

    from isagi.cli import app
    from isagi.datadir import open_data_dir

    engine, made = sessions
    home = str(engine.settings.home)
    server = open_data_dir(engine.settings, repair=False)  # what isagi web holds while it runs
    try:
        refused = CliRunner().invoke(app, ["sessions", "prune", "--older-than", "30", "--home", home])
        assert refused.exit_code == 2 and "another ISAGI process" in refused.output, refused.output
        assert made["old"] in engine.store.session_times(), "nothing was removed"
    finally:
        server.close()
    done = CliRunner().invoke(app, ["sessions", "prune", "--older-than", "30", "--home", home])
    assert done.exit_code == 0 and made["old"] not in engine.store.session_times()


def test_the_timer_runs_at_start_after_the_server_is_ready_and_survives_a_failed_pass() -> None:
    calls: list[str] = []
    ready_called = []

    def run():
        calls.append("run")
        if len(calls) == 1:
            raise OSError("No space left on device")
        from isagi.session.retention import Pruned
        return Pruned()

    timer = RetentionTimer(run, interval_s=0.05, ready=lambda: ready_called.append(1) or True)
    timer.start()
    deadline = time.time() + 5
    while len(calls) < 2 and time.time() < deadline:
        time.sleep(0.01)
    timer.stop()
    assert ready_called == [1] and len(calls) >= 2, "a failed pass is tried again"
    never = RetentionTimer(lambda: calls.append("never"), ready=lambda: False)
    never.start()
    never.stop()
    assert "never" not in calls


@pytest.mark.parametrize(("value", "days"), [("30", 30.0), ("0.5", 0.5), ("keep", None), ("", None)])
def test_the_retention_setting_reads_days_or_keep(tmp_path: Path, value: str, days: float | None) -> None:
    s = load_settings(environ={"ISAGI_SESSION_RETENTION": value}, home=tmp_path)
    assert s.session_retention_days == days


@pytest.mark.parametrize("value", ["0", "-3", "abc", "nan", "1_0", "\u0663", "infinity", "0x10"])
def test_a_bad_retention_setting_says_what_to_set(tmp_path: Path, value: str) -> None:
    with pytest.raises(ConfigError, match="ISAGI_SESSION_RETENTION"):
        load_settings(environ={"ISAGI_SESSION_RETENTION": value}, home=tmp_path)


def test_a_server_with_a_retention_removes_old_sessions_when_it_starts(sessions) -> None:
    from fastapi.testclient import TestClient

    from isagi.app.server import create_app

    engine, made = sessions
    settings = engine.settings.with_overrides(session_retention_days=30)
    app = create_app(engine, settings, page=False)
    with TestClient(app, client=("127.0.0.1", 5000)):
        deadline = time.time() + 10
        while {made["old"], made["live"]} & set(engine.store.session_times()) and time.time() < deadline:
            time.sleep(0.05)  # the pass removes them one after the other
        times = engine.store.session_times()
        assert made["old"] not in times and made["new"] in times and made["live"] not in times
        assert SessionFiles(settings.sessions_dir).find(made["old"]) is None
        # (the orphan's row is written back from its file by the start-up repair, dated now)


def test_the_idle_time_is_a_setting(tmp_path: Path) -> None:
    from isagi.app.server import create_app
    from tests.tiny_engine import tiny_engine

    assert load_settings(environ={}, home=tmp_path).web_idle_minutes == 30.0
    s = load_settings(environ={"ISAGI_IDLE_MINUTES": "0.5"}, home=tmp_path)
    engine = tiny_engine(tmp_path / "home", with_store=False)
    app = create_app(engine, s, page=False)
    assert app.state.isagi_registry.idle_s == 30.0
    with pytest.raises(ConfigError, match="ISAGI_IDLE_MINUTES"):
        load_settings(environ={"ISAGI_IDLE_MINUTES": "0"}, home=tmp_path)
