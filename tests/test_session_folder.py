"""SessionFiles (isagi.session.folder), the one owner of where a session's file lives: every
path it names, finds, lists or removes is a ``.miku`` directly inside the sessions folder, so a
path recorded elsewhere (a history row), a traversal id or a link out of the folder reaches
nothing outside it."""

from __future__ import annotations

from pathlib import Path

import pytest

from isagi.session.folder import SessionFiles


@pytest.fixture
def folder(tmp_path: Path) -> tuple[SessionFiles, Path, Path]:
    sessions = tmp_path / "sessions"
    sessions.mkdir()
    outside = tmp_path / "victim.miku"
    outside.write_bytes(b"keep me")
    (sessions / "fedcba987654.miku").symlink_to(outside)  # a link out of the folder
    return SessionFiles(sessions), sessions, outside


def test_a_session_autosaves_to_its_id_directly_in_the_folder(folder):
    files, sessions, _ = folder
    assert files.path("0123456789ab") == sessions / "0123456789ab.miku"
    for bad in ("../victim", "0123456789ab/..", "a\\b", "..", ".", "", "a\0b"):
        with pytest.raises(ValueError):
            files.path(bad)


def test_find_takes_the_recorded_file_or_the_ids_and_never_one_outside(folder):
    files, sessions, outside = folder
    own = sessions / "0123456789ab.miku"
    assert files.find("0123456789ab") is None  # nothing written yet
    own.write_bytes(b"x")
    assert files.find("0123456789ab") == own.resolve()
    assert files.find("0123456789ab", "0123456789ab.miku") == own.resolve()  # relative to the folder
    moved = sessions / "renamed-by-hand.miku"
    moved.write_bytes(b"y")
    assert files.find("aaaaaaaaaaaa", str(moved)) == moved.resolve()  # the recorded path first
    assert files.find("aaaaaaaaaaaa", str(outside)) is None
    assert files.find("fedcba987654") is None  # its name is in the folder, the file is not
    assert files.find("aaaaaaaaaaaa", "../victim.miku") is None


def test_remove_stays_inside_the_folder(folder):
    files, sessions, outside = folder
    own = sessions / "0123456789ab.miku"
    own.write_bytes(b"x")
    assert files.remove("0123456789ab", str(own)) == [own.resolve()]
    assert not own.exists()
    assert files.remove("0123456789ab") == []  # gone already: nothing, no error
    # a recorded path outside the folder, a traversal id, a link out: nothing removed
    assert files.remove("x", str(outside)) == []
    assert files.remove("../victim") == []
    assert files.remove("fedcba987654") == []
    assert outside.read_bytes() == b"keep me"


def test_all_lists_the_session_files_by_name_and_nothing_else(folder, tmp_path):
    files, sessions, _ = folder
    for name in ("bbbbbbbbbbbb.miku", "aaaaaaaaaaaa.miku", "notes.miku", "cccccccccccc.miku.tmp"):
        (sessions / name).write_bytes(b"x")
    # the link out of the folder is not one of them: the start-up repair reads what this lists
    assert [p.name for p in files.all()] == ["aaaaaaaaaaaa.miku", "bbbbbbbbbbbb.miku"]
    assert SessionFiles(tmp_path / "missing").all() == []
