"""A full disk and a read-only data directory, for real: small tmpfs mounts.

A full tmpfs gives the real ENOSPC (and SQLite's real "database or disk is full");
a tmpfs remounted read-only gives the real EROFS (chmod would not stop root). The
tests need to mount (root, or CAP_SYS_ADMIN) and are skipped, saying so, where
that is not permitted.

What they hold the app to: messages shown to the browser are one line and name no
server path or URL; nothing is lost (a turn made while the disk was full reaches
the file and the history once there is room, or at the next start); ``isagi web``
and ``isagi chat`` refuse a data directory they cannot write with one line and
exit status 2.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from isagi.app.loader import EngineHolder
from isagi.app.ui import WebUI
from isagi.datadir import open_data_dir
from isagi.session.registry import SessionRegistry
from isagi.session.service import SessionService
from isagi.session.turn import turns_from_messages
from isagi.storage.miku import read_miku
from tests.tiny_engine import tiny_engine, tiny_settings

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def tmpfs(where: Path, size: str = "4m") -> Iterator[Path]:
    """A fresh tmpfs of ``size`` mounted at ``where`` (unmounted afterwards), or a skip."""
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here (needs root or CAP_SYS_ADMIN): "
                    f"{done.stderr.strip() or done.returncode}")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)


def read_only(where: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True, capture_output=True)


class Filler:
    """Fills a file system to the last byte (real ENOSPC) and frees it again."""

    def __init__(self, root: Path) -> None:
        self.path = root / "filler"

    def fill(self) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            size = 65536
            while size:
                try:
                    os.write(fd, b"\0" * size)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC
                    size //= 2  # down to the last byte
        finally:
            os.close(fd)

    def free(self) -> None:
        self.path.unlink(missing_ok=True)


def run(gen) -> list:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gr.Warning outside a request falls back to warnings
        return list(gen)


def quiet(fn, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args)


def make_ui(home: Path, **kw) -> WebUI:
    engine = tiny_engine(home, max_new_tokens=6, **kw)
    holder = EngineHolder(engine)
    return WebUI(holder, SessionService(SessionRegistry(lambda: holder.engine, idle_s=600)), engine.settings)


def file_texts(path: Path) -> list[str]:
    return [t.user_text for t in turns_from_messages(read_miku(path).conversation)]


def history_texts(ui: WebUI, sid: str) -> list[str]:
    return [r.text for r in ui.page.engine.store.get_turns(sid, owner="local") if r.role == "user"]


def assert_public_line(alert: str, *server_strings: str) -> None:
    """One line, a plain reason, no server path, URL or database name in it."""
    text = alert.replace("⚠️ ", "")
    for part in text.split("\n\n"):  # a verdict line and a notice are separate paragraphs
        assert "\n" not in part.strip(), alert
    assert "the disk is full" in text, alert
    for s in server_strings:
        assert s not in text, (s, alert)
    assert "sqlite" not in text.lower() and "://" not in text and "/tmp" not in text, alert


def test_a_full_disk_loses_nothing_and_tells_the_browser_plainly(tmp_path):
    with tmpfs(tmp_path / "home") as home:
        ui = make_ui(home)
        disk = Filler(home)
        sid = ui.page.registry.create()
        run(ui.chat.send("first question", sid, 4))
        disk.fill()
        updates = run(ui.chat.send("second question", sid, 4))
        alert = updates[-1].alert
        assert_public_line(alert, str(home), ui.page.settings.resolved_database_url)
        assert "next message" in alert
        session = ui.page.registry.entry(sid).session
        assert [t.user_text for t in session.turns] == ["first question", "second question"]  # shown and kept
        assert file_texts(session.miku_path) == ["first question"] == history_texts(ui, sid)
        # New chat on the full disk: no unhandled error, the old chat stays in memory
        fresh = quiet(ui.chat.new_chat, sid)
        new, note = fresh.state, fresh.alert
        assert new and new != sid and sid in ui.page.registry
        assert_public_line(note, str(home))
        # the user can still take the whole chat away: downloads are made outside the data directory
        saved = quiet(ui.files.save_miku, sid).files_note
        assert saved.startswith("Saved 2 trajectories and 2 turns"), saved
        disk.free()
        assert ui.page.registry.save_all() == 1  # e.g. at shutdown: the file, then its history
        assert file_texts(session.miku_path) == ["first question", "second question"] == history_texts(ui, sid)
        ui.page.engine.store.close()


@contextlib.contextmanager
def history_filled_at_the_second_turn(tmp_path: Path) -> Iterator[tuple[WebUI, Filler, str, str, str]]:
    """The history on a 1 MiB tmpfs of its own (the sessions have room): a turn "one", then the
    history's disk filled and a turn "two"; yields (ui, the filler, the session id, the second
    turn's alert, the database URL)."""
    with tmpfs(tmp_path / "db", size="1m") as db:
        url = f"sqlite:///{db / 'history.sqlite3'}"
        ui = make_ui(tmp_path / "home", database_url=url)
        disk = Filler(db)
        sid = ui.page.registry.create()
        run(ui.chat.send("one", sid, 4))
        disk.fill()
        yield ui, disk, sid, run(ui.chat.send("two", sid, 4))[-1].alert, url


