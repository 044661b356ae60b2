"""A chat killed with SIGKILL mid-save, then a restart: nothing kept is lost, and the
history and the session file agree.

The chatting process is a real one (:mod:`tests.fault_child`: the real engine on the
tiny model, the real keeper, a real SQLite history and real ``.miku`` files); it is
stopped at the two moments a save can be interrupted (its temporary file written but
not renamed; its file renamed but its history rows not committed) or at a random
moment, killed, and the data directory is opened again as ``isagi web`` opens it at
start (:func:`isagi.datadir.open_data_dir`).
"""

from __future__ import annotations

import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from isagi.datadir import open_data_dir
from isagi.session.turn import turns_from_messages
from isagi.storage.history import HistoryStore
from isagi.storage.miku import read_miku
from tests.tiny_engine import tiny_settings

ROOT = Path(__file__).resolve().parents[1]


class Child:
    """``python -m tests.fault_child HOME MODE TURNS``, its output lines read in a thread."""

    def __init__(self, home: Path, mode: str, turns: int = 3) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.fault_child", str(home), mode, str(turns)],
                                     cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def wait_for(self, pred, timeout: float = 180.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"child said {self.seen[-5:]}; exit code {self.proc.poll()}") from None
            self.seen.append(line)
            if pred(line):
                return line

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        while not self.lines.empty():
            self.seen.append(self.lines.get())

    @property
    def session(self) -> str:
        return next(line.split()[1] for line in self.seen if line.startswith("session "))

    @property
    def kept(self) -> int:
        return sum(line.startswith("kept ") for line in self.seen)


def _state(home: Path, sid: str) -> tuple[list[str], list[str]]:
    """(user texts in the session file, user texts in the history) of session ``sid``."""
    settings = tiny_settings(home)
    in_file = [t.user_text for t in turns_from_messages(read_miku(settings.sessions_dir / f"{sid}.miku").conversation)]
    store = HistoryStore(settings.resolved_database_url)
    try:
        in_history = [r.text for r in store.get_turns(sid, owner="local") if r.role == "user"]
    finally:
        store.close()
    return in_file, in_history


def _restart(home: Path):
    data = open_data_dir(tiny_settings(home))
    data.close()
    return data


def test_killed_before_the_rename_leaves_the_old_file_and_the_restart_removes_the_temp(tmp_path):
    child = Child(tmp_path, "before-rename", turns=3)
    child.wait_for(lambda line: line == "blocked")
    sessions = tiny_settings(tmp_path).sessions_dir
    temps = list(sessions.glob(".*.tmp"))
    assert len(temps) == 1 and temps[0].stat().st_size > 0  # written and synced, not yet renamed
    child.kill()
    data = _restart(tmp_path)
    assert data.alone and data.removed == temps and not temps[0].exists()  # however young it was
    in_file, in_history = _state(tmp_path, child.session)
    assert child.kept == 3 and in_file == in_history and len(in_file) == 3  # the turn in flight never was kept


def test_killed_between_the_file_and_the_history_the_restart_completes_the_history(tmp_path):
    child = Child(tmp_path, "before-history", turns=3)
    child.wait_for(lambda line: line == "blocked")
    child.kill()
    in_file, in_history = _state(tmp_path, child.session)
    assert len(in_file) == 4 and len(in_history) == 3  # the kill's gap: the file is ahead, never the history
    data = _restart(tmp_path)
    assert data.repair is not None and data.repair.added == {child.session: 1}
    assert any("added from the files" in line for line in data.lines())
    in_file, in_history = _state(tmp_path, child.session)
    assert in_file == in_history and len(in_file) == 4


@pytest.mark.slow
def test_killed_at_random_moments_nothing_kept_is_lost(tmp_path):
    rng = random.Random(2024)
    sessions: dict[str, int] = {}
    for _ in range(4):
        child = Child(tmp_path, "free")
        child.wait_for(lambda line: line.startswith("kept 2"))
        started = time.monotonic()
        child.wait_for(lambda line: line.startswith("kept 3"))
        time.sleep(rng.uniform(0, time.monotonic() - started))  # somewhere inside a turn
        child.kill()
        sessions[child.session] = child.kept
        data = _restart(tmp_path)
        assert data.alone and not list(tiny_settings(tmp_path).sessions_dir.glob(".*.tmp"))
        for sid, kept in sessions.items():
            in_file, in_history = _state(tmp_path, sid)
            assert in_file == in_history, sid
            assert len(in_file) >= kept, (sid, kept, len(in_file))
            assert in_file[:kept] == [f"message number {i}:" + " words" * (i % 7) for i in range(kept)]
