"""The session store's contract (isagi.session.store.SessionStore), run on both implementations:
the sessions directory and the PostgreSQL table replicas share (marker ``postgres``)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from isagi.bench.miku import synthetic_state
from isagi.errors import MikuError
from isagi.ids import new_session_id
from isagi.session.folder import SessionFiles
from isagi.storage.miku import decode_miku


@pytest.fixture(params=["directory", pytest.param("postgres", marks=pytest.mark.postgres)])
def files(request: pytest.FixtureRequest, tmp_path: Path):
    root = tmp_path / "sessions"
    if request.param == "directory":
        yield SessionFiles(root)
        return
    from isagi.session.dbstore import DatabaseSessionFiles

    store = DatabaseSessionFiles(request.getfixturevalue("pg_url"), root)
    try:
        yield store
    finally:
        store.close()


def _state(sid: str, turns: int, seed: int = 0):
    state = synthetic_state(turns, k=4, d=8, seed=seed, app_fields=True)
    state.extra["session_id"] = sid
    return state


def _texts(state) -> list[str]:
    return [m["text"] for m in state.conversation]


def test_write_read_find_list_remove(files) -> None:
    a, b = sorted(new_session_id() for _ in range(2))
    assert files.all() == [] and files.find(a) is None
    files.write(files.path(a), _state(a, 3))
    files.write(files.path(b), _state(b, 2))
    assert files.find(a) == files.path(a) == files.root / f"{a}.miku"
    assert files.all() == [files.path(a), files.path(b)]
    got = files.read(files.path(a))
    assert got.extra["session_id"] == a and _texts(got) == _texts(_state(a, 3))
    assert decode_miku(files.read_bytes(files.path(b))).extra["session_id"] == b
    assert files.modified(files.path(a)) is not None
    # the history's recorded path finds it too; one outside the folder never does
    assert files.find(a, str(files.path(a))) == files.path(a)
    assert files.find("not-an-id", "/elsewhere/x.miku") is None
    assert files.remove(a) == [files.path(a)]
    assert files.find(a) is None and files.all() == [files.path(b)] and files.modified(files.path(a)) is None
    with pytest.raises(MikuError):
        files.read(files.path(a))


def test_a_write_replaces_the_whole_file(files) -> None:
    sid = new_session_id()
    files.write(files.path(sid), _state(sid, 6, seed=1))
    files.write(files.path(sid), _state(sid, 2, seed=2))
    assert _texts(files.read(files.path(sid))) == _texts(_state(sid, 2, seed=2))
    assert len(files.all()) == 1


def test_a_reader_during_writes_sees_the_old_or_the_new_bytes_never_a_mix(files) -> None:
    sid = new_session_id()
    path = files.path(sid)
    old, new = _state(sid, 40, seed=3), _state(sid, 7, seed=4)
    files.write(path, old)
    allowed = [_texts(old), _texts(new)]
    stop = threading.Event()
    seen: list[list[str]] = []
    errors: list[BaseException] = []

    def read() -> None:
        while not stop.is_set():
            try:
                seen.append(_texts(files.read(path)))
            except BaseException as exc:  # a torn read: MikuError (checksum, truncation)
                errors.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(30):
            files.write(path, new if i % 2 == 0 else old)
    finally:
        stop.set()
        reader.join()
    assert not errors, errors[:1]
    assert seen and all(s in allowed for s in seen)


def test_a_path_outside_the_folder_is_a_local_file(files, tmp_path: Path) -> None:
    """A download or `isagi chat --save` names a file elsewhere: written there, on both stores."""
    sid = new_session_id()
    elsewhere = tmp_path / "downloads" / f"{sid}.miku"
    files.write(elsewhere, _state(sid, 1))
    assert elsewhere.is_file() and files.all() == []
    assert files.read(elsewhere).extra["session_id"] == sid


def test_the_setting_chooses_the_store(tmp_path: Path) -> None:
    from isagi.config import load_settings
    from isagi.errors import ConfigError
    from isagi.session.store import session_files

    default = load_settings(environ={"ISAGI_HOME": str(tmp_path)})
    assert default.sessions_url is None
    store = session_files(default)
    assert isinstance(store, SessionFiles) and store.root == tmp_path / "sessions" and not store.shared
    url = "postgresql+psycopg://u:p@127.0.0.1/db"
    assert load_settings(environ={"ISAGI_SESSIONS_URL": url}).sessions_url == url
    with pytest.raises(ConfigError, match="PostgreSQL URL"):
        load_settings(environ={"ISAGI_SESSIONS_URL": "sqlite:///x.db"})