def test_turns_made_while_the_database_was_full_reach_the_history(tmp_path):
    """The history on its own full file system (the sessions have room): the file has every
    turn at once, the history gets them at the next turn once there is room, or, after a
    crash, at the next start."""
    with history_filled_at_the_second_turn(tmp_path) as (ui, disk, sid, alert, url):
        assert_public_line(alert, url, str(disk.path.parent))
        assert "history could not record" in alert
        path = ui.page.registry.entry(sid).session.miku_path
        assert file_texts(path) == ["one", "two"] and history_texts(ui, sid) == ["one"]
        disk.free()
        assert run(ui.chat.send("three", sid, 4))[-1].alert == ""  # all recorded: nothing to say
        assert history_texts(ui, sid) == ["one", "two", "three"] == file_texts(path)
        disk.fill()
        run(ui.chat.send("four", sid, 4))
        assert history_texts(ui, sid) == ["one", "two", "three"]
        ui.page.engine.store.close()  # the server dies here, with "four" only in the file
        disk.free()
        data = open_data_dir(ui.page.settings)  # the next start
        data.close()
        assert data.repair.added == {sid: 1}
        ui2 = make_ui(tmp_path / "home", database_url=url)
        assert history_texts(ui2, sid) == ["one", "two", "three", "four"] == file_texts(path)
        ui2.page.engine.store.close()


