"""isagi.persist.TurnKeeper on a real SQLite history store: one store write per turn, the
file path told to the store when it is new to it, and again after the session row is gone."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from isagi.persist import TurnKeeper
from isagi.session import Session
from isagi.turn import Turn
from storage.history import HistoryStore


def _session(tmp_path: Path) -> Session:
    from isagi.cog import Metric
    from isagi.memory import TrajectoryMemory
    from isagi.ugt import Basis

    basis = Basis(np.eye(8, 4, dtype=np.float32), np.zeros(8, np.float32), np.ones(4, np.float32), 0.5)
    s = Session(id="s1", basis=basis, metric=Metric(4), memory=TrajectoryMemory(4))
    s.miku_path = tmp_path / "s1.miku"
    return s


def test_the_store_is_told_the_file_path_once_per_session_row(tmp_path: Path, monkeypatch) -> None:
    store = HistoryStore(f"sqlite:///{tmp_path / 'h.sqlite3'}")
    saved: list[Path] = []
    told: list[str] = []
    real = store.set_miku_path
    monkeypatch.setattr(store, "set_miku_path", lambda sid, path, owner: told.append(path) or real(sid, path, owner=owner))
    keep = TurnKeeper(store, lambda session, path: saved.append(path), model_id="m")
    session = _session(tmp_path)
    for i in range(3):
        keep(session, Turn(user_text=f"q{i}", reply_text=f"a{i}"))
    assert len(saved) == 3 and told == [str(session.miku_path)]
    assert store.get_session("s1", owner=session.owner).miku_path == str(session.miku_path)
    assert len(store.get_turns("s1", owner=session.owner)) == 6
    store.delete_session("s1", owner=session.owner)  # deleted from the history while still open
    keep(session, Turn(user_text="q3", reply_text="a3"))
    assert told == [str(session.miku_path)] * 2
    assert store.get_session("s1", owner=session.owner).miku_path == str(session.miku_path)
    store.close()
