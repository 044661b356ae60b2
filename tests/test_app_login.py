"""Login throttling (per user name and per client address, with a growing
back-off), constant-time password checks, the reserved owner name, and what
the server cleans at start: temp files of killed saves. The upload limit
is the .miku reader's own limit. A fake engine; FastAPI's test client."""

from __future__ import annotations

import os
import time

import pytest

from isagi.app.login import Backoff, Logins
from isagi.app.server import MAX_UPLOAD_BYTES, create_app, parse_auth
from isagi.config import load_settings
from isagi.errors import ConfigError
from isagi.storage.miku import MAX_MIKU_BYTES
from tests.tiny_engine import engine_for


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_backoff_grows_after_the_allowed_failures_and_resets_on_success():
    clock = Clock()
    b = Backoff(3, 30.0, clock=clock)
    assert [b.failure("k") for _ in range(2)] == [0.0, 0.0]
    assert b.wait_s("k") == 0.0
    assert b.failure("k") == 30.0  # the third failure: refused for 30 s
    clock.t += 29
    assert 0 < b.wait_s("k") <= 1.0
    clock.t += 2
    assert b.wait_s("k") == 0.0
    assert b.failure("k") == 60.0 and b.failure("k") == 120.0  # doubled each time
    for _ in range(40):
        b.failure("k")
    assert b.wait_s("k") == 3600.0  # capped at an hour
    assert b.wait_s("other") == 0.0  # keys are independent
    b.success("k")
    assert b.wait_s("k") == 0.0


def test_backoff_table_is_bounded():
    b = Backoff(3, 30.0, max_keys=100)
    for i in range(1000):
        b.failure(f"made-up-{i}")
    assert len(b) <= 100


def test_logins_check_passwords_and_back_off_per_user():
    from fastapi import HTTPException

    clock = Clock()
    logins = Logins([("alice", "a"), ("bob", "b")], Backoff(3, 30.0, clock=clock))
    assert logins("alice", "a") is True
    assert logins("alice", "b") is False and logins("alice", "a ") is False
    assert logins("nobody", "a") is False and logins("nobody", "\0") is False and logins("x", "") is False
    assert logins("alice", "") is False  # third failure for alice
    with pytest.raises(HTTPException) as info:
        logins("alice", "a")  # even the right password waits now
    assert info.value.status_code == 429 and "try again in 30 s" in info.value.detail
    assert logins("bob", "b") is True  # bob is not affected
    clock.t += 31
    assert logins("alice", "a") is True


def test_auth_refuses_the_reserved_owner_name_and_duplicates():
    with pytest.raises(ConfigError, match="reserved"):
        parse_auth("local:pw")
    with pytest.raises(ConfigError, match="twice"):
        parse_auth("ann:a,ann:b")
    assert parse_auth(" ann :a") == [("ann", "a")]


def test_login_throttled_per_client_address_with_a_clear_message(tmp_path):
    from fastapi.testclient import TestClient

    settings = load_settings(environ={}, home=tmp_path, auth="alice:a,bob:b", login_max_failures=3,
                             login_backoff_s=60)
    app = create_app(engine_for(settings), settings)
    with TestClient(app) as client:
        for user in ("alice", "bob", "carol"):  # three names, one address
            assert client.post("/login", data={"username": user, "password": "x"}).status_code == 400
        r = client.post("/login", data={"username": "bob", "password": "b"})
        assert r.status_code == 429, r.text
        assert "Too many failed logins" in r.json()["detail"] and int(r.headers["retry-after"]) >= 59
    # per user name: failures from many addresses add up for that name
    app = create_app(engine_for(settings), settings)
    with TestClient(app) as first:
        for i in range(3):
            first.post("/login", data={"username": "alice", "password": f"x{i}"})
    user_backoff, client_backoff = app.state.isagi_logins
    assert user_backoff.wait_s("alice") > 0 and user_backoff.wait_s("bob") == 0


def test_start_removes_the_temp_files_of_killed_saves(tmp_path):
    """Alone on its data directory, a starting server removes every temporary file of a
    killed save, however young (no save can be in progress); with another ISAGI process
    on it (its lock held), only those untouched for a minute."""
    import fcntl

    from fastapi.testclient import TestClient

    settings = load_settings(environ={}, home=tmp_path)
    sessions = settings.sessions_dir
    sessions.mkdir(parents=True)
    stale = sessions / ".0123456789ab.miku.k2j3h4.tmp"
    fresh = sessions / ".0123456789ab.miku.zz9911.tmp"
    kept = sessions / "0123456789ab.miku"

    def leave() -> None:
        for p in (stale, fresh, kept):
            p.write_bytes(b"x")
        old = time.time() - 600
        os.utime(stale, (old, old))

    leave()
    with TestClient(create_app(engine_for(settings), settings)):
        assert not stale.exists() and not fresh.exists()
        assert kept.exists()  # a session file is never touched
    leave()
    with open(tmp_path / ".lock", "ab") as other:  # another ISAGI process on this data directory
        fcntl.flock(other, fcntl.LOCK_SH)
        with TestClient(create_app(engine_for(settings), settings)) as client:
            assert not stale.exists()
            assert fresh.exists() and kept.exists()  # perhaps the other process's save in progress
            assert client.app.state.isagi_data_dir.alone is False


def test_upload_limit_is_the_miku_readers_limit(tmp_path):
    from fastapi.testclient import TestClient

    assert MAX_UPLOAD_BYTES == MAX_MIKU_BYTES == 64 * 1024**2
    settings = load_settings(environ={}, home=tmp_path)
    app = create_app(engine_for(settings), settings)
    with TestClient(app) as client:
        big = b"\0" * (MAX_UPLOAD_BYTES + 1)
        r = client.post("/gradio_api/upload", files={"files": ("big.miku", big)})
        assert r.status_code == 413, r.text[:200]
        r = client.post("/gradio_api/upload", files={"files": ("small.miku", b"\0" * 1024)})
        assert r.status_code == 200