def test_when_the_servers_retry_writes_history_rows_a_full_database_held_back_the_page_says_saved(tmp_path):
    """Only the history's file system full (the session file is written): the turn's notice says
    its rows wait; once there is room, the server's own retry (no new message) writes them and the
    page's next sync says "Saved" (before: the warning stayed, only a file retry said Saved)."""
    from isagi.session.registry import SAVED_AGAIN

    with history_filled_at_the_second_turn(tmp_path) as (ui, disk, sid, alert, _url):
        assert "history could not record" in alert
        assert ui.page.registry.retry_history() == 1 and history_texts(ui, sid) == ["one"]
        disk.free()
        assert ui.page.registry.retry_history() == 0  # the server's round, every few seconds
        assert history_texts(ui, sid) == ["one", "two"]
        update = quiet(ui.chat.sync, sid, None)
        assert update.alert == SAVED_AGAIN
        assert quiet(ui.chat.sync, sid, None).alert != SAVED_AGAIN  # said once
        ui.page.engine.store.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _isagi(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    env.pop("ISAGI_HOME", None)
    return subprocess.run([sys.executable, "-m", "isagi.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120, input="hello\n")


@pytest.mark.parametrize("command", ["web", "chat"])
def test_a_read_only_data_directory_ends_the_command_with_one_line_and_status_2(tmp_path, command):
    with tmpfs(tmp_path / "home") as home:
        (home / "sessions").mkdir()
        read_only(home)
        extra = ["--port", str(_free_port())] if command == "web" else []
        done = _isagi(command, "--home", str(home), *extra)
        assert done.returncode == 2, done.stderr[-2000:]
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
        assert lines[0] == (f"error: cannot write to the data directory {home} (Read-only file system): make it "
                            "writable, or point ISAGI_HOME (--home) at a writable directory.")


def test_a_full_data_directory_ends_isagi_web_with_one_line_and_status_2(tmp_path):
    with tmpfs(tmp_path / "home", size="1m") as home:
        Filler(home).fill()
        done = _isagi("web", "--home", str(home), "--port", str(_free_port()))
        assert done.returncode == 2
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "(No space left on device): free some space." in lines[0], done.stderr


def test_a_read_only_data_directory_is_refused_before_anything_is_served(tmp_path):
    """The same check in process: :class:`DataDirError`, one line, nothing left behind."""
    from isagi.errors import DataDirError

    with tmpfs(tmp_path / "home") as home:
        read_only(home)
        with pytest.raises(DataDirError) as info:
            open_data_dir(tiny_settings(home))
        assert "\n" not in str(info.value) and "Read-only file system" in str(info.value)


def test_the_server_saves_what_a_full_disk_held_back_within_seconds_of_space_returning(tmp_path):
    """Issue 37: a turn in an existing chat and a new chat's first turn, made on a full disk, are
    written by the server on its own once space returns (before: only at the user's next
    message, a close or a shutdown, so a kill in between lost them); the page then says so."""
    from isagi.session.registry import SAVED_AGAIN

    with tmpfs(tmp_path / "home") as home:
        ui = make_ui(home)
        registry = ui.page.registry
        disk = Filler(home)
        old = registry.create()
        run(ui.chat.send("first question", old, 4))
        disk.fill()
        run(ui.chat.send("second question", old, 4))
        new = registry.create()
        run(ui.chat.send("a new chat on a full disk", new, 4))
        new_session = registry.entry(new).session
        assert registry.retry_saves() == [], "no room yet: nothing written, nothing lost"
        assert file_texts(registry.entry(old).session.miku_path) == ["first question"]
        registry.start_reaper(interval_s=60, retry_s=0.1)
        try:
            disk.free()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and (
                    not Path(new_session.miku_path).is_file() or len(history_texts(ui, old)) < 2):
                time.sleep(0.05)
        finally:
            registry.stop_reaper()
        # what a SIGKILL now would leave: every finished turn in its file and in the history
        assert file_texts(registry.entry(old).session.miku_path) == ["first question", "second question"]
        assert history_texts(ui, old) == ["first question", "second question"]
        assert file_texts(new_session.miku_path) == ["a new chat on a full disk"] == history_texts(ui, new)
        assert not ui.page.engine.keep.unsaved(new_session)
        # the page's next periodic check replaces the "not saved" notice
        shown = quiet(ui.chat.sync, old, None)
        assert shown.alert == SAVED_AGAIN
        from isagi.app.updates import KEEP

        assert quiet(ui.chat.sync, old, shown.seen).alert is KEEP, "said once"
        ui.page.engine.store.close()


def test_the_api_says_saved_once_the_server_has_written_what_a_full_disk_held_back(tmp_path):
    from fastapi.testclient import TestClient

    from isagi.app.server import create_app
    from isagi.session.registry import SAVED_AGAIN

    with tmpfs(tmp_path / "home") as home:
        engine = tiny_engine(home, max_new_tokens=6)
        app = create_app(engine, engine.settings, page=False)
        registry = app.state.isagi_registry
        disk = Filler(home)
        with TestClient(app, client=("127.0.0.1", 5000)) as client:
            registry.stop_reaper()  # this test turns the retry by hand

            def ask(messages, sid=None):
                r = client.post("/v1/chat/completions", headers={"X-Isagi-Session": sid} if sid else {},
                                json={"model": engine.lm.model_id, "messages": messages})
                assert r.status_code == 200, r.text
                return r.json()

            disk.fill()
            first = ask([{"role": "user", "content": "a question on a full disk"}])
            sid = first["isagi"]["session"]
            assert "could not be saved (the disk is full)" in first["isagi"]["notice"]
            disk.free()
            assert registry.retry_saves() == [sid]
            assert file_texts(registry.entry(sid).session.miku_path) == ["a question on a full disk"]
            reply = first["choices"][0]["message"]["content"]
            second = ask([{"role": "user", "content": "a question on a full disk"},
                          {"role": "assistant", "content": reply},
                          {"role": "user", "content": "and another"}], sid)
            assert second["isagi"]["notice"] == SAVED_AGAIN
        engine.store.close()


def test_a_reload_while_the_disk_is_still_full_says_again_that_the_chat_is_not_saved(tmp_path):
    """The page reloaded before space returned shows the unsaved chat with its warning again
    (before: an empty alert, as if all were saved)."""
    with tmpfs(tmp_path / "home", size="3m") as home:
        ui = make_ui(home)
        disk = Filler(home)
        sid = ui.page.registry.create()
        run(ui.chat.send("one", sid, 4))
        disk.fill()
        assert "the disk is full" in run(ui.chat.send("two", sid, 4))[-1].alert
        again = quiet(ui.chat.on_load, sid)
        assert again.state == sid and "the disk is full" in (again.alert or "")
        disk.free()
        ui.page.registry.retry_saves()
        assert not quiet(ui.chat.on_load, sid).alert  # saved now: nothing to warn about
        ui.page.engine.store.close()
